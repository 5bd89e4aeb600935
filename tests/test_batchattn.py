"""The batched attention path (cloud_worker/batchattn.py), on the CPU: one attention call per layer for the whole
step; its logits are the per-session path's on ragged rows with rollbacks and token trees; greedy output through
it equals HF `generate` on every architecture the KV store serves, with chains and with trees, and at bfloat16;
the path choice and the refusal of --deterministic off the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from trees import Oracle, hf_greedy

from specrelay.archs import ARCHS, build
from specrelay.bench.gpucheck import decisive
from specrelay.cloud_worker import kvcache
from specrelay.cloud_worker.attention import Row, forward_packed, install
from specrelay.cloud_worker.config import VerifierConfig
from specrelay.cloud_worker.kvcache import KVShape, KVStore
from specrelay.cloud_worker.verifier import Verifier, check_deterministic_device, use_batched
from specrelay.common.errors import FatalError
from specrelay.common.runner import ModelRunner
from specrelay.edge_worker.draft.drafter import Drafter
from specrelay.speculative import speculative_generate_batch
from specrelay.edge_worker.config import SessionConfig
from specrelay.treeref import TreeShape, tree_generate

from conftest import MODELS

SERVED = [a for a in ARCHS if a.model_type not in ("falcon", "bloom")]  # no AttentionInterface: own cache
BATCHED = dict(max_sessions=8, max_cache_bytes=1 << 22, attention="batched")
PROMPTS = ["class Point:\n    def __init__(self, x, y):\n", "def add(a, b):\n", "for i in range(10):"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("batched-archs")
    return {a.model_type: build(a, MODELS / "demo-target", root / a.model_type) for a in SERVED}


@pytest.fixture(scope="module")
def llama(checkpoints):
    return ModelRunner.load(str(checkpoints["llama"]))


def ragged_steps(model, batched: bool, counter: list | None = None) -> list[torch.Tensor]:
    """Three forwards of four sessions with ragged rows, a rollback and a token tree beside chains."""
    store = KVStore(KVShape.of(model.config, model.dtype), 2048)
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 1000, (n,), generator=gen).tolist()  # noqa: E731
    for key in range(4):
        store.reserve(key, 64)
    steps = [[Row(k, ids(n), 3) for k, n in enumerate((5, 40, 1, 17))],
             [Row(0, ids(3), 3), Row(1, ids(1), 1), Row(2, ids(6), 6, [-1, -1, 0, 1, 2]), Row(3, ids(9), 2)]]
    out = []
    for i, rows in enumerate(steps + [[Row(k, ids(2), 2) for k in (3, 2, 0)]]):
        out += forward_packed(model, store, rows, batched=batched)
        if i == 1:
            store.truncate(0, 4)        # a rollback (session 0 holds 8 positions: keep 4)
            store.keep(2, 2, [0, 2])    # the tree's accepted path: nodes 0 and 2 after the committed token
    return out


def test_one_attention_call_per_layer_for_the_whole_step(demo_runners, monkeypatch):
    model = demo_runners[0].model
    install(model)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    layers, rows = model.config.num_hidden_layers, 4
    batched = ragged_steps(model, True)
    assert len(calls) == 3 * layers          # three forwards, four sessions each but one call per layer
    calls.clear()
    reference = ragged_steps(model, False)
    assert len(calls) >= 2 * layers * rows  # the per-session path: one per session per layer
    assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(batched, reference))


@pytest.mark.parametrize("name", [a.model_type for a in SERVED])
def test_batched_greedy_equals_hf_generate_on_every_architecture(checkpoints, llama, name):
    """Chains (three sessions in each forward, drafts from another model: rejections and rollbacks) and trees
    (an oracle whose accepted paths run through second children) through the batched path equal HF generate;
    Verifier() first runs the start-up self-check (ragged rows, a rollback, a sliding tree) on that path."""
    target = ModelRunner.load(str(checkpoints[name]))
    verifier = Verifier(target, VerifierConfig(**BATCHED))
    assert verifier.attention == "batched"
    prompts = [target.tokenizer(p).input_ids for p in PROMPTS]
    want = [hf_greedy(target, ids, 12) for ids in prompts]
    draft = Drafter(llama, target.vocab_size)
    got = speculative_generate_batch(draft, verifier, prompts, [SessionConfig(max_new_tokens=12, draft_len=3)] * 3)
    assert [out for out, _ in got] == want
    out, _ = tree_generate(Oracle(target, TreeShape(3, 2, 12, 2.0)), verifier, prompts[0], 12)
    assert out == want[0]


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])  # plain; window + softcap; window + sinks
def test_batched_bfloat16_greedy_equals_hf_generate_at_bfloat16(checkpoints, name):
    """Equal up to the first tie: two top logits within one bfloat16 step, where the order in which a forward
    sums may flip the pick (measured on llama, `for i in range(10):`: token 12's top two at 0.5508 and 0.5469,
    HF generate picks the second and HF's own full forward the first), for either path."""
    target = ModelRunner.load(str(checkpoints[name]), dtype="bfloat16")
    prompts = [target.tokenizer(p).input_ids for p in PROMPTS]
    want = [hf_greedy(target, ids, 12) for ids in prompts]
    draft = Drafter(ModelRunner.load(str(checkpoints["mistral"]), dtype="bfloat16"), target.vocab_size)
    verifier = Verifier(target, VerifierConfig(**BATCHED))
    got = speculative_generate_batch(draft, verifier, prompts, [SessionConfig(max_new_tokens=12, draft_len=3)] * 3)
    cuts = [decisive(target, ids, hf) for ids, hf in zip(prompts, want)]  # up to the first bfloat16 tie
    assert sum(cuts) >= 10  # random tiny models tie often at bfloat16: still at least 10 tokens compared
    assert all(out[:cut] == hf[:cut] for (out, _), hf, cut in zip(got, want, cuts))


def test_the_path_choice_and_its_refusals():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device name only: nothing runs on it
    assert [use_batched(a, cpu) for a in ("auto", "batched", "per-session")] == [False, True, False]
    assert [use_batched(a, cuda) for a in ("auto", "batched", "per-session")] == [True, True, False]
    with pytest.raises(ValueError, match="attention must be one of auto, batched, per-session"):
        VerifierConfig(attention="varlen")
    check_deterministic_device(True, cpu)
    check_deterministic_device(False, cuda)
    with pytest.raises(FatalError, match="--deterministic runs on the cpu only") as err:
        check_deterministic_device(True, cuda)
    assert "\n" not in str(err.value)


def test_the_cpu_default_is_the_per_session_path(demo_runners):
    assert Verifier(demo_runners[0], VerifierConfig(max_sessions=2, max_cache_bytes=1 << 22)).attention == "per-session"
    assert kvcache.to_device(torch.ones(2), torch.device("cpu")).device.type == "cpu"


@pytest.mark.timeout(300)
def test_a_worker_process_on_the_batched_path_serves_greedy_equal_to_hf(tiny_pair, tmp_path):
    """`specrelay cloud-worker --attention batched` behind a real broker, `specrelay generate` as the edge."""
    import json
    import subprocess
    import sys
    import urllib.request

    from specrelay.cluster import LocalCluster

    target, draft = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    with LocalCluster(str(target), extra_worker_args=("--attention", "batched")) as cluster:
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{cluster.health_ports[0]}/healthz",
                                                   timeout=5).read())
        out = subprocess.run([sys.executable, "-m", "specrelay.cli", "generate", "--broker", cluster.frontend,
                              "--draft-model", str(draft), "--prompts", str(prompts), "--max-new-tokens", "16",
                              "--json"], capture_output=True, text=True, timeout=200)
    assert health["attention"] == "batched"
    assert out.returncode == 0, out.stderr[-3000:]
    runner = ModelRunner.load(str(target))
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["token_ids"] for r in rows] == [hf_greedy(runner, runner.tokenizer(p).input_ids, 16) for p in PROMPTS]
