# Sourced by scripts/train.sh and scripts/test.sh: create .venv and install on first use.
#
# Installs, in order:
#   1. $TITAN_TORCH (default torch==2.13.0) with the extra pip arguments in $TITAN_PIP_ARGS. Which
#      build that is depends on where pip looks: from PyPI on Linux it is the CUDA build (several GB
#      with its nvidia-* wheels); TITAN_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
#      picks the CPU build. TITAN_PIP_ARGS applies to this step only, so the index it names need
#      not carry the other packages (use pip's own configuration to redirect every install).
#   2. this repository, editable, with the `test` and `tpu` extras; `tpu` brings torch-tpu and
#      libtpu (about 0.5 GB) on Python 3.11+, and imports on machines without chips too.
#   3. a startup hook (site-packages/titan_tpu_startup.pth): on a host without TPU device files, every
#      Python process of the venv starts with torch's autoload of torch_tpu off, so a bare
#      `torchrun` (whose agent imports torch before train.py runs) or `import torch` neither loads it
#      nor prints libtpu's lines; on a TPU host it does nothing (titan_tpu/device/tpu_runtime.py).
# It reinstalls when pyproject.toml, this script, TITAN_TORCH or TITAN_PIP_ARGS change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
TITAN_TORCH="${TITAN_TORCH:-torch==2.13.0}"
TITAN_PIP_ARGS="${TITAN_PIP_ARGS:-}"
FINGERPRINT="$(
    { cat "$ROOT/pyproject.toml" "$ROOT/scripts/_venv.sh"; echo "$TITAN_TORCH|$TITAN_PIP_ARGS"; } \
        | sha1sum | cut -c1-12
)"
STAMP="$VENV/.installed-$FINGERPRINT"
if [ ! -f "$STAMP" ]; then
    echo "setting up $VENV (first use, or the set-up changed) ..." >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    # Word splitting of TITAN_PIP_ARGS is wanted: it holds several arguments.
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet $TITAN_PIP_ARGS "$TITAN_TORCH"
    "$VENV/bin/pip" install --quiet -e "$ROOT[test,tpu]"
    "$VENV/bin/python" -c "from titan_tpu.device.tpu_runtime import install_startup_hook; install_startup_hook()"
    rm -f "$VENV"/.installed-*
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
