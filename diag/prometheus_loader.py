"""Compatibility names: the Prometheus loader moved to ``diag.sources.prometheus``; import from there."""

from diag.sources.prometheus import default_step, load_prometheus

__all__ = ["default_step", "load_prometheus"]
