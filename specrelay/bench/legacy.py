"""The first benchmarks (issues 2-4), each a function of the parsed arguments returning its JSON result:

    calls         cloud calls per token: --draft-len (auto: under --objective) vs --draft-len 0, greedy
    concurrency   one cloud worker: 16 concurrent sessions vs 1 (verified tokens/s)
    hf            one session over loopback vs HF assisted generation in-process
    xvocab        cross-vocabulary pair, T=1: bits/token up+down for full|hr|srdv|coupled
    wire          bytes of each message for d = 4 and d = 8
    srdv_k        SR-DV candidates per round: downlink bits vs extra round trips

Everything runs on 127.0.0.1 (broker and workers as child processes, `specrelay.cluster`), the edge (this
process) and the cloud side on separate cores unless --no-pin (specrelay/placement.py); a result records both.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

from ..common.protocol import Mode, Strategy
from ..placement import stamp
from .runs import load_prompts, run_edge, run_edges, totals


def bench_calls(args) -> dict:
    """Cloud calls per token through the broker, greedy, under --draft-len (auto: under --objective) against
    --draft-len 0 (whose output is the target alone's); per-position acceptance and the lengths auto chose.
    The two run on fresh edges of their own, --slice prompts at a time, taking turns (bench/runs.py run_edges).
    --repeats N: N such pairs of runs; the top-level figures are the medians, `runs` every pair's, `spread` the
    largest minus the smallest."""
    from .link import LinkRelay, LinkSpec

    texts = load_prompts(args.prompts, args.num_prompts)
    draft_len = None if args.draft_len == "auto" else int(args.draft_len)
    run = dict(target_tok=args.target_tokenizer, max_new_tokens=args.max_new_tokens)
    pairs = []
    with cluster(args) as c, LinkRelay(LinkSpec.parse(args.link), c.frontend, rate_by="relay") as link:
        if link.proc is not None:
            c.place_cloud(link.proc.pid)
        for i in range(max(1, getattr(args, "repeats", 1))):
            setting = {"draft_len": draft_len, "objective": args.objective}
            (spec, wall), (base, base_wall) = asyncio.run(run_edges(
                link.endpoint, args.draft, texts, args.concurrency, [setting, {"draft_len": 0}],
                slice_=getattr(args, "slice", 0), **run))
            pairs.append(_calls_row(spec, wall, base, base_wall))
            if len(pairs) > 1 or getattr(args, "repeats", 1) > 1:
                print(f"run {i + 1}: {pairs[-1]['cloud_calls_per_token']} calls/token, "
                      f"{pairs[-1]['speed_vs_target_alone']}x the target alone's tokens/s", file=sys.stderr)
    out = pairs[0] if len(pairs) == 1 else _medians(pairs)
    return stamp({"prompts": len(texts), "max_new_tokens": args.max_new_tokens, "draft": args.draft,
                  "cross_vocab": bool(args.target_tokenizer), "concurrency": args.concurrency,
                  "link": link.described, "draft_len": args.draft_len, "objective": args.objective, **out}, c.placement)


def _calls_row(spec, wall: float, base, base_wall: float) -> dict:
    s, b = totals(spec), totals(base)
    tokens_per_s, alone = s["generated_tokens"] / wall, b["generated_tokens"] / base_wall
    return {"generated_tokens": s["generated_tokens"], "cloud_calls": s["cloud_calls"],
            "cloud_calls_per_token": round(s["cloud_calls"] / s["generated_tokens"], 4),
            "baseline_cloud_calls_per_token": round(b["cloud_calls"] / b["generated_tokens"], 4),
            "reduction_vs_target_alone": round(1 - s["cloud_calls"] / b["cloud_calls"], 4),
            "acceptance_rate": round(s["accepted_tokens"] / max(1, s["draft_tokens"]), 4),
            "acceptance_per_position": position_acceptance(spec),
            "rounds_by_draft_len": rounds_by_length(spec),
            "tokens_per_s": round(tokens_per_s, 2), "target_alone_tokens_per_s": round(alone, 2),
            "speed_vs_target_alone": round(tokens_per_s / alone, 3),
            "outputs_identical_to_draft_len_0": all(x[0] == z[0] for x, z in zip(spec, base)),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def _medians(pairs: list[dict]) -> dict:
    """The runs' medians of each figure, every run, and the spread (max - min) of calls per token and speed."""
    keys = ("cloud_calls_per_token", "tokens_per_s", "target_alone_tokens_per_s", "speed_vs_target_alone")
    spread = {k: round(max(p[k] for p in pairs) - min(p[k] for p in pairs), 4) for k in keys}
    return {**{k: statistics.median(p[k] for p in pairs) for k in keys}, "runs": pairs, "spread": spread,
            "outputs_identical_to_draft_len_0": all(p["outputs_identical_to_draft_len_0"] for p in pairs)}


def cluster(args, **options):
    """A LocalCluster of the target, placed as the flags say (--no-pin, --threads)."""
    from ..cluster import LocalCluster

    return LocalCluster(args.target, threads=args.threads, pin=not args.no_pin, **options)


def position_acceptance(out: list[tuple[list[int], dict]], top: int = 12) -> list[float]:
    """a_j: accepted / tested at draft position j, over all sessions (positions tested at least once)."""
    rates = []
    for j in range(top):
        reached = sum(s["reached_per_pos"][j] for _, s in out if len(s["reached_per_pos"]) > j)
        accepted = sum(s["accepted_per_pos"][j] for _, s in out if len(s["accepted_per_pos"]) > j)
        if reached:
            rates.append(round(accepted / reached, 3))
    return rates


def rounds_by_length(out: list[tuple[list[int], dict]]) -> dict[str, int]:
    counts: dict[int, int] = {}
    for _, s in out:
        for d, n in s["rounds_by_draft_len"].items():
            counts[int(d)] = counts.get(int(d), 0) + n
    return {str(d): counts[d] for d in sorted(counts)}


def bench_concurrency(args) -> dict:
    """Aggregate tokens/s at 16 concurrent sessions against one, through a local broker and worker (greedy)."""
    texts = load_prompts(args.prompts, 16)
    rows = {}
    with cluster(args, max_batch=32) as c:
        for n in (1, 16):
            batch = texts[:n] if n > 1 else texts[:4]
            out, wall = asyncio.run(run_edge(c.frontend, args.draft, batch, n,
                                             max_new_tokens=args.max_new_tokens))
            t = totals(out)
            rows[n] = {"sessions": n, "generated_tokens": t["generated_tokens"], "wall_s": round(wall, 3),
                       "tokens_per_s": round(t["generated_tokens"] / wall, 2)}
    ratio = rows[16]["tokens_per_s"] / rows[1]["tokens_per_s"]
    return stamp({"one_session": rows[1], "sixteen_sessions": rows[16], "speedup": round(ratio, 2),
                  "bar_ge_5x": ratio >= 5}, c.placement)


def bench_hf(args) -> dict:
    """Tokens/s of one session through specrelay against HF assisted generation in one process, outputs compared."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = load_prompts(args.prompts, args.num_prompts)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft).eval()
    n_hf, t0 = 0, time.perf_counter()
    hf_out = []
    for text in texts:
        ids = torch.tensor([tok(text).input_ids])
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=args.max_new_tokens,
                              pad_token_id=tok.eos_token_id)
        hf_out.append(out[0, ids.shape[1]:].tolist())
        n_hf += len(hf_out[-1])
    hf_wall = time.perf_counter() - t0
    del target
    with cluster(args) as c:
        out, wall = asyncio.run(run_edge(c.frontend, args.draft, texts, 1,
                                         max_new_tokens=args.max_new_tokens))
    ours = totals(out)["generated_tokens"] / wall
    hf = n_hf / hf_wall
    same = sum(a == b[0] for a, b in zip(hf_out, out))
    return stamp({"prompts": len(texts), "specrelay_tokens_per_s": round(ours, 2),
                  "hf_assisted_tokens_per_s": round(hf, 2), "ratio": round(ours / hf, 3), "bar_ge_0.9": ours / hf >= 0.9,
                  "outputs_equal_hf": f"{same}/{len(texts)}"}, c.placement)


def bench_xvocab(args) -> dict:
    """Cross-vocabulary pair at T = 1, default flags (auto, balanced), 8 sessions: bits per token up and down per
    resampling mode, tokens per VERDICT; coupled output checked against the target alone (d = 0, same seed)."""
    texts = load_prompts(args.prompts, args.num_prompts)
    rows, outs = {}, {}
    with cluster(args) as c:
        def run(**cfg) -> list[tuple[list[int], dict]]:
            return asyncio.run(run_edge(c.frontend, args.draft, texts, 8, temperature=1.0, seed=7,
                                        target_tok=args.target_tokenizer or args.target,
                                        max_new_tokens=args.max_new_tokens, **cfg))[0]

        for strategy in ("full", "hr", "srdv", "coupled"):
            cfg = {"mode": Mode.COUPLED} if strategy == "coupled" else {"mode": Mode.SAMPLE,
                                                                        "resample": Strategy[strategy.upper()]}
            outs[strategy] = out = run(**cfg)
            t = totals(out)
            n = t["generated_tokens"]
            rows[strategy] = {"uplink_bits_per_token": round(8 * t["uplink_bytes"] / n, 1),
                              "downlink_bits_per_token": round(8 * t["downlink_bytes"] / n, 1),
                              "acceptance_rate": round(t["accepted_tokens"] / max(1, t["draft_tokens"]), 4),
                              "cloud_calls_per_token": round(t["cloud_calls"] / n, 4),
                              "tokens_per_verdict": round(n / max(1, t["cloud_calls"]), 3), "generated_tokens": n}
        alone = run(mode=Mode.COUPLED, draft_len=0)  # coupled is drafter-invariant: the target alone's text
        rows["coupled"]["outputs_identical_to_target_alone"] = all(
            a[0] == b[0] for a, b in zip(outs["coupled"], alone))
    return stamp({"temperature": 1.0, "prompts": len(texts), "modes": rows,
                  "bar_srdv_down_le_150": rows["srdv"]["downlink_bits_per_token"] <= 150,
                  "bar_coupled_down_le_64": rows["coupled"]["downlink_bits_per_token"] <= 64}, c.placement)


def bench_srdv_k(args) -> dict:
    """SR-DV candidates per round K, in-process on the cross-vocab demo pair at T = 1: downlink bits per token
    (VERDICT + RESAMPLED) and extra round trips. Picks the K the protocol uses (common.resample)."""
    from ..common import resample
    from ..common.runner import ModelRunner
    from ..common.sampling import SamplingParams
    from ..edge_worker.loading import load_drafter
    from ..edge_worker.config import SessionConfig
    from ..speculative import speculative_generate_batch

    target = ModelRunner.load(args.target)
    drafter, tok = load_drafter(args.draft, args.target_tokenizer or args.target)
    ids = [tok(t).input_ids for t in load_prompts(args.prompts, args.num_prompts)]
    rows, default = {}, resample.SRDV_CANDIDATES
    try:
        for k in (1, 2, 4, 8):
            resample.SRDV_CANDIDATES = k
            configs = [SessionConfig(max_new_tokens=args.max_new_tokens, params=SamplingParams(1.0), mode=Mode.SAMPLE,
                                     seed=i, resample=Strategy.SRDV) for i in range(len(ids))]
            res = speculative_generate_batch(drafter, target, ids, configs)
            n = sum(s["generated_tokens"] for _, s in res)
            rows[f"K={k}"] = {"downlink_bits_per_token": round(8 * sum(s["downlink_bytes"] for _, s in res) / n, 1),
                              "resample_round_trips_per_token": round(sum(s["resample_calls"] for _, s in res) / n, 4)}
    finally:
        resample.SRDV_CANDIDATES = default
    return {"temperature": 1.0, "prompts": len(ids), "protocol_default_K": default, "by_K": rows}


def two_branches(d: int) -> list[int]:
    """parents of a d-node tree: two chains from the root, nodes alternating between them (0, 1, then 2 under 0,
    3 under 1, ...)."""
    return [-1, -1][:d] + list(range(max(0, d - 2)))


def bench_wire(args) -> dict:
    """Bytes on the wire (header + body frames) of each message, for d = 4 and d = 8 draft tokens.
    Realistic field values: a small per-edge session id (37), token ids near 8000, position 300."""
    from ..common import protocol as P
    from ..common.packing import f32

    sid, ids = 37, lambda n: [8000 + i for i in range(n)]
    size = lambda m: sum(map(len, P.encode(m)))
    rows = {}
    for d in (4, 8):
        rows[f"d={d}"] = {
            "VERIFY greedy/coupled": size(P.Verify(sid, 57, 300, [], ids(d))),
            "VERIFY sample (q per token)": size(P.Verify(sid, 57, 300, [], ids(d), f32([0.5] * d))),
            "VERIFY sample + 1 tail token": size(P.Verify(sid, 57, 300, [8001], ids(d), f32([0.5] * d))),
            "VERIFY greedy/coupled tree (2 branches at the root)": size(P.Verify(sid, 57, 300, [], ids(d), b"",
                                                                               two_branches(d))),
            "VERIFY sample tree, root's q row sparse (top-40)": size(P.Verify(
                sid, 57, 300, [], ids(d), f32([0.5] * d), two_branches(d), [P.QRow(f32([0.025] * 40), ids(40))])),
            "VERIFY sample tree, root's q row dense (8192 floats)": size(P.Verify(
                sid, 57, 300, [], ids(d), f32([0.5] * d), two_branches(d), [P.QRow(f32([1 / 8192] * 8192))])),
        }
    rows["any d"] = {
        "OPEN (100-token prompt)": size(P.Open(sid, ids(100), P.Mode.GREEDY)),
        "OPEN (sample, cross-vocab bitmap 8192)": size(P.Open(sid, ids(100), P.Mode.SAMPLE, 1.0, 0, 1.0, 7,
                                                              P.Strategy.HR, b"\xff" * 1024, 8192)),
        "VERDICT (accepted + next token)": size(P.Verdict(sid, 57, 3, 8001)),
        "VERDICT of a tree (+ the deepest accepted node)": size(P.Verdict(sid, 57, 3, 8001, node=5)),
        f"VERDICT + load hint (1 in {P.HINT_EVERY})": size(P.Verdict(sid, 57, 3, 8001,
                                                                     load=P.LoadHint(16, 5, 41000, 3000, 80, 0, 350, 777))),
        f"VERDICT + load hint with the cost curve (1 in {P.HINT_EVERY ** 2})": size(P.Verdict(
            sid, 57, 3, 8001, load=P.LoadHint(16, 5, 41000, 3000, 80, 0, 350, 777, [8600, 12400, 15200, 26500]))),
        "VERDICT srdv (4 candidates)": size(P.Verdict(sid, 57, 1, -1, candidates=ids(4), cand_p=f32([0.1] * 4))),
        "VERDICT hr (p on V_c: 2950 floats + θ_o)": size(P.Verdict(sid, 57, 1, -1, p=f32([0.0] * 2950), theta_o=0.1)),
        "VERDICT full (8192 floats)": size(P.Verdict(sid, 57, 1, -1, p=f32([0.0] * 8192))),
        "RESAMPLE": size(P.Resample(sid, 57, P.ResampleKind.SERVER_ONLY)),
        "RESAMPLED": size(P.Resampled(sid, 57, 8001)),
        "CLOSE": size(P.Close(sid)), "ERROR": size(P.Error(sid, 57, P.ErrorCode.UNKNOWN_SESSION,
                                                           "session 37 is not held by this worker; re-OPEN it")),
        "READY": size(P.Ready("models/demo-target", 8192, 1024, 32)), "HEARTBEAT": size(P.Heartbeat(12)),
        "DISCONNECT": size(P.Disconnect("shutdown")),
    }
    return rows


def wire_markdown(rows: dict) -> str:
    """bench_wire's result as the README's table (tests/test_readme_wire.py keeps the README equal to it)."""
    lines = ["| message | d = 4 | d = 8 |", "|---|---:|---:|"]
    lines += [f"| {name} | {n} | {rows['d=8'][name]} |" for name, n in rows["d=4"].items()]
    lines += [f"| {name} | {n} | {n} |" for name, n in rows["any d"].items()]
    return "\n".join(lines)


LEGACY = {"wire": bench_wire, "srdv_k": bench_srdv_k, "calls": bench_calls, "concurrency": bench_concurrency,
          "hf": bench_hf, "xvocab": bench_xvocab}
