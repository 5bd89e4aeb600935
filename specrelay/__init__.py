"""specrelay: edge-cloud speculative decoding over ZeroMQ. The public entry point is `Client`.

`Client` and `Result` load on first use, so `import specrelay.cli` (and the broker, which never touches a
model) does not import torch.
"""

from __future__ import annotations

from importlib import metadata

from . import logs

try:
    __version__ = metadata.version("specrelay")
except metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0.0.0+unknown"
__all__ = ["Client", "Result", "__version__"]

logs.library_default()


def __getattr__(name: str):
    if name in ("Client", "Result"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'specrelay' has no attribute {name!r}")
