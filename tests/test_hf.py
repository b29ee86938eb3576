"""Hugging Face causal LMs through wstream: the streamed model computes what ``transformers`` does,
trains as ``transformers`` + ``torch.optim.AdamW`` does, exports to a folder ``from_pretrained``
loads, and is created without holding more than one stage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from wstream.client import AdamW, Client, LayoutError, StateError, Tied  # noqa: E402
from wstream.protocol.layout import numel_of  # noqa: E402
from wstream.client import hf  # noqa: E402
from wstream.client.hf import (  # noqa: E402
    attach_job_from_pretrained,
    causal_lm_loss,
    create_job_from_pretrained,
    export_pretrained,
    stages_from_pretrained,
)

VOCAB, SEQ = 96, 12


def tiny_config(kind: str, *, dropout: float = 0.0) -> Any:
    """2 layers, width 32, vocabulary 96: ``gpt2`` (tied head), ``llama`` (untied), ``llama_tied``."""
    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1}
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **common
        )
    return transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=kind == "llama_tied",
        **common,
    )


def save_model(kind: str, folder: Path, *, max_shard_size: str | None = None, dropout: float = 0.0, seed: int = 0) -> Path:
    """A model of ``tiny_config(kind)`` with random weights, written by ``save_pretrained``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, dropout=dropout))
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **options)
    return folder


def reference(folder: Path, attn: str = "sdpa") -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)


def batch(step: int, size: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(step))


def padded(ids: torch.Tensor) -> torch.Tensor:
    """An attention mask with left padding in every other row."""
    mask = torch.ones_like(ids)
    mask[1::2, :3] = 0
    return mask


