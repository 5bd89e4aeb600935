"""Is the broker there, and does it have a live cloud worker? Asked before anything heavy loads, so a mistyped
address or an empty pool ends within `--connect-timeout` seconds in one sentence that names the address. With
several brokers (`probe_brokers`) every one is asked at once and the first with a live worker ends the wait.

ZeroMQ connects lazily and silently retries forever, so "unreachable" is read off the socket monitor: the
ZMTP handshake (CURVE included) either succeeds in time or the last event says why not. The worker check is
one real round trip: OPEN a one-token session, VERIFY an empty draft, CLOSE (the broker answers UNAVAILABLE
while no worker is registered, WORKER_LOST when the one it chose just went away: both, and every other
retryable code, are retried until the deadline). Needs no model and no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ...common import protocol as P
from ...common import transport
from ...common.brokers import broker_list, per_broker
from ...common.errors import AuthenticationFailed, FatalError, InvalidRequest, from_wire

HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed: the broker at {} refused this process's CURVE key "
                                     "(is its public key in the broker's --edge-keys / --worker-keys directory?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the peer at {} does not speak ZeroMQ's protocol (wrong port?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the ZeroMQ handshake with {} failed (CURVE keys on one side only, or "
                                          "not a ZeroMQ peer)",
}
MECHANISM_MISMATCH = ("the broker at {} and this process disagree on CURVE: one side has keys and the other "
                      "none; pass --curve-secret and --broker-key (or neither, on both sides)")
RETRY_S = 0.25  # between worker checks while the broker answers UNAVAILABLE
NOTICE_AFTER_S = 2.0  # a wait this long is announced once (`on_wait`): a broker or worker that is still starting


async def probe_broker(endpoint: str, timeout: float, *, worker: bool = True, curve: transport.Curve | None = None,
                       context: zmq.asyncio.Context | None = None,
                       on_wait: Callable[[str], None] | None = None) -> None:
    """Return once the broker at `endpoint` completed a handshake (and, with `worker`, answered a VERIFY through a
    live cloud worker); otherwise raise FatalError within `timeout` seconds, naming the endpoint and the fix.
    `on_wait(what)` is called once if the wait passes NOTICE_AFTER_S (a broker or worker still starting)."""
    ctx = context or zmq.asyncio.Context.instance()
    sock = transport.make_socket(ctx, zmq.DEALER, linger_ms=0, curve=curve)  # the broker assigns its identity
    monitor = sock.get_monitor_socket()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    waiting = ["the broker at " + endpoint]  # what we wait for now, for the notice
    notice = loop.call_later(NOTICE_AFTER_S, lambda: on_wait and on_wait(f"waiting for {waiting[0]}"))
    try:
        await _resolve(endpoint, deadline, loop)
        transport.connect(sock, endpoint, "probe")
        await _handshake(monitor, endpoint, timeout, deadline, loop)
        waiting[0] = f"a cloud worker behind the broker at {endpoint}"
        if worker:
            await _worker_answers(sock, endpoint, deadline, loop)
    finally:
        notice.cancel()
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def _resolve(endpoint: str, deadline: float, loop) -> None:
    """A tcp:// host name that does not resolve fails at once (libzmq would retry it silently)."""
    url = urlsplit(endpoint)
    if url.scheme != "tcp" or url.hostname in (None, "*"):
        return
    try:
        await asyncio.wait_for(loop.getaddrinfo(url.hostname, None), max(0.0, deadline - loop.time()))
    except (OSError, asyncio.TimeoutError) as exc:
        raise FatalError(f"cannot reach the broker at {endpoint}: the host name {url.hostname!r} does not resolve "
                         f"({exc or 'timed out'}); check --broker") from None


