"""Where Grafana reads the generated dashboards from: one path for the provisioning file, `--help` and the README.

Why its own module: `diag dashboards --help` must name it without importing the dashboard builders (the SDK),
and a second spelling elsewhere is how a user ends up copying the JSON to one directory while Grafana reads
another. A test holds the README, the help and the generated provisioning.yaml to this value.
"""

from __future__ import annotations

GRAFANA_DASHBOARDS_DIR = "/var/lib/grafana/dashboards/llm-diag"
PROVISIONING_FILE = "provisioning.yaml"
