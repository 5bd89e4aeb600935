"""Building an edge: the draft model, the target's tokenizer, and the drafter for that pair. Every edge
(the CLI's edge-worker and generate, `Client.local`, the demo, the benchmarks) is assembled here."""

from __future__ import annotations

import asyncio

import structlog

from ..common import transport
from ..common.errors import FatalError
from ..common.modelsource import check_model
from ..common.runner import ModelRunner, config_context
from . import draftkv
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
    draftkv.self_check(runner)  # before READY: a draft K/V path that is not the model's own fails here
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
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise FatalError(f"cannot load the target tokenizer {name!r}: {exc}") from exc
    config = _target_config(name)
    return tokenizer, getattr(config, "vocab_size", None)


def _target_config(name: str):
    """The target's model config when `name` is a model directory (or id) that has one, else None."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(check_model(name, "target tokenizer", weights=False))
    except (OSError, ValueError):
        return None


def target_context(name: str | None) -> int | None:
    """The target's context from its config next to the tokenizer (None: not known here)."""
    config = _target_config(name) if name else None
    return config_context(config) if config is not None else None


async def load_edge(broker: str, draft_model: str, target_tokenizer: str | None = None, *, device: str = "cpu",
                    dtype: str = "float32", target_vocab_size: int | None = None, config: EdgeConfig | None = None,
                    **options) -> EdgeWorker:
    """Load the draft model (in a thread) and build an EdgeWorker (not started). options: EdgeWorker's
    keyword arguments (context, identity, curve)."""
    from dataclasses import replace

    drafter, tokenizer = await asyncio.to_thread(load_drafter, draft_model, target_tokenizer, device, dtype,
                                                 target_vocab_size)
    config = config or EdgeConfig()
    if config.max_context is None:  # requests past it are refused before any work (EdgeWorker.check_fits)
        config = replace(config, max_context=await asyncio.to_thread(target_context, target_tokenizer))
    return EdgeWorker(broker, drafter, tokenizer, config, **options)


async def serve(broker: str, draft_model: str, listen: str | None, target_tokenizer: str | None = None, *,
                device: str = "cpu", dtype: str = "float32", config: EdgeConfig | None = None,
                http: tuple[str, int] | None = None, http_limits=None, served_model_name: str = "specrelay",
                health_port: int | None = None, health_host: str = "127.0.0.1", **options) -> None:
    """`specrelay edge-worker`: load the draft model, connect to the broker and serve clients on `listen`
    (ZeroMQ), on `http` (the OpenAI-compatible API) and health / metrics on `health_port`, until SIGTERM / SIGINT."""
    import sys
    from dataclasses import replace

    from ..runtime import serve_all
    from .http import HttpFrontend, HttpStats

    sys.setswitchinterval(GIL_SWITCH_S)
    config = replace(config or EdgeConfig(), listen=listen)
    edge = await load_edge(broker, draft_model, target_tokenizer, device=device, dtype=dtype, config=config,
                           **options)
    if edge.config.max_context is None:
        structlog.get_logger("specrelay.edge").warning(
            "the target's context is unknown (no config next to --target-tokenizer, no --max-model-len): a request "
            "past it fails only when the cloud worker refuses it, after generating")
    stats = HttpStats()
    services = [edge] + ([HttpFrontend(edge, *http, served_model_name, stats, http_limits)] if http else [])
    services += [EdgeHealth(edge, stats, health_host, health_port)] if health_port is not None else []
    await serve_all(*services)


class EdgeHealth(transport.Service):
    """The edge worker's /healthz, /readyz (200 while it serves) and /metrics: the edge's speculation counters
    (telemetry.EdgeMetrics), sessions and, with the HTTP front end, its counters."""

    name = "edge-health"
    GAUGES = ("sessions_open", "draft_queue_depth", "http_in_flight")

    def __init__(self, edge: EdgeWorker, stats, host: str, port: int) -> None:
        super().__init__()
        self.edge, self.stats, self.host, self.port = edge, stats, host, port
        self._server = None

    def snapshot(self) -> dict:
        from dataclasses import asdict

        http = asdict(self.stats) if self.stats is not None else {}
        return {**self.edge.metrics.stats(self.edge), "sessions_open": self.edge.sessions_open, **http}

    async def _open(self) -> None:
        from ..common import health

        probe = lambda: (True, {"sessions_open": self.edge.sessions_open})  # noqa: E731  answers = the loop runs
        endpoints = health.Endpoints(probe, probe, health.registry_for("specrelay_edge_", self.snapshot,
                                                                       self.GAUGES))
        self._server = await health.start_http(self.host, self.port, endpoints)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
