"""X-CoSD exactness on a tiny synthetic pair with partly overlapping vocabularies (12 target, 10 draft tokens):
the law of the first two generated tokens over 20k seeds is the target's (chi-square, p > 0.001), for the
hr, srdv and coupled modes, through the same edge/cloud cores the distributed path runs."""

from __future__ import annotations

import pytest

from specrelay.common.runner import ModelRunner
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.loading import load_drafter
from specrelay.edge_worker.session import SessionConfig
from specrelay.speculative import speculative_generate, speculative_generate_batch, target_generate
from stats import chi2_pvalue
from synthetic import exact_two_token_law, make_synthetic_pair

SEEDS = 20_000
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    target_dir, draft_dir = make_synthetic_pair(tmp_path_factory.mktemp("synthetic"))
    target = ModelRunner.load(str(target_dir))
    drafter, target_tok = load_drafter(str(draft_dir), str(target_dir))
    prompt = target_tok("ab").input_ids
    return target, drafter, prompt


def test_synthetic_pair_overlaps_partly(synthetic):
    _, drafter, _ = synthetic
    assert (drafter.vocab.n_draft, drafter.vocab.n_target, drafter.vocab.n_shared) == (10, 12, 6)


# coupled-hr's law runs in `make test-all` only (`extended`): coupled mode is exact per seed, so the default run's
# sibling is test_coupled_cross_vocab_equals_target_alone_coupled (400 seeds equal the target alone's coupled draw,
# target-only tokens among them) with test_core.py's test_gumbel_argmax_is_a_sample_of_p (that draw's law is p).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode, resample", [("sample", "hr"), ("sample", "srdv"),
                                            pytest.param("coupled", "hr", marks=pytest.mark.extended)])
def test_first_two_tokens_follow_the_target_law(synthetic, mode, resample):
    target, drafter, prompt = synthetic
    law = exact_two_token_law(target, prompt, PARAMS)
    configs = [SessionConfig(max_new_tokens=3, params=PARAMS, mode=mode, seed=s, draft_len=2, resample=resample)
               for s in range(SEEDS)]
    results = speculative_generate_batch(drafter, target, [prompt] * SEEDS, configs)
    counts: dict[tuple[int, int], int] = {}
    for ids, _ in results:
        key = (ids[0], ids[1] if len(ids) > 1 else -1)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(law), "drew a sequence the target gives probability 0"
    outcomes = sorted(law)
    assert chi2_pvalue([counts.get(k, 0) for k in outcomes], [law[k] for k in outcomes]) > 0.001
    drafted = sum(s["draft_tokens"] for _, s in results)
    accepted = sum(s["accepted_tokens"] for _, s in results)
    assert 0 < accepted < drafted  # both branches (accept and resample) were exercised


def test_server_only_tokens_are_reachable(synthetic):
    """hr must sometimes ask the cloud for a target-only token (V_o), and srdv must accept some of them."""
    target, drafter, prompt = synthetic
    shared = drafter.shared_mask
    for resample in ("hr", "srdv"):
        configs = [SessionConfig(max_new_tokens=3, params=PARAMS, mode="sample", seed=s, draft_len=2,
                                 resample=resample) for s in range(400)]
        results = speculative_generate_batch(drafter, target, [prompt] * 400, configs)
        assert any(not shared[t] for ids, _ in results for t in ids), resample


def test_coupled_cross_vocab_equals_target_alone_coupled(synthetic):
    """Token for token the target alone's coupled draw for every seed, target-only tokens (V_o) included."""
    target, drafter, prompt = synthetic
    configs = [SessionConfig(max_new_tokens=6, params=PARAMS, mode="coupled", seed=s, draft_len=2 + s % 2,
                             resample="hr") for s in range(400)]
    results = speculative_generate_batch(drafter, target, [prompt] * 400, configs)
    for seed, (out, _) in enumerate(results):
        assert out == target_generate(target, prompt, 6, PARAMS, "coupled", seed), seed
    assert any(not drafter.shared_mask[t] for out, _ in results for t in out)  # V_o tokens were committed
    out, _ = speculative_generate(drafter, target, prompt, max_new_tokens=6, params=PARAMS, mode="coupled", seed=7,
                                  draft_len=3)  # one session alone: the same draw as in the batch
    assert out == results[7][0]


