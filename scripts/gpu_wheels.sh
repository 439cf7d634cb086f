#!/usr/bin/env bash
# Wheels for `make gpu-check` on a GPU machine that reaches no package index (the course's lent
# H100/H200: Python 3.12 with its own torch 2.11, Lightning, TensorBoard, matplotlib and pytest).
#
#   scripts/gpu_wheels.sh download [NAME...]  # here, with a package index: what that machine lacks
#                                     # (and each NAME, though its image has it), at the versions of
#                                     # constraints.txt, in .whl/carry-1, .whl/carry-2, ...
#   scripts/gpu_wheels.sh install     # there, in the repository, after each carry: collects the
#                                     # pieces in /tmp/course-wheels, installs what is whole into
#                                     # /tmp/course-site; then: export PYTHONPATH=/tmp/course-site
#   scripts/gpu_wheels.sh needs       # what a notebook run needs beside torch's own CUDA stack, one
#                                     # "name==version carried|there normalised-name" a line
#                                     # (scripts/gpu_check.py asks)
#
# One call may carry at most 64 MiB and Ray's wheel alone is about 79 MB, so `download` splits every
# wheel into pieces of at most 30 MiB and puts them in folders of at most 60 MiB (two for what the
# lent machine lacks). Carry .whl/carry-1 in one call, .whl/carry-2 in the next and so on, while the
# machine stays warm (/tmp outlives a call, not the machine); each call runs `install`, which
# installs the wheels whose pieces have all arrived. The machine's own packages are never replaced:
# only missing ones are carried.
set -euo pipefail
cd "$(dirname "$0")/.."

WHL=.whl
PIECE=30m
CARRY_MIB=60  # one call carries 64 MiB, the repository included
# What the lent machine's image already holds (its package list in the device tool's KINDS.md),
# and what a notebook run does not need (the installer, the site builder, the JupyterLab server and its widgets).
THERE='^(cuda-.*|torch|torchvision|torchaudio|triton|nvidia-.*|lightning.*|pytorch-lightning|torchmetrics|numpy|matplotlib|pytest.*|pandas|scipy|pillow|tensorboard|tensorboard-data-server|psutil|packaging|pyyaml|filelock|fsspec|jinja2|markupsafe|sympy|mpmath|networkx|typing-extensions|requests|urllib3|idna|certifi|charset-normalizer|attrs|click|protobuf|grpcio|msgpack|tqdm|aiohttp|aiosignal|frozenlist|multidict|yarl|propcache|aiohappyeyeballs|six|python-dateutil|pygments|rich|markdown-it-py|mdurl|contourpy|cycler|fonttools|kiwisolver|pyparsing|setuptools|wheel|pip|werkzeug|markdown|absl-py|cloudpickle|h5py|py-cpuinfo|einops|iniconfig|pluggy|coverage|execnet|hypothesis|sortedcontainers|joblib|threadpoolctl|scikit-learn|pyarrow|wrapt|zipp|anyio|h11|httpcore|httpx|sniffio|decorator|prometheus-client|nvidia-ml-py)$'
NOT_NEEDED='^(uv|sphinx.*|myst-.*|furo|accessible-pygments|alabaster|docutils|imagesize|jupyter-cache|lazy-importer|markdown-it-py|mdit-py-plugins|mdurl|roman-numerals|snowballstemmer|tabulate|zipp|importlib-metadata|jupyterlab.*|jupyter-server.*|jupyter-lsp|jupyter-events|jupyter-builder|notebook-shim|terminado|send2trash|argon2-.*|babel|json5|async-lru|ipywidgets|widgetsnbextension|overrides|rfc3.*|uri-template|webcolors|fqdn|isoduration|arrow|lark|python-json-logger|websocket-client|bleach|tinycss2|webencodings|defusedxml|mistune|nbconvert|pandocfilters|beautifulsoup4|soupsieve|jupyterlab-pygments|cffi|pycparser)$'
# torch's own CUDA stack: the machine's torch brings its own build of these, never ours (NVML's
# Python binding, nvidia-ml-py, is not part of it)
TORCH_OWN='^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$'

