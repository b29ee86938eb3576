#!/usr/bin/env bash
# Run HERE (not on the device machine): download the wheels the device machine's image lacks into
# .whl/ (ignored by git), to carry with the device tool's `run` (BENCHMARKS.md, "How to run the GPU
# figures"). The image has Python 3.12, torch (CUDA), msgpack, psutil, safetensors, tqdm,
# prometheus-client, numpy, pytest, hypothesis, pyyaml; it lacks pyzmq, msgspec and pytest-asyncio.
#   bash bench/gpu_prepare.sh [--with-deepspeed]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
plats=()
for n in 17 27 28 31 34 35; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d .whl pyzmq msgspec pytest-asyncio
if [[ "${1:-}" == "--with-deepspeed" ]]; then
    # DeepSpeed has no prebuilt wheel: build a pure-Python one (ops compile just in time there),
    # and fetch what it needs that the image lacks.
    # its setup.py imports torch, so no build isolation: this python needs torch, setuptools and wheel
    py=python3
    [[ -x .venv/bin/python ]] && py=.venv/bin/python
    $py -c "import torch, setuptools, wheel" 2>/dev/null || $py -m pip install -q setuptools wheel
    $py -m pip download -q --no-deps --no-binary=:all: -d .whl/src deepspeed
    DS_BUILD_OPS=0 $py -m pip wheel -q --no-deps --no-build-isolation -w .whl .whl/src/deepspeed-*.tar.gz
    rm -rf .whl/src
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plats[@]}" -d .whl hjson pydantic pydantic-core annotated-types typing-inspection ninja py-cpuinfo einops
fi
ls -l .whl
du -sh .whl
