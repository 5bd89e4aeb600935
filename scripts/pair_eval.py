"""How well a demo draft serves the demo target while generating (models/metrics.json's generation fields):
run through the specrelay cores in-process, so it works across vocabularies. Used by
`scripts/train_demo_models.py eval`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for an uninstalled checkout


def generation_acceptance(models: Path, draft: str, n_prompts: int = 20, max_new: int = 64) -> dict:
    """Acceptance while generating from held-out prompts with the specrelay cores (works across vocabularies):
    greedy (accepted / drafted draft tokens) and sampling at temperature 1 (alpha estimate), draft length 4."""
    from specrelay.common.runner import ModelRunner
    from specrelay.common.sampling import SamplingParams
    from specrelay.edge_worker.loading import load_drafter
    from specrelay.edge_worker.config import SessionConfig
    from specrelay.speculative import speculative_generate_batch

    target = ModelRunner.load(str(models / "demo-target"))
    drafter, tok = load_drafter(str(models / draft), str(models / "demo-target"))
    prompts = [tok(json.loads(x)["prompt"]).input_ids
               for x in (models / "heldout_prompts.jsonl").read_text().splitlines()[:n_prompts]]
    out = {}
    for label, params in (("greedy", SamplingParams()), ("t1", SamplingParams(1.0))):
        configs = [SessionConfig(max_new_tokens=max_new, params=params, mode=None if params.greedy else "sample",
                                 seed=i, draft_len=4) for i in range(len(prompts))]
        res = speculative_generate_batch(drafter, target, prompts, configs)
        acc = sum(s["accepted_tokens"] for _, s in res) / max(1, sum(s["draft_tokens"] for _, s in res))
        calls = sum(s["cloud_calls"] for _, s in res) / sum(s["generated_tokens"] for _, s in res)
        out[f"generation_acceptance_{label}_d4"] = round(acc, 4)
        out[f"cloud_calls_per_token_{label}_d4"] = round(calls, 4)
    return out
