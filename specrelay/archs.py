"""Tiny random models of many decoder architectures, built from transformers' own configs: the list the
architecture matrix (tests/test_arch_matrix.py, `specrelay bench archs`) runs and the README table comes from.

Each entry is a transformers `model_type` with the config fields that make it small (2 layers, hidden 64) and
exercise its attention features within a few tokens (a sliding window of 8). Heads follow the real checkpoints:
grouped-query where the family uses it, multi-head (kv_heads = heads) where its checkpoints are MHA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

WINDOW = 8       # sliding window of the tiny models: short prompts already slide past it
HIDDEN, LAYERS, HEADS = 64, 2, 4


@dataclass(frozen=True)
class Arch:
    model_type: str
    feature: str = ""                  # the attention feature it exercises ("" = plain causal attention)
    mha: bool = False                  # the family's checkpoints use multi-head attention (kv_heads = heads)
    extra: dict = field(default_factory=dict)


SLIDING = {"sliding_window": WINDOW}
ARCHS: tuple[Arch, ...] = (
    Arch("llama"), Arch("qwen2"), Arch("qwen3"), Arch("gemma", mha=True), Arch("phi", mha=True),
    Arch("olmo2", mha=True), Arch("granite"), Arch("smollm3"), Arch("cohere"), Arch("stablelm", mha=True),
    Arch("glm4"), Arch("gpt2", mha=True), Arch("gpt_neox", mha=True), Arch("gptj", mha=True),
    Arch("opt", mha=True),
    Arch("qwen3_moe", "mixture of experts", extra={"num_experts": 4, "num_experts_per_tok": 2,
                                                   "moe_intermediate_size": 32}),
    Arch("mixtral", "mixture of experts", extra={"num_local_experts": 4, "num_experts_per_tok": 2}),
    Arch("mistral", "sliding window", extra=SLIDING),
    Arch("ministral", "sliding window (per layer)", extra=SLIDING),
    Arch("gemma2", "sliding window (alternating) + logit softcap", extra={**SLIDING, "attn_logit_softcapping": 5.0}),
    Arch("gemma3_text", "sliding window (pattern)", extra={**SLIDING, "sliding_window_pattern": 2}),
    Arch("phi3", "sliding window", extra=SLIDING),
    Arch("starcoder2", "sliding window", mha=False, extra=SLIDING),
    Arch("exaone4", "sliding window (pattern)", extra={**SLIDING, "sliding_window_pattern": 2}),
    Arch("cohere2", "sliding window (pattern)", extra={**SLIDING, "sliding_window_pattern": 2}),
    Arch("gpt_oss", "sliding window + attention sinks + experts",
         extra={**SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2}),
    Arch("falcon", "no AttentionInterface", mha=True),
    Arch("bloom", "ALiBi, no AttentionInterface", mha=True),
)


def config_for(arch: Arch, vocab_size: int, eos: int):
    """A transformers config of `arch` with tiny dimensions."""
    from transformers import AutoConfig

    heads = HEADS
    kv_heads = heads if arch.mha else 2
    fields = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                  num_hidden_layers=LAYERS, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=HIDDEN // heads, max_position_embeddings=512, n_positions=512,
                  bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    if arch.model_type == "opt":
        fields.update(ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN)
    if arch.model_type == "gptj":
        fields.update(rotary_dim=HIDDEN // heads // 2)
    if arch.model_type == "falcon":
        fields.update(new_decoder_architecture=False, multi_query=False, num_kv_heads=heads)
        del fields["head_dim"]  # derived from hidden_size / heads
    fields.update(arch.extra)
    config = AutoConfig.for_model(arch.model_type, **fields)
    if arch.model_type in ("gpt2", "gptj"):
        config.n_inner = 2 * HIDDEN
    return config


def build(arch: Arch, tokenizer_dir: Path, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Save a random `arch` model with the tokenizer of `tokenizer_dir` under `out` (a real HF checkpoint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = config_for(arch, len(tok), tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
