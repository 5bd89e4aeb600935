"""`specrelay bench xvdraft`: drafts with the target's vocabulary and without, side by side on the same prompts
(in-process: the same edge and cloud cores the network path runs, counting the same message bytes).

    python -m specrelay.bench.xvdraft [--prompts N] [--max-new-tokens N] [--out DIR]

Greedy: accepted/drafted, cloud calls per generated token, outputs identical to target-alone, and what the
rejections were: a *segmentation mismatch* when the rejected draft token and the target's token spell the
same text split differently (one's bytes are a prefix of the other's), else a *content mismatch*.
T = 1: downlink and uplink bits per generated token per resampling mode (sample + full | hr | srdv, coupled).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .runs import HelpFormatter, write_result

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"

DRAFTS = [  # (label, draft model, re-tokenise greedy blocks)
    ("same vocabulary (demo-draft)", "demo-draft", None),
    ("cross-vocab before (demo-draft-xv-plain, TLI)", "demo-draft-xv-plain", False),
    ("cross-vocab distilled, TLI", "demo-draft-xv", False),
    ("cross-vocab distilled, target boundaries", "demo-draft-xv", True),
]
SAMPLED = [("full", "sample", "full"), ("hr", "sample", "hr"), ("srdv", "sample", "srdv"),
           ("coupled", "coupled", "srdv")]


def classify(table):
    """observe() callback counting greedy rejections by kind; `table` maps a target id to its bytes."""
    from ..common import protocol as P

    counts = {"rejections": 0, "segmentation_mismatch": 0}

    def observe(request, reply) -> None:
        if isinstance(request, P.Verify) and isinstance(reply, P.Verdict) and reply.n_accepted < len(request.draft):
            x, y = table[request.draft[reply.n_accepted]] or b"", table[reply.next_token] or b""
            counts["rejections"] += 1
            counts["segmentation_mismatch"] += bool(x and y and x != y and (x.startswith(y) or y.startswith(x)))
    return counts, observe


def row(results, n_prompts: int) -> dict:
    n = sum(s["generated_tokens"] for _, s in results)
    return {"accepted_per_drafted": round(sum(s["accepted_tokens"] for _, s in results) /
                                          max(1, sum(s["draft_tokens"] for _, s in results)), 4),
            "cloud_calls_per_token": round(sum(s["cloud_calls"] for _, s in results) / n, 4),
            "downlink_bits_per_token": round(8 * sum(s["downlink_bytes"] for _, s in results) / n, 1),
            "uplink_bits_per_token": round(8 * sum(s["uplink_bytes"] for _, s in results) / n, 1),
            "resample_round_trips_per_token": round(sum(s["resample_calls"] for _, s in results) / n, 4),
            "generated_tokens": n, "prompts": n_prompts}


def run(args) -> dict:
    from ..common.runner import ModelRunner
    from ..common.sampling import SamplingParams
    from ..edge_worker.loading import load_drafter
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.xvocab.mapping import token_bytes
    from ..speculative import speculative_generate_batch, target_generate

    target = ModelRunner.load(str(MODELS / "demo-target"))
    texts = [json.loads(x)["prompt"] for x in (MODELS / "heldout_prompts.jsonl").read_text().splitlines()
             if x.strip()][:args.prompts]
    prompts = [target.tokenizer(t).input_ids for t in texts]
    refs = [target_generate(target, p, args.max_new_tokens) for p in prompts]
    table = token_bytes(target.tokenizer)
    out = {}
    for label, name, retokenize in DRAFTS:
        drafter, _ = load_drafter(str(MODELS / name), str(MODELS / "demo-target"))
        if retokenize is not None:
            drafter.retokenize = retokenize
        counts, observe = classify(table)
        greedy = speculative_generate_batch(drafter, target, prompts, [SessionConfig(args.max_new_tokens)] *
                                            len(prompts), observe=observe)
        entry = {"greedy": row(greedy, len(prompts)) | {
            "outputs_identical_to_target_alone": [ids for ids, _ in greedy] == refs,
            "rejections": counts["rejections"],
            "segmentation_mismatch_share": round(counts["segmentation_mismatch"] / max(1, counts["rejections"]), 4)}}
        if retokenize is not True:  # sampled modes do not re-tokenise: the TLI row holds for both
            for strategy, mode, resample in SAMPLED:
                configs = [SessionConfig(args.max_new_tokens, SamplingParams(1.0), mode=mode, seed=i,
                                         resample=resample) for i in range(len(prompts))]
                entry[f"t1_{strategy}"] = row(speculative_generate_batch(drafter, target, prompts, configs),
                                              len(prompts))
        out[label] = entry
        print(f"{label}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "drafts": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench xvdraft", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    result = run(args)
    write_result(args.out, "xvocab", result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
