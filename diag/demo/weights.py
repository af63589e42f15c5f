"""The demo model's checkpoint: shapes, deterministic generation, loading, and the refresh policy.

Shapes (``ModelConfig``; defaults d_model 256, 4 heads, 2 layers, FFN 512, vocab 259 = 256 bytes +
BOS/EOS/PAD). Per layer: ``wq/wk/wv/wo`` [d, d], two RMSNorm gains [d], and either a dense FFN
(``w1`` [d, ffn], ``w2`` [ffn, d]) or, with ``experts`` E > 0, an MoE FFN (``router`` [d, E],
``experts_w1`` [E, d, ffn], ``experts_w2`` [E, ffn, d]). The token embedding [259, d] is tied to the
output projection. Everything else of the ``--weights-mb`` budget goes to ``ngram_table`` [R, d]: a
hashed trigram embedding (each token adds the row its last three bytes hash to). That table is why
a 200 MB model still answers in milliseconds: a token *reads one row* of it, so the bytes are real
and resident but the per-token compute stays ~1 M multiply-adds (plus top-k experts with MoE).

Two ways to load, mirroring the duplicate-model incident:
- ``per-worker``: ``safetensors.numpy.load_file`` copies every tensor into private numpy arrays, so
  each worker's RSS grows by the model size (anonymous memory, N workers -> N copies).
- ``shared``: one read-only ``mmap`` of the file; tensors are zero-copy views into it, so the page
  cache holds one copy and the workers' PSS sums to about one model.

In both modes the process keeps the file mapped read-only for as long as the weights live (in
``per-worker`` mode only the header pages are touched). That is true, not a trick: the header and
metadata are read through that mapping, and it is how a process sampler sees "this process holds the
model file" in ``/proc/<pid>/maps`` whichever way the tensors were loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

PreloadMode = Literal["per-worker", "shared"]
RefreshMode = Literal["none", "every-request", "ttl"]
PRELOAD_MODES: tuple[str, ...] = ("per-worker", "shared")
REFRESH_MODES: tuple[str, ...] = ("none", "every-request", "ttl")

VOCAB_BYTES = 256
BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
MIN_TABLE_ROWS = 1024


@dataclass(frozen=True)
class ModelConfig:
    """Everything that decides the checkpoint's bytes. Same config + seed -> same file, bit for bit."""

    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 2
    ffn: int = 512
    experts: int = 0
    top_k: int = 2
    table_rows: int = MIN_TABLE_ROWS
    vocab: int = VOCAB
    seed: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ValueError("top_k must be between 1 and the number of experts")
        if self.table_rows < 1:
            raise ValueError("table_rows must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor in the checkpoint."""
        d, f, e = self.d_model, self.ffn, self.experts
        out: dict[str, tuple[int, ...]] = {
            "tok_emb": (self.vocab, d),
            "ngram_table": (self.table_rows, d),
            "final_norm": (d,),
        }
        for i in range(self.n_layers):
            p = f"layers.{i}."
            out |= {p + "attn_norm": (d,), p + "wq": (d, d), p + "wk": (d, d), p + "wv": (d, d), p + "wo": (d, d)}
            out[p + "ffn_norm"] = (d,)
            if e:
                out |= {p + "router": (d, e), p + "experts_w1": (e, d, f), p + "experts_w2": (e, f, d)}
            else:
                out |= {p + "w1": (d, f), p + "w2": (f, d)}
        return out

    def nbytes(self) -> int:
        return sum(4 * int(np.prod(s)) for s in self.shapes().values())

    @classmethod
    def for_budget(cls, weights_mb: float, *, experts: int = 0, top_k: int = 2, seed: int = 0, **kw: Any) -> ModelConfig:
        """Size the n-gram table so the whole checkpoint is about ``weights_mb`` MiB.

        The transformer core is fixed by the other fields; if it alone exceeds the budget the table
        keeps its minimum (MIN_TABLE_ROWS) and the file is larger than asked (say so in the logs).
        """
        base = cls(experts=experts, top_k=min(top_k, experts) if experts else top_k, seed=seed, **kw)
        core = base.nbytes() - 4 * base.table_rows * base.d_model
        rows = int((weights_mb * 1024 * 1024 - core) // (4 * base.d_model))
        return dataclasses.replace(base, table_rows=max(MIN_TABLE_ROWS, rows))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in known})

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]


