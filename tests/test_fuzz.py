"""Fuzz every request op of the wire protocol against a live server while a real job trains.

The ops (20 in protocol 4) and the types of their fields are read from ``wstream.protocol.messages``
at run time (the ``Request`` union, each record's ``frames`` and ``msgspec.inspect.type_info``), so an
op or a field added later is fuzzed without editing this file. Hypothesis builds one request per
example, of one of these kinds:

* ``valid``: every field of its declared type and within its declared bounds, random values;
* ``wrong_type``: one or two fields (``v``, ``op`` and ``id`` included) of another msgpack type;
* ``missing_extra``: required fields left out, unknown fields added, keys repeated;
* ``extreme``: integers anywhere in the header (sizes, counts, stage indices, steps, numel, slot,
  ids, seqs, nframes) set to huge, negative or just-out-of-bounds values;
* ``big``: very long strings and bytes, long lists, huge or many-dimensional shapes in stage
  specs, 65,537 parameters;
* ``raw``: random bytes; ``truncated``: a valid header cut short or with trailing bytes;
  ``not_map``: a header that is not a map, a map with non-string keys, or nested thousands deep;
* ``frames``: a valid header with too many, too few, oversized or odd-sized data frames;
* ``cross_job``: a real session of job A (or C) naming the stages, steps and sizes of job B, with
  data frames sized for B's stages;
* ``stateful``: a nearly valid request for the live state of a job (its current step, real stage
  indices, sizes, slots and sessions, fresh nonces, right or wrong attach proofs, own or other job
  names), so that pushes are gathered, steps commit, fetches and commits wait, and attaches, joins,
  leaves, schedule changes and drops succeed;
* ``replay``: a signed request that was accepted earlier, sent again byte for byte.

Protocol 2 (NOTE [Signed requests] in ``wstream.protocol.auth``): every header that carries a
session and decodes is, in most cases, signed at send time with that session's real key and a
fresh ``seq`` from the session's own :class:`SessionSigner` (the one the client library signs with,
so the seqs of the fuzzer and of a trainer's heartbeat thread never collide), so that it is judged by
its handler. A fraction is left as drawn, unsigned (``mac`` empty), signed and then altered, or
signed with another live session's key. ``nonce`` fields are, mostly, a fresh nonce fetched with
``hello`` just before sending, else a spent or a made-up one; ``nframes`` is mostly the number of
data frames sent. Sessions come only from the public client API (``client.create_job``,
``client.attach_job``, ``job.trainer()``; their signers as the client keeps them), from the
replies to fuzzed ``create_job`` and ``attach`` requests (their keys derived as the protocol
says), or are random.

The fuzz targets follow protocol 4's step commit point (NOTE [The step commit point] in
``wstream.server.step_commit``): a push is only gathered, and a step commits, on every stage at once, when
every stage holds its worker's gradient; each stage's version then moves to the next step as its
update ends. A target's only worker is an idle :class:`Trainer` whose pushes the fuzzer makes by
hand: :meth:`Fuzzer.advance` commits one whole step (a push of every stage, then ``commit``), and
every stage of a target is always at the same step. A fuzzed ``leave`` of that worker after a
fuzzed push of it was gathered discards the open step (the fuzzer then makes a new worker).

The oracle, for every case:

* an answer comes within ``DEADLINE_S``, except where the specification lets a request wait: a
  ``fetch`` by a joined worker of the step after the stage's current one, answered later with
  ``weights`` of exactly that stage and step (as the stage's update ends), or with
  ``session_expired`` when the worker's session ends first; a ``commit`` by a joined
  worker of the open step or the next one, held until that step commits and answered with
  ``committed`` of that step, or with ``session_expired`` when the worker's session ends first (it
  leaves: the server must answer it then). The run ends by committing steps of the targets until
  nothing waits. Either is answered ``unknown_job`` when its job is dropped meanwhile (before the
  drop's ``ok``). An ``await_step`` (any session of the job) of the step after the one its job is
  at waits too, answered with ``step_reached`` of that step once every stage is there. A worker that
  already has ``MAX_WAITING_FETCHES`` fetches (or ``MAX_HELD_COMMITS`` commits) waiting, or a job with ``MAX_WAITING_STEPS`` waiting
  ``await_step`` requests, gets ``bad_state`` at once instead. A ``push`` of the target's worker
  that carries its norm (``sumsq``) and that the server must *hold* (NOTE [Held gradient slots] in
  ``wstream.server.step_commit``, rules 1-2, computed from the fuzzer's own count of the step's
  pushes) is answered ``pushed`` only once its step committed and the stage's update read it
  (``session_expired`` when its worker leaves before the commit); whether it was refused at once
  instead is told by a ``status`` sent right after it on the same socket, answered after it. One
  target is created with ``delayed_update``: its step t reads the weights of step t - 1, so its
  fetch of the step after the next one waits (answered with the next step's weights), and its
  worker's push of the step after the open one is held back until the stage gets there (answered
  once taken, with ``pushed`` or the error taking it met, or ``session_expired`` when the worker
  leaves first);
* a header that the protocol's own decoder refuses, or data frames of a count the op does not take
  (or other than its ``nframes``), get the decoder's error code (``bad_message``, ``unknown_op``,
  ``version_mismatch``), and a header it accepts never gets one of those;
* a request naming a session that is not alive gets ``session_expired``; one of a live session
  that is unsigned, badly signed or replayed gets ``auth_failed``; one signed right gets neither
  (``auth_failed`` only from its handler: ``shutdown`` without an admin session, a ``drop_job`` of
  another job); an ``attach``/``admin_attach``/``create_job`` with a nonce that is not fresh gets
  ``auth_failed``, and one with a fresh nonce is not refused for its nonce;
* ``shutdown`` and ``admin_attach`` never succeed (the server has no admin secret), and the server
  is still running after every ``shutdown``; ``drop_job``/``save``/``set_schedule`` naming another
  job never succeed (a ``set_schedule`` of a target's own is fine: targets are not compared with a
  reference; the job trained beside the fuzzer has a token and sessions the fuzzer never learns);
* the answer is an ``error`` with a known code other than ``internal`` and a message, or a known
  reply that decodes under the reply schema and echoes the request id.

After all cases: every waiting request got its answer, the server answers, its log has no
traceback, "internal error" or ERROR line, its RSS grew by at most ``RSS_BOUND`` from the end of the
warm-up to the end, and the job trained beside the fuzzer (steps interleaved with the cases) has the
weights plain PyTorch gives.

``WSTREAM_FUZZ_CASES`` (default 1000) sets the number of cases; ``WSTREAM_FUZZ_SEED`` replaces the
fixed derandomized sequence with a seeded random one. With ``-s`` a summary is printed
(``WSTREAM_FUZZ_DEBUG=1``: with every outcome counted).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import re
import threading
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import psutil
import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch import nn

import models
from conftest import ServerProcess, start_server
from test_equivalence import assert_weights_equal, reference_train
from wstream.client import AdamW, Client, Trainer
from wstream.client import Job as ClientJob
from wstream.client.options import Transport
from wstream.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    WstreamError,
    check_frames,
    decode_reply,
    decode_request,
    encode,
)
from wstream.protocol import messages as m
from wstream.protocol.auth import SessionSigner, admin_proof, attach_proof, secret_key, session_key
from wstream.protocol.layout import build_stage_spec
from wstream.protocol.lr_schedules import Constant, InverseSqrt, MultiStep, Piecewise, Warmup, WarmupCosine
from wstream.protocol.messages import CHUNK_BYTES, MAX_HEADER_BYTES
from wstream.protocol.shm import segment_paths
from wstream.server import job as server_job
from wstream.server import step_commit as server_step_commit
from wstream.server import versions as server_versions
from wstream.server.config import ServerConfig

CASES = int(os.environ.get("WSTREAM_FUZZ_CASES", "1000"))
SEED = os.environ.get("WSTREAM_FUZZ_SEED") or None
DEADLINE_S = 20.0
"""A reply that is not deferred by the specification must come within this (normally < 10 ms)."""
RSS_BOUND = 64 * 2**20
TRAIN_STEPS = 12
MAX_WAITING_FETCHES: int | None = getattr(server_job, "MAX_WAITING_FETCHES", None)
"""Deferred fetches a worker may have at once (the server's; None where it has no such cap)."""
MAX_WAITING_STEPS: int | None = getattr(server_versions, "MAX_WAITING_STEPS", None)
"""``await_step`` requests a job keeps waiting at once (the server's; None where it has no cap)."""
MAX_HELD_COMMITS: int | None = getattr(server_step_commit, "MAX_HELD_COMMITS", None)
"""``commit`` requests a worker keeps waiting at once (the server's; None where it has no cap)."""
_config_defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
CREATION_TIMEOUT_S: float | None = _config_defaults.get("creation_timeout_s")  # type: ignore[assignment]
"""An unsealed job that gets no stage for this long is dropped (the fixture server's default)."""
GRAD_SLOTS = Transport().grad_slots
"""The gradient slots of a target's worker (a trainer's default ring; not a step ring)."""
MAX_EXTRA_SESSIONS = 4
"""Sessions opened by fuzzed ``attach`` requests kept alive at once (the oldest leave)."""

# ---- the protocol, as messages.py defines it ------------------------------------------------------
Type = msgspec.inspect.Type
REQUESTS: dict[str, type[m.Message]] = {}
for _cls in typing.get_args(m.Request):
    _info = msgspec.inspect.type_info(_cls)
    assert isinstance(_info, msgspec.inspect.StructType) and isinstance(_info.tag, str)
    REQUESTS[_info.tag] = _cls
OPS = sorted(REQUESTS)
TAG_FIELD = msgspec.inspect.type_info(typing.get_args(m.Request)[0]).tag_field
FIELDS: dict[str, tuple[msgspec.inspect.Field, ...]] = {
    op: msgspec.inspect.type_info(cls).fields for op, cls in REQUESTS.items()  # type: ignore[union-attr]
}
REPLY_OPS = {msgspec.inspect.type_info(c).tag for c in typing.get_args(m.Reply)}  # type: ignore[union-attr]
DECODE_CODES = {ErrorCode.BAD_MESSAGE.value, ErrorCode.UNKNOWN_OP.value, ErrorCode.VERSION_MISMATCH.value}
WIRE_CODES = {c.value for c in ErrorCode} - {ErrorCode.UNAVAILABLE.value, ErrorCode.INTERNAL.value}
ALL_FIELD_NAMES = sorted({f.encode_name for fs in FIELDS.values() for f in fs})
AUTH_FAILED = ErrorCode.AUTH_FAILED.value
SESSION_EXPIRED = ErrorCode.SESSION_EXPIRED.value
UNKNOWN_JOB = ErrorCode.UNKNOWN_JOB.value
BAD_STATE = ErrorCode.BAD_STATE.value
AUTH_LAYER = re.compile(r"not signed|bad mac|replayed|too old|seq must be")
"""The messages of the checks every signed request passes before its handler."""
NONCE_OPS = (m.CreateJob, m.Attach, m.AdminAttach)
"""Requests that use up a ``hello`` nonce."""
STEP_OPS = [op for op in ("push", "commit", "fetch", "leave", "join", "set_schedule") if op in REQUESTS]
"""The ops whose stateful cases move a target's steps and sessions (drawn more often)."""

I64_MIN, U64_MAX = -(2**63), 2**64 - 1
EXTREME_INTS = [
    -1, -2, 0, -(2**31), -(2**32), I64_MIN, 2**31 - 1, 2**31, 2**32, 2**40, 2**40 + 1, 2**53 + 1,
    2**62, 2**62 + 1, 2**63 - 1, 2**63, U64_MAX, 10**6 - 1, 10**6, 63, 64, 65, 65_535, 65_536, 65_537,
]  # fmt: skip
RESERVED_IDS = 2**62
"""Ids from here up are given to requests the oracle lets wait; fuzzed ids there are moved down."""
SIGN_MODES = ["sign"] * 12 + ["drawn", "unsigned", "altered", "other"]
"""How a header with a session is sent: signed with its session's key and a fresh seq (most), with
the ``seq`` and ``mac`` as drawn, with an empty ``mac``, signed and then changed, or signed with
another live session's key."""


def test_derived_op_list_is_complete() -> None:
    assert {"fetch", "push", "pull", "create_job", "add_stage", "join", "status"} <= set(OPS), OPS
    assert {"hello", "attach", "admin_attach", "shutdown", "drop_job", "save"} <= set(OPS), OPS
    assert {"commit", "set_schedule", "leave", "heartbeat", "seal", "describe", "timeline"} <= set(OPS), OPS
    assert len(OPS) >= 20, OPS  # protocol 4 has 20
    assert {"committed", "ok", "master", "joined", "attached"} <= REPLY_OPS
    assert set(OPS) == set(m.REQUEST_TYPES), "the Request union and REQUEST_TYPES (what servers decode) differ"
    assert TAG_FIELD == "op" and all(f.name != "op" for fs in FIELDS.values() for f in fs)
    assert {"error", "weights", "pushed", "challenge"} <= REPLY_OPS
    for op, cls in REQUESTS.items():  # the fuzzer signs every request that carries a session
        names = {f.name for f in FIELDS[op]}
        assert issubclass(cls, m.SessionMessage) == ("session" in names), op
        if "session" in names:
            assert {"seq", "mac"} <= names, op
        if cls.frames[1] > 0 and issubclass(cls, m.SessionMessage):
            assert "nframes" in names, op
    for cls in NONCE_OPS:
        assert {"nonce", "client_nonce"} <= set(cls.__struct_fields__), cls


# ---- header values ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionRef:
    """A session slot, resolved at send time against the sessions alive then."""

    k: int
    live: bool = False  # only the live sessions of the fuzz target jobs


@dataclass(frozen=True)
class NonceRef:
    """A ``nonce``, resolved at send time: ``fresh`` from a ``hello`` just before, or ``spent``
    (one that an earlier request used up)."""

    kind: str


@dataclass(frozen=True)
class ProofRef:
    """An attach (or admin) proof with ``token``, over the header's own name and nonces as sent."""

    token: str
    admin: bool = False


class _NFrames:
    """``nframes``: the number of data frames the case sends."""

    def __repr__(self) -> str:
        return "NFRAMES"


NFRAMES = _NFrames()


@dataclass(frozen=True)
class Raw:
    """Pre-encoded msgpack bytes, spliced into the header as one value."""

    data: bytes


def deep(depth: int, kind: int) -> Raw:
    opener = (b"\x91", b"\x81\xa1k", b"\x91\x81\xa1k")[kind % 3]  # [x], {"k": x}, [{"k": x}]
    return Raw(opener * depth + b"\xc0")


def timestamp_ext(b: bytes) -> Raw:
    """msgpack extension type -1 (timestamp), of a valid or invalid length."""
    return Raw(b"\xd4\xff" + b[:1] if len(b) < 4 else b"\xc7" + bytes([len(b)]) + b"\xff" + b)


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(I64_MIN, U64_MAX),
    st.sampled_from(EXTREME_INTS),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=20),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.binary(min_size=1, max_size=12).map(timestamp_ext),
)
ANY = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=6
)
WRONG = st.one_of(ANY, st.sampled_from([None, True, 1.5, -1, U64_MAX, "x", b"\x00" * 16, [], {}, [1, 2]]))
"""A value for a field of another type, mostly (the oracle does not need it to be invalid)."""


