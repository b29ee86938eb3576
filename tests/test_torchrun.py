"""Data-parallel ranks launched by torchrun: the server averages, or the ranks all-reduce first."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from conftest import HERE, ServerProcess
from test_buffers import mean_statistics_reference
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import AdamW, Client

STEPS = 4


def torchrun(
    address: str, job: str, ranks: int, reduce: str, tmp_path: Path, *extra: str, model: str = "mixed"
) -> list[dict]:
    """``torchrun --standalone --nproc-per-node RANKS tests/worker_main.py ...``; the ranks' reports."""
    log = tmp_path / f"torchrun-{job}.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        str(HERE / "worker_main.py"), address, job, "t", model, str(STEPS), "-1",
        str(tmp_path / f"{job}-{{rank}}.json"), "--reduce", reduce, *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=240).returncode
    assert rc == 0, log.read_text(errors="replace")
    return [json.loads((tmp_path / f"{job}-{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.server_process  # torchrun ranks in other processes
@pytest.mark.parametrize("reduce", ["server", "allreduce"])
def test_torchrun_ranks_train_like_one_process_on_the_mean_gradient(
    server: ServerProcess, tmp_path: Path, reduce: str
) -> None:
    stages = models.mixed()
    start = copy.deepcopy(stages)
    with Client(server.address, timeout=30) as c:
        # unit_bytes=None: pushes and updates counted per chain stage
        c.create_job(f"tr-{reduce}", stages, optimizer=AdamW(lr=3e-3, weight_decay=0.05), token="t", unit_bytes=None)
        reports = torchrun(server.address, f"tr-{reduce}", 2, reduce, tmp_path)
        got = c.attach_job(f"tr-{reduce}", token="t").state_dict()
        info = {j.name: j for j in c.status().jobs}[f"tr-{reduce}"]
    want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05), "mixed", STEPS, ranks=2)
    assert_weights_equal(got, want, atol=1e-6)
    n = len(models.mixed())
    pushes = [r["pushes"] for r in reports]
    # the server averages 2 pushes per stage, or rank 0 alone pushes the all-reduced mean
    assert pushes == ([STEPS * n, STEPS * n] if reduce == "server" else [STEPS * n, 0])
    assert info.updates == STEPS * n


@pytest.mark.server_process  # torchrun ranks in other processes
def test_torchrun_ranks_keep_the_mean_of_their_batchnorm_statistics_either_way(server: ServerProcess, tmp_path: Path) -> None:
    """The buffers' rule is the same whether the server averages the ranks' pushes or the ranks
    all-reduce and rank 0 pushes: the mean of what each rank's forward left."""
    want = mean_statistics_reference(
        models.batchnorm(), lambda t, r: models.batch("batchnorm", t, r), STEPS, 2, 3e-3
    ).state_dict()
    with Client(server.address, timeout=30) as c:
        for reduce in ("server", "allreduce"):
            c.create_job(f"bn-{reduce}", models.batchnorm(), optimizer=AdamW(lr=3e-3, weight_decay=0.01), token="t")
            torchrun(server.address, f"bn-{reduce}", 2, reduce, tmp_path, model="batchnorm")
            got = c.attach_job(f"bn-{reduce}", token="t").state_dict()
            assert got["0.1.num_batches_tracked"].item() == STEPS
            assert_weights_equal({k: v.double() for k, v in got.items()}, {k: v.double() for k, v in want.items()}, atol=1e-5)


def test_allreduce_needs_a_process_group(client: Client) -> None:
    job = client.create_job("no-pg", models.mixed(), optimizer=AdamW(), token="t")
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        job.trainer(reduce="allreduce")
    with pytest.raises(ValueError, match="reduce must be"):
        job.trainer(reduce="nccl")


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A gloo process group of one rank in this process (what ``from_torchrun`` makes)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_found_by_review_an_allreduce_rank_does_not_retry_a_step_alone(
    client: Client, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``reduce="allreduce"`` every rank all-reduces each stage in lockstep. A rank that lost
    its session used to reconnect and train the step again from its forward on its own: its next
    all-reduce paired with another rank's next stage, mixed gradients were pushed, and the job hung
    (defect seen with 2 ranks). It now raises, naming why, so that torchrun stops every rank."""
    from wstream.client import SessionExpiredError, StateError
    from wstream.client.push import GradientPusher

    job = client.create_job("ar-lost", models.mixed(), optimizer=AdamW(), token="t")
    queue_push = GradientPusher.push

    def lose_the_session(pusher: GradientPusher, stage: int, step: int, *args: object, **kw: object) -> None:
        if step == 1:
            raise SessionExpiredError("injected: the server forgot this worker")
        queue_push(pusher, stage, step, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(GradientPusher, "push", lose_the_session)
    with job.trainer(reduce="allreduce", reconnect_s=30) as trainer:
        trainer.step(*models.batch("mixed", 0), models.loss_fn)
        with pytest.raises(StateError, match="allreduce.*restart every rank") as caught:
            trainer.step(*models.batch("mixed", 1), models.loss_fn)
        assert isinstance(caught.value.__cause__, SessionExpiredError)
        assert trainer.reconnects == 0


def test_found_by_review_allreduce_ranks_refuse_a_non_finite_loss_together(
    client: Client, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-finite loss on one rank only made that rank raise while the others waited in the
    stage's all-reduce for ever. The ranks now agree on the loss's finiteness (a one-number
    all-reduce), so every rank raises the same FloatingPointError at the same point."""
    import torch.distributed as dist

    agreed: list[float] = []
    real_all_reduce = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: object, **kw: object) -> object:
        if tensor.numel() == 1:
            agreed.append(float(tensor))
        return real_all_reduce(tensor, *args, **kw)

    monkeypatch.setattr(dist, "all_reduce", spy)
    job = client.create_job("ar-nan", models.mixed(), optimizer=AdamW(), token="t")
    x, y = models.batch("mixed", 0)
    with job.trainer(reduce="allreduce") as trainer:
        trainer.step(x, y, models.loss_fn)
        assert agreed == [1.0]  # this rank's loss was finite
        with pytest.raises(FloatingPointError, match="on this rank"):
            trainer.step(x * float("nan"), y, models.loss_fn)
        assert agreed == [1.0, 0.0]


def test_found_by_review_from_torchrun_starts_the_group_for_one_rank_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torchrun --nproc-per-node 1`` sets WORLD_SIZE=1: the same script that works with 2 ranks
    failed with reduce='allreduce', telling the user to call ``from_torchrun()`` first."""
    import socket

    import torch.distributed as dist

    from wstream.client.distributed import from_torchrun

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_RUN_ID": "review"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launch = from_torchrun()
    try:
        assert launch.world_size == 1 and dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # outside torchrun, one process needs no group
    from_torchrun()
    assert not dist.is_initialized()


@pytest.mark.server_process  # torchrun ranks in other processes
def test_found_by_review_allreduce_ranks_with_different_micro_batches_are_told_why(server: ServerProcess, tmp_path: Path) -> None:
    """The ranks agree on each micro-batch's loss (a one-number all-reduce per micro-batch), so a
    rank with 2 micro-batches paired its second agreement with the other rank's stage all-reduce:
    gloo aborted the process with a size mismatch (NCCL, which checks no sizes, could hang or mix
    a gradient with a flag). Every rank now refuses the step at its start, naming the counts."""
    with Client(server.address, timeout=30) as c:
        c.create_job("ar-k", models.mixed(), optimizer=AdamW(), token="t")
    log = tmp_path / "torchrun.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(HERE / "worker_main.py"), server.address, "ar-k", "t", "mixed", "2", "-1",
        str(tmp_path / "ar-k-{rank}.json"), "--reduce", "allreduce", "--micro-batches", "2,1",
    ]
    with open(log, "wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240).returncode
    text = log.read_text(errors="replace")
    assert rc != 0
    assert "EnforceNotMet" not in text and "doesn't match" not in text, text
    assert text.count("micro_batches=") >= 2, text  # each rank says so
    assert "micro_batches=2 on this rank" in text and "micro_batches=1 on this rank" in text, text


def test_found_by_review_allreduce_clips_by_the_gradient_norm_without_the_buffers(
    client: Client, one_rank_group: None
) -> None:
    """With ``reduce="allreduce"`` rank 0 pushes the mean as one flat run, and the squared norm it
    sent counted the buffers' values after the gradient (BatchNorm's running statistics): a
    grad_norm 4x torch's, and clipping by it changed the weights (1.9e-3 off after 3 steps). The
    push now measures the gradient part only, as ``reduce="server"`` does."""
    from torch import nn

    from wstream.client import SGD

    def chain() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(12, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 5)]

    def data(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(t)
        return torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)

    clip = 0.05
    ref = nn.Sequential(*chain())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    norms = []
    for t in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(ref(data(t)[0]), data(t)[1]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
    job = client.create_job("ar-bn-clip", chain(), optimizer=SGD(lr=0.1, clip_grad_norm=clip), token="t")
    seen = []
    with job.trainer(reduce="allreduce") as trainer:
        for t in range(3):
            trainer.step(*data(t), nn.functional.mse_loss)
            seen.append(trainer.stats().grad_norm)
    assert seen == pytest.approx(norms, rel=1e-5)
    got = job.state_dict()
    for k, v in ref.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5)

