"""Penalties and logit_bias: HF's repetition rule, OpenAI's presence/frequency formula, and speculative exactness."""

import pytest
import torch
from transformers import LogitsProcessor, RepetitionPenaltyLogitsProcessor

from specrelay.common.errors import InvalidRequest
import msgspec

from specrelay.common.penalties import Penalties, PenaltiesWire, apply, from_wire, penalised_rows, to_wire
from specrelay.constrained_ref import ConstraintLogitsProcessor, speculative


def openai_formula(logits, generated, presence, frequency):
    """OpenAI's documented rule, written out per token: mu[j] -= c[j] * alpha_freq + (c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for j in set(generated):
        c = generated.count(j)
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


class OpenAIPenalty(LogitsProcessor):
    """The hand-written formula as an HF processor, counting the tokens generated after the prompt."""

    def __init__(self, prompt_len, presence, frequency):
        self.n, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        return openai_formula(scores[0], input_ids[0, self.n:].tolist(), self.presence, self.frequency)[None]


def test_repetition_equals_hf_processor():
    torch.manual_seed(0)
    logits = torch.randn(64) * 3
    prompt, generated = [1, 5, 5, 9], [9, 12, 1, 40]
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + generated]), logits[None].clone())[0]
    assert torch.allclose(apply(logits, Penalties(repetition=1.7), prompt, generated), ref)
    ref = RepetitionPenaltyLogitsProcessor(0.6)(torch.tensor([prompt + generated]), logits[None].clone())[0]
    assert torch.allclose(apply(logits, Penalties(repetition=0.6), prompt, generated), ref)


def test_presence_frequency_and_bias_equal_the_formula():
    torch.manual_seed(1)
    logits = torch.randn(64)
    prompt, generated = [3, 3, 4], [7, 7, 7, 3, 10]  # the prompt's tokens count for repetition only
    got = apply(logits, Penalties(presence=0.5, frequency=0.3), prompt, generated)
    assert torch.allclose(got, openai_formula(logits, generated, 0.5, 0.3))
    assert got[4] == logits[4] and torch.isclose(got[7], logits[7] - 3 * 0.3 - 0.5)
    pen = Penalties(logit_bias=((2, 100.0), (5, -100.0)))
    biased = apply(logits, pen, prompt, generated)
    assert int(biased.argmax()) == 2 and biased[5] == logits[5] - 100
    both = apply(logits, Penalties(repetition=1.5, presence=0.2, frequency=0.1, logit_bias=((7, 2.0),)), prompt,
                 generated)
    step = logits.clone()
    step[7] += 2.0
    step = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + generated]), step[None])[0]
    assert torch.allclose(both, openai_formula(step, generated, 0.2, 0.1))  # bias, repetition, then OpenAI's
    assert torch.equal(apply(logits, Penalties(), prompt, generated), logits)


def test_rows_use_the_counts_before_each_position():
    torch.manual_seed(2)
    logits = torch.randn(32).expand(4, 32)  # one row repeated: only the counts differ between positions
    pen = Penalties(presence=0.4, frequency=0.6, repetition=1.2)
    prompt, generated, drafted = [1, 2], [3], [3, 4, 3]
    rows = penalised_rows(logits, pen, prompt, generated, drafted)
    for i in range(4):
        assert torch.equal(rows[i], apply(logits[i], pen, prompt, generated + drafted[:i]))
    assert rows[3, 3] < rows[2, 3] == rows[1, 3] < rows[0, 3]  # 3 is seen 1, 2, 2, 3 times before the rows


def test_request_fields():
    pen = Penalties.from_request({"presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                                  "logit_bias": {"7": 5, "2": -3.5}}, vocab_size=10)
    assert pen == Penalties(1.0, -0.5, 1.1, ((2, -3.5), (7, 5.0))) and pen.active
    assert not Penalties.from_request({}, vocab_size=10).active
    held = Penalties.from_request({"min_tokens": 4, "stop_token_ids": [5, 2]}, vocab_size=10, eos=0)
    assert held.stop_ids == (0, 2, 5) and held.active
    assert not Penalties.from_request({"stop_token_ids": [5]}, vocab_size=10, eos=0).active  # stops: the edge's job
    for body, field in [({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"10": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
                        ({"logit_bias": [1]}, "logit_bias"), ({"min_tokens": 1.5}, "min_tokens"),
                        ({"stop_token_ids": [10]}, "stop_token_ids"), ({"min_tokens": -2}, "min_tokens")]:
        with pytest.raises(InvalidRequest) as e:
            Penalties.from_request(body, vocab_size=10)
        assert e.value.field == field


@pytest.mark.parametrize("grammar", [False, True])
def test_penalised_speculative_equals_hf_generate(tiny_runners, grammar):
    """Greedy speculative decoding with penalties on both sides equals HF generate with the same processors
    (sequence_bias, repetition_penalty, the OpenAI formula; and a regex grammar after them)."""
    pytest.importorskip("llguidance") if grammar else None
    target, draft = tiny_runners
    tok = target.tokenizer
    ids, n = tok("def add(a, b):\n").input_ids, 30
    pen = Penalties(presence=0.6, frequency=0.4, repetition=1.3, logit_bias=((tok("self").input_ids[0], 1.5),))
    procs = [OpenAIPenalty(len(ids), pen.presence, pen.frequency)]
    make = None
    if grammar:
        from specrelay.common.constraint import Constraint, ConstraintSpec, TokenVocab

        vocab = TokenVocab(tok, target.model.config.vocab_size)
        spec = ConstraintSpec("regex", r"[a-z_ ().:+,\n]{1,80}")
        make = lambda: Constraint(vocab, spec)  # noqa: E731
        procs.append(ConstraintLogitsProcessor(make(), len(ids)))
    ref = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, repetition_penalty=1.3,
                                sequence_bias={(pen.logit_bias[0][0],): 1.5}, logits_processor=procs,
                                pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    plain = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    assert ref != plain  # the penalties change the output, so equality below says they were applied
    for k in (1, 4):
        assert speculative(target.model, draft.model, ids, make, n, k=k, eos=tok.eos_token_id, pen=pen) == ref


def test_wire_form_round_trips_and_is_checked_again():
    pen = Penalties(0.5, 0.25, 1.25, ((3, -2.5), (9, 100.0)), min_tokens=3, stop_ids=(0, 7))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(pen)), type=PenaltiesWire)
    assert from_wire(wire, vocab_size=10) == pen and to_wire(Penalties()) is None
    for bad, vocab, field in [(PenaltiesWire(3.0, 0, 1), 10, "presence_penalty"),
                              (PenaltiesWire(0, 0, -1), 10, "repetition_penalty"),
                              (PenaltiesWire(0, 0, 1, wire.bias_ids, wire.bias_values[:4]), 10, "logit_bias"),
                              (PenaltiesWire(0, 0, 1, wire.bias_ids, wire.bias_values), 5, "logit_bias"),
                              (PenaltiesWire(0, 0, 1, min_tokens=-1), 10, "min_tokens"),
                              (PenaltiesWire(0, 0, 1, stop_ids=b"\x0b\0\0\0"), 10, "stop_token_ids")]:
        with pytest.raises(InvalidRequest) as e:
            from_wire(bad, vocab_size=vocab)
        assert e.value.field == field


def test_min_tokens_equals_hf_min_new_tokens(tiny_runners):
    """EOS pushed up by a bias: HF's min_new_tokens holds it back exactly as min_tokens does, per position."""
    target, draft = tiny_runners
    tok, eos = target.tokenizer, target.tokenizer.eos_token_id
    ids = tok("for i in").input_ids
    pen = Penalties(logit_bias=((eos, 8.0),), min_tokens=5, stop_ids=(eos,))
    ref = target.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, min_new_tokens=5,
                                sequence_bias={(eos,): 8.0}, pad_token_id=eos)[0, len(ids):].tolist()
    assert len(ref) == 6 and ref[-1] == eos  # the bias wins as soon as min_tokens lets it
    for k in (1, 4):
        assert speculative(target.model, draft.model, ids, None, 20, k=k, eos=eos, pen=pen) == ref
