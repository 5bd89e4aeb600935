"""Uplink bits per token of an edge's first session with a cross-vocabulary pair (it sends the shared-vocabulary
bitmap) and of the sessions after it (they name it by hash), through a real broker and cloud worker.

    .venv/bin/python scripts/bitmap_uplink.py            # the demo pair (demo-draft-xv -> demo-target)
    .venv/bin/python scripts/bitmap_uplink.py --real     # SmolLM2-135M -> gemma-3-270m (make real-models)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPTS = ["The weather today is", "def add(a, b):\n", "La casa de mi abuela", "SELECT name FROM users WHERE"]


async def measure(target: str, draft: str, tokens: int) -> dict:
    from specrelay.bench.runs import run_sessions
    from specrelay.cluster import LocalCluster
    from specrelay.edge_worker.config import SessionConfig
    from specrelay.edge_worker.server import load_edge

    config = SessionConfig(max_new_tokens=tokens)
    with LocalCluster(target, startup_timeout=900) as cluster:
        async with await load_edge(cluster.frontend, draft, target) as edge:
            runs = [(await run_sessions(edge, [p], config, 1))[0][0] for p in PROMPTS]
    rows = [{"session": i + 1, "tokens": len(r.ids), "uplink_bytes": r.stats["uplink_bytes"],
             "uplink_bits_per_token": round(8 * r.stats["uplink_bytes"] / len(r.ids), 1)} for i, r in enumerate(runs)]
    return {"target": target, "draft": draft, "max_new_tokens": tokens, "sessions": rows,
            "load_average": os.getloadavg()}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true")
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    if args.real:
        pair = ROOT / "models/real/gemma-3-270m", ROOT / "models/real/smollm2-135m"
    else:
        pair = ROOT / "models/demo-target", ROOT / "models/demo-draft-xv"
    print(json.dumps(asyncio.run(measure(str(pair[0]), str(pair[1]), args.tokens)), indent=1))


if __name__ == "__main__":
    main()