def int_bounds(t: Any) -> tuple[int, int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else I64_MIN)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else U64_MAX)
    return lo, hi


class Values:
    """Hypothesis strategies for values of msgspec types, biased towards the running jobs' numbers."""

    def __init__(self, ctx_ints: set[int], names: list[str]) -> None:
        self.ctx_ints = sorted(ctx_ints)
        self.names = names

    def valid(self, t: Type, name: str = "") -> st.SearchStrategy[Any]:
        I = msgspec.inspect  # noqa: E741, N806 (the type classes, by short name)
        if name == "v":
            return st.one_of(st.just(PROTOCOL_VERSION), st.just(PROTOCOL_VERSION), st.integers(-2, 3))
        if isinstance(t, I.IntType):
            lo, hi = int_bounds(t)
            near = sorted(x for x in {lo, lo + 1, hi, hi - 1, *self.ctx_ints} if lo <= x <= hi)
            return st.one_of(st.integers(lo, min(hi, lo + 8)), st.sampled_from(near), st.integers(lo, hi))
        if isinstance(t, I.FloatType):
            return st.one_of(st.sampled_from([0.0, 1e-3, 0.01, 0.5, 0.9, 0.999, 1e-8]), st.floats(0, 1), st.floats())
        if isinstance(t, I.StrType):
            hi = t.max_length if t.max_length is not None else 64
            if t.pattern is not None:
                made = st.from_regex(t.pattern, fullmatch=True).filter(lambda s: len(s) <= hi)
                return st.one_of(st.sampled_from(self.names), st.sampled_from(self.names), made) if t.min_length else made
            return st.text(min_size=t.min_length or 0, max_size=min(hi, 24))
        if isinstance(t, I.BytesType):
            if t.min_length == t.max_length == 16:  # a session
                return st.one_of(st.builds(SessionRef, st.integers(0, 15)), st.binary(min_size=16, max_size=16))
            if name == "nonce":  # from a challenge: fresh (mostly), spent or made up
                fixed = st.binary(min_size=t.min_length or 0, max_size=min(t.max_length or 32, 32))
                return st.one_of(st.just(NonceRef("fresh")), st.just(NonceRef("fresh")), st.just(NonceRef("spent")), fixed)
            return st.binary(min_size=t.min_length or 0, max_size=min(t.max_length or 32, 32))
        if isinstance(t, I.BoolType):
            return st.booleans()
        if isinstance(t, I.LiteralType):
            return st.sampled_from(t.values)
        if isinstance(t, I.NoneType):
            return st.none()
        if isinstance(t, I.UnionType):
            return st.one_of(*(self.valid(u, name) for u in t.types))
        if isinstance(t, I.TupleType):
            return st.tuples(*(self.valid(u) for u in t.item_types)).map(list)
        if isinstance(t, (I.ListType, I.VarTupleType, I.SetType, I.FrozenSetType)):
            hi = min(t.max_length if t.max_length is not None else 4, 4)
            return st.lists(self.valid(t.item_type), min_size=min(t.min_length or 0, hi), max_size=hi)
        if isinstance(t, I.DictType):
            return st.dictionaries(self.valid(t.key_type), self.valid(t.value_type), max_size=3)
        if isinstance(t, I.StructType):
            generic = self.struct(t)
            if t.cls is m.StageSpec:
                return st.one_of(generic, layout_specs())
            return generic
        return ANY  # a type this file does not know yet: any msgpack value

    def struct(self, t: Any) -> st.SearchStrategy[Any]:
        required = {f.encode_name: self.valid(f.type, f.name) for f in t.fields if f.required}
        optional = {f.encode_name: self.valid(f.type, f.name) for f in t.fields if not f.required}
        if t.array_like:  # fields in order; the optional tail may be left off
            items = [self.valid(f.type, f.name) for f in t.fields]
            n_req = sum(f.required for f in t.fields)
            return st.integers(n_req, len(items)).flatmap(lambda n: st.tuples(*items[:n]).map(list))
        fixed: dict[str, Any] = dict(required)
        if t.tag_field is not None:
            fixed[t.tag_field] = st.just(t.tag)
        return st.fixed_dictionaries(fixed, optional=optional)


SCHEDULES = [
    msgspec.to_builtins(s)
    for s in (
        Constant(),
        WarmupCosine(warmup_steps=2, total_steps=10, min_lr_ratio=0.1),
        InverseSqrt(warmup_steps=0, timescale=1),
        MultiStep(milestones=[0, 1, 2**62], gamma=1e100),
        Piecewise(steps=[0, 3], factors=[1e300, 0.0]),
        Warmup(steps=1, then=Constant()),
    )
]
"""Valid schedules for ``set_schedule`` (some with huge factors: a target's lr may overflow to inf)."""


def layout_specs() -> st.SearchStrategy[dict[str, Any]]:
    """Stage specs that pass validation (small, so that their weights can be sent)."""
    shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)
    params = st.lists(shapes, min_size=1, max_size=4)
    return st.tuples(st.text("abcxyz._", min_size=1, max_size=10), params).map(
        lambda np: msgspec.to_builtins(build_stage_spec(np[0], [(f"p{i}", s) for i, s in enumerate(np[1])]))
    )


STATE = st.fixed_dictionaries(
    {
        "target": st.integers(0, 3),
        "session": st.sampled_from(["worker"] * 6 + ["plain", "extra"]),
        "stage": st.integers(0, 8),
        "index": st.sampled_from([0, 0, 0, 1, -1]),
        "step": st.sampled_from([0, 0, 1, 1, -1, 2]),
        "slot": st.sampled_from([0, 0, 1, 2]),
        "numel": st.integers(1, 64),
        "ghost": st.sampled_from([False, False, False, False, True]),  # name no job
        "new_name": st.sampled_from(["new", "new", "new", "taken"]),
        "spec": layout_specs(),
        "optimizer": st.sampled_from([{"kind": "adamw", "lr": 0.01}, {"kind": "sgd", "momentum": 0.9}]),
        "wrong_token": st.sampled_from([False, False, False, False, True]),  # attach proof of another token
        "job": st.sampled_from(["none", "own", "none", "own", "train", "other"]),
        "keep": st.sampled_from([-1] * 6 + list(range(16))),  # >= 0: a detail left as drawn
        "no_frames": st.integers(0, 7),
        "cuts": st.lists(st.integers(0, 2**22), max_size=3),
        "lr": st.sampled_from([0.01, 1e-3, 0.0, 1e30]),  # set_schedule
        "schedule": st.sampled_from(["drawn", None, *SCHEDULES]),
    }
)
"""The details of a ``stateful`` case, drawn whatever the state (see ``Fuzzer.draw_stateful``)."""


