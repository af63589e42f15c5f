"""``python -m diag.cli``: the ``diag`` command without its console script (the tests, the triage worker)."""

from diag.cli.main import app

app()
