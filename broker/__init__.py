"""The specrelay broker: routes edge sessions to cloud workers over ZeroMQ (see routing.py, server.py)."""

from .routing import Router
from .server import Broker, serve

__all__ = ["Broker", "Router", "serve"]