def find_int(obj: Any, key: str) -> int | None:
    """The first integer at ``key`` anywhere in a header (the size its data frames should have)."""
    if isinstance(obj, dict):
        v = obj.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        for x in obj.values():
            found = find_int(x, key)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for x in obj:
            found = find_int(x, key)
            if found is not None:
                return found
    return None


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) in a header tree."""
    out = [(prefix, obj)] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


def replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {**obj, head: replaced(obj[head], rest, value) if rest else value}
    out = list(obj)
    out[head] = replaced(out[head], rest, value)
    return out


# ---- cases ------------------------------------------------------------------------------------------
@dataclass
class Case:
    kind: str
    op: str | None
    header: Any = None  # a map (dict) or, for not_map, any value; None: ``raw`` is the frame
    extra: list[tuple[Any, Any]] = field(default_factory=list)  # more map entries (repeats, Raw values)
    raw: bytes | None = None
    frames: list[bytes] = field(default_factory=list)
    cut: int | None = None  # truncated: keep this many bytes (modulo the length)
    trailing: bytes = b""  # truncated: bytes after the map
    depth: int = 0  # not_map: nesting depth of a value (the decoders' recursion limits differ)
    sign: str = "sign"  # one of SIGN_MODES
    replay_k: int = 0  # replay: which stored request
    fresh: set[bytes] = field(default_factory=set)  # nonces fetched for this case (set at send time)

    def describe(self, wire: bytes | None = None) -> str:
        def short(x: Any) -> str:
            s = repr(x)
            return s if len(s) <= 600 else f"{s[:300]} ...({len(s)} chars)... {s[-200:]}"

        sizes = [len(f) for f in self.frames]
        fr = f"{len(sizes)} data frames of {sizes[:8]}{'...' if len(sizes) > 8 else ''} bytes"
        hdr = short(wire if wire is not None else self.raw)
        extra = [(k, f"<raw {len(v.data)} bytes: {v.data[:12]!r}...>" if isinstance(v, Raw) else v) for k, v in self.extra]
        return (
            f"kind={self.kind} op={self.op} sign={self.sign} header={short(self.header)} extra={short(extra)}"
            f"\n  wire={hdr}\n  {fr}"
        )


class _HasRaw(Exception):
    pass


def pack(obj: Any) -> bytes:
    """msgpack of ``obj``; :class:`Raw` values are spliced in as they are."""

    def default(x: Any) -> Any:
        raise _HasRaw if isinstance(x, Raw) else TypeError(f"cannot pack {x!r}")

    try:
        return msgpack.packb(obj, default=default)
    except _HasRaw:
        pass
    if isinstance(obj, Raw):
        return obj.data
    if isinstance(obj, dict):
        return pack_map(list(obj.items()))
    if isinstance(obj, (list, tuple)):
        n = len(obj)
        head = bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 2**16 else b"\xdd" + n.to_bytes(4, "big"))
        return head + b"".join(pack(x) for x in obj)
    raise TypeError(f"cannot pack {obj!r}")


def pack_map(pairs: list[tuple[Any, Any]]) -> bytes:
    n = len(pairs)
    head = bytes([0x80 | n]) if n < 16 else (b"\xde" + n.to_bytes(2, "big") if n < 2**16 else b"\xdf" + n.to_bytes(4, "big"))
    return head + b"".join(pack(k) + pack(v) for k, v in pairs)


def sized_frames(nbytes: int, cuts: list[int], fill: int) -> list[bytes]:
    """``nbytes`` split at ``cuts`` (any positions, not only multiples of 4)."""
    points = sorted({0, nbytes, *(c % (nbytes + 1) for c in cuts)})
    byte = bytes([fill])
    return [byte * (b - a) for a, b in zip(points, points[1:], strict=False)] or [b""]


def try_decode(wire: bytes) -> m.Message | None:
    try:
        return decode_request(wire)
    except (WstreamError, RecursionError):
        return None


# ---- the jobs the fuzzer aims at ----------------------------------------------------------------------
@dataclass(eq=False)
class Target:
    """A job of the fuzzer's own, sealed, with one idle worker (a Trainer) whose pushes the fuzzer
    makes, so that its step moves only when the fuzzer commits one (:meth:`Fuzzer.advance`) or
    fuzzed pushes of that worker have gathered every stage of it."""

    name: str
    token: str
    build: Any
    shm: bool
    job: ClientJob | None = None
    trainer: Trainer | None = None
    plain: bytes = b""
    worker: bytes = b""
    gen: int = 0
    numels: list[int] = field(default_factory=list)
    gathered: set[int] = field(default_factory=set)  # stages of the open step a fuzzed push of the worker filled
    delayed: bool = False  # created with delayed_update: step t computes on the weights of t - 1


@dataclass(eq=False)
class FuzzJob:
    """A job created by a fuzzed ``create_job`` and not sealed yet: ``add_stage`` aims at it."""

    name: str
    token: str
    session: bytes
    stages: int = 0
    last_activity: float = field(default_factory=time.monotonic)  # creation or its last stage


@dataclass
class Waiting:
    """A request the specification lets wait, and the answer it must get: a ``fetch`` of
    (``stage``, ``step``) gets ``weights`` of exactly that stage and step once the stage's update
    to ``step`` ends; a ``commit`` of ``step`` (``stage`` -1) gets ``committed`` of that step when
    the step commits, or ``session_expired`` when its worker's session ends first; an ``await_step``
    of ``step`` (``stage`` -1) gets ``step_reached`` of it once every stage is there. Each gets
    ``unknown_job`` when its job is dropped meanwhile."""

    target: str
    gen: int
    stage: int
    step: int
    case: str
    session: bytes = b""  # the worker's
    before: int = 0  # fetches of that worker already waiting when it was sent
    kind: str = "fetch"  # or "commit", "await", "push" (held), "early" (a delayed job's, held back)
    slot: int = -1  # a held or held-back push's
    accepted: bool = False  # a push: not refused at once (the marker after it said so)
    lag: int = 0  # a fetch of a delayed job: it reads the weights of step - lag

    @property
    def expects(self) -> str:
        """The reply op that answers it when nothing ends it first."""
        return {"fetch": "weights", "commit": "committed", "await": "step_reached", "push": "pushed", "early": "pushed"}[self.kind]

    @property
    def due_at(self) -> int:
        """The step the job's stages must be at for the answer to be due."""
        return self.step + 1 if self.kind in ("commit", "push") else self.step - self.lag

    def __str__(self) -> str:
        return {
            "fetch": f"a waiting fetch of stage {self.stage} step {self.step}",
            "commit": f"a held commit of step {self.step}",
            "await": f"an await_step of step {self.step}",
            "push": f"a held push of stage {self.stage} step {self.step}",
            "early": f"a held-back push of stage {self.stage} step {self.step} (a delayed job's)",
        }[self.kind]


