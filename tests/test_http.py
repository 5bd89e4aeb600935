"""The OpenAI-compatible HTTP API, driven by the official `openai` client against real processes: `specrelay
broker` + `specrelay cloud-worker` (tiny target) + `specrelay edge-worker --http` (tiny draft), 127.0.0.1.

Greedy output equals the target's own `generate` (non-streaming and streaming, 20 prompts); streamed pieces
concatenate to the same text; a client that disconnects mid-stream (or mid-request) frees its cloud session.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from specrelay.bench.httpfuzz import wait_http
from specrelay.cluster import LocalCluster, bindable, free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-target"
N_NEW = 16
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.fixture(scope="module")
def stack(tiny_pair, tmp_path_factory):
    """(openai client, base url, worker health port, edge health port, target dir, target tokenizer dir)."""
    target, draft = tiny_pair
    tok_dir = tmp_path_factory.mktemp("chat-tok")  # the target's tokenizer plus a chat template
    for f in target.glob("*.json"):
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, tok_dir / f.name)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    http_port, edge_health = free_port(), free_port()
    with LocalCluster(str(target), threads=1) as cluster:  # 1 torch thread per process: no oversubscription
        edge = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "edge-worker", "--broker", cluster.frontend,
                                 "--draft-model", str(draft), "--target-tokenizer", str(tok_dir),
                                 "--listen", f"tcp://127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{http_port}",
                                 "--served-model-name", MODEL, "--health-port", str(edge_health)],
                                env=dict(os.environ, SPECRELAY_THREADS="1", OMP_NUM_THREADS="1"))
        try:
            base = f"http://127.0.0.1:{http_port}"
            wait_http(base + "/health", edge)
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
            yield client, base, cluster.health_ports[0], edge_health, target, tok_dir
        finally:
            edge.terminate()
            assert edge.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def reference(tiny_runners, tiny_pair):
    """prompt ids -> the target's own greedy text (HF generate, stopping at EOS, EOS not shown)."""
    target, _ = tiny_runners
    import torch

    def ref(ids: list[int], n: int = N_NEW) -> str:
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                    pad_token_id=target.tokenizer.eos_token_id)[0, len(ids):].tolist()
        out = [t for t in out if t not in target.eos_ids]
        return target.tokenizer.decode(out)

    return ref


def test_models_lists_the_served_name(stack):
    client, *_ = stack
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_greedy_equal_target_alone_streaming_and_not(stack, reference, heldout_prompts, tiny_runners):
    client, *_ = stack
    tok = tiny_runners[0].tokenizer
    for prompt in heldout_prompts[:20]:
        expected = reference(tok(prompt).input_ids)
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0)
        assert full.choices[0].text == expected, prompt
        assert full.usage.prompt_tokens == len(tok(prompt).input_ids)
        assert 1 <= full.usage.completion_tokens <= N_NEW
        assert full.choices[0].finish_reason in ("stop", "length")
        spec = full.model_extra["speculative"]
        assert spec["generated_tokens"] == full.usage.completion_tokens and spec["cloud_calls"] >= 1
        pieces, finish, usage = [], None, None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert "".join(pieces) == expected, prompt
        assert finish == full.choices[0].finish_reason and usage.completion_tokens == full.usage.completion_tokens


def test_chat_uses_the_target_chat_template(stack, reference):
    client, _, _, _, _, tok_dir = stack
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    messages = [{"role": "system", "content": "code"}, {"role": "user", "content": "def add(a, b):"}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False).input_ids
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_NEW, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == reference(ids)
    assert full.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_NEW, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference(ids)


def test_stop_strings_end_on_committed_text(stack, reference, tiny_runners, heldout_prompts):
    client, *_ = stack
    tok = tiny_runners[0].tokenizer
    for prompt in heldout_prompts[:20]:
        text = reference(tok(prompt).input_ids, 32)
        stop = text[5:7]
        if len(text) < 8 or not stop.strip():
            continue
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "\0"])
        assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=stop, stream=True) if c.choices)
        assert streamed == out.choices[0].text
        return
    pytest.fail("no prompt gave text to stop on")


def test_seeded_sampling_is_reproducible(stack):
    client, *_ = stack
    args = dict(model=MODEL, prompt="def add(a, b):\n", max_tokens=N_NEW, temperature=0.8, top_p=0.95, seed=7)
    first, second = (client.completions.create(**args).choices[0].text for _ in range(2))
    assert first == second


@pytest.mark.parametrize("kwargs, status, param", [
    ({"model": "gpt-4"}, 404, "model"),
    ({"n": 17}, 400, "n"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [-1]}}, 400, "stop_token_ids"),
    ({"echo": True, "max_tokens": 0}, 400, "max_tokens"),
    ({"extra_body": {"mode": "sample"}, "temperature": 0.5, "logprobs": 1}, 400, "mode"),
    ({"top_p": 0.0}, 400, "top_p"),
    ({"temperature": -1.0}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"extra_body": {"mode": "telepathy"}}, 400, "mode"),
])
def test_bad_requests_get_openai_error_objects(stack, kwargs, status, param):
    client, *_ = stack
    args = {"model": MODEL, "prompt": "x", "max_tokens": 4} | kwargs
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    assert info.value.body["param"] == param and info.value.body["message"]


