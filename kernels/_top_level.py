"""This folder is ``kvpool.kernels``. From a checkout's root (``python -m ...`` run there, the
test runner) it is also importable as a top-level ``kernels``: the import name of Hugging
Face's ``kernels`` distribution, which transformers imports whenever it is installed (it is a
dependency of transformers from 5.25). Imported under that name, the folder hands the name to
the installed distribution instead of shadowing it, and where none is installed it stays an
empty package (it never loads kvpool's kernels under another name)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def give_way() -> None:
    """Replace ``sys.modules["kernels"]`` (this folder, imported as top-level ``kernels``) by the
    installed ``kernels`` distribution, found on ``sys.path`` without this checkout's root.
    Without one the module stays as it is, empty: transformers then finds no version on it and
    takes the package for absent, as it does where none is installed."""
    checkout = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    others = [p for p in sys.path if os.path.realpath(p or os.curdir) != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise
