"""What a trainer needs of the client that made it: where the server is and how to talk to it.

:class:`WorkerEndpoint` is the seam between :class:`~wstream.client.job_handle.Job` and the worker
(``connection.py``, ``trainer.py``): a frozen record of the ZeroMQ context, the address, the CURVE
keys, the timeouts and the job's name and token, plus callbacks through which the client keeps a
list of its open trainers (``Client.close()`` closes them). The worker side never imports
``client.py`` and never reads its private fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from wstream.protocol import StageSpec
from wstream.protocol.curve import ClientKeys

from .channel import Channel, Signer


class Closeable(Protocol):
    """What the client closes when it closes: its trainers."""

    def close(self) -> None: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class WorkerEndpoint:
    """How a worker reaches its job on the server."""

    ctx: zmq.Context[Any]
    """The client's ZeroMQ context (every socket of the worker is made in it)."""
    address: str
    """The server's ZeroMQ endpoint."""
    curve: ClientKeys | None
    """The client's CURVE keys, or None (no encryption)."""
    timeout_s: float
    """Bound of an ordinary request (the client's ``timeout``)."""
    wait_timeout_s: float
    """Bound of a wait on other workers (the client's ``wait_timeout``)."""
    wait_report_s: float
    """A wait on other workers that lasts longer is reported, what it waits for in words, and again
    at this period (the client's ``wait_report``)."""
    job: str
    """The job's name."""
    token: str
    """The job's token (it proves the worker's sessions)."""
    stages: tuple[StageSpec, ...]
    """The job's layout as the trainer's stages were made for it; the layout the server sends at
    each attach (a reconnect's too) must be this one, else the worker refuses to join (a job
    dropped and created again under its name with other shapes)."""
    units: tuple[int, ...] | None = None
    """How ``stages`` hold the chain's stages (``JobOptions.units``; None: one server stage per
    stage). A job whose stages are cut otherwise is refused too: the trainer's runners view their
    units."""
    base_stages: tuple[StageSpec, ...] = ()
    """Its frozen base's layout (empty without a base), checked the same way."""
    register: Callable[[Closeable], None]
    """Called with a trainer once it has joined: the client closes it on ``close()``."""
    unregister: Callable[[Closeable], None]
    """Called with a trainer that closed."""

    def channel(self, timeout_s: float | None = None, signer: Signer | None = None) -> Channel:
        """A new channel to the server (its own socket, with the client's CURVE keys), for one
        thread; ``timeout_s`` defaults to ``timeout_s``."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        return Channel(self.ctx, self.address, timeout_s=limit, signer=signer, curve=self.curve)
