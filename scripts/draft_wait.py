"""What a drafting round's wait is spent on, and what the draft policy priced it at: runs `specrelay bench calls`
or `sweep` with its edge in this process, times every real draft job (queued behind the draft thread's batch or
pre-draft, drafting in its lockstep batch, handed back to the event loop), logs each timed round's waits for its
draft and its VERDICT beside the model's price of them just before (a chain's D(n) and W, a tree's D_S and W:
docs/policy.md), the draft wait line D(n) = c + s n over time, and per draft batch the other sessions' chain jobs a
second that came in meanwhile (what a tree batch holds up: EdgeEstimates.blocking). Prints tables, writes JSON.

    python scripts/draft_wait.py --out bench_results/draft_wait.json -- calls --max-new-tokens 48 --repeats 2 --xv
    python scripts/draft_wait.py -- sweep --no-plots --link 50ms --sessions 16 --draft-lens auto --trees auto

Arguments after `--` are a `specrelay bench calls` or `sweep` command line (its edges run here, so the probe sees
them; the broker and cloud worker are their usual processes on the cloud side's cores). A sweep's configurations
share the tables: probe one at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from specrelay.common import protocol
from specrelay.edge_worker import session
from specrelay.edge_worker.draft import batcher, drafter
from specrelay.edge_worker.policy import choose, estimates

EVENTS: list[dict] = []
_LOCK = threading.Lock()


def _log(**event) -> None:
    with _LOCK:
        EVENTS.append(event)


def _instrument() -> None:
    """Wrap the draft batcher, the drafter's lockstep batch and the wait line's update to log what they did."""
    draft, timed = batcher.DraftBatcher.draft, batcher.DraftBatcher._timed
    draft_batch, observe_waited = drafter.Drafter.draft_batch, estimates.EdgeEstimates.observe_waited

    async def probed_draft(self, job):
        job.probe = {"submit": time.perf_counter(), "busy": getattr(self, "probe_busy", None) or "idle"}
        block = await draft(self, job)
        if job.d > 0 and "start" in job.probe and "ready" in job.probe:
            _log(kind="job", end=time.perf_counter(), steps=block.steps, tree=not hasattr(block, "behind_trees"),
                 behind_trees=getattr(block, "behind_trees", False), **job.probe)
        return block

    def probed_timed(self, jobs, loop, ready=None, admit=None):
        self.probe_busy = "batch" if admit is not None else "predraft"
        try:
            return timed(self, jobs, loop, ready, admit)
        finally:
            self.probe_busy = None

    def probed_batch(self, jobs, ready=None, forwards=None, admit=None):
        _started(jobs)

        def probed_ready(i, block):
            getattr(jobs[i], "probe", {})["ready"] = time.perf_counter()
            ready(i, block)

        def probed_admit(rows):
            return _started(admit(rows))
        return draft_batch(self, jobs, probed_ready if ready else None, forwards, probed_admit if admit else None)

    observe_draft = estimates.EdgeEstimates.observe_draft

    def probed_observe_draft(self, rows, forwards, others=None):
        observe_draft(self, rows, forwards, others)
        if others is not None:  # a real draft batch: other sessions' chain jobs a second that came in (blocking)
            _log(kind="others", per_s=others, learnt=self.others.value)

    def probed_waited(self, steps, seconds):
        observe_waited(self, steps, seconds)
        _log(kind="line", t=time.perf_counter(), edge=id(self), line=self.draft_line(), step=self.step())

    batcher.DraftBatcher.draft, batcher.DraftBatcher._timed = probed_draft, probed_timed
    drafter.Drafter.draft_batch, estimates.EdgeEstimates.observe_waited = probed_batch, probed_waited
    estimates.EdgeEstimates.observe_draft = probed_observe_draft
    _instrument_rounds()


def _instrument_rounds() -> None:
    """Log each VERIFY round's measured waits beside what the model priced them at just before it learnt them
    (a chain's D(n) and W, a tree's D_S and W: edge_worker/policy/choose.py)."""
    observe_round = choose.DraftPolicy.observe_round

    def probed_round(self, width, latency_s, hint, draft_s, steps=0, catchup=False, prefilled=False, tree=None,
                     handled_s=None):
        edge = self.edge
        if draft_s is not None and not prefilled and not catchup and edge.waits.count:
            w0, w1 = edge.wait_line()
            if tree is None:
                priced = choose.wait_for(edge.draft_line(), steps)
            else:
                priced = choose.wait_for(edge.tree_line(), choose.tree_compute(edge, tree, steps))
            _log(kind="round", shape="chain" if tree is None else "tree", width=width, steps=steps, draft_s=draft_s,
                 latency_s=latency_s, priced_draft_s=priced, priced_latency_s=w0 + w1 * width)
        observe_round(self, width, latency_s, hint, draft_s, steps, catchup, prefilled, tree, handled_s)
    choose.DraftPolicy.observe_round = probed_round
    _instrument_yield()


def _instrument_yield() -> None:
    """Log each round's modelled tokens per call E and price T (what its shape was chosen at) beside the tokens
    its VERDICT committed. A chain's: its row at the session's own rates; a tree's: the objective's final pick."""
    pick, shape, choose_d = choose.pick, choose.DraftPolicy.shape, choose.DraftPolicy.choose
    request_for, apply = session.EdgeSession.request_for, session.EdgeSession.apply
    last_pick: list = [None]

    def probed_pick(rows, objective):
        best = pick(rows, objective)
        last_pick[0] = rows[best]
        return best

    def probed_shape(self, *args, **kwargs):
        out = shape(self, *args, **kwargs)
        self.probe_decision = ("tree", *last_pick[0]) if out is not None and last_pick[0] else None
        return out

    def probed_choose(self, remaining, *args, **kwargs):
        d = choose_d(self, remaining, *args, **kwargs)
        top = max(0, min(choose.MAX_LEN, remaining - 1))
        rows = choose.chain_rows(self.edge, self.own_rates(top + 1), top, cut=False)
        self.probe_decision = ("chain", *rows[d]) if d and self.fixed is None else None
        return d

    def probed_request_for(self, block):
        self.probe_round = getattr(self.policy, "probe_decision", None)
        return request_for(self, block)

    def probed_apply(self, reply):
        new = apply(self, reply)
        decision = getattr(self, "probe_round", None)
        if isinstance(reply, protocol.Verdict) and decision is not None:
            _log(kind="yield", shape=decision[0], modelled_e=decision[1], modelled_t=decision[2], committed=len(new))
        self.probe_round = None
        return new

    choose.pick, choose.DraftPolicy.shape, choose.DraftPolicy.choose = probed_pick, probed_shape, probed_choose
    session.EdgeSession.request_for, session.EdgeSession.apply = probed_request_for, probed_apply


def _started(jobs: list) -> list:
    now = time.perf_counter()
    for job in jobs:
        probe = getattr(job, "probe", None)
        if probe is not None and "start" not in probe:
            probe["start"] = now
    return jobs


def _runs(jobs: list[dict]) -> list[list[dict]]:
    """The jobs split into the bench's runs (a gap of over a second between two submits)."""
    jobs = sorted(jobs, key=lambda j: j["submit"])
    runs: list[list[dict]] = [[]]
    for job in jobs:
        if runs[-1] and job["submit"] - runs[-1][-1]["submit"] > 1.0:
            runs.append([])
        runs[-1].append(job)
    return [r for r in runs if r]


