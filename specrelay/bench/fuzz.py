"""`specrelay bench fuzz`: legit greedy sessions through a broker and a cloud worker (real processes) while attacker
processes send malformed and valid-but-abusive traffic; prints and writes JSON.

    python -m specrelay.bench.fuzz [--malformed 100000] [--abusive 10000] [--attackers 2] [--cpus 0]
    python -m specrelay.bench.fuzz --attack squat        # routing-id squatting on every ROUTER
    python -m specrelay.bench.fuzz --attack multipart [--frames 120] [--frame-mib 1]

Measured, against a no-attack run of the same sessions: legit latency per committed chunk (p50/p99, and the
ratio of the p99s), outputs identical to target-alone greedy, the longest /healthz answer of the broker during
the attack (polled every 50 ms), workers the broker declared lost, processes alive at the end, and the broker's
counters (bad requests, quota refusals, ...). --cpus pins the system (broker, worker and the legit edge) to
those cores and the attackers to the others, so an attack costs the system only what it makes it do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
import urllib.request

from .runs import HelpFormatter, load_prompts, write_result



def attacker(frontend: str, n_malformed: int, n_abusive: int, seed: int, vocab: int, cpus: set[int]) -> None:
    """A separate process (on `cpus`, not the system's): raw ZeroMQ, as fast as the socket takes it."""
    import zmq

    if cpus:
        os.sched_setaffinity(0, cpus)
    from .attacks import Fuzzer

    fuzz = Fuzzer(seed, vocab)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(frontend)
    kinds = [True] * n_malformed + [False] * n_abusive
    fuzz.rng.shuffle(kinds)
    for malformed in kinds:
        frames = fuzz.malformed() if malformed else fuzz.abusive()
        sock.send_multipart(frames)  # blocks when the pipe is full: the broker sets the pace
        while sock.poll(0, zmq.POLLIN):
            sock.recv_multipart()  # drop the broker's answers
    time.sleep(0.5)
    sock.close()
    ctx.term()


class HealthWatch:
    """Polls GET /healthz every 50 ms in a thread; records the longest answer (a timeout counts as its length)."""

    def __init__(self, port: int) -> None:
        self.url, self.worst, self.failures = f"http://127.0.0.1:{port}/healthz", 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    ok = r.status == 200
            except OSError:
                ok = False
            self.worst = max(self.worst, time.monotonic() - t0)
            self.failures += not ok
            self._stop.wait(0.05)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def legit(frontend: str, draft: str, prompts: list[str], max_new: int, timing: dict | None = None,
                draft_len: int | None = None) -> tuple[list[list[int]], list[float]]:
    """Greedy generations of every prompt at once (`draft_len` None: the edge's policy); returns the outputs and
    the gaps between committed chunks. `timing`, if given, gets the edge's mean VERIFY -> VERDICT seconds and
    draft tokens per VERIFY."""
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.server import load_edge

    gaps: list[float] = []
    async with await load_edge(frontend, draft) as edge:
        async def one(prompt: str) -> list[int]:
            last = time.monotonic()

            def tick(_new) -> None:
                nonlocal last
                now = time.monotonic()
                gaps.append(now - last)
                last = now

            ids, _ = await edge.generate(edge.tokenizer(prompt).input_ids, SessionConfig(max_new, draft_len=draft_len),
                                        tick)
            return ids

        outs = await asyncio.gather(*(one(p) for p in prompts))
        if timing is not None:
            m = edge.metrics
            rounds = max(sum(m.verify_latency_seconds.counts), 1)
            timing.update(verify_latency_s=round(m.verify_latency_seconds.total / rounds, 4),
                          draft_len=round(m.draft_len.total / rounds, 2), rounds=rounds)
    return outs, gaps


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values or [0.0])[0]


def run(args) -> dict:
    from ..cluster import LocalCluster
    from ..common.runner import ModelRunner
    from ..speculative import target_generate

    prompts = load_prompts(args.prompts, args.sessions)
    target = ModelRunner.load(args.target)
    refs = [target_generate(target, target.tokenizer(p).input_ids, args.max_new_tokens) for p in prompts]
    pin = ("taskset", "-c", args.cpus) if args.cpus else ()
    system = {int(c) for c in args.cpus.split(",")} if args.cpus else set()
    attack_cpus = set(range(os.cpu_count() or 1)) - system if system else set()
    if system:
        os.sched_setaffinity(0, system)  # the legit edge runs here, on the system's cores too
    with LocalCluster(args.target, threads=1, launcher=pin) as cluster:
        base_outs, base_gaps = asyncio.run(legit(cluster.frontend, args.draft, prompts, args.max_new_tokens))
        lost_before = cluster.metrics(cluster.broker_health_port)["specrelay_broker_workers_lost_total"]
        procs = [multiprocessing.Process(target=attacker, args=(cluster.frontend, args.malformed // args.attackers,
                                                                args.abusive // args.attackers, seed,
                                                                target.vocab_size, attack_cpus))
                 for seed in range(args.attackers)]
        with HealthWatch(cluster.broker_health_port) as watch:
            t0 = time.monotonic()
            for p in procs:
                p.start()
            outs, gaps = asyncio.run(legit(cluster.frontend, args.draft, prompts, args.max_new_tokens))
            for p in procs:
                p.join()
            attack_s = time.monotonic() - t0
        metrics = cluster.metrics(cluster.broker_health_port)
        alive = all(proc.poll() is None for proc in cluster.procs)
    base_p99, p99 = pct(base_gaps, 99), pct(gaps, 99)
    return {
        "malformed_sent": args.malformed, "abusive_sent": args.abusive, "attack_wall_s": round(attack_s, 1),
        "cpus": args.cpus or "all", "sessions": len(prompts), "max_new_tokens": args.max_new_tokens,
        "outputs_identical_to_target_alone": outs == refs and base_outs == refs,
        "legit_chunk_latency_ms": {"no_attack_p50": round(1000 * pct(base_gaps, 50), 2),
                                   "no_attack_p99": round(1000 * base_p99, 2),
                                   "attack_p50": round(1000 * pct(gaps, 50), 2), "attack_p99": round(1000 * p99, 2)},
        "p99_ratio": round(p99 / base_p99, 2) if base_p99 else None,
        "healthz_worst_s": round(watch.worst, 3), "healthz_failures": watch.failures,
        "workers_falsely_lost": int(metrics["specrelay_broker_workers_lost_total"] - lost_before),
        "processes_alive": alive,
        "broker": {k.removeprefix("specrelay_broker_"): v for k, v in metrics.items()
                   if k.startswith("specrelay_broker_") and not k.endswith(("_created", "loop_lag_s"))},
    }


