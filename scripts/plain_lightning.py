#!/usr/bin/env python
"""plain_ddp.py's training as a LightningModule, as a researcher writes it: no course_utils. The module says what
a step computes; Lightning's Trainer runs the loop, gives each rank its share of the data (a DistributedSampler of
its own), wraps DDP, runs the precision and writes the checkpoints. Run again with the same --ckpt-dir, it resumes
from last.ckpt: weights, optimizer, epoch and step.

One process per GPU, each seeing all the node's GPUs: torchrun, or srun with slurm/lib/torch_env.sh and no
--gpus-per-task (notebook 06 shows why; the course's train_lightning.py also takes that binding).

    torchrun --standalone --nproc-per-node=2 scripts/plain_lightning.py --epochs 3 --ckpt-dir runs/plain-lightning
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from plain_parts import build_model, evaluate, get_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="per rank: a step averages ranks x this")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--n-train", type=int, default=4096, help="images of the offline data set")
parser.add_argument("--n-val", type=int, default=1024, help="held-out images of the offline data set")
parser.add_argument("--data", default=None, help="a folder with torchvision's MNIST, instead of the offline data")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
parser.add_argument("--ckpt-dir", default="runs/plain-lightning", help="last.ckpt goes here; a second run resumes it")
args = parser.parse_args()


class Classifier(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model, self.lr = build_model(), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, sync_dist=True)  # the mean over every rank
        return loss  # Lightning runs backward (DDP all-reduces the gradients there) and the optimizer's step

    def on_validation_epoch_start(self) -> None:
        self.held_out = torch.zeros(3, device=self.device)

    def validation_step(self, batch, batch_idx):
        self.held_out += evaluate(self.model, [batch], self.device)  # sums: loss, correct, images

    def on_validation_epoch_end(self) -> None:
        held_out = self.trainer.strategy.reduce(self.held_out, reduce_op="sum")  # added over the ranks' shares
        if self.global_rank == 0 and not self.trainer.sanity_checking:
            print(f"epoch {self.current_epoch}: held-out loss {held_out[0] / held_out[2]:.4f}, accuracy "
                  f"{held_out[1] / held_out[2]:.1%} ({self.trainer.world_size} ranks, step {self.global_step})",
                  flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


use_gpu = torch.cuda.is_available()  # the same answer on every rank: all NCCL, or all gloo
# mixed precision where the GPU has it: bf16 from compute capability 8 (A100, H100), fp16 with loss scaling before
precision = "32-true"
if use_gpu:  # this rank's own GPU (its local rank), not GPU 0
    precision = "bf16-mixed" if torch.cuda.get_device_capability(int(os.environ["LOCAL_RANK"]))[0] >= 8 else "16-mixed"
per_node = int(os.environ["LOCAL_WORLD_SIZE"])  # set by torchrun, or by slurm/lib/torch_env.sh under srun
trainer = L.Trainer(accelerator="cuda" if use_gpu else "cpu", devices=per_node,
                    num_nodes=int(os.environ["WORLD_SIZE"]) // per_node, strategy="ddp", precision=precision,
                    max_epochs=args.epochs, callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)],
                    logger=False, enable_progress_bar=False, enable_model_summary=False)
torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
train = DataLoader(get_dataset(args.n_train, args.data), batch_size=args.batch_size, shuffle=True,
                   drop_last=True, num_workers=args.workers, pin_memory=use_gpu)  # Lightning adds the sampler
val = DataLoader(get_dataset(args.n_val, args.data, train=False), batch_size=256)
last = os.path.join(args.ckpt_dir, "last.ckpt")
resume = last if os.path.exists(last) else None
if resume and trainer.global_rank == 0:
    print(f"resuming from {last}", flush=True)
trainer.fit(Classifier(args.lr), train, val, ckpt_path=resume)
if trainer.global_rank == 0:
    print(f"done: {trainer.world_size} ranks, {args.epochs} epochs, {trainer.global_step} optimizer steps; "
          f"last.ckpt in {args.ckpt_dir}", flush=True)
