"""Parameter groups (per-group weight decay and lr scale) and frozen parameters (requires_grad=False).

The server's per-stage optimizer must equal ``torch.optim`` built with the same param groups on
ordinary parameters; a job trained through wstream must equal plain PyTorch with those groups; frozen
parameters must stay bit-for-bit where they were and cost no optimizer state.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import models
from conftest import ServerThread, start_server
from test_equivalence import assert_weights_equal
from rawwire import RawPeer, RawSession
from wstream.client import connection as connection_module
from wstream.client import SGD, AdamW, Client, GradientError, LayoutError, ParamGroup, no_decay
from wstream.protocol import GroupSpec, JobOptions
from wstream.protocol import messages as m
from wstream.protocol.auth import secret_key, session_key
from wstream.protocol.layout import ALIGN_ELEMENTS, build_stage_spec, grad_layout, numel_of
from wstream.server.optimizer import StageOptimizer, state_nbytes

LR, WD = 3e-3, 0.05


# ---- the server's optimizer against torch.optim -------------------------------------------------
SHAPES = [(5, 3), (7,), (4, 4), (3,), (9, 2), (6,), (2, 8)]
MARKS = [(0, False), (1, False), (0, True), (2, False), (1, False), (0, False), (2, True)]  # (group, frozen)
GROUPS = [GroupSpec(name="no_decay", weight_decay=0.0), GroupSpec(name="slow", lr_scale=0.5, weight_decay=0.3)]


def _stage(marks: list[tuple[int, bool]] = MARKS) -> m.StageSpec:
    return build_stage_spec("0", [(f"p{k}", s, g, f) for k, (s, (g, f)) in enumerate(zip(SHAPES, marks))])


def _reference(spec: m.StageSpec, master: torch.Tensor, groups: list[GroupSpec], make, fused: bool):  # noqa: ANN001, ANN202
    """Ordinary parameters with the stage's values, and ``make(param_groups)`` over the trained ones."""
    params = [nn.Parameter(master[p.offset : p.offset + numel_of(p.shape)].clone().view(p.shape)) for p in spec.params]
    param_groups = []
    for k in range(1 + len(groups)):
        members = [q for q, p in zip(params, spec.params) if p.group == k and not p.frozen]
        extra = {} if k == 0 else {"lr_scale": groups[k - 1].lr_scale}
        if k and groups[k - 1].weight_decay is not None:
            extra["weight_decay"] = groups[k - 1].weight_decay
        if members:
            param_groups.append({"params": members, **extra})
    return params, make(param_groups, fused)


def _views(spec: m.StageSpec, master: torch.Tensor) -> list[torch.Tensor]:
    return [master[p.offset : p.offset + numel_of(p.shape)].view(p.shape) for p in spec.params]


