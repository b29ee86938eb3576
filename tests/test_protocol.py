"""The wire format, in isolation: round trips, validation, bounds, layouts, sizes."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import msgspec
import pytest

from wstream.protocol import (
    PROTOCOL_VERSION,
    SGD,
    AdamW,
    LayoutError,
    ProtocolError,
    UnknownOpError,
    VersionMismatchError,
    check_frames,
    decode_reply,
    decode_request,
    encode,
    error_from_code,
    format_bytes,
    parse_size,
    peek_id,
)
from wstream.protocol import messages as m
from wstream.protocol.errors import ErrorCode, GradientError, WstreamError
from wstream.protocol.layout import ALIGN_ELEMENTS, build_stage_spec, describe_mismatch, validate_stage
from wstream.protocol.lr_schedules import WarmupCosine

SID = bytes(range(16))
NONCE = bytes(range(32))
CNONCE = bytes(range(100, 116))
SPEC = build_stage_spec("0", [("w", (3, 5)), ("b", (5,))])

REQUESTS: list[m.Message] = [
    m.Hello(),
    m.CreateJob(
        name="job-1", token="t", nonce=NONCE, client_nonce=CNONCE,
        options=m.JobOptions(optimizer=AdamW(lr=0.1), dtype="bfloat16"), total_numel=10,
    ),
    m.CreateJob(name="j", token="t", nonce=NONCE, client_nonce=CNONCE, options=m.JobOptions(optimizer=SGD(momentum=0.9))),
    m.AddStage(session=SID, index=0, spec=SPEC, nframes=1, seq=3, mac=b"m" * 32),
    m.Seal(session=SID),
    m.Attach(name="j", nonce=NONCE, client_nonce=CNONCE, proof=b"p" * 32),
    m.AdminAttach(nonce=NONCE, client_nonce=CNONCE * 4, proof=b"p" * 32),
    m.Join(session=SID, shm=True, grad_slots=4, world_size=2),
    m.Fetch(session=SID, stage=3, step=9),
    m.Push(session=SID, stage=3, step=9, slot=1, numel=100),
    m.Commit(session=SID, step=9),
    m.Pull(session=SID, stage=0),
    m.Heartbeat(session=SID),
    m.Leave(session=SID),
    m.DropJob(session=SID),
    m.DropJob(session=SID, job="other"),
    m.Status(),
    m.Save(session=SID, job="j"),
    m.SetSchedule(session=SID, job="j", lr=1e-3, schedule=WarmupCosine(warmup_steps=10, total_steps=100)),
    m.Shutdown(session=SID, seq=2**63 - 1, mac=b"m" * 32),
    m.Timeline(session=SID, since_ns=12345),
    m.Describe(session=SID, job="j"),
    m.Pull(session=SID, stage=2, job="j"),
    m.AwaitStep(session=SID, step=7),
    m.AwaitStep(session=SID, step=0, job="j"),
    m.CreateJob(
        name="d", token="t", nonce=NONCE, client_nonce=CNONCE,
        options=m.JobOptions(delayed_update=True, delay_after=5),
    ),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda x: type(x).__name__)
def test_every_request_round_trips_and_is_plain_msgpack(msg: m.Message) -> None:
    header = encode(msg)
    assert decode_request(header) == msg
    plain = msgpack.unpackb(header)
    assert plain["op"] == m.op_of(type(msg)) and plain["v"] == PROTOCOL_VERSION
    assert decode_request(msgpack.packb(plain)) == msg  # another encoder's bytes decode too


def test_every_op_is_covered_here() -> None:
    assert {m.op_of(type(x)) for x in REQUESTS} == set(m.REQUEST_TYPES)


def test_replies_round_trip() -> None:
    replies = [
        m.Weights(id=3, stage=1, step=2, offset=64),
        m.Pushed(id=4, stage=1, step=2, slot=0),
        m.Committed(id=4, step=2, grad_norm=float("inf"), lr=1e-3, skipped=True),
        m.Master(stage=0, version=5),
        m.Ok(id=1),
        m.Error(code="bad_message", message="x"),
        m.Joined(worker=1, step=0, grad_path="/dev/shm/x", grad_slot_bytes=64, grad_slots=2),
        m.Challenge(id=2, nonce=NONCE),
        m.AdminAttached(id=2, session=SID),
        m.Layout(id=6, job="j", stages=[SPEC], step=3),
        m.StepReached(id=7, step=4),
        m.TimelineReply(
            id=5,
            now_ns=10**12,
            events=[m.TraceEvent(name="update 3", cat="optimizer", lane="t0", start_ns=5, dur_ns=7, stage=3, step=2)],
            dropped=1,
        ),
    ]
    for r in replies:
        assert decode_reply(encode(r)) == r
    with pytest.raises(UnknownOpError):
        decode_reply(encode(m.Status()))  # a request is not a reply


@pytest.mark.parametrize(
    ("header", "error", "words"),
    [
        (b"\x93\x01\x02", ProtocolError, "not a msgpack map"),
        (b"\xc1", ProtocolError, "not a msgpack map"),
        (msgpack.packb({"v": 1}), ProtocolError, "op"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "nope"}), UnknownOpError, "'nope'"),
        (msgpack.packb({"v": 99, "op": "status"}), VersionMismatchError, "version 99"),
        (msgpack.packb({"op": "status"}), VersionMismatchError, "no protocol version 'v'"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "status", "extra": 1}), ProtocolError, "extra"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "fetch", "session": b"x" * 15, "stage": 0, "step": 0}), ProtocolError, "$.session"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "fetch", "session": SID, "stage": 2**40, "step": 0}), ProtocolError, "$.stage"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "join", "session": SID, "shm": True, "grad_slots": 0}), ProtocolError, "$.grad_slots"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "../etc", "nonce": NONCE, "client_nonce": CNONCE, "proof": NONCE}), ProtocolError, "$.name"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "a" * 129, "nonce": NONCE, "client_nonce": CNONCE, "proof": NONCE}), ProtocolError, "$.name"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "j", "token": "t"}), ProtocolError, "token"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "j", "nonce": NONCE, "client_nonce": b"c" * 15, "proof": NONCE}), ProtocolError, "$.client_nonce"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "j", "nonce": NONCE[:31], "client_nonce": CNONCE, "proof": NONCE}), ProtocolError, "$.nonce"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "session": SID, "seq": -1}), ProtocolError, "$.seq"),
        # a job name must match as a whole: "$" alone would let a trailing newline through
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "attach", "name": "j\n", "nonce": NONCE, "client_nonce": CNONCE, "proof": NONCE}), ProtocolError, "$.name"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "drop_job", "session": SID, "job": "\nj"}), ProtocolError, "$.job"),
        # version 3: a job's options travel as one record; the old top-level fields are refused by name
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "op": "create_job", "name": "j", "token": "t", "nonce": NONCE,
                           "client_nonce": CNONCE, "optimizer": {"kind": "adamw"}}),
            ProtocolError,
            "optimizer",
        ),
        (msgpack.packb({"v": PROTOCOL_VERSION, "op": "heartbeat", "session": SID, "mac": b"m" * 33}), ProtocolError, "$.mac"),
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "op": "create_job", "name": "j", "token": "t", "nonce": NONCE,
                           "client_nonce": CNONCE, "options": {"optimizer": {"kind": "adamw", "lr": -1.0}}}),
            ProtocolError,
            "lr must be",
        ),
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "op": "create_job", "name": "j", "token": "t", "nonce": NONCE,
                           "client_nonce": CNONCE, "options": {"optimizer": {"kind": "lion"}}}),
            ProtocolError,
            "lion",
        ),
        (
            msgpack.packb(
                {"v": PROTOCOL_VERSION, "op": "add_stage", "session": SID, "index": 0,
                 "spec": {"name": "0", "numel": 4, "params": [["w", [1] * 9, 0]]}}
            ),
            ProtocolError,
            "length <= 8",
        ),
        # unknown fields inside the records are refused as at the top (a typo was dropped silently)
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "op": "create_job", "name": "j", "token": "t", "nonce": NONCE,
                           "client_nonce": CNONCE, "options": {"optimizer": {"kind": "adamw", "weight_decay_typo": 0.5}}}),
            ProtocolError,
            "weight_decay_typo",
        ),
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "op": "create_job", "name": "j", "token": "t", "nonce": NONCE,
                           "client_nonce": CNONCE, "options": {"optimizer": {"kind": "sgd", "momentun": 0.9}}}),
            ProtocolError,
            "momentun",
        ),
        (
            msgpack.packb(
                {"v": PROTOCOL_VERSION, "op": "add_stage", "session": SID, "index": 0,
                 "spec": {"name": "0", "numel": 4, "params": [["w", [4], 0]], "extra": 1}}
            ),
            ProtocolError,
            "extra",
        ),
    ],
)
def test_malformed_headers_raise_named_errors(header: bytes, error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        decode_request(header)
    assert words in str(info.value)
    assert isinstance(info.value, WstreamError)


def test_peek_id_survives_garbage() -> None:
    assert peek_id(msgpack.packb({"op": "x", "id": 42})) == 42
    assert peek_id(b"\xff\xff") == 0
    assert peek_id(msgpack.packb({"op": "x", "id": "seven"})) == 0
    # an id no reply may carry (RequestId is at most 2**63 - 1) is answered as 0, so the error decodes
    assert peek_id(msgpack.packb({"op": "x", "id": 2**64 - 1})) == 0
    assert peek_id(msgpack.packb({"op": "x", "id": 2**63 - 1})) == 2**63 - 1
    decode_reply(encode(m.Error(id=peek_id(msgpack.packb({"op": "x", "id": 2**64 - 1})), code="bad_message", message="m")))


def test_frame_counts_are_checked() -> None:
    check_frames(m.Status(), [])
    with pytest.raises(ProtocolError, match="0 data frame"):
        check_frames(m.Status(), [b""])
    with pytest.raises(ProtocolError, match="1 to 65536 data frame"):
        check_frames(m.AddStage(session=SID, index=0, spec=SPEC), [])
    check_frames(m.Push(session=SID, stage=0, step=0, slot=0, numel=1, nframes=1), [b"x"])
    with pytest.raises(ProtocolError, match="nframes=0"):
        check_frames(m.Push(session=SID, stage=0, step=0, slot=0, numel=1), [b"x"])


def test_optimizer_records_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="betas"):
        AdamW(betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="nesterov"):
        SGD(nesterov=True)
    with pytest.raises(ValueError, match="eps"):
        AdamW(eps=float("nan"))
    assert msgspec.msgpack.decode(encode(AdamW()), type=AdamW) == AdamW()


def test_layouts_are_aligned_and_validated() -> None:
    spec = build_stage_spec("s", [("a", (3,)), ("b", (2, 2)), ("c", ())])
    assert [p.offset for p in spec.params] == [0, ALIGN_ELEMENTS, 2 * ALIGN_ELEMENTS]
    assert spec.numel == 3 * ALIGN_ELEMENTS
    validate_stage(0, spec)
    overlap = m.StageSpec(name="x", numel=10, params=[m.ParamSpec("a", (4,), 0), m.ParamSpec("b", (4,), 2)])
    with pytest.raises(LayoutError, match="overlap"):
        validate_stage(1, overlap)
    outside = m.StageSpec(name="x", numel=3, params=[m.ParamSpec("a", (4,), 0)])
    with pytest.raises(LayoutError, match="beyond"):
        validate_stage(1, outside)
    with pytest.raises(LayoutError, match="no parameters"):
        validate_stage(2, m.StageSpec(name="x", numel=0, params=[]))
    with pytest.raises(LayoutError, match="twice"):
        validate_stage(2, m.StageSpec(name="x", numel=8, params=[m.ParamSpec("a", (2,), 0), m.ParamSpec("a", (2,), 4)]))
    other = build_stage_spec("s", [("a", (3,)), ("b", (2, 3)), ("c", ())])
    assert describe_mismatch([spec], [spec]) is None
    assert "'b' has shape [2, 3]" in describe_mismatch([spec], [other])
    assert "2 stages" in describe_mismatch([spec, spec], [spec])


def test_error_codes_map_back_to_classes() -> None:
    err = error_from_code("bad_gradient", "too big")
    assert isinstance(err, GradientError) and err.message == "too big"
    assert error_from_code("from_the_future", "x").code == ErrorCode.INTERNAL
    assert "[from_the_future]" in str(error_from_code("from_the_future", "x"))


def test_tensor_frames_round_trip_in_chunks() -> None:
    import torch

    from wstream.protocol.frames import copy_frames_into, frames_nbytes, tensor_frames

    t = torch.randn(1000)
    frames = tensor_frames(t, chunk=1024)  # 4000 bytes -> 4 frames
    assert [len(f) for f in frames] == [1024, 1024, 1024, 928]
    assert frames_nbytes(frames) == 4000
    out = torch.empty(1000)
    copy_frames_into(out, frames)
    assert torch.equal(out, t)
    with pytest.raises(ValueError, match="hold 3072 bytes, the tensor takes 4000"):
        copy_frames_into(out, frames[:3])


def test_sizes() -> None:
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("512") == 512
    assert parse_size(7) == 7
    with pytest.raises(ValueError, match="cannot read 'lots'"):
        parse_size("lots")
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(10) == "10 B"


def test_published_segment_growth_doubles_then_adds_a_quarter() -> None:
    from wstream.server.published import SEGMENT_DOUBLING_LIMIT, SEGMENT_START, grown_capacity

    cap, sizes = SEGMENT_START, []
    while cap < 1 << 34:
        cap = grown_capacity(cap, cap + 1)
        sizes.append(cap)
    assert sizes[:2] == [2 * SEGMENT_START, 4 * SEGMENT_START]
    big = [b for a, b in zip(sizes, sizes[1:]) if a >= SEGMENT_DOUBLING_LIMIT]
    assert all(b == a + a // 4 for a, b in zip([s for s in sizes if s >= SEGMENT_DOUBLING_LIMIT], big))
    assert len(sizes) < 40  # 16 GiB in few remaps
    assert grown_capacity(SEGMENT_START, 10**9) == 10**9  # one big stage: exactly what it needs


def test_server_update_takes_the_mean_of_worker_gradients() -> None:
    """The mean is folded into the fused kernel's grad_scale; it must equal (g1 + g2) / 2."""
    import torch

    from wstream.protocol import SGD, AdamW
    from wstream.server.optimizer import StageOptimizer

    for spec, ref_cls in ((SGD(lr=0.1, momentum=0.9), torch.optim.SGD), (AdamW(lr=0.1), torch.optim.AdamW)):
        kwargs = {"lr": 0.1, "momentum": 0.9} if ref_cls is torch.optim.SGD else {"lr": 0.1}
        master = torch.randn(1000)
        ref_param = master.clone()
        opt = StageOptimizer(spec, master, m.StageSpec(name="0", numel=1000, params=[m.ParamSpec("w", (1000,), 0)]))
        ref = ref_cls([ref_param], **kwargs)
        for _ in range(3):
            g1, g2, g3 = torch.randn(1000), torch.randn(1000), torch.randn(1000)
            opt.step(g1 + g2 + g3, grad_scale=3)
            ref_param.grad = (g1 + g2 + g3) / 3
            ref.step()
            opt.step(g1.clone())  # and a single worker: no scaling at all
            ref_param.grad = g1
            ref.step()
        assert (master - ref_param).abs().max().item() < 1e-6


