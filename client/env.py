"""Where a client finds its server and its job's token when none is given: the environment.

``Client()`` and every command line read these when no argument or flag is given; an explicit
one always wins. (The CURVE keys' variables, ``$WSTREAM_SERVER_KEY`` and ``$WSTREAM_CLIENT_KEY``,
are in ``wstream.protocol.curve``: the server's configuration names them too.)
"""

from __future__ import annotations

import os

ENV_SERVER = "WSTREAM_SERVER"
"""The server's ZeroMQ endpoint, for a client given no address."""

ENV_TOKEN = "WSTREAM_TOKEN"
"""The job's token, for ``create_job``, ``attach_job`` and the job commands given none."""

DEFAULT_SERVER = "tcp://127.0.0.1:5555"
"""The endpoint of a client given no address and no ``$WSTREAM_SERVER``: ``wstream-server``'s
default bind on this host."""


def server_address(address: str | None = None, default: str = DEFAULT_SERVER) -> str:
    """``address``, else ``$WSTREAM_SERVER`` (when set and not empty), else ``default``."""
    if address is not None:
        return address
    return os.environ.get(ENV_SERVER) or default


def check_new_token(token: str) -> None:
    """Refuse a new job's token with whitespace around it: a token read from a file with its
    newline would never match the one ``wstream --token-file`` reads (stripped)."""
    if token != token.strip():
        raise ValueError(
            "the token has whitespace around it (a newline read from a file?); wstream --token-file and "
            "$WSTREAM_TOKEN from $(cat file) give it stripped, so it would not open the job: strip() it"
        )


def job_token(token: str | None = None, *, how: str = "token=") -> str:
    """``token``, else ``$WSTREAM_TOKEN``; ``ValueError`` saying to give one ``how`` (the argument
    or the flag) or to set the variable when neither is there."""
    if token is not None:
        return token
    token = os.environ.get(ENV_TOKEN)
    if not token:
        raise ValueError(f"no job token: give {how} or set ${ENV_TOKEN}")
    return token
