"""Structured outputs: the grammar constraint, and constrained speculative decoding equal to the target alone.

Greedy: `specrelay.constrained_ref.speculative` (masks on both sides, rollback at rejections) equals HF `generate`
with `ConstraintLogitsProcessor`, token for token. Sampling: its output law on a choice list equals the target's
masked law, computed exactly by walking every token path the grammar allows (chi-square).
"""

import json
from collections import Counter

import pytest
import torch

pytest.importorskip("llguidance")

from specrelay.common.constraint import Constraint, ConstraintSpec, TokenVocab, mask_logits, spec_from_request  # noqa: E402
from specrelay.common.errors import InvalidRequest  # noqa: E402
from specrelay.common.sampling import SamplingParams, probs_from_logits  # noqa: E402
from specrelay.constrained_ref import ConstraintLogitsProcessor, speculative  # noqa: E402
from stats import chi2_pvalue  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}}, "required": ["name", "n"],
          "additionalProperties": False}
SPECS = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    "regex": {"guided_regex": r"(def|class) [a-z_]{1,12}\((a|b|x)?\):"},
    "choice": {"guided_choice": ["return a + b", "print(i)", "self.x = x"]},
}
CHOICES = ["yes", "no", "maybe", "ok"]
LAW_CHOICES = ["add", "print", "self", "range"]  # several token paths each; a law near 0.1 / 0.37 / 0.1 / 0.45


def _vocab(runner):
    return TokenVocab(runner.tokenizer, runner.model.config.vocab_size)


def _hf(runner, vocab, spec, ids, n):
    cons = Constraint(vocab, spec)
    out = runner.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                logits_processor=[ConstraintLogitsProcessor(cons, len(ids))],
                                pad_token_id=runner.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist()


def _check_greedy(target, draft, prompt, n):
    vocab, eos = _vocab(target), target.tokenizer.eos_token_id
    ids = target.tokenizer(prompt).input_ids
    for name, body in SPECS.items():
        spec = spec_from_request(body)
        ref = _hf(target, vocab, spec, ids, n)
        for k in (1, 4):
            out = speculative(target.model, draft.model, ids, lambda: Constraint(vocab, spec), n, k=k, eos=eos)
            assert out == ref, (name, k, target.tokenizer.decode(out), target.tokenizer.decode(ref))
        text = target.tokenizer.decode(ref[:-1] if ref and ref[-1] == eos else ref)
        if name == "choice" and ref[-1] == eos:
            assert text in body["guided_choice"]
        if name == "json_schema" and ref[-1] == eos:
            assert set(json.loads(text)) == {"name", "n"}


def test_greedy_constrained_speculative_equals_hf_generate_tiny(tiny_runners):
    target, draft = tiny_runners
    _check_greedy(target, draft, "def add(a, b):\n", 24)


@pytest.mark.demo
def test_greedy_constrained_speculative_equals_hf_generate_demo(demo_runners):
    target, draft = demo_runners
    _check_greedy(target, draft, "def add(a, b):\n    ", 32)


def test_logits_processor_masks_to_the_grammar(tiny_runners):
    """The constraint actually bites: unconstrained greedy is not a choice, constrained greedy is one."""
    target = tiny_runners[0]
    vocab, tok = _vocab(target), target.tokenizer
    ids = tok("for i in").input_ids
    free = target.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    out = _hf(target, vocab, ConstraintSpec("choice", json.dumps(CHOICES)), ids, 8)
    assert out[-1] == tok.eos_token_id and tok.decode(out[:-1]) in CHOICES
    assert tok.decode(free) not in CHOICES


def test_advance_rollback_and_masks_along(tiny_runners):
    target = tiny_runners[0]
    vocab, tok = _vocab(target), target.tokenizer
    cons = Constraint(vocab, ConstraintSpec("choice", json.dumps(CHOICES)))
    start = cons.allowed().clone()
    assert not start[tok.eos_token_id]
    yes = tok("yes", add_special_tokens=False).input_ids
    bad = tok("zzz", add_special_tokens=False).input_ids
    assert cons.advance(bad) == 0 and torch.equal(cons.allowed(), start)
    rows, m = cons.masks_along(yes + [tok.eos_token_id] + bad)
    assert m == len(yes) + 1 and cons.is_terminated() and rows.shape == (m + 1, vocab.vocab_size)
    assert torch.equal(rows[0], start) and rows[len(yes)].sum() == 1 and rows[len(yes), tok.eos_token_id]
    cons.rollback(m)
    assert not cons.is_terminated() and torch.equal(cons.allowed(), start)
    assert cons.advance(yes[:1] + bad) == 1  # stops at the first refused token
    cons.rollback(1)
    assert torch.equal(cons.allowed(), start)


