"""trainer.trace(): one Chrome-trace file with the worker's and the server's side of the steps."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

import models
from wstream.client import AdamW, Client
from wstream.client.timeline import Span, Tracer, _assign_sublanes, write_worker_trace
from wstream.protocol import messages as m

STEPS = 2


def load(path: Path) -> tuple[list[dict], dict[int, str], dict]:
    trace = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    return spans, names, trace["otherData"]


@pytest.mark.parametrize("delayed", [False, True])
def test_trace_shows_every_fetch_compute_push_and_update(client: Client, tmp_path: Path, delayed: bool) -> None:
    # unit_bytes=None: the spans are counted per chain stage, and a stage's push is matched to its gather
    job = client.create_job(
        "traced", models.mixed(), optimizer=AdamW(lr=1e-3), token="t", delayed_update=delayed, unit_bytes=None
    )
    n = len(job.specs)
    with job.trainer(zero_copy=False, schedule="revolve", slots=2) as trainer:
        trainer.step(*models.batch("mixed", 0), models.loss_fn)  # untraced
        with trainer.trace(tmp_path / "step.json"):
            for s in range(1, 1 + STEPS):
                trainer.step(*models.batch("mixed", s), models.loss_fn)
        plan = trainer.plan
        assert plan is not None
        trainer.step(*models.batch("mixed", 3), models.loss_fn)  # untraced again
    spans, procs, meta = load(tmp_path / "step.json")
    worker_pid = next(p for p, name in procs.items() if name.startswith("worker"))
    server_pid = next(p for p, name in procs.items() if name.startswith("wstream-server"))
    worker = [e for e in spans if e["pid"] == worker_pid]
    server = [e for e in spans if e["pid"] == server_pid]
    # (a delayed-update job acknowledges step 0's pushes, and updates it, during step 1)
    count = Counter(e["cat"] for e in worker if e["args"].get("step", 1) in (1, 2))
    assert count["step"] == STEPS  # only the traced steps
    assert count["forward"] == STEPS * (n - 1)  # the last stage's forward runs in its backward
    assert count["recompute"] == STEPS * (plan.advances - (n - 1))
    assert count["backward"] == STEPS * n
    assert count["fetch"] == count["copy"] == STEPS * len(plan.fetch_order())
    assert count["push"] == 2 * STEPS * n  # the gradient copy and the push itself, per stage
    assert {e["args"]["step"] for e in worker if e["cat"] == "backward"} == {1, 2}
    # the server gathered every push of both steps; step 1's updates are done by the end of step 2
    # (its fetches and pushes wait for them); step 2's may still run when the trace is taken
    gathers = [e for e in server if e["cat"] == "gather" and e["args"]["step"] in (1, 2)]
    assert sorted((e["args"]["stage"], e["args"]["step"]) for e in gathers) == sorted((i, t) for i in range(n) for t in (1, 2))
    updates = [e for e in server if e["cat"] == "optimizer" and e["args"]["step"] == 1]
    assert sorted(e["args"]["stage"] for e in updates) == list(range(n))
    queued = Counter((e["args"]["stage"], e["args"]["step"]) for e in server if e["cat"] == "queue")
    assert all(queued[(e["args"]["stage"], 1)] == 1 for e in updates)
    # the clocks agree: each gather runs after its push was sent and ends before the worker saw the
    # reply; every update of a step starts after the step's last push was sent (the commit point)
    slack = meta["clock_uncertainty_ns"] / 1000 + 1.0  # microseconds
    pushes = {
        (e["args"]["stage"], e["args"]["step"]): e for e in worker if e["cat"] == "push" and e["name"].startswith("push")
    }
    for g in gathers:
        p = pushes[(g["args"]["stage"], g["args"]["step"])]
        assert p["ts"] - slack <= g["ts"] and g["ts"] + g["dur"] <= p["ts"] + p["args"]["ack_seen_us"] + slack
    last_push = max(p["ts"] for (_, t), p in pushes.items() if t == 1)
    assert all(u["ts"] >= last_push - slack for u in updates)
    commits = [e for e in worker if e["cat"] == "commit"]
    assert sorted(e["args"]["step"] for e in commits if e["args"]["step"] in (1, 2)) == [1, 2]


def test_overlapping_spans_get_their_own_sub_lanes() -> None:
    spans = [
        Span("a", "fetch", "weight fetches", 0, 10),
        Span("b", "fetch", "weight fetches", 5, 15),  # overlaps a without nesting
        Span("c", "fetch", "weight fetches", 6, 8),  # nested in a... and in b: first free sub-lane
        Span("d", "fetch", "weight fetches", 12, 20),  # a ended: back on the first
    ]
    lanes = {s.name: lane for lane, s in _assign_sublanes(spans)}
    assert lanes == {"a": "weight fetches", "b": "weight fetches #2", "c": "weight fetches", "d": "weight fetches"}


def test_tracing_twice_at_once_is_refused(client: Client, tmp_path: Path) -> None:
    job = client.create_job("twice", models.mixed(), optimizer=AdamW(lr=1e-3), token="t")
    with job.trainer() as trainer, trainer.trace(tmp_path / "a.json"):
        with pytest.raises(Exception, match="already tracing"):
            with trainer.trace(tmp_path / "b.json"):
                pass


def test_server_events_near_the_trace_start_survive_a_one_sided_round_trip(tmp_path: Path) -> None:
    """The server's clock is mapped onto the worker's by the timeline request's round trip, right
    to within half of it. A reply that was slow on the way *to* the server (a loaded machine) maps
    its events too early: one 2 ms after the trace began must still be in the trace."""
    tracer = Tracer()
    event = m.TraceEvent(
        name="held 4 (4)", cat="gather", lane="held gradients", start_ns=tracer.started_ns + 2_000_000, dur_ns=0, stage=4, step=1
    )

    def request() -> m.TimelineReply:
        time.sleep(0.05)  # the request waited 50 ms; the server answered, and the reply came back, at once
        return m.TimelineReply(id=1, now_ns=time.monotonic_ns(), events=[event], dropped=0)

    write_worker_trace(tmp_path / "t.json", tracer, request, job="j", worker=0)
    spans, _, meta = load(tmp_path / "t.json")
    assert meta["clock_uncertainty_ns"] >= 25_000_000
    assert [e["name"] for e in spans if e["cat"] == "gather"] == ["held 4 (4)"]
