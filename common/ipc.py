"""ipc:// endpoints' socket files: whether a process listens on one (ZeroMQ would silently replace a live
process's file on bind, and a client would wait silently for a listener that never comes), and which file a
process made (so it removes only its own on exit)."""

from __future__ import annotations

import os
import socket

from .errors import ConfigError


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ipc:// endpoint (None for any other transport, or an abstract `ipc://@name`)."""
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    return path if path and not path.startswith("@") else None


def ipc_listening(endpoint: str) -> bool | None:
    """Whether a process listens on an ipc:// endpoint's socket file (None: not an ipc:// file endpoint)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:  # no file, or a file nobody answers on (left by a process that died)
            return False
    return True


def refuse_held(endpoint: str, flag: str) -> None:
    """ZeroMQ binds an ipc:// path a live process listens on by replacing its file (the first process can then
    no longer be reached): refuse that. A file nobody answers on is taken over."""
    if ipc_listening(endpoint):
        raise ConfigError(f"{flag} {endpoint}: another process is listening on it (another edge worker?); stop it "
                          f"or pass {flag} with another endpoint")


def file_id(endpoint: str) -> tuple[str, int, int] | None:
    path = ipc_path(endpoint)
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (path, st.st_dev, st.st_ino) if st else None
