"""LoRA adapters on a shared frozen base (client/lora.py): training equals ``peft`` + torch AdamW,
only the adapters are held (and optimized) by the adapter job, and both exports load back, the
adapter with ``peft``, the merged model with ``transformers``, giving the streamed logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf_families import EPS, attn_of, batch, reference, save_model  # noqa: E402

from wstream.client import AdamW, Client, LayoutError  # noqa: E402
from wstream.client.hf import causal_lm_loss, create_job_from_pretrained, stages_from_pretrained  # noqa: E402
from wstream.client.lora import PEFT_PREFIX, Lora, add_lora, export_adapter, export_merged, peft_name  # noqa: E402
from wstream.client.stages import Tied  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # peft 0.21 reads transformers' deprecated is_gradient_checkpointing; not ours to fix
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

TARGETS = {
    "gpt2": ["c_attn", "c_proj"],
    "llama": ["q_proj", "v_proj", "down_proj"],
    "mistral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj", "o_proj"],
    "gemma": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "gpt_neox": ["query_key_value", "dense"],
    "opt": ["q_proj", "v_proj", "fc1"],
}
"""GPT-2's are ``Conv1D`` layers (weight in x out), the others' ``nn.Linear``; GPT-2's c_proj is
in its attention and its MLP, Llama's down_proj and OPT's fc1 in the MLP, Phi-3's qkv_proj and
GPT-NeoX's query_key_value fused q/k/v projections."""


def lora_params(item: Any) -> dict[str, torch.nn.Parameter]:
    module = item.module if isinstance(item, Tied) else item
    return {name: p for name, p in module.named_parameters() if ".lora_" in name}


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_lora_trains_as_peft_and_both_exports_load_back(client: Client, tmp_path: Path, kind: str) -> None:
    folder = save_model(kind, tmp_path / "model")
    steps, lr, wd, rank, alpha = 5, 1e-2, 0.01, 4, 8.0

    # peft + torch AdamW
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS[kind], fan_in_fan_out=kind == "gpt2"
    )
    torch.manual_seed(7)
    want = peft.get_peft_model(reference(folder, attn_of(kind)), config)
    start = {name: p.detach().clone() for name, p in want.named_parameters() if p.requires_grad}
    assert start and all(".lora_" in name for name in start)
    opt = torch.optim.AdamW([p for p in want.parameters() if p.requires_grad], lr=lr, weight_decay=wd, eps=EPS)
    want.train()
    want_losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = want(input_ids=batch(s), labels=batch(s)).loss
        loss.backward()
        opt.step()
        want_losses.append(loss.item())

    # wstream: the pretrained weights once in a frozen base, the adapters in a job on it
    base = create_job_from_pretrained(client, f"{kind}-base", folder, token="b", frozen=True)
    lora = Lora(targets=TARGETS[kind], rank=rank, alpha=alpha)
    stages = list(add_lora(stages_from_pretrained(folder, weights=False), lora))
    for item in stages:  # peft's initial adapters (lora_B is zero on both sides; lora_A random)
        for name, p in lora_params(item).items():
            p.data.copy_(start[PEFT_PREFIX + name])
    job = client.create_job(
        f"{kind}-lora", stages, token="t", base=f"{kind}-base", base_token="b",
        optimizer=AdamW(lr=lr, weight_decay=wd, eps=EPS),
    )
    assert {p.name.rsplit(".", 3)[1] for s in job.specs for p in s.params} == {"lora_A", "lora_B"}  # adapters only
    probe = batch(99)
    with job.trainer() as trainer:
        losses = [trainer.step(batch(s), batch(s), causal_lm_loss) for s in range(steps)]
        with torch.no_grad():
            streamed = trainer.forward(probe)
    got = {PEFT_PREFIX + key.split(".", 1)[1]: t for key, t in job.state_dict().items()}
    trained = {name: p.detach() for name, p in want.named_parameters() if p.requires_grad}
    assert got.keys() == trained.keys()
    assert max((got[k] - trained[k]).abs().max().item() for k in got) < 1e-5
    assert max((got[k] - start[k]).abs().max().item() for k in got) > 1e-3  # it did train
    assert losses == pytest.approx(want_losses, rel=1e-5)

    # memory on the server: the base's weights once, the adapters' weights and AdamW state
    held = {j.name: j.bytes for j in client.status().jobs}
    adapter_numel = sum(t.numel() for t in got.values())
    base_numel = sum(p.numel() for p in reference(folder, attn_of(kind)).parameters())  # a tied matrix once
    aligned = 16 * 4 * sum(len(s.params) for s in job.specs + base.specs)  # each parameter 16-element aligned
    assert base_numel * 4 <= held[f"{kind}-base"] <= base_numel * 4 + aligned  # weights once, no optimizer state
    per_element = 4 + 8 + 4  # fp32 master (published as it is), AdamW's two moments, gradient accumulator
    assert adapter_numel * per_element <= held[f"{kind}-lora"] <= adapter_numel * per_element + aligned * 4

    with torch.no_grad():
        # (a) the adapter alone, loaded by peft on the base model
        adapter = export_adapter(job, tmp_path / "adapter", lora, base_model=folder)
        assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        loaded = peft.PeftModel.from_pretrained(reference(folder, attn_of(kind)), adapter).eval()
        again = add_lora(stages_from_pretrained(folder, weights=False), Lora.from_pretrained(adapter), weights=adapter)
        reread = {PEFT_PREFIX + n: p for item in again for n, p in lora_params(item).items()}  # our export, read back
        assert reread.keys() == got.keys() and all(torch.equal(reread[k], got[k]) for k in got)
        torch.testing.assert_close(loaded(input_ids=probe).logits, streamed, rtol=0, atol=1e-5)
        torch.testing.assert_close(want.eval()(input_ids=probe).logits, streamed, rtol=0, atol=1e-5)
        # (b) merged into the base's weights, loaded by transformers
        merged = export_merged(job, client.attach_job(f"{kind}-base", token="b"), tmp_path / "merged", folder, lora)
        model = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation=attn_of(kind)).eval()
        torch.testing.assert_close(model(probe).logits, streamed, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(probe).logits, loaded.merge_and_unload()(probe).logits, rtol=0, atol=1e-5)


