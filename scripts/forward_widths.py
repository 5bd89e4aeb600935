"""A target's verify forward against the tokens it verifies (1..N after a cached context), on the threads a cloud
worker gets: on a CPU a matrix product's kernel changes with its rows, so the cost need not be a line (gemma-3-270m
on one thread: 124, 226, 287, 186, 216 ms for 1-5 tokens). Prints a table and writes JSON.

    python scripts/forward_widths.py models/real/gemma-3-270m --threads 1 --out bench_results/forward_widths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=60, help="cached tokens before each verify")
    ap.add_argument("--widths", type=int, default=8, help="verify 1..N tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench_results/forward_widths.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = []
    with torch.no_grad():
        cache = model(torch.randint(0, vocab, (1, args.context), generator=gen), use_cache=True).past_key_values
        for width in range(1, args.widths + 1):
            times = []
            for _ in range(args.repeats):
                ids = torch.randint(0, vocab, (1, width), generator=gen)
                t0 = time.perf_counter()
                model(ids, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                cache.crop(-width)  # back to the context
            rows.append({"tokens": width, "median_ms": round(1000 * statistics.median(times), 1),
                         "min_ms": round(1000 * min(times), 1)})
            print(f"{width:3d} tokens  median {rows[-1]['median_ms']:7.1f} ms  min {rows[-1]['min_ms']:7.1f} ms",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "threads": args.threads, "context": args.context,
                               "rows": rows}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
