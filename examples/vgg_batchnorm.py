"""A VGG-style CNN with BatchNorm through wstream: the running statistics travel with the stages.

The workload of vDNN (convolutions whose activations, not weights, fill memory) on a synthetic
10-class image task: each class is a random 32x32 pattern, each sample that pattern under noise.
Every VGG block is a stage; its BatchNorm running mean, variance and count are stored on the server
with the block's weights, updated once per micro-batch's real forward (never by the plan's
recomputation), sent back with the step and used by ``trainer.forward`` in eval mode. At the end
the job is exported and loaded into a plain ``nn.Sequential``, which classifies as the trainer did.

    python examples/vgg_batchnorm.py [--steps 30] [--schedule revolve]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from wstream.client import AdamW, local_server
from wstream.client.cli_flags import add_connection_flags, client_from_args, key_options, token_from_args
from wstream.client.local import default_address
from wstream.client.models import vgg_stages

CLASSES = 10


def task(seed: int) -> torch.Tensor:
    """One 3x32x32 pattern per class."""
    return torch.randn(CLASSES, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def samples(patterns: torch.Tensor, n: int, seed: int, noise: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy images of random classes, and their labels."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return patterns[labels] + noise * torch.randn(n, 3, 32, 32, generator=g), labels


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(1) == labels).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_flags(
        p, default_server=default_address(), server_help="server endpoint, started for this program if none answers", token=True
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--schedule", default="revolve", help="checkpoint plan (revolve recomputes: stats still move once)")
    args = p.parse_args()
    torch.manual_seed(0)
    patterns = task(1)
    stages = vgg_stages(CLASSES, dropout=0.0)
    names = [f"{i}.{k}" for i, s in enumerate(stages) for k in s.state_dict()]
    test_x, test_y = samples(patterns, 256, seed=10_000)

    with local_server(args.server, announce=print, **key_options(args)), client_from_args(args) as client:
        job = client.create_job("vgg-bn", stages, optimizer=AdamW(lr=2e-3), token=token_from_args(args, default="vgg"))
        buffers = sum(1 for s in job.specs for q in s.params if q.buffer)
        print(f"job {job.name!r}: {job.num_stages} stages, {job.num_params:,} weights and buffers ({buffers} buffers)")
        options = {"slots": 1} if args.schedule == "revolve" else {}
        t0 = time.perf_counter()
        with job.trainer(schedule=args.schedule, **options) as trainer:
            losses = [
                trainer.step(*samples(patterns, args.batch, seed=t), nn.functional.cross_entropy, micro_batches=args.micro_batches)
                for t in range(args.steps)
            ]
            elapsed = time.perf_counter() - t0
            plan = trainer.plan_summary()
            streamed = trainer.forward(test_x)  # eval mode: BatchNorm uses the job's running statistics
            print(trainer.stats())
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        print(f"\nloss {first:.3f} -> {last:.3f} in {args.steps} steps ({args.steps / elapsed:.1f} steps/s)")
        print(f"plan {plan['schedule']}: {plan['recomputed_forwards']} forwards for {plan['stages']} stages a step")
        state = job.state_dict()
        count = int(state["0.features.1.num_batches_tracked"])
        print(f"BatchNorm updates per layer: {count} ({args.steps} steps x {args.micro_batches} micro-batches, none from recomputation)")
        print(f"test accuracy through the stream (eval mode): {accuracy(streamed, test_y):.1%}")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "vgg.safetensors"
            job.export(path)
            exported = load_file(path)
        job.drop()

    assert sorted(exported) == sorted(names), "the export holds every weight and buffer"
    model = nn.Sequential(*vgg_stages(CLASSES, dropout=0.0))
    model.load_state_dict(exported)  # "<stage>.<name>": the stages' keys in an nn.Sequential
    with torch.no_grad():
        plain = model.eval()(test_x)
    print(f"the export in plain PyTorch (eval mode): test accuracy {accuracy(plain, test_y):.1%}, "
          f"largest logit difference from the stream {(plain - streamed).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
