"""The wstream parameter server (``wstream-server``)."""

from .config import ServerConfig
from .service import Server

__all__ = ["Server", "ServerConfig"]
