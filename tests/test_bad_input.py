"""Bad input gets a clear error, and the server keeps serving every other job."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from torch import nn

import models
from conftest import HERE, ServerProcess, start_server
from rawwire import RawPeer, RawSession
from wstream.client import AdamW, Client, JobExistsError, MemoryLimitError
from wstream.protocol import PROTOCOL_VERSION

ADAM = {"kind": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}


def _attach_worker(peer: RawPeer, job: str, token: str, *, shm: bool) -> RawSession:
    session = peer.attach(job, token)
    reply, _ = session.request("join", shm=shm)
    assert reply["op"] == "joined", reply
    return session


@pytest.mark.server_process  # a worker subprocess and raw peers on the wire
def test_every_bad_message_is_answered_while_another_job_trains(server: ServerProcess, tmp_path: Path) -> None:
    steps = 8
    stages = models.mixed(seed=11)
    start = copy.deepcopy(stages)
    client = Client(server.address, timeout=30)
    client.create_job("busy", stages, optimizer=AdamW(lr=1e-3), token="busy-token")
    out = tmp_path / "busy.json"
    with open(tmp_path / "busy.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, str(HERE / "worker_main.py"), server.address, "busy", "busy-token", "mixed", str(steps), "0", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    # raw pushes of chain stage 0's gradient size: one server stage per chain stage
    victim = client.create_job("victim", models.mixed(seed=2), optimizer=AdamW(), token="victim-token", unit_bytes=None)
    peer = RawPeer(server.address)
    try:
        cases: list[tuple[str, list[bytes], str, str]] = [
            ("garbage bytes", [b"\xc1\xff\x00not msgpack"], "bad_message", "not a msgpack map"),
            ("header is a list", [msgpack.packb([1, 2, 3])], "bad_message", "not a msgpack map"),
            ("no op", [msgpack.packb({"v": PROTOCOL_VERSION, "id": 1})], "bad_message", "op"),
            ("unknown op", [msgpack.packb({"v": PROTOCOL_VERSION, "op": "format_disk"})], "unknown_op", "format_disk"),
            ("old version", [msgpack.packb({"v": 0, "op": "status"})], "version_mismatch", "version 0"),
            (
                "wrong field type",
                [msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": 5, "nonce": b"n" * 32,
                                "client_nonce": b"c" * 16, "proof": b"p" * 32})],
                "bad_message",
                "$.name",
            ),
            (
                "negative step",
                [msgpack.packb({"v": PROTOCOL_VERSION, "op": "fetch", "session": b"s" * 16, "stage": 0, "step": -3})],
                "bad_message",
                "$.step",
            ),
            (
                "extra data frame",
                [msgpack.packb({"v": PROTOCOL_VERSION, "op": "status"}), b"junk"],
                "bad_message",
                "data frame",
            ),
            (
                "unknown session",
                [msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "session": b"z" * 16})],
                "session_expired",
                "session",
            ),
            (
                "unsigned request",
                [msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "session": peer.attach("victim", "victim-token").session})],
                "auth_failed",
                "not signed",
            ),
            (
                "attach with a token (protocol 1)",
                [msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "victim", "token": "victim-token"})],
                "bad_message",
                "token",
            ),
        ]
        for what, frames, code, words in cases:
            reply, _ = peer.send_frames(frames)
            assert reply["op"] == "error", what
            assert reply["code"] == code, (what, reply)
            assert words in reply["message"], (what, reply["message"])
        reply, _ = peer.try_attach("victim", "nope")
        assert (reply["code"], "wrong token") == ("auth_failed", "wrong token") and "wrong token" in reply["message"]
        reply, _ = peer.try_attach("ghost", "x")
        assert reply["code"] == "unknown_job" and "ghost" in reply["message"]

        # gradients: wrong size, wrong slot, stale step, not joined, frames mode length
        session = _attach_worker(peer, "victim", "victim-token", shm=True)
        numel0 = victim.specs[0].numel
        reply, _ = session.request("push", stage=0, step=0, slot=0, numel=numel0 + 1)
        assert (reply["code"], "elements") == ("bad_gradient", "elements") and str(numel0) in reply["message"]
        reply, _ = session.request("push", stage=0, step=0, slot=9, numel=numel0)
        assert reply["code"] == "bad_gradient" and "slot 9" in reply["message"]
        reply, _ = session.request("push", stage=0, step=4, slot=0, numel=numel0)
        assert reply["code"] == "stale_step"
        reply, _ = session.request("fetch", stage=99, step=0)
        assert reply["code"] == "bad_layout" and "no stage 99" in reply["message"]
        framed = _attach_worker(peer, "victim", "victim-token", shm=False)
        reply, _ = framed.request("push", b"\x00" * 12, stage=0, step=0, slot=0, numel=numel0)
        assert reply["code"] == "bad_gradient" and "12 bytes" in reply["message"]
        header = framed.header("push", nframes=2, stage=0, step=0, slot=0, numel=numel0)
        reply, _ = peer.send_frames([header, b"\x00" * 12])  # one frame dropped on the way
        assert reply["code"] == "bad_message" and "nframes=2" in reply["message"]
        reader = peer.attach("victim", "victim-token")
        joined, _ = reader.request("join", shm=True, reader=True)
        assert joined["op"] == "joined" and joined["grad_slots"] == 0 and joined["grad_path"] == ""
        reply, _ = reader.request("push", stage=0, step=0, slot=0, numel=numel0)
        assert reply["code"] == "bad_gradient" and "reader" in reply["message"]
        unjoined = peer.attach("victim", "victim-token")
        reply, _ = unjoined.request("push", stage=0, step=0, slot=0, numel=numel0)
        assert reply["code"] == "bad_state" and "join" in reply["message"]

        # duplicate job name and a job over the memory limit, through the client API
        with pytest.raises(JobExistsError, match="busy"):
            client.create_job("busy", models.mixed(), token="x")
        with torch.device("meta"):  # sizes are all admission needs: refused before any upload
            huge = [nn.Linear(8192, 8192) for _ in range(20)]  # 1.3 G params * 12 bytes > 4 GiB
        with pytest.raises(MemoryLimitError, match=r"needs .* bytes\) but only .* bytes\) .* free"):
            client.create_job("huge", huge, token="x")
        assert "huge" not in {j.name for j in client.status().jobs}
    finally:
        peer.close()

    assert worker.wait(timeout=240) == 0, (tmp_path / "busy.log").read_text()
    ref = nn.Sequential(*start)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for s in range(steps):
        opt.zero_grad()
        models.loss_fn(ref(models.batch("mixed", s)[0]), models.batch("mixed", s)[1]).backward()
        opt.step()
    got = client.attach_job("busy", token="busy-token").state_dict()
    want = ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    client.close()


def test_sessions_are_bound_to_their_job(client: Client) -> None:
    a = client.create_job("a", [nn.Linear(4, 4)], token="ta")
    client.create_job("b", [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)], token="tb")
    # a's session cannot reach b's stages: stage 2 exists only in b
    with pytest.raises(Exception, match="no stage 2"):
        from wstream.protocol import messages as m

        client._chan.request(m.Pull(session=a.session, stage=2), m.Master)
    with pytest.raises(Exception, match="wrong token"):
        client.attach_job("b", token="ta")


def test_growing_job_and_join_over_memory_limit_are_refused(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--memory-limit", "3MiB")
    try:
        with Client(srv.address, timeout=30) as c:
            # a generator gives no size up front: the stage that crosses the limit is refused,
            # and the half-made job is removed (each Linear(256, 256) holds 16 bytes/parameter:
            # master, AdamW moments, the step's gradient accumulator; 1.05 MiB, and the segment's
            # first MiB: stage 2 is the one that does not fit; test_units has the job of units)
            with pytest.raises(MemoryLimitError, match="stage 2"):
                c.create_job("growing", (nn.Linear(256, 256) for _ in range(10)), token="x", unit_bytes=None)
            assert c.status().jobs == [] and c.status().memory_used == 0
            job = c.create_job("j", [nn.Linear(256, 256)], optimizer=AdamW(), token="t")  # ~1.05 MiB
            with pytest.raises(MemoryLimitError, match="gradient ring"):
                job.trainer(grad_slots=64, step_ring=False)  # a step ring of this one stage would fit
            with job.trainer(grad_slots=2) as tr:  # a smaller ring fits
                tr.step(torch.randn(2, 256), torch.randn(2, 256), models.loss_fn)
    finally:
        assert srv.stop() == 0


def test_found_by_fuzzing_deep_nesting_waiting_fetches_and_abandoned_creation(tmp_path: Path) -> None:
    """Regressions for what the fuzzer found: each gets an error reply, nothing grows unbounded."""
    srv = start_server(tmp_path, "--memory-limit", "1GiB", "--creation-timeout", "3")
    peer = RawPeer(srv.address)
    try:
        # 1. a header nested a thousand levels deep: bad_message, not an internal error
        deep = b"\x84\xa1v" + msgpack.packb(PROTOCOL_VERSION) + b"\xa2op\xa6status\xa2id\x01\xa1x" + b"\x91" * 5000 + b"\xc0"
        reply, _ = peer.send_frames([deep])
        assert reply["code"] == "bad_message" and "deep" in reply["message"], reply
        # 2. a worker's deferred fetches are capped, and dropping the job answers them
        with Client(srv.address, timeout=30) as c:
            c.create_job("held", models.mixed(), optimizer=AdamW(), token="t")
        s = peer.attach("held", "t")
        assert s.request("join", shm=True)[0]["op"] == "joined"
        limit = 1024
        for _ in range(limit):  # fetches of step 1: deferred until step 0's update, never answered now
            peer.sock.send_multipart([s.header("fetch", stage=0, step=1)])
        reply, _ = s.request("fetch", stage=0, step=1)
        assert reply["code"] == "bad_state" and f"limit is {limit}" in reply["message"], reply
        with Client(srv.address, timeout=30) as c:
            before = c.status().memory_used
            c.drop_job("held", token="t")
        waited = []
        while len(waited) < limit and peer.sock.poll(20_000):
            waited.append(msgpack.unpackb(peer.sock.recv_multipart()[0]))
        assert len(waited) == limit and all(r["code"] == "unknown_job" for r in waited), waited[:3]
        # 3. an unsealed job holds its first block of shared memory in the account, and is dropped
        #    when no stage comes for --creation-timeout seconds
        with Client(srv.address, timeout=30) as c:
            assert c.status().memory_used < before
            nonce, mine = peer.nonce(), os.urandom(32)
            reply, _ = peer.request("create_job", name="abandoned", token="t", options={"optimizer": {"kind": "sgd"}},
                                    nonce=nonce, client_nonce=mine)
            assert reply["op"] == "attached", reply
            assert c.status().memory_used == 2**20
            # a creator run again at once is told the job is still being created and when it goes
            # (it used to hear "already exists", with a hint at exist_ok=True, which cannot help)
            with pytest.raises(JobExistsError, match=r"still being created .* dropped \d+ s from now") as exists:
                c.create_job("abandoned", models.mixed(), optimizer=AdamW(), token="t")
            assert "exist_ok" not in "".join(getattr(exists.value, "__notes__", []))
            deadline = time.monotonic() + 30
            while c.status().jobs and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.status().jobs == [] and c.status().memory_used == 0
        assert "still unsealed" in srv.log()
    finally:
        peer.close()
        assert srv.stop() == 0
    assert "Traceback" not in srv.log()


def test_found_by_fuzzing_a_held_commit_is_answered_when_its_worker_leaves(server: ServerProcess) -> None:
    """A ``commit`` held until its step commits gets an answer when its worker leaves having pushed
    nothing of the open step (the step goes on without it): ``session_expired``, not silence."""
    with Client(server.address, timeout=30) as c:
        c.create_job("held-commit", [nn.Linear(4, 4), nn.Linear(4, 2)], optimizer=AdamW(), token="t")
    peer = RawPeer(server.address)
    try:
        s = _attach_worker(peer, "held-commit", "t", shm=True)
        for step in (0, 1):  # the open step and the next one are held
            peer.sock.send_multipart([s.header("commit", id=100 + step, step=step)])
        assert not peer.sock.poll(200), "a commit of a step nobody pushed was answered"
        reply, _ = s.request("leave")
        held = [reply]
        while len(held) < 3 and peer.sock.poll(20_000):
            held.append(msgpack.unpackb(peer.sock.recv_multipart()[0]))
        assert len(held) == 3, f"the held commits got no reply when their worker left: {held}"
        by_id = {r["id"]: r for r in held}
        assert by_id[7]["op"] == "ok", held
        for rid in (100, 101):
            assert by_id[rid]["op"] == "error" and by_id[rid]["code"] == "session_expired", held
    finally:
        peer.close()


def test_found_by_review_units_past_what_msgpack_holds_are_refused_and_no_reply_can_end_the_loop(server: ServerProcess) -> None:
    """A job whose ``units`` summed past 2**64 made every later ``status`` reply unencodable, and
    the exception in the send ended the server for every job. Each entry and their sum are now
    bounded (MAX_CHAIN_STAGES), and a reply that cannot be encoded becomes an internal error."""
    from wstream.protocol.auth import secret_key, session_key
    from wstream.protocol.messages import MAX_CHAIN_STAGES

    peer = RawPeer(server.address)
    try:
        nonce, mine = peer.nonce(), os.urandom(32)
        reply, _ = peer.request("create_job", name="big-units", token="t", nonce=nonce, client_nonce=mine,
                                options={"units": [2**64 - 1, 2**64 - 1]})
        assert reply["op"] == "error" and reply["code"] == "bad_message" and "units" in reply["message"], reply
        nonce, mine = peer.nonce(), os.urandom(32)
        reply, _ = peer.request("create_job", name="big-sum", token="t", nonce=nonce, client_nonce=mine, options={})
        assert reply["op"] == "attached", reply
        session = RawSession(peer, reply["session"], session_key(secret_key("t"), nonce, mine))
        spec = {"name": "s", "numel": 16, "params": [["w", [16], 0]]}
        for i in range(2):
            assert session.request("add_stage", b"\0" * 64, index=i, spec=spec)[0]["op"] == "ok"
        reply, _ = session.request("seal", units=[MAX_CHAIN_STAGES, MAX_CHAIN_STAGES])
        assert reply["op"] == "error" and "units" in reply["message"] and str(MAX_CHAIN_STAGES) in reply["message"], reply
        reply, _ = peer.request("status")
        assert reply["op"] == "status_reply", reply
    finally:
        peer.close()


def test_a_reply_that_cannot_be_encoded_is_answered_as_an_internal_error(tmp_path: Path) -> None:
    """The transport's last line: whatever a handler builds, its send never ends the loop."""
    import zmq

    from wstream.protocol import messages as m
    from wstream.server.config import ServerConfig
    from wstream.server.outgoing import Outgoing
    from wstream.server.transport import Transport

    transport = Transport(ServerConfig(bind=[f"ipc://{tmp_path}/t.sock"], memory_limit=2**20))
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.linger = 0
    try:
        peer.connect(transport.endpoints[0])
        peer.send(b"hi")
        assert transport._sock.poll(20_000)
        identity = transport._sock.recv_multipart()[0]
        transport.send(Outgoing(identity, m.Error(id=5, code="internal", message="\udcff")))  # not UTF-8 encodable
        assert peer.poll(20_000)
        reply = msgpack.unpackb(peer.recv_multipart()[0])
        assert reply["op"] == "error" and reply["code"] == "internal" and reply["id"] == 5, reply
        assert "could not be encoded" in reply["message"]
    finally:
        peer.close()
        ctx.term()
        transport.close()


