"""GPU figures 2 and 3: training a GPT through wstream against the same model resident on the GPU.

Figure 2 (throughput) and 3 (peak GPU memory): a GPT of ``--layers`` blocks of width ``--width``,
sequence ``--seq``, bf16 compute, at several batch sizes:
* resident: the model on the GPU (fp32 weights, bf16 autocast), ``torch.utils.checkpoint`` on
  every stage (each stage's forward runs again in backward: the recomputation of wstream's
  ``store_all`` plan) and ``torch.optim.AdamW(fused=True)`` on the GPU;
* wstream: the job published in bf16 by a server on this host (fp32 master and AdamW on the CPU,
  stage by stage during backward), one worker streaming every stage into a device ring sized by
  ``--weight-budget``.
Printed per batch: tokens/s of each, the ratio wstream / resident, and the peak GPU memory of each
(``torch.cuda.max_memory_allocated``).

Then (``--big-layers``, 0 to skip) a model whose resident training does not fit in GPU memory,
trained by wstream within the weight budget: tokens/s and peak GPU memory. It uses SGD so that
the host (128 GiB on the device machine) holds it: 8 bytes/parameter on the server (fp32 master
and two bf16 slots) against AdamW's 16.

    python bench/gpu_train.py [--layers 24 --width 2048 --seq 1024 --batches 4,8,16] [--big-layers 56 --big-width 4096]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import parse_args, server
from gpu_common import add_model_args, empty_cache, header, peak_memory, require_cuda, reset_peak_memory, synchronize
from wstream.client import SGD, AdamW, Client
from wstream.client.models.gpt import GPTConfig, gpt_stages, lm_loss

VOCAB = 50304


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits.float(), targets)


def batch(cfg: GPTConfig, size: int, device: torch.device, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.block_size + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def timed_steps(step: Callable[[int], object], steps: int, warmup: int, device: torch.device) -> float:
    """Median seconds of ``step(t)`` (each ends synchronized: it returns the loss as a float)."""
    for t in range(warmup):
        step(t)
    times = []
    for t in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        step(t)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def resident(cfg: GPTConfig, sizes: list[int], device: torch.device, steps: int, warmup: int) -> dict[int, tuple[float, int]]:
    """Per batch size: (seconds per step, peak bytes) of plain PyTorch with the model on the GPU."""
    out = _resident(cfg, sizes, device, steps, warmup)
    gc.collect()  # the model and its optimizer state are gone: free their memory for wstream
    empty_cache(device)
    return out


def _resident(cfg: GPTConfig, sizes: list[int], device: torch.device, steps: int, warmup: int) -> dict[int, tuple[float, int]]:
    torch.manual_seed(0)
    with torch.device(device):
        stages = nn.ModuleList(gpt_stages(cfg))
    opt = torch.optim.AdamW(stages.parameters(), lr=1e-4, fused=True)
    out: dict[int, tuple[float, int]] = {}
    for size in sizes:
        def step(t: int, size: int = size) -> float:
            x, y = batch(cfg, size, device, t)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                for s in stages:
                    x = checkpoint(s, x, use_reentrant=False)
                loss = loss_fn(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        try:
            reset_peak_memory(device)
            seconds = timed_steps(step, steps, warmup, device)
            out[size] = (seconds, peak_memory(device))
        except torch.OutOfMemoryError:
            print(f"  resident, batch {size}: out of GPU memory")
            opt.zero_grad(set_to_none=True)
            empty_cache(device)
    return out


def wstream(
    cfg: GPTConfig, sizes: list[int], device: torch.device, steps: int, warmup: int, *, weight_budget: str,
    optimizer: object, memory_limit: str, server_threads: int | None, huge_pages: str = "auto", delayed_update: bool = False,
    step_ring: bool = False,
) -> dict[int, tuple[float, int, dict[str, float]]]:
    """Per batch size: (seconds per step, peak bytes, worker stats per step) through a server."""
    out: dict[int, tuple[float, int, dict[str, float]]] = {}
    extra = ("--memory-limit", memory_limit, "--huge-pages", huge_pages)
    if server_threads is not None:
        extra += ("--torch-threads", str(server_threads))
    with server(*extra) as address, Client(address, timeout=600) as client:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        job = client.create_job("gpt", gpt_stages(cfg), optimizer=optimizer, token="b", dtype="bfloat16", delayed_update=delayed_update)  # type: ignore[arg-type]
        print(f"  job created in {time.perf_counter() - t0:.0f} s ({job.num_params / 1e9:.2f} B parameters)")
        sys.stdout.flush()
        for size in sizes:
            reset_peak_memory(device)
            with job.trainer(device, weight_budget=weight_budget, step_ring=step_ring) as trainer:
                st = trainer.stats()
                print(
                    f"  wstream ring: {st.ring_capacity} stages, {st.ring_bytes / 2**30:.2f} GiB of {weight_budget}; "
                    f"registered {st.registered_bytes / 2**30:.2f} GiB of host memory in {st.registration_s:.2f} s"
                )
                try:
                    seconds = timed_steps(lambda t: trainer.step(*batch(cfg, size, device, t), loss_fn), steps, warmup, device)
                except torch.OutOfMemoryError:
                    print(f"  wstream, batch {size}: out of GPU memory")
                    break
                st = trainer.stats()
                per = {"fetch_wait_s": st.fetch_wait_s / st.steps, "push_wait_s": st.push_wait_s / st.steps}
                out[size] = (seconds, peak_memory(device), per)
    return out


def gib(n: int) -> str:
    return f"{n / 2**30:6.1f} GiB"


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--weight-budget", default="4GiB")
    p.add_argument("--memory-limit", default="100GiB", help="the server's")
    p.add_argument(
        "--server-threads", type=int, default=None,
        help="torch threads of the server's optimizer (default: the server's own, half the host's cores)",
    )
    p.add_argument("--big-layers", type=int, default=56, help="0: skip the model larger than GPU memory")
    p.add_argument("--big-width", type=int, default=4096)
    p.add_argument("--big-heads", type=int, default=32)
    p.add_argument("--big-batch", type=int, default=4)
    p.add_argument("--huge-pages", default="auto", choices=["auto", "on", "off"], help="the server's --huge-pages")
    p.add_argument("--only", choices=["small", "big"], help="run only the model of figures 2/3 or the big one")
    p.add_argument(
        "--delayed-update", action="store_true",
        help="wstream's job with delayed_update (step t's update overlaps all of step t + 1)",
    )
    p.add_argument(
        "--step-ring", action="store_true",
        help="the worker asks for a step ring (a gradient slot per stage, page-locked: every push read in place)",
    )
    p.add_argument("--json", help="also write the figures here (bench/gpu_deepspeed.py --compare reads them)")
    args = parse_args(p, smoke=dict(steps=1, warmup=0, layers=1, width=64, heads=2, seq=16, batches="1", big_layers=0, memory_limit="2GiB"))
    device = require_cuda("gpu_train.py", smoke=args.smoke, cpu_smoke=True)
    header(device)
    sizes = [int(b) for b in args.batches.split(",")]
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    if args.only != "big":
        print(f"GPT: {args.layers} blocks, width {args.width}, seq {args.seq}, {cfg.num_params / 1e9:.2f} B parameters, bf16")
        sys.stdout.flush()
        small(args, cfg, sizes, device)
    if args.big_layers and args.only != "small":
        big(args, device)


def small(args: argparse.Namespace, cfg: GPTConfig, sizes: list[int], device: torch.device) -> None:
    """Figures 2 and 3."""
    res = resident(cfg, sizes, device, args.steps, args.warmup)
    ws = wstream(
        cfg, sizes, device, args.steps, args.warmup, weight_budget=args.weight_budget, optimizer=AdamW(lr=1e-4),
        memory_limit=args.memory_limit, server_threads=args.server_threads, delayed_update=args.delayed_update, huge_pages=args.huge_pages,
        step_ring=args.step_ring,
    )
    print("batch | tokens/s resident | tokens/s wstream | ratio (wstream/resident) | peak GPU resident | peak GPU wstream | wstream waits/step (weights, updates)")
    for size in sizes:
        tokens = size * args.seq
        r = res.get(size)
        w = ws.get(size)
        rt = f"{tokens / r[0]:17,.0f}" if r else " " * 13 + "OOM"
        wt = f"{tokens / w[0]:16,.0f}" if w else " " * 12 + "OOM"
        ratio = f"{r[0] / w[0]:5.2f}" if r and w else "    -"
        rm = gib(r[1]) if r and r[1] else "-"  # (0: not measured, off CUDA)
        wm = gib(w[1]) if w and w[1] else "-"
        waits = f"{w[2]['fetch_wait_s']:.3f} s, {w[2]['push_wait_s']:.3f} s" if w else "-"
        print(f"{size:5d} | {rt} | {wt} | {ratio} | {rm:>17} | {wm:>16} | {waits}")
    sys.stdout.flush()
    if args.json:
        figures = {
            "config": {"layers": args.layers, "width": args.width, "seq": args.seq, "params": cfg.num_params},
            "batches": {
                str(size): {
                    "resident_tokens_per_s": size * args.seq / res[size][0] if size in res else None,
                    "resident_peak_bytes": res[size][1] if size in res else None,
                    "wstream_tokens_per_s": size * args.seq / ws[size][0] if size in ws else None,
                    "wstream_peak_bytes": ws[size][1] if size in ws else None,
                }
                for size in sizes
            },
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def big(args: argparse.Namespace, device: torch.device) -> None:
    """A model whose resident training does not fit in GPU memory, through wstream."""
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.big_layers, n_head=args.big_heads, n_embd=args.big_width)
    total = torch.cuda.get_device_properties(device).total_memory
    need = cfg.num_params * 8  # fp32 weights + fp32 gradients, before any optimizer state or activation
    print(
        f"GPT: {args.big_layers} blocks, width {args.big_width}, seq {args.seq}, bf16; "
        f"larger than GPU memory: {cfg.num_params / 1e9:.2f} B parameters; resident training needs at least "
        f"{gib(need).strip()} (fp32 weights + gradients) of {gib(total).strip()}: "
        f"{'does not fit' if need > total else 'FITS (choose a bigger model)'}"
    )
    sys.stdout.flush()
    limit = f"{int(cfg.num_params * 9 / 2**30) + 16}GiB"
    wb = wstream(
        cfg, [args.big_batch], device, max(2, args.steps // 2), 1, weight_budget=args.weight_budget,
        optimizer=SGD(lr=1e-4), memory_limit=limit, server_threads=args.server_threads, huge_pages=args.huge_pages,
    )
    if args.big_batch in wb:
        s, peak, per = wb[args.big_batch]
        print(
            f"wstream, batch {args.big_batch}: {args.big_batch * args.seq / s:,.0f} tokens/s, {s:.2f} s/step, "
            f"peak GPU {gib(peak).strip()}, waits/step {per['fetch_wait_s']:.3f} s weights, {per['push_wait_s']:.3f} s updates"
        )


if __name__ == "__main__":
    main()
