"""Loaded by Python at start-up in every process ``diag wrap`` runs (its directory leads ``PYTHONPATH``).

It applies llm-diag's tracking (``collectors.tracking.wrapped``) when ``$LLMDIAG_WRAP`` is set, then runs
the ``sitecustomize`` this one shadows, if the environment has one, so a site's own start-up code still runs.
"""

import importlib.util
import os
import sys


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_llmdiag_chained_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if os.environ.get("LLMDIAG_WRAP"):
    try:
        from collectors.tracking.wrapped import install_from_env
    except ImportError as exc:
        print(
            f"diag wrap: llm-diag is not importable by {sys.executable} ({exc}); install it in that environment",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)  # an exception here would become a traceback and status 1
    install_from_env()
_chain_next_sitecustomize()
