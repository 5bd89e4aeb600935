"""Measure llguidance and xgrammar on this CPU: compile time, per-token mask time, rollback, install size.

    .venv/bin/pip install llguidance xgrammar
    .venv/bin/python scripts/grammar_engines.py [--out grammar_engines.json]

Two tokenizers: the demo target's (byte-level BPE, 8192) and cl100k_base (100k, rebuilt as a Hugging Face
tokenizer from the ranks that the bpe-openai test dependency ships). Each mask is timed along a real walk: the
tokens of a document the grammar accepts, a mask computed before each token, the token then consumed. Prints a
table and writes JSON with the load average (the machine is shared: times are indicative, counts are not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
DOC = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]}'
REGEX = r"[a-z]+@[a-z]+\.(com|org)"
REGEX_DOC = "ada@engines.org"


def cl100k_tokenizer():
    """cl100k_base as a PreTrainedTokenizerFast (merges from its ranks, as transformers' TikTokenConverter)."""
    import bpe_openai
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    enc = bpe_openai.get_encoding("cl100k_base")

    class Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, _url):
            return dict(enc._mergeable_ranks)

    conv = Converter(vocab_file="-", pattern=enc._pat_str, extra_special_tokens=list(enc._special_tokens))
    tok = PreTrainedTokenizerFast(tokenizer_object=conv.converted(), eos_token="<|endoftext|>")
    assert tok(DOC).input_ids == enc.encode(DOC), "rebuilt cl100k tokenizes differently"
    return tok


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t) * 1e3


def llg_engine(tok):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    info, t_info = timed(llguidance.hf.from_tokenizer, tok)
    v = info.vocab_size

    def compile_(kind, text):
        m = llguidance.LLMatcher(info, llguidance.grammar_from(kind, text), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def walk(m, ids):
        mask = lt.allocate_token_bitmask(1, v)
        times = []
        for t in ids:
            _, ms = timed(lt.fill_next_token_bitmask, m, mask, 0)
            times.append(ms)
            assert m.consume_token(t), m.get_error()
        return times, m.is_accepting()

    def rollback(m, ids):
        mask0, mask1 = lt.allocate_token_bitmask(1, v), lt.allocate_token_bitmask(1, v)
        lt.fill_next_token_bitmask(m, mask0, 0)
        m.consume_tokens(ids[:5])
        ok = m.rollback(5)
        lt.fill_next_token_bitmask(m, mask1, 0)
        return bool(ok) and torch.equal(mask0, mask1)

    return "llguidance", t_info, compile_, walk, rollback


def xgr_engine(tok):
    import xgrammar as xgr

    info, t_info = timed(xgr.TokenizerInfo.from_huggingface, tok)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    v = info.vocab_size

    def compile_(kind, text):
        g = compiler.compile_json_schema(text) if kind == "json_schema" else compiler.compile_regex(text)
        return xgr.GrammarMatcher(g, max_rollback_tokens=64)

    def walk(m, ids):
        mask = xgr.allocate_token_bitmask(1, v)
        times = []
        for t in ids:
            _, ms = timed(m.fill_next_token_bitmask, mask)
            times.append(ms)
            assert m.accept_token(t)
        return times, True

    def rollback(m, ids):
        mask0, mask1 = xgr.allocate_token_bitmask(1, v), xgr.allocate_token_bitmask(1, v)
        m.fill_next_token_bitmask(mask0)
        for t in ids[:5]:
            m.accept_token(t)
        m.rollback(5)
        m.fill_next_token_bitmask(mask1)
        return torch.equal(mask0, mask1)

    return "xgrammar", t_info, compile_, walk, rollback


def measure(engine, tok, tok_name):
    name, t_info, compile_, walk, rollback = engine(tok)
    row = {"engine": name, "tokenizer": tok_name, "vocab": len(tok), "tokenizer_info_ms": round(t_info, 1)}
    for kind, text, doc in (("json_schema", json.dumps(SCHEMA), DOC), ("regex", REGEX, REGEX_DOC)):
        ids = tok(doc, add_special_tokens=False).input_ids
        m, ms = timed(compile_, kind, text)
        times, accepting = walk(m, ids)
        row[kind] = {"compile_ms": round(ms, 1), "tokens": len(ids), "mask_ms_median": round(statistics.median(times), 3),
                     "mask_ms_max": round(max(times), 3), "accepting_at_end": accepting,
                     "rollback_5_restores_mask": rollback(compile_(kind, text), ids)}
    return row


def install_size(dists):
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    out = {}
    for d in dists:
        paths = [p for p in site.iterdir() if p.name.lower().replace("-", "_").startswith(d.replace("-", "_"))]
        size = subprocess.run(["du", "-sck", *map(str, paths)], capture_output=True, text=True).stdout
        out[d] = int(size.strip().splitlines()[-1].split()[0]) // 1024 if paths else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, )
    ap.add_argument("--out", default="grammar_engines.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    toks = [("demo-target", AutoTokenizer.from_pretrained(ROOT / "models" / "demo-target"))]
    toks.append(("cl100k_base", cl100k_tokenizer()))
    rows = [measure(e, tok, n) for n, tok in toks for e in (llg_engine, xgr_engine)]
    result = {"rows": rows, "install_mib": install_size(["llguidance", "xgrammar", "triton", "tvm_ffi",
                                                         "apache_tvm_ffi"]),
              "requires": {d: subprocess.run([sys.executable, "-m", "pip", "show", d], capture_output=True,
                                             text=True).stdout.split("Requires:")[1].split("\n")[0].strip()
                           for d in ("llguidance", "xgrammar")},
              "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "note": "2 cores shared by 7 sessions"}
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
