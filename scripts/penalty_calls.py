"""Cloud calls per token of penalised requests, with the draft penalised as the target is and without.

The demo pair, same vocabulary, greedy, presence 0.5 / frequency 0.3 / repetition 1.2, draft length 4, in-process
(specrelay/speculative.py: the edge and cloud cores the processes run). The output is the same either way (the
cloud's penalties make it exact); a draft that applies the same penalties is accepted more often.

    .venv/bin/python scripts/penalty_calls.py [--prompts 6] [--tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

from specrelay.common.penalties import Penalties
from specrelay.common.runner import ModelRunner
from specrelay.edge_worker.config import SessionConfig
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.paths import demo_model, models_dir
from specrelay.speculative import speculative_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    target, draft = ModelRunner.load(demo_model("demo-target")), ModelRunner.load(demo_model("demo-draft"))
    lines = (models_dir() / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:args.prompts]
    pen = Penalties(presence=0.5, frequency=0.3, repetition=1.2)
    rows, outputs = [], []
    for penalised in (True, False):
        drafter = Drafter(draft, target.vocab_size)
        drafter.penalises = penalised  # False: the draft proposes from its plain logits
        calls = tokens = 0
        out = []
        for prompt in prompts:
            ids = target.tokenizer(prompt).input_ids
            gen, stats = speculative_generate(drafter, target, ids, SessionConfig(
                max_new_tokens=args.tokens, draft_len=4, penalties=pen))
            calls, tokens = calls + stats["cloud_calls"], tokens + len(gen)
            out.append(gen)
        outputs.append(out)
        rows.append({"draft_penalised": penalised, "tokens": tokens, "cloud_calls": calls,
                     "calls_per_token": round(calls / tokens, 3), "load_average": os.getloadavg()[0]})
        print(rows[-1])
    print("outputs equal:", outputs[0] == outputs[1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "outputs_equal": outputs[0] == outputs[1]}, f, indent=1)


if __name__ == "__main__":
    main()
