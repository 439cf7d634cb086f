"""course_utils: the plumbing every notebook and script of the course shares.

Modules (import what you need; tests/test_repo.py checks every module is listed here)::

    sizing          COURSE_PROFILE=ci|full and pick(ci=..., full=...)
    setup           a notebook's first cell: profile, ranks, device and hardware, chosen once and said in a line
    hardware        environment_report(), print_report(), usable_cores(), threads_per_rank()
    process_group   launcher-agnostic process groups, imported as ``cdist``: session(), init_distributed(),
                    get_rank(), print0() ... (env: who am I, group: join and leave, report: what the ranks print)
    devices         one policy for which device each rank drives (never two NCCL ranks on one GPU)
    config          TrainConfig, the one source of training knobs: command line, TOML files, resume checks
    data            data sets (offline synthetic, CIFAR-10, MNIST, tar shards) and loaders; python -m course_utils.data
    models          SmallCNN, ResNet18, build_model()
    llama           the course's transformer: a small Llama-style decoder, its sizes, its FLOPs per token
    parallel        every parallelism of the transformer in one short file each, on one mesh; parallelize()
    trainer         the Trainer (DDP, accumulation, checkpoints, stop requests)
    precision       fp32/TF32, bf16, fp16 and autocast
    rng             every random stream, saved and restored with a checkpoint
    checkpoint      atomic save_checkpoint(), load_checkpoint(), the previous checkpoint kept; sharded (DCP) checkpoints
    preemption      stop at the next step when the scheduler warns that time is running out
    timing          Throughput meter: the GPU synchronised where a timed window opens and closes
    ladder          the single-device speed-up ladder (notebook 01, benchmark script)
    collectives     collectives by hand (a ring all-reduce) and their bus bandwidth (notebook 02)
    scaling         the same train.py under torchrun on 1, 2, ... ranks; efficiency tables (notebook 03)
    traces          each rank's profiled steps read from its trace: compute, communication, overlap, idle (03)
    launch          run scripts/ (alone or under torchrun) from a notebook
    slurm           submit Slurm jobs (the test cluster, or yours when asked), wait for them, read them (04-06)
    lit             the course's model and data as Lightning pieces; launch checks; stop on a signal (06)
    sharding        ZeRO's theory, DeepSpeed and FSDP2 measured, ds_config (07)
    tuning          Ray Tune around the Trainer (notebook 08, scripts/tune.py)
    tensor_parallel Megatron's column/row split by hand and as a DTensor plan (09)
    pipeline        pipeline stages, the bubble, the schedules' order (09)
    results         the RESULT line a script ends with, and reading it back; the take-home scripts' lines
    claims          verify(): a section's checks as the claims they verify, one printed line each
    checks          the claims of the notebooks' runs, one call each, by the notebooks they judge (as exercises)
    events          TensorBoard event files read back, for figures and tests
    waiting         wait_until(): one way to wait with a deadline
    progress        StatusLine: long work's progress in one line, gone from the executed copy when it ends
    errors          first_line(): an error in one line, for messages that then say what to do
    exercises       the notebooks' exercises and their checkers, by notebook group; solutions: the reference answers
    paths           REPO_ROOT, the scripts folder, a child process's environment
    storage         one large file vs many small files, per storage folder
    plots           charts of measured results
    diagrams        each idea drawn before it is measured: the ring, launch trees, DDP's buckets, checkpoints, ZeRO
    failures        random failures replayed on a checkpoint timeline: what each checkpoint interval wastes (05)
    flight_records  each rank's flight record (its last collectives) read back: who waits for whom; torch's debug
                    server's pages (11)
    show            the lesson's lines on the page: a function's source, a script's lines, a command line
    targets         the workshop's machines as facts (tests compute every notebook's full profile for them)
"""

from .sizing import current_profile, pick

__all__ = ["current_profile", "pick"]
__version__ = "0.1.0"
