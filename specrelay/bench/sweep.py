"""`specrelay bench sweep`: for every emulated link and draft length, tokens/s, cloud calls per token against
theory, acceptance per position, time per output token (TPOT), the gaps between streamed commits, and whether the
outputs equal the target alone's. `specrelay bench first` is a small sweep (about a minute) to look at first.

One broker and `--workers` cloud workers run as child processes; per link a relay (bench/link.py) sits in front
of the broker's frontend and in-process edges connect through it. Configurations run interleaved slice by slice
(`--sessions` prompts at a time, the order rotating), `--repeat` times, so a slow spell of a shared machine hits
them alike; tokens/s = all tokens / all wall time of a configuration. By default the edge side (this process)
runs on CPU 0 and the cloud side (broker, workers, relay) on the other CPUs (`--no-pin` to share), as if on
separate machines (specrelay/placement.py); every row records the placement and the load average.
`--draft-len 0` (the target alone through the same path) always runs: it is the reference for speed and output.
`auto` runs once per `--objectives` entry (rows carry `objective`), each on an edge of its own.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import theory, treesweep
from .treesweep import Config
from .link import LinkRelay, LinkSpec, measure_rtt
from ..common.protocol import Objective
from ..placement import stamp
from .plots import configuration, sample_key
from .runs import SessionRun, cpu_seconds, load_prompts, run_sessions, wall_split

AUTO = "auto"
OBJECTIVES = ("speed", "balanced", "cloud")


def parse_lens(text: str, objectives: str = "balanced") -> list[int | str]:
    """Draft lengths: integers, and `auto` once per objective as "auto:OBJECTIVE"; 0 always first."""
    chosen = [o.strip().lower() for o in objectives.split(",") if o.strip()]
    if not chosen or any(o not in OBJECTIVES for o in chosen):
        raise SystemExit(f"--objectives takes {', '.join(OBJECTIVES)}, got {objectives!r}")
    lens: list[int | str] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == AUTO:
            lens += [f"{AUTO}:{o}" for o in chosen]
        elif part.isdigit():
            lens.append(int(part))
        else:
            raise SystemExit(f"--draft-lens takes integers and 'auto', got {part!r}")
    return ([0] if 0 not in lens else []) + lens


def is_auto(d) -> bool:
    return isinstance(d, str) and d.startswith(AUTO)


def objective_of(d) -> str | None:
    """The objective of an "auto:OBJECTIVE" configuration; None for a fixed length."""
    return d.split(":", 1)[1] if is_auto(d) else None


@dataclass
class Tally:
    """Everything one configuration (link, draft length, pre-drafting) measured over its runs."""

    runs: list[list[SessionRun]] = field(default_factory=list)
    tokens: dict[int, int] = field(default_factory=dict)    # by repeat
    wall: dict[int, float] = field(default_factory=dict)    # by repeat
    cloud: dict[str, float] = field(default_factory=dict)   # cloud counters and CPU seconds, summed
    walls: list[float] = field(default_factory=list)        # each run's wall, in `runs` order

    def add(self, repeat: int, runs: list[SessionRun], wall: float, cloud_delta: dict[str, float]) -> None:
        self.runs.append(runs)
        self.walls.append(wall)
        self.tokens[repeat] = self.tokens.get(repeat, 0) + sum(len(r.ids) for r in runs)
        self.wall[repeat] = self.wall.get(repeat, 0.0) + wall
        for k, v in cloud_delta.items():
            self.cloud[k] = self.cloud.get(k, 0.0) + v

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens.values()) / sum(self.wall.values())

    @property
    def runs_tps(self) -> list[float]:
        return [self.tokens[r] / self.wall[r] for r in sorted(self.tokens)]

    @property
    def slices_tps(self) -> list[float]:
        """tokens/s of each slice run, in run order: the same slices, in the same order, for every configuration."""
        return [sum(len(r.ids) for r in runs) / max(wall, 1e-9) for runs, wall in zip(self.runs, self.walls)]

    @property
    def sessions(self) -> list[SessionRun]:
        return [r for runs in self.runs for r in runs]


def scrape(ports: list[int]) -> dict[str, float]:
    """Sum of the cloud workers' counters that matter here, read from their Prometheus /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"specrelay_cloud_verify_requests_total": "verify_requests",
              "specrelay_cloud_forward_passes_total": "forward_passes",
              "specrelay_cloud_forward_seconds_sum": "forward_seconds"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    out[wanted[sample.name]] += sample.value
    return out


