"""Protocol 2 authentication: challenge-response attach, signed requests, the admin secret.

Raw frames come from ``rawwire`` (hand-made handshakes and signatures); every refusal must leave
the server serving a job that trains beside it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import models
import msgpack
import msgspec
import pytest
import torch
from safetensors.torch import load_file
from conftest import HERE, ServerProcess, start_server
from rawwire import RawPeer
from torch import nn
from wstream.client import (
    AdamW,
    AuthError,
    Client,
    MemoryLimitError,
    StateError,
    UnknownJobError,
)
from wstream.protocol import messages as m
from wstream.protocol.auth import create_proof, secret_key
from wstream.protocol.shm import segment_paths
from wstream.server.auth import NonceStore, ReplayWindow
from wstream.server.inprocess import InProcessServer

TOKEN = "tok-6f1d2b-very-secret"


def _start_worker(address: str, job: str, token: str, steps: int, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / f"{job}.json"
    with open(tmp_path / f"{job}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "worker_main.py"), address, job, token, "mixed", str(steps), "0", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, out


def _finish_worker(proc: subprocess.Popen[bytes], out: Path, steps: int) -> None:
    rc = proc.wait(timeout=240)
    assert rc == 0, (out.parent / f"{out.stem}.log").read_text()
    assert len(json.loads(out.read_text())["losses"]) == steps


@pytest.mark.server_process  # raw ZeroMQ peers on the wire
def test_the_token_never_travels_after_creation(server: ServerProcess, client: Client) -> None:
    client.create_job("quiet", models.mixed(seed=1), optimizer=AdamW(), token=TOKEN, unit_bytes=None)  # pulls stage 1 raw
    peer = RawPeer(server.address)
    try:
        s = peer.attach("quiet", TOKEN)
        assert s.request("join", shm=False)[0]["op"] == "joined"
        reply, frames = s.request("fetch", stage=0, step=0)
        assert reply["op"] == "weights" and frames
        assert s.request("heartbeat")[0]["op"] == "ok"
        assert s.request("pull", stage=1)[0]["op"] == "master"
        assert s.request("leave")[0]["op"] == "ok"
        wire = b"".join(peer.sent + peer.received)
        assert len(peer.sent) >= 7 and len(wire) > 1000
        for secret in (TOKEN.encode(), hashlib.sha256(TOKEN.encode()).digest(), s.key):
            assert secret not in wire
    finally:
        peer.close()


def test_forged_replayed_and_stale_requests_are_refused_while_a_job_trains(tmp_path: Path) -> None:
    ttl = 0.5
    srv = start_server(tmp_path, "--nonce-ttl", str(ttl))
    steps = 6
    try:
        with Client(srv.address, timeout=30) as client:
            _refusals_beside_a_training_job(srv, client, ttl, steps, tmp_path)
    finally:
        assert srv.stop() == 0


def _refusals_beside_a_training_job(srv: ServerProcess, client: Client, ttl: float, steps: int, tmp_path: Path) -> None:
    client.create_job("busy", models.mixed(seed=3), optimizer=AdamW(), token="busy-token")
    worker, out = _start_worker(srv.address, "busy", "busy-token", steps, tmp_path)
    client.create_job("victim", models.mixed(seed=4), optimizer=AdamW(), token=TOKEN)
    peer = RawPeer(srv.address)
    try:

        def refused(reply: dict, words: str) -> None:
            assert reply["op"] == "error" and reply["code"] == "auth_failed", reply
            assert words in reply["message"], reply["message"]

        # the handshake: a wrong proof, a reused, an expired and a made-up nonce
        refused(peer.try_attach("victim", "not-the-token")[0], "wrong token")
        nonce = peer.nonce()
        assert peer.try_attach("victim", TOKEN, nonce=nonce)[0]["op"] == "attached"
        refused(peer.try_attach("victim", TOKEN, nonce=nonce)[0], "already used nonce")
        nonce = peer.nonce()
        time.sleep(3 * ttl)  # nothing to wait on: the nonce's lifetime must pass
        # "expired nonce", or the generic refusal when a later hello already pruned it
        refused(peer.try_attach("victim", TOKEN, nonce=nonce)[0], "expired")
        refused(peer.try_attach("victim", TOKEN, nonce=os.urandom(32))[0], "unknown")
        nonce = peer.nonce()  # a wrong proof uses the nonce up: one guess per nonce
        refused(peer.try_attach("victim", "guess", nonce=nonce)[0], "wrong token")
        refused(peer.try_attach("victim", TOKEN, nonce=nonce)[0], "already used nonce")

        s = peer.attach("victim", TOKEN)
        other = peer.attach("victim", TOKEN)
        busy = peer.attach("busy", "busy-token")
        assert s.request("join", shm=True)[0]["op"] == "joined"
        # signed with a random key, with another session's key, with another job's key
        for key in (os.urandom(32), other.key, busy.key):
            refused(peer.send_frames([s.header("heartbeat", key=key)])[0], "bad mac")
        # altered after signing
        header = msgpack.unpackb(s.header("fetch", stage=0, step=0))
        header["stage"] = 1
        refused(peer.send_frames([msgpack.packb(header)])[0], "bad mac")
        # a session's signature moved onto another session id
        header = msgpack.unpackb(other.header("heartbeat"))
        header["session"] = s.session
        refused(peer.send_frames([msgpack.packb(header)])[0], "bad mac")
        # replayed: the same signed bytes twice, and an old seq signed anew
        header = s.header("heartbeat")
        assert peer.send_frames([header])[0]["op"] == "ok"
        refused(peer.send_frames([header])[0], "replayed")
        assert s.request("heartbeat", seq=100_000)[0]["op"] == "ok"
        assert s.request("heartbeat", seq=99_000)[0]["op"] == "ok"  # late, inside the window
        refused(s.request("heartbeat", seq=99_000)[0], "replayed")
        refused(s.request("heartbeat", seq=100_000 - 65_536)[0], "too old")
        refused(s.request("heartbeat", seq=0)[0], "seq must be > 0")
        s.seq = 100_001
        assert s.request("fetch", stage=0, step=0)[0]["op"] == "weights"  # the session still works
    finally:
        peer.close()
    _finish_worker(worker, out, steps)
    assert {j.name: j.step for j in client.status().jobs}["busy"] == steps


@pytest.mark.server_process  # raw ZeroMQ peers on the wire
def test_without_an_admin_secret_a_job_session_manages_only_its_own_job(server: ServerProcess, client: Client) -> None:
    a = client.create_job("a", [nn.Linear(4, 4)], token="ta")
    client.create_job("b", [nn.Linear(4, 4)], token="tb")
    peer = RawPeer(server.address)
    try:
        reply, _ = peer.admin_attach("anything")
        assert reply["code"] == "auth_failed" and "no admin secret" in reply["message"]
        s = peer.attach("a", "ta")
        reply, _ = s.request("drop_job", job="b")
        assert reply["code"] == "auth_failed" and "cannot drop job 'b'" in reply["message"]
        reply, _ = s.request("shutdown")
        assert reply["code"] == "auth_failed" and "admin session" in reply["message"]
    finally:
        peer.close()
    with Client(server.address, admin_secret="guess") as admin, pytest.raises(AuthError, match="no admin secret"):
        admin.shutdown()
    a.drop()
    client.drop_job("b", token="tb")
    assert client.status().jobs == []


def _secret_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / "admin-secret"
    path.write_text("admin-s3cret\n")
    os.chmod(path, mode)
    return path


def test_admin_operations_need_the_admin_secret(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path, 0o600)
    srv = start_server(
        tmp_path, "--admin-secret-file", str(secret), "--store", str(tmp_path / "store"), "--memory-limit", "3MiB"
    )
    try:
        with Client(srv.address, timeout=30) as c, Client(srv.address, admin_secret="admin-s3cret") as creator:
            creator.create_job("j", models.mixed(seed=5), optimizer=AdamW(), token="t")
            # a failed creation still cleans up after itself (its session drops the unsealed job)
            with pytest.raises(MemoryLimitError):
                creator.create_job("growing", (nn.Linear(256, 256) for _ in range(10)), token="x")
            assert [j.name for j in c.status().jobs] == ["j"]
            plain = c.attach_job("j", token="t")  # a handle of a client without the secret (the creator's uses it)
            with pytest.raises(AuthError, match="admin secret"):
                plain.drop()
            with pytest.raises(AuthError, match="admin secret"):
                plain.save()
            with pytest.raises(StateError, match="admin_secret"):
                c.shutdown()
            with pytest.raises(AuthError, match="admin secret"):
                c.drop_job("j", token="t")
        peer = RawPeer(srv.address)
        try:
            reply, _ = peer.admin_attach("wrong")
            assert reply["code"] == "auth_failed" and "wrong admin secret" in reply["message"]
            reply, s = peer.admin_attach("admin-s3cret")
            assert reply["op"] == "admin_attached" and s is not None
            reply, _ = s.request("fetch", stage=0, step=0)
            assert reply["code"] == "bad_state" and "admin session has no job" in reply["message"]
            reply, _ = s.request("drop_job")
            assert reply["code"] == "bad_state" and "name the job" in reply["message"]
        finally:
            peer.close()
        other = Client(srv.address, admin_secret="admin-s3cret", timeout=30).create_job("other", [nn.Linear(3, 3)], token="o")
        with pytest.raises(AuthError, match="cannot read job 'j'"):  # a job session reads only its own job
            other.client._chan.request(m.Pull(session=other.session, stage=0, job="j"), m.Master)
        other.client.close()
        cli = [sys.executable, "-m", "wstream.client.admin"]
        common = ["--server", srv.address, "--admin-secret-file", str(secret)]
        out = tmp_path / "j.safetensors"  # export with the admin secret: no job token needed
        r = subprocess.run([*cli, "export", "j", *common, "--out", str(out)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        want = nn.Sequential(*models.mixed(seed=5)).state_dict()
        got = load_file(out)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        with Client(srv.address, admin_secret="admin-s3cret", timeout=30) as admin:
            with pytest.raises(UnknownJobError, match="no job named 'ghost'"):
                admin.export_job("ghost", tmp_path / "ghost.safetensors")
            admin.drop_job("other")
            step, path = admin.save_job("j")
            assert step == 0 and Path(path).is_dir()
            admin.drop_job("j")
            assert admin.status().jobs == []
            with pytest.raises(UnknownJobError, match="no job named 'j'"):
                admin.drop_job("j")
            admin.create_job("k", [nn.Linear(4, 4)], token="t")
        r = subprocess.run([*cli, "drop", "k", *common], capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0 and "dropped" in r.stdout, r.stdout + r.stderr
        r = subprocess.run([*cli, "shutdown", *common], capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0 and "shutting down" in r.stdout, r.stdout + r.stderr
        assert srv.proc.wait(timeout=30) == 0, srv.log()
        assert "shutdown requested by an admin session" in srv.log()
        assert not segment_paths(srv.proc.pid)
    finally:
        srv.stop()


def test_creating_a_job_needs_the_admin_secret_where_the_server_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = _secret_file(tmp_path, 0o600)
    with InProcessServer(admin_secret_file=str(secret), memory_limit=2**28) as srv:
        with Client(srv.address, timeout=30) as anyone:
            with pytest.raises(AuthError, match="has an admin secret: creating job 'j' needs it"):
                anyone.create_job("j", [nn.Linear(4, 4)], token="t")
            assert anyone.status().jobs == []
        with Client(srv.address, admin_secret="guess", timeout=30) as guesser:
            with pytest.raises(AuthError, match="wrong admin secret"):
                guesser.create_job("j", [nn.Linear(4, 4)], token="t")
        with Client(srv.address, admin_secret="admin-s3cret", timeout=30) as admin:
            admin.create_job("j", [nn.Linear(4, 4)], token="t")
        with Client(srv.address, timeout=30) as rank:  # a restarted rank attaches without the admin secret
            assert rank.create_job("j", [nn.Linear(4, 4)], token="t", exist_ok=True).num_stages == 1
            with pytest.raises(AuthError, match="admin secret"):  # dropping needs it too
                rank.drop_job("j", token="t")
        peer = RawPeer(srv.address)
        try:  # a creation proof is good for one name and one nonce
            nonce, mine = peer.nonce(), os.urandom(32)
            options = msgspec.to_builtins(m.JobOptions())
            proof = create_proof(secret_key("admin-s3cret"), "other-name", nonce, mine)
            reply, _ = peer.request("create_job", name="x", token="t", nonce=nonce, client_nonce=mine, options=options,
                                    admin_proof=proof)
            assert reply["code"] == "auth_failed" and "wrong admin secret" in reply["message"], reply
        finally:
            peer.close()
        monkeypatch.setenv("WSTREAM_ADMIN_SECRET_FILE", str(secret))
        with Client(srv.address, timeout=30) as from_env:
            from_env.create_job("k", [nn.Linear(4, 4)], token="t")
            from_env.drop_job("k")
            assert [j.name for j in from_env.status().jobs] == ["j"]


def test_a_readable_admin_secret_file_is_refused_at_start(tmp_path: Path) -> None:
    secret = _secret_file(tmp_path, 0o644)
    r = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--bind", f"ipc://{tmp_path / 's.sock'}", "--admin-secret-file", str(secret)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert "readable or writable by group or others (mode 0644)" in r.stderr and "chmod 600" in r.stderr


def test_nonces_are_single_use_expire_and_stay_bounded() -> None:
    now = [0.0]
    store = NonceStore(ttl_s=30.0, capacity=4, clock=lambda: now[0])
    a = store.issue()
    store.take(a)
    with pytest.raises(AuthError, match="already used"):
        store.take(a)
    b = store.issue()
    now[0] = 31.0
    with pytest.raises(AuthError, match="expired"):
        store.take(b)
    flood = [store.issue() for _ in range(1000)]
    assert len(store) == 4 and store.evicted == 996
    with pytest.raises(AuthError, match="unknown"):
        store.take(flood[0])
    store.take(flood[-1])
    now[0] = 100.0
    store.issue()
    assert len(store) == 1  # the expired ones went


def test_replay_window() -> None:
    w = ReplayWindow(size=64)
    for seq in (1, 3, 2, 10):
        w.check(seq)
    for seq in (1, 2, 3, 10):
        with pytest.raises(AuthError, match="replayed"):
            w.check(seq)
    w.check(9)
    w.check(200)
    with pytest.raises(AuthError, match="too old"):
        w.check(136)
    w.check(137)  # the oldest seq still inside the window
    with pytest.raises(AuthError, match="replayed"):
        w.check(137)
    w.check(200 + 64)  # reuses slot 200 % 64, which must count as unseen for 264
    with pytest.raises(AuthError, match="too old"):
        w.check(200)


def test_replay_window_answers_as_a_set_of_seen_seqs_through_jumps_of_any_length() -> None:
    """The window clears the slots a jump skips whole bytes at a time (a session skipping far
    ahead cost the server a Python step per skipped seq, 11 ms per request); it still answers
    as the plain model does: a seq is refused when seen or more than ``size`` below the highest."""
    import random

    rng = random.Random(5)
    for size in (64, 128):
        w, seen, highest = ReplayWindow(size=size), set(), 0
        for _ in range(4000):
            jump = rng.choice([1, 2, 7, 8, 9, size - 1, size, size + 3, 5 * size])
            seq = max(1, highest + jump if rng.random() < 0.5 else highest - rng.randrange(size + 8))
            fresh = seq > highest - size and seq not in seen
            try:
                w.check(seq)
                accepted = True
            except AuthError:
                accepted = False
            assert accepted == fresh, (size, seq, highest)
            if accepted:
                seen.add(seq)
                highest = max(highest, seq)


# ---- what a store holds of a job's token ----------------------------------------------------------
def _hex_values_in_manifests(store: Path) -> list[bytes]:
    """Every hex string of 16 bytes or more in the store's manifests, as bytes: whatever of the
    token a snapshot keeps is among them."""
    found: list[bytes] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str) and len(value) >= 32 and re.fullmatch(r"(?:[0-9a-f]{2})+", value):
            found.append(bytes.fromhex(value))

    for manifest in sorted(store.glob("job-*/step-*/manifest.json")):
        walk(json.loads(manifest.read_text()))
    return found


def _try_every_use(peer: RawPeer, job: str, value: bytes) -> None:
    """``value`` from a stolen store, used every way it could open ``job``: all refused."""

    def protocol_2_proof(nonce: bytes, mine: bytes) -> bytes:  # HMAC(key, ...): how protocol 4 proved
        return hmac.new(value, b"wstream/attach/2\0" + job.encode() + b"\0" + nonce + mine, hashlib.sha256).digest()

    attempts = {
        "as the token": peer.try_attach(job, value.hex()),
        "as the key the client derives from the token": peer.try_attach(job, key=value),
        "as the HMAC key of a protocol-4 proof": peer.try_attach(job, proof=protocol_2_proof),
    }
    for how, (reply, _) in attempts.items():
        assert reply["op"] == "error" and reply["code"] == "auth_failed", f"{value.hex()} {how}: {reply}"


def test_a_copy_of_the_store_does_not_open_its_jobs(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with InProcessServer(store=str(store), memory_limit=2**28) as srv:
        with Client(srv.address, timeout=30) as c:
            c.create_job("vault", [nn.Linear(4, 4)], token=TOKEN)  # durable (a snapshot) once created
        stolen = _hex_values_in_manifests(store)
        assert stolen, "the manifest holds no hex values: the test would prove nothing"
        peer = RawPeer(srv.address)
        try:
            for value in stolen:
                _try_every_use(peer, "vault", value)
            assert peer.try_attach("vault", TOKEN)[0]["op"] == "attached"
        finally:
            peer.close()
    # a server started from the store alone still knows the token when it is shown
    with InProcessServer(store=str(store), memory_limit=2**28) as srv, Client(srv.address, timeout=30) as c:
        assert c.attach_job("vault", token=TOKEN).num_stages == 1
        peer = RawPeer(srv.address)
        try:
            for value in stolen:
                _try_every_use(peer, "vault", value)
            reply, _ = peer.try_attach("vault", "not-" + TOKEN)
            assert reply["code"] == "auth_failed" and "wrong token" in reply["message"]
        finally:
            peer.close()


def test_a_protocol_4_manifest_is_migrated_when_its_job_resumes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "store"
    with InProcessServer(store=str(store), memory_limit=2**28) as srv, Client(srv.address, timeout=30) as c:
        c.create_job("old", [nn.Linear(4, 4)], token=TOKEN)
    (manifest,) = store.glob("job-old/step-*/manifest.json")
    data = json.loads(manifest.read_text())
    data["job"] = {k: v for k, v in data["job"].items() if not k.startswith("token")}
    data["job"]["token_sha256"] = hashlib.sha256(TOKEN.encode()).hexdigest()  # what protocol 4 wrote
    manifest.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="wstream.server.snapshot"):
        with InProcessServer(store=str(store), memory_limit=2**28) as srv, Client(srv.address, timeout=30) as c:
            assert c.attach_job("old", token=TOKEN).num_stages == 1
            with pytest.raises(AuthError, match="wrong token"):
                c.attach_job("old", token="not-" + TOKEN)
    migrated = json.loads(manifest.read_text())["job"]
    assert "token_sha256" not in migrated and "token_verifier" in migrated, migrated
    assert any("token_sha256" in r.getMessage() and str(manifest.parent) in r.getMessage() for r in caplog.records)
    with InProcessServer(store=str(store), memory_limit=2**28) as srv, Client(srv.address, timeout=30) as c:
        assert c.attach_job("old", token=TOKEN).num_stages == 1  # the rewritten manifest is read as any other


def test_hkdf_sha256_matches_rfc_5869() -> None:
    from wstream.protocol.auth import hkdf_sha256

    okm = hkdf_sha256(bytes([0x0B] * 22), salt=bytes(range(13)), info=bytes(range(0xF0, 0xFA)), length=42)
    assert okm.hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"
    )  # RFC 5869, A.1 (test case 1)


def test_a_connection_that_claims_another_peers_routing_id_gets_none_of_its_replies(held) -> None:  # type: ignore[no-untyped-def]
    """A peer may choose its ZeroMQ routing id. One that claims the id of a connected worker gets
    none of that worker's replies: they still go to the worker (defect seen: the server's ROUTER
    handed the id over, and the newcomer, with no token, received the worker's weights)."""
    import zmq

    from test_drop import commit_with_updates_held
    from wstream.protocol import decode_reply, encode

    job = held.victim()
    a, sign_a = held.worker(job)
    commit_with_updates_held(held, a, sign_a, job)  # stage 1's weights of step 1 are not there yet
    ctx = zmq.Context()
    victim, thief = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (victim, thief):
            sock.linger = 0
            sock.setsockopt(zmq.ROUTING_ID, b"worker-a-connection")
        victim.connect(held.srv.address)
        victim.send_multipart([encode(sign_a.sign(m.Fetch(session=a.session, stage=1, step=1, id=7)))])  # deferred
        victim.send_multipart([encode(m.Status(id=8))])
        assert victim.poll(20_000) and decode_reply(victim.recv_multipart()[0]).id == 8  # the fetch waits
        thief.connect(held.srv.address)
        thief.send_multipart([encode(m.Status(id=9))])  # the thief's connection is made (or refused)
        thief.poll(2_000)
        held.update.release()
        assert victim.poll(20_000), "the worker's deferred fetch was never answered to it"
        reply = decode_reply(victim.recv_multipart()[0])
        assert isinstance(reply, m.Weights) and reply.id == 7, reply
        stolen = [decode_reply(thief.recv_multipart()[0]) for _ in range(10) if thief.poll(200)]
        assert not any(r.id == 7 for r in stolen), stolen
    finally:
        victim.close()
        thief.close()
        ctx.term()
