"""Model runner shared by edge and cloud: any Hugging Face causal LM + tokenizer, its context limit, incremental
decoding with a KV cache, rollback of rejected positions (cache crop), and a ragged batched forward (the edge's
drafter). The cloud verifies through its own KV store instead (cloud_worker/kvcache.py, attention.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .errors import FatalError
from .modelsource import check_device, check_model, pretrained_args
from .selfcheck import refuse_recurrent

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each [kv_heads, seq, head_dim]


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "KVShape":
        """From a transformers config (the text config of a multimodal one)."""
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(c.num_hidden_layers, kv_heads, head_dim, dtype)


class ModelRunner:
    """A causal LM and its tokenizer, loaded by `AutoModelForCausalLM`/`AutoTokenizer` from a path or hub id."""

    def __init__(self, model, tokenizer, name: str = "") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        # transformers 5 calls the argument `cache`, 4.x `past_key_values`
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    @classmethod
    def load(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32") -> "ModelRunner":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        name_or_path = check_model(name_or_path)  # a path-looking name is never sent to the hub
        check_device(device)
        source, gguf = pretrained_args(name_or_path)  # a GGUF file: dequantised to `dtype` by transformers
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **gguf)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], **gguf).to(device)
        except (OSError, ValueError, NotImplementedError) as exc:
            raise FatalError(f"cannot load model {name_or_path!r}: {exc}") from exc
        if gguf:  # plain tensors now: nothing of the quantisation remains to apply
            model.hf_quantizer = None
            model.config.__dict__.pop("quantization_config", None)
        refuse_recurrent(model)  # a state-space layer's state cannot roll back: refused here, in one line
        return cls(model, tokenizer, name=str(name_or_path))

    @cached_property
    def kv_shape(self) -> KVShape:
        """Layers, KV heads, head size and dtype of this model's key/value cache."""
        return KVShape.of(self.model.config, self.model.dtype)

    @property
    def max_context(self) -> int | None:
        """The most positions the model takes (its config's max_position_embeddings or equivalent)."""
        return config_context(self.model.config)

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    @torch.no_grad()
    def forward(self, ids: list[int], cache: DynamicCache, start: int) -> torch.Tensor:  # -> [n, V] float32
        """Run `ids` at positions start.. on top of `cache` (which grows by len(ids))."""
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(start, start + len(ids), device=self.device)[None]  # [1, n]
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=True, **{self._cache_kw: cache})
        return out.logits[0].float()

    @torch.no_grad()
    def forward_batch(self, rows: list["BatchRow"]) -> list[tuple[torch.Tensor, KV]]:
        """One forward pass over many sequences with different cached lengths and new-token counts.

        Past K/V are left-padded to the longest past, new tokens right-padded; the attention mask hides
        padding and position ids are per row. Returns, per row, (logits [n_i, V] float32, new K/V whose first
        n_i positions are its tokens) — the caller keeps only the K/V of tokens that end up committed.
        """
        b = len(rows)
        past = max(r.past_len for r in rows)
        width = max(len(r.ids) for r in rows)
        ids = torch.zeros(b, width, dtype=torch.long)
        positions = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, past + width, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.ids)
            ids[i, :n] = torch.tensor(r.ids)
            positions[i] = r.past_len + torch.arange(width)  # padded tail keeps counting: harmless, masked
            mask[i, past - r.past_len: past + n] = 1
        cache = DynamicCache(ddp_cache_data=_stack_left_padded([r.kv for r in rows], past)) if past else DynamicCache()
        out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                         attention_mask=mask.to(self.device), use_cache=True, **{self._cache_kw: cache})
        layers = [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in cache.layers]
        logits = out.logits.float()
        return [(logits[i, :len(r.ids)], [(k[i], v[i]) for k, v in layers]) for i, r in enumerate(rows)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class BatchRow:
    """One sequence in a batched forward: its cached K/V (None when empty), cached length, new token ids."""

    kv: KV | None
    past_len: int
    ids: list[int]


def _stack_left_padded(kvs: list[KV | None], past: int) -> KV:
    """Per layer, stack rows into [batch, kv_heads, past, head_dim], zero-padding each row on the left."""
    if all(kv and kv[0][0].shape[1] == past for kv in kvs):  # no padding needed: one stack per layer
        return [(torch.stack([kv[li][0] for kv in kvs]), torch.stack([kv[li][1] for kv in kvs]))
                for li in range(len(kvs[0]))]
    template = next(kv for kv in kvs if kv)
    layers = []
    for li, (k0, v0) in enumerate(template):
        shape = (len(kvs), k0.shape[0], past, k0.shape[2])
        keys, values = k0.new_zeros(shape), v0.new_zeros(shape)
        for i, kv in enumerate(kvs):
            if kv:
                k, v = kv[li]
                keys[i, :, past - k.shape[1]:] = k
                values[i, :, past - v.shape[1]:] = v
        layers.append((keys, values))
    return layers


def append_kv(kv: KV | None, new: KV, keep: int) -> KV:
    """kv + the first `keep` positions of `new` (per layer concatenation along the sequence axis)."""
    if kv is None:
        return [(k[:, :keep].clone(), v[:, :keep].clone()) for k, v in new]
    return [(torch.cat([k, nk[:, :keep]], 1), torch.cat([v, nv[:, :keep]], 1)) for (k, v), (nk, nv) in zip(kv, new)]


@dataclass
class Decoder:
    """One sequence's incremental decoding state: the ids whose K/V are cached, and rollback by cache crop."""

    runner: ModelRunner
    ids: list[int] = field(default_factory=list)
    cache: DynamicCache | None = None
    last_logits: torch.Tensor | None = None  # [V] logits after the last cached id

    def __post_init__(self) -> None:
        self.cache = self.runner.new_cache()

    def rollback(self, length: int) -> None:
        """Forget cached positions >= length (rejected draft tokens)."""
        if length < len(self.ids):
            self.cache.crop(length - len(self.ids))  # negative: remove that many (transformers 4.x and 5.x)
            self.ids = self.ids[:length]
            self.last_logits = None

    def extend(self, ids: list[int]) -> torch.Tensor:  # -> [n, V]
        logits = self.runner.forward(ids, self.cache, start=len(self.ids))
        self.ids.extend(ids)
        self.last_logits = logits[-1]
        return logits

    def sync(self, context: list[int]) -> None:
        """Keep only the cached prefix that `context` still starts with (rejected drafts are dropped)."""
        n = len(self.ids)
        if n > len(context) or self.ids != context[:n]:
            self.rollback(common_prefix(self.ids, context))

    def next_logits(self, context: list[int]) -> torch.Tensor:  # -> [V]
        """Logits for the token after `context`, feeding only the part of it the cache lacks."""
        self.sync(context)
        if len(self.ids) == len(context) and self.last_logits is not None:
            return self.last_logits
        if len(self.ids) == len(context):  # fully cached but logits lost to a rollback: re-run the last id
            self.rollback(len(context) - 1)
        return self.extend(context[len(self.ids):])[-1]


def config_context(config) -> int | None:
    """The most positions a model config allows (max_position_embeddings or equivalent); None if it names none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