def test_request_fields_give_one_line_errors():
    assert spec_from_request({}) is None and spec_from_request({"response_format": {"type": "text"}}) is None
    assert spec_from_request({"structured_outputs": {"regex": "a+"}}) == ConstraintSpec("regex", "a+")
    assert spec_from_request({"guided_json": '{"type": "integer"}'}).kind == "json_schema"
    assert spec_from_request({"structured_outputs": {"json_object": True}}).kind == "json_object"
    for body, field in [({"response_format": {"type": "yaml"}}, "response_format.type"),
                        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                        ({"guided_choice": []}, "guided_choice"), ({"guided_json": "{"}, "guided_json"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml"),
                        ({"guided_grammar": "x" * 70_000}, "guided_grammar")]:
        with pytest.raises(InvalidRequest) as e:
            spec_from_request(body)
        assert e.value.field == field and "\n" not in str(e.value)


def test_bad_grammar_is_a_request_error(tiny_runners):
    vocab = _vocab(tiny_runners[0])
    for spec in (ConstraintSpec("regex", "(a"), ConstraintSpec("grammar", "start: undefined_rule")):
        with pytest.raises(InvalidRequest):
            Constraint(vocab, spec)


def _exact_law(model, tok, prompt, vocab, params):
    """Every string the choice grammar allows -> its probability under the masked model (all token paths)."""
    law: Counter = Counter()
    cons = Constraint(vocab, ConstraintSpec("choice", json.dumps(LAW_CHOICES)))

    def walk(path, prob):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + path])).logits[0, -1]
        p = probs_from_logits(mask_logits(logits, cons.allowed()), params)
        for t in p.nonzero()[:, 0].tolist():
            if t == tok.eos_token_id:
                law[tok.decode(path)] += prob * float(p[t])
                continue
            assert cons.advance([t]) == 1
            walk(path + [t], prob * float(p[t]))
            cons.rollback(1)

    walk([], 1.0)
    return law


def test_sampled_constrained_speculative_is_exact_in_law(tiny_runners):
    """800 seeds of the speculative sampler (draft k = 3, rejections and rollbacks on most runs) against the
    target's exact masked law; the draft's own masked law is far from it, so drawing from q would fail."""
    target, draft = tiny_runners
    tok, eos = target.tokenizer, target.tokenizer.eos_token_id
    vocab, params, prompt = _vocab(target), SamplingParams(temperature=1.0), tok("def ").input_ids
    law = _exact_law(target.model, tok, prompt, vocab, params)
    q_law = _exact_law(draft.model, tok, prompt, vocab, params)
    assert abs(sum(law.values()) - 1) < 1e-4 and set(law) == set(LAW_CHOICES)
    assert sum(abs(law[c] - q_law[c]) for c in LAW_CHOICES) > 0.2
    spec = ConstraintSpec("choice", json.dumps(LAW_CHOICES))
    draws = Counter()
    for seed in range(800):
        out = speculative(target.model, draft.model, prompt, lambda: Constraint(vocab, spec), 12, k=3,
                          params=params, seed=seed, eos=eos)
        assert out[-1] == eos
        draws[tok.decode(out[:-1])] += 1
    assert set(draws) <= set(LAW_CHOICES)
    assert chi2_pvalue([draws[c] for c in LAW_CHOICES], [law[c] for c in LAW_CHOICES]) > 0.001


def test_tree_masks_equal_each_paths_chain_masks(tiny_runners):
    """A token tree's rows: every node's row equals the chain mask along its path; refused nodes are marked and
    the state comes back to the root."""
    target = tiny_runners[0]
    vocab, tok = _vocab(target), target.tokenizer
    cons = Constraint(vocab, ConstraintSpec("choice", json.dumps(CHOICES)))
    start = cons.allowed().clone()
    one = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
    y, n, z = one("y")[0], one("n")[0], one("z")[0]
    rest_yes, rest_no = one("es"), one("o")
    tokens = [y, n, z, *rest_yes, tok.eos_token_id, *rest_no, z]
    a = 3 + len(rest_yes)  # index of the EOS after "yes"
    parents = [-1, -1, -1] + [0] + list(range(3, 3 + len(rest_yes) - 1)) + [a - 1, 1] + list(
        range(a + 1, a + len(rest_no))) + [2]
    assert len(parents) == len(tokens)
    rows, ok = cons.masks_tree(tokens, parents)
    assert rows.shape == (len(tokens) + 1, vocab.vocab_size) and torch.equal(cons.allowed(), start)
    assert ok[0] and ok[1] and not ok[2] and not ok[-1] and ok[a]
    for leaf in (a, a + len(rest_no)):
        path, u = [], leaf
        while u >= 0:
            path.append(u)
            u = parents[u]
        path.reverse()
        chain, m = cons.masks_along([tokens[u] for u in path])
        cons.rollback(m)
        assert m == len(path)
        assert torch.equal(rows[0], chain[0])
        for i, u in enumerate(path[:-1] if tokens[leaf] == tok.eos_token_id else path):
            assert torch.equal(rows[u + 1], chain[i + 1]), (leaf, u)


@pytest.mark.demo
def test_the_same_spec_constrains_a_draft_vocabulary(demo_runners):
    """Across vocabularies the edge compiles the same spec against its draft tokenizer (grammars are over bytes):
    whatever it drafts under its mask, re-tokenized by the target, the target's constraint accepts whole."""
    from transformers import AutoTokenizer

    from specrelay.paths import demo_model

    target_tok = demo_runners[0].tokenizer
    draft_tok = AutoTokenizer.from_pretrained(demo_model("demo-draft-xv"))
    assert len(draft_tok) != len(target_tok)
    spec = spec_from_request(SPECS["json_schema"])
    draft_vocab = TokenVocab(draft_tok)
    target_cons = Constraint(TokenVocab(target_tok, demo_runners[0].model.config.vocab_size), spec)
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        cons, out = Constraint(draft_vocab, spec), []
        while not cons.is_terminated() and len(out) < 60:
            allowed = cons.allowed().nonzero()[:, 0]
            out.append(int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))
            assert cons.advance(out[-1:]) == 1
        text = draft_tok.decode(out[:-1] if cons.is_terminated() else out)
        ids = target_tok(text, add_special_tokens=False).input_ids
        assert target_cons.advance(ids) == len(ids), (trial, text)
        target_cons.rollback(len(ids))
