"""`specrelay bench hf --real`: the real pair (gemma-3-270m target, SmolLM2-135M-Instruct draft, different
tokenizers; `make real-models`) through specrelay against the target alone and against HF assisted generation.

Per prompt, interleaved so that a change in the shared machine's load hits every column alike:
  target alone   HF `target.generate(do_sample=False)` in this process
  HF assisted    HF `target.generate(assistant_model=draft, tokenizer=, assistant_tokenizer=)` (the
                 different-tokenizer path; universal assisted decoding)
  specrelay      one session, default flags, through a broker and a cloud worker: over loopback and over an
                 emulated link (--link, 50 ms RTT by default; bench/link.py)
The edge side (this process: the in-process edges and both HF runs) is pinned to one CPU, the cloud side (broker,
worker, relay) to the others, as if on separate machines (specrelay/placement.py; --no-pin to share). Every
output is compared with the target alone's. Then `--objective cloud` over loopback: cloud calls per token.
Prints a table, writes real-hf.json to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from .runs import meta, run_sessions, text_table, write_result

ROOT = Path(__file__).resolve().parents[2]
TARGET, DRAFT = ROOT / "models/real/gemma-3-270m", ROOT / "models/real/smollm2-135m"
# everyday text, code, Spanish, Japanese, SQL, and two more of each kind
PROMPTS = ["The best way to learn a new language is", "def binary_search(items, target):\n",
           "Mi ciudad favorita es", "日本の首都は", "SELECT customer_id, SUM(amount) FROM orders",
           "Once upon a time, in a small village,", "import numpy as np\n\ndef normalize(x):\n",
           "El clima de hoy es", "今日はとても", "CREATE TABLE users (\n"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench hf --real",
                                description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=3, help="the first N of the built-in prompts")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--link", default="50ms", help="the emulated link's RTT beside loopback (bench/link.py)")
    p.add_argument("--target", default=str(TARGET))
    p.add_argument("--draft", default=str(DRAFT))
    p.add_argument("--no-hf-assisted", action="store_true", help="skip HF assisted generation (the slowest)")
    p.add_argument("--no-pin", action="store_true")
    p.add_argument("--out", default="bench_results")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    for d in (args.target, args.draft):
        if not (Path(d) / "config.json").is_file():
            raise SystemExit(f"specrelay bench hf --real: {d} is missing; run `make real-models` first")
    result = {"bench": "real-hf", "meta": meta(["hf", "--real", *argv]), **asyncio.run(run(args))}
    write_result(args.out, "real-hf", result)
    print(table(result))
    return 0


class Columns:
    """Per run (column): tokens, wall seconds, outputs, and for specrelay runs cloud calls and uplink bytes."""

    def __init__(self) -> None:
        self.cols: dict[str, dict] = {}

    def add(self, name: str, ids: list[int], wall: float, stats: dict | None = None) -> None:
        col = self.cols.setdefault(name, {"tokens": 0, "wall_s": 0.0, "outputs": [], "cloud_calls": 0,
                                          "uplink_bytes": 0, "edge": stats is not None})
        col["tokens"] += len(ids)
        col["wall_s"] += wall
        col["outputs"].append(ids)
        col["cloud_calls"] += (stats or {}).get("cloud_calls", 0)
        col["uplink_bytes"] += (stats or {}).get("uplink_bytes", 0)

    def rows(self, ref: str) -> dict:
        want, rows = self.cols[ref]["outputs"], {}
        for name, col in self.cols.items():
            rows[name] = {"tokens": col["tokens"], "wall_s": round(col["wall_s"], 2),
                          "tokens_per_s": round(col["tokens"] / col["wall_s"], 3),
                          "outputs_equal_target": f"{sum(a == b for a, b in zip(col['outputs'], want))}/{len(want)}"}
            if col["edge"]:
                rows[name]["cloud_calls_per_token"] = round(col["cloud_calls"] / col["tokens"], 3)
                rows[name]["uplink_bits_per_token"] = round(8 * col["uplink_bytes"] / col["tokens"], 1)
        return rows


def hf_runs(args):
    """(target alone, HF assisted, target tokenizer): functions of a prompt -> (generated ids, wall seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok_t, tok_d = AutoTokenizer.from_pretrained(args.target), AutoTokenizer.from_pretrained(args.draft)
    target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft).eval()

    def timed(**kw):
        def generate(text: str) -> tuple[list[int], float]:
            ids = torch.tensor([tok_t(text).input_ids])
            t0 = time.perf_counter()
            with torch.no_grad():
                out = target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens, **kw)
            return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t0
        return generate

    return timed(), timed(assistant_model=draft, tokenizer=tok_t, assistant_tokenizer=tok_d)


