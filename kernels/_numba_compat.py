"""The one place that imports Numba for the kernels: a NumPy patch first, then the threading layer.

numba-cuda (as installed on the GPU machine, with NumPy 2.x) still refers to
``np.row_stack``, which NumPy removed; the first CUDA launch then fails with
``module 'numpy' has no attribute 'row_stack'``. ``np.vstack`` is the same
function, so we restore the alias before Numba is imported. The CPU kernels
import this too, so the package has exactly one import order for Numba.

The CPU kernels' ``prange`` loops run on Numba's ``workqueue`` threading layer
unless ``NUMBA_THREADING_LAYER`` names another. Numba's default there is its
OpenMP layer, which links the system's libgomp, while torch runs its ops on a
libgomp of its own: two OpenMP runtimes whose idle threads spin for a while
after each parallel region, each team's spinning taking the cores from the
other's work (a forward alternates torch ops and kernels). The workqueue's
threads sleep on a condition variable between regions. It cannot take two
launches at once (Numba aborts the process: "concurrent access"), so every
parallel kernel launches under ``PARALLEL_LAUNCH``. The layer is chosen at the
first parallel launch in the process: set ``NUMBA_THREADING_LAYER`` (e.g.
``omp`` or ``tbb``) where other code in the process runs Numba's parallel
functions from several threads.
"""

import os
import threading

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # type: ignore[attr-defined]

import numba  # noqa: E402  (must come after the patch above)

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

PARALLEL_LAUNCH = threading.Lock()  # held by each launch of a parallel kernel (see above)

__all__ = ["PARALLEL_LAUNCH", "numba"]
