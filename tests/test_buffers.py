"""Buffers (BatchNorm's running statistics) streamed with their stage: updated once per real
forward, never by a recomputation, sent back with the step, averaged over workers, kept in
snapshots and exports, and used in eval mode (issue 19)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import start_server
from wstream.client import AdamW, Client, LayoutError, Tied
from wstream.client import connection as connection_module
from wstream.client.models import resnet18_stages
from wstream.protocol import messages as m
from wstream.protocol.layout import push_layout

LR = 1e-3


def state_of(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """``job.state_dict()``'s keys for plain modules: ``<stage>.<name>``, parameters and buffers."""
    return {f"{i}.{k}": v for i, s in enumerate(stages) for k, v in s.state_dict().items()}


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The largest difference of the parameters and of the buffers (running statistics, counts)."""
    assert got.keys() == want.keys()
    weights, buffers = 0.0, 0.0
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        d = (got[k].double() - w.double()).abs().max().item()
        if "running" in k or "num_batches" in k or "calls" in k:
            buffers = max(buffers, d)
        else:
            weights = max(weights, d)
    return weights, buffers


def images(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def plain_training(stages: list[nn.Module], steps: int, micro_batches: int = 1) -> nn.Sequential:
    """Plain PyTorch, no checkpointing: AdamW, each micro-batch's forward updating the running
    statistics as gradient accumulation does. Fused, as the server runs it: a ResNet on a batch of
    four random images is chaotic (a relative change of 1e-7 in the weights grows to 2e-2 in three
    AdamW steps), so only the same arithmetic can be compared to 1e-5."""
    model = nn.Sequential(*stages).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    for t in range(steps):
        opt.zero_grad()
        x, y = images(t)
        for xs, ys in zip(torch.tensor_split(x, micro_batches), torch.tensor_split(y, micro_batches)):
            (nn.functional.cross_entropy(model(xs), ys) / micro_batches).backward()
        opt.step()
    return model


@pytest.mark.parametrize(
    ("schedule", "micro_batches"), [("store_all", 1), ("revolve", 1), ("store_all", 2)], ids=["store_all", "revolve", "micro-batches"]
)
def test_resnet18_trains_to_the_weights_and_running_statistics_of_plain_pytorch(
    client: Client, schedule: str, micro_batches: int
) -> None:
    """ResNet-18 in six stages (stem, four residual layers, head) on 32x32 images: the same weights
    and running statistics as plain PyTorch within 1e-5, whatever the plan recomputes; eval mode
    then normalizes with the job's running statistics."""
    torch.manual_seed(0)
    stages = resnet18_stages(10)
    want = plain_training(copy.deepcopy(stages), 3, micro_batches)
    job = client.create_job("resnet", stages, optimizer=AdamW(lr=LR), token="t")
    assert job.num_stages == 6
    options = {"slots": 1} if schedule == "revolve" else {}
    with job.trainer(schedule=schedule, **options) as trainer:
        for t in range(3):
            trainer.step(*images(t), nn.functional.cross_entropy, micro_batches=micro_batches)
        if schedule == "revolve":
            assert trainer.plan_summary()["recomputed_forwards"] > 5  # more than one forward of each stage
        x = images(99)[0]
        got_eval = trainer.forward(x)  # eval mode: the running statistics
    got = job.state_dict()
    weights, buffers = differences(got, state_of(list(want)))
    print(f"ResNet-18 {schedule} x{micro_batches}: weights differ by at most {weights:.3g}, buffers by {buffers:.3g}")
    assert weights < 1e-5 and buffers < 1e-5
    assert got["1.layer1.0.bn1.num_batches_tracked"].item() == 3 * micro_batches  # once per real forward
    with torch.no_grad():
        torch.testing.assert_close(got_eval, want.eval()(x), rtol=0, atol=1e-4)


