"""The start-up self-check shared by the cloud worker and the edge: one short ragged forward through the
process's own K/V path compared with the model's own forward, so that an attention feature the path does not
reproduce is caught before READY, in one line, never as a failure after it.

The probe is two sequences of different lengths (21 and 13 ids, ragged), fed in three forwards that include a
rollback; sliding windows are shrunk to 8 meanwhile, so that the probe slides past them. Logits must agree to a tolerance that depends on the dtype (float32:
1e-3 of the logits' scale; 16-bit: 5e-2), which separates rounding from a wrong mask, softcap or sink.
"""

from __future__ import annotations

import contextlib

import torch

from .errors import FatalError

LENGTHS = (21, 13)
PROBE_WINDOW = 8  # sliding windows are shrunk to this during the check, so a 21-token probe slides past them
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}  # the `layer_types` a K/V cache with rollback can serve
# config fields of state-space / recurrent layers (Mamba, Jamba, Falcon-H1, Qwen3-Next, LFM2)
RECURRENT_FIELDS = ("state_size", "mamba_d_state", "ssm_state_size", "linear_conv_kernel_dim", "conv_L_cache")


def refuse_recurrent(model) -> None:
    """Raise FatalError (one line) for a model with layers that are not K/V attention: their recurrent state
    cannot be rolled back to drop rejected drafts (state-space and hybrid models)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    others = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)
    fields = [f for f in RECURRENT_FIELDS if getattr(config, f, None) is not None]
    if others or fields:
        what = f"layers of type {', '.join(others)}" if others else f"state-space layers ({fields[0]})"
        raise FatalError(f"{_name(model)} has {what}: a recurrent state cannot be rolled back to drop rejected "
                         "drafts, so specrelay cannot serve it (state-space and hybrid models are not supported)")


def _name(model) -> str:
    return f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"


def probe(vocab_size: int) -> list[list[int]]:
    """The probe's id sequences: fixed pseudo-random ids (never the specials at the bottom of a vocabulary)."""
    g = torch.Generator().manual_seed(19)
    low = min(5, vocab_size - 1)
    return [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


@torch.no_grad()
def reference(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The model's own logits [n, V] (float32, CPU) for each sequence, one plain forward each."""
    device = next(model.parameters()).device
    return [model(input_ids=torch.tensor([s], device=device), use_cache=False).logits[0].float().cpu()
            for s in sequences]


def compare(model, path: str, run) -> None:
    """Raise FatalError (one line) naming the architecture and the path unless `run()` (the path's logits for
    the probe, [n, V] per sequence) matches the model's own forward; an exception inside the path counts."""
    refuse_recurrent(model)
    try:
        with shrunk_windows(model):
            want = reference(model, probe(model.get_output_embeddings().weight.shape[0]))
            got = run()
    except FatalError:
        raise
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise FatalError(f"{_name(model)}: {path} failed on the start-up self-check ({type(exc).__name__}: "
                         f"{reason}); this architecture is not supported") from exc
    require_close(model, path, got, want)


@contextlib.contextmanager
def shrunk_windows(model, window: int = PROBE_WINDOW):
    """Within the block, every sliding window of the model (its config's, and each attention module's own copy)
    is at most `window`, so the short probe exercises the windowed masks of a real checkpoint (4096 for
    Mistral); both the model's own forward and the checked path see the same windows."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    saved = []
    for owner in [config, *model.modules()]:
        value = getattr(owner, "sliding_window", None)
        if isinstance(value, int) and value > window:
            saved.append((owner, value))
            setattr(owner, "sliding_window", window)
    try:
        yield
    finally:
        for owner, value in saved:
            setattr(owner, "sliding_window", value)


def require_close(model, path: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Raise FatalError naming the architecture and the path unless every got[i] matches want[i]."""
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    worst = max(float((g.float().cpu() - w).abs().max() / max(1.0, float(w.abs().max())))
                for g, w in zip(got, want))
    if not worst <= tolerance:  # also catches NaN
        raise FatalError(f"{_name(model)}: {path} does not reproduce the model's own forward "
                         f"(relative logit difference {worst:.2g} > {tolerance:g}); this architecture uses an "
                         "attention feature specrelay does not support")
