"""Structured outputs and tools through real processes, driven by the official `openai` client: `specrelay
broker` + `specrelay cloud-worker` (tiny target) + `specrelay edge-worker --http` (tiny draft, same vocabulary).

Greedy output under a JSON schema, a regex and a choice list equals HF `generate` with the grammar as a logits
processor, streamed and not; a forced tool call comes back as OpenAI's `tool_calls`; bad specs are one-line 400s
naming their field; 400 sampled generations of a choice list follow the target's masked law (chi-square).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from specrelay.bench.httpfuzz import wait_http
from specrelay.cluster import LocalCluster, free_port

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(300)

from test_constraint import SCHEMA, _hf, _vocab  # noqa: E402

MODEL = "tiny-target"
N_NEW = 24
# renders tools like the templates of tool-calling models do (a JSON list before the conversation)
TOOLS_TEMPLATE = ("{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}}, "required": ["text"],
    "additionalProperties": False}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
REQUESTS = {  # name -> the request's fields (the openai client's completions take them as extra_body)
    "json_schema": {"response_format": JSON_SCHEMA},
    "regex": {"guided_regex": r"(def|class) [a-z_]{1,12}\((a|b|x)?\):"},
    "choice": {"structured_outputs": {"choice": ["return a + b", "print(i)", "self.x = x"]}},
}


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    """(openai client, the target tokenizer with the tools template, the LocalCluster)."""
    from transformers import AutoTokenizer

    target, draft = tiny_pair
    tok_dir = tmp_path_factory.mktemp("tools-tok")
    for f in target.glob("*.json"):
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, tok_dir / f.name)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TOOLS_TEMPLATE}))
    http_port = free_port()
    with LocalCluster(str(target), threads=1) as cluster:
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", str(draft), "--target-tokenizer", str(tok_dir),
                                 "--http", f"127.0.0.1:{http_port}", "--served-model-name", MODEL,
                                 "--health-port", str(free_port())],
                                env=dict(os.environ, SPECRELAY_THREADS="1", OMP_NUM_THREADS="1"))
        try:
            base = f"http://127.0.0.1:{http_port}"
            wait_http(base + "/health", edge)
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
            yield client, AutoTokenizer.from_pretrained(tok_dir), cluster
        finally:
            edge.terminate()
            assert edge.wait(timeout=30) == 0


def _reference(tiny_runners, body: dict, ids: list[int]) -> tuple[str, bool]:
    """HF generate under the request's grammar: (its text without EOS, whether it ended with EOS)."""
    from specrelay.common.constraint import spec_from_request

    target = tiny_runners[0]
    out = _hf(target, _vocab(target), spec_from_request(body), ids, N_NEW)
    eos = bool(out) and out[-1] == target.tokenizer.eos_token_id
    return target.tokenizer.decode(out[:-1] if eos else out), eos


def test_completions_under_each_grammar_equal_hf_generate_streamed_and_not(stack, tiny_runners):
    client, *_ = stack
    tok = tiny_runners[0].tokenizer
    prompt = "def add(a, b):\n"
    for name, body in REQUESTS.items():
        expected, eos = _reference(tiny_runners, body, tok(prompt).input_ids)
        fields = {"extra_body": body | {"draft_len": 3}}  # a fixed length: auto may pick d = 0 on a loaded box
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0, **fields)
        assert full.choices[0].text == expected, name
        assert full.choices[0].finish_reason == ("stop" if eos else "length")
        assert full.model_extra["speculative"]["draft_tokens"] > 0, name  # the edge drafted under the grammar
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0, stream=True, **fields) if c.choices)
        assert streamed == expected, name
        if name == "json_schema" and eos:
            assert set(json.loads(expected)) == {"name", "n"}


def test_chat_response_format_equals_hf_generate(stack, tiny_runners):
    client, tok, _ = stack
    messages = [{"role": "user", "content": "a point"}]
    ids = _chat_ids(tok, messages, None)
    for fmt in (JSON_SCHEMA, {"type": "json_object"}):
        expected, eos = _reference(tiny_runners, {"response_format": fmt}, ids)
        full = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=N_NEW,
                                              temperature=0)
        assert full.choices[0].message.content == expected
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, response_format=fmt, max_tokens=N_NEW, temperature=0, stream=True)
            if c.choices)
        assert streamed == expected


