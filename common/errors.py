"""specrelay's exceptions, and the error codes that travel in ERROR messages.

    SpecRelayError
    ├── RequestError            a request failed; the process keeps serving (wire code in `.code`)
    │   ├── InvalidRequest      malformed frame, wrong type, out-of-range field       -> BAD_REQUEST
    │   ├── UnknownSession      the worker has no state for this session             -> RESEND_CONTEXT
    │   ├── WorkerLost          the worker holding the session vanished (retryable)   -> WORKER_LOST
    │   ├── Overloaded          no live worker / queue full (retryable)               -> UNAVAILABLE
    │   └── GenerationTimeout   the client gave up waiting
    └── FatalError              the component cannot go on (model failed to load, socket gone)

A bad request fails that request, never the process. asyncio.CancelledError is never caught here.
"""

from __future__ import annotations


class SpecRelayError(Exception):
    """Base of every specrelay exception."""


class RequestError(SpecRelayError):
    code = "INTERNAL"
    retryable = False

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidRequest(RequestError, ValueError):
    code = "BAD_REQUEST"


class UnknownSession(RequestError):
    code = "RESEND_CONTEXT"
    retryable = True


class WorkerLost(RequestError):
    code = "WORKER_LOST"
    retryable = True


class Overloaded(RequestError):
    code = "UNAVAILABLE"
    retryable = True


class GenerationTimeout(RequestError, TimeoutError):
    code = "TIMEOUT"


class FatalError(SpecRelayError):
    """The component is dead (like vLLM's EngineDeadError); callers should not retry on it."""


_BY_CODE = {cls.code: cls for cls in (InvalidRequest, UnknownSession, WorkerLost, Overloaded, GenerationTimeout)}


def from_wire(code: str, message: str) -> RequestError:
    """The exception an ERROR message stands for."""
    cls = _BY_CODE.get(code, RequestError)
    err = cls(message)
    if cls is RequestError:
        err.code = code
    return err
