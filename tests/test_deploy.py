"""The files under deploy/ are parsed and cross-checked against the real command-line parsers:
every ``wstream-server``, ``wstream`` and ``torchrun`` command line must parse (no abbreviations),
and the ports, paths and sizes the files repeat must agree with one another. Then every
``wstream-server`` command line they ship (and ``--config server.toml`` alone) is started for real,
with its store, admin secret and endpoints moved into a temporary directory, and must answer
``status`` and stop cleanly. The last tests break each file on purpose and expect its check to fail."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from conftest import start_server
from wstream.client import Client
from wstream.client.admin import build_parser as admin_parser
from wstream.protocol import PROTOCOL_VERSION
from wstream.protocol.shm import segment_paths
from wstream.server.cli import build_parser as server_parser
from wstream.server.cli import load_config
from wstream.server.config import is_loopback
from wstream.server.config_file import read_config_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
SHELL_ENDS = {"\n", ";", "&", "&&", "|", "||", ">", ">>", "<", ")", "}"}


# ---- parsing command lines with the real parsers ------------------------------------------------
def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """No prefix abbreviations (``--metrics-por`` must not pass for ``--metrics-port``), in
    subcommands too."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return strict(parser).parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{where}: `{parser.prog} {shlex.join(argv)}` does not parse: {err.getvalue().strip().splitlines()[-1]}") from None


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def tcp_ports(endpoints: list[str]) -> set[int]:
    return {port for e in endpoints if e.startswith("tcp://") and (port := urlsplit(e).port) is not None}


def check_not_open(args: argparse.Namespace, where: str) -> None:
    """A server that listens beyond its host has an admin secret (or says --insecure): it would
    refuse to start otherwise."""
    beyond = [e for e in args.bind or [] if not is_loopback(e)]
    assert not beyond or args.admin_secret_file or args.insecure, (
        f"{where}: listens on {beyond} without --admin-secret-file (the server refuses to start so)"
    )


def quantity(text: str | int) -> int:
    """A Kubernetes quantity ("64Gi", "500M", 8) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    found = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    assert found, f"not a quantity: {text!r}"
    return int(found.group(1)) * units.get(found.group(2) or "", 1)


# ---- shell text ----------------------------------------------------------------------------------
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}|\$(\w+)")


def expand(text: str, env: dict[str, str]) -> str:
    """``$X``, ``${X}``, ``${X:-default}`` and ``${X:?message}`` from ``env``; an unknown one fails."""

    def one(found: re.Match[str]) -> str:
        name = found.group(1) or found.group(4)
        if name in env:
            return env[name]
        if found.group(2) == "-":
            return expand(found.group(3), env)
        raise AssertionError(f"the shell text uses ${name}, which the test does not know")

    return _VAR.sub(one, text)


def shell_tokens(text: str) -> list[str]:
    """Words of shell text, with newlines and operators as words of their own."""
    lex = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lex.whitespace = " \t\r"
    lex.wordchars += "${}:?%@,+[]!^"
    lex.commenters = "#"
    return list(lex)


def shell_commands(text: str, program: str, env: dict[str, str]) -> list[list[str]]:
    """The arguments of every ``program`` command in ``text``, also inside ``bash -c '...'``."""
    found: list[list[str]] = []
    tokens = shell_tokens(text)
    for i, token in enumerate(tokens):
        if token == program:
            argv = []
            for word in tokens[i + 1 :]:
                if word in SHELL_ENDS:
                    break
                argv.append(expand(word, env))
            found.append(argv)
        elif token != "\n" and any(c.isspace() for c in token):  # a script inside a string
            found += shell_commands(token, program, env)
    return found


def shell_assignments(text: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the script's ``[export] NAME=value`` lines, in order."""
    env = dict(env)
    for line in text.splitlines():
        found = re.fullmatch(r"\s*(?:export\s+)?(\w+)=(.*?)\s*", line)
        if found:
            env[found.group(1)] = expand(found.group(2), env)
    return env