def _split(jobs: list[dict]) -> dict:
    ms = lambda xs: round(1000 * statistics.mean(xs), 2) if xs else None  # noqa: E731
    return {"jobs": len(jobs), "wait_ms": ms([j["end"] - j["submit"] for j in jobs]),
            "queued_ms": ms([j["start"] - j["submit"] for j in jobs]),
            "drafting_ms": ms([j["ready"] - j["start"] for j in jobs]),
            "handed_back_ms": ms([j["end"] - j["ready"] for j in jobs]),
            "forwards": round(statistics.mean(j["steps"] for j in jobs), 2) if jobs else None,
            "queued_ms_by_thread_state": {s: ms([j["start"] - j["submit"] for j in jobs if j["busy"] == s])
                                          for s in ("idle", "batch", "predraft")}}


def _bucket(width: int) -> int:
    """A row width's bucket: 1-4 alone (a row of 1 is a round at d = 0), then 5-8, 9-12, ..."""
    return width if width <= 4 else (width - 1) // 4 * 4 + 1


def _priced(rounds: list[dict]) -> dict:
    """Measured against priced waits of the timed rounds, by shape and row width (tokens verified: _bucket)."""
    out = {}
    for shape, low in sorted({(r["shape"], _bucket(r["width"])) for r in rounds}):
        mine = [r for r in rounds if r["shape"] == shape and _bucket(r["width"]) == low]
        mean = lambda key: round(1000 * statistics.mean(r[key] for r in mine), 2)  # noqa: E731
        out[f"{shape} {low}" if low <= 4 else f"{shape} {low}-{low + 3}"] = {
            "rounds": len(mine), "draft_ms": mean("draft_s"), "priced_draft_ms": mean("priced_draft_s"),
            "verify_ms": mean("latency_s"), "priced_verify_ms": mean("priced_latency_s")}
    return out


