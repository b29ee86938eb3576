"""Progress of long operations: bars on the client (uploading a model, pulling its weights) only
when asked or on a terminal; a resuming server logs how far it got."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import models
from wstream.client import AdamW, Client
from wstream.protocol import SGD, JobOptions
from wstream.protocol.layout import build_stage_spec
from wstream.server import snapshot
from wstream.server.snapshot import JobRecord, Snapshot, SnapshotStore


def test_bars_show_when_asked_and_not_by_default_off_a_terminal(
    client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    job = client.create_job("quiet", models.mixed(), optimizer=AdamW(), token="t")
    job.state_dict()
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    job = client.create_job("loud", models.mixed(), optimizer=AdamW(), token="t", progress=True)
    job.state_dict(progress=True)
    err = capsys.readouterr().err
    params = sum(p.numel() for m in models.mixed() for p in m.parameters())
    assert "uploading loud: 100%" in err and "pulling loud: 100%" in err
    assert f"{params / 1000:.2f}k/{params / 1000:.2f}k" in err


def test_a_resuming_server_logs_its_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(snapshot, "SHARD_BYTES", 1)  # one file per stage
    monkeypatch.setattr(snapshot, "PROGRESS_EVERY_S", 0.0)
    specs = [build_stage_spec(str(i), [("w", (16,))]) for i in range(4)]
    record = JobRecord("j", b"k" * 32, JobOptions(optimizer=SGD()), specs)
    store = SnapshotStore(tmp_path, keep=1)
    try:
        sources = [(threading.Lock(), lambda previous=False, i=i: {"master": torch.full((16,), float(i))}) for i in range(4)]
        store.write(Snapshot(record, 7, 2**20, "test"), sources)
        with caplog.at_level(logging.INFO, logger="wstream.server.snapshot"):
            step, _, stages, path = store.load_latest("j")
            masters = [t["master"][0].item() for _, t in stages]
    finally:
        store.close()  # it holds the store's lock (one server per store)
    assert step == 7 and masters == [0.0, 1.0, 2.0, 3.0]
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading")]
    assert [p.split(": ")[1].split()[0] for p in progress] == ["25%", "50%", "75%"]
    assert str(path) in progress[0]
