"""Cloud calls per token of constrained speculative decoding (demo pair, same vocabulary).

    .venv/bin/python scripts/constrained_calls.py [--out constrained_calls.json]
    .venv/bin/python scripts/constrained_calls.py --real [--draft-len auto|N] [--out constrained_calls_real.json]

Counts target verifications per generated token for a JSON-schema task; counts do not depend on the machine's
load. Without --real: the in-process reference at fixed draft lengths. With --real: through the real path
(`specrelay broker` + `specrelay cloud-worker` as child processes, LocalCluster, an edge in this process) with
the edge's default flags (draft length auto), checking every output against HF `generate` under the same
grammar. The unconstrained run of the same prompts is printed beside each.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from specrelay.common.constraint import Constraint, TokenVocab, spec_from_request
from specrelay.common.runner import ModelRunner
from specrelay.constrained_ref import speculative

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"},
                                           "requires": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 4}},
          "required": ["name", "version", "requires"], "additionalProperties": False}
PROMPTS = ["config = ", "setup(**", "def metadata():\n    return ", "PACKAGE = ", "data = json.loads(",
           "    info = ", "result = ", "print("]


def real(args, target: ModelRunner, vocab: TokenVocab, spec) -> None:
    """Through LocalCluster and an edge, default flags; outputs checked against HF generate under the grammar."""
    import asyncio

    from specrelay.bench.runs import run_edge
    from specrelay.cluster import LocalCluster
    from specrelay.constrained_ref import ConstraintLogitsProcessor

    rows, outputs = [], {}
    with LocalCluster(str(ROOT / "models" / "demo-target"), threads=1) as cluster:
        for name, constraint in (("json_schema", spec), ("none", None)):
            out, wall = asyncio.run(run_edge(cluster.frontend, str(ROOT / "models" / "demo-draft"), PROMPTS, 1,
                                             max_new_tokens=args.max_new, constraint=constraint,
                                             draft_len=None if args.draft_len == "auto" else int(args.draft_len)))
            outputs[name] = [ids for ids, _ in out]
            tokens, calls = sum(s["generated_tokens"] for _, s in out), sum(s["cloud_calls"] for _, s in out)
            lengths: dict = {}
            for _, st in out:
                for d, n in st["rounds_by_draft_len"].items():
                    lengths[int(d)] = lengths.get(int(d), 0) + n
            rows.append({"constraint": name, "tokens": tokens, "calls": calls,
                         "calls_per_token": round(calls / tokens, 3), "wall_s": round(wall, 2),
                         "accepted_per_drafted": round(sum(st["accepted_tokens"] for _, st in out)
                                                       / max(1, sum(st["draft_tokens"] for _, st in out)), 3),
                         "rounds_by_draft_len": dict(sorted(lengths.items()))})
            print(json.dumps(rows[-1]))
    equal = []
    for prompt, got in zip(PROMPTS, outputs["json_schema"]):
        ids = target.tokenizer(prompt).input_ids
        ref = target.model.generate(torch.tensor([ids]), max_new_tokens=args.max_new, do_sample=False,
                                    logits_processor=[ConstraintLogitsProcessor(Constraint(vocab, spec), len(ids))],
                                    pad_token_id=target.tokenizer.eos_token_id)[0, len(ids):].tolist()
        equal.append(got == ref)
    print(json.dumps({"outputs_equal_hf_generate": all(equal), "loadavg": os.getloadavg()}))
    Path(args.out).write_text(json.dumps({"rows": rows, "outputs_equal_hf_generate": equal, "prompts": PROMPTS,
                                          "schema": SCHEMA, "path": "LocalCluster + edge", "draft_len": args.draft_len,
                                          "loadavg": os.getloadavg()}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, )
    ap.add_argument("--out", default="constrained_calls.json")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--real", action="store_true", help="through the broker and a cloud worker (LocalCluster)")
    ap.add_argument("--draft-len", default="auto", help="--real: the edge's draft length (auto: its default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = ModelRunner.load(str(ROOT / "models" / "demo-target"))
    draft = ModelRunner.load(str(ROOT / "models" / "demo-draft"))
    vocab = TokenVocab(target.tokenizer, target.model.config.vocab_size)
    spec = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {"name": "pkg", "schema": SCHEMA}}})
    if args.real:
        return real(args, target, vocab, spec)
    rows = []
    for k in (2, 4, 6, 8):
        for name, make in (("json_schema", lambda: Constraint(vocab, spec)), ("none", None)):
            stats, tokens = {}, 0
            for prompt in PROMPTS:
                ids = target.tokenizer(prompt).input_ids
                out = speculative(target.model, draft.model, ids, make, args.max_new, k=k,
                                  eos=target.tokenizer.eos_token_id, stats=stats)
                tokens += len(out)
            rows.append({"k": k, "constraint": name, "tokens": tokens, "calls": stats["calls"],
                         "calls_per_token": round(stats["calls"] / tokens, 3),
                         "accepted_per_drafted": round((tokens - stats["calls"]) / stats["drafted"], 3)})
            print(json.dumps(rows[-1]))
    Path(args.out).write_text(json.dumps({"rows": rows, "prompts": PROMPTS, "schema": SCHEMA,
                                          "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
