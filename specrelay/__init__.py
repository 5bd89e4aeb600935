"""specrelay: edge-cloud speculative decoding over ZeroMQ. The public entry point is `Client`."""

from .client import Client, Result

__version__ = "0.1.0"
__all__ = ["Client", "Result", "__version__"]
