"""The cloud's logprobs and penalties (cloud_worker/scoring.py) in-process: a plain session's frames are the bytes
they always were, a prompt prefilled in chunks is scored like the target's own forward, the worker refuses what
it does not serve by field name, and a cross-vocabulary session's logprobs are the target's."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from specrelay.cloud_worker.attention import Row
from specrelay.cloud_worker.config import VerifierConfig
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common import logprobs as L
from specrelay.common import protocol as P
from specrelay.common.errors import InvalidRequest
from specrelay.common.penalties import Penalties, to_wire
from specrelay.common.sampling import SamplingParams
from specrelay.edge_worker.config import SessionConfig
from specrelay.speculative import speculative_generate


def forward_logp(runner, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return runner.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len(ids), V]


def test_a_plain_sessions_frames_are_unchanged(tiny_runners):
    """OPEN and VERDICT of a session without logprobs or penalties: the same MessagePack as the fields before
    them (the new trailing fields are left off), in a real in-process run too."""
    assert P.encode(P.Open(7, [1, 2, 3]))[1] == msgspec.msgpack.encode([7, [1, 2, 3]])
    assert P.encode(P.Verdict(7, 2, 3, 4))[1] == msgspec.msgpack.encode([7, 2, 3, 4])
    target, draft = tiny_runners
    ids = target.tokenizer("def add(a, b):\n").input_ids
    seen: list[tuple[int, int]] = []

    def sizes(config: SessionConfig) -> tuple[int, int]:
        _, stats = speculative_generate(draft, target, ids, config)
        return stats["uplink_bytes"], stats["downlink_bytes"]

    plain = sizes(SessionConfig(max_new_tokens=16, draft_len=3))
    scored = sizes(SessionConfig(max_new_tokens=16, draft_len=3, logprobs=2))
    seen += [plain, scored]
    assert scored[0] == plain[0] and scored[1] > plain[1] + 16 * 4 * 5  # VERIFYs as before; chosen + 2 ids + 2 values
    verifier = Verifier(target, VerifierConfig(client_kv_share=1.0))
    verifier.open((b"", 1), P.Open(1, ids))
    verdict = verifier.verify([((b"", 1), P.Verify(1, 1, len(ids), draft=[5, 6]))])[0]
    assert verdict.logprobs is None and verdict.prompt_logprobs is None
    assert P.encode(verdict)[1] == msgspec.msgpack.encode([1, 1, verdict.n_accepted, verdict.next_token])


def test_a_prompt_prefilled_in_chunks_is_scored_as_the_targets_forward(tiny_runners):
    """echo: prefill chunks and the first VERIFY row keep every prompt position; the first VERDICT carries the
    prompt's rows, equal to the target's forward (and a replay of that VERIFY carries them again)."""
    target, _ = tiny_runners
    ids = target.tokenizer("class Point:\n    def __init__(self, x, y):\n        self.x = x\n").input_ids
    assert len(ids) > 12
    verifier = Verifier(target, VerifierConfig(client_kv_share=1.0))
    key = (b"", 1)
    verifier.open(key, P.Open(1, ids, logprobs=3, prompt_logprobs=True))
    verifier.verify([], prefill=[Row(key, ids[0:5])])
    verifier.verify([], prefill=[Row(key, ids[5:11])])
    request = P.Verify(1, 1, len(ids), draft=[ids[3]])
    verdict = verifier.verify([(key, request)])[0]
    rows = L.unpack(verdict.prompt_logprobs, len(ids) - 1)
    ref = forward_logp(target, ids)
    assert len(rows.chosen) == len(ids) - 1
    assert (rows.chosen - ref[range(len(ids) - 1), ids[1:]]).abs().max() < 1e-4
    assert (rows.top_logprobs - ref[:-1].topk(3, -1).values).abs().max() < 1e-4
    out = L.unpack(verdict.logprobs, 2)  # the committed tokens: accepted draft (if any) and the next token
    committed = [ids[3]] * verdict.n_accepted + [verdict.next_token]
    assert len(out.chosen) == len(committed) and abs(float(out.chosen[0]) - float(ref[-1, committed[0]])) < 1e-4
    assert verifier.verify([(key, request)])[0] is verdict  # the retry's answer: the same, prompt rows included


def test_the_worker_refuses_what_it_does_not_serve_by_field(tiny_runners):
    target, _ = tiny_runners
    verifier = Verifier(target, VerifierConfig(client_kv_share=1.0))
    for msg, field in [(P.Open(1, [1, 2], P.Mode.SAMPLE, 1.0, logprobs=1), "logprobs"),
                       (P.Open(1, [1, 2], prompt_logprobs=True), "prompt_logprobs"),
                       (P.Open(1, [1, 2], generated=2), "generated"),
                       (P.Open(1, [1, 2], penalties=P.PenaltiesWire(9.0, 0, 1)), "presence_penalty")]:
        with pytest.raises(InvalidRequest) as e:
            verifier.open((b"", 1), msg)
        assert e.value.field == field
    verifier.open((b"", 2), P.Open(2, [1, 2, 3], penalties=to_wire(Penalties(presence=0.5))))
    reply = verifier.verify([((b"", 2), P.Verify(2, 1, 3, draft=[4, 5], parents=[-1, -1]))])[0]
    assert isinstance(reply, P.Error) and "parents" in reply.message
    with pytest.raises(InvalidRequest) as e:
        SessionConfig(logprobs=2, trees="on")
    assert e.value.field == "trees"


def test_cross_vocabulary_logprobs_are_the_targets():
    """A draft with its own tokenizer: the logprobs are of the target's tokens (the output), from its forward;
    penalties apply on the cloud alone and greedy output equals the target penalised the same way."""
    from specrelay.edge_worker.loading import load_drafter
    from specrelay.paths import demo_model

    from conftest import demo_available

    if not demo_available() or not (Path(demo_model("demo-draft-xv")) / "config.json").exists():
        pytest.skip("demo models not trained")
    from specrelay.common.runner import ModelRunner

    drafter, tok = load_drafter(demo_model("demo-draft-xv"), demo_model("demo-target"))
    assert not drafter.penalises
    target = ModelRunner.load(str(demo_model("demo-target")))
    ids = tok("def fibonacci(n):\n").input_ids
    pen = Penalties(repetition=1.2)
    gen, stats = speculative_generate(drafter, target, ids, SessionConfig(max_new_tokens=12, draft_len=3,
                                                                          logprobs=1, penalties=pen))
    ref = forward_logp(target, ids + gen)
    rows = stats["scores"]["logprobs"]
    assert (rows.chosen - ref[range(len(ids) - 1, len(ids) - 1 + len(gen)), gen]).abs().max() < 1e-4
    alone = target.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, repetition_penalty=1.2,
                                  pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    assert gen == alone[:len(gen)] and len(gen) == len(alone)


def test_coupled_sampling_logprobs_are_the_raw_targets(tiny_runners):
    """At temperature 0.7, coupled: the logprobs are the target's raw log-softmax (before temperature)."""
    target, draft = tiny_runners
    ids = target.tokenizer("for i in range(10):\n").input_ids
    gen, stats = speculative_generate(draft, target, ids, SessionConfig(
        max_new_tokens=12, params=SamplingParams(0.7), draft_len=2, seed=3, logprobs=0))
    ref = forward_logp(target, ids + gen)
    assert (stats["scores"]["logprobs"].chosen - ref[range(len(ids) - 1, len(ids) - 1 + len(gen)), gen]).abs().max() < 1e-4


def test_deterministic_logprobs_are_bit_identical_whatever_the_draft(tiny_runners):
    """With deterministic numerics the logprobs (and the prompt's) do not depend on the rows a forward ran: draft
    lengths 0 and 4 give the same bits (fast numerics agree within float32 rounding only)."""
    target, draft = tiny_runners
    ids = target.tokenizer("def add(a, b):\n    return a + b\n").input_ids
    runs = []
    for d in (0, 4):
        verifier = Verifier(target, VerifierConfig(client_kv_share=1.0, deterministic=True))
        runs.append(speculative_generate(draft, verifier, ids, SessionConfig(
            max_new_tokens=20, draft_len=d, logprobs=3, prompt_logprobs=True)))
    (gen0, s0), (gen4, s4) = runs
    assert gen0 == gen4 and s4["draft_tokens"] > 0 == s0["draft_tokens"]  # rows of 5 positions against rows of 1
    for name in ("logprobs", "prompt_logprobs"):
        a, b = s0["scores"][name], s4["scores"][name]
        assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(a, b))
