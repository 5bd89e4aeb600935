"""Alternating A/B runs of draft-policy variants: one `specrelay bench sweep` per arm per run, the arms in turn (their
order reversed every other run), each in a process of its own whose policy a patch file may change first. Prints per
arm and cell, run by run and as mean and standard error: `--trees auto` against the chain policy's tokens/s, its tree
rounds, its tokens a call over the chain policy's, and the control (the chain policy against its own copy: tokens/s,
tokens a call); with two arms, their paired difference run by run. Writes JSON.

    python scripts/policy_ab.py --runs 4 --arm code --arm noveto=/tmp/noveto.py -- sweep --no-plots --link 0 \\
        --sessions 1 --draft-lens auto --objectives balanced --trees compare --control --num-prompts 10 \\
        --max-new-tokens 48 --repeat 1

(10 slice runs: one pass over the Williams orders of those 5 configurations; the bench's warning where a size is
not a whole number of passes is printed here too.)

A patch file is Python run in the arm's process before the bench; it gets `patch(fn, [(old, new), ...])`, which
rebuilds a function or method from its source with those replacements (each must occur once) and returns it, e.g.

    from specrelay.edge_worker.policy import choose
    choose.DraftPolicy.shape = patch(choose.DraftPolicy.shape, [("if est.vetoed:", "if False:")])

(a property's source keeps its decorator: `Cls.prop = patch(Cls.prop.fget, ...)` gets the property back).

An arm without a file runs the code as it is. The edges run in the arm's process (the bench's), so a patch reaches
them; the broker and cloud worker are the bench's usual processes. One run's bar lines swing by several percent
(the control read 0.91-1.08x in one session on loopback): compare arms over several runs, not one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import runpy
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


def patch(fn, subs: list[tuple[str, str]]):
    """`fn` rebuilt from its source with `subs` applied (each `old` occurs exactly once), in its module's globals."""
    src = textwrap.dedent(inspect.getsource(fn))
    for old, new in subs:
        if src.count(old) != 1:
            raise SystemExit(f"policy_ab.py: {old!r} occurs {src.count(old)} times in {fn.__qualname__}, not once")
        src = src.replace(old, new)
    scope: dict = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), sys.modules[fn.__module__].__dict__, scope)
    return scope[fn.__name__]


def _child(patch_file: str, argv: list[str]) -> None:
    if patch_file:
        runpy.run_path(patch_file, init_globals={"patch": patch})
    from specrelay.bench.cli import main
    main(argv)


def measures(sweep: dict) -> dict[str, dict]:
    """Per cell (link, sessions, pre-drafting, objective): the bar lines of one sweep's JSON."""
    from specrelay.bench import treesweep

    bars, rows, out = sweep.get("bars", {}), sweep.get("rows", []), {}
    for cell, line in bars.get("trees_auto_vs_chain_policy", {}).items():
        def row(trees: str, copy: int = 0) -> dict:
            return next((r for r in rows if r["draft_len"] == "auto" and r["trees"] == trees
                         and bool(r.get("copy")) == bool(copy) and treesweep.cell(r) == cell), {})
        auto, chain, copy = row("auto"), row("off"), row("off", copy=1)

        def calls(a: dict, b: dict) -> float | None:  # a's tokens a call over b's
            return round(a["tokens_per_call"] / b["tokens_per_call"], 3) if a and b else None
        out[cell] = {"auto_vs_chain_policy": line["ratio"], "tree_round_share": line["tree_round_share"],
                     "tokens_per_call_vs_chain_policy": calls(auto, chain),
                     "control": bars.get("control", {}).get(cell, {}).get("ratio"),
                     "control_tokens_per_call": calls(chain, copy),
                     "outputs_identical": all(r["outputs_identical_to_target_alone"] for r in rows)}
    return out


def sweep_warnings(stderr: str) -> list[str]:
    """The lines of a sweep's stderr that warn about the run itself (`bench sweep: ...`), not its progress."""
    return [line for line in stderr.splitlines() if line.startswith("bench sweep:")]


def _mean_se(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
    return f"{statistics.mean(xs):.3f} ± {se:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME[=PATCH.py]",
                    help="an arm: a name, and a patch file run before the bench (none: the code); repeat")
    ap.add_argument("--runs", type=int, default=3, help="runs of every arm (default 3)")
    ap.add_argument("--out", default="bench_results/policy_ab.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then a `specrelay bench sweep` command line")
    args = ap.parse_args()
    argv = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if args.child is not None:
        return _child(args.child, argv)
    if argv[:1] != ["sweep"] or not any(a.startswith("--trees") for a in argv):
        raise SystemExit("policy_ab.py: give `-- sweep ... --trees compare|auto` (the bar lines it compares)")
    arms = dict(a.partition("=")[::2] for a in args.arm or ["code"])
    for name, path in arms.items():
        if path and not Path(path).is_file():
            raise SystemExit(f"policy_ab.py: arm {name}: no patch file {path}")
    results: dict[str, list[dict]] = {name: [] for name in arms}
    said: set[str] = set()
    print(f"policy_ab.py: {len(arms)} arm(s) x {args.runs} run(s), one sweep each; a line after each", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for name in list(arms)[::-1 if run % 2 else 1]:
                out, t0 = Path(tmp) / f"{name}-{run}", time.monotonic()
                done = subprocess.run([sys.executable, __file__, "--child", arms[name], "--", *argv, "--out",
                                       str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if done.returncode:
                    raise SystemExit(f"policy_ab.py: arm {name}, run {run + 1} failed:\n{done.stderr[-3000:]}")
                for line in sweep_warnings(done.stderr):  # the sweep's own warnings, each once (an uneven order:
                    if line not in said:  # docs/policy.md; a configuration whose generations failed)
                        said.add(line)
                        print(f"{name}, run {run + 1}: {line}", flush=True)
                got = measures(json.loads((out / "sweep.json").read_text()))
                results[name].append(got)
                print(f"run {run + 1}/{args.runs} {name} ({time.monotonic() - t0:.0f} s): " + "; ".join(
                    f"{cell}: {m}" for cell, m in got.items()), flush=True)
    cells = dict.fromkeys(c for runs in results.values() for got in runs for c in got)
    summary: dict = {}
    for cell in cells:
        print(f"\n{cell}")
        for name, runs in results.items():
            col = {k: [got.get(cell, {}).get(k) for got in runs] for k in (
                "auto_vs_chain_policy", "tree_round_share", "tokens_per_call_vs_chain_policy", "control",
                "control_tokens_per_call")}
            summary.setdefault(cell, {})[name] = col
            print(f"  {name}: " + "; ".join(f"{k} {_mean_se(v)} {v}" for k, v in col.items()))
        if len(arms) == 2:
            a, b = (summary[cell][name]["auto_vs_chain_policy"] for name in arms)
            diffs = [x - y for x, y in zip(a, b) if x is not None and y is not None]
            print(f"  {' - '.join(arms)} (auto vs the chain policy, paired by run): {_mean_se(diffs)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"argv": argv, "arms": arms, "runs": results, "summary": summary}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