def test_sampled_requests_follow_the_masked_target_law(stack, tiny_runners):
    """Sample mode over the wire (rejections finished on the edge, their tokens sent as the next VERIFY's tail):
    400 seeds of a choice list through the real processes against the target's exact masked law (chi-square)."""
    from concurrent.futures import ThreadPoolExecutor

    from specrelay.common.sampling import SamplingParams
    from stats import chi2_pvalue
    from test_constraint import LAW_CHOICES, _exact_law

    client, *_ = stack
    target = tiny_runners[0]
    prompt = "def "
    law = _exact_law(target.model, target.tokenizer, target.tokenizer(prompt).input_ids, _vocab(target),
                     SamplingParams(temperature=1.0))

    def draw(seed: int):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=seed,
                                        extra_body={"guided_choice": LAW_CHOICES, "draft_len": 3})
        return out.choices[0].text, out.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        draws = list(pool.map(draw, range(400)))
    assert all(text in LAW_CHOICES and finish == "stop" for text, finish in draws)
    counts = [sum(text == c for text, _ in draws) for c in LAW_CHOICES]
    assert chi2_pvalue(counts, [law[c] for c in LAW_CHOICES]) > 0.001, (counts, law)
    q_law = _exact_law(tiny_runners[1].model, target.tokenizer, target.tokenizer(prompt).input_ids, _vocab(target),
                       SamplingParams(temperature=1.0))
    assert chi2_pvalue(counts, [q_law[c] for c in LAW_CHOICES]) < 0.001  # the test tells the draft's law apart


def _chat_ids(tok, messages, tools):
    tools = {"tools": tools} if tools else {}
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **tools),
               add_special_tokens=False).input_ids


def test_a_forced_tool_call_comes_back_as_tool_calls(stack, tiny_runners):
    from specrelay.common.constraint import tool_call_spec

    client, tok, _ = stack
    messages = [{"role": "user", "content": "add 2 and 3"}]
    ids = _chat_ids(tok, messages, [ADD, ECHO])
    target = tiny_runners[0]
    for choice, allowed in (("required", [ADD, ECHO]), ({"type": "function", "function": {"name": "echo"}}, [ECHO])):
        spec = tool_call_spec([(t["function"]["name"], t["function"]["parameters"]) for t in allowed])
        ref = _hf(target, _vocab(target), spec, ids, 64)
        assert ref[-1] == target.tokenizer.eos_token_id, "the call must end within 64 tokens"
        call = json.loads(target.tokenizer.decode(ref[:-1]))
        full = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD, ECHO], tool_choice=choice,
                                              max_tokens=64, temperature=0)
        c = full.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [got] = c.message.tool_calls
        assert got.type == "function" and got.id.startswith("call_")
        assert got.function.name == call["name"] and json.loads(got.function.arguments) == call["arguments"]
        parts = {}
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD, ECHO],
                                                    tool_choice=choice, max_tokens=64, temperature=0, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                parts[delta.function.name] = parts.get(delta.function.name, "") + delta.function.arguments
            if chunk.choices and chunk.choices[0].finish_reason:
                assert chunk.choices[0].finish_reason == "tool_calls"
        assert {k: json.loads(v) for k, v in parts.items()} == {call["name"]: call["arguments"]}


