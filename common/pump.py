"""A socket read and written in batches, without a Future per message: the broker's data path.

pyzmq's asyncio wrapper creates Futures for every `recv`/`send` and `recv_capped` awaited every frame; at a few
thousand round trips per second that was most of a broker core (issue 23). Here one `Pump` per socket:
- reads with the synchronous shadow of the asyncio socket, NOBLOCK and copy=False, up to `burst` whole messages
  per wakeup (copy=False: a frame stays libzmq's buffer, so the frames of a hostile many-frame message past `cap`
  are dropped without a copy), then yields to the event loop;
- waits for readability on the socket's file descriptor with the event loop's `add_reader`, never a Future per
  message;
- sends synchronously (NOBLOCK), returning the error instead of raising, as `transport.send_nowait` does.

ZeroMQ's descriptor is edge-triggered: it signals that `EVENTS` may have changed, and any operation on the socket
(a send too) may consume that signal. So the reader re-checks `EVENTS` before it sleeps, and whoever sends on a
socket re-checks it: after each batch a pump wakes every socket of its group that was sent on, so a message
that arrived meanwhile is not left waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq
import zmq.asyncio

from .transport import FRAME_CAP, RECV_BURST

# pyzmq's sugar layer (send_multipart, recv_multipart) costs ~3x the socket operation itself (flag enums, type
# checks, a getsockopt per frame): the data path calls the Cython socket's own send/recv with plain int flags.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


class Pump:
    """The batch reader and non-blocking sender of one asyncio socket (which keeps owning the socket's life)."""

    def __init__(self, sock: zmq.asyncio.Socket, group: list[Pump] | None = None) -> None:
        self.sock = sock
        self._sync = zmq.Socket.shadow(sock.underlying)
        self._readable = asyncio.Event()
        self._sent = False              # sent on since the last wake(): the descriptor's edge may be gone
        self._group = group if group is not None else []
        self._group.append(self)

    def send_nowait(self, frames: list[bytes]) -> zmq.ZMQError | None:
        """Send one message without blocking; the error (EAGAIN: queue full, EHOSTUNREACH: unknown peer) is
        returned, not raised."""
        self._sent = True
        sock, last = self._sync, len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                _send(sock, frame, _NOBLOCK if i == last else _MORE_NOBLOCK)
        except zmq.ZMQError as exc:
            return exc  # the first frame failed (later ones cannot: a multipart message is queued whole)
        return None

    def wake(self) -> None:
        """After sending on this socket: a message that arrived meanwhile may have consumed the descriptor's edge."""
        self._sent = False
        if self._sync.getsockopt(_EVENTS) & _POLLIN:
            self._readable.set()


    async def receive_forever(self, handle: Callable[..., None], *, cap: int = FRAME_CAP, burst: int = RECV_BURST,
                              with_user: bool = False) -> None:
        """`handle(frames, n_frames)` per message (`handle(frames, n_frames, user_id)` with `with_user`), the
        frames kept at most `cap`; yields to the event loop every `burst` messages and whenever the socket is
        empty, so heartbeats, timers and the health port keep time under any input rate."""
        loop = asyncio.get_running_loop()
        fd = self._sync.getsockopt(zmq.FD)
        loop.add_reader(fd, self._readable.set)
        try:
            while True:
                drained = self._drain(handle, cap, burst, with_user)
                wake_sent(self._group)
                if drained == burst:
                    await asyncio.sleep(0)
                    continue
                self._readable.clear()
                if self._sync.getsockopt(_EVENTS) & _POLLIN:  # reading EVENTS re-arms the descriptor
                    continue
                await self._readable.wait()
        finally:
            loop.remove_reader(fd)

    def _drain(self, handle: Callable[..., None], cap: int, burst: int, with_user: bool) -> int:
        sock = self._sync
        for n in range(burst):
            try:
                first = _recv(sock, _NOBLOCK, False)
            except zmq.Again:
                return n
            frames, n_frames, part = [first.bytes], 1, first
            while part.more:  # the rest of a message is queued with its first frame
                part = _recv(sock, _NOBLOCK, False)
                n_frames += 1
                if n_frames <= cap:  # frames past the cap are read and dropped, never copied
                    frames.append(part.bytes)
            if with_user:
                handle(frames, n_frames, _user_id(first))
            else:
                handle(frames, n_frames)
        return burst


def wake_sent(group: list[Pump]) -> None:
    """After a batch of sends: every socket of the group that was sent on re-checks for input."""
    for pump in group:
        if pump._sent:
            pump.wake()


def _user_id(frame: zmq.Frame) -> str | None:
    """The peer's authenticated User-Id (the z85 CURVE key the ZAP handler accepted); None without CURVE."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None
