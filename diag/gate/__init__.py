"""``diag gate``: a stepped load test against an inference endpoint, judged on the client's latencies and
errors *and* on what the host's memory did, with the rules engine's diagnosis of every step.

Modules, each one job: ``spec`` (the YAML contract, validated), ``load`` (the open- and closed-loop load
generator), ``host`` (the agent sampling during the run, a step's PSI and OOM kills), ``criteria`` (PASS/FAIL
per criterion), ``runner`` (the steps in order, Ctrl-C included), ``report`` (the table and the JSON).
"""
