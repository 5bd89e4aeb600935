"""`bench sweep --trees on|off|compare|auto`: token trees beside chains. A configuration is a draft length, pre-drafting,
and the trees setting (off: chains; on: trees, at a fixed node budget with --tree-nodes or the shape policy's;
auto: the shape policy, chains included). Rows gain `shape` (chain or tree: what most rounds carried),
`tokens_per_call` (generated tokens per cloud VERIFY), the pre-draft hit rate and bytes per token each way; the
bars compare the best tree with the best chain (issue 22: >= 1.2x the tokens per call at >= 1.0x the tokens/s,
every output identical to the target alone)."""

from __future__ import annotations

from typing import NamedTuple


class Config(NamedTuple):
    d: int | str
    predraft: bool
    trees: str = "off"
    nodes: int | None = None
    copy: int = 0  # 1: the control (--control), a second copy of an auto chain configuration on an edge of its own

    @property
    def label(self) -> str:
        tree = "" if self.trees == "off" else f" trees={self.trees}" + (f" nodes={self.nodes}" if self.nodes else "")
        return f"d={self.d}{'' if self.predraft else ' no-predraft'}{tree}{' copy' if self.copy else ''}"


def expand(configs: list[Config], trees: str, nodes: str | None) -> list[Config]:
    """Every speculative configuration as chains (off), trees (on: each --tree-nodes budget, or the policy's;
    auto: the shape policy) or both (compare: chains and trees)."""
    budgets = [int(n) for n in nodes.split(",")] if nodes else [None]
    out = []
    for c in configs:
        if c.d == 0:
            out.append(c)
            continue
        if trees in ("off", "compare"):
            out.append(c)
        if trees in ("on", "compare"):
            out += [c._replace(trees="on", nodes=n) for n in (budgets if not str(c.d).startswith("auto") else [None])]
        if trees in ("auto", "compare") and str(c.d).startswith("auto"):
            out.append(c._replace(trees="auto"))
    return out


def fields(config: Config, stats: list[dict], tokens: int, verify_requests: float) -> dict:
    """A sweep row's tree fields, from its sessions' stats and the cloud's VERIFY count."""
    total = lambda key: sum(s.get(key, 0) for s in stats)  # noqa: E731
    rounds = max(1, total("cloud_calls"))
    tries = total("predraft_tries")
    return {
        "trees": config.trees, "tree_nodes": config.nodes, "copy": config.copy,
        "shape": "tree" if total("tree_rounds") * 2 > rounds else "chain",
        "tree_round_share": round(total("tree_rounds") / rounds, 4),
        "mean_nodes": round(total("draft_tokens") / rounds, 3),
        "tokens_per_call": round(tokens / max(1.0, verify_requests), 4),
        "predraft_hit_rate": round(total("predraft_rounds") / tries, 4) if tries else None,
        "predraft_round_share": round(total("predraft_rounds") / rounds, 4),
        "draft_ms_per_round": round(1e3 * total("draft_s") / rounds, 2),    # waited for drafts (critical path)
        "verify_ms_per_round": round(1e3 * total("verify_s") / rounds, 2),  # VERIFY sent -> its VERDICT
        "uplink_bytes_per_token": round(total("uplink_bytes") / tokens, 2),
        "downlink_bytes_per_token": round(total("downlink_bytes") / tokens, 2),
    }


