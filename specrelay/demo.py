"""`specrelay demo`: broker + cloud worker (child processes) + an in-process edge on 127.0.0.1, the demo pair.

Shows progress while the models load, then generates the prompts twice through the same path: target alone
(`--draft-len 0`, one cloud call per token) and speculative (the defaults: `auto` under the default objective),
and prints tokens/s of both, the acceptance rate, the cloud calls saved and bytes per token; then both again over
an emulated 50 ms link (a user-space delay relay, bench/link.py; `--link-ms 0` skips it), where what drafting
buys shows: on loopback on a small machine the draft model and the target share the CPU, so there is little
speed to win. `--json FILE` writes the same numbers.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from .cluster import LocalCluster
from .paths import models_dir
from .runtime import run_async

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n",
]
TOTALS = ("generated_tokens", "draft_tokens", "accepted_tokens", "cloud_calls", "resample_calls", "uplink_bytes",
          "downlink_bytes")


class Progress:
    """`with Progress("loading ..."):` one line on stderr, with the elapsed seconds ticking on a terminal."""

    def __init__(self, what: str) -> None:
        self.what, self.tty = what, sys.stderr.isatty()
        self._done = threading.Event()

    def __enter__(self) -> "Progress":
        self.t0 = time.perf_counter()
        if self.tty:
            print(f"{self.what} ...", end="", file=sys.stderr, flush=True)
        threading.Thread(target=self._tick if self.tty else self._announce, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            print(f"\r{self.what} ... {time.perf_counter() - self.t0:.0f} s", end="", file=sys.stderr, flush=True)

    def _announce(self) -> None:
        """Not a terminal (a log): one line at the end, and one at the start only for a step that takes a while."""
        if not self._done.wait(2.0):
            print(f"{self.what} ...", file=sys.stderr, flush=True)

    def __exit__(self, exc_type, *_) -> None:
        self._done.set()
        status = "done" if exc_type is None else "failed"
        print(f"{chr(13) if self.tty else ''}{self.what} ... {status} ({time.perf_counter() - self.t0:.1f} s)",
              file=sys.stderr, flush=True)


def totals(results: list[dict], wall: float) -> dict:
    total = {k: sum(r["stats"][k] for r in results) for k in TOTALS}
    n = max(1, total["generated_tokens"])
    return total | {"wall_s": wall, "tokens_per_s": total["generated_tokens"] / wall,
                    "cloud_calls_per_token": total["cloud_calls"] / n,
                    "round_trips_per_token": (total["cloud_calls"] + total["resample_calls"]) / n,
                    "acceptance_rate": total["accepted_tokens"] / max(1, total["draft_tokens"]),
                    "uplink_bits_per_token": 8 * total["uplink_bytes"] / n,
                    "downlink_bits_per_token": 8 * total["downlink_bytes"] / n}


def summary(spec: dict, alone: dict, sessions: int, objective: str = "balanced") -> list[str]:
    saved = 1 - spec["cloud_calls"] / max(1, alone["cloud_calls"])
    return [
        f"acceptance rate        {spec['acceptance_rate']:.1%} "
        f"({spec['accepted_tokens']}/{spec['draft_tokens']} drafted tokens accepted)",
        f"cloud calls            {spec['cloud_calls']} vs {alone['cloud_calls']} target alone: {saved:.0%} saved "
        f"({spec['cloud_calls_per_token']:.2f} per token; --draft-len auto, --objective {objective})",
        f"bytes per token        up {spec['uplink_bytes'] / max(1, spec['generated_tokens']):.1f}, down "
        f"{spec['downlink_bytes'] / max(1, spec['generated_tokens']):.1f} "
        f"({spec['downlink_bits_per_token']:.0f} bits down)",
        f"throughput             speculative {spec['tokens_per_s']:.1f} tokens/s, target alone "
        f"{alone['tokens_per_s']:.1f} tokens/s ({spec['tokens_per_s'] / max(1e-9, alone['tokens_per_s']):.2f}x; "
        f"{sessions} sessions in flight, loopback)",
    ]


def link_summary(spec: dict, alone: dict, rtt_ms: float) -> list[str]:
    """What speculation buys where a cloud call costs a round trip."""
    gain = spec["tokens_per_s"] / max(1e-9, alone["tokens_per_s"])
    return [f"over a {rtt_ms:g} ms link    speculative {spec['tokens_per_s']:.1f} tokens/s, target alone "
            f"{alone['tokens_per_s']:.1f} tokens/s ({gain:.2f}x): every cloud call saved is a round trip saved"]


LOOPBACK_NOTE = ("(on loopback the draft and the target share this machine's CPU and a cloud call costs no round "
                 "trip, so speculation saves cloud calls there but little time)")


async def run_demo(frontend: str, draft: Path, prompts: list[str], max_new_tokens: int,
                   temperature: float, resample: str | None = None, mode: str | None = None,
                   link_ms: float = 0.0, objective: str = "balanced", place_relay=None) -> dict:
    from .common import protocol as P
    from .edge_worker.config import SessionConfig, session_config
    from .edge_worker.server import load_edge

    with Progress(f"loading the draft model ({draft.name})"):
        target_tokenizer = None if draft.name == "demo-draft" else str(draft.parent / "demo-target")
        edge = await load_edge(frontend, str(draft), target_tokenizer)
    config = session_config(edge.config, max_new_tokens=max_new_tokens, temperature=temperature, seed=1, mode=mode,
                            resample=resample, objective=objective)
    async with edge:
        tok = edge.tokenizer
        ids = [tok(p).input_ids for p in prompts]
        await edge.generate(ids[0], SessionConfig(max_new_tokens=2))  # warm-up: first-call costs on both sides

        async def run(what: str, cfg: SessionConfig) -> tuple[list, float]:
            with Progress(f"generating {len(prompts)} prompts, {what}"):
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(edge.generate(i, cfg) for i in ids))
            return outs, time.perf_counter() - t0

        alone_config = replace(config, draft_len=0)
        alone, alone_wall = await run("target alone (--draft-len 0)", alone_config)
        spec, spec_wall = await run("speculative", config)
    linked = (await run_over_link(frontend, edge, ids, config, alone_config, link_ms, place_relay) if link_ms > 0
              else None)
    results = [{"prompt": p, "text": tok.decode(out), "token_ids": out, "stats": stats}
               for p, (out, stats) in zip(prompts, spec)]
    return {"results": results, "speculative": totals(results, spec_wall),
            "target_alone": totals([{"stats": s} for _, s in alone], alone_wall),
            "mode": config.mode.name.lower(),
            # greedy and coupled outputs are target-alone's exactly; sample mode matches it in distribution only
            "identical": [a for a, _ in alone] == [s for s, _ in spec] if config.mode != P.Mode.SAMPLE else None,
            "objective": config.objective.name.lower(), "link": linked}


async def run_over_link(frontend: str, edge, ids: list[list[int]], config, alone_config, rtt_ms: float,
                        place_relay=None) -> dict:
    """Target alone, then speculative, through a relay that delays each direction by rtt_ms / 2: a second edge
    (same draft model) connects to the broker through it. `place_relay(pid)`: put the relay on the cloud side."""
    from .bench.link import LinkRelay, LinkSpec
    from .edge_worker.server import EdgeWorker

    rows = {}
    with LinkRelay(LinkSpec.parse(f"{rtt_ms}ms"), frontend, rate_by="relay") as relay:
        if place_relay is not None and relay.proc is not None:
            place_relay(relay.proc.pid)
        async with EdgeWorker(relay.endpoint, edge.drafter, edge.tokenizer, edge.config) as far:
            await far.generate(ids[0], config)  # warm-up: auto learns this link's round trip
            for name, cfg in (("target_alone", alone_config), ("speculative", config)):
                with Progress(f"generating {len(ids)} prompts over a {rtt_ms:g} ms link, {name.replace('_', ' ')}"):
                    t0 = time.perf_counter()
                    outs = await asyncio.gather(*(far.generate(i, cfg) for i in ids))
                rows[name] = totals([{"stats": s} for _, s in outs], time.perf_counter() - t0)
    return {"rtt_ms": rtt_ms, **rows}


def load_prompts(args) -> list[str]:
    if not args.prompts:
        prompts = PROMPTS
    else:
        from .generate import read_prompts

        prompts = read_prompts(type("Args", (), {"prompt": None, "prompts": args.prompts}))
    return prompts[:args.limit] if args.limit else prompts


def main(args) -> int:
    models = models_dir(args.models_dir)
    prompts = load_prompts(args)
    target = models / "demo-target"
    print(f"demo pair in {models}", file=sys.stderr)
    with Progress(f"starting a broker and a cloud worker on 127.0.0.1 (loads {target.name})"):
        cluster = LocalCluster(str(target), pin=not getattr(args, "no_pin", False),
                               env={"SPECRELAY_LOG_LEVEL": args.log_level or "warning"}).__enter__()
    try:
        out = run_async(run_demo(cluster.frontend, models / args.draft, prompts, args.max_new_tokens,
                                 args.temperature, args.resample, args.mode, args.link_ms, args.objective,
                                 cluster.place_cloud))
    finally:
        cluster.stop()
    for r in out["results"]:
        print("=" * 72)
        print(r["prompt"] + r["text"])
    print("=" * 72)
    print("\n".join(summary(out["speculative"], out["target_alone"], len(prompts), out["objective"])))
    if out["link"]:
        print("\n".join(link_summary(out["link"]["speculative"], out["link"]["target_alone"], args.link_ms)))
    if out["speculative"]["tokens_per_s"] < 1.1 * out["target_alone"]["tokens_per_s"]:
        print(LOOPBACK_NOTE)
    if out["identical"] is not None:
        print(f"{out['mode']} output{' ' * (16 - len(out['mode']))}{'identical' if out['identical'] else 'DIFFERENT'} "
              "to target alone")
    if args.json:
        record = {k: v for k, v in out.items() if k != "results"} | {
            "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "draft": args.draft, "resample": args.resample or "default"}
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"-> {args.json}", file=sys.stderr)
    return 0 if out["identical"] in (None, True) else 1