OPTIMIZERS = {
    "adamw": (AdamW(lr=1e-2, weight_decay=0.1), lambda g, f: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, fused=f)),
    "sgd-nesterov": (
        SGD(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
        lambda g, f: torch.optim.SGD(g, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, fused=f),
    ),
    "sgd-dampened": (
        SGD(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01),
        lambda g, f: torch.optim.SGD(g, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, fused=f),
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused-reference"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_stage_optimizer_with_groups_and_frozen_parameters_equals_torch(kind: str, fused: bool) -> None:
    """12 steps with random gradients, a grad_scale and a per-step lr: to 1e-6 of torch's own
    optimizer (bit for bit against the fused one, which runs the same kernel); frozen parameters
    never change and hold no state."""
    spec_opt, make = OPTIMIZERS[kind]
    spec = _stage()
    layout = grad_layout(spec)
    assert layout.offsets[2] is None and layout.offsets[6] is None
    assert layout.numel < spec.numel
    torch.manual_seed(0)
    master = torch.randn(spec.numel)
    before = master.clone()
    opt = StageOptimizer(spec_opt, master, spec, GROUPS)
    params, ref = _reference(spec, master, GROUPS, make, fused)
    assert opt.state_tensors() == {}  # created lazily, as torch's
    for step in range(12):
        grad = torch.randn(layout.numel)
        scale = (None, 2.0, 3.0)[step % 3]
        lr = None if step % 2 else spec_opt.lr * 0.9**step
        for q, p, offset in zip(params, spec.params, layout.offsets):
            q.grad = None if offset is None else grad[offset : offset + numel_of(p.shape)].view(p.shape) / (scale or 1.0)
        for g in ref.param_groups:
            g["lr"] = (spec_opt.lr if lr is None else lr) * g.get("lr_scale", 1.0)
        ref.step()
        opt.step(grad.clone(), grad_scale=scale, lr=lr)
    got = _views(spec, master)
    worst = max((a - b).abs().max().item() for a, b in zip(got, params))
    assert worst <= (0.0 if fused and kind == "adamw" else 1e-6), worst
    for k, p in enumerate(spec.params):
        if p.frozen:
            assert torch.equal(got[k], _views(spec, before)[k])
    state = opt.state_tensors()
    flat_keys = {"exp_avg", "exp_avg_sq"} if kind == "adamw" else {"momentum_buffer"}
    assert {k for k in state if k != "step"} == flat_keys
    assert all(state[k].shape == (layout.numel,) for k in flat_keys)
    if kind == "adamw":
        assert state["step"].shape == () and float(state["step"]) == 12
    for k in flat_keys:  # each trained parameter's state is its view of the flat state
        for q, p, offset in zip(params, spec.params, layout.offsets):
            if offset is not None:
                want = ref.state[q][k].reshape(-1)
                assert (state[k][offset : offset + numel_of(p.shape)] - want).abs().max().item() <= 1e-6


def _today(master: torch.Tensor) -> torch.optim.Optimizer:
    """The update as it was before groups: one fused AdamW on the flat master."""
    return torch.optim.AdamW([master], lr=LR, weight_decay=WD, fused=True)


def test_the_flat_fast_path_is_bit_for_bit_what_it_was() -> None:
    spec = build_stage_spec("0", [(f"p{k}", s) for k, s in enumerate(SHAPES)])
    assert grad_layout(spec) == (spec.numel, tuple(p.offset for p in spec.params))
    torch.manual_seed(1)
    master = torch.randn(spec.numel)
    theirs = master.clone()
    opt = StageOptimizer(AdamW(lr=LR, weight_decay=WD), master, spec)
    assert opt.flat
    old = _today(theirs)
    for step in range(6):
        grads = [torch.randn(spec.numel) for _ in range(1 + step % 3)]
        summed = grads[0].clone()
        for g in grads[1:]:
            summed.add_(g)
        old.grad_scale = torch.tensor(float(len(grads))) if len(grads) > 1 else None  # type: ignore[attr-defined]
        theirs.grad = summed.clone()
        old.step()
        opt.step(summed, grad_scale=len(grads) if len(grads) > 1 else None)
    assert torch.equal(master, theirs)
    state = opt.state_tensors()
    assert list(state) == ["step", "exp_avg", "exp_avg_sq"]  # the keys snapshots have always had
    for k, v in old.state[theirs].items():
        assert torch.equal(state[k], v)
    assert state_nbytes(AdamW(), spec) == spec.numel * 8
    assert state_nbytes(SGD(momentum=0.9), spec) == spec.numel * 4 and state_nbytes(SGD(), spec) == 0


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("marks", ["grouped", "flat"])
def test_state_round_trip_continues_bit_for_bit(kind: str, marks: str) -> None:
    spec_opt, _ = OPTIMIZERS[kind]
    spec = _stage() if marks == "grouped" else build_stage_spec("0", [(f"p{k}", s) for k, s in enumerate(SHAPES)])
    layout = grad_layout(spec)
    torch.manual_seed(2)
    master = torch.randn(spec.numel)
    a = StageOptimizer(spec_opt, master, spec, GROUPS)
    grads = [torch.randn(layout.numel) for _ in range(10)]
    for g in grads[:5]:
        a.step(g.clone(), grad_scale=2.0)
    saved = {k: v.clone() for k, v in a.state_tensors().items()}
    copy_master = master.clone()
    b = StageOptimizer(spec_opt, copy_master, spec, GROUPS)
    b.load_state_tensors(saved)
    for g in grads[5:]:
        a.step(g.clone(), grad_scale=2.0)
        b.step(g.clone(), grad_scale=2.0)
    assert torch.equal(master, copy_master)
    sa, sb = a.state_tensors(), b.state_tensors()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    if marks == "grouped":  # (the flat path hands torch's own state back to it, as it always did)
        with pytest.raises(LayoutError, match="does not fit"):
            b.load_state_tensors({k: torch.zeros(3) if k != "step" else v for k, v in saved.items()})


def test_a_stage_with_every_parameter_frozen_has_no_gradient_and_no_state() -> None:
    spec = build_stage_spec("0", [("w", (4, 4), 0, True), ("b", (4,), 0, True)])
    assert grad_layout(spec) == (0, (None, None))
    master = torch.randn(spec.numel)
    before = master.clone()
    opt = StageOptimizer(AdamW(), master, spec)
    opt.step(torch.empty(0))
    assert torch.equal(master, before) and opt.state_tensors() == {}
    assert state_nbytes(AdamW(), spec) == 0
    with pytest.raises(ValueError, match="bug in wstream"):
        opt.step(torch.empty(5))


def test_grad_layout_packs_trained_parameters_aligned_in_spec_order() -> None:
    spec = build_stage_spec("0", [("a", (3,), 0, True), ("b", (20,)), ("c", (5,), 0, True), ("d", (2, 2))])
    layout = grad_layout(spec)
    assert layout.offsets == (None, 0, None, 32)
    assert layout.numel == 32 + ALIGN_ELEMENTS
    assert grad_layout(spec) is layout  # kept for the same spec object
    from wstream.client.distributed import flat_spec
    from wstream.client.scatter import scatter_grads

    assert flat_spec(spec).numel == layout.numel  # what reduce="allreduce" pushes
    dst = torch.full((layout.numel,), float("nan"))
    scatter_grads(dst, spec, [None, torch.ones(20), None, torch.full((2, 2), 2.0)])
    assert torch.equal(dst, torch.cat([torch.ones(20), torch.zeros(12), torch.full((4,), 2.0), torch.zeros(12)]))


# ---- wire records ---------------------------------------------------------------------------------
def test_group_records_are_checked() -> None:
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr_scale"):
            GroupSpec(name="g", lr_scale=bad)
        with pytest.raises(ValueError, match="lr_scale"):
            ParamGroup("g", where=r".*", lr_scale=bad)
        with pytest.raises(ValueError, match="weight_decay"):
            GroupSpec(name="g", weight_decay=bad)
    with pytest.raises(ValueError, match="name"):
        GroupSpec(name="")
    with pytest.raises(ValueError, match="unique"):
        JobOptions(param_groups=[GroupSpec(name="g"), GroupSpec(name="g")])
    with pytest.raises(ValueError, match="regular expression"):
        ParamGroup("g", where="(")
    with pytest.raises(TypeError, match="where="):
        ParamGroup("g", where=3)  # type: ignore[arg-type]
    # an ordinary parameter still decodes from the three fields it had before
    import msgspec

    old = msgspec.msgpack.encode(["w", [4], 0])
    assert msgspec.msgpack.decode(old, type=m.ParamSpec) == m.ParamSpec("w", (4,), 0, 0, False)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["w", [4], 0, m.MAX_PARAM_GROUPS + 1]), type=m.ParamSpec)


