"""`specrelay` command line: broker, cloud-worker, edge-worker, serve, generate, demo, bench.

`--broker` (cloud-worker, edge-worker, generate) is repeatable and takes comma lists: several brokers
(common/brokers.py); `--broker-key` names one key for all of them or one per broker.

Every flag also reads SPECRELAY_<COMMAND>_<FLAG> / SPECRELAY_<FLAG> (specrelay/cliargs.py). A mistake ends in one
line on stderr: exit 2 for a usage error (a flag, a file, a model directory, a device), 1 when something it needs
is not there (the broker, a live worker), 130 on Ctrl-C; `--debug` shows the traceback instead. Building the
parser imports no torch, so --help, --version and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__, cliargs, logs
from .cliargs import Parser, UsageError
from .cliflags import (bench_flags, broker_flags, cloud_worker_flags, demo_flags, edge_worker_flags, generate_flags,
                       keys_flags, serve_flags)
from .preflight import check_edge_models, check_ports, client_curve

SERVER_LOG_LEVEL, CLIENT_LOG_LEVEL = "info", "warning"
EPILOG = """Every flag also reads an environment variable: SPECRELAY_<COMMAND>_<FLAG>, else SPECRELAY_<FLAG>
(e.g. SPECRELAY_CLOUD_WORKER_MAX_BATCH=16 or SPECRELAY_MAX_BATCH=16); a flag on the command line wins.
Exit codes: 0 ok, 1 failed (broker or worker unreachable, a generation failed), 2 usage error, 130 interrupted."""


# ------------------------------------------------------------------------------------------ servers

def cmd_keys(args) -> int:
    from .common import auth
    public, secret = auth.generate(args.dir, args.name)
    print(f"wrote {public} (public: list it in the broker's --edge-keys or --worker-keys directory, or pass it "
          f"as --broker-key)\nwrote {secret} (secret, mode 0600: this process's --curve-secret)")
    return 0


def cmd_broker(args) -> int:
    from .broker.server import serve
    from .broker.quotas import Limits
    from .runtime import run_async

    check_ports(args)
    limits = Limits(max_sessions_per_client=args.max_sessions_per_client,
                    max_prompt_tokens_per_client=args.max_prompt_tokens_per_client, edge_ttl=args.edge_ttl)
    run_async(serve(args.frontend, args.backend, health_port=args.health_port, health_host=args.health_host,
                    limits=limits, curve_secret=args.curve_secret, edge_keys=args.edge_keys,
                    worker_keys=args.worker_keys, insecure=args.insecure, max_rss_mb=args.max_rss_mb or None))
    return 0


def cmd_cloud_worker(args) -> int:
    from .common.modelsource import check_device, check_model
    from .runtime import ignore_sighup, run_async, set_threads

    check_model(args.model, "--model")
    check_device(args.device)
    check_ports(args)
    ignore_sighup()
    curve = client_curve(args)
    set_threads()
    from .cloud_worker.server import serve
    from .edge_worker.routing.probe import warn_if_unreachable

    async def main() -> None:
        warning = warn_if_unreachable(args.broker, args.connect_timeout, worker=False, curve=curve)
        await serve(args.broker, args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                    max_wait_ms=args.max_wait_ms, health_port=args.health_port, health_host=args.health_host,
                    max_cache_bytes=int(args.max_cache_mb * 2**20), kv_cache_fraction=args.kv_cache_fraction,
                    deterministic=args.deterministic, prefill_tokens=args.prefill_tokens, attention=args.attention,
                    max_step_tokens=args.max_step_tokens, curve=curve)
        warning.cancel()

    run_async(main())
    return 0


def cmd_edge_worker(args) -> int:
    from .runtime import ignore_sighup, run_async, set_threads

    check_edge_models(args)
    check_ports(args)
    ignore_sighup()
    curve = client_curve(args)
    set_threads()
    from .edge_worker.config import EdgeConfig
    from .edge_worker.routing.probe import warn_if_unreachable
    from .edge_worker.server import serve

    async def main() -> None:
        warning = warn_if_unreachable(args.broker, args.connect_timeout, curve=curve)
        config = EdgeConfig(retry_budget_s=args.retry_budget, max_context=args.max_model_len,
                            insecure_listen=args.insecure, client_keys=args.client_keys,
                            default_objective=args.objective, default_trees=args.trees)
        await serve(args.broker, args.draft_model, args.listen, args.target_tokenizer, device=args.device,
                    dtype=args.dtype, config=config, curve=curve, http=args.http, http_limits=http_limits(args),
                    served_model_name=args.served_model_name, health_port=args.health_port,
                    health_host=args.health_host)
        warning.cancel()

    run_async(main())
    return 0


def cmd_serve(args) -> int:
    from .common.modelsource import check_model
    from .runtime import run_async, set_threads

    from .onebox import health_port, serve

    check_model(args.model, "--model")
    args.target_tokenizer = args.target_tokenizer or args.model  # one box holds the target: its tokenizer is known
    check_edge_models(args)
    args.health_port = health_port(args)  # on by default, beside --http
    check_ports(args)
    set_threads()

    run_async(serve(args, http_limits(args)))
    return 0


def http_limits(args):
    from .edge_worker.http.guards import limits_from_args

    return limits_from_args(args)


# ------------------------------------------------------------------------------------------ clients

def cmd_generate(args) -> int:
    from .generate import main as generate_main

    return generate_main(args)


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(args)


def cmd_bench(args) -> int:
    from .bench import main as bench_main

    return bench_main(args.rest)


# ------------------------------------------------------------------------------------------ parser

COMMANDS = [  # name, help, what it runs, its default log level, its flags
    ("broker", "route edges to cloud workers", cmd_broker, SERVER_LOG_LEVEL, broker_flags),
    ("cloud-worker", "hold the target model and verify drafts in batches", cmd_cloud_worker, SERVER_LOG_LEVEL,
     cloud_worker_flags),
    ("edge-worker", "hold the draft model and serve clients (ZeroMQ, and HTTP with --http)", cmd_edge_worker,
     SERVER_LOG_LEVEL, edge_worker_flags),
    ("serve", "one box: broker, cloud worker and edge in one process behind the OpenAI HTTP API", cmd_serve,
     SERVER_LOG_LEVEL, serve_flags),
    ("generate", "generate through the broker with an in-process edge", cmd_generate, CLIENT_LOG_LEVEL,
     generate_flags),
    ("keys", "CURVE key pairs for the broker, cloud workers and edges", cmd_keys, CLIENT_LOG_LEVEL, keys_flags),
    ("demo", "broker + cloud worker + edge on 127.0.0.1 with the demo pair", cmd_demo, CLIENT_LOG_LEVEL,
     demo_flags),
    ("bench", "benchmarks (python -m specrelay.bench --help)", cmd_bench, CLIENT_LOG_LEVEL, bench_flags),
]


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="specrelay", description="Edge-cloud speculative decoding over ZeroMQ.", epilog=EPILOG,
                formatter_class=cliargs.HelpFormatter)
    ap.add_argument("--version", action="version", version=f"specrelay {__version__}")
    ap.add_argument("--log-level", choices=logs.LEVELS, default=None,
                    help=f"{SERVER_LOG_LEVEL} for servers, {CLIENT_LOG_LEVEL} for generate and demo")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help, fn, log_level, flags in COMMANDS:
        p = sub.add_parser(name, help=help, description=help, epilog=EPILOG, formatter_class=cliargs.HelpFormatter)
        p.set_defaults(fn=fn, log_default=log_level)
        flags(p)
    return cliargs.finish(ap, aliases={"models_dir": "SPECRELAY_MODELS"})


# ------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None, environ=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] in (["-h"], ["--help"]):  # the benchmarks' own help: every subcommand
        from .bench import main as bench_main
        return bench_main(argv[1:])
    args = cliargs.parse(parser(), argv, environ)
    logs.configure(args.log_level or args.log_default)
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        code, message = describe(exc)
        print(f"specrelay {args.command}: error: {message}", file=sys.stderr)
        return code


def describe(exc: BaseException) -> tuple[int, str]:
    """(exit code, one line) for an error that ends a command."""
    from .common.errors import ConfigError, InvalidRequest, SpecRelayError

    def line(text: str) -> str:
        return " ".join(str(text).split()) or type(exc).__name__

    if isinstance(exc, (UsageError, ConfigError)):
        return 2, line(exc)
    if isinstance(exc, InvalidRequest):  # a flag the session checks refused: said in the flags' words
        return 2, line(flag_words(str(exc), exc.field))
    if isinstance(exc, (SpecRelayError, OSError)):
        return 1, line(exc)
    return 1, f"internal error: {type(exc).__name__}: {line(exc)} (run with --debug for the traceback)"


def flag_words(text: str, field: str | None) -> str:
    """A SessionConfig refusal in the flags' words: "mode greedy needs temperature 0" -> "--mode greedy needs
    --temperature 0" (a refusal that names no setting gets its field's flag in front)."""
    import dataclasses
    import re

    from .common.sampling import SamplingParams
    from .edge_worker.config import SessionConfig

    names = {f.name for cls in (SessionConfig, SamplingParams) for f in dataclasses.fields(cls)}
    flagged = re.sub(r"\b[a-z][a-z_]*\b", lambda m: "--" + m[0].replace("_", "-") if m[0] in names else m[0], text)
    return flagged if flagged != text or not field else f"--{field.replace('_', '-')}: {text}"


if __name__ == "__main__":
    sys.exit(main())
