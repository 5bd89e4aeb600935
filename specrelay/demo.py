"""`specrelay demo`: broker + cloud worker (child processes) + an in-process edge on localhost, demo pair."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from .cluster import LocalCluster
from .runtime import run_async

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n",
]


def summary(results: list[dict], wall: float) -> list[str]:
    total = {k: sum(r["stats"][k] for r in results) for k in
             ("generated_tokens", "draft_tokens", "accepted_tokens", "cloud_calls", "uplink_bytes", "downlink_bytes")}
    n = max(1, total["generated_tokens"])
    return [
        f"acceptance rate        {total['accepted_tokens'] / max(1, total['draft_tokens']):.1%} "
        f"({total['accepted_tokens']}/{total['draft_tokens']} drafted tokens accepted)",
        f"cloud calls            {total['cloud_calls']} vs {total['generated_tokens']} target-alone "
        f"({1 - total['cloud_calls'] / n:.0%} fewer, {total['cloud_calls'] / n:.2f} per token)",
        f"bytes per token        up {total['uplink_bytes'] / n:.1f}, down {total['downlink_bytes'] / n:.1f}",
        f"throughput             {total['generated_tokens'] / wall:.1f} tokens/s "
        f"({len(results)} sessions in flight, {wall:.2f}s)",
    ]


async def run_demo(frontend: str, max_new_tokens: int, temperature: float) -> tuple[list[dict], float]:
    from .common.sampling import SamplingParams
    from .edge_worker.loading import load_edge
    from .edge_worker.session import SessionConfig

    config = SessionConfig(max_new_tokens=max_new_tokens, params=SamplingParams(temperature), seed=1)
    async with await load_edge(frontend, str(ROOT / "models" / "demo-draft")) as edge:
        tok = edge.tokenizer
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(edge.generate(tok(p).input_ids, config) for p in PROMPTS))
        wall = time.perf_counter() - t0
    return [{"prompt": p, "text": tok.decode(ids), "token_ids": ids, "stats": stats}
            for p, (ids, stats) in zip(PROMPTS, outs)], wall


def main(args) -> int:
    target = ROOT / "models" / "demo-target"
    if not (target / "config.json").exists():
        print("demo models are missing: train them with `make train-models` (see models/README.md)", file=sys.stderr)
        return 2
    print(f"starting broker + cloud worker ({target.name}) on 127.0.0.1 ...", file=sys.stderr)
    with LocalCluster(str(target)) as cluster:
        out = run_async(run_demo(cluster.frontend, args.max_new_tokens, args.temperature))
    if not isinstance(out, tuple):
        return 1
    results, wall = out
    for r in results:
        print("=" * 72)
        print(r["prompt"] + r["text"])
    print("=" * 72)
    print("\n".join(summary(results, wall)))
    return 0