# ---- end to end -----------------------------------------------------------------------------------
V, D, T, C = 11, 8, 4, 3


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens) + self.pos


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.proj = nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x)).mean(dim=1)


def model(seed: int = 0, *, frozen: bool = True) -> list[nn.Module]:
    """Embedding (its position table frozen), a block with a frozen bias, a block frozen whole, a
    block, a head. Norms get a non-trivial start so that their weight decay shows."""
    torch.manual_seed(seed)
    stages: list[nn.Module] = [Embed(), Block(), Block(), Block(), Head()]
    with torch.no_grad():
        for s in stages:
            for mod in s.modules():
                if isinstance(mod, nn.LayerNorm):
                    mod.weight.uniform_(0.5, 1.5)
                    mod.bias.uniform_(-0.5, 0.5)
    if frozen:
        stages[0].pos.requires_grad_(False)
        stages[1].fc.bias.requires_grad_(False)
        stages[2].requires_grad_(False)
    return stages


def groups() -> list[ParamGroup]:
    return [
        no_decay(),
        ParamGroup("slow", where=r"fc\.weight", lr_scale=0.5),
        ParamGroup("head", where=["proj.weight"], lr_scale=2.0, weight_decay=0.2),
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (6, T), generator=g), torch.randn(6, C, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def reference(stages: list[nn.Module], steps: int, micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """Plain PyTorch: AdamW with the groups written out by hand (the first rule that fits wins)."""
    ref = nn.Sequential(*stages)
    by: dict[str, list[nn.Parameter]] = {"default": [], "no_decay": [], "slow": [], "head": []}
    for s in stages:
        for name, p in s.named_parameters():
            if not p.requires_grad:
                continue
            owner = s.get_submodule(name.rpartition(".")[0])
            if p.ndim < 2 or isinstance(owner, nn.Embedding):
                by["no_decay"].append(p)
            elif name == "fc.weight":
                by["slow"].append(p)
            elif name == "proj.weight":
                by["head"].append(p)
            else:
                by["default"].append(p)
    opt = torch.optim.AdamW(
        [
            {"params": by["default"]},
            {"params": by["no_decay"], "weight_decay": 0.0},
            {"params": by["slow"], "lr": LR * 0.5},
            {"params": by["head"], "lr": LR * 2.0, "weight_decay": 0.2},
        ],
        lr=LR,
        weight_decay=WD,
    )
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        for xs, ys in zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches)):
            (loss_fn(ref(xs), ys) / micro_batches).backward()
        opt.step()
    return {f"{i}.{k}": v for i, s in enumerate(stages) for k, v in s.state_dict().items()}


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"largest difference {worst:.3g} exceeds {atol:.3g}"


