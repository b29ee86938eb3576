"""The metrics and ``status`` of a server with several kinds of jobs: a job on a frozen base, a
stage with nothing to train, a job cut into transfer units while it is created, clients that
came and went; the endpoint's name filter and a scrape while the server is still being made."""

from __future__ import annotations

import copy
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from test_shared_base import adapted, base_stages, batch
from wstream.client import AdamW, Client
from wstream.server import service
from wstream.server.config import ServerConfig
from wstream.server.inprocess import InProcessServer
from wstream.server.metrics import _kind

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def metered(tmp_path: Path) -> Iterator[InProcessServer]:
    srv = InProcessServer(bind=[f"ipc://{tmp_path / 's.sock'}"], memory_limit=2**30, metrics_port=0, metrics_addr="127.0.0.1")
    with srv:
        yield srv


def page(srv: InProcessServer, query: str = "") -> str:
    assert srv.server.metrics is not None
    with urllib.request.urlopen(srv.server.metrics.url + query, timeout=30) as resp:
        return resp.read().decode()


def scrape(srv: InProcessServer, query: str = "") -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(page(srv, query))
        for s in fam.samples
    }


def served(samples: Samples, job: str) -> dict[tuple[str, str], float]:
    out = {}
    for (name, labels), v in samples.items():
        lab = dict(labels)
        if name == "wstream_bytes_served_total" and lab["job"] == job:
            out[lab["op"], lab["via"]] = v
    return out


def test_a_job_on_a_frozen_base_counts_the_base_bytes_its_fetches_serve(metered: InProcessServer) -> None:
    """A fetch of a stage on a base carries (frames) or points at (shared memory) the base's stage
    too: both are bytes served, to the job whose worker fetched them."""
    with Client(metered.address, timeout=30) as c:
        base = base_stages()
        c.create_job("base", copy.deepcopy(base), token="bt", frozen=True)
        fetched = {}
        for name, shm in (("ft-frames", False), ("ft-shm", True)):
            job = c.create_job(name, adapted(base, 1), optimizer=AdamW(lr=1e-2), token="t", base="base", base_token="bt", unit_bytes=None)
            with job.trainer(shm=shm) as tr:
                for t in range(2):
                    tr.step(*batch(1, t), nn.functional.mse_loss)
                fetched[name] = tr.stats().bytes_fetched
        samples = scrape(metered)
    frames, shm_served = served(samples, "ft-frames")["fetch", "frames"], served(samples, "ft-shm")["fetch", "shm"]
    assert frames == fetched["ft-frames"]  # over the socket: exactly what the trainer received, base included
    assert shm_served == frames  # the same fetches, pointed at in shared memory
    base_bytes = sum(p.numel() * 4 for s in base for p in s.parameters())
    assert frames > 2 * base_bytes  # (two steps' fetches of every base stage at least)
    assert sum(served(samples, "base").values()) == 0  # the base job's own workers fetched nothing


