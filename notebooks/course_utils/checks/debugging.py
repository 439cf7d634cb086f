"""Notebook 11: a rank that never arrives (its flight records, its stacks), two ranks in different collectives, a
straggler, a checkpoint only rank 0 writes, a port taken, a rendezvous split in two, a step's memory predicted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..claims import verify
from ..launch import RunResult


def check_hang(hang: RunResult, records: Mapping[int, list[dict]]) -> None:
    """faulty_ddp.py with rank 1 stuck before step 3: the run's end and the ranks' flight records."""
    last = {rank: entries[-1] for rank, entries in records.items()}
    verify([
        (f"the run failed (exit code {hang.returncode}) instead of hanging", hang.returncode != 0),
        (f"rank 1's record stops at #{last[1]['seq']}, before the collective rank 0 waits in, #{last[0]['seq']}",
         last[1]["seq"] < last[0]["seq"]),
        (f"and rank 0's names the call: {last[0]['op']} at {last[0]['where']}",
         last[0]["op"] == "all_reduce" and last[0]["where"].startswith("faulty_ddp.py:")),
    ], detail=hang.output[-2000:])


def check_live_stacks(stacks: Mapping[int, str], served: Mapping[int, str], where: str) -> bool:
    """py-spy's dumps and the debug server's /stacks, taken while rank 1 was stuck; ``where``: the line rank 0's
    record names. Returns whether py-spy could read the ranks (a node may forbid tracing another process)."""
    traced = not any(m in stacks[r] for r in (0, 1) for m in ("Permission", "not permitted"))
    claims = [("the debug server's page shows rank 0 in all_reduce and rank 1 elsewhere",
               "in all_reduce" in served[0] and "in all_reduce" not in served[1])]
    if traced:
        claims += [
            (f"py-spy finds rank 0 in the all-reduce its record names ({where})",
             "all_reduce" in stacks[0] and where in stacks[0]),
            ("and rank 1 on a line of its own, before it", "all_reduce" not in stacks[1] and "faulty_ddp.py" in stacks[1]),
        ]
    verify(claims)
    return traced


def check_detail(mismatch: RunResult, named: Mapping[int, tuple[int, str, list[int]]]) -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL on two ranks in different all-reduces: the calls its error named, by rank."""
    verify([
        ("DETAIL stopped the run, naming both ranks' calls", mismatch.returncode != 0 and set(named) == {0, 1}),
        (f"rank 0's extra all-reduce of its loss (shape {named.get(0, (0, '', []))[2]}), rank 1's of the gradients",
         named[0][2] == [1] and named[1][2] != [1]),
        ("the same operation and sequence number on both", named[0][:2] == named[1][:2]),
    ], detail=mismatch.output[-2000:])


def check_straggler(compute: Sequence[float], wait: Sequence[float], slow_ms: float) -> None:
    """Each rank's mean compute and all-reduce time, ms a step, rank 1 made ``slow_ms`` slower."""
    verify([
        (f"rank 1 computes longer: {compute[1] - compute[0]:.0f} ms a step", compute[1] - compute[0] > 0.8 * slow_ms),
        (f"rank 0 spends that time waiting in the all-reduce: {wait[0]:.0f} ms against rank 1's {wait[1]:.0f}",
         wait[0] > 0.6 * slow_ms and wait[1] < wait[0] / 2),
    ])


def check_save_modes(said: Mapping[str, list[str]], ended: Mapping[str, RunResult], waits: Sequence[float],
                     in_write: int, timeout_s: float) -> None:
    """Rank 0 saving after step 2 for twice the collective timeout: plain, with a barrier, in the background.
    ``said``: each run's ``rank ...`` lines; ``waits``: rank 1's all-reduce times in the background run;
    ``in_write``: the script's line that stands for the slow write."""
    verify([
        ("plain: rank 1 timed out in the next all-reduce, step 3's",
         any("rank 1: step 3 failed" in line and "Timed out" in line for line in said["plain"])),
        (f"while rank 0 was still inside the write (faulty_ddp.py:{in_write}), where the launcher stopped it",
         f"rank 0: stopped by the launcher at faulty_ddp.py:{in_write};" in "\n".join(said["plain"])),
        ("with a barrier, rank 1 timed out one collective earlier, in the barrier",
         any("rank 1: step 2 failed" in line and "Timed out" in line for line in said["barrier"])),
        (f"in the background nobody waited: the run ended well, rank 1's longest all-reduce {max(waits) * 1000:.0f} ms",
         ended["background"].returncode == 0 and max(waits) < timeout_s / 2),
    ])


def check_port_clash(clash: RunResult, error: str) -> None:
    """torchrun started on a port another socket holds."""
    verify([("torchrun stopped, the port another's: address already in use",
             clash.returncode != 0 and "address already in use" in error)], detail=clash.output[-1500:])


def check_split_rendezvous(last_line: Mapping[str, str]) -> None:
    """Two torchrun agents and two course ranks, each told a rendezvous of its own: each one's last line."""
    verify([
        ("each torchrun ended with a bare RendezvousTimeoutError",
         all(last_line[f"torchrun, node {n}"].endswith("RendezvousTimeoutError") for n in (0, 1))),
        ("the course's rank 0 named the rank that never joined",
         "rank(s) 1 of 2 never joined the rendezvous" in last_line["course, rank 0"]),
        ("and rank 1 the address it could not reach", "could not reach rank 0's rendezvous" in last_line["course, rank 1"]),
    ])


def check_step_peaks(est: Mapping[int, list[dict]], opt_bytes: float, batches: Sequence[int]) -> None:
    """memory_steps.py --estimate: each step's peak by batch; ``opt_bytes``: AdamW's state, predicted."""
    verify([
        ("step 1 peaks before AdamW has any state", all(est[b][0]["peak"]["optimizer"] == 0 for b in batches)),
        (f"step 2 peaks higher by the optimizer's state, {opt_bytes / 2**20:.1f} MiB, at batch "
         f"{' and '.join(map(str, batches))}",
         all(abs(est[b][1]["peak_total"] - est[b][0]["peak_total"] - opt_bytes) < 0.01 * opt_bytes for b in batches)),
    ])


def check_estimate_measured(measured: Sequence[dict], estimated: Sequence[dict], on_gpu: bool) -> None:
    """The batch run for real against its FakeTensor estimate, step by step."""
    tolerance = 0.05 if on_gpu else 0.01  # a GPU's kernels may save other tensors than a CPU's
    claims = [(f"the estimate counts what the real run held, within {tolerance:.0%}, at each step",
               all(abs(m["peak_total"] - e["peak_total"]) <= tolerance * e["peak_total"]
                   for m, e in zip(measured, estimated, strict=True)))]
    if on_gpu:
        claims.append(("and the allocator held what was counted",
                       all(0.95 < m["max_allocated"] / m["peak_total"] < 1.5 for m in measured)))
    verify(claims)