def run(args) -> dict:
    from ..cluster import LocalCluster

    links = [LinkSpec.parse(x) for x in (args.link or ["0"])]
    lens = parse_lens(args.draft_lens, args.objectives)
    texts = load_prompts(args.prompts, args.num_prompts or max(8, 2 * args.sessions))
    configs = treesweep.expand([Config(d, p) for d in lens for p in _predraft_modes(args.predraft, d)],
                               args.trees, args.tree_nodes)
    if getattr(args, "control", False):  # the chain policy twice: the noise of a bar line (treesweep.control)
        configs += [c._replace(copy=1) for c in configs if is_auto(c.d) and c.trees == "off"]
    if note := uneven_order(args.repeat * -(-len(texts) // args.sessions), len(configs)):
        print(note, file=sys.stderr)
    rows, itl, tpot = [], {}, {}
    cluster = LocalCluster(args.target, workers=args.workers, max_batch=args.max_batch, threads=args.threads,
                           pin=not args.no_pin)
    with started(cluster, args.draft, args.target_tokenizer) as loaded:
        drafter, tokenizer = loaded
        for link in links:
            with LinkRelay(link, cluster.frontend, rate_by=args.rate_by) as relay:
                described = relay.described
                if relay.proc:
                    cluster.place_cloud(relay.proc.pid)
                probe = measure_rtt(relay.endpoint)
                cloud_pids = [proc.pid for proc in cluster.procs] + ([relay.proc.pid] if relay.proc else [])
                tallies = _run_async(_sweep_link(args, relay.endpoint, cluster.health_ports, cloud_pids, texts,
                                                 configs, drafter, tokenizer))
            for c, tally in tallies.items():
                row = stamp(make_row(args, link, described, probe, c, tally, tallies[Config(0, False)], len(texts)),
                            cluster.placement)
                rows.append(row)
                label = sample_key(row)  # the plots find a row's samples by it
                itl[label] = sorted(round(g, 2) for r in tally.sessions for g in r.gaps_ms())
                tpot[label] = sorted(round(t, 2) for r in tally.sessions if (t := r.tpot_ms()) is not None)
    bars = evaluate(rows)
    for f in bars["failed"]:  # the bars leave out a configuration that committed nothing: say why here
        print(f"bench sweep: {f['config']} over {f['link']}: {f['errors']} generation(s) failed: "
              f"{'; '.join(f['error_samples'])}", file=sys.stderr)
    return {"config": {"links": [x.label for x in links], "draft_lens": lens, "sessions": args.sessions,
                       "prompts": len(texts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeat,
                       "predraft": args.predraft, "trees": args.trees, "tree_nodes": args.tree_nodes,
                       "workers": args.workers, "temperature": args.temperature,
                       "placement": cluster.placement.describe(),
                       "mode": args.mode or ("greedy" if args.temperature == 0 else "sample")},
            "rows": rows, "bars": bars, "itl_ms_samples": itl, "tpot_ms_samples": tpot}


@contextmanager
def started(cluster, draft: str, target_tokenizer: str | None):
    """Start the cluster's processes while this process loads the draft model; yields (drafter, tokenizer) and
    stops the processes afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from ..edge_worker.loading import load_drafter

    try:
        cluster.catch_sigterm()  # a SIGTERM now stops the children too (the pool's thread cannot install it)
        cluster.place_caller()  # here: this thread starts the edge's draft thread (torch threads per thread)
        with ThreadPoolExecutor(1) as pool:
            up = pool.submit(cluster.__enter__)
            try:
                loaded = load_drafter(draft, target_tokenizer)
            finally:
                up.result()
        yield loaded
    finally:
        cluster.stop()


def _predraft_modes(choice: str, d: int | str) -> list[bool]:
    if d == 0:
        return [False]  # nothing to pre-draft for the target alone
    return {"on": [True], "off": [False], "compare": [True, False]}[choice]


def _run_async(coro):
    from ..runtime import run_async
    return run_async(coro)


async def _sweep_link(args, endpoint: str, worker_ports: list[int], pids: list[int], texts: list[str], configs,
                      drafter, tokenizer) -> dict:
    """Run every configuration on every slice of `sessions` prompts, slice by slice and configuration after
    configuration (in `orders`' orders, slice run after slice run), `repeat` times: a slow spell of a shared machine hits all alike. `auto`
    runs on an edge of its own (one per pre-drafting setting), so it learns only from its own rounds."""
    from contextlib import AsyncExitStack

    from tqdm.auto import tqdm

    from ..edge_worker.config import EdgeConfig
    from ..edge_worker.server import EdgeWorker

    tallies, order = {c: Tally() for c in configs}, orders(len(configs))
    slices = [texts[i:i + args.sessions] for i in range(0, len(texts), args.sessions)]
    async with AsyncExitStack() as stack:
        edges = {}
        # A throwaway edge takes the process's first drafts (torch's cold start), not the first measured edge's
        # warm-up: without it the edge made first ran ahead of those made after it (docs/limits.md).
        for c in [c for c in configs if c.d != 0][:1]:
            async with EdgeWorker(endpoint, drafter, tokenizer, EdgeConfig(request_timeout_s=120.0)) as cold:
                await run_sessions(cold, slices[0], _session_config(args, c), args.sessions)
        for c in configs:
            key = _edge_key(c)
            if key in edges:
                continue
            config = EdgeConfig(request_timeout_s=120.0, retry_budget_s=120.0, predraft=c.predraft)
            edges[key] = await stack.enter_async_context(EdgeWorker(endpoint, drafter, tokenizer, config))
            if is_auto(c.d) or c.trees != "off":  # warm-up: the controller learns this link and this load
                await run_sessions(edges[key], slices[0], _session_config(args, c), args.sessions)
        total = len(configs) * args.repeat * len(texts) * args.max_new_tokens
        with tqdm(total=total, unit="tok", desc="sweep", leave=False, disable=None) as bar:
            for r in range(args.repeat):
                for i, part in enumerate(slices):
                    for c in (configs[j] for j in order[(r * len(slices) + i) % len(order)]):
                        edge = edges[_edge_key(c)]
                        before = await asyncio.to_thread(scrape, worker_ports) | _cpu(pids)
                        runs, wall = await run_sessions(edge, part, _session_config(args, c), args.sessions, bar)
                        after = await asyncio.to_thread(scrape, worker_ports) | _cpu(pids)
                        tallies[c].add(r, runs, wall, {k: after[k] - before[k] for k in after})
    return tallies


def orders(n: int) -> list[list[int]]:
    """The slice runs' orders of n configurations (a Williams design): over these, each configuration runs in each
    place of a slice's order and right after each other one equally often. A plain rotation keeps each one's
    predecessor: the chain policy then always ran after the same configuration and read 0.92-0.99x its own copy in 8
    of 8 runs (16 sessions; docs/benchmarks.md)."""
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    rows = [[(k + j) % n for j in first] for k in range(n)]
    return rows + [row[::-1] for row in rows] * (n % 2 and n > 1)  # odd n: the reversed rows balance the
    # predecessors


def uneven_order(runs: int, configs: int) -> str | None:
    """A warning where `runs` slice runs are not a whole number of passes over the `orders` of `configs`
    configurations: a bar line between two may then read their places in the order, not them."""
    if runs % (period := len(orders(configs))) == 0:
        return None
    return (f"bench sweep: {runs} slice runs (--repeat x slices of --sessions prompts) over {configs} configurations "
            f"give them unequal places in a slice's order; a multiple of {period} runs each in each place and after "
            f"each other one equally often")


def _edge_key(c: Config) -> tuple:
    """Each auto configuration and each trees setting on an edge of its own (its own estimates)."""
    return (c.d if is_auto(c.d) else "fixed", c.predraft, c.trees, c.copy)


def _session_config(args, c: Config):
    from ..common.sampling import SamplingParams
    from ..edge_worker.config import SessionConfig

    return SessionConfig(max_new_tokens=args.max_new_tokens, params=SamplingParams(args.temperature),
                         mode=args.mode, seed=args.seed, draft_len=None if is_auto(c.d) else c.d,
                         objective=objective_of(c.d) or "balanced", trees=c.trees, tree_nodes=c.nodes)


def _cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far: this process (the edge: event loop and draft thread) and the others (broker, workers,
    relay). On a shared machine wall-clock rates swing with other jobs; CPU per token does not."""
    return {"edge_cpu_s": cpu_seconds(), "other_cpu_s": sum(cpu_seconds(pid) for pid in pids)}


def make_row(args, link: LinkSpec, described: str, probe: dict, c: Config, tally: Tally, base: Tally,
             n_prompts: int) -> dict:
    d, predraft = c.d, c.predraft
    sessions = tally.sessions
    ok = [r for r in sessions if r.error is None]
    stats = [r.stats for r in ok]
    total = lambda key: sum(s.get(key, 0) for s in stats)
    tokens = max(1, total("generated_tokens"))
    pool = theory.pooled(stats)
    a = theory.acceptance_per_position(pool["reached_per_pos"], pool["accepted_per_pos"])
    theo = theory.theoretical_calls_per_token(a, pool["rounds_by_draft_len"])
    calls = tally.cloud.get("verify_requests", 0.0) / tokens
    tps, base_tps = tally.tokens_per_s, base.tokens_per_s
    reference = {r.prompt: r.ids for r in base.sessions}
    gaps = [g for r in ok for g in r.gaps_ms()]
    tpot = [t for r in ok if (t := r.tpot_ms()) is not None]
    return {
        "draft_len": AUTO if is_auto(d) else d, "objective": objective_of(d), "predraft": predraft, "link": described, "link_rtt_ms": round(link.rtt_s * 1e3, 3),
        "link_rate_mbit": None if link.rate_bps is None else link.rate_bps / 1e6, **probe,
        "sessions": args.sessions, "sessions_in_flight": max((len(runs) for runs in tally.runs), default=0),
        "prompts": n_prompts, "max_new_tokens": args.max_new_tokens,
        "repeats": len(tally.tokens), "tokens_per_s": round(tps, 2),
        "tokens_per_s_runs": [round(x, 2) for x in tally.runs_tps],
        "tokens_per_s_slices": [round(x, 2) for x in tally.slices_tps], "target_alone_tokens_per_s": round(base_tps, 2),
        "speedup_vs_target_alone": round(tps / base_tps, 3) if base_tps else None, "generated_tokens": tokens,
        "cloud_calls_per_token": round(calls, 4),
        "cloud_forward_passes_per_token": round(tally.cloud.get("forward_passes", 0.0) / tokens, 4),
        "cloud_forward_ms_per_token": round(tally.cloud.get("forward_seconds", 0.0) * 1e3 / tokens, 3),
        "cloud_forward_ms_per_pass": round(1e3 * tally.cloud.get("forward_seconds", 0.0)
                                           / max(1.0, tally.cloud.get("forward_passes", 0.0)), 2),
        "theoretical_cloud_calls_per_token": None if theo is None else round(theo, 4),
        "calls_vs_theory": None if not theo else round(calls / theo, 4),
        "acceptance_per_position": [round(x, 4) for x in a],
        "acceptance_rate": round(total("accepted_tokens") / max(1, total("draft_tokens")), 4),
        "mean_draft_len": round(total("draft_tokens") / max(1, total("cloud_calls")), 3),
        "draft_len_histogram": {str(k): v for k, v in sorted(pool["rounds_by_draft_len"].items())},
        "predraft_tokens_fraction": round(total("predraft_tokens") / max(1, total("draft_tokens")), 4),
        "itl_ms_p50": _pct(gaps, 50), "itl_ms_p99": _pct(gaps, 99),
        "tpot_ms": round(statistics.mean(tpot), 2) if tpot else None,
        "cpu_ms_per_token": round((tally.cloud["edge_cpu_s"] + tally.cloud["other_cpu_s"]) * 1e3 / tokens, 3),
        "edge_cpu_ms_per_token": round(tally.cloud["edge_cpu_s"] * 1e3 / tokens, 3),
        "uplink_bits_per_token": round(8 * total("uplink_bytes") / tokens, 1),
        "downlink_bits_per_token": round(8 * total("downlink_bytes") / tokens, 1),
        "outputs_identical_to_target_alone": bool(ok) and all(r.ids == reference.get(r.prompt) for r in ok),
        "errors": len(sessions) - len(ok), "error_samples": sorted({r.error for r in sessions if r.error})[:3],
        **treesweep.fields(c, stats, tokens, tally.cloud.get("verify_requests", 0.0)),
        **wall_split(list(zip(tally.runs, tally.walls))),
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np
    return round(float(np.percentile(values, q)), 2)


def evaluate(rows: list[dict]) -> dict:
    """The issue's bars, from this run's rows (a copy's, --control, only in `control`). A configuration whose every
    generation failed (0 tokens/s: nothing to divide by) has no bar; `failed` names each row with errors."""
    failed = [{"config": configuration(r), "link": r["link"], "errors": r["errors"],
               "error_samples": r.get("error_samples", [])}
              for r in rows if r.get("errors")]
    copies = [r for r in rows if r["tokens_per_s"] > 0]
    rows = [r for r in copies if not r.get("copy")]
    calls = [r["calls_vs_theory"] for r in rows  # chains: theory is a chain's E(d) (a tree row's is shown only)
             if r["draft_len"] != 0 and r["calls_vs_theory"] is not None and r.get("trees", "off") == "off"]
    out: dict = {"calls_vs_theory_max": max(calls) if calls else None,
                 "calls_le_1.02x_theory": bool(calls) and max(calls) <= 1.02, "auto_vs_best_fixed": {},
                 "predraft_gain": {}, "trees_vs_chains": treesweep.trees_vs_chains(rows),
                 "trees_auto_vs_chain_policy": treesweep.auto_vs_chain_policy(rows, paired),
                 "control": treesweep.control(copies, paired), "failed": failed}
    for (link, predraft, _), group in _groups(rows).items():
        fixed = [r for r in group if r["draft_len"] != AUTO]
        best = max(fixed, key=lambda r: r["tokens_per_s"]) if fixed else None
        # a group whose every fixed run failed has nothing to compare with: its rows' errors say why
        for auto in (r for r in group if r["draft_len"] == AUTO and best):
            bar = auto_bar(auto["objective"])
            trees = f" trees={auto['trees']}" if auto["trees"] != "off" else ""  # apart from the chain policy's
            out["auto_vs_best_fixed"][f"{link} predraft={predraft} objective={auto['objective']}{trees}"] = {
                "auto": auto["tokens_per_s"], "best_fixed_draft_len": best["draft_len"],
                "best_fixed": best["tokens_per_s"], "ratio": round(auto["tokens_per_s"] / best["tokens_per_s"], 3),
                "bar": bar, "auto_ge_bar": auto["tokens_per_s"] >= bar * best["tokens_per_s"],
                "paired_ratios": paired(auto.get("tokens_per_s_slices"), best.get("tokens_per_s_slices")),
                "auto_ge_target_alone": (auto["speedup_vs_target_alone"] or 0.0) >= 1.0,
                "speedup_vs_target_alone": auto["speedup_vs_target_alone"],
                "cloud_calls_per_token": auto["cloud_calls_per_token"],
                "best_fixed_cloud_calls_per_token": best["cloud_calls_per_token"]}
    for r in rows:
        twin = next((x for x in rows if x["link"] == r["link"] and x["draft_len"] == r["draft_len"]
                     and x["trees"] == r["trees"] and x["tree_nodes"] == r["tree_nodes"]
                     and r["predraft"] and not x["predraft"]), None)
        if twin:
            gain = r["tokens_per_s"] / twin["tokens_per_s"] - 1
            out["predraft_gain"][f"{r['link']} d={r['draft_len']} trees={r['trees']}"] = {
                "gain": round(gain, 4), "ge_5pct": gain >= 0.05,
                "outputs_identical": r["outputs_identical_to_target_alone"] and twin["outputs_identical_to_target_alone"]}
    return out


def auto_bar(objective: str | None) -> float:
    """The share of the best fixed length's tokens/s `auto` is held to: `speed` 0.97 (its model's argmax, less the
    measurement's noise), `balanced` 0.90 (it gives up to 10 % of the modelled best for tokens per call), `cloud` 0
    (the fewest calls, whatever the speed)."""
    from ..edge_worker.policy import TOLERANCE

    return round(min(0.97, 1.0 - TOLERANCE[Objective[(objective or "balanced").upper()]]), 2)


def paired(auto: list[float] | None, best: list[float] | None) -> dict | None:
    """auto's tokens/s over the best fixed length's, slice by slice (the two ran the same prompts one after the
    other, so a slow spell of the machine hits both): the median and the range of those ratios."""
    if not auto or not best or len(auto) != len(best):
        return None
    ratios = [a / b for a, b in zip(auto, best) if b > 0]
    return {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
            "max": round(max(ratios), 3), "slices": len(ratios)} if ratios else None


def _groups(rows: list[dict]) -> dict:
    """(link, pre-drafting, trees or not) -> its speculative rows plus that link's target-alone row."""
    groups: dict = {}
    for r in rows:
        if r["draft_len"] != 0:
            groups.setdefault((r["link"], r["predraft"], r["trees"] != "off"), []).append(r)  # chains, trees
    for (link, _, _), group in groups.items():
        group += [r for r in rows if r["link"] == link and r["draft_len"] == 0]
    return groups
