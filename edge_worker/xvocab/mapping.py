"""Cross-vocabulary token mapping (X-CoSD; Timor et al. 2025): tokens are compared by the BYTES they decode to.

  token_bytes(tok)  id -> the exact bytes the token stands for inside text (None for special tokens).
  V_c               shared vocabulary: draft/target token pairs with equal bytes, plus draft eos <-> target eos.
  V_o               target-only tokens (target_mask == False); the draft never proposes them.
  SharedVocab       the two id maps over V_c; `SharedVocab.identity` is the same-vocabulary case.

Report of |V| and |V_c| for the demo pair and the OpenAI vocabularies:
    python -m specrelay.edge_worker.xvocab.mapping --report [--gpt2-encoder path/to/encoder.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import struct
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import structlog
import torch

log = structlog.get_logger("specrelay.vocab")

FORMAT = "specrelay-vocab-v1"  # bump when the byte rules change: old cache entries then stop matching
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


# ----------------------------------------------------------------------------- bytes of a token

@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in char -> the byte it encodes ('Ġ' -> 0x20)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:  # unprintable bytes are shifted past 255 in order of appearance
            chars[chr(256 + n)] = b
            n += 1
    return chars


def byte_level_bytes(piece: str) -> bytes | None:
    """'Ġdef' -> b' def'; None when a char is outside the alphabet (not a byte-level piece)."""
    alphabet = _byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in piece)
    except KeyError:
        return None


def _component(backend, name: str) -> dict:
    obj = getattr(backend, name)
    return json.loads(obj.__getstate__()) if obj is not None else {}


def _types(node) -> set[str]:
    """Every "type" in a (possibly nested Sequence) tokenizers component, plus marker for a '▁'->' ' Replace."""
    found: set[str] = set()
    if isinstance(node, dict):
        if node.get("type"):
            found.add(node["type"])
        if node.get("type") == "Replace" and node.get("pattern", {}).get("String") == "▁":
            found.add("ReplaceMetaspace")
        for value in node.values():
            found |= _types(value)
    elif isinstance(node, list):
        for value in node:
            found |= _types(value)
    return found


def vocab_scheme(tokenizer) -> str:
    """How the vocabulary spells bytes, read from the backend's decoder/pre-tokenizer (never guessed per token):
    'byte_level' (GPT-2 alphabet), 'metaspace' ('▁' = space) or 'plain' (pieces are UTF-8 text), each with
    '+byte_fallback' when <0xNN> pieces stand for single bytes."""
    backend = tokenizer.backend_tokenizer
    kinds = _types(_component(backend, "decoder")) | _types(_component(backend, "pre_tokenizer"))
    if "WordPiece" in kinds:
        raise ValueError("WordPiece vocabularies have no exact byte spelling (spaces are implicit)")
    if "ByteLevel" in kinds:
        base = "byte_level"
    elif kinds & {"Metaspace", "ReplaceMetaspace"}:
        base = "metaspace"
    else:
        base = "plain"
    fallback = "ByteFallback" in kinds or bool(getattr(backend.model, "byte_fallback", False))
    return base + ("+byte_fallback" if fallback and base != "byte_level" else "")


def special_ids(tokenizer) -> set[int]:
    """eos/bos/pad/unk and every added token marked special: these never match by bytes."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids


def token_bytes(tokenizer) -> list[bytes | None]:
    """For ids 0..len(tokenizer)-1, the exact bytes each token contributes inside text (None: special token)."""
    scheme = vocab_scheme(tokenizer)
    specials = special_ids(tokenizer)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in specials or piece is None:
            table.append(None)
        elif i in added:  # added tokens are matched literally in the raw text
            table.append(added[i].encode("utf-8"))
        else:
            table.append(_piece_bytes(piece, scheme))
    return table


def _piece_bytes(piece: str, scheme: str) -> bytes | None:
    if scheme == "byte_level":
        return byte_level_bytes(piece)
    if scheme.endswith("+byte_fallback") and (m := _BYTE_FALLBACK.match(piece)):
        return bytes([int(m.group(1), 16)])  # '<0x0A>' -> b'\n'
    if scheme.startswith("metaspace"):
        piece = piece.replace("▁", " ")
    return piece.encode("utf-8")


def byte_fallback_ids(tokenizer) -> set[int]:
    """Ids of <0xNN> pieces: kept out of V_c when a canonical piece has the same bytes."""
    if not vocab_scheme(tokenizer).endswith("+byte_fallback"):
        return set()
    return {i for p, i in tokenizer.get_vocab().items() if _BYTE_FALLBACK.match(p)}


def target_bytes_table(target_tokenizer) -> list[bytes | None]:
    """The edge's decode table for verdict tokens: the target TOKENIZER's files suffice, no weights."""
    return token_bytes(target_tokenizer)


# ----------------------------------------------------------------------------- shared vocabulary

