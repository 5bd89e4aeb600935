"""CURVE keys and the broker's ZAP authenticator (ZeroMQ's CurveZMQ, RFC 26; ZAP, RFC 27).

  keys      `generate(dir, name)` writes NAME.key (public) and NAME.key_secret (both keys, mode 0600) in
            zmq.auth's certificate format; `client(secret_file, broker_key_file)` / `server(secret_file, domain)`
            load them into `transport.Curve`.
  broker    `Allowlists` runs pyzmq's asyncio ZAP authenticator with two domains: "edge" (the frontend) and
            "worker" (the backend), each with its own directory of public keys, re-read on SIGHUP. A key
            listed only as an edge can never register as a worker, and vice versa. Sockets set
            ZAP_ENFORCE_DOMAIN, so a CURVE socket with no authenticator answering refuses every peer.
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
from zmq.auth.asyncio import AsyncioAuthenticator

from .errors import FatalError
from .transport import Curve

log = structlog.get_logger("specrelay.auth")

EDGE_DOMAIN = "edge"
WORKER_DOMAIN = "worker"


def generate(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key and DIR/NAME.key_secret (0600); returns their paths. Refuses to overwrite."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise FatalError(f"key name {name!r} must be a plain file name")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise FatalError(f"{public} or {secret} already exists; remove it first or pick another --name")
    directory.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)  # zmq.auth writes it world-readable
    return public, secret


def _load(path: str | os.PathLike, *, secret: bool) -> tuple[bytes, bytes | None]:
    path = Path(path)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise FatalError(f"cannot read the CURVE key file {path}: {exc}") from None
    if secret and secret_key is None:
        raise FatalError(f"{path} holds no secret key: pass the NAME.key_secret file")
    return public, secret_key


def client(secret_file: str | os.PathLike, broker_key_file: str | os.PathLike) -> Curve:
    """This process's key pair (NAME.key_secret) and the broker's public key (BROKER.key)."""
    public, secret = _load(secret_file, secret=True)
    server_key, _ = _load(broker_key_file, secret=False)
    return Curve(public=public, secret=secret, server_key=server_key)


def server(secret_file: str | os.PathLike, domain: str) -> Curve:
    public, secret = _load(secret_file, secret=True)
    return Curve(public=public, secret=secret, domain=domain)


class Allowlists:
    """The broker's ZAP handler: edge keys may use the frontend, worker keys the backend, nothing else."""

    def __init__(self, ctx: zmq.Context, edge_keys: str | os.PathLike, worker_keys: str | os.PathLike) -> None:
        self.dirs = {EDGE_DOMAIN: Path(edge_keys), WORKER_DOMAIN: Path(worker_keys)}
        for domain, path in self.dirs.items():
            if not path.is_dir():
                raise FatalError(f"the {domain} key directory {path} does not exist")
        self._auth = AsyncioAuthenticator(ctx)

    def start(self) -> None:
        try:
            self._auth.start()
        except zmq.ZMQError as exc:  # fail closed: without a ZAP handler libzmq would take any key
            raise FatalError(f"cannot start the ZAP authenticator: {exc}") from exc
        self.reload()

    def reload(self) -> dict[str, int]:
        """Re-read both directories (SIGHUP). Returns the number of keys per domain."""
        counts = {}
        for domain, path in self.dirs.items():
            keys = zmq.auth.load_certificates(path) if path.is_dir() else {}
            self._auth.certs[domain] = keys  # an empty or vanished directory admits nobody
            counts[domain] = len(keys)
        log.info("key allowlists loaded", **counts)
        return counts

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
