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
