"""Every flag of every `specrelay` command (argparse); `cli.py` wires them to the commands. An edge's defaults
are read from its config dataclasses (edge_worker/config.py), so a flag and the library agree. Environment
variables, one-line usage errors and help formatting come from `cliargs.py`."""

from __future__ import annotations

import argparse

from . import cliargs, defaults
from .common.brokers import MAX_BROKERS
from .common.protocol import DEFAULT_STRATEGY, Mode, Objective, Strategy
from .common.sampling import SamplingParams
from .edge_worker.config import TREES, EdgeConfig, HttpLimits, SessionConfig
from .paths import demo_model

MODES = tuple(m.name.lower() for m in Mode)
STRATEGIES = tuple(s.name.lower() for s in Strategy)
OBJECTIVES = tuple(o.name.lower() for o in Objective)  # what --draft-len auto optimises (docs/policy.md)
DTYPES = ("float32", "bfloat16", "float16")


BROKERS_MEAN = {  # what several --broker endpoints mean, per command
    "backend": "several (repeat the flag, or a comma list): this worker registers with every one and serves them "
               "all from one KV store",
    "frontend": "several (repeat the flag, or a comma list): each session goes to one of them (a stable choice per "
                "session), and a lost broker's sessions re-open on another with their committed context",
}


def add_broker(p, default: str, what: str) -> None:
    p.add_argument("--broker", action=cliargs.Extend, type=cliargs.endpoint_list, default=default,
                   limit=MAX_BROKERS, metavar="ENDPOINT", help=f"the broker's {what} endpoint; {BROKERS_MEAN[what]}")
    p.add_argument("--connect-timeout", type=cliargs.seconds, default=defaults.CONNECT_TIMEOUT_S,
                   help="seconds to wait for a broker (and a live cloud worker) before saying so")


def add_client_keys(p) -> None:
    p.add_argument("--curve-secret", default=None, metavar="FILE",
                   help="this process's CURVE key pair (NAME.key_secret from `specrelay keys generate`)")
    p.add_argument("--broker-key", action=cliargs.Extend, type=cliargs.path_list, default=None, metavar="FILE",
                   limit=MAX_BROKERS, help="the broker's public key (BROKER.key): one for every --broker, or one per "
                   "--broker in the same order (repeat the flag, or a comma list)")


def add_retry_budget(p) -> None:
    p.add_argument("--retry-budget", type=cliargs.nonneg_float, default=EdgeConfig.retry_budget_s, metavar="SECONDS",
                   help="how long a generation keeps retrying through consecutive failures (broker restart, "
                        "no live worker) before it fails")


def add_health(p, default: str = "off") -> None:
    p.add_argument("--health-port", type=cliargs.port, default=None,
                   help=f"HTTP port for /healthz, /readyz and /metrics (0 = any free port) [default: {default}]")
    p.add_argument("--health-host", default="127.0.0.1", help="address the health port binds (0.0.0.0 in a pod)")


def add_edge(p) -> None:
    p.add_argument("--draft-model", default=demo_model("demo-draft"), help="draft model: directory, .gguf or hub id")
    p.add_argument("--target-tokenizer", default=None,
                   help="the target's tokenizer (directory or hub id) when it differs from the draft's")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="draft model weights")


def add_target(p) -> None:
    from .cloud_worker.config import WorkerConfig as W  # the worker's defaults, defined once there

    p.add_argument("--model", default=demo_model("demo-target"), help="target model: directory, .gguf or hub id")
    p.add_argument("--max-batch", type=cliargs.positive_int, default=W.max_batch,
                   help="VERIFYs verified in one forward")
    p.add_argument("--max-wait-ms", type=cliargs.nonneg_float, default=W.max_wait_ms,
                   help="longest wait to fill a batch")


def add_http(p, default: str | None) -> None:
    p.add_argument("--http", type=cliargs.host_port, default=default,
                   metavar="HOST:PORT", help="serve the OpenAI-compatible HTTP API here")
    p.add_argument("--served-model-name", default=defaults.SERVED_MODEL_NAME,
                   help="the `model` name the HTTP API answers to")
    p.add_argument("--api-key", action=cliargs.Append, default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* (repeatable; each key gets a fair share)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="API keys, one a line (# comments)")
    p.add_argument("--max-concurrent-requests", type=cliargs.positive_int, default=HttpLimits.max_concurrent,
                   help="HTTP generations in flight; more get 429 with Retry-After")
    p.add_argument("--max-prompt-tokens-in-flight", type=cliargs.positive_int, default=HttpLimits.max_prompt_tokens,
                   help="prompt tokens of HTTP generations in flight (at most the broker's per-client quota)")
    p.add_argument("--http-read-timeout", type=cliargs.seconds, default=HttpLimits.header_timeout_s, metavar="SECONDS",
                   help="a request's head must arrive within this, its body within 3x (slow clients are closed)")
    p.add_argument("--max-model-len", type=cliargs.positive_int, default=None,
                   help="the target's context; a longer request is refused before any work (default: the target "
                        "config next to --target-tokenizer)")


