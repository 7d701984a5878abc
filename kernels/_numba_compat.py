"""The one place that imports Numba for the kernels: a NumPy patch first, then the threading layer.

numba-cuda (as installed on the GPU machine, with NumPy 2.x) still refers to
``np.row_stack``, which NumPy removed; the first CUDA launch then fails with
``module 'numpy' has no attribute 'row_stack'``. ``np.vstack`` is the same
function, so we restore the alias before Numba is imported. The CPU kernels
import this too, so the package has exactly one import order for Numba.

The CPU kernels' ``prange`` loops run on the threading layer Numba picks
(its OpenMP layer where it loads) unless ``NUMBA_THREADING_LAYER`` names
another. On idle cores OpenMP is the fastest. On cores loaded by other work
the ``workqueue`` layer can be faster: Numba's OpenMP layer links the system's
libgomp while torch runs its ops on a libgomp of its own, and each runtime's
idle threads spin after a parallel region, taking the cores from the other's
work; the workqueue's threads sleep instead (``benchmarks/NOTES-engine-cpu.md``).
The workqueue cannot take two launches at once (Numba aborts the process:
"concurrent access"), so every parallel kernel launches under
``PARALLEL_LAUNCH``, whatever the layer. The layer is chosen at the first
parallel launch in the process.
"""

import threading

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # type: ignore[attr-defined]

import numba  # noqa: E402  (must come after the patch above)

PARALLEL_LAUNCH = threading.Lock()  # held by each launch of a parallel kernel (see above)

__all__ = ["PARALLEL_LAUNCH", "numba"]
