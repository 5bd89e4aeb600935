"""Clients keep their work and processes keep running (issue 18, items 6, 10 and 11, edge and worker side):
ids from a bad worker, the start-up probe against WORKER_LOST, SIGHUP, a refused edge key, exceptions in the
JSON logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import zmq

from specrelay.cluster import free_port
from specrelay.common import protocol as P
from specrelay.common.errors import ErrorCode
from specrelay.common.packing import f32
from specrelay.common.resample import Rejection
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.edge_worker.routing.probe import probe_broker
from specrelay.edge_worker.session import EdgeSession, SessionConfig, WorkerMisbehaved
from specrelay.speculative import next_request
from test_security import keys  # noqa: F401  the fixture

pytestmark = pytest.mark.timeout(120)


def sampled_session(tiny_runners, strategy: str = "srdv") -> EdgeSession:
    target, draft = tiny_runners
    config = SessionConfig(max_new_tokens=8, params=SamplingParams(1.0), mode="sample", seed=1, draft_len=2,
                           resample=strategy)
    return EdgeSession(target.tokenizer("def f():").input_ids, config, Drafter(draft, target.vocab_size), sid=4)


@pytest.mark.parametrize("reply", ["next_token", "candidates", "resampled"])
def test_ids_a_worker_sends_outside_the_vocabulary_are_a_retryable_error(tiny_runners, reply):
    """A worker-sent id must index the target vocabulary (on a CUDA edge, q'[id] out of range is a device fault
    that kills the process): a retryable error, the session re-OPENs, nothing is committed."""
    target, _ = tiny_runners
    v = target.vocab_size
    session = sampled_session(tiny_runners)
    request = next_request(session)
    if reply == "next_token":
        bad = P.Verdict(4, request.seq, 0, v + 3)
    else:
        bad = P.Verdict(4, request.seq, 0, -1, candidates=[1, v], cand_p=f32(torch.ones(2) / 2))
    if reply == "resampled":  # a rejection pending on the edge, then a RESAMPLED with a bad token
        session._rejection = Rejection(torch.zeros(v), None, 1, 5, request.seq, 4, P.Strategy.SRDV)
        bad = P.Resampled(4, request.seq, token=v + 1)
    with pytest.raises(WorkerMisbehaved, match="outside the target vocabulary") as info:
        session.apply(bad)
    assert info.value.retryable and info.value.code == ErrorCode.INTERNAL
    assert session.generated == []


@pytest.mark.parametrize("mode", ["greedy", "sample-all-accepted"])
def test_no_next_token_outside_a_sample_rejection_is_a_retryable_error(tiny_runners, mode):
    """A VERDICT with next_token = -1 where no q' row can finish the draw (greedy, or every draft token accepted)
    raised IndexError before (not retried): now the retryable WorkerMisbehaved, nothing committed."""
    target, draft = tiny_runners
    if mode == "greedy":
        config = SessionConfig(max_new_tokens=8, draft_len=2)
        session = EdgeSession(target.tokenizer("def f():").input_ids, config, Drafter(draft, target.vocab_size),
                              sid=4)
    else:
        session = sampled_session(tiny_runners)
    request = next_request(session)
    n = 0 if mode == "greedy" else len(session._block.ids)
    with pytest.raises(WorkerMisbehaved, match="no next token") as info:
        session.apply(P.Verdict(4, request.seq, n, -1))
    assert info.value.retryable and session.generated == []


async def test_the_start_up_probe_retries_worker_lost(zctx):
    """The broker answers WORKER_LOST while the worker it picked goes away; the probe asks again (before the fix it
    gave up at once: `specrelay generate` failed although a worker was back within its budget)."""
    router = zctx.socket(zmq.ROUTER)
    router.linger = 0
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"

    async def broker() -> None:
        lost = 2
        while True:
            peer, *frames = await router.recv_multipart()
            msg = P.decode(frames)
            if isinstance(msg, P.Verify):
                reply = P.Error(msg.session, msg.seq, ErrorCode.WORKER_LOST, "the worker was lost") if lost else \
                    P.Verdict(msg.session, msg.seq, 0, 5)
                lost -= lost > 0
                await router.send_multipart([peer, *P.encode(reply)])

    task = asyncio.create_task(broker())
    try:
        await probe_broker(endpoint, 10.0, context=zctx)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(linger=0)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specrelay.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def healthy(port: int, proc: subprocess.Popen, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            time.sleep(0.2)
    return False


def stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.communicate(timeout=20)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


def test_edge_and_cloud_worker_survive_sighup(tiny_pair):
    target, draft = tiny_pair
    broker = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: both keep retrying, which is all this needs
    ports = free_port(), free_port()
    procs = [spawn("cloud-worker", "--broker", broker, "--model", str(target), "--health-port", str(ports[0])),
             spawn("edge-worker", "--broker", broker, "--draft-model", str(draft), "--listen",
                   f"tcp://127.0.0.1:{free_port()}", "--health-port", str(ports[1]))]
    try:
        assert all(healthy(port, proc) for port, proc in zip(ports, procs)), [p.poll() for p in procs]
        for proc in procs:
            proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)  # SIGHUP's default action would have ended them by now
        assert [proc.poll() for proc in procs] == [None, None]
        assert all(healthy(port, proc, 10) for port, proc in zip(ports, procs))
    finally:
        for proc in procs:
            stop(proc)


def test_an_edge_whose_key_the_broker_refuses_exits_with_one_line(keys, tiny_pair):  # noqa: F811
    """Before: it stayed up, /readyz 200, then 503 to every request. Now it stops: exit 1, one line."""
    secrets, edges, workers = keys
    frontend, backend = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    broker = spawn("broker", "--frontend", frontend, "--backend", backend, "--curve-secret",
                   str(secrets / "broker.key_secret"), "--edge-keys", str(edges), "--worker-keys", str(workers))
    try:
        edge = spawn("--log-level", "error", "edge-worker", "--broker", frontend, "--draft-model",
                     str(tiny_pair[1]), "--listen", f"tcp://127.0.0.1:{free_port()}", "--curve-secret",
                     str(secrets / "rogue.key_secret"), "--broker-key", str(secrets / "broker.key"))
        try:
            code = edge.wait(90)
        finally:
            err = stop(edge)
    finally:
        stop(broker)
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert code == 1 and len(lines) == 1 and "authentication failed" in lines[0], (code, err)


def test_json_logs_carry_the_exception_and_its_traceback():
    code = ("import structlog; from specrelay import logs; logs.configure('info')\n"
            "try:\n    {}['missing']\nexcept KeyError as exc:\n"
            "    structlog.get_logger('t').error('request failed', exc_info=exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    line = json.loads(out.stderr.strip().splitlines()[-1])
    (exc,) = line["exception"]
    assert exc["exc_type"] == "KeyError" and "missing" in exc["exc_value"] and exc["frames"]
    assert "locals" not in exc["frames"][0]  # frame locals can hold keys and prompts
    assert "exc_info" not in line
