import sys
from pathlib import Path

# test helpers (the Slurm test cluster) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank in this process (DTensor, DCP and FSDP need one), destroyed after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
