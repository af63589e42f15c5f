"""``diag demo serve``: a reference LLM backend on which every failure mode llm-diag diagnoses can be reproduced.

Why it exists: the rules need real evidence -- four workers really holding four copies of a model, a
loader really re-reading its checkpoint on the request path, a queue really backing up behind one
inference slot, a batcher really forming a batch ten times the tokens of the last one, an MoE router
really sending every token to one expert. A numpy model small enough for a 2-core CI box, served by
FastAPI behind uvicorn's multi-process supervisor and instrumented with ``collectors.tracking``,
gives all of that for real. It is also the worked example users copy to instrument their own server.

Modules, one job each:
- ``weights``: the model's shapes, the deterministic ``.safetensors`` checkpoint, loading it as a
  private copy or a shared read-only mmap, and the refresh policy (none / every request / TTL).
- ``model``: the byte tokenizer and the decoder-only transformer (KV cache, optional MoE FFN).
- ``batcher``: forms batches by request count or token budget and runs them on one model thread.
- ``settings``: the frozen settings handed from the launcher to every spawned worker (as JSON).
- ``app``: the FastAPI app factory (``/v1/completions``, ``/healthz``, ``/metrics``).
- ``server``: the multi-worker launcher (uvicorn's spawn supervisor, PROMETHEUS_MULTIPROC_DIR).
- the ``demo serve`` command and ``demo --scenario NAME`` are ``diag.cli.demo`` (``python -m diag.cli.demo serve``
  runs the backend without the rest of the CLI).
- ``harness``: start it as a subprocess on a free loopback port, wait until ready, load it, stop it
  by PID (tests, scenarios, benches).
- ``scenarios``: every incident class reproduced for real on this backend, inside real memory
  cgroups, recorded by the host agent and analysed (``diag demo --scenario NAME``).
"""
