"""The connection flags every command line shares, and the :class:`Client` they make.

``wstream``'s commands and the examples' scripts reach a server the same way, so they take the
same flags, defined here once: ``--server``, ``--server-key``, ``--client-key`` and ``--timeout``;
with ``token=True`` also ``--token-file``, with ``admin=True`` also ``--admin-secret-file``. Each
flag left out falls back to its environment variable (``$WSTREAM_SERVER``, ``$WSTREAM_SERVER_KEY``,
``$WSTREAM_CLIENT_KEY``, ``$WSTREAM_TOKEN``), and each ``--help`` says which::

    p = argparse.ArgumentParser()
    add_connection_flags(p, token=True)
    args = p.parse_args()
    with client_from_args(args) as client:
        job = client.attach_job("j", token=token_from_args(args))
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Literal

from wstream.protocol.curve import ENV_CLIENT_KEY, ENV_SERVER_KEY

from .client import ENV_ADMIN_SECRET_FILE, Client, admin_secret_from_env, read_secret_file
from .env import DEFAULT_SERVER, ENV_SERVER, ENV_TOKEN, job_token, server_address


def positive_seconds(text: str) -> float:
    """``--timeout``'s value: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def add_connection_flags(
    parser: argparse.ArgumentParser,
    *,
    timeout: float = 60.0,
    default_server: str = DEFAULT_SERVER,
    server_help: str = "the server's ZeroMQ endpoint",
    token: bool = False,
    admin: bool | Literal["required"] = False,
) -> None:
    """Add the connection flags to ``parser``: those of every command that talks to a server,
    ``--token-file`` where ``token``, ``--admin-secret-file`` where ``admin`` (``"required"``: the
    command cannot work without it). ``default_server`` is the endpoint when neither ``--server``
    nor ``$WSTREAM_SERVER`` gives one; ``timeout`` the default of ``--timeout``."""
    g = parser.add_argument_group("connection")
    g.add_argument(
        "--server", metavar="ADDR",
        default=server_address(None, default_server),
        help=f"{server_help} (default: ${ENV_SERVER}, else {default_server})",
    )
    g.add_argument(
        "--server-key", metavar="FILE",
        help=f"the server's public CURVE certificate (or z85 key), for a server with --curve-secret-key "
        f"(default: ${ENV_SERVER_KEY})",
    )
    g.add_argument(
        "--client-key", metavar="FILE",
        help=f"this client's secret CURVE certificate, for a server with --curve-authorized-keys "
        f"(default: ${ENV_CLIENT_KEY})",
    )
    g.add_argument(
        "--timeout", metavar="SECONDS", type=positive_seconds, default=timeout, help="seconds to wait for an answer (default: %(default)g)"
    )
    if token:
        g.add_argument("--token-file", metavar="FILE", help=f"file holding the job's token (default: ${ENV_TOKEN})")
    if admin:
        needed = "needed" if admin == "required" else "where the server has one; the job token is not used then"
        g.add_argument(
            "--admin-secret-file", metavar="FILE",
            help=f"file holding the server's admin secret ({needed}; default: ${ENV_ADMIN_SECRET_FILE})",
        )


def key_options(args: argparse.Namespace) -> dict[str, Any]:
    """The CURVE keys the flags give, as the keywords of :class:`Client`, ``wait_for_server`` and
    ``local_server`` (None where a flag was left out: the environment's are read then)."""
    return {"server_public_key": args.server_key, "client_secret_key": args.client_key}


def client_from_args(args: argparse.Namespace, **options: Any) -> Client:
    """The client of the parsed flags (``--server`` or ``$WSTREAM_SERVER``, the keys, the admin
    secret, the timeout); ``options`` are more :class:`Client` keywords, or override those."""
    secret = admin_secret_from_args(args)
    # None from an explicit --token-file must not let the Client read $WSTREAM_ADMIN_SECRET_FILE itself
    no_secret = secret is None and bool(getattr(args, "token_file", None))
    flags = {**key_options(args), "admin_secret": False if no_secret else secret, "timeout": args.timeout}
    return Client(args.server, **{**flags, **options})


def token_from_args(args: argparse.Namespace, default: str | None = None) -> str:
    """The job's token: the contents of ``--token-file`` (stripped), else ``$WSTREAM_TOKEN``, else
    ``default``; ``ValueError`` when none is there."""
    path = getattr(args, "token_file", None)
    if path:
        return read_secret_file(path, "the job token (--token-file)")
    if default is not None and not os.environ.get(ENV_TOKEN):
        return default
    return job_token(None, how="--token-file FILE")


def admin_secret_from_args(args: argparse.Namespace) -> str | None:
    """The admin secret in ``--admin-secret-file``, else in the file ``$WSTREAM_ADMIN_SECRET_FILE``
    names, else None (also for a command without the flag). A ``--token-file`` given on the
    command line wins over the environment's admin secret, as every flag given wins over its
    variable: the job's token is used then."""
    if not hasattr(args, "admin_secret_file"):
        return None
    path = args.admin_secret_file
    if path:
        return read_secret_file(path, "the admin secret (--admin-secret-file)")
    return None if getattr(args, "token_file", None) else admin_secret_from_env()

