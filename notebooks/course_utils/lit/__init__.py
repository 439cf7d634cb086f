"""The course's model, data and optimiser as Lightning pieces, and the launch checks Lightning leaves to you.

:class:`CourseModule` trains any model of :func:`course_utils.models.build_model` with the
optimiser, learning-rate rule and warm-up of :class:`course_utils.trainer.Trainer`.
:class:`CourseDataModule` serves :func:`course_utils.data.make_loader`'s loaders: they already
give each rank its slice in an order fixed by (seed, epoch), so Lightning keeps their sampler
(it only swaps in a ``DistributedSampler`` for loaders without one) and Lightning, Fabric and
``scripts/train.py`` see the same batches. :func:`plan_launch` reads the launcher's environment
before Lightning starts and stops with one line where Lightning would hang or fail late.

In three parts: ``launch`` (the layout and each rank's device, the strategies), ``module`` (the
LightningModule, DataModule and callbacks), ``trainer`` (the ``Trainer(...)``, resuming, quiet logs).
"""

from .launch import (
    LIGHTNING_PRECISION,
    LaunchMismatch,
    LaunchPlan,
    STRATEGIES,
    add_launch_args,
    placement_args,
    plan_launch,
    precision_args,
    precision_refused,
    sharded_placement,
    strategy_refused,
)
from .module import (
    CourseDataModule,
    CourseModule,
    OneThreadPerForkedRank,
    StopOnSignal,
    StopTraining,
    ThroughputCallback,
)
from .trainer import (
    full_weights,
    latest_checkpoint,
    make_trainer,
    quiet_lightning,
)
