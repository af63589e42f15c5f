"""Suite-wide test plumbing.

- Live tests (root, real cgroups, /dev/kmsg) carry ``@pytest.mark.live`` so that
  ``pytest -m "not live"`` is the suite an ordinary user can run. The mark is enforced, not trusted:
  ``tests.livecg.require_live`` (which every cgroup helper calls) fails a test that needs the live
  tier without the mark, so a new unmarked live test fails loudly as root instead of skipping
  silently for everyone else.
- Shared helpers live in helper modules (``tests/livecg.py``, ``tests/promserver.py``,
  ``tests/paths.py``, ``tests/diag/*_builders.py``, ``tests/bundle/helpers.py``); test modules never
  import each other (``tests/test_import_cycles.py`` checks it).
"""

from __future__ import annotations

import pytest

from tests import livecg


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tell the live helpers which test is being set up (before any of its fixtures run)."""
    livecg.current_test = item


def pytest_runtest_teardown(item: pytest.Item) -> None:
    livecg.current_test = None
