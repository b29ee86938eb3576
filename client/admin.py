"""``wstream``: look at and manage a running server."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import msgspec
import zmq

from wstream.protocol import WstreamError, format_bytes, version_line
from wstream.protocol.curve import ENV_CLIENT_KEY, ENV_SERVER_KEY, write_keypair
from wstream.protocol import messages as m
from wstream.protocol.lr_schedules import Schedule

from .cli_flags import add_connection_flags, admin_secret_from_args, client_from_args, positive_seconds, token_from_args
from .client import ENV_ADMIN_SECRET_FILE
from .env import server_address


def _status(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        st = client.status()
    if args.json:
        print(json.dumps(_finite(msgspec.to_builtins(st)), indent=2, allow_nan=False))
        return 0
    print(format_status(st, client.address))
    return 0


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (a skipped step's gradient norm) made null: JSON has
    no such numbers, and Python's ``NaN`` token is refused by strict parsers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


_STATUS_COLUMNS = (
    "job", "state", "step", "steps/s", "workers", "memory", "snapshot", "stages", "params", "optimizer", "lr", "grad-norm",
    "opt-time",
)
_LEFT = {"job", "state", "optimizer"}


def format_status(st: m.StatusReply, server: str) -> str:
    """``wstream status`` as text: a line about the server, then one row per job (columns
    :data:`_STATUS_COLUMNS`, sized to their contents). Scripts should use ``--json``."""
    head = (
        f"server {server}  pid {st.pid}  protocol {st.protocol}  up {st.uptime_s:.0f} s  "
        f"memory {format_bytes(st.memory_used)} of {format_bytes(st.memory_limit)}"
    )
    if not st.jobs:
        return f"{head}\nno jobs"
    rows = [
        [
            j.name,
            "ready" if j.ready else "creating",
            str(j.step),
            f"{j.steps_per_s:.2f}",
            str(len(j.workers)),
            format_bytes(j.bytes),
            "-" if j.last_snapshot is None else str(j.last_snapshot),
            str(j.stages) if j.units is None else f"{j.stages} ({j.units} unit{'' if j.units == 1 else 's'})",
            f"{j.params:,}",
            j.optimizer,
            "-" if j.lr is None else f"{j.lr:.3g}",
            "-" if j.grad_norm is None else f"{j.grad_norm:.4g}",
            f"{j.optimizer_s:.2f}s",
        ]
        for j in st.jobs
    ]
    return "\n".join([head, *_table(list(_STATUS_COLUMNS), rows)])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if h in _LEFT else c.rjust(w) for h, c, w in zip(header, cells, widths))
        return "  ".join(padded).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _jobs(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        st = client.status()
    if args.json:
        print(json.dumps([{"name": j.name, "step": j.step, "ready": j.ready} for j in st.jobs], indent=2))
        return 0
    width = max((len(j.name) for j in st.jobs), default=0)
    for j in st.jobs:
        print(f"{j.name:<{width}}  {j.step}")
    return 0


def _token(args: argparse.Namespace) -> str | None:
    """The job's token for a command run without the admin secret (None with it: not used)."""
    return None if admin_secret_from_args(args) is not None else token_from_args(args)


def _save(args: argparse.Namespace) -> int:
    token = _token(args)
    with client_from_args(args, wait_timeout=args.wait) as client:
        step, path = client.save_job(args.job, token=token, timeout=args.wait)
    print(f"job {args.job!r}: snapshot of step {step} written to {path}")
    return 0


def _drop(args: argparse.Namespace) -> int:
    token = _token(args)
    with client_from_args(args) as client:
        client.drop_job(args.job, token=token)
    print(f"job {args.job!r} dropped")
    return 0


def _schedule(args: argparse.Namespace) -> int:
    if args.lr is None and args.schedule is None:
        raise ValueError("wstream schedule: give --lr, --schedule or both")
    schedule = None
    if args.schedule is not None:
        try:
            schedule = msgspec.json.decode(args.schedule, type=Schedule)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--schedule {args.schedule!r}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"--schedule must be a JSON object such as {_SCHEDULE_EXAMPLE}: {exc}") from None
    token = _token(args)
    with client_from_args(args) as client:
        client.set_schedule(args.job, schedule, lr=args.lr, token=token)
    changes = ([f"lr {args.lr:g}"] if args.lr is not None else []) + ([f"schedule {schedule!r}"] if schedule else [])
    print(f"job {args.job!r}: {', '.join(changes)} from its next step on")
    return 0


_SCHEDULE_EXAMPLE = '\'{"kind": "warmup_cosine", "warmup_steps": 100, "total_steps": 10000, "min_lr_ratio": 0.1}\''