def test_greedy_cross_vocab_equals_target_greedy(synthetic):
    target, drafter, prompt = synthetic
    out, _ = speculative_generate(drafter, target, prompt, max_new_tokens=10, draft_len=3)
    assert out == target_generate(target, prompt, 10)


@pytest.mark.demo
def test_predraft_continues_a_cross_vocab_chain_as_text():
    """A chain through target tokens outside V_c ('\\n' + indentation, ' foo'): the pre-draft continues from the
    re-tokenised text (the context the session will have once the chain is committed), never from ids mapped
    token by token (-1 outside V_c: an IndexError that wiped the session's draft K/V)."""
    from specrelay.common.protocol import Mode
    from specrelay.edge_worker.draft.drafter import DraftJob
    from specrelay.paths import demo_model

    drafter, tok = load_drafter(demo_model("demo-draft-xv"), demo_model("demo-target"))
    prompt = tok("def f(x):").input_ids
    chain = tok("def f(x):\n        return foo", add_special_tokens=False).input_ids[len(prompt):]
    assert any(drafter.to_draft(t) < 0 for t in chain)  # the chain holds target-only tokens
    state = drafter.new_state(prompt)
    job = DraftJob(state, drafter.draft_context(state, prompt), len(prompt), 3, Mode.GREEDY, SamplingParams(), 0)
    drafter.draft_batch([job])
    more = drafter.continue_job(job, chain, 2)
    assert more.position == len(prompt) + len(chain) and more.unverified == tuple(chain)
    block = drafter.draft_batch([more])[0]
    assert len(block.ids) == 2 and len(state.ids) > len(job.context)  # drafted, the K/V kept
    assert drafter.draft_context(state, prompt + chain) == more.context  # what the session will draft after
    assert drafter.continue_job(job, chain, 2) is not None  # the reuse check still gets the committed context


def test_a_cross_vocabulary_block_times_its_prefixes_and_a_short_one_the_tokens_asked(tiny_runners, monkeypatch):
    """A cross-vocabulary block's draft forwards teach the policy's forwards line at every count of target tokens
    its text reached (the forwards until then) and last at the tokens asked for plus the one drafted past them. A
    draft whose text forms fewer (a run of whitespace, a character cut short) stops at 3d + 3 forwards and hands
    over a short block: it is timed at the tokens asked. Timed by the final point alone, blocks of 8-16 tokens
    left the line's intercept to noise (6-10 forwards where a short block takes 2-3: every session of the edge then
    priced d = 1 above d = 0 and stopped drafting), and a block that formed nothing sat at x = 1."""
    from specrelay.common import protocol as P
    from specrelay.edge_worker.policy import EdgeEstimates
    from specrelay.edge_worker.session import EdgeSession
    from specrelay.edge_worker.xvocab.drafter import CrossVocabDrafter
    from specrelay.speculative import next_request

    target, draft = tiny_runners
    drafter, est, seen = CrossVocabDrafter(draft, target.tokenizer), EdgeEstimates(), []
    monkeypatch.setattr(est, "observe_block_steps", lambda points, timed=True: seen.append((points, timed)))
    text = {"ids": lambda drafted: [256 + t % 40 for t in drafted]}  # a target token per draft token (the random
    monkeypatch.setattr(drafter, "_retokenized", lambda drafted: text["ids"](drafted))  # draft's bytes are no text)
    session = EdgeSession(target.tokenizer("def add(a, b):").input_ids, SessionConfig(max_new_tokens=16, draft_len=3),
                          drafter, estimates=est)
    rounds = []
    for ids in (text["ids"], lambda drafted: [256] * max(0, len(drafted) - 2), lambda drafted: []):
        text["ids"] = ids  # the opening; then the first token forms at the third draft token; then none forms
        request = next_request(session)
        session.apply(P.Verdict(session.sid, request.seq, len(request.draft), 7))
        rounds.append(len(request.draft))
    assert rounds == [3, 3, 0] and [timed for _, timed in seen] == [False, True, True]
    points, steps = seen[1][0], seen[1][0][-1][1]
    assert [x for x, _ in points] == [1, 2, 3, 4] and [steps - y for _, y in points] == [3, 2, 1, 0]
    assert seen[2][0] == [(4, 12)]  # 3 x 3 + 3 forwards, for the 3 tokens asked and the one past them
