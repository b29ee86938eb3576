"""``wstream`` commands' output: the status table and the job list (in-process, against a real server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import models
from conftest import ServerProcess
from wstream.client import AdamW, Client
from wstream.client.admin import build_parser, format_status, main
from wstream.protocol import messages as m


def job_info(name: str, **kw: object) -> m.JobInfo:
    fields: dict[str, object] = {
        "name": name, "stages": 1, "params": 10, "step": 0, "ready": True, "optimizer": "AdamW",
        "dtype": "float32", "bytes": 1024, "workers": [], "updates": 0, "optimizer_s": 0.0,
    }
    return m.JobInfo(**{**fields, **kw})  # type: ignore[arg-type]


def test_status_table_is_sized_to_its_contents() -> None:
    st = m.StatusReply(
        id=1, protocol=2, pid=42, uptime_s=12.4, memory_limit=2**30, memory_used=3 * 2**20,
        jobs=[
            job_info(
                "gpt", stages=26, params=1234567, step=120, bytes=3 * 2**20, optimizer_s=1.234, last_snapshot=100,
                steps_per_s=2.5, workers=[m.WorkerInfo(id=0, shm=True, first_step=0, idle_s=0.1)],
                lr=3e-4, grad_norm=1.23456,
            ),
            job_info("a-much-longer-name", ready=False, optimizer="SGD", bytes=2**20),
            job_info("cut", stages=1000, units=9),
        ],
    )
    assert format_status(st, "tcp://h:5555").splitlines() == [
        "server tcp://h:5555  pid 42  protocol 2  up 12 s  memory 3.00 MiB of 1.00 GiB",
        "job                 state     step  steps/s  workers    memory  snapshot          stages     params  optimizer      lr  grad-norm  opt-time",
        "gpt                 ready      120     2.50        1  3.00 MiB       100              26  1,234,567  AdamW      0.0003      1.235     1.23s",
        "a-much-longer-name  creating     0     0.00        0  1.00 MiB         -               1         10  SGD             -          -     0.00s",
        "cut                 ready        0     0.00        0  1.00 KiB         -  1000 (9 units)         10  AdamW           -          -     0.00s",
    ]
    empty = m.StatusReply(id=1, protocol=2, pid=42, uptime_s=1, memory_limit=2**30, memory_used=0, jobs=[])
    assert format_status(empty, "ipc:///s").splitlines()[1:] == ["no jobs"]


def test_jobs_lists_names_and_steps(server: ServerProcess, client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "--server", server.address]) == 0
    assert capsys.readouterr().out == ""
    job = client.create_job("first", models.mixed(), optimizer=AdamW(), token="t")
    client.create_job("second-job", models.mixed(), optimizer=AdamW(), token="t")
    with job.trainer() as tr:
        for s in range(2):
            tr.step(*models.batch("mixed", s), models.loss_fn)
    assert main(["jobs", "--server", server.address]) == 0
    assert capsys.readouterr().out.splitlines() == ["first       2", "second-job  0"]
    assert main(["jobs", "--server", server.address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"name": "first", "step": 2, "ready": True},
        {"name": "second-job", "step": 0, "ready": True},
    ]


def test_both_commands_say_their_version_and_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    from wstream.protocol import PROTOCOL_VERSION
    from wstream.server.cli import build_parser as server_parser

    for parser in (build_parser(), server_parser()):
        with pytest.raises(SystemExit) as done:
            parser.parse_args(["--version"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert f"(protocol {PROTOCOL_VERSION})" in out and out.split()[0] in ("wstream", "wstream-server")


def test_export_to_a_folder_that_does_not_exist_fails_before_pulling_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # no server at this address: the destination is checked first, so nothing is even asked
    monkeypatch.setenv("WSTREAM_TOKEN", "t")
    out = tmp_path / "no" / "such" / "dir" / "w.safetensors"
    argv = ["export", "j", "--out", str(out), "--server", f"ipc://{tmp_path}/nobody.sock"]
    assert main(argv) == 2
    assert f"cannot write {out}: the directory {out.parent} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf", "soon"])
def test_a_timeout_that_is_no_positive_number_of_seconds_is_refused(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect seen: ``--timeout nan`` ended in "cannot convert float NaN to integer", and 0 or -1 in
    "did not answer within -1 s"."""
    with pytest.raises(SystemExit) as exit_:
        main(["status", "--server", "ipc:///nonexistent", "--timeout", timeout])
    assert exit_.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_an_address_zeromq_cannot_use_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """Defect seen: ``wstream jobs --server foo://x`` ended in a ZMQError traceback."""
    assert main(["jobs", "--server", "foo://x", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot use the server address 'foo://x'" in err and "tcp://HOST:PORT" in err


@pytest.mark.parametrize("out", ["dir", ""])
def test_export_to_a_directory_or_to_nothing_fails_before_pulling_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, out: str
) -> None:
    """Found by review: ``--out`` naming an existing directory (or empty) pulled every weight, then
    ended in a SafetensorError traceback."""
    monkeypatch.setenv("WSTREAM_TOKEN", "t")
    target = str(tmp_path) if out == "dir" else ""
    assert main(["export", "j", "--out", target, "--server", f"ipc://{tmp_path}/nobody.sock"]) == 2
    assert f"--out {target!r} is {'a directory' if out else 'empty'}" in capsys.readouterr().err


def test_status_json_is_strict_json_after_a_skipped_step(
    server: ServerProcess, client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: after a step with a non-finite gradient, ``--json`` printed
    ``"grad_norm": NaN``, which strict JSON parsers (the monitoring scripts ``--json`` is for)
    refuse. Numbers that are not finite are null."""
    import torch
    from torch import nn

    job = client.create_job("inf", [nn.Linear(2, 2)], optimizer=AdamW(), token="t")
    with job.trainer() as trainer:
        # sqrt's gradient at 0 is infinite: the step is skipped, and its norm is not finite
        trainer.step(torch.ones(1, 2), torch.zeros(1, 2), lambda out, y: torch.sqrt(out - out.detach()).sum())
    assert main(["status", "--server", server.address, "--json"]) == 0

    def refuse(token: str) -> None:
        raise AssertionError(f"not JSON: {token}")

    (info,) = json.loads(capsys.readouterr().out, parse_constant=refuse)["jobs"]
    assert info["name"] == "inf" and info["grad_norm"] is None


def test_an_explicit_token_file_wins_over_the_environments_admin_secret(
    server: ServerProcess, client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by review: with ``$WSTREAM_ADMIN_SECRET_FILE`` set (for other servers), ``--token-file``
    was ignored and the command failed "this server has no admin secret"."""
    client.create_job("tok", models.mixed(), optimizer=AdamW(), token="t")
    (tmp_path / "token").write_text("t\n")
    secret = tmp_path / "admin"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    monkeypatch.setenv("WSTREAM_ADMIN_SECRET_FILE", str(secret))
    out = tmp_path / "w.safetensors"
    given = ["--server", server.address, "--token-file", str(tmp_path / "token")]
    assert main(["export", "tok", *given, "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.exists()
    # (found by a second review: the commands that ask the Client for its secret still read the variable)
    assert main(["schedule", "tok", *given, "--lr", "0.5"]) == 0, capsys.readouterr().err
    assert main(["save", "tok", *given]) == 0 or "no store" in capsys.readouterr().err
    assert main(["drop", "tok", *given]) == 0, capsys.readouterr().err


def test_save_refuses_a_wait_that_is_no_positive_number_of_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: ``--wait nan`` failed after sending the save, and ``--wait 0`` reported a
    failure for a snapshot the server then took."""
    for wait in ("nan", "0", "-5"):
        with pytest.raises(SystemExit) as exit_:
            main(["save", "j", "--server", "ipc:///nonexistent", "--wait", wait])
        assert exit_.value.code == 2 and "--wait" in capsys.readouterr().err


def test_ctrl_c_is_no_traceback(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: Ctrl-C during any command printed a KeyboardInterrupt traceback."""
    from wstream.client import admin

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(admin, "_jobs", interrupted)
    assert main(["jobs", "--server", "ipc:///nonexistent"]) == 130
    assert capsys.readouterr().err == "wstream: interrupted\n"


def test_an_ipv6_loopback_endpoint_is_served_and_reached(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: ``tcp://[::1]:PORT`` failed "No such device" (ZeroMQ's IPV6 option was
    never set), although the configuration counts ``::1`` as loopback."""
    import socket

    from wstream.server.inprocess import InProcessServer

    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
        probe.close()
    except OSError:
        pytest.skip("this host has no IPv6 loopback")
    with InProcessServer(bind=[f"tcp://[::1]:{port}"]) as srv:
        assert main(["jobs", "--server", f"tcp://[::1]:{port}", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == []
        assert srv.address == f"tcp://[::1]:{port}"
