"""``wstream-server``: run a parameter server in the foreground, logging to stderr."""

from __future__ import annotations

import argparse
import logging
import sys

from wstream.protocol import format_bytes, parse_size, version_line

from .config import ConfigError, ServerConfig, default_memory_limit
from .config_file import apply_config_file, default_of, setting_names
from .threads import default_compute_threads, wait_passively


def size_arg(text: str) -> int:
    """A flag's byte size ("64GiB"); a wrong one makes argparse name the flag, the value and the forms."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wstream-server",
        description="Hold training jobs' weights and optimizer state in host memory and stream them to workers.",
    )
    p.add_argument("--version", action="version", version=version_line("wstream-server"))
    p.add_argument(
        "--bind",
        action="append",
        metavar="ADDR",
        help="ZeroMQ endpoint to listen on, e.g. tcp://127.0.0.1:5555 or ipc:///tmp/wstream.sock "
        "(repeat for several; default tcp://127.0.0.1:5555)",
    )
    p.add_argument(
        "--memory-limit",
        type=size_arg,
        default=None,
        metavar="SIZE",
        help=f"bytes all jobs may hold, e.g. 64GiB (default 80%% of RAM or of a container's memory limit, at most the size of /dev/shm: {format_bytes(default_memory_limit())})",
    )
    p.add_argument("--store", metavar="DIR", help="directory for snapshots; jobs found there are resumed at start")
    p.add_argument(
        "--snapshot-every", type=int, default=0, metavar="N",
        help="snapshot each job every N steps (needs --store; default 0: at creation, on 'wstream save' and at shutdown only)",
    )
    p.add_argument("--keep-snapshots", type=int, default=3, metavar="K", help="snapshots kept per job (default 3)")
    p.add_argument("--lease", type=float, default=30.0, metavar="SECONDS", help="detach workers silent this long (default 30)")
    p.add_argument(
        "--creation-timeout", type=float, default=300.0, metavar="SECONDS",
        help="drop a job still being created that gets no stage for this long (default 300)",
    )
    p.add_argument("--optimizer-workers", type=int, default=1, metavar="N", help="threads running stage updates (default 1)")
    p.add_argument(
        "--torch-threads", type=int, default=None, metavar="N",
        help=f"torch intra-op threads of the updates (default: half the cores, here {default_compute_threads()}; "
        "co-located workers keep to the rest)",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file of settings keyed by field name (memory_limit = \"64GiB\", "
                   "lease_s = 30); flags on the command line override it (docs/operating.md)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port (0: any free one)")
    p.add_argument("--metrics-addr", default=default_of("metrics_addr"), metavar="ADDR",
                   help="address of the metrics endpoint (default %(default)s; it has no authentication)")
    p.add_argument("--metrics-stage-limit", type=int, default=default_of("metrics_stage_limit"), metavar="N",
                   help="export per-stage series for jobs of at most N stages (default %(default)s)")
    p.add_argument("--snapshot-buffer", type=size_arg, default=default_of("snapshot_buffer"), metavar="SIZE",
                   help="stage copies a snapshot may hold while the disk catches up (default 512MiB)")
    p.add_argument("--max-sessions-per-job", type=int, default=default_of("max_sessions_per_job"), metavar="N",
                   help="non-worker sessions kept per job, oldest evicted beyond; also the most readers a job takes (default %(default)s)")
    p.add_argument("--max-pending-nonces", type=int, default=default_of("max_pending_nonces"), metavar="N",
                   help="handshake nonces outstanding at most (default %(default)s)")
    p.add_argument(
        "--admin-secret-file", metavar="FILE",
        help="file (mode 0600) holding the admin secret: needed to create, drop or save jobs and to shut down over the wire",
    )
    p.add_argument(
        "--insecure", action="store_true",
        help="listen beyond this host (tcp on a non-loopback address) without --admin-secret-file, where "
        "anyone who reaches the server may create jobs; without it such a server refuses to start",
    )
    p.add_argument(
        "--curve-secret-key", metavar="FILE", dest="curve_secret_key_file",
        help="the server's secret CURVE certificate (mode 0600; 'wstream keys DIR' writes one): encrypt every "
        "tcp endpoint (ipc endpoints stay plaintext); clients need the public NAME.key",
    )
    p.add_argument(
        "--curve-authorized-keys", metavar="DIR", dest="curve_authorized_keys_dir",
        help="with --curve-secret-key: only clients whose public certificate (*.key) is in DIR may connect",
    )
    p.add_argument("--huge-pages", choices=["auto", "on", "off"], default=default_of("huge_pages"),
                   help="shared memory on hugetlbfs huge pages (faster GPU page-locking): auto (default), on, off")
    p.add_argument("--nonce-ttl", type=float, default=30.0, metavar="SECONDS", help="lifetime of a handshake nonce (default 30)")
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="what the server logs (default INFO)"
    )
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    kwargs: dict[str, object] = {
        "lease_s": args.lease,
        "creation_timeout_s": args.creation_timeout,
        "optimizer_workers": args.optimizer_workers,
        "torch_threads": args.torch_threads,
        "metrics_port": args.metrics_port,
        "metrics_addr": args.metrics_addr,
        "metrics_stage_limit": args.metrics_stage_limit,
        "snapshot_buffer": args.snapshot_buffer,
        "max_sessions_per_job": args.max_sessions_per_job,
        "max_pending_nonces": args.max_pending_nonces,
        "store": args.store,
        "snapshot_every": args.snapshot_every,
        "keep_snapshots": args.keep_snapshots,
        "admin_secret_file": args.admin_secret_file,
        "insecure": args.insecure,
        "nonce_ttl_s": args.nonce_ttl,
        "curve_secret_key_file": args.curve_secret_key_file,
        "curve_authorized_keys_dir": args.curve_authorized_keys_dir,
        "huge_pages": args.huge_pages,
    }
    if args.bind is not None:  # an empty list from a file is ServerConfig's to refuse, not a default
        kwargs["bind"] = args.bind
    if args.memory_limit is not None:
        kwargs["memory_limit"] = args.memory_limit
    config = ServerConfig(**kwargs)  # type: ignore[arg-type]
    for addr in config.bind:  # an in-process server may take one; a process of its own reaches nobody so
        if addr.startswith("inproc://"):
            raise ConfigError("bind", f": {addr!r} reaches only this process: wstream-server listens on tcp:// or ipc://")
    return config


def load_config(argv: list[str] | None) -> tuple[ServerConfig, argparse.Namespace]:
    """The settings ``wstream-server ARGV`` runs with, and its parsed arguments. A setting that
    cannot be used is a ValueError naming its flag and config key (and the config file it came
    from); argparse exits by itself for a flag it cannot parse."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from_file = apply_config_file(args, argv, build_parser)
    try:
        return config_from_args(args), args
    except ConfigError as exc:
        raise ValueError(exc.render(setting_names(parser, from_file, args.config))) from None


def main(argv: list[str] | None = None) -> int:
    try:
        config, args = load_config(argv)
    except ValueError as exc:
        print(f"wstream-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    wait_passively()  # NOTE [Threads of a co-located server], rule 1: before torch loads
    from .service import Server

    if config.torch_threads is None:  # rule 2: a process of its own
        config.torch_threads = default_compute_threads()
    try:
        server = Server(config)
    except (ValueError, OSError) as exc:
        print(f"wstream-server: {exc}", file=sys.stderr)
        return 2
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
