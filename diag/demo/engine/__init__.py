"""A real inference engine no one here wrote: llama.cpp through llama-cpp-python's own server.

Why: the reference backend (``diag demo serve``) fakes nothing it can measure, but its queue, weights
and threads are ours. llama.cpp brings what ours cannot: weights mmap'd (or mlock'd) by C++ code,
native threads Python does not account for, its own request serialisation (llama-cpp-python's server
queues every request on one model lock), and a FastAPI app we did not write. No GPU and no download:
the model file is written here.

The modules, one job each:

- ``model.py``: ``write_model(path, size_bytes, seed)`` writes a llama-architecture GGUF of about that
  size with the ``gguf`` package (random weights from the seed, a byte-level vocabulary);
- ``server.py``: ``EngineServer(EngineSettings(model, n_ctx, n_threads, use_mmap, use_mlock), log, group)``
  starts ``python -m llama_cpp.server`` on 127.0.0.1 (inside a ``ScenarioCgroups`` memory group when one
  is given), polls it ready and stops it by PID; ``unavailable_reason()`` says when the extra is missing;
- ``client.py``: requests through the OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``,
  streamed or not) and load drivers that time each request as the client sees it (``RequestTiming`` rows);
- ``pagecache.py``: the model file dropped from the page cache, the running group's limit set from what
  the server holds besides the file (the mmap thrashing scenario);
- ``copies.py``: several servers with private copies started together in one group, and the limit that holds the
  running copies but not one more (the fourth-copy OOM).

The incidents as scenarios: ``diag demo --scenario engine-NAME`` (``diag/demo/scenarios/engine_scenarios.py``:
queue, thrash, mlock, copies, fourth-copy, n-ctx, healthy; ``--param attachment=wrapped`` runs the server under
``diag wrap`` where the scenario serves requests), and ``bench/accuracy.py --engine`` runs them all.

Entry points: the live tests in ``tests/engine/`` (``pytest tests/engine``; root for the memory cgroups,
and the ``engines`` extra: ``pip install -c constraints.txt '.[engines]'``, which ``make test`` installs).
A minimal session::

    from pathlib import Path
    from diag.demo.engine.model import write_model
    from diag.demo.engine.server import EngineServer, EngineSettings
    from diag.demo.engine.client import drive

    model = write_model("/tmp/m.gguf", 64 << 20, seed=7)
    with EngineServer(EngineSettings(model=model.path), Path("/tmp/server.log")) as server:
        rows = drive(server.url, ["hello"] * 16, concurrency=4, max_tokens=16, pid=server.pid)

The optional packages (``llama_cpp``, ``gguf``) are imported only where used, so importing this package
never needs the extra.
"""
