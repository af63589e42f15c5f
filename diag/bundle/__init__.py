"""Incident bundles: ``take_bundle(BundleOptions)`` -> a folder + .tar.gz that another machine can analyse.

Modules, one job each: ``plugins`` (what is collected: one declaration per subsystem, in order),
``plugin`` (the vocabulary those declarations use), ``runner`` (executing them, each step in an abandonable
worker under its deadline), ``bounded`` (tail-capped reads, commands killed at their deadline), ``redactor``
(the one pass every byte goes through), ``writer`` (files, SHA256SUMS, archive), ``selfcg`` (leaving the
diagnosed cgroup), ``charts`` + ``report`` (report.md / report.html), ``core`` (the order and the time
budget). The command, ``diag bundle``, is ``diag.cli.bundle``.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diag.bundle.core import BundleResult, take_bundle
    from diag.bundle.options import BundleOptions

__all__ = ["BundleOptions", "BundleResult", "take_bundle"]


def __getattr__(name: str) -> Any:
    """Lazy exports: importing the package (the CLI does, for `diag collect` too) must not pull numpy in."""
    if name in ("BundleResult", "take_bundle"):
        from diag.bundle import core

        return getattr(core, name)
    if name == "BundleOptions":
        from diag.bundle.options import BundleOptions

        return BundleOptions
    raise AttributeError(name)
