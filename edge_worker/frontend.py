"""The edge worker's face to local clients: a ROUTER speaking GENERATE / CANCEL -> TOKENS* DONE | ERROR.

    client DEALER -> [client_id, header, body] -> ROUTER (this module) -> EdgeWorker.generate

`handle_generate` runs one request against an EdgeWorker and reports through an `emit` callback; the ROUTER
loop and `Client.local` (no socket) both use it. Cancelling a request cancels its generation, which CLOSEs the
session in the cloud.
"""

from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable

import structlog
import zmq
import zmq.asyncio

from ..common import auth, ipc, transport
from ..common import protocol as P
from ..common.errors import ErrorCode, FatalError, InvalidRequest, RequestError
from . import config as edge_config
from .config import SessionConfig
from .http.textstream import TextStream

log = structlog.get_logger("specrelay.edge")

Emit = Callable[[P.Base], Awaitable[None]]


def session_config(edge, msg: P.Generate) -> SessionConfig:
    """A client's GENERATE -> the session's settings (config.session_config: the edge's defaults fill what the
    client left out; draft_len -1 = the edge's default)."""
    return edge_config.session_config(edge.config, max_new_tokens=msg.max_new_tokens, temperature=msg.temperature,
                                      top_k=msg.top_k, top_p=msg.top_p, seed=msg.seed,
                                      draft_len=None if msg.draft_len < 0 else msg.draft_len, mode=msg.mode,
                                      resample=msg.resample, objective=msg.objective)


async def handle_generate(edge, msg: P.Generate, emit: Emit) -> None:
    """One client request: TOKENS per committed chunk, then DONE; a failed request becomes one ERROR."""
    text = None
    try:
        settings = session_config(edge, msg)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(None, lambda: list(edge.tokenizer(msg.prompt).input_ids))
        text = TextStream(edge.tokenizer)

        async def on_tokens(new: list[int]) -> None:
            await emit(P.Tokens(msg.request, new, text.push(new)))

        _, stats = await edge.generate(ids, settings, on_tokens)
        tail = text.flush()
        if tail:
            await emit(P.Tokens(msg.request, [], tail))
        await emit(P.Done(msg.request, {k: v for k, v in stats.items() if isinstance(v, (int, float))}))
    except zmq.ZMQError:
        raise  # the client is gone: nobody to tell
    except RequestError as exc:
        tail = text.flush() if text is not None else ""  # the committed text held back for a whole character
        if tail:
            await emit(P.Tokens(msg.request, [], tail))
        await emit(P.Error(msg.request, 0, exc.code, str(exc)))
    except FatalError as exc:
        await emit(P.Error(msg.request, 0, ErrorCode.INTERNAL, str(exc)))
    except Exception as exc:  # a bug fails this request, not the process
        log.exception("request failed", request=msg.request)
        await emit(P.Error(msg.request, 0, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))


