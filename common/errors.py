"""specrelay's exceptions, and the error codes that travel in ERROR messages.

    SpecRelayError
    ├── RequestError            a request failed; the process keeps serving (wire code in `.code`)
    │   ├── InvalidRequest      malformed frame, wrong type, out-of-range field       -> BAD_REQUEST
    │   │   └── ChainsOnly      a token tree to a worker that verifies chains only    -> CHAINS_ONLY
    │   ├── UnknownSession      no live state for this (peer, session): re-OPEN       -> UNKNOWN_SESSION
    │   │   └── UnknownVocab    the OPEN's bitmap hash is not cached: re-OPEN with it -> UNKNOWN_VOCAB
    │   ├── WorkerLost          the worker holding the session vanished (retryable)   -> WORKER_LOST
    │   ├── Overloaded          no live worker / a limit reached (retryable)          -> UNAVAILABLE
    │   ├── ConnectionLost      the link to the broker dropped mid-request (local)    -> UNAVAILABLE
    │   ├── GenerationTimeout   the client gave up waiting                            -> TIMEOUT
    │   ├── InternalError       the cloud failed on this request; its state is gone  -> INTERNAL
    │   └── ContextFull         the session reached the target's context: it ends     -> CONTEXT_FULL
    └── FatalError              the component cannot go on (model failed to load, socket gone)
        ├── AuthenticationFailed  the broker refused this process's CURVE key
        └── ConfigError           a setting names something that is not there (model directory, CUDA): the
            │                     CLI prints its one line and exits 2, like a bad flag
            └── SettingError      a setting's value is out of its range (also a ValueError)

A bad request fails that request, never the process. asyncio.CancelledError is never caught here.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """ERROR.code on the wire (one byte)."""

    BAD_REQUEST = 1      # the message is malformed or a field is out of range: do not retry it as is
    UNKNOWN_SESSION = 2  # nobody holds this session (for this peer): re-OPEN with the whole context
    WORKER_LOST = 3      # the worker holding the session died: re-OPEN
    UNAVAILABLE = 4      # no worker has room, or a per-client limit was reached: retry later
    TIMEOUT = 5
    INTERNAL = 6         # a bug or a failed forward pass: re-OPEN
    # 7 is reserved (an unused key-permission code in 0.1.0): never reuse it, a peer of 0.1.0 may know it
    CONTEXT_FULL = 8     # the session reached the target's context: the generation ends there ("length")
    CHAINS_ONLY = 9      # this worker cannot verify token trees: re-OPEN and send chains (parents = [])
    UNKNOWN_VOCAB = 10   # the OPEN named its shared-vocabulary bitmap by hash only, not cached here: send it


class SpecRelayError(Exception):
    """Base of every specrelay exception."""


class RequestError(SpecRelayError):
    """A request failed; `code` is its wire code, `retryable` whether the edge re-OPENs and tries again.
    Subclasses set both in their class line: `class WorkerLost(RequestError, code=..., retryable=True)`."""

    code = ErrorCode.INTERNAL
    retryable = False

    def __init_subclass__(cls, code: ErrorCode | None = None, retryable: bool | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if retryable is not None:
            cls.retryable = retryable

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidRequest(RequestError, ValueError, code=ErrorCode.BAD_REQUEST):
    """A malformed frame, a wrong type, an out-of-range field: do not retry it as is."""


class ChainsOnly(InvalidRequest, code=ErrorCode.CHAINS_ONLY):
    """A token tree sent to a worker that verifies chains only (the model's own cache: Falcon, Bloom). A bad
    request like any other (counted as one); an edge with a tree in flight re-OPENs and drafts chains."""


class UnknownSession(RequestError, code=ErrorCode.UNKNOWN_SESSION, retryable=True):
    """Nobody holds this (peer, session): re-OPEN with the whole context."""


class UnknownVocab(UnknownSession, code=ErrorCode.UNKNOWN_VOCAB):
    """A hash-only OPEN whose bitmap this worker does not hold (never sent, expired or pushed out of its cache):
    the edge re-OPENs at once with the bitmap itself."""


class WorkerLost(RequestError, code=ErrorCode.WORKER_LOST, retryable=True):
    """The worker holding the session vanished: re-OPEN."""


NO_LIVE_WORKER = "no live cloud worker"  # how a broker's UNAVAILABLE begins when it has no worker for a new session


class Overloaded(RequestError, code=ErrorCode.UNAVAILABLE, retryable=True):
    """No live worker has room (the message starts with NO_LIVE_WORKER), or a per-client limit was reached:
    retry later."""


class ConnectionLost(RequestError, code=ErrorCode.UNAVAILABLE, retryable=True):
    """The edge's connection to the broker dropped while a request was in flight: retry (re-OPEN)."""


class GenerationTimeout(RequestError, TimeoutError, code=ErrorCode.TIMEOUT, retryable=True):
    """No reply within the timeout."""


class InternalError(RequestError, code=ErrorCode.INTERNAL, retryable=True):
    """The cloud failed on this request (a bug, or the model's forward pass raised); its state is gone."""


class FatalError(SpecRelayError):
    """The component is dead (like vLLM's EngineDeadError); callers should not retry on it."""


class AuthenticationFailed(FatalError):
    """The broker refused this process's CURVE key (not in its allowlist, or the wrong role)."""


class ConfigError(FatalError):
    """A setting is wrong for this machine: a model directory that does not exist, no tokenizer files, CUDA
    asked for where there is none. The message names the setting and the fix."""


class SettingError(ConfigError, ValueError):
    """A setting's value is out of its range (a config dataclass refused it): the CLI says so and exits 2."""


class ContextFull(RequestError, code=ErrorCode.CONTEXT_FULL):
    """The session holds as many tokens as the target's context: not a failure of the request, its end. The edge
    finishes the generation with what it committed (finish_reason "length")."""


_BY_CODE = {cls.code: cls for cls in (InvalidRequest, ChainsOnly, UnknownSession, UnknownVocab, WorkerLost,
                                      Overloaded, GenerationTimeout, InternalError, ContextFull)}


def from_wire(code: ErrorCode, message: str) -> RequestError:
    """The exception an ERROR message stands for."""
    return _BY_CODE.get(code, InternalError)(message)
