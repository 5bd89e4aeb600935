"""The optimisation loop every demo model shares: AdamW, linear warm-up, cosine decay to 10 % over a wall-time
budget (so a run fits a laptop), gradient clip 1.0, a checkpoint every 100 steps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def fit(model, batches: Iterable, loss_fn: Callable, *, lr: float, minutes: float, warmup: int, name: str,
        save: Callable[[], None], log_every: int = 50) -> int:
    """Train until the budget is spent; `loss_fn(model, batch)` returns the loss (or (loss, {metric: value}) to
    log more). Returns the number of steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0, step, budget = time.time(), 0, minutes * 60
    model.train()
    for batch in batches:
        frac = (time.time() - t0) / budget
        if frac >= 1:
            break
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        out = loss_fn(model, batch)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % log_every == 0:
            shown = " ".join(f"{k} {v:.3f}" for k, v in ({"loss": loss.item()} | metrics).items())
            log(f"{name} step {step} {shown} lr {lr * scale:.2e} {time.time() - t0:.0f}s")
        if step % 100 == 0:
            save()
    save()
    return step
