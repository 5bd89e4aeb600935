"""The edge's HTTP API and the health ports under hostile clients, with real processes on 127.0.0.1: `specrelay
broker` + `specrelay cloud-worker` (tiny target, context 512) + `specrelay edge-worker --http --api-key K1
--api-key K2 --max-concurrent-requests 2` (tiny draft).

No key -> 401; a 64 MB body -> 413 with the edge's RSS growing far less; 200 connections holding half-sent headers
do not delay a legit request and are closed at the head deadline, a body that stops arriving gets 408; one key cannot take the other's share (429 with
Retry-After); a request past the target's context is a 400 before any work, on HTTP and on the ZeroMQ client; a
chat template's error text never reaches the client; 64 idle connections to each health port leave /healthz
answering in under 1 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from specrelay.bench import httpfuzz
from specrelay.cluster import LocalCluster, free_port
from specrelay.edge_worker.http.guards import FairShare, HttpLimits, load_api_keys

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-target"
KEYS = ("key-one", "key-two")
CONTEXT = 512  # tests/tiny.py: the tiny target's max_position_embeddings
READ_TIMEOUT = 3  # --http-read-timeout: a request head within 3 s, its body within 9 s
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('SECRET template "
                 "detail') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    """dict: base (HTTP url), edge (Popen), listen (ZeroMQ client endpoint), health ports of the three roles."""
    target, draft = tiny_pair
    tok_dir = tmp_path_factory.mktemp("target-tok")  # the target's tokenizer and config (its context), no weights
    for f in target.glob("*.json"):
        shutil.copy(f, tok_dir / f.name)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    key_file = tok_dir / "api-keys"
    key_file.write_text(f"# the second key\n{KEYS[1]}\n")
    http_port, edge_health, listen = free_port(), free_port(), f"tcp://127.0.0.1:{free_port()}"
    log_path = tok_dir / "edge.log"
    with LocalCluster(str(target), threads=1) as cluster, open(log_path, "wb") as edge_log:
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", str(draft), "--target-tokenizer", str(tok_dir), "--listen", listen,
                                 "--http", f"127.0.0.1:{http_port}", "--served-model-name", MODEL,
                                 "--api-key", KEYS[0], "--api-key-file", str(key_file),
                                 "--max-concurrent-requests", "2", "--http-read-timeout", str(READ_TIMEOUT),
                                 "--health-port", str(edge_health)],
                                env=dict(os.environ, SPECRELAY_THREADS="1", OMP_NUM_THREADS="1"),
                                stdout=edge_log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{http_port}"
            httpfuzz.wait_http(base + "/health", edge, log=log_path)
            yield {"base": base, "port": http_port, "edge": edge, "listen": listen, "log": log_path,
                   "health": {"broker": cluster.broker_health_port, "cloud worker": cluster.health_ports[0],
                              "edge": edge_health}}
        finally:
            edge.terminate()
            assert edge.wait(timeout=30) == 0


def post(base: str, path: str, body: dict, key: str | None = KEYS[0], timeout: float = 60) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one POST."""
    return httpfuzz.post(base, path, body, key, timeout)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


# ------------------------------------------------------------------------------------------ keys

