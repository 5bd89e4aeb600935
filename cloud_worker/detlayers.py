"""The deterministic (batch-invariant) numerics of the layers outside attention (cloud_worker/detattn.py does
attention): inside a deterministic packed forward a token's result in every layer does not depend on how many
rows the batch has, so that its logits depend only on its own session's tokens.

Two things make a CPU layer depend on the row count, and each has its fix here:
- Matrix products pick kernels (and summation orders) by shape. `nn.Linear`, GPT-2's `Conv1D` and any other
  module's own matrix weight (a router's `F.linear(hidden, self.weight)`) run as products of fixed
  [TILE, in] x [in, out] shape (one batched matmul, `tiled_linear`). Mixture-of-experts experts (transformers'
  `@use_experts_implementation` classes: Qwen3-MoE, Mixtral, gpt-oss, ...), whose kernels multiply each expert
  by however many tokens the batch routes to it, run each expert on its tokens in TILE-row tiles, and add a
  token's k weighted outputs in its router's order, in float32 (`experts_forward`).
- Element-wise functions whose CPU kernel computes the vectorised body and the scalar tail of a tensor with
  different formulas (SiLU, sigmoid, GELU, softplus, Mish, ELU, GLU; rsqrt in 16 bits): an element's result
  depends on where the tensor ends. They are computed here from functions whose tail runs the vector code too
  (exp, erf, tanh, log1p, sqrt), and exact arithmetic, in float32.
Leaf modules (activations, routers; norms in 16 bits) and the blocks that hold experts (Qwen2-MoE's sigmoid
shared-expert gate) run under the torch function mode `_FixedShape` that does both; the experts' gates too.
Outside a deterministic forward every patched module runs its own forward, unchanged.

`untiled` names a module with weights of 3 or more dimensions that is not an experts class handled here:
deterministic numerics cannot promise batch invariance for it, and the worker refuses it at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.pytorch_utils import Conv1D

TILE = 16  # rows per matrix product


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear (x [..., in], weight [out, in]) as products of fixed [TILE, in] x [in, out] shape (one batched
    matmul), so that a row's result does not depend on how many rows the batch has."""
    rows = x.reshape(-1, x.shape[-1])  # [R, in]
    r = rows.shape[0]
    if r == 0:
        return F.linear(x, weight, bias)
    if weight.shape[0] == 1:  # one output (a gate): a single tile would take a matrix-vector kernel; add a zero one
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(1)])
        return tiled_linear(x, torch.cat([weight, weight.new_zeros(weight.shape)]), bias)[..., :1]
    tiles = -(-r // TILE)
    padded = rows.new_zeros(tiles * TILE, rows.shape[1])
    padded[:r] = rows
    w = weight.t().unsqueeze(0).expand(tiles, *weight.t().shape)  # [tiles, in, out], not copied
    out = torch.bmm(padded.view(tiles, TILE, -1), w).view(tiles * TILE, -1)[:r]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


# ---- patching the model ----------------------------------------------------------------------------------

def install(model, active: Callable[[], bool]) -> None:
    """Route the model's layers through their deterministic forms while `active()` (idempotent)."""
    for module in model.modules():
        tiled = None if getattr(module, "_specrelay_tiled", False) else _deterministic_forward(module)
        if tiled is not None:
            own = module.forward
            module.forward = lambda *a, _own=own, _tiled=tiled, **kw: (_tiled if active() else _own)(*a, **kw)
            module._specrelay_tiled = True


def _deterministic_forward(module: nn.Module) -> Callable | None:
    """The module's forward in deterministic numerics, or None where its own is batch-invariant (its children
    being patched)."""
    if type(module) is nn.Linear:
        return lambda x: tiled_linear(x, module.weight, module.bias)
    if isinstance(module, Conv1D):  # weight [in, out]
        return lambda x: tiled_linear(x, module.weight.t(), module.bias)
    if _is_experts(module):
        return lambda *args: experts_forward(module, *args)
    own = list(module.parameters(recurse=False))
    if isinstance(module, nn.Embedding) or (own and all(p.dim() == 1 and p.dtype.itemsize >= 4 for p in own)):
        return None  # a gather; a 32-bit norm (mean, rsqrt: their tails run the vector code)
    children = list(module.children())
    if not children or any(p.dim() == 2 for p in own) or any(_is_experts(c) for c in children):
        return _fixed_shape(module.forward)  # activations, 16-bit norms, routers, MoE blocks (a shared gate)
    return None


def _fixed_shape(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        with _FixedShape():
            return forward(*args, **kwargs)
    return run


def _is_experts(module: nn.Module) -> bool:
    """A transformers `@use_experts_implementation` experts module (the decorator sets these attributes)."""
    return (all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts"))
            and isinstance(getattr(module, "down_proj", None), torch.Tensor) and module.down_proj.dim() == 3)


def untiled(model) -> str | None:
    """The class name of a module with 3-D (or larger) weights that deterministic numerics do not tile, or None."""
    for module in model.modules():
        if not _is_experts(module) and any(p.dim() > 2 for p in module.parameters(recurse=False)):
            return type(module).__name__
    return None


# ---- the function mode: fixed-shape products, tail-independent element-wise functions ---------------------

def _f32(formula: Callable) -> Callable:
    """`formula` on x in float32, the result in x's dtype."""
    def run(x, *args, **kwargs):
        return formula(x.float(), *args, **kwargs).to(x.dtype)
    return run


def _softplus(x, beta=1.0, threshold=20.0):
    return torch.where(x * beta > threshold, x, torch.log1p(torch.exp(x * beta)) / beta)


def _gelu(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * (x * x * x))))
    return 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))


