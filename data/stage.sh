# shellcheck shell=bash
# Copy a data set to node-local storage at the start of a job, and point COURSE_DATA at the copy.
#   source data/stage.sh cifar10              # inside an sbatch script, before training
#   source data/stage.sh shards               # the shards python -m course_utils.data shard wrote
# Many small reads are slow on a shared file system (notebook 00), and every rank of every epoch reads
# the data again (notebook 10): read it from the node's own disk. In a job of several nodes the batch
# script runs on the first node only, so the copy is made by one task on each node (srun). The copy
# goes to a temporary name and is renamed when whole: a job killed mid-copy leaves no half data set.
# Source: $COURSE_DATA (default: data/ in the repository). Target: $TMPDIR, else /tmp, the same path on
# every node.
course_stage() {
    local name="${1:?usage: source data/stage.sh <dataset folder name>}"
    local src_root="${COURSE_DATA:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
    local dst_root="${TMPDIR:-/tmp}/course-data-${SLURM_JOB_ID:-$$}"
    local folder="$name"   # torchvision's folder names inside the data root
    case "$name" in
        cifar10) folder="cifar-10-batches-py" ;;
        mnist) folder="MNIST" ;;
    esac
    local src="$src_root/$folder"
    if [[ ! -d "$src" ]]; then
        if [[ "$name" == shards ]]; then
            echo "error: $src not found. Write the shards first (on a login node): python -m course_utils.data shard cifar10 --out $src" >&2
        else
            echo "error: $src not found. On a login node run: python -m course_utils.data download $name --root $src_root" >&2
        fi
        return 2
    fi
    if [[ -n "${SLURM_JOB_ID:-}" && -z "${SLURM_STEP_ID:-}" && "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]]; then
        srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
            bash "${BASH_SOURCE[0]}" --copy "$src" "$dst_root" || return 2
    else
        _course_copy "$src" "$dst_root" || return 2
    fi
    export COURSE_DATA="$dst_root"
}

# Copy folder $1 into folder $2 on this node, and say how long it took.
_course_copy() {
    local src="$1" dst_root="$2" node="${SLURMD_NODENAME:-$(hostname -s)}"
    local target partial start end
    target="$dst_root/$(basename "$src")"
    partial="$dst_root/.$(basename "$src").partial-$node-$$"
    mkdir -p "$dst_root"
    if [[ -d "$target" ]]; then
        echo "staged $(basename "$src") on $node: already there ($target)"
        return 0
    fi
    start=$(date +%s%N)
    cp -r "$src" "$partial" || { rm -rf "$partial"; return 2; }
    if ! mv -T "$partial" "$target" 2>/dev/null; then   # another task on this node was first
        rm -rf "$partial"
    fi
    end=$(date +%s%N)
    echo "staged $(basename "$src") on $node: $(du -sm "$target" | cut -f1) MiB, $(find "$target" -type f | wc -l) files," \
         "from $(dirname "$src") to $dst_root in $(( (end - start) / 1000000 )) ms"
}

if [[ "${1:-}" == --copy ]]; then
    _course_copy "$2" "$3"
else
    course_stage "$@"
fi
