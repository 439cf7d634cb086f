#!/usr/bin/env bash
# One short lease of a lent GPU machine, end to end: a bare machine with its own torch, 15 minutes of device time
# with its start-up counted, at most 10 minutes a command, at most 8 files of 16 MiB brought back.
#
#   here, once:  scripts/gpu_wheels.sh download        # .whl/carry-1 and .whl/carry-2 (what the machine lacks)
#   there, call 1, carrying .whl/carry-1:   bash scripts/gpu_lease.sh install
#   there, call 2 at once, carrying .whl/carry-2:   COURSE_COMMIT=<commit> bash scripts/gpu_lease.sh run
#   here:        cp <the files brought back>/20*.json records/gpu/ && python scripts/gpu_records.py --write
#                && git add records README.md INSTRUCTORS.md && git commit
#
# install: the wheels carried so far (scripts/gpu_wheels.sh install), and DeepSpeed's CPU op built once (notebook 07
#          on one GPU runs its ranks on the CPU, and each would build it, racing).
# run:     the rest of the wheels, then scripts/gpu_check.py within LEASE_MIN minutes (default 8.3: the command
#          ends within 9, its packing included), resuming from the committed records in records/gpu: first every
#          notebook in the CI profile, three at a time (each one's CUDA path on one device), then the full profile:
#          what has no result on this GPU model first (those never run in full, then 06 and 07), then what failed,
#          then what passed on older code; what passed on its current code is skipped. Into OUT (the device tool's
#          $OUT; runs/gpu-lease here): report.md, report.json, this run's record (<date>-<gpu>.json), executed.tgz
#          (the notebooks with their outputs) and logs.tgz: 5 files.
#          Arguments after `run` go to gpu_check.py (--cpu checks this on a CPU; --notebooks 06 07; --rerun).
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
    bash scripts/gpu_wheels.sh install
    export PYTHONPATH="/tmp/course-site:$PWD/notebooks${PYTHONPATH:+:$PYTHONPATH}"
    if python3 -c 'import deepspeed' 2>/dev/null; then
        timeout 240 python3 -c 'from course_utils.sharding import warm_deepspeed_ops; warm_deepspeed_ops()' \
            || echo "note: DeepSpeed's CPU op was not built here; notebook 07's ranks build it on first use"
    fi
}

run() {
    local out="${OUT:-runs/gpu-lease}" work
    work="$(mktemp -d /tmp/gpu-lease.XXXXXX)"
    mkdir -p "$out"
    if [[ " $* " == *" --cpu "* ]]; then   # this machine's own environment: nothing carried
        export PYTHONPATH="$PWD/notebooks${PYTHONPATH:+:$PYTHONPATH}"
    else
        if compgen -G ".whl/carry-*" >/dev/null; then bash scripts/gpu_wheels.sh install; fi
        export PYTHONPATH="$PWD/notebooks:/tmp/course-site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local status=0
    # gpu_check keeps to its budget; the timeout is for a runner that would not (its report is written as it goes)
    timeout $(( ${LEASE_MIN%.*} * 60 + 60 )) python3 scripts/gpu_check.py --budget-min "${LEASE_MIN:-8.3}" \
        --notebook-timeout 480 --out "$work" "$@" || status=$?
    cp "$work"/report.md "$work"/report.json "$out"/ 2>/dev/null || true
    cp "$work"/20*.json "$out"/ 2>/dev/null || true
    (cd "$work" && tar czf - executed*) > "$out/executed.tgz" 2>/dev/null || true   # executed/ and executed-ci/
    tar czf "$out/logs.tgz" -C "$work" --exclude='ipython' logs 2>/dev/null || true
    echo "brought back in $out: $(find "$out" -maxdepth 1 -type f -printf '%f ')"
    return "$status"
}

LEASE_MIN="${LEASE_MIN:-8.3}"
case "${1:-}" in
    install) install ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 install | run [gpu_check.py's arguments] (see the comment at the top)" >&2; exit 2 ;;
esac