def test_job_options_round_trip_through_a_snapshot_record_and_old_manifests_still_read() -> None:
    from wstream.protocol.auth import client_key_of_digest, verifier
    from wstream.server.snapshot import JobRecord

    options = m.JobOptions(optimizer=SGD(lr=0.5, momentum=0.9), dtype="bfloat16", delayed_update=True, delay_after=3)
    record = JobRecord("j", verifier(client_key_of_digest(b"\x01" * 32)), options, [SPEC])
    assert JobRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    # a manifest written before protocol 3 holds the options at the top level of "job", and (as before
    # protocol 5) the token's digest, read as the verifier it gives
    old = {
        "name": "j", "token_sha256": "01" * 32, "optimizer": {"kind": "sgd", "lr": 0.5, "momentum": 0.9},
        "dtype": "bfloat16", "double_buffer": False, "delayed_update": True, "delay_after": 3, "frozen": False,
        "base": None, "stages": [msgspec.to_builtins(SPEC)],
    }
    read = JobRecord.from_json(old)
    assert dataclasses.replace(read, incarnation=record.incarnation) == record  # an old manifest: an incarnation of its own


def test_create_job_takes_options_or_their_fields_and_names_an_unknown_one() -> None:
    from wstream.client.job_options import job_options

    assert job_options(None, {"dtype": "bfloat16"}) == m.JobOptions(dtype="bfloat16")
    given = m.JobOptions(frozen=True)
    assert job_options(given, {}) is given
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['lr'\]"):
        job_options(None, {"lr": 1e-3})
    with pytest.raises(TypeError, match="not both"):
        job_options(given, {"dtype": "float16"})
