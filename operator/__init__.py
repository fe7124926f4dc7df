# Imported as the top-level `operator` (not `tandem.operator`), this folder stands in for the standard
# library's module of that name: the repo root is first on sys.path when `python -m pytest` (or any
# `python -m`) runs there, and collections, re and most of the standard library import `operator`.
# So load the standard library's module in this one's place: an import returns whatever sys.modules
# holds for the name once the module has run. tests/serving/test_process_imports.py runs pytest that way.
if __name__ == "operator":
    # Only the import system's own frozen modules: importlib.util or sysconfig would import collections,
    # which is what is importing this.
    import os as _os
    import sys as _sys
    from _frozen_importlib import module_from_spec as _module_from_spec
    from _frozen_importlib_external import PathFinder as _PathFinder

    _stdlib = getattr(_sys, "_stdlib_dir", None) or _os.path.dirname(_os.__file__)
    _spec = _PathFinder.find_spec("operator", [_stdlib])
    _stdlib_operator = _module_from_spec(_spec)
    _sys.modules["operator"] = _stdlib_operator
    _spec.loader.exec_module(_stdlib_operator)