def test_a_stage_with_nothing_to_train_is_not_counted_as_updated(metered: InProcessServer) -> None:
    with Client(metered.address, timeout=30) as c:
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
        stages[1].requires_grad_(False)
        job = c.create_job("fz", stages, optimizer=AdamW(), token="t", unit_bytes=None)
        with job.trainer() as tr:
            for _ in range(2):
                tr.step(torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
            tr.wait_updates()
        samples = scrape(metered)
        info = next(j for j in c.status().jobs if j.name == "fz")
    per_stage = [samples[("wstream_stage_optimizer_seconds_count", frozenset({"job": "fz", "stage": str(i), "chain_stages": str(i)}.items()))] for i in range(3)]
    assert per_stage == [2, 0, 2]
    assert info.updates == 4
    assert samples[("wstream_optimizer_seconds_count", frozenset({"job": "fz"}.items()))] == 4


def test_sessions_of_clients_that_closed_are_not_counted(metered: InProcessServer) -> None:
    with Client(metered.address, timeout=30) as c:
        c.create_job("a", [nn.Linear(4, 4)], optimizer=AdamW(), token="t")
    for _ in range(3):
        with Client(metered.address, timeout=30) as other:
            other.attach_job("a", token="t")
    sessions = {dict(k[1])["kind"]: v for k, v in scrape(metered).items() if k[0] == "wstream_sessions"}
    assert sessions == {"job": 0, "worker": 0, "admin": 0}


def test_the_name_filter_of_the_endpoint_finds_every_family(metered: InProcessServer) -> None:
    with Client(metered.address, timeout=30) as c:
        c.create_job("f", [nn.Linear(4, 4)], optimizer=AdamW(), token="t")
        for name, want in (("wstream_job_step", "wstream_job_step"), ("wstream_jobs", "wstream_jobs"),
                           ("wstream_optimizer_seconds_count", "wstream_optimizer_seconds_count"),
                           ("process_open_fds", "process_open_fds")):
            samples = scrape(metered, f"?name[]={name}")
            assert {k[0] for k in samples} == {want}, name
        for fam in text_string_to_metric_families(page(metered)):  # each family of the type it was described with
            if fam.name.startswith("wstream_"):
                assert fam.type == _kind(fam.name + ("_total" if fam.type == "counter" else "")), fam.name


def test_a_scrape_while_the_server_is_made_is_answered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint starts only once everything it reads exists (a scrape in between got a 500)."""
    answers: list[int] = []
    real = service.SessionTable

    def slow_table(config: ServerConfig) -> object:
        started.wait(10)  # the endpoint is up (or not) by now: scrape it before the table exists
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                answers.append(resp.status)
        except urllib.error.HTTPError as exc:
            answers.append(exc.code)
        except urllib.error.URLError:
            answers.append(0)  # nothing listens yet: fine
        return real(config)

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = threading.Event()
    started.set()
    monkeypatch.setattr(service, "SessionTable", slow_table)
    srv = service.Server(ServerConfig(bind=[f"ipc://{tmp_path / 's.sock'}"], metrics_port=port, memory_limit=2**28))
    try:
        assert answers and answers[0] in (0, 200)
    finally:
        assert srv.metrics is not None
        srv.metrics.close()
        srv.transport.close()
        srv._updates.shutdown()


def test_a_job_cut_into_units_reports_no_chain_count_before_its_seal(metered: InProcessServer) -> None:
    """Until the seal says how many chain stages its units hold, a job being created has no
    ``wstream_job_stages``/``units`` and no per-stage series (they named each unit as one chain
    stage, then changed at the seal); status counts the stages uploaded so far and says so."""
    seen: list[Samples] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            s = scrape(metered)
            if s.get(("wstream_job_ready", frozenset({"job": "u"}.items()))) == 0:
                seen.append(s)

    t = threading.Thread(target=watch)
    t.start()
    try:
        with Client(metered.address, timeout=60) as c:
            c.create_job("u", [nn.Linear(64, 64) for _ in range(400)], optimizer=AdamW(), token="t")
    finally:
        stop.set()
        t.join()
    assert seen, "no scrape fell inside the creation"
    for s in seen:
        assert not [k for k in s if dict(k[1]).get("job") == "u" and k[0] in (
            "wstream_job_stages", "wstream_job_units", "wstream_stage_optimizer_last_seconds")], "a chain count before the seal"
    after = scrape(metered)
    assert after[("wstream_job_stages", frozenset({"job": "u"}.items()))] == 400
    chain_stages = sorted(dict(k[1])["chain_stages"] for k in after if k[0] == "wstream_stage_optimizer_last_seconds")
    assert chain_stages and all("-" in c for c in chain_stages)


def test_found_by_review_closing_a_client_does_not_wait_for_another_threads_request(metered: InProcessServer) -> None:
    """Leaving its sessions, a closing Client queued behind another thread's held request on its
    channel (a ``wait_step`` of 30 s: close took as long). The shared channel is closed first, as
    before, which ends that request; the sessions are left on a channel of their own."""
    with Client(metered.address, timeout=30) as c:
        c.create_job("w", [nn.Linear(4, 4)], optimizer=AdamW(), token="t")
    c = Client(metered.address, timeout=30)
    job = c.attach_job("w", token="t")
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            job.wait_step(5, timeout=30)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - what ended the wait is the point
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while not any(s.job is not None for s in metered.server.sessions.values()):
        pass
    import time

    time.sleep(0.3)  # the waiter is inside its request
    c.close()
    waiter.join()
    from wstream.client import WaitTimeoutError

    assert outcome and not isinstance(outcome[0], WaitTimeoutError), outcome  # interrupted, not waited out
    assert not metered.server.sessions  # and the handle's session was left
