"""The start-up self-check shared by the cloud worker and the edge: one short ragged forward through the
process's own K/V path compared with the model's own forward, so that an attention feature the path does not
reproduce is caught before READY, in one line, never as a failure after it.

The probe is two sequences of different lengths (21 and 13 ids: longer than a tiny sliding window, ragged), fed
in three forwards that include a rollback. Logits must agree to a tolerance that depends on the dtype (float32:
1e-3 of the logits' scale; 16-bit: 5e-2), which separates rounding from a wrong mask, softcap or sink.
"""

from __future__ import annotations

import torch

from .errors import FatalError

LENGTHS = (21, 13)


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


def require_close(model, path: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Raise FatalError naming the architecture and the path unless every got[i] matches want[i]."""
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    worst = max(float((g.float().cpu() - w).abs().max() / max(1.0, float(w.abs().max())))
                for g, w in zip(got, want))
    if not worst <= tolerance:  # also catches NaN
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise FatalError(f"{type(model).__name__} ({kind}): {path} does not reproduce the model's own forward "
                         f"(relative logit difference {worst:.2g} > {tolerance:g}); this architecture uses an "
                         "attention feature specrelay does not support")
