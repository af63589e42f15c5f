"""The diagnosis while the agent runs (``diag collect --diagnose-every``): ``diagnosis.LiveDiagnosis`` reads the
recorder's last minutes through ``diag.sources``, runs ``diag.rules`` on them and exports the verdict as
``llmdiag_incident{class}`` metrics on the agent's own registry.

Why a package of its own, beside ``bundle``, ``triage`` and ``demo``: like them it is a consumer at the end of the
pipeline (sources -> Timeline -> rules -> an output: here Prometheus metrics), so it may import those layers and
none of them may import it. It is neither a source (it judges) nor a view (it keeps state and runs on a thread), and
it cannot live with the agent in ``collectors``, which never imports ``diag``: ``diag.cli.collect`` attaches it to
the agent, and checks its option.
"""
