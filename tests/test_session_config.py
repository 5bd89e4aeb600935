"""One door from a request to a SessionConfig (edge_worker/config.py): the HTTP API, a client's GENERATE and
`specrelay generate`'s flags reach the same settings through it, each refusal said in that front end's words,
and the edge's defaults are defined once (issue 21)."""

from __future__ import annotations

import msgspec
import pytest

from specrelay import cli, cliargs, generate
from specrelay.common import protocol as P
from specrelay.common.errors import InvalidRequest
from specrelay.common.protocol import Mode, Objective, Strategy
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker import frontend
from specrelay.edge_worker.http.server import api
from specrelay.edge_worker.config import EdgeConfig, HttpLimits, SessionConfig, session_config


class Edge:  # what frontend.session_config reads of an EdgeWorker
    def __init__(self, config: EdgeConfig) -> None:
        self.config = config


def http(body: dict, edge: EdgeConfig, max_tokens: int = 8) -> SessionConfig:
    req = msgspec.json.decode(msgspec.json.encode({"model": "m", "prompt": "x"} | body), type=api.CompletionRequest)
    return api.session_config(req, max_tokens, edge)


def flags(*argv: str):
    return cliargs.parse(cli.parser(), ["generate", "--prompt", "x", *argv], environ={})


def test_the_three_front_ends_reach_the_same_settings():
    edge = EdgeConfig()
    fields = dict(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    want = SessionConfig(8, SamplingParams(0.7, 5, 0.9), Mode.COUPLED, 3, None, Strategy.SRDV,
                         edge.default_objective)
    assert session_config(edge, **fields) == want
    assert http({"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3}, edge) == want
    assert frontend.session_config(Edge(edge), P.Generate(1, "x", **fields)) == want
    args = flags("--max-new-tokens", "8", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3")
    assert generate.session_config(args, edge) == want


def test_what_a_request_leaves_out_is_the_edges_default():
    edge = EdgeConfig(default_objective="cloud", default_trees="on")
    for config in (session_config(edge, temperature=1.0), http({}, edge),
                   frontend.session_config(Edge(edge), P.Generate(1, "x", temperature=1.0))):
        assert (config.mode, config.resample, config.draft_len, config.objective, config.trees) == \
            (Mode.COUPLED, Strategy.SRDV, None, Objective.CLOUD, "on")
    assert session_config(edge).mode == Mode.GREEDY  # temperature 0 is greedy whatever the edge samples with
    assert session_config(edge, draft_len="auto").draft_len is None and session_config(edge, draft_len=3).draft_len == 3
    assert session_config(edge, seed=None).seed != session_config(edge, seed=None).seed  # no seed: a random one


def test_the_cli_flags_defaults_are_the_dataclasses():
    args = flags()
    assert generate.session_config(args, EdgeConfig()) == SessionConfig(max_new_tokens=args.max_new_tokens)
    assert args.max_new_tokens == SessionConfig.max_new_tokens and args.retry_budget == EdgeConfig.retry_budget_s
    assert args.objective == EdgeConfig.default_objective.name.lower()
    assert args.resample == SessionConfig.resample.name.lower()
    edge = cliargs.parse(cli.parser(), ["edge-worker"], environ={})
    assert (edge.max_concurrent_requests, edge.max_prompt_tokens_in_flight, edge.http_read_timeout) == \
        (HttpLimits.max_concurrent, HttpLimits.max_prompt_tokens, HttpLimits.header_timeout_s)


@pytest.mark.parametrize("mode, temperature, words", [
    ("greedy", 0.8, "mode greedy needs temperature 0"),
    ("sample", 0.0, "mode sample needs temperature > 0"),
    ("coupled", 0.0, "mode coupled needs temperature > 0"),
])
def test_the_mode_rule_is_one_rule_said_in_each_front_ends_words(mode, temperature, words):
    edge = EdgeConfig()
    with pytest.raises(InvalidRequest, match=words) as wire:
        frontend.session_config(Edge(edge), P.Generate(1, "x", temperature=temperature, mode=Mode[mode.upper()]))
    assert wire.value.field == "mode"
    with pytest.raises(api.APIError) as caught:
        http({"temperature": temperature, "mode": mode}, edge)
    assert caught.value.status == 400 and caught.value.param == "mode" and str(caught.value) == words
    with pytest.raises(InvalidRequest) as refused:
        generate.session_config(flags("--mode", mode, "--temperature", str(temperature)), edge)
    code, line = cli.describe(refused.value)
    assert code == 2 and line == words.replace("mode", "--mode").replace("temperature", "--temperature")


@pytest.mark.parametrize("body, param, words", [
    ({"seed": 2**63}, "seed", "seed must be in [0, 2^63)"),
    ({"draft_len": 99}, "draft_len", "draft_len must be in [0, 64] or auto"),
    ({"top_k": -1}, "top_k", "top_k must be in"),
    ({"mode": "telepathy"}, "mode", "mode must be one of greedy, sample, coupled"),
    ({"resample": "all"}, "resample", "resample must be one of full, hr, srdv"),
])
def test_http_refusals_name_the_apis_fields(body, param, words):
    with pytest.raises(api.APIError) as caught:
        http(body, EdgeConfig())
    assert caught.value.status == 400 and caught.value.param == param and words in str(caught.value)


def test_max_tokens_past_the_wire_limit_is_refused_as_max_tokens():
    with pytest.raises(api.APIError) as caught:
        http({}, EdgeConfig(), max_tokens=P.MAX_CONTEXT + 1)
    assert caught.value.param == "max_tokens" and str(caught.value).startswith("max_tokens must be in [1, ")


def test_an_http_request_is_not_encoded_and_decoded_to_be_checked(monkeypatch):
    def refuse(*_):
        raise AssertionError("the HTTP path went through the wire codec")

    monkeypatch.setattr(P, "encode", refuse)
    monkeypatch.setattr(P, "decode", refuse)
    assert http({"temperature": 0.5, "seed": 1}, EdgeConfig()).mode == Mode.COUPLED


def test_flag_words_turn_field_names_into_flags():
    assert cli.flag_words("draft_len must be in [0, 64] or auto", "draft_len") == "--draft-len must be in [0, 64] or auto"
    assert cli.flag_words("the prompt must hold at least one token", "prompt") == \
        "--prompt: the prompt must hold at least one token"
