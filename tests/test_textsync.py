"""Edge context sync (edge_worker/xvocab/textsync.py): after any sequence of appends, DraftContext's draft ids equal a full
re-tokenisation of the committed text, while re-tokenising only the tail."""

from __future__ import annotations

import codecs
import inspect
import json.decoder
import random

import pytest
import torch

from specrelay.edge_worker.xvocab.textsync import DraftContext, incremental_backoff
from specrelay.edge_worker.xvocab.mapping import token_bytes
from test_vocab import TRICKY, demo_tokenizer, tiny_byte_level, tiny_metaspace  # sibling test module
from test_vocab import byte_level, metaspace  # noqa: F401  (its module-scoped fixtures, shared)

torch.set_num_threads(1)

CODE = inspect.getsource(json.decoder) + TRICKY  # held out from every tokenizer's training text


def full_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False, split_special_tokens=True).input_ids


def replay(ctx: DraftContext, chunks, append) -> list[int]:
    """Apply appends the way the edge does: crop to n_keep, extend with new ids. Returns the caller's mirror."""
    mirror = list(ctx.draft_ids)
    for chunk in chunks:
        n_keep, new = append(chunk)
        assert n_keep <= len(mirror)
        mirror = mirror[:n_keep] + new
        assert mirror == ctx.draft_ids
    return mirror


def random_chunks(seq, rng: random.Random, max_len: int = 7):
    i = 0
    while i < len(seq):
        n = rng.randint(1, max_len)
        yield seq[i:i + n]
        i += n


def check_sync(draft, target, text: str, seed: int) -> None:
    """Commit text as target tokens in random-sized steps; the draft side must match full re-tokenisation."""
    table = token_bytes(target)
    ids = target(text, add_special_tokens=False).input_ids
    ctx = DraftContext(draft, table)
    mirror = replay(ctx, random_chunks(ids, random.Random(seed)), ctx.append_target_tokens)
    assert mirror == full_ids(draft, text)


def test_backoff_rules(byte_level, metaspace):
    assert incremental_backoff(byte_level) == 2
    assert incremental_backoff(metaspace) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_tiny_cross_vocab(byte_level, metaspace, seed):
    check_sync(metaspace, byte_level, CODE, seed)
    check_sync(byte_level, metaspace, CODE, seed)


def test_tiny_metaspace_prepend_first(byte_level):
    check_sync(tiny_metaspace(prepend_scheme="first"), byte_level, CODE, seed=2)


@pytest.mark.parametrize("seed", [0, 1])
def test_demo_cross_vocab(seed):
    draft, target = demo_tokenizer("demo-draft-xv"), demo_tokenizer("demo-target")
    text = CODE + inspect.getsource(inspect.getmodule(random))[:20_000]
    check_sync(draft, target, text, seed)
    check_sync(target, draft, text, seed)  # the other direction exercises the byte-level tail rule


@pytest.mark.parametrize("make", [tiny_byte_level, tiny_metaspace])
def test_byte_by_byte_holds_back_partial_chars(make):
    """Target tokens that are half a multi-byte char: held back until complete, never mangled."""
    draft = make()
    text = "s = '€😀日本' # ü\n" + CODE[:600]
    ctx = DraftContext(draft, [])
    data = text.encode("utf-8")
    for i in range(len(data)):
        ctx.append_bytes(data[i:i + 1])
        complete = data[: i + 1].decode("utf-8", errors="ignore")
        assert ctx.pending == data[len(complete.encode()): i + 1]
        assert ctx.draft_ids == full_ids(draft, complete)
    assert ctx.draft_ids == full_ids(draft, text) and ctx.pending == b""


def test_single_byte_target_tokens(byte_level, metaspace):
    """A byte-level target emitting '€' as three single-byte tokens (as a model may): same draft ids."""
    table = token_bytes(byte_level)
    by_byte = {b: i for i, b in enumerate(table) if b is not None and len(b) == 1}
    text = "price = '5€' + 'ü'\n"
    ctx = DraftContext(metaspace, table)
    replay(ctx, [[by_byte[bytes([b])]] for b in text.encode("utf-8")], ctx.append_target_tokens)
    assert ctx.draft_ids == full_ids(metaspace, text)


def test_regex_stress(byte_level, metaspace):
    """Strings built to hit the GPT-2 regex corners (contractions, whitespace before words, runs of
    punctuation/digits), appended a char or a few at a time."""
    alphabet = ["'", "s", "r", "e", "l", "d", "ve", " ", "  ", "\n", "\t", "a", "1", "23", "!", ".(", "é", "€"]
    rng = random.Random(7)
    for draft in (byte_level, metaspace):
        for _ in range(60):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
            ctx = DraftContext(draft, [])
            chunks = [c.encode() for c in random_chunks(text, rng, max_len=3)]
            assert replay(ctx, chunks, ctx.append_bytes) == full_ids(draft, text), repr(text)


