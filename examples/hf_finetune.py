"""Fine-tune a Hugging Face causal LM through wstream and export it back to a transformers folder.

Creates the job from a ``save_pretrained`` folder one stage at a time (the model is never whole in
this process), trains a few steps on the sonnets, exports with ``export_pretrained`` and checks
that ``AutoModelForCausalLM.from_pretrained`` on the export gives the streamed model's logits.
Without ``--model``, a tiny GPT-2 with random weights is written to a temporary folder first.

    python examples/hf_finetune.py                              # tiny random GPT-2, 20 steps
    python examples/hf_finetune.py --model path/to/gpt2 --out ft --steps 100 --lr 1e-5
    python examples/hf_finetune.py --lora                       # LoRA adapters on a frozen base

With ``--lora`` the pretrained weights go into a frozen base job (held once, no optimizer state)
and a second job on it holds and trains only LoRA adapters (``wstream.client.lora``); both exports
are written and loaded back: the adapter alone (``peft``'s layout, loaded with
``PeftModel.from_pretrained`` when peft is installed) and the adapters merged into the weights
(``from_pretrained``). The server's memory for the base and the adapters is printed.

Needs the hf extra, from a checkout of wstream (not on a package index): pip install -e '.[hf]'.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers

from wstream.client import AdamW, Job, local_server
from wstream.client.cli_flags import add_connection_flags, client_from_args, key_options, token_from_args
from wstream.client.hf import causal_lm_loss, create_job_from_pretrained, export_pretrained, stages_from_pretrained
from wstream.client.lora import Lora, add_lora, export_adapter, export_merged

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
    p.add_argument("--lora", action="store_true", help="train LoRA adapters on a frozen base instead of every weight")
    p.add_argument("--lora-targets", help="regex of the adapted layers (default: c_attn for GPT-2, else q_proj|v_proj)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    args = p.parse_args()
    if args.lora:
        lora_main(args)
        return

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
            probe, streamed = train(job, ids, args)
            export_pretrained(job, out, model)
            job.drop()
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa")
        with torch.no_grad():
            diff = (reloaded(probe).logits - streamed).abs().max().item()
        print(f"exported to {out}; from_pretrained gives the streamed logits to {diff:.1e}")
        if args.out is None:
            print("(a temporary folder, removed now: pass --out to keep it)")
        scratch.cleanup()


def train(job: Job, ids: torch.Tensor, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """``args.steps`` steps on the text; prints the losses; returns a probe batch and its logits."""
    data = batches(ids, args.seq, args.batch, args.seed)
    with job.trainer() as trainer:
        t0 = time.perf_counter()
        losses = [trainer.step(x, x, causal_lm_loss) for x in itertools.islice(data, args.steps)]
        elapsed = time.perf_counter() - t0
        probe = next(data)[:2]
        streamed = trainer.forward(probe)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps ({args.steps / elapsed:.1f} steps/s)")
    return probe, streamed


def lora_main(args: argparse.Namespace) -> None:
    """Base job (frozen, the pretrained weights once) + adapter job (LoRA only), both exports."""
    scratch = tempfile.TemporaryDirectory(prefix="wstream-hf-")
    model = args.model or tiny_gpt2(Path(scratch.name) / "tiny-gpt2", args.seed)
    out = args.out or Path(scratch.name) / "finetuned"
    config = transformers.AutoConfig.from_pretrained(model)
    targets = args.lora_targets or ("c_attn" if config.model_type == "gpt2" else "q_proj|v_proj")
    lora = Lora(targets=targets, rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout, seed=args.seed)
    ids = torch.tensor(encoder(model, config.vocab_size)(TEXT.read_text()))
    name, token = f"hf-demo-{os.getpid()}", token_from_args(args, default="demo")
    with local_server(args.server, announce=print, **key_options(args)):
        with client_from_args(args) as client:
            base = create_job_from_pretrained(client, f"{name}-base", model, token=token, frozen=True)
            job = client.create_job(
                f"{name}-lora", add_lora(stages_from_pretrained(model, weights=False), lora), token=token,
                base=base.name, base_token=token, optimizer=AdamW(lr=args.lr, weight_decay=0.01),
            )
            print(f"job {job.name!r} on the frozen base {base.name!r}: LoRA rank {lora.rank} on {targets!r}, "
                  f"{job.num_params:,} trained parameters of {base.num_params:,}")
            probe, streamed = train(job, ids, args)
            held = {j.name: j.bytes for j in client.status().jobs}
            print(f"server memory: base {held[base.name]:,} B (weights once, no optimizer state), "
                  f"adapters {held[job.name]:,} B (weights, AdamW state, accumulator)")
            export_adapter(job, out / "adapter", lora, base_model=model)
            export_merged(job, base, out / "merged", model, lora)
            job.drop()
            base.drop()
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", attn_implementation="sdpa")
        with torch.no_grad():
            diff = (merged(probe).logits - streamed).abs().max().item()
        print(f"merged export in {out / 'merged'}; from_pretrained gives the streamed logits to {diff:.1e}")
        try:
            import peft
        except ImportError:
            print(f"adapter export in {out / 'adapter'} (install peft to load it back)")
        else:
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            plain = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa")
            adapted = peft.PeftModel.from_pretrained(plain, out / "adapter").eval()
            with torch.no_grad():
                diff = (adapted(input_ids=probe).logits - streamed).abs().max().item()
            print(f"adapter export in {out / 'adapter'}; peft gives the streamed logits to {diff:.1e}")
        if args.out is None:
            print("(a temporary folder, removed now: pass --out to keep it)")
        scratch.cleanup()


if __name__ == "__main__":
    main()
