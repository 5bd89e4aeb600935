"""Checks on a model argument and a device, made before anything heavy is loaded (no torch import unless CUDA
must be asked about).

A model argument is a local directory, a GGUF file (or a directory holding exactly one, and no config.json), or a
Hugging Face hub id ("gpt2", "Qwen/Qwen2.5-0.5B"). A GGUF file is read by transformers' GGUF support and
dequantised to the --dtype asked for (it needs the `gguf` package: the `real` extra); its header is checked here
(magic, architecture, every tensor's quantisation) so that what transformers cannot read fails in one line. A
path-looking argument (absolute, relative with ./ or ../, ~, more than one slash, an existing file, or a first
component that is a local folder, as in "models/demo-targt") is NEVER sent to the hub: a typo must not turn into
a minute of download retries. A local directory must hold a config, weights and tokenizer files. A hub id must be
in the local cache or on a hub that answers within seconds.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model*.bin", "*.pt")
HUB_TIMEOUT_S = 3.0  # to open a connection to the hub
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def looks_like_path(name: str) -> bool:
    """True when `name` must be a local path (see the module docstring); False for a plausible hub id."""
    if os.path.exists(name) or not HUB_ID.fullmatch(name):
        return True
    return "/" in name and os.path.isdir(name.split("/", 1)[0])


def check_model(name: str, what: str = "model", *, weights: bool = True, tokenizer: bool = True) -> str:
    """`name` itself for a hub id (after `check_hub`); for a path, the directory after checking it holds what is
    needed. Raises ConfigError naming `what` (a flag, or "model") and the fix."""
    if not looks_like_path(name):
        check_hub(name, what)
        return name
    path = Path(name).expanduser()
    gguf = gguf_of(path, what)
    if gguf is not None:
        return check_gguf(gguf, what)
    if not path.exists():
        kind = "file" if path.suffix.lower() == ".gguf" else "directory"
        raise ConfigError(f"{what}: {kind} {name} does not exist{_did_you_mean(path)} "
                          "(a path is never looked up on the Hugging Face hub)")
    if not path.is_dir():
        raise ConfigError(f"{what}: {name} is a file; give the model's directory (or a .gguf file)")
    if weights and not (path / "config.json").is_file():
        raise ConfigError(f"{what}: {name} has no config.json, so it is not a Hugging Face model directory")
    if weights and not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        raise ConfigError(f"{what}: {name} has no weights (*.safetensors or pytorch_model*.bin)")
    if tokenizer and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{what}: {name} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): "
                          "copy the model's tokenizer into that directory")
    return str(path)


def gguf_of(path: Path, what: str = "model") -> Path | None:
    """The GGUF file a model argument names: the file itself (*.gguf), or the single *.gguf in a directory that has
    no config.json; None when it names none. A directory with several is refused: which one is meant?"""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(f"{what}: {path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:4])}); "
                          "name the file")
    return found[0] if found else None


def check_gguf(path: Path, what: str = "model") -> str:
    """The GGUF file's path once its header says transformers can read it: the magic, an architecture transformers
    maps, and tensor types the gguf package dequantises. Reads the header only (the file is memory-mapped)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{what}: {path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        import gguf
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError as exc:
        raise ConfigError(f"{what}: {path} is a GGUF file; reading it needs the gguf package ({exc.name} is "
                          "missing): pip install 'specrelay[real]'") from None
    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, IndexError, ValueError, OSError) as exc:
        raise ConfigError(f"{what}: {path}: cannot read its GGUF header ({exc})") from None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and _GGUF_ALIASES.get(arch) not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{what}: {path} is a GGUF of architecture {arch!r}, which transformers "
                          f"{metadata.version('transformers')} cannot read (it reads "
                          f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    bad = sorted({t.tensor_type.name for t in reader.tensors
                  if t.tensor_type not in plain and t.tensor_type not in gguf.quants._type_traits})
    if bad:
        raise ConfigError(f"{what}: {path} holds tensors quantised as {', '.join(bad)}, which gguf "
                          f"{metadata.version('gguf')} cannot dequantise")
    return str(path)


# GGUF architecture names that transformers maps to another name before looking them up (load_gguf_checkpoint)
_GGUF_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
                 "t5encoder": "t5"}


def pretrained_args(name: str) -> tuple[str, dict]:
    """(what to pass to from_pretrained, its extra keyword arguments) for a checked model argument: a GGUF file is
    its directory plus gguf_file=its name."""
    if name.lower().endswith(".gguf") and os.path.isfile(name):
        return os.path.dirname(os.path.abspath(name)), {"gguf_file": os.path.basename(name)}
    return name, {}


def check_hub(name: str, what: str = "model", timeout: float = HUB_TIMEOUT_S) -> None:
    """A hub id must be reachable: in the local cache, or on a hub this machine can reach. Offline, transformers
    retries for about a minute before failing; here an unreachable hub takes at most `timeout` seconds, and a
    cached model is then loaded with HF_HUB_OFFLINE=1 (no retries)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return
    host = urlsplit(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as exc:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            os.environ["HF_HUB_OFFLINE"] = "1"  # cached: load it without asking the hub
            return
        raise ConfigError(f"{what}: {name!r} is not a local directory, it is not in the Hugging Face cache, and the "
                          f"hub ({host}) cannot be reached from here ({exc.strerror or exc}); give the model's "
                          "directory") from None


def _did_you_mean(path: Path) -> str:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f" (nor does {parent})"
    siblings = [p.name for p in parent.iterdir() if p.is_dir()]
    close = difflib.get_close_matches(path.name, siblings, n=1)
    return f" (did you mean {parent / close[0]}?)" if close else ""


def check_device(device: str, what: str = "--device") -> None:
    """cpu, cuda or cuda:N that this machine has; otherwise ConfigError with the fix. Asks torch only for cuda,
    and not even then when the installed torch is a CPU-only build."""
    if device == "cpu":
        return
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise ConfigError(f"{what} must be cpu, cuda or cuda:N, got {device!r}")
    if _torch_is_cpu_only():
        raise ConfigError(f"{what} {device}: the installed torch is a CPU-only build; use --device cpu, or "
                          "install a CUDA build of torch")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{what} {device}: no CUDA device is visible (torch {torch.__version__}); "
                          "use --device cpu, or check the driver and CUDA_VISIBLE_DEVICES")
    index, count = int(m.group(1) or 0), torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"{what} {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")


def _torch_is_cpu_only() -> bool:
    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False
