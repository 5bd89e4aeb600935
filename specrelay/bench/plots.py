"""PNG plots of benchmark results (matplotlib, headless). `draw(out, name, result)` writes OUT/<name>_*.png for the
benchmarks that have plots and returns the files; ImportError when matplotlib is not installed.

A sweep's plots read alike: one colour per configuration (target alone, d=N, auto (objective), ...) in every
plot, one line style and marker per link (its RTT and the sessions in flight as run), legends outside the data,
and nothing cut at the figure's edge."""

from __future__ import annotations

from pathlib import Path

from .theory import expected_tokens

# the colour of a configuration, the same in every plot and every run (matplotlib's tab10, then its light tones)
FIXED_COLOURS = {"target alone": "#4d4d4d", "d=2": "#1f77b4", "d=4": "#ff7f0e", "d=8": "#8c564b",
                 "auto (balanced)": "#2ca02c", "auto (speed)": "#d62728", "auto (cloud)": "#9467bd",
                 "auto": "#2ca02c", "d=1": "#17becf", "d=3": "#bcbd22", "d=6": "#e377c2"}
SPARE_COLOURS = ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
                 "#9edae5", "#7f7f7f"]
LINK_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]  # (line style, marker) per link, in order
DODGE = 0.15  # x offset between the links' measured points at one draft length, so none hides another


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw(out: Path, name: str, result: dict) -> list[Path]:
    makers = list(MAKERS.get(result.get("bench"), {}).values())
    if not makers:
        return []
    plt = _pyplot()
    files = []
    for make in makers:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        suffix = make(ax, result)
        if suffix:
            path = out / f"{name}_{suffix}.png"
            fig.savefig(path, bbox_inches="tight")  # the legends outside the axes and every label kept whole
            files.append(path)
        plt.close(fig)
    return files


# ------------------------------------------------------------------------------------------ labels and styles

def configuration(row: dict) -> str:
    """A row's configuration: target alone, d=N or auto (objective), and what else it varied."""
    if row["draft_len"] == 0:
        return "target alone"
    base = f"d={row['draft_len']}"
    if row["draft_len"] == "auto":
        base = f"auto ({row['objective']})" if row.get("objective") else "auto"
    if row.get("predraft") is False:
        base += ", no pre-draft"
    if row.get("trees", "off") != "off":
        base += f", trees {row['trees']}" + (f" {row['tree_nodes']} nodes" if row.get("tree_nodes") else "")
    return base + (", copy" if row.get("copy") else "")


def in_flight(row: dict) -> int:
    """Sessions in flight as the run ran them (fewer than --sessions when fewer prompts ran)."""
    return row.get("sessions_in_flight") or min(row["sessions"], row.get("prompts") or row["sessions"])


def link_name(row: dict) -> str:
    """"loopback", "RTT 50 ms" or "RTT 50 ms, 20 Mbit/s": whole words, never cut."""
    rate = f", {row['link_rate_mbit']:g} Mbit/s" if row.get("link_rate_mbit") else ""
    return f"RTT {row['link_rtt_ms']:g} ms{rate}" if row.get("link_rtt_ms") or rate else "loopback"


def link_label(row: dict, sep: str = ", ") -> str:
    """The link and the sessions in flight: "RTT 50 ms, 4 sessions in flight"."""
    n = in_flight(row)
    return f"{link_name(row)}{sep}{n} session{'' if n == 1 else 's'} in flight"


def sample_key(row: dict) -> str:
    """The key of a row's samples in the result's `tpot_ms_samples` / `itl_ms_samples`."""
    return f"{link_label(row)} | {configuration(row)}"


def colours(rows: list[dict]) -> dict[str, str]:
    """Configuration -> colour: the fixed one where it has one, else the next spare, in the rows' order."""
    spare, out = iter(SPARE_COLOURS * 4), {}
    for c in _configurations(rows):
        out[c] = FIXED_COLOURS.get(c) or next(spare)
    return out


def link_styles(rows: list[dict]) -> dict[str, tuple[str, str]]:
    labels = list(dict.fromkeys(link_label(r) for r in rows))
    return {label: LINK_STYLES[i % len(LINK_STYLES)] for i, label in enumerate(labels)}