def default_weights_dir() -> Path:
    """``<user cache dir>/llm-diag/demo`` (e.g. ~/.cache/llm-diag/demo): regenerable, so a cache."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("llm-diag")) / "demo"


def weights_path(weights_dir: str | os.PathLike[str], config: ModelConfig) -> Path:
    mib = config.nbytes() / (1024 * 1024)
    return Path(weights_dir) / f"demo-{mib:.0f}mib-e{config.experts}-{config.digest()}.safetensors"


def generate_tensors(config: ModelConfig) -> dict[str, np.ndarray]:
    """Deterministic float32 tensors: each from its own child seed, so order and additions do not matter."""
    out: dict[str, np.ndarray] = {}
    for name, shape in config.shapes().items():
        if name.endswith("norm"):
            out[name] = np.ones(shape, dtype=np.float32)
            continue
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        rng = np.random.default_rng([config.seed, key])
        fan_in = shape[-2] if len(shape) >= 2 and name != "ngram_table" and name != "tok_emb" else 50
        std = 1.0 / np.sqrt(fan_in)
        arr = rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(std)
        out[name] = arr
    return out


def ensure_weights(weights_dir: str | os.PathLike[str], config: ModelConfig) -> Path:
    """Return the checkpoint for ``config``, generating it on first use.

    Written to a temporary name and renamed, so a worker (or a second server) never sees half a file.
    """
    from safetensors.numpy import save_file

    path = weights_path(weights_dir, config)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tensors = generate_tensors(config)
        # One metadata key: safetensors writes the metadata map in hash order, and the file must be
        # the same bytes on every run.
        save_file(tensors, str(tmp), metadata={"config": config.to_json()})
        del tensors
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path


# --------------------------------------------------------------------------- loading


@dataclass
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int


def read_header(buf: Any) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors header from any buffer (the mmap): u64 LE length, JSON, then the data."""
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    header = json.loads(bytes(buf[8 : 8 + n]))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    infos = {
        name: TensorInfo(h["dtype"], tuple(h["shape"]), base + h["data_offsets"][0], base + h["data_offsets"][1])
        for name, h in header.items()
    }
    return infos, meta


_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


@dataclass
class LoadedWeights:
    """The tensors of one load plus the read-only mapping of the file that stays open alongside them."""

    path: Path
    mode: PreloadMode
    config: ModelConfig
    tensors: dict[str, np.ndarray]
    file_bytes: int
    loaded_at: float
    mtime_ns: int
    checksum: float
    _map: mmap.mmap | None = dataclasses.field(default=None, repr=False)

    def close(self) -> None:
        """Drop the mapping (views into it must be gone: in shared mode call this only when unused)."""
        m, self._map = self._map, None
        if m is not None:
            with contextlib.suppress(BufferError):  # a batch in flight still holds views; GC will unmap
                m.close()


