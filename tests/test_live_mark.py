"""The live mark is enforced: a test that reaches for real cgroups without ``@pytest.mark.live`` fails.

Why: ``pytest -m "not live"`` is the suite an ordinary user runs. An unmarked live test would skip
for them (hiding that it never ran) and, as root, create cgroups in a run that promised not to.
"""

from __future__ import annotations

import re

import pytest

from tests import livecg


def test_an_unmarked_test_that_needs_the_live_tier_fails() -> None:
    assert livecg.current_test is not None and livecg.current_test.name == "test_an_unmarked_test_that_needs_the_live_tier_fails"
    with pytest.raises(pytest.fail.Exception, match=r"not marked @pytest\.mark\.live"):
        livecg.require_live()
    with pytest.raises(pytest.fail.Exception, match="not marked"), livecg.memory_cgroup(16 << 20):
        pass


@pytest.mark.live
@pytest.mark.host_quiet(reason="asks whether the live tier is here; makes no group")
def test_a_marked_test_gets_the_live_tier_or_the_reason_it_cannot() -> None:
    reason = livecg.skip_reason()
    if reason is None:
        livecg.require_live()  # no failure, no skip: the live tier is here
    else:
        with pytest.raises(pytest.skip.Exception, match=re.escape(reason)):
            livecg.require_live()
