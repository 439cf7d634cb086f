"""course_utils: the plumbing every notebook and script of the course shares.

Modules (import what you need)::

    profile     COURSE_PROFILE=ci|full and pick(ci=..., full=...)
    hardware    environment_report(), print_report()
    dist        launcher-agnostic process groups: init_distributed(), get_rank(), ...
    data        data sets (offline synthetic, CIFAR-10, MNIST) and loaders
    models      SmallCNN, ResNet18, build_model()
    trainer     Trainer and TrainConfig (AMP, TF32, channels_last, compile, DDP)
    checkpoint  atomic save_checkpoint(), load_checkpoint()
    devices     one policy for which device each rank drives (never two NCCL ranks on one GPU)
    timing      Throughput meter: the GPU synchronised where a timed window opens and closes
    ladder      the single-device speed-up ladder (notebook 01, benchmark script)
    launch      run scripts/ (alone or under torchrun) from a notebook
    storage     one large file vs many small files, per storage folder
    plots       the course's figures
"""

from .profile import current_profile, pick

__all__ = ["current_profile", "pick"]
__version__ = "0.1.0"
