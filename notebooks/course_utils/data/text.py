"""Text for the language model (``scripts/train_lm.py``), offline: byte-level tokens (vocabulary 256, no
tokenizer to download) of a real corpus every machine with Python has, the standard library's own
sources, read in place and never copied into the project. ``--text FILE`` trains on a file of your own;
``python -m course_utils.data download tinyshakespeare`` (on a login node) fetches a standard small corpus.

:class:`TokenBatches` cuts the stream into sequences and deals each step's batch to the data-parallel
ranks. A step's batch is a function of the seed and the step number alone, so a run resumed at step
``s`` (on any number of ranks) trains on exactly the sequences the unstopped run would have.
"""

from __future__ import annotations

import sysconfig
import urllib.request
from pathlib import Path

import torch

TINY_SHAKESPEARE = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
STDLIB = "stdlib"


def stdlib_sources(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the Python standard library's ``.py`` files, in path order (tests and
    site-packages left out): real text with structure a small model learns in minutes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "dist-packages", "test", "idlelib") or "tests" in parts:
            continue
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_tokens(text: str = STDLIB, max_bytes: int = 4_000_000) -> torch.Tensor:
    """Byte tokens (int64) of ``text``: ``stdlib`` (this Python's sources), or a file's path."""
    if text == STDLIB:
        data = stdlib_sources(max_bytes)
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"--text {text}: no such file; give a text file, or leave --text out to train on "
                             "this Python's standard library (or: python -m course_utils.data download "
                             "tinyshakespeare, on a login node)")
        data = path.read_bytes()[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def download_text(root: str | Path) -> Path:
    """Tiny Shakespeare (1.1 MB, Karpathy's char-rnn corpus) into ``root``: a login node's job."""
    target = Path(root) / "tinyshakespeare.txt"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_suffix(".part")
        try:
            urllib.request.urlretrieve(TINY_SHAKESPEARE, part)
        except BaseException:
            part.unlink(missing_ok=True)  # a download cut short is not the corpus
            raise
        part.replace(target)
    return target


class TokenBatches:
    """Sequences of ``seq_len + 1`` tokens (input and the next-token targets), a new order every epoch.

    Step ``s``'s global batch is ``batch x dp_ranks`` sequences; rank ``dp_index`` takes its ``batch`` of
    them. The last ``val_fraction`` of the stream is held out (:meth:`validation`).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, dp_ranks: int = 1, dp_index: int = 0,
                 seed: int = 0, val_fraction: float = 0.05) -> None:
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        self.seq_len, self.batch, self.dp_ranks, self.dp_index, self.seed = seq_len, batch, dp_ranks, dp_index, seed
        self.sequences = (len(self.train) - 1) // seq_len
        self.steps_per_epoch = self.sequences // (batch * dp_ranks)
        if self.steps_per_epoch < 1:
            raise ValueError(f"{len(self.train):,} training tokens make {self.sequences} sequences of {seq_len}, "
                             f"fewer than one step's {batch * dp_ranks}: use more text, a shorter --seq-len or a "
                             "smaller --batch-size")

    def _rows(self, starts: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([stream[s:s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of step ``step``, each (batch, seq_len)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.sequences, generator=torch.Generator().manual_seed(self.seed + epoch))
        first = within * self.batch * self.dp_ranks + self.dp_index * self.batch
        return self._rows(order[first:first + self.batch] * self.seq_len, self.train)

    def validation(self, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``sequences`` held-out sequences of this rank's share (the same on every layout)."""
        count = min(sequences, (len(self.val) - 1) // self.seq_len)
        starts = torch.arange(count) * self.seq_len
        return self._rows(starts[self.dp_index::self.dp_ranks], self.val)
