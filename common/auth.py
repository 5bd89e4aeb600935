"""CURVE keys and the broker's ZAP authenticator (ZeroMQ's CurveZMQ, RFC 26; ZAP, RFC 27).

  keys      `generate(dir, name)` writes NAME.key (public) and NAME.key_secret (both keys, created 0600: no
            moment when others can read it) in zmq.auth's certificate format; `client(secret_file,
            broker_key_file)` / `server(secret_file, domain)` load them into `transport.Curve`, refusing a secret
            file that group or others can read.
  broker    `Allowlists` runs the ZAP handler (common/zap.py: a handshake budget per key and address, refused
            keys logged) with two domains: "edge" (the frontend) and "worker" (the backend), each with its own
            directory of public keys, re-read on SIGHUP. A key may be listed in one of them only, so an edge
            key can never register as a worker, and vice versa. A reload that fails (an unreadable key file, a
            key in both) keeps the lists in force and logs why. Sockets set ZAP_ENFORCE_DOMAIN, so a CURVE
            socket with no authenticator answering refuses every peer.
  plain TCP `check_insecure_bind`: binding a non-loopback address without keys needs an explicit --insecure.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import urlsplit

import structlog
import zmq
import zmq.auth

from .errors import FatalError
from .transport import Curve
from .zap import ThrottledAuthenticator

log = structlog.get_logger("specrelay.auth")

EDGE_DOMAIN = "edge"
WORKER_DOMAIN = "worker"
CLIENT_DOMAIN = "client"  # applications on an edge worker's --listen port (edge-worker --client-keys)


def generate(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key and DIR/NAME.key_secret (0600); returns their paths. Refuses to overwrite."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise FatalError(f"key name {name!r} must be a plain file name")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise FatalError(f"{public} or {secret} already exists; remove it first or pick another --name")
    directory.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0o077)  # zmq.auth opens both files with the umask's mode: the secret is never readable
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(umask)
    os.chmod(public, 0o644)
    return public, secret


def _load(path: str | os.PathLike, *, secret: bool) -> tuple[bytes, bytes | None]:
    path = Path(path)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise FatalError(f"cannot read the CURVE key file {path}: {exc}") from None
    if secret and secret_key is None:
        raise FatalError(f"{path} holds no secret key: pass the NAME.key_secret file")
    if secret and path.stat().st_mode & 0o077:
        raise FatalError(f"{path} can be read by group or others (mode {path.stat().st_mode & 0o777:o}): a "
                         f"secret key must be private; chmod 600 {path}")
    return public, secret_key


def client(secret_file: str | os.PathLike, broker_key_file: str | os.PathLike) -> Curve:
    """This process's key pair (NAME.key_secret) and the broker's public key (BROKER.key)."""
    public, secret = _load(secret_file, secret=True)
    server_key, _ = _load(broker_key_file, secret=False)
    return Curve(public=public, secret=secret, server_key=server_key)


def server(secret_file: str | os.PathLike, domain: str) -> Curve:
    public, secret = _load(secret_file, secret=True)
    return Curve(public=public, secret=secret, domain=domain)


HANDSHAKES_PER_S = 1.0  # per (domain, address, key), after a burst of HANDSHAKE_BURST (common/zap.py)
HANDSHAKE_BURST = 64


class Allowlists:
    """The broker's ZAP handler: edge keys may use the frontend, worker keys the backend, nothing else."""

    def __init__(self, ctx: zmq.Context, edge_keys: str | os.PathLike | None, worker_keys: str | os.PathLike | None,
                 *, client_keys: str | os.PathLike | None = None, handshakes_per_s: float = HANDSHAKES_PER_S,
                 handshake_burst: int = HANDSHAKE_BURST) -> None:
        dirs = {EDGE_DOMAIN: edge_keys, WORKER_DOMAIN: worker_keys, CLIENT_DOMAIN: client_keys}
        self.dirs = {domain: Path(path) for domain, path in dirs.items() if path is not None}
        self._read()  # refuse a bad directory at start-up, with one line
        self._auth = ThrottledAuthenticator(ctx, handshakes_per_s=handshakes_per_s, handshake_burst=handshake_burst)

    def start(self) -> None:
        try:
            self._auth.start()
        except zmq.ZMQError as exc:  # fail closed: without a ZAP handler libzmq would take any key
            raise FatalError(f"cannot start the ZAP authenticator: {exc}") from exc
        self._install(self._read())

    def _read(self) -> dict[str, dict[bytes, bool]]:
        """Both directories' public keys; FatalError naming the problem if either cannot be used."""
        if len({path.resolve() for path in self.dirs.values()}) < len(self.dirs):
            raise FatalError(f"--edge-keys and --worker-keys are the same directory ({self.dirs[EDGE_DOMAIN]}): "
                             "every worker key would be an edge key too; give each role its own directory")
        lists = {}
        for domain, path in self.dirs.items():
            if not path.is_dir():
                raise FatalError(f"the {domain} key directory {path} does not exist")
            try:
                lists[domain] = zmq.auth.load_certificates(path)
            except (OSError, ValueError) as exc:
                raise FatalError(f"cannot read the {domain} keys in {path}: {exc}") from None
        both = lists.get(EDGE_DOMAIN, {}).keys() & lists.get(WORKER_DOMAIN, {}).keys()
        if both:
            names = ", ".join(k.decode() for k in sorted(both))
            raise FatalError(f"{len(both)} key(s) listed as both edge and worker ({names}): a key may have one "
                             f"role; remove it from {self.dirs[EDGE_DOMAIN]} or {self.dirs[WORKER_DOMAIN]}")
        return lists

    def _install(self, lists: dict[str, dict[bytes, bool]]) -> dict[str, int]:
        for domain, keys in lists.items():
            self._auth.certs[domain] = keys
        counts = {domain: len(keys) for domain, keys in lists.items()}
        log.info("key allowlists loaded", **counts)
        return counts

    def reload(self) -> dict[str, int] | None:
        """Re-read both directories (SIGHUP), all or nothing: on any problem the lists in force stay and the
        reason is logged. Returns the number of keys per domain, or None when the reload was refused."""
        try:
            return self._install(self._read())
        except FatalError as exc:
            log.error("key reload refused; the previous allowlists stay in force", reason=str(exc))
            return None

    def stop(self) -> None:
        self._auth.stop()


def is_loopback(endpoint: str) -> bool:
    """ipc:// and inproc:// are local; tcp:// is local when its host is a loopback address or localhost."""
    parts = urlsplit(endpoint)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name, a host name or '*': not provably local


def check_insecure_bind(endpoints: list[str], *, keys: bool, insecure: bool) -> None:
    """Refuse to bind a non-loopback address without CURVE keys unless --insecure was given."""
    if keys or insecure:
        return
    exposed = [e for e in endpoints if not is_loopback(e)]
    if exposed:
        raise FatalError(f"refusing to bind {', '.join(exposed)} without CURVE keys: anyone who reaches it could "
                         "read prompts and forge outputs. Pass --curve-secret/--edge-keys/--worker-keys "
                         "(see `specrelay keys generate`), or --insecure on a trusted network.")