async def run(args) -> dict:
    from ..cluster import LocalCluster
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.server import load_edge
    from .link import LinkRelay, LinkSpec

    texts, cols = PROMPTS[:args.num_prompts], Columns()
    alone, assisted = hf_runs(args)
    config = SessionConfig(max_new_tokens=args.max_new_tokens)
    with LocalCluster(args.target, startup_timeout=900, pin=not args.no_pin) as c, \
            LinkRelay(LinkSpec.parse(args.link), c.frontend, rate_by="relay") as link:
        if link.proc:  # the cluster put its children on the cloud side and this process (edge, HF runs) on the edge's
            c.place_cloud(link.proc.pid)
        endpoints = {"specrelay loopback": c.frontend, f"specrelay {args.link} RTT": link.endpoint}
        edges = {name: await load_edge(ep, args.draft, args.target) for name, ep in endpoints.items()}
        for edge in edges.values():
            await edge.__aenter__()
            await run_sessions(edge, texts[:1], SessionConfig(max_new_tokens=4), 1)  # first session: the bitmap
        try:
            for text in texts:
                print(f"[real-hf] {text[:30]!r}", file=sys.stderr, flush=True)
                cols.add("target alone (HF)", *await asyncio.to_thread(alone, text))
                if not args.no_hf_assisted:
                    cols.add("HF assisted", *await asyncio.to_thread(assisted, text))
                for name, edge in edges.items():
                    runs, wall = await run_sessions(edge, [text], config, 1)
                    cols.add(name, runs[0].ids, wall, runs[0].stats)
            runs, _ = await run_sessions(edges["specrelay loopback"], texts,
                                         SessionConfig(max_new_tokens=args.max_new_tokens, objective="cloud"), 1)
        finally:
            for edge in edges.values():
                await edge.__aexit__(None, None, None)
    want = cols.cols["target alone (HF)"]["outputs"]
    calls, tokens = sum(r.stats["cloud_calls"] for r in runs), sum(len(r.ids) for r in runs)
    return {"prompts": len(texts), "max_new_tokens": args.max_new_tokens, "target": args.target, "draft": args.draft,
            "link": link.described, "placement": c.placement.describe(), "load_average_at_end": os.getloadavg(),
            "rows": cols.rows("target alone (HF)"),
            "objective_cloud": {"cloud_calls": calls, "tokens": tokens,
                                "cloud_calls_per_token": round(calls / tokens, 3),
                                "outputs_equal_target": sum(r.ids == o for r, o in zip(runs, want))}}


def table(result: dict) -> str:
    base = result["rows"]["target alone (HF)"]["tokens_per_s"]
    lines = [[name, r["tokens_per_s"], f"{r['tokens_per_s'] / base:.2f}x", r["outputs_equal_target"],
              r.get("cloud_calls_per_token", "-"), r.get("uplink_bits_per_token", "-")]
             for name, r in result["rows"].items()]
    oc = result["objective_cloud"]
    return (text_table(["run", "tokens/s", "vs target", "outputs = target", "calls/token", "uplink bit/token"], lines)
            + f"\n--objective cloud (loopback): {oc['cloud_calls_per_token']} cloud calls/token, outputs equal "
              f"{oc['outputs_equal_target']}/{result['prompts']}; load average {result['load_average_at_end']}")
