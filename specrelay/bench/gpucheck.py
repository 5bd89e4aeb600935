"""`specrelay bench gpu` (scripts/gpu_check.sh, `make gpu-check`): the cloud worker on one device.

(a) exactness: greedy output of the demo pair (and of each model under models/real/ when present, drafting for
    itself) through the Verifier on the device, both attention paths, float32 and bfloat16, against HF `generate`
    of the target at the same dtype on the same device; bfloat16 is also compared up to the first tie (two top
    logits within one bfloat16 step, where the order a forward sums in may flip the pick);
(b) a verify step (d = 4 drafts per session, greedy) against the model's bare forward over the same new tokens
    on a DynamicCache, at each batch and context, for both attention paths ((d): batched vs per-session);
(c) tokens/s of 16 concurrent sessions against 1, one Verifier (in-process edge and worker: drafting included).

`--device cpu --small` runs the same program at small sizes (tests/test_batchattn_gpucheck.py). Prints tables and
writes OUT/gpu_check.json; exits 1 when an exactness row fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .runs import (DEFAULT_OUT, DEMO_DRAFT, DEMO_TARGET, load_prompts, median_ms as _median_ms, meta, text_table,
                   write_result)

PATHS = ("per-session", "batched")
DRAFT_LEN = 4
# full: the sizes the issue asks for on one large GPU; small: the same program in a test's time on 2 CPUs
SIZES = {"full": dict(batches=(1, 16, 64), contexts=(64, 256, 1024, 2048), reps=5, prompts=4, tokens=32,
                      sessions=16),
         "small": dict(batches=(1, 4), contexts=(64, 96), reps=1, prompts=2, tokens=8, sessions=4)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decisive(runner, ids: list[int], out: list[int]) -> int:
    """How many of `out` (greedy tokens after ids) the model's own full forward picks by more than one bfloat16
    step (relative gap > eps of bfloat16): past that, the order in which a forward sums may flip the pick."""
    with torch.no_grad():
        x = torch.tensor([ids + out], device=runner.device)
        logits = runner.model(x).logits[0, len(ids) - 1:-1].float()  # [len(out), V]
    top = logits.topk(2, -1).values
    ties = (top[:, 0] - top[:, 1] <= torch.finfo(torch.bfloat16).eps * top[:, 0].abs()).tolist()
    return ties.index(True) if True in ties else len(out)


def hf_greedy(runner, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids], device=runner.device)
    out = runner.model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=runner.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def _verifier(runner, attention: str, sessions: int = 16, context: int = 1024):
    from ..cloud_worker.config import VerifierConfig
    from ..cloud_worker.verifier import Verifier

    budget = sessions * (context + 96) * runner.kv_shape.bytes_per_token
    return Verifier(runner, VerifierConfig(max_sessions=sessions, max_cache_bytes=budget, attention=attention,
                                           client_kv_share=1.0))  # one client: the whole store


def exactness(pair: str, target: str, draft: str | None, device: str, dtype: str, size: dict) -> list[dict]:
    """One row per attention path: the pair's greedy output through the Verifier against HF generate."""
    from ..common.runner import ModelRunner
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.draft.drafter import Drafter
    from ..speculative import speculative_generate_batch

    t = ModelRunner.load(target, device, dtype)
    d = ModelRunner.load(draft, device, dtype) if draft else t  # no draft: the target drafts for itself
    prompts = [t.tokenizer(p).input_ids[-96:] for p in load_prompts(None, size["prompts"])]
    n = size["tokens"]
    want = [hf_greedy(t, ids, n) for ids in prompts]
    cuts = [decisive(t, ids, w) for ids, w in zip(prompts, want)]
    rows = []
    for attention in PATHS:
        verifier = _verifier(t, attention, len(prompts), 512)
        config = SessionConfig(max_new_tokens=n, draft_len=DRAFT_LEN)
        got = [o for o, _ in speculative_generate_batch(Drafter(d, t.vocab_size), verifier, prompts,
                                                        [config] * len(prompts))]
        rows.append({"pair": pair, "dtype": dtype, "attention": verifier.attention, "prompts": len(prompts),
                     "tokens": n, "exact": got == want,
                     "equal_to_first_tie": all(g[:c] == w[:c] for g, w, c in zip(got, want, cuts)),
                     "tokens_before_first_tie": sum(cuts)})
    del t, d
    return rows


