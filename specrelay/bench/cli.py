"""`specrelay bench NAME ...` (also `python -m specrelay.bench NAME ...`): every benchmark's command line.

Start with `specrelay bench first`: about a minute on a 2-core machine, the demo pair on loopback and over a
50 ms link, plots in bench_results/first/.

Each run writes OUT/<name>.json (schema: `specrelay bench schema`), a markdown table
OUT/<name>.md and PNG plots OUT/<name>_*.png; OUT defaults to ./bench_results. `report` turns whatever JSON is
in OUT into bench_results/benchmarks.md with the plots next to it (docs/benchmarks.md says what each measures).
The edge and the cloud side run on separate cores unless --no-pin (docs/single-host.md).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import textwrap
from pathlib import Path

from .runs import DEFAULT_OUT, DEMO_DRAFT, DEMO_DRAFT_XV, DEMO_TARGET, HelpFormatter, meta, write_result

FIRST_HELP = ("start here: about a minute (demo pair, loopback and a 50 ms link, d = 0, 4 and auto); plots in "
              "bench_results/first/")
FIRST = {"draft_lens": "0,4,auto", "sessions": 4, "num_prompts": 8, "max_new_tokens": 32,
         "out": f"{DEFAULT_OUT}/first"}  # a small sweep: the three configurations a reader compares first
FIRST_LINKS = ["0", "50ms"]  # where drafting costs time (loopback) and where it saves round trips

# benchmarks that live in their own module: NAME -> (module, function taking argv, what it measures)
EXTERNAL: dict[str, tuple[str, str, str]] = {
    "kv": ("specrelay.bench.kv", "main", "KV store, chunked prefill, determinism, tree verification"),
    "fuzz": ("specrelay.bench.fuzz", "main", "legit sessions under malformed / abusive traffic"),
    "xvdraft": ("specrelay.bench.xvdraft", "main", "cross-vocabulary drafts: plain vs distilled, TLI vs retok"),
    "draft": ("specrelay.bench.draft", "main", "the edge's lockstep draft step: in-place K/V vs restack"),
    "archs": ("specrelay.bench.archmatrix", "main", "the architecture matrix and the README's table"),
    "httpfuzz": ("specrelay.bench.httpfuzz", "main", "the edge's HTTP API and health ports under attack"),
    "broker": ("specrelay.bench.broker_load", "main", "round trips per broker core, fake workers and edges"),
    "gpu": ("specrelay.bench.gpucheck", "main", "the cloud worker on a device: exactness, step, attention paths"),
    "worker-abuse": ("specrelay.bench.worker_abuse", "main", "RESAMPLE floods, OPEN/CLOSE churn, long prefill"),
    "hostile-broker": ("specrelay.bench.hostile_broker", "main", "a hostile broker's OPEN flood beside an honest one"),
    "fairshare": ("specrelay.bench.fairshare", "main", "one client's tree flood against the others' share of a step"),
}
# what each benchmark of specrelay.bench.legacy measures (its --help)
LEGACY_HELP = {
    "wire": "bytes on the wire of each message kind, for d = 4 and d = 8",
    "srdv_k": "SR-DV candidates per round K: downlink bits per token (cross-vocabulary pair, T = 1)",
    "calls": "cloud calls per token through the broker, greedy, per --draft-len / --objective",
    "concurrency": "aggregate tokens/s at 16 concurrent sessions against one",
    "hf": "one session's tokens/s against HF assisted generation, outputs compared (--real: the real pair, "
          "bench/realhf.py)",
    "xvocab": "cross-vocabulary pair at T = 1: bits per token up and down per resampling mode",
}


def _models(p: argparse.ArgumentParser, draft: str = DEMO_DRAFT, target_tokenizer: str | None = None) -> None:
    p.add_argument("--target", default=DEMO_TARGET, help="target model directory or hub id (default: demo target)")
    p.add_argument("--draft", default=draft, help="draft model directory or hub id (default: demo draft)")
    p.add_argument("--target-tokenizer", default=target_tokenizer,
                   help="the target's tokenizer when the draft's vocabulary differs")
    p.add_argument("--prompts", default=None, help="JSON lines file, {\"prompt\": ...} per line (default: held-out "
                   "stdlib prompts); a bare number N means --num-prompts N")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generation (at most)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (edge and each worker; "
                   "default: one per core of its side, half the cores each with --no-pin)")


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, help="results directory")
    p.add_argument("--json", action="store_true", help="print JSON lines on stdout (the rows) instead of tables")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--tag", default="", help="suffix of the result file names (NAME-TAG.json)")
    p.add_argument("--no-pin", action="store_true", help="edge and cloud share every core (default: the edge side "
                   "on CPU 0, the cloud side - broker, workers, relay - on the others, as on separate machines)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="name", required=True,  # subcommands refuse prefixes too
                            parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False))
    add = lambda name, help, **kw: sub.add_parser(name, help=help, formatter_class=HelpFormatter,  # noqa: E731
                                                  description=textwrap.fill(kw.pop("description", help), 100), **kw)
    first = add("first", FIRST_HELP, description="The benchmark to run first, in about a minute: the demo pair on "
                "loopback and over a 50 ms link, the target alone (d = 0), d = 4 and auto, 4 sessions in flight. A "
                "sweep (`specrelay bench sweep --help`) with smaller defaults; it writes OUT/first.json, "
                "OUT/first.md and the plots OUT/first_*.png (throughput, cloud calls per token, acceptance, time "
                "per output token).")
    _sweep_flags(first, links="0 and 50ms")
    first.set_defaults(**FIRST)
    _sweep_flags(add("sweep", "tokens/s, cloud calls and acceptance per draft length, per emulated link"))
    _stress_flags(add("stress", "edge-worker, broker and cloud-worker processes under load for a duration"))
    _report_flags(add("report", "render bench_results/benchmarks.md (tables + plots) from the JSON in --out"))
    add("schema", "print the JSON schema of sweep rows and stress results")
    _legacy_parsers(add)
    for name, (_, _, what) in EXTERNAL.items():  # listed for --help; main() hands their arguments to the module
        add(name, f"{what} (specrelay bench {name} --help)")
    p = add("all", f"{', '.join(LEGACY_HELP)} at their default settings")
    _models(p)
    _output(p)
    return ap


def _sweep_flags(p: argparse.ArgumentParser, links: str = "0") -> None:
    _models(p)
    _output(p)
    p.add_argument("--link", action="append", default=None, metavar="RTT[,RATE]",
                   help=f"emulated edge<->broker link, e.g. 50ms or 50ms,20mbit (repeat for several; default: {links})")
    p.add_argument("--rate-by", choices=("auto", "tbf", "relay"), default="auto",
                   help="what limits a link's RATE: tbf on a veth pair into a namespace (needs root), the relay's "
                        "token bucket, or tbf when it can be set up (auto); the results say which ran")
    p.add_argument("--sessions", type=int, default=16, help="sessions in flight at once")
    p.add_argument("--draft-lens", default="0,2,4,8,auto", help="comma-separated draft lengths, 'auto' included")
    p.add_argument("--objectives", default="balanced",
                   help="what auto optimises, comma-separated (speed,balanced,cloud): one auto row each")
    p.add_argument("--predraft", choices=("on", "off", "compare"), default="on",
                   help="pre-drafting while a VERIFY is in flight; compare = every draft length with and without")
    p.add_argument("--trees", choices=("off", "on", "auto", "compare"), default="off",
                   help="token trees: off (chains), on (trees at every length), auto (auto lengths choose their "
                        "shape, chains included), compare (chains and trees); rows carry `shape`")
    p.add_argument("--control", action="store_true",
                   help="run each auto chain configuration twice, on edges of their own: the bar `control` (the "
                        "first's tokens/s over its copy's) is the noise any bar line between two configurations has")
    p.add_argument("--tree-nodes", default=None, metavar="N[,N...]",
                   help="node budgets of the tree rows at fixed lengths (default: the shape policy's)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per configuration, interleaved (tokens/s over all of them)")
    p.add_argument("--workers", type=int, default=1, help="cloud workers")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--mode", choices=("greedy", "sample", "coupled"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--xv", action="store_true", help="the cross-vocabulary pair (demo-draft-xv)")


def _stress_flags(p: argparse.ArgumentParser) -> None:
    _models(p)
    _output(p)
    p.add_argument("--edges", type=int, default=4)
    p.add_argument("--sessions-per-edge", type=int, default=16)
    p.add_argument("--cloud-workers", type=int, default=2)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load after the warm-up")
    p.add_argument("--warmup", type=float, default=None, help="seconds before RSS growth is measured from "
                   "(default: 10%% of --duration, at least 20 s)")
    p.add_argument("--link", default="0", metavar="RTT[,RATE]", help="emulated link of every edge")
    p.add_argument("--rate-by", choices=("auto", "tbf", "relay"), default="auto",
                   help="what limits a link's RATE: tbf on a veth pair into a namespace (needs root), the relay's "
                        "token bucket, or tbf when it can be set up (auto); the results say which ran")
    p.add_argument("--draft-len", default="auto")
    p.add_argument("--objective", choices=("speed", "balanced", "cloud"), default="balanced",
                   help="what auto optimises on every edge")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--xv", action="store_true", help="the cross-vocabulary pair (demo-draft-xv)")


def _report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--docs", default=f"{DEFAULT_OUT}/benchmarks.md", help="markdown file to write")
    p.add_argument("--images", default=f"{DEFAULT_OUT}/plots", help="directory the plots are copied to")
    p.add_argument("--merge", action="store_true", help="keep the sections of --docs that no result in --out "
                   "replaces (regenerate only what was rerun)")


def _legacy_parsers(add) -> None:
    """One subcommand per benchmark of specrelay.bench.legacy (`add(name, help)` makes a subparser)."""
    from .legacy import LEGACY

    xv = {"xvocab", "srdv_k"}
    for name in LEGACY:
        p = add(name, LEGACY_HELP[name])
        _models(p, DEMO_DRAFT_XV if name in xv else DEMO_DRAFT, DEMO_TARGET if name in xv else None)
        _output(p)
        if name == "calls":
            p.add_argument("--draft-len", default="auto", help="auto or a fixed length")
            p.add_argument("--objective", choices=("speed", "balanced", "cloud"), default="balanced",
                           help="what auto optimises")
            p.add_argument("--concurrency", type=int, default=8, help="sessions in flight at once")
            p.add_argument("--xv", action="store_true", help="the cross-vocabulary pair (demo-draft-xv)")
            p.add_argument("--link", default="0", metavar="RTT", help="emulated edge<->broker link (default 0)")
            p.add_argument("--repeats", type=int, default=1, help="run the pair of runs (the setting, then "
                           "--draft-len 0) this many times, interleaved, each with a fresh edge: every run's "
                           "figures, their medians and spread (one run's speed on a shared machine varies ~30 %%)")
            p.add_argument("--slice", type=int, default=0, metavar="N",
                           help="run the setting and --draft-len 0 N prompts at a time, taking turns, so that a "
                           "slow spell of a shared machine hits both alike (0: all the prompts, one run after the "
                           "other). Each turn ends with its last sessions running with fewer beside them: with "
                           "--concurrency above 1 that changes what is measured")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hf"] and "--real" in argv:  # the real pair (bench/realhf.py), not the demo pair's legacy run
        from .realhf import main as real_main
        return real_main([a for a in argv[1:] if a != "--real"])
    if argv and argv[0] in EXTERNAL:
        module, fn, _ = EXTERNAL[argv[0]]
        try:
            return getattr(importlib.import_module(module), fn)(argv[1:]) or 0
        except ModuleNotFoundError as exc:
            raise SystemExit(f"specrelay bench {argv[0]}: {module} is not installed ({exc})") from None
    args = parser().parse_args(argv)
    _normalise(args)
    import os

    from .. import logs
    os.environ.setdefault("SPECRELAY_LOG", "warning")  # child processes (broker, workers, edges) log warnings only
    logs.configure("warning")
    if hasattr(args, "threads"):
        from ..edge_worker.server import GIL_SWITCH_S
        sys.setswitchinterval(GIL_SWITCH_S)  # as in an edge-worker process (torch threads: the placement's)
    if args.name == "schema":
        from .schema import describe
        print(json.dumps(describe(), indent=1))
        return 0
    if args.name == "report":
        from .report import render_docs
        print(f"-> {render_docs(args.out, args.docs, args.images, args.merge)}", file=sys.stderr)
        return 0
    return _run(args, argv)


def _normalise(args: argparse.Namespace) -> None:
    prompts = getattr(args, "prompts", None)
    if prompts is not None and prompts.isdigit() and not Path(prompts).exists():
        args.prompts, args.num_prompts = None, int(prompts)  # `--prompts 20` of the first benchmarks
    if args.name == "first" and not args.link:
        args.link = list(FIRST_LINKS)
    if getattr(args, "xv", False):  # the cross-vocabulary demo pair
        args.draft, args.target_tokenizer = DEMO_DRAFT_XV, args.target


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from . import report
    from .legacy import LEGACY

    if args.name in ("first", "sweep", "stress"):
        bench = "sweep" if args.name == "first" else args.name  # first: a sweep with smaller defaults
        module = importlib.import_module(f".{bench}", __package__)
        result = {"bench": bench, "meta": meta(argv), **module.run(args)}
        name = args.name + (f"-{args.tag}" if args.tag else "")
        write_result(args.out, name, result)
        for png in report.write_outputs(args.out, name, result, plots=not args.no_plots):
            print(f"-> {png}", file=sys.stderr)
        rows = result.get("rows", [result.get("summary", {})])
        lines = [json.dumps(row) for row in rows] if args.json else report.console_lines(rows)
        print("\n".join(lines), flush=True)
        bars = report.bar_lines(result["bars"]) if bench == "sweep" else [json.dumps(result.get("bars", {}))]
        print("bars:", *bars, sep="\n  ", file=sys.stderr)
        return 0  # the run worked; whether a bar is met is in the result
    for name in LEGACY if args.name == "all" else [args.name]:
        print(f"== {name}", file=sys.stderr)
        bench_args = argparse.Namespace(**vars(args))
        if args.name == "all" and name in ("xvocab", "srdv_k"):  # the cross-vocabulary pair
            bench_args.draft, bench_args.target_tokenizer = DEMO_DRAFT_XV, args.target
        result = {"bench": name, "meta": meta(argv), **LEGACY[name](bench_args)}
        write_result(args.out, name, result)
        report.write_outputs(args.out, name, result, plots=not args.no_plots)
        print(json.dumps(result, indent=None if args.json else 1))
        if name == "wire":  # README's "Wire protocol" table, as tests/test_readme_wire.py expects it
            from .legacy import wire_markdown
            print(wire_markdown(result), file=sys.stderr)
    return 0
