"""Structured outputs through the real edge session, drafter and cloud Verifier (in-process, no sockets):
greedy output equals HF `generate` with the grammar as a logits processor; sampled output has the masked target's
law (chi-square); the worker refuses a bad spec or a history the grammar refuses in one line naming the field.
"""

import json
from collections import Counter

import pytest
import torch

pytest.importorskip("llguidance")

from specrelay.cloud_worker.config import VerifierConfig  # noqa: E402
from specrelay.cloud_worker.verifier import Verifier  # noqa: E402
from specrelay.common import protocol as P  # noqa: E402
from specrelay.common.constraint import ConstraintSpec, spec_from_request, tool_call_spec  # noqa: E402
from specrelay.common.errors import InvalidRequest  # noqa: E402
from specrelay.common.sampling import SamplingParams  # noqa: E402
from specrelay.edge_worker.config import SessionConfig  # noqa: E402
from specrelay.speculative import speculative_generate, speculative_generate_batch  # noqa: E402
from stats import chi2_pvalue  # noqa: E402
from test_constraint import LAW_CHOICES, SPECS, _exact_law, _hf, _vocab  # noqa: E402

TOOL = tool_call_spec([("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                "required": ["a", "b"], "additionalProperties": False}),
                       ("echo", None)])


@pytest.fixture(scope="module")
def verifier(tiny_runners):
    return Verifier(tiny_runners[0], VerifierConfig(max_sessions=1024, client_kv_share=1.0))


def test_greedy_through_session_and_verifier_equals_hf_generate(tiny_runners, verifier):
    target, draft = tiny_runners
    vocab, ids, n = _vocab(target), target.tokenizer("def add(a, b):\n").input_ids, 24
    specs = {name: spec_from_request(body) for name, body in SPECS.items()} | {"tool": TOOL}
    for name, spec in specs.items():
        ref = _hf(target, vocab, spec, ids, n)
        for d in (1, 4, None):  # None: the draft policy's own choice
            out, stats = speculative_generate(draft, verifier, ids, max_new_tokens=n, draft_len=d, constraint=spec)
            assert out == ref, (name, d, target.tokenizer.decode(out), target.tokenizer.decode(ref))
            assert stats["draft_tokens"] > 0 or d is None
        if name == "tool" and ref[-1] == target.tokenizer.eos_token_id:
            call = json.loads(target.tokenizer.decode(ref[:-1]))
            assert call["name"] in ("add", "echo") and isinstance(call["arguments"], dict)


@pytest.mark.parametrize("mode", ["sample", "coupled"])
def test_sampled_through_session_and_verifier_is_exact_in_law(tiny_runners, verifier, mode):
    """600 sessions (seeds) of a choice list, batched as an edge and a worker batch them, against the target's
    exact masked law (every token path enumerated); the draft's masked law differs from it."""
    target, draft = tiny_runners
    tok, vocab, params = target.tokenizer, _vocab(target), SamplingParams(temperature=1.0)
    prompt = tok("def ").input_ids
    law = _exact_law(target.model, tok, prompt, vocab, params)
    q_law = _exact_law(draft.model, tok, prompt, vocab, params)
    assert sum(abs(law[c] - q_law[c]) for c in LAW_CHOICES) > 0.2
    spec = ConstraintSpec("choice", json.dumps(LAW_CHOICES))
    draws: Counter = Counter()
    for start in range(0, 600, 200):
        configs = [SessionConfig(max_new_tokens=12, params=params, mode=mode, seed=seed, draft_len=3,
                                 constraint=spec)
                   for seed in range(start, start + 200)]
        for out, _ in speculative_generate_batch(draft, verifier, [prompt] * len(configs), configs):
            assert out[-1] == tok.eos_token_id
            draws[tok.decode(out[:-1])] += 1
    assert set(draws) <= set(LAW_CHOICES)
    assert chi2_pvalue([draws[c] for c in LAW_CHOICES], [law[c] for c in LAW_CHOICES]) > 0.001


def test_the_worker_refuses_bad_specs_and_histories_by_field(tiny_runners, verifier):
    tok = tiny_runners[0].tokenizer
    ids = tok("def ").input_ids
    bad = [(ConstraintSpec("regex", "(a"), 0, "regex"), (ConstraintSpec("xml", "<a/>"), 0, "constraint"),
           (ConstraintSpec("choice", json.dumps(["yes"])), 1, "generated")]
    for spec, generated, field in bad:  # the last: the prompt's final token, as generated, is not a choice
        with pytest.raises(InvalidRequest) as e:
            verifier.open((b"bad", 1), P.Open(1, ids, constraint=spec, generated=generated))
        assert e.value.field == field and "\n" not in str(e.value)
    assert (b"bad", 1) not in verifier.sessions
    # a VERIFY whose tail the grammar refuses: refused, and the session's grammar is unchanged
    spec = ConstraintSpec("choice", json.dumps(["yes", "no"]))
    verifier.open((b"bad", 2), P.Open(2, ids, constraint=spec))
    [reply] = verifier.verify([((b"bad", 2), P.Verify(2, 1, len(ids) + 1, tail=tok("zz").input_ids[:1]))])
    assert isinstance(reply, P.Error) and reply.code == P.ErrorCode.BAD_REQUEST and "tail" in reply.message
    assert verifier.sessions[(b"bad", 2)].grammar.consumed == []
    verifier.close((b"bad", 2))


def test_a_token_tree_is_verified_under_the_grammar(tiny_runners, verifier):
    """A greedy tree VERIFY: its branch along the target's constrained greedy path is accepted, a branch the
    grammar refuses never is (even where the unmasked target would pick it), and the grammar's state after the
    tree is right for the next chain."""
    target = tiny_runners[0]
    tok, vocab = target.tokenizer, _vocab(target)
    spec = spec_from_request(SPECS["choice"])
    ids = tok("for i in").input_ids
    ref = _hf(target, vocab, spec, ids, 16)
    assert len(ref) >= 6
    refused = int(target.model(torch.tensor([ids])).logits[0, -1].argmax())  # the unmasked pick: refused here
    assert refused != ref[0]
    key = (b"tree", 7)
    verifier.open(key, P.Open(7, ids, constraint=spec))
    tree = P.Verify(7, 1, len(ids), draft=[refused, ref[0], ref[1], refused], parents=[-1, -1, 1, 1])
    [v] = verifier.verify([(key, tree)])
    assert (v.n_accepted, v.next_token, v.node) == (2, ref[2], 2)
    [v] = verifier.verify([(key, P.Verify(7, 2, len(ids) + 3, draft=ref[3:5]))])
    assert (v.n_accepted, v.next_token) == (2, ref[5])
    verifier.close(key)


def test_a_worker_without_the_grammar_engine_refuses_in_one_line(tiny_runners, monkeypatch):
    import sys

    from specrelay.common.constraint import TokenVocab

    monkeypatch.setitem(sys.modules, "llguidance.hf", None)  # what an install without the extra sees
    with pytest.raises(InvalidRequest) as e:
        TokenVocab(tiny_runners[0].tokenizer)
    assert "pip install 'specrelay[structured]'" in str(e.value)


def test_a_cross_vocabulary_edge_drafts_nothing_and_stays_exact(tiny_pair, tiny_runners, verifier, tmp_path):
    """A draft with its own tokenizer: under a constraint the session runs at d = 0 (the worker's mask alone
    constrains), and greedy output still equals HF generate under the grammar."""
    from specrelay.edge_worker.loading import load_drafter
    from tiny import make_model, make_tokenizer

    target_dir, _ = tiny_pair
    draft_dir = make_model(tmp_path / "xv", make_tokenizer(tmp_path / "xv-tok", vocab_size=200), seed=3)
    drafter, _ = load_drafter(str(draft_dir), str(target_dir))
    assert not drafter.masks_grammar
    target = tiny_runners[0]
    ids = target.tokenizer("def add(a, b):\n").input_ids
    for name in ("json_schema", "choice"):
        spec = spec_from_request(SPECS[name])
        out, stats = speculative_generate(drafter, verifier, ids, max_new_tokens=16, constraint=spec)
        assert out == _hf(target, _vocab(target), spec, ids, 16), name
        assert stats["draft_tokens"] == 0 and stats["cloud_calls"] == len(out)


def test_sync_follows_a_random_walk_of_drafts_and_rejections(tiny_runners):
    """Constraint.sync (the edge's drafts): after any sequence of extensions and cut-backs the state equals a
    fresh constraint advanced over the same tokens."""
    import random

    from specrelay.common.constraint import Constraint

    tok, vocab = tiny_runners[0].tokenizer, _vocab(tiny_runners[0])
    spec = ConstraintSpec("regex", "[a-z ]{0,200}")
    alphabet = set("abcdefghijklmnopqrstuvwxyz ")
    letters = [t for t in range(len(tok)) if tok.decode([t]) and set(tok.decode([t])) <= alphabet]
    cons, seq, rng = Constraint(vocab, spec), [], random.Random(0)
    for _ in range(200):
        cut = rng.randint(max(0, len(seq) - 2), len(seq))
        new = seq[:cut] + [rng.choice(letters) for _ in range(rng.randint(0, 4))]
        if len(tok.decode(new)) > 200:
            continue
        assert cons.sync(new) and cons.consumed == new
        seq = new
    fresh = Constraint(vocab, spec)
    assert fresh.advance(seq) == len(seq) > 20 and torch.equal(fresh.allowed(), cons.allowed())
    assert not cons.sync(seq + tok("A1", add_special_tokens=False).input_ids) and cons.consumed == seq


def test_a_reopen_resumes_the_grammar_over_the_history(tiny_runners, verifier):
    """A re-OPEN (a lost worker, UNKNOWN_SESSION) carries prompt + committed tokens and how many are generated: the
    worker's grammar resumes after the history, so the next VERIFY is masked as if nothing had happened."""
    target = tiny_runners[0]
    tok, vocab = target.tokenizer, _vocab(target)
    spec = spec_from_request(SPECS["json_schema"])
    ids = tok("def add(a, b):\n").input_ids
    ref = _hf(target, vocab, spec, ids, 12)
    key = (b"reopen", 5)
    verifier.open(key, P.Open(5, ids + ref[:4], constraint=spec, generated=4))
    [v] = verifier.verify([(key, P.Verify(5, 1, len(ids) + 4, draft=ref[4:6]))])
    assert (v.n_accepted, v.next_token) == (2, ref[6])
    verifier.close(key)
