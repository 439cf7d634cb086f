import sys
from pathlib import Path

# test helpers (the Slurm test cluster) import as plain modules
sys.path.insert(0, str(Path(__file__).parent))
