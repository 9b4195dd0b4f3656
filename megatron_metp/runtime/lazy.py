"""Public names of a package imported on first use (PEP 562), so that importing the package, or a
torch-free submodule of it, does not import what the names need (torch)."""

from __future__ import annotations

import importlib
import sys
from typing import Dict, Iterable


def lazy_names(package: str, where: Dict[str, str], public: Iterable[str]):
    """``(__getattr__, __dir__)`` for ``package``: ``where`` maps each public name to the
    submodule (relative, without the dot) that defines it; a name is imported once, then kept
    in the package."""
    public = list(public)

    def __getattr__(name):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__