# ---- systemd ---------------------------------------------------------------------------------------
def unit_sections(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values...]}}`` of a systemd unit (continuation lines joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None and "=" in line, f"not a unit line: {line!r}"
        key, _, val = line.partition("=")
        current.setdefault(key.strip(), []).append(val.strip())
    return sections


def check_unit(text: str) -> None:
    service = unit_sections(text)["Service"]
    one = {k: v[-1] for k, v in service.items()}
    assert one.get("LimitMEMLOCK") == "infinity", "LimitMEMLOCK=infinity: pinned memory for GPU copies"
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes"}.items():
        assert one.get(key) == want, f"hardening: {key}={want}"
    assert one.get("KillSignal", "SIGTERM") == "SIGTERM" and "TimeoutStopSec" in one, "stop by SIGTERM, with time to snapshot"
    assert "EnvironmentFile" in one
    credentials = "/run/credentials/wstream-server.service"
    words = [w.replace("%d", credentials) for w in shlex.split(one["ExecStart"])]
    assert words[0].endswith("/wstream-server"), words[0]
    args = parse(server_parser(), [w for w in words[1:] if not re.fullmatch(r"\$\w+", w)], "ExecStart")
    check_not_open(args, "ExecStart")
    run_dir = f"/run/{one['RuntimeDirectory']}/"
    ipc = [e for e in args.bind if e.startswith("ipc://")]
    assert ipc and all(e.removeprefix("ipc://").startswith(run_dir) for e in ipc), f"ipc sockets in {run_dir}"
    assert args.store == f"/var/lib/{one['StateDirectory']}"
    assert args.config.startswith(f"/etc/{one['ConfigurationDirectory']}/")
    read_config_file(str(DEPLOY / Path(args.config).name))  # the file shipped next to the unit
    name, _, _ = one["LoadCredential"].partition(":")
    assert args.admin_secret_file == f"{credentials}/{name}"
    assert args.metrics_port is not None and tcp_ports(args.bind), "a metrics port and a tcp endpoint"
    assert args.metrics_port not in tcp_ports(args.bind)


# ---- Containerfile -------------------------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def check_containerfile(text: str) -> None:
    steps = instructions(text)
    runs = [i for i, (op, _) in enumerate(steps) if op == "RUN"]
    torch_at = next((i for i in runs if re.search(r"pip install\b.*\btorch\b", steps[i][1])), None)
    assert torch_at is not None, "no RUN installs torch"
    assert "${TORCH_INDEX_URL}" in steps[torch_at][1], "torch comes from the TORCH_INDEX_URL build arg"
    args = {rest.split("=")[0]: rest.partition("=")[2] for op, rest in steps if op == "ARG"}
    assert "/whl/cpu" in args["TORCH_INDEX_URL"], "the default build is the CPU server"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    src_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copies = [(i, rest.split()) for i, (op, rest) in enumerate(steps) if op == "COPY"]
    copied = {Path(word).name for _, words in copies for word in words[:-1]}
    assert src_dirs | {"pyproject.toml", pyproject["project"]["readme"]} <= copied, "COPY every package directory"
    dest = Path(next(words[-1] for _, words in copies if "pyproject.toml" in words))
    install_at = next((i for i in runs if re.search(rf"pip install\b.*\s{re.escape(str(dest))}/?(\s|$)", steps[i][1])), None)
    assert install_at is not None, f"no RUN installs wstream from {dest}"
    assert torch_at < min(i for i, _ in copies) and torch_at < install_at, "torch must be installed before wstream"
    entry = json.loads(next(rest for op, rest in steps if op == "ENTRYPOINT"))
    assert entry == ["wstream-server"]
    cmd = parse(server_parser(), json.loads(next(rest for op, rest in steps if op == "CMD")), "CMD")
    check_not_open(cmd, "CMD")
    exposed = {int(p.split("/")[0]) for op, rest in steps if op == "EXPOSE" for p in rest.split()}
    assert exposed == tcp_ports(cmd.bind) | {cmd.metrics_port}, f"EXPOSE {exposed} against CMD's ports"
    user = next(rest for op, rest in steps if op == "USER")
    assert user.split(":")[0] not in ("root", "0"), "the server does not run as root"


# ---- Kubernetes ----------------------------------------------------------------------------------
def k8s_docs(text: str) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(text) if d]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def container_port(container: dict[str, Any], ref: str | int) -> int:
    for p in container.get("ports", []):
        if ref in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']!r} has no port {ref!r}")


