"""Byte sizes as people write them ("8GiB", "512M") and back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")  # fullmatch: surrounding blanks allowed


def parse_size(text: str | int) -> int:
    """Parse ``"2GiB"``, ``"1.5G"``, ``"4096"`` or an int into a number of bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: write a number with an optional unit "
            "(B, K, M, G, T, KiB, MiB, GiB, TiB), e.g. 64GiB, 500M, 1.5T"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int | float) -> str:
    """``1536 -> '1.50 KiB'``; exact byte counts stay in error messages next to this."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def version_line(prog: str) -> str:
    """What ``--version`` prints: the installed wstream release and the protocol it speaks."""
    from importlib.metadata import PackageNotFoundError, version

    from .messages import PROTOCOL_VERSION

    try:
        release = version("wstream")
    except PackageNotFoundError:  # run from a source tree that was not installed
        release = "(not installed)"
    return f"{prog} {release} (protocol {PROTOCOL_VERSION})"

