"""``wstream-server --config FILE``: a TOML file is equivalent to the flags, field by field."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from wstream.protocol import format_bytes
from wstream.protocol.curve import write_keypair
from wstream.protocol.shm import SHM_DIR
from wstream.server.cli import build_parser, config_from_args, load_config
from wstream.server.config import ServerConfig, default_memory_limit
from wstream.server.config_file import apply_config_file, setting_types
from wstream.server.inprocess import InProcessServer
from wstream.server.service import Server
from wstream.server.snapshot import LOCK_FILE


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
        "insecure": ("true", ["--insecure"], True),
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
    if accepted:  # (insecure: "tcp://*" listens beyond this host, which needs an admin secret otherwise)
        assert ServerConfig(bind=[endpoint], insecure=True).bind == [endpoint]
        return
    with pytest.raises(ValueError, match=r"ServerConfig\.bind: .*port must be 1-65535 \(or \* for any free port\)"):
        ServerConfig(bind=[endpoint])
    with pytest.raises(ValueError, match="metrics_port must be a TCP port"):
        ServerConfig(metrics_port=99999)


# ---- listening beyond this host ------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://[::]:5555",
                                      "tcp://eth0:5555", "tcp://node7.example.org:5555"])
def test_listening_beyond_this_host_needs_an_admin_secret_or_insecure(tmp_path: Path, endpoint: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(["--bind", endpoint])
    message = str(err.value)
    assert f"--bind (config key bind): {endpoint} is not a loopback address" in message
    assert "--admin-secret-file (config key admin_secret_file)" in message and "--insecure (config key insecure)" in message
    assert ServerConfig(bind=[endpoint], insecure=True).insecure
    secret = tmp_path / "admin-secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    assert ServerConfig(bind=[endpoint], admin_secret_file=str(secret)).bind == [endpoint]


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://127.1.2.3:5555", "tcp://[::1]:5555",
                                      "tcp://localhost:5555", "ipc:///tmp/wstream.sock"])
def test_loopback_and_ipc_endpoints_need_no_admin_secret(endpoint: str) -> None:
    assert ServerConfig(bind=[endpoint]).bind == [endpoint]


# ---- errors name the flag and the config key ------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lease", "-1"], "--lease (config key lease_s) must be a finite number > 0 of seconds, got -1"),
        # found by review: accepted, then every worker's heartbeat thread died (OverflowError)
        (["--lease", "inf"], "--lease (config key lease_s) must be a finite number > 0 of seconds, got inf"),
        (["--creation-timeout", "inf"], "--creation-timeout (config key creation_timeout_s) must be a finite number > 0"),
        # found by review: asked for an admin secret, then failed "Protocol not supported"
        (["--bind", "foo://x"], "--bind (config key bind): 'foo://x': the server listens on tcp://HOST:PORT or ipc:///PATH"),
        # found by review: the server's working directory became the store, and paths it reported were relative
        (["--store", ""], "--store (config key store): is empty"),
        (["--keep-snapshots", "0"], "--keep-snapshots (config key keep_snapshots) must be >= 1, got 0"),
        (["--memory-limit", "0"], "--memory-limit (config key memory_limit) must be > 0 bytes, got 0"),
        (["--snapshot-every", "5"], "--snapshot-every (config key snapshot_every) needs a store to write to: "
                                    "give --store (config key store)"),
        (["--bind", "tcp://127.0.0.1:99999"], "--bind (config key bind): 'tcp://127.0.0.1:99999': a tcp endpoint's port"),
        (["--huge-pages", "auto", "--nonce-ttl", "0"], "--nonce-ttl (config key nonce_ttl_s) must be a finite number > 0 of seconds, got 0"),
        # defect seen: accepted, then every create_job failed "unknown or expired session"
        (["--max-sessions-per-job", "0"], "--max-sessions-per-job (config key max_sessions_per_job) must be >= 1, got 0"),
        # defect seen: "another wstream-server (pid <its own>) holds it"
        (["--bind", "ipc:///tmp/x.sock", "--bind", "ipc:///tmp/x.sock"],
         "--bind (config key bind): 'ipc:///tmp/x.sock' is listed twice"),
        # defect seen: accepted, a server nobody could reach
        (["--bind", "inproc://x"], "--bind (config key bind): 'inproc://x' reaches only this process"),
    ],
)
def test_a_bad_setting_names_its_flag_and_its_config_key(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(argv)
    assert message in str(err.value)
    assert "ServerConfig." not in str(err.value)


def test_a_bad_setting_from_the_file_names_the_file_too(tmp_path: Path) -> None:
    conf = tmp_path / "server.toml"
    conf.write_text("lease_s = -1.5\n")
    with pytest.raises(ValueError) as err:
        load_config(["--config", str(conf)])
    assert f"--lease (config key lease_s, set in {conf}) must be a finite number > 0 of seconds, got -1.5" in str(err.value)


def test_an_empty_bind_list_in_the_file_is_refused(tmp_path: Path) -> None:
    """``bind = []`` names no endpoint: refused, as ``ServerConfig(bind=[])`` is (defect seen: the
    server listened on the default tcp endpoint instead)."""
    conf = tmp_path / "server.toml"
    conf.write_text("bind = []\n")
    with pytest.raises(ValueError, match=r"--bind \(config key bind, set in .*\): give at least one endpoint"):
        load_config(["--config", str(conf)])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lease_s": "30"}, r"ServerConfig\.lease_s: Expected `float`, got `str` \(got '30'\)"),
        ({"memory_limit": "16GiB"}, r"ServerConfig\.memory_limit: Expected `int`, got `str`"),
        ({"bind": "ipc:///tmp/x.sock"}, r"ServerConfig\.bind: Expected `array`, got `str`"),
        ({"insecure": "no"}, r"ServerConfig\.insecure: Expected `bool`, got `str`"),
        ({"keep_snapshots": 2.5}, r"ServerConfig\.keep_snapshots: Expected `int`, got `float`"),
        ({"store": 5}, r"ServerConfig\.store: Expected `str \| null`, got `int`"),
    ],
)
def test_the_python_api_refuses_a_value_of_the_wrong_type_naming_the_field(fields: dict, message: str) -> None:
    """Defect seen: ``insecure='no'`` turned insecure mode on, ``store=5`` and ``keep_snapshots=2.5``
    were taken, and ``lease_s='30'`` failed in a comparison that named no field."""
    with pytest.raises(ValueError, match=message):
        ServerConfig(**fields)


def test_a_negative_snapshot_buffer_from_the_file_is_refused(tmp_path: Path) -> None:
    """The flag reads a size (never negative); a file's integer did not go through it (defect seen:
    ``snapshot_buffer = -1`` was taken)."""
    conf = tmp_path / "server.toml"
    conf.write_text("snapshot_buffer = -1\n")
    with pytest.raises(ValueError, match=r"--snapshot-buffer \(config key snapshot_buffer, set in .*\) must be >= 0, got -1"):
        load_config(["--config", str(conf)])
    assert ServerConfig(snapshot_buffer=0).snapshot_buffer == 0  # one capture at a time


def test_the_python_api_takes_a_path_for_a_path(tmp_path: Path) -> None:
    assert ServerConfig(store=tmp_path / "store").store == str(tmp_path / "store")


def test_the_python_api_still_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"ServerConfig\.lease_s must be a finite number > 0 of seconds, got -1"):
        ServerConfig(lease_s=-1)


@pytest.mark.parametrize("flag", ["--memory-limit", "--snapshot-buffer"])
def test_a_bad_size_on_the_command_line_names_the_flag_the_value_and_the_forms(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, "12XB"])
    err = capsys.readouterr().err
    assert f"argument {flag}: cannot read '12XB' as a size" in err, err
    assert "e.g. 64GiB, 500M, 1.5T" in err and "invalid parse_size value" not in err


def test_a_bad_size_in_the_file_names_the_file_the_key_and_the_forms(tmp_path: Path) -> None:
    conf = tmp_path / "server.toml"
    conf.write_text('snapshot_buffer = "1.5 lots"\n')
    with pytest.raises(ValueError) as err:
        load_config(["--config", str(conf)])
    assert f"{conf}: snapshot_buffer: cannot read '1.5 lots' as a size" in str(err.value)
    assert "e.g. 64GiB, 500M, 1.5T" in str(err.value)


def test_the_server_exits_2_naming_the_flag_and_key(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wstream.server", "--bind", f"ipc://{tmp_path / 's.sock'}", "--lease", "-1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "wstream-server: --lease (config key lease_s) must be a finite number > 0 of seconds, got -1" in out.stderr, out.stderr


# ---- the store is checked at start ----------------------------------------------------------------
@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """``directory`` refuses new files, for root too (immutable, where chattr can set it)."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no way to make a directory unwritable")
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"running as root and chattr +i is refused here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True, timeout=60)