def test_malformed_json_is_a_400(stack):
    _, base, *_ = stack
    request = urllib.request.Request(base + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400 and "error" in json.loads(info.value.read())


def raw_request(base: str, body: dict) -> socket.socket:
    """A POST on a raw socket (so the test can drop the connection whenever it likes)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def long_prompt(tiny_runners, heldout_prompts) -> str:
    """A prompt whose greedy continuation has no EOS for LONG tokens: its request runs until dropped."""
    import torch

    target, _ = tiny_runners
    for prompt in heldout_prompts:
        ids = target.tokenizer(prompt).input_ids
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=LONG, do_sample=False,
                                    pad_token_id=target.tokenizer.eos_token_id)[0, len(ids):].tolist()
        if len(out) == LONG and not set(out) & target.eos_ids and len(ids) + LONG < 500:
            return prompt
    pytest.skip("every held-out prompt reaches EOS early with the tiny target")


LONG = 300


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_the_cloud_session(stack, long_prompt, stream):
    client, base, worker_health, edge_health, *_ = stack
    sessions = lambda: metric(worker_health, "specrelay_cloud_sessions_open")  # noqa: E731
    assert wait_for(lambda: sessions() == 0)
    disconnects = metric(edge_health, "specrelay_edge_http_disconnects_total")
    sock = raw_request(base, {"model": MODEL, "prompt": long_prompt, "max_tokens": LONG, "temperature": 0,
                              "stream": stream, "draft_len": 1})
    try:
        if stream:
            received = b""
            while b"data: " not in received:  # generating: the first chunk arrived
                received += sock.recv(65536)
        assert wait_for(lambda: sessions() == 1), "the session never opened in the cloud"
    finally:
        sock.close()
    assert wait_for(lambda: sessions() == 0), "the cloud session outlived its client"
    assert wait_for(lambda: metric(edge_health, "specrelay_edge_http_disconnects_total") == disconnects + 1)
    assert metric(edge_health, "specrelay_edge_sessions_open") == 0
    # the edge still serves
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens


@pytest.mark.timeout(180)
def test_specrelay_serve_one_box(tiny_pair, reference, tiny_runners):
    """`specrelay serve`: broker, cloud worker and edge in one process behind the same API and guards (API key,
    context), its health port on by default beside the API's; SIGTERM stops it."""
    target, draft = tiny_pair
    port = next(p for p in iter(free_port, None) if bindable(p + 1))  # the default health port: --http's + 1
    proc = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "serve", "--model", str(target), "--draft-model",
                             str(draft), "--http", f"127.0.0.1:{port}", "--served-model-name", MODEL],
                            env=dict(os.environ, SPECRELAY_THREADS="1", SPECRELAY_API_KEY="serve-key"),
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/readyz", timeout=10) as ready:
            assert ready.status == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="serve-key", max_retries=0,
                               timeout=60)
        prompt = "def add(a, b):\n"
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0)
        ids = tiny_runners[0].tokenizer(prompt).input_ids
        assert out.choices[0].text == reference(ids)
        choices = ["return a + b", "print(i)"]  # structured outputs through the one box too
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0,
                                        extra_body={"guided_choice": choices})
        assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
        scored = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1,
                                           echo=True)  # what lm-eval's local-completions sends for loglikelihood
        want = target_logp(tiny_runners, ids)[range(len(ids) - 1), ids[1:]]
        got = scored.choices[0].logprobs.token_logprobs
        assert got[0] is None and max(abs(a - float(b)) for a, b in zip(got[1:len(ids)], want)) < 1e-4
        with pytest.raises(openai.AuthenticationError):  # the same guards as the edge worker's HTTP API
            client.with_options(api_key="wrong").completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="512"):  # its own model's context: refused before work
            client.completions.create(model=MODEL, prompt=[5], max_tokens=5000)
        client.close()  # no idle keep-alive connection for the shutdown to wait on
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]


# ------------------------------------------------------------------ logprobs, prompt scoring, penalties, n