def test_found_by_review_a_frames_reader_is_served_a_copy_not_the_live_slot(server: Any) -> None:
    """NOTE [Versions and who may read what] rule 8: a reader pushes nothing, so no commit waits
    for its reads (rule 2 does not hold for it). Its data-frames reply used to be a zero-copy view
    of the published slot: still queued behind a slow reader when the update to version t + 2
    rewrote the slot, it carried the next weights under a ``step t`` header. A reader's frames are
    now a copy of the version (one per version, shared by its replies still queued); a pushing
    worker's stay zero-copy (rule 2 covers them)."""
    from wstream.protocol import messages as m

    client = Client(server.address, timeout=30)
    client.create_job("torn", [nn.Linear(64, 64)], optimizer=AdamW(), token="tok")
    job = server.inprocess.server.jobs["torn"]
    peer = RawPeer(server.address)
    try:
        reader = peer.attach("torn", "tok")
        assert reader.request("join", shm=False, reader=True)[0]["op"] == "joined"
        worker = peer.attach("torn", "tok")
        assert worker.request("join", shm=False)[0]["op"] == "joined"
        st = job.stages[0]
        slot = st.slots[st.slot_for(0)]
        slot_memory = range(slot.data_ptr(), slot.data_ptr() + slot.nbytes)
        by_kind = {w.reader: w for w in job.workers.values()}
        replies = {}
        for is_reader, w in by_kind.items():
            replies[is_reader] = job.versions.fetch(m.Fetch(stage=0, step=0, session=w.session), b"peer", w)
        shared = {k: any(f.obj.__array_interface__["data"][0] in slot_memory for f in r.frames) for k, r in replies.items()}
        assert shared == {True: False, False: True}, shared
        want = b"".join(bytes(f) for f in replies[False].frames)
        assert b"".join(bytes(f) for f in replies[True].frames) == want  # the same bytes, from a copy
        again = job.versions.fetch(m.Fetch(stage=0, step=0, session=by_kind[True].session), b"peer", by_kind[True])
        def address(frame: Any) -> int:
            return frame.obj.__array_interface__["data"][0]

        assert address(again.frames[0]) == address(replies[True].frames[0])  # one copy per version while its replies live
    finally:
        peer.close()
        client.close()


