"""A GGUF file as a model argument (common/modelsource.py): the file, or a directory holding exactly one, checked
from its header before anything loads; what transformers cannot read fails in one line that says which part.
The headers here are written with the gguf package's own GGUFWriter; loading a real GGUF end to end is in
tests/test_real_models.py (the `real` tier)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the `real` extra (gguf) is not installed")

from specrelay.common.errors import ConfigError  # noqa: E402
from specrelay.common.modelsource import check_model, pretrained_args  # noqa: E402


def write(path, arch: str = "llama", qtype=None) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # raw bytes of one block of a quantisation type
        _, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("token_embd.weight", np.zeros((1, size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_readable_gguf_file_or_its_only_directory_is_accepted(tmp_path):
    f = write(tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q4_0)
    assert check_model(f, "--model") == f
    assert check_model(str(tmp_path), "--draft-model") == f  # the one GGUF of a directory without config.json
    assert check_model(f, "--target-tokenizer", weights=False) == f
    assert pretrained_args(f) == (str(tmp_path), {"gguf_file": "m.gguf"})
    assert pretrained_args(str(tmp_path)) == (str(tmp_path), {})


def test_gguf_refusals_name_the_flag_and_the_cause(tmp_path):
    cases = {
        "not a GGUF file": lambda: (tmp_path / "a.gguf").write_bytes(b"PK\x03\x04 not gguf") and tmp_path / "a.gguf",
        "architecture 'nosucharch', which transformers": lambda: write(tmp_path / "b.gguf", "nosucharch"),
        "quantised as Q8_1, which gguf": lambda: write(tmp_path / "c.gguf", qtype=gguf.GGMLQuantizationType.Q8_1),
        "file .*missing.gguf does not exist": lambda: tmp_path / "missing.gguf",
    }
    for message, make in cases.items():
        with pytest.raises(ConfigError, match=f"^--model: .*{message}"):
            check_model(str(make()), "--model")
    two = tmp_path / "two"
    two.mkdir()
    write(two / "x.gguf")
    write(two / "y.gguf")
    with pytest.raises(ConfigError, match="holds 2 GGUF files .*name the file"):
        check_model(str(two), "--draft-model")