def test_tool_choice_auto_is_plain_generation_with_the_tools_in_the_prompt(stack, tiny_runners):
    client, tok, _ = stack
    messages = [{"role": "user", "content": "add 2 and 3"}]
    ids = _chat_ids(tok, messages, [ADD])
    target = tiny_runners[0]
    import torch

    out = target.model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                pad_token_id=target.tokenizer.eos_token_id)[0, len(ids):].tolist()
    expected = target.tokenizer.decode([t for t in out if t not in target.eos_ids])
    full = client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], tool_choice="auto",
                                          max_tokens=N_NEW, temperature=0)
    assert full.choices[0].message.content == expected and not full.choices[0].message.tool_calls
    assert full.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("fields, param", [
    ({"extra_body": {"guided_regex": "(a"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"response_format": {"type": "yaml"}}}, "response_format.type"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs.xml"),
    ({"extra_body": {"tools": [ADD]}}, "tools"),  # completions: chat only
])
def test_bad_specs_are_one_line_400s_naming_the_field(stack, fields, param):
    client, *_ = stack
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def ", max_tokens=4, temperature=0, **fields)
    error = e.value.body
    assert error["param"] == param and "\n" not in error["message"]
    assert client.completions.create(model=MODEL, prompt="def ", max_tokens=2, temperature=0).choices[0].text \
        is not None  # the edge still serves


def test_tool_choice_errors_name_the_field(stack):
    client, *_ = stack
    messages = [{"role": "user", "content": "x"}]
    for fields, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [ADD]},
                           "tool_choice"),
                          ({"tool_choice": "required", "tools": [ADD],
                            "response_format": {"type": "json_object"}}, "tool_choice"),
                          ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **fields)
        assert e.value.body["param"] == param, fields


def test_the_worker_answers_a_bad_spec_on_the_wire_with_an_error_and_counts_it(stack, tiny_runners):
    """An OPEN whose constraint the engine refuses, sent straight to the broker (no edge to check it first): the
    worker answers one BAD_REQUEST naming the field, counts it, and goes on serving."""
    import urllib.request

    import zmq

    from specrelay.common import protocol as P
    from specrelay.common.constraint import ConstraintSpec

    client, _, cluster = stack

    def bad_requests() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.health_ports[0]}/metrics", timeout=5).read()
        return sum(float(line.split()[-1]) for line in text.decode().splitlines()
                   if line.startswith("specrelay_cloud_bad_requests_total "))

    before = bad_requests()
    ids = tiny_runners[0].tokenizer("def ").input_ids
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        sock.connect(cluster.frontend)
        for spec in (ConstraintSpec("regex", "(a"), ConstraintSpec("xml", "x" * 100)):
            sock.send_multipart(P.encode(P.Open(11, ids, constraint=spec)))
            reply = P.decode(sock.recv_multipart())
            assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST, reply
            assert "\n" not in reply.message and ("regex" in reply.message or "constraint" in reply.message)
    finally:
        sock.close()
    assert bad_requests() == before + 2
    assert client.completions.create(model=MODEL, prompt="def ", max_tokens=2, temperature=0).choices[0].text \
        is not None


def test_a_grammar_with_penalties_logprobs_and_n_together(stack, tiny_runners):
    """The features compose as the target alone would: the cloud penalises each verified row, then masks it
    (the drafter the same), and reports logprobs of the raw logits; n choices each follow their own seed. Greedy
    output equals HF generate with the repetition penalty before the grammar; every reported logprob is the
    target's own log-softmax at that position."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from specrelay.common.constraint import Constraint, spec_from_request
    from test_constraint import ConstraintLogitsProcessor

    client, *_ = stack
    target = tiny_runners[0]
    tok = target.tokenizer
    prompt, body = "def add(a, b):\n", REQUESTS["json_schema"]
    ids = tok(prompt).input_ids
    cons = Constraint(_vocab(target), spec_from_request(body))
    ref = target.model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                pad_token_id=tok.eos_token_id, logits_processor=[RepetitionPenaltyLogitsProcessor(1.3),
                                                  ConstraintLogitsProcessor(cons, len(ids))])[0, len(ids):].tolist()
    eos = bool(ref) and ref[-1] == tok.eos_token_id
    expected = tok.decode(ref[:-1] if eos else ref)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0, n=2, logprobs=2,
                                    extra_body=body | {"repetition_penalty": 1.3, "draft_len": 3})
    assert [c.text for c in out.choices] == [expected, expected]  # greedy: n equal choices
    with torch.no_grad():
        raw = target.model(torch.tensor([ids + ref])).logits[0].float().log_softmax(-1)
    got = out.choices[0].logprobs.token_logprobs
    want = [float(raw[len(ids) - 1 + i, t]) for i, t in enumerate(ref)]
    assert len(got) >= len(ref[:-1]) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