def test_an_unwritable_store_is_refused_at_start(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    (store / LOCK_FILE).write_text("")  # a store used before: its lock file can still be opened
    config = ServerConfig(bind=[f"ipc://{tmp_path / 's.sock'}"], store=str(store))
    with unwritable(store), pytest.raises(OSError) as err:
        Server(config)
    message = str(err.value)
    assert f"the store {store} is not writable" in message, message
    assert "Operation not permitted" in message or "Permission denied" in message, message


def test_a_store_that_cannot_be_created_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    config = ServerConfig(bind=[f"ipc://{tmp_path / 's.sock'}"], store=str(tmp_path / "file" / "store"))
    with pytest.raises(OSError, match=f"cannot create the store directory {tmp_path / 'file' / 'store'}: Not a directory"):
        Server(config)


# ---- the memory limit against the host ------------------------------------------------------------
def test_a_memory_limit_beyond_ram_or_dev_shm_is_warned_about_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ram = psutil.virtual_memory().total
    st = os.statvfs(SHM_DIR)
    shm = st.f_blocks * st.f_frsize
    huge = 2 * max(ram, shm)
    with caplog.at_level(logging.WARNING, logger="wstream.server"):
        InProcessServer(bind=[f"ipc://{tmp_path / 'a.sock'}"], memory_limit=huge).stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(format_bytes(huge) in w and format_bytes(ram) in w and "physical memory" in w for w in warnings), warnings
    assert any(format_bytes(huge) in w and format_bytes(shm) in w and SHM_DIR in w for w in warnings), warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wstream.server"):
        InProcessServer(bind=[f"ipc://{tmp_path / 'b.sock'}"], memory_limit=2**20).stop()
    assert not [r for r in caplog.records if "memory limit" in r.getMessage()]


def _cgroup_tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(root), str(tmp_path / "proc_cgroup")


@pytest.mark.parametrize(
    ("files", "proc", "want"),
    [
        # cgroup v2 (a container sees its own cgroup at the mount; the host's path is not there)
        ({"cgroup.controllers": "memory", "memory.max": "1073741824"}, "0::/kubepods/pod1/c1\n", 2**30),
        ({"cgroup.controllers": "memory", "memory.max": "max"}, "0::/\n", None),
        # v2 on the host: the limit is on a parent of the process's cgroup
        ({"a/memory.max": "max", "memory.max": "max", "a/b/memory.max": "max"}, "0::/a/b\n", None),
        ({"a/memory.max": "2147483648", "a/b/memory.max": "max"}, "0::/a/b\n", 2**31),
        # v1 (and hybrid: v1's memory controller beside an empty v2 hierarchy)
        ({"memory/docker/x/memory.limit_in_bytes": "536870912", "memory/memory.limit_in_bytes": "9223372036854771712"},
         "12:memory:/docker/x\n0::/\n", 2**29),
        ({"memory/memory.limit_in_bytes": "9223372036854771712"}, "4:memory:/process_api/abc\n0::/\n", None),
    ],
)
def test_a_containers_memory_limit_is_read_from_its_cgroup(
    tmp_path: Path, files: dict[str, str], proc: str, want: int | None
) -> None:
    from wstream.server.memory import container_memory_limit

    root, proc_cgroup = _cgroup_tree(tmp_path, files, proc)
    assert container_memory_limit(root, proc_cgroup) == want


def test_the_default_memory_limit_keeps_under_a_containers_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's /dev/shm pages count against its memory limit: the default stays at 80% of it,
    and a limit above it is warned about (defect seen: 18.8 GiB by default in a 1 GiB container,
    and the server was OOM-killed at the first step instead of refusing the job)."""
    from wstream.server import memory

    monkeypatch.setattr(memory, "container_memory_limit", lambda: 2**30)
    assert default_memory_limit() <= int(0.8 * 2**30)
    (warning,) = memory.memory_limit_warnings(2**31, ram=2**34, shm_size=2**34, container=2**30)
    assert "this container's memory limit (1.00 GiB)" in warning and "OOM killer" in warning
    assert memory.memory_limit_warnings(2**29, ram=2**34, shm_size=2**34, container=2**30) == []


def test_a_relative_store_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a relative ``--store`` made the paths ``wstream save`` printed relative to
    the server's working directory, meaningless to whoever ran it."""
    monkeypatch.chdir(tmp_path)
    assert ServerConfig(store="snaps").store == str(tmp_path / "snaps")