@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_no_or_wrong_api_key_is_a_401_error_object(stack, key):
    status, body, _ = post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    request = urllib.request.Request(stack["base"] + "/v1/models",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401


@pytest.mark.parametrize("key", KEYS)  # from --api-key and from --api-key-file
def test_each_configured_key_is_served(stack, key):
    status, body, headers = post(stack["base"], "/v1/completions",
                                 {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}, key)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert headers["x-request-id"].startswith("req-")


# ------------------------------------------------------------------------------------------ bodies, slow clients

@pytest.mark.parametrize("chunked", [False, True])
def test_a_64_mb_body_is_refused_without_being_read_whole(stack, chunked):
    pid = stack["edge"].pid
    before = httpfuzz.rss_kib(pid)
    answer = httpfuzz.send_large_body(stack["port"], 64 << 20, chunked, KEYS[0])
    grown_mib = (httpfuzz.rss_kib(pid) - before) / 1024
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert grown_mib < 32, f"the edge grew {grown_mib:.0f} MiB reading a 64 MiB body"
    assert stack["edge"].poll() is None


def test_many_large_bodies_at_once_are_bounded_together(stack):
    """Ten bodies within the 8 MiB limit, held open, 71 MiB together: one is read at a time (LARGE_BODY_BYTES), the
    others wait unread, each gets 408 when its time is up (or 429 past the 64 MiB budget of bodies being read; the
    one sent whole, first, not JSON: a 400), and the edge's RSS grows by less than that budget. (Sent last, the
    whole one would wait its turn behind nine half-sent ones and could time out with them: one large body is read
    at a time.)"""
    pid, chunk = stack["edge"].pid, b"x" * (1 << 20)
    before = httpfuzz.rss_kib(pid)
    socks = []
    for mib in [8] + [7] * 9:
        sock = socket.create_connection(("127.0.0.1", stack["port"]), timeout=60)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {8 << 20}\r\n\r\n".encode())
        try:
            sock.sendall(chunk * mib)
        except OSError:  # refused and closed while it was sending
            pass
        socks.append(sock)
    try:
        answers = [httpfuzz.first_line(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert answers[0].split()[1:2] in (["429"], ["400"]), answers[0]  # the complete one: not JSON
    assert all(a.split()[1:2] in (["429"], ["408"]) or a == "" for a in answers[1:]), sorted(set(answers))
    assert (httpfuzz.rss_kib(pid) - before) / 1024 < 96
    assert post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200


def test_a_large_body_is_refused_while_another_is_read_and_small_requests_go_on(stack):
    """Bodies past LARGE_BODY_BYTES are read one at a time (before: 8 bodies of 7.5 MB were read and decoded at
    once on the event loop, a legit request beside them 2.5-3x slower): while the first is held half sent, a small
    request is served, a second large one is dropped unparsed and answered 429 at once (counted; before, one waited
    its turn and 8 at once cost a legit request twice as much), its connection closed; once the first is gone the
    next large one is read in its turn and its prompt refused."""
    def large(declared: int, sent: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", stack["port"]), timeout=60)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)
        return sock

    def read_all(sock: socket.socket) -> bytes:
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):  # to the end: the server closes the connection after its answer
            answer += chunk
        return answer

    refused = lambda: metric(stack["health"]["edge"], "specrelay_edge_http_large_body_refusals_total")  # noqa: E731
    before = refused()
    first = large(4 << 20, b"x" * (2 << 20))  # past 1 MiB, held half sent: it holds the large bodies' turn
    body = json.dumps({"model": MODEL, "prompt": "y" * ((2 << 20) - 40)}).encode()
    try:
        time.sleep(0.3)  # the first's head parsed and its turn taken
        assert post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200
        second = large(len(body), body)
        try:
            answer = read_all(second)
        finally:
            second.close()
        assert answer.startswith(b"HTTP/1.1 429") and b"connection: close" in answer.lower(), answer[:300]
        assert refused() == before + 1
        first.close()
        time.sleep(0.3)  # the first's turn ends with its connection
        third = large(len(body), body)
        try:
            answer = read_all(third)  # its prompt, read in its turn and refused
        finally:
            third.close()
        assert answer.startswith(b"HTTP/1.1 400") and b'"param":"prompt"' in answer.replace(b" ", b""), answer[:300]
        assert refused() == before + 1
    finally:
        first.close()


def test_a_large_valid_body_is_served_as_if_small(stack):
    """A body past LARGE_BODY_BYTES takes the large bodies' turn (read and decoded under it), in pieces of whatever
    size the socket gives: a valid request padded past 1 MiB is served as if small."""
    body = json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": 2, "temperature": 0}).encode()
    padded = body[:-1] + b" " * ((1 << 20) + 12345) + b"}"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(padded)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", stack["port"]), timeout=30) as sock:
        sock.sendall(head + padded[:1000])
        time.sleep(0.3)  # the head parsed and a first piece through h11, the rest in pieces
        for i in range(1000, len(padded), 300_001):
            sock.sendall(padded[i:i + 300_001])
        reply = sock.makefile("rb")
        status, length = reply.readline(), 0
        while (line := reply.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        answer = json.loads(reply.read(length))
    small = post(stack["base"], "/v1/completions", json.loads(body))
    assert status.startswith(b"HTTP/1.1 200"), (status, answer)
    assert answer["choices"][0]["text"] == small[1]["choices"][0]["text"]


def test_half_sent_headers_neither_delay_a_request_nor_stay_open(stack):
    slow = httpfuzz.half_sent_heads(stack["port"], 200)
    try:
        t0 = time.monotonic()
        status, _, _ = post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                            timeout=10)
        assert status == 200 and time.monotonic() - t0 < 10
        assert all(httpfuzz.closed_by_peer(sock) for sock in slow)  # at the head deadline
    finally:
        for sock in slow:
            sock.close()
    assert metric(stack["health"]["edge"], "specrelay_edge_http_timeouts_total") >= 200


def test_more_idle_connections_than_the_cap_leave_room_for_a_request(stack):
    """600 idle connections (the cap is 512): a legit request is answered; every idle one is closed, by the cap
    (oldest first) or by the head deadline."""
    idle = [socket.create_connection(("127.0.0.1", stack["port"]), timeout=30) for _ in range(600)]
    try:
        status, _, _ = post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                            timeout=10)
        assert status == 200
        assert all(httpfuzz.closed_by_peer(sock) for sock in idle)
    finally:
        for sock in idle:
            sock.close()


def test_a_body_that_stops_arriving_is_a_408(stack):
    with socket.create_connection(("127.0.0.1", stack["port"]), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ".encode())
        t0 = time.monotonic()
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 3 * READ_TIMEOUT - 1 < time.monotonic() - t0 < 60


# ------------------------------------------------------------------------------------------ fair share

def test_one_key_cannot_take_the_other_keys_share(stack):
    """--max-concurrent-requests 2 with two keys: one generation in flight per key."""
    long = {"model": MODEL, "prompt": "a b c", "max_tokens": 400, "temperature": 0, "stream": True}
    request = urllib.request.Request(stack["base"] + "/v1/completions", json.dumps(long).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[0]}"})
    with urllib.request.urlopen(request, timeout=60) as held:
        held.readline()  # the stream has started: key one holds its share
        assert held.headers["x-request-id"].startswith("req-")
        status, body, headers = post(stack["base"], "/v1/completions",
                                     {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 429 and body["error"]["type"] == "rate_limit_error" and headers["retry-after"] == "1"
        status, _, _ = post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2},
                            KEYS[1])
        assert status == 200
    deadline = time.monotonic() + 60  # the held stream was left early: its share comes back
    while metric(stack["health"]["edge"], "specrelay_edge_http_in_flight") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200


def test_fair_share_unit():
    share = FairShare(HttpLimits(api_keys=("a", "b"), max_concurrent=4, max_prompt_tokens=100))
    tickets = [share.admit("a", 10), share.admit("a", 10)]
    with pytest.raises(Exception) as refused:
        share.admit("a", 1)
    assert refused.value.status == 429
    big = share.admit("b", 50)  # a key's first request may carry up to its whole token share
    with pytest.raises(Exception):
        share.admit("b", 1)
    for ticket in [*tickets, big, big]:  # release is idempotent
        ticket.release()
    assert sum(share.requests.values()) == 0 and sum(share.tokens.values()) == 0


def test_api_keys_from_flags_env_and_file(tmp_path):
    from specrelay import cli, cliargs

    parse = lambda argv, env: cliargs.parse(cli.parser(), ["edge-worker", *argv], env).api_key  # noqa: E731
    assert parse(["--api-key", "a", "--api-key", "b"], {}) == ["a", "b"]
    assert parse([], {"SPECRELAY_API_KEY": "k-env"}) == "k-env"
    assert parse([], {}) is None
    path = tmp_path / "keys"
    path.write_text("# operators\nk-file-1\n\n  k-file-2  \nk-flag\n")
    assert load_api_keys(["k-flag"], str(path)) == ("k-flag", "k-file-1", "k-file-2")
    assert load_api_keys("k-env", None) == ("k-env",)
    with pytest.raises(ValueError):
        HttpLimits(api_keys=(" spaced",))
    from specrelay.common.errors import ConfigError
    with pytest.raises(ConfigError, match="--api-key-file"):  # the CLI's one line, exit 2
        cli.http_limits(cliargs.parse(cli.parser(), ["edge-worker", "--api-key-file", str(tmp_path / "nope")], {}))
    with pytest.raises(ConfigError, match="--api-key"):
        cli.http_limits(cliargs.parse(cli.parser(), ["edge-worker", "--api-key", ""], {}))


# ------------------------------------------------------------------------------------------ context, errors

@pytest.mark.parametrize("stream", [False, True])
def test_past_the_context_is_a_400_before_any_work(stack, stream):
    t0 = time.monotonic()
    status, body, _ = post(stack["base"], "/v1/completions",
                           {"model": MODEL, "prompt": [5], "max_tokens": 5000, "stream": stream})
    assert status == 400 and time.monotonic() - t0 < 2
    message = body["error"]["message"]
    assert body["error"]["param"] == "max_tokens" and "1 tokens" in message and "5000" in message
    assert str(CONTEXT) in message


def test_past_the_context_is_refused_on_the_zeromq_client_too(stack):
    from specrelay.client import Client
    from specrelay.common.errors import InvalidRequest

    async def main() -> None:
        async with Client(stack["listen"], timeout=30) as client:
            with pytest.raises(InvalidRequest, match=str(CONTEXT)):
                await client.generate("x", max_new_tokens=5000)
            assert (await client.generate("x", max_new_tokens=3)).token_ids

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 30


def test_template_errors_are_logged_not_returned(stack):
    status, body, headers = post(stack["base"], "/v1/chat/completions",
                                 {"model": MODEL, "messages": [{"role": "system", "content": "x"}]})
    assert status == 400 and "SECRET" not in json.dumps(body)
    assert headers["x-request-id"].startswith("req-")
    status, body, _ = post(stack["base"], "/v1/chat/completions",  # no max_tokens: up to the context, not 1024
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert status == 200, body


# ------------------------------------------------------------------------------------------ health ports

@pytest.mark.parametrize("role", ["broker", "cloud worker", "edge"])
def test_idle_connections_do_not_starve_the_health_port(stack, role):
    worst = httpfuzz.healthz_under_idle(stack["health"][role], n_idle=64)
    assert worst < 1, f"{role} /healthz took {worst:.2f} s with 64 idle connections held"


# ------------------------------------------------------------------------------------------ bounded before expensive

def test_huge_prompts_are_refused_before_tokenising_beside_a_legit_request(stack):
    """8 prompts of 7.5 MB at once (under the 8 MiB body limit; each took 21 s of tokenising and the 8 took the
    edge from 500 to 5,766 MiB): each a 400 on `prompt` or, while another is read, a 429 (drained, not
    decoded), the edge's RSS grows by far less, a legit request alongside is served."""
    out = httpfuzz.huge_prompts(stack["base"], stack["edge"].pid, n=8, key=KEYS[1], legit_key=KEYS[0], model=MODEL)
    refused = [(status, param) for status, param in zip(out["statuses"], out["params"])]
    assert set(refused) <= {(400, "prompt"), (429, None)} and (400, "prompt") in refused, out
    assert out["rss_growth_mib"] <= 100, out
    assert set(out["legit_statuses"]) == {200} and out["slowest_refusal_s"] < 10, out  # 21 s each before
    assert stack["edge"].poll() is None


def test_a_client_leaving_a_plain_request_logs_no_traceback(stack):
    before = stack["log"].read_bytes().count(b"InvalidStateError")
    body = json.dumps({"model": MODEL, "prompt": "a b c", "max_tokens": 300, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", stack["port"]), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.0)  # the generation is under way
    deadline = time.monotonic() + 60
    while metric(stack["health"]["edge"], "specrelay_edge_http_in_flight") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    assert stack["log"].read_bytes().count(b"InvalidStateError") == before
    assert metric(stack["health"]["edge"], "specrelay_edge_http_disconnects_total") >= 1
    assert post(stack["base"], "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200
