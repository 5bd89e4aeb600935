"""Greedy acceptance of the demo pair, replayed offline: what fixed draft lengths really commit per call, and what the
auto draft length's model (edge_worker/draftlen.py) would predict for them from rates measured at another length.

    .venv/bin/python scripts/acceptance_replay.py [--num-prompts 32] [--max-new-tokens 64] [--lengths 2,4,8,12] [--json FILE]

With greedy verification and one vocabulary a drafted token is accepted iff the draft's greedy token after the
target's own text equals the target's next token, whatever the block: so one pass of each model over the target's
greedy text gives the match bits m(t), and replaying blocks of d over them gives exactly the tokens per call and
the acceptance per position that `specrelay bench sweep --draft-lens d` measures on the same prompts (no clock, no
noise). The extrapolation table is E(d) = sum_k prod_{j<k} a_j at the pooled rates a_j measured while drafting
another length (the model a lone session evaluates every candidate with), the same per prompt combined as calls
do (tokens over rounds), and the two-state E(d) a busy edge's shared length uses (acceptance after a rejected
block vs after a fully accepted one, ratecurve.mixture_curve), against the replayed truth. docs/draftlen.md
("A busy edge over a link", "One length for a busy edge") reads it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def match_bits(num_prompts: int, max_new_tokens: int) -> list[list[int]]:
    """Per prompt, m(t) over the target's greedy continuation: 1 iff the draft's greedy token there is the target's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrelay.bench.runs import DEMO_DRAFT, DEMO_TARGET, load_prompts

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    target = AutoModelForCausalLM.from_pretrained(DEMO_TARGET).eval()
    draft = AutoModelForCausalLM.from_pretrained(DEMO_DRAFT).eval()
    bits = []
    for prompt in load_prompts(n=num_prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, n]
        with torch.no_grad():
            text = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.eos_token_id)[0]  # [n + g]
            guesses = draft(text[None, :-1]).logits[0, ids.shape[1] - 1:].argmax(-1)  # [g]: the draft's greedy
        bits.append([int(a == b) for a, b in zip(guesses.tolist(), text[ids.shape[1]:].tolist())])
    return bits


def replay(bits: list[int], d: int) -> list[tuple[int, int]]:
    """Blocks of d (shortened to the tokens left - 1, as FixedDraftLen does) over one text: (sent, accepted) each."""
    rounds, s = [], 0
    while s < len(bits):
        top = min(d, len(bits) - s - 1)
        n = 0
        while n < top and bits[s + n]:
            n += 1
        rounds.append((top, n))
        s += n + 1
    return rounds


def rates(rounds: list[tuple[int, int]], n: int) -> list[float | None]:
    """Acceptance per draft position (reached -> accepted), as the bench and AcceptanceCounts count it."""
    reached, accepted = [0] * n, [0] * n
    for top, k in rounds:
        for j in range(min(k + 1, top, n)):
            reached[j] += 1
            accepted[j] += j < k
    return [a / r if r else None for a, r in zip(accepted, reached)]


def expected(a: list[float | None], d: int) -> float:
    """E(d) = sum_{k<=d} prod_{j<k} a_j; a position never reached takes the last measured rate."""
    total, p, last = 0.0, 1.0, 0.5
    for k in range(d + 1):
        total += p
        if k < d:
            last = a[k] if k < len(a) and a[k] is not None else last
            p *= last
    return total


def two_state(texts: list[list[int]], at: int, top: int, lengths: list[int]) -> dict:
    """E(d) as a busy edge's shared length evaluates it (edge_worker/ratecurve.mixture_curve): acceptance per
    position counted apart for blocks after a rejected block (or none) and after a fully accepted one, measured
    while drafting `at`, each shrunk toward the pooled rates as EdgeEstimates.class_rates does."""
    from specrelay.edge_worker.draftlen import PRIOR_WEIGHT
    from specrelay.edge_worker.ratecurve import mixture_curve

    counts = {True: ([0] * top, [0] * top), False: ([0] * top, [0] * top)}  # after a miss -> (reached, accepted)
    for bits in texts:
        after_miss = True
        for sent, k in replay(bits, at):
            reached, accepted = counts[after_miss]
            for j in range(min(k + 1, sent, top)):
                reached[j] += 1
                accepted[j] += j < k
            after_miss = not (sent > 0 and k == sent)
    pooled, last = [], 0.5
    for a in rates([r for bits in texts for r in replay(bits, at)], top):
        last = a if a is not None else last
        pooled.append(last)
    shrunk = {m: [(a + PRIOR_WEIGHT * p) / (r + PRIOR_WEIGHT) for r, a, p in zip(*counts[m], pooled)]
              for m in counts}
    curve = mixture_curve(shrunk[True] + [pooled[-1]], shrunk[False] + [pooled[-1]], lambda d, p: 1.0, top)
    return {d: round(curve[d][0], 3) for d in lengths}


def tokens_per_call(texts: list[list[int]], d: int) -> float:
    rounds = [r for bits in texts for r in replay(bits, d)]
    return sum(map(len, texts)) / len(rounds)


def report(texts: list[list[int]], lengths: list[int]) -> dict:
    top = max(lengths)
    truth = {d: tokens_per_call(texts, d) for d in lengths}
    rows = []
    for at in lengths:
        pooled = rates([r for bits in texts for r in replay(bits, at)], top)
        own = [rates(replay(bits, at), top) for bits in texts]
        mixture = {d: sum(map(len, texts)) / sum(len(b) / expected(a, d) for b, a in zip(texts, own) if b)
                   for d in lengths}
        after = [r for bits in texts for r in replay(bits, at)]
        restarts = sum(1 for (t, k) in after[:-1] if k < t) / max(1, len(after) - 1)
        rows.append({"measured_at": at, "acceptance_per_position": [round(x, 4) for x in pooled[:at] if x is not None],
                     "blocks_after_a_rejection": round(restarts, 3),
                     "pooled_product": {d: round(expected(pooled, d), 3) for d in lengths},
                     "per_prompt": {d: round(v, 3) for d, v in mixture.items()},
                     "two_state": two_state(texts, at, top, lengths)})
    return {"tokens_per_call": {d: round(v, 4) for d, v in truth.items()}, "extrapolated": rows}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lengths", default="2,4,8,12")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    out = report(match_bits(args.num_prompts, args.max_new_tokens), lengths)
    print("tokens per call, replayed:", "  ".join(f"d={d}: {v:.4f}" for d, v in out["tokens_per_call"].items()))
    for row in out["extrapolated"]:
        print(f"rates measured at d={row['measured_at']} ({row['blocks_after_a_rejection']:.0%} of blocks start "
              f"after a rejection): a = {row['acceptance_per_position'][:6]}")
        for name in ("pooled_product", "per_prompt", "two_state"):
            print(f"  E(d) {name:>14}: " + "  ".join(f"d={d}: {v:.2f}" for d, v in row[name].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