async def _handshake(monitor: zmq.asyncio.Socket, endpoint: str, timeout: float, deadline: float, loop) -> None:
    why = "nothing answered"
    while True:
        try:
            frames = await asyncio.wait_for(monitor.recv_multipart(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise FatalError(f"cannot reach the broker at {endpoint} within {timeout:g} s: {why}; check --broker "
                             "and that `specrelay broker` runs there (or raise --connect-timeout)") from None
        message = parse_monitor_message(frames)
        event = message["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise AuthenticationFailed(HANDSHAKE_FAILED[event].format(endpoint))
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                message["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            raise FatalError(MECHANISM_MISMATCH.format(endpoint))
        if event in HANDSHAKE_FAILED:
            raise FatalError(HANDSHAKE_FAILED[event].format(endpoint))
        if event in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CLOSED):
            why = "the connection was refused (nothing listens there)" if event != zmq.EVENT_CONNECT_DELAYED else why
        elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
            why = "a TCP connection opened but no ZeroMQ handshake completed"


async def _worker_answers(sock: zmq.asyncio.Socket, endpoint: str, deadline: float, loop) -> None:
    """OPEN + empty VERIFY until a VERDICT comes back; a retryable ERROR is retried until the deadline."""
    seq, last = 0, "no reply"
    try:
        while loop.time() < deadline:
            seq += 1
            for msg in (P.Open(1, [0]), P.Verify(1, seq, 1)):
                await sock.send_multipart(P.encode(msg))
            reply = await _reply(sock, seq, deadline, loop)
            if isinstance(reply, P.Verdict):
                return
            if reply is None:
                break
            if not from_wire(reply.code, reply.message).retryable:
                raise FatalError(f"the broker at {endpoint} refused a request: {reply.message}")
            last = f"{reply.code.name}: {reply.message}"
            await asyncio.sleep(min(RETRY_S, max(0.0, deadline - loop.time())))
    finally:
        transport.send_nowait(sock, P.encode(P.Close(1)))
    raise FatalError(f"the broker at {endpoint} has no live cloud worker ({last}); start `specrelay cloud-worker "
                     "--broker BACKEND` against it (or raise --connect-timeout)")


async def _reply(sock: zmq.asyncio.Socket, seq: int, deadline: float, loop) -> P.Verdict | P.Error | None:
    """The VERDICT or ERROR for this round (stale replies skipped); None at the deadline."""
    while True:
        try:
            frames = await asyncio.wait_for(sock.recv_multipart(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return None
        try:
            msg = P.decode(frames)
        except InvalidRequest:
            continue
        if isinstance(msg, P.Verdict) and msg.seq == seq or isinstance(msg, P.Error) and msg.seq in (0, seq):
            return msg


async def probe_brokers(endpoints: str | Sequence[str], timeout: float, *, worker: bool = True,
                        curve: transport.Curve | Sequence[transport.Curve] | None = None,
                        context: zmq.asyncio.Context | None = None,
                        on_wait: Callable[[str], None] | None = None) -> str:
    """`probe_broker` for several brokers at once (`curve`: one for all or one per broker): returns the first
    endpoint whose probe succeeds. A refused key is raised at once; when every probe fails, one FatalError
    naming each broker and why. `on_wait` is called once, naming them all, if the wait passes NOTICE_AFTER_S."""
    endpoints = broker_list(endpoints, "broker")
    curves = per_broker(curve, len(endpoints), "curve")
    if len(endpoints) == 1:
        await probe_broker(endpoints[0], timeout, worker=worker, curve=curves[0], context=context, on_wait=on_wait)
        return endpoints[0]
    what = "a cloud worker behind" if worker else "a handshake with"
    notice = asyncio.get_running_loop().call_later(
        NOTICE_AFTER_S, lambda: on_wait and on_wait(f"waiting for {what} any of the brokers at {', '.join(endpoints)}"))
    tasks = {asyncio.create_task(probe_broker(e, timeout, worker=worker, curve=c, context=context)): e
             for e, c in zip(endpoints, curves)}
    failures: list[str] = []
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is None:
                    return tasks[task]
                if isinstance(exc, AuthenticationFailed) or not isinstance(exc, FatalError):
                    raise exc
                failures.append(str(exc))
    finally:
        notice.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    raise FatalError(f"none of the {len(endpoints)} brokers answered: " + "; ".join(failures))


def warn_if_unreachable(endpoints: str | Sequence[str], timeout: float, *, worker: bool = True,
                        curve: transport.Curve | Sequence[transport.Curve] | None = None, **options) -> asyncio.Task:
    """For servers, which keep retrying: a background probe of each broker that logs one warning naming it when
    it is not reachable (or has no worker) within `timeout`. Cancel the task when serving ends."""
    import structlog

    endpoints = broker_list(endpoints, "broker")

    async def check(endpoint: str, keys: transport.Curve | None) -> None:
        try:
            await probe_broker(endpoint, timeout, worker=worker, curve=keys, **options)
        except FatalError as exc:
            structlog.get_logger("specrelay.probe").warning("broker not ready; still retrying", broker=endpoint,
                                                            reason=str(exc))

    async def check_all() -> None:
        await asyncio.gather(*(check(e, c) for e, c in zip(endpoints, per_broker(curve, len(endpoints), "curve"))))

    return asyncio.create_task(check_all(), name="broker-probe")
