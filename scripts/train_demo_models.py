"""Train the demo model pair (and a cross-vocabulary draft) on CPython's standard library source.

Reproducible (seeded) and budgeted by wall time, so it fits a laptop:

    python scripts/train_demo_models.py data          # split Lib/ (tests left out, 5% held out), prompts
    python scripts/train_demo_models.py tokenizers    # byte-level BPE 8k (target) + Metaspace/byte-fallback 4k (xv)
    python scripts/train_demo_models.py target  --minutes 45
    python scripts/train_demo_models.py draft   --minutes 20 --threads 1   # distilled from the target (KL)
    python scripts/train_demo_models.py draft-xv --minutes 20 --threads 1  # its own tokenizer, LM loss
    python scripts/train_demo_models.py teacher-data --threads 1      # target continuations (sequence-level KD)
    python scripts/train_demo_models.py distill-xv --minutes 60 --threads 1  # cross-tokenizer distillation
    python scripts/train_demo_models.py eval          # held-out loss, greedy agreement, alpha -> models/metrics.json

Everything lands in models/ as save_pretrained directories that AutoModelForCausalLM/AutoTokenizer load offline.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainlib, xv_distill

import trainlib  # noqa: E402
from pair_eval import generation_acceptance  # noqa: E402
from trainlib import log  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
WORK = ROOT / ".train"  # token caches, checkpoints (git-ignored)
SEED = 1234
EOS = "<|endoftext|>"
TEST_DIRS = {"test", "tests", "idle_test", "unittests"}
SEQ_LEN = 256

TARGET_CFG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8)
DRAFT_CFG = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4)


# ----------------------------------------------------------------------------- data

def stdlib_files() -> list[Path]:
    """Every .py file of the running interpreter's Lib/, test directories and site-packages left out."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(lib.rglob("*.py")):
        parts = set(path.relative_to(lib).parts[:-1])
        if parts & TEST_DIRS or "site-packages" in parts or "dist-packages" in parts:
            continue
        files.append(path)
    return files


def split_files() -> tuple[list[Path], list[Path]]:
    files = stdlib_files()
    rng = random.Random(SEED)
    held = set(rng.sample(range(len(files)), max(1, round(0.05 * len(files)))))
    train = [f for i, f in enumerate(files) if i not in held]
    heldout = [f for i, f in enumerate(files) if i in held]
    return train, heldout


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def make_prompts(heldout: list[Path], n: int = 40) -> list[dict]:
    """Prompts cut from held-out files: a few whole lines ending at a line break, 80-400 chars."""
    rng = random.Random(SEED + 1)
    prompts = []
    while len(prompts) < n:
        text = read(rng.choice(heldout))
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(0, len(lines) - 10)
        chunk = "".join(lines[start:start + rng.randint(3, 8)])
        if 80 <= len(chunk) <= 400 and chunk.strip():
            prompts.append({"prompt": chunk})
    return prompts


def cmd_data(args) -> None:
    train, heldout = split_files()
    lib = Path(sysconfig.get_paths()["stdlib"])
    MODELS.mkdir(exist_ok=True)
    split = {"stdlib": str(lib), "seed": SEED, "train_files": len(train),
             "train_chars": sum(len(read(f)) for f in train),
             "heldout_files": [str(f.relative_to(lib)) for f in heldout]}
    (MODELS / "split.json").write_text(json.dumps(split, indent=1))
    with open(MODELS / "heldout_prompts.jsonl", "w") as fh:
        for p in make_prompts(heldout):
            fh.write(json.dumps(p) + "\n")
    log(f"train files {len(train)} ({split['train_chars']} chars), held-out files {len(heldout)}")


# ----------------------------------------------------------------------------- tokenizers

# The demo target is a code model: a chat renders as Python comments and the assistant answers in code, so
# /v1/chat/completions works out of the box (README's example). Real -Instruct checkpoints bring their own.
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] | replace('\\n', '\\n# ') }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")


