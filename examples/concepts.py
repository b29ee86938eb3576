"""wstream's concepts in one small program: stages, a job, a worker, a checkpoint plan.

A model is a chain of *stages* (here: six residual MLP blocks). A *job* on the server holds their
weights and AdamW state; a *worker* (``Trainer``) fetches each stage's weights just before it
runs it and pushes the stage's gradient back, and the server updates that stage while the
worker goes on. The checkpoint *plan* decides which stage inputs the worker keeps; micro-batches
run stage-major. At the end the job's weights are compared with plain PyTorch training.

    python examples/concepts.py [--steps 5]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from wstream.client import AdamW, local_server
from wstream.client.cli_flags import add_connection_flags, client_from_args, key_options, token_from_args
from wstream.client.local import default_address


class Block(nn.Module):
    """One stage: x + MLP(LayerNorm(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_flags(
        p, default_server=default_address(), server_help="server endpoint, started for this program if none answers", token=True
    )
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    width = 32
    stages = [Block(width) for _ in range(6)]  # 1. the model, as a chain of stages
    reference = nn.Sequential(*copy.deepcopy(stages))
    data = [(torch.randn(16, width), torch.randn(16, width)) for _ in range(args.steps)]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, y)

    with local_server(args.server, **key_options(args)), client_from_args(args) as client:
        # 2. the job: weights and optimizer state move to the server, stage by stage; the local
        #    modules become meta-device skeletons (their memory is freed)
        token = token_from_args(args, default="a-secret")
        job = client.create_job("concepts", stages, optimizer=AdamW(lr=1e-3), token=token)
        print(f"job {job.name!r}: {job.num_stages} stages, {job.num_params:,} parameters on the server")
        # 3. a worker, with a checkpoint plan: Revolve keeping 2 stage inputs
        with job.trainer(schedule="revolve", slots=2) as trainer:
            for t, (x, y) in enumerate(data):
                # 4. one step: 4 micro-batches run stage-major, one update per stage
                loss = trainer.step(x, y, loss_fn, micro_batches=4)
                print(f"step {t}: loss {loss:.4f}")
            plan = trainer.plan_summary()
            print(
                f"plan {plan['schedule']}: {plan['recomputed_forwards']} forwards for {plan['stages']} stages, "
                f"at most {plan['peak_live_states']} stage inputs live"
            )
        got = job.state_dict()  # 5. the weights, pulled back from the server
        job.drop()

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for x, y in data:  # the same training in plain PyTorch (gradient accumulation over 4 chunks)
        opt.zero_grad()
        for xj, yj in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
            (loss_fn(reference(xj), yj) / 4).backward()
        opt.step()
    want = reference.state_dict()
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"largest difference from plain PyTorch training: {diff:.2e}")


if __name__ == "__main__":
    main()
