"""Where the shared fixtures are: ``../shared`` beside the checkout (as for developers and CI), or
``$LLMDIAG_SHARED`` when set."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LLMDIAG_SHARED", REPO.parent / "shared"))
EXTERNAL = SHARED / "fixtures" / "external"