def _glu(x, dim=-1):
    a, b = x.chunk(2, dim)
    return a / (1 + torch.exp(-b))


_SIGMOID = _f32(lambda x: 1 / (1 + torch.exp(-x)))
_ELEMENTWISE = {
    F.silu: _f32(lambda x, inplace=False: x / (1 + torch.exp(-x))),
    torch.sigmoid: _SIGMOID, torch.Tensor.sigmoid: _SIGMOID, F.sigmoid: _SIGMOID, torch.special.expit: _SIGMOID,
    F.gelu: _f32(_gelu),
    F.softplus: _f32(_softplus),
    F.mish: _f32(lambda x, inplace=False: x * torch.tanh(_softplus(x))),
    F.elu: _f32(lambda x, alpha=1.0, inplace=False: torch.where(x > 0, x, alpha * torch.expm1(x))),
    F.glu: _f32(_glu),
    torch.rsqrt: _f32(lambda x: 1 / torch.sqrt(x)), torch.Tensor.rsqrt: _f32(lambda x: 1 / torch.sqrt(x)),
}
_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


class _FixedShape(TorchFunctionMode):
    """F.linear, addmm and matmul by a 2-D weight as `tiled_linear`; the element-wise functions above by their
    tail-independent formulas; every other call unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ELEMENTWISE and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return _ELEMENTWISE[func](*args, **kwargs)
        if func is F.linear:
            return tiled_linear(*args, **kwargs)
        if func in (torch.addmm, torch.Tensor.addmm) and not kwargs and len(args) == 3:
            bias, x, w = args  # bias + x @ w
            return tiled_linear(x, w.t(), bias)
        if func in _MATMUL and not kwargs and len(args) == 2 and _weight_like(*args):
            return tiled_linear(args[0], args[1].t())
        return func(*args, **kwargs)


def _weight_like(x, w) -> bool:
    return isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2 and x.dim() >= 2


# ---- experts -------------------------------------------------------------------------------------------------

def experts_forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], index / weights [T, K] (each token's experts and their weights) -> [T, H]: every expert on
    the tokens routed to it in TILE-row tiles; a token's K outputs weighted and added in router order, in float32."""
    t, k = index.shape
    flat = index.reshape(-1)                                     # [T*K] expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)                     # pairs grouped by expert
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    out = hidden.new_zeros(t * k, hidden.shape[-1])              # [T*K, H]
    start = 0
    for expert, count in enumerate(counts[:self.num_experts]):   # ids >= num_experts: no expert (transformers)
        if count:
            pairs = order[start:start + count]
            out[pairs] = _expert(self, expert, hidden[pairs // k]).to(out.dtype)
        start += count
    y = out.view(t, k, -1) * weights.to(out.dtype)[..., None]     # [T, K, H]
    total = y[:, 0].float()
    for slot in range(1, k):
        total = total + y[:, slot].float()
    return total.to(hidden.dtype)


def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens x [c, H] -> [c, H], as transformers' experts implementations apply it."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[e] if self.has_bias else None
    h = tiled_linear(x, up[e].t() if self.is_transposed else up[e], up_bias)
    with _FixedShape():
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    down_bias = self.down_proj_bias[e] if self.has_bias else None
    h = tiled_linear(h, self.down_proj[e].t() if self.is_transposed else self.down_proj[e], down_bias)
    if getattr(self, "has_post_expert_norm", False):
        with _FixedShape():
            h = self.post_expert_norm(h)
    return h