class Counted(nn.Module):
    """A stage whose output depends on a buffer it updates at each forward in train mode: a
    recomputation that updated it, or saw it updated, would change both the count and the output."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("offset", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(x) + self.offset)
        if self.training:
            self.calls.add_(1)
            self.offset.mul_(0.5).add_(out.detach().mean(0), alpha=0.5)
        return out


def counted_chain(n: int = 5) -> list[nn.Module]:
    torch.manual_seed(3)
    return [Counted() for _ in range(n)]


def vectors(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


@pytest.mark.parametrize("schedule", ["store_all", "revolve", "sqrt"])
@pytest.mark.parametrize("mode", ["zero-copy", "copy", "frames", "staged"])
def test_buffers_change_once_per_real_forward_and_reruns_see_what_it_saw(
    client: Client, schedule: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``staged``: the GPU path's logic on a CPU (pushes through the staging buffers)."""
    if mode == "staged":
        monkeypatch.setattr(connection_module, "host_staging", lambda device: True)
    stages = counted_chain()
    reference = nn.Sequential(*copy.deepcopy(stages)).train()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    job = client.create_job("counted", stages, optimizer=AdamW(lr=1e-2), token="t")
    transport = {"zero-copy": {"zero_copy": True}, "copy": {"zero_copy": False}, "frames": {"shm": False},
                 "staged": {"zero_copy": False}}[mode]
    options = {"slots": 1} if schedule == "revolve" else {}
    with job.trainer(schedule=schedule, **transport, **options) as trainer:
        for t in range(4):
            trainer.step(*vectors(t), nn.functional.mse_loss, micro_batches=2)
            opt.zero_grad()
            x, y = vectors(t)
            for xs, ys in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)):
                (nn.functional.mse_loss(reference(xs), ys) / 2).backward()
            opt.step()
    got = job.state_dict()
    assert all(got[f"{i}.calls"].item() == 8 for i in range(5))  # 4 steps x 2 micro-batches
    weights, buffers = differences(got, state_of(list(reference)))
    assert weights < 1e-6 and buffers < 1e-6


def small_bn(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(6, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU()),
        nn.Linear(16, 3),
    ]


def rows(step: int, worker: int = 0, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(n, 6, generator=g) * (1 + worker), torch.randn(n, 3, generator=g)


def mean_statistics_reference(
    stages: list[nn.Module], batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], steps: int, workers: int, lr: float
) -> nn.Sequential:
    """Plain PyTorch data parallelism as a wstream job does it: the mean gradient over the
    workers' batches (``batch(step, worker)``), and every buffer the mean of what each worker's
    forward, started from the job's statistics, left (a count: its common increment)."""
    model = nn.Sequential(*stages).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    norms = [mod for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    for t in range(steps):
        opt.zero_grad()
        start = [copy.deepcopy(b.state_dict()) for b in norms]
        ends = []
        for w in range(workers):
            for b, s in zip(norms, start):
                b.load_state_dict(s)
            x, y = batch(t, w)
            (nn.functional.mse_loss(model(x), y) / workers).backward()
            ends.append([copy.deepcopy(b.state_dict()) for b in norms])
        for k, b in enumerate(norms):
            b.load_state_dict({name: sum(e[k][name] for e in ends) / workers if name != "num_batches_tracked"
                               else ends[0][k][name] for name in ends[0][k]})
        opt.step()
    return model


def test_two_workers_keep_the_mean_of_their_running_statistics(client: Client) -> None:
    """Data parallel over two workers: the gradient is the mean of theirs, and each buffer the
    mean of what each worker's forward left (the rule for any number of workers)."""
    stages = small_bn()
    model = mean_statistics_reference(copy.deepcopy(stages), rows, 4, 2, 1e-2)
    job = client.create_job("dp", stages, optimizer=AdamW(lr=1e-2), token="t")
    with torch.device("meta"):  # a skeleton of its own for the second worker (threads must not share modules)
        other = client.attach_job("dp", token="t", stages=small_bn())
    errors: list[BaseException] = []

    def train(w: int) -> None:
        try:
            with (job, other)[w].trainer(world_size=2) as trainer:
                for t in range(4):
                    trainer.step(*rows(t, w), nn.functional.mse_loss)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(w,)) for w in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    got = job.state_dict()
    weights, buffers = differences(got, state_of(list(model)))
    assert weights < 1e-5 and buffers < 1e-6
    assert got["0.1.num_batches_tracked"].item() == 4


