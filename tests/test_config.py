"""``wstream-server --config FILE``: a TOML file is equivalent to the flags, field by field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from wstream.protocol.curve import write_keypair
from wstream.server.cli import build_parser, config_from_args
from wstream.server.config import ServerConfig
from wstream.server.config_file import apply_config_file, setting_types


def config_of(argv: list[str]) -> ServerConfig:
    """What ``wstream-server ARGV`` would run with."""
    args = build_parser().parse_args(argv)
    apply_config_file(args, argv, build_parser)
    return config_from_args(args)


def every_setting(tmp_path: Path) -> dict[str, tuple[str, list[str], object]]:
    """Per ServerConfig field: (TOML value, the same as flags, the field's value), none a default."""
    secret = tmp_path / "admin-secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    store = str(tmp_path / "store")
    server_public, server_secret = write_keypair(tmp_path / "keys", "server")
    clients = tmp_path / "clients"
    write_keypair(clients, "worker")
    return {
        "bind": (
            '["ipc:///tmp/a.sock", "tcp://127.0.0.1:7001"]',
            ["--bind", "ipc:///tmp/a.sock", "--bind", "tcp://127.0.0.1:7001"],
            ["ipc:///tmp/a.sock", "tcp://127.0.0.1:7001"],
        ),
        "memory_limit": ('"3GiB"', ["--memory-limit", "3GiB"], 3 * 2**30),
        "store": (f'"{store}"', ["--store", store], store),
        "snapshot_every": ("7", ["--snapshot-every", "7"], 7),
        "keep_snapshots": ("5", ["--keep-snapshots", "5"], 5),
        "snapshot_buffer": ('"64MiB"', ["--snapshot-buffer", "64MiB"], 64 * 2**20),
        "lease_s": ("12.5", ["--lease", "12.5"], 12.5),
        "creation_timeout_s": ("90", ["--creation-timeout", "90"], 90.0),
        "optimizer_workers": ("3", ["--optimizer-workers", "3"], 3),
        "torch_threads": ("2", ["--torch-threads", "2"], 2),
        "metrics_port": ("9464", ["--metrics-port", "9464"], 9464),
        "metrics_addr": ('"0.0.0.0"', ["--metrics-addr", "0.0.0.0"], "0.0.0.0"),
        "metrics_stage_limit": ("16", ["--metrics-stage-limit", "16"], 16),
        "max_sessions_per_job": ("10", ["--max-sessions-per-job", "10"], 10),
        "admin_secret_file": (f'"{secret}"', ["--admin-secret-file", str(secret)], str(secret)),
        "nonce_ttl_s": ("5", ["--nonce-ttl", "5"], 5.0),
        "max_pending_nonces": ("100", ["--max-pending-nonces", "100"], 100),
        "huge_pages": ('"off"', ["--huge-pages", "off"], "off"),
        "curve_secret_key_file": (f'"{server_secret}"', ["--curve-secret-key", server_secret], server_secret),
        "curve_authorized_keys_dir": (f'"{clients}"', ["--curve-authorized-keys", str(clients)], str(clients)),
    }


def test_every_field_has_a_key_and_a_flag_that_agree(tmp_path: Path) -> None:
    cases = every_setting(tmp_path)
    fields = [f.name for f in dataclasses.fields(ServerConfig)]
    assert sorted(cases) == sorted(fields), (
        "a ServerConfig field was added or removed: give it a wstream-server flag (named after it; durations "
        "in seconds drop the _s) and a case here"
    )
    defaults = ServerConfig()
    for name, (_, _, want) in cases.items():
        assert getattr(defaults, name) != want, f"the case for {name} is its default: it would prove nothing"
    conf = tmp_path / "server.toml"
    conf.write_text("".join(f"{name} = {toml}\n" for name, (toml, _, _) in cases.items()))
    from_file = config_of(["--config", str(conf)])
    from_flags = config_of([arg for _, flags, _ in cases.values() for arg in flags])
    for name, (_, _, want) in cases.items():
        assert getattr(from_file, name) == want, f"{name} from the file"
        assert getattr(from_flags, name) == want, f"{name} from the flags"
    assert from_file == from_flags


def test_flags_on_the_command_line_override_the_file(tmp_path: Path) -> None:
    conf = tmp_path / "server.toml"
    conf.write_text('bind = ["tcp://127.0.0.1:7001"]\nlease_s = 12.5\nkeep_snapshots = 5\nlog_level = "DEBUG"\n')
    argv = ["--config", str(conf), "--bind", "ipc:///tmp/b.sock", "--lease", "30"]  # 30 is also the default
    config = config_of(argv)
    assert config.bind == ["ipc:///tmp/b.sock"]  # replaced, not appended to
    assert config.lease_s == 30.0
    assert config.keep_snapshots == 5  # from the file
    args = build_parser().parse_args(argv)
    apply_config_file(args, argv, build_parser)
    assert args.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lease = 3\n", "unknown key 'lease'"),
        ("[server]\nlease_s = 3\n", "unknown key 'server'"),
        ('lease_s = "soon"\n', "lease_s = 'soon': Expected `float`, got `str`"),
        ("keep_snapshots = true\n", "keep_snapshots = True: Expected `int`, got `bool`"),
        ('memory_limit = "lots"\n', "memory_limit: cannot read 'lots' as a size"),
        ('log_level = "LOUD"\n', "log_level = 'LOUD': choose one of DEBUG, INFO, WARNING, ERROR"),
        ("lease_s = \n", "is not valid TOML"),
    ],
)
def test_a_wrong_file_is_refused_naming_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text(text)
    with pytest.raises(ValueError) as err:
        config_of(["--config", str(conf)])
    assert str(conf) in str(err.value)
    assert message in str(err.value)


def test_the_server_exits_2_on_a_bad_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text("lease = 3\n")
    out = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--config", str(conf)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert f"wstream-server: {conf}: unknown key 'lease'" in out.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--config", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert "cannot read the config file" in missing.stderr


def test_every_flag_and_key_is_in_the_operating_guide() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "operating.md").read_text()
    parser = build_parser()
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    missing = [f for f in flags if f"`{f}" not in doc]
    missing += [k for k in setting_types() if f"`{k}`" not in doc]
    assert not missing, f"docs/operating.md does not describe {missing}"


@pytest.mark.parametrize(
    ("endpoint", "accepted"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.1:65535", True),
        ("tcp://*:*", True),  # ZeroMQ's "any free port"
        ("tcp://[::1]:7001", True),
        ("ipc:///tmp/wstream.sock", True),
        ("tcp://127.0.0.1:99999", False),  # would wrap around to another port
        ("tcp://127.0.0.1:0", False),
        ("tcp://127.0.0.1:-1", False),
        ("tcp://127.0.0.1", False),
        ("tcp://127.0.0.1:http", False),
    ],
)
def test_a_tcp_endpoint_needs_a_port_from_1_to_65535(endpoint: str, accepted: bool) -> None:
    if accepted:
        assert ServerConfig(bind=[endpoint]).bind == [endpoint]
        return
    with pytest.raises(ValueError, match=r"ServerConfig\.bind: .*port must be 1-65535 \(or \* for any free port\)"):
        ServerConfig(bind=[endpoint])
    with pytest.raises(ValueError, match="metrics_port must be a TCP port"):
        ServerConfig(metrics_port=99999)
