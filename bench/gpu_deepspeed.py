"""GPU figure 4: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU, on the GPT of
bench/gpu_train.py (same sizes, bf16, a checkpoint per stage), against wstream's figures from the
same run of gpu_train.py (``--compare``). Without DeepSpeed it says exactly why and measures nothing.
The two figures come from two processes run one after the other on the same machine (DeepSpeed's
engine and its process group do not share a process with a wstream trainer), not from one process
as every other ratio in BENCHMARKS.md: read it as less robust against drift. Both time a step from
the making of its batch to a synchronized end.

DeepSpeed is not in the device machine's image and is not on the index as a prebuilt wheel; its CPU
Adam is compiled just in time (nvcc and ninja are there). bench/gpu_prepare.sh --with-deepspeed
tries to build a pure-Python wheel here to carry.

    python bench/gpu_deepspeed.py [--layers 24 --width 2048 --seq 1024 --batches 4,8,16] [--compare out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import parse_args
from gpu_common import add_model_args, header, require_cuda
from gpu_train import VOCAB, batch, loss_fn
from wstream.client.models.gpt import GPTConfig, gpt_stages


class Chain(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.stages = nn.ModuleList(gpt_stages(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = checkpoint(s, x, use_reentrant=False)
        return x


def ds_config(micro_batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
        },
        "steps_per_print": 10**9,
    }


def run(cfg: GPTConfig, size: int, device: torch.device, steps: int, warmup: int) -> tuple[float, int]:
    import deepspeed

    conf = ds_config(size)
    with deepspeed.zero.Init(config_dict_or_path=conf):
        model = Chain(cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for t in range(warmup + steps):
        t0 = time.perf_counter()  # the batch's making is timed, as in gpu_train.py's steps
        x, y = batch(cfg, size, device, t)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if t >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device)
    engine.destroy()
    del engine, model
    torch.cuda.empty_cache()
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--compare", help="the --json file of bench/gpu_train.py from this run")
    args = parse_args(p, smoke=dict(steps=1, warmup=0, layers=1, width=64, heads=2, seq=16, batches="1"))
    device = require_cuda("gpu_deepspeed.py", smoke=args.smoke)
    header(device)
    try:
        import deepspeed
    except Exception as exc:  # ImportError, or its op builder failing at import
        print(
            f"DeepSpeed ZeRO-3 offload: NOT MEASURED: 'import deepspeed' failed: {type(exc).__name__}: {exc}. "
            "It is not in this image and nothing can be fetched here; carry a wheel built by "
            "bench/gpu_prepare.sh --with-deepspeed (its CPU Adam then compiles just in time with nvcc)."
        )
        return
    print(f"deepspeed {deepspeed.__version__}")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29513"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl")
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    theirs: dict[str, Any] = {}
    if args.compare and os.path.exists(args.compare):
        with open(args.compare) as f:
            theirs = json.load(f)["batches"]
    print("batch | tokens/s DeepSpeed ZeRO-3 offload | peak GPU | tokens/s wstream | ratio (wstream/DeepSpeed)")
    for size in (int(b) for b in args.batches.split(",")):
        try:
            seconds, peak = run(cfg, size, device, args.steps, args.warmup)
        except torch.OutOfMemoryError:
            print(f"{size:5d} | out of GPU memory")
            continue
        mine = (theirs.get(str(size)) or {}).get("wstream_tokens_per_s")
        tokens = size * args.seq / seconds
        ratio = f"{mine / tokens:.2f}" if mine else "- (no gpu_train.py figures)"
        print(f"{size:5d} | {tokens:31,.0f} | {peak / 2**30:6.1f} GiB | {mine or 0:16,.0f} | {ratio}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
