"""Tiny random-weight model pairs for fast tests (seconds, no training): real HF checkpoints on disk."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y\n\nfor i in range(10):\n    print(i, add(i, i))\n") * 4


def make_tokenizer(path: Path, vocab_size: int = 300):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(path)
    return fast


def make_model(path: Path, tok, *, hidden: int = 32, layers: int = 2, seed: int = 0, init: float = 0.2,
               vocab_size: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size or len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=init, tie_word_embeddings=True,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def make_pair(root: Path) -> tuple[Path, Path]:
    """A 'target' and a smaller, differently seeded 'draft' with the same tokenizer."""
    tok = make_tokenizer(root / "tok")
    target = make_model(root / "target", tok, hidden=48, layers=2, seed=1)
    draft = make_model(root / "draft", tok, hidden=32, layers=1, seed=2)
    return target, draft


def hf_greedy(model, tok, prompt: str, n: int) -> list[int]:
    """The model's own greedy continuation of `prompt` (HF generate): what every distributed run must equal."""
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def greedy_references(target: Path, prompts: list[str], max_new_tokens: int) -> dict[str, list[int]]:
    """prompt -> the target model's own greedy continuation (hf_greedy), loaded once for all prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(target), AutoModelForCausalLM.from_pretrained(target)
    return {prompt: hf_greedy(model, tok, prompt, max_new_tokens) for prompt in prompts}
