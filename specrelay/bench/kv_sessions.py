"""`specrelay bench kv determinism | concurrency` (dispatched by specrelay/bench/kv.py): the KV-store benchmarks
that run whole generations through a local cluster's broker and workers with an edge in this process."""

from __future__ import annotations

import asyncio
import time

from .runs import load_prompts, text_table


# --------------------------------------------------------------------------------------- determinism

def bench_determinism(args) -> dict:
    """16 prompts x 96 tokens at T = 0.8, seed 7, through broker + worker(s): concurrency 1, 8, 16 on one
    worker, and 16 on two workers with one killed (SIGKILL) a third of the way in; for each worker numerics
    (default, --deterministic) and session mode (sample, coupled)."""
    from ..cluster import LocalCluster

    texts = load_prompts(None, 16)
    out: dict = {}
    for numerics, extra in (("default", ()), ("deterministic", ("--deterministic",))):
        for mode in args.session_modes:
            runs = {}
            with LocalCluster(args.model, threads=args.threads, extra_worker_args=extra) as c:
                for conc in (1, 8, 16):
                    runs[f"concurrency {conc}"] = asyncio.run(_generate(c.frontend, args, texts, conc, mode))
            with LocalCluster(args.model, workers=2, threads=args.threads, extra_worker_args=extra) as c:
                runs["failover"] = asyncio.run(_generate(c.frontend, args, texts, 16, mode, kill=c.procs[1]))
            ref = runs["concurrency 1"]["outputs"]
            out.setdefault(numerics, {})[mode] = {
                name: {"identical_to_concurrency_1": sum(a == b for a, b in zip(r["outputs"], ref)),
                       "first_divergence": [_diverge(a, b) for a, b in zip(r["outputs"], ref)],
                       "tokens_per_s": r["tokens_per_s"], "retries": r["retries"], "outputs": r["outputs"]}
                for name, r in runs.items()}
    rows = [[numerics, mode, name, f"{r['identical_to_concurrency_1']}/16", r["tokens_per_s"], r["retries"]]
            for numerics, modes in out.items() for mode, runs in modes.items() for name, r in runs.items()]
    print(text_table(["worker numerics", "session mode", "run", "outputs identical to concurrency 1", "tokens/s",
                 "edge retries"], rows))
    det = [r for runs in out["deterministic"].values() for r in runs.values()]
    return {"model": args.model, "prompts": 16, "max_new_tokens": args.max_new_tokens, "temperature": 0.8,
            "seed": 7, **out, "bar_identical_everywhere_deterministic": all(
                r["identical_to_concurrency_1"] == 16 for r in det)}


def _diverge(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def _generate(frontend: str, args, texts: list[str], concurrency: int, mode: str, kill=None) -> dict:
    """Seeded sampling (T = 0.8, seed 7) of every text; `kill` (a worker process) is SIGKILLed once a third of
    the tokens are committed."""
    import signal

    from ..common.sampling import SamplingParams
    from ..edge_worker.config import SessionConfig

    config = SessionConfig(max_new_tokens=args.max_new_tokens, params=SamplingParams(0.8), seed=7, mode=mode)
    total = [0]

    def count(new: list[int]) -> None:
        total[0] += len(new)
        if kill is not None and kill.poll() is None and total[0] >= len(texts) * args.max_new_tokens // 3:
            kill.send_signal(signal.SIGKILL)

    res, wall = await _run_edge(frontend, args.draft, texts, concurrency, config, count)
    n = sum(len(ids) for ids, _ in res)
    return {"outputs": [ids for ids, _ in res], "tokens_per_s": round(n / wall, 1),
            "retries": sum(s["retries"] for _, s in res)}


async def _run_edge(frontend: str, draft: str, texts: list[str], concurrency: int, config, on_tokens=None,
                    warm_up: bool = False) -> tuple[list, float]:
    """Generate every text through the broker with an in-process edge, `concurrency` at a time:
    ([(ids, stats)], wall seconds)."""
    from ..edge_worker.server import load_edge

    gate = asyncio.Semaphore(concurrency)

    async def one(text: str):
        async with gate:
            return await edge.generate(edge.tokenizer(text).input_ids, config, on_tokens)

    async with await load_edge(frontend, draft) as edge:
        if warm_up:
            await one(texts[0])  # first forward passes allocate
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(t) for t in texts))
        return res, time.perf_counter() - t0


# --------------------------------------------------------------------------------------- concurrency

def bench_concurrency(args) -> dict:
    """Verified tokens/s: 16 sessions at once vs 1 at a time through one worker (the existing `bench
    concurrency` setup), against the same ratio in-process (`speculative_generate_batch`, lockstep)."""
    import torch

    from ..cluster import LocalCluster
    from ..common.runner import ModelRunner
    from ..common.sampling import SamplingParams
    from ..edge_worker.draft.drafter import Drafter
    from ..edge_worker.config import SessionConfig
    from ..speculative import speculative_generate_batch

    torch.set_num_threads(args.threads)
    texts, tokens = load_prompts(None, 16), args.concurrency_tokens
    with LocalCluster(args.model, max_batch=32, threads=args.threads) as c:
        one = asyncio.run(_greedy(c.frontend, args.draft, texts[:4], 1, tokens))
        sixteen = asyncio.run(_greedy(c.frontend, args.draft, texts, 16, tokens))
    target, draft = ModelRunner.load(args.model), ModelRunner.load(args.draft)
    ids = [target.tokenizer(t).input_ids for t in texts]
    config = SessionConfig(max_new_tokens=tokens, params=SamplingParams(0.0))
    drafter = Drafter(draft, target.vocab_size)
    speculative_generate_batch(drafter, target, ids[:1], [config])  # warm-up
    t0, n1 = time.perf_counter(), 0
    for x in ids[:4]:
        n1 += sum(len(o) for o, _ in speculative_generate_batch(drafter, target, [x], [config]))
    lock1 = n1 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n16 = sum(len(o) for o, _ in speculative_generate_batch(drafter, target, ids, [config] * 16))
    lock16 = n16 / (time.perf_counter() - t0)
    dist, lock = sixteen / one, lock16 / lock1
    print(text_table(["path", "1 session tokens/s", "16 sessions tokens/s", "speed-up"],
                [["broker + worker", round(one, 1), round(sixteen, 1), round(dist, 2)],
                 ["in-process lockstep", round(lock1, 1), round(lock16, 1), round(lock, 2)]]))
    print(f"distributed speed-up / lockstep speed-up = {dist / lock:.3f} (bar >= 0.9)")
    return {"model": args.model, "threads": args.threads, "max_new_tokens": args.concurrency_tokens,
            "worker_1_tps": round(one, 2), "worker_16_tps": round(sixteen, 2), "worker_speedup": round(dist, 3),
            "lockstep_1_tps": round(lock1, 2), "lockstep_16_tps": round(lock16, 2), "lockstep_speedup": round(lock, 3),
            "ratio": round(dist / lock, 3), "bar_ge_0.9": dist / lock >= 0.9}


async def _greedy(frontend: str, draft: str, texts: list[str], concurrency: int, tokens: int) -> float:
    from ..common.sampling import SamplingParams
    from ..edge_worker.config import SessionConfig

    config = SessionConfig(max_new_tokens=tokens, params=SamplingParams(0.0))
    res, wall = await _run_edge(frontend, draft, texts, concurrency, config, warm_up=True)
    return sum(len(ids) for ids, _ in res) / wall