def _configurations(rows: list[dict]) -> list[str]:
    """Target alone first, fixed lengths by length, then auto; variants after their base."""
    def order(r: dict) -> tuple:
        d = r["draft_len"]
        return (0 if d == 0 else 2 if d == "auto" else 1, d if isinstance(d, int) else 0, configuration(r))
    return list(dict.fromkeys(configuration(r) for r in sorted(rows, key=order)))


def _legend(ax, handles=None, title: str | None = None) -> None:
    """A legend beside the axes, never over the data."""
    kwargs = {"handles": handles} if handles is not None else {}
    ax.legend(**kwargs, title=title, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7,
              title_fontsize=7, frameon=False)


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _key_handles(rows: list[dict], shown: list[dict]) -> list:
    """Legend entries for the `shown` rows (colours and styles as over all `rows`): a colour per configuration,
    then, in grey, a line style and marker per link."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    configs, links = {configuration(r) for r in shown}, {link_label(r) for r in shown}
    return ([Patch(color=colour, label=c) for c, colour in colours(rows).items() if c in configs]
            + [Line2D([], [], color="grey", ls=ls, marker=m, label=link)
               for link, (ls, m) in link_styles(rows).items() if link in links])


# ------------------------------------------------------------------------------------------ the sweep's plots

def tokens_per_s(ax, result: dict) -> str:
    """One group of bars per link, one bar per configuration in it (a category: no line between them)."""
    rows, palette = result["rows"], colours(result["rows"])
    links = list(dict.fromkeys(link_label(r) for r in rows))
    width = 0.8 / max(1, len(palette))
    for i, c in enumerate(palette):
        at = {link_label(r): r["tokens_per_s"] for r in rows if configuration(r) == c}
        xs = [x + (i - (len(palette) - 1) / 2) * width for x, link in enumerate(links) if link in at]
        ax.bar(xs, [at[link] for link in links if link in at], width, color=palette[c], label=c)
    ax.set_xticks(range(len(links)), [link_label(_first(rows, link), "\n") for link in links], fontsize=8)
    ax.set(ylabel="generated tokens / s", title="Throughput by link and configuration")
    _legend(ax, title="configuration")
    ax.grid(alpha=0.3, axis="y")
    return "tokens_per_s"


def _first(rows: list[dict], link: str) -> dict:
    return next(r for r in rows if link_label(r) == link)


def cloud_calls(ax, result: dict) -> str:
    """Measured calls per token (a marker per link, coloured by configuration, drawn over every line) against
    theory 1/E(d) at each link's measured acceptance (a grey line per link)."""
    rows, palette, styles = result["rows"], colours(result["rows"]), link_styles(result["rows"])
    for i, (link, (ls, marker)) in enumerate(styles.items()):
        group = [r for r in rows if link_label(r) == link]
        speculative = [r for r in group if r["draft_len"] != 0 and r.get("acceptance_per_position")]
        if speculative:  # up to the longest length measured, auto's included, at its widest acceptance
            a = max(speculative, key=lambda r: len(r["acceptance_per_position"]))["acceptance_per_position"]
            top = max(r["draft_len"] if isinstance(r["draft_len"], int) else r["mean_draft_len"] for r in group)
            ds = list(range(int(top + 0.999) + 1))
            ax.plot(ds, [1 / expected_tokens(a, d) for d in ds], ls=ls, color="grey", lw=1.2, alpha=0.7, zorder=1)
        dodge = (i - (len(styles) - 1) / 2) * DODGE
        for r in group:
            x = r["draft_len"] if isinstance(r["draft_len"], int) else r["mean_draft_len"]
            ax.plot([x + dodge], [r["cloud_calls_per_token"]], marker="*" if r["draft_len"] == "auto" else marker,
                    ms=13 if r["draft_len"] == "auto" else 7, ls="none", color=palette[configuration(r)],
                    markeredgecolor="black", markeredgewidth=0.5, zorder=3)
            if r["draft_len"] == "auto":  # a star has no marker of its link: name the link beside it
                ax.annotate(link_name(r), (x + dodge, r["cloud_calls_per_token"]), xytext=(6, 6),
                            textcoords="offset points", fontsize=6, color="dimgrey")
    from matplotlib.lines import Line2D

    theory = Line2D([], [], color="grey", ls="-", label="theory 1/E(d) at the measured acceptance")
    star = Line2D([], [], color="grey", marker="*", ls="none", ms=10, label="auto, at its mean d")
    _legend(ax, _key_handles(rows, rows) + [theory, star])
    ax.set(xlabel="draft length d", ylabel="cloud calls / generated token", title="Cloud calls per token")
    ax.set_ylim(bottom=0)
    _integer_x(ax)
    ax.grid(alpha=0.3)
    return "cloud_calls"


