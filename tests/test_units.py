"""Transfer units: consecutive small stages stored, streamed and updated as one server stage
(NOTE [Transfer units] in client/units.py), trained to the very weights of one stage per unit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import models
from conftest import ADMIN_SECRET
from test_equivalence import assert_weights_equal, reference_train
from test_ties import TiedHead, batch as tied_batch, chain as tied_chain, loss_fn as tied_loss, reference as tied_reference
from wstream.client import AdamW, Client, LayoutError, MemoryLimitError, Tied
from wstream.client import connection as connection_module
from wstream.client.stages import spec_of
from wstream.client.units import UnitCutter, Units, split_unit, unit_spec
from wstream.server.inprocess import InProcessServer

STEPS = 5
LR, WD = 3e-3, 0.05


def adamw(p):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(p, lr=LR, weight_decay=WD)


def test_a_unit_layout_is_its_stages_back_to_back_and_splits_back() -> None:
    specs = [spec_of(i, m) for i, m in enumerate(models.mixed())]
    unit = unit_spec(2, specs[2:5])
    assert unit.numel == sum(s.numel for s in specs[2:5])
    assert [p.name for p in unit.params][:3] == ["2.0.weight", "2.0.bias", "2.1.weight"]
    assert split_unit(2, 3, unit) == [spec_of(i, m) for i, m in list(enumerate(models.mixed()))[2:5]]
    units = Units((2, 3))
    assert units.unit_of == (0, 0, 1, 1, 1) and units.first_of == (0, 2)
    assert units.chain_specs(units.unit_specs(specs)) == specs
    with pytest.raises(LayoutError, match="not named"):
        split_unit(0, 2, unit)


def test_units_are_cut_greedily_and_big_or_buffered_stages_stand_alone() -> None:
    modules = [
        nn.Linear(4, 4),  # 20 params (32 with alignment) = 128 B
        nn.Linear(4, 4),
        nn.Linear(4, 4),
        nn.Linear(32, 32),  # over 256 B: alone
        nn.Linear(4, 4),
        nn.BatchNorm1d(4),  # buffers: alone
        nn.Linear(4, 4),
    ]
    cutter = UnitCutter(256, 4)
    closed = []
    for i, mod in enumerate(modules):
        spec = spec_of(i, mod)
        closed += cutter.add(spec, None, has_buffers=any(p.buffer for p in spec.params))
    closed += cutter.finish()
    assert cutter.counts == [2, 1, 1, 1, 1, 1]
    assert [first for first, _, _ in closed] == [0, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("schedule", "mode"),
    [("store_all", "zero-copy"), ("store_all", "shm-copy"), ("store_all", "frames"), ("revolve", "zero-copy"), ("dnc", "shm-copy")],
)
def test_a_job_of_units_trains_to_the_weights_of_plain_pytorch(client: Client, schedule: str, mode: str) -> None:
    stages = models.mixed()
    start = copy.deepcopy(stages)
    job = client.create_job("units", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", unit_bytes=32 * 1024)
    assert job.units is not None and sum(job.units.counts) == 5 and len(job.units.counts) < 5
    assert max(job.units.counts) > 1  # some unit really holds several stages
    assert job.num_stages == 5 and len(job.unit_specs) == len(job.units.counts)
    status = {j.name: j for j in client.status().jobs}["units"]
    assert (status.stages, status.units) == (5, len(job.units.counts))  # the chain's stages, the server's units
    transport = {"shm": mode != "frames", "zero_copy": mode == "zero-copy" if mode != "frames" else None}
    options = {"slots": 1} if schedule == "revolve" else {}
    with job.trainer(schedule=schedule, prefetch=1, **transport, **options) as trainer:
        losses = [trainer.step(*models.batch("mixed", s), models.loss_fn) for s in range(STEPS)]
        stats = trainer.stats()
        fetch_order = trainer.planning.fetch_order
    want_losses: list[float] = []
    want = reference_train(start, adamw, "mixed", STEPS, losses=want_losses)
    got = job.state_dict()
    assert got.keys() == want.keys()  # the same names as a job without units
    assert_weights_equal(got, want, atol=1e-6)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    # one push per unit and step; one fetch per run of positions on one unit
    assert stats.pushes == len(job.units.counts) * STEPS
    assert stats.fetches == len(fetch_order) * STEPS
    assert all(a != b for a, b in zip(fetch_order, fetch_order[1:]))
    if schedule == "store_all":
        assert len(fetch_order) == 2 * len(job.units.counts) - 1
    # the chain-stage view: each stage's own tensors, as a job without units gives them
    own = job.pull_stage(3)
    assert own.keys() == {k.removeprefix("3.") for k in want if k.startswith("3.")}
    for name, t in own.items():
        torch.testing.assert_close(t, want[f"3.{name}"], rtol=0, atol=1e-6)


def test_an_admin_export_of_a_job_of_units_names_its_chain_stages(tmp_path: Path, admin_server: InProcessServer) -> None:
    with Client(admin_server.address, admin_secret=ADMIN_SECRET, timeout=30) as admin:
        job = admin.create_job("u", models.mixed(), optimizer=AdamW(), token="t", unit_bytes=32 * 1024)
        assert job.units is not None and len(job.units.counts) < job.num_stages
        job.export(tmp_path / "by-token.safetensors")
        admin.export_job("u", tmp_path / "by-admin.safetensors")
    want = nn.Sequential(*models.mixed()).state_dict()
    with safe_open(tmp_path / "by-admin.safetensors", "pt") as by_admin, safe_open(tmp_path / "by-token.safetensors", "pt") as by_token:
        assert by_admin.metadata() == by_token.metadata()
        assert set(by_admin.keys()) == set(want)  # "<stage>.<param>", not the unit's prefix twice
        for k in want:
            assert torch.equal(by_admin.get_tensor(k), want[k])


@pytest.mark.parametrize("mode", ["shm-copy", "frames"])
def test_a_job_of_units_trains_through_the_staging_buffers(client: Client, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's logic on a CPU (test_device): frames land in the receive ring and gradients
    go through the staging buffers, here a unit's at a time."""
    monkeypatch.setattr(connection_module, "host_staging", lambda device: True)
    stages = models.mixed(seed=4)
    start = copy.deepcopy(stages)
    job = client.create_job("staged", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t")  # "auto"
    assert job.units is not None and job.units.counts == (5,)
    with job.trainer(shm=mode != "frames", zero_copy=False, prefetch=1) as trainer:
        assert (trainer.connection.receive is not None) == (mode == "frames")
        assert trainer.stats().grad_staging_bytes == 2 * job.unit_specs[0].numel * 4  # two of the unit
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
    assert_weights_equal(job.state_dict(), reference_train(start, adamw, "mixed", STEPS), atol=1e-6)


@pytest.mark.parametrize(
    "case",
    [
        {"schedule": "optimal", "memory_budget": 12 * 4 * 8 * 4},
        {"schedule": "min_peak"},
        {"schedule": "offload", "memory_budget": 8 * 4 * 8 * 4},
        {"schedule": "sqrt"},
    ],
    ids=lambda case: case["schedule"],
)
def test_plans_over_units_train_bit_identically_to_store_all_without_units(client: Client, case: dict) -> None:
    """test_schedules' plans (their profiles too) on 16 stages of 8 wide with dropout, in units of 4."""
    from test_schedules import chain

    torch.manual_seed(7)
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)]
    results = {}
    for name, unit_bytes, options in (("plain", None, {}), ("units", 1000, case)):
        job = client.create_job(name, chain(16, dropout=True), optimizer=AdamW(lr=1e-2), token="t", unit_bytes=unit_bytes)
        torch.manual_seed(123)  # the same dropout masks
        with job.trainer(**options) as trainer:
            losses = [trainer.step(x, y, nn.functional.mse_loss) for x, y in data]
            stats, fetch_order = trainer.stats(), trainer.planning.fetch_order
        results[name] = job.state_dict(), losses
    assert job.units is not None and job.units.counts == (4, 4, 4, 4)
    profiling = 0 if case["schedule"] == "sqrt" else 4  # a profiling pass fetches each unit once
    assert stats.fetches == 2 * len(fetch_order) + profiling and stats.pushes == 2 * 4
    (want, want_losses), (got, losses) = results["plain"], results["units"]
    assert losses == want_losses
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_deep_chain_of_units_fetches_each_unit_once_per_pass(client: Client) -> None:
    stages = models.deep(40, 16)
    start = copy.deepcopy(stages)
    job = client.create_job("deep", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", unit_bytes=4096)
    assert job.units is not None
    units = len(job.units.counts)
    assert units == 10  # 272 fp32 elements (1,088 B) per stage: four stages make a unit
    with job.trainer(schedule="store_all") as trainer:
        for s in range(STEPS):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(s))
            trainer.step(x, torch.zeros(16, 16), models.loss_fn)
        stats = trainer.stats()
    assert stats.fetches == (2 * units - 1) * STEPS and stats.pushes == units * STEPS
    ref = nn.Sequential(*start)
    opt = adamw(ref.parameters())
    for s in range(STEPS):
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        models.loss_fn(ref(x), torch.zeros(16, 16)).backward()
        opt.step()
    assert_weights_equal(job.state_dict(), ref.state_dict(), atol=1e-6)


