"""The Prometheus endpoint (``--metrics-port``): its figures agree with what the workers did and
with what ``status`` reports; the pieces it is made of behave."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import models
from conftest import ServerProcess, run_workers, start_server
from wstream.client import AdamW, Client
from wstream.protocol import messages as m
from wstream.server.metrics import HELP, Histogram, StepRate

STEPS = 3  # per subprocess worker
RANKS = 2
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics_url(srv: ServerProcess) -> str:
    found = re.search(r"Prometheus metrics at (http://\S+)", srv.log())
    assert found, f"the server did not log its metrics endpoint\n{srv.log()}"
    return found.group(1)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def test_metrics_agree_with_the_work_done_and_with_status(tmp_path: Path) -> None:
    conf = tmp_path / "server.toml"  # the endpoint is configured through the file: --config works too
    conf.write_text(
        f'memory_limit = "1GiB"\nmetrics_port = 0\nmetrics_stage_limit = 5\nstore = "{tmp_path / "store"}"\n'
    )
    srv = start_server(tmp_path, "--config", str(conf))
    try:
        url = metrics_url(srv)
        with Client(srv.address, timeout=30) as c:
            # unit_bytes=None: the counts below are per chain stage, and "deep" has 6 server stages
            job = c.create_job("m", models.mixed(), optimizer=AdamW(), token="t", unit_bytes=None)
            c.create_job("deep", models.deep(6, 8), optimizer=AdamW(), token="t", unit_bytes=None)  # over the stage limit
            reports = run_workers(srv.address, "m", "t", "mixed", STEPS, RANKS, tmp_path, "--copy")
            with job.trainer(shm=False) as tr:  # one more step, over data frames, and stays joined
                tr.step(*models.batch("mixed", STEPS), models.loss_fn)
                mine = tr.stats()
                saved_step, _ = job.save()
                samples = scrape(url)
                status = c.status()
            job.drop()
            after_drop = scrape(url)
    finally:
        assert srv.stop() == 0, srv.log()

    info = {j.name: j for j in status.jobs}["m"]
    stages = 5
    steps = STEPS + 1
    numel = sum(p.numel() for mod in models.mixed() for p in mod.parameters())
    flat = sum(spec.numel for spec in job.specs)  # with the alignment padding between parameters
    # gradients: one per stage, step and worker
    gradients = STEPS * stages * RANKS + stages
    assert value(samples, "wstream_gradients_received_total", job="m") == gradients
    assert value(samples, "wstream_requests_total", op="push") == gradients
    assert value(samples, "wstream_gradient_bytes_received_total", job="m") == (STEPS * RANKS + 1) * flat * 4
    # bytes served: exactly what the workers copied, each through the way it used
    assert value(samples, "wstream_bytes_served_total", job="m", op="fetch", via="shm") == sum(
        r["bytes_fetched"] for r in reports
    )
    assert value(samples, "wstream_bytes_served_total", job="m", op="fetch", via="frames") == mine.bytes_fetched
    assert value(samples, "wstream_requests_total", op="fetch") == sum(r["fetches"] for r in reports) + mine.fetches
    assert mine.bytes_fetched >= flat * 4  # every stage at least once
    # steps, updates and optimizer time: as status says
    assert value(samples, "wstream_job_step", job="m") == info.step == steps
    assert value(samples, "wstream_optimizer_seconds_count", job="m") == info.updates == steps * stages
    assert value(samples, "wstream_optimizer_seconds_sum", job="m") == pytest.approx(info.optimizer_s)
    assert value(samples, "wstream_optimizer_seconds_bucket", job="m", le="+Inf") == steps * stages
    for i in range(stages):
        assert value(samples, "wstream_stage_optimizer_seconds_count", job="m", stage=str(i), chain_stages=str(i)) == steps
        assert value(samples, "wstream_stage_optimizer_last_seconds", job="m", stage=str(i), chain_stages=str(i)) > 0
    assert total(samples, "wstream_stage_optimizer_seconds_sum", job="m") == pytest.approx(info.optimizer_s)
    assert total(samples, "wstream_stage_optimizer_seconds_count", job="deep") == 0  # 6 stages > limit 5
    assert value(samples, "wstream_job_steps_per_second", job="m") > 0 and info.steps_per_s > 0
    # workers, memory, queues
    assert value(samples, "wstream_job_workers", job="m") == len(info.workers) == 1
    assert value(samples, "wstream_sessions", kind="worker") == 1
    assert total(samples, "wstream_job_memory_bytes", job="m") == info.bytes
    assert value(samples, "wstream_job_memory_bytes", job="m", kind="gradients") > 0  # the trainer's ring
    assert value(samples, "wstream_job_memory_bytes", job="m", kind="reserve") == 0  # sealed
    assert total(samples, "wstream_job_memory_bytes") == value(samples, "wstream_memory_used_bytes")
    assert value(samples, "wstream_memory_used_bytes") == status.memory_used
    assert value(samples, "wstream_memory_limit_bytes") == 2**30
    for idle in ("deferred_fetches", "deferred_pulls", "waiting_steps", "held_commits", "pending_gradients", "updates_in_flight"):
        assert value(samples, f"wstream_job_{idle}", job="m") == 0
    assert value(samples, "wstream_job_info", job="m", optimizer="AdamW", dtype="float32") == 1
    # the newest step's commit: its norm and lr as the worker saw them (and status says)
    assert value(samples, "wstream_job_grad_norm", job="m") == pytest.approx(mine.grad_norm) == info.grad_norm
    assert value(samples, "wstream_job_lr", job="m") == mine.lr == info.lr == AdamW().lr
    assert value(samples, "wstream_job_clip_factor", job="m") == 1.0
    assert value(samples, "wstream_job_skipped_steps_total", job="m") == 0 == info.skipped_steps
    assert value(samples, "wstream_job_discarded_steps_total", job="m") == 0 == info.discarded_steps
    assert value(samples, "wstream_job_parameters", job="m") == numel
    # snapshots: the one at creation and the one saved
    assert value(samples, "wstream_snapshot_seconds_count", job="m") == 2
    assert value(samples, "wstream_snapshot_bytes_total", job="m") > numel * 4
    assert value(samples, "wstream_snapshot_failures_total", job="m") == 0
    assert value(samples, "wstream_job_last_snapshot_step", job="m") == saved_step == info.last_snapshot == steps
    # a dropped job's series go with it
    assert not [k for k in after_drop if ("job", "m") in k[1]]
    assert value(after_drop, "wstream_job_step", job="deep") == 0


def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "operating.md").read_text()
    missing = [name for name in HELP if f"`{name}`" not in doc]
    assert not missing, f"docs/operating.md does not describe {missing}"


def test_a_metrics_port_in_use_stops_the_server_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "wstream.server", "--bind", f"ipc://{tmp_path}/s.sock", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr


def test_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == pytest.approx(2.65)


def test_step_rate_counts_the_last_window_only() -> None:
    r = StepRate()
    assert r.rate(100.0) == 0.0  # not started
    r.start(100.0)
    for t in range(100, 110):
        r.add(1, t + 0.5)
    assert r.rate(110.0) == pytest.approx(1.0)  # 10 steps in the first 10 s
    assert r.rate(200.0) == 0.0  # nothing in the last 30 s
    r.add(3, 200.2)
    assert r.rate(200.5) == pytest.approx(3 / 30)


def test_every_error_reply_is_counted_also_those_the_jobs_build() -> None:
    """``wstream_request_errors_total`` counts the errors a job's parts answer with (a discarded
    step, a failed update, a worker gone) as well as those a handler raises (defect seen: only the
    latter were counted)."""
    from collections import Counter

    from wstream.protocol import SessionExpiredError, StaleStepError
    from wstream.server.outgoing import Outbox, Outgoing

    sent: list[Outgoing] = []
    errors: Counter[str] = Counter()
    outbox = Outbox(sent.append, errors)
    outbox.error(b"a", 1, StaleStepError("raised by a handler"))
    outbox.send_all([Outgoing.error(b"b", 2, SessionExpiredError("built by a job")), Outgoing(b"c", m.Ok(id=3))])
    outbox.send(Outgoing.error(b"d", 4, RuntimeError("a pool task's failure")))
    assert len(sent) == 4
    assert errors == Counter({"stale_step": 1, "session_expired": 1, "internal": 1})
