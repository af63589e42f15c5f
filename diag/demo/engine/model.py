"""A GGUF model written at test time: llama architecture, random weights, a byte-level vocabulary.

Why written, not downloaded: the engine scenarios need a real model file that llama.cpp loads, maps
and runs, of a size chosen per scenario (a few MiB for a queue behind the model lock, more than a
memory cgroup holds for page-cache thrashing) -- and nothing may be fetched from a model hub. The
weights are random (``numpy``'s generator, seeded), so the same seed and size give the same bytes,
and greedy decoding at temperature 0 gives the same text on every run.

The vocabulary is SentencePiece-style (``tokenizer.ggml.model = llama``) with the three control tokens
and the 256 byte tokens ``<0x00>``..``<0xFF>``: llama.cpp's byte fallback turns any text into byte
tokens, so no merges or pieces are needed. The output rows of every token but the printable ASCII bytes
are zero, so greedy decoding never picks a control token (each request generates exactly ``max_tokens``
tokens) nor half a UTF-8 character (each streamed token is one printable character).

The tensors are written one by one (``GGUFWriter.write_tensor_data``), so writing a model of hundreds
of MiB holds one tensor in memory, never the whole model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIB = 1 << 20
MIN_SIZE_BYTES = 1 * MIB
MAX_SIZE_BYTES = 2048 * MIB  # a scenario never needs more; the cgroup limits stop at 4 GiB
N_VOCAB = 3 + 256  # <unk>, <s>, </s>, then one token per byte
HEAD_DIM = 64
CONTEXT_LENGTH = 4096
_F32 = 4
# The tokens greedy decoding may pick: the printable ASCII bytes. Every other output row is zero.
PRINTABLE = np.zeros(N_VOCAB, dtype=bool)
PRINTABLE[3 + 0x20 : 3 + 0x7F] = True


class EngineUnavailable(RuntimeError):
    """The ``engines`` extra (llama-cpp-python, gguf) is not installed; the message says how to get it."""


def _gguf():  # type: ignore[no-untyped-def]
    try:
        import gguf
    except ImportError as exc:
        raise EngineUnavailable("the gguf package is missing: pip install -c constraints.txt '.[engines]'") from exc
    return gguf


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that give a model of about the requested size (F32 throughout)."""

    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int

    @property
    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and numpy shape, in file order (llama.cpp's names; ggml's order is reversed)."""
        e, f = self.n_embd, self.n_ff
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (N_VOCAB, e))]
        for i in range(self.n_layer):
            b = f"blk.{i}"
            out += [
                (f"{b}.attn_norm.weight", (e,)),
                (f"{b}.attn_q.weight", (e, e)),
                (f"{b}.attn_k.weight", (e, e)),
                (f"{b}.attn_v.weight", (e, e)),
                (f"{b}.attn_output.weight", (e, e)),
                (f"{b}.ffn_norm.weight", (e,)),
                (f"{b}.ffn_gate.weight", (f, e)),
                (f"{b}.ffn_up.weight", (f, e)),
                (f"{b}.ffn_down.weight", (e, f)),
            ]
        out += [("output_norm.weight", (e,)), ("output.weight", (N_VOCAB, e))]
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(math.prod(shape) for _, shape in self.tensors) * _F32


def shape_for(size_bytes: int) -> ModelShape:
    """Dimensions for a model of about ``size_bytes`` of weights: four layers (two when tiny), the attention
    about half the budget, the feed-forward width filling the rest (so the size lands within a few KiB)."""
    if not MIN_SIZE_BYTES <= size_bytes <= MAX_SIZE_BYTES:
        raise ValueError(f"model size must be between {MIN_SIZE_BYTES // MIB} MiB and {MAX_SIZE_BYTES // MIB} MiB")
    n_layer = 2 if size_bytes < 8 * MIB else 4
    per_layer = size_bytes / n_layer / _F32
    n_embd = max(HEAD_DIM, int(math.sqrt(per_layer / 2 / 4)) // HEAD_DIM * HEAD_DIM)
    fixed = 2 * N_VOCAB * n_embd + n_embd  # embeddings, output, output norm
    ff_budget = (size_bytes / _F32 - fixed) / n_layer - 4 * n_embd * n_embd - 2 * n_embd
    n_ff = max(32, int(ff_budget / (3 * n_embd)) // 32 * 32)
    return ModelShape(n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=n_embd // HEAD_DIM)


@dataclass(frozen=True)
class WrittenModel:
    path: Path
    shape: ModelShape
    seed: int
    file_bytes: int


def _tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    fan_in = shape[-1]
    data = rng.standard_normal(shape, dtype=np.float32)
    data *= np.float32(1.0 / math.sqrt(fan_in))
    if name == "output.weight":
        data[~PRINTABLE] = 0.0  # a zero logit never wins a greedy step among ~95 random ones (see the module doc)
    return data


def write_model(path: str | Path, size_bytes: int, seed: int = 0) -> WrittenModel:
    """Write a llama-architecture GGUF of about ``size_bytes`` of weights to ``path``; same seed, same bytes."""
    gguf = _gguf()
    shape = shape_for(size_bytes)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name(f"llmdiag-random-{size_bytes // MIB}mib-seed{seed}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * N_VOCAB)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tshape in shape.tensors:
        writer.add_tensor_info(name, tshape, np.dtype(np.float32), math.prod(tshape) * _F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, tshape in shape.tensors:
        writer.write_tensor_data(_tensor(rng, name, tshape))
    writer.close()
    os.replace(tmp, path)
    return WrittenModel(path=path, shape=shape, seed=seed, file_bytes=path.stat().st_size)
