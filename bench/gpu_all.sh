#!/usr/bin/env bash
# Every GPU figure and the CUDA tests, sized for one H100 80 GB (128 GiB host, 16 cores), in at
# most 25 minutes, in two parts of under 10 minutes each (the device tool's limit per command):
#   bash bench/gpu_all.sh 1   # CUDA tests, figure 1 (bandwidth), figures 2-3 (GPT, 1.4 B)
#   bash bench/gpu_all.sh 2   # a model larger than GPU memory (11.5 B, SGD), figure 4 (DeepSpeed)
#   bash bench/gpu_all.sh     # both
# Logs and figures go to $OUT (the device tool's folder) or bench/out. Wheels the image lacks come
# from .whl/ (bench/gpu_prepare.sh). Every step has its own time limit (SIGINT first, so that a
# benchmark stops its server), so a hang costs only that step.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

site=/tmp/wstream-site
if ! PYTHONPATH=$site python3 -c "import zmq, msgspec, pytest_asyncio" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl \
        || { echo "gpu_all: installing .whl/ failed: run bench/gpu_prepare.sh here and carry .whl"; exit 1; }
fi
# wstream itself every call: a machine still warm from an earlier call keeps /tmp (and the ignored
# build/), and this call's tree may differ from the one installed then
rm -rf build $site/wstream $site/wstream-*.dist-info
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target $site . \
    || { echo "gpu_all: installing wstream failed"; exit 1; }
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name (at most ${limit} s): $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

if [[ $part == 1 || $part == all ]]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    df -h /dev/shm | tail -1
    if [[ $(id -u) == 0 ]] && ! grep -q hugetlbfs /proc/mounts; then  # 9 GiB of 2 MiB pages for figure 1
        mkdir -p /dev/hugepages && mount -t hugetlbfs -o pagesize=2M none /dev/hugepages \
            && echo 4608 > /proc/sys/vm/nr_hugepages
        grep -E 'HugePages_(Total|Free)' /proc/meminfo || echo "huge pages: could not reserve any"
    fi
    step cuda_tests 120 python3 -m pytest -q -s -m cuda -p no:cacheprovider tests/test_cuda.py
    step gpu_bandwidth 140 python3 bench/gpu_bandwidth.py --stage-mib 256 --stages 8 --rounds 4 --register-gib 8
    step gpu_train 270 python3 bench/gpu_train.py --only small --layers 24 --width 2048 --seq 1024 \
        --batches 4,8,16 --steps 4 --warmup 2 --weight-budget 4GiB --server-threads 12 --json "$out/gpu_train.json"
    cp "$out/gpu_train.json" /tmp/wstream-gpu_train.json 2>/dev/null  # for part 2 ($OUT is emptied per command)
    # the same with a step ring (every gradient read in place by its update; session 13: not yet measured)
    step gpu_train_step_ring 150 python3 bench/gpu_train.py --only small --layers 24 --width 2048 --seq 1024 \
        --batches 4,16 --steps 4 --warmup 2 --weight-budget 4GiB --server-threads 12 --step-ring
    # and a delayed update with a step ring (session 13: delayed alone was slower than commit)
    step gpu_train_delayed_step_ring 150 python3 bench/gpu_train.py --only small --layers 24 --width 2048 --seq 1024 \
        --batches 4,16 --steps 4 --warmup 2 --weight-budget 4GiB --server-threads 12 --step-ring --delayed-update
    # the server's default threads (half the cores: 8 of 16) where the figures above give it 12: what a
    # user gets without the flag, on a host whose worker computes on the GPU (session 18: not yet measured)
    step gpu_train_default_threads 120 python3 bench/gpu_train.py --only small --layers 24 --width 2048 --seq 1024 \
        --batches 16 --steps 4 --warmup 2 --weight-budget 4GiB
fi
if [[ $part == 2 || $part == all ]]; then
    if [[ $(id -u) == 0 ]] && grep -q hugetlbfs /proc/mounts; then
        echo 0 > /proc/sys/vm/nr_hugepages  # give figure 1's pages back: the 10 B model needs the RAM
    fi
    step gpu_train_big 420 python3 bench/gpu_train.py --only big --big-layers 56 --big-width 4096 --big-heads 32 \
        --seq 1024 --big-batch 4 --steps 4 --weight-budget 4GiB --server-threads 12
    step gpu_deepspeed 120 python3 bench/gpu_deepspeed.py --layers 24 --width 2048 --seq 1024 --batches 4,8,16 \
        --compare /tmp/wstream-gpu_train.json
fi