def frozen_names(stages: list[nn.Module]) -> list[str]:
    return [f"{i}.{n}" for i, s in enumerate(stages) for n, p in s.named_parameters() if not p.requires_grad]


def job_bytes(client: Client, name: str) -> int:
    return next(j.bytes for j in client.status().jobs if j.name == name)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_groups_and_frozen_parameters_train_as_plain_pytorch(client: Client, micro_batches: int) -> None:
    stages = model()
    start = copy.deepcopy(stages)
    initial = {f"{i}.{k}": v.clone() for i, s in enumerate(stages) for k, v in s.state_dict().items()}
    job = client.create_job("groups", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", param_groups=groups())
    assert [g.name for g in job.options.param_groups] == ["no_decay", "slow", "head"]
    by_name = {f"{i}.{p.name}": p for i, s in enumerate(job.specs) for p in s.params}
    assert by_name["0.emb.weight"].group == 1 and by_name["0.pos"].frozen
    assert by_name["1.fc.weight"].group == 2 and by_name["1.fc.bias"].frozen and by_name["3.fc.bias"].group == 1
    assert all(p.frozen for p in job.specs[2].params) and grad_layout(job.specs[2]).numel == 0
    assert by_name["4.proj.weight"].group == 3 and by_name["4.norm.weight"].group == 1

    # the same model with nothing frozen costs 8 bytes more (AdamW's moments) per frozen element
    plain = client.create_job("plain", model(frozen=False), optimizer=AdamW(lr=LR, weight_decay=WD), token="t",
                              param_groups=groups())
    saved = sum(s.numel - grad_layout(s).numel for s in job.specs)
    assert saved > 0
    # each frozen element saves its AdamW moments (8 bytes) and its place in the step's gradient accumulator (4)
    assert job_bytes(client, "plain") - job_bytes(client, "groups") == (8 + 4) * saved
    plain.drop()

    with job.trainer() as trainer:
        for step in range(10):
            trainer.step(*batch(step), loss_fn, micro_batches=micro_batches)
    got = job.state_dict()
    want = reference(start, 10, micro_batches)
    assert_close(got, want)
    for k in frozen_names(start):
        assert torch.equal(got[k], initial[k]), k
    moved = [k for k in want if k not in frozen_names(start)]
    assert min((got[k] - initial[k]).abs().max().item() for k in moved) > 1e-4  # every trained one moved


@pytest.mark.parametrize("schedule", ["store_all", "revolve"])
def test_a_first_stage_frozen_whole_trains_as_plain_pytorch(client: Client, schedule: str) -> None:
    """Its backward has nothing to differentiate (no parameter, and its input is the data): it is
    fetched and run forward, and pushes nothing; the stages above train as in PyTorch."""
    stages = model()
    stages[0].requires_grad_(False)
    start = copy.deepcopy(stages)
    job = client.create_job(
        "first", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", param_groups=groups(),
        unit_bytes=None,  # counts one push per trained chain stage
    )
    options = {"slots": 1} if schedule == "revolve" else {}
    with job.trainer(schedule=schedule, **options) as trainer:
        for step in range(4):
            trainer.step(*batch(step), loss_fn)
        assert trainer.stats().pushes == 3 * 4  # stages 1, 3 and 4 train; 0 and 2 are frozen whole
    assert_close(job.state_dict(), reference(start, 4))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_frames_and_a_copying_worker_push_the_gradient_layout(
    client: Client, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shared memory without zero-copy, and data frames, each with the gradient written straight
    into its slot or (the GPU path's logic, on a CPU) through the staging buffers: the same
    weights as plain PyTorch."""
    if staged:
        monkeypatch.setattr(connection_module, "host_staging", lambda device: True)
    for mode, kw in (("copy", {"zero_copy": False}), ("frames", {"shm": False})):
        stages = model(seed=4)
        start = copy.deepcopy(stages)
        job = client.create_job(f"g-{mode}", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", param_groups=groups())
        with job.trainer(**kw) as trainer:
            for step in range(4):
                trainer.step(*batch(step), loss_fn)
        assert_close(job.state_dict(), reference(start, 4))


def test_attach_compares_frozen_flags_and_groups_only_when_given(client: Client) -> None:
    client.create_job("a", model(), optimizer=AdamW(), token="t", param_groups=groups())
    with torch.device("meta"):
        same = model()
    job = client.attach_job("a", token="t", stages=same)  # groups not given: they are not compared
    assert {p.name: p.group for p in job.specs[0].params} == {"pos": 0, "emb.weight": 1}
    with torch.device("meta"):
        job = client.attach_job("a", token="t", stages=model(), param_groups=groups())
    with torch.device("meta"), pytest.raises(LayoutError, match=r"stage 0: parameter 'pos' is trained in the given model, frozen \(requires_grad=False\) in the job"):
        client.attach_job("a", token="t", stages=model(frozen=False))
    with torch.device("meta"), pytest.raises(LayoutError, match="param_groups"):
        client.attach_job("a", token="t", stages=model(), param_groups=groups()[:2])
    with torch.device("meta"):
        again = client.create_job("a", model(), optimizer=AdamW(), token="t", param_groups=groups(), exist_ok=True)
    assert again.options.param_groups == job.options.param_groups
    with torch.device("meta"), pytest.raises(LayoutError):
        client.create_job("a", model(), optimizer=AdamW(), token="t", exist_ok=True)  # without its groups


# ---- bad input ------------------------------------------------------------------------------------
def test_a_group_that_gets_no_parameter_is_refused_and_no_job_is_left(client: Client) -> None:
    nothing = ParamGroup("nothing", where=lambda name, p, owner: isinstance(owner, nn.Conv2d))
    with pytest.raises(ValueError, match="'nothing' matches no trained parameter"):
        client.create_job("bad", model(), token="t", param_groups=[no_decay(), nothing])
    shadowed = ParamGroup("norms", where=r".*norm\..*")
    with pytest.raises(ValueError, match=r"'norms' gets no parameter: the \d+ it matches are taken by earlier groups"):
        client.create_job("bad", model(), token="t", param_groups=[no_decay(), shadowed])
    with pytest.raises(ValueError, match="unique"):
        client.create_job("bad", model(), token="t", param_groups=[no_decay(), no_decay()])
    with pytest.raises(ValueError, match="param_groups"):
        client.create_job("bad", model(), token="t", options=JobOptions(param_groups=[GroupSpec(name="x")]))
    assert [j.name for j in client.status().jobs] == []
    assert client.status().memory_used == 0


def test_the_server_refuses_bad_groups_on_the_wire(server: ServerThread) -> None:
    peer = RawPeer(server.address)
    try:
        nonce, mine = peer.nonce(), os.urandom(32)
        options = {"param_groups": [{"name": "g", "lr_scale": -1.0}]}
        reply, _ = peer.request("create_job", name="raw", token="t", options=options, nonce=nonce, client_nonce=mine)
        assert reply["op"] == "error" and reply["code"] == "bad_message" and "lr_scale" in reply["message"], reply

        nonce, mine = peer.nonce(), os.urandom(32)
        options = {"param_groups": [{"name": "g", "weight_decay": 0.0}]}
        reply, _ = peer.request("create_job", name="raw", token="t", options=options, nonce=nonce, client_nonce=mine)
        assert reply["op"] == "attached", reply
        session = RawSession(peer, reply["session"], session_key(secret_key("t"), nonce, mine))
        weights = torch.zeros(32).numpy().tobytes()
        spec = {"name": "0", "numel": 32, "params": [["w", [4], 0, 1, False], ["b", [4], 16, 2, False]]}
        reply, _ = session.request("add_stage", weights, index=0, spec=spec)
        assert reply["op"] == "error" and reply["code"] == "bad_layout", reply
        assert "stage 0 ('0'): parameter 'b' is in parameter group 2, but the job's are 1..1" in reply["message"]
        spec["params"] = [["w", [4], 0, 1, False], ["b", [4], 16, 0, True]]
        reply, _ = session.request("add_stage", weights, index=0, spec=spec)
        assert reply["op"] == "ok", reply
        reply, _ = session.request("drop_job")
        assert reply["op"] == "ok", reply
    finally:
        peer.close()


@pytest.mark.filterwarnings("ignore::wstream.client.scatter.UnusedParameterWarning")  # it pushes no gradient on purpose
def test_a_push_of_the_whole_stage_is_refused_when_some_parameters_are_frozen(client: Client) -> None:
    """The gradient of a stage with frozen parameters is smaller than the stage: the server says so."""
    import msgspec

    job = client.create_job("push", model(), optimizer=AdamW(), token="t", unit_bytes=None)  # pushes chain stage 0's layout
    with job.trainer() as trainer:
        pusher = trainer.connection.pusher
        spec = job.specs[0]
        whole = msgspec.structs.replace(spec, params=[msgspec.structs.replace(p, frozen=False) for p in spec.params])
        with pytest.raises(GradientError, match=rf"gradient of stage 0 step 0: [0-9]+ elements, its gradient has {grad_layout(spec).numel} \(its frozen parameters"):
            pusher.push(0, 0, whole, [None] * len(spec.params))
            pusher.drain()


# ---- snapshots ------------------------------------------------------------------------------------
def test_a_snapshot_keeps_the_groups_frozen_flags_and_optimizer_state(tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = start_server(tmp_path, "--store", str(store), name="a")
    stages = model(seed=7)
    start = copy.deepcopy(stages)
    with Client(srv.address, timeout=30) as c:
        job = c.create_job(
            "snap", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", param_groups=groups(),
            unit_bytes=None,  # reads each chain stage's optimizer state from the snapshot's server stage i
        )
        specs = job.specs
        with job.trainer() as trainer:
            for step in range(4):
                trainer.step(*batch(step), loss_fn)
    assert srv.stop() == 0  # SIGTERM: a snapshot of step 4
    path = store / "job-snap" / "step-000000000004"
    manifest = json.loads((path / "manifest.json").read_text())
    assert [g["name"] for g in manifest["job"]["options"]["param_groups"]] == ["no_decay", "slow", "head"]
    tensors = {k: t for f in manifest["files"] for k, t in load_file(path / f["name"]).items()}
    for i, spec in enumerate(specs):
        n = grad_layout(spec).numel
        if n == 0:
            assert not [k for k in tensors if k.startswith(f"{i}.opt.")]
        else:
            assert tensors[f"{i}.opt.exp_avg"].shape == (n,) and int(tensors[f"{i}.opt.step"]) == 4
        assert tensors[f"{i}.master"].shape == (spec.numel,)

    srv = start_server(tmp_path, "--store", str(store), name="b", address=srv.address)
    try:
        with Client(srv.address, timeout=30) as c:
            with torch.device("meta"):
                skeleton = model(seed=7)
            job = c.attach_job("snap", token="t", stages=skeleton, param_groups=groups())
            assert job.specs == specs and [g.name for g in job.options.param_groups] == ["no_decay", "slow", "head"]
            with job.trainer() as trainer:
                for step in range(4, 8):
                    trainer.step(*batch(step), loss_fn)
            assert_close(job.state_dict(), reference(start, 8))  # the moments came back too
    finally:
        assert srv.stop() == 0


def test_an_export_carries_the_groups_and_the_frozen_parameters(client: Client, tmp_path: Path) -> None:
    """The optimizer settings travel with the weights: the safetensors metadata names each group's
    settings and tensors, and the frozen tensors."""
    from safetensors import safe_open

    stages = models.mixed()
    stages[0][0].bias.requires_grad_(False)
    job = client.create_job("exported", stages, optimizer=AdamW(weight_decay=0.1), token="t",
                            param_groups=[no_decay(), ParamGroup("up", where=r"up\.weight", lr_scale=0.5)])
    job.export(tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        meta = f.metadata()
        names = set(f.keys())
    groups = {g["name"]: g for g in json.loads(meta["param_groups"])}
    assert groups["up"] == {"name": "up", "weight_decay": None, "lr_scale": 0.5, "params": ["1.up.weight", "3.up.weight"]}
    assert groups["no_decay"]["weight_decay"] == 0.0 and "1.norm.weight" in groups["no_decay"]["params"]
    assert json.loads(meta["frozen"]) == ["0.0.bias"]
    assert set(groups["no_decay"]["params"]) | set(groups["up"]["params"]) | {"0.0.bias"} <= names
    assert meta["job"] == "exported"


class _Gated(nn.Module):
    """A data-dependent branch (as MoE routing): ``extra`` runs only while ``use`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)
        self.extra = nn.Linear(12, 12)
        self.use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.extra(x) if self.use else self.lin(x)


def test_a_parameter_without_a_gradient_is_updated_as_with_a_zero_one_and_said_so(client: Client) -> None:
    """A trained parameter that gets no gradient in a step is updated as with a zero gradient (as
    DistributedDataParallel with find_unused_parameters=True does; torch.optim on one process skips
    it), and the worker says so once, naming it (defect seen: the departure from plain PyTorch was
    silent and written nowhere)."""
    from wstream.client.scatter import UnusedParameterWarning

    torch.manual_seed(0)
    stages: list[nn.Module] = [_Gated(), nn.Linear(12, 5)]
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    job = client.create_job("gated", stages, optimizer=AdamW(lr=1e-2, weight_decay=0.1), token="t")
    with pytest.warns(UnusedParameterWarning, match=r"extra\.(weight|bias)' got no gradient") as said, job.trainer() as trainer:
        for step in range(4):
            stages[0].use = ref[0].use = step == 0
            x, y = models.batch("mixed", step)
            trainer.step(x, y, models.loss_fn)
            opt.zero_grad()
            models.loss_fn(ref(x), y).backward()
            for p in ref.parameters():  # zero, not None: the update wstream documents
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
    for name in ("extra.weight'", "extra.bias'"):
        assert len([w for w in said if name in str(w.message)]) == 1, name  # once, not every step
    assert_weights_equal(job.state_dict(), {f"{i}.{k}": v for i, m in enumerate(ref) for k, v in m.state_dict().items()}, atol=2e-6)
