"""CURVE encryption of tcp connections: training through it, clients without the right keys,
authorized client keys, what a relay on the wire sees, and configuration errors.

Servers listen on loopback tcp (CURVE applies to tcp, never to ipc); clients' timeouts are short
because a failed CURVE handshake is answered by silence.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import models
import pytest
import torch
from conftest import ServerProcess, free_tcp_address, run_workers, start_server
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import AdamW, Client, ServerUnavailable, admin
from wstream.protocol.curve import ENV_CLIENT_KEY, ENV_SERVER_KEY, client_keys, write_keypair
from wstream.protocol.shm import segment_paths
from wstream.server.cli import build_parser, config_from_args
from wstream.server.config import ServerConfig

NO_ANSWER_S = 1.5  # the timeout of clients expected to get no answer


@dataclass
class Keys:
    server_public: str
    server_secret: str
    client_public: str
    client_secret: str
    other_public: str  # a keypair the server has never heard of
    other_secret: str
    authorized: str  # a directory holding client_public only


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    d = tmp_path / "keys"
    server = write_keypair(d, "server")
    client = write_keypair(d, "client")
    other = write_keypair(d, "other")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_bytes(Path(client[0]).read_bytes())
    return Keys(*server, *client, *other, str(authorized))


@pytest.fixture(autouse=True)
def no_keys_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients here get their keys explicitly, unless a test sets these itself."""
    monkeypatch.delenv(ENV_SERVER_KEY, raising=False)
    monkeypatch.delenv(ENV_CLIENT_KEY, raising=False)


def curve_server(tmp_path: Path, keys: Keys, *extra: str, authorized: bool = False) -> ServerProcess:
    options = {"server_public_key": keys.server_public, "client_secret_key": keys.client_secret}
    args = ["--curve-secret-key", keys.server_secret, "--memory-limit", "2GiB", *extra]
    if authorized:
        args += ["--curve-authorized-keys", keys.authorized]
    return start_server(tmp_path, *args, address=free_tcp_address(), client_options=options)


def stop(srv: ServerProcess) -> None:
    rc = srv.stop()
    log = srv.log()
    assert rc == 0, f"server exited with {rc}\n{log}"
    assert not segment_paths(srv.proc.pid), f"server left shared-memory segments\n{log}"
    assert "Traceback" not in log and " ERROR " not in log, log


def train_and_check(client: Client, name: str, steps: int, *, seed: int) -> None:
    """Create job ``name``, train ``steps`` steps in this process with weights and gradients as
    data frames (over the socket), and compare with plain PyTorch."""
    stages = models.mixed(seed=seed)
    start = copy.deepcopy(stages)
    job = client.create_job(name, stages, optimizer=AdamW(lr=3e-3), token=f"{name}-token")
    with job.trainer(shm=False) as trainer:
        for s in range(steps):
            trainer.step(*models.batch("mixed", s), models.loss_fn)
    want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3), "mixed", steps)
    assert_weights_equal(job.state_dict(), want, atol=1e-6)


def test_a_curve_client_trains_to_the_weights_of_plain_pytorch(tmp_path: Path, keys: Keys) -> None:
    srv = curve_server(tmp_path, keys)
    try:
        assert "CURVE, any client with the server's public key" in srv.log()
        stages = models.mixed(seed=2)
        start = copy.deepcopy(stages)
        with Client(srv.address, timeout=30, server_public_key=keys.server_public) as client:
            assert client.curve is not None and client.curve.ephemeral
            job = client.create_job("enc", stages, optimizer=AdamW(lr=3e-3), token="enc-token")
            with job.trainer(shm=False) as trainer:  # weights and gradients cross the encrypted socket
                for s in range(3):
                    trainer.step(*models.batch("mixed", s), models.loss_fn)
            # a worker process that knows the key from the environment trains three more steps
            env = {ENV_SERVER_KEY: keys.server_public, ENV_CLIENT_KEY: keys.client_secret}
            run_workers(srv.address, "enc", "enc-token", "mixed", 3, 1, tmp_path, env=env)
            got = job.state_dict()
        want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3), "mixed", 6)
        assert_weights_equal(got, want, atol=1e-6)
    finally:
        stop(srv)


