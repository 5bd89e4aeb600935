"""Building an edge: the draft model, the target's tokenizer, and the drafter for that pair. Every edge
(the CLI's edge-worker and generate, `Client.local`, the demo, the benchmarks) is assembled here."""

from __future__ import annotations

import asyncio

from ..common.errors import FatalError
from ..common.runner import ModelRunner
from .drafter import Drafter
from .server import EdgeConfig, EdgeWorker
from .xdrafter import CrossVocabDrafter

# An edge-worker process hands the GIL between its event loop and its draft thread every 0.5 ms (Python's default
# is 5 ms): a VERDICT that arrives while the draft thread runs (pre-drafting) is handled without waiting 5 ms.
GIL_SWITCH_S = 0.0005


def load_drafter(draft_model: str, target_tokenizer: str | None = None, device: str = "cpu",
                 dtype: str = "float32", target_vocab_size: int | None = None):
    """Load the draft model and return (drafter, target tokenizer).

    With no target tokenizer, or one whose vocabulary equals the draft's, the pair shares a vocabulary;
    otherwise the cross-vocabulary drafter (shared vocabulary V_c, context sync by bytes) is used. The target
    vocabulary size defaults to the target config's (when `target_tokenizer` is a model directory/id).
    """
    runner = ModelRunner.load(draft_model, device=device, dtype=dtype)
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
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise FatalError(f"cannot load the target tokenizer {name!r}: {exc}") from exc
    try:
        vocab_size = getattr(AutoConfig.from_pretrained(name), "vocab_size", None)
    except (OSError, ValueError):
        vocab_size = None
    return tokenizer, vocab_size


async def load_edge(broker: str, draft_model: str, target_tokenizer: str | None = None, *, device: str = "cpu",
                    dtype: str = "float32", target_vocab_size: int | None = None, config: EdgeConfig | None = None,
                    **options) -> EdgeWorker:
    """Load the draft model (in a thread) and build an EdgeWorker (not started). options: EdgeWorker's
    keyword arguments (context, identity, curve)."""
    drafter, tokenizer = await asyncio.to_thread(load_drafter, draft_model, target_tokenizer, device, dtype,
                                                 target_vocab_size)
    return EdgeWorker(broker, drafter, tokenizer, config, **options)


async def serve(broker: str, draft_model: str, listen: str, target_tokenizer: str | None = None, *,
                device: str = "cpu", dtype: str = "float32", config: EdgeConfig | None = None, **options) -> None:
    """`specrelay edge-worker`: load the draft model, connect to the broker and serve clients on `listen`
    until SIGTERM / SIGINT."""
    import sys
    from dataclasses import replace

    from ..common import transport

    sys.setswitchinterval(GIL_SWITCH_S)
    config = replace(config or EdgeConfig(), listen=listen)
    edge = await load_edge(broker, draft_model, target_tokenizer, device=device, dtype=dtype, config=config,
                           **options)
    await transport.serve_until_signalled(edge)
