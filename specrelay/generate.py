"""`specrelay generate`: prompts through the broker(s) with an in-process edge, results on stdout.

Everything that can be checked cheaply is checked before torch loads (the prompts file, the flags through the
edge's own SessionConfig rules, the model directories, the device, the keys), then a broker with a live worker
(any of them, with several --broker; within --connect-timeout): a mistake costs seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys

from .cliargs import UsageError
from .preflight import check_edge_models, client_curve


def read_prompts(args) -> list[str]:
    """--prompt, or --prompts FILE (JSON lines, {"prompt": "..."}); UsageError names the file and line."""
    if args.prompt is not None:
        return [args.prompt]
    prompts = []
    try:
        with open(args.prompts, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    prompt = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    prompt = None
                if not isinstance(prompt, str):
                    raise UsageError(f'--prompts {args.prompts}:{n}: expected a JSON object with a "prompt" string')
                prompts.append(prompt)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts {args.prompts}: {getattr(exc, 'strerror', None) or exc}") from None
    if not prompts:
        raise UsageError(f"--prompts {args.prompts}: no prompts in the file")
    return prompts


def session_config(args, edge):
    """The sampling flags -> SessionConfig through the one door (edge_worker/config.py), before torch loads."""
    from .edge_worker import config

    return config.session_config(edge, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                 draft_len="auto" if args.draft_len == "auto" else int(args.draft_len),
                                 mode=args.mode, resample=args.resample, objective=args.objective, trees=args.trees)


async def generate_all(args, prompts: list[str], edge_config, config, emit, curve=None) -> int:
    """Generate every prompt with `config` (at most `--concurrency` at once); `emit(i, result)` runs for each
    prompt in input order, as soon as it and all earlier ones are done. A failed prompt is a result with an
    `error` field. Returns the number of failed prompts."""
    from .common.errors import AuthenticationFailed
    from .edge_worker.server import load_edge

    edge = await load_edge(args.broker, args.draft_model, args.target_tokenizer, device=args.device,
                           dtype=args.dtype, config=edge_config, curve=curve)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> dict:
        async with gate:
            try:
                ids = edge.tokenizer(prompt).input_ids
                generated, stats = await edge.generate(ids, config)
            except AuthenticationFailed:
                raise  # nothing will work: one line, exit 1
            except Exception as exc:  # reported as this prompt's result, with what was committed; the others go on
                committed = list(getattr(exc, "committed", None) or [])
                return {"prompt": prompt, "error": f"{type(exc).__name__}: {exc}",
                        "text": edge.tokenizer.decode(committed), "token_ids": committed}
            return {"prompt": prompt, "text": edge.tokenizer.decode(generated), "token_ids": generated,
                    "stats": stats}

    async with edge:
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        try:
            failed = 0
            for i, task in enumerate(tasks):
                result = await task
                failed += "error" in result
                emit(i, result)
            return failed
        finally:
            for task in tasks:
                task.cancel()


def print_result(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result), flush=True)
    elif "error" in result:
        if result["token_ids"]:  # the tokens committed before the failure are the target's: keep them
            print(result["prompt"] + result["text"], flush=True)
        print(f"--- failed after {len(result['token_ids'])} committed tokens: {result['error']}", file=sys.stderr,
              flush=True)
    else:
        s = result["stats"]
        print(result["prompt"] + result["text"], flush=True)
        print(f"--- {s['generated_tokens']} tokens, {s['cloud_calls']} cloud calls, accepted "
              f"{s['accepted_tokens']}/{s['draft_tokens']} drafted, {s['wall_s']:.2f}s", file=sys.stderr, flush=True)


def print_totals(results: list[dict]) -> None:
    """The run's figures over every prompt that finished (stderr): what `specrelay bench calls` reports per run."""
    stats = [r["stats"] for r in results if "stats" in r]
    tokens, calls = sum(s["generated_tokens"] for s in stats), sum(s["cloud_calls"] for s in stats)
    print(f"--- all: {len(stats)} of {len(results)} prompts, {tokens} tokens, {calls} cloud calls "
          f"({calls / max(1, tokens):.4f} a token)", file=sys.stderr, flush=True)


def main(args) -> int:
    from .edge_worker.config import EdgeConfig
    from .edge_worker.routing.probe import probe_brokers
    from .runtime import run_async, set_threads

    prompts = read_prompts(args)
    edge_config = EdgeConfig(retry_budget_s=args.retry_budget)
    config = session_config(args, edge_config)  # a refused flag ends here, before anything loads
    check_edge_models(args)
    curve = client_curve(args)

    async def run() -> int:
        waited = []

        def on_wait(what: str) -> None:  # a broker or worker still starting: say so, once
            waited.append(what)
            print(f"specrelay generate: {what} (up to {args.connect_timeout:g} s, --connect-timeout)",
                  file=sys.stderr, flush=True)

        found = await probe_brokers(args.broker, args.connect_timeout, curve=curve, on_wait=on_wait)
        if waited and len(args.broker) > 1:
            print(f"specrelay generate: a cloud worker answers through the broker at {found}", file=sys.stderr,
                  flush=True)
        set_threads()
        done = []

        def emit(i: int, result: dict) -> None:
            print_result(args, result)
            done.append(result)

        failed = await generate_all(args, prompts, edge_config, config, emit, curve)
        if len(prompts) > 1:
            print_totals(done)
        return failed

    return 1 if run_async(run()) else 0
