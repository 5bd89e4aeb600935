"""PNG plots of benchmark results (matplotlib, headless). `draw(out, name, result)` writes OUT/<name>_*.png for the
benchmarks that have plots and returns the files; ImportError when matplotlib is not installed."""

from __future__ import annotations

from pathlib import Path

from .theory import expected_tokens


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw(out: Path, name: str, result: dict) -> list[Path]:
    bench = result.get("bench")
    makers = {"sweep": [tokens_per_s, cloud_calls, acceptance, tpot_cdf], "stress": [rss, itl_cdf],
              "xvocab": [bits_per_token]}.get(bench, [])
    if not makers:
        return []
    plt = _pyplot()
    files = []
    for make in makers:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        suffix = make(ax, result)
        if suffix:
            fig.tight_layout()
            path = out / f"{name}_{suffix}.png"
            fig.savefig(path)
            files.append(path)
        plt.close(fig)
    return files


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    """(link, pre-drafting) label -> rows, target-alone rows in every series of their link."""
    series: dict[str, list[dict]] = {}
    for r in rows:
        if r["draft_len"] != 0:
            label = f"{_short(r)}{'' if r['predraft'] else ', no pre-draft'}"
            series.setdefault(label, []).append(r)
    for label, group in series.items():
        group += [r for r in rows if r["draft_len"] == 0 and r["link"] == group[0]["link"]]
    return series


def _short(row: dict) -> str:
    rate = f", {row['link_rate_mbit']:g} Mbit/s" if row.get("link_rate_mbit") else ""
    sessions = row["sessions"]
    return f"RTT {row['link_rtt_ms']:g} ms{rate}, {sessions} session{'' if sessions == 1 else 's'}"


def _fixed_and_auto(group: list[dict]) -> tuple[list[dict], list[dict]]:
    fixed = sorted((r for r in group if r["draft_len"] != "auto"), key=lambda r: r["draft_len"])
    return fixed, [r for r in group if r["draft_len"] == "auto"]


def _configuration(row: dict) -> str:
    """A row's configuration as a category: target alone, d=N, or auto (objective)."""
    if row["draft_len"] == 0:
        return "target alone"
    if row["draft_len"] == "auto":
        return f"auto ({row['objective']})" if row.get("objective") else "auto"
    return f"d={row['draft_len']}"


def tokens_per_s(ax, result: dict) -> str:
    """One bar per configuration (a category: no line between them), one colour per link and pre-drafting."""
    series = _series(result["rows"])
    fixed_and_auto = [_fixed_and_auto(group) for group in series.values()]
    categories = list(dict.fromkeys(_configuration(r) for fixed, autos in fixed_and_auto for r in fixed + autos))
    width = 0.8 / max(1, len(series))
    for i, (label, (fixed, autos)) in enumerate(zip(series, fixed_and_auto)):
        rows = {_configuration(r): r for r in fixed + autos}
        xs = [x + (i - (len(series) - 1) / 2) * width for x, c in enumerate(categories) if c in rows]
        ax.bar(xs, [rows[c]["tokens_per_s"] for c in categories if c in rows], width, label=label)
    ax.set_xticks(range(len(categories)), categories, fontsize=8)
    ax.set(xlabel="configuration", ylabel="generated tokens / s", title="Throughput by configuration")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return "tokens_per_s"


def cloud_calls(ax, result: dict) -> str:
    for label, group in _series(result["rows"]).items():
        fixed, autos = _fixed_and_auto(group)
        line, = ax.plot([r["draft_len"] for r in fixed], [r["cloud_calls_per_token"] for r in fixed], "o",
                        label=f"measured, {label}")
        widest = max(fixed, key=lambda r: len(r["acceptance_per_position"]))
        a, top = widest["acceptance_per_position"], max(r["draft_len"] for r in fixed)
        ds = list(range(top + 1))
        ax.plot(ds, [1 / expected_tokens(a, d) for d in ds], "-", color=line.get_color(), alpha=0.6,
                label=f"theory 1/E(d) at measured a_j, {label}")
        for auto in autos:
            ax.plot([auto["mean_draft_len"]], [auto["cloud_calls_per_token"]], "*", ms=14, color=line.get_color(),
                    label=f"{_configuration(auto)} at its mean d, {label}")
    ax.set(xlabel="draft length d", ylabel="cloud calls / generated token", title="Cloud calls per token")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return "cloud_calls"


def acceptance(ax, result: dict) -> str:
    for r in result["rows"]:
        if r["draft_len"] != 0 and r["acceptance_per_position"] and r["predraft"] in (True, False):
            a = r["acceptance_per_position"]
            ax.plot(range(len(a)), a, "o-", ms=3, label=f"d={r['draft_len']}, {_short(r)}")
    ax.set(xlabel="draft position j (0 = first)", ylabel="P(accept j | 0..j-1 accepted)", ylim=(0, 1.02),
           title="Acceptance per draft position")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    return "acceptance"


def _cdf(ax, samples_by_label: dict[str, list[float]]) -> None:
    import numpy as np

    for label, samples in samples_by_label.items():
        if samples:
            xs = np.sort(np.asarray(samples))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post", label=label)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)


def tpot_cdf(ax, result: dict) -> str:
    """Time per output token of each generation, as vLLM reports it: (e2e - TTFT) / (tokens - 1). Unlike the gap
    between commits it does not grow when speculation commits several tokens at once."""
    _cdf(ax, result.get("tpot_ms_samples", {}))
    ax.set(xlabel="time per output token (TPOT) = (e2e - TTFT) / (tokens - 1), ms", ylabel="CDF of generations",
           title="Time per output token")
    return "tpot_cdf"


def itl_cdf(ax, result: dict) -> str:
    """The gaps between the commits a stream sees (one commit carries every token its round accepted)."""
    _cdf(ax, result.get("itl_ms_samples", {}))
    ax.set(xlabel="ms between commits (a commit carries a whole round's tokens)", ylabel="CDF", xscale="symlog",
           title="Gaps between streamed commits")
    return "itl_cdf"


def bits_per_token(ax, result: dict) -> str:
    modes = result["modes"]
    names = list(modes)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [modes[m]["uplink_bits_per_token"] for m in names], 0.4, label="uplink")
    ax.bar([x + 0.2 for x in xs], [modes[m]["downlink_bits_per_token"] for m in names], 0.4, label="downlink")
    ax.set_xticks(list(xs), names)
    ax.set(yscale="log", ylabel="bits per generated token", title="Bits per token by resampling mode (T = 1)")
    ax.legend()
    return "bits"


def rss(ax, result: dict) -> str:
    for proc, samples in result.get("rss_samples", {}).items():
        ax.plot([t for t, _ in samples], [mb for _, mb in samples], label=proc)
    warm = result.get("summary", {}).get("warmup_s")
    if warm:
        ax.axvline(warm, color="grey", ls="--", lw=1, label="end of warm-up")
    ax.set(xlabel="seconds", ylabel="RSS MB", title="Resident memory per process")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    return "rss"