def test_a_worker_that_attaches_rebuilds_the_units_from_its_own_stages(client: Client) -> None:
    stages = models.mixed()
    start = copy.deepcopy(stages)
    job = client.create_job("att", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", unit_bytes=32 * 1024)
    with torch.device("meta"):
        skeleton = models.mixed()
    other = client.attach_job("att", token="t", stages=skeleton)
    assert other.units == job.units and other.specs == job.specs
    with other.trainer() as trainer:
        for s in range(STEPS):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
    assert_weights_equal(job.state_dict(), reference_train(start, adamw, "mixed", STEPS), atol=1e-6)
    with torch.device("meta"):
        fewer = models.mixed()[:4]
    with pytest.raises(LayoutError, match="the job has 5 stages, the given model has 4"):  # as without units
        client.attach_job("att", token="t", stages=fewer)
    with torch.device("meta"):
        changed = models.mixed()
        changed[3] = nn.Sequential(nn.Linear(48, 24))
    with pytest.raises(LayoutError, match="do not match job 'att': stage 3"):  # the chain's stage, not its unit
        client.attach_job("att", token="t", stages=changed)
    # create_job(exist_ok=True) attaches to the job of units, whatever unit_bytes it is given
    again = client.create_job("att", models.mixed(), optimizer=AdamW(lr=LR, weight_decay=WD), token="t", exist_ok=True)
    assert again.units == job.units


def three(width: int) -> list[nn.Module]:
    """Three small stages (one unit with "auto") whose middle one is ``width`` wide."""
    return [nn.Linear(4, 4), nn.Linear(4, width), nn.Linear(width, 2)]


@pytest.mark.parametrize("unit_bytes", [None, "auto"])
def test_a_layout_mismatch_names_the_chain_stage_with_or_without_units(client: Client, unit_bytes: str | None) -> None:
    created = client.create_job("shaped", three(4), token="t", unit_bytes=unit_bytes)
    assert created.units == (None if unit_bytes is None else Units((3,)))
    with torch.device("meta"):
        handle = client.attach_job("shaped", token="t", stages=three(4))
        with pytest.raises(LayoutError, match=r"do not match job 'shaped': the job has 3 stages, the given model has 2$"):
            client.attach_job("shaped", token="t", stages=three(4)[:2])
        with pytest.raises(LayoutError, match=r"'shaped': stage 1: parameter 'weight' has shape \[6, 4\], the job has \[4, 4\]$"):
            client.attach_job("shaped", token="t", stages=three(6))
    created.drop()  # made again with stage 1 wider: the handle's trainer is refused naming stage 1, not its unit
    client.create_job("shaped", three(6), token="t", unit_bytes=unit_bytes)
    with pytest.raises(LayoutError, match=r"created again\?\): stage 1: parameter 'weight' has shape \[4, 4\], the job has \[6, 4\];"):
        handle.trainer()


def test_a_trainer_is_refused_by_a_job_made_again_with_its_stages_cut_otherwise(client: Client) -> None:
    created = client.create_job("cut", three(4), token="t")  # "auto": one unit of the 3 stages
    with torch.device("meta"):
        handle = client.attach_job("cut", token="t", stages=three(4))
    created.drop()
    client.create_job("cut", three(4), token="t", unit_bytes=None)
    with pytest.raises(LayoutError, match=r"holds its stages as one server stage per stage, the trainer was made for transfer units of \[3\] stages"):
        handle.trainer()  # its runners view one unit; the job streams three stages
    with torch.device("meta"):
        right = client.attach_job("cut", token="t", stages=three(4))
    with right.trainer() as trainer:
        trainer.step(torch.randn(3, 4), torch.randn(3, 2), nn.functional.mse_loss)


def test_a_tied_head_on_a_unit_trains_as_one_shared_parameter(client: Client) -> None:
    embed, blocks = tied_chain()
    want, want_losses = tied_reference(copy.deepcopy(embed), copy.deepcopy(blocks), 4)
    job = client.create_job(
        "tied", [embed, *blocks, Tied(0, TiedHead().to("meta"))], optimizer=AdamW(lr=1e-2, weight_decay=0.01),
        token="t", unit_bytes=2**20,
    )
    assert job.units is not None and job.units.counts == (4,)  # one unit holds every stage
    assert job.positions == [0, 1, 2, 3, 0]
    with job.trainer(schedule="store_all") as trainer:
        losses = [trainer.step(*tied_batch(s), tied_loss) for s in range(4)]
        stats = trainer.stats()
    assert stats.fetches == 4 and stats.pushes == 4  # the whole chain on one resident fetch
    got = job.state_dict()
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
    assert losses == pytest.approx(want_losses, rel=1e-5)


def test_units_with_batchnorm_stages_keep_their_running_statistics(client: Client) -> None:
    stages = models.batchnorm()
    start = copy.deepcopy(stages)
    job = client.create_job("bn", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", unit_bytes=2**20)
    assert job.units is not None and job.units.counts == (1, 1, 1)  # stages with buffers stand alone
    with job.trainer() as trainer:
        for s in range(STEPS):
            trainer.step(*models.batch("batchnorm", s), models.loss_fn)
    want = reference_train(start, adamw, "batchnorm", STEPS)
    got = job.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].to(want[k].dtype), want[k], rtol=0, atol=1e-5)


