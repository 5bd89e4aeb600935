"""An edge's settings, validated once, here: `EdgeConfig` (the process), `HttpLimits` (its HTTP API),
`SessionConfig` (one generation), and `session_config`, the ONE door from a request to a SessionConfig.

    HTTP body (api.session_config) ──┐
    client GENERATE (frontend) ──────┼──> session_config(EdgeConfig, fields) ──> SessionConfig
    `specrelay generate` flags ──────┘    (the edge's defaults, then the mode rule: checked once)

Every default lives on these dataclasses; the CLI's flags (specrelay/cliflags.py) read them from here. Importing
this module loads no torch, so the CLI checks a request's settings before any model loads. The cloud worker checks
what arrives on the wire again (another trust boundary: cloud_worker/verifier.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..common import protocol as P
from ..common.constraint import ConstraintSpec
from ..common.errors import InvalidRequest, SettingError
from ..common.logprobs import MAX_TOP
from ..common.packing import enum_value
from ..common.penalties import Penalties
from ..common.protocol import (DEFAULT_OBJECTIVE, DEFAULT_SAMPLED_MODE, DEFAULT_STRATEGY, HEARTBEAT_INTERVAL, Mode,
                               Objective, Strategy)
from ..common.sampling import SamplingParams

SEED_LIMIT = 1 << 63
SERVED_MODEL_NAME = "specrelay"  # the `model` the HTTP API answers to (specrelay/defaults.py shares it)
TREES = ("off", "on", "auto")  # token trees (edge_worker/policy)  # seeds travel as unsigned 63-bit integers (protocol.U63)


@dataclass(frozen=True)
class SessionConfig:
    """One generation's settings. `mode` comes out resolved (the mode rule, `_resolve_mode`): given None it is
    GREEDY at temperature 0, else DEFAULT_SAMPLED_MODE; names are accepted ("coupled")."""

    max_new_tokens: int = P.DEFAULT_MAX_NEW_TOKENS
    params: SamplingParams = SamplingParams()
    mode: Mode | None = None
    seed: int = 0
    draft_len: int | None = None  # None = auto
    resample: Strategy = DEFAULT_STRATEGY
    objective: Objective = DEFAULT_OBJECTIVE  # what `auto` optimises (edge_worker/policy)
    trees: str = "off"             # token trees: off (chains), on (trees), auto (the shape policy may choose chains)
    tree_nodes: int | None = None  # a tree's node budget; None = chosen (edge_worker/policy)
    constraint: ConstraintSpec | None = None  # structured outputs (common/constraint.py); None = unconstrained
    logprobs: int | None = None    # the target's logprobs with the top k per output token; None: none
    prompt_logprobs: bool = False  # the prompt's logprobs too (echo: prompt scoring)
    penalties: Penalties | None = None  # presence / frequency / repetition, logit_bias, min_tokens (both sides)
    ignore_eos: bool = False       # EOS does not end the generation
    stop_token_ids: tuple[int, ...] = ()  # more ids that end it (after being generated), as EOS does

    def __post_init__(self) -> None:
        object.__setattr__(self, "resample", enum_value(Strategy, self.resample, "resample"))
        object.__setattr__(self, "objective", enum_value(Objective, self.objective, "objective"))
        object.__setattr__(self, "mode", _resolve_mode(self.params, enum_value(Mode, self.mode, "mode")))
        if self.resample is None:
            raise InvalidRequest("resample must be full, hr or srdv", field="resample")
        if self.objective is None:
            raise InvalidRequest("objective must be speed, balanced or cloud", field="objective")
        if self.trees not in TREES:
            raise InvalidRequest(f"trees must be one of {', '.join(TREES)}", field="trees")
        if self.tree_nodes is not None and not 1 <= self.tree_nodes <= P.MAX_DRAFT:
            raise InvalidRequest(f"tree_nodes must be in [1, {P.MAX_DRAFT}] or auto", field="tree_nodes")
        if self.draft_len is not None and not 0 <= self.draft_len <= P.MAX_DRAFT:
            raise InvalidRequest(f"draft_len must be in [0, {P.MAX_DRAFT}] or auto", field="draft_len")
        if not 1 <= self.max_new_tokens <= P.MAX_CONTEXT:
            raise InvalidRequest(f"max_new_tokens must be in [1, {P.MAX_CONTEXT}]", field="max_new_tokens")
        if not 0 <= self.seed < SEED_LIMIT:
            raise InvalidRequest("seed must be in [0, 2^63)", field="seed")
        self._check_scoring()

    @property
    def scored(self) -> bool:
        """Logprobs or penalties: what the cloud computes per row for this session (cloud_worker/scoring.py)."""
        return self.logprobs is not None or self.prompt_logprobs or self.penalties is not None

    def _check_scoring(self) -> None:
        if self.penalties is not None and not self.penalties.active:
            object.__setattr__(self, "penalties", None)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP}]", field="logprobs")
        if self.prompt_logprobs and self.logprobs is None:
            raise InvalidRequest("echo scores the prompt with logprobs: name logprobs too", field="logprobs")
        if self.logprobs is not None and self.mode == Mode.SAMPLE:
            raise InvalidRequest("logprobs are served in modes greedy and coupled (the default at temperature > 0), "
                                 "not sample", field="mode")
        if self.scored and self.trees != "off":
            raise InvalidRequest("token trees are not drafted with logprobs or penalties: trees off", field="trees")


def _resolve_mode(params: SamplingParams, mode: Mode | None) -> Mode:
    """The one rule tying the mode to the temperature: greedy is temperature 0, and temperature 0 is greedy."""
    if params.greedy:
        if mode not in (None, Mode.GREEDY):
            raise InvalidRequest(f"mode {mode.name.lower()} needs temperature > 0", field="mode")
        return Mode.GREEDY
    if mode == Mode.GREEDY:
        raise InvalidRequest("mode greedy needs temperature 0", field="mode")
    return mode or DEFAULT_SAMPLED_MODE


@dataclass
class EdgeConfig:
    """listen: ROUTER endpoint for local clients (None = library use only). request_timeout_s: wait for one
    cloud reply. retry_budget_s: how long consecutive failures (timeout, UNKNOWN_SESSION, WORKER_LOST,
    UNAVAILABLE, INTERNAL) are retried before the generation fails. default_*: what a request that names none
    of these gets."""

    listen: str | None = None
    insecure_listen: bool = False      # allow `listen` on a non-loopback address without client_keys
    client_keys: str | None = None     # a directory of public keys that may use `listen` (CURVE; edge's keys)
    request_timeout_s: float = 30.0
    # plus this many seconds per prompt token this edge's sessions wait to have prefilled (they queue for the
    # worker's prefill budget, --prefill-tokens per forward pass): a long prompt under load is not given up on
    prefill_s_per_token: float = 0.01
    retry_budget_s: float = 30.0
    retry_backoff_s: float = 0.1      # doubled per consecutive failure, capped at max_backoff_s
    max_backoff_s: float = 1.0
    default_objective: Objective = DEFAULT_OBJECTIVE  # what auto optimises when a request names none
    default_trees: str = "off"        # token trees: off, on, auto (edge_worker/policy)
    linger_ms: int = 100
    heartbeat_s: float = HEARTBEAT_INTERVAL  # ZMTP heartbeats on the broker connection (drop a dead TCP peer)
    predraft: bool = True             # draft ahead while a VERIFY is in flight (edge_worker/draft/predraft.py)
    max_context: int | None = None    # the target's context (prompt + max_new_tokens); None = unknown

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0 or self.prefill_s_per_token < 0:
            raise SettingError("request_timeout_s must be > 0, prefill_s_per_token >= 0")
        if self.retry_budget_s < 0 or self.retry_backoff_s < 0:
            raise SettingError("retry_budget_s and retry_backoff_s must be >= 0")
        if not 0 <= self.linger_ms <= 5000:
            raise SettingError("linger_ms must be in [0, 5000] so shutdown cannot hang")
        check = SessionConfig(objective=self.default_objective, trees=self.default_trees)  # validates both
        self.default_objective = check.objective  # a name -> its member


def session_config(edge: EdgeConfig, *, max_new_tokens: int = SessionConfig.max_new_tokens,
                   temperature: float = SamplingParams.temperature, top_k: int = SamplingParams.top_k,
                   top_p: float = SamplingParams.top_p, seed: int | None = SessionConfig.seed,
                   draft_len: int | str | None = None, mode: Mode | str | None = None,
                   resample: Strategy | str | None = None, objective: Objective | str | None = None,
                   trees: str | None = None, **features) -> SessionConfig:
    """A request's fields -> its SessionConfig, for every front end. None takes the default: auto for the draft
    length ("auto" names it too), the protocol's resampling strategy, the edge's objective and trees, and the mode
    (greedy at temperature 0, DEFAULT_SAMPLED_MODE above it). seed None draws a random seed (OpenAI's rule). A
    refusal is an InvalidRequest naming the field; each front end says it in its own words. `features`: constraint,
    logprobs, prompt_logprobs, penalties, ignore_eos, stop_token_ids (SessionConfig's); with logprobs or penalties,
    trees default to off."""
    scored = features.get("logprobs") is not None or getattr(features.get("penalties"), "active", False)
    trees = trees if trees is not None else "off" if scored else edge.default_trees
    return SessionConfig(max_new_tokens=max_new_tokens, params=SamplingParams(float(temperature), top_k, top_p),
                         mode=mode, seed=int.from_bytes(os.urandom(7), "little") if seed is None else seed,
                         draft_len=None if draft_len == "auto" else draft_len,
                         resample=DEFAULT_STRATEGY if resample is None else resample,
                         objective=edge.default_objective if objective is None else objective,
                         trees=trees, **features)


@dataclass
class HttpLimits:
    """What one edge's HTTP API allows (enforced by edge_worker/http/guards.py). max_body_bytes: the largest legal
    request (a prompt of protocol.MAX_PROMPT_CHARS characters, JSON-escaped) fits. max_prompt_tokens: prompt
    tokens in flight, at most the broker's --max-prompt-tokens-per-client for this edge's key (divided by the edges
    that share the key)."""

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    max_body_bytes_in_flight: int = 64 << 20  # all bodies being read at once
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 512          # well below the default 1,024 open files (ZeroMQ and models need some)
    max_concurrent: int = 64            # generations in flight (the broker's per-client session quota is 256)
    max_prompt_tokens: int = 1 << 19    # prompt tokens in flight (the broker's per-client default is 1 << 20)

    def __post_init__(self) -> None:
        if any(not key or key != key.strip() for key in self.api_keys):
            raise SettingError("an API key must be non-empty, without surrounding whitespace")
        if min(self.max_body_bytes, self.max_body_bytes_in_flight, self.max_connections, self.max_concurrent,
               self.max_prompt_tokens) < 1:
            raise SettingError("HTTP limits must be >= 1")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise SettingError("HTTP timeouts must be > 0")
