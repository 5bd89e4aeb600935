"""Attention features of other architectures, without sockets: sliding windows (Mistral, Gemma 2/3, gpt-oss),
the attention logit softcap (Gemma 2) and sinks (gpt-oss) in the cloud's packed forward (both numerics) and the
edge's lockstep draft K/V; the start-up self-checks that catch a path that does not reproduce the model; the
fallback for models without AttentionInterface (Falcon, Bloom); bfloat16 on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specrelay.archs import ARCHS, build
from specrelay.cloud_worker import attention
from specrelay.cloud_worker.attention import Row, forward_packed, install, self_check
from specrelay.cloud_worker.kvcache import KVStore
from specrelay.cloud_worker.owncache import OwnCacheStore
from specrelay.cloud_worker.config import VerifierConfig
from specrelay.cloud_worker.verifier import Verifier
from specrelay.common.errors import FatalError
from specrelay.common.runner import KVShape, ModelRunner
from specrelay.edge_worker.draft import kv as draft_kv
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.speculative import speculative_generate

from conftest import MODELS

BY_TYPE = {a.model_type: a for a in ARCHS}
FEATURED = ("mistral", "gemma2", "gemma3_text", "gpt_oss")  # window; window + softcap; window pattern; + sinks
SMALL = dict(max_sessions=4, max_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    return {t: build(BY_TYPE[t], MODELS / "demo-target", root / t)
            for t in FEATURED + ("falcon", "bloom", "llama")}


def load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", FEATURED)
def test_packed_forward_reproduces_the_model(checkpoints, name, deterministic):
    model = load(checkpoints[name])
    assert install(model)
    # ragged forwards with a rollback, prompts longer than the window (8): raises FatalError on any mismatch
    self_check(model, KVStore(KVShape.of(model.config, model.dtype), 256, block=128 if deterministic else 32),
               deterministic)


def test_deterministic_sliding_window_is_batch_invariant(checkpoints):
    model = load(checkpoints["gpt_oss"])
    install(model)
    store = KVStore(KVShape.of(model.config, model.dtype), 1024, block=128)
    ids = list(range(40, 70))
    for key in ("alone", "crowded", "other"):
        store.reserve(key, 64)
    alone = forward_packed(model, store, [Row("alone", ids, 5)], deterministic=True)[0]
    crowded = forward_packed(model, store, [Row("other", list(range(100, 117)), 1), Row("crowded", ids, 5)],
                             deterministic=True)[1]
    assert torch.equal(alone, crowded)


def test_cloud_self_check_catches_a_feature_the_path_ignores(checkpoints, monkeypatch):
    model = load(checkpoints["gemma2"])
    install(model)
    monkeypatch.setattr(attention._Features, "of", classmethod(lambda cls, module, kwargs: cls()))
    with pytest.raises(FatalError, match=r"Gemma2ForCausalLM \(gemma2\): the cloud worker's packed forward") as err:
        self_check(model, KVStore(KVShape.of(model.config, model.dtype), 256), False)
    assert "\n" not in str(err.value)


def test_edge_draft_kv_reproduces_sliding_models_and_its_check_catches_stretched_windows(checkpoints, monkeypatch):
    for name in FEATURED:
        draft_kv.self_check(ModelRunner.load(str(checkpoints[name])))  # ragged lockstep batches with holes
    runner = ModelRunner.load(str(checkpoints["mistral"]))
    monkeypatch.setattr(draft_kv, "attention_windows", lambda config: None)  # transformers' column-based window
    with pytest.raises(FatalError, match="the edge's lockstep draft forward does not reproduce"):
        draft_kv.self_check(runner)


@pytest.mark.parametrize("name", ["falcon", "bloom"])
def test_models_without_attention_interface_use_their_own_cache(checkpoints, name):
    runner = ModelRunner.load(str(checkpoints[name]))
    verifier = Verifier(runner, VerifierConfig(**SMALL))
    assert isinstance(verifier.store, OwnCacheStore)
    ids = runner.tokenizer("def add(a, b):\n    return").input_ids
    want = runner.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=runner.tokenizer.eos_token_id)[0, len(ids):].tolist()
    draft = Drafter(ModelRunner.load(str(checkpoints["llama"])), runner.vocab_size)
    out, _ = speculative_generate(draft, verifier, ids, max_new_tokens=12, draft_len=3)
    assert out == want
    with pytest.raises(FatalError, match=r"\(%s\) does not take a custom attention function.*--deterministic" % name):
        Verifier(ModelRunner.load(str(checkpoints[name])), VerifierConfig(**SMALL, deterministic=True))


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss", "falcon"])
def test_bfloat16_greedy_equals_the_targets_own_bfloat16_output(checkpoints, name):
    target = ModelRunner.load(str(checkpoints[name]), dtype="bfloat16")
    ids = target.tokenizer("class Point:\n    def __init__(self, x, y):\n").input_ids
    want = target.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=target.tokenizer.eos_token_id)[0, len(ids):].tolist()
    draft = Drafter(ModelRunner.load(str(checkpoints["mistral"]), dtype="bfloat16"), target.vocab_size)
    out, _ = speculative_generate(draft, Verifier(target, VerifierConfig(**SMALL)), ids, max_new_tokens=16,
                                  draft_len=3)
    assert out == want


@pytest.mark.parametrize("name,extra", [("mamba", {"state_size": 8}), ("jamba", {"attn_layer_period": 2,
                                                                                  "attn_layer_offset": 1})])
def test_state_space_and_hybrid_models_are_refused_at_load_in_one_line(tmp_path, name, extra):
    from specrelay.archs import Arch

    path = build(Arch(name, extra=extra), MODELS / "demo-target", tmp_path / name)
    with pytest.raises(FatalError, match=r"\(%s\) has layers of type .*cannot be rolled back" % name) as err:
        ModelRunner.load(str(path))  # cloud worker and edge both load through here
    assert "\n" not in str(err.value)


def test_self_checks_shrink_a_real_checkpoints_long_window_so_the_probe_slides_past_it(tmp_path, monkeypatch):
    arch = BY_TYPE["gemma2"]
    path = build(type(arch)(arch.model_type, extra={**arch.extra, "sliding_window": 4096}), MODELS / "demo-target",
                 tmp_path / "gemma2-4096")
    runner = ModelRunner.load(str(path))
    install(runner.model)
    store = KVStore(runner.kv_shape, 256)
    self_check(runner.model, store, False)
    draft_kv.self_check(runner)
    assert runner.model.config.sliding_window == 4096  # restored
    monkeypatch.setattr(draft_kv, "attention_windows", lambda config: None)
    with pytest.raises(FatalError, match="does not reproduce"):
        draft_kv.self_check(runner)
    ignore_window = classmethod(lambda cls, module, kwargs: cls(softcap=kwargs.get("softcap")))
    monkeypatch.setattr(attention._Features, "of", ignore_window)
    with pytest.raises(FatalError, match="does not reproduce"):
        self_check(runner.model, KVStore(runner.kv_shape, 256), False)
