"""`specrelay bench httpfuzz`: the edge's HTTP API and the health ports under hostile clients (issue 18, items 3, 4,
5, 8), real processes on 127.0.0.1: broker + cloud worker + `edge-worker --http --api-key`.

Measures: the status without a key; a 64 MiB body (declared and chunked): the answer and the edge's RSS growth;
200 connections holding half-sent headers, then a legit request: its latency, and when the half-sent ones are
closed; 1,000 idle connections, then a legit request; a 1-token prompt with max_tokens 5000: status and seconds;
/healthz of each role with 64 idle connections held to it. Prints the numbers, writes OUT/httpfuzz.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .runs import DEFAULT_OUT, DEMO_DRAFT, DEMO_TARGET, HelpFormatter, meta, write_result

KEY = "bench-key"
MODEL = "specrelay"


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120, log: Path | None = None) -> None:
    """Until `url` answers (any status); fails if `proc` exits first (saying the last lines of its `log`, the file
    its output goes to) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(errors="replace").splitlines()[-5:] if log and log.exists() else []
            raise RuntimeError(f"the server exited with {proc.returncode}" + "".join("\n  " + s for s in said))
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def post(base: str, path: str, body: dict | bytes, key: str | None = KEY,
         timeout: float = 60) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one POST (`body`: an object, or its JSON already encoded)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(base + path, body if isinstance(body, bytes) else json.dumps(body).encode(),
                                     headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def send_large_body(port: int, total: int, chunked: bool, key: str = KEY) -> bytes:
    """Send up to `total` bytes of body (1 MiB at a time) until the edge answers or closes; its answer (b"" when
    it closed without one)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\n")
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {total}\r\n\r\n"
    chunk = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for _ in range(total // len(chunk)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        except OSError:  # the edge closed the connection: it read no more than it had to
            pass
        try:
            return sock.recv(65536)
        except OSError:
            return b""


def half_sent_heads(port: int, n: int) -> list[socket.socket]:
    """n connections that send the start of a request head and never finish it (slowloris)."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(sock)
    return socks


def first_line(sock: socket.socket) -> str:
    """The status line the server answers on `sock` ("" when it closed without one)."""
    try:
        return sock.recv(65536).split(b"\r\n", 1)[0].decode()
    except OSError:
        return ""


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (EOF or a reset) before the socket's own timeout."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except OSError:  # the timeout
        return False


def seconds_until_closed(socks: list[socket.socket]) -> float:
    t0 = time.monotonic()
    for sock in socks:
        closed_by_peer(sock)
    return time.monotonic() - t0


def timed_request(base: str, key: str = KEY, model: str = MODEL, **body) -> tuple[int, float]:
    t0 = time.monotonic()
    status, _, _ = post(base, "/v1/completions", {"model": model, "prompt": "def add(a, b):", "max_tokens": 8,
                                                  "temperature": 0} | body, key, timeout=60)
    return status, time.monotonic() - t0


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_lag(base: str, stop) -> list[float]:
    """Seconds each GET /health took, one after another until `stop` is set: the edge's event loop answers it
    at once, so the slowest is how long the loop was busy with something else."""
    lags = []
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(base + "/health", timeout=30).read()
        except OSError:
            pass
        lags.append(time.monotonic() - t0)
        stop.wait(0.01)
    return lags


def _legit_beside(base: str, key: str, model: str, stop, out, at_least: int = 1) -> None:
    """In a child process (so the senders' threads cannot delay it): legit requests one after another (at least
    `at_least`, then until `stop` is set) and the event loop's stall (loop_lag) polled beside them; puts
    (statuses, seconds, longest stall)."""
    import threading

    stalls: list[float] = []
    done = threading.Event()
    poller = threading.Thread(target=lambda: stalls.extend(loop_lag(base, done)))
    poller.start()
    answers = [timed_request(base, key, model) for _ in range(at_least)]
    while not stop.is_set():
        answers.append(timed_request(base, key, model))
    done.set()
    poller.join()
    out.put(([a[0] for a in answers], [a[1] for a in answers], max(stalls, default=0.0)))


def legit_at_rest(base: str, key: str = KEY, model: str = MODEL, n: int = 5) -> float:
    """The median of n legit requests made as under attack (the same child process, /health polled beside)."""
    import multiprocessing
    import statistics

    ctx = multiprocessing.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    stop.set()
    child = ctx.Process(target=_legit_beside, args=(base, key, model, stop, results, n))
    child.start()
    _, seconds, _ = results.get(timeout=120)
    child.join()
    return round(statistics.median(seconds), 3)


def huge_prompts(base: str, edge_pid: int, n: int = 8, key: str = KEY, legit_key: str = KEY,
                 model: str = MODEL, sender_cpus: tuple[int, ...] = ()) -> dict:
    """n prompts of 7.5 MB at once (each under the 8 MiB body limit, past protocol.MAX_PROMPT_CHARS) beside legit
    requests (one after another until every huge one is answered, from another process): their statuses and
    refused params, the slowest refusal, the edge's peak RSS growth (sampled every 20 ms) and CPU seconds, its
    event loop's longest stall (GET /health, polled), the legit requests' statuses and seconds (legit_s: the
    slowest). `sender_cpus`: where the attackers' sending threads run (an attacker is another machine: on the
    edge's own core, its copying of 60 MB into the loopback would be charged to the edge's legit client)."""
    import multiprocessing
    import threading
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps({"model": model, "prompt": "ab " * 2_500_000, "max_tokens": 1}).encode()  # once, before
    before, peak, done = rss_kib(edge_pid), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss_kib(edge_pid))

    def one(_) -> tuple[int, str | None, float, float]:
        if sender_cpus:
            os.sched_setaffinity(threading.get_native_id(), sender_cpus)
        t0, cpu = time.monotonic(), time.thread_time()
        status, answer, _ = post(base, "/v1/completions", body, key, timeout=300)
        return status, answer.get("error", {}).get("param"), time.monotonic() - t0, time.thread_time() - cpu

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cpu0 = cpu_s(edge_pid)
    ctx = multiprocessing.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_legit_beside, args=(base, legit_key, model, stop, results))
    child.start()
    try:
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(one, range(n)))
    finally:
        stop.set()
        done.set()
    legit_statuses, legit_s, lag = results.get(timeout=120)
    child.join()
    sampler.join()
    return {"statuses": [a[0] for a in answers], "params": [a[1] for a in answers],
            "slowest_refusal_s": round(max(a[2] for a in answers), 3),
            "rss_growth_mib": round((max(peak[0], rss_kib(edge_pid)) - before) / 1024, 1),
            "edge_cpu_s": round(cpu_s(edge_pid) - cpu0, 2), "loop_stall_max_s": round(lag, 3),
            "senders_cpu_s": round(sum(a[3] for a in answers), 2),  # on sender_cpus (the cloud's, when pinned)
            "legit_statuses": legit_statuses, "legit_s": round(max(legit_s), 3),
            "legit_each_s": [round(t, 3) for t in legit_s]}


