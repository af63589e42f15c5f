"""Where the test fixtures are. Everything lives inside the repository (``tests/fixtures``), so a
plain clone with nothing beside it runs the whole suite; external captures are vendored under
``tests/fixtures/external`` with their provenance and licences."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
EXTERNAL = FIXTURES / "external"