def test_b_clients_without_the_right_server_key_get_a_clear_error_and_the_server_serves_on(
    tmp_path: Path, keys: Keys
) -> None:
    ipc = f"ipc://{tmp_path / 'local.sock'}"
    srv = curve_server(tmp_path, keys, "--bind", ipc)
    try:
        log = srv.log()
        assert "CURVE, any client with the server's public key" in log and f"{ipc} (plaintext" in log, log
        with Client(srv.address, timeout=30, **srv.client_options) as good:
            stages = models.mixed(seed=4)
            start = copy.deepcopy(stages)
            job = good.create_job("served", stages, optimizer=AdamW(lr=3e-3), token="served-token")
            with job.trainer(shm=False) as trainer:
                trainer.step(*models.batch("mixed", 0), models.loss_fn)
                with Client(srv.address, timeout=NO_ANSWER_S) as plain:
                    with pytest.raises(ServerUnavailable, match="CURVE") as exc:
                        plain.status()
                assert "did not answer" in exc.value.message and ENV_SERVER_KEY in exc.value.message
                with Client(srv.address, timeout=NO_ANSWER_S, server_public_key=keys.other_public) as wrong:
                    with pytest.raises(ServerUnavailable, match="check that it is the server's public key"):
                        wrong.status()
                # the same ROUTER socket answers plaintext on its ipc endpoint (keys are not used there)
                with Client(ipc, timeout=30, server_public_key=keys.other_public) as local:
                    assert local.curve is None and local.status().jobs[0].name == "served"
                for s in range(1, 3):
                    trainer.step(*models.batch("mixed", s), models.loss_fn)
            got = job.state_dict()
        want = reference_train(start, lambda p: torch.optim.AdamW(p, lr=3e-3), "mixed", 3)
        assert_weights_equal(got, want, atol=1e-6)
    finally:
        stop(srv)


