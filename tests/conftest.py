import sys
from pathlib import Path

# test helpers (the Slurm test cluster) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

from references import uninterrupted_run  # noqa: E402


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(ranks)``: the final checkpoint and RESULT of references.RESUME_ARGS on ``ranks``
    ranks, run once per rank count for the whole session, whichever test asks first."""
    done = {}

    def reference(ranks: int):
        if ranks not in done:
            done[ranks] = uninterrupted_run(ranks, tmp_path_factory.mktemp(f"uninterrupted-{ranks}"))
        return done[ranks]

    return reference


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank in this process (DTensor, DCP and FSDP need one), destroyed after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
