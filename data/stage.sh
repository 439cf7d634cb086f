# shellcheck shell=bash
# Copy a data set to node-local storage at the start of a job, and point COURSE_DATA at the copy.
#   source data/stage.sh cifar10              # inside an sbatch script, before training
# Many small reads are slow on a shared file system (notebook 00): read them from the node's disk.
# Source: $COURSE_DATA (default: data/ in the repository). Target: $TMPDIR, else /tmp.
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
        echo "error: $src not found. On a login node run: python -m course_utils.data download $name --root $src_root" >&2
        return 2
    fi
    mkdir -p "$dst_root"
    local start=$SECONDS
    cp -r "$src" "$dst_root/"
    echo "staged $name: $(du -sh "$dst_root/$folder" | cut -f1) from $src_root to $dst_root in $((SECONDS - start)) s"
    export COURSE_DATA="$dst_root"
}
course_stage "$@"