def run_squat(args) -> dict:
    """Squat the predicted routing ids (32) + 5 anonymous connections on the broker's frontend and backend and
    on `edge-worker --listen`, then one greedy generation through the edge; every process must survive."""
    from ..client import Client
    from ..cluster import LocalCluster, free_port
    from ..common.runner import ModelRunner
    from .fuzz import end_squat, predicted_routing_ids, squat
    from ..speculative import target_generate

    prompt = load_prompts(args.prompts, 1)[0]
    target = ModelRunner.load(args.target)
    ref = target_generate(target, target.tokenizer(prompt).input_ids, args.max_new_tokens)
    with LocalCluster(args.target, threads=1) as cluster:
        listen = f"tcp://127.0.0.1:{free_port()}"
        cluster._spawn("edge-worker", "--broker", cluster.frontend, "--draft-model", args.draft, "--listen", listen)

        async def generate() -> list[int]:
            async with Client(listen, timeout=300) as client:
                return (await client.generate(prompt, max_new_tokens=args.max_new_tokens)).token_ids

        asyncio.run(generate())
        survived, squats = {}, []
        for name, endpoint in (("broker_frontend", cluster.frontend), ("broker_backend", cluster.backend),
                               ("edge_listen", listen)):
            try:
                squats.append(squat(endpoint, predicted_routing_ids(32), anonymous=5))
            except (TimeoutError, ConnectionRefusedError):
                pass
            survived[name] = all(p.poll() is None for p in cluster.procs)
        out = asyncio.run(generate()) if all(survived.values()) else None
        for squatted in squats:
            end_squat(squatted)
    return {"attack": "squat", "squatted_ids": 32, "anonymous_connections": 5, "processes_survived": survived,
            "output_identical_to_target_alone": out == ref}


def run_multipart(args) -> dict:
    """One multipart message of `frames` x `frame_mib` MiB (the sender holds one buffer, zero-copy) at a broker's
    frontend: its peak resident memory growth (VmHWM), without a memory budget and with `--max-rss-mb`."""
    import subprocess

    import zmq

    from ..cluster import free_port

    result = {"attack": "multipart", "frames": args.frames, "frame_mib": args.frame_mib}
    for budget in (0, args.max_rss_mb):
        frontend = f"tcp://127.0.0.1:{free_port()}"
        broker = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "broker", "--frontend", frontend,
                                   "--backend", f"tcp://127.0.0.1:{free_port()}", "--max-rss-mb", str(budget)],
                                  stderr=subprocess.DEVNULL)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(frontend)
        sock.send_multipart([b"\x02\x07", b"\x90"])  # a heartbeat: connected and served
        time.sleep(3.0)
        before = _peak_mb(broker.pid)
        frame = zmq.Frame(b"x" * int(args.frame_mib * 2**20))
        for _ in range(args.frames - 1):
            sock.send(frame, zmq.SNDMORE, copy=False)
        sock.send(b"end")
        time.sleep(3.0)
        code = broker.poll()
        key = "no_budget" if not budget else f"budget_{budget:g}_mib"
        result[key] = {"peak_growth_mib": None if code is not None else round(_peak_mb(broker.pid) - before, 1),
                       "broker_exit_code": code, "baseline_rss_mib": round(before, 1)}
        sock.close()
        ctx.term()
        broker.terminate()
        broker.wait()
    return result


def _peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench fuzz", description=__doc__,
                                 formatter_class=HelpFormatter)
    from .runs import model_flags
    model_flags(ap, max_new_tokens=64)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--malformed", type=int, default=100_000)
    ap.add_argument("--abusive", type=int, default=10_000)
    ap.add_argument("--attackers", type=int, default=2, help="attacker processes")
    ap.add_argument("--cpus", default="", help="pin broker, worker and legit edge to these cores, e.g. 0; the "
                    "attackers get the others")
    ap.add_argument("--attack", choices=("flood", "squat", "multipart"), default="flood")
    ap.add_argument("--frames", type=int, default=120, help="--attack multipart: frames in the one message")
    ap.add_argument("--frame-mib", type=float, default=1.0, help="--attack multipart: MiB per frame")
    ap.add_argument("--max-rss-mb", type=float, default=256, help="--attack multipart: the budget tried")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    if args.attack != "flood":
        result = run_squat(args) if args.attack == "squat" else run_multipart(args)
        write_result(args.out, f"fuzz_{args.attack}", result)
        print(json.dumps(result, indent=1))
        return 0
    result = run(args)
    write_result(args.out, "fuzz", result)
    print(json.dumps(result, indent=1))
    ok = (result["outputs_identical_to_target_alone"] and result["processes_alive"] and
          result["workers_falsely_lost"] == 0 and result["healthz_worst_s"] <= 1.0 and
          (result["p99_ratio"] or 0) <= 3.0)
    print("bars met" if ok else "bars NOT met", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