def huge_only(base: str, edge_pid: int, sender_cpus: tuple[int, ...] = (), bursts: int = 5) -> dict:
    """`--only huge`: the legit request at rest (median of 5, made and polled as under attack), then `bursts`
    attacks of huge_prompts one after another, then at rest again. legit_vs_rest compares like with like: the
    median burst's slowest legit request over the median at rest; legit_vs_rest_each: every burst's own ratio (one
    legit request, one sample, carries the at-rest latency's own +-25 % spread)."""
    import statistics

    rest = legit_at_rest(base)
    runs = [huge_prompts(base, edge_pid, sender_cpus=sender_cpus) for _ in range(bursts)]
    each = [round(r["legit_s"] / max(rest, 1e-9), 2) for r in runs]
    return {"at_rest_s": rest, "at_rest_after_s": legit_at_rest(base),
            "legit_vs_rest": round(statistics.median(r["legit_s"] for r in runs) / max(rest, 1e-9), 2),
            "legit_vs_rest_each": each, "within_2x": sum(r <= 2 for r in each), "bursts": bursts,
            "slowest_refusal_s": max(r["slowest_refusal_s"] for r in runs),
            "rss_growth_mib": max(r["rss_growth_mib"] for r in runs),
            "statuses": sorted({(s, p) for r in runs for s, p in zip(r["statuses"], r["params"])}, key=str),
            "huge_prompts_8": runs, "loadavg": os.getloadavg()}


