"""Loading what an edge needs: the draft model, the target's tokenizer (never its weights) and context, and the
drafter for that pair (same or cross vocabulary). `server.load_edge` builds an EdgeWorker on them."""

from __future__ import annotations

from ..common.errors import FatalError
from ..common.modelsource import check_model, pretrained_args
from ..common.runner import ModelRunner, config_context
from .draft import kv as draft_kv
from .draft.drafter import Drafter
from .xvocab.drafter import CrossVocabDrafter


def load_drafter(draft_model: str, target_tokenizer: str | None = None, device: str = "cpu",
                 dtype: str = "float32", target_vocab_size: int | None = None):
    """Load the draft model and return (drafter, target tokenizer).

    With no target tokenizer, or one whose vocabulary equals the draft's, the pair shares a vocabulary;
    otherwise the cross-vocabulary drafter (shared vocabulary V_c, context sync by bytes) is used. The target
    vocabulary size defaults to the target config's (when `target_tokenizer` is a model directory/id).
    """
    runner = ModelRunner.load(draft_model, device=device, dtype=dtype)
    draft_kv.self_check(runner)  # before READY: a draft K/V path that is not the model's own fails here
    if target_tokenizer is None:
        return Drafter(runner, target_vocab_size), runner.tokenizer
    target_tok, config_vocab = load_target_tokenizer(target_tokenizer)
    target_vocab_size = target_vocab_size or config_vocab
    if target_tok.get_vocab() == runner.tokenizer.get_vocab():
        return Drafter(runner, target_vocab_size), target_tok
    return CrossVocabDrafter(runner, target_tok, target_vocab_size), target_tok


def load_target_tokenizer(name: str):
    """(tokenizer, vocab size from the model config when `name` is a model, else None). The edge needs only
    the target's tokenizer files (its decode table), never its weights."""
    from transformers import AutoTokenizer

    name = check_model(name, "target tokenizer", weights=False)  # a path-looking name is never sent to the hub
    try:
        source, gguf = pretrained_args(name)  # a GGUF file holds its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(source, **gguf)
    except (OSError, ValueError, NotImplementedError) as exc:
        raise FatalError(f"cannot load the target tokenizer {name!r}: {exc}") from exc
    config = _target_config(name)
    return tokenizer, getattr(config, "vocab_size", None)


def _target_config(name: str):
    """The target's model config when `name` is a model directory (or id) that has one, else None."""
    from transformers import AutoConfig

    try:
        source, gguf = pretrained_args(check_model(name, "target tokenizer", weights=False))
        return AutoConfig.from_pretrained(source, **gguf)
    except (OSError, ValueError, NotImplementedError):
        return None


def target_context(name: str | None) -> int | None:
    """The target's context from its config next to the tokenizer (None: not known here)."""
    config = _target_config(name) if name else None
    return config_context(config) if config is not None else None