def train_target_tokenizer(texts: list[str]):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=8192, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, model_max_length=1024, clean_up_tokenization_spaces=False,
                                   chat_template=CHAT_TEMPLATE)


def train_xv_tokenizer(texts: list[str]):
    """SentencePiece-style BPE: Metaspace ('▁' for space) plus <0xNN> byte-fallback tokens, 4k merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=4096, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=200, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback pieces, as Llama/SentencePiece spell them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", model_max_length=1024, clean_up_tokenization_spaces=False)


def cmd_tokenizers(args) -> None:
    train, heldout = split_files()
    texts = [read(f) for f in train]
    for name, fn in (("demo-target", train_target_tokenizer), ("demo-draft-xv", train_xv_tokenizer)):
        tok = fn(texts)
        sample = read(heldout[0])[:5000]
        assert tok.decode(tok(sample).input_ids) == sample, f"{name} tokenizer does not round-trip"
        tok.save_pretrained(WORK / f"tok-{name}")
        log(f"{name}: vocab {len(tok)}")
        encode_corpus(tok, name)


def encode_corpus(tok, name: str) -> None:
    train, heldout = split_files()
    for split, files in (("train", train), ("heldout", heldout)):
        ids: list[int] = []
        for f in files:
            ids.extend(tok(read(f)).input_ids)
            ids.append(tok.eos_token_id)
        torch.save(torch.tensor(ids, dtype=torch.int32), WORK / f"{name}.{split}.pt")
        log(f"{name} {split}: {len(ids)} tokens")


# ----------------------------------------------------------------------------- models

def new_model(tok, cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, num_key_value_heads=cfg["num_attention_heads"], **cfg)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batches(data: torch.Tensor, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + SEQ_LEN + 1].long() for s in starts])


def heldout_windows(name: str, n: int = 48) -> torch.Tensor:
    data = torch.load(WORK / f"{name}.heldout.pt")
    step = (len(data) - SEQ_LEN - 1) // n
    return torch.stack([data[i * step:i * step + SEQ_LEN + 1].long() for i in range(n)])


@torch.no_grad()
def heldout_loss(model, name: str) -> float:
    model.eval()
    losses = []
    for chunk in heldout_windows(name).split(8):
        logits = model(chunk[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def train_loop(model, name: str, minutes: float, loss_fn, lr: float, batch: int, out: Path, tok,
               seed: int = SEED) -> dict:
    """`trainlib.fit` on random windows of the `name` corpus; saves to `out` on the way."""
    data = torch.load(WORK / f"{name}.train.pt")
    gen = torch.Generator().manual_seed(seed)  # a resumed run draws different windows
    t0 = time.time()
    step = trainlib.fit(model, batches(data, batch, gen), loss_fn, lr=lr, minutes=minutes, warmup=50,
                        name=out.name, save=lambda: save(model, tok, out))
    stats = {"steps": step, "tokens_seen": step * batch * SEQ_LEN, "wall_minutes": round((time.time() - t0) / 60, 1),
             "params": n_params(model), "heldout_loss": round(heldout_loss(model, name), 4)}
    (out / "training.json").write_text(json.dumps(stats, indent=1))
    log(out.name, stats)
    return stats


def save(model, tok, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def lm_loss(model, x):
    logits = model(x[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def load_tok(name: str):
    """The tokenizer trained by `tokenizers`, else the one shipped in models/ (a fresh clone has no .train/)."""
    from transformers import AutoTokenizer
    path = WORK / f"tok-{name}"
    return AutoTokenizer.from_pretrained(path if path.exists() else MODELS / name)


def cmd_encode(args) -> None:
    """Token caches for a fresh clone: encode the corpus with the tokenizers in models/ (no retraining)."""
    for name in ("demo-target", "demo-draft-xv"):
        if not (WORK / f"{name}.train.pt").exists():
            encode_corpus(load_tok(name), name)


def cmd_teacher_data(args) -> None:
    """Target continuations of random training windows, for sequence-level distillation of the xv draft."""
    from transformers import AutoModelForCausalLM
    import xv_distill

    target = AutoModelForCausalLM.from_pretrained(MODELS / "demo-target").eval()
    corpus = torch.load(WORK / "demo-target.train.pt")
    texts = xv_distill.teacher_texts(target, load_tok("demo-target"), corpus, args.teacher_texts, SEED + 7)
    xv_distill.save_texts(WORK / "teacher.jsonl", texts)
    log(f"{len(texts)} teacher texts -> {WORK / 'teacher.jsonl'}")


def corpus_texts(n: int, n_tokens: int = 170) -> list[str]:
    """`n` random windows of the training corpus as text (the target's tokenization, decoded)."""
    tok = load_tok("demo-target")
    data = torch.load(WORK / "demo-target.train.pt")
    gen = torch.Generator().manual_seed(SEED + 11)
    starts = torch.randint(0, len(data) - n_tokens, (n,), generator=gen)
    return [tok.decode(data[s:s + n_tokens].tolist()) for s in starts]


def cmd_distill_xv(args) -> None:
    """Continue `demo-draft-xv` on teacher text + corpus windows with LM loss and boundary KL on V_c."""
    from transformers import AutoModelForCausalLM
    import xv_distill
    from specrelay.edge_worker.xvocab.mapping import build_shared_vocab

    target = AutoModelForCausalLM.from_pretrained(MODELS / "demo-target").eval()
    out = Path(args.out) if args.out else MODELS / "demo-draft-xv"
    draft = AutoModelForCausalLM.from_pretrained(MODELS / "demo-draft-xv")
    t_tok, d_tok = load_tok("demo-target"), load_tok("demo-draft-xv")
    vocab = build_shared_vocab(d_tok, t_tok)
    teacher = xv_distill.load_texts(WORK / "teacher.jsonl")
    texts = teacher + corpus_texts(args.corpus_texts)
    windows = xv_distill.build_windows(texts, t_tok, d_tok)
    previous = json.loads((MODELS / "demo-draft-xv" / "training.json").read_text())
    stats = xv_distill.train(draft, target, windows, vocab.shared_target_ids, vocab.shared_draft_ids,
                             minutes=args.minutes, lr=args.lr, batch=args.batch, kl_weight=args.kl_weight,
                             seed=SEED + 3, save=lambda: save(draft, d_tok, out))
    stats |= {"method": "cross-tokenizer distillation: LM loss on target-generated text (half greedy, half T=1) "
                        "and corpus windows + KL(p_c || q'_c) on V_c at shared token boundaries",
              "kl_weight": args.kl_weight, "lr": args.lr, "batch": args.batch, "teacher_texts": len(teacher),
              "corpus_texts": args.corpus_texts, "params": n_params(draft),
              "heldout_loss": round(heldout_loss(draft, "demo-draft-xv"), 4)}
    phases = previous.get("phases", [previous]) + [stats]
    (out / "training.json").write_text(json.dumps({**stats, "phases": phases}, indent=1))
    log("distill-xv", stats)


def cmd_target(args) -> None:
    """Train the target; --resume continues from models/demo-target with a fresh, lower cosine schedule."""
    from transformers import AutoModelForCausalLM

    tok = load_tok("demo-target")
    out = MODELS / "demo-target"
    previous = json.loads((MODELS / "demo-draft-xv" / "training.json").read_text()) if args.resume else None
    model = AutoModelForCausalLM.from_pretrained(out) if args.resume else new_model(tok, TARGET_CFG)
    log(f"target params {n_params(model)}" + (f", resuming after {previous['steps']} steps" if previous else ""))
    stats = train_loop(model, "demo-target", args.minutes, lm_loss, 8e-4 if args.resume else 2e-3, args.batch, out, tok,
                       seed=SEED + 1 if args.resume else SEED)
    if previous:
        stats["phases"] = previous.get("phases", [previous]) + [dict(stats)]
        for key in ("steps", "tokens_seen", "wall_minutes"):
            stats[key] = round(sum(phase[key] for phase in stats["phases"]), 1)
        (out / "training.json").write_text(json.dumps(stats, indent=1))


def cmd_draft(args) -> None:
    """DistillSpec-style: minimise KL(p_target || q_draft) on training text, temperature 1."""
    from transformers import AutoModelForCausalLM

    tok = load_tok("demo-target")
    teacher = AutoModelForCausalLM.from_pretrained(MODELS / "demo-target").eval()
    model = new_model(tok, DRAFT_CFG)
    assert n_params(model) * 5 <= n_params(teacher), "draft must be at most 1/5 of the target"
    log(f"draft params {n_params(model)} (target {n_params(teacher)})")

    def kd_loss(student, x):
        with torch.no_grad():
            log_p = F.log_softmax(teacher(x[:, :-1]).logits, -1)
        log_q = F.log_softmax(student(x[:, :-1]).logits, -1)
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()

    train_loop(model, "demo-target", args.minutes, kd_loss, 3e-3, args.batch, MODELS / "demo-draft", tok)


def cmd_draft_xv(args) -> None:
    tok = load_tok("demo-draft-xv")
    model = new_model(tok, DRAFT_CFG)
    log(f"draft-xv params {n_params(model)}")
    train_loop(model, "demo-draft-xv", args.minutes, lm_loss, 3e-3, args.batch, MODELS / "demo-draft-xv", tok)


@torch.no_grad()
def cmd_eval(args) -> None:
    """Teacher-forced on held-out code: greedy agreement argmax q == argmax p, and alpha = E[sum min(p, q)]."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(MODELS / "demo-target").eval()
    draft = AutoModelForCausalLM.from_pretrained(MODELS / "demo-draft").eval()
    agree, alpha, n = 0.0, 0.0, 0
    for chunk in heldout_windows("demo-target").split(8):
        p = F.softmax(target(chunk[:, :-1]).logits, -1)
        q = F.softmax(draft(chunk[:, :-1]).logits, -1)
        agree += (p.argmax(-1) == q.argmax(-1)).float().sum().item()
        alpha += torch.minimum(p, q).sum(-1).sum().item()
        n += p.shape[0] * p.shape[1]
    metrics = {"demo-draft": {"teacher_forced_greedy_agreement": round(agree / n, 4),
                              "teacher_forced_alpha_t1": round(alpha / n, 4), "heldout_positions": n}}
    for name in ("demo-draft", "demo-draft-xv"):
        metrics.setdefault(name, {}).update(generation_acceptance(MODELS, name))
    (MODELS / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=["data", "tokenizers", "encode", "target", "draft", "draft-xv",
                                          "teacher-data", "distill-xv", "eval"])
    parser.add_argument("--minutes", type=float, default=45)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="target: continue from models/demo-target")
    parser.add_argument("--teacher-texts", type=int, default=6000, help="teacher-data: target continuations")
    parser.add_argument("--corpus-texts", type=int, default=3000, help="distill-xv: corpus windows mixed in")
    parser.add_argument("--kl-weight", type=float, default=1.0, help="distill-xv: weight of the boundary KL")
    parser.add_argument("--lr", type=float, default=1e-3, help="distill-xv: peak learning rate")
    parser.add_argument("--out", default=None, help="distill-xv: output directory (default models/demo-draft-xv)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    WORK.mkdir(exist_ok=True)
    {"data": cmd_data, "tokenizers": cmd_tokenizers, "target": cmd_target, "draft": cmd_draft,
     "draft-xv": cmd_draft_xv, "encode": cmd_encode, "teacher-data": cmd_teacher_data,
     "distill-xv": cmd_distill_xv, "eval": cmd_eval}[args.phase](args)


if __name__ == "__main__":
    main()
