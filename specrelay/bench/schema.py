"""The JSON the benchmarks write, field by field: one source for the docs (`specrelay bench schema`,
docs/benchmarks.md) and for the CI check (`validate`). Every result file also holds `bench` and `meta`
(command, date, git commit, machine)."""

from __future__ import annotations

NUM = (int, float)
OPT_NUM = (int, float, type(None))

SWEEP_ROW: dict[str, tuple[tuple[type, ...], str]] = {
    "draft_len": ((int, str), "draft tokens per VERIFY, or \"auto\" (goodput-driven, edge_worker/policy)"),
    "objective": ((str, type(None)), "what auto optimised: speed | balanced | cloud (null for a fixed length)"),
    "predraft": ((bool,), "pre-drafting while a VERIFY is in flight"),
    "link": ((str,), "the link emulation that ran (\"none (loopback)\" or the relay's RTT and rate)"),
    "link_rtt_ms": (NUM, "requested round-trip time, ms"),
    "link_rate_mbit": (OPT_NUM, "requested rate per direction, Mbit/s (null = unlimited)"),
    "rtt_ms_measured": (NUM, "median round trip of a null request through the link to the broker, ms"),
    "sessions": ((int,), "sessions in flight requested (--sessions)"),
    "sessions_in_flight": ((int,), "sessions in flight as run: at most --sessions, and no more than the prompts"),
    "prompts": ((int,), "generations per run"),
    "max_new_tokens": ((int,), "tokens per generation (at most)"),
    "repeats": ((int,), "runs of this configuration (interleaved with the others)"),
    "tokens_per_s": (NUM, "generated tokens / wall time, over all the runs of this configuration"),
    "tokens_per_s_runs": ((list,), "tokens/s of each repeat"),
    "target_alone_tokens_per_s": (NUM, "the same with --draft-len 0 (the target alone, same path)"),
    "speedup_vs_target_alone": (NUM, "tokens_per_s / target_alone_tokens_per_s"),
    "generated_tokens": ((int,), "tokens generated over all runs"),
    "cloud_calls_per_token": (NUM, "VERIFYs the cloud workers ran (their /metrics) / generated tokens"),
    "cloud_forward_passes_per_token": (NUM, "batched forward passes the workers ran / generated tokens"),
    "cloud_forward_ms_per_token": (NUM, "the workers' forward-pass time / generated tokens (what a cloud call costs)"),
    "theoretical_cloud_calls_per_token": (OPT_NUM, "rounds / sum of E(d) at the measured per-position acceptance "
                                                   "and the draft lengths used (bench/theory.py)"),
    "calls_vs_theory": (OPT_NUM, "cloud_calls_per_token / theoretical_cloud_calls_per_token (bar: <= 1.02)"),
    "acceptance_per_position": ((list,), "a_j = accepted / reached at draft position j"),
    "acceptance_rate": (NUM, "accepted / drafted tokens"),
    "mean_draft_len": (NUM, "drafted tokens per VERIFY"),
    "draft_len_histogram": ((dict,), "VERIFY rounds by draft length"),
    "predraft_tokens_fraction": (NUM, "share of draft tokens taken from a pre-drafted chain"),
    "itl_ms_p50": (OPT_NUM, "time between the commits a stream sees, median, ms (a commit holds every token its "
                            "round accepted, so speculation lengthens it: compare tpot_ms)"),
    "itl_ms_p99": (OPT_NUM, "the same, 99th percentile"),
    "tpot_ms": (OPT_NUM, "time per output token after the first, (e2e - TTFT) / (tokens - 1) as vLLM reports it, "
                         "mean over generations, ms"),
    "cpu_ms_per_token": (NUM, "CPU ms per generated token, every process (edge, broker, workers, relay): the "
                              "cost a shared machine's load does not distort"),
    "edge_cpu_ms_per_token": (NUM, "of which the edge (drafting, event loop)"),
    "uplink_bits_per_token": (NUM, "edge -> cloud bits per generated token"),
    "downlink_bits_per_token": (NUM, "cloud -> edge bits per generated token"),
    "outputs_identical_to_target_alone": ((bool,), "every output equals the --draft-len 0 run's (greedy and "
                                                   "coupled; false in sample mode, where only the law is equal)"),
    "errors": ((int,), "generations that failed"),
    "trees": ((str,), "token trees: off (chains), on (trees only), auto (the shape policy, chains included)"),
    "tree_nodes": ((int, type(None)), "a tree's fixed node budget (null: the shape policy's)"),
    "copy": ((int,), "1: the control (--control), a second copy of an auto chain row on an edge of its own"),
    "shape": ((str,), "chain or tree: what most VERIFY rounds carried"),
    "tree_round_share": (NUM, "share of VERIFY rounds that carried a tree"),
    "mean_nodes": (NUM, "draft tokens (tree nodes) per VERIFY"),
    "tokens_per_call": (NUM, "generated tokens / VERIFYs the cloud workers ran"),
    "predraft_hit_rate": (OPT_NUM, "rounds whose block started from a pre-draft / rounds that could (trees: the "
                                   "verdicts that came while a pre-draft of their outcomes ran)"),
    "predraft_round_share": (NUM, "rounds whose block started from a pre-draft / all rounds"),
    "draft_ms_per_round": (NUM, "ms a round waited for its draft (the critical path), mean"),
    "verify_ms_per_round": (NUM, "ms from sending a VERIFY to its VERDICT, mean"),
    "session_ms_per_round": (NUM, "a session's own wall time (OPEN to its last VERDICT) per VERIFY round, mean"),
    "untimed_ms_per_round": (NUM, "session_ms_per_round less draft_ms_per_round and verify_ms_per_round: what "
                                  "the edge does not time of a round"),
    "occupancy": (NUM, "sessions' own wall time / (sessions x the run's wall): below 1, a run of `sessions` "
                       "prompts waited for its slowest generations"),
    "full_house_tokens_per_s": (OPT_NUM, "tokens / s until each run's first generation ended (every session "
                                         "in flight)"),
    "steady_tokens_per_s": (OPT_NUM, "the same from each run's last first commit on (start-up and prefill left "
                                     "out): a steady state of `sessions` in flight"),
    "uplink_bytes_per_token": (NUM, "edge -> cloud bytes per generated token"),
    "downlink_bytes_per_token": (NUM, "cloud -> edge bytes per generated token"),
    "placement": ((dict, type(None)), "CPUs and torch threads of the edge and the cloud side "
                                      "(specrelay/placement.py; pinned false: --no-pin, both share every core)"),
    "load_average": ((list,), "the machine's load average (1, 5, 15 min) as the row was written"),
}

