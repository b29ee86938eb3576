"""Facts of the host that both ends size themselves by."""

from __future__ import annotations

import os


def host_cores() -> int:
    """Cores this process may run on (its affinity mask, as a container or ``taskset`` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def is_ipv6_endpoint(address: str) -> bool:
    """A ``tcp://[addr]:port`` endpoint (an IPv6 address in brackets): ZeroMQ reaches it only with
    its ``IPV6`` socket option set, which is off by default."""
    return address.startswith("tcp://[")
