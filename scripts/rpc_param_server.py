#!/usr/bin/env python
"""A parameter server with torch.distributed.rpc: remote references, distributed autograd, a distributed optimizer.

    torchrun --standalone --nproc-per-node=3 scripts/rpc_param_server.py --steps 40

Rank 0 is the parameter server: it owns the model and never trains. Every other rank is a trainer
that holds no weights: it calls the model's forward pass on the server through an RRef (a remote
reference to the server's object), computes the loss of its own batch, and runs the backward pass
with distributed autograd, which follows the RPC calls back to the server's weights; a
DistributedOptimizer then steps them there. The trainers do not wait for each other: the server
applies each trainer's update as it arrives (notebook 02's asynchronous parameter server, written
with PyTorch's RPC framework instead of send and recv). The server ends with RESULT {json}: the
loss of a held-out batch before and after, and how many steps each trainer took.

The RPC package is stable and in maintenance mode; CUDA tensors over RPC are beta and unsupported
for RRefs, distributed autograd and the distributed optimizer, so this runs on CPU tensors.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from course_utils.process_group import detect_env
from course_utils.results import emit_result

FEATURES, CLASSES = 16, 4


def teacher_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable problem: labels from a fixed random linear teacher (the same on every rank)."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


class ParameterServer(nn.Module):
    """The model and the count of forward passes each trainer asked for; lives on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        self.steps: dict[int, int] = {}
        self.lock = threading.Lock()  # RPC serves each call on a thread of its pool

    def forward(self, trainer: int, x: torch.Tensor) -> torch.Tensor:
        # With a copy of the weights as they are now (clone is differentiable: the gradient still reaches
        # them): another trainer's step, applied in place meanwhile, cannot change what this call's
        # backward pass needs. The gradient is the one at the weights this trainer saw: the stale gradient
        # of an asynchronous server.
        # The forward pass stays inside the lock too: functional_call swaps the module's tensors for the
        # call's duration, so two RPC threads in it at once could leave the model holding one trainer's
        # clones instead of the parameters the optimizer steps (the server would then stop learning).
        with self.lock:
            self.steps[trainer] = self.steps.get(trainer, 0) + 1
            weights = {name: p.clone() for name, p in self.model.named_parameters()}
            return torch.func.functional_call(self.model, weights, (x,))

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.model.parameters()]


SERVER: ParameterServer | None = None


def make_server() -> ParameterServer:
    """Runs on rank 0 when the first trainer asks (rpc.remote): one server for all of them."""
    global SERVER
    if SERVER is None:
        SERVER = ParameterServer()
    return SERVER


def call_method(method, rref: rpc.RRef, *args):
    """Run ``method`` on the object ``rref`` refers to, where it lives."""
    return method(rref.local_value(), *args)


def remote_method(method, rref: rpc.RRef, *args):
    return rpc.rpc_sync(rref.owner(), call_method, args=(method, rref, *args))


def train(rank: int, steps: int, batch: int, lr: float) -> list[float]:
    server = rpc.remote("server", make_server)  # an RRef: the object stays on the server
    # The two trainers' steps can overlap on the server: the functional SGD the DistributedOptimizer picks
    # takes no lock in this torch (whatever its docstring says), so an update may be lost to a race, which
    # an asynchronous server tolerates.
    optimizer = DistributedOptimizer(torch.optim.SGD, remote_method(ParameterServer.parameter_rrefs, server), lr=lr)
    losses = []
    for step in range(steps):
        x, y = teacher_batch(batch, seed=1000 * rank + step)  # each trainer its own data
        with dist_autograd.context() as context:
            loss = nn.functional.cross_entropy(remote_method(ParameterServer.forward, server, rank, x), y)
            dist_autograd.backward(context, [loss])  # into the server's weights, through the RPC call
            optimizer.step(context)  # on the server, with this context's gradients
        losses.append(loss.item())
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="steps per trainer (default: 40)")
    p.add_argument("--batch", type=int, default=32, help="samples per trainer step (default: 32)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    p.add_argument("--timeout", type=float, default=60, help="seconds an RPC may take, joining included (default: 60)")
    args = p.parse_args()
    info = detect_env()
    if info.world_size < 2:
        print("error: rpc_param_server.py needs a server and at least one trainer; start it under a launcher, e.g.\n"
              "  torchrun --standalone --nproc-per-node=3 scripts/rpc_param_server.py", flush=True)
        return 2
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=args.timeout, init_method="env://")
    name = "server" if info.rank == 0 else f"trainer{info.rank}"
    if info.rank == 0:  # the server, and its loss on held-out data before any trainer can reach it
        held_out = teacher_batch(512, seed=999_999)  # no trainer draws this seed
        with torch.no_grad():
            before = nn.functional.cross_entropy(make_server().model(held_out[0]), held_out[1]).item()
    rpc.init_rpc(name, rank=info.rank, world_size=info.world_size, rpc_backend_options=options)
    start = time.perf_counter()
    if info.rank == 0:
        rpc.shutdown()  # waits until every trainer has finished and shut down too
        with torch.no_grad():
            after = nn.functional.cross_entropy(SERVER.model(held_out[0]), held_out[1]).item()
        emit_result({"script": "rpc_param_server.py", "trainers": info.world_size - 1, "steps": SERVER.steps,
                     "held_out_loss_before": before, "held_out_loss_after": after,
                     "seconds": time.perf_counter() - start})
    else:
        losses = train(info.rank, args.steps, args.batch, args.lr)
        print(f"{name}: {len(losses)} steps, loss {losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f} (mean of the last 5)",
              flush=True)
        rpc.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
