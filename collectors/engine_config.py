"""An inference engine's memory-shaping settings, read from outside: llama-cpp-python's server command line and its
GGUF model's header, as one ``ServiceConfig`` record per server process.

Why here: the ``unsafe_config`` rule judges settings no sampler sees (a context length whose KV cache outweighs
the model, weights pinned with mlock), and an engine we did not write writes no ``ServiceConfig`` of its own. Its
command line is already read for every sampled process; the KV cache's size follows from it and from four
numbers in the model file's header (layers, heads, KV heads, head width), read here because rules never read
files.

What is kept, and only that: the flags in ``_FLAGS`` (context length, batch, threads, mmap/mlock, KV cache types,
the model's path) -- never another argument's value, so an ``--api_key`` or a URL with a token never reaches a
record. The command line read is the sampler's redacted display (space-joined argv, secrets already masked): a
path holding spaces is not split back (its shape is then missing, and the record says why). A relative ``--model``
is resolved against the model files the process holds; an absolute one is taken as given.

Bounded: the header is read up to ``MAX_HEADER_BYTES`` and parsed until the wanted keys are found (they come
before the tokenizer's arrays in converted models); a value past the bound is missing, and the record says so.
One record per (pid, start time); the cache of seen processes forgets those no longer sampled.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from collectors.records import ProcessSample, ServiceConfig

SERVICE = "llama_cpp.server"
MAX_HEADER_BYTES = 1 << 20
_MODULE = "llama_cpp.server"
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
# flag -> (settings key, parser). Every other argument is skipped, value and all.
_FLAGS: dict[str, tuple[str, str]] = {
    "--model": ("model_path", "str"),
    "--n_ctx": ("n_ctx", "int"),
    "--n_batch": ("n_batch", "int"),
    "--n_ubatch": ("n_ubatch", "int"),
    "--n_threads": ("n_threads", "int"),
    "--n_gpu_layers": ("n_gpu_layers", "int"),
    "--use_mmap": ("use_mmap", "bool"),
    "--use_mlock": ("use_mlock", "bool"),
    "--type_k": ("type_k", "int"),
    "--type_v": ("type_v", "int"),
}
# llama-cpp-python's server defaults for the flags above, where the KV arithmetic needs one (its settings.py).
_DEFAULTS: dict[str, Any] = {"n_ctx": 2048, "use_mmap": True}
# ggml type id -> (name, bytes per element) for the KV cache types llama.cpp accepts; quantised ones per block.
GGML_TYPES: dict[int, tuple[str, float]] = {
    0: ("f32", 4.0),
    1: ("f16", 2.0),
    2: ("q4_0", 18 / 32),
    3: ("q4_1", 20 / 32),
    6: ("q5_0", 22 / 32),
    7: ("q5_1", 24 / 32),
    8: ("q8_0", 34 / 32),
    30: ("bf16", 2.0),
}
F16 = 1


def llama_cpp_argv(argv: Sequence[str]) -> dict[str, Any] | None:
    """The kept flags of a ``python -m llama_cpp.server`` command line, or None for any other process.

    Both ``--flag value`` and ``--flag=value``; a value that does not parse is left out rather than guessed.
    """
    try:
        at = next(i for i in range(len(argv) - 1) if argv[i] == "-m" and argv[i + 1] == _MODULE)
    except StopIteration:
        return None
    out: dict[str, Any] = {}
    args = list(argv[at + 2 :])
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        spec = _FLAGS.get(flag)
        if spec is None:
            i += 1
            continue
        if eq:
            value, i = inline, i + 1
        elif i + 1 < len(args):
            value, i = args[i + 1], i + 2
        else:
            break
        key, kind = spec
        if kind == "int":
            if value.lstrip("-").isdigit() and len(value) <= 12:
                out[key] = int(value)
        elif kind == "bool":
            if value.lower() in _BOOL:
                out[key] = _BOOL[value.lower()]
        else:
            out[key] = value
    return out


# --------------------------------------------------------------------------- the GGUF header

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_WANTED = (
    "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv", "context_length",
    "attention.key_length", "attention.value_length",
)  # fmt: skip


class _Short(Exception):
    """The header runs past what was read."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise _Short
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS:  # skipped whole: nothing wanted is an array
                self.take(struct.calcsize(_SCALARS[itype]) * count)
            else:
                for _ in range(count):
                    self.value(itype)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_shape(path: str, max_bytes: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], str | None]:
    """The model's dimensions from a GGUF header, and why some are missing (None when all were found).

    Keys: n_layer, n_embd, n_head, n_head_kv, n_embd_k_gqa, n_embd_v_gqa, context_length (llama.cpp's names).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes)
    except OSError as exc:
        return {}, f"cannot read {path}: {os.strerror(exc.errno) if exc.errno else exc}"
    raw: dict[str, Any] = {}
    reason: str | None = None
    r = _Reader(data)
    try:
        if r.take(4) != b"GGUF":
            return {}, f"{path} is not a GGUF file"
        r.unpack("<I")  # version
        r.unpack("<Q")  # tensor count
        n_kv = r.unpack("<Q")
        arch = None
        for _ in range(min(n_kv, 100_000)):
            key, vtype = r.string(), r.unpack("<I")
            value = r.value(vtype)
            if key == "general.architecture":
                arch = value
            elif arch and key.startswith(f"{arch}."):
                raw[key[len(arch) + 1 :]] = value
            if arch and all(k in raw for k in _WANTED):
                break
    except _Short:
        reason = f"the header's first {max_bytes} bytes end before its model dimensions"
    except (ValueError, struct.error) as exc:
        reason = f"malformed GGUF header: {exc}"
    shape = _shape(raw)
    if shape:
        return shape, None  # the optional keys (KV heads, head widths) have llama.cpp's defaults when absent
    return shape, reason or "the header names no layer count, width or heads"


def _shape(raw: dict[str, Any]) -> dict[str, Any]:
    def num(key: str) -> int | None:
        v = raw.get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    n_layer, n_embd, n_head = num("block_count"), num("embedding_length"), num("attention.head_count")
    if not (n_layer and n_embd and n_head):
        return {}
    n_head_kv = num("attention.head_count_kv") or n_head
    k_len = num("attention.key_length") or n_embd // n_head
    v_len = num("attention.value_length") or n_embd // n_head
    shape = {
        "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "n_head_kv": n_head_kv,
        "n_embd_k_gqa": k_len * n_head_kv, "n_embd_v_gqa": v_len * n_head_kv,
    }  # fmt: skip
    if num("context_length"):
        shape["context_length"] = num("context_length")
    return shape


# --------------------------------------------------------------------------- one record per server


def _model_path(settings: dict[str, Any], sample: ProcessSample) -> str | None:
    """The ``--model`` value when it is absolute (a server is sampled before it maps its model); a relative one is
    resolved to the model file the process holds that ends with it (None until it holds one).

    Why not "the one model file it holds": a Python process holds other files with model-like names while it
    starts (site's ``.pth`` files), and the flag is the truth.
    """
    given = settings.get("model_path")
    if not isinstance(given, str) or not given:
        return None
    if os.path.isabs(given):
        return given
    tail = "/" + given.removeprefix("./")
    matches = [p for p in sample.model_files if p.endswith(tail)]
    return matches[0] if len(matches) == 1 else None


@dataclass
class EngineConfigs:
    """Turns sampled processes into one ``ServiceConfig`` per llama-cpp-python server (per pid and start time)."""

    max_header_bytes: int = MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        self._seen: set[tuple[int, float | None]] = set()
        # The command line last found not to be an engine's, per process: not split again while it stays the same
        # (a process that execs keeps its key and gets a new command line, so it is looked at again).
        self._other: dict[tuple[int, float | None], str] = {}

    def observe(self, ts: float, processes: Iterable[ProcessSample]) -> list[ServiceConfig]:
        out: list[ServiceConfig] = []
        current: set[tuple[int, float | None]] = set()
        for sample in processes:
            key = (sample.pid, sample.start_time_s)
            current.add(key)
            if key in self._seen or not sample.cmdline or self._other.get(key) == sample.cmdline:
                continue
            settings = llama_cpp_argv(sample.cmdline.split())
            if settings is None:
                self._other[key] = sample.cmdline
                continue
            path = _model_path(settings, sample)
            if "model_path" in settings and path is None:
                continue  # a relative path no held file resolves yet: the next sample sees the file once it is mapped
            self._seen.add(key)
            out.append(self._record(ts, settings, sample.pid, path))
        self._seen &= current  # a process no longer sampled is forgotten (bounded; a new start is a new key)
        self._other = {k: v for k, v in self._other.items() if k in current}
        return out

    def _record(self, ts: float, settings: dict[str, Any], pid: int, path: str | None) -> ServiceConfig:
        settings = {**_DEFAULTS, **settings, "engine": "llama.cpp"}
        if path is None:
            settings.pop("model_path", None)
        else:
            settings["model_path"] = path
            with contextlib.suppress(OSError):
                settings["weights_bytes"] = os.stat(path).st_size
            shape, reason = read_gguf_shape(path, self.max_header_bytes)
            settings.update(shape)
            if reason:
                settings["model_shape_missing"] = reason
        for key in ("type_k", "type_v"):
            settings[key] = GGML_TYPES.get(int(settings.get(key, F16)), (f"ggml type {settings.get(key)}", 0.0))[0]
        return ServiceConfig(ts=ts, service=SERVICE, pid=pid, settings=settings)


__all__ = ["GGML_TYPES", "SERVICE", "EngineConfigs", "llama_cpp_argv", "read_gguf_shape"]
