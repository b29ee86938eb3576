"""Fine-tune a Hugging Face causal LM through wstream and export it back to a transformers folder.

Creates the job from a ``save_pretrained`` folder one stage at a time (the model is never whole in
this process), trains a few steps on the sonnets, exports with ``export_pretrained`` and checks
that ``AutoModelForCausalLM.from_pretrained`` on the export gives the streamed model's logits.
Without ``--model``, a tiny GPT-2 with random weights is written to a temporary folder first.

    python examples/hf_finetune.py                              # tiny random GPT-2, 20 steps
    python examples/hf_finetune.py --model path/to/gpt2 --out ft --steps 100 --lr 1e-5

Needs the hf extra, from a checkout of wstream (not on a package index): pip install -e '.[hf]'.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers

from wstream.client import AdamW, local_server
from wstream.client.cli_flags import add_connection_flags, client_from_args, key_options, token_from_args
from wstream.client.hf import causal_lm_loss, create_job_from_pretrained, export_pretrained

sys.path.insert(0, str(Path(__file__).parent))
from train_gpt import DEFAULT_SERVER, TEXT  # noqa: E402


def tiny_gpt2(folder: Path, seed: int) -> Path:
    """A 4-layer GPT-2 over bytes (vocabulary 256) with random weights, saved with save_pretrained."""
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=128, n_layer=4, n_embd=64, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def encoder(folder: Path, vocab_size: int) -> Callable[[str], list[int]]:
    """The folder's tokenizer when it has one, else bytes (folded into the vocabulary)."""
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return lambda text: [b % vocab_size for b in text.encode()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return lambda text: tokenizer(text)["input_ids"]


def batches(ids: torch.Tensor, seq: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=g)
        yield torch.stack([ids[s : s + seq] for s in starts])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a save_pretrained folder (default: a tiny random GPT-2)")
    p.add_argument("--out", type=Path, help="where to export (default: a temporary folder)")
    add_connection_flags(p, default_server=DEFAULT_SERVER, server_help="server endpoint, started if none answers", token=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--blocks-per-stage", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    scratch = tempfile.TemporaryDirectory(prefix="wstream-hf-")
    model = args.model or tiny_gpt2(Path(scratch.name) / "tiny-gpt2", args.seed)
    out = args.out or Path(scratch.name) / "finetuned"
    config = transformers.AutoConfig.from_pretrained(model)
    ids = torch.tensor(encoder(model, config.vocab_size)(TEXT.read_text()))
    name = f"hf-demo-{os.getpid()}"
    with local_server(args.server, announce=print, **key_options(args)):
        with client_from_args(args) as client:
            job = create_job_from_pretrained(
                client, name, model, token=token_from_args(args, default="demo"), blocks_per_stage=args.blocks_per_stage,
                optimizer=AdamW(lr=args.lr, weight_decay=0.01),
            )
            print(f"job {name!r} from {model}: {job.num_stages} stages, positions {job.positions}, {job.num_params:,} parameters")
            data = batches(ids, args.seq, args.batch, args.seed)
            with job.trainer() as trainer:
                t0 = time.perf_counter()
                losses = []
                for _ in range(args.steps):
                    x = next(data)
                    losses.append(trainer.step(x, x, causal_lm_loss))
                elapsed = time.perf_counter() - t0
                probe = next(data)[:2]
                streamed = trainer.forward(probe)
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps ({args.steps / elapsed:.1f} steps/s)")
            export_pretrained(job, out, model)
            job.drop()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
        with torch.no_grad():
            diff = (reloaded(probe).logits - streamed).abs().max().item()
        print(f"exported to {out}; from_pretrained gives the streamed logits to {diff:.1e}")
        if args.out is None:
            print("(a temporary folder, removed now: pass --out to keep it)")
        scratch.cleanup()


if __name__ == "__main__":
    main()
