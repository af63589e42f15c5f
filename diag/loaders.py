"""Compatibility names: the loaders moved to ``diag.sources`` (recorder, bundle, prometheus); import from there."""

from diag.sources.bundle import load_bundle
from diag.sources.recorder import load_recorder

__all__ = ["load_bundle", "load_recorder"]
