"""Prometheus metrics of a server (``--metrics-port``): what it serves, receives and holds, per job.

# NOTE [Metrics are read from the server's state at scrape time]
# 1. Gauges (step, workers, memory, queue depths) are not kept a second time: the collector reads
#    them from the jobs when Prometheus scrapes, on the HTTP endpoint's thread.
# 2. What no state holds (bytes served, gradients received, optimizer and snapshot durations) is
#    counted in plain ints and floats (:class:`JobCounters`, :class:`ServerCounters`) written by the
#    loop thread only. Optimizer durations are measured on pool threads but recorded when the loop
#    finishes the update, so the hot path takes no lock.
# 3. The scrape thread only reads. It copies a container before walking it (``list(d.values())``
#    runs in C: under the GIL it cannot see a dict change size) and reads each number once. A scrape
#    may fall between two stage updates of one step; each figure was true at some instant during
#    the scrape, and counters never go backwards (a histogram's count is summed from one copy of
#    its buckets, so ``+Inf`` and ``_count`` always agree).
# 4. Each server has a CollectorRegistry of its own, not prometheus_client's global one: several
#    servers in one process (tests) do not collide, and a job's series vanish with the job.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from wstream.protocol import JobOptions

from .counters import RATE_WINDOW_S, Histogram, JobCounters, ServerCounters, StepRate

__all__ = ["HELP", "Histogram", "MetricsEndpoint", "ServerCollector", "StepRate"]

log = logging.getLogger(__name__)


# ---- what the collector reads (the server and its jobs match these structurally) -----------------
class StageView(Protocol):
    index: int
    waiting_fetch: Sequence[object]
    waiting_pull: Sequence[object]
    pending: Mapping[int, object]
    updates: int
    optimizer_s: float
    last_optimizer_s: float

    @property
    def chain_stages(self) -> str: ...


class CommitView(Protocol):
    grad_norm: float
    lr: float
    clip: float


class JobView(Protocol):
    name: str
    options: JobOptions
    num_params: int
    counters: JobCounters
    last_snapshot_step: int | None

    @property
    def last_commit(self) -> CommitView | None: ...
    @property
    def skipped_steps(self) -> int: ...
    @property
    def discarded_steps(self) -> int: ...
    @property
    def stages(self) -> Sequence[StageView]: ...
    @property
    def num_chain_stages(self) -> int: ...
    @property
    def workers(self) -> Mapping[int, object]: ...
    @property
    def ready(self) -> bool: ...
    @property
    def step(self) -> int: ...
    @property
    def updates_in_flight(self) -> int: ...
    @property
    def waiting_steps(self) -> int: ...
    @property
    def held_commits(self) -> int: ...
    def memory_by_kind(self, workers: list[object] | None = None) -> dict[str, int]: ...


class SessionView(Protocol):
    @property
    def admin(self) -> bool: ...
    @property
    def worker(self) -> int | None: ...


class MemoryView(Protocol):
    limit: int
    used: int


class MetricsConfig(Protocol):
    @property
    def metrics_stage_limit(self) -> int: ...


class ServerView(Protocol):
    """What :class:`ServerCollector` reads of a server (``wstream.server.service.Server``)."""

    counters: ServerCounters

    @property
    def config(self) -> MetricsConfig: ...
    @property
    def memory(self) -> MemoryView: ...
    @property
    def jobs(self) -> Mapping[str, JobView]: ...
    @property
    def sessions(self) -> Mapping[bytes, SessionView]: ...

HELP: dict[str, str] = {
    "wstream_memory_limit_bytes": "Bytes all jobs together may hold (--memory-limit).",
    "wstream_memory_used_bytes": "Bytes the jobs hold now (what admission control counts).",
    "wstream_jobs": "Jobs on the server, sealed or being created.",
    "wstream_sessions": "Open sessions by kind: job (attached, not training), worker, admin.",
    "wstream_requests_total": "Requests decoded, by op.",
    "wstream_request_errors_total": "Error replies sent, by code.",
    "wstream_job_info": "Always 1; labels carry the job's optimizer and compute dtype.",
    "wstream_job_ready": "1 once the job is sealed (its weights are all uploaded).",
    "wstream_job_step": "Steps every stage of the job has completed.",
    "wstream_job_steps_per_second": f"Steps completed per second over the last {RATE_WINDOW_S} s.",
    "wstream_job_stages": "Stages of the chain the job was made from (once it is sealed).",
    "wstream_job_units": "Server stages holding them (transfer units; the stage label of per-stage metrics counts these, chain_stages names the chain's stages each holds).",
    "wstream_job_parameters": "Elements of the job's stages: trained and frozen parameters and buffers.",
    "wstream_job_workers": "Workers attached to the job now, readers (which fetch and never push) included.",
    "wstream_job_memory_bytes": (
        "Bytes the job holds, by kind: published (shared-memory weights workers read), private "
        "(optimizer state, the step's gradient accumulator, a separate fp32 master), gradients "
        "(workers' shared-memory gradient "
        "rings), reserve (room held ahead in the weights segment while the job is created)."
    ),
    "wstream_job_deferred_fetches": "Fetches waiting for a stage update to finish.",
    "wstream_job_deferred_pulls": "Pulls waiting for a stage update to finish.",
    "wstream_job_waiting_steps": "await_step requests waiting for every update of their step.",
    "wstream_job_held_commits": "commit requests held until their step commits.",
    "wstream_job_pending_gradients": "Gradients received and not yet added into their stage's accumulator.",
    "wstream_job_grad_norm": "Global gradient norm of the newest committed step, before clipping.",
    "wstream_job_lr": "Base learning rate of the newest committed step's update (the schedule's).",
    "wstream_job_clip_factor": "Factor the newest committed step's gradient was multiplied by (1: not clipped).",
    "wstream_job_skipped_steps_total": "Steps committed without an update (gradient norm not finite).",
    "wstream_job_discarded_steps_total": "Step attempts discarded because a worker left after pushing part of one.",
    "wstream_job_updates_in_flight": "Stage updates handed to the optimizer pool, queued or running.",
    "wstream_bytes_served_total": (
        "Bytes of weights served, by op (fetch, pull) and via (shm: bytes a reply pointed at in "
        "shared memory; frames: bytes sent in data frames); a fetch of a job on a base counts the base's stage too."
    ),
    "wstream_gradients_received_total": "Gradients accepted (one per stage, step and worker).",
    "wstream_gradient_bytes_received_total": "Bytes of the gradients accepted.",
    "wstream_optimizer_seconds": "Seconds of each stage update (mean of the workers' gradients, optimizer, publication).",
    "wstream_stage_optimizer_seconds": "Seconds of each update of one stage (jobs up to --metrics-stage-limit stages).",
    "wstream_stage_optimizer_last_seconds": "Seconds of the last update of one stage (jobs up to --metrics-stage-limit stages).",
    "wstream_snapshot_seconds": "Seconds from the start of a snapshot to its being durable.",
    "wstream_snapshot_bytes_total": "Bytes of snapshot files written.",
    "wstream_snapshot_failures_total": "Snapshots that failed.",
    "wstream_job_last_snapshot_step": "Step of the job's newest durable snapshot (absent: none yet).",
}


HISTOGRAMS = ("wstream_optimizer_seconds", "wstream_snapshot_seconds")
SUMMARIES = ("wstream_stage_optimizer_seconds",)
_FAMILY_KINDS: dict[str, type[Metric]] = {
    "gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily, "summary": SummaryMetricFamily,
}


def _kind(name: str) -> str:
    """The type of the family ``name`` (counters end in ``_total``)."""
    if name in HISTOGRAMS:
        return "histogram"
    if name in SUMMARIES:
        return "summary"
    return "counter" if name.endswith("_total") else "gauge"


class _Families:
    """Metric families of one scrape, made on first use and filled label set by label set."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def _get(self, make: type[Metric], name: str, labels: dict[str, str]) -> Metric:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = make(name, HELP[name], labels=list(labels))
        return fam

    def gauge(self, name: str, value: float, **labels: str) -> None:
        self._get(GaugeMetricFamily, name, labels).add_metric(list(labels.values()), value)

    def counter(self, name: str, value: float, **labels: str) -> None:
        self._get(CounterMetricFamily, name, labels).add_metric(list(labels.values()), value)

    def histogram(self, name: str, hist: Histogram, **labels: str) -> None:
        fam = self._get(HistogramMetricFamily, name, labels)
        fam.add_metric(list(labels.values()), buckets=hist.cumulative(), sum_value=hist.sum)

    def summary(self, name: str, count: int, total: float, **labels: str) -> None:
        self._get(SummaryMetricFamily, name, labels).add_metric(list(labels.values()), count, total)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class ServerCollector(Collector):
    """Builds every ``wstream_*`` family from the server's state when scraped (see the NOTE)."""

    def __init__(self, server: ServerView) -> None:
        self._server = server

    def describe(self) -> list[Metric]:
        """Every family this collector may yield, empty: the registry learns the names from it, so
        the endpoint's ``?name[]=`` filter finds them (which families a scrape has depends on the
        jobs present)."""
        return [_FAMILY_KINDS[_kind(name)](name, doc) for name, doc in HELP.items()]

    def collect(self) -> Iterator[Metric]:
        srv = self._server
        out = _Families()
        out.gauge("wstream_memory_limit_bytes", srv.memory.limit)
        out.gauge("wstream_memory_used_bytes", srv.memory.used)
        jobs = list(srv.jobs.values())
        out.gauge("wstream_jobs", len(jobs))
        kinds = Counter("admin" if s.admin else "worker" if s.worker is not None else "job" for s in list(srv.sessions.values()))
        for kind in ("job", "worker", "admin"):
            out.gauge("wstream_sessions", kinds[kind], kind=kind)
        for op, n in sorted(srv.counters.requests.items()):
            out.counter("wstream_requests_total", n, op=op)
        for code, n in sorted(srv.counters.errors.items()):
            out.counter("wstream_request_errors_total", n, code=code)
        now = time.monotonic()
        for job in jobs:
            _collect_job(out, job, now, srv.config.metrics_stage_limit)
        return iter(out)


