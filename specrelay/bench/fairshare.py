"""`specrelay bench fairshare`: one client against the others' share of a cloud worker (real processes:
`specrelay broker` + `specrelay cloud-worker`; the attacker is a raw ZeroMQ client on the broker's frontend).

    tree flood   `--sessions` (48) sessions of one client each keep a 64-node token-tree VERIFY in flight for
                 `--flood-s` seconds, while one legit greedy generation runs (`--legit-draft-len` tokens a VERIFY):
                 its round trip (VERIFY sent -> VERDICT, mean; also the median gap between committed chunks)
                 under the flood against at rest, its output against the target alone, and the worker's steps
                 (how many, their mean seconds, tokens, VERIFYs, prefill tokens) at rest and under the flood.
    KV fill      (`--kv-cache-mb`, a second worker run) one client opens sessions of `--fill-tokens`-token prompts
                 until refused and keeps them busy, while 4 legit greedy generations run: how many finished and
                 equal the target alone, and what share of the store the attacker held.
Prints and writes JSON (OUT/fairshare.json), with the load average (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter

from .fuzz import legit
from .runs import load_prompts, model_flags, write_result


async def attacker(frontend: str, sessions: int, seconds: float, prompt: list[int], nodes: int) -> Counter:
    """`sessions` sessions, each with one VERIFY of `nodes` nodes (a path) in flight, re-OPENed on any error."""
    import zmq
    import zmq.asyncio

    from ..common import protocol as P

    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(frontend)
    pos, seq, seen = {}, {}, Counter()

    async def verify(sid: int) -> None:
        seq[sid] += 1
        await sock.send_multipart(P.encode(P.Verify(sid, seq[sid], pos[sid], draft=[5] * nodes,
                                                    parents=[-1] + list(range(nodes - 1)))))

    async def open_(sid: int) -> None:
        pos[sid], seq[sid] = len(prompt), 0
        await sock.send_multipart(P.encode(P.Open(sid, prompt)))
        await verify(sid)

    for sid in range(1, sessions + 1):
        await open_(sid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not await sock.poll(100):
            continue
        msg = P.decode(await sock.recv_multipart())
        seen[type(msg).__name__] += 1
        if isinstance(msg, P.Verdict) and msg.seq == seq.get(msg.session):
            pos[msg.session] += msg.n_accepted + (msg.next_token >= 0)
            if pos[msg.session] + nodes + 8 > 480:  # near the context: start again
                await open_(msg.session)
            else:
                await verify(msg.session)
        elif isinstance(msg, P.Error) and msg.session in pos:
            await open_(msg.session)
    for sid in pos:
        await sock.send_multipart(P.encode(P.Close(sid)))
    sock.close()
    return seen


def _gap(gaps: list[float]) -> float:
    return round(statistics.median(gaps[1:] or gaps), 4)  # the first gap includes the prefill


def _steps(before: dict, after: dict) -> dict:
    """The worker's steps between two /metrics reads: how many, their mean seconds, tokens, VERIFYs, prefill."""
    name = lambda k: f"specrelay_cloud_{k}" + ("" if k.startswith("forward_seconds") else "_total")  # noqa: E731
    d = {k: after.get(name(k), 0.0) - before.get(name(k), 0.0)
         for k in ("forward_passes", "forward_tokens", "prefill_tokens", "verify_requests", "forward_seconds_sum",
                   "forward_seconds_count")}
    n = max(d["forward_passes"], 1.0)
    return {"steps": int(d["forward_passes"]), "mean_s": round(d["forward_seconds_sum"] / max(d["forward_seconds_count"], 1), 4),
            "tokens_per_step": round(d["forward_tokens"] / n, 1), "prefill_tokens_per_step": round(d["prefill_tokens"] / n, 1),
            "verifies_per_step": round(d["verify_requests"] / n, 2)}


def tree_flood(args, prompts, refs) -> dict:
    from ..cluster import LocalCluster
    from ..common.runner import ModelRunner

    tok = ModelRunner.load(args.target).tokenizer
    attack_prompt = tok(prompts[1]).input_ids
    with LocalCluster(args.target, threads=1) as cluster:
        before = cluster.metrics(cluster.health_ports[0])
        rest_timing, flood_timing = {}, {}
        rest_out, rest = asyncio.run(legit(cluster.frontend, args.draft, prompts[:1], args.max_new_tokens, rest_timing,
                                           args.legit_draft_len))
        at_rest = _steps(before, cluster.metrics(cluster.health_ports[0]))

        async def both():
            flood = asyncio.create_task(attacker(cluster.frontend, args.sessions, args.flood_s, attack_prompt, 64))
            await asyncio.sleep(3.0)
            before = cluster.metrics(cluster.health_ports[0])
            outs, gaps = await legit(cluster.frontend, args.draft, prompts[:1], args.max_new_tokens, flood_timing,
                                     args.legit_draft_len)
            after = cluster.metrics(cluster.health_ports[0])
            return outs, gaps, await flood, _steps(before, after)

        outs, gaps, seen, steps = asyncio.run(both())
    return {"sessions": args.sessions, "nodes": 64, "attacker_replies": dict(seen), "steps_at_rest": at_rest, "steps_under_flood": steps,
            "legit_verify_at_rest": rest_timing, "legit_verify_under_flood": flood_timing,
            "legit_round_trip_at_rest_s": _gap(rest), "legit_round_trip_under_flood_s": _gap(gaps),
            "slowdown": round(flood_timing["verify_latency_s"] / max(rest_timing["verify_latency_s"], 1e-9), 2),
            "gap_slowdown": round(_gap(gaps) / max(_gap(rest), 1e-9), 2),
            "legit_exact": outs == refs[:1] and rest_out == refs[:1], "loadavg": os.getloadavg()}


