"""Results as people read them: a markdown table per run, PNG plots (matplotlib, optional), and
one page (bench_results/benchmarks.md) assembled from every result in a results directory (`specrelay bench report`)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from . import plots as plotting

SWEEP_COLUMNS = [("link", "link"), ("sessions_in_flight", "in flight"), ("draft_len", "d"), ("objective", "objective"), ("predraft", "pre-draft"),
                 ("trees", "trees"), ("shape", "shape"), ("tree_round_share", "tree rounds"),
                 ("mean_nodes", "nodes"), ("tokens_per_s", "tokens/s"),
                 ("tokens_per_call", "tokens/call"), ("predraft_hit_rate", "pre-draft hits"),
                 ("uplink_bytes_per_token", "B/token up"), ("downlink_bytes_per_token", "B/token down"),
                 ("speedup_vs_target_alone", "× target alone"), ("cloud_calls_per_token", "cloud calls/token"),
                 ("theoretical_cloud_calls_per_token", "theory"), ("calls_vs_theory", "ratio"),
                 ("acceptance_rate", "acceptance"), ("mean_draft_len", "mean d"),
                 ("predraft_tokens_fraction", "pre-drafted"), ("rtt_ms_measured", "RTT ms"),
                 ("tpot_ms", "TPOT ms"), ("itl_ms_p50", "commit gap p50 ms"), ("itl_ms_p99", "commit gap p99 ms"),
                 ("outputs_identical_to_target_alone", "= target alone"), ("errors", "errors")]
ORDER = ["first", "sweep", "stress", "calls", "concurrency", "hf", "xvocab", "srdv_k", "wire", "draft_step"]


CONSOLE_COLUMNS = [("link", "link"), ("in flight", "in flight"), ("configuration", "configuration"),
                   ("shape", "shape"), ("tokens_per_s", "tokens/s"), ("speedup_vs_target_alone", "x alone"),
                   ("tokens_per_call", "tokens/call"), ("cloud_calls_per_token", "calls/token"),
                   ("theoretical_cloud_calls_per_token", "theory"), ("occupancy", "occupancy"),
                   ("steady_tokens_per_s", "steady tok/s"), ("outputs_identical_to_target_alone", "= alone")]


def console_lines(rows: list[dict]) -> list[str]:
    """What a run prints on stdout without --json: a table with a header, one row per sweep row (link and
    configuration named as in the plots), or a stress run's summary as field / value."""
    from .runs import text_table

    if rows and "predraft" in rows[0]:  # sweep rows (a stress summary has a draft_len too)
        columns = [c for c in CONSOLE_COLUMNS if c[0] != "shape" or any(r.get("trees", "off") != "off" for r in rows)]
        cells = [{**r, "link": plotting.link_name(r), "in flight": plotting.in_flight(r),
                  "configuration": plotting.configuration(r)} for r in rows]
        return text_table([title for _, title in columns],
                          [[_cell(c.get(key)).replace("**", "") for key, _ in columns] for c in cells]).splitlines()
    fields = [(k, v) for row in rows for k, v in row.items() if not isinstance(v, dict)]
    return text_table(["field", "value"], [[k, json.dumps(v) if isinstance(v, list) else _cell(v).replace("**", "")]
                                           for k, v in fields]).splitlines()


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return "–" if value is None else str(value)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|"
    body = ["| " + " | ".join(_cell(r.get(key)) for key, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _flat(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in data.items():
        if key in ("meta", "bench", "itl_ms_samples", "tpot_ms_samples", "rss_samples"):
            continue
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def markdown(name: str, result: dict) -> str:
    """The tables of one result."""
    bench = result.get("bench", name)
    if bench == "sweep":
        bars = [f"- {line}" for line in bar_lines(result.get("bars", {}))]
        return "\n".join([table(result["rows"], SWEEP_COLUMNS), "", "Bars (this run):", "", *bars])
    if bench == "stress":
        return _stress_markdown(result)
    rows = [{"field": k, "value": v} for k, v in _flat({k: v for k, v in result.items() if k != "rows"})]
    text = table(rows, [("field", "field"), ("value", "value")])
    listed = result.get("rows")
    if isinstance(listed, list) and listed and all(isinstance(r, dict) for r in listed):  # one table row each
        text += "\n\n" + table(listed, [(k, k) for k in listed[0]])
    return text


def bar_lines(bars: dict) -> list[str]:
    """A sweep's bars in words: each figure, the bar it is held to, met or not, and what it means (a bar this
    does not know is printed as its JSON)."""
    lines = []
    for key, value in bars.items():
        try:
            lines += _BAR_WORDS[key](bars) if key in _BAR_WORDS else [f"{key}: {json.dumps(value)}"]
        except (KeyError, TypeError, ValueError):
            lines.append(f"{key}: {json.dumps(value)}")
    return lines


def _calls_words(bars: dict) -> list[str]:
    ratio = bars["calls_vs_theory_max"]
    return [] if ratio is None else [
        f"cloud calls per token vs theory (chain rows): at most {ratio:.3f}x the calls E(d) predicts at the measured "
        f"acceptance (bar <= 1.02x: {_met(bars['calls_le_1.02x_theory'])}; above 1, rounds committed fewer tokens than "
        "their acceptance predicts: generations cut at max_new_tokens or EOS, retries, or auto's varying d)"]


def _auto_words(bars: dict) -> list[str]:
    return [f"auto vs the best fixed length, {where}: {a['ratio']:.3f}x d={a['best_fixed_draft_len']} (bar >= "
            f"{a['bar']:.2f}x: {_met(a['auto_ge_bar'])}{_paired_words(a.get('paired_ratios'))}), "
            f"{a['speedup_vs_target_alone']:.2f}x the target alone (bar >= 1x: {_met(a['auto_ge_target_alone'])}), "
            f"{a['cloud_calls_per_token']} cloud calls per token (best fixed: {a['best_fixed_cloud_calls_per_token']})"
            for where, a in bars["auto_vs_best_fixed"].items()]


def _paired_words(p: dict | None) -> str:
    return "" if not p or p["slices"] < 2 else \
        f"; slice by slice {p['median']:.3f}x median, {p['min']:.3f}-{p['max']:.3f}x over {p['slices']} slices"


def _predraft_words(bars: dict) -> list[str]:
    return [f"pre-drafting, {where}: {g['gain']:+.1%} tokens/s (bar >= +5%: {_met(g['ge_5pct'])}), outputs "
            f"{'identical' if g['outputs_identical'] else 'DIFFERENT'} to the target alone's"
            for where, g in bars["predraft_gain"].items()]


def _trees_words(bars: dict) -> list[str]:
    return [f"trees vs chains, {where}: the best tree (by tokens/s: d={t['best_tree']['draft_len']}, "
            f"{t['best_tree']['mean_nodes']} nodes) commits {t['tokens_per_call_ratio']:.3f}x the best chain's tokens "
            f"per cloud call (d={t['best_chain']['draft_len']}) at {t['tokens_per_s_ratio']:.3f}x its tokens/s (bar "
            f">= 1.2x at >= 1.0x: {_met(t['bar_met'])}); outputs "
            f"{'identical' if t['outputs_identical'] else 'DIFFERENT'}; its pre-draft hit rate "
            f"{t['best_tree']['predraft_hit_rate']}"
            for where, t in bars["trees_vs_chains"].items()]


def _trees_auto_words(bars: dict) -> list[str]:
    return [f"--trees auto vs the chain policy, {where}: {t['ratio']:.3f}x its tokens/s (bar >= 1.0x: "
            f"{_met(t['bar_met'])}{_paired_words(t.get('paired_ratios'))}), {t['tree_round_share']:.0%} tree rounds"
            for where, t in bars["trees_auto_vs_chain_policy"].items()]


def _control_words(bars: dict) -> list[str]:
    return [f"control, {where}: the chain policy at {t['ratio']:.3f}x its own copy's tokens/s (the same code on an "
            f"edge of its own: the noise any bar line between two configurations carries"
            f"{_paired_words(t.get('paired_ratios'))})" for where, t in bars["control"].items()]


_BAR_WORDS = {"calls_vs_theory_max": _calls_words, "calls_le_1.02x_theory": lambda _: [], "control": _control_words,
              "trees_auto_vs_chain_policy": _trees_auto_words,
              "auto_vs_best_fixed": _auto_words, "predraft_gain": _predraft_words, "trees_vs_chains": _trees_words}


def _met(ok) -> str:
    return "met" if ok else "not met"


def _stress_markdown(result: dict) -> str:
    """A stress run: its summary, the RSS of each process, its bars."""
    s = result["summary"]
    keys = [k for k in s if k != "rss"]
    lines = [table([{"field": k, "value": s[k]} for k in keys], [("field", "field"), ("value", "value")]), "",
             table([{"process": p, **v} for p, v in s["rss"].items()],
                   [("process", "process"), ("warm_mb", "RSS after warm-up MB"), ("end_mb", "RSS at end MB"),
                    ("max_mb", "max MB"), ("growth", "growth")]), "", f"Bars: {result['bars']}"]
    return "\n".join(lines)


def write_outputs(out_dir: str | Path, name: str, result: dict, plots: bool = True) -> list[Path]:
    """OUT/<name>.md and (unless plots is False) the PNG plots; returns the plot files."""
    out = Path(out_dir)
    (out / f"{name}.md").write_text(f"# {name}\n\n`{result['meta']['command']}`\n\n{markdown(name, result)}\n")
    if not plots:
        return []
    try:
        return plotting.draw(out, name, result)
    except ImportError as exc:
        print(f"plots skipped: {exc} (pip install 'specrelay[bench]')", file=sys.stderr)
        return []


def _machine(meta: dict) -> str:
    m = meta.get("machine", {})
    load = ", ".join(f"{x:.1f}" for x in m.get("load_average_at_start", []))
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('memory_mb', '?')} MB, "
            f"{m.get('gpu') or 'no GPU'}; load average at start {load} (a shared machine: compare within a run)")


def render_docs(out_dir: str | Path, docs_path: str | Path, images_dir: str | Path, merge: bool = False) -> Path:
    """docs/benchmarks.md from every *.json in `out_dir`, plots copied to `images_dir`. merge: keep the sections
    of the existing page that no result in `out_dir` replaces (a partial rerun)."""
    out, docs, images = Path(out_dir), Path(docs_path), Path(images_dir)
    images.mkdir(parents=True, exist_ok=True)
    results = {p.stem: p for p in out.glob("*.json")}
    kept = {k: v for k, v in _sections(docs).items() if k not in results} if merge and docs.exists() else {}
    parts = ["# Measured numbers", "",
             "Generated by `specrelay bench report` from the JSON results of the runs below; every section names",
             "the command that produced it, when, on which machine. The JSON fields are described by",
             "`specrelay bench schema` (see the end of this page).", ""]
    for stem in sorted({*results, *kept}, key=lambda s: (_rank(s), s)):
        if stem in kept:
            parts += [kept[stem].rstrip("\n"), ""]
            continue
        path = results[stem]
        result = json.loads(path.read_text())
        meta = result.get("meta", {})
        parts += [f"## {path.stem}", "", f"`{meta.get('command', '?')}`", "",
                  f"{meta.get('date', '?')}, commit {meta.get('git')}; {_machine(meta)}.", "",
                  _NOTES.get(result.get("bench", path.stem), ""), "", markdown(path.stem, result), ""]
        suffixes = plotting.MAKERS.get(result.get("bench"), {})
        for png in sorted(p for p in out.glob(f"{path.stem}_*.png") if p.stem[len(path.stem) + 1:] in suffixes):
            shutil.copy(png, images / png.name)
            parts += [f"![{png.stem}]({_relative(images / png.name, docs.parent)})", ""]
    from .schema import describe
    parts += ["## JSON schema", ""]
    for title, fields in describe().items():
        rows = [{"field": k, **v} for k, v in fields.items()]
        parts += [f"### {title}", "", table(rows, [("field", "field"), ("type", "type"), ("meaning", "meaning")]), ""]
    docs.write_text("\n".join(parts))
    return docs


def _sections(docs: Path) -> dict[str, str]:
    """The page's `## name` sections (heading included) by name, the generated schema section left out."""
    sections: dict[str, str] = {}
    name = None
    for line in docs.read_text().splitlines(keepends=True):
        if line.startswith("## "):
            name = line[3:].strip()
        if name is not None and name != "JSON schema":
            sections[name] = sections.get(name, "") + line
    return sections


def _rank(stem: str) -> int:
    base = stem.split("-")[0]
    return ORDER.index(base) if base in ORDER else len(ORDER)


def _relative(path: Path, start: Path) -> str:
    import os
    return os.path.relpath(path, start)


_NOTES = {
    "sweep": "Greedy unless the command says otherwise. `d` is the draft length (`auto` = goodput-driven, "
             "docs/policy.md); `0` is the target alone through the same path. Cloud calls are counted by the "
             "workers; theory = rounds / Σ E(d) at the measured per-position acceptance (bench/theory.py). "
             "Each row's `placement` says where the processes ran: the edge side on CPU 0 and the cloud side "
             "(broker, workers, relay) on the other CPUs unless the command says --no-pin (docs/single-host.md).",
    "stress": "Real processes: `specrelay broker`, `specrelay cloud-worker` ×K, `specrelay edge-worker` ×N, each "
              "edge behind its own emulated link; clients keep S greedy generations in flight per edge and "
              "check every output against the target alone.",
    "calls": "Greedy, held-out stdlib code, `auto` under the `objective` shown (or the fixed `draft_len`), 8 "
             "sessions in flight, through broker + cloud worker processes, against `--draft-len 0` (the target "
             "alone through the same path); `--xv`: the cross-vocabulary pair.",
    "concurrency": "One cloud worker, torch threads as the placement gives them: verified tokens/s with 16 "
                   "concurrent sessions vs 1. On two CPU cores the 16-session case is compute-bound: one batched "
                   "verification of 16 sessions costs the same FLOPs as 16 separate passes, so batching removes "
                   "only per-call overhead (the edge on CPU 0, the worker on the other core unless --no-pin).",
    "hf": "One session over loopback against HF `target.generate(assistant_model=draft, do_sample=False)` "
          "in-process; outputs compared token for token.",
    "xvocab": "`demo-draft-xv` (Metaspace/byte-fallback, 4352 tokens) drafting for `demo-target` (byte-level BPE, "
              "8192) at T = 1 through broker + cloud worker. Uplink includes the one-time OPEN (prompt ids and "
              "the 1 KiB shared-vocabulary bitmap). X-CoSD-E reports 266–384 bits per token for SR-DV.",
    "srdv_k": "SR-DV candidates per round K, in-process, cross-vocabulary pair at T = 1: K = 1 and 2 fall back to "
              "`hr` (a large payload) too often; a large K sends candidates that are never needed.",
    "draft_step": "In-process, the draft model alone, 1 torch thread: each round every session drafts d tokens "
                  "greedily in one lockstep batch, then keeps a prefix plus one other token (a rollback and a "
                  "catch-up, as after a VERDICT). `in place` is the edge's drafter (edge_worker/draft/kv.py); "
                  "`restack` the path it used before (every step restacks every session's past and concatenates "
                  "it twice more). Median ms per round over contexts from the prompt to `context (end)`.",
    "wire": "Bytes on the wire (header + body frames) with realistic values: a per-edge session id of 37, token "
            "ids near 8000, position 300.",
}
