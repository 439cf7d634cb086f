"""Ray Tune around the course's Trainer: notebook 08, ``scripts/tune.py`` and ``slurm/*/multi_node_ray.sbatch``.

A trial is the course's own training run (:func:`train_one`: the data, model and
:class:`~course_utils.trainer.Trainer` of ``scripts/train.py``). The Trainer's epoch
callback reports to Tune after each epoch, with the checkpoint it has just written, so
ASHA can stop a trial between two epochs and a resumed search continues a trial from its
last epoch. A trial with ``workers > 1`` is itself data parallel: Ray Train's
``TorchTrainer`` starts the workers and their process group, and the same Trainer wraps
the model in DDP because it finds a process group (:func:`ddp_trial`).

Ray itself: :func:`start_ray` joins the cluster named by ``RAY_ADDRESS`` (the Slurm
pattern starts one across the job's nodes) or starts one on this machine, with its
temporary files in a short folder under /tmp (not the shared home: Ray's sockets live
there, and a socket's path may be at most 107 bytes) and token authentication on.

In four modules: ``cluster`` (Ray itself), ``trial`` (one trial), ``search`` (a search), ``report`` (what
a search found); everything is imported here, as ``tuning.run_search`` and so on.
"""


from .cluster import (  # noqa: F401
    auth_env,
    ray_temp_dir,
    start_ray,
    unreachable,
    wait_for_nodes,
)
from .trial import (  # noqa: F401
    ddp_trial,
    Report,
    RUN_KEYS,
    SHAPE_KEYS,
    train_one,
    trial_settings,
    tune_trial,
)
from .search import (  # noqa: F401
    DEFAULT_STORAGE,
    fitting_trials,
    gpu_share_warning,
    interrupt_after,
    make_scheduler,
    METRIC,
    MODE,
    most_at_once,
    node_resources,
    pbt_refused,
    PEAK_FILE,
    run_search,
    tpe_startup_trials,
    SCHEDULERS,
    SEARCHERS,
    space,
    this_machine,
    trials_per_node,
    unfit_ddp_trial,
    unfit_request,
)
from .report import (  # noqa: F401
    best_so_far,
    exploits,
    held_out_score,
    history,
    status,
    summary,
    table,
    trials,
)
