"""The claims of the notebooks' runs, one call each after the run's output: each prints the claims it verified
(``✓ ...``) and stops the cell at the first that does not hold (:func:`course_utils.claims.verify`).

They live by the notebooks they judge, as the exercises' checkers do: foundations (01-03), clusters (04-05),
frameworks (06, 08), sharding (07), parallelism (09), data (10), debugging (11).
"""

from .clusters import (
    check_collective_timeout,
    check_elastic,
    check_killed_and_resumed,
    check_plain_job,
    check_requeued_job,
    check_requeued_train,
    check_restarted_plain,
    check_submitit_ranks,
)
from .data import (
    check_formats,
    check_readers_at_once,
    check_shuffle_buffer,
    check_staged_copy,
    check_staged_job,
    check_webdataset,
    check_workers_rule,
)
from .debugging import (
    check_detail,
    check_estimate_measured,
    check_hang,
    check_live_stacks,
    check_port_clash,
    check_save_modes,
    check_split_rendezvous,
    check_step_peaks,
    check_straggler,
)
from .foundations import (
    check_bandwidth,
    check_buckets,
    check_ddp_run,
    check_launcher_env,
    check_n_by_b,
    check_param_servers,
    check_placements,
    check_plain_ddp,
    check_script_run,
)
from .frameworks import check_asha_against_fifo, check_four_trainers, check_lightning_jobs, check_plain_fabric
from .parallelism import (
    check_all_to_all_traffic,
    check_balancing_loss,
    check_cp_activations,
    check_expert_load,
    check_fsdp_tp,
    check_interleaved_run,
    check_param_server,
    check_pipeline,
    check_sequence_parallel,
    check_tensor_parallel,
    check_transformer_layouts,
    check_ring_traffic,
    check_zigzag_balance,
)
from .sharding import (
    check_activation_checkpointing,
    check_dcp_resume,
    check_fsdp_against_zero3,
    check_fsdp_transformer,
    check_plain_fsdp,
    check_stage2_switches,
    check_universal,
    check_zero_comm,
    check_zero_estimators,
    check_zero_resume,
    check_zero_stages,
)