def target_logp(tiny_runners, ids: list[int]):
    """The target's own forward over ids: log_softmax of its logits [len(ids), V]."""
    import torch

    with torch.no_grad():
        return tiny_runners[0].model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_logprobs_equal_the_targets_own_forward(stack, tiny_runners):
    """Completions (streamed and not) and chat: every output token's logprob and its top k are the target's
    log-softmax at that position, within 1e-4."""
    import torch

    client, *_ = stack
    tok = tiny_runners[0].tokenizer
    prompt = "def add(a, b):\n"
    ids = tok(prompt).input_ids
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0, logprobs=5)
    gen = full.model_extra["speculative"]["generated_tokens"]
    lp = full.choices[0].logprobs
    assert len(lp.token_logprobs) == gen and all(len(t) <= 5 for t in lp.top_logprobs)
    out_ids = tiny_runners[0].model.generate(torch.tensor([ids]), max_new_tokens=gen, do_sample=False,
                                             pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()  # greedy: these
    ref = target_logp(tiny_runners, ids + out_ids)
    rows = ref[len(ids) - 1:len(ids) - 1 + gen]
    chosen = rows[range(gen), out_ids]
    assert max(abs(a - float(b)) for a, b in zip(lp.token_logprobs, chosen)) < 1e-4
    top = rows.topk(5, -1).values
    for i, alternatives in enumerate(lp.top_logprobs):  # strings that coincide share an entry: compare the best
        assert abs(max(alternatives.values()) - float(top[i, 0])) < 1e-4
        assert all(min(abs(v - float(t)) for t in top[i]) < 1e-4 for v in alternatives.values())
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=N_NEW, temperature=0, logprobs=5, stream=True)
        if c.choices and c.choices[0].logprobs is not None]
    flat = [v for s in streamed for v in s.token_logprobs]  # the same tokens; rows of other shapes: fast numerics
    assert len(flat) == gen and max(abs(a - b) for a, b in zip(flat, lp.token_logprobs)) < 1e-4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)
    streamed = [c for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_the_prompt_as_the_targets_forward(stack, tiny_runners, max_tokens):
    """echo + logprobs (what lm-eval's loglikelihood sends): the prompt's logprobs, first token null, equal to
    the target's forward over the prompt; max_tokens 0 returns the prompt alone."""
    client, *_ = stack
    ids = tiny_runners[0].tokenizer("for i in range(10):\n    print(i, add(i, i))\n").input_ids
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
                                    echo=True)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
    ref = target_logp(tiny_runners, ids)
    want = ref[range(len(ids) - 1), ids[1:]]
    assert max(abs(a - float(b)) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < 1e-4
    if max_tokens == 0:
        assert out.choices[0].text == tiny_runners[0].tokenizer.decode(ids) and out.usage.completion_tokens == 0
    else:
        assert abs(lp.token_logprobs[-1] - float(ref[-1].max())) < 1e-4


def test_penalties_greedy_equal_hf_generate(stack, tiny_runners):
    """presence / frequency / repetition penalties and logit_bias: greedy output equals HF generate with the same
    processors (RepetitionPenaltyLogitsProcessor, sequence_bias, OpenAI's formula as a processor)."""
    import torch
    from test_penalties import OpenAIPenalty

    client, *_ = stack
    target = tiny_runners[0]
    tok = target.tokenizer
    ids, n, bias = tok("def add(a, b):\n").input_ids, 24, tok("self").input_ids[0]
    ref = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, repetition_penalty=1.3,
                                sequence_bias={(bias,): 1.5}, logits_processor=[OpenAIPenalty(len(ids), 0.6, 0.4)],
                                pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    plain = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    assert ref != plain  # the penalties change the output, so equality below says they were applied
    text = tok.decode([t for t in ref if t not in target.eos_ids])
    for stream in (False, True):
        args = dict(model=MODEL, prompt=ids, max_tokens=n, temperature=0, presence_penalty=0.6,
                    frequency_penalty=0.4, logit_bias={str(bias): 1.5},
                    extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
        else:
            got = client.completions.create(**args).choices[0].text
        assert got == text


def test_n_choices_are_seeds_seed_plus_one(stack):
    """n = 3 sampled: choice j is the single request with seed + j; usage sums the completions, prompt once."""
    client, *_ = stack
    args = dict(model=MODEL, prompt="def add(a, b):\n", max_tokens=N_NEW, temperature=0.9)
    many = client.completions.create(**args, n=3, seed=11)
    singles = [client.completions.create(**args, seed=11 + j).choices[0] for j in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [c.text for c in singles]
    assert len({c.text for c in many.choices}) > 1  # distinct seeds, distinct samples
    assert many.usage.prompt_tokens == client.completions.create(**args, seed=11).usage.prompt_tokens
    streamed = {}
    for chunk in client.completions.create(**args, n=2, seed=11, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: singles[0].text, 1: singles[1].text}


def test_min_tokens_ignore_eos_and_stop_token_ids(stack, tiny_runners):
    """EOS pushed up by logit_bias ends at once; min_tokens holds it back exactly that many tokens; ignore_eos
    runs to max_tokens; a stop token id ends the generation where the target first draws it."""
    import torch

    client, *_ = stack
    tok = tiny_runners[0].tokenizer
    eos = str(tok.eos_token_id)
    args = dict(model=MODEL, prompt="def add(a, b):\n", max_tokens=12, temperature=0, logit_bias={eos: 100})
    first = client.completions.create(**args, logprobs=0)
    assert first.usage.completion_tokens == 1 and first.choices[0].finish_reason == "stop"
    assert first.choices[0].text == "" and len(first.choices[0].logprobs.token_logprobs) == 1  # EOS has its row
    held = client.completions.create(**args, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    assert client.completions.create(**args, extra_body={"ignore_eos": True}).usage.completion_tokens == 12
    ids = tok("def add(a, b):\n").input_ids
    greedy = tiny_runners[0].model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                            pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    stop = greedy[2]  # the target's third greedy token: the generation ends where it first appears
    cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop]})
    assert cut.usage.completion_tokens == greedy.index(stop) + 1 and cut.choices[0].finish_reason == "stop"
