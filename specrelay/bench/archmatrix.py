"""The architecture matrix: every tiny model of `specrelay.archs` as a target behind a real broker and cloud
worker, and as a draft on a real edge, greedy output compared with transformers' `generate` of the target.

Processes: the cloud side is ONE child process (`python -m specrelay.bench.archmatrix`) holding a broker and a cloud
worker per target (real ZeroMQ over tcp on 127.0.0.1, the same `Broker` and `CloudWorker` the CLI starts);
twenty-odd `specrelay cloud-worker` processes would spend minutes importing torch on two cores. The edges run
in the calling process (`load_edge`: the CLI's edge, self-check included) and reach their brokers over tcp.

Pairs: a ring (target = ARCHS[i], draft = ARCHS[i + 1]) puts every architecture once on each side; the
cross-vocabulary pairs draft with the demo-draft-xv tokenizer against demo-target-vocabulary targets
(`--target-tokenizer`). `specrelay bench archs` runs it, prints the README's table and writes JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..archs import ARCHS, Arch, build
from ..paths import demo_model
from .runs import HelpFormatter

TARGET_TOKENIZER = Path(demo_model("demo-target"))
XV_TOKENIZER = Path(demo_model("demo-draft-xv"))
NEW_TOKENS = 8
DRAFT_LEN = 3
LOOPBACK = "tcp://127.0.0.1:0"  # a broker binds a free port itself
WORKER = dict(max_sessions=8, max_cache_bytes=1 << 22, max_wait_ms=2.0)  # tiny models: a 4 MiB KV store


@dataclass(frozen=True)
class Pair:
    target: Arch
    draft: Arch
    cross_vocab: bool = False

    @property
    def name(self) -> str:
        return f"{self.target.model_type}<-{self.draft.model_type}{'/xv' if self.cross_vocab else ''}"


def pairs(archs: tuple[Arch, ...] = ARCHS) -> list[Pair]:
    by_type = {a.model_type: a for a in archs}
    ring = [Pair(a, archs[(i + 1) % len(archs)]) for i, a in enumerate(archs)]
    cross = [Pair(by_type[t], by_type[d], True) for t, d in (("gpt_oss", "gemma2"), ("bloom", "mistral"),
                                                             ("gemma3_text", "phi3")) if t in by_type and d in by_type]
    return ring + cross


def build_models(root: Path, chosen: list[Pair]) -> dict[tuple[str, bool], Path]:
    """(model_type, cross_vocab) -> checkpoint directory, for every target and draft of `chosen`."""
    by_type = {p.target.model_type: p.target for p in chosen} | {p.draft.model_type: p.draft for p in chosen}
    need = {(p.target.model_type, False) for p in chosen} | {(p.draft.model_type, p.cross_vocab) for p in chosen}
    out = {}
    for arch, xv in ((by_type[t], xv) for t, xv in sorted(need)):
        path = root / (arch.model_type + ("-xv" if xv else ""))
        if not (path / "config.json").exists():
            build(arch, XV_TOKENIZER if xv else TARGET_TOKENIZER, path, seed=1 + xv)
        out[arch.model_type, xv] = path
    return out


# ---- the cloud side: one process, a broker + a cloud worker per target ------------------------------------------

async def _host(spec: list[dict]) -> None:
    """Start a broker (on free ports it binds itself: no race for a port) and a cloud worker for every
    {name, model} of `spec`; print `READY name path frontend` or `REFUSED name: why` per entry; serve until
    stdin closes."""
    import torch

    from ..broker.server import Broker
    from ..cloud_worker.config import WorkerConfig
    from ..cloud_worker.server import CloudWorker
    from ..common.runner import ModelRunner

    torch.set_num_threads(1)
    async with contextlib.AsyncExitStack() as stack:
        for entry in spec:
            try:
                runner = await asyncio.to_thread(ModelRunner.load, entry["model"])
                broker = await stack.enter_async_context(Broker(LOOPBACK, LOOPBACK, linger_ms=0))
                worker = await stack.enter_async_context(CloudWorker(broker.backend, runner, WorkerConfig(**WORKER)))
            except Exception as exc:  # FatalError: refused at start-up; anything else is reported the same way
                print("REFUSED", entry["name"] + ":", " ".join(f"{type(exc).__name__}: {exc}".split()), flush=True)
                continue
            path = "own-cache" if type(worker.verifier.store).__name__ == "OwnCacheStore" else "kv-store"
            print("READY", entry["name"], path, broker.frontend, flush=True)
        print("ALL", flush=True)
        await asyncio.to_thread(sys.stdin.read)


@contextlib.contextmanager
def cloud(models: dict[tuple[str, bool], Path], targets: list[str], timeout: float = 300.0):
    """Yield {target: (frontend or None, path or None if refused, refusal)} while the cloud-side process runs."""
    spec = [dict(name=t, model=str(models[t, False])) for t in targets]
    proc = subprocess.Popen([sys.executable, "-m", "specrelay.bench.archmatrix", json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        status, deadline = {}, time.monotonic() + timeout
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "ALL":
                break
            if word == "READY":
                name, path, frontend = rest.split()
                status[name] = (frontend, path, "")
            elif word == "REFUSED":
                name, _, why = rest.partition(": ")
                status[name.rstrip(":")] = (None, None, why)
            if time.monotonic() > deadline:
                raise TimeoutError("the cloud side did not start in time")
        else:
            raise RuntimeError(f"the cloud side exited early: {proc.wait()}")
        yield {t: status.get(t, (None, None, "no answer")) for t in targets}
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the edge side ------------------------------------------------------------------------------------------

def references(models: dict, targets: list[str], prompts: list[str], n: int) -> dict[str, list[tuple]]:
    """target -> [(prompt ids, transformers' greedy continuation)] per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for t in targets:
        tok = AutoTokenizer.from_pretrained(models[t, False])
        model = AutoModelForCausalLM.from_pretrained(models[t, False]).eval()
        rows = []
        for prompt in prompts:
            ids = tok(prompt).input_ids
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            rows.append((ids, gen[0, len(ids):].tolist()))
        out[t] = rows
    return out


async def load_pair(pair: Pair, models: dict, frontend: str):
    """The pair's edge (not started), or the exception its start-up raised (the draft's self-check among them)."""
    from ..edge_worker.config import EdgeConfig
    from ..edge_worker.server import load_edge

    target_tok = str(models[pair.target.model_type, False]) if pair.cross_vocab else None
    try:
        return await load_edge(frontend, str(models[pair.draft.model_type, pair.cross_vocab]), target_tok,
                               config=EdgeConfig(request_timeout_s=120.0, linger_ms=0))
    except Exception as exc:
        return exc


async def run_pair(pair: Pair, edge, refs: list[tuple], n: int) -> dict:
    """Generate greedily through the edge for every reference prompt; the row of the result table."""
    from ..edge_worker.config import SessionConfig

    row = dict(pair=pair.name, target=pair.target.model_type, draft=pair.draft.model_type,
               cross_vocab=pair.cross_vocab, exact=False, error="", accepted=0, drafted=0)
    started = time.monotonic()
    try:
        if isinstance(edge, Exception):
            raise edge
        async with edge:
            outs = await asyncio.gather(*(edge.generate(ids, SessionConfig(max_new_tokens=n, draft_len=DRAFT_LEN))
                                          for ids, _ in refs))
        row["exact"] = all(out == want for (out, _), (_, want) in zip(outs, refs))
        row["accepted"] = sum(s.get("accepted_tokens", 0) for _, s in outs)
        row["drafted"] = sum(s.get("draft_tokens", 0) for _, s in outs)
    except Exception as exc:  # one row's failure is that row's result
        row["error"] = f"{type(exc).__name__}: {exc}"
    row["wall_s"] = round(time.monotonic() - started, 2)
    return row


async def run_pairs(chosen: list[Pair], models: dict, endpoints: dict, refs: dict, n: int) -> list[dict]:
    """Every pair's row; edges load one after another (transformers' loading is not thread-safe), then all
    generate at once."""
    edges = [await load_pair(p, models, endpoints[p.target.model_type][0]) for p in chosen]
    return await asyncio.gather(*(run_pair(p, e, refs[p.target.model_type], n) for p, e in zip(chosen, edges)))


# ---- the table ------------------------------------------------------------------------------------------------

PATHS = {"kv-store": "supported (KV store)", "own-cache": "fallback (own cache, 1 forward/session)", None: "refused"}


def table(rows: list[dict], endpoints: dict, archs: tuple[Arch, ...] = ARCHS) -> list[dict]:
    """Per architecture: its attention feature, how the cloud serves it, and whether greedy output was exact
    with it as the target and as a draft (✓ / ✗ / – not run)."""
    def mark(found: list[dict]) -> str:
        return "–" if not found else "✓" if all(r["exact"] for r in found) else "✗"

    return [dict(architecture=a.model_type, feature=a.feature or "causal", cloud=PATHS[endpoints[a.model_type][1]]
                 if a.model_type in endpoints else "–",
                 target=mark([r for r in rows if r["target"] == a.model_type]),
                 draft=mark([r for r in rows if r["draft"] == a.model_type and not r["cross_vocab"]]),
                 cross_vocab_draft=mark([r for r in rows if r["draft"] == a.model_type and r["cross_vocab"]]))
            for a in archs]


def run(root: Path, n_prompts: int = 2, new_tokens: int = NEW_TOKENS) -> dict:
    """The whole matrix; the result JSON (per-pair rows, per-architecture table, seconds per phase)."""
    started = time.monotonic()
    chosen = pairs()
    models = build_models(root, chosen)
    targets = sorted({p.target.model_type for p in chosen})
    lines = Path(demo_model("heldout_prompts.jsonl")).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:n_prompts]
    refs = references(models, targets, prompts, new_tokens)
    with cloud(models, targets) as endpoints:
        rows = asyncio.run(run_pairs(chosen, models, endpoints, refs, new_tokens))
    return dict(pairs=rows, table=table(rows, endpoints), prompts=n_prompts, new_tokens=new_tokens,
                seconds=round(time.monotonic() - started, 1))


def main(argv: list[str] | None = None) -> int:
    """`specrelay bench archs`: run the matrix, print the README table, write OUT/archs.json."""
    import argparse
    import tempfile

    from .runs import meta, text_table, write_result

    ap = argparse.ArgumentParser(allow_abbrev=False, prog="specrelay bench archs", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per pair")
    ap.add_argument("--max-new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        result = run(Path(root), args.prompts, args.max_new_tokens)
    result["meta"] = meta(["archs", *(argv or [])])
    write_result(args.out, "archs", result)
    headers = ["architecture", "attention", "cloud worker", "as target", "as draft", "as cross-vocab draft"]
    print(text_table(headers, [list(r.values()) for r in result["table"]]))
    exact = sum(r["exact"] for r in result["pairs"])
    print(f"\n{exact} of {len(result['pairs'])} pairs exact; {result['seconds']} s")
    return 0 if exact == len(result["pairs"]) else 1


if __name__ == "__main__":
    asyncio.run(_host(json.loads(sys.argv[1])))
