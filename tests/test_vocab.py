"""Byte mapping of tokens and the shared vocabulary V_c (edge_worker/xvocab/mapping.py).

Tiny tokenizers built in-test (one byte-level BPE, one Metaspace + byte-fallback BPE) test the logic on every
run; the demo pair and the OpenAI vocabularies are used when present."""

from __future__ import annotations

import inspect
import json
import string
import textwrap

import pytest
import torch

from specrelay.edge_worker.xvocab import mapping as V

torch.set_num_threads(1)

# Held-out text: training the tiny tokenizers never sees it.
TRAIN_TEXT = inspect.getsource(textwrap) + inspect.getsource(string)
TRICKY = "x = 'héllo'\t# € 😀 ünïcödé — “quotes” 日本語\r\n\n    def f(a): return a's  \n"


def tiny_byte_level(vocab_size: int = 600):
    """GPT-2 style: ByteLevel pre-tokenizer/decoder, 'Ġ' = space, eos <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator([TRAIN_TEXT], vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def tiny_metaspace(vocab_size: int = 400, prepend_scheme: str = "never"):
    """SentencePiece style: Metaspace '▁' = space, <0xNN> byte-fallback pieces, specials <unk> <s> </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme, split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=80, show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT], trainer=trainer)
    spec = json.loads(tok.to_str())
    for b in range(256):  # byte-fallback pieces, as Llama spells them
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def demo_tokenizer(name: str):
    tok = V._demo_tokenizer(name)
    if tok is None:
        pytest.skip(f"{name} tokenizer not present (models/{name})")
    return tok


@pytest.fixture(scope="module")
def byte_level():
    return tiny_byte_level()


@pytest.fixture(scope="module")
def metaspace():
    return tiny_metaspace()


def heldout_text() -> str:
    return inspect.getsource(json.decoder) + TRICKY


def decode_by_table(tok, text: str) -> bytes:
    table = V.token_bytes(tok)
    return b"".join(table[i] for i in tok(text, add_special_tokens=False).input_ids)


# ----------------------------------------------------------------------------- token_bytes

def test_byte_level_alphabet():
    assert V.byte_level_bytes("Ġdef") == b" def"
    assert V.byte_level_bytes("Ċ") == b"\n"
    assert V.byte_level_bytes("ĉ") == b"\t"
    assert sorted(V._byte_level_alphabet().values()) == list(range(256))
    assert V.byte_level_bytes("▁") is None  # not a byte-level piece


def test_schemes(byte_level, metaspace):
    assert V.vocab_scheme(byte_level) == "byte_level"
    assert V.vocab_scheme(metaspace) == "metaspace+byte_fallback"


@pytest.mark.parametrize("make", [tiny_byte_level, tiny_metaspace])
def test_round_trip_tiny(make):
    tok = make()
    text = heldout_text()
    assert decode_by_table(tok, text) == text.encode("utf-8")


@pytest.mark.parametrize("name", ["demo-target", "demo-draft-xv"])
def test_round_trip_demo(name):
    tok = demo_tokenizer(name)
    text = heldout_text()
    assert decode_by_table(tok, text) == text.encode("utf-8")


def test_specials_are_none(byte_level, metaspace):
    assert V.token_bytes(byte_level)[byte_level.eos_token_id] is None
    table = V.token_bytes(metaspace)
    for piece in ("<unk>", "<s>", "</s>"):
        assert table[metaspace.convert_tokens_to_ids(piece)] is None
    assert table[metaspace.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert table[metaspace.convert_tokens_to_ids("<0xE2>")] == b"\xe2"


# ----------------------------------------------------------------------------- SharedVocab

def check_consistent(sv: V.SharedVocab, draft_table, target_table) -> None:
    """Maps are inverse bijections on V_c and every shared pair spells the same bytes."""
    d = sv.shared_draft_ids
    t = sv.shared_target_ids
    assert torch.equal(sv.draft_to_target[d], t) and torch.equal(sv.target_to_draft[t], d)
    assert torch.equal(t, torch.sort(t).values)
    assert int(sv.draft_mask.sum()) == int(sv.target_mask.sum()) == sv.n_shared == len(set(d.tolist()))
    for di, ti in zip(d.tolist(), t.tolist()):
        assert draft_table[di] == target_table[ti]  # both None only for the eos pair


def test_shared_vocab_tiny(byte_level, metaspace, tmp_path):
    sv = V.build_shared_vocab(metaspace, byte_level, cache_dir=tmp_path)
    draft_table, target_table = V.token_bytes(metaspace), V.token_bytes(byte_level)
    check_consistent(sv, draft_table, target_table)
    assert (sv.n_draft, sv.n_target) == (len(metaspace), len(byte_level))
    assert sv.draft_to_target[metaspace.eos_token_id] == byte_level.eos_token_id
    assert sv.draft_to_target[metaspace.convert_tokens_to_ids("<s>")] == -1  # other specials stay out
    # every single byte is a target token (byte-level) and a draft token (byte fallback): all shared
    singles = {b for b in target_table if b is not None and len(b) == 1}
    assert len(singles) == 256
    assert all(sv.target_to_draft[target_table.index(b)] >= 0 for b in singles)
    # a canonical piece wins over the <0xNN> piece with the same bytes
    a = metaspace.convert_tokens_to_ids("a")
    assert sv.target_to_draft[target_table.index(b"a")] == a
    assert sv.draft_to_target[metaspace.convert_tokens_to_ids("<0x61>")] == -1


def test_identity(byte_level):
    sv = V.SharedVocab.identity(byte_level)
    n = len(byte_level)
    assert sv.is_identity and sv.n_shared == sv.n_draft == sv.n_target == n
    assert torch.equal(sv.draft_to_target, torch.arange(n)) and torch.equal(sv.shared_target_ids, torch.arange(n))
    assert sv.key == V.SharedVocab.identity(byte_level).key


def test_same_tokenizer_gives_identity(byte_level, tmp_path):
    sv = V.build_shared_vocab(byte_level, byte_level, cache_dir=tmp_path)
    assert sv.is_identity and sv.key == V.SharedVocab.identity(byte_level).key
    assert sv.draft_to_target[byte_level.eos_token_id] == byte_level.eos_token_id


def test_cache_hit(byte_level, metaspace, tmp_path, monkeypatch):
    first = V.build_shared_vocab(metaspace, byte_level, cache_dir=tmp_path)
    assert (tmp_path / f"{first.key}.safetensors").exists()

    def no_build(*args, **kwargs):
        raise AssertionError("cache hit must not rebuild the maps")

    monkeypatch.setattr(V, "shared_maps", no_build)
    again = V.build_shared_vocab(metaspace, byte_level, cache_dir=tmp_path)
    assert again.key == first.key
    assert torch.equal(again.draft_to_target, first.draft_to_target)
    assert torch.equal(again.target_to_draft, first.target_to_draft)


def test_cache_dir_from_env(byte_level, metaspace, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path))
    assert V.default_cache_dir() == tmp_path / "vocab"
    sv = V.build_shared_vocab(metaspace, byte_level)
    assert (tmp_path / "vocab" / f"{sv.key}.safetensors").exists()


