"""Cloud calls per token of constrained speculative decoding (in-process reference, demo pair, same vocabulary).

    .venv/bin/python scripts/constrained_calls.py [--out constrained_calls.json]

Counts target verifications per generated token for a JSON-schema task at fixed draft lengths; counts do not
depend on the machine's load. The unconstrained run of the same prompts is printed beside it.
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


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, )
    ap.add_argument("--out", default="constrained_calls.json")
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = ModelRunner.load(str(ROOT / "models" / "demo-target"))
    draft = ModelRunner.load(str(ROOT / "models" / "demo-draft"))
    vocab = TokenVocab(target.tokenizer, target.model.config.vocab_size)
    spec = spec_from_request({"response_format": {"type": "json_schema", "json_schema": {"name": "pkg", "schema": SCHEMA}}})
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
