"""course_utils: the plumbing every notebook and script of the course shares.

Modules (import what you need)::

    sizing      COURSE_PROFILE=ci|full and pick(ci=..., full=...)
    hardware    environment_report(), print_report(), usable_cores(), threads_per_rank()
    dist        launcher-agnostic process groups: session(), init_distributed(), get_rank(), print0() ...
                (env: who am I, group: join and leave, report: what the ranks print)
    devices     one policy for which device each rank drives (never two NCCL ranks on one GPU)
    config      TrainConfig, the one source of training knobs: command line, TOML files, resume checks
    data        data sets (offline synthetic, CIFAR-10, MNIST) and loaders; python -m course_utils.data
    models      SmallCNN, ResNet18, build_model()
    trainer     the Trainer (DDP, accumulation, checkpoints, stop requests)
    precision   fp32/TF32, bf16, fp16 and autocast
    rng         every random stream, saved and restored with a checkpoint
    checkpoint  atomic save_checkpoint(), load_checkpoint(), the previous checkpoint kept
    timing      Throughput meter: the GPU synchronised where a timed window opens and closes
    ladder      the single-device speed-up ladder (notebook 01, benchmark script)
    launch      run scripts/ (alone or under torchrun) from a notebook
    results     the RESULT line a script ends with, and reading it back
    waiting     wait_until(): one way to wait with a deadline
    exercises   the notebooks' exercises and their checkers; solutions: the reference answers
    paths       REPO_ROOT and the scripts folder
    storage     one large file vs many small files, per storage folder
    plots       the course's figures
    tuning      Ray Tune around the Trainer (notebook 08, scripts/tune.py)
    targets     the workshop's machines as facts (tests compute every notebook's full profile for them)
"""

from .sizing import current_profile, pick

__all__ = ["current_profile", "pick"]
__version__ = "0.1.0"