def weights_by_name(job_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``job.state_dict()`` keyed by checkpoint names (the stage prefix dropped)."""
    return {key.split(".", 1)[1]: t for key, t in job_state.items()}


def largest_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in got)


@pytest.mark.parametrize(("kind", "shard"), [("gpt2", None), ("llama", "20KB"), ("llama_tied", None)])
def test_streamed_logits_equal_transformers(client: Client, tmp_path: Path, kind: str, shard: str | None) -> None:
    folder = save_model(kind, tmp_path / "model", max_shard_size=shard)
    assert (folder / "model.safetensors.index.json").exists() == (shard is not None)
    ids = batch(0)
    for attn in ("sdpa", "eager"):
        want = reference(folder, attn)
        job = create_job_from_pretrained(client, f"{kind}-{attn}", folder, token="t", attn_implementation=attn)
        tied = kind != "llama"
        assert job.positions == ([0, 1, 2, 0] if tied else [0, 1, 2, 3])  # embed, 2 blocks (+ norm), head
        with job.trainer() as trainer:
            with torch.no_grad():
                torch.testing.assert_close(trainer.forward(ids), want(ids).logits, rtol=0, atol=1e-5)
                mask = padded(ids)
                torch.testing.assert_close(
                    trainer.forward((ids, mask)), want(ids, attention_mask=mask).logits, rtol=0, atol=1e-5
                )
    # a second worker attaches from the config alone and sees the same model
    other = attach_job_from_pretrained(client, f"{kind}-eager", folder, token="t", attn_implementation="eager")
    with other.trainer() as trainer, torch.no_grad():
        torch.testing.assert_close(trainer.forward(ids), want(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "blocks_per_stage", "dropout", "early_stop"),
    [("gpt2", 1, 0.1, None), ("llama", 1, 0.0, None), ("llama_tied", 2, 0.0, None), ("gpt2", 1, 0.1, True), ("llama_tied", 2, 0.0, True)],
)
def test_training_equals_transformers_with_adamw(
    client: Client, tmp_path: Path, kind: str, blocks_per_stage: int, dropout: float, early_stop: bool | None
) -> None:
    """A few steps through a real server give the weights of the same steps of plain
    ``transformers`` training: in particular the tied embedding gets both uses' gradients. With
    ``early_stop`` every block's recomputation stops before its last op (its dropout replayed)."""
    folder = save_model(kind, tmp_path / "model", dropout=dropout)
    steps, lr, wd = 3, 1e-3, 0.01
    model = reference(folder)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    torch.manual_seed(123)  # the same dropout masks on both sides
    want_losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = model(batch(s), labels=batch(s)).loss
        loss.backward()
        opt.step()
        want_losses.append(loss.item())

    job = create_job_from_pretrained(
        client, kind, folder, token="t", blocks_per_stage=blocks_per_stage, optimizer=AdamW(lr=lr, weight_decay=wd)
    )
    torch.manual_seed(123)
    with job.trainer(early_stop=early_stop) as trainer:
        assert bool(trainer.planning.taped) and all(trainer.executor.tapes) if early_stop else not any(trainer.executor.tapes)
        losses = [trainer.step(batch(s), batch(s), causal_lm_loss) for s in range(steps)]
    got = weights_by_name(job.state_dict())
    want = model.state_dict()
    assert largest_difference(got, want) < 1e-5
    assert losses == pytest.approx(want_losses, rel=1e-5)
    if kind != "llama":  # the tied matrix is one parameter, and it moved by both uses' gradients
        embed = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
        assert "lm_head.weight" not in got
        start = reference(folder).state_dict()[embed]
        assert (got[embed] - start).abs().max().item() > 1e-3


def test_export_round_trips_through_from_pretrained(client: Client, tmp_path: Path) -> None:
    folder = save_model("gpt2", tmp_path / "model", max_shard_size="20KB")
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    job = create_job_from_pretrained(client, "ex", folder, token="t", optimizer=AdamW(lr=1e-2))
    ids = batch(0)
    with job.trainer() as trainer:
        trainer.step(ids, ids, causal_lm_loss)  # the export must carry trained weights, not the source's
        logits = trainer.forward(ids)
    trained = weights_by_name(job.state_dict())
    for shard in ("20KB", "5GB"):
        out = export_pretrained(job, tmp_path / f"out-{shard}", folder, max_shard_size=shard)
        written = sorted(p.name for p in out.glob("*.safetensors"))
        assert (len(written) > 1) == (shard == "20KB")
        if len(written) > 1:
            assert all((out / name).stat().st_size <= 20_000 + 4096 for name in written)  # data + header
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"].values()) == set(written)
            assert "lm_head.weight" not in index["weight_map"]  # tied weights are written once
        assert (out / "tokenizer_config.json").exists()
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="sdpa", output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
        state = loaded.state_dict()
        assert largest_difference(trained, state) == 0.0
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, logits, rtol=0, atol=1e-5)
    with pytest.raises(FileExistsError, match="already holds weights"):
        export_pretrained(job, tmp_path / "out-5GB", folder)
    # from a config object: the model class is recorded as save_pretrained does
    out = export_pretrained(job, tmp_path / "out-config", tiny_config("gpt2"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    # a job that is not this model is refused before anything is written
    other = client.create_job("other", [torch.nn.Linear(4, 4)], token="t")
    with pytest.raises(LayoutError, match="does not hold a gpt2 model"):
        export_pretrained(other, tmp_path / "out-other", tiny_config("gpt2"))
    assert not (tmp_path / "out-other").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_export_writes_the_dtype_of_the_weights_it_saved(client: Client, tmp_path: Path, dtype: torch.dtype) -> None:
    """A source labelled bfloat16 whose job trained in fp32: the export's config says the dtype
    of the tensors written, so ``from_pretrained`` (dtype "auto" by default) loads them exactly."""
    folder = save_model("llama", tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    job = create_job_from_pretrained(client, "ex", folder, token="t", optimizer=AdamW(lr=1e-2))
    with job.trainer() as trainer:
        trainer.step(batch(0), batch(0), causal_lm_loss)
    trained = weights_by_name(job.state_dict())
    out = export_pretrained(job, tmp_path / "out", folder, dtype=dtype)
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == dtype
    state = loaded.state_dict()
    for name, want in trained.items():
        assert torch.equal(state[name], want.to(dtype)), name  # bit for bit, in the dtype written


@pytest.mark.parametrize("label", ["bfloat16", "float16"])
def test_a_job_holds_the_checkpoints_fp32_weights_whatever_dtype_its_config_names(
    client: Client, tmp_path: Path, label: str
) -> None:
    """Found by review: fp32 tensors under a config that says bfloat16 or float16 (a label
    transformers 5 builds its modules in) were rounded to that dtype in every block and untied head
    (22 of 30 tensors of a tiny Llama differed, by up to 2.4e-4), and a value past float16's range
    became inf; the embedding, built anew in fp32, was exact. The fp32 job holds the checkpoint's
    tensors bit for bit, as ``from_pretrained(dtype=torch.float32)`` does."""
    folder = save_model("llama", tmp_path / "model")
    path = folder / "model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    down = next(k for k in tensors if k.endswith("down_proj.weight"))
    tensors[down][0, 0] = 7e4  # past float16's largest finite value (65504)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = label
    (folder / "config.json").write_text(json.dumps(config))
    job = create_job_from_pretrained(client, "label", folder, token="t", optimizer=AdamW(lr=1e-2))
    held = weights_by_name(job.state_dict())
    assert held.keys() == tensors.keys()
    different = [k for k, t in tensors.items() if not torch.equal(held[k], t)]
    assert not different, different
    assert held[down][0, 0].item() == 7e4


def test_export_takes_a_dtype_by_name_and_refuses_one_that_is_not_floating_point(client: Client, tmp_path: Path) -> None:
    """Found by review: ``dtype="bfloat16"`` (as ``create_job`` takes it) raised AttributeError
    after making the folder, and ``dtype=torch.int8`` wrote truncated integer weights that only
    transformers refused to load."""
    folder = save_model("gpt2", tmp_path / "model")
    job = create_job_from_pretrained(client, "named", folder, token="t", optimizer=AdamW(lr=1e-2))
    out = export_pretrained(job, tmp_path / "out", folder, dtype="bfloat16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    for bad, words in ((torch.int8, "floating point"), ("int8", "floating point"), ("bf16", "not a torch dtype")):
        with pytest.raises(ValueError, match=words):
            export_pretrained(job, tmp_path / f"out-{bad}", folder, dtype=bad)
        assert not (tmp_path / f"out-{bad}").exists()


def test_creation_holds_one_stage_and_reads_only_its_tensors(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While ``create_job`` consumes the loader, the materialized parameters alive at once are
    those of the stage being uploaded, and each stage reads only its own tensors."""
    folder = save_model("gpt2", tmp_path / "model", max_shard_size="20KB")
    reads: list[str] = []
    real_open = hf.safe_open

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._f = real_open(*args, **kwargs)

        def __enter__(self) -> Counting:
            self._f.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._f.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self._f.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            reads.append(name)
            return self._f.get_tensor(name)

    monkeypatch.setattr(hf, "safe_open", Counting)
    seen: list[torch.nn.Module] = []
    live: list[int] = []
    read_per_stage: list[list[str]] = []

    def watched() -> Iterator[torch.nn.Module | Tied]:
        done = 0
        for item in stages_from_pretrained(folder):
            module = item.module if isinstance(item, Tied) else item
            seen.append(module)
            live.append(sum(p.numel() * p.element_size() for m in seen for p in m.parameters() if not p.is_meta))
            read_per_stage.append(reads[done:])
            done = len(reads)
            yield item

    job = client.create_job("mem", watched(), token="t")
    stage_bytes = [sum(numel_of(p.shape) for p in spec.params) * 4 for spec in job.specs]
    assert live == [*stage_bytes, 0]  # one stage at a time; the tied head is a meta skeleton
    assert all(p.is_meta for m in seen for p in m.parameters())  # every stage was freed after upload
    for k, spec in enumerate(job.specs):
        assert sorted(read_per_stage[k]) == sorted(p.name for p in spec.params)
    assert len(reads) == len(set(reads))  # nothing read twice


def test_a_bare_model_checkpoint_is_read_without_its_prefix(tmp_path: Path) -> None:
    """``GPT2Model.save_pretrained`` names tensors ``h.0...`` where the LM says ``transformer.h.0...``."""
    torch.manual_seed(0)
    bare = transformers.GPT2Model(tiny_config("gpt2"))
    bare.save_pretrained(tmp_path / "bare")
    stages = [s for s in stages_from_pretrained(tmp_path / "bare") if not isinstance(s, Tied)]
    got = {name: p for s in stages for name, p in s.named_parameters()}
    want = {f"transformer.{name}": p for name, p in bare.state_dict().items()}
    assert got.keys() == want.keys()
    assert largest_difference(got, want) == 0.0


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request to the Hugging Face hub fails the test at once. (Without network the hub is asked
    again and again for about 25 s before transformers gives up.) ``pytest.fail`` raises a
    ``BaseException``, which transformers' ``except Exception`` around the download lets through."""
    import transformers.utils.hub as hub

    def refuse(*args: object, **kw: object) -> None:
        pytest.fail(f"the hub was asked for {args}")

    monkeypatch.setattr(hub, "hf_hub_download", refuse)
    monkeypatch.setattr(hub, "snapshot_download", refuse)


def test_a_mistyped_folder_is_named_without_asking_the_hub(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_hub: None
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    save_model("gpt2", tmp_path / "models" / "tiny-gpt2")
    # "models/tiny-gtp2" has the form of a hub id (namespace/name) but "models" is a folder here
    for typo in (tmp_path / "models" / "no-such", "models/tiny-gtp2", "./tiny-gpt2", "~/no-such-model-here", "no such"):
        with pytest.raises(FileNotFoundError, match=f"{typo}: no such folder") as missing:
            create_job_from_pretrained(client, "typo", typo, token="t")
        assert "config.json" in str(missing.value)
        with pytest.raises(FileNotFoundError, match=f"{typo}: no such folder"):
            attach_job_from_pretrained(client, "typo", typo, token="t")
    # create reads the weights from a local folder: a hub id is named as such, not looked up
    with pytest.raises(FileNotFoundError, match="openai/gpt-x: no such folder; .* reads a local save_pretrained folder"):
        create_job_from_pretrained(client, "typo", "openai/gpt-x", token="t")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty is a folder without config.json"):
        create_job_from_pretrained(client, "typo", tmp_path / "empty", token="t")
    assert client.status().jobs == []  # refused before asking the server for a job
    job = create_job_from_pretrained(client, "right", "models/tiny-gpt2", token="t")
    assert job.num_stages == 3


def test_offline_a_hub_id_that_is_not_cached_is_refused_without_asking_the_hub(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_hub: None
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="someone/some-model is not a local folder and HF_HUB_OFFLINE is set"):
        attach_job_from_pretrained(client, "j", "someone/some-model", token="t")
    # a local folder needs no hub, offline or not
    save_model("gpt2", tmp_path / "tiny")
    job = create_job_from_pretrained(client, "offline", "tiny", token="t")
    assert attach_job_from_pretrained(client, "offline", "./tiny", token="t").specs == job.specs


class _Racing:
    """A job read while it trains, replayed deterministically: ``lag`` stages are first read one
    step behind (their update still to come), then as they are; with ``ahead`` the job moves on
    one step under the reader at stage 2 (its weights all +1 from then on), ``forever`` times."""

    def __init__(self, job: Any, *, lag: set[int] = frozenset(), ahead: int = 0) -> None:  # type: ignore[assignment]
        self._job, self._lag, self._ahead = job, set(lag), ahead
        self.name, self.specs, self.num_stages, self.num_params = job.name, job.specs, job.num_stages, job.num_params
        self.step = 1

    def pull_stage_versioned(self, stage: int) -> tuple[int, dict[str, torch.Tensor]]:
        if stage == 2 and self._ahead:
            self._ahead -= 1
            self.step += 1
        weights = self._job.pull_stage(stage)
        if stage in self._lag:
            self._lag.discard(stage)
            return self.step - 1, {k: torch.zeros_like(t) for k, t in weights.items()}
        return self.step, {k: t + (self.step - 1) for k, t in weights.items()}

    def pull_stage(self, stage: int) -> dict[str, torch.Tensor]:  # what exports read before they checked steps
        return self.pull_stage_versioned(stage)[1]


def test_an_export_read_while_the_job_trains_is_of_one_step(client: Client, tmp_path: Path) -> None:
    """Found by review: ``export_pretrained`` (and LoRA's exports) read stage after stage through
    ``pull_stage`` and wrote what came, so an export made while a trainer stepped mixed steps.
    A stage behind the others is read again; a job that moved on under the export starts it again
    (the shards already written are replaced); one that keeps moving on is refused, and leaves no
    weights behind to be taken for a whole export."""
    folder = save_model("gpt2", tmp_path / "model")
    job = create_job_from_pretrained(client, "race", folder, token="t", optimizer=AdamW(lr=1e-2))
    want = weights_by_name(job.state_dict())

    def exported(racing: _Racing, name: str) -> dict[str, torch.Tensor]:
        out = export_pretrained(racing, tmp_path / name, folder, max_shard_size="20KB")
        state = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").state_dict()
        return {k: v for k, v in state.items() if k in want}

    got = exported(_Racing(job, lag={1, 3}), "lagging")  # read again until they catch up
    assert largest_difference(want, got) == 0.0
    racing = _Racing(job, lag={4}, ahead=1)  # stages 0, 1 written at step 1, then the job is at step 2
    got = exported(racing, "ahead")
    assert racing.step == 2 and largest_difference({k: v + 1 for k, v in want.items()}, got) == 0.0
    with pytest.raises(StateError, match="kept training while its weights were read"):
        export_pretrained(_Racing(job, ahead=10**6), tmp_path / "never", folder, max_shard_size="20KB")
    assert not list((tmp_path / "never").glob("model*.safetensors*"))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_job_created_from_a_config_is_a_new_model_initialized_as_transformers_does(client: Client, kind: str) -> None:
    """Found by review: there was no way to train a model from scratch: ``create_job_from_pretrained``
    with a config failed with "'transformer.wte.weight' is on the meta device". A config now makes
    a new model, initialized stage by stage by the model's own ``_init_weights`` (a seed makes it
    the same again), which trains and which another worker attaches to with the config."""
    config = tiny_config(kind)
    job = create_job_from_pretrained(client, f"new-{kind}", config, token="t", optimizer=AdamW(lr=1e-2), seed=3)
    again = create_job_from_pretrained(client, f"again-{kind}", config, token="t", optimizer=AdamW(lr=1e-2), seed=3)
    start = job.state_dict()
    assert all(torch.equal(start[k], t) for k, t in again.state_dict().items())
    torch.manual_seed(3)
    want = transformers.AutoModelForCausalLM.from_config(config).state_dict()  # other draws, the same distributions
    got = weights_by_name(start)
    assert set(got) <= set(want)
    for name, t in got.items():
        w = want[name]
        if w.std() == 0:  # norms at one, biases at zero
            assert torch.equal(t, w), name
        else:  # normal(0, initializer_range); GPT-2's output projections / sqrt(2 layers)
            assert abs(t.std().item() - w.std().item()) < 0.25 * w.std().item(), (name, t.std(), w.std())
    ids = batch(0)
    with job.trainer() as trainer:
        losses = [trainer.step(ids, ids, causal_lm_loss) for _ in range(6)]
    assert losses[-1] < losses[0]
    other = hf.attach_job_from_pretrained(client, f"new-{kind}", config, token="t")
    assert other.num_stages == job.num_stages
