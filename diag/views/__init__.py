"""What renders: the outputs people read, drawn from what the pipeline produced, deriving nothing themselves.

``snapshot`` (``diag snapshot``: rich tables or one JSON document), ``analysis`` (an Analysis in the terminal: the
verdict in plain words, the evidence, what could not be evaluated), ``charts`` (the chart primitives: matplotlib to
inline SVG, for the dashboards preview; the bundle's report shares their palette and envelope) and
``dashboards_preview`` (every generated panel's queries from a real Prometheus, drawn into one HTML page).

Layer: above the rules (a view renders their Analysis) and the generators (the preview draws the dashboards'
panels); below the bundle, triage, demo and live diagnosis, which use these views, and the CLI
(``tests/test_layers.py``).
"""