class Fuzzer:
    def __init__(self, server: ServerProcess, train_specs: list[m.StageSpec]) -> None:
        self.server = server
        self.client = Client(server.address, timeout=30)
        self.ctx = zmq.Context()
        self.sock = self._socket()  # fuzzed requests
        self.ctl = self._socket()  # the fuzzer's own bookkeeping requests
        self.ctl_id = 0
        self.signers: dict[bytes, SessionSigner] = {}  # every session the fuzzer has a key of
        self.extras: list[tuple[Target | FuzzJob, bytes]] = []  # sessions of fuzzed attaches
        self.dead: collections.deque[bytes] = collections.deque(maxlen=6)
        self.targets = {
            "fz-shm": Target("fz-shm", "tok-a", lambda: [nn.Linear(8, 8), nn.Linear(8, 3)], shm=True),
            "fz-frames": Target("fz-frames", "tok-c", lambda: [nn.Linear(4, 4), nn.Linear(4, 6), nn.Linear(6, 2)], shm=False),
            "fz-delayed": Target("fz-delayed", "tok-d", lambda: [nn.Linear(5, 5), nn.Linear(5, 7)], shm=True, delayed=True),
        }
        for t in self.targets.values():
            self._create(t)
        self.fuzz_job: FuzzJob | None = None
        self.waiting: dict[int, Waiting] = {}
        self.dropped_answers: list[Waiting] = []  # waiting requests answered unknown_job: their job must be gone
        self.expired_answers: list[Waiting] = []  # waiting requests answered session_expired: their session must be gone
        self.spent: collections.deque[bytes] = collections.deque(maxlen=8)  # nonces used up
        self.replayable: collections.OrderedDict[bytes, tuple[bytes, list[bytes], str | None]] = collections.OrderedDict()
        self.next_reserved = RESERVED_IDS
        self.train_specs = train_specs
        self.count = 0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.auth: collections.Counter[str] = collections.Counter()
        self.deferred_answered = 0  # waiting fetches answered with their weights
        self.commits_answered = 0  # held commits answered with committed
        self.steps_reached = 0  # waiting await_step answered with step_reached
        self.held_answered = 0  # held pushes answered with pushed
        self.steps_committed = 0  # steps the fuzzer committed on its targets (advance)
        self.seconds: collections.Counter[str] = collections.Counter()
        self.slowest: list[tuple[float, str, str]] = []
        own = {n for t in self.targets.values() for n in t.numels}
        other = self.train_numels = {s.numel for s in train_specs}
        assert not own & other, "the fuzz targets' stage sizes must differ from the trained job's"
        ctx_ints = own | other | {len(train_specs), len(train_specs) - 1, 3, 2, 1}
        self.values = Values(ctx_ints, [*self.targets, "train", "ghost"])
        self.header_of = {op: self.values.struct(msgspec.inspect.type_info(cls)) for op, cls in REQUESTS.items()}

    def _socket(self) -> zmq.Socket[bytes]:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(self.server.address)
        return s

    def close(self) -> None:
        for t in self.targets.values():
            if t.trainer is not None:
                t.trainer.close()
        self.client.close()
        self.sock.close()
        self.ctl.close()
        self.ctx.term()

    # ---- bookkeeping requests (the fuzzer's own, on the control socket) -------------------------
    def request(self, msg: m.Message, frames: list[bytes] | None = None) -> tuple[m.Message, list[bytes]]:
        """Send one of the fuzzer's own requests (signed, where it has a session) and wait for its reply."""
        self.ctl_id += 1
        frames = frames or []
        msg = msgspec.structs.replace(msg, id=self.ctl_id)
        if "nframes" in msg.__struct_fields__:
            msg = msgspec.structs.replace(msg, nframes=len(frames))  # type: ignore[call-arg]
        if isinstance(msg, m.SessionMessage):
            msg = self.signers[msg.session].sign(msg)
        self.ctl.send_multipart([encode(msg), *frames])
        deadline = time.monotonic() + DEADLINE_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.ctl.poll(int(left * 1000)), f"no reply to the fuzzer's own {msg!r}"
            reply = self.ctl.recv_multipart()
            decoded = decode_reply(reply[0])
            if decoded.id == self.ctl_id:
                return decoded, reply[1:]

    def hello(self) -> bytes:
        reply, _ = self.request(m.Hello())
        assert isinstance(reply, m.Challenge), reply
        return reply.nonce

    def version(self, t: Target, stage: int) -> int:
        """The version of ``stage`` of ``t``, once its update (if one runs) ended: ``pull`` waits for it."""
        reply, _ = self.request(m.Pull(session=t.plain, stage=stage))
        assert isinstance(reply, m.Master), reply
        return reply.version

    def open_step(self, t: Target) -> int:
        """The step ``t`` gathers: every stage is at it (a step commits on every stage or on none)."""
        versions = [self.version(t, stage) for stage in range(len(t.numels))]
        assert len(set(versions)) == 1, f"the stages of {t.name} are at steps {versions}: a step was applied in part"
        return versions[0]

    def _attach(self, name: str, token: str) -> bytes:
        """A new session of job ``name`` through the client API; the fuzzer keeps its signer."""
        job = self.client.attach_job(name, token=token)
        self.signers[job.session] = job._signer  # as the client keeps it: one seq counter per session
        return job.session

    def _create(self, t: Target) -> None:
        # unit_bytes=None: the fuzzer aims its messages at each chain stage (t.numels)
        t.job = self.client.create_job(
            t.name, t.build(), optimizer=AdamW(lr=1e-2), token=t.token, unit_bytes=None, delayed_update=t.delayed
        )
        t.numels = [s.numel for s in t.job.specs]
        t.plain = t.job.session
        self.signers[t.plain] = t.job._signer
        self._new_trainer(t)
        t.gen += 1

    def _new_trainer(self, t: Target) -> None:
        assert t.job is not None
        if t.trainer is not None:  # its session is gone: closing it would warn that leave failed
            quiet = logging.getLogger("wstream.client.trainer")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                t.trainer.close()
            finally:
                quiet.setLevel(level)
        t.trainer = t.job.trainer(shm=t.shm, prefetch=0, step_ring=False)  # fuzzed pushes pick their slots
        t.worker = t.trainer.session
        t.gathered = set()  # (the old worker's pushes were discarded with the open step)
        self.signers[t.worker] = t.trainer.connection.sc.signer  # shared with its heartbeat thread

    def _kill(self, *sessions: bytes) -> None:
        """These sessions ended (left, dropped, expired): later requests naming them get session_expired."""
        for s in sessions:
            self.dead.append(s)
            self.replayable.pop(s, None)
        keep = {s for _, s in self.sessions(live=False)}
        for s in [s for s in self.signers if s not in keep]:
            del self.signers[s]

    def _kill_job(self, job: Target | FuzzJob) -> None:
        """Every session of ``job`` ended (the job was dropped)."""
        mine = [s for j, s in self.extras if j is job]
        self.extras = [(j, s) for j, s in self.extras if j is not job]
        if isinstance(job, FuzzJob):
            if self.fuzz_job is job:
                self.fuzz_job = None
            self._kill(job.session, *mine)
        else:
            self._kill(job.plain, job.worker, *mine)

    def _leave_extra(self, session: bytes) -> None:
        reply, _ = self.request(m.Leave(session=session))
        assert isinstance(reply, m.Ok), reply
        self.extras = [(j, s) for j, s in self.extras if s != session]
        self._kill(session)

    def _drop_fuzz_job(self) -> None:
        job = self.fuzz_job
        if job is None:
            return
        reply, _ = self.request(m.DropJob(session=job.session))
        if not self.creation_expired(job, reply):
            assert isinstance(reply, m.Ok), reply
        self._kill_job(job)

    def creation_timed_out(self, job: FuzzJob) -> bool:
        """Whether the server may have dropped unsealed ``job`` for getting no stage for too long."""
        return CREATION_TIMEOUT_S is not None and time.monotonic() - job.last_activity > CREATION_TIMEOUT_S - 5

    def creation_expired(self, job: Any, reply: Any) -> bool:
        """``reply`` (to a request of a session of ``job``) says the session is gone, and that is
        explained by the server's creation timeout: forget the job."""
        code = reply.code if isinstance(reply, m.Error) else reply.get("code") if isinstance(reply, dict) else None
        if not isinstance(job, FuzzJob) or code != SESSION_EXPIRED or not self.creation_timed_out(job):
            return False
        assert job.name not in {j.name for j in self.client.status().jobs}, f"{job.name}: session expired, job kept"
        self.outcomes["creation timed out"] += 1
        self._kill_job(job)
        return True

    def check_creation_timeout(self) -> None:
        """An unsealed job idle well beyond the creation timeout must be gone."""
        job = self.fuzz_job
        if job is None or CREATION_TIMEOUT_S is None:
            return
        if time.monotonic() - job.last_activity > CREATION_TIMEOUT_S + 5:
            names = {j.name for j in self.client.status().jobs}
            assert job.name not in names, f"unsealed job {job.name} idle for {CREATION_TIMEOUT_S + 5:g} s still exists"
            self.outcomes["creation timed out"] += 1
            self._kill_job(job)

    def sessions(self, live: bool) -> list[tuple[str, bytes]]:
        out = []
        for t in self.targets.values():
            out += [(f"{t.name}.plain", t.plain), (f"{t.name}.worker", t.worker)]
        if self.fuzz_job is not None:
            out.append(("fuzz_job", self.fuzz_job.session))
        out += [(f"extra.{j.name}", s) for j, s in self.extras]
        if live:
            return out
        out += [("dead", s) for s in self.dead]
        return out

    def live(self) -> set[bytes]:
        return {s for _, s in self.sessions(live=True)}

    def owner(self, session: bytes) -> tuple[Target | FuzzJob | None, str]:
        for t in self.targets.values():
            if session == t.plain:
                return t, "plain"
            if session == t.worker:
                return t, "worker"
        if self.fuzz_job is not None and session == self.fuzz_job.session:
            return self.fuzz_job, "plain"
        for j, s in self.extras:
            if s == session:
                return j, "extra"
        return None, ""

    def job_named(self, name: str) -> Target | FuzzJob | None:
        if name in self.targets:
            return self.targets[name]
        if self.fuzz_job is not None and self.fuzz_job.name == name:
            return self.fuzz_job
        return None

    def waiting_of(self, session: bytes) -> int:
        """The fetches of ``session`` waiting now (the server caps those; held commits are not counted)."""
        return sum(1 for w in self.waiting.values() if w.session == session and w.kind == "fetch")

    def awaits_of(self, t: Target) -> int:
        """The ``await_step`` requests of job ``t`` waiting now (the server caps those per job)."""
        return len(self.waiting_of_kind(t, "await"))
    # ---- drawing a case -------------------------------------------------------------------------------
    KINDS = [
        "valid", "valid", "wrong_type", "missing_extra", "extreme", "big", "raw", "truncated",
        "not_map", "frames", "frames", "cross_job", "stateful", "stateful", "stateful", "stateful", "replay",
    ]  # fmt: skip

    def draw(self, data: st.DataObject) -> Case:
        kind = data.draw(st.sampled_from(self.KINDS), label="kind")
        op = data.draw(st.sampled_from(OPS), label="op")
        sign = data.draw(st.sampled_from(SIGN_MODES), label="sign")
        if kind == "raw":
            return Case(kind, None, raw=data.draw(st.binary(max_size=300)))
        if kind == "replay":
            return Case(kind, None, replay_k=data.draw(st.integers(0, 7)))
        if kind == "stateful":  # (half of them one of the ops that move a target's steps and sessions)
            op = data.draw(st.one_of(st.just(op), st.sampled_from(STEP_OPS)), label="stateful op")
            case = self.draw_stateful(data, op)
            case.sign = data.draw(st.sampled_from(["sign", sign]), label="stateful sign")  # (mostly signed)
            return case
        header = data.draw(self.header_of[op], label="header")
        header = {TAG_FIELD: op, **header}
        fields = {f.encode_name: f for f in FIELDS[op]}
        if data.draw(st.integers(0, 5), label="nframes") and "nframes" in fields:
            header["nframes"] = NFRAMES  # the count sent, mostly (else as drawn: rarely right)
        case = Case(kind, op, header, sign=sign)
        if kind == "wrong_type":
            for key in data.draw(st.lists(st.sampled_from([TAG_FIELD, *fields]), min_size=1, max_size=2, unique=True)):
                case.header[key] = data.draw(WRONG)
        elif kind == "missing_extra":
            keys = list(case.header)
            for key in data.draw(st.lists(st.sampled_from(keys), max_size=len(keys), unique=True)):
                del case.header[key]
            names = st.one_of(st.sampled_from([*ALL_FIELD_NAMES, "frames", "kind", "session", "op"]), st.text(max_size=10))
            case.extra = data.draw(st.lists(st.tuples(names, ANY), max_size=3))
        elif kind == "extreme":
            ints = [p for p, v in paths(case.header) if isinstance(v, int) and not isinstance(v, bool)]
            if ints:
                for p in data.draw(st.lists(st.sampled_from(ints), min_size=1, max_size=4, unique=True)):
                    case.header = replaced(case.header, p, data.draw(st.sampled_from(EXTREME_INTS)))
            else:
                case.header["id"] = data.draw(st.sampled_from(EXTREME_INTS))
        elif kind == "big":
            self.make_big(data, case)
        elif kind == "not_map":
            self.make_not_map(data, case)
        elif kind == "truncated":
            if data.draw(st.integers(0, 2)):
                case.cut = data.draw(st.integers(0, 2**16))
            else:
                case.trailing = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "cross_job":
            self.make_cross_job(data, case)
        if kind == "frames":
            case.frames = self.fuzz_frames(data, case)
        elif kind != "cross_job":
            case.frames = self.default_frames(case)
        return case

    def default_frames(self, case: Case) -> list[bytes]:
        if case.op is None or REQUESTS[case.op].frames[0] == 0:
            return []
        numel = find_int(case.header, "numel")
        nbytes = numel * 4 if numel is not None and 0 <= numel <= 2**20 else 16
        return sized_frames(nbytes, [], 0)

    def fuzz_frames(self, data: st.DataObject, case: Case) -> list[bytes]:
        lo, hi = REQUESTS[case.op].frames if case.op else (0, 0)
        how = data.draw(st.sampled_from(["sized", "sized", "sized", "count", "count", "count", "oversized", "many"]))
        fill = data.draw(st.sampled_from([0, 0xFF, 0x7F]))
        if how == "sized":  # the right total (or off by a little), cut anywhere
            numel = find_int(case.header, "numel")
            numel = numel if numel is not None and 0 <= numel <= 2**20 else data.draw(st.integers(0, 4096))
            nbytes = max(0, numel * 4 + data.draw(st.sampled_from([0, 0, 0, 1, -1, 4, -4])))
            return sized_frames(nbytes, data.draw(st.lists(st.integers(0, nbytes), max_size=4)), fill)
        if how == "count":
            n = data.draw(st.sampled_from(sorted({0, 1, 2, 3, max(lo - 1, 0), lo, lo + 1, min(hi, 70), min(hi + 1, 70)})))
            return [bytes([fill]) * data.draw(st.sampled_from([0, 1, 3, 4, 64, 4096])) for _ in range(n)]
        if how == "oversized":
            size = data.draw(st.sampled_from([CHUNK_BYTES, CHUNK_BYTES + 1, 3 * 2**20 + 5, 2 * CHUNK_BYTES + 3]))
            return [bytes([fill]) * size]
        return [b""] * data.draw(st.sampled_from([hi, hi + 1, 1000]))  # many (empty) frames

    def make_big(self, data: st.DataObject, case: Case) -> None:
        spec = case.header.get("spec") if isinstance(case.header, dict) else None
        how = data.draw(st.sampled_from(["string", "string", "bytes", "list", "shapes", "params"] if spec else ["string", "bytes", "list"]))
        big = data.draw(st.sampled_from([129, 513, 4097, 10**5, 10**6, 2**22]))
        tree = paths(case.header)
        if how == "shapes" and spec:
            shapes = data.draw(
                st.lists(st.lists(st.sampled_from([0, 1, 2**20, 2**40, 2**40 + 1, U64_MAX]), min_size=0, max_size=12), min_size=1, max_size=8)
            )
            spec["params"] = [[f"p{i}", s, data.draw(st.sampled_from([0, 16, 2**40, 2**40 - 1]))] for i, s in enumerate(shapes)]
            spec["numel"] = data.draw(st.sampled_from([1, 2**20, 2**40, 2**40 + 1]))
        elif how == "params" and spec:
            n = data.draw(st.sampled_from([m.MAX_PARAMS_PER_STAGE, m.MAX_PARAMS_PER_STAGE + 1, 20_000]))
            spec["params"] = [[f"p{i}", [1], 16 * i] for i in range(n)]
            spec["numel"] = 16 * n
        elif how == "string":
            strs = [p for p, v in tree if isinstance(v, str)]
            key = data.draw(st.sampled_from(strs)) if strs else (data.draw(st.sampled_from(ALL_FIELD_NAMES)),)
            case.header = replaced(case.header, key, "é" * (big // 2) if data.draw(st.booleans()) else "n" * big)
        elif how == "bytes":
            key = data.draw(st.sampled_from([p for p, v in tree if isinstance(v, (bytes, SessionRef))] or [("session",)]))
            case.header = replaced(case.header, key, b"\x01" * big)
        else:
            lists = [p for p, v in tree if isinstance(v, list)]
            key = data.draw(st.sampled_from(lists)) if lists else ("x",)
            case.header = replaced(case.header, key, [0] * min(big, 10**5))

    def make_not_map(self, data: st.DataObject, case: Case) -> None:
        how = data.draw(st.sampled_from(["value", "keys", "deep", "deep", "op"]))
        if how == "value":  # a list, a number, a string... as the whole header
            case.header = data.draw(st.one_of(ANY, st.lists(ANY, max_size=4), st.just(list(case.header.values()))))
        elif how == "keys":  # keys that are not strings
            keys = st.one_of(st.integers(I64_MIN, U64_MAX), st.binary(max_size=4), st.none(), st.booleans(), st.floats())
            case.extra = data.draw(st.lists(st.tuples(keys, ANY), min_size=1, max_size=2))
        elif how == "deep":  # nested deeper than any decoder recursion limit, in any field
            depth = data.draw(st.sampled_from([10, 500, 900, 990, 1000, 1100, 3000, 100_000]))
            key = data.draw(st.sampled_from([*case.header, "x"]))
            case.header.pop(key, None)
            case.extra = [(key, deep(depth, data.draw(st.integers(0, 2))))]
            case.depth = depth
        else:  # op names that are no request: replies, case changes, empty, long
            case.header[TAG_FIELD] = data.draw(
                st.one_of(st.sampled_from(sorted(REPLY_OPS)), st.sampled_from([o.upper() for o in OPS]), st.text(max_size=12), st.just("x" * 5000))
            )

    def make_cross_job(self, data: st.DataObject, case: Case) -> None:
        """A real session of a fuzz target naming job B's stages, steps and sizes."""
        b = self.train_specs
        others = {s.numel for s in b}
        ints = {
            "stage": st.integers(1, len(b) - 1),
            "index": st.integers(0, len(b)),
            "step": st.integers(0, TRAIN_STEPS + 1),
            "numel": st.sampled_from(sorted(others)),
            "slot": st.integers(0, 3),
        }
        for key in case.header:
            if key in ints:
                case.header[key] = data.draw(ints[key])
            elif key == "session":
                case.header[key] = SessionRef(data.draw(st.integers(0, 15)), live=True)
        if "name" in case.header:
            case.header["name"] = "train"
        case.header["v"] = PROTOCOL_VERSION  # (else left out half the time: version_mismatch)
        numel = data.draw(st.sampled_from(sorted(others)))
        cuts = data.draw(st.lists(st.integers(0, numel * 4), max_size=2))
        case.frames = sized_frames(numel * 4, cuts, 0) if data.draw(st.integers(0, 3)) else []

    def draw_stateful(self, data: st.DataObject, op: str) -> Case:
        """A request that is right for the live state, but for one or two details.

        Every draw is made whatever the state (hypothesis replays choice sequences and needs them
        to be the same for the same earlier choices); the state only interprets them."""
        header = {TAG_FIELD: op, **data.draw(self.header_of[op], label="header")}
        d = data.draw(STATE, label="state")
        names = sorted(self.targets) + (["fuzz_job"] if self.fuzz_job is not None else [])
        which = names[d["target"] % len(names)]
        if op in ("add_stage", "seal") and self.fuzz_job is not None and d["target"] != 1:
            which = "fuzz_job"  # (the only job still being created)
        job: Target | FuzzJob
        if which == "fuzz_job":
            assert self.fuzz_job is not None
            job = self.fuzz_job
            session, stage_count, numels, shm = job.session, job.stages, [], True
        else:
            job = t = self.targets[which]
            joins = op == "join" and d["slot"] != 2  # (mostly a session that has not joined)
            session = t.worker if d["session"] == "worker" and not joins else t.plain
            stage_count, numels, shm = len(t.numels), t.numels, t.shm
        extras = [s for j, s in self.extras if j is job]
        if d["session"] == "extra" and extras:
            session = extras[d["stage"] % len(extras)]
        stage = d["stage"] % (stage_count + 1)  # stage_count: no such stage
        fields = {f.encode_name for f in FIELDS[op]}
        version = 0
        if isinstance(job, Target) and stage < stage_count and "step" in fields:
            version = self.version(job, stage)
        others = [n for n in self.targets if n != job.name]
        new_name = f"fz-new-{self.count}" if d["new_name"] == "new" else job.name
        want: dict[str, Any] = {
            "session": session,
            "stage": stage,
            "index": max(0, stage_count + d["index"]),
            "step": max(0, version + d["step"]),
            "slot": d["slot"],
            "numel": numels[stage] if stage < len(numels) else d["numel"],
            "dtype": "float32",
            "v": PROTOCOL_VERSION,
            "name": new_name if op == "create_job" else ("ghost" if d["ghost"] else job.name),
            "spec": d["spec"],
            "options": {"optimizer": d["optimizer"]},
            "nonce": NonceRef("fresh"),
            "proof": ProofRef("not-" + job.token if d["wrong_token"] else job.token, admin=op == "admin_attach"),
            "job": {"none": None, "own": job.name, "train": "train", "other": others[0]}[d["job"]],
            "nframes": NFRAMES,
            "lr": d["lr"],
        }
        for i, (key, value) in enumerate(want.items()):
            if key in fields and d["keep"] != i:
                header[key] = value
        if "schedule" in fields and d["schedule"] != "drawn":
            header["schedule"] = d["schedule"]
        case = Case("stateful", op, header)
        nbytes = (find_int(header, "numel") or 0) * 4
        if REQUESTS[op].frames[1] == 0 or (op == "push" and shm and d["no_frames"]):
            case.frames = []
        elif 0 <= nbytes <= 2**22:
            case.frames = sized_frames(nbytes, d["cuts"], 0)
        else:
            case.frames = [b"\x00" * 16]
        return case

    # ---- running a case -------------------------------------------------------------------------------
    def session_of(self, ref: SessionRef) -> bytes:
        pool = self.sessions(ref.live)
        return pool[ref.k % len(pool)][1]

    def nonce_for(self, ref: NonceRef, case: Case) -> bytes:
        if ref.kind == "fresh" or not self.spent:
            nonce = self.hello()
            case.fresh.add(nonce)
            return nonce
        return self.spent[-1]

    def resolve(self, obj: Any, case: Case, top: bool = False) -> Any:
        """``obj`` with the placeholders resolved against the state now (a copy)."""
        if isinstance(obj, SessionRef):
            return self.session_of(obj)
        if isinstance(obj, NonceRef):
            return self.nonce_for(obj, case)
        if obj is NFRAMES:
            return len(case.frames)
        if isinstance(obj, ProofRef):
            return obj if top else b"\x00" * 32  # (a proof is made over its own header's fields)
        if isinstance(obj, dict):
            out = {k: self.resolve(v, case) if not isinstance(v, ProofRef) else v for k, v in obj.items()}
            if top:
                for k, v in out.items():
                    if isinstance(v, ProofRef):
                        out[k] = self.proof(v, out)
            else:
                out = {k: b"\x00" * 32 if isinstance(v, ProofRef) else v for k, v in out.items()}
            return out
        if isinstance(obj, list):
            return [self.resolve(v, case) for v in obj]
        return obj

    @staticmethod
    def proof(ref: ProofRef, header: dict[Any, Any]) -> bytes:
        name, nonce, mine = header.get("name"), header.get("nonce"), header.get("client_nonce")
        if not (isinstance(nonce, bytes) and isinstance(mine, bytes)):
            return b"\x00" * 32
        if ref.admin:
            return admin_proof(secret_key(ref.token), nonce, mine)
        if isinstance(name, str):
            return attach_proof(secret_key(ref.token), name, nonce, mine)
        return b"\x00" * 32

    def sign(self, mode: str, header: dict[Any, Any], msg: m.SessionMessage) -> m.Message | None:
        """Put ``seq`` and ``mac`` into ``header`` as ``mode`` says; the signed record where they are
        right (the server must then judge the request in its handler), else None."""
        signer = self.signers.get(msg.session)
        if mode == "drawn" or signer is None:
            return None  # as drawn (a random session cannot be signed: it has no key)
        if mode == "unsigned":
            header["mac"] = b""
            return None
        if mode == "other":
            others = [self.signers[s] for s in self.live() if s != msg.session and s in self.signers]
            if others:
                other = others[len(header) % len(others)]
                forged = other.sign(msgspec.structs.replace(msg, session=other.session))
                header["seq"], header["mac"] = forged.seq, forged.mac  # type: ignore[attr-defined]
                return None
            mode = "altered"
        signed = signer.sign(msg)
        assert isinstance(signed, m.SessionMessage)
        header["seq"], header["mac"] = signed.seq, signed.mac
        if mode == "altered":  # changed after signing: the id (covered by the mac) or the mac itself
            if isinstance(header.get("id"), int) and not isinstance(header["id"], bool) and signed.mac[0] % 2:
                header["id"] ^= 1
            else:
                header["mac"] = bytes([signed.mac[0] ^ 1]) + signed.mac[1:]
            return None
        return signed

    def may_wait(self, msg: m.Message) -> Waiting | None:
        """The deferrals the specification allows: a joined worker fetching the step after its
        stage's current one, or committing the job's open step or the next one (held until that
        step commits; NOTE [The step commit point] in server/step_commit.py)."""
        if isinstance(msg, m.AwaitStep):  # any session of a target; the step after the job's one waits
            owner, _ = self.owner(msg.session)
            if not isinstance(owner, Target) or msg.job not in (None, owner.name) or msg.step != self.open_step(owner) + 1:
                return None
            return Waiting(owner.name, owner.gen, -1, msg.step, "", msg.session, self.awaits_of(owner), kind="await")
        if not isinstance(msg, (m.Fetch, m.Commit, m.Push)):
            return None
        owner, role = self.owner(msg.session)
        if not isinstance(owner, Target) or role != "worker":
            return None
        if isinstance(msg, m.Push):
            return self.early_push(owner, msg) if owner.delayed else self.held_push(owner, msg)
        if isinstance(msg, m.Commit):
            open_step = self.open_step(owner)
            if not open_step <= msg.step <= open_step + 1:
                return None  # answered at once: from the kept outcomes of committed steps, or stale_step
            held = sum(1 for w in self.waiting.values() if w.session == msg.session and w.kind == "commit")
            return Waiting(owner.name, owner.gen, -1, msg.step, "", msg.session, held, kind="commit")
        if msg.stage >= len(owner.numels):
            return None
        version = self.version(owner, msg.stage)
        lag = 1 if owner.delayed and msg.step >= 1 else 0  # (NOTE rule 5 of server/versions.py; created at step 0)
        if msg.step - lag != version + 1:
            return None
        return Waiting(owner.name, owner.gen, msg.stage, msg.step, "", msg.session, self.waiting_of(msg.session), lag=lag)

    def early_push(self, t: Target, msg: m.Push) -> Waiting | None:
        """The wait of a delayed job's push of the step after the open one, which the server holds
        back until its stage reaches that step (NOTE [The step commit point] rule 6 in
        server/step_commit.py), else None. At most a slot per stage per worker's slot is held back
        (more: ``bad_state`` at once)."""
        if msg.stage >= len(t.numels) or msg.step != self.open_step(t) + 1:
            return None
        if sum(1 for w in self.waiting_of_kind(t, "early") if (w.stage, w.step) == (msg.stage, msg.step)) >= GRAD_SLOTS:
            return None
        return Waiting(t.name, t.gen, msg.stage, msg.step, "", msg.session, kind="early", slot=msg.slot)

    def waiting_of_kind(self, t: Target, kind: str) -> list[Waiting]:
        """The requests of job ``t`` (this generation of it) waiting now, of one kind."""
        return [w for w in self.waiting.values() if w.kind == kind and w.target == t.name and w.gen == t.gen]

    def held_push(self, t: Target, msg: m.Push) -> Waiting | None:
        """The wait of a push of ``t``'s worker that the server holds if it accepts it (NOTE [Held
        gradient slots] rules 1-2: it carries its norm, its worker is the only one, and its slots
        held, this one and one for each stage it still owes the step fit in its ring), else None.
        Pushes held in the step before are answered first, so that the worker's held slots are
        exactly the waiting held pushes of the open step."""
        if msg.sumsq is None or msg.stage >= len(t.numels) or msg.stage in t.gathered or t.delayed:
            return None
        step = self.open_step(t)
        if msg.step != step:
            return None  # refused at once: stale_step
        self.answered(t, step)  # the held pushes of the last step, answered as their updates ended
        held = self.held_slots(t)
        owed = len(t.numels) - (len(t.gathered) + 1)  # (every stage of a target trains)
        if len(held) + 1 + owed > GRAD_SLOTS:
            return None
        return Waiting(t.name, t.gen, msg.stage, msg.step, "", msg.session, kind="push", slot=msg.slot)

    def held_slots(self, t: Target) -> set[int]:
        """The slots of ``t``'s worker that held pushes of its open step keep (a held-back push takes
        its slot only when its stage takes it)."""
        return {w.slot for w in self.waiting_of_kind(t, "push") if w.accepted}

    def build(self, case: Case) -> tuple[bytes, m.Message | None, Waiting | None, bool]:
        """The header frame with the state now: sessions, nonces, proofs, ``nframes``, ids clear of
        the reserved ones, and the signature; the signed record, the wait it may make, and whether
        it is a fetch that would wait but for the cap on waiting fetches."""
        if case.raw is not None:
            return case.raw, None, None, False
        header = self.resolve(case.header, case, top=True)
        extra = [(k, self.resolve(v, case)) for k, v in case.extra]
        if not isinstance(header, dict):
            return pack(header), None, None, False
        rid = header.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and rid >= RESERVED_IDS:
            header["id"] = rid - RESERVED_IDS // 2
        wire = pack_map([*header.items(), *extra])
        signed: m.Message | None = None
        waiting: Waiting | None = None
        capped = False
        if case.cut is not None:
            return wire[: case.cut % len(wire)], None, None, False
        if case.trailing:
            return wire + case.trailing, None, None, False
        msg = try_decode(wire)
        if isinstance(msg, m.SessionMessage):
            if case.sign == "sign" and msg.session in self.live():
                try:
                    check_frames(msg, case.frames)
                    waiting = self.may_wait(msg)
                except WstreamError:
                    pass
                limit = {"await": MAX_WAITING_STEPS, "fetch": MAX_WAITING_FETCHES, "commit": MAX_HELD_COMMITS}.get(waiting.kind) if waiting else None
                if waiting is not None and limit is not None and waiting.before >= limit:
                    waiting, capped = None, True  # refused at once
                elif waiting is not None:
                    header["id"] = self.next_reserved
                    self.next_reserved += 1
                    msg = msgspec.structs.replace(msg, id=header["id"])
            signed = self.sign(case.sign, header, msg)
            wire = pack_map([*header.items(), *extra])
        return wire, signed, waiting, capped

    def flood(self, case: Case) -> None:
        """Fill the case's worker up to the cap on waiting fetches (each will wait): the case itself
        is then one fetch too many. The fetches are spread over the stages, so that each stage's
        update answers its share of them (the step the case is followed by answers them all)."""
        ref = case.header["session"]
        t = self.targets["fz-shm"]
        assert MAX_WAITING_FETCHES is not None and self.session_of(ref) == t.worker
        signer = self.signers[t.worker]
        steps = [self.version(t, stage) + 1 for stage in range(len(t.numels))]
        case.header["step"] = steps[case.header["stage"]]
        before = self.waiting_of(t.worker)
        for n in range(before, MAX_WAITING_FETCHES):
            rid = self.next_reserved
            self.next_reserved += 1
            stage = n % len(steps)
            msg = signer.sign(m.Fetch(id=rid, session=t.worker, stage=stage, step=steps[stage]))
            what = f"flood fetch {n} of stage {stage} step {steps[stage]}"
            self.waiting[rid] = Waiting(t.name, t.gen, stage, steps[stage], what, t.worker, n)
            self.sock.send_multipart([encode(msg)])
        self.outcomes["deferred"] += MAX_WAITING_FETCHES - before

    def pick_replay(self, case: Case) -> None:
        """A replay case: a signed request accepted earlier, byte for byte (or ``status``)."""
        stored = list(self.replayable.values())
        if stored:
            case.raw, case.frames, case.op = stored[case.replay_k % len(stored)]
        else:
            case.raw, case.op = pack({"v": PROTOCOL_VERSION, TAG_FIELD: "status", "id": 3}), "status"

    def run(self, case: Case) -> None:
        if case.kind == "replay":
            self.pick_replay(case)
        elif case.kind == "flood":
            self.flood(case)
        wire, signed, waiting, capped = self.build(case)
        expected_code: str | None = None
        msg: m.Message | None = None
        try:
            msg = decode_request(wire)
            check_frames(msg, case.frames)
        except WstreamError as exc:
            expected_code, msg = exc.code.value, None
        except RecursionError:  # the spec: a header that cannot be decoded is a bad_message
            expected_code, msg = ErrorCode.BAD_MESSAGE.value, None
        auth = ""
        fresh_nonce = False
        if isinstance(msg, m.SessionMessage):
            if msg.session not in self.live():
                auth, expected_code = "expired", SESSION_EXPIRED
            elif signed is not None and same_message(msg, signed):
                auth = "signed"
            else:
                auth, expected_code = "refused", AUTH_FAILED
            self.auth[auth] += 1
        elif isinstance(msg, NONCE_OPS):
            fresh_nonce = msg.nonce in case.fresh
            self.spent.append(msg.nonce)  # used up, whatever the outcome
            self.auth["fresh nonce" if fresh_nonce else "stale nonce"] += 1
            if not fresh_nonce:
                expected_code = AUTH_FAILED
        if auth != "signed":
            waiting, capped = None, False  # (it is refused before its handler)
        if capped:
            expected_code = BAD_STATE
        if waiting is not None:
            assert msg is not None
            waiting.case = case.describe(wire)
            self.waiting[msg.id] = waiting
        self.count += 1
        self.kinds[case.kind] += 1
        self.ops[case.op or "-"] += 1
        large = len(wire) + sum(len(f) for f in case.frames) > 2**16
        self.sock.send_multipart([wire, *case.frames], copy=not large)
        if waiting is not None and waiting.kind in ("push", "early"):
            return self.sent_held_push(waiting, msg)
        if waiting is not None:
            self.outcomes[{"fetch": "deferred", "commit": "held commits", "await": "step waits"}[waiting.kind]] += 1
            return
        sent = time.perf_counter()
        got = self.receive(time.monotonic() + DEADLINE_S)
        latency = time.perf_counter() - sent
        self.slowest = sorted([*self.slowest, (latency, case.kind, case.op or "-")], reverse=True)[:5]
        where = Where(self.count, case, wire)
        assert got is not None, f"no reply within {DEADLINE_S} s to {where}\n{self.server.log()[-3000:]}"
        reply, frames = got
        assert isinstance(reply, dict) and isinstance(reply.get("op"), str), f"reply {reply!r} to {where}"
        op = reply["op"]
        owner = self.owner(msg.session)[0] if isinstance(msg, m.SessionMessage) else None
        if op == "error":
            code = reply.get("code")
            text = reply.get("message")
            self.outcomes[f"{case.op}:{code}"] += 1
            assert code in WIRE_CODES, f"error code {code!r} ({text!r}) for {where}"
            assert isinstance(text, str) and text, f"no message in {reply!r} for {where}"
            if auth in ("signed", "refused") and code == SESSION_EXPIRED and self.creation_expired(owner, reply):
                pass  # its unsealed job went at the creation timeout
            elif case.depth > 200 and code == ErrorCode.BAD_MESSAGE.value:
                pass  # nested too deeply for the server (its stack and recursion limit are not ours)
            elif expected_code is not None:
                assert code == expected_code, f"expected {expected_code}, got {reply!r} for {where}"
            else:
                assert code not in DECODE_CODES, f"a valid request was refused: {reply!r} for {where}"
            if auth == "signed":
                assert not (code == AUTH_FAILED and AUTH_LAYER.search(text)), f"signed right, refused: {reply!r} for {where}"
            if fresh_nonce:
                assert not (code == AUTH_FAILED and "nonce" in text), f"a fresh nonce refused: {reply!r} for {where}"
            if capped:
                assert "limit" in text, f"expected the cap on waiting requests, got {reply!r} for {where}"
                self.outcomes["capped"] += 1
            if isinstance(msg, m.Shutdown) and auth == "signed":  # nobody may stop a server without an admin secret
                assert code == AUTH_FAILED and "admin" in text, f"{reply!r} for {where}"
        else:
            self.outcomes[f"{case.op}:{op}"] += 1
            assert expected_code is None, f"expected error {expected_code}, got {reply!r} for {where}"
            assert op in REPLY_OPS, f"unknown reply op in {reply!r} for {where}"
            try:
                decode_reply(frames[0])
            except WstreamError as exc:
                raise AssertionError(f"reply does not decode ({exc}): {reply!r} for {where}") from None
            assert not isinstance(msg, (m.Shutdown, m.AdminAttach)), f"without an admin secret: {reply!r} for {where}"
            if isinstance(msg, (m.DropJob, m.Save, m.SetSchedule)) and msg.job is not None:
                assert owner is not None and msg.job == owner.name, f"another job's {case.op}: {reply!r} for {where}"
            if isinstance(msg, m.SessionMessage):  # (the job trained beside the fuzzer is out of its reach)
                assert owner is not None, f"accepted for a session the fuzzer does not know: {reply!r} for {where}"
        if isinstance(msg, m.Shutdown):
            assert self.server.proc.poll() is None, f"the server stopped after {where}\n{self.server.log()[-3000:]}"
        if msg is not None:
            assert reply.get("id") == msg.id, f"reply id {reply.get('id')} for request id {msg.id}: {where}"
        else:
            rid = reply.get("id")
            assert rid == 0 or rid in request_ids(wire), f"reply id {rid!r} to {where}"
        if auth == "signed" and (op != "error" or reply["code"] not in (SESSION_EXPIRED, AUTH_FAILED)):
            assert isinstance(msg, m.SessionMessage)
            if sum(len(f) for f in case.frames) <= 2**20:  # its seq is used now: sent again, it is a replay
                self.replayable[msg.session] = (wire, list(case.frames), case.op)
                self.replayable.move_to_end(msg.session)
                while len(self.replayable) > 8:
                    self.replayable.popitem(last=False)
        if op != "error" and msg is not None:
            if case.kind == "cross_job":  # sized for job B, sent with a session of another job
                assert getattr(msg, "numel", None) not in self.train_numels, f"accepted: {reply!r} for {where}"
            self.after_success(msg, reply)
        if case.kind == "flood":  # the step's updates answer every waiting fetch: the worker may wait again
            self.advance(self.targets["fz-shm"])
        for w in self.dropped_answers:  # answered unknown_job: their job must be gone now
            assert self.targets[w.target].gen != w.gen, f"a waiting {w.kind} got unknown_job, its job is alive: {w.case}"
        self.dropped_answers.clear()
        for w in self.expired_answers:  # answered session_expired: their worker's session must be gone now
            assert w.session not in self.live(), f"{w} got session_expired, its session is alive: {w.case}"
        self.expired_answers.clear()
        self.check_creation_timeout()

    def sent_held_push(self, w: Waiting, msg: m.Message | None) -> None:
        """A push the server must hold if it accepts it was sent: a ``status`` sent after it on the
        same socket is answered after any refusal of it (one loop handles both in order). Not
        refused: it is held, and counts as the worker's push of its stage."""
        assert isinstance(msg, m.Push)
        marker = self.next_reserved
        self.next_reserved += 1
        self.sock.send_multipart([encode(m.Status(id=marker))])
        got = self.receive(time.monotonic() + DEADLINE_S)
        assert got is not None and got[0].get("id") == marker, f"no answer to the status sent after {w.case}: {got!r}"
        if msg.id in self.waiting and not w.accepted:
            w.accepted = True
            if w.kind == "early":  # it counts when its stage takes it, and is answered then
                self.outcomes["held-back pushes"] += 1
                return
            self.outcomes["held pushes"] += 1
            self.fuzz_pushed(self.targets[w.target], w.stage)

    def fuzz_pushed(self, t: Target, stage: int) -> None:
        """A fuzzed push of ``t``'s worker was accepted for ``stage`` of the open step."""
        assert stage not in t.gathered, f"a second push of stage {stage} was accepted"
        t.gathered.add(stage)
        if len(t.gathered) == len(t.numels):  # the step committed
            t.gathered.clear()
            self.outcomes["steps committed by fuzzed pushes"] += 1

    def receive(self, deadline: float, until: Any = None) -> tuple[Any, list[bytes]] | None:
        """The next reply that is not the late answer of a waiting request (those are checked);
        None at the deadline, or once ``until()`` holds after such an answer."""
        while True:
            if until is not None and until():
                return None
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                return None
            frames = self.sock.recv_multipart()
            reply = msgpack.unpackb(frames[0], strict_map_key=False)
            rid = reply.get("id") if isinstance(reply, dict) else None
            if rid in self.waiting:
                self.settle(rid, reply, frames[0])
            else:
                return reply, frames

    def settle(self, rid: int, reply: dict[str, Any], header: bytes) -> None:
        """Check the late answer of a waiting request (see :class:`Waiting`)."""
        w = self.waiting.pop(rid)
        what = str(w)
        assert isinstance(reply, dict), f"{what} got {reply!r}: {w.case}"
        error = reply.get("code") if reply.get("op") == "error" else None
        if w.kind in ("push", "early") and not w.accepted:  # answered before the status sent after it
            if error is not None:  # refused at once, as any push may be
                assert error in WIRE_CODES - DECODE_CODES and reply.get("message"), f"{what} got {reply!r}: {w.case}"
                self.outcomes[f"push:{error}"] += 1
                return
            assert w.kind == "push", f"{what} got {reply!r} before its step committed: {w.case}"
            w.accepted = True  # held, and its step committed and its update ran at once
            self.fuzz_pushed(self.targets[w.target], w.stage)
        if error == UNKNOWN_JOB:
            self.dropped_answers.append(w)  # checked once the case that dropped the job is done
            self.outcomes["dropped with their job"] += 1
            return
        if w.kind in ("fetch", "commit", "push", "early") and error == SESSION_EXPIRED:  # answered as its worker left
            self.expired_answers.append(w)  # checked once the case that ended the session is done
            what_ended = {"fetch": "waiting fetches", "commit": "commits", "push": "held pushes", "early": "held-back pushes"}
            self.outcomes[what_ended[w.kind] + " ended with their session"] += 1
            return
        if w.kind == "early" and error is not None:  # taken when its stage got there, and refused then
            assert error in WIRE_CODES - DECODE_CODES and reply.get("message"), f"{what} got {reply!r}: {w.case}"
            self.outcomes[f"held-back push:{error}"] += 1
            return
        if w.kind == "fetch" and MAX_WAITING_FETCHES is None and error == BAD_STATE:
            self.outcomes["capped"] += 1  # (a server with a cap this file does not know of)
            return
        ok = reply.get("op") == w.expects and reply.get("step") == w.step - w.lag
        if w.kind == "fetch":
            ok = ok and reply.get("stage") == w.stage
            self.deferred_answered += 1
        elif w.kind == "await":
            self.steps_reached += 1
        elif w.kind == "early":
            ok = ok and reply.get("stage") == w.stage and reply.get("slot") == w.slot
            t = self.targets[w.target]
            if ok and t.gen == w.gen:  # taken for its step, which is the open one now
                self.fuzz_pushed(t, w.stage)
            self.outcomes["held-back pushes taken"] += 1
        elif w.kind == "push":
            ok = ok and reply.get("stage") == w.stage and reply.get("slot") == w.slot
            t = self.targets[w.target]
            if ok and t.gen == w.gen:  # answered only once its update read it: the stage is past its step
                assert self.version(t, w.stage) > w.step, f"{what} got {reply!r} before its update: {w.case}"
            self.held_answered += 1
        else:
            self.commits_answered += 1
        assert ok, f"{what} got {reply!r}: {w.case}"
        try:
            decode_reply(header)
        except WstreamError as exc:
            raise AssertionError(f"the answer to {what} does not decode ({exc}): {reply!r}: {w.case}") from None

    def after_success(self, msg: m.Message, reply: dict[str, Any]) -> None:
        """Keep the fuzzer's jobs and sessions in step with what an accepted request changed."""
        session = getattr(msg, "session", None)
        owner, role = self.owner(session) if session is not None else (None, "")
        if isinstance(msg, m.CreateJob):
            self._drop_fuzz_job()
            self.fuzz_job = FuzzJob(msg.name, msg.token, reply["session"])
            self.signers[reply["session"]] = SessionSigner(
                reply["session"], session_key(secret_key(msg.token), msg.nonce, msg.client_nonce)
            )
        elif isinstance(msg, m.Attach):
            job = self.job_named(msg.name)
            assert job is not None, f"an attach to {msg.name!r} with a proof the fuzzer did not make succeeded: {reply!r}"
            sid = reply["session"]
            self.signers[sid] = SessionSigner(sid, session_key(secret_key(job.token), msg.nonce, msg.client_nonce))
            self.extras.append((job, sid))
            if len(self.extras) > MAX_EXTRA_SESSIONS:
                self._leave_extra(self.extras[0][1])
        elif isinstance(owner, FuzzJob):
            if isinstance(msg, m.AddStage):
                owner.stages += 1
                owner.last_activity = time.monotonic()
                if owner.stages > 16:
                    self._drop_fuzz_job()
            elif isinstance(msg, (m.Seal, m.Join)):
                self._drop_fuzz_job()  # a sealed fuzz job is not aimed at (its workers would wait)
            elif isinstance(msg, m.Leave):
                if role == "extra":
                    self.extras = [(j, s) for j, s in self.extras if s != session]
                    self._kill(session)
                else:
                    self._kill(owner.session)
                    owner.session = self._attach(owner.name, owner.token)
            elif isinstance(msg, m.DropJob):
                self._kill_job(owner)
        elif isinstance(owner, Target):
            if isinstance(msg, m.DropJob):
                left = [w.case for w in self.waiting.values() if w.target == owner.name and w.gen == owner.gen]
                assert not left, f"{len(left)} waiting requests got no reply before the drop's ok; the first:\n{left[0]}"
                self._kill_job(owner)
                self._create(owner)
            elif isinstance(msg, m.Join):  # a second worker would hold every step back: leave again
                assert role in ("plain", "extra"), (role, msg)
                if role == "extra":
                    self._leave_extra(session)
                else:
                    reply2, _ = self.request(m.Leave(session=owner.plain))
                    assert isinstance(reply2, m.Ok), reply2
                    self._kill(owner.plain)
                    owner.plain = self._attach(owner.name, owner.token)
            elif isinstance(msg, m.Push):  # only a joined session pushes: the worker
                assert role == "worker" and reply["stage"] == msg.stage and reply["step"] == msg.step, (role, reply)
                self.fuzz_pushed(owner, msg.stage)
            elif isinstance(msg, m.Leave):
                if role == "worker":
                    self.outcomes["steps discarded (the worker left)" if owner.gathered else "worker left"] += 1
                    self._kill(session)
                    self._new_trainer(owner)
                elif role == "extra":
                    self.extras = [(j, s) for j, s in self.extras if s != session]
                    self._kill(session)
                else:
                    self._kill(session)
                    owner.plain = self._attach(owner.name, owner.token)

    def advance(self, t: Target) -> None:
        """Commit one whole step of ``t`` as its worker: push every stage of the open step (a stage
        that a fuzzed push of the worker's gathered already counts as pushed: pushed again first,
        it must be refused as such; the step commits at the last push of the others), then
        ``commit`` it, which must answer ``committed``; every request waiting for the step
        (fetches of the next one, as each stage's update ends, and held commits of it) must then
        be answered."""
        step = self.open_step(t)
        self.answered(t, step)  # held-back pushes of this step were taken (their answers count them)
        assert len(t.gathered) < len(t.numels), t.gathered  # (else the step committed)
        slot = min(set(range(GRAD_SLOTS)) - self.held_slots(t))  # (held pushes keep theirs until the updates)
        for stage in sorted(range(len(t.numels)), key=lambda i: i not in t.gathered):
            numel = t.numels[stage]
            frames = [] if t.shm else [b"\x00" * (numel * 4)]
            reply, _ = self.request(m.Push(session=t.worker, stage=stage, step=step, slot=slot, numel=numel), frames)
            where = f"the push of stage {stage} step {step} of {t.name} (gathered by fuzzed pushes: {sorted(t.gathered)})"
            if stage in t.gathered:
                refused = isinstance(reply, m.Error) and reply.code == ErrorCode.BAD_GRADIENT.value
                assert refused and "already pushed" in reply.message, f"{reply!r} to {where}"  # type: ignore[union-attr]
                self.outcomes["pushed by a fuzzed push"] += 1
                continue
            assert isinstance(reply, m.Pushed) and reply.step == step, f"{reply!r} to {where}"
        t.gathered.clear()
        reply, _ = self.request(m.Commit(session=t.worker, step=step))
        assert isinstance(reply, m.Committed) and reply.step == step, f"{reply!r} to the commit of step {step} of {t.name}"
        self.steps_committed += 1
        self.answered(t, step + 1)

    def answered(self, t: Target, step: int) -> None:
        """Wait for the answers to the requests of ``t`` that are due once its stages are at
        ``step``: fetches of ``step`` or before, commits of the steps before it."""

        def due() -> list[Waiting]:
            return [
                x for x in self.waiting.values()
                if x.target == t.name and x.due_at <= step
            ]  # fmt: skip

        if due():  # answers that are due may still be on their way
            got = self.receive(time.monotonic() + DEADLINE_S, until=lambda: not due())
            assert got is None, f"an unexpected reply {got[0]!r} while waiting requests were answered"
            assert not due(), f"every stage of {t.name} is at step {step}; never answered:\n" + "\n".join(
                x.case for x in due()[:5]
            )

    def finish_waiting(self) -> None:
        """Commit steps of the targets that have waiting requests (as their worker) until none is
        left: each must be answered (a fetch with the weights of its step, a commit with its step)."""
        for _ in range(10_000):
            if not self.waiting:
                return
            w = next(iter(self.waiting.values()))
            t = self.targets[w.target]
            step = self.open_step(t)
            if w.due_at <= step:
                self.answered(t, step)
            else:
                self.advance(t)
        raise AssertionError(f"requests still waiting: {list(self.waiting.values())}")


class Where:
    """Names a case in an assertion message (built only when one fails)."""

    def __init__(self, n: int, case: Case, wire: bytes) -> None:
        self.n, self.case, self.wire = n, case, wire

    def __str__(self) -> str:
        return f"case {self.n}: {self.case.describe(self.wire)}"


def same_message(a: m.Message, b: m.Message) -> bool:
    """``a == b``, but a NaN field equals a NaN (a struct's ``==`` says NaN != NaN)."""
    return msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b)


class _IdOnly(msgspec.Struct):
    id: Any = None


def request_ids(wire: bytes) -> list[Any]:
    """The ``id`` of a header as two msgpack readers see it (other fields unread), where they can."""
    ids = []
    for read in (lambda: msgpack.unpackb(wire, strict_map_key=False)["id"], lambda: msgspec.msgpack.decode(wire, type=_IdOnly).id):
        try:
            ids.append(read())
        except Exception:
            pass
    return ids


def server_rss(server: ServerProcess) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server process (its memory is measured) with a store that snapshots every job at every
    step, so that seals and saves wait for snapshots, and drops land during snapshot writes."""
    srv = start_server(
        tmp_path, "--memory-limit", "4GiB", "--store", str(tmp_path / "store"), "--snapshot-every", "1",
        "--keep-snapshots", "1",
    )
    yield srv
    rc = srv.stop()
    assert rc == 0, f"server exited with {rc}\n{srv.log()[-5000:]}"
    assert not segment_paths(srv.proc.pid), f"server left shared-memory segments\n{srv.log()[-5000:]}"


def test_fuzz_every_op_while_a_job_trains(store_server: ServerProcess) -> None:
    server = store_server
    stages = models.mixed(seed=21)
    start = copy.deepcopy(stages)
    train_client = Client(server.address, timeout=30)
    job = train_client.create_job("train", stages, optimizer=AdamW(lr=1e-3), token="train-token")
    gate = threading.Semaphore(0)
    train_errors: list[BaseException] = []
    want: dict[str, torch.Tensor] = {}
    step_at: list[int] = []  # the number of fuzz cases sent when each training step began

    def train() -> None:  # one step each time the fuzzer opens the gate
        try:
            with job.trainer() as trainer:
                for s in range(TRAIN_STEPS):
                    assert gate.acquire(timeout=600), "the fuzzer never let the training go on"
                    step_at.append(fz.count)
                    trainer.step(*models.batch("mixed", s), models.loss_fn)
        except BaseException as exc:  # reported by the test thread
            train_errors.append(exc)

    def reference() -> None:  # plain PyTorch, meanwhile (its first step imports much of torch)
        try:
            want.update(reference_train(start, lambda p: torch.optim.AdamW(p, lr=1e-3), "mixed", TRAIN_STEPS))
        except BaseException as exc:
            train_errors.append(exc)

    reference_thread = threading.Thread(target=reference, name="fuzz-reference")
    reference_thread.start()
    fz = Fuzzer(server, job.specs)  # (its own client, sockets and two small jobs)
    # the job compared with plain PyTorch is out of the fuzzer's reach: no session, no token of it
    assert "train-token" not in {t.token for t in fz.targets.values()} and job.session not in fz.signers
    trainer_thread = threading.Thread(target=train, name="fuzz-train")
    trainer_thread.start()
    marks = landmarks(fz)
    warmup = len(marks) + max(1, min(CASES // 2, max(100, CASES // 5)))
    every = max(1, CASES // TRAIN_STEPS)
    rss: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        for landmark in marks:
            fz.run(landmark)
        # hypothesis parses the tests' sources (ast) at its first draw, as torch does in the reference's
        # first optimizer step; CPython 3.11.7's ast keeps its recursion depth in state shared by threads,
        # so both at once can fail with SystemError("AST constructor recursion depth mismatch")
        reference_thread.join(timeout=300)

        cfg = settings(
            max_examples=CASES,
            deadline=None,
            database=None,
            derandomize=SEED is None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
            print_blob=False,
        )

        @cfg
        @given(st.data())
        def one_case(data: st.DataObject) -> None:
            t_draw = time.perf_counter()
            case = fz.draw(data)
            t_run = time.perf_counter()
            fz.run(case)
            fz.seconds["draw"] += t_run - t_draw
            fz.seconds[case.kind] += time.perf_counter() - t_run
            n = fz.count
            if n % every == 0:  # a step of the trained job, and one of each target (answering what waits for it)
                gate.release()
                t_advance = time.perf_counter()
                for t in fz.targets.values():
                    fz.advance(t)
                fz.seconds["advance"] += time.perf_counter() - t_advance
            if n == warmup:
                fz._drop_fuzz_job()
                rss["warm"] = server_rss(server)

        if SEED is not None:
            one_case = hypothesis_seed(int(SEED))(one_case)
        one_case()
        fuzz_end = fz.count
        for _ in range(TRAIN_STEPS):
            gate.release()
        fz.finish_waiting()
        fz._drop_fuzz_job()
        rss.setdefault("warm", server_rss(server))  # (hypothesis stopped before the warm-up's end)
        rss["end"] = server_rss(server)
        elapsed = time.monotonic() - t0
        trainer_thread.join(timeout=300)
        assert not trainer_thread.is_alive(), "the training beside the fuzzer did not finish"
        if train_errors:
            raise train_errors[0]
        assert server.proc.poll() is None, f"the server exited during the fuzz\n{server.log()[-5000:]}"
        status = train_client.status()  # it still answers
        assert {"train", *fz.targets} <= {j.name for j in status.jobs}
        log = server.log()
        bad = [ln for ln in log.splitlines() if "Traceback" in ln or "internal error" in ln or " ERROR " in ln]
        assert not bad, "server log:\n" + "\n".join(bad[:20]) + "\n" + log[-5000:]
        growth = rss["end"] - rss["warm"]
        ops = sorted(op for op in fz.ops if op != "-")
        print(
            f"\nfuzz: {fz.count} cases over {len(ops)} ops in {elapsed:.1f} s; "
            f"server RSS {rss['warm'] / 2**20:.1f} MiB after {warmup} cases -> {rss['end'] / 2**20:.1f} MiB "
            f"({growth / 2**20:+.1f} MiB); {fz.outcomes['deferred']} deferred fetches: {fz.deferred_answered} answered, "
            f"{fz.outcomes['capped']} over the cap; {fz.outcomes['held commits']} held commits: {fz.commits_answered} "
            f"committed, {fz.outcomes['commits ended with their session']} ended with their worker's session; "
            f"{fz.outcomes['step waits']} await_step waits: {fz.steps_reached} reached; {fz.outcomes['held pushes']} held "
            f"pushes: {fz.held_answered} answered after their update, {fz.outcomes['held pushes ended with their session']} ended "
            f"with their worker's session; {fz.outcomes['held-back pushes']} held-back pushes: "
            f"{fz.outcomes['held-back pushes taken']} taken, {fz.outcomes['held-back pushes ended with their session']} ended "
            f"with their worker's session; "
            f"{fz.outcomes['dropped with their job']} waiting requests refused when their job was dropped"
            f"\n  steps committed by the fuzzer: {fz.steps_committed} ({fz.outcomes['pushed by a fuzzed push']} of their "
            f"stages gathered by a fuzzed push already); set_schedule accepted: {fz.outcomes['set_schedule:ok']}"
            f"\n  auth: {dict(sorted(fz.auth.items()))}; unsealed jobs timed out: {fz.outcomes['creation timed out']}"
            f"\n  training steps began after cases {step_at} (the fuzz ended after {fuzz_end})"
            f"\n  kinds: {dict(sorted(fz.kinds.items()))}"
            f"\n  ops: {dict(sorted(fz.ops.items()))}"
            f"\n  seconds: { {k: round(v, 2) for k, v in sorted(fz.seconds.items())} }"
            f"\n  slowest replies: {[(round(t, 3), k, o) for t, k, o in fz.slowest]}"
            f"\n  accepted: {dict(sorted((k, v) for k, v in fz.outcomes.items() if ':' in k and k.split(':')[1] not in WIRE_CODES))}"
            + (f"\n  outcomes: {dict(sorted(fz.outcomes.items()))}" if os.environ.get("WSTREAM_FUZZ_DEBUG") else "")
        )
        assert set(ops) == set(OPS), f"ops never fuzzed: {set(OPS) - set(ops)}"
        assert fz.outcomes["held pushes"] >= 1, "the landmark's push was not held"
        assert fz.outcomes["held-back pushes"] >= 1, "the delayed landmark's push was not held back"
        assert growth <= RSS_BOUND, f"server RSS grew by {growth / 2**20:.1f} MiB over the fuzz (bound {RSS_BOUND / 2**20:.0f} MiB)"

        reference_thread.join(timeout=300)
        if train_errors:
            raise train_errors[0]
        assert_weights_equal(job.state_dict(), want, atol=1e-6)
    finally:
        for _ in range(TRAIN_STEPS):
            gate.release()
        trainer_thread.join(timeout=60)
        reference_thread.join(timeout=300)
        fz.close()
        train_client.close()


def landmarks(fz: Fuzzer) -> list[Case]:
    """Fixed cases too big to leave to chance, run first (part of the warm-up), and requests that
    wait: every target's worker fetching the step after the current one (and waiting for it with
    ``await_step``), and committing the open
    step (fz-shm: answered by the step that follows the flood) or the next one (fz-frames); answered
    at the end, or when a fuzzed ``leave`` of the worker ends its session (the commits). fz-frames's
    worker also pushes stage 0 of its open step: that step is then committed by the fuzzer with a
    stage pushed already, or discarded by a fuzzed ``leave`` of the worker. fz-shm's worker pushes
    its last stage with its norm: held (NOTE [Held gradient slots]) until that step commits.
    fz-delayed (``delayed_update``) fetches the step after the next one (its step t + 1 reads the
    weights of t), and pushes stage 0 of the step after the open one: held back until stage 0
    gets there."""
    status = {"v": PROTOCOL_VERSION, TAG_FIELD: "status", "id": 1}
    big = MAX_HEADER_BYTES + 1
    waits = []
    for k, t in enumerate(fz.targets.values()):
        worker = SessionRef(2 * k + 1, live=True)
        assert fz.session_of(worker) == t.worker
        step = fz.open_step(t)
        lag = 1 if t.delayed else 0  # a delayed job's step t + 1 reads the weights of t: its t + 2 waits
        for stage in range(len(t.numels)):
            fetch = {"v": PROTOCOL_VERSION, TAG_FIELD: "fetch", "id": 2, "session": worker, "stage": stage}
            waits.append(Case("landmark", "fetch", {**fetch, "step": step + 1 + lag}))
        commit = {"v": PROTOCOL_VERSION, TAG_FIELD: "commit", "id": 5, "session": worker, "step": step + min(k, 1)}
        waits.append(Case("landmark", "commit", commit))
        if "await_step" in REQUESTS:  # the step after the job's one: answered as the fuzzer commits it
            reach = {"v": PROTOCOL_VERSION, TAG_FIELD: "await_step", "id": 7, "session": worker, "step": step + 1}
            waits.append(Case("landmark", "await_step", reach))
        if t.delayed:  # of the step after the open one: held back until stage 0 gets there
            push = {"v": PROTOCOL_VERSION, TAG_FIELD: "push", "id": 6, "session": worker, "stage": 0, "step": step + 1,
                    "slot": 1, "numel": t.numels[0]}  # fmt: skip
            waits.append(Case("landmark", "push", push))
        elif not t.shm:
            push = {"v": PROTOCOL_VERSION, TAG_FIELD: "push", "id": 6, "session": worker, "stage": 0, "step": step,
                    "slot": 0, "numel": t.numels[0], "nframes": NFRAMES}  # fmt: skip
            waits.append(Case("landmark", "push", push, frames=[b"\x00" * (4 * t.numels[0])]))
        else:  # with its norm, of the step's first stage pushed: held until the step commits
            last = len(t.numels) - 1
            push = {"v": PROTOCOL_VERSION, TAG_FIELD: "push", "id": 6, "session": worker, "stage": last, "step": step,
                    "slot": 1, "numel": t.numels[last], "sumsq": 1.0}  # fmt: skip
            waits.append(Case("landmark", "push", push))
    if MAX_WAITING_FETCHES is not None:  # fz-shm's worker: as many waiting fetches as allowed, and one more
        assert fz.session_of(SessionRef(1, live=True)) == fz.targets["fz-shm"].worker
        fetch = {"v": PROTOCOL_VERSION, TAG_FIELD: "fetch", "id": 4, "session": SessionRef(1, live=True), "stage": 0}
        waits.append(Case("flood", "fetch", {**fetch, "step": 0}))
    return [
        Case("landmark", "status", raw=b""),
        Case("landmark", "status", raw=pack_map([*status.items(), ("x", "a" * (big - 40))])),  # > 64 MiB
        Case("landmark", "status", raw=pack_map([*status.items(), ("x", "a" * (MAX_HEADER_BYTES - 100))])),
        Case("landmark", "status", status, frames=[b""] * (m.MAX_DATA_FRAMES + 1)),
        Case("landmark", "status", status, extra=[("x", deep(100_000, 0))], depth=100_000),
        *waits,
    ]