def test_a_bfloat16_job_keeps_its_counts_exact(client: Client) -> None:
    """bfloat16 holds 1001 as 1000: a count pushed as a value would stop growing there, so a count
    travels as its increment and the fp32 master adds it."""
    stages = small_bn()
    for s in stages[:2]:
        s[1].num_batches_tracked.fill_(1001)
    job = client.create_job("bf16", stages, optimizer=AdamW(lr=1e-2), token="t", dtype="bfloat16")
    with job.trainer() as trainer:
        for t in range(3):
            trainer.step(*rows(t), lambda out, y: nn.functional.mse_loss(out.float(), y))
    got = job.state_dict()
    assert got["0.1.num_batches_tracked"].item() == got["1.1.num_batches_tracked"].item() == 1004
    assert got["0.1.running_var"].dtype == torch.float32


def test_buffers_survive_a_restart_and_go_into_exports(tmp_path: Path) -> None:
    store = tmp_path / "store"
    srv = start_server(tmp_path, "--store", str(store), name="a")
    stages = small_bn(1)
    model = nn.Sequential(*copy.deepcopy(stages)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for t in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(rows(t)[0]), rows(t)[1]).backward()
        opt.step()
    try:
        with Client(srv.address, timeout=30) as client:
            job = client.create_job("bn", stages, optimizer=AdamW(lr=1e-2), token="t")
            with job.trainer() as trainer:
                for t in range(2):
                    trainer.step(*rows(t), nn.functional.mse_loss)
            assert job.save()[0] == 2
    finally:
        srv.stop()
    srv = start_server(tmp_path, "--store", str(store), name="b", address=srv.address)
    try:
        with Client(srv.address, timeout=30) as client:
            with torch.device("meta"):
                skeleton = small_bn()
            job = client.attach_job("bn", token="t", stages=skeleton)
            with job.trainer() as trainer:
                assert trainer.step_index == 2
                for t in range(2, 4):
                    trainer.step(*rows(t), nn.functional.mse_loss)
            weights, buffers = differences(job.state_dict(), state_of(list(model)))
            assert weights < 1e-5 and buffers < 1e-6
            job.export(tmp_path / "bn.safetensors")
    finally:
        assert srv.stop() == 0, srv.log()
    exported = load_file(tmp_path / "bn.safetensors")
    assert exported["0.1.num_batches_tracked"].dtype == torch.int64
    plain = nn.Sequential(*small_bn(7))
    plain.load_state_dict(exported)  # "<stage>.<name>": the keys of the stages in an nn.Sequential
    x = rows(50)[0]
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), model.eval()(x), rtol=0, atol=1e-5)


