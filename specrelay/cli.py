"""`specrelay` command line: broker, cloud-worker, edge-worker, serve, generate, demo, bench.

Every flag also reads SPECRELAY_<COMMAND>_<FLAG> / SPECRELAY_<FLAG> (specrelay/cliargs.py). A mistake ends in one
line on stderr: exit 2 for a usage error (a flag, a file, a model directory, a device), 1 when something it needs
is not there (the broker, a live worker), 130 on Ctrl-C; `--debug` shows the traceback instead. Building the
parser imports no torch, so --help, --version and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__, cliargs, defaults, logs
from .cliargs import Parser, UsageError
from .paths import demo_model

MODES = ("greedy", "sample", "coupled")
STRATEGIES = ("full", "hr", "srdv")
OBJECTIVES = ("speed", "balanced", "cloud")  # what --draft-len auto optimises (docs/draftlen.md)
DTYPES = ("float32", "bfloat16", "float16")
SERVER_LOG_LEVEL, CLIENT_LOG_LEVEL = "info", "warning"
EPILOG = """Every flag also reads an environment variable: SPECRELAY_<COMMAND>_<FLAG>, else SPECRELAY_<FLAG>
(e.g. SPECRELAY_CLOUD_WORKER_MAX_BATCH=16 or SPECRELAY_MAX_BATCH=16); a flag on the command line wins.
Exit codes: 0 ok, 1 failed (broker or worker unreachable, a generation failed), 2 usage error, 130 interrupted."""


# ------------------------------------------------------------------------------------------ servers

def client_curve(args):
    """--curve-secret / --broker-key -> the client side of CURVE, or None (both or neither)."""
    if (args.curve_secret is None) != (args.broker_key is None):
        raise UsageError("--curve-secret and --broker-key go together")
    if args.curve_secret is None:
        return None
    from .common import auth
    from .common.errors import FatalError

    try:
        return auth.client(args.curve_secret, args.broker_key)
    except FatalError as exc:  # a key file that is not there or not a key: the flag is wrong
        raise UsageError(f"--curve-secret / --broker-key: {exc}") from None


def cmd_keys(args) -> int:
    from .common import auth
    public, secret = auth.generate(args.dir, args.name)
    print(f"wrote {public} (public: list it in the broker's --edge-keys or --worker-keys directory, or pass it "
          f"as --broker-key)\nwrote {secret} (secret, mode 0600: this process's --curve-secret)")
    return 0


def cmd_broker(args) -> int:
    from .broker.server import serve
    from .broker.table import Limits
    from .runtime import run_async

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
    ignore_sighup()
    curve = client_curve(args)
    set_threads()
    from .cloud_worker.server import serve
    from .edge_worker.probe import warn_if_unreachable

    async def main() -> None:
        warning = warn_if_unreachable(args.broker, args.connect_timeout, worker=False, curve=curve)
        await serve(args.broker, args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
                    max_wait_ms=args.max_wait_ms, health_port=args.health_port, health_host=args.health_host,
                    max_cache_bytes=int(args.max_cache_mb * 2**20), kv_cache_fraction=args.kv_cache_fraction,
                    deterministic=args.deterministic, prefill_tokens=args.prefill_tokens, curve=curve)
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
    from .edge_worker.loading import serve
    from .edge_worker.probe import warn_if_unreachable
    from .edge_worker.server import EdgeConfig

    async def main() -> None:
        warning = warn_if_unreachable(args.broker, args.connect_timeout, curve=curve)
        config = EdgeConfig(retry_budget_s=args.retry_budget, max_context=args.max_model_len,
                            insecure_listen=args.insecure, client_keys=args.client_keys,
                            default_objective=args.objective)
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

    check_model(args.model, "--model")
    check_edge_models(args)
    check_ports(args)
    set_threads()
    from .onebox import serve

    run_async(serve(args, http_limits(args)))
    return 0


def check_ports(args) -> None:
    """An HTTP or health port that is taken fails now, not after the models have loaded."""
    import socket

    from .common.errors import ConfigError

    wanted = [("--http", *args.http)] if getattr(args, "http", None) else []
    wanted += [("--health-port", args.health_host, args.health_port)] if args.health_port else []
    for flag, host, number in wanted:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, number))
            except OSError as exc:
                raise ConfigError(f"{flag}: cannot listen on {host}:{number}: {exc.strerror or exc}") from None


def http_limits(args):
    from .edge_worker.httpguard import limits_from_args

    return limits_from_args(args)


def check_edge_models(args) -> None:
    """The cheap checks before torch loads: the draft directory, the target tokenizer, the device."""
    from .common.modelsource import check_device, check_model

    check_model(args.draft_model, "--draft-model")
    if args.target_tokenizer:
        check_model(args.target_tokenizer, "--target-tokenizer", weights=False)
    check_device(args.device)


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

def add_broker(p, default: str, what: str) -> None:
    p.add_argument("--broker", default=default, help=f"the broker's {what} endpoint")
    p.add_argument("--connect-timeout", type=cliargs.seconds, default=defaults.CONNECT_TIMEOUT_S,
                   help="seconds to wait for the broker (and a live cloud worker) before saying so")


def add_client_keys(p) -> None:
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="this process's CURVE key pair (NAME.key_secret from `specrelay keys generate`)")
    p.add_argument("--broker-key", default=None, metavar="FILE", help="the broker's public key (BROKER.key)")


def add_retry_budget(p) -> None:
    p.add_argument("--retry-budget", type=cliargs.nonneg_float, default=30.0, metavar="SECONDS",
                   help="how long a generation keeps retrying through consecutive failures (broker restart, "
                        "no live worker) before it fails")


def add_health(p) -> None:
    p.add_argument("--health-port", type=cliargs.port, default=None,
                   help="HTTP port for /healthz, /readyz and /metrics (0 = any free port)")
    p.add_argument("--health-host", default="127.0.0.1", help="address the health port binds (0.0.0.0 in a pod)")


def add_edge(p) -> None:
    p.add_argument("--draft-model", default=demo_model("demo-draft"), help="draft model directory or hub id")
    p.add_argument("--target-tokenizer", default=None,
                   help="the target's tokenizer (directory or hub id) when it differs from the draft's")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="draft model weights")


def add_target(p) -> None:
    p.add_argument("--model", default=demo_model("demo-target"), help="target model directory or hub id")
    p.add_argument("--max-batch", type=cliargs.positive_int, default=32, help="VERIFYs verified in one forward")
    p.add_argument("--max-wait-ms", type=cliargs.nonneg_float, default=5.0, help="longest wait to fill a batch")


def add_http(p, default: str | None) -> None:
    p.add_argument("--http", type=cliargs.host_port, default=default,
                   metavar="HOST:PORT", help="serve the OpenAI-compatible HTTP API here")
    p.add_argument("--served-model-name", default=defaults.SERVED_MODEL_NAME,
                   help="the `model` name the HTTP API answers to")
    p.add_argument("--api-key", action=cliargs.Append, default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* (repeatable; each key gets a fair share)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="API keys, one a line (# comments)")
    p.add_argument("--max-concurrent-requests", type=cliargs.positive_int, default=64,
                   help="HTTP generations in flight; more get 429 with Retry-After")
    p.add_argument("--max-prompt-tokens-in-flight", type=cliargs.positive_int, default=1 << 19,
                   help="prompt tokens of HTTP generations in flight (at most the broker's per-client quota)")
    p.add_argument("--http-read-timeout", type=cliargs.seconds, default=10.0, metavar="SECONDS",
                   help="a request's head must arrive within this, its body within 3x (slow clients are closed)")
    p.add_argument("--max-model-len", type=cliargs.positive_int, default=None,
                   help="the target's context; a longer request is refused before any work (default: the target "
                        "config next to --target-tokenizer)")


def add_objective(p) -> None:
    p.add_argument("--objective", choices=OBJECTIVES, default="balanced",
                   help="what --draft-len auto optimises: speed (the session's tokens/s), balanced (the fewest cloud "
                   "calls within 10%% of the best speed) or cloud (the least cloud time per token, whatever the "
                   "session's speed); docs/draftlen.md")


def add_sampling(p) -> None:
    from .common.protocol import DEFAULT_STRATEGY

    p.add_argument("--max-new-tokens", type=cliargs.positive_int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=cliargs.nonneg_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=cliargs.count, default=0, help="0 = off")
    p.add_argument("--top-p", type=cliargs.probability, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=cliargs.count, default=0, help="seed of the counter-based sampler")
    p.add_argument("--draft-len", type=cliargs.draft_len, default="auto",
                   help="tokens drafted per cloud call, or auto (adaptive); 0 = target alone through the same path")
    add_objective(p)
    p.add_argument("--mode", choices=MODES, default=None,
                   help="greedy at temperature 0, else coupled (shared Gumbel noise: the fewest bytes); sample = "
                   "rejection sampling, its rejections resolved by --resample")
    p.add_argument("--resample", choices=(*STRATEGIES, "coupled"), default=DEFAULT_STRATEGY.name.lower(),
                   help="what a rejection sends down in --mode sample: srdv (fewest bytes) | hr | full")


def broker_flags(p) -> None:
    p.add_argument("--frontend", default=defaults.BROKER_FRONTEND, help="endpoint edges connect to")
    p.add_argument("--backend", default=defaults.BROKER_BACKEND, help="endpoint cloud workers connect to")
    add_health(p)
    p.add_argument("--curve-secret", default=None, metavar="FILE", help="the broker's CURVE key pair "
                   "(NAME.key_secret); with it both sockets require keys")
    p.add_argument("--edge-keys", default=None, metavar="DIR", help="public keys (NAME.key) edges may use "
                   "(re-read on SIGHUP)")
    p.add_argument("--worker-keys", default=None, metavar="DIR", help="public keys cloud workers may use "
                   "(re-read on SIGHUP)")
    p.add_argument("--insecure", action="store_true", help="allow binding a non-loopback address without keys")
    p.add_argument("--max-rss-mb", type=float, default=1024, metavar="MiB", help="exit (code 75) for a restart once "
                   "resident memory passes this (one huge multipart message can grow it; 0: no limit)")
    p.add_argument("--max-sessions-per-client", type=cliargs.positive_int, default=256,
                   help="open sessions per edge key")
    p.add_argument("--max-prompt-tokens-per-client", type=cliargs.positive_int, default=1 << 20,
                   help="prompt tokens held by one edge key's open sessions")
    p.add_argument("--edge-ttl", type=cliargs.seconds, default=10.0,
                   help="seconds an edge may stay silent before its sessions are closed for it")


def cloud_worker_flags(p) -> None:
    add_broker(p, defaults.BROKER_BACKEND, "backend")
    add_target(p)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="target model weights")
    p.add_argument("--kv-cache-mb", "--max-cache-mb", dest="max_cache_mb", type=cliargs.nonneg_float, default=2048,
                   help="size of the preallocated KV store (capped at 1024 full-context sessions)")
    p.add_argument("--kv-cache-fraction", type=cliargs.nonneg_float, default=0.0,
                   help="cuda only: give the KV store this share (< 1) of the device memory free after loading "
                        "the model, instead of --kv-cache-mb")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a session's logits do not depend on the other sessions in its "
                        "batch or on prefill chunking, so seeded sampling repeats at any concurrency and after "
                        "failover (slower; see README)")
    p.add_argument("--prefill-tokens", type=cliargs.positive_int, default=64,
                   help="prompt tokens prefilled per forward pass, beside the running sessions' verification")
    add_health(p)
    add_client_keys(p)


def edge_worker_flags(p) -> None:
    add_broker(p, defaults.BROKER_FRONTEND, "frontend")
    add_edge(p)
    p.add_argument("--listen", default=defaults.EDGE_ENDPOINT, help="ZeroMQ endpoint specrelay.Client connects to "
                   "(without --client-keys: loopback or ipc:// only, unless --insecure)")
    p.add_argument("--client-keys", default=None, metavar="DIR", help="public keys (NAME.key) of the applications "
                   "that may use --listen: CURVE with this edge's --curve-secret (clients pass its public key)")
    p.add_argument("--insecure", action="store_true", help="allow --listen on a non-loopback address: anyone who "
                   "reaches it can run generations on this edge's broker key")
    add_http(p, None)
    add_health(p)
    add_client_keys(p)
    add_retry_budget(p)
    add_objective(p)


def serve_flags(p) -> None:
    add_target(p)
    add_edge(p)
    add_http(p, defaults.HTTP)
    add_health(p)
    add_objective(p)


def generate_flags(p) -> None:
    add_broker(p, defaults.BROKER_FRONTEND, "frontend")
    add_edge(p)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="one prompt")
    group.add_argument("--prompts", help='JSON lines file, {"prompt": ...} per line')
    add_sampling(p)
    p.add_argument("--concurrency", type=cliargs.positive_int, default=8, help="sessions in flight at once")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    add_client_keys(p)
    add_retry_budget(p)


def keys_flags(p) -> None:
    keys = p.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    k = keys.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret (secret, 0600)",
                        formatter_class=cliargs.HelpFormatter)
    k.add_argument("dir", help="where the two files go")
    k.add_argument("--name", required=True, help="the key's name (NAME.key, NAME.key_secret)")
    k.set_defaults(fn=cmd_keys)


def demo_flags(p) -> None:
    p.add_argument("--models-dir", default=None, help="directory holding demo-target/ and demo-draft/ "
                   "(default: the copy inside the package, else ./models)")
    p.add_argument("--draft", default="demo-draft", choices=("demo-draft", "demo-draft-xv"),
                   help="the draft in the models directory (demo-draft-xv: a different vocabulary)")
    p.add_argument("--max-new-tokens", type=cliargs.positive_int, default=48, help="tokens per prompt")
    p.add_argument("--temperature", type=cliargs.nonneg_float, default=0.0, help="0 = greedy")
    p.add_argument("--prompts", default=None, help='JSON lines file, {"prompt": ...} per line (default: 4 built in)')
    p.add_argument("--limit", type=cliargs.positive_int, default=None, help="use the first N prompts")
    p.add_argument("--mode", choices=MODES, default=None, help="as for generate (default: the edge's)")
    p.add_argument("--resample", choices=STRATEGIES, default=None,
                   help="what a rejection sends down in sample mode (default: the edge's)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the numbers to FILE as JSON")
    add_objective(p)
    p.add_argument("--link-ms", type=cliargs.nonneg_float, default=50.0,
                   help="also run over an emulated link of this round trip (user-space relay); 0 = loopback only")


def bench_flags(p) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER)


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
    ("keys", "CURVE key pairs for the broker, cloud workers and edges", None, CLIENT_LOG_LEVEL, keys_flags),
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
    if isinstance(exc, InvalidRequest):  # a flag the sampling or session checks refused
        flag = f"--{exc.field.replace('_', '-')}: " if exc.field else ""
        return 2, flag + line(exc)
    if isinstance(exc, (SpecRelayError, OSError)):
        return 1, line(exc)
    return 1, f"internal error: {type(exc).__name__}: {line(exc)} (run with --debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
