"""Benchmarks of the cloud worker's KV store (issue 9). Each prints a table and writes JSON.

    python -m specrelay.bench.kv step          # verifier step vs the model's forward on a pre-stacked cache,
                                              # contexts 64..max, batch 1/4/16; memory per session; sessions
                                              # at a budget; the deterministic mode's cost
    python -m specrelay.bench.kv prefill       # worst verification latency of 15 short sessions while a
                                              # 900-token prompt arrives (chunked vs not); a too-long prompt
    python -m specrelay.bench.kv determinism   # seeded sampling at concurrency 1, 8, 16 and after failover
    python -m specrelay.bench.kv concurrency   # 16 sessions vs 1 on one worker vs the in-process lockstep
    python -m specrelay.bench.kv tree          # a token tree's verification step vs a chain's of as many
                                              # tokens, both numerics (what a tree node costs the cloud)
    python -m specrelay.bench.kv all

Results go to ./bench_results/kv_<name>.json (--out to change). Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from .runs import MODELS, HelpFormatter, load_prompts, median_ms as _median_ms, text_table, write_result
from .kv_sessions import bench_concurrency, bench_determinism


# ---------------------------------------------------------------------------------------------- step

def bench_step(args) -> dict:
    """One verification step of `batch` sessions at `context` cached tokens, d = 4 drafts each (greedy),
    against the model's own forward over the same new tokens on a DynamicCache built from pre-stacked K/V."""
    import torch

    from ..cloud_worker.config import VerifierConfig
    from ..cloud_worker.verifier import OPEN_HEADROOM, Verifier
    from ..common.runner import ModelRunner

    torch.set_num_threads(args.threads)
    runner = ModelRunner.load(args.model, args.device)
    limit = runner.max_context or 4096
    contexts = [c for c in args.contexts if c + 8 <= limit]
    budget = int(args.budget_mb * 2**20)
    verifiers = {det: Verifier(runner, VerifierConfig(max_sessions=64, max_cache_bytes=budget, deterministic=det,
                                                       client_kv_share=1.0))
                 for det in (False, True)}
    rows, out = [], []
    for ctx in contexts:
        for batch in args.batches:
            r = _step_row(runner, verifiers, ctx, batch, args.reps)
            store = verifiers[False].store
            per_session = store.shape.bytes_per_token * ctx
            r |= {"kv_bytes_per_session": per_session,
                  "sessions_at_budget": budget // store.shape.bytes_per_token // store.round_up(ctx + OPEN_HEADROOM)}
            out.append(r)
            rows.append([ctx, batch, r["forward_ms"], r["verifier_ms"], r["ratio"], r["deterministic_ms"],
                         r["deterministic_cost"], r["main_path_ms"], f"{per_session / 2**20:.2f}",
                         r["sessions_at_budget"]])
    print(text_table(["context", "batch", "model forward ms", "verifier step ms", "ratio", "deterministic ms",
                 "det. cost", "main's path ms", "KV MiB/session", f"sessions in {args.budget_mb:g} MiB"], rows))
    worst16 = max((r["ratio"] for r in out if r["batch"] == 16 and 64 <= r["context"] <= 896), default=None)
    return {"model": args.model, "threads": args.threads, "draft_len": 4, "reps": args.reps,
            "kv_bytes_per_token": verifiers[False].store.shape.bytes_per_token, "budget_mb": args.budget_mb,
            "rows": out, "worst_ratio_batch16_64_896": worst16,
            "bar_ratio_le_1.15": worst16 is not None and worst16 <= 1.15}


def _step_row(runner, verifiers: dict, ctx: int, batch: int, reps: int) -> dict:
    import torch

    from ..cloud_worker.scheduler import ChunkedPrefill
    from ..common import protocol as P
    from ..common.runner import BatchRow, append_kv

    gen = torch.Generator().manual_seed(ctx * 100 + batch)
    ids = [torch.randint(1, runner.vocab_size, (ctx,), generator=gen).tolist() for _ in range(batch)]
    drafts = [torch.randint(1, runner.vocab_size, (4,), generator=gen).tolist() for _ in range(batch)]
    keys = [(b"bench", i) for i in range(batch)]
    for v in verifiers.values():
        v.reset()
        for key, x in zip(keys, ids):
            v.open(key, P.Open(key[1], x))
        v.verify([], ChunkedPrefill(v, batch * ctx).rows())  # each context cached but its last token
    spans = [verifiers[False].store.span(k) for k in keys]
    layers = [(torch.stack([s.kv[li, 0, :, :ctx - 1] for s in spans]), torch.stack([s.kv[li, 1, :, :ctx - 1]
                                                                                     for s in spans]))
              for li in range(runner.model.config.num_hidden_layers)]  # [batch, heads, ctx-1, d] per layer
    new = torch.tensor([[x[-1]] + d for x, d in zip(ids, drafts)])  # [batch, 5]
    positions = torch.arange(ctx - 1, ctx + 4).expand(batch, 5)

    def model_forward():
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=layers)
        with torch.no_grad():
            runner.model(input_ids=new, position_ids=positions, use_cache=True, **{runner._cache_kw: cache})

    def verifier_step(v):
        def run():
            reqs = [(k, P.Verify(k[1], 1, ctx, [], d)) for k, d in zip(keys, drafts)]
            v.verify(reqs)
            for k, x in zip(keys, ids):  # back to the same state: context ctx, ctx - 1 cached
                s = v.sessions[k]
                s.tokens, s.last_seq, s.last_reply = list(x), -1, None
                v.store.truncate(k, ctx - 1)
        return run

    per_row = [[(k[i], v[i]) for k, v in layers] for i in range(batch)]

    def main_path():  # main's verifier: stack left-padded, DynamicCache concat, append the kept K/V
        outs = runner.forward_batch([BatchRow(kv, ctx - 1, [x[-1]] + d) for kv, x, d in zip(per_row, ids, drafts)])
        for kv, (_, new_kv) in zip(per_row, outs):
            append_kv(kv, new_kv, keep=1)

    ms = _median_ms({"forward": model_forward, "verifier": verifier_step(verifiers[False]),
                     "deterministic": verifier_step(verifiers[True]), "main_path": main_path}, reps)
    return {"context": ctx, "batch": batch, "forward_ms": round(ms["forward"], 2),
            "verifier_ms": round(ms["verifier"], 2), "ratio": round(ms["verifier"] / ms["forward"], 3),
            "deterministic_ms": round(ms["deterministic"], 2),
            "deterministic_cost": round(ms["deterministic"] / ms["verifier"], 3),
            "main_path_ms": round(ms["main_path"], 2)}



