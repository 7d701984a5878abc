"""The copier for a pool in host memory (the CPU backend): numpy copies, done when they return."""

from __future__ import annotations

import numpy as np

from .cuda import run_bounds


class CpuCopier:
    """Copies between a pool in host memory (numpy rows) and host slots, with numpy; done on return."""

    @staticmethod
    def to_host(rows: np.ndarray, ids: np.ndarray, host: np.ndarray, offsets: np.ndarray):
        bb = rows.shape[1]
        for i0, i1 in run_bounds(offsets, bb):
            o = int(offsets[i0])
            np.take(rows, ids[i0:i1], axis=0, out=host[o:o + (i1 - i0) * bb].reshape(i1 - i0, bb))
        return None

    @staticmethod
    def to_device(rows: np.ndarray, ids: np.ndarray, host: np.ndarray, offsets: np.ndarray):
        bb = rows.shape[1]
        for i0, i1 in run_bounds(offsets, bb):
            o = int(offsets[i0])
            rows[ids[i0:i1]] = host[o:o + (i1 - i0) * bb].reshape(i1 - i0, bb)
        return None
