#!/usr/bin/env bash
# The checks only a machine with a CUDA device can make (issues 15 and 38), within 5 minutes on one GPU machine with
# no network, from the repository root:
#
#   scripts/gpu_check.sh                 # on the GPU machine: writes results/gpu/README.md (exit 1 if a check failed)
#   scripts/gpu_check.sh --device cpu    # the dry run on a machine without a GPU (.venv's python; report in the work
#                                        # folder, $TMPDIR/distlion-gpu-check)
#   scripts/gpu_check.sh --fetch-wheels  # here, with network: the wheels the GPU machine lacks, into .whl/
#
# What it checks and how: scripts/gpu_check.py's docstring. Further options go to it (--budget S, --jobs J,
# --methods a,b, --no-bench, --out DIR).
#
# The GPU machine's own `python3` holds torch, timm (and so torchvision), transformers, accelerate, pyarrow, pandas,
# scikit-learn, pytest, but not hydra-core, omegaconf (and its antlr4 runtime), datasets or wandb. A digits run with
# `logger=none` needs only the first three: wandb is imported only by `logger=wandb` (distlion/loggers.py) and
# timm's optional `try: import wandb`; datasets only for `hub:` data. So this script installs the three from wheels
# carried in the ignored folder .whl/ (0.4 MB, fetched beforehand with --fetch-wheels, which runs
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==V
# for each, except antlr4-python3-runtime 4.9.3, which PyPI has as a source archive only: `pip wheel` builds its pure
# Python wheel), into /tmp/site, and runs everything with `python3` (`python3 -m distlion.train`,
# `python3 -m torch.distributed.run`), the repository on PYTHONPATH; never `make setup`. With the device tool:
#   run(command="scripts/gpu_check.sh", carry=[".whl"], timeout_s=360)
# Where $OUT is set (the device tool's folder that comes back), results/gpu/ and the logs and run summaries are
# copied into it.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1)
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    for wheel in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$wheel"
    done
    for source in "${SOURCE_ONLY[@]}"; do
        python3 -m pip wheel -q --no-deps --no-binary=:all: -w .whl "$source"
    done
    ls -l .whl
    exit 0
fi

PY=${GPU_CHECK_PYTHON:-python3}
case " $* " in
    *" --device cpu "*) [ -z "${GPU_CHECK_PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python ;;
esac

if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=${GPU_CHECK_SITE:-/tmp/site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import hydra, omegaconf, torch" || {
    echo "gpu_check: $PY cannot import hydra, omegaconf and torch; fetch the wheels first: scripts/gpu_check.sh --fetch-wheels" >&2
    exit 2
}

status=0
"$PY" scripts/gpu_check.py "$@" || status=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    WORK=${TMPDIR:-/tmp}/distlion-gpu-check
    [ -d results/gpu ] && cp -r results/gpu "$OUT/"
    [ -d "$WORK" ] && tar -czf "$OUT/gpu-check-work.tar.gz" -C "$(dirname "$WORK")" --exclude='*.pt' \
        --exclude='absent' "$(basename "$WORK")"
fi
exit $status
