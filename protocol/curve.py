"""CURVE encryption of the transport (CurveZMQ): key files, and which endpoints use it.

# NOTE [Which endpoints are encrypted]
# 1. With a server key (``wstream-server --curve-secret-key``), every endpoint whose transport is
#    not ``ipc://`` (or ``inproc://``) uses CURVE: ``tcp://`` in practice. :func:`uses_curve` is
#    the rule, and both ends apply it, so one setting (``$WSTREAM_SERVER_KEY``) serves clients of
#    either kind of endpoint.
# 2. ``ipc://`` endpoints stay plaintext (ZeroMQ's NULL mechanism): a Unix socket file, which a
#    process can connect to only with write permission on it (with the usual umask 022 only the
#    server's user has it) and which never leaves the host. The shared memory the workers map is
#    protected the same way (mode 0600).
# 3. ZeroMQ takes security options at each bind or connect (zmq_setsockopt: "only take effect for
#    subsequent socket bind/connects"), so one ROUTER socket serves both: the server turns
#    ``CURVE_SERVER`` on before each tcp bind and off before each ipc bind. No second socket or loop.
# 4. A failed CURVE handshake (no keys, the wrong server key, a client key the server does not
#    authorize) is silent in ZeroMQ: the client just gets no answer. The client's
#    ``ServerUnavailable`` says so and names the keys to check.
# 5. What CURVE adds on top of protocol 2's HMAC: confidentiality and integrity of everything on a
#    tcp connection (the token ``create_job`` sends, tensor data frames, replies, job names), and
#    with ``--curve-authorized-keys`` a list of the clients that may connect at all.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

ENV_SERVER_KEY = "WSTREAM_SERVER_KEY"
"""The server's public certificate file (or its z85 public key) for clients that do not pass
``server_public_key``."""

ENV_CLIENT_KEY = "WSTREAM_CLIENT_KEY"
"""The client's secret certificate file for clients that do not pass ``client_secret_key``."""

KEY_CHARS = 40  # a 32-byte Curve25519 key in z85

KeySource = str | bytes | os.PathLike[str]


def uses_curve(address: str) -> bool:
    """Whether a connection to ``address`` is encrypted when CURVE is on (NOTE above)."""
    return address.split("://", 1)[0] not in ("ipc", "inproc")


def curve_available() -> None:
    """Raise ValueError when this pyzmq's libzmq was built without CURVE."""
    if not zmq.has("curve"):
        raise ValueError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE support")


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """A client's CURVE keys (z85): the server's public key and this client's keypair."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)
    ephemeral: bool = False
    """The keypair was made for this process (no ``client_secret_key``): enough for encryption,
    never in a server's authorized-keys directory."""

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of the server; before it connects."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def client_keys(server_public_key: KeySource, client_secret_key: str | os.PathLike[str] | None) -> ClientKeys:
    """Load a client's keys; without ``client_secret_key`` an ephemeral keypair is made."""
    curve_available()
    server = load_public_key(server_public_key)
    if client_secret_key is None:
        public, secret = zmq.curve_keypair()
        return ClientKeys(server, public, secret, ephemeral=True)
    public, secret = load_secret_certificate(client_secret_key, "client secret key")
    return ClientKeys(server, public, secret)


def load_public_key(source: KeySource) -> bytes:
    """A z85 public key from a certificate file (public or secret), or given as z85 itself."""
    if isinstance(source, bytes):
        return _z85_key(source, "server public key")
    path = os.fspath(source)
    if not os.path.exists(path):
        if len(path) == KEY_CHARS:
            return _z85_key(path.encode(), "server public key")
        raise ValueError(f"server public key: no such certificate file {path} (nor a {KEY_CHARS}-character z85 key)")
    public, _ = _load(path, "server public key")
    return public


def load_secret_certificate(path: str | os.PathLike[str], what: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a secret certificate file, which must be private."""
    path = os.fspath(path)
    check_private_file(path, what)
    public, secret = _load(path, what)
    if secret is None:
        raise ValueError(
            f"{what}: {path} is a public certificate; give the secret one (NAME.key_secret, written "
            "next to NAME.key by 'wstream keys')"
        )
    return public, _z85_key(secret, f"{what} in {path}")


def check_private_file(path: str, what: str) -> None:
    """ValueError unless ``path`` is a regular file that group and others cannot read or write."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: {path} is not a regular file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{what}: {path} is readable or writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); refusing to use it: chmod 600 {path}"
        )


def public_keys_in(directory: str) -> set[bytes]:
    """The z85 public keys of the certificates (``*.key``) in ``directory``; ValueError when it is
    missing, unreadable or holds none (a server that authorizes nobody is a mistake)."""
    if not os.path.isdir(directory):
        raise ValueError(f"authorized keys: {directory} is not a directory")
    try:
        keys = set(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise ValueError(f"authorized keys: cannot read the certificates in {directory}: {exc}") from None
    if not keys:
        raise ValueError(
            f"authorized keys: {directory} holds no public certificate (*.key); copy the clients' "
            "NAME.key files there ('wstream keys DIR --name NAME' writes them)"
        )
    return {_z85_key(k, f"a certificate in {directory}") for k in keys}


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def write_keypair(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """Write ``NAME.key`` (public, mode 0644) and ``NAME.key_secret`` (mode 0600) into
    ``directory`` with ``zmq.auth.create_certificates``; never overwrites. Returns both paths.

    The files are written in a private temporary directory first (``create_certificates`` opens
    them with the process umask) and then hard-linked into place, so the secret key is never
    readable by others, even briefly, and an existing key file is never replaced."""
    curve_available()
    if not _NAME.fullmatch(name) or name.startswith("."):
        raise ValueError(f"key name {name!r}: use letters, digits, '_', '.', '-' (not a leading '.')")
    directory = os.fspath(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public_path = os.path.join(directory, f"{name}.key")
    secret_path = os.path.join(directory, f"{name}.key_secret")
    for p in (public_path, secret_path):
        if os.path.exists(p):
            raise FileExistsError(f"{p} exists already; choose another --name or directory")
    with tempfile.TemporaryDirectory(dir=directory, prefix=".wstream-keys-") as tmp:
        pub, sec = zmq.auth.create_certificates(tmp, name)
        os.chmod(sec, 0o600)
        os.chmod(pub, 0o644)
        os.link(sec, secret_path)
        try:
            os.link(pub, public_path)
        except OSError:
            os.unlink(secret_path)
            raise
    return public_path, secret_path


def _load(path: str, what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: {path} is not a readable ZeroMQ certificate: {exc}") from None
    return _z85_key(public, f"{what} in {path}"), secret


def _z85_key(key: bytes, what: str) -> bytes:
    try:
        ok = len(key) == KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError):
        ok = False
    if not ok:
        raise ValueError(f"{what}: not a {KEY_CHARS}-character z85 CURVE key")
    return key