def test_found_by_review_a_peer_cannot_make_the_server_hold_a_huge_frame_or_a_million_frames(tmp_path: Path) -> None:
    """A frame longer than a header may be (64 MiB) disconnects its peer before the server holds
    it (a 300 MiB frame raised the server's memory by 350 MB), and a message's data frames past
    the most any op takes are read and dropped, not kept (a million empty frames stalled the loop
    and held 350 MB). Other peers are served as before."""
    import zmq

    from wstream.protocol.messages import MAX_DATA_FRAMES, MAX_HEADER_BYTES
    from wstream.server.config import ServerConfig
    from wstream.server.transport import Transport

    transport = Transport(ServerConfig(bind=[f"ipc://{tmp_path}/t.sock"], memory_limit=2**20))
    ctx = zmq.Context()
    big, many, fine = (ctx.socket(zmq.DEALER) for _ in range(3))
    try:
        for sock in (big, many, fine):
            sock.linger = 0
            sock.connect(transport.endpoints[0])
        big.send_multipart([b"header", bytes(MAX_HEADER_BYTES + 1)])
        many.send_multipart([b"header", *([b""] * (MAX_DATA_FRAMES + 100))])
        fine.send_multipart([b"header", b"data"])
        got = []
        while len(got) < 2 and transport._sock.poll(20_000):
            got.append(transport.receive_one())
        assert not transport._sock.poll(500)  # the huge frame never arrives
        by_size = sorted(len(frames) for frames in got)
        assert by_size == [3, MAX_DATA_FRAMES + 3], by_size  # id, header, data (at most one past the limit)
    finally:
        for sock in (big, many, fine):
            sock.close()
        ctx.term()
        transport.close()


