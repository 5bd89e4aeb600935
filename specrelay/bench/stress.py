"""`specrelay bench stress`: real processes under load for a duration.

    broker ── K × cloud-worker          (child processes, specrelay.cluster.LocalCluster)
       ▲
    relay (emulated link, bench/link.py)
       ▲
    N × `specrelay edge-worker` processes, each with a health port
       ▲
    this process: one DEALER per edge speaking GENERATE / TOKENS / DONE, S greedy generations in flight per edge

Reports aggregate and per-session tokens/s, inter-token latency (gaps between TOKENS messages), cloud busy seconds
per generated token (the workers' forward-pass time, from their /metrics), errors by code, every greedy output
compared with the target alone, and the RSS of every process sampled over time (growth after the warm-up).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..common import protocol as P
from .link import LinkRelay, LinkSpec, measure_rtt
from ..placement import stamp
from .runs import load_prompts
from .sweep import _pct, scrape

REQUEST_TIMEOUT_S = 300.0


@dataclass
class Generation:
    edge: int
    prompt: str
    start: float
    end: float = 0.0
    ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None


class LoadClient:
    """One DEALER to one edge worker; many GENERATEs in flight, replies routed by request id."""

    def __init__(self, ctx, endpoint: str) -> None:
        import zmq

        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.queues: dict[int, asyncio.Queue] = {}
        self.ids = itertools.count(1)

    async def receive(self) -> None:
        while True:
            msg = P.decode(await self.sock.recv_multipart())
            queue = self.queues.get(msg.session if isinstance(msg, P.Error) else msg.request)
            if queue is not None:
                queue.put_nowait((time.perf_counter(), msg))

    async def generate(self, gen: Generation, max_new_tokens: int, draft_len: int) -> Generation:
        request = next(self.ids)
        queue = self.queues[request] = asyncio.Queue()
        try:
            await self.sock.send_multipart(P.encode(P.Generate(request, gen.prompt, max_new_tokens,
                                                               draft_len=draft_len)))
            while True:
                at, msg = await asyncio.wait_for(queue.get(), REQUEST_TIMEOUT_S)
                if isinstance(msg, P.Tokens) and msg.token_ids:
                    gen.ids += msg.token_ids
                    gen.arrivals.append(at)
                elif isinstance(msg, P.Error):
                    gen.error = msg.code.name
                    break
                elif isinstance(msg, P.Done):
                    break
        except asyncio.TimeoutError:
            gen.error = "TIMEOUT"
        finally:
            self.queues.pop(request, None)
            gen.end = time.perf_counter()
        return gen

    def close(self) -> None:
        self.sock.close()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def sample_rss(procs: dict[str, int], every: float, t0: float, out: dict[str, list]) -> None:
    while True:
        now = round(time.perf_counter() - t0, 2)
        for name, pid in procs.items():
            mb = rss_mb(pid)
            if mb is not None:
                out.setdefault(name, []).append((now, round(mb, 2)))
        await asyncio.sleep(every)


def references(args, texts: list[str]) -> dict[str, list[int]]:
    """Target-alone greedy output of every prompt (in-process, KV-cached; equals HF generate)."""
    from ..common.runner import ModelRunner
    from ..speculative import target_generate

    target = ModelRunner.load(args.target)
    tok = target.tokenizer
    return {t: target_generate(target, tok(t).input_ids, args.max_new_tokens) for t in texts}


def run(args) -> dict:
    from tqdm.auto import tqdm

    from ..cluster import LocalCluster, free_port

    link, texts = LinkSpec.parse(args.link), load_prompts(args.prompts, args.num_prompts or 20)
    warmup = args.warmup if args.warmup is not None else max(20.0, 0.1 * args.duration)
    refs = references(args, tqdm(texts, desc="target-alone references", leave=False, disable=None))
    with LocalCluster(args.target, workers=args.cloud_workers, max_batch=args.max_batch,
                      threads=args.threads, pin=not args.no_pin) as cluster:
        with LinkRelay(link, cluster.frontend, rate_by=args.rate_by) as relay:
            probe = {"link": relay.described, **measure_rtt(relay.endpoint)}
            edges = []
            for i in range(args.edges):
                listen, port = f"tcp://127.0.0.1:{free_port()}", free_port()
                extra = ["--target-tokenizer", args.target_tokenizer] if args.target_tokenizer else []
                proc = cluster.spawn_edge("--broker", relay.endpoint, "--draft-model", args.draft, "--listen", listen,
                                          "--health-port", str(port), "--objective", args.objective, *extra)
                cluster._wait_healthy(port, proc, f"edge worker {len(edges)}")
                edges.append((listen, proc))
            procs = {"broker": cluster.broker.pid,
                     **{f"cloud-worker-{i}": p.pid for i, p in enumerate(cluster.worker_procs)},
                     **{f"edge-{i}": p.pid for i, (_, p) in enumerate(edges)}}
            if relay.proc is not None:
                procs["link-relay"] = relay.proc.pid
                cluster.place_cloud(relay.proc.pid)
            from ..runtime import run_async
            measured = run_async(_load(args, [e for e, _ in edges], texts, warmup, procs, cluster.health_ports))
    result = summarise(args, probe, warmup, measured, refs)
    result["summary"] = stamp(result["summary"], cluster.placement)
    return result


async def _load(args, endpoints: list[str], texts: list[str], warmup: float, procs: dict, worker_ports) -> dict:
    import zmq.asyncio
    from tqdm.auto import tqdm

    ctx = zmq.asyncio.Context()
    clients = [LoadClient(ctx, e) for e in endpoints]
    receivers = [asyncio.create_task(c.receive()) for c in clients]
    draft_len = -1 if args.draft_len == "auto" else int(args.draft_len)
    t0 = time.perf_counter()
    warm_at, end_at = t0 + warmup, t0 + warmup + args.duration
    rss: dict[str, list] = {}
    sampler = asyncio.create_task(sample_rss(procs, args.sample_every, t0, rss))
    prompts = itertools.cycle(texts)
    done: list[Generation] = []
    cloud: dict[str, dict] = {}

    async def session(edge: int) -> None:
        while time.perf_counter() < end_at:
            gen = Generation(edge, next(prompts), time.perf_counter())
            done.append(await clients[edge].generate(gen, args.max_new_tokens, draft_len))

    async def marks(bar) -> None:
        await asyncio.sleep(warmup)
        cloud["warm"] = await asyncio.to_thread(scrape, worker_ports)
        while time.perf_counter() < end_at:
            bar.n = min(args.duration, round(time.perf_counter() - warm_at))
            bar.refresh()
            await asyncio.sleep(min(5.0, max(0.0, end_at - time.perf_counter())))
        cloud["end"] = await asyncio.to_thread(scrape, worker_ports)

    try:
        with tqdm(total=args.duration, unit="s", desc="stress", leave=False, disable=None) as bar:
            await asyncio.gather(marks(bar), *(session(e) for e in range(len(clients))
                                               for _ in range(args.sessions_per_edge)))
    finally:
        for task in (sampler, *receivers):
            task.cancel()
        await asyncio.gather(sampler, *receivers, return_exceptions=True)
        for c in clients:
            c.close()
        ctx.term()
    return {"generations": done, "t0": t0, "warm_at": warm_at, "end_at": end_at, "rss": rss, "cloud": cloud}


def summarise(args, probe: dict, warmup: float, m: dict, refs: dict) -> dict:
    gens: list[Generation] = m["generations"]
    window = [g for g in gens if m["warm_at"] < g.end <= m["end_at"] + REQUEST_TIMEOUT_S]
    ok = [g for g in window if g.error is None]
    tokens = sum(len(g.ids) for g in ok)
    span = max(1e-9, max((g.end for g in window), default=m["end_at"]) - m["warm_at"])
    per_session = sorted(len(g.ids) / max(1e-9, g.end - g.start) for g in ok)
    gaps = [(b - a) * 1e3 for g in ok for a, b in zip(g.arrivals, g.arrivals[1:])]
    errors: dict[str, int] = {}
    for g in gens:
        if g.error:
            errors[g.error] = errors.get(g.error, 0) + 1
    checked = [g for g in gens if g.error is None]
    mismatched = [g for g in checked if g.ids != refs.get(g.prompt)]
    scraped = len(m["cloud"]) == 2
    busy = m["cloud"]["end"]["forward_seconds"] - m["cloud"]["warm"]["forward_seconds"] if scraped else None
    calls = m["cloud"]["end"]["verify_requests"] - m["cloud"]["warm"]["verify_requests"] if scraped else None
    tokens_in_scrape = sum(len(g.ids) for g in ok if g.end <= m["end_at"])  # the span the busy time covers
    rss = rss_growth(m["rss"], warmup)
    growth = [v["growth"] for v in rss.values() if v["growth"] is not None]
    summary = {
        "edges": args.edges, "sessions_per_edge": args.sessions_per_edge, "cloud_workers": args.cloud_workers,
        **probe, "duration_s": round(span, 1), "warmup_s": warmup,
        "draft_len": args.draft_len, "objective": args.objective, "max_new_tokens": args.max_new_tokens, "generations": len(ok),
        "generated_tokens": tokens, "tokens_per_s": round(tokens / span, 2),
        "session_tokens_per_s_p50": round(statistics.median(per_session), 2) if per_session else 0.0,
        "session_tokens_per_s_p10": round(per_session[len(per_session) // 10], 2) if per_session else 0.0,
        "itl_ms_p50": _pct(gaps, 50), "itl_ms_p99": _pct(gaps, 99),
        "cloud_busy_s_per_token": round(busy / tokens_in_scrape, 5) if busy is not None and tokens_in_scrape else None,
        "cloud_calls_per_token": round(calls / tokens_in_scrape, 4) if calls is not None and tokens_in_scrape else None,
        "errors": sum(errors.values()), "errors_by_code": errors, "outputs_checked": len(checked),
        "outputs_mismatched": len(mismatched), "rss_growth_max": max(growth) if growth else None, "rss": rss,
    }
    bars = {"zero_errors": summary["errors"] == 0, "outputs_equal_target_alone": not mismatched and bool(checked),
            "rss_growth_lt_10pct": summary["rss_growth_max"] is not None and summary["rss_growth_max"] < 0.10}
    return {"summary": summary, "bars": bars, "ok": all(bars.values()), "rss_samples": m["rss"],
            "itl_ms_samples": {f"{args.edges}x{args.sessions_per_edge} sessions": sorted(round(g, 2) for g in gaps)},
            "mismatched_prompts": sorted({g.prompt for g in mismatched})[:10]}


def rss_growth(samples: dict[str, list], warmup: float) -> dict:
    """Per process: RSS just after the warm-up (median of 3 samples), at the end (median of the last 3), growth."""
    out = {}
    for name, series in samples.items():
        after = [mb for t, mb in series if t >= warmup]
        if len(after) < 2:
            out[name] = {"warm_mb": None, "end_mb": None, "max_mb": None, "growth": None}
            continue
        warm, end = statistics.median(after[:3]), statistics.median(after[-3:])
        out[name] = {"warm_mb": round(warm, 1), "end_mb": round(end, 1), "max_mb": round(max(after), 1),
                     "growth": round(end / warm - 1, 4)}
    return out
