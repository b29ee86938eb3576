"""The protocol's written spec (``protocol/README.md``, ``docs/protocol.md``) against its code
(``protocol/messages.py``): found by review, the spec still said version 8 in three places while
the code spoke 11, and the tables lacked fields added since (a client written from the spec sent
``v: 8`` and got ``version_mismatch``). These keep the two in step."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from wstream.protocol import PROTOCOL_VERSION
from wstream.protocol import messages as m

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "protocol" / "README.md"
ENVELOPE = {"v", "op", "id", "seq", "mac", "nframes"}
"""Fields every message (or every signed one) has, described once above the tables."""
NESTED = {"JobInfo", "WorkerInfo", "TraceEvent"}
"""Records described in their op's row (the rest have sections of their own: StageSpec,
JobOptions, the schedules)."""


def ops() -> list[type[m.Message]]:
    return [
        cls for cls in vars(m).values()
        if isinstance(cls, type) and issubclass(cls, m.Message)
        and re.fullmatch("[a-z_]+", str(cls.__struct_config__.tag))  # not the bases (Message, SessionMessage)
    ]


def rows() -> dict[str, str]:
    found: dict[str, str] = {}
    for line in SPEC.read_text().splitlines():
        op = re.match(r"\| `([a-z_]+)` \|", line)
        if op:
            found.setdefault(op.group(1), line)
    return found


def records(tp: object) -> list[type[msgspec.Struct]]:
    inner = [r for arg in typing.get_args(tp) for r in records(arg)]
    return inner + [tp] if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else inner


def test_the_spec_names_the_version_the_code_speaks() -> None:
    spec = SPEC.read_text()
    assert f"# The wstream protocol, version {PROTOCOL_VERSION}\n" in spec
    assert f'{{"v": {PROTOCOL_VERSION}, "op"' in spec
    assert f"`v` = {PROTOCOL_VERSION}," in (ROOT / "docs" / "protocol.md").read_text()
    example = (ROOT / "examples" / "raw_protocol.py").read_text()
    assert f"VERSION = {PROTOCOL_VERSION}\n" in example and f"speaks protocol {PROTOCOL_VERSION} " in example


@pytest.mark.parametrize("op", ops(), ids=lambda cls: cls.__struct_config__.tag)
def test_every_field_of_every_op_and_reply_is_in_its_row(op: type[m.Message]) -> None:
    tag = op.__struct_config__.tag
    row = rows().get(tag)
    assert row is not None, f"protocol/README.md has no row for {tag!r}"
    hints = typing.get_type_hints(op, include_extras=True)
    missing = [f for f in op.__struct_fields__ if f not in ENVELOPE and f"`{f}`" not in row]
    for field in op.__struct_fields__:
        for record in records(hints[field]):
            if record.__name__ in NESTED:
                missing += [f"{record.__name__}.{f}" for f in record.__struct_fields__ if f"`{f}`" not in row]
    assert not missing, f"{tag}: {missing} not in its row of protocol/README.md"
