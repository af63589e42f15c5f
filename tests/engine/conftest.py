"""What the engine tests share: one model file per session, and the skips where the engine cannot run.

Why one file: writing a GGUF of tens of MiB costs seconds of CPU on a busy 2-core host, and every test
here only reads it (the thrashing test drops it from the page cache first, see its docstring).
"""

from __future__ import annotations

import pytest

from diag.demo.engine.model import MIB, WrittenModel, write_model
from diag.demo.engine.server import unavailable_reason
from tests.livecg import require_live

MODEL_MIB = 64
MODEL_SEED = 7


@pytest.fixture(scope="session")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> WrittenModel:
    require_live()  # first: without root there is nothing to write the model for
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("engine-model")
    return write_model(folder / f"random-{MODEL_MIB}mib-seed{MODEL_SEED}.gguf", MODEL_MIB * MIB, seed=MODEL_SEED)