def test_key_is_stable_and_specific(byte_level, metaspace, tmp_path):
    """Same files -> same key (sha256 of bytes, nothing process-specific); other vocab -> other key."""
    from transformers import AutoTokenizer

    byte_level.save_pretrained(tmp_path / "bl")
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "bl"))
    k1 = V.build_shared_vocab(metaspace, byte_level, cache_dir=tmp_path).key
    assert V.build_shared_vocab(metaspace, reloaded, cache_dir=tmp_path).key == k1
    assert V.build_shared_vocab(byte_level, metaspace, cache_dir=tmp_path).key != k1
    assert V.build_shared_vocab(metaspace, tiny_byte_level(500), cache_dir=tmp_path).key != k1


def test_maps_must_be_inverse():
    with pytest.raises(ValueError):
        V.SharedVocab(torch.tensor([1, -1]), torch.tensor([-1, 1]), key="bad")


def test_padded(byte_level, metaspace, tmp_path):
    sv = V.build_shared_vocab(metaspace, byte_level, cache_dir=tmp_path).padded(len(metaspace) + 3, len(byte_level) + 5)
    assert (sv.n_draft, sv.n_target) == (len(metaspace) + 3, len(byte_level) + 5)
    assert (sv.draft_to_target[-3:] == -1).all() and (sv.target_to_draft[-5:] == -1).all()


def test_demo_pair(tmp_path):
    draft, target = demo_tokenizer("demo-draft-xv"), demo_tokenizer("demo-target")
    sv = V.build_shared_vocab(draft, target, cache_dir=tmp_path)
    check_consistent(sv, V.token_bytes(draft), V.token_bytes(target))
    assert sv.draft_to_target[draft.eos_token_id] == target.eos_token_id
    print(f"demo-draft-xv {sv.n_draft} demo-target {sv.n_target} shared {sv.n_shared}")
    assert sv.n_shared > 256  # at least every single byte, plus common words


# ----------------------------------------------------------------------------- OpenAI vocabularies

@pytest.fixture(scope="module")
def openai_tables():
    pytest.importorskip("bpe_openai")
    tables = {name: V.openai_token_bytes(name) for name in ("cl100k_base", "o200k_base")}
    try:  # gpt2/r50k: needs tiktoken's data, or SPECRELAY_GPT2_ENCODER=path/to/encoder.json
        tables["r50k_base"] = V.openai_token_bytes("r50k_base")
    except Exception:
        pass
    return tables


def test_openai_intersections(openai_tables):
    names = sorted(openai_tables)
    for i, a in enumerate(names):
        ta = {b for b in openai_tables[a] if b}
        assert {bytes([x]) for x in range(256)} <= ta  # byte-level BPE: every single byte is a token
        for b in names[i + 1:]:
            tb = {x for x in openai_tables[b] if x}
            shared = V.shared_size(openai_tables[a], openai_tables[b])
            print(f"{a} {len(ta)} & {b} {len(tb)}: shared {shared}")
            assert 256 < shared < min(len(ta), len(tb))
    if "cl100k_base" in openai_tables and "o200k_base" in openai_tables:
        assert V.shared_size(openai_tables["cl100k_base"], openai_tables["o200k_base"]) > 80_000
    if "r50k_base" in openai_tables:
        assert sum(1 for b in openai_tables["r50k_base"] if b) == 50_256  # 50257 minus <|endoftext|>
