"""Log-probabilities: equal to the target's own forward, in OpenAI's shapes, across the wire form."""

import math

import msgspec
import pytest
import torch

from specrelay.common import logprobs as L
from specrelay.common.errors import InvalidRequest

TEXT = "def add(a, b):\n    return a + b  # café → ünïcode"


def _incremental_logits(runner, ids, prompt_len, chunk=3):
    """Logits rows as a verifier sees them: a prefill, then blocks of `chunk` tokens over the runner's cache."""
    cache = runner.new_cache()
    rows = [runner.forward(ids[:prompt_len], cache, 0)]
    for start in range(prompt_len, len(ids), chunk):
        rows.append(runner.forward(ids[start:start + chunk], cache, start))
    return torch.cat(rows)  # [len(ids), V]: row i predicts token i + 1


@pytest.mark.demo
def test_logprobs_equal_the_targets_own_forward(demo_runners):
    target = demo_runners[0]
    ids = target.tokenizer(TEXT).input_ids
    with torch.no_grad():
        ref = target.model(torch.tensor([ids])).logits[0].log_softmax(-1)  # [n, V]
    logits = _incremental_logits(target, ids, prompt_len=6)
    n = len(ids)
    rows = L.token_logprobs(logits[:-1], ids[1:], 20)
    assert torch.allclose(rows.chosen, ref[torch.arange(n - 1), torch.tensor(ids[1:])], atol=1e-4)
    assert torch.allclose(rows.top_logprobs, ref[:-1].gather(-1, rows.top_ids), atol=1e-4)
    assert torch.allclose(rows.top_logprobs, ref[:-1].topk(20, -1).values, atol=1e-4)
    assert (rows.top_logprobs[:, :-1] >= rows.top_logprobs[:, 1:]).all()
    prompt = L.prompt_logprobs(logits, ids, 5)  # echo: the prompt scored from its own prefill
    assert math.isnan(prompt.chosen[0]) and prompt.top_ids.shape == (n, 5)
    assert torch.allclose(prompt.chosen[1:], rows.chosen) and torch.equal(prompt.top_ids[1:], rows.top_ids[:, :5])


def test_wire_form_round_trips_and_refuses_bad_lengths():
    torch.manual_seed(0)
    rows = L.token_logprobs(torch.randn(7, 50), torch.randint(0, 50, (7,)), 4)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(L.pack(rows)), type=L.LogprobsWire)
    assert len(wire.chosen) == 7 * 4 and len(wire.top_ids) == 7 * 4 * 4
    back = L.unpack(wire, max_positions=7)
    assert all(torch.equal(a, b) for a, b in zip(back, rows))
    assert L.token_logprobs(torch.randn(3, 50), [1, 2, 3], 0).top_ids.shape == (3, 0)
    for bad in (L.LogprobsWire(4, wire.chosen, wire.top_ids[:-4], wire.top_logprobs),
                L.LogprobsWire(21, b"", b"", b""), L.LogprobsWire(4, wire.chosen[:-1], b"", b"")):
        with pytest.raises(InvalidRequest):
            L.unpack(bad, max_positions=7)
    with pytest.raises(InvalidRequest):
        L.unpack(wire, max_positions=6)


def test_token_bytes_rebuild_the_text(tiny_runners):
    tok = tiny_runners[0].tokenizer
    table = L.token_byte_table(tok, tiny_runners[0].model.config.vocab_size)
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert b"".join(table[i] for i in ids) == TEXT.encode()
    assert table[tok.eos_token_id] == tok.eos_token.encode()


def test_openai_shapes_validate(tiny_runners):
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion import ChoiceLogprobs
    from openai.types.completion_choice import Logprobs

    target = tiny_runners[0]
    tok = target.tokenizer
    table = L.token_byte_table(tok, target.model.config.vocab_size)
    ids = tok(TEXT).input_ids
    with torch.no_grad():
        logits = target.model(torch.tensor([ids])).logits[0]
    gen = ids[5:]
    rows = L.token_logprobs(logits[4:-1], gen, 3)
    start = len(tok.decode(ids[:5]))
    comp = Logprobs.model_validate(L.completion_logprobs(rows, gen, table, text_offset=start))
    assert "".join(comp.tokens).startswith(TEXT[start:TEXT.index("caf")]) and comp.text_offset[0] == start
    assert all(b - a == len(t) for a, b, t in zip(comp.text_offset, comp.text_offset[1:], comp.tokens))
    # a dict by token string: ids whose strings coincide (split UTF-8 shown as U+FFFD) share one entry
    strings = [{table[t].decode("utf-8", "replace") for t in row} for row in rows.top_ids.tolist()]
    assert [set(t) for t in comp.top_logprobs] == strings and len(comp.token_logprobs) == len(gen)
    assert [b for i in gen for b in table[i]] == list(TEXT[start:].encode())
    chat = ChoiceLogprobs.model_validate(L.chat_logprobs(rows, gen, table))
    assert all(isinstance(c, ChatCompletionTokenLogprob) and len(c.top_logprobs) == 3 for c in chat.content)
    assert bytes(b for c in chat.content for b in c.bytes) == TEXT[start:].encode()
    echo = L.completion_logprobs(L.prompt_logprobs(logits, ids, 2), ids, table)
    assert echo["token_logprobs"][0] is None and echo["top_logprobs"][0] is None
    Logprobs.model_validate({k: v[1:] for k, v in echo.items()})


def test_requested_k_fields():
    assert L.requested_k({}, chat=False) is None and L.requested_k({"logprobs": 0}, chat=False) == 0
    assert L.requested_k({"logprobs": True, "top_logprobs": 5}, chat=True) == 5
    assert L.requested_k({"logprobs": True}, chat=True) == 0 and L.requested_k({}, chat=True) is None
    for body, chat, field in [({"logprobs": 21}, False, "logprobs"), ({"logprobs": "3"}, False, "logprobs"),
                              ({"logprobs": True, "top_logprobs": 99}, True, "top_logprobs"),
                              ({"top_logprobs": 2}, True, "top_logprobs")]:
        with pytest.raises(InvalidRequest) as e:
            L.requested_k(body, chat)
        assert e.value.field == field
