"""The acceptance rule three ways (tables, fixed seeds, convergence), the sampling transform, KV rollback."""

from __future__ import annotations

import pytest
import torch
from stats import chi2_pvalue

from specrelay.common.rng import Purpose, gumbel, sample_index, uniform, uniforms
from specrelay.common.runner import Decoder
from specrelay.common.sampling import SamplingParams, probs_from_logits
from specrelay.common import verify
from specrelay.common.protocol import Mode
from specrelay.common.verify import accept_prefix, residual
from specrelay.speculative import speculative_generate, target_generate


def one_hot_logits(ids: list[int], v: int = 6) -> torch.Tensor:  # -> [len(ids), v] with argmax = ids
    logits = torch.zeros(len(ids), v)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


@pytest.mark.parametrize("draft, target, n, nxt", [
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),   # all accepted: bonus = target's token at d+1
    ([1, 2, 3], [1, 5, 3, 4], 1, 5),   # first mismatch at 2: recovered = target argmax there
    ([1, 2, 3], [0, 2, 3, 4], 0, 0),   # rejected at once
    ([], [4], 0, 4),                   # d = 0: target-alone step
    ([2, 2], [2, 2, 2], 2, 2),
])
def test_greedy_table(draft, target, n, nxt):
    assert verify.greedy(torch.tensor(draft, dtype=torch.long), one_hot_logits(target)) == (n, nxt)


def test_greedy_ties_pick_first_index():
    logits = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]])
    assert verify.greedy(torch.tensor([2]), logits) == (0, 1)


@pytest.mark.parametrize("p, q, u, n", [
    ([0.5, 0.5], [0.5, 0.5], [0.99, 0.99], 2),  # q <= p: always accept
    ([0.2, 0.5], [0.4, 0.5], [0.49, 0.1], 2),   # accept w.p. p/q = 0.5: u = 0.49 passes
    ([0.2, 0.5], [0.4, 0.5], [0.51, 0.1], 0),   # u = 0.51 fails
    ([0.9, 0.0], [0.3, 0.2], [0.0, 0.0], 1),    # p(x) = 0 always rejects
])
def test_accept_table(p, q, u, n):
    assert accept_prefix(torch.tensor(p), torch.tensor(q), torch.tensor(u)) == n


@pytest.mark.parametrize("u, n, token", [
    ([0.1, 0.1], 2, 2),       # both accepted: the bonus is drawn from p[d] (all its mass on token 2)
    ([0.1, 0.99], 1, None),   # x_2 rejected (p/q = 0.5 < u): the edge resolves the recovered token
    ([0.99, 0.6], 1, None),   # u_2 * q = 0.3 >= p = 0.25: rejected; x_1 (q <= p) never is
])
def test_sampled_table(u, n, token):
    p = torch.tensor([[0.2, 0.8, 0.0], [0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])  # [d+1, V]
    q_draft = torch.tensor([0.2, 0.5])  # q(x_1 = 1) <= p: always accepted; q(x_2 = 2) = 2 p(x_2)
    assert verify.sampled(torch.tensor([1, 2]), p, q_draft, torch.tensor(u), 0.5) == (n, token)


def test_residual_is_normalised_positive_part():
    r = residual(torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2]))
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_counter_rng_is_pure_and_separates_purposes():
    assert uniform(7, 100, Purpose.ACCEPT) == uniform(7, 100, Purpose.ACCEPT)
    assert uniform(7, 100, Purpose.ACCEPT) != uniform(7, 100, Purpose.RESIDUAL)
    assert uniform(7, 100, Purpose.ACCEPT) != uniform(7, 101, Purpose.ACCEPT)
    assert torch.equal(gumbel(1, 2, 50), gumbel(1, 2, 50))
    u = uniforms(3, 4, Purpose.CANDIDATE, 10000)
    assert 0 < u.min() and u.max() < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_sample_index_inverse_cdf():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert sample_index(p, 0.1) == 1 and sample_index(p, 0.3) == 3 and sample_index(p, 0.999999) == 3


