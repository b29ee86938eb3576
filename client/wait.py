"""Waiting for a server to come up (scripts and tests that start one)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from wstream.protocol import ServerUnavailable
from wstream.protocol import messages as m
from wstream.protocol.curve import KeySource

from .channel import curve_hint
from .client import Client


def wait_for_server(
    address: str,
    *,
    timeout: float = 60.0,
    alive: Callable[[], bool] | None = None,
    server_public_key: KeySource | None = None,
    client_secret_key: str | os.PathLike[str] | None = None,
) -> m.StatusReply:
    """Wait until a server answers ``status`` at ``address``; return its status.

    ``alive`` (e.g. ``lambda: proc.poll() is None``) stops the wait early when it turns False.
    The keys are :class:`Client`'s. Raises :class:`ServerUnavailable` when no server answered in
    time (saying, for a tcp address, which CURVE keys to check)."""
    deadline = time.monotonic() + timeout
    while True:
        client = Client(
            address,
            timeout=min(1.0, max(timeout, 0.05)),
            server_public_key=server_public_key,
            client_secret_key=client_secret_key,
        )
        try:
            return client.status()
        except ServerUnavailable:
            if time.monotonic() >= deadline or (alive is not None and not alive()):
                why = f"no wstream-server answered at {address} within {timeout:g} s"
                hint = curve_hint(address, client.curve)
                raise ServerUnavailable(f"{why}. {hint}" if hint else why) from None
        finally:
            client.close()