def test_buffers_that_cannot_be_streamed_are_refused(client: Client) -> None:
    class Masked(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("mask", torch.ones(4), persistent=False)

    with pytest.raises(LayoutError, match="non-persistent buffer 'mask'"):
        client.create_job("np", [Masked()], token="t")

    class Wide(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.register_buffer("count", torch.tensor(2**24 + 1))

    with pytest.raises(LayoutError, match="exact up to 16777216"):
        client.create_job("wide", [Wide()], token="t")

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

    with pytest.raises(LayoutError, match=r"position 1 \(tied to stage 0\) has buffers \['bn.running_mean'"):
        client.create_job("tied", [Norm(), Tied(0, Norm().to("meta"))], token="t")
    assert client.status().jobs == []  # nothing half-made was left


def test_a_layout_marks_buffers_and_pushes_them_after_the_gradient(client: Client) -> None:
    job = client.create_job("layout", small_bn(), token="t")
    spec = job.specs[0]
    assert [(p.name, p.frozen, p.buffer) for p in spec.params] == [
        ("0.weight", False, ""), ("1.weight", False, ""), ("1.bias", False, ""),
        ("1.running_mean", True, "float32"), ("1.running_var", True, "float32"), ("1.num_batches_tracked", True, "int64"),
    ]
    push = push_layout(spec)
    assert push.grad_numel == 96 + 16 + 16 and push.numel == push.grad_numel + 16 + 16 + 16
    assert push.offsets[3:] == (128, 144, 160)
    # a worker's stages must say the same: a buffer where the job has a parameter is named
    with torch.device("meta"):
        other = small_bn()
    del other[0][1]._buffers["running_mean"]
    other[0][1].register_parameter("running_mean", nn.Parameter(torch.zeros(16)))
    with pytest.raises(LayoutError, match="'1.running_mean' is a parameter in the given model, a float32 buffer in the job"):
        client.attach_job("layout", token="t", stages=other)
    # a layout written before protocol 6 (five fields a parameter) still reads, without buffers
    old = msgspec.msgpack.encode({"name": "0", "numel": 16, "params": [["w", [4, 4], 0, 0, False]]})
    assert msgspec.msgpack.decode(old, type=m.StageSpec).params[0].buffer == ""


def test_a_cpu_worker_maps_the_published_weights_read_only(client: Client) -> None:
    """A CPU worker computes on the published weights in place (zero copy): its mapping is
    read-only, so a stray in-place write faults in the worker instead of changing the weights every
    worker reads, past the step commit point (defect seen: mapped read-write, a ``zero_()`` in a
    worker zeroed the server's master)."""
    job = client.create_job("read-only", [nn.Linear(4, 4), nn.Linear(4, 2)], optimizer=AdamW(lr=1e-3), token="t")
    with job.trainer() as trainer:
        published = trainer.connection.sc.published
        assert published is not None and trainer.connection.zero_copy
        start = published.data_ptr()
        with open("/proc/self/maps") as maps:
            perms = [line.split()[1] for line in maps if int(line.split("-")[0], 16) == start]
        assert perms and perms[0].startswith("r-"), perms
        trainer.step(torch.randn(3, 4), torch.randn(3, 2), nn.functional.mse_loss)


@pytest.mark.parametrize(("dtype", "largest"), [("bfloat16", 256), ("float16", 2048)])
def test_a_16_bit_job_reads_its_integer_buffers_exactly(client: Client, dtype: str, largest: int) -> None:
    """Found by review: workers read buffers from the published copy, in the job's dtype, so a
    bfloat16 job's stage looked up positions [3, 256, 1000, 2048, 2048, 4096] for the persistent
    ids [3, 257, 1001, 2049, 2051, 4095] (4096 past its embedding's end: an IndexError). A 16-bit
    copy now holds an integer buffer as int32 values where the layout has room (up to 8 elements
    always: NOTE [Integer buffers in a 16-bit published copy]), and after updates too; a bigger
    one the dtype would round is refused by name before the job exists."""
    from wstream.client import SGD

    seen: list[list[int]] = []

    class Positions(nn.Module):
        def __init__(self, ids: list[int]) -> None:
            super().__init__()
            self.emb = nn.Embedding(2**15, 1)
            self.register_buffer("ids", torch.tensor(ids))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.ids.tolist())
            return x + self.emb(self.ids).squeeze(1)

    ids = [3, 257, 1001, 2049, 2051, 4095, 32767, -0]
    job = client.create_job("ids", [Positions(ids)], optimizer=SGD(lr=0.1), token="t", dtype=dtype)  # type: ignore[arg-type]
    for transport in ({}, {"shm": False}):  # read in place from shared memory, and from data frames
        with job.trainer(**transport) as trainer:  # type: ignore[arg-type]
            for _ in range(2):  # after updates, from the other slot, as before them
                trainer.step(torch.zeros(1, len(ids)), torch.ones(1, len(ids)), lambda out, y: nn.functional.mse_loss(out.float(), y))
            trainer.forward(torch.zeros(1, len(ids)))
    assert len(seen) >= 6 and all(s == ids for s in seen), seen
    assert job.state_dict()["0.ids"].tolist() == ids

    too_big = Positions(list(range(largest - 8, largest + 8)))  # 16 elements: no room for int32s in an aligned layout
    with pytest.raises(LayoutError, match=f"stage 0's integer buffer 'ids' holds {largest + 7}, which {dtype}.*exactly only up to {largest}"):
        client.create_job("big", [too_big], token="t", dtype=dtype)  # type: ignore[arg-type]
    assert [j.name for j in client.status().jobs] == ["ids"] and not too_big.emb.weight.is_meta  # nothing created, the model kept
    client.create_job("big", [Positions(list(range(largest - 16, largest)))], token="t", dtype=dtype)  # type: ignore[arg-type]