def test_speculative_sampling_converges_to_p():
    """One step of draft-then-verify over a 6-token vocabulary, 30k seeds: the output law is p (chi-square)."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)
    p = probs_from_logits(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3]), params)
    q = probs_from_logits(torch.tensor([0.0, 2.0, 0.5, 1.0, 0.0, -2.0]), params)
    counts = torch.zeros(6)
    for seed in range(30_000):
        x = sample_index(q, uniform(seed, 0, Purpose.DRAFT))
        if accept_prefix(p[x:x + 1], q[x:x + 1], torch.tensor([uniform(seed, 0, Purpose.ACCEPT)])):
            counts[x] += 1
        else:
            counts[sample_index(residual(p, q), uniform(seed, 0, Purpose.RESIDUAL))] += 1
    assert chi2_pvalue(counts.numpy(), p.numpy()) > 0.001


def test_gumbel_argmax_is_a_sample_of_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = torch.bincount(torch.stack([(p.log() + gumbel(s, 0, 4)).argmax() for s in range(20_000)]), minlength=4)
    assert chi2_pvalue(counts.numpy(), p.numpy()) > 0.001


def test_coupled_verify_accepts_while_noisy_argmax_agrees():
    logp = torch.log_softmax(torch.randn(3, 8, generator=torch.Generator().manual_seed(0)), -1)
    noise = torch.stack([gumbel(5, j, 8) for j in range(3)])
    target_ids = (logp.double() + noise).argmax(-1)
    assert verify.coupled(target_ids[:2], logp, noise) == (2, int(target_ids[2]))


def test_sampling_defaults_to_the_coupled_mode(tiny_runners):
    """One source of defaults: at temperature > 0 a session that names no mode is COUPLED, at 0 GREEDY."""
    from specrelay.common.protocol import DEFAULT_SAMPLED_MODE
    from specrelay.edge_worker.config import SessionConfig

    assert DEFAULT_SAMPLED_MODE == Mode.COUPLED
    assert SessionConfig(params=SamplingParams(0.7)).mode == Mode.COUPLED
    assert SessionConfig(params=SamplingParams(0.7), mode="sample").mode == Mode.SAMPLE
    assert SessionConfig().mode == Mode.GREEDY


def test_top_k_top_p_transform():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert (probs_from_logits(logits, SamplingParams(1.0, top_k=2)) > 0).tolist() == [True, True, False, False]
    pk = probs_from_logits(logits, SamplingParams(1.0, top_p=0.7))  # softmax: .64 .24 .09 .03
    assert (pk > 0).tolist() == [True, True, False, False] and abs(float(pk.sum()) - 1) < 1e-6
    assert probs_from_logits(logits, SamplingParams(0.0)).tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=0.0)


def test_kv_rollback_matches_fresh_forward(tiny_runners):
    target, _ = tiny_runners
    ids = target.tokenizer("def add(a, b):\n    return").input_ids
    dec = Decoder(target)
    dec.extend(ids)
    dec.extend([5, 6, 7])        # a draft block ...
    dec.rollback(len(ids) + 1)   # ... two of which are rejected
    rolled = dec.extend([9, 10])
    fresh = Decoder(target).extend(ids + [5, 9, 10])[-2:]
    assert torch.allclose(rolled, fresh, atol=1e-5)


def test_greedy_speculative_equals_hf_generate(tiny_runners):
    target, draft = tiny_runners
    for prompt in ["def add(a, b):\n", "class Point:\n", "for i in"]:
        ids = target.tokenizer(prompt).input_ids
        ref = target.model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
        for d in (None, 0, 1, 4):
            out, stats = speculative_generate(draft, target, ids, max_new_tokens=30, draft_len=d)
            assert out == ref, (prompt, d)
            assert stats["generated_tokens"] == len(out)


def test_coupled_equals_target_alone_coupled(tiny_runners):
    target, draft = tiny_runners
    ids = target.tokenizer("def add(a, b):\n").input_ids
    params = SamplingParams(temperature=1.0, top_p=0.9)
    for seed in range(5):
        out, _ = speculative_generate(draft, target, ids, max_new_tokens=25, params=params, mode="coupled", seed=seed)
        assert out == target_generate(target, ids, 25, params, Mode.COUPLED, seed)


@pytest.mark.parametrize("resample", ["full", "hr", "srdv"])
def test_fixed_seed_reproducible(tiny_runners, resample):
    target, draft = tiny_runners
    ids = target.tokenizer("class Point:\n").input_ids
    run = lambda seed: speculative_generate(draft, target, ids, max_new_tokens=20, params=SamplingParams(1.0),
                                            mode="sample", seed=seed, resample=resample)[0]
    assert run(11) == run(11)
    assert any(run(11) != run(s) for s in (12, 13, 14))