def test_found_by_review_readers_are_counted_against_the_session_limit(tmp_path: Path) -> None:
    """A reader holds no gradient ring, so the memory account never limited them and the session
    cap skipped joined sessions: one token holder opened 3,000 readers. A reader past
    ``--max-sessions-per-job`` is now refused, naming the limit; workers are not affected."""
    from wstream.server.inprocess import InProcessServer

    with InProcessServer(bind=[f"ipc://{tmp_path}/s.sock"], memory_limit=2**30, max_sessions_per_job=3) as srv:
        with Client(srv.address, timeout=30) as client:
            client.create_job("readers", [nn.Linear(4, 4)], optimizer=AdamW(), token="t")
        peer = RawPeer(srv.address)
        try:
            for _ in range(3):
                assert peer.attach("readers", "t").request("join", shm=True, reader=True)[0]["op"] == "joined"
            reply, _ = peer.attach("readers", "t").request("join", shm=True, reader=True)
            assert reply["op"] == "error" and "3 readers" in reply["message"] and "max-sessions-per-job" in reply["message"], reply
            assert peer.attach("readers", "t").request("join", shm=True)[0]["op"] == "joined"  # a worker still joins
        finally:
            peer.close()


def test_found_by_review_replies_left_unread_hold_a_bounded_number_of_weight_copies(server: Any) -> None:
    """A ``pull`` is answered with a copy of the master (it changes with the next update), shared
    by the replies of one version. A peer that pulled after every step without reading its replies
    kept one copy per step alive in the server's send queue: 16 MiB a step, 2.6 GiB outside the
    memory limit after 160 steps (found by review). Copies that unread replies hold are now
    bounded per job (:data:`REPLY_COPIES_STAGES` of its largest stage): past that a pull is refused
    by name, and once the replies are read the copies go and pulls are answered again."""
    from wstream.server.stage_state import REPLY_COPIES_STAGES

    job = server.inprocess.server.jobs  # the server's table, to watch the copies
    client = Client(server.address, timeout=30)
    stages = [nn.Linear(2048, 2048)]  # 16 MiB of fp32 master
    handle = client.create_job("unread", stages, optimizer=AdamW(lr=1e-3), token="t")
    peer = RawPeer(server.address)
    session = peer.attach("unread", "t")
    peer.sock.close()
    peer.sock = peer.ctx.socket(zmq.DEALER)  # a peer that reads nothing: one message in its queue at most
    peer.sock.rcvhwm = 1
    peer.sock.linger = 0
    peer.sock.connect(server.address)
    copies = job["unread"].reply_copies
    pulls = REPLY_COPIES_STAGES + 4
    x = torch.randn(4, 2048)
    with handle.trainer() as trainer:
        for step in range(pulls):
            trainer.step(x, x, torch.nn.functional.mse_loss)
            trainer.wait_updates()
            peer.sock.send_multipart([session.header("pull", stage=0)])  # a new version each time: a new copy
    deadline = time.monotonic() + 30
    while copies.made + copies.refused < pulls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert copies.made + copies.refused == pulls and copies.refused > 0
    assert copies.nbytes <= REPLY_COPIES_STAGES * 2048 * 2049 * 4
    replies = []
    while len(replies) < pulls and peer.sock.poll(20_000):
        replies.append(msgpack.unpackb(peer.sock.recv_multipart()[0]))
    refused = [r for r in replies if r["op"] == "error"]
    assert [r["op"] for r in replies].count("master") >= REPLY_COPIES_STAGES - 1 and refused, [r["op"] for r in replies]
    assert all(r["code"] == "memory_limit" and "not read" in r["message"] for r in refused), refused[0]
    reply, frames = session.request("pull", stage=0)  # read now: the copies are gone
    assert reply["op"] == "master" and len(b"".join(frames)) == 2048 * 2049 * 4
    peer.close()
    client.close()