async def edges_generate(frontend: str, draft: str, prompts: list[str], max_new: int) -> list:
    """One edge per prompt (loaded one after another: HF loading is not safe side by side), generating at once;
    each output or its exception."""
    from contextlib import AsyncExitStack

    from ..edge_worker.config import SessionConfig
    from ..edge_worker.server import load_edge

    async with AsyncExitStack() as stack:
        edges = [await stack.enter_async_context(await load_edge(frontend, draft)) for _ in prompts]

        async def one(edge, prompt: str) -> list[int]:
            return (await edge.generate(edge.tokenizer(prompt).input_ids, SessionConfig(max_new)))[0]

        return await asyncio.gather(*(one(e, p) for e, p in zip(edges, prompts)), return_exceptions=True)


def kv_fill(args, prompts, refs) -> dict:
    """One client opening 32 sessions of --fill-tokens-token prompts (and keeping each busy), 4 legit edges."""
    from ..cluster import LocalCluster

    fill = [5 + i % 50 for i in range(args.fill_tokens)]
    with LocalCluster(args.target, threads=1, extra_worker_args=("--kv-cache-mb", str(args.kv_cache_mb))) as cluster:
        port, used = cluster.health_ports[0], [0.0]

        async def watch() -> None:
            while True:
                m = cluster.metrics(port)
                cap = m.get("specrelay_cloud_kv_capacity_tokens", 0) or 1
                used[0] = max(used[0], 1 - m.get("specrelay_cloud_kv_free_tokens", cap) / cap)
                await asyncio.sleep(0.5)

        async def both():
            flood = asyncio.create_task(attacker(cluster.frontend, 32, args.flood_s, fill, 1))
            watcher = asyncio.create_task(watch())
            await asyncio.sleep(5.0)
            alone = used[0]  # the attacker's share, before the legit edges open theirs
            runs = await edges_generate(cluster.frontend, args.draft, prompts[:4], args.max_new_tokens)
            seen = await flood
            watcher.cancel()
            return runs, seen, alone

        runs, seen, alone = asyncio.run(both())
        metrics = cluster.metrics(port)
    done = [r if not isinstance(r, BaseException) else None for r in runs]
    return {"attacker_sessions": 32, "fill_tokens": args.fill_tokens, "kv_cache_mb": args.kv_cache_mb,
            "attacker_replies": dict(seen), "attacker_kv_fraction": round(alone, 3),
            "kv_used_max_fraction": round(used[0], 3),
            "legit_completed": sum(d is not None for d in done),
            "legit_errors": [repr(r)[:200] for r in runs if isinstance(r, BaseException)],
            "legit_exact": sum(d == r for d, r in zip(done, refs[:4])),
            "worker_budget_refusals": metrics.get("specrelay_cloud_budget_refusals_total"),
            "worker_evictions": metrics.get("specrelay_cloud_evictions_total"), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench fairshare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags(ap, max_new_tokens=48)
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--flood-s", type=float, default=40.0)
    ap.add_argument("--legit-draft-len", type=int, default=4,
                    help="tree flood: the legit session's draft length, the same at rest and under the flood")
    ap.add_argument("--fill-tokens", type=int, default=400, help="KV fill: each attacker prompt's tokens")
    ap.add_argument("--kv-cache-mb", type=float, default=64, help="KV fill: the worker's KV store")
    ap.add_argument("--only", choices=("trees", "kv"), help="run one attack")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    from ..common.runner import ModelRunner
    from ..speculative import target_generate

    prompts = load_prompts(args.prompts, 4)
    target = ModelRunner.load(args.target)
    refs = [target_generate(target, target.tokenizer(p).input_ids, args.max_new_tokens) for p in prompts]
    result, ok = {}, True
    if args.only != "kv":
        flood = result["tree_flood"] = tree_flood(args, prompts, refs)
        ok = flood["legit_exact"] and flood["slowdown"] <= 3.0
    if args.only != "trees":
        kv = result["kv_fill"] = kv_fill(args, prompts, refs)
        ok = ok and kv["legit_exact"] == 4 and kv["attacker_kv_fraction"] <= 0.5 and kv["worker_evictions"] == 0
    write_result(args.out, "fairshare", result)
    print(json.dumps(result, indent=1))
    print("bars met" if ok else "bars NOT met", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