def _shutdown(args: argparse.Namespace) -> int:
    if admin_secret_from_args(args) is None:
        raise ValueError(f"shutdown needs the server's admin secret: --admin-secret-file FILE or ${ENV_ADMIN_SECRET_FILE}")
    with client_from_args(args) as client:
        client.shutdown()
    print(f"server {client.address} is shutting down")
    return 0


def _export(args: argparse.Namespace) -> int:
    if not args.out.strip() or os.path.isdir(args.out):  # before pulling every weight, not after
        raise ValueError(f"--out {args.out!r} is {'empty' if not args.out.strip() else 'a directory'}: give the .safetensors file to write")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {args.out}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write {args.out}: the directory {folder} is not writable")
    from safetensors import SafetensorError

    token = _token(args)
    with client_from_args(args) as client:
        try:
            if token is None:  # the admin secret: any job, no token needed
                client.export_job(args.job, args.out)
            else:
                client.attach_job(args.job, token=token).export(args.out)
        except SafetensorError as exc:  # the file could not be written (a full disk)
            raise OSError(f"cannot write {args.out}: {exc}") from None
    print(f"job {args.job!r}: weights written to {args.out}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    public, secret = write_keypair(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret} (mode 0600; keep it private)")
    print(
        f"as a server's key: wstream-server --curve-secret-key {secret}; clients then connect with "
        f"--server-key {public} (or {ENV_SERVER_KEY}={public})\n"
        f"as a client's key: --client-key {secret} (or {ENV_CLIENT_KEY}={secret}), with {public} copied "
        "into the server's --curve-authorized-keys directory"
    )
    return 0


def _job_command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A command on one job: its name, then the connection flags with the job's token or the
    server's admin secret."""
    c = sub.add_parser(name, help=help)
    c.add_argument("job", help="the job's name")
    add_connection_flags(c, timeout=10.0, token=True, admin=True)
    return c


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wstream", description="Inspect and manage a wstream-server.")
    p.add_argument("--version", action="version", version=version_line("wstream"))
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="jobs, workers, steps and memory of a server")
    add_connection_flags(s, timeout=5.0)
    s.add_argument("--json", action="store_true", help="print the raw status as JSON (a number that is not finite, as null)")
    s.set_defaults(func=_status)
    j = sub.add_parser("jobs", help="the jobs of a server: one line each, name and step")
    add_connection_flags(j, timeout=5.0)
    j.add_argument("--json", action="store_true", help="a JSON list of {name, step, ready}")
    j.set_defaults(func=_jobs)
    c = _job_command(sub, "save", "snapshot a job on the server's store now (its next consistent step)")
    c.add_argument(
        "--wait", type=positive_seconds, default=600.0, help="seconds to wait for the snapshot to be durable (default %(default)g)"
    )
    c.set_defaults(func=_save)
    c = _job_command(sub, "export", "write a job's current weights to a plain safetensors file")
    c.add_argument("--out", required=True, help="the .safetensors file to write")
    c.set_defaults(func=_export)
    c = _job_command(sub, "schedule", "change a live job's base learning rate and/or its schedule")
    c.add_argument("--lr", type=float, help="the new base learning rate")
    c.add_argument("--schedule", help=f"the new schedule as JSON, e.g. {_SCHEDULE_EXAMPLE}")
    c.set_defaults(func=_schedule)
    c = _job_command(sub, "drop", "delete a job from the server (and its snapshots)")
    c.set_defaults(func=_drop)
    d = sub.add_parser("shutdown", help="stop the server cleanly, as SIGTERM does (needs the admin secret)")
    add_connection_flags(d, timeout=10.0, admin="required")
    d.set_defaults(func=_shutdown)
    k = sub.add_parser("keys", help="write a CURVE keypair (NAME.key public, NAME.key_secret mode 0600) into DIR")
    k.add_argument("dir", help="directory to write into (created, mode 0700, if missing)")
    k.add_argument("--name", default="server", help="file name of the pair (default %(default)s)")
    k.set_defaults(func=_keys)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C: no traceback (a command that changes a job has either been sent or not)
        print("wstream: interrupted", file=sys.stderr)
        return 130
    except WstreamError as exc:
        print(f"wstream: {exc}", file=sys.stderr)
        return 1
    except zmq.ZMQError as exc:  # an endpoint ZeroMQ cannot use ("foo://x": protocol not supported)
        address = server_address(getattr(args, "server", None))
        print(f"wstream: cannot use the server address {address!r}: {exc} (tcp://HOST:PORT or ipc:///PATH)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # a bad key file or directory, a key that exists already
        print(f"wstream: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
