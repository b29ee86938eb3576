"""Train a small character-level GPT through wstream, end to end on one machine.

Starts a ``wstream-server`` on an embedded default address (unless one already answers there),
creates the job stage by stage, trains with a progress bar, then prints the worker's peak memory
next to what the whole model would need, and a sample of generated text.

    python examples/train_gpt.py                 # defaults: 4 layers, 200 steps
    python examples/train_gpt.py --steps 20      # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch import nn
from tqdm import tqdm

from wstream.client import AdamW, WarmupCosine, local_server, no_decay
from wstream.client.cli_flags import add_connection_flags, client_from_args, key_options, token_from_args
from wstream.client.models import GPTConfig, gpt_stages, lm_loss
from wstream.protocol import format_bytes

TEXT = Path(__file__).parent / "data" / "sonnets.txt"
DEFAULT_SERVER = f"ipc://{tempfile.gettempdir()}/wstream-demo-{os.getuid()}.sock"


def batches(data: torch.Tensor, seq: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        yield x, y


@torch.no_grad()
def sample(model: nn.Module, stoi: dict[str, int], itos: list[str], prompt: str, length: int, block: int) -> str:
    idx = torch.tensor([[stoi[c] for c in prompt]])
    g = torch.Generator().manual_seed(0)
    for _ in range(length):
        logits = model(idx[:, -block:])[:, -1] / 0.8
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return "".join(itos[i] for i in idx[0].tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_flags(p, default_server=DEFAULT_SERVER, server_help="server endpoint, started if none answers", token=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (after the warmup)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: a tenth of --steps)")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batches", type=int, default=1, help="run each stage for K micro-batches of the batch (stage-major)")
    p.add_argument("--delayed-update", action="store_true", help="one-step delayed parameter update (off the critical path)")
    p.add_argument("--delay-after", type=int, default=0, metavar="N", help="with --delayed-update: the first N steps are synchronous")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the dtype the server publishes and the worker computes in (fp32 master on the server; float16 scales the loss); "
        "the 16-bit types are for GPUs: a CPU emulates them, about 10x slower",
    )
    p.add_argument("--trace", metavar="FILE", help="write a Chrome-trace/Perfetto timeline of the last 2 steps to FILE")
    args = p.parse_args()

    text = TEXT.read_text()
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    data = torch.tensor([stoi[c] for c in text])
    cfg = GPTConfig(vocab_size=len(itos), block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)

    job_name = f"gpt-demo-{os.getpid()}"
    with local_server(args.server, announce=print, **key_options(args)):
        with client_from_args(args) as client:
            torch.manual_seed(args.seed)
            # the GPT recipe: warmup + cosine decay to a tenth, the global gradient norm clipped to 1,
            # no weight decay on biases, norms and embeddings
            warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
            recipe = AdamW(
                lr=args.lr,
                betas=(0.9, 0.95),
                weight_decay=0.1,
                clip_grad_norm=args.clip or None,
                schedule=WarmupCosine(warmup_steps=min(warmup, args.steps), total_steps=args.steps, min_lr_ratio=0.1),
            )
            job = client.create_job(
                job_name,
                gpt_stages(cfg),
                optimizer=recipe,
                param_groups=[no_decay()],
                token=token_from_args(args, default="demo"),
                progress=True,
                delayed_update=args.delayed_update,
                delay_after=args.delay_after,
                dtype=args.dtype,
            )
            # the server stores, streams and updates runs of small stages as one transfer unit
            held = len(job.unit_specs)
            server_stages = f"{held} stages" if job.units is None else f"{held} transfer unit{'s' * (held != 1)}"
            stored = "" if job.units is None else f" in {server_stages}"
            print(f"job {job_name!r}: {job.num_stages} stages{stored}, {job.num_params:,} parameters")
            data_iter = batches(data, args.seq, args.batch, args.seed)
            process = psutil.Process()
            with job.trainer(prefetch=args.prefetch) as trainer:
                bar = tqdm(range(args.steps), desc="training", unit="step")
                first = last = 0.0
                t0 = time.perf_counter()
                with contextlib.ExitStack() as tracing:
                    for step in bar:
                        if args.trace and step == max(args.steps - 2, 0):
                            tracing.enter_context(trainer.trace(args.trace))  # written when the loop ends
                        x, y = next(data_iter)
                        last = trainer.step(x, y, lm_loss, micro_batches=args.micro_batches)
                        first = first or last
                        now = trainer.stats()
                        shown = {
                            "loss": f"{last:.3f}",
                            "lr": f"{now.lr or 0:.2e}",
                            "|g|": f"{now.grad_norm or 0:.2f}",
                            "tok/s": f"{now.tokens_per_s or 0:,.0f}",
                        }
                        if now.loss_scale:
                            shown["loss_scale"] = f"{now.loss_scale:g}"
                        bar.set_postfix(shown)
                elapsed = time.perf_counter() - t0
                stats = trainer.stats()
            rss = process.memory_info().rss
            params = job.num_params
            if args.trace:
                print(f"timeline of the last steps: {args.trace} (open in https://ui.perfetto.dev)")
            print(f"\nloss {first:.3f} -> {last:.3f} in {args.steps} steps ({args.steps / elapsed:.1f} steps/s)")
            print("memory:")
            print(f"  whole model, fp32 weights + grads + AdamW state (16 B/param): {format_bytes(16 * params)}")
            print(
                f"  worker peak: weight ring {format_bytes(stats.ring_bytes)} "
                f"({min(stats.ring_capacity, held)} of {server_stages} resident at most, peak {stats.peak_resident_stages}) "
                f"+ stage-boundary activations {format_bytes(stats.peak_boundary_bytes)}"
            )
            print(f"  (this process's RSS, torch runtime included: {format_bytes(rss)})")
            steps = max(stats.steps, 1)
            if stats.zero_copy:  # nothing is copied: the worker computes on the server's shared memory
                weights_in = f"{format_bytes(stats.bytes_read_in_place / steps)} of weights read in place (zero-copy)"
            else:
                weights_in = f"{format_bytes(stats.bytes_fetched / steps)} of weights copied in"
            print(f"  streamed per step: {weights_in}, {format_bytes(stats.bytes_pushed / steps)} of gradients out")
            model = nn.Sequential(*gpt_stages(cfg))
            model.load_state_dict(job.state_dict())
            model.eval()
            print("\nsample:\n" + sample(model, stoi, itos, "Shall I ", 240, args.seq))
            job.drop()


if __name__ == "__main__":
    main()
