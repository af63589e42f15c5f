"""The ``diag`` command line: one module per command group, each a thin shell over a library call.

``main`` is the root Typer app (the console script ``diag`` and ``python -m diag.cli``) and registers the
groups in the order ``diag --help`` lists them: ``snapshot``, ``collect``, ``analyze``, ``alerts``, ``bundle``,
``demo``, ``dashboards``, ``triage`` and ``tickets`` (``triage``). Beside them, what every command shares:
``options`` (each value checked before work starts, one line naming the option, the value and the accepted
forms) and ``errors`` (Typer's own usage errors in the same one-line form, exit status 2).

This package is the top of the house: it may import anything in ``diag``, and nothing in ``diag`` imports it
(``tests/test_layers.py``). Its ``__init__`` imports nothing, so ``python -m diag.cli.demo serve`` (each worker
of the reference backend) does not pay for the other commands.
"""
