"""The one place that patches NumPy for Numba; import it before any ``import numba``.

numba-cuda (as installed on the GPU machine, with NumPy 2.x) still refers to
``np.row_stack``, which NumPy removed; the first CUDA launch then fails with
``module 'numpy' has no attribute 'row_stack'``. ``np.vstack`` is the same
function, so we restore the alias before Numba is imported. The CPU kernels
import this too, so the package has exactly one import order for Numba.
"""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # type: ignore[attr-defined]

import numba  # noqa: E402  (must come after the patch above)

__all__ = ["numba"]
