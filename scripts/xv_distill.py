"""Cross-tokenizer distillation of the cross-vocabulary draft (`demo-draft-xv`) toward `demo-target`.

Two signals, both chosen to match how the draft is used at inference:

  teacher text   sequence-level KD (DistillSpec's on-policy data): the target continues random training windows,
                 half greedily, half sampled at T = 1; the draft learns the target's own text (LM loss on the
                 draft's canonical tokenization of it). Greedy drafting re-tokenises drafted text with the target
                 tokenizer, so predicting the target's text is what pays there.
  boundary KL    at every byte offset where both tokenizations have a token boundary, KL(p_c || q'_c): the
                 target's next-token distribution restricted to the shared vocabulary V_c (renormalised) against
                 the draft's, also restricted to V_c, exactly as TLI samples q' at inference (sample mode).

Used by `scripts/train_demo_models.py teacher-data | distill-xv`.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import trainlib
from trainlib import log

DRAFT_LEN = 256  # draft tokens per training window


@torch.no_grad()
def teacher_texts(target, tok, corpus: torch.Tensor, n: int, seed: int, prompt_len: int = 48,
                  new_tokens: int = 120, batch: int = 64) -> list[str]:
    """`n` texts: a random training window of `prompt_len` target tokens, continued by the target for
    `new_tokens` (even batches greedy, odd batches sampled at T = 1). Seeded."""
    gen = torch.Generator().manual_seed(seed)
    texts: list[str] = []
    t0 = time.time()
    for b in range(0, n, batch):
        starts = torch.randint(0, len(corpus) - prompt_len - 1, (batch,), generator=gen)
        ids = torch.stack([corpus[s:s + prompt_len].long() for s in starts])
        torch.manual_seed(seed + b)
        sample = (b // batch) % 2 == 1
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None,
                              top_p=1.0 if sample else None, pad_token_id=tok.eos_token_id)
        texts += tok.batch_decode(out, skip_special_tokens=False)
        if (b // batch) % 10 == 0:
            log(f"teacher text {len(texts)}/{n} ({time.time() - t0:.0f}s)")
    return texts[:n]


def _offsets(ids: list[int], table: list[bytes | None]) -> list[int]:
    """Byte offset where each token ends."""
    out, pos = [], 0
    for i in ids:
        pos += len(table[i] or b"")
        out.append(pos)
    return out


def align(text: str, target_tok, draft_tok, t_table, d_table) -> dict | None:
    """Both tokenizations of `text` (the draft's cut at DRAFT_LEN tokens) and the aligned boundary pairs
    (target position i, draft position j) whose prefixes end at the same byte offset."""
    d_ids = draft_tok(text, add_special_tokens=False).input_ids[:DRAFT_LEN + 1]
    d_end = _offsets(d_ids, d_table)
    cut = d_end[-1]
    t_ids = target_tok(text, add_special_tokens=False).input_ids
    t_end = _offsets(t_ids, t_table)
    if t_end[-1] != len(text.encode("utf-8")) or _offsets(draft_tok(text, add_special_tokens=False).input_ids,
                                                          d_table)[-1] != t_end[-1]:
        return None  # a token without exact bytes (special text): skip the window
    t_ids = [t for t, e in zip(t_ids, t_end) if e <= cut]
    t_at = {e: i for i, e in enumerate(t_end[:len(t_ids)])}
    pairs = [(t_at[e], j) for j, e in enumerate(d_end[:-1]) if e in t_at and t_at[e] < len(t_ids) - 1]
    return {"t": t_ids, "d": d_ids, "pairs": pairs}


def build_windows(texts: list[str], target_tok, draft_tok) -> list[dict]:
    from specrelay.edge_worker.xvocab.mapping import token_bytes

    t_table, d_table = token_bytes(target_tok), token_bytes(draft_tok)
    windows = [w for w in (align(x, target_tok, draft_tok, t_table, d_table) for x in texts) if w and len(w["d"]) > 8]
    log(f"{len(windows)} aligned windows; boundary pairs per window "
        f"{sum(len(w['pairs']) for w in windows) / max(1, len(windows)):.1f}")
    return windows


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def distill_loss(draft, target, batch: list[dict], shared_t: torch.Tensor, shared_d: torch.Tensor,
                 kl_weight: float) -> tuple[torch.Tensor, float, float]:
    """LM loss on the draft's tokens + kl_weight * KL(p_c || q'_c) at aligned boundaries."""
    d = _pad([w["d"] for w in batch], 0)
    d_mask = _pad([[1] * len(w["d"]) for w in batch], 0)
    logits = draft(d[:, :-1], attention_mask=d_mask[:, :-1]).logits  # [B, Ld-1, V_draft]
    lm = F.cross_entropy(logits.flatten(0, 1), d[:, 1:].flatten(), reduction="none")
    lm = (lm * d_mask[:, 1:].flatten()).sum() / d_mask[:, 1:].sum()
    if kl_weight == 0:
        return lm, lm.item(), 0.0
    t = _pad([w["t"] for w in batch], 0)
    t_mask = _pad([[1] * len(w["t"]) for w in batch], 0)
    with torch.no_grad():
        p_logits = target(t, attention_mask=t_mask).logits[..., shared_t]  # [B, Lt, V_c]
    rows = [(b, i, j) for b, w in enumerate(batch) for i, j in w["pairs"]]
    bi = torch.tensor([r[0] for r in rows])
    log_p = F.log_softmax(p_logits[bi, torch.tensor([r[1] for r in rows])].float(), -1)  # [N, V_c]
    log_q = F.log_softmax(logits[bi, torch.tensor([r[2] for r in rows])][:, shared_d], -1)  # [N, V_c]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return lm + kl_weight * kl, lm.item(), kl.item()


def train(draft, target, windows: list[dict], shared_t, shared_d, *, minutes: float, lr: float, batch: int,
          kl_weight: float, seed: int, save) -> dict:
    """`trainlib.fit` over shuffled epochs of the aligned windows."""
    rng = random.Random(seed)

    def epochs():
        while True:
            order = rng.sample(range(len(windows)), len(windows))
            for i in range(0, len(order) - batch + 1, batch):
                yield [windows[j] for j in order[i:i + batch]]

    def loss_fn(model, picked):
        loss, lm, kl = distill_loss(model, target, picked, shared_t, shared_d, kl_weight)
        return loss, {"lm": lm, "kl": kl}

    t0 = time.time()
    steps = trainlib.fit(draft, epochs(), loss_fn, lr=lr, minutes=minutes, warmup=30, name="distill-xv",
                         save=save, log_every=25)
    return {"steps": steps, "windows": len(windows), "wall_minutes": round((time.time() - t0) / 60, 1)}


def save_texts(path: Path, texts: list[str]) -> None:
    path.write_text("\n".join(json.dumps(t) for t in texts))


def load_texts(path: Path) -> list[str]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
