"""Why `--trees auto` drafts trees or not: runs a `specrelay bench sweep` with its edges in this process and logs, for
every `--trees auto` shape() call, whether a tree reached the node floor and came out, beside the cloud's per-token
slope c1 the edge priced it at (est.cloud: a tree's nodes and the floor are priced at it); and for every tree round
its modelled tokens a call E, the pooled chain's E(d) at its depth, the spine's agreement and the path committed
(where an overestimate of E comes from: the chain part or the side branches). Prints tables, writes JSON.

    python scripts/tree_decisions.py -- sweep --no-plots --link 50ms --sessions 1 --draft-lens auto \\
        --objectives balanced --trees compare --control --num-prompts 8 --max-new-tokens 48 --repeat 2

`--slope-cap MS` reprices `--trees auto`'s shape() at a cloud slope of at most MS milliseconds a token (an
experiment, not in the code: what the decisions would be if the edge knew the worker's marginal cost at a tree's
width; `scripts/forward_widths.py` measures that cost, which is not a line in the tokens verified).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specrelay.edge_worker import session
from specrelay.edge_worker.policy import choose
from specrelay.edge_worker.trees import rounds

SHAPES: list[dict] = []
TREES: list[dict] = []
ROUNDS: list[dict] = []  # every round after an `auto` shape() call: its modelled (E, T) against its measured seconds
_LAST: dict = {}
AUTO: set[int] = set()  # the `--trees auto` edges' estimates (id): every other edge's rounds are the chain policy's


def _instrument(cap_s: float | None) -> None:
    pick, tree_rows, shape = choose.pick, choose.tree_rows, choose.DraftPolicy.shape
    count, request_for = rounds.TreeRounds._count, session.EdgeSession.request_for
    observe_round = choose.DraftPolicy.observe_round

    def probed_pick(rows, objective):
        best = pick(rows, objective)
        _LAST["pick"] = rows[best]
        _LAST.setdefault("picks", []).append(rows[best][:2])  # shape()'s: the two chain bars, then its decision
        return best

    def probed_tree_rows(est, chain, *args, **kwargs):
        out = tree_rows(est, chain, *args, **kwargs)
        _LAST["chain"], _LAST["trees"] = list(chain), len(out)
        return out

    def probed_shape(self, remaining, trees, *args, **kwargs):
        if trees != "auto":
            return shape(self, remaining, trees, *args, **kwargs)
        cloud, fit = self.edge.cloud, self.edge.cloud.fit
        if cap_s is not None:
            cloud.fit = lambda: (lambda f: (f[0], min(f[1], cap_s)))(fit())
        _LAST.update(chain=None, trees=0, pick=None, picks=[])
        AUTO.add(id(self.edge))
        t0 = time.perf_counter()
        try:
            out = shape(self, remaining, trees, *args, **kwargs)
            spent = time.perf_counter() - t0
            c1 = cloud.fit()[1] if cloud.known else None
        finally:
            if cap_s is not None:
                del cloud.fit  # the instance attribute: the class's fit again
        tree = out is not None and bool(out.widths) and _LAST["chain"] is not None
        SHAPES.append({"edge": id(self.edge), "c1_ms": None if c1 is None else 1000 * c1, "trees_over_floor":
                       _LAST["trees"], "tree": tree, "ms": 1000 * spent})
        self.probe_tree, self.probe_pick = None, (tree, _LAST["pick"], out.nodes if tree else 0)
        if tree:
            d = min(out.depth, len(_LAST["chain"]) - 1)
            self.probe_tree = {"depth": out.depth, "nodes": out.nodes, "modelled_e": _LAST["pick"][0],
                               "chain_e": _LAST["chain"][d], "after_tree": args[2] if len(args) > 2 else
                               kwargs.get("after_tree", True), "bars_e_t_ms": [(e, 1000 * t) for e, t in
                               _LAST["picks"][:2]], "modelled_t_ms": 1000 * _LAST["pick"][1]}
        return out

    def probed_request_for(self, block):
        self.probe_tree = getattr(self.policy, "probe_tree", None)
        return request_for(self, block)

    def probed_count(self, block, tree, path):
        decision = getattr(self.s, "probe_tree", None)
        if decision is not None:
            spine = rounds._spine(tree, set(block.nodes))
            same = next((k for k, (u, p) in enumerate(zip(spine, path)) if u != p), min(len(spine), len(path)))
            TREES.append(dict(decision, sent=len(block.nodes), committed=len(path) + 1, spine_committed=same + 1))
        return count(self, block, tree, path)

    def probed_observe_round(self, width, latency_s, hint, draft_s, *args, **kwargs):
        tree, picked, nodes = getattr(self, "probe_pick", (None, None, 0))
        self.probe_pick = (None, None, 0)
        prefilled = args[2] if len(args) > 2 else kwargs.get("prefilled")
        if picked is None and not prefilled and id(self.edge) not in AUTO:  # the chain policy's own rounds
            ROUNDS.append({"tree": None, "edge": id(self.edge), "width": width, "nodes": 0, "modelled_t_ms": 0.0,
                           "draft_ms": 1000 * (draft_s or 0.0), "wait_ms": 1000 * latency_s,
                           "handled_ms": 1000 * (kwargs.get("handled_s") or 0.0)})
        if picked is not None and not prefilled:
            ROUNDS.append({"tree": tree, "width": width, "nodes": nodes, "modelled_t_ms": 1000 * picked[1],
                           "draft_ms": 1000 * (draft_s or 0.0), "wait_ms": 1000 * latency_s,
                           "handled_ms": 1000 * (kwargs.get("handled_s") or 0.0)})
        return observe_round(self, width, latency_s, hint, draft_s, *args, **kwargs)

    choose.pick, choose.tree_rows, choose.DraftPolicy.shape = probed_pick, probed_tree_rows, probed_shape
    choose.DraftPolicy.observe_round = probed_observe_round
    rounds.TreeRounds._count, session.EdgeSession.request_for = probed_count, probed_request_for


def _mean_se(xs: list[float]) -> list[float]:
    if not xs:
        return []
    se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
    return [round(statistics.mean(xs), 3), round(se, 3)]


def summary() -> dict:
    bands = {}
    for low, high in ((0.0, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, float("inf"))):
        mine = [s for s in SHAPES if s["c1_ms"] is not None and low <= s["c1_ms"] < high]
        bands[f"{low}-{high}"] = {"shape_calls": len(mine), "a_tree_over_the_floor": sum(s["trees_over_floor"] > 0
                                  for s in mine), "tree_drafted": sum(s["tree"] for s in mine)}
    over = {"total": [t["modelled_e"] - t["committed"] for t in TREES],
            "chain_part": [t["chain_e"] - t["spine_committed"] for t in TREES],
            "side_branches": [(t["modelled_e"] - t["chain_e"]) - (t["committed"] - t["spine_committed"])
                              for t in TREES]}
    timed = {}
    groups = {"tree": [r for r in ROUNDS if r["tree"]], "chain": [r for r in ROUNDS if r["tree"] is False]}
    for edge in dict.fromkeys(r["edge"] for r in ROUNDS if r["tree"] is None):  # the other edges, one by one
        groups[f"another edge's ({len(groups) - 1})"] = [r for r in ROUNDS if r.get("edge") == edge]
    for kind, mine in groups.items():
        timed[kind] = {k: _mean_se([r[k] for r in mine]) for k in (
            "width", "modelled_t_ms", "draft_ms", "wait_ms", "handled_ms")} | {"rounds": len(mine)}
    bars = {}
    for after in (True, False):
        mine = [t for t in TREES if t.get("after_tree") == after and len(t.get("bars_e_t_ms", [])) == 2]
        bars[f"after_{'tree' if after else 'chain'}"] = {"rounds": len(mine)} | {
            k: _mean_se([f(t) for t in mine]) for k, f in (
                ("tree_e", lambda t: t["modelled_e"]), ("tree_t_ms", lambda t: t["modelled_t_ms"]),
                ("pooled_bar_e", lambda t: t["bars_e_t_ms"][0][0]),
                ("pooled_bar_t_ms", lambda t: t["bars_e_t_ms"][0][1]),
                ("own_bar_e", lambda t: t["bars_e_t_ms"][1][0]), ("own_bar_t_ms", lambda t: t["bars_e_t_ms"][1][1]),
                ("committed", lambda t: t["committed"]))}
    return {"tree_decisions_against_their_bars": bars, "shape_calls": len(SHAPES),
            "shape_ms": _mean_se([s["ms"] for s in SHAPES]), "timed_rounds": timed,
            "trees_drafted": sum(s["tree"] for s in SHAPES), "by_c1_ms": bands,
            "tree_rounds": len(TREES), "modelled_e": _mean_se([t["modelled_e"] for t in TREES]),
            "committed": _mean_se([t["committed"] for t in TREES]),
            "overestimate_mean_se": {k: _mean_se(v) for k, v in over.items()}, "rounds": TREES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="bench_results/tree_decisions.json")
    ap.add_argument("--slope-cap", type=float, default=None, metavar="MS",
                    help="reprice --trees auto at a cloud slope of at most MS ms a token (an experiment)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then a `specrelay bench sweep` command line")
    args = ap.parse_args()
    argv = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if argv[:1] != ["sweep"]:
        raise SystemExit("tree_decisions.py: give `-- sweep ... --trees auto|compare` (its edges run in-process)")
    _instrument(None if args.slope_cap is None else args.slope_cap / 1000)
    from specrelay.bench.cli import main as bench
    bench(argv)
    result = summary()
    print(f"--trees auto: {result['shape_calls']} shape() calls ({result['shape_ms']} ms each: mean, standard "
          f"error), {result['trees_drafted']} trees drafted")
    print("| cloud slope c1 (ms a token) | shape() calls | a tree over the floor | a tree drafted |")
    print("|---|---|---|---|")
    for band, row in result["by_c1_ms"].items():
        print(f"| {band} | " + " | ".join(str(v) for v in row.values()) + " |")
    print(f"tree rounds: {result['tree_rounds']}; modelled E {result['modelled_e']} against committed "
          f"{result['committed']} (mean, standard error); overestimate {result['overestimate_mean_se']}")
    for kind, row in result["tree_decisions_against_their_bars"].items():
        print(f"tree rounds {kind}: {row}")
    for kind, row in result["timed_rounds"].items():
        print(f"{kind} rounds: {row}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