# ---------------------------------------------------------------------------------------------- tree

def bench_tree(args) -> dict:
    """One verification step of `batch` sessions at context 256: a chain of n draft tokens vs a tree of n nodes
    (two children a node, breadth first), fast and deterministic numerics."""
    import torch

    from ..cloud_worker.verifier import Verifier, VerifierConfig
    from ..common import protocol as P
    from ..common.runner import ModelRunner

    torch.set_num_threads(args.threads)
    runner = ModelRunner.load(args.model, args.device)
    ctx, gen, rows, out = 256, torch.Generator().manual_seed(22), [], []
    for nodes in (4, 8, 16, 32, 64):
        for batch in (1, 4):
            ids = [torch.randint(1, runner.vocab_size, (ctx,), generator=gen).tolist() for _ in range(batch)]
            draft = torch.randint(1, runner.vocab_size, (nodes,), generator=gen).tolist()
            tree = [-1 if i < 2 else (i - 2) // 2 for i in range(nodes)]
            fns = {}
            for det in (False, True):
                v = Verifier(runner, VerifierConfig(max_sessions=8, deterministic=det))
                for i, x in enumerate(ids):
                    v.open((b"bench", i), P.Open(i, x))
                for name, parents in (("chain", []), ("tree", tree)):
                    fns[(det, name)] = _step_fn(v, ids, draft, parents)
            ms = _median_ms(fns, args.reps)
            r = {"nodes": nodes, "batch": batch} | {f"{'det_' if det else ''}{name}_ms": round(t, 2)
                                                    for (det, name), t in ms.items()}
            out.append(r)
            rows.append([nodes, batch, r["chain_ms"], r["tree_ms"], round(r["tree_ms"] / r["chain_ms"], 2),
                         r["det_chain_ms"], r["det_tree_ms"], round(r["det_tree_ms"] / r["det_chain_ms"], 2)])
    print(text_table(["nodes", "batch", "chain ms", "tree ms", "tree/chain", "det. chain ms", "det. tree ms",
                      "det. tree/chain"], rows))
    return {"model": args.model, "threads": args.threads, "context": ctx, "reps": args.reps, "rows": out}


def _step_fn(v, ids: list[list[int]], draft: list[int], parents: list[int]):
    """One VERIFY per session (the same draft), then every session back to its state before it."""
    from ..common import protocol as P

    keys = [(b"bench", i) for i in range(len(ids))]
    v.verify([], prefill_tokens=sum(map(len, ids)))  # each context cached but its last token

    def run():
        v.verify([(k, P.Verify(k[1], 1, len(x), [], draft, b"", parents)) for k, x in zip(keys, ids)])
        for k, x in zip(keys, ids):
            s = v.sessions[k]
            s.tokens, s.last_seq, s.last_reply = list(x), -1, None
            v.store.truncate(k, len(x) - 1)
    return run


# ------------------------------------------------------------------------------------------- prefill

def bench_prefill(args) -> dict:
    """15 short sessions verifying in a loop; then a 900-token OPEN arrives. Worst VERIFY round trip of the
    short sessions before and while it is prefilled, chunked (--prefill-tokens) and in one piece."""
    from ..cluster import LocalCluster

    results = {}
    for label, chunk in (("chunked", args.prefill_tokens), ("unchunked", 1_000_000)):
        extra = ("--prefill-tokens", str(chunk))
        with LocalCluster(args.model, threads=args.threads, extra_worker_args=extra) as c:
            results[label] = asyncio.run(_prefill_run(c.frontend, args))
    rows = [[label, r["baseline_worst_ms"], r["baseline_median_ms"], r["during_worst_ms"], r["long_first_verdict_ms"]]
            for label, r in results.items()]
    print(text_table(["prefill", "worst VERIFY ms before", "median before", "worst VERIFY ms during the 900-token "
                 "OPEN", "900-token OPEN to its first VERDICT ms"], rows))
    limit = results["chunked"]["too_long"]
    print(f"OPEN of {limit['tokens']} tokens: {limit['code']} in {limit['ms']} ms: {limit['message']}")
    return {"model": args.model, "prefill_tokens": args.prefill_tokens, "short_sessions": 15,
            "long_prompt_tokens": 900, **results,
            "bar_bad_request_within_1s": limit["code"] == "BAD_REQUEST" and limit["ms"] < 1000}


class _Edge:
    """A bare edge on the broker's frontend: raw protocol messages, one reply awaited per session."""

    def __init__(self, frontend: str) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(frontend)
        self.waiters: dict[int, asyncio.Future] = {}
        self.receiver = asyncio.create_task(self._receive())

    async def _receive(self) -> None:
        from ..common import protocol as P

        while True:
            msg = P.decode(await self.sock.recv_multipart())
            fut = self.waiters.pop(msg.session, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def send(self, msg) -> None:
        from ..common import protocol as P

        await self.sock.send_multipart(P.encode(msg))

    async def call(self, msg):
        self.waiters[msg.session] = fut = asyncio.get_running_loop().create_future()
        await self.send(msg)
        return await asyncio.wait_for(fut, 60)

    def close(self) -> None:
        self.receiver.cancel()
        self.sock.close()
        self.ctx.term()


async def _prefill_run(frontend: str, args) -> dict:
    from transformers import AutoTokenizer

    from ..common import protocol as P

    tok = AutoTokenizer.from_pretrained(args.model)
    texts = load_prompts(None, 40)
    long_ids = [t for text in texts for t in tok(text).input_ids][:900]
    edge = _Edge(frontend)
    log: list[tuple[float, float]] = []  # (sent, latency) of the short sessions' VERIFYs
    stop = asyncio.Event()

    async def short(sid: int) -> None:
        ids = tok(texts[sid]).input_ids[:60]
        await edge.send(P.Open(sid, ids))
        for seq in range(1, 10_000):
            t0 = time.perf_counter()
            verdict = await edge.call(P.Verify(sid, seq, len(ids), [], ids[-4:]))
            log.append((t0, time.perf_counter() - t0))
            ids = ids + ids[-4:][:verdict.n_accepted] + [verdict.next_token]
            if stop.is_set() or len(ids) > 400:
                return

    try:
        shorts = [asyncio.create_task(short(sid)) for sid in range(1, 16)]
        await asyncio.sleep(3.0)
        t_long = time.perf_counter()
        await edge.send(P.Open(100, long_ids))
        verdict = await edge.call(P.Verify(100, 1, len(long_ids), [], []))
        t_done = time.perf_counter()
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*shorts)
        limit = await _too_long(edge.call, tok, texts)
    finally:
        edge.close()
    assert isinstance(verdict, P.Verdict), verdict
    before = [lat for t, lat in log if 1.0 < t - log[0][0] and t + lat < t_long]
    during = [lat for t, lat in log if t + lat > t_long and t < t_done]
    return {"baseline_worst_ms": round(max(before) * 1000, 1), "baseline_median_ms": round(
        statistics.median(before) * 1000, 1), "during_worst_ms": round(max(during) * 1000, 1),
        "during_verifies": len(during), "long_first_verdict_ms": round((t_done - t_long) * 1000, 1),
        "too_long": limit}


async def _too_long(call, tok, texts: list[str]) -> dict:
    from ..common import protocol as P

    ids = [t for text in texts for t in tok(text).input_ids] * 4
    ids = ids[:3125]
    t0 = time.perf_counter()
    reply = await call(P.Open(200, ids))
    ms = round((time.perf_counter() - t0) * 1000, 1)
    return {"tokens": len(ids), "ms": ms, "code": getattr(getattr(reply, "code", None), "name", "none"),
            "message": getattr(reply, "message", "")}


BENCHES = {"step": bench_step, "prefill": bench_prefill, "determinism": bench_determinism,
           "concurrency": bench_concurrency, "tree": bench_tree}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench kv", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("name", choices=[*BENCHES, "all"])
    ap.add_argument("--model", default=str(MODELS / "demo-target"), help="target model (directory or hub id)")
    ap.add_argument("--draft", default=str(MODELS / "demo-draft"), help="draft model (determinism, concurrency)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512, 896])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions per cell (median)")
    ap.add_argument("--budget-mb", type=float, default=2048, help="KV budget for the sessions-at-budget column")
    ap.add_argument("--prefill-tokens", type=int, default=64, help="the worker's prefill chunk (prefill)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (determinism)")
    ap.add_argument("--session-modes", nargs="+", default=["sample", "coupled"], choices=["sample", "coupled"],
                    help="sampling modes the determinism runs use")
    ap.add_argument("--concurrency-tokens", type=int, default=64, help="tokens per prompt (concurrency)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"), help="directory for the JSON results")
    args = ap.parse_args(argv)
    from .. import logs
    logs.configure("warning")
    os.environ.setdefault("SPECRELAY_LOG", "warning")  # the broker and workers we start
    for name in BENCHES if args.name == "all" else [args.name]:
        print(f"== {name}", file=sys.stderr)
        write_result(args.out, f"kv_{name}", BENCHES[name](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
