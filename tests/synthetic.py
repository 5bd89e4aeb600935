"""A tiny synthetic cross-vocabulary pair: character-level vocabularies of 12 (target) and 10 (draft) tokens
that share only part of their alphabet, with random-weight Llama models, saved as real HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

TARGET_CHARS = list("abcdefghijk")      # + eos = 12 tokens
DRAFT_CHARS = list("abcdexyzw")         # + eos = 10 tokens; shares a..e (and eos) with the target


def char_tokenizer(path: Path, chars: list[str], eos: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {eos: 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, clean_up_tokenization_spaces=False)
    fast.save_pretrained(path)
    return fast


def char_model(path: Path, tok, seed: int, hidden: int = 16, init: float = 0.4) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=init, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def make_synthetic_pair(root: Path) -> tuple[Path, Path]:
    target_tok = char_tokenizer(root / "ttok", TARGET_CHARS, "<eos>")
    draft_tok = char_tokenizer(root / "dtok", DRAFT_CHARS, "</s>")
    return char_model(root / "target", target_tok, seed=5), char_model(root / "draft", draft_tok, seed=6)


@torch.no_grad()
def exact_two_token_law(target, prompt: list[int], params) -> dict[tuple[int, int], float]:
    """P(first two generated tokens) under the target alone; a first token that is EOS ends the text (-1)."""
    from specrelay.common.sampling import probs_from_logits

    def p_next(ids):
        return probs_from_logits(target.model(torch.tensor([ids])).logits[0, -1], params).double()

    law = {}
    p1 = p_next(prompt)
    for t1 in range(len(p1)):
        if p1[t1] <= 0:
            continue
        if t1 in target.eos_ids:
            law[(t1, -1)] = float(p1[t1])
            continue
        p2 = p_next(prompt + [t1])
        for t2 in range(len(p2)):
            if p2[t2] > 0:
                law[(t1, t2)] = float(p1[t1] * p2[t2])
    return law