class ClientFrontend:
    """The ROUTER loop: GENERATE starts a generation task, CANCEL cancels it; anything else gets an ERROR."""

    def __init__(self, edge, listen: str) -> None:
        self.edge, self.listen = edge, listen
        self.endpoint: str | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._requests: dict[tuple[bytes, int], asyncio.Task] = {}
        self._allowlist: auth.Allowlists | None = None
        self._ctx = edge.ctx
        self._ipc_file: tuple[str, int, int] | None = None  # (path, device, inode) of the socket file it made

    def open(self) -> None:
        """Bind the client port: CURVE with the edge's key pair when `client_keys` lists the applications' keys
        (its own context: one ZAP handler per context); without keys only loopback / ipc:// unless
        `insecure_listen`."""
        config, curve = self.edge.config, None
        if config.client_keys is not None:
            curve = self._client_curve()
        elif not (config.insecure_listen or auth.is_loopback(self.listen)):
            raise FatalError(f"refusing --listen {self.listen} without keys: anyone who reaches it could generate "
                             "on this edge's broker key. Pass --client-keys DIR (with --curve-secret), listen on "
                             "127.0.0.1 or ipc://, or pass --insecure on a trusted network.")
        ipc.refuse_held(self.listen, "--listen")
        self._sock = transport.make_socket(self._ctx, zmq.ROUTER, linger_ms=config.linger_ms, curve=curve,
                                           mandatory=True)  # a vanished client -> EHOSTUNREACH, not silence
        self.endpoint = transport.bind(self._sock, self.listen, "edge worker")
        self._ipc_file = ipc.file_id(self.listen)

    def _client_curve(self) -> transport.Curve:
        edge_keys = self.edge._curve
        if edge_keys is None:
            raise FatalError("--client-keys needs the edge's own key pair (--curve-secret): clients check it")
        self._ctx = zmq.asyncio.Context()
        self._allowlist = auth.Allowlists(self._ctx, None, None, client_keys=self.edge.config.client_keys)
        self._allowlist.start()
        return transport.Curve(public=edge_keys.public, secret=edge_keys.secret, domain=auth.CLIENT_DOMAIN)

    async def serve(self) -> None:
        await transport.receive_forever(self._sock, self._on_message)

    async def _on_message(self, frames: list[bytes], n_frames: int) -> None:
        client, body = frames[0], frames[1:]
        try:
            if n_frames != 3:
                raise InvalidRequest(f"a request is 2 frames (header, body), got {n_frames - 1}", field="frames")
            msg = P.decode(body)
            if not isinstance(msg, (P.Generate, P.Cancel)):
                raise InvalidRequest(f"the edge worker takes GENERATE or CANCEL, got {type(msg).__name__}",
                                     field="header.type")
        except InvalidRequest as exc:
            await self._refuse(client, _request_id(body), str(exc))
            return
        if isinstance(msg, P.Cancel):
            task = self._requests.get((client, msg.request))
            if task is not None:
                task.cancel()
        elif (client, msg.request) in self._requests:
            await self._refuse(client, msg.request, f"request id {msg.request} is already running")
        else:
            self._start(client, msg)

    def _start(self, client: bytes, msg: P.Generate) -> None:
        key = (client, msg.request)
        task = asyncio.create_task(self._run(client, msg), name=f"edge-request-{msg.request}")
        self._requests[key] = task
        task.add_done_callback(lambda _: self._requests.pop(key, None))

    async def _run(self, client: bytes, msg: P.Generate) -> None:
        try:
            await handle_generate(self.edge, msg, lambda reply: self._to_client(client, reply))
        except zmq.ZMQError as exc:
            log.info("client gone; generation stopped", request=msg.request, error=str(exc))

    async def _to_client(self, client: bytes, msg: P.Base) -> None:
        await self._sock.send_multipart([client, *P.encode(msg)])

    async def _refuse(self, client: bytes, request: int, reason: str) -> None:
        """BAD_REQUEST to a client; one that has already gone away is only logged."""
        try:
            await self._to_client(client, P.Error(request, 0, ErrorCode.BAD_REQUEST, reason))
        except zmq.ZMQError as exc:
            log.info("cannot refuse a request: client gone", request=request, error=str(exc))

    async def cancel_all(self) -> None:
        requests = list(self._requests.values())
        for task in requests:
            task.cancel()
        await asyncio.gather(*requests, return_exceptions=True)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ipc_file is not None:  # ZeroMQ leaves the file; remove it unless another process made it since
            path = self._ipc_file[0]
            if ipc.file_id(f"ipc://{path}") == self._ipc_file:
                os.unlink(path)
            self._ipc_file = None
        if self._allowlist is not None:
            self._allowlist.stop()
            self._allowlist = None
            self._ctx.term()


def _request_id(body: list[bytes]) -> int:
    """The request id of an undecodable client message, when its first field is readable (else 0)."""
    return P.session_or_zero(body, 1) if len(body) == 2 else 0