def test_lora_refuses_targets_that_are_not_linear_or_absent(tmp_path: Path) -> None:
    folder = save_model("llama", tmp_path / "model")
    with pytest.raises(ValueError, match=r"target 'model.layers.0.input_layernorm' is a LlamaRMSNorm, not a linear"):
        list(add_lora(stages_from_pretrained(folder, weights=False), targets=r"input_layernorm"))
    with pytest.raises(ValueError, match=r"Lora targets 'k_proj_typo' picked no module of the chain"):
        list(add_lora(stages_from_pretrained(folder, weights=False), targets="k_proj_typo"))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        Lora(targets="q_proj", rank=0)


def test_lora_layer_starts_equal_to_its_base_and_scales_by_alpha_over_rank() -> None:
    from wstream.client.lora import LoraLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 5)
    x = torch.randn(3, 6)
    want = layer(x)
    wrapped = LoraLinear(layer, Lora(targets="x", rank=2, alpha=6.0), None)
    trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trained == ["lora_A.default.weight", "lora_B.default.weight"]
    torch.testing.assert_close(wrapped(x), want, rtol=0, atol=0)  # lora_B starts at zero
    with torch.no_grad():
        wrapped.lora_B["default"].weight.normal_()
    delta = x @ wrapped.lora_A["default"].weight.T @ wrapped.lora_B["default"].weight.T * 3.0
    torch.testing.assert_close(wrapped(x), want + delta)


def test_lora_dropout_is_replayed_in_recomputation_as_peft_draws_it(client: Client, tmp_path: Path) -> None:
    """Adapter dropout (0.2) with a recomputing schedule (revolve): the same adapters as peft after
    three steps from the same seed and the same starting adapters (peft's folder, read back): the
    masks are drawn in the same order, and recomputation replays them. A second worker attaches
    with the same ``add_lora`` chain built without weights."""
    folder = save_model("llama", tmp_path / "model")
    steps, lr = 3, 1e-2
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(3)
    want = peft.get_peft_model(reference(folder, "sdpa"), config)
    with torch.no_grad():  # lora_B off zero, so that dropout changes the first step's output too
        for name, p in want.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    want.save_pretrained(tmp_path / "start")  # the starting adapters, read by wstream below
    opt = torch.optim.AdamW([p for p in want.parameters() if p.requires_grad], lr=lr, eps=EPS)
    want.train()
    torch.manual_seed(11)
    for s in range(steps):
        opt.zero_grad()
        want(input_ids=batch(s), labels=batch(s)).loss.backward()
        opt.step()

    create_job_from_pretrained(client, "base", folder, token="b", frozen=True)
    lora = Lora.from_pretrained(tmp_path / "start")
    stages = add_lora(stages_from_pretrained(folder, weights=False), lora, weights=tmp_path / "start")
    job = client.create_job("ft", stages, token="t", base="base", base_token="b", optimizer=AdamW(lr=lr, eps=EPS))
    torch.manual_seed(11)
    with job.trainer(schedule="revolve") as trainer:
        for s in range(steps):
            trainer.step(batch(s), batch(s), causal_lm_loss)
    got = {PEFT_PREFIX + key.split(".", 1)[1]: t for key, t in job.state_dict().items()}
    trained = {name: p.detach() for name, p in want.named_parameters() if p.requires_grad}
    assert max((got[k] - trained[k]).abs().max().item() for k in got) < 1e-5

    other = client.attach_job("ft", token="t", stages=add_lora(stages_from_pretrained(folder, weights=False), lora))
    with other.trainer() as trainer, torch.no_grad():
        want_logits = want.eval()(input_ids=batch(99)).logits
        torch.testing.assert_close(trainer.forward(batch(99)), want_logits, rtol=0, atol=1e-5)