def mounted_volume(workload: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume (or volume claim template) mounted at ``path`` or at a directory above it."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    assert mounts, f"nothing is mounted at {path}"
    name = max(mounts, key=lambda m: len(m["mountPath"]))["name"]
    claims = [{"name": c["metadata"]["name"], **c} for c in workload["spec"].get("volumeClaimTemplates", [])]
    found = [v for v in pod_spec(workload)["volumes"] + claims if v["name"] == name]
    assert found, f"the volume {name!r} mounted at {path} is not defined"
    return found[0]


def check_k8s_server(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], argparse.Namespace]:
    """Checks server.yaml; returns its Service and the server's parsed arguments."""
    service = next(d for d in docs if d["kind"] == "Service")
    workload = next(d for d in docs if d["kind"] in ("StatefulSet", "Deployment"))
    pod = pod_spec(workload)
    server = next(c for c in pod["containers"] if c["name"] == "server")
    args = parse(server_parser(), [str(a) for a in server["args"]], "server.yaml")
    check_not_open(args, "server.yaml")
    tcp = tcp_ports(args.bind)
    assert tcp and all(container_port(server, p) == p for p in tcp)
    assert container_port(server, args.metrics_port) == args.metrics_port
    targets = {container_port(server, p["targetPort"]) for p in service["spec"]["ports"]}
    assert targets == tcp | {args.metrics_port}, f"the Service reaches ports {targets}"
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    notes = workload["spec"]["template"]["metadata"].get("annotations", {})
    assert int(notes["prometheus.io/port"]) == args.metrics_port
    shm = mounted_volume(workload, server, "/dev/shm")["emptyDir"]
    assert shm["medium"] == "Memory", "/dev/shm: a memory-backed emptyDir"
    assert args.memory_limit is not None and args.memory_limit <= quantity(shm["sizeLimit"]), "--memory-limit within /dev/shm"
    memory = quantity(server["resources"]["limits"]["memory"])
    assert memory > quantity(shm["sizeLimit"]), "tmpfs pages count against the container's memory limit"
    mounted_volume(workload, server, args.store)
    mounted_volume(workload, server, args.admin_secret_file)
    assert int(pod["terminationGracePeriodSeconds"]) >= 60, "time for the final snapshots after SIGTERM"
    return service, args


def check_k8s_workers(docs: list[dict[str, Any]], service: dict[str, Any]) -> None:
    job = next(d for d in docs if d["kind"] == "Job")
    pod = pod_spec(job)
    worker = pod["containers"][0]
    assert worker["command"] == ["torchrun"]
    run = parse(torchrun_parser(), [str(a) for a in worker["args"]], "worker-job.yaml")
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    assert int(run.nproc_per_node) == gpus, "one process per GPU requested"
    env = {e["name"]: e for e in worker["env"]}
    address = urlsplit(env["WSTREAM_SERVER"]["value"])
    ports = {p["port"] for p in service["spec"]["ports"] if p["name"] == "zmq"}
    assert address.hostname == service["metadata"]["name"] and address.port in ports
    assert "secretKeyRef" in env["WSTREAM_TOKEN"]["valueFrom"], "the token comes from a Secret"


# ---- Slurm -----------------------------------------------------------------------------------------
SLURM_ENV = {"1": "train.py", "HOME": "/home/u", "SLURM_JOB_ID": "123", "SLURMD_NODENAME": "node7", "servers": "1"}