def test_found_by_review_messages_of_many_frames_do_not_hold_the_mailboxes_back(tmp_path: Path) -> None:
    """The loop read up to 256 messages a turn before draining its mailboxes (every job's finished
    updates and snapshots): a peer sending messages of 65,536 empty frames (about 100 ms each to
    read in Python) held them back 25 s a turn, and other jobs' workers waited on their weights for
    minutes (found by review). A turn now ends once it has read MAX_FRAMES_PER_TURN frames."""
    import threading

    from wstream.server.config import ServerConfig
    from wstream.server.transport import MAX_FRAMES_PER_TURN, Transport

    transport = Transport(ServerConfig(bind=[f"ipc://{tmp_path}/t.sock"], memory_limit=2**20))
    ctx = zmq.Context()
    many = ctx.socket(zmq.DEALER)
    many.linger = 0
    many.connect(transport.endpoints[0])
    events: list[object] = []
    stop = threading.Event()
    sent = 4

    def receive(_identity: bytes, frames: list[Any]) -> None:
        events.append(len(frames))
        if sum(1 for e in events if e != "turn") == sent:
            stop.set()

    try:
        for _ in range(sent):  # each longer than a turn may read
            many.send_multipart([b"header", *([b""] * (MAX_FRAMES_PER_TURN + 10))])
        serving = threading.Thread(
            target=transport.serve, args=(stop, receive, [], lambda: events.append("turn"), lambda now: None, 60.0)
        )
        serving.start()
        serving.join(60)
        assert not serving.is_alive()
        messages = [i for i, e in enumerate(events) if e != "turn"]
        assert len(messages) == sent
        assert all(any(events[k] == "turn" for k in range(a + 1, b)) for a, b in zip(messages, messages[1:])), events
    finally:
        stop.set()
        many.close()
        ctx.term()
        transport.close()