def _yields(rounds: list[dict]) -> dict:
    """Modelled against committed tokens per call, by shape and modelled E (1-2, 2-3, ...)."""
    out = {}
    for shape, low in sorted({(r["shape"], int(r["modelled_e"])) for r in rounds}):
        mine = [r for r in rounds if r["shape"] == shape and int(r["modelled_e"]) == low]
        mean = lambda key: round(statistics.mean(r[key] for r in mine), 3)  # noqa: E731
        out[f"{shape} {low}-{low + 1}"] = {"rounds": len(mine), "modelled_e": mean("modelled_e"),
                                           "committed": mean("committed"), "modelled_t_ms": 1000 * mean("modelled_t")}
    return out


def summary() -> dict:
    jobs = [e for e in EVENTS if e["kind"] == "job"]
    chains = [j for j in jobs if not j["tree"]]
    out = {"all": _split(jobs), "trees": _split([j for j in jobs if j["tree"]]),
           "chains_behind_trees": _split([j for j in chains if j["behind_trees"]]),
           "chains_not_behind_trees": _split([j for j in chains if not j["behind_trees"]]),
           "priced_by_width": _priced([e for e in EVENTS if e["kind"] == "round"]),
           "yield_by_modelled_e": _yields([e for e in EVENTS if e["kind"] == "yield"]), "runs": []}
    for run in _runs(jobs):
        t0 = run[0]["submit"]
        seconds = sorted({int(j["submit"] - t0) for j in run})
        out["runs"].append({"by_second": {s: _split([j for j in run if int(j["submit"] - t0) == s])
                                          for s in seconds}})
    others = [e for e in EVENTS if e["kind"] == "others"]
    out["draft_batches"] = {"count": len(others), "chain_jobs_per_s": _spread([e["per_s"] for e in others]),
                           "learnt_per_s": _spread([e["learnt"] for e in others])}
    lines = [e for e in EVENTS if e["kind"] == "line"]
    for edge in dict.fromkeys(e["edge"] for e in lines):
        mine = [e for e in lines if e["edge"] == edge]
        step = max(1, len(mine) // 12)
        out.setdefault("draft_line", []).append(
            [{"t_s": round(e["t"] - mine[0]["t"], 2), "c_ms": round(1000 * e["line"][0], 2),
              "s_ms": round(1000 * e["line"][1], 2), "t_ms": round(1000 * e["step"], 2)} for e in mine[::step]])
    return out


def _spread(xs: list[float]) -> list[float]:
    """[min, median, max] of xs, to 0.1 ([] for none)."""
    return [round(x, 1) for x in (min(xs), statistics.median(xs), max(xs))] if xs else []


def _print(result: dict) -> None:
    cols = ("jobs", "wait_ms", "queued_ms", "drafting_ms", "handed_back_ms", "forwards")
    print("| run | second | " + " | ".join(cols) + " | queued when idle / batch / pre-draft |")
    print("|---" * (len(cols) + 3) + "|")
    for i, run in enumerate(result["runs"]):
        for second, row in run["by_second"].items():
            q = row["queued_ms_by_thread_state"]
            print(f"| {i} | {second} | " + " | ".join(str(row[c]) for c in cols)
                  + f" | {q['idle']} / {q['batch']} / {q['predraft']} |")
    print("| jobs | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for key in ("trees", "chains_behind_trees", "chains_not_behind_trees"):
        print(f"| {key} | " + " | ".join(str(result[key][c]) for c in cols) + " |")
    print("| shape, tokens verified | rounds | draft ms | priced | verify ms | priced |")
    print("|---" * 6 + "|")
    for width, row in result["priced_by_width"].items():
        print(f"| {width} | " + " | ".join(str(v) for v in row.values()) + " |")
    print("| shape, modelled E | rounds | modelled E | committed | modelled T ms |")
    print("|---" * 5 + "|")
    for key, row in result["yield_by_modelled_e"].items():
        print(f"| {key} | " + " | ".join(str(v) for v in row.values()) + " |")
    b = result["draft_batches"]
    print(f"draft batches: {b['count']}; other sessions' chain jobs that came in during one, a second (min, median, "
          f"max): {b['chain_jobs_per_s']}; the edge's estimate after each: {b['learnt_per_s']}")
    for i, line in enumerate(result.get("draft_line", [])):
        print(f"edge {i}: draft wait line over time (s: c ms + s ms per forward; t: a forward's compute)")
        print("  " + ", ".join(f"{p['t_s']}: {p['c_ms']} + {p['s_ms']} ({p['t_ms']})" for p in line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="bench_results/draft_wait.json")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then a `specrelay bench calls|sweep` command line")
    args = ap.parse_args()
    _instrument()
    from specrelay.bench.cli import main as bench
    argv = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if argv[:1] not in (["calls"], ["sweep"]):
        raise SystemExit("draft_wait.py: give `-- calls ...` or `-- sweep ...` (a bench whose edge runs in-process)")
    bench(argv)
    result = summary()
    _print(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
