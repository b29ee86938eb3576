"""Where a client finds its server: the connection flags every command line shares (``wstream``'s
commands and the examples'), and ``$WSTREAM_SERVER``, ``$WSTREAM_TOKEN`` and
``$WSTREAM_SERVER_KEY`` read by ``Client()`` and by every command when no argument is given (an
explicit one wins). The commands run as real processes against a real CURVE server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import models
from conftest import HERE, ServerProcess, ServerThread, free_tcp_address, start_server
from wstream.client import AdamW, AuthError, Client
from wstream.client.admin import main
from wstream.protocol.curve import ENV_CLIENT_KEY, ENV_SERVER_KEY, write_keypair
from wstream.protocol.shm import segment_paths

ENV = ("WSTREAM_SERVER", "WSTREAM_TOKEN", ENV_SERVER_KEY, ENV_CLIENT_KEY)
COMMANDS = ("status", "jobs", "save", "export", "schedule", "drop", "shutdown")  # every command that connects
JOB_COMMANDS = ("save", "export", "schedule", "drop")
EXAMPLES = HERE.parent / "examples"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of the test runner's environment reaches a client here unless a test sets it."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def flat(text: str) -> str:
    """``--help`` output with its line wrapping undone."""
    return " ".join(text.split())


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return flat(capsys.readouterr().out)


def test_every_command_that_connects_takes_the_same_flags_and_names_their_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in COMMANDS:
        text = help_of([command, *(["JOB"] if command in JOB_COMMANDS else [])], capsys)
        for flag in ("--server ADDR", "--server-key FILE", "--client-key FILE", "--timeout SECONDS"):
            assert flag in text, (command, flag, text)
        assert "(default: $WSTREAM_SERVER, else tcp://127.0.0.1:5555)" in text, (command, text)
        assert "(default: $WSTREAM_SERVER_KEY)" in text and "(default: $WSTREAM_CLIENT_KEY)" in text, (command, text)
        if command in JOB_COMMANDS:
            assert "--token-file FILE" in text and "(default: $WSTREAM_TOKEN)" in text, (command, text)
        if command in (*JOB_COMMANDS, "shutdown"):
            assert "--admin-secret-file FILE" in text, (command, text)


@pytest.mark.parametrize("script", ["train_gpt.py", "hf_finetune.py", "concepts.py"])
def test_the_examples_take_the_same_connection_flags(script: str) -> None:
    if script == "hf_finetune.py":
        pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = flat(proc.stdout)
    for flag in ("--server ADDR", "--server-key FILE", "--client-key FILE", "--token-file FILE", "--timeout SECONDS"):
        assert flag in text, (script, flag, text)
    assert "(default: $WSTREAM_SERVER, else " in text and "$WSTREAM_TOKEN" in text and "$WSTREAM_SERVER_KEY" in text


def wstream(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``wstream ARGV`` as a process with ``env`` added to a clean environment."""
    base = {k: v for k, v in os.environ.items() if k not in ENV}
    return subprocess.run(
        [sys.executable, "-m", "wstream.client.admin", *argv], capture_output=True, text=True, env={**base, **env}, timeout=120
    )


def test_the_commands_find_the_server_its_key_and_the_token_in_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    server_public, server_secret = write_keypair(keys, "server")
    other_public, _ = write_keypair(keys, "other")
    address = free_tcp_address()
    srv = start_server(
        tmp_path, "--curve-secret-key", server_secret, "--memory-limit", "1GiB",
        address=address, client_options={"server_public_key": server_public},
    )
    try:
        with Client(address, timeout=30, server_public_key=server_public) as client:
            client.create_job("from-env", models.mixed(), optimizer=AdamW(), token="env-token")
        env = {"WSTREAM_SERVER": address, ENV_SERVER_KEY: server_public}
        jobs = wstream("jobs", "--timeout", "30", env=env)
        assert (jobs.returncode, jobs.stdout) == (0, "from-env  0\n"), jobs.stderr
        status = wstream("status", "--timeout", "30", env=env)
        assert status.returncode == 0 and f"server {address}" in status.stdout, status.stderr
        out = tmp_path / "w.safetensors"
        export = wstream("export", "from-env", "--out", str(out), "--timeout", "30", env={**env, "WSTREAM_TOKEN": "env-token"})
        assert export.returncode == 0 and out.exists(), export.stderr

        # a flag wins over the environment: the server and its key
        wrong = {"WSTREAM_SERVER": f"ipc://{tmp_path}/nobody.sock", ENV_SERVER_KEY: other_public}
        jobs = wstream("jobs", "--server", address, "--server-key", server_public, "--timeout", "30", env=wrong)
        assert (jobs.returncode, jobs.stdout) == (0, "from-env  0\n"), jobs.stderr
        # and the token file over $WSTREAM_TOKEN
        token = tmp_path / "token"
        token.write_text("env-token\n")
        drop = wstream("drop", "from-env", "--token-file", str(token), "--timeout", "30", env={**env, "WSTREAM_TOKEN": "no"})
        assert drop.returncode == 0 and "dropped" in drop.stdout, drop.stderr
    finally:
        stop(srv)


def stop(srv: ServerProcess) -> None:
    rc = srv.stop()
    assert rc == 0, f"server exited with {rc}\n{srv.log()}"
    assert not segment_paths(srv.proc.pid), f"server left shared-memory segments\n{srv.log()}"


def test_client_finds_the_server_the_token_and_the_key_in_the_environment(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with Client() as nowhere:
        assert nowhere.address == "tcp://127.0.0.1:5555"
    with Client(server.address) as client, pytest.raises(ValueError, match=r"no job token: give token= or set \$WSTREAM_TOKEN"):
        client.create_job("j", [nn.Linear(2, 2)])

    monkeypatch.setenv("WSTREAM_SERVER", server.address)
    monkeypatch.setenv("WSTREAM_TOKEN", "env-token")
    with Client() as client:
        assert client.address == server.address
        job = client.create_job("env", models.mixed(), optimizer=AdamW())
        with job.trainer() as trainer:  # the trainer proves its sessions with the same token
            trainer.step(*models.batch("mixed", 0), models.loss_fn)
        assert client.attach_job("env").name == "env"
        with pytest.raises(AuthError, match="wrong token"):  # an explicit token wins
            client.attach_job("env", token="other")
        client.set_schedule("env", lr=1e-4)  # the job's token, where no admin secret is given
        client.drop_job("env")
        assert client.status().jobs == []
    with Client(f"ipc://{tmp_path}/elsewhere.sock") as explicit:  # an explicit address wins
        assert explicit.address == f"ipc://{tmp_path}/elsewhere.sock"

    public, _ = write_keypair(tmp_path / "keys", "server")
    monkeypatch.setenv("WSTREAM_SERVER", "tcp://127.0.0.1:5555")
    monkeypatch.setenv(ENV_SERVER_KEY, public)
    with Client() as encrypted:
        assert encrypted.curve is not None and encrypted.curve.ephemeral