def _collect_job(out: _Families, job: JobView, now: float, stage_limit: int) -> None:
    name = job.name
    stages = list(job.stages)
    workers = list(job.workers.values())
    c = job.counters
    out.gauge("wstream_job_info", 1, job=name, optimizer=type(job.options.optimizer).__name__, dtype=job.options.dtype)
    out.gauge("wstream_job_ready", int(job.ready), job=name)
    out.gauge("wstream_job_step", job.step, job=name)
    out.gauge("wstream_job_steps_per_second", c.steps.rate(now), job=name)
    if job.ready:  # until the seal says how many chain stages units hold, neither count is known
        out.gauge("wstream_job_stages", job.num_chain_stages, job=name)
        out.gauge("wstream_job_units", len(stages), job=name)
    out.gauge("wstream_job_parameters", job.num_params, job=name)
    out.gauge("wstream_job_workers", len(workers), job=name)
    for kind, nbytes in job.memory_by_kind(workers).items():
        out.gauge("wstream_job_memory_bytes", nbytes, job=name, kind=kind)
    out.gauge("wstream_job_deferred_fetches", sum(len(st.waiting_fetch) for st in stages), job=name)
    out.gauge("wstream_job_deferred_pulls", sum(len(st.waiting_pull) for st in stages), job=name)
    out.gauge("wstream_job_waiting_steps", job.waiting_steps, job=name)
    out.gauge("wstream_job_held_commits", job.held_commits, job=name)
    out.gauge("wstream_job_pending_gradients", sum(len(st.pending) for st in stages), job=name)
    out.gauge("wstream_job_updates_in_flight", job.updates_in_flight, job=name)
    commit = job.last_commit
    if commit is not None:
        out.gauge("wstream_job_grad_norm", commit.grad_norm, job=name)
        out.gauge("wstream_job_lr", commit.lr, job=name)
        out.gauge("wstream_job_clip_factor", commit.clip, job=name)
    out.counter("wstream_job_skipped_steps_total", job.skipped_steps, job=name)
    out.counter("wstream_job_discarded_steps_total", job.discarded_steps, job=name)
    for (op, via), nbytes in list(c.served.items()):
        out.counter("wstream_bytes_served_total", nbytes, job=name, op=op, via=via)
    out.counter("wstream_gradients_received_total", c.gradients, job=name)
    out.counter("wstream_gradient_bytes_received_total", c.gradient_bytes, job=name)
    out.histogram("wstream_optimizer_seconds", c.optimizer, job=name)
    if job.ready and len(stages) <= stage_limit:  # (a unit names its chain stages from the seal on)
        for st in stages:  # ``stage``: the server's stage (a unit); ``chain_stages``: the chain's it holds
            labels = {"job": name, "stage": str(st.index), "chain_stages": st.chain_stages}
            out.summary("wstream_stage_optimizer_seconds", st.updates, st.optimizer_s, **labels)
            out.gauge("wstream_stage_optimizer_last_seconds", st.last_optimizer_s, **labels)
    out.histogram("wstream_snapshot_seconds", c.snapshots, job=name)
    out.counter("wstream_snapshot_bytes_total", c.snapshot_bytes, job=name)
    out.counter("wstream_snapshot_failures_total", c.snapshot_failures, job=name)
    if job.last_snapshot_step is not None:
        out.gauge("wstream_job_last_snapshot_step", job.last_snapshot_step, job=name)


class MetricsEndpoint:
    """``http://ADDR:PORT/metrics`` for one server, on a daemon thread, from a registry of its own."""

    def __init__(self, server: ServerView, addr: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)  # ProcessCollector's names too, for ?name[]=
        self.registry.register(ServerCollector(server))
        ProcessCollector(registry=self.registry)  # process_* : CPU, resident memory, open fds
        self._httpd, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port: int = self._httpd.server_port
        self.url = f"http://{_host_for_url(addr)}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()  # releases the port (shutdown alone does not)
        self._thread.join()


def _host_for_url(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
