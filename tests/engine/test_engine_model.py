"""The GGUF the engine tests load: about the requested size, the same bytes for the same seed, readable by gguf.

Why a quick test beside the live ones: the model writer is plain file output, and a wrong shape or a
non-deterministic weight would only show later as a server that refuses the file or answers
differently run to run. Skips where the ``engines`` extra (gguf) is not installed, as in ``make check``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from diag.demo.engine.model import MIB, N_VOCAB, PRINTABLE, shape_for, write_model

gguf = pytest.importorskip("gguf", reason="the engines extra is not installed (pip install -c constraints.txt '.[engines]')")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("mib", [1, 3, 16, 64, 256, 1024])
def test_the_shape_lands_near_the_requested_size(mib: int) -> None:
    shape = shape_for(mib * MIB)
    assert abs(shape.weight_bytes - mib * MIB) <= 0.07 * mib * MIB, (shape, shape.weight_bytes / MIB)
    assert shape.n_embd % 64 == 0 and shape.n_head * 64 == shape.n_embd and shape.n_ff >= 32


@pytest.mark.parametrize("size", [0, MIB - 1, 4096 * MIB])
def test_a_size_out_of_range_is_refused_with_the_range(size: int) -> None:
    with pytest.raises(ValueError, match="between 1 MiB and 2048 MiB"):
        shape_for(size)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = write_model(tmp_path / "a.gguf", 2 * MIB, seed=3)
    b = write_model(tmp_path / "b.gguf", 2 * MIB, seed=3)
    c = write_model(tmp_path / "c.gguf", 2 * MIB, seed=4)
    assert _sha(a.path) == _sha(b.path) != _sha(c.path)
    assert not list(tmp_path.glob("*.partial"))  # written aside, then renamed into place


def test_the_file_is_a_llama_model_with_a_byte_vocabulary(tmp_path: Path) -> None:
    written = write_model(tmp_path / "m.gguf", 4 * MIB, seed=1)
    reader = gguf.GGUFReader(written.path)

    def field(name: str) -> object:
        return reader.fields[name].contents()

    assert field("general.architecture") == "llama" and field("tokenizer.ggml.model") == "llama"
    assert field("llama.embedding_length") == written.shape.n_embd and field("llama.block_count") == written.shape.n_layer
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == N_VOCAB and tokens[3 + ord("A")] == "<0x41>"
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(written.shape.tensors) and written.file_bytes > written.shape.weight_bytes
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [written.shape.n_ff, written.shape.n_embd]  # ggml order
    out = np.asarray(tensors["output.weight"].data)
    assert not out[~PRINTABLE].any() and out[PRINTABLE].any(axis=1).all()  # only printable bytes can win a greedy step