class SharedVocab:
    """V_c as two id maps. Tensors: draft_to_target [V_draft], target_to_draft [V_target] (int64, -1 outside
    V_c); shared_target_ids [n_shared] sorted, shared_draft_ids [n_shared] aligned with it (p on V_c travels in
    that order); target_mask [V_target], draft_mask [V_draft] bool."""

    def __init__(self, draft_to_target: torch.Tensor, target_to_draft: torch.Tensor, key: str,
                 is_identity: bool = False) -> None:
        self.draft_to_target = draft_to_target.to(torch.int64)  # [V_draft]
        self.target_to_draft = target_to_draft.to(torch.int64)  # [V_target]
        self.key, self.is_identity = key, is_identity
        self.draft_mask = self.draft_to_target >= 0  # [V_draft]
        self.target_mask = self.target_to_draft >= 0  # [V_target]
        self.shared_target_ids = self.target_mask.nonzero().flatten()  # [n_shared], ascending
        self.shared_draft_ids = self.target_to_draft[self.shared_target_ids]  # [n_shared]
        self.n_draft, self.n_target = len(self.draft_to_target), len(self.target_to_draft)
        self.n_shared = len(self.shared_target_ids)
        self._check_inverse()

    def _check_inverse(self) -> None:
        """The maps must be a bijection on V_c (a corrupt cache file fails here, not in a session)."""
        d = self.draft_to_target[self.draft_mask]
        if int(self.draft_mask.sum()) != self.n_shared or (len(d) and int(d.max()) >= self.n_target) \
                or not torch.equal(self.target_to_draft[d], self.draft_mask.nonzero().flatten()):
            raise ValueError(f"shared vocab {self.key}: draft_to_target and target_to_draft are not inverses")

    @classmethod
    def identity(cls, tokenizer, fingerprint: str | None = None) -> SharedVocab:
        """Same vocabulary on both sides: V_c is everything and both maps are arange (one code path)."""
        n = len(tokenizer)
        key = _digest("identity", fingerprint or _fingerprint(tokenizer, token_bytes(tokenizer)))
        return cls(torch.arange(n), torch.arange(n), key, is_identity=True)

    def padded(self, n_draft: int, n_target: int) -> SharedVocab:
        """Maps widened with -1 to a model's embedding size when it exceeds len(tokenizer)."""
        def pad(t: torch.Tensor, n: int) -> torch.Tensor:
            return torch.cat([t, torch.full((n - len(t),), -1, dtype=torch.int64)])
        return SharedVocab(pad(self.draft_to_target, n_draft), pad(self.target_to_draft, n_target), self.key)

    def __repr__(self) -> str:
        return f"SharedVocab(n_draft={self.n_draft}, n_target={self.n_target}, n_shared={self.n_shared})"


def _first_by_bytes(table: Sequence[bytes | None], demoted: set[int]) -> dict[bytes, int]:
    """bytes -> one id: canonical pieces before byte-fallback ones, then the lowest id (deterministic)."""
    best: dict[bytes, int] = {}
    for i in sorted(range(len(table)), key=lambda i: (i in demoted, i)):
        b = table[i]
        if b and b not in best:  # None (special) and b"" never match
            best[b] = i
    return best


def shared_maps(draft_table: Sequence[bytes | None], target_table: Sequence[bytes | None],
                eos: tuple[int | None, int | None] = (None, None),
                demoted: tuple[set[int], set[int]] = (set(), set())) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft_to_target [V_draft], target_to_draft [V_target]) for tokens with equal bytes, plus eos <-> eos."""
    draft_by = _first_by_bytes(draft_table, demoted[0])
    target_by = _first_by_bytes(target_table, demoted[1])
    d2t = torch.full((len(draft_table),), -1, dtype=torch.int64)
    t2d = torch.full((len(target_table),), -1, dtype=torch.int64)
    pairs = [(d, target_by[b]) for b, d in draft_by.items() if b in target_by]
    if eos[0] is not None and eos[1] is not None:
        pairs.append(eos)  # specials are None in the tables, so eos is not already paired
    if pairs:
        d, t = torch.tensor(pairs, dtype=torch.int64).T
        d2t[d], t2d[t] = t, d
    return d2t, t2d


def _fingerprint(tokenizer, table: Sequence[bytes | None]) -> str:
    """Hash of scheme + every token's bytes (specials by name) + eos: equal iff the byte mapping is equal."""
    h = hashlib.sha256(f"{FORMAT}|{vocab_scheme(tokenizer)}|{tokenizer.eos_token_id}|".encode())
    names = tokenizer.convert_ids_to_tokens([i for i, b in enumerate(table) if b is None])
    for name in names:
        h.update(b"\x00" + str(name).encode("utf-8") + b"\x00")
    for b in table:
        h.update(b"\xff" if b is None else struct.pack("<I", len(b)) + b)
    return h.hexdigest()