def add_objective(p) -> None:
    p.add_argument("--objective", choices=OBJECTIVES, default=EdgeConfig.default_objective.name.lower(),
                   help="what --draft-len auto optimises: speed (the session's tokens/s), balanced (the fewest cloud "
                   "calls within 10%% of the best speed) or cloud (the fewest cloud calls per token, whatever the "
                   "session's speed); docs/policy.md")


def add_trees(p) -> None:
    p.add_argument("--trees", choices=TREES, default=EdgeConfig.default_trees,
                   help="token trees: off (chains), on (trees: several candidates where the draft is unsure), auto "
                   "(the shape policy chooses, chains included); same vocabulary only; docs/policy.md")


def add_sampling(p) -> None:
    p.add_argument("--max-new-tokens", type=cliargs.positive_int, default=SessionConfig.max_new_tokens,
                   help="tokens to generate per prompt")
    p.add_argument("--temperature", type=cliargs.nonneg_float, default=SamplingParams.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=cliargs.count, default=SamplingParams.top_k, help="0 = off")
    p.add_argument("--top-p", type=cliargs.probability, default=SamplingParams.top_p, help="1.0 = off")
    p.add_argument("--seed", type=cliargs.count, default=SessionConfig.seed, help="seed of the counter-based sampler")
    p.add_argument("--draft-len", type=cliargs.draft_len, default="auto",
                   help="tokens drafted per cloud call, or auto (adaptive); 0 = target alone through the same path")
    add_objective(p)
    add_trees(p)
    p.add_argument("--mode", choices=MODES, default=None,
                   help="greedy at temperature 0, else coupled (shared Gumbel noise: the fewest bytes); sample = "
                   "rejection sampling, its rejections resolved by --resample")
    p.add_argument("--resample", choices=STRATEGIES, default=DEFAULT_STRATEGY.name.lower(),
                   help="what a rejection sends down in --mode sample: srdv (fewest bytes) | hr | full")


def broker_flags(p) -> None:
    from .broker.quotas import Limits  # the broker's defaults, defined once there

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
    p.add_argument("--max-sessions-per-client", type=cliargs.positive_int, default=Limits.max_sessions_per_client,
                   help="open sessions per edge key")
    p.add_argument("--max-prompt-tokens-per-client", type=cliargs.positive_int,
                   default=Limits.max_prompt_tokens_per_client,
                   help="prompt tokens held by one edge key's open sessions")
    p.add_argument("--edge-ttl", type=cliargs.seconds, default=Limits.edge_ttl,
                   help="seconds an edge may stay silent before its sessions are closed for it")


def cloud_worker_flags(p) -> None:
    from .cloud_worker.config import ATTENTION_PATHS, WorkerConfig as W

    add_broker(p, defaults.BROKER_BACKEND, "backend")
    add_target(p)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="target model weights")
    p.add_argument("--kv-cache-mb", "--max-cache-mb", dest="max_cache_mb", type=cliargs.nonneg_float,
                   default=W.max_cache_bytes // 2**20,
                   help=f"size of the preallocated KV store (capped at {W.max_sessions} full-context sessions)")
    p.add_argument("--kv-cache-fraction", type=cliargs.nonneg_float, default=0.0,
                   help="cuda only: give the KV store this share (< 1) of the device memory free after loading "
                        "the model, instead of --kv-cache-mb")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a session's logits do not depend on the other sessions in its "
                        "batch or on prefill chunking, so seeded sampling repeats at any concurrency and after "
                        "failover (slower; see README)")
    p.add_argument("--prefill-tokens", type=cliargs.positive_int, default=W.prefill_tokens,
                   help="prompt tokens prefilled per forward pass, beside the running sessions' verification")
    p.add_argument("--attention", default=W.attention, choices=ATTENTION_PATHS,
                   help="one attention call per layer for the whole batch (batched) or one per session "
                        "(per-session); auto: batched on cuda, per-session on the cpu (docs/gpu.md)")
    p.add_argument("--max-step-tokens", type=cliargs.positive_int, default=W.max_step_tokens,
                   help="new tokens of the VERIFYs in one forward pass (tree nodes count; shared fairly by clients)")
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
    add_trees(p)


def serve_flags(p) -> None:
    add_target(p)
    add_edge(p)
    for action in p._actions:  # one box holds the target model: its tokenizer is the target's (cli.cmd_serve)
        if action.dest == "target_tokenizer":
            action.help = "the target's tokenizer (directory or hub id); when not given, --model's"
    add_http(p, defaults.HTTP)
    add_health(p, "the --http port + 1")
    add_objective(p)
    add_trees(p)


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
    p.add_argument("--no-pin", action="store_true", help="edge and cloud share every core (default: the edge on "
                   "CPU 0, broker and cloud worker on the others, as on separate machines)")


def bench_flags(p) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER)
