"""What the benchmarks share: models and prompts, an in-process edge that records what a benchmark needs
(outputs, per-session stats, the time of every committed chunk), the machine a run was on, results on disk."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..paths import packaged_models

ROOT = Path(__file__).resolve().parents[2]  # a source checkout's root (for the git revision in `meta`)
MODELS = packaged_models() or ROOT / "models"  # the demo pair and the held-out prompts (shipped in the wheel)
DEMO_TARGET = str(MODELS / "demo-target")
DEMO_DRAFT = str(MODELS / "demo-draft")
DEMO_DRAFT_XV = str(MODELS / "demo-draft-xv")
HELDOUT = MODELS / "heldout_prompts.jsonl"
DEFAULT_OUT = "bench_results"  # relative to the working directory, never inside the installed package

__all__ = ["DEMO_DRAFT", "DEMO_TARGET", "DEMO_DRAFT_XV", "load_prompts", "SessionRun", "run_sessions", "wall_split", "run_edge",
           "totals", "meta", "write_result"]


def load_prompts(path: str | None = None, n: int | None = None) -> list[str]:
    """Prompts from a JSON-lines file ({"prompt": ...} per line; default: the held-out stdlib prompts)."""
    source = Path(path) if path else HELDOUT
    if not source.exists():
        raise SystemExit(f"prompts file {source} not found (JSON lines, {{\"prompt\": ...}} per line)")
    prompts = []
    for i, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SystemExit(f"{source}:{i}: expected a JSON object with a \"prompt\" string") from None
    if not prompts:
        raise SystemExit(f"{source} holds no prompts")
    return prompts[:n] if n else prompts


@dataclass
class SessionRun:
    """One generation as a benchmark saw it: output, the edge's stats, commit events (seconds since its start,
    tokens committed)."""

    prompt: str
    ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    commits: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None

    def gaps_ms(self) -> list[float]:
        """The gaps a streaming client sees between consecutive commits (a commit carries a round's tokens)."""
        times = [t for t, _ in self.commits]
        return [(b - a) * 1e3 for a, b in zip(times, times[1:])]

    def tpot_ms(self) -> float | None:
        """Time per output token after the first, as vLLM reports it: (e2e - TTFT) / (tokens - 1), from the first
        and the last commit. Unlike the gaps between commits, it does not grow when a commit carries more tokens."""
        if len(self.ids) < 2 or not self.commits:
            return None
        return (self.commits[-1][0] - self.commits[0][0]) * 1e3 / (len(self.ids) - 1)


async def run_sessions(edge, texts: list[str], config, concurrency: int, progress=None) -> tuple[list[SessionRun], float]:
    """Generate every text with at most `concurrency` sessions in flight; returns (runs in input order, wall s).
    A failed generation is a run with `error` set (the others go on)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(text: str) -> SessionRun:
        run = SessionRun(text)
        async with gate:
            t0 = time.perf_counter()

            def on_tokens(new: list[int]) -> None:
                run.commits.append((time.perf_counter() - t0, len(new)))
                if progress is not None:
                    progress.update(len(new))

            try:
                run.ids, run.stats = await edge.generate(edge.tokenizer(text).input_ids, config, on_tokens)
            except Exception as exc:  # counted, not fatal: a benchmark reports failures
                run.error = f"{type(exc).__name__}: {exc}"
        return run

    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one(t) for t in texts))
    return list(runs), time.perf_counter() - t0


def wall_split(slices: list[tuple[list[SessionRun], float]]) -> dict:
    """Where the wall time of runs of `run_sessions` (each: its runs and its wall; all of a run's generations
    in flight from its start, as the sweep's slices of `--sessions` prompts are) went, per VERIFY round:
    a session's own wall (OPEN to its last VERDICT) against what the edge times of a round (draft wait +
    VERIFY->VERDICT), and the share of sessions x wall a session was in flight (`occupancy`: below 1, the
    run waited for its slowest generations). `full_house_tokens_per_s`: tokens / s until the first
    generation of each run ended, while every session was in flight (a run's start-up, prefill included);
    `steady_tokens_per_s` the same from the last session's first commit on (start-up and prefill left out)."""
    ok = [(runs, wall) for runs, wall in slices if runs]
    stats = [r.stats for runs, _ in ok for r in runs if r.error is None and r.stats]
    total = lambda key: sum(s.get(key, 0.0) for s in stats)  # noqa: E731
    rounds = max(1, total("cloud_calls"))
    session_ms = 1e3 * total("wall_s") / rounds
    full_tokens = full_s = steady_tokens = steady_s = 0.0
    for runs, _ in ok:
        if not all(r.commits for r in runs):
            continue
        start, end = max(r.commits[0][0] for r in runs), min(r.commits[-1][0] for r in runs)
        full_s += end
        full_tokens += sum(n for r in runs for t, n in r.commits if t <= end)
        if end > start:
            steady_s += end - start
            steady_tokens += sum(n for r in runs for t, n in r.commits if start < t <= end)
    return {"session_ms_per_round": round(session_ms, 2),
            "untimed_ms_per_round": round(session_ms - 1e3 * (total("draft_s") + total("verify_s")) / rounds, 2),
            "occupancy": round(total("wall_s") / max(1e-9, sum(len(runs) * wall for runs, wall in ok)), 4),
            "full_house_tokens_per_s": round(full_tokens / full_s, 2) if full_s else None,
            "steady_tokens_per_s": round(steady_tokens / steady_s, 2) if steady_s else None}


async def run_edge(frontend: str, draft: str, texts: list[str], concurrency: int, target_tok: str | None = None,
                   **cfg) -> tuple[list[tuple[list[int], dict]], float]:
    """Generate `texts` through the broker with an in-process edge; returns per-prompt (ids, stats), wall."""
    return (await run_edges(frontend, draft, texts, concurrency, [cfg], target_tok))[0]


async def run_edges(frontend: str, draft: str, texts: list[str], concurrency: int, configs: list[dict],
                    target_tok: str | None = None, slice_: int = 0,
                    **common) -> list[tuple[list[tuple[list[int], dict]], float]]:
    """Generate `texts` under each of `configs` (SessionConfig fields, `common` added to each) on a fresh edge of
    its own, `slice_` prompts at a time (0: all of them), taking turns, the order alternating: with short turns a
    slow spell of a shared machine hits them alike (real pair, one session: runs of a minute each, one after the
    other, differed by up to 15 % in the same configuration). Returns per config its per-prompt (ids, stats) and
    its wall, summed over its turns."""
    from contextlib import AsyncExitStack

    from ..common.sampling import SamplingParams
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.server import load_edge

    sessions = []
    for config in configs:
        fields = common | config
        sessions.append(SessionConfig(params=SamplingParams(fields.pop("temperature", 0.0)), **fields))
    runs: list[list[SessionRun]] = [[] for _ in configs]
    walls = [0.0] * len(configs)
    async with AsyncExitStack() as stack:
        edges = [await stack.enter_async_context(await load_edge(frontend, draft, target_tok)) for _ in configs]
        for edge, config in zip(edges, sessions):
            await run_sessions(edge, texts[:1], config, 1)  # warm-up: first forward passes allocate
        step = slice_ or max(1, len(texts))
        for n, i in enumerate(range(0, len(texts), step)):
            for k in (range(len(configs)) if n % 2 == 0 else reversed(range(len(configs)))):
                part, wall = await run_sessions(edges[k], texts[i:i + step], sessions[k], concurrency)
                runs[k] += part
                walls[k] += wall
    for run in (r for part in runs for r in part):
        if run.error:
            raise RuntimeError(run.error)
    return [([(r.ids, r.stats) for r in part], wall) for part, wall in zip(runs, walls)]


def totals(out: list[tuple[list[int], dict]]) -> dict:
    keys = ("generated_tokens", "draft_tokens", "accepted_tokens", "cloud_calls", "uplink_bytes", "downlink_bytes")
    return {k: sum(s[k] for _, s in out) for k in keys}


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of a process so far: this one (all its threads) when pid is None."""
    if pid is None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ provenance

def machine() -> dict:
    """The machine a run was on (benchmarks on a shared box are only comparable within one run)."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem = next((int(line.split()[1]) // 1024 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), None)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_mb": mem, "load_average_at_start": os.getloadavg(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def meta(argv: list[str]) -> dict:
    return {"command": " ".join(["specrelay", "bench", *argv]), "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), "git": git_commit(), "machine": machine()}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every benchmark's --help: the description as written, each flag's default after its help (not for a
    switch, an unset value or a help that names its default itself)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "(default" in text:
            return text
        return super()._get_help_string(action)


def text_table(headers: list[str], rows: list[list]) -> str:
    """A right-aligned markdown table of `rows` (any values) under `headers`."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def model_flags(ap: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """--target, --draft (the demo pair), --prompts (the held-out prompts) and --max-new-tokens: the flags every
    attack benchmark starts with."""
    ap.add_argument("--target", default=str(MODELS / "demo-target"))
    ap.add_argument("--draft", default=str(MODELS / "demo-draft"))
    ap.add_argument("--prompts", default=str(MODELS / "heldout_prompts.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)


def write_result(out_dir: str | Path, name: str, data: dict) -> Path:
    """OUT/<name>.json; a result that does not say its machine's load gets the load average as it ends."""
    data.setdefault("load_average", [round(x, 2) for x in os.getloadavg()])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"-> {path}", file=sys.stderr)
    return path


def median_ms(fns: dict, reps: int) -> dict[str, float]:
    """Median milliseconds of each function over `reps` rounds, interleaved (load changes hit every column
    alike), after one warm-up round."""
    times = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}