# The packages of constraints.txt a notebook run needs beside torch's own, with where they come
# from: "carried" (download fetches them) or "there" (the lent machine's image has them), and the
# name normalised. One awk, not a process per package: gpu_check.py asks before every run.
needs() {
    grep -E '^[A-Za-z0-9]' constraints.txt | sed 's/[[:space:]]*#.*//' | awk -F'==' -v there="$THERE" \
            -v not_needed="$NOT_NEEDED" \
            -v own="$TORCH_OWN" '{
        norm = tolower($1); gsub(/[_.]/, "-", norm)
        if (norm ~ not_needed || (norm ~ own && norm != "nvidia-ml-py")) next
        print $1 "==" $2 " " (norm ~ there ? "there" : "carried") " " norm
    }'
}

download() {
    # NAME arguments: packages the lent machine's image has but the machine at hand lacks (gpu_check.py names them)
    local wanted
    wanted=" $(printf '%s ' "$@" | tr 'A-Z_.' 'a-z--')"
    rm -rf "$WHL" && mkdir -p "$WHL/all"
    needs | while IFS=' ' read -r pin where norm; do
        name=${pin%%==*} version=${pin##*==}
        if [[ "$where" == there && "$wanted" != *" $norm "* ]]; then continue; fi
        if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                --platform any -d "$WHL/all" "$name==$version" 2>/dev/null; then
            # a package published as source only (DeepSpeed): its pure-Python wheel, built here
            python3 -m pip wheel --quiet --no-deps -w "$WHL/all" "$name==$version"
        fi
    done
    # each piece into the first folder it fits: as many folders of at most CARRY_MIB as the wheels need
    # (two for what the lent machine lacks; more where it lacks what its image usually has)
    local limit=$((CARRY_MIB * 1024 * 1024)) sizes=() i size
    for wheel in "$WHL"/all/*.whl; do
        split -b "$PIECE" -d -a 2 "$wheel" "$WHL/piece-"
        for piece in "$WHL"/piece-*; do
            size=$(wc -c < "$piece")
            i=0
            while ((i < ${#sizes[@]})) && ((sizes[i] + size > limit)); do i=$((i + 1)); done
            sizes[i]=$((${sizes[i]:-0} + size))
            mkdir -p "$WHL/carry-$((i + 1))"
            mv "$piece" "$WHL/carry-$((i + 1))/$(basename "$wheel").${piece##*-}"
        done
    done
    rm -rf "$WHL/all"
    du -sh "$WHL"/carry-*
    echo "carry each of the ${#sizes[@]} folders .whl/carry-N in a device call of its own; each runs:" \
         "scripts/gpu_wheels.sh install"
}

install() {
    local pieces=/tmp/course-wheels site=/tmp/course-site
    mkdir -p "$pieces" "$site"
    for folder in "$WHL"/carry-*; do
        [[ -d "$folder" ]] && cp "$folder"/* "$pieces"/ 2>/dev/null || true
    done
    local whole=() missing=0
    for first in "$pieces"/*.whl.00; do
        [[ -e "$first" ]] || continue
        local wheel="${first%.00}" count
        count=$(ls "$wheel".* | wc -l)
        # a wheel is whole when its pieces add up to a valid zip
        cat "$wheel".* > "$wheel" 2>/dev/null
        if python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).testzip()" "$wheel" 2>/dev/null; then
            whole+=("$wheel")
        else
            rm -f "$wheel"; missing=$((missing + 1))
        fi
    done
    if ((${#whole[@]})); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${whole[@]}"
    fi
    echo "${#whole[@]} wheel(s) installed in $site, $missing still waiting for pieces; export PYTHONPATH=$site"
}

case "${1:-}" in
    download) shift; download "$@" ;;
    install) install ;;
    needs) needs ;;
    *) echo "usage: $0 download [NAME...]|install|needs (see the comment at the top)" >&2; exit 2 ;;
esac
