"""`specrelay bench draft`: the edge's lockstep draft step, in-process, on the draft model alone.

    specrelay bench draft [--draft DIR_OR_ID] [--sessions 1 4 16] [--draft-len 4] [--rounds 100] [--out DIR]

Each round, every session drafts d tokens greedily in one lockstep batch, then keeps a prefix of its draft and
one other token (as after a VERDICT: the cache rolls back, the next batch feeds the catch-up). Two paths draft
the same contexts, interleaved round by round:

- `in place`: the edge's drafter (edge_worker/draft/kv.py): pasts gathered once per batch, K/V written in place;
- `restack`: the path the edge used before, kept in common/runner.py: every step restacks every session's
  past left-padded (`forward_batch`) and appends the kept K/V by concatenation (`append_kv`).

Prints ms per round and per drafted token for each and whether the drafts were identical; writes
`draft_step.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from .runs import DEMO_DRAFT, HelpFormatter, load_prompts, meta, text_table, write_result


class Restack:
    """Greedy lockstep drafting the way the edge did it before (one restack and two concatenations per step)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.state: dict[int, tuple[list[int], object]] = {}  # session -> (cached ids, per-layer K/V)

    def draft(self, contexts: list[list[int]], d: int) -> list[list[int]]:
        from ..common.runner import BatchRow, append_kv, common_prefix

        ctxs = [list(c) for c in contexts]
        out = [[] for _ in ctxs]
        for _ in range(d):
            rows = []
            for i, ctx in enumerate(ctxs):
                ids, kv = self.state.get(i, ([], None))
                keep = common_prefix(ids, ctx)
                if keep == len(ctx):  # fully cached: re-run the last id for its logits
                    keep -= 1
                kv = [(k[:, :keep], v[:, :keep]) for k, v in kv] if kv and keep else None
                self.state[i] = (ctx[:keep], kv)
                rows.append(BatchRow(kv, keep, ctx[keep:]))
            for i, (row, (logits, new_kv)) in enumerate(zip(rows, self.runner.forward_batch(rows))):
                self.state[i] = (list(ctxs[i]), append_kv(row.kv, new_kv, keep=len(row.ids)))
                out[i].append(int(logits[-1].argmax()))
                ctxs[i].append(out[i][-1])
        return out


def run(args) -> dict:
    import torch

    from ..common.protocol import Mode
    from ..common.runner import ModelRunner
    from ..common.sampling import SamplingParams
    from ..edge_worker.draft.drafter import Drafter, DraftJob

    torch.set_num_threads(args.threads)
    runner = ModelRunner.load(args.draft)
    texts = load_prompts(args.prompts, max(args.sessions))
    rows = []
    for b in args.sessions:
        contexts = [runner.tokenizer(t).input_ids for t in texts[:b]]
        drafter, restack = Drafter(runner), Restack(runner)
        states = [drafter.new_state(c) for c in contexts]
        times = {"in place": [], "restack": []}
        identical = True
        for r in range(args.rounds + 1):  # round 0 warms both paths up and is not timed
            jobs = [DraftJob(s, c, len(c), args.draft_len, Mode.GREEDY, SamplingParams(), 0)
                    for s, c in zip(states, contexts)]
            t0 = time.perf_counter()
            mine = [block.ids for block in drafter.draft_batch(jobs)]
            t1 = time.perf_counter()
            theirs = restack.draft(contexts, args.draft_len)
            t2 = time.perf_counter()
            identical &= mine == theirs
            if r:
                times["in place"].append(t1 - t0)
                times["restack"].append(t2 - t1)
            for i, ids in enumerate(mine):  # keep a prefix and one other token, as after a VERDICT
                contexts[i] += ids[:(r + i) % (len(ids) + 1)] + [(r * 31 + i) % (runner.vocab_size - 3) + 3]
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"sessions": b, "draft_len": args.draft_len, "rounds": args.rounds,
                     "final_context_mean": round(sum(map(len, contexts)) / b),
                     "in_place_ms_per_round": round(ms["in place"], 2), "restack_ms_per_round": round(ms["restack"], 2),
                     "in_place_ms_per_token": round(ms["in place"] / (b * args.draft_len), 3),
                     "restack_ms_per_token": round(ms["restack"] / (b * args.draft_len), 3),
                     "speedup": round(ms["restack"] / ms["in place"], 2), "drafts_identical": identical})
    headers = ["sessions", "d", "context (end)", "in place ms/round", "restack ms/round", "speed-up", "identical"]
    print(text_table(headers,
                     [[r["sessions"], r["draft_len"], r["final_context_mean"], r["in_place_ms_per_round"],
                       r["restack_ms_per_round"], f"{r['speedup']}x", r["drafts_identical"]] for r in rows]))
    return {"draft": args.draft, "threads": args.threads, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench draft", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--draft", default=DEMO_DRAFT, help="draft model directory or hub id (default: demo draft)")
    ap.add_argument("--prompts", default=None, help="prompts JSONL (default: the held-out prompts)")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16], help="lockstep batch sizes")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=100, help="timed rounds per batch size (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=Path("bench_results"), help="directory for the JSON result")
    ap.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = ap.parse_args(argv)
    if args.draft_len < 1 or args.rounds < 1 or min(args.sessions) < 1:
        ap.error("--draft-len, --rounds and --sessions must be at least 1")
    result = {"bench": "draft_step", "meta": meta(["draft", *(sys.argv[1:] if argv is None else argv)]), **run(args)}
    write_result(args.out, "draft_step", result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