STRESS_SUMMARY: dict[str, tuple[tuple[type, ...], str]] = {
    "edges": ((int,), "edge-worker processes"),
    "sessions_per_edge": ((int,), "client sessions kept in flight per edge"),
    "cloud_workers": ((int,), "cloud-worker processes"),
    "link": ((str,), "the link emulation that ran"),
    "rtt_ms_measured": (NUM, "null-request round trip through the link, ms"),
    "duration_s": (NUM, "seconds of measured load (after the warm-up)"),
    "generations": ((int,), "generations finished in the measured window"),
    "generated_tokens": ((int,), "tokens generated in the measured window"),
    "tokens_per_s": (NUM, "aggregate tokens/s"),
    "session_tokens_per_s_p50": (NUM, "per-session tokens/s, median"),
    "session_tokens_per_s_p10": (NUM, "per-session tokens/s, 10th percentile"),
    "itl_ms_p50": (OPT_NUM, "gap between the TOKENS messages a client sees (one carries a whole round's tokens), "
                            "median, ms"),
    "itl_ms_p99": (OPT_NUM, "the same, 99th percentile"),
    "cloud_busy_s_per_token": (OPT_NUM, "seconds the workers spent in forward passes / generated token"),
    "cloud_calls_per_token": (OPT_NUM, "VERIFYs the workers ran / generated token (same span)"),
    "errors": ((int,), "generations that failed (all codes)"),
    "errors_by_code": ((dict,), "failed generations by error code"),
    "outputs_checked": ((int,), "greedy outputs compared with the target alone"),
    "outputs_mismatched": ((int,), "of those, how many differed"),
    "rss_growth_max": (OPT_NUM, "largest RSS growth of any process after the warm-up (fraction; bar < 0.10)"),
    "rss": ((dict,), "per process: RSS MB after the warm-up, at the end, growth"),
    "placement": ((dict, type(None)), "CPUs and torch threads of the edge and the cloud side "
                                      "(specrelay/placement.py; pinned false: --no-pin, both share every core)"),
    "load_average": ((list,), "the machine's load average (1, 5, 15 min) as the row was written"),
}


def validate(obj: dict, schema: dict[str, tuple[tuple[type, ...], str]]) -> list[str]:
    """Every schema field present with an allowed type; returns the problems (empty = valid)."""
    problems = []
    for name, (types, _) in schema.items():
        if name not in obj:
            problems.append(f"missing {name}")
        elif not isinstance(obj[name], types) or (isinstance(obj[name], bool) and bool not in types):
            problems.append(f"{name}: {type(obj[name]).__name__} is not {'/'.join(t.__name__ for t in types)}")
    return problems


def describe() -> dict:
    as_doc = lambda schema: {k: {"type": "/".join(t.__name__ for t in types), "meaning": meaning}
                             for k, (types, meaning) in schema.items()}
    return {"sweep row (one per draft length and link; rows[] in sweep*.json, one per line with --json)":
            as_doc(SWEEP_ROW), "stress summary (summary in stress*.json)": as_doc(STRESS_SUMMARY)}