def test_a_peft_adapter_folder_is_read_back_into_the_chain(tmp_path: Path) -> None:
    """``Lora.from_pretrained`` + ``add_lora(weights=)``: the settings and adapters peft saved (B
    made non-zero first); what does not fit is refused."""
    folder = save_model("llama", tmp_path / "model")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    want = peft.get_peft_model(reference(folder, "sdpa"), config)
    with torch.no_grad():
        for name, p in want.named_parameters():
            if "lora_B" in name:
                p.normal_()
    adapter = tmp_path / "adapter"
    want.save_pretrained(adapter)
    lora = Lora.from_pretrained(adapter)
    assert (lora.targets, lora.rank, lora.alpha, lora.dropout) == (("q_proj", "v_proj"), 4, 8, 0.1)
    stages = list(add_lora(stages_from_pretrained(folder, weights=False), lora, weights=adapter))
    got = {PEFT_PREFIX + name: p for item in stages for name, p in lora_params(item).items()}
    trained = {name: p for name, p in want.named_parameters() if p.requires_grad}
    assert got.keys() == trained.keys()
    assert all(torch.equal(got[k], trained[k]) for k in got)
    with pytest.raises(LayoutError, match=r"adapter 'model.layers.0.self_attn.k_proj.lora_A.default.weight' is not in"):
        list(add_lora(stages_from_pretrained(folder, weights=False), targets="q_proj|k_proj", rank=4, weights=adapter))
    with pytest.raises(LayoutError, match=r"4 tensors of .* are no adapter of the chain"):
        list(add_lora(stages_from_pretrained(folder, weights=False), targets="q_proj", rank=4, weights=adapter))
    rslora = adapter / "adapter_config.json"
    rslora.write_text(rslora.read_text().replace('"use_rslora": false', '"use_rslora": true'))
    with pytest.raises(ValueError, match="use_rslora=True is not supported"):
        Lora.from_pretrained(adapter)
    # settings peft saves that change what the adapter computes or which layers hold one (defect
    # seen: accepted, then a LayoutError or other layers than peft's)
    plain = {**json.loads(rslora.read_text()), "use_rslora": False}
    for key, value in (("exclude_modules", ["k_proj"]), ("lora_bias", True), ("init_lora_weights", "pissa")):
        config = {**plain, key: value}
        rslora.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"{key}=.* is not supported"):
            Lora.from_pretrained(adapter)


def test_an_adapter_of_a_job_without_a_base_holds_only_the_adapters(client: Client, tmp_path: Path) -> None:
    """A LoRA job created without ``base=`` keeps its frozen weights in the job itself;
    ``export_adapter`` writes only the adapters, under peft's names, and the folder reads back
    (defect seen: every frozen weight went into ``adapter_model.safetensors``, and reading it back
    failed)."""
    from safetensors import safe_open

    folder = save_model("llama", tmp_path / "model")
    lora = Lora(targets=["q_proj", "v_proj"], rank=4, alpha=8)
    chain = list(add_lora(stages_from_pretrained(folder), lora))
    job = client.create_job("no-base", chain, token="t", optimizer=AdamW(lr=1e-3))
    out = export_adapter(job, tmp_path / "adapter", lora, base_model=folder)
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        saved = set(f.keys())
    want = {peft_name(name) for item in chain for name in lora_params(item)}
    assert saved == want, sorted(saved ^ want)[:4]
    back = list(add_lora(stages_from_pretrained(folder, weights=False), Lora.from_pretrained(out), weights=out))
    assert {peft_name(name) for item in back for name in lora_params(item)} == want
    job.drop()


