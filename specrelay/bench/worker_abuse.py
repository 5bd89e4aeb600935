"""`specrelay bench worker-abuse`: one hostile edge against a broker and a cloud worker (real processes), issue 18
items 6, 7 and 9; prints and writes JSON (OUT/worker_abuse.json).

    python -m specrelay.bench.worker_abuse [--flood-s 75] [--sessions 14] [--in-flight 60] [--pairs 20000]

resample flood (item 6): the attacker opens `--sessions` SAMPLE/srdv sessions, gets each a rejected VERIFY, then
keeps `--in-flight` RESAMPLE(CANDIDATES, last round) per session in flight for `--flood-s` seconds, while 8 legit
greedy generations run. Measured: the worker's slowest /healthz (polled every 50 ms), workers the broker declared
lost, legit outputs against target-alone greedy, and what the attacker got back (answers by kind).
open/close (item 7): `--pairs` OPEN + CLOSE with a fresh shared_vocab bitmap each, twice; the worker's RSS
growth over the second round (the first warms the allocator up), per pair.
prefill (item 9, `--prefill-only` runs just this): `--long-prompts` prompts of ~`--long-tokens` tokens at once
from one edge, against a worker with `--prefill-tokens 4`; how many finished, and the worker's prefill tokens
against the prompts' (1.0 = each prompt prefilled once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter

from .runs import HelpFormatter, load_prompts, write_result
from .fuzz import HealthWatch, legit


class HealthProcess:
    """fuzz.HealthWatch in a process of its own, so the legit edge and the attacker in this process (the
    GIL, the event loop) never delay the poller: what it measures is the worker's answer time."""

    def __init__(self, port: int) -> None:
        import multiprocessing

        self._port, self._stop = port, multiprocessing.Event()
        self._result = multiprocessing.Queue()
        self._proc = multiprocessing.Process(target=self._run, daemon=True)

    def _run(self) -> None:
        watch = HealthWatch(self._port)
        with watch:
            self._stop.wait()
        self._result.put((watch.worst, watch.failures))

    def __enter__(self) -> "HealthProcess":
        self._proc.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.worst, self.failures = self._result.get(timeout=30)
        self._proc.join()


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


async def _rejections(sock, sessions: int, prompt: list[int]) -> list[int]:
    """One rejected SAMPLE/srdv VERIFY per session (draft token 7 sent with q = 1): the session ids."""
    import torch

    from ..common import protocol as P
    from ..common.packing import f32

    rejected = []
    for sid in range(1, sessions + 1):
        for seed in range(100):
            await sock.send_multipart(P.encode(P.Open(sid, prompt, P.Mode.SAMPLE, 1.0, seed=seed,
                                                      resample=P.Strategy.SRDV)))
            await sock.send_multipart(P.encode(P.Verify(sid, 1, len(prompt), [], [7], f32(torch.ones(1)))))
            reply = P.decode(await sock.recv_multipart())
            if isinstance(reply, P.Verdict) and reply.next_token < 0:
                rejected.append(sid)
                break
    return rejected


async def flood(frontend: str, seconds: float, sessions: int, in_flight: int, prompt: list[int]) -> Counter:
    """The attacker of item 6: RESAMPLE(CANDIDATES, last round), `in_flight` per session, for `seconds`."""
    import zmq
    import zmq.asyncio

    from ..common import protocol as P
    from ..common.resample import SRDV_MAX_ROUNDS

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(frontend)
    answers: Counter = Counter()
    try:
        sids = await _rejections(sock, sessions, prompt)
        answers["sessions_with_a_rejection"] = len(sids)
        for sid in sids:
            for _ in range(in_flight):
                await sock.send_multipart(P.encode(P.Resample(sid, 1, P.ResampleKind.CANDIDATES, SRDV_MAX_ROUNDS - 1)))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not await sock.poll(1000):
                continue
            reply = P.decode(await sock.recv_multipart())
            answers[reply.code.name if isinstance(reply, P.Error) else type(reply).__name__] += 1
            await sock.send_multipart(P.encode(P.Resample(reply.session, 1, P.ResampleKind.CANDIDATES,
                                                          SRDV_MAX_ROUNDS - 1)))
    finally:
        sock.close()
        ctx.term()
    return answers


