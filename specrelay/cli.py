"""`specrelay` command line: broker, cloud-worker, edge-worker, generate, demo, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import warnings
from pathlib import Path

from . import logs
from .runtime import run_async, set_threads

ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = str(ROOT / "models" / "demo-target")
DEMO_DRAFT = str(ROOT / "models" / "demo-draft")
MODES = ("greedy", "sample", "coupled")
STRATEGIES = ("full", "hr", "srdv")


# ------------------------------------------------------------------------------------------ servers

def cmd_broker(args) -> int:
    from .broker.server import serve
    run_async(serve(args.frontend, args.backend, health_port=args.health_port, health_host=args.health_host))
    return 0


def cmd_cloud_worker(args) -> int:
    set_threads()
    from .cloud_worker.server import serve
    run_async(serve(args.broker, args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                    max_wait_ms=args.max_wait_ms, health_port=args.health_port, health_host=args.health_host,
                    max_cache_bytes=int(args.max_cache_mb * 2**20)))
    return 0


def cmd_edge_worker(args) -> int:
    set_threads()
    from .edge_worker.loading import serve
    from .edge_worker.server import EdgeConfig
    config = EdgeConfig(health_port=args.health_port, health_host=args.health_host)
    run_async(serve(args.broker, args.draft_model, args.listen, args.target_tokenizer, device=args.device,
                    config=config))
    return 0


# ------------------------------------------------------------------------------------------ generate

def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    prompts = []
    with open(args.prompts, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise SystemExit(f"{args.prompts}:{n}: expected a JSON object with a \"prompt\" string")
    return prompts


def session_config(args, max_new_tokens: int | None = None):
    """The sampling flags -> SessionConfig. `--resample coupled` (before --mode existed) still selects the
    coupled mode, with a deprecation warning."""
    from .common.protocol import Mode, Strategy
    from .common.sampling import SamplingParams
    from .edge_worker.session import SessionConfig

    mode, resample = args.mode, args.resample
    if resample == "coupled":
        warnings.warn("--resample coupled is deprecated: use --mode coupled", DeprecationWarning, stacklevel=2)
        print("specrelay: --resample coupled is deprecated, use --mode coupled", file=sys.stderr)
        mode, resample = "coupled", "srdv"
    return SessionConfig(max_new_tokens=max_new_tokens or args.max_new_tokens,
                         params=SamplingParams(args.temperature, args.top_k, args.top_p),
                         mode=Mode[mode.upper()] if mode else None, seed=args.seed,
                         draft_len=None if args.draft_len == "auto" else int(args.draft_len),
                         resample=Strategy[resample.upper()])


async def generate_all(args, prompts: list[str], emit) -> int:
    """Generate every prompt (at most `--concurrency` at once); `emit(i, result)` runs for each prompt in input
    order, as soon as it and all earlier ones are done. A failed prompt is a result with an `error` field.
    Returns the number of failed prompts."""
    from .edge_worker.loading import load_edge

    if args.concurrency < 1:
        raise SystemExit("--concurrency must be >= 1")
    edge = await load_edge(args.broker, args.draft_model, args.target_tokenizer, device=args.device)
    config = session_config(args)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> dict:
        async with gate:
            try:
                ids = edge.tokenizer(prompt).input_ids
                generated, stats = await edge.generate(ids, config)
            except Exception as exc:  # reported as this prompt's result; the others go on
                return {"prompt": prompt, "error": f"{type(exc).__name__}: {exc}"}
            return {"prompt": prompt, "text": edge.tokenizer.decode(generated), "token_ids": generated,
                    "stats": stats}

    async with edge:
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        failed = 0
        for i, task in enumerate(tasks):
            result = await task
            failed += "error" in result
            emit(i, result)
        return failed


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


def cmd_generate(args) -> int:
    set_threads()
    prompts = read_prompts(args)
    failed = run_async(generate_all(args, prompts, lambda i, result: print_result(args, result)))
    return 1 if failed else 0


def cmd_demo(args) -> int:
    from .demo import main as demo_main
    return demo_main(args)


def cmd_bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args.rest)


# ------------------------------------------------------------------------------------------ parser

def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-len", default="auto", help="tokens drafted per cloud call, or 'auto' (adaptive); "
                   "0 = target alone through the same path")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="default: greedy at temperature 0, else sample; coupled = shared Gumbel noise")
    from .common.protocol import DEFAULT_STRATEGY

    p.add_argument("--resample", choices=(*STRATEGIES, "coupled"), default=DEFAULT_STRATEGY.name.lower(),
                   help="what a rejection sends down in sample mode: full | hr | srdv")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specrelay", description="Edge-cloud speculative decoding over ZeroMQ.")
    ap.add_argument("--log-level", default=None, help="debug | info | warning (env SPECRELAY_LOG)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("broker", help="route edges to cloud workers")
    p.add_argument("--frontend", default="tcp://127.0.0.1:5555", help="endpoint edges connect to")
    p.add_argument("--backend", default="tcp://127.0.0.1:5556", help="endpoint cloud workers connect to")
    p.add_argument("--health-port", type=int, default=None, help="HTTP /healthz, /readyz and /metrics port")
    p.add_argument("--health-host", default="127.0.0.1", help="address the health port binds (0.0.0.0 in a pod)")
    p.set_defaults(fn=cmd_broker)

    p = sub.add_parser("cloud-worker", help="hold the target model and verify drafts in batches")
    p.add_argument("--broker", default="tcp://127.0.0.1:5556", help="the broker's backend endpoint")
    p.add_argument("--model", default=DEMO_TARGET, help="target model directory or hub id")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="longest wait to fill a batch")
    p.add_argument("--max-cache-mb", type=float, default=2048, help="KV cache cap; LRU sessions evicted past it")
    p.add_argument("--health-port", type=int, default=None, help="HTTP /healthz, /readyz and /metrics port")
    p.add_argument("--health-host", default="127.0.0.1", help="address the health port binds (0.0.0.0 in a pod)")
    p.set_defaults(fn=cmd_cloud_worker)

    p = sub.add_parser("edge-worker", help="hold the draft model and serve local clients")
    p.add_argument("--broker", default="tcp://127.0.0.1:5555", help="the broker's frontend endpoint")
    p.add_argument("--draft-model", default=DEMO_DRAFT)
    p.add_argument("--target-tokenizer", default=None, help="the target's tokenizer when it differs from the draft's")
    p.add_argument("--listen", default="ipc:///tmp/specrelay-edge.sock", help="endpoint clients connect to")
    p.add_argument("--device", default="cpu")
    p.add_argument("--health-port", type=int, default=None, help="HTTP /healthz, /readyz and /metrics port")
    p.add_argument("--health-host", default="127.0.0.1", help="address the health port binds (0.0.0.0 in a pod)")
    p.set_defaults(fn=cmd_edge_worker)

    p = sub.add_parser("generate", help="generate through the broker with an in-process edge")
    p.add_argument("--broker", default="tcp://127.0.0.1:5555", help="the broker's frontend endpoint")
    p.add_argument("--draft-model", default=DEMO_DRAFT)
    p.add_argument("--target-tokenizer", default=None, help="the target's tokenizer when it differs from the draft's")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="one prompt")
    group.add_argument("--prompts", help='JSON lines file, {"prompt": ...} per line')
    add_sampling(p)
    p.add_argument("--concurrency", type=int, default=8, help="sessions in flight at once")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("demo", help="broker + cloud worker + edge on localhost with the demo pair")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("bench", help="benchmarks (python -m specrelay.bench --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