def trees_vs_chains(rows: list[dict]) -> dict:
    """Per link, sessions and pre-drafting: the best chain row (trees off) and the best tree row (trees on or auto,
    most rounds trees) by tokens/s, and whether the best tree commits >= 1.2x the chain's tokens per call at >= 1.0x
    its tokens/s with identical outputs; also the tree row with the most tokens per call at >= 1.0x the best chain's
    tokens/s. A `--trees auto` row that drafted mostly chains is neither: its tree rounds would lend a "chain" their
    tokens per call."""
    out = {}
    groups: dict = {}
    for r in rows:
        if r["draft_len"] != 0:
            groups.setdefault((r["link"], r["sessions"], r["predraft"]), []).append(r)
    for (link, sessions, predraft), group in groups.items():
        chains = [r for r in group if r.get("trees", "off") == "off"]
        trees = [r for r in group if r.get("trees", "off") != "off" and r["shape"] == "tree"]
        if not (chains and trees):
            continue
        chain = max(chains, key=lambda r: r["tokens_per_s"])
        tree = max(trees, key=lambda r: r["tokens_per_s"])
        fast = [r for r in trees if r["tokens_per_s"] >= chain["tokens_per_s"]]
        most = max(fast, key=lambda r: r["tokens_per_call"]) if fast else None
        out[f"{link} sessions={sessions} predraft={predraft}"] = {
            "best_chain": _brief(chain), "best_tree": _brief(tree),
            "tokens_per_call_ratio": round(tree["tokens_per_call"] / chain["tokens_per_call"], 3),
            "tokens_per_s_ratio": round(tree["tokens_per_s"] / chain["tokens_per_s"], 3),
            "bar_met": (tree["tokens_per_call"] >= 1.2 * chain["tokens_per_call"]
                        and tree["tokens_per_s"] >= chain["tokens_per_s"]
                        and tree["outputs_identical_to_target_alone"]),
            "most_tokens_per_call_at_chain_speed": _brief(most) if most else None,
            "outputs_identical": all(r["outputs_identical_to_target_alone"] for r in group),
        }
    return out


def cell(r: dict) -> str:
    """A row's cell in the bar lines keyed per link, sessions, pre-drafting and objective."""
    return f"{r['link']} sessions={r['sessions']} predraft={r['predraft']} objective={r['objective']}"


def auto_vs_chain_policy(rows: list[dict], paired) -> dict:
    """Per link, sessions, pre-drafting and objective: `--trees auto` against the chain policy (`auto` with trees
    off), tokens/s over the whole run and slice by slice (`paired`); the bar: no slower (>= 1.0x)."""
    out = {}
    for r in (r for r in rows if r["draft_len"] == "auto" and r["trees"] == "auto"):
        if chain := _chain_policy(rows, r):
            ratio = r["tokens_per_s"] / chain["tokens_per_s"]
            out[cell(r)] = {
                "ratio": round(ratio, 3), "bar_met": ratio >= 1.0, "tree_round_share": r["tree_round_share"],
                "paired_ratios": paired(r.get("tokens_per_s_slices"), chain.get("tokens_per_s_slices"))}
    return out


def control(rows: list[dict], paired) -> dict:
    """Per link, sessions, pre-drafting and objective: the chain policy against its own copy (`--control`), the same
    code on an edge of its own: the run-to-run noise that a bar line between two configurations carries."""
    out = {}
    for r in (r for r in rows if r.get("copy")):
        if (first := _chain_policy(rows, r)) and r["tokens_per_s"]:
            out[cell(r)] = {
                "ratio": round(first["tokens_per_s"] / r["tokens_per_s"], 3),
                "paired_ratios": paired(first.get("tokens_per_s_slices"), r.get("tokens_per_s_slices"))}
    return out


def _chain_policy(rows: list[dict], r: dict) -> dict | None:
    """The chain policy's row (`auto`, trees off; not a --control copy) of `r`'s link, sessions, pre-drafting and
    objective."""
    return next((x for x in rows if x["draft_len"] == "auto" and x["trees"] == "off" and not x.get("copy")
                 and x["link"] == r["link"] and x["sessions"] == r["sessions"] and x["predraft"] == r["predraft"]
                 and x["objective"] == r["objective"]), None)


def _brief(r: dict) -> dict:
    return {k: r[k] for k in ("draft_len", "objective", "trees", "tree_nodes", "tokens_per_s", "tokens_per_call",
                              "mean_nodes", "predraft_hit_rate")}
