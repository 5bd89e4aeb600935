"""A target's verify forward against the tokens it verifies (1..N after a cached context), on the threads a cloud
worker gets: on a CPU a matrix product's kernel changes with its rows, so the cost need not be a line (gemma-3-270m
on one thread: 124, 226, 287, 186, 216 ms for 1-5 tokens). `--verifier`: the worker's whole verify path instead
(cloud_worker/verifier.py: a scratch session's VERIFY of a chain of N, as the worker's `token_us` is measured).
Prints a table and writes JSON.

    python scripts/forward_widths.py models/real/gemma-3-270m --threads 1 --out bench_results/forward_widths.json
    python scripts/forward_widths.py models/demo-target --threads 1 --widths 64 --verifier
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
    ap.add_argument("--verifier", action="store_true", help="time the worker's VERIFY path, not a bare forward")
    ap.add_argument("--out", default="bench_results/forward_widths.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.verifier:
        return _report(args, _verifier_rows(args))
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
    _report(args, rows, printed=True)


def _verifier_rows(args) -> list[dict]:
    """VERIFYs of 1..N tokens (a chain of N - 1 and its bonus) on a scratch session through
    cloud_worker.verifier.Verifier (the packed forward, the output head and the acceptance rule), reopened at
    `--context` tokens for each width."""
    from specrelay.cloud_worker.verifier import Verifier
    from specrelay.common import protocol as P
    from specrelay.common import selfcheck
    from specrelay.common.runner import ModelRunner

    verifier = Verifier(ModelRunner.load(args.model))
    ids = (selfcheck.probe(verifier.runner.vocab_size)[0] * (2 * (args.context + args.widths)))
    key, seq, rows = (b"", -1), 0, []

    def verify(width: int) -> float:
        nonlocal seq
        seq, pos = seq + 1, len(verifier.sessions[key].tokens)
        t0 = time.perf_counter()
        verifier.verify([(key, P.Verify(0, seq, pos, [], ids[pos:pos + width - 1]))])
        return time.perf_counter() - t0

    for width in range(1, args.widths + 1):
        verifier.open(key, P.Open(0, ids[:args.context]))
        verify(width)  # the prompt's prefill and this width's first run: not timed
        times = [verify(width) for _ in range(args.repeats)]  # each commits a token or more: the context grows
        verifier.close(key)
        rows.append({"tokens": width, "median_ms": round(1000 * statistics.median(times), 1),
                     "min_ms": round(1000 * min(times), 1)})
    return rows


def _report(args, rows: list[dict], printed: bool = False) -> None:
    if not printed:
        for row in rows:
            print(f"{row['tokens']:3d} tokens  median {row['median_ms']:7.1f} ms  min {row['min_ms']:7.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "threads": args.threads, "context": args.context,
                               "verifier": args.verifier, "rows": rows}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