def sbatch_options(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, val = line.removeprefix("#SBATCH ").strip().partition("=")
            out[key] = val
    return out


def check_sbatch(text: str) -> None:
    env = shell_assignments(text, SLURM_ENV)
    (server,) = shell_commands(text, "wstream-server", env)
    args = parse(server_parser(), server, "wstream-server in train.sbatch")
    check_not_open(args, "wstream-server in train.sbatch")
    (status,) = shell_commands(text, "wstream", env)
    st = parse(admin_parser(), status, "wstream in train.sbatch")
    (torchrun,) = shell_commands(text, "torchrun", env)
    run = parse(torchrun_parser(), torchrun, "torchrun in train.sbatch")
    assert st.command == "status" and st.server == env["WSTREAM_SERVER"] in args.bind, "workers find the server"
    assert tcp_ports(args.bind) == {int(env["WSTREAM_PORT"])}
    assert args.metrics_port == int(env["METRICS_PORT"])
    assert args.store.endswith(SLURM_ENV["SLURMD_NODENAME"]), "one store per node: a server resumes every job in its store"
    options = sbatch_options(text)
    assert options["--ntasks-per-node"] == "1", "one server per node"
    assert int(options["--gpus-per-node"]) == int(run.nproc_per_node), "one worker per GPU"
    if shutil.which("bash"):
        syntax = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=60)
        assert syntax.returncode == 0, syntax.stderr


# ---- the files -----------------------------------------------------------------------------------
def test_systemd_unit() -> None:
    check_unit((DEPLOY / "wstream-server.service").read_text())


def test_server_toml_is_a_valid_config() -> None:
    assert read_config_file(str(DEPLOY / "server.toml"))["memory_limit"] > 0
    config, _ = load_config(["--config", str(DEPLOY / "server.toml")])  # as shipped: every setting usable
    assert config.snapshot_every == 0 or config.store is not None


def test_containerfile() -> None:
    check_containerfile((DEPLOY / "Containerfile").read_text())


def test_kubernetes_manifests() -> None:
    service, _ = check_k8s_server(k8s_docs((DEPLOY / "k8s" / "server.yaml").read_text()))
    check_k8s_workers(k8s_docs((DEPLOY / "k8s" / "worker-job.yaml").read_text()), service)


def test_slurm_batch_script() -> None:
    check_sbatch((DEPLOY / "slurm" / "train.sbatch").read_text())


# ---- each server command line, started ---------------------------------------------------------------
def unit_server_argv() -> list[str]:
    one = {k: v[-1] for k, v in unit_sections((DEPLOY / "wstream-server.service").read_text())["Service"].items()}
    words = [w.replace("%d", "/run/credentials/wstream-server.service") for w in shlex.split(one["ExecStart"])]
    return [w for w in words[1:] if not re.fullmatch(r"\$\w+", w)]


def containerfile_server_argv() -> list[str]:
    steps = instructions((DEPLOY / "Containerfile").read_text())
    return [str(w) for w in json.loads(next(rest for op, rest in steps if op == "CMD"))]


def k8s_server_argv() -> list[str]:
    docs = k8s_docs((DEPLOY / "k8s" / "server.yaml").read_text())
    workload = next(d for d in docs if d["kind"] in ("StatefulSet", "Deployment"))
    return [str(a) for a in next(c for c in pod_spec(workload)["containers"] if c["name"] == "server")["args"]]


def slurm_server_argv() -> list[str]:
    text = (DEPLOY / "slurm" / "train.sbatch").read_text()
    (argv,) = shell_commands(text, "wstream-server", shell_assignments(text, SLURM_ENV))
    return argv


SERVER_COMMANDS: dict[str, Callable[[], list[str]]] = {
    "server.toml": lambda: ["--config", str(DEPLOY / "server.toml")],
    "wstream-server.service": unit_server_argv,
    "Containerfile": containerfile_server_argv,
    "k8s/server.yaml": k8s_server_argv,
    "slurm/train.sbatch": slurm_server_argv,
}


def redirected(argv: list[str], tmp_path: Path) -> list[str]:
    """``argv`` with what lives outside the test moved under ``tmp_path``: no ``--bind`` (the
    caller binds a fresh ipc socket), the store and the admin secret there, the config file the one
    shipped in deploy/, metrics on any free loopback port. Everything else is kept as shipped."""
    secret = tmp_path / "admin-secret"
    secret.write_text("deploy-test-secret\n")
    secret.chmod(0o600)
    moved = {
        "--store": str(tmp_path / "store"),
        "--admin-secret-file": str(secret),
        "--metrics-port": "0",
        "--metrics-addr": "127.0.0.1",
    }
    out: list[str] = []
    words = iter(argv)
    for word in words:
        flag, eq, value = word.partition("=")
        if flag == "--bind" or flag in moved or flag == "--config":
            value = value if eq else next(words)
            if flag == "--config":
                out += [flag, str(DEPLOY / Path(value).name)]
            elif flag != "--bind":
                out += [flag, moved[flag]]
        else:
            out.append(word)
    if "--store" not in out:  # (server.toml names /var/lib/wstream)
        out += ["--store", moved["--store"]]
    return out