def load_weights(path: str | os.PathLike[str], mode: PreloadMode) -> LoadedWeights:
    """Load the checkpoint as private copies (``per-worker``) or zero-copy mmap views (``shared``).

    Both modes touch every weight page once (a checksum, like a loader's validation pass), so RSS
    reflects the whole model right after start, as it does for a real server after warm-up.
    """
    if mode not in PRELOAD_MODES:
        raise ValueError(f"preload mode must be one of {PRELOAD_MODES}")
    p = Path(path)
    with open(p, "rb") as fh:
        st = os.fstat(fh.fileno())
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # the fd may close; the mapping stays
    infos, meta = read_header(m)
    config = ModelConfig.from_json(meta["config"]) if "config" in meta else None
    if config is None:
        raise ValueError(f"{p} is not a demo checkpoint (no config metadata)")
    tensors: dict[str, np.ndarray]
    if mode == "shared":
        tensors = {}
        for name, info in infos.items():
            dt = np.dtype(_DTYPES[info.dtype])
            count = (info.end - info.begin) // dt.itemsize
            tensors[name] = np.frombuffer(m, dtype=dt, count=count, offset=info.begin).reshape(info.shape)
        with contextlib.suppress(OSError, AttributeError):
            m.madvise(mmap.MADV_WILLNEED)
    else:
        from safetensors.numpy import load_file

        tensors = load_file(str(p))  # reads into private, writable arrays
    checksum = float(sum(float(np.sum(t, dtype=np.float64)) for t in tensors.values()))
    return LoadedWeights(p, mode, config, tensors, st.st_size, time.time(), st.st_mtime_ns, checksum, m)


# --------------------------------------------------------------------------- refresh policy

LoaderHook = Callable[..., contextlib.AbstractContextManager[Any]]


@contextlib.contextmanager
def _no_hook(name: str, **_: Any) -> Iterator[None]:
    yield


class WeightRegistry:
    """Hands out the current weights and applies the refresh policy -- the "model registry" of the incidents.

    - ``none``: loaded once at start.
    - ``every-request``: :meth:`for_request` re-reads the whole checkpoint *on the request path*, every
      request (the blocking-loader incident; it blocks the caller, by design).
    - ``ttl``: a cache. A background thread revalidates every ``ttl_s`` (stat; re-read only if the
      file changed), so nothing is read on the request path after warm-up.

    Every load goes through ``loader_hook(name, bytes_read=, cache_hit=)`` (the tracker's
    ``track_loader``), which decides from its own state whether the load sat in a request's window.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        mode: PreloadMode = "per-worker",
        refresh: RefreshMode = "none",
        ttl_s: float = 300.0,
        loader_hook: LoaderHook | None = None,
    ) -> None:
        if refresh not in REFRESH_MODES:
            raise ValueError(f"refresh mode must be one of {REFRESH_MODES}")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.path = Path(path)
        self.mode: PreloadMode = mode
        self.refresh: RefreshMode = refresh
        self.ttl_s = ttl_s
        self._hook = loader_hook or _no_hook
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.loads = 0
        self.current = self._load(cache_hit=False)
        if refresh == "ttl":
            self._thread = threading.Thread(target=self._revalidate_loop, name="demo-weights-ttl", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _load(self, cache_hit: bool) -> LoadedWeights:
        size = self.path.stat().st_size
        with self._hook("checkpoint", bytes_read=size, cache_hit=cache_hit):
            weights = load_weights(self.path, self.mode)
        self.loads += 1
        return weights

    def _swap(self, new: LoadedWeights) -> None:
        old, self.current = self.current, new
        if old is not new and old.mode == "per-worker":
            old.close()  # private arrays do not depend on the mapping; shared views may still be in use

    def for_request(self) -> LoadedWeights:
        """The weights a request should use, applying the refresh policy (may block: see class doc)."""
        if self.refresh == "every-request":
            with self._lock:
                self._swap(self._load(cache_hit=False))
        return self.current

    def _revalidate_loop(self) -> None:
        while not self._stop.wait(self.ttl_s):
            self.revalidate()

    def revalidate(self) -> bool:
        """Re-read the checkpoint if it changed on disk. Returns True when it was re-read."""
        try:
            st = self.path.stat()
            if st.st_mtime_ns == self.current.mtime_ns and st.st_size == self.current.file_bytes:
                with self._hook("checkpoint", bytes_read=0, cache_hit=True):
                    self.current.loaded_at = time.time()
                return False
            with self._lock:
                self._swap(self._load(cache_hit=False))
            return True
        except OSError:
            return False  # keep serving the weights we have; the next round tries again