def test_unit_bytes_is_refused_on_a_base(client: Client) -> None:
    client.create_job("base", models.mixed(), token="b", frozen=True)
    with pytest.raises(ValueError, match="unit_bytes cannot be used with base"):
        client.create_job("on", models.mixed(), token="t", base="base", base_token="b", unit_bytes=4096)


def test_a_job_of_units_resumes_after_a_server_kill_with_its_cut(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import signal

    from conftest import start_server

    args = ("--memory-limit", "1GiB", "--store", str(tmp_path / "store"), "--snapshot-every", "1")
    srv = start_server(tmp_path, *args, name="srv0")
    address = srv.address
    stages = models.mixed()
    start = copy.deepcopy(stages)
    with Client(address, timeout=30) as c:
        job = c.create_job("kept", stages, optimizer=AdamW(lr=LR, weight_decay=WD), token="t", unit_bytes=32 * 1024)
        cut = job.units
        with job.trainer() as trainer:
            for s in range(2):
                trainer.step(*models.batch("mixed", s), models.loss_fn)
        c.save_job("kept", token="t")
    srv.stop(signal.SIGKILL)
    srv = start_server(tmp_path, *args, name="srv1", address=address)
    try:
        with Client(address, timeout=30) as c:
            with torch.device("meta"):
                skeleton = models.mixed()
            job = c.attach_job("kept", token="t", stages=skeleton)
            assert job.units == cut and cut is not None and max(cut.counts) > 1
            with job.trainer() as trainer:
                assert trainer.step_index == 2
                for s in range(2, STEPS):
                    trainer.step(*models.batch("mixed", s), models.loss_fn)
            assert_weights_equal(job.state_dict(), reference_train(start, adamw, "mixed", STEPS), atol=1e-6)
    finally:
        assert srv.stop() == 0


def test_a_unit_over_the_memory_limit_is_refused_naming_its_chain_stages(tmp_path: Path) -> None:
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 'small.sock'}"], memory_limit=3 << 20)
    try:
        with Client(srv.address, timeout=30) as c:
            # a generator gives no size up front; four Linear(256, 256) of 257 KiB make the first
            # 1 MiB unit, whose 16 bytes/parameter do not fit: the server names its stage 0, the
            # client says which stages that is
            with pytest.raises(MemoryLimitError, match=r"stage 0 needs .* free \(the server's stage 0 is the transfer unit of chain stages 0\.\.3\)$"):
                c.create_job("growing", (nn.Linear(256, 256) for _ in range(10)), token="x")
            assert c.status().jobs == [] and c.status().memory_used == 0
    finally:
        srv.stop()