@pytest.mark.parametrize("where", sorted(SERVER_COMMANDS))
def test_each_shipped_server_command_starts_answers_and_stops(where: str, tmp_path: Path) -> None:
    argv = redirected(SERVER_COMMANDS[where](), tmp_path)
    address = f"ipc://{tmp_path / 'server.sock'}"
    config, _ = load_config(["--bind", address, *argv])  # what the server will run with
    srv = start_server(tmp_path, *argv, address=address)
    try:
        with Client(srv.address, timeout=30) as c:
            status = c.status()
        assert status.protocol == PROTOCOL_VERSION and status.pid == srv.proc.pid
        assert status.memory_limit == config.memory_limit
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()
    assert not segment_paths(srv.proc.pid)
    assert (tmp_path / "store").is_dir()


def _k8s(server: str) -> None:
    service, _ = check_k8s_server(k8s_docs(server))
    check_k8s_workers(k8s_docs((DEPLOY / "k8s" / "worker-job.yaml").read_text()), service)


BREAKAGES: list[tuple[str, Callable[[str], None], str, str]] = [
    ("wstream-server.service", check_unit, "--metrics-port 9464", "--metrics-prot 9464"),
    ("wstream-server.service", check_unit, "--metrics-port 9464", "--metrics-por 9464"),  # an abbreviation
    ("wstream-server.service", check_unit, "LimitMEMLOCK=infinity", "LimitMEMLOCK=64M"),
    ("wstream-server.service", check_unit, "ipc:///run/wstream/", "ipc:///tmp/"),
    ("Containerfile", check_containerfile, "EXPOSE 5555 9464", "EXPOSE 5555 9465"),
    ("Containerfile", check_containerfile, '"--store"', '"--stor"'),
    ("k8s/server.yaml", _k8s, "containerPort: 9464", "containerPort: 9465"),
    ("k8s/server.yaml", _k8s, "sizeLimit: 64Gi", "sizeLimit: 32Gi"),
    ("k8s/server.yaml", _k8s, "- --store\n", "- --stor\n"),
    ("slurm/train.sbatch", check_sbatch, '--metrics-port "$METRICS_PORT"', '--metrics_port "$METRICS_PORT"'),
    ("slurm/train.sbatch", check_sbatch, "--gpus-per-node=4", "--gpus-per-node=8"),
    ("slurm/train.sbatch", check_sbatch, '--admin-secret-file "$WSTREAM_ADMIN_SECRET_FILE"', ""),
    ("Containerfile", check_containerfile, '"--admin-secret-file", "/run/secrets/wstream-admin", ', ""),
    ("k8s/server.yaml", _k8s, "\n            - --admin-secret-file\n            - /run/wstream-admin/admin-secret", ""),
]


def _moved_torch_install(text: str) -> str:
    torch_run = next(line for line in text.splitlines() if line.startswith("RUN pip install --index-url"))
    return text.replace(torch_run + "\n", "").replace("USER 10001", torch_run + "\nUSER 10001")


@pytest.mark.parametrize(("name", "check", "old", "new"), BREAKAGES, ids=lambda x: x if isinstance(x, str) else "")
def test_each_check_fails_on_a_broken_file(name: str, check: Callable[[str], None], old: str, new: str) -> None:
    text = (DEPLOY / name).read_text()
    assert old in text, f"{name} no longer contains {old!r}: update the breakage"
    with pytest.raises(AssertionError):
        check(text.replace(old, new))


def test_the_containerfile_check_wants_torch_first() -> None:
    with pytest.raises(AssertionError, match="torch must be installed before wstream"):
        check_containerfile(_moved_torch_install((DEPLOY / "Containerfile").read_text()))