async def open_close(frontend: str, pairs: int, vocab: int, prompt: list[int]) -> None:
    """Item 7's attacker: OPEN + CLOSE with a fresh bitmap each (one token left out per pair), then one VERIFY
    round trip so every pair has been handled when this returns."""
    import zmq
    import zmq.asyncio

    from ..common import protocol as P

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(frontend)
    size = (vocab + 7) // 8
    try:
        for n in range(pairs):
            bits = bytearray(b"\xff" * size)
            bits[n % size] &= ~(1 << (n // size) % 8)
            await sock.send_multipart(P.encode(P.Open(1, prompt, shared_vocab=bytes(bits))))
            await sock.send_multipart(P.encode(P.Close(1)))
        await sock.send_multipart(P.encode(P.Open(2, prompt)))
        await sock.send_multipart(P.encode(P.Verify(2, 1, len(prompt))))
        await asyncio.wait_for(sock.recv_multipart(), 300)
        await sock.send_multipart(P.encode(P.Close(2)))
    finally:
        sock.close()
        ctx.term()


def long_prompts(tokenizer, prompts: list[str], n: int, tokens: int) -> list[list[int]]:
    """`n` distinct prompts of exactly `tokens` target tokens, from the held-out text repeated."""
    text = "\n".join(prompts)
    ids = tokenizer(text * (1 + tokens // max(1, len(tokenizer(text).input_ids)))).input_ids
    return [tokenizer(f"# {i}\n").input_ids + ids[:tokens - len(tokenizer(f"# {i}\n").input_ids)] for i in range(n)]


def run_prefill(args) -> dict:
    from ..cluster import LocalCluster
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.server import load_edge

    with LocalCluster(args.target, threads=1, extra_worker_args=("--prefill-tokens", "4")) as cluster:
        async def generate() -> tuple[list, float]:
            async with await load_edge(cluster.frontend, args.draft) as edge:
                ids = long_prompts(edge.tokenizer, load_prompts(args.prompts), args.long_prompts, args.long_tokens)
                t0 = time.monotonic()
                outs = await asyncio.gather(*(edge.generate(p, SessionConfig(16)) for p in ids),
                                            return_exceptions=True)
                return ids, outs, time.monotonic() - t0

        ids, outs, wall = asyncio.run(generate())
        prefilled = cluster.metrics(cluster.health_ports[0])["specrelay_cloud_prefill_tokens_total"]
    failed = [f"{type(o).__name__}: {o}" for o in outs if isinstance(o, BaseException)]
    prompt_tokens = sum(len(p) for p in ids)
    return {"prompts": len(ids), "prompt_tokens_each": len(ids[0]), "finished": len(ids) - len(failed),
            "failures": failed[:3], "wall_s": round(wall, 1), "worker_prefill_tokens": int(prefilled),
            "prefill_per_prompt_token": round(prefilled / prompt_tokens, 3),
            "retries": sum(o[1]["retries"] for o in outs if not isinstance(o, BaseException))}


def run(args) -> dict:
    from ..cluster import LocalCluster
    from ..common.runner import ModelRunner
    from ..speculative import target_generate

    prompts = load_prompts(args.prompts, 8)
    target = ModelRunner.load(args.target)
    refs = [target_generate(target, target.tokenizer(p).input_ids, args.max_new_tokens) for p in prompts]
    attack_prompt = target.tokenizer(prompts[0]).input_ids
    with LocalCluster(args.target, threads=1) as cluster:
        worker_pid, health = cluster.worker_procs[0].pid, cluster.health_ports[0]

        async def attack_and_legit():
            attacker = asyncio.create_task(flood(cluster.frontend, args.flood_s, args.sessions, args.in_flight,
                                                 attack_prompt))
            await asyncio.sleep(min(5.0, args.flood_s / 4))  # the flood is on before the legit runs start
            runs = []
            while not attacker.done() or not runs:  # legit greedy runs, one after another, for the whole flood
                runs.append((await legit(cluster.frontend, args.draft, prompts, args.max_new_tokens))[0])
            return runs, await attacker

        with HealthProcess(health) as quiet:
            base, _ = asyncio.run(legit(cluster.frontend, args.draft, prompts, args.max_new_tokens))
        lost_before = cluster.metrics(cluster.broker_health_port)["specrelay_broker_workers_lost_total"]
        with HealthProcess(health) as watch:
            t0 = time.monotonic()
            outs, answers = asyncio.run(attack_and_legit())
            flood_wall = time.monotonic() - t0
        lost = cluster.metrics(cluster.broker_health_port)["specrelay_broker_workers_lost_total"] - lost_before
        asyncio.run(open_close(cluster.frontend, args.pairs, target.vocab_size, attack_prompt))  # warm-up
        rss0 = _rss_kb(worker_pid)
        t0 = time.monotonic()
        asyncio.run(open_close(cluster.frontend, args.pairs, target.vocab_size, attack_prompt))
        pairs_wall, rss1 = time.monotonic() - t0, _rss_kb(worker_pid)
        alive = all(proc.poll() is None for proc in cluster.procs)
    return {
        "resample_flood": {
            "flood_s": args.flood_s, "wall_s": round(flood_wall, 1), "sessions": args.sessions,
            "in_flight_per_session": args.in_flight, "attacker_answers": dict(answers),
            "worker_healthz_worst_s": round(watch.worst, 3), "worker_healthz_failures": watch.failures,
            "worker_healthz_worst_s_no_attack": round(quiet.worst, 3),
            "workers_declared_lost": int(lost),
            "legit_runs": len(outs), "legit_outputs_identical": all(o == refs for o in outs) and base == refs,
        },
        "open_close": {"pairs": args.pairs, "wall_s": round(pairs_wall, 1), "vocab": target.vocab_size,
                       "worker_rss_before_kb": rss0, "worker_rss_after_kb": rss1,
                       "growth_bytes_per_pair": round(1024 * (rss1 - rss0) / args.pairs, 1)},
        "processes_alive": alive,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench worker-abuse", description=__doc__,
                                 formatter_class=HelpFormatter)
    from .runs import model_flags
    model_flags(ap, max_new_tokens=64)
    ap.add_argument("--flood-s", type=float, default=75.0)
    ap.add_argument("--sessions", type=int, default=14)
    ap.add_argument("--in-flight", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--long-prompts", type=int, default=12)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill part (item 9)")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    result = {} if args.prefill_only else run(args)
    result["prefill"] = pre = run_prefill(args)
    write_result(args.out, "worker_abuse_prefill" if args.prefill_only else "worker_abuse", result)
    print(json.dumps(result, indent=1))
    ok = pre["finished"] == pre["prompts"] and pre["prefill_per_prompt_token"] <= 1.0
    if not args.prefill_only:
        flood_r, pairs = result["resample_flood"], result["open_close"]
        ok = ok and (flood_r["worker_healthz_worst_s"] < 1.0 and flood_r["workers_declared_lost"] == 0
                     and flood_r["legit_outputs_identical"] and result["processes_alive"]
                     and pairs["growth_bytes_per_pair"] < 100)
    print("bars met" if ok else "bars NOT met", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
