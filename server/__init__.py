"""The wstream parameter server (``wstream-server``).

``Server`` is imported on first use (PEP 562), so that ``wstream-server`` can configure OpenMP
before torch loads (NOTE [Threads of a co-located server] in ``server/threads.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import ServerConfig

if TYPE_CHECKING:
    from .service import Server

__all__ = ["Server", "ServerConfig"]


def __getattr__(name: str) -> Any:
    if name == "Server":
        from .service import Server

        return Server
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