def test_a_unit_whose_gradient_no_scale_makes_finite_sends_nothing_and_the_trainer_goes_on(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_loss_scale's premise is a stage per server stage: the last stage's gradient was sent,
    so the trainer must close. In one unit nothing is pushed before the backward of position 0:
    the step is refused whole, and taken again once the model's gradient is finite."""
    from test_loss_scale import InfiniteSlope, _loss

    stages = [nn.Linear(12, 8), InfiniteSlope(), nn.Linear(8, 5)]
    job = client.create_job("sqrt", stages, optimizer=AdamW(lr=LR), token="t", dtype="float16")
    assert job.units is not None and job.units.counts == (3,)
    with job.trainer() as trainer:
        with pytest.raises(FloatingPointError, match="position 1, micro-batch 0: the gradient is not finite even at"):
            trainer.step(*models.batch("mixed", 0), _loss)
        assert trainer.stats().pushes == 0 and trainer.step_index == 0
        monkeypatch.setattr(InfiniteSlope, "forward", lambda self, x: self.lin(x))
        trainer.step(*models.batch("mixed", 0), _loss)
        assert trainer.stats().pushes == 1 and trainer.step_index == 1


def server_job_of_units(units: list[int]):  # noqa: ANN201 - a sealed wstream.server.job.Job
    """A server-side job of ``len(units)`` one-parameter stages, sealed as units holding ``units``
    chain stages each (what a client's ``seal`` sends)."""
    import zmq

    from wstream.protocol import AdamW as AdamWSpec
    from wstream.protocol import messages as m
    from wstream.protocol.layout import build_stage_spec
    from wstream.server.job import Job
    from wstream.server.memory import MemoryAccount

    created = m.CreateJob(name="u", token="t", nonce=b"n" * 32, client_nonce=b"c" * 16, options=m.JobOptions(optimizer=AdamWSpec()))
    job = Job.create(created, MemoryAccount(2**30))
    for i in range(len(units)):
        spec = build_stage_spec(str(i), [("w", (10,))])
        job.add_stage(m.AddStage(session=b"s" * 16, index=i, spec=spec), [zmq.Frame(torch.zeros(spec.numel).numpy().tobytes())])
    job.seal(units=units)
    return job


def test_the_servers_errors_and_spans_name_a_units_chain_stages() -> None:
    from wstream.protocol import GradientError, StaleStepError
    from wstream.protocol import messages as m

    job = server_job_of_units([3, 2])  # unit 0 holds chain stages 0-2, unit 1 holds 3-4
    try:
        w = job.join(b"w" * 16, m.Join(session=b"w" * 16, shm=True, grad_slots=2))
        with pytest.raises(GradientError, match=r"gradient of unit 1 \(chain stages 3-4\) step 0: 7 elements, its gradient has 16"):
            job.push(m.Push(session=w.session, stage=1, step=0, slot=0, numel=7), [], b"id", w, lambda task: None)
        with pytest.raises(StaleStepError, match=r"unit 0 \(chain stages 0-2\) is at step 0; step 5 is more than one step ahead"):
            job.fetch(m.Fetch(session=w.session, stage=0, step=5), b"id", w)
        job.open_barrier(lambda task: None)  # a lone worker's push with its norm: held, a span of the timeline
        job.push(m.Push(session=w.session, stage=1, step=0, slot=0, numel=16, sumsq=1.0), [], b"id", w, lambda task: None)
        assert [e.name for e in job.timeline.events] == ["held 1 (3-4)"]
    finally:
        job.close()


def test_per_stage_metrics_of_a_unit_name_its_chain_stages() -> None:
    import time

    from wstream.server.metrics import _collect_job, _Families

    job = server_job_of_units([3, 1])
    try:
        out = _Families()
        _collect_job(out, job, time.monotonic(), stage_limit=10)
        family = {f.name: f for f in out}["wstream_stage_optimizer_last_seconds"]
        assert [(s.labels["stage"], s.labels["chain_stages"]) for s in family.samples] == [("0", "0-2"), ("1", "3")]
    finally:
        job.close()


def test_unit_bytes_takes_a_size_string_and_names_itself_when_it_cannot(client: Client) -> None:
    """``unit_bytes="64KiB"`` reads as ``memory_budget`` reads a size (defect seen: a bare
    ``TypeError: '<' not supported between instances of 'str' and 'int'``); a string that is no
    size is refused naming ``unit_bytes`` and the forms it takes."""
    stages = [nn.Linear(16, 16) for _ in range(8)]
    job = client.create_job("units-str", stages, optimizer=AdamW(lr=1e-3), token="t", unit_bytes="2KiB")
    assert job.unit_specs is not None and 1 < len(job.unit_specs) < 8
    with pytest.raises(ValueError, match=r"unit_bytes: cannot read 'lots' as a size.*'auto', or None"):
        client.create_job("units-bad", [nn.Linear(4, 4)], optimizer=AdamW(lr=1e-3), token="t", unit_bytes="lots")


def test_an_admin_export_records_the_jobs_parameter_groups(tmp_path: Path, admin_server: InProcessServer) -> None:
    """Found by review: an export made with the admin secret wrote ``param_groups: []`` for a job
    with groups (its ``layout`` reply did not carry them); one made with the token listed them."""
    from wstream.client.groups import no_decay

    with Client(admin_server.address, admin_secret=ADMIN_SECRET, timeout=30) as admin:
        job = admin.create_job("g", models.mixed(), optimizer=AdamW(weight_decay=0.1), token="t", param_groups=[no_decay()])
        job.export(tmp_path / "by-token.safetensors")
        admin.export_job("g", tmp_path / "by-admin.safetensors")
    with safe_open(tmp_path / "by-admin.safetensors", "pt") as by_admin, safe_open(tmp_path / "by-token.safetensors", "pt") as by_token:
        assert by_admin.metadata() == by_token.metadata()
        assert "no_decay" in by_admin.metadata()["param_groups"]