def acceptance(ax, result: dict) -> str:
    rows = [r for r in result["rows"] if r["draft_len"] != 0 and r.get("acceptance_per_position")]
    palette, styles = colours(result["rows"]), link_styles(result["rows"])
    for r in rows:
        a = r["acceptance_per_position"]
        ls, marker = styles[link_label(r)]
        ax.plot(range(len(a)), a, ls=ls, marker=marker, ms=4, color=palette[configuration(r)])
    ax.set(xlabel="draft position j (0 = first)", ylabel="P(accept j | 0..j-1 accepted)", ylim=(0, 1.02),
           title="Acceptance per draft position")
    _integer_x(ax)
    _legend(ax, _key_handles(result["rows"], rows))
    ax.grid(alpha=0.3)
    return "acceptance"


def _cdf(ax, samples, colour=None, ls="-", label=None) -> None:
    import numpy as np

    xs = np.sort(np.asarray(samples))
    ys = np.arange(0, len(xs) + 1) / len(xs)  # from 0 at the smallest sample up to 1 at the largest
    ax.plot(np.concatenate([xs[:1], xs]), ys, drawstyle="steps-post", color=colour, ls=ls, label=label)


def tpot_cdf(ax, result: dict) -> str:
    """Time per output token of each generation, as vLLM reports it: (e2e - TTFT) / (tokens - 1). Unlike the gap
    between commits it does not grow when speculation commits several tokens at once."""
    samples, rows = result.get("tpot_ms_samples", {}), result["rows"]
    palette, styles = colours(rows), link_styles(rows)
    drawn = [r for r in rows if samples.get(sample_key(r))]
    for r in drawn:
        _cdf(ax, samples[sample_key(r)], palette[configuration(r)], styles[link_label(r)][0])
    if drawn:
        _legend(ax, _key_handles(rows, drawn))
    else:  # a result written before its keys named the row: its own labels
        for label, values in samples.items():
            if values:
                _cdf(ax, values, label=label)
        _legend(ax)
    ax.set(xlabel="time per output token (TPOT) = (e2e - TTFT) / (tokens - 1), ms", ylabel="share of generations",
           ylim=(0, 1.02), title="Time per output token, CDF over generations")
    ax.grid(alpha=0.3)
    return "tpot_cdf"


# ------------------------------------------------------------------------------------------ other benchmarks

def itl_cdf(ax, result: dict) -> str:
    """The gaps between the commits a stream sees (one commit carries every token its round accepted)."""
    for label, samples in result.get("itl_ms_samples", {}).items():
        if samples:
            _cdf(ax, samples, label=label)
    _legend(ax)
    ax.set(xlabel="ms between commits (a commit carries a whole round's tokens)", ylabel="share of gaps",
           xscale="symlog", ylim=(0, 1.02), title="Gaps between streamed commits, CDF")
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
    _legend(ax)
    return "bits"


def rss(ax, result: dict) -> str:
    for proc, samples in result.get("rss_samples", {}).items():
        ax.plot([t for t, _ in samples], [mb for _, mb in samples], label=proc)
    warm = result.get("summary", {}).get("warmup_s")
    if warm:
        ax.axvline(warm, color="grey", ls="--", lw=1, label="end of warm-up")
    ax.set(xlabel="seconds", ylabel="RSS MB", title="Resident memory per process")
    _legend(ax)
    ax.grid(alpha=0.3)
    return "rss"


# each benchmark's plots, <name>_<suffix>.png: what `draw` writes and `report` embeds (no file an older version left)
MAKERS = {"sweep": {"tokens_per_s": tokens_per_s, "cloud_calls": cloud_calls, "acceptance": acceptance,
                    "tpot_cdf": tpot_cdf},
          "stress": {"rss": rss, "itl_cdf": itl_cdf}, "xvocab": {"bits": bits_per_token}}