def healthz_under_idle(port: int, n_idle: int = 64) -> float:
    """The slowest of 3 /healthz answers with n_idle connections held open (inf when none came)."""
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n_idle)]
    worst = 0.0
    try:
        for _ in range(3):
            t0 = time.monotonic()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).read()
            except OSError:
                return float("inf")
            worst = max(worst, time.monotonic() - t0)
    finally:
        for sock in idle:
            sock.close()
    return worst


def attack(base: str, port: int, edge_pid: int, health: dict[str, int], sender_cpus: tuple[int, ...] = ()) -> dict:
    out: dict = {"no_key_status": post(base, "/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)[0]}
    out["at_rest"] = timed_request(base)
    for chunked in (False, True):
        before = rss_kib(edge_pid)
        answer = send_large_body(port, 64 << 20, chunked)
        out[f"body_64mib_{'chunked' if chunked else 'declared'}"] = {
            "answer": answer.split(b"\r\n", 1)[0].decode() or "connection closed",
            "rss_growth_mib": round((rss_kib(edge_pid) - before) / 1024, 1)}
    slow = half_sent_heads(port, 200)
    out["slowloris_200"] = {"legit": timed_request(base), "closed_after_s": round(seconds_until_closed(slow), 1)}
    for sock in slow:
        sock.close()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(1000)]
    out["idle_1000_legit"] = timed_request(base)
    for sock in idle:
        sock.close()
    t0 = time.monotonic()
    status, body, _ = post(base, "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 5000})
    out["past_context"] = {"status": status, "seconds": round(time.monotonic() - t0, 3),
                           "message": body.get("error", {}).get("message")}
    out["huge_prompts_8"] = huge_prompts(base, edge_pid, sender_cpus=sender_cpus)
    out["at_rest_after"] = timed_request(base)
    out["healthz_64_idle_s"] = {role: round(healthz_under_idle(p), 3) for role, p in health.items()}
    return out


def run(args) -> dict:
    from ..cluster import LocalCluster, free_port

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this program holds 1,000 sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    http_port, edge_health = free_port(), free_port()
    with LocalCluster(args.target, threads=args.threads) as cluster:
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", args.draft, "--target-tokenizer", args.target,
                                 "--listen", f"tcp://127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{http_port}",
                                 "--api-key", KEY, "--health-port", str(edge_health)],
                                env=dict(os.environ, SPECRELAY_THREADS=str(args.threads)))
        try:
            base = f"http://127.0.0.1:{http_port}"
            wait_http(base + "/health", edge, timeout=300)
            health = {"broker": cluster.broker_health_port, "cloud_worker": cluster.health_ports[0],
                      "edge": edge_health}
            senders = cluster.placement.cloud_cpus if cluster.placement.pinned else ()  # not the edge's core
            run_attack = (lambda b, pid: huge_only(b, pid, senders, args.bursts)) if args.only == "huge" else \
                lambda b, pid: attack(b, http_port, pid, health, senders)
            return run_attack(base, edge.pid) | {"edge_alive": edge.poll() is None}
        finally:
            edge.terminate()
            edge.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench httpfuzz", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--target", default=DEMO_TARGET, help="target model (its config gives the edge the context)")
    ap.add_argument("--draft", default=DEMO_DRAFT)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("huge",), help="huge: only the 8 huge prompts beside a legit request")
    ap.add_argument("--bursts", type=int, default=5, help="--only huge: attacks one after another, each beside a "
                    "legit request")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    result = {"meta": meta(["httpfuzz", *(argv or [])]), "results": run(args)}
    print(json.dumps(result["results"], indent=1))
    write_result(Path(args.out), "httpfuzz", result)
    return 0