def _digest(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def default_cache_dir() -> Path:
    root = os.environ.get("SPECRELAY_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "specrelay") / "vocab"


def build_shared_vocab(draft_tok, target_tok, cache_dir: str | Path | None = None) -> SharedVocab:
    """SharedVocab of a draft/target tokenizer pair, loaded from (or saved to) `cache_dir/<key>.safetensors`."""
    from safetensors.torch import load_file, save_file

    draft_table, target_table = token_bytes(draft_tok), token_bytes(target_tok)
    draft_fp, target_fp = _fingerprint(draft_tok, draft_table), _fingerprint(target_tok, target_table)
    if draft_fp == target_fp:  # one vocabulary: specials are shared too
        vocab = SharedVocab.identity(target_tok, target_fp)
        log.info("shared_vocab", n_draft=vocab.n_draft, n_target=vocab.n_target, n_shared=vocab.n_shared,
                 key=vocab.key, identity=True)
        return vocab
    key = _digest(draft_fp, target_fp)
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = path / f"{key}.safetensors"
    cached = file.exists()
    if cached:
        maps = load_file(file)
        vocab = SharedVocab(maps["draft_to_target"], maps["target_to_draft"], key)
    else:
        eos = (draft_tok.eos_token_id, target_tok.eos_token_id)
        demoted = (byte_fallback_ids(draft_tok), byte_fallback_ids(target_tok))
        vocab = SharedVocab(*shared_maps(draft_table, target_table, eos, demoted), key)
        path.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        save_file({"draft_to_target": vocab.draft_to_target, "target_to_draft": vocab.target_to_draft},
                  str(tmp), metadata={"key": key, "format": FORMAT})
        os.replace(tmp, file)  # atomic: a concurrent reader never sees half a file
    log.info("shared_vocab", n_draft=vocab.n_draft, n_target=vocab.n_target, n_shared=vocab.n_shared,
             key=key, cached=cached)
    return vocab


# ----------------------------------------------------------------------------- OpenAI vocabularies, report

def openai_token_bytes(name: str, gpt2_encoder: str | Path | None = None) -> list[bytes | None]:
    """Byte table of a tiktoken vocabulary ('cl100k_base', 'o200k_base', 'r50k_base'/'gpt2') via bpe-openai.

    gpt2/r50k need tiktoken's downloadable data; offline, pass GPT-2's encoder.json (same 50257 tokens)."""
    gpt2_encoder = gpt2_encoder or os.environ.get("SPECRELAY_GPT2_ENCODER")
    if name in ("gpt2", "r50k_base") and gpt2_encoder:
        encoder = json.loads(Path(gpt2_encoder).read_text(encoding="utf-8"))
        table: list[bytes | None] = [None] * (max(encoder.values()) + 1)
        for piece, i in encoder.items():
            table[i] = None if piece == "<|endoftext|>" else byte_level_bytes(piece)
        return table
    import bpe_openai

    enc = bpe_openai.get_encoding(name)
    return [None if (not b or enc.is_special_token(i)) else b for i, b in enumerate(enc.token_byte_values())]


def shared_size(a: Sequence[bytes | None], b: Sequence[bytes | None]) -> int:
    """|V_c| by bytes alone (specials excluded)."""
    return len({x for x in a if x} & {x for x in b if x})


def _n_tokens(table: Sequence[bytes | None]) -> int:
    return sum(1 for b in table if b)


def _demo_tokenizer(name: str):
    from transformers import AutoTokenizer

    root = Path(__file__).resolve().parents[2]
    for path in (root / "models" / name, root / ".train" / f"tok-{name}"):
        if (path / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(path))
    return None


def vocab_report(gpt2_encoder: str | Path | None = None) -> list[tuple[str, str, int, int, int]]:
    """Rows (a, b, |V_a|, |V_b|, |V_c|) for demo-draft-xv vs demo-target and every pair of OpenAI vocabs."""
    rows = []
    draft, target = _demo_tokenizer("demo-draft-xv"), _demo_tokenizer("demo-target")
    if draft is not None and target is not None:
        sv = build_shared_vocab(draft, target)
        rows.append(("demo-draft-xv", "demo-target", sv.n_draft, sv.n_target, sv.n_shared))
    tables = {}
    for name in ("r50k_base", "cl100k_base", "o200k_base"):
        try:
            tables[name] = openai_token_bytes(name, gpt2_encoder)
        except Exception as exc:  # r50k without tiktoken data offline: report the rest
            log.warning("vocab_unavailable", name=name, error=str(exc))
    names = list(tables)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            rows.append((a, b, _n_tokens(tables[a]), _n_tokens(tables[b]), shared_size(tables[a], tables[b])))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print |V| and |V_c| as a markdown table")
    parser.add_argument("--gpt2-encoder", help="GPT-2 encoder.json, for r50k_base when tiktoken data is absent")
    args = parser.parse_args(argv)
    if not args.report:
        parser.print_help()
        return
    rows = vocab_report(args.gpt2_encoder)
    print("| A | B | size A | size B | shared (V_c) | V_c / A | V_c / B |\n|---|---|---:|---:|---:|---:|---:|")
    for a, b, na, nb, nc in rows:
        print(f"| {a} | {b} | {na} | {nb} | {nc} | {nc / na:.1%} | {nc / nb:.1%} |")


if __name__ == "__main__":
    main()
