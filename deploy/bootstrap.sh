#!/usr/bin/env bash
# Set up a virtual environment for wstream and run the demo or the tests.
#
#   bash deploy/bootstrap.sh demo [args for examples/train_gpt.py]
#   bash deploy/bootstrap.sh test [args for pytest]
#
# Creates .venv (if missing) next to this repository, installs torch FIRST, keeping a torch that
# is already importable (set WSTREAM_TORCH to choose another requirement, e.g. a CUDA build), then
# installs wstream itself in editable mode (to test, with its test, hf and lora extras).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${WSTREAM_VENV:-$here/.venv}"
python="${PYTHON:-python3}"
what="${1:-}"
shift || true

case "$what" in
  demo|test) ;;
  *) echo "usage: bash deploy/bootstrap.sh demo|test [args...]" >&2; exit 2 ;;
esac

if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -c "import venv, ensurepip" >/dev/null 2>&1; then
    echo "bootstrap: $python cannot make a virtual environment (on Debian/Ubuntu: apt install python3-venv)" >&2
    exit 1
  fi
  # --system-site-packages: a torch installed system-wide is used rather than downloaded again
  "$python" -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"

if ! "$py" -c "import torch" >/dev/null 2>&1; then
  # WSTREAM_TORCH is pip's arguments, split into words (e.g. "torch --index-url URL")
  read -r -a torch_args <<< "${WSTREAM_TORCH:-torch==2.13.0}"
  "$py" -m pip install --quiet "${torch_args[@]}"
fi
# tests: the hf extra (transformers) too, so that tests/test_hf.py runs rather than skips
if [ "$what" = test ]; then
  "$py" -m pip install --quiet -e "$here[test,hf,lora]"
else
  "$py" -m pip install --quiet -e "$here"
fi

cd "$here"
export PYTHONUNBUFFERED=1
if [ "$what" = demo ]; then
  exec "$py" examples/train_gpt.py "$@"
else
  exec "$py" -m pytest "$@"
fi