def test_byte_level_needs_two_words_of_backoff(byte_level):
    """Why backoff=2: "x'r" + "e" turns the pre-tokens "'", "r" into "'re" (the second-to-last changes)."""
    words = byte_level.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    assert [w for w, _ in words("x'r")] == ["x", "'", "r"] and [w for w, _ in words("x're")] == ["x", "'re"]
    for backoff, exact in ((2, True), (1, False)):
        ctx = DraftContext(byte_level, [])
        ctx._backoff = backoff
        ctx.append_bytes(b"x'r")
        ctx.append_bytes(b"e")
        assert (ctx._word_pos == [0, 1]) is exact  # backoff 1 keeps the stale "'" | "r" boundary


def test_cost_is_tail_only(byte_level, metaspace):
    """After a long prompt, one more token re-tokenises a few words, not the whole text."""
    for draft, target in ((metaspace, byte_level), (byte_level, metaspace)):
        table = token_bytes(target)
        ids = target(CODE, add_special_tokens=False).input_ids
        ctx = DraftContext(draft, table)
        ctx.append_target_tokens(ids[:-5])
        seen = []
        real = ctx._enc
        ctx._enc = type("Spy", (), {"encode": lambda self, s, **kw: seen.append(len(s)) or real.encode(s, **kw),
                                    "pre_tokenizer": real.pre_tokenizer})()
        replay(ctx, [[i] for i in ids[-5:]], ctx.append_target_tokens)
        assert ctx.draft_ids == full_ids(draft, CODE)
        assert max(seen) < 100 < len(CODE)


def test_special_token_text_stays_text(metaspace, byte_level):
    """'</s>' inside generated HTML is text for the draft, not its eos."""
    text = "html = '<p>hi</s>'\n"
    ctx = DraftContext(metaspace, token_bytes(byte_level))
    ctx.append_target_tokens(byte_level(text, add_special_tokens=False).input_ids)
    assert metaspace.eos_token_id not in ctx.draft_ids
    assert ctx.draft_ids == full_ids(metaspace, text)


def test_special_target_tokens_add_no_text(byte_level, metaspace):
    ctx = DraftContext(metaspace, token_bytes(byte_level))
    n_keep, new = ctx.append_target_tokens([byte_level.eos_token_id])
    assert (n_keep, new, ctx.draft_ids) == (0, [], [])


def test_invalid_utf8_becomes_replacement_char(metaspace):
    ctx = DraftContext(metaspace, [])
    ctx.append_bytes(b"a\xffb")
    assert ctx.draft_ids == full_ids(metaspace, "a\ufffdb")


def test_prefix_ids_are_kept(byte_level, metaspace):
    bos = metaspace.convert_tokens_to_ids("<s>")
    ctx = DraftContext(metaspace, token_bytes(byte_level), prefix_ids=[bos])
    n_keep, new = ctx.append_target_tokens(byte_level("def f", add_special_tokens=False).input_ids)
    assert n_keep == 1 and ctx.draft_ids == [bos] + new == [bos] + full_ids(metaspace, "def f")


def test_fallback_for_unproven_pipeline(byte_level):
    """A normaliser (NFC here) has no proven tail rule: the whole text is re-tokenised, still exact."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    backend = byte_level.backend_tokenizer.__class__.from_str(byte_level.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    assert incremental_backoff(tok) is None
    text = CODE[:1500]
    ctx = DraftContext(tok, [])
    replay(ctx, [c.encode() for c in random_chunks(text, random.Random(3), 20)], ctx.append_bytes)
    assert ctx.draft_ids == full_ids(tok, text)


def test_extended_ids_are_the_ids_after_committing(byte_level, metaspace):
    """`extended_ids(ids)` (the context a pre-draft continues in) equals a full re-tokenisation of the text with
    those target tokens appended, and commits nothing."""
    table = token_bytes(byte_level)
    ids = byte_level(CODE[:3000], add_special_tokens=False).input_ids
    ctx = DraftContext(metaspace, table)
    rng = random.Random(3)
    i = 0
    while i < len(ids):
        n, k = rng.randint(1, 5), rng.randint(1, 6)
        before = (list(ctx.draft_ids), ctx.pending)
        ahead = ctx.extended_ids(ids[i:i + n + k])
        assert (ctx.draft_ids, ctx.pending) == before
        assert ahead == full_ids(metaspace, text_of(table, ids[:i + n + k]))
        ctx.append_target_tokens(ids[i:i + n])
        i += n
        assert ctx.extended_ids(ids[i:i + k]) == ahead


def text_of(table, ids: list[int]) -> str:
    """What DraftContext makes of target tokens: complete characters, a held-back partial one dropped."""
    data = b"".join(table[t] or b"" for t in ids)
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data)
