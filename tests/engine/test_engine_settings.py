"""The engine's settings read from outside (``collectors/engine_config.py``): llama-cpp-python's server flags, the
GGUF header's dimensions, one ``ServiceConfig`` per server process -- no engine, no root, no process.

The GGUF headers are built here byte by byte (the format's own layout), so the parser is checked against the
format rather than against the writer the live tests use.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from collectors.engine_config import SERVICE, EngineConfigs, llama_cpp_argv, read_gguf_shape
from collectors.records import ProcessSample

PY = ["/usr/bin/python3", "-m", "llama_cpp.server"]


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, value: object) -> bytes:
    fmt = {4: "<I", 5: "<i", 6: "<f", 10: "<Q"}
    if vtype == 8:
        body = _str(str(value))
    elif vtype == 9:  # an array of strings, as a tokenizer's vocabulary
        items = list(value)  # type: ignore[call-overload]
        body = struct.pack("<IQ", 8, len(items)) + b"".join(_str(i) for i in items)
    else:
        body = struct.pack(fmt[vtype], value)
    return _str(key) + struct.pack("<I", vtype) + body


def _gguf(path: Path, kvs: list[bytes]) -> Path:
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs) + b"\0" * 64)
    return path


def _llama(path: Path, *, head_count_kv: int | None = 4, key_length: int | None = None, tokens_first: bool = False) -> Path:
    arch = [_kv("general.architecture", 8, "llama"), _kv("general.name", 8, "t")]
    dims = [
        _kv("llama.context_length", 4, 4096),
        _kv("llama.embedding_length", 4, 2048),
        _kv("llama.block_count", 4, 16),
        _kv("llama.attention.head_count", 4, 32),
    ]
    if head_count_kv is not None:
        dims.append(_kv("llama.attention.head_count_kv", 4, head_count_kv))
    if key_length is not None:
        dims.append(_kv("llama.attention.key_length", 4, key_length))
    tokens = [_kv("tokenizer.ggml.tokens", 9, [f"t{i}" for i in range(3000)])]
    return _gguf(path, arch + (tokens + dims if tokens_first else dims + tokens))


# --------------------------------------------------------------------------- the command line


def test_only_the_memory_flags_are_kept_never_another_arguments_value() -> None:
    argv = [*PY, "--model", "/m/a.gguf", "--api_key", "s3cr3t", "--n_ctx=32768", "--use_mlock", "true", "--n_threads", "4",
            "--type_k", "8", "--host", "0.0.0.0", "--use_mmap", "False"]  # fmt: skip
    got = llama_cpp_argv(argv)
    assert got == {"model_path": "/m/a.gguf", "n_ctx": 32768, "use_mlock": True, "n_threads": 4, "type_k": 8, "use_mmap": False}
    assert "s3cr3t" not in repr(got) and "0.0.0.0" not in repr(got)


@pytest.mark.parametrize(
    "argv",
    [
        ["/usr/bin/python3", "-m", "http.server", "--n_ctx", "5"],
        ["/usr/bin/llama-server", "--n_ctx", "5"],
        ["python3", "llama_cpp.server"],
        [],
    ],
)
def test_other_processes_are_not_engines(argv: list[str]) -> None:
    assert llama_cpp_argv(argv) is None


def test_values_that_do_not_parse_are_left_out_not_guessed() -> None:
    assert llama_cpp_argv([*PY, "--n_ctx", "lots", "--use_mlock", "maybe", "--n_batch"]) == {}


# --------------------------------------------------------------------------- the GGUF header


def test_the_dimensions_of_a_gqa_model_with_the_head_width_derived(tmp_path: Path) -> None:
    shape, reason = read_gguf_shape(str(_llama(tmp_path / "m.gguf")))
    assert reason is None
    assert shape == {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 4, "n_embd_k_gqa": 256, "n_embd_v_gqa": 256,
                     "context_length": 4096}  # fmt: skip


def test_an_explicit_key_length_and_no_kv_head_count(tmp_path: Path) -> None:
    shape, _ = read_gguf_shape(str(_llama(tmp_path / "m.gguf", head_count_kv=None, key_length=128)))
    assert shape["n_head_kv"] == 32 and shape["n_embd_k_gqa"] == 32 * 128 and shape["n_embd_v_gqa"] == 32 * 64


def test_a_vocabulary_before_the_dimensions_is_walked_and_a_short_read_says_so(tmp_path: Path) -> None:
    path = str(_llama(tmp_path / "m.gguf", tokens_first=True))
    assert read_gguf_shape(path)[0]["n_layer"] == 16
    shape, reason = read_gguf_shape(path, max_bytes=4096)  # the vocabulary alone is ~30 KB
    assert shape == {} and reason is not None and "4096 bytes" in reason


def test_not_a_gguf_or_unreadable_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert read_gguf_shape(str(tmp_path / "x.bin")) == ({}, f"{tmp_path / 'x.bin'} is not a GGUF file")
    shape, reason = read_gguf_shape(str(tmp_path / "missing.gguf"))
    assert shape == {} and reason is not None and "cannot read" in reason
    bad = _gguf(tmp_path / "bad.gguf", [_str("general.architecture") + struct.pack("<I", 77)])
    assert "malformed" in (read_gguf_shape(str(bad))[1] or "")


# --------------------------------------------------------------------------- one record per server


def _sample(pid: int, start: float, cmdline: str, model_files: list[str] | None = None) -> ProcessSample:
    return ProcessSample(ts=1.0, pid=pid, start_time_s=start, cmdline=cmdline, model_files=model_files or [])


def test_one_config_per_server_process_with_its_model_and_cache_types(tmp_path: Path) -> None:
    model = _llama(tmp_path / "m.gguf")
    configs = EngineConfigs()
    line = " ".join([*PY, "--model", str(model), "--n_ctx", "8192", "--type_v", "8", "--api_key", "<redacted>"])
    first = configs.observe(1.0, [_sample(10, 5.0, line), _sample(11, 6.0, "/usr/bin/bash")])
    assert len(first) == 1 and first[0].service == SERVICE and first[0].pid == 10
    s = first[0].settings
    assert s["engine"] == "llama.cpp" and s["n_ctx"] == 8192 and s["model_path"] == str(model)
    assert s["weights_bytes"] == model.stat().st_size and s["n_layer"] == 16 and s["n_embd_k_gqa"] == 256
    assert s["type_k"] == "f16" and s["type_v"] == "q8_0" and s["use_mmap"] is True
    assert configs.observe(2.0, [_sample(10, 5.0, line)]) == []  # once per process
    assert len(configs.observe(3.0, [_sample(10, 9.0, line)])) == 1  # the pid reused by a new start: a new server


def test_a_process_that_execs_into_a_server_is_looked_at_again(tmp_path: Path) -> None:
    model = _llama(tmp_path / "m.gguf")
    configs = EngineConfigs()
    assert configs.observe(1.0, [_sample(10, 5.0, "/usr/bin/python3 -c gate")]) == []
    assert configs.observe(2.0, [_sample(10, 5.0, "/usr/bin/python3 -c gate")]) == []
    (cfg,) = configs.observe(3.0, [_sample(10, 5.0, " ".join([*PY, "--model", str(model)]))])  # same pid, new argv
    assert cfg.pid == 10


def test_a_relative_model_path_waits_for_the_file_the_process_holds(tmp_path: Path) -> None:
    model = _llama(tmp_path / "m.gguf")
    configs = EngineConfigs()
    line = " ".join([*PY, "--model", "./m.gguf"])
    assert configs.observe(1.0, [_sample(10, 5.0, line)]) == []
    (cfg,) = configs.observe(2.0, [_sample(10, 5.0, line, [str(model)])])
    assert cfg.settings["model_path"] == str(model) and cfg.settings["n_layer"] == 16


def test_other_held_files_never_stand_in_for_the_model(tmp_path: Path) -> None:
    """A Python process starting up holds its site's ``.pth`` files: a model-like name that is not the model."""
    model = _llama(tmp_path / "m.gguf")
    pth = tmp_path / "__editable__.x.pth"
    pth.write_text("import x\n")
    (cfg,) = EngineConfigs().observe(1.0, [_sample(10, 5.0, " ".join([*PY, "--model", str(model)]), [str(pth)])])
    assert cfg.settings["model_path"] == str(model) and cfg.settings["n_layer"] == 16
    relative = EngineConfigs()
    line = " ".join([*PY, "--model", "m.gguf"])
    assert relative.observe(1.0, [_sample(11, 5.0, line, [str(pth)])]) == []  # waits for the model itself
    (cfg,) = relative.observe(2.0, [_sample(11, 5.0, line, [str(pth), str(model)])])
    assert cfg.settings["model_path"] == str(model)


def test_an_unreadable_model_is_named_and_the_flags_still_recorded(tmp_path: Path) -> None:
    line = " ".join([*PY, "--model", str(tmp_path / "gone.gguf"), "--n_ctx", "4096"])
    (cfg,) = EngineConfigs().observe(1.0, [_sample(10, 5.0, line)])
    assert cfg.settings["n_ctx"] == 4096 and "n_layer" not in cfg.settings and "weights_bytes" not in cfg.settings
    assert "cannot read" in cfg.settings["model_shape_missing"]