def _step_fns(runner, verifiers: dict, ctx: int, batch: int, ragged: bool = False) -> dict:
    """Functions running one verify step of each path and (same contexts) the bare forward, each leaving the
    state it found. ragged: the sessions' contexts spread evenly from 64 to ctx (the batched path pays padding)."""
    from ..cloud_worker.scheduler import ChunkedPrefill
    from ..common import protocol as P

    gen = torch.Generator().manual_seed(ctx * 100 + batch)
    lengths = [min(ctx, 64 + (ctx - 64) * i // max(1, batch - 1)) if ragged else ctx for i in range(batch)]
    ids = [torch.randint(1, runner.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    drafts = [torch.randint(1, runner.vocab_size, (DRAFT_LEN,), generator=gen).tolist() for _ in range(batch)]
    keys = [(b"gpu", i) for i in range(batch)]
    for v in verifiers.values():
        v.reset()
        for key, x in zip(keys, ids):
            v.open(key, P.Open(key[1], x))
        v.verify([], ChunkedPrefill(v, sum(lengths)).rows())  # each context cached but its last token

    def step(v):
        def run():
            v.verify([(k, P.Verify(k[1], 1, len(x), [], d)) for k, x, d in zip(keys, ids, drafts)])
            for k, x in zip(keys, ids):  # back to the state it found: its context, all but the last cached
                s = v.sessions[k]
                s.tokens, s.last_seq, s.last_reply = list(x), -1, None
                v.store.truncate(k, len(x) - 1)
        return run

    fns = {path: step(v) for path, v in verifiers.items()}
    spans = [next(iter(verifiers.values())).store.span(k) for k in keys]
    return fns if ragged else {"forward": _bare(runner, spans, ids, drafts, ctx)} | fns


def _bare(runner, spans, ids, drafts, ctx: int):
    """The model's own forward over the step's new tokens on a DynamicCache of the sessions' cached K/V."""
    from transformers import DynamicCache

    batch = len(ids)
    layers = [(torch.stack([s.kv[li, 0, :, :ctx - 1] for s in spans]),
               torch.stack([s.kv[li, 1, :, :ctx - 1] for s in spans]))
              for li in range(runner.kv_shape.layers)]  # [batch, heads, ctx - 1, d] per layer
    new = torch.tensor([[x[-1]] + d for x, d in zip(ids, drafts)], device=runner.device)
    positions = torch.arange(ctx - 1, ctx + DRAFT_LEN, device=runner.device).expand(batch, DRAFT_LEN + 1)

    def bare():
        cache = DynamicCache(ddp_cache_data=layers)
        with torch.no_grad():
            runner.model(input_ids=new, position_ids=positions, use_cache=True, **{runner._cache_kw: cache})
        _sync(runner.device)
    return bare


def _attention_calls(fn) -> int:
    """SDPA calls one run of `fn` makes (a count: it does not depend on the machine's load)."""
    import torch.nn.functional as F

    sdpa, calls = F.scaled_dot_product_attention, []
    F.scaled_dot_product_attention = lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    try:
        fn()
    finally:
        F.scaled_dot_product_attention = sdpa
    return len(calls)



def steps(model: str, device: str, dtype: str, size: dict) -> list[dict]:
    """(b) and (d): a verify step of each path against the bare forward, per context and batch; and, for batches
    of more than one, with the sessions' contexts spread from 64 to it (context "64-N": no bare forward)."""
    from ..common.runner import ModelRunner

    runner = ModelRunner.load(model, device, dtype)
    limit = runner.max_context or 4096
    contexts = [c for c in size["contexts"] if c + 2 * DRAFT_LEN <= limit]
    most = max(size["batches"])
    verifiers = {path: _verifier(runner, path, most, max(contexts)) for path in PATHS}
    rows = []
    for ctx, batch, ragged in [(c, b, r) for c in contexts for b in size["batches"] for r in (False, True)
                               if not r or (b > 1 and c > 64)]:
        fns = _step_fns(runner, verifiers, ctx, batch, ragged)
        error = None if ragged else _guarded(fns["forward"], lambda e: e)  # only the baseline: may be left out
        ms = _median_ms({p: fns[p] for p in PATHS} if error or ragged else fns, size["reps"])
        bare = ms.get("forward")
        rows.append({"context": f"64-{ctx}" if ragged else ctx, "batch": batch, "forward_ms": bare and round(bare, 2)}
                    | {f"{p}_ms": round(ms[p], 2) for p in PATHS}
                    | {"batched_vs_forward": bare and round(ms["batched"] / bare, 3),
                       "per_session_vs_forward": bare and round(ms["per-session"] / bare, 3),
                       "batched_vs_per_session": round(ms["batched"] / ms["per-session"], 3),
                       "load": os.getloadavg()[0]}
                    | {f"{p}_sdpa_calls": _attention_calls(fns[p]) for p in PATHS}
                    | ({"forward_error": error} if error else {}))
    return rows


def throughput(target: str, draft: str, device: str, dtype: str, size: dict) -> dict:
    """(c): generated tokens/s of `sessions` concurrent sessions against one, one Verifier (its default path)."""
    from ..common.runner import ModelRunner
    from ..edge_worker.config import SessionConfig
    from ..edge_worker.draft.drafter import Drafter
    from ..speculative import speculative_generate_batch

    t, d = ModelRunner.load(target, device, dtype), ModelRunner.load(draft, device, dtype)
    texts = load_prompts(None, size["sessions"])
    prompts = [t.tokenizer(p).input_ids[-96:] for p in texts]
    verifier = _verifier(t, "auto", len(prompts), 512)
    config = SessionConfig(max_new_tokens=size["tokens"], draft_len=DRAFT_LEN)
    rates = {}
    for n in (1, len(prompts)):
        speculative_generate_batch(Drafter(d, t.vocab_size), verifier, prompts[:n], [config] * n)  # warm-up
        t0 = time.perf_counter()
        out = speculative_generate_batch(Drafter(d, t.vocab_size), verifier, prompts[:n], [config] * n)
        rates[n] = sum(len(o) for o, _ in out) / (time.perf_counter() - t0)
    one, many = rates[1], rates[len(prompts)]
    return {"attention": verifier.attention, "sessions": len(prompts), "tokens_per_s_1": round(one, 1),
            f"tokens_per_s_{len(prompts)}": round(many, 1), "ratio": round(many / one, 2),
            "load": os.getloadavg()[0]}


def real_models(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*") if (p / "config.json").is_file()) if root.is_dir() else []


def run(args) -> dict:
    size = dict(SIZES["small" if args.small else "full"])
    size |= {k: tuple(v) for k, v in (("batches", args.batches), ("contexts", args.contexts)) if v}
    size |= {"reps": args.reps} if args.reps else {}
    real = real_models(Path(args.real))
    exact = []
    for dtype in () if args.steps_only else ("float32", "bfloat16"):
        pairs = [("demo", args.target, args.draft)] + [(f"real:{p.name}", str(p), None) for p in real]
        for pair, target, draft in pairs:
            exact += _guarded(lambda: exactness(pair, target, draft, args.device, dtype, size),
                              lambda e: [{"pair": pair, "dtype": dtype, "exact": False, "equal_to_first_tie": False,
                                          "attention": "-", "prompts": 0, "tokens": 0, "error": e}])
    step_model = str(real[0]) if real else args.target
    return {"meta": meta(["gpu", *args.argv]), "device": _describe(args.device), "size": size,
            "exactness": exact, "step_model": step_model,
            "steps": _guarded(lambda: steps(step_model, args.device, args.step_dtype, size),
                              lambda e: [{"error": e}]),
            "throughput": None if args.steps_only else _guarded(
                lambda: throughput(args.target, args.draft, args.device, args.step_dtype, size),
                lambda e: {"error": e}),
            "real_models": [p.name for p in real]}


def _guarded(part, failed):
    """Run one part of the check; a failure is recorded (one line) in its place, and the other parts still run."""
    try:
        return part()
    except Exception as exc:  # the check's first run on a device: report everything it can
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"gpu check: {message}", file=sys.stderr)
        return failed(message)


def _describe(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (torch {torch.__version__})"
    return f"cpu, {torch.get_num_threads()} threads (torch {torch.__version__})"


def report(result: dict) -> None:
    ex = result["exactness"]
    print(f"device: {result['device']}")
    print(text_table(["pair", "dtype", "attention", "prompts", "tokens", "exact", "equal to first tie", "error"],
                     [[r["pair"], r["dtype"], r["attention"], r["prompts"], r["tokens"], r["exact"],
                       r["equal_to_first_tie"], r.get("error", "")] for r in ex]))
    print(f"\nverify step vs bare forward ({result['step_model']}, d = {DRAFT_LEN}):")
    if result["steps"] and "error" in result["steps"][0]:
        print(result["steps"][0]["error"])
    else:
        print(text_table(["context", "batch", "forward ms", "per-session ms", "batched ms",
                          "batched / per-session", "batched / forward", "attention calls", "load"],
                         [[r["context"], r["batch"], r["forward_ms"], r["per-session_ms"], r["batched_ms"],
                           r["batched_vs_per_session"], r["batched_vs_forward"],
                           f"{r['per-session_sdpa_calls']} / {r['batched_sdpa_calls']}", round(r["load"], 1)]
                          for r in result["steps"]]))
    tp = result["throughput"]
    if tp and "error" in tp:
        print(f"\nthroughput: {tp['error']}")
    elif tp:
        print(f"\nthroughput ({tp['attention']}): {tp['sessions']} sessions / 1 = {tp['ratio']}x "
              f"({tp['tokens_per_s_1']} tokens/s alone)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small sizes (the default on cpu)")
    ap.add_argument("--target", default=DEMO_TARGET)
    ap.add_argument("--draft", default=DEMO_DRAFT)
    ap.add_argument("--real", default="models/real", help="directory of real checkpoints (skipped when absent)")
    ap.add_argument("--step-dtype", default=None, help="dtype of the step and throughput measurements "
                    "(default: bfloat16 on cuda, float32 on the cpu, where bfloat16 is slow)")
    ap.add_argument("--batches", type=int, nargs="+", help="override the step's batch sizes")
    ap.add_argument("--contexts", type=int, nargs="+", help="override the step's contexts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the cpu (default 1: a shared machine)")
    ap.add_argument("--reps", type=int, help="override the timed rounds of each step")
    ap.add_argument("--steps-only", action="store_true", help="only (b) and (d): the step table")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.argv = list(argv or [])
    args.small = args.small or args.device == "cpu"
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    args.step_dtype = args.step_dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    result = run(args)
    report(result)
    write_result(args.out, "gpu_check", result)
    bad = [r for r in result["exactness"] if not (r["exact"] if r["dtype"] == "float32" else r["equal_to_first_tie"])]
    broken = (result["steps"] and "error" in result["steps"][0]) or (result["throughput"] or {}).get("error")
    return 1 if bad or broken else 0
