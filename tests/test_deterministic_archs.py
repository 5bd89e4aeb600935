"""`--deterministic` on every architecture of specrelay/archs.py (and five more mixture-of-experts families): a
session's logits are the same, bit for bit, verified alone, in ragged batches beside other sessions, and with its
context split into other forward passes (GPT-2's Conv1D, experts, routers, activations whose CPU kernels end in
a scalar tail); the start-up self-check passes there, and catches main's numerics (gpt2, the MoE models, llama
at odd widths) in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from specrelay.archs import ARCHS, Arch, config_for
from specrelay.cloud_worker import detlayers
from specrelay.cloud_worker.attention import Row, forward_packed, install, self_check
from specrelay.common.errors import FatalError
from packed import chunked_logits, store_for

PACKED = [a for a in ARCHS if "no AttentionInterface" not in a.feature]  # the others refuse --deterministic
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MORE_MOE = [Arch("qwen2_moe", extra={**EXPERTS, "shared_expert_intermediate_size": 64}),  # sigmoid-gated shared
            Arch("olmoe", extra=EXPERTS), Arch("granitemoe", extra={"num_local_experts": 4, "num_experts_per_tok": 2}),
            Arch("phimoe", extra={"num_local_experts": 4, "num_experts_per_tok": 2}),  # an nn.Linear-subclass router
            Arch("glm4_moe", extra={"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0})]  # sigmoid scores
BY_TYPE = {a.model_type: a for a in ARCHS}
VOCAB = 300


def tiny(arch, dtype=torch.float32, odd: bool = True):
    """A random `arch` model; `odd`: feed-forward widths 8 past the tiny's (136, experts 40), so that no tensor of
    theirs is a whole number of CPU vectors and element-wise kernels end in a scalar tail (as the demo target's
    688 does). The vocabulary (300) is odd too."""
    config = config_for(arch, VOCAB, 0)
    for name in ("intermediate_size", "moe_intermediate_size", "n_inner", "ffn_dim") if odd else ():
        if getattr(config, name, None):
            setattr(config, name, getattr(config, name) + 8)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def logits_of(model, seqs: dict, key, chunks: list[int], others: list) -> torch.Tensor:
    return chunked_logits(model, seqs, key, chunks, others)


def sequences() -> dict:
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randint(5, VOCAB, (n,), generator=gen).tolist()
            for k, n in [("me", 40), ("x", 30), ("yy", 9), ("zzz", 70)]}


@pytest.mark.parametrize("odd", [False, True], ids=["tiny-widths", "odd-widths"])
@pytest.mark.parametrize("arch", PACKED + MORE_MOE, ids=[a.model_type for a in PACKED + MORE_MOE])
def test_deterministic_logits_do_not_depend_on_batch_or_chunking(arch, odd):
    model = tiny(arch, odd=odd)
    assert install(model)
    self_check(model, store_for(model, 256), True)  # the worker's start-up check passes
    seqs = sequences()
    alone = logits_of(model, seqs, "me", [40], [])
    for chunks, others in [([5], ["x", "yy", "zzz"]), ([1, 2, 3], []), ([1], ["zzz"]), ([17, 1], ["x", "yy"]),
                           ([7, 1, 13, 16], [])]:
        assert torch.equal(logits_of(model, seqs, "me", chunks, others), alone), (chunks, others)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_demo_target_is_batch_invariant(demo_runners, threads):
    """The demo target (llama, feed-forward width 688: SiLU's CPU tail), with 1 and 2 torch threads (a forward of
    90 tokens: element-wise kernels over 32768 elements split across threads)."""
    model = demo_runners[0].model
    install(model)
    gen = torch.Generator().manual_seed(4)
    seqs = {k: torch.randint(5, 8000, (n,), generator=gen).tolist() for k, n in [("me", 90), ("x", 30), ("zzz", 70)]}
    try:
        torch.set_num_threads(threads)
        alone = logits_of(model, seqs, "me", [90], [])
        # few forwards with 2 threads: on this shared 2-core machine their synchronisation is slow
        for chunks, others in [([64, 1], ["zzz"])] + [([7, 30], ["x"]), ([1, 2, 3], [])] * (threads == 1):
            assert torch.equal(logits_of(model, seqs, "me", chunks, others), alone), (chunks, others)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "gpt2"])
def test_deterministic_bfloat16_is_batch_invariant(name):
    model = tiny(BY_TYPE[name], torch.bfloat16)
    install(model)
    seqs = sequences()
    alone = logits_of(model, seqs, "me", [40], [])
    assert torch.equal(logits_of(model, seqs, "me", [1, 2, 3], ["x", "zzz"]), alone)


def test_tiled_products_do_not_depend_on_the_row_count():
    """Including a one-output gate (Qwen2-MoE's shared-expert gate), which a single tile would send to a
    matrix-vector kernel."""
    gen = torch.Generator().manual_seed(5)
    for inputs, outputs in [(64, 1), (688, 1), (64, 2), (100, 17), (256, 688), (688, 256), (64, 300)]:
        weight, bias = torch.randn(outputs, inputs, generator=gen), torch.randn(outputs, generator=gen)
        x = torch.randn(100, inputs, generator=gen)
        full = detlayers.tiled_linear(x, weight, bias)
        assert all(torch.equal(detlayers.tiled_linear(x[:n], weight, bias), full[:n]) for n in range(1, 100, 3))
        assert torch.allclose(full, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


ELEMENTWISE = list(detlayers._ELEMENTWISE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("func", ELEMENTWISE, ids=[f"{i}-{f.__name__}" for i, f in enumerate(ELEMENTWISE)])
def test_elementwise_functions_do_not_depend_on_where_the_tensor_ends(func, dtype):
    """Under the function mode each replaced function gives an element the same bits whatever the tensor's length
    (torch's own SiLU, sigmoid, GELU, ... compute a CPU scalar tail differently), within rounding of torch's."""
    x = (torch.randn(3000, 2, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)  # GLU halves the 2
    if func.__name__ == "rsqrt":
        x = x.abs() + 0.1
    with detlayers._FixedShape():
        full = func(x)
        cut = [func(x[:n]) for n in range(1, 200)] + [func(x[:n]) for n in range(2000, 3000, 97)]
    assert all(torch.equal(c, full[:len(c)]) for c in cut)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(full.float(), func(x).float(), rtol=tolerance, atol=tolerance)


def test_experts_run_the_tiled_path_and_stay_close_to_the_model(monkeypatch):
    """The fixed-shape experts are the model's experts: deterministic logits within rounding of the model's own
    forward (grouped_mm), and the tiled expert path is the one that ran."""
    model = tiny(BY_TYPE["qwen3_moe"])
    install(model)
    calls = []
    real = detlayers.experts_forward
    monkeypatch.setattr(detlayers, "experts_forward", lambda *a: calls.append(1) or real(*a))
    ids = sequences()["me"]
    store = store_for(model)
    store.reserve("me", 8)
    got = forward_packed(model, store, [Row("me", ids, len(ids))], deterministic=True)[0]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0]
    assert len(calls) == model.config.num_hidden_layers
    assert torch.allclose(got, want, atol=1e-4)


MAINS = [("llama", True)] + [(n, odd) for n in ("gpt2", "qwen3_moe", "mixtral", "gpt_oss") for odd in (False, True)]


@pytest.mark.parametrize("name,odd", MAINS, ids=[f"{n}-{'odd' if o else 'tiny'}-widths" for n, o in MAINS])
def test_self_check_catches_mains_deterministic_numerics(name, odd, monkeypatch):
    """main made only nn.Linear fixed-shape: gpt2's Conv1D, the MoE experts and routers, and (odd widths, llama
    too) the activations' scalar tails still depended on the batch. The start-up check refuses that in one line."""
    own = detlayers._deterministic_forward
    monkeypatch.setattr(detlayers, "_deterministic_forward", lambda m: own(m) if type(m) is nn.Linear else None)
    model = tiny(BY_TYPE[name], odd=odd)
    install(model)
    with pytest.raises(FatalError, match=r"\(%s\): --deterministic is not batch-invariant" % name) as err:
        self_check(model, store_for(model, 256), True)
    assert "\n" not in str(err.value)
    self_check(model, store_for(model, 256), False)  # the default numerics promise no invariance


def test_experts_outside_the_experts_interface_are_refused():
    """Weights of 3 or more dimensions in a module that is not a transformers experts class: deterministic
    numerics cannot tell how it multiplies them, so --deterministic is refused before any forward."""
    model = tiny(BY_TYPE["llama"])
    model.model.layers[0].mlp.register_parameter("stacked", nn.Parameter(torch.zeros(2, 4, 4)))
    install(model)
    with pytest.raises(FatalError, match=r"\(llama\): --deterministic cannot make LlamaMLP batch-invariant"):
        self_check(model, store_for(model, 256), True)
