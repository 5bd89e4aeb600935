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
    makers = {"sweep": [tokens_per_s, cloud_calls, acceptance, itl_cdf], "stress": [rss, itl_cdf],
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
    return f"RTT {row['link_rtt_ms']:g} ms{rate}, {row['sessions']} sessions"


def _fixed_and_auto(group: list[dict]) -> tuple[list[dict], dict | None]:
    fixed = sorted((r for r in group if r["draft_len"] != "auto"), key=lambda r: r["draft_len"])
    return fixed, next((r for r in group if r["draft_len"] == "auto"), None)


def tokens_per_s(ax, result: dict) -> str:
    for label, group in _series(result["rows"]).items():
        fixed, auto = _fixed_and_auto(group)
        line, = ax.plot([r["draft_len"] for r in fixed], [r["tokens_per_s"] for r in fixed], "o-", label=label)
        if auto:
            ax.plot([auto["mean_draft_len"]], [auto["tokens_per_s"]], "*", ms=14, color=line.get_color(),
                    label=f"auto (at its mean d), {label}")
    ax.set(xlabel="draft length d", ylabel="generated tokens / s", title="Throughput vs draft length")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return "tokens_per_s"


def cloud_calls(ax, result: dict) -> str:
    for label, group in _series(result["rows"]).items():
        fixed, auto = _fixed_and_auto(group)
        line, = ax.plot([r["draft_len"] for r in fixed], [r["cloud_calls_per_token"] for r in fixed], "o",
                        label=f"measured, {label}")
        widest = max(fixed, key=lambda r: len(r["acceptance_per_position"]))
        a, top = widest["acceptance_per_position"], max(r["draft_len"] for r in fixed)
        ds = list(range(top + 1))
        ax.plot(ds, [1 / expected_tokens(a, d) for d in ds], "-", color=line.get_color(), alpha=0.6,
                label=f"theory 1/E(d) at measured a_j, {label}")
        if auto:
            ax.plot([auto["mean_draft_len"]], [auto["cloud_calls_per_token"]], "*", ms=14, color=line.get_color(),
                    label="auto (at its mean d)")
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


def itl_cdf(ax, result: dict) -> str:
    import numpy as np

    for label, samples in result.get("itl_ms_samples", {}).items():
        if samples:
            xs = np.sort(np.asarray(samples))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    ax.set(xlabel="inter-token latency (ms between commits)", ylabel="CDF", xscale="symlog",
           title="Inter-token latency")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
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