def test_c_authorized_keys_admit_only_the_clients_listed(
    tmp_path: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = curve_server(tmp_path, keys, authorized=True)
    try:
        assert f"CURVE, only clients of {keys.authorized}" in srv.log()
        with Client(srv.address, timeout=30, **srv.client_options) as good:
            train_and_check(good, "listed", 2, seed=6)
        other = {"server_public_key": keys.server_public, "client_secret_key": keys.other_secret}
        with Client(srv.address, timeout=NO_ANSWER_S, **other) as refused:
            with pytest.raises(ServerUnavailable, match="is in that directory"):
                refused.status()
        with Client(srv.address, timeout=NO_ANSWER_S, server_public_key=keys.server_public) as temporary:
            with pytest.raises(ServerUnavailable, match="temporary key"):
                temporary.status()
        other_key = Path(keys.other_public).read_text().split('public-key = "')[1].split('"')[0]
        wait_for_log(srv, f"refused a CURVE connection: client key {other_key} is not in {keys.authorized}")
        # the admin command with the authorized client's key files
        argv = ["status", "--server", srv.address, "--server-key", keys.server_public]
        assert admin.main([*argv, "--client-key", keys.client_secret]) == 0
        assert "listed" in capsys.readouterr().out
        assert admin.main([*argv, "--client-key", keys.other_secret, "--timeout", str(NO_ANSWER_S)]) == 1
        assert "is in that directory" in capsys.readouterr().err
    finally:
        stop(srv)


def wait_for_log(srv: ServerProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in srv.log():
        assert time.monotonic() < deadline, f"{text!r} not in the server log within {timeout} s:\n{srv.log()}"
        time.sleep(0.05)


class Relay:
    """A TCP relay from a loopback port to the server that keeps every byte it forwards, per
    connection and direction (so a string split across two reads is still found)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self.streams: list[bytearray] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [downstream, upstream]
            for src, dst in ((downstream, upstream), (upstream, downstream)):
                seen = bytearray()
                with self._lock:
                    self.streams.append(seen)
                threading.Thread(target=self._pump, args=(src, dst, seen), daemon=True, name="relay-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket, seen: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def contains(self, needle: bytes) -> bool:
        with self._lock:
            return any(needle in stream for stream in self.streams)

    def total(self) -> int:
        with self._lock:
            return sum(len(stream) for stream in self.streams)

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()


@pytest.mark.parametrize("curve", [True, False], ids=["curve", "plaintext-control"])
def test_d_a_relay_on_the_wire_sees_no_token_name_or_weights_with_curve(
    tmp_path: Path, keys: Keys, curve: bool
) -> None:
    if curve:
        srv = curve_server(tmp_path, keys)
    else:
        srv = start_server(tmp_path, "--memory-limit", "2GiB", address=free_tcp_address())
    relay = Relay(srv.address)
    name, token = "confidential-job-7f3a91", "token-c0ffee-5eb2d4e1"
    stages = models.mixed(seed=9)
    weight_bytes = stages[1].up.weight.detach().numpy().tobytes()[:256]  # uploaded by add_stage
    try:
        with Client(relay.address, timeout=30, **srv.client_options) as client:
            job = client.create_job(name, stages, optimizer=AdamW(lr=3e-3), token=token)
            with job.trainer(shm=False) as trainer:  # weights and gradients as data frames
                for s in range(2):
                    trainer.step(*models.batch("mixed", s), models.loss_fn)
            trained = job.state_dict()["1.up.weight"].numpy().tobytes()[:256]  # pulled back
    finally:
        relay.close()
        stop(srv)
    model_bytes = sum(p.numel() * 4 for s in models.mixed() for p in s.parameters())
    assert relay.total() > 2 * model_bytes, "the relay did not see the traffic"
    needles = {
        "job name": name.encode(),
        "token": token.encode(),
        "initial weights": weight_bytes,
        "trained weights": trained,
    }
    found = {what: relay.contains(needle) for what, needle in needles.items()}
    if curve:
        assert not any(found.values()), f"readable on the wire with CURVE: {found}"
    else:  # the control: the same search finds them all in plaintext
        assert all(found.values()), f"not found on a plaintext wire: {found}"


def test_e_configuration_errors_name_the_file(tmp_path: Path, keys: Keys) -> None:
    rx = re.escape
    missing = str(tmp_path / "nope.key_secret")
    with pytest.raises(ValueError, match=f"cannot read {rx(missing)}"):
        ServerConfig(curve_secret_key_file=missing)
    os.chmod(keys.server_secret, 0o644)
    with pytest.raises(ValueError, match=rf"{rx(keys.server_secret)} is readable .* by group or others .*chmod 600"):
        ServerConfig(curve_secret_key_file=keys.server_secret)
    os.chmod(keys.server_secret, 0o600)
    os.chmod(keys.server_public, 0o600)
    with pytest.raises(ValueError, match=f"{rx(keys.server_public)} is a public certificate"):
        ServerConfig(curve_secret_key_file=keys.server_public)
    with pytest.raises(ValueError, match="needs curve_secret_key_file"):
        ServerConfig(curve_authorized_keys_dir=keys.authorized)
    with pytest.raises(ValueError, match=f"{rx(str(tmp_path / 'absent'))} is not a directory"):
        ServerConfig(curve_secret_key_file=keys.server_secret, curve_authorized_keys_dir=str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no public certificate"):
        ServerConfig(curve_secret_key_file=keys.server_secret, curve_authorized_keys_dir=str(tmp_path / "empty"))
    args = ["--curve-secret-key", keys.server_secret, "--curve-authorized-keys", keys.authorized]
    config = config_from_args(build_parser().parse_args(args))
    assert (config.curve_secret_key_file, config.curve_authorized_keys_dir) == (keys.server_secret, keys.authorized)
    # the client's side: key files as for the server, a z85 key given as such
    os.chmod(keys.client_secret, 0o640)
    with pytest.raises(ValueError, match=f"{rx(keys.client_secret)} is readable"):
        Client("tcp://127.0.0.1:1", server_public_key=keys.server_public, client_secret_key=keys.client_secret)
    with pytest.raises(ValueError, match="without the server's public key"):
        Client("tcp://127.0.0.1:1", client_secret_key=keys.other_secret)
    with pytest.raises(ValueError, match="no such certificate file"):
        Client("tcp://127.0.0.1:1", server_public_key=str(tmp_path / "server.key"))
    z85 = client_keys(keys.server_public, None).server_public
    assert client_keys(z85.decode(), None).server_public == client_keys(z85, None).server_public == z85
    # 'wstream keys' never overwrites, and its secret file is private
    with pytest.raises(FileExistsError):
        write_keypair(Path(keys.server_public).parent, "server")
    assert admin.main(["keys", str(tmp_path / "new"), "--name", "n1"]) == 0
    assert os.stat(tmp_path / "new" / "n1.key_secret").st_mode & 0o777 == 0o600
    # the server refuses to start, naming the file
    os.chmod(keys.server_secret, 0o604)
    cmd = [sys.executable, "-m", "wstream.server", "--bind", free_tcp_address()]
    cmd += ["--curve-secret-key", keys.server_secret]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and f"{keys.server_secret} is readable" in proc.stderr, proc.stderr