def test_a_target_that_picks_nothing_is_refused_by_name(tmp_path: Path) -> None:
    """Every name of a list of targets must pick a module (defect seen: GPT-NeoX's ``lm_head``, which
    the chain holds under its checkpoint name ``embed_out``, was skipped without a word, as peft
    adapts it, once another target matched)."""
    neox = save_model("gpt_neox", tmp_path / "neox")
    with pytest.raises(ValueError, match=r"\['lm_head'\] picked no module of the chain .*'embed_out'"):
        list(add_lora(stages_from_pretrained(neox, weights=False), targets=["query_key_value", "lm_head"], rank=4))
    llama = save_model("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"\['v_prj'\] picked no module"):
        list(add_lora(stages_from_pretrained(llama, weights=False), targets=["q_proj", "v_prj"], rank=4))


def test_an_adapter_on_a_renamed_head_is_exported_under_the_models_name(client: Client, tmp_path: Path) -> None:
    """GPT-NeoX's head is ``embed_out`` in the chain (its checkpoint's name) and ``lm_head`` in the
    model: the adapter folder names the model's module, so peft loads it onto the head (defect seen:
    ``target_modules=['embed_out']``, which peft refuses)."""
    folder = save_model("gpt_neox", tmp_path / "model")
    lora = Lora(targets=["query_key_value", "embed_out"], rank=4, alpha=8, seed=0)
    chain = list(add_lora(stages_from_pretrained(folder), lora))
    for item in chain:  # a non-zero B, so that the adapter changes the logits
        for name, p in lora_params(item).items():
            if "lora_B" in name:
                torch.nn.init.normal_(p)
    job = client.create_job("neox-head", chain, token="t", optimizer=AdamW(lr=1e-3))
    out = export_adapter(job, tmp_path / "adapter", lora, base_model=folder)
    model = peft.PeftModel.from_pretrained(reference(folder, "sdpa"), out)
    adapted = {n.removeprefix(PEFT_PREFIX).split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert "lm_head" in adapted, sorted(adapted)
    got = {n.removeprefix(PEFT_PREFIX): p for n, p in model.named_parameters() if ".lora_" in n}
    assert torch.equal(got["lm_head.lora_B.default.weight"], job.pull_stage(job.num_stages - 1)["embed_out.lora_B.default.weight"])
    job.drop()


def test_adapter_and_merged_exports_read_while_the_job_trains_are_of_one_step(client: Client, tmp_path: Path) -> None:
    """Found by review: both exports read stage after stage through ``pull_stage`` and wrote what
    came, mixing steps while a trainer stepped. A stage behind the others (here read first as
    zeros, one step back) is read again until it catches up (the adapters' pull is of the
    adapter stages only; the merged one's of every stage, from the base and the adapter job)."""
    from safetensors.torch import load_file
    from test_hf import _Racing

    folder = save_model("gpt2", tmp_path / "model")
    create_job_from_pretrained(client, "base", folder, token="b", frozen=True)
    lora = Lora(targets=TARGETS["gpt2"], rank=4, alpha=8.0)
    job = client.create_job(
        "lora", list(add_lora(stages_from_pretrained(folder, weights=False), lora)), token="t", base="base", base_token="b",
        optimizer=AdamW(lr=1e-2),
    )
    with job.trainer() as trainer:
        trainer.step(batch(0), batch(0), causal_lm_loss)  # lora_B moves off zero
    adapted = [i for i, s in enumerate(job.specs) if s.params]
    base = client.attach_job("base", token="b")
    with torch.no_grad():
        want = load_file(export_adapter(job, tmp_path / "adapter", lora) / "adapter_model.safetensors")
        got = load_file(export_adapter(_Racing(job, lag={adapted[-1]}), tmp_path / "adapter-racing", lora) / "adapter_model.safetensors")
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert any(k.endswith("lora_B.weight") and want[k].abs().max() > 0 for k in want)
        merged = [
            transformers.AutoModelForCausalLM.from_pretrained(
                export_merged(j, base, tmp_path / name, folder, lora), attn_implementation="sdpa"
            ).state_dict()
            for j, name in ((job, "merged"), (_Racing(job, lag={adapted[0]}), "merged-racing"))
        ]
        assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])


def test_an_adapter_export_holds_only_the_adapters(client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a second review: made to read one step, ``export_adapter`` kept every adapted
    stage's whole weights until the file was written (a job made without ``base=`` holds its frozen
    weights too: the whole model in fp32). It keeps the adapters only."""
    from wstream.client import lora as lora_module

    folder = save_model("gpt2", tmp_path / "model")
    lora = Lora(targets=TARGETS["gpt2"], rank=4, alpha=8.0)
    job = client.create_job("whole", list(add_lora(stages_from_pretrained(folder), lora)), token="t", optimizer=AdamW(lr=1e-2))
    held: list[int] = []
    pull_consistent = lora_module.pull_consistent

    def measured(pull, stages, name):  # type: ignore[no-untyped-def]
        step, pulled = pull_consistent(pull, stages, name)
        held.append(sum(t.numel() * t.element_size() for tensors in pulled for t in tensors.values()))
        return step, pulled

    monkeypatch.setattr(lora_module, "pull_consistent", measured)
    written = load_file_sizes(export_adapter(job, tmp_path / "adapter", lora) / "adapter_model.safetensors")
    assert held == [written], (held, written)


def load_file_sizes(path: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(path).values())
