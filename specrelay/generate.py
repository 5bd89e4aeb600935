"""`specrelay generate`: prompts through the broker with an in-process edge, results on stdout.

Everything that can be checked cheaply is checked before torch loads (the prompts file, the flags, the model
directories, the device), then the broker and a live worker (within --connect-timeout): a mistake costs seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings

from .cliargs import UsageError


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


def check_sampling(args) -> None:
    """What the flag types cannot see alone (mode against temperature), without importing torch."""
    mode = "coupled" if args.resample == "coupled" else args.mode
    if mode == "greedy" and args.temperature > 0:
        raise UsageError("--mode greedy needs --temperature 0")
    if mode in ("sample", "coupled") and args.temperature == 0:
        raise UsageError(f"--mode {mode} needs --temperature > 0")
    if args.temperature > 100:
        raise UsageError("--temperature must be in [0, 100]")


def session_config(args, max_new_tokens: int | None = None):
    """The sampling flags -> SessionConfig. `--resample coupled` (before --mode existed) still selects the
    coupled mode, with a deprecation warning."""
    from .common.protocol import Mode, Strategy
    from .common.sampling import SamplingParams
    from .edge_worker.frontend import default_mode
    from .edge_worker.server import EdgeConfig
    from .edge_worker.session import SessionConfig

    mode, resample = args.mode, args.resample
    if resample == "coupled":
        warnings.warn("--resample coupled is deprecated: use --mode coupled", DeprecationWarning, stacklevel=2)
        print("specrelay: --resample coupled is deprecated, use --mode coupled", file=sys.stderr)
        mode, resample = "coupled", "srdv"
    config = SessionConfig(max_new_tokens=max_new_tokens or args.max_new_tokens,
                           params=SamplingParams(args.temperature, args.top_k, args.top_p),
                           mode=default_mode(EdgeConfig(), args.temperature, Mode[mode.upper()] if mode else None),
                           seed=args.seed,
                           draft_len=None if args.draft_len == "auto" else int(args.draft_len),
                           resample=Strategy[resample.upper()], objective=args.objective)
    config.resolved_mode()  # greedy vs temperature, checked now
    return config


async def generate_all(args, prompts: list[str], emit) -> int:
    """Generate every prompt (at most `--concurrency` at once); `emit(i, result)` runs for each prompt in input
    order, as soon as it and all earlier ones are done. A failed prompt is a result with an `error` field.
    Returns the number of failed prompts."""
    from .cli import client_curve
    from .common.errors import AuthenticationFailed
    from .edge_worker.loading import load_edge
    from .edge_worker.server import EdgeConfig

    edge = await load_edge(args.broker, args.draft_model, args.target_tokenizer, device=args.device,
                           dtype=args.dtype, config=EdgeConfig(retry_budget_s=args.retry_budget),
                           curve=client_curve(args))
    config = session_config(args)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> dict:
        async with gate:
            try:
                ids = edge.tokenizer(prompt).input_ids
                generated, stats = await edge.generate(ids, config)
            except AuthenticationFailed:
                raise  # nothing will work: one line, exit 1
            except Exception as exc:  # reported as this prompt's result; the others go on
                return {"prompt": prompt, "error": f"{type(exc).__name__}: {exc}"}
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
        print(f"--- failed: {result['error']}", file=sys.stderr, flush=True)
    else:
        s = result["stats"]
        print(result["prompt"] + result["text"], flush=True)
        print(f"--- {s['generated_tokens']} tokens, {s['cloud_calls']} cloud calls, accepted "
              f"{s['accepted_tokens']}/{s['draft_tokens']} drafted, {s['wall_s']:.2f}s", file=sys.stderr, flush=True)


def main(args) -> int:
    from .cli import check_edge_models
    from .edge_worker.probe import probe_broker
    from .runtime import run_async, set_threads

    prompts = read_prompts(args)
    check_sampling(args)
    check_edge_models(args)

    from .cli import client_curve

    curve = client_curve(args)

    async def run() -> int:
        def on_wait(what: str) -> None:  # a broker or worker still starting: say so, once
            print(f"specrelay generate: {what} (up to {args.connect_timeout:g} s, --connect-timeout)",
                  file=sys.stderr, flush=True)

        await probe_broker(args.broker, args.connect_timeout, curve=curve, on_wait=on_wait)
        set_threads()
        return await generate_all(args, prompts, lambda i, result: print_result(args, result))

    return 1 if run_async(run()) else 0
