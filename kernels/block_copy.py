"""Batched block copies inside a paged KV pool: copy-on-write, gather and scatter.

``pool`` is any torch tensor whose axis 0 is the physical block id and whose
blocks are each contiguous (``pool[0].is_contiguous()``); the byte layout
inside a block does not matter here, a block is one opaque copy unit.

* ``copy_blocks(pool, pairs)``: ``pool[dst] = pool[src]`` for every row of an
  int64 ``[P, 2]`` (src, dst) array: the copies copy-on-write returns.
* ``gather_blocks(pool, ids, out)``: ``out[i] = pool[ids[i]]``, blocks into a
  contiguous staging buffer (swap out).
* ``scatter_blocks(pool, ids, src)``: ``pool[ids[i]] = src[i]`` (swap in).

Overlap rule (checked when ``check=True``): in one ``copy_blocks`` batch the
dst ids are unique and no dst is also a src.  On the GPU all pairs run at
once, so a block that is both read and written in one batch would give an
undefined result; the CPU path copies in pair order, but portable callers
follow the rule.  ``scatter_blocks`` ids must be unique too.

GPU: ONE kernel launch per batch (a CuPy RawKernel), on the caller's current
torch stream (or ``stream=``), so it is ordered after the caller's own KV
writes.  A work item is one chunk (<= 64 KiB) of one block; each thread block
copies one item with 16-byte loads/stores and strides over the items, so a
few 2 MiB blocks still fill the GPU and many 32 KiB blocks cost one launch.
With ``check=False`` and ids already on the device, nothing synchronizes the
host (so it should be capturable in a CUDA graph; not tested yet).
The ``**tune`` keywords of the three functions, for benchmarks
(``bench_block_copy.py --sweep``), change the launch shape: ``threads`` per
thread block, ``chunk`` bytes per work item, ``ctas_per_sm``, and ``kernel``,
another entry point of ``cuda/block_copy.cu``; the defaults are what the
sweep chose.

CPU: one ``memcpy`` per block over a ``[num_blocks, block_bytes]`` uint8
NumPy view (dtype-agnostic: bfloat16 and float8 too), in pair order.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from kvpool.protocol.sizes import cdiv
from .cuda_source import BLOCK_COPY, read

__all__ = ["copy_blocks", "gather_blocks", "scatter_blocks"]

_CHUNK = 64 * 1024  # bytes one thread block copies per work item
_THREADS = 512
_CTAS_PER_SM = 8  # grid = min(work items, 8 per SM); the rest is grid-stride

# The launch shape that benchmarks/bench_block_copy.py --sweep chose (benchmarks/NOTES-memory.md):
# 512 threads and 64 KiB chunks come closest to a plain device copy for small and large blocks
# alike. ``**tune`` overrides it.
_DEFAULT = {"threads": _THREADS, "chunk": _CHUNK, "ctas_per_sm": _CTAS_PER_SM}
_TUNE_KEYS = {*_DEFAULT, "kernel"}


def _pick_kernel(chunk: int, threads: int) -> str:
    """8 loads in flight per thread where a chunk is big enough to give every thread 8, else 4:
    an unrolled loop the chunk cannot fill leaves its threads idle. Plain ``.cg`` loads and
    stores (L2 only: a copy never reuses data); the streaming hint made no difference."""
    return "kvpool_copy_v16_u8_cg" if chunk >= 8 * 16 * threads else "kvpool_copy_v16_u4_cg"


_module_cache: dict = {}
_sm_count: dict[int, int] = {}
_streams: dict[tuple[int, int], object] = {}


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - GPU machines only
        raise RuntimeError(
            f"GPU block copies need CuPy ({e}): pip install 'kvpool[cuda13]' or 'kvpool[cuda]'"
        ) from None
    return cupy


def _kernel(dev: int, name: str):
    """The compiled function for the current device (compiled once per process by NVRTC)."""
    fn = _module_cache.get((dev, name))
    if fn is None:
        mod = _module_cache.get("mod")
        if mod is None:
            mod = _module_cache["mod"] = _cupy().RawModule(code=read(BLOCK_COPY), options=("-std=c++17",))
        fn = _module_cache[(dev, name)] = mod.get_function(name)
    return fn


def _cupy_stream(cupy, ptr: int, dev: int):
    s = _streams.get((dev, ptr))
    if s is None:
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external; same object
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _streams[(dev, ptr)] = cupy.cuda.ExternalStream(ptr, dev)
    return s


# ---------------------------------------------------------------- validation

def _block_geometry(pool: torch.Tensor, what: str = "pool") -> tuple[int, int]:
    """(bytes per block, bytes between consecutive blocks)."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() < 1 or pool.shape[0] == 0:
        raise ValueError(f"{what} must have at least one block on axis 0, got shape {tuple(pool.shape)}")
    if not pool[0].is_contiguous():
        raise ValueError(f"each block of {what} must be contiguous (axis 0 = block id); got strides {pool.stride()}")
    item = pool.element_size()
    return pool[0].numel() * item, pool.stride(0) * item


def _as_ids(ids, name: str, ndim: int) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        t = ids
    else:
        t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integers (int64), got {t.dtype}")
    if ndim == 2 and t.numel() == 0:
        t = t.reshape(0, 2)
    if t.dim() != ndim or (ndim == 2 and t.shape[1] != 2):
        want = "[P, 2] (src, dst)" if ndim == 2 else "[P]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    return t


def _check_ids(ids: torch.Tensor, num_blocks: int, name: str, unique: bool) -> np.ndarray:
    """Host-side checks (a device->host copy, hence a sync, for GPU ids)."""
    a = ids.detach().to("cpu", torch.int64).numpy()
    if a.size and (a.min() < 0 or a.max() >= num_blocks):
        raise IndexError(f"{name} out of range [0, {num_blocks}): min {a.min()}, max {a.max()}")
    if unique and np.unique(a).size != a.size:
        raise ValueError(f"{name} must be unique within one batch")
    return a


def _check_pairs(pairs: torch.Tensor, num_blocks: int) -> None:
    a = _check_ids(pairs, num_blocks, "pairs", unique=False)
    if len(a) <= 256:  # the usual copy-on-write batch: sets beat np.unique's sort
        src, dst = a[:, 0].tolist(), a[:, 1].tolist()
        dup = len(set(dst)) != len(dst)
        both = sorted(set(src) & set(dst))
    else:
        src, dst = a[:, 0], a[:, 1]
        dup = np.unique(dst).size != dst.size
        both = np.intersect1d(src, dst).tolist()
    if dup:
        raise ValueError("dst block ids must be unique within one copy_blocks batch")
    if both:
        raise ValueError(f"block(s) {both[:8]} are both a src and a dst in one batch: split the batch")


def _check_rows(pool: torch.Tensor, other: torch.Tensor, n: int, block_bytes: int, what: str) -> int:
    """Validate a staging buffer; returns its row pitch in bytes."""
    if other.device != pool.device:
        raise ValueError(
            f"{what} is on {other.device} but the pool is on {pool.device}: stage on the pool's "
            "device, then copy_ to/from pinned host memory"
        )
    if not other.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if other.dim() < 1 or other.shape[0] != n:
        raise ValueError(f"{what} must have {n} rows on axis 0 (one per id), got shape {tuple(other.shape)}")
    row = other.numel() * other.element_size() // n if n else block_bytes
    if row != block_bytes:
        raise ValueError(f"{what} rows hold {row} bytes but a pool block holds {block_bytes}")
    return row


# ---------------------------------------------------------------- CPU path

def _rows_u8(t: torch.Tensor) -> np.ndarray:
    """[num_blocks, block_bytes] uint8 NumPy view (no copy; any dtype, bfloat16 too)."""
    return t.detach().reshape(t.shape[0], -1).view(torch.uint8).numpy()


def _cpu_copy(dst_rows: np.ndarray, dst_ids, src_rows: np.ndarray, src_ids) -> None:
    """One ``memcpy`` per block, in order, no temporary: as fast as ``numpy.copyto`` of the
    same bytes, where ``torch.index_select``/``index_copy_`` on uint8 rows and NumPy fancy
    indexing (which goes through a temporary) are far slower (benchmarks/NOTES-memory.md).
    """
    for d, s in zip(dst_ids, src_ids):
        dst_rows[d] = src_rows[s]


# ---------------------------------------------------------------- GPU path

def _torch_stream(stream, device: torch.device) -> "torch.cuda.Stream":
    """None (current), a torch stream, a CuPy stream or a raw cudaStream_t -> torch stream."""
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    ptr = int(getattr(stream, "ptr", stream))
    return torch.cuda.ExternalStream(ptr, device=device)


def _launch(dev: int, src_base, dst_base, src_ids, src_stride, dst_ids, dst_stride,
            n, src_row, dst_row, block_bytes, sptr: int, **tune) -> None:
    cupy = _cupy()
    unknown = tune.keys() - _TUNE_KEYS
    if unknown:
        raise TypeError(f"unknown block copy tuning keywords {sorted(unknown)}; known: {sorted(_TUNE_KEYS)}")
    cfg = {**_DEFAULT, **tune}
    aligned = all(x % 16 == 0 for x in (src_base, dst_base, src_row, dst_row, block_bytes))
    chunk = min(cfg["chunk"], block_bytes)
    chunk = max(16, chunk // 16 * 16) if aligned else chunk
    if not aligned:
        name = "kvpool_copy_v1"
    else:
        name = cfg.get("kernel") or _pick_kernel(chunk, int(cfg["threads"]))
    chunks = cdiv(block_bytes, chunk)
    with cupy.cuda.Device(dev):
        if dev not in _sm_count:
            _sm_count[dev] = cupy.cuda.runtime.deviceGetAttribute(
                cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, dev)
        cs = _cupy_stream(cupy, sptr, dev)
        items = n * chunks
        grid = int(min(items, _sm_count[dev] * cfg.get("ctas_per_sm", _CTAS_PER_SM)))
        u64, i64 = np.uint64, np.int64
        _kernel(dev, name)(
            (grid,), (int(cfg["threads"]),),
            (u64(src_base), u64(dst_base), u64(src_ids), i64(src_stride), u64(dst_ids), i64(dst_stride),
             i64(n), i64(src_row), i64(dst_row), i64(block_bytes), i64(chunk), i64(chunks)),
            stream=cs,
        )


def _gpu(pool: torch.Tensor, ids: torch.Tensor, stream):
    """(device index, ids on the device as int64, torch stream) for a launch.

    The ids are uploaded under ``stream``, so their (caching-allocator)
    memory belongs to the stream the kernel runs on and cannot be reused
    before the kernel has read it; torch's pinned-memory cache likewise keeps
    the host copy until the upload is done.
    """
    if pool.device.type != "cuda":
        raise ValueError(f"unsupported device {pool.device}")
    dev = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
    ts = _torch_stream(stream, torch.device("cuda", dev))
    if stream is None:  # already the current stream: skip the (costly) context switch
        return dev, _upload(ids, pool.device), ts
    with torch.cuda.stream(ts):
        return dev, _upload(ids, pool.device), ts


def _upload(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    if ids.device.type == "cpu":  # pinned + async: the host does not wait for the upload
        return ids.to(torch.int64).contiguous().pin_memory().to(device, non_blocking=True)
    return ids.to(device=device, dtype=torch.int64).contiguous()


# ---------------------------------------------------------------- public API

def copy_blocks(pool: torch.Tensor, pairs, *, stream=None, check: bool = True, **tune) -> None:
    """``pool[dst] = pool[src]`` for each (src, dst) row of ``pairs`` (int64 ``[P, 2]``).

    One kernel launch on the GPU (on ``stream``, default the current torch
    stream).  ``check`` validates ids and the overlap rule on the host (for
    ids already on the GPU that costs a synchronization).
    """
    block_bytes, row = _block_geometry(pool)
    pairs = _as_ids(pairs, "pairs", 2)
    n = pairs.shape[0]
    if check:
        _check_pairs(pairs, pool.shape[0])
    if n == 0:
        return
    if pool.device.type == "cpu":
        rows = _rows_u8(pool)
        p = pairs.to(torch.int64).tolist()
        _cpu_copy(rows, (d for _, d in p), rows, (s for s, _ in p))
        return
    dev, p, ts = _gpu(pool, pairs, stream)
    base = pool.data_ptr()
    _launch(dev, base, base, p.data_ptr(), 2, p.data_ptr() + 8, 2,
            n, row, row, block_bytes, ts.cuda_stream, **tune)


def gather_blocks(pool: torch.Tensor, ids, out: torch.Tensor, *, stream=None, check: bool = True,
                  **tune) -> torch.Tensor:
    """``out[i] = pool[ids[i]]``; ``out`` is contiguous, one block per row, on the pool's device."""
    block_bytes, row = _block_geometry(pool)
    ids = _as_ids(ids, "ids", 1)
    n = ids.shape[0]
    out_row = _check_rows(pool, out, n, block_bytes, "out")
    if check:
        _check_ids(ids, pool.shape[0], "ids", unique=False)
    if n == 0:
        return out
    if pool.device.type == "cpu":
        _cpu_copy(_rows_u8(out), range(n), _rows_u8(pool), ids.to(torch.int64).tolist())
        return out
    dev, i, ts = _gpu(pool, ids, stream)
    _launch(dev, pool.data_ptr(), out.data_ptr(), i.data_ptr(), 1, 0, 0,
            n, row, out_row, block_bytes, ts.cuda_stream, **tune)
    return out


def scatter_blocks(pool: torch.Tensor, ids, src: torch.Tensor, *, stream=None, check: bool = True,
                   **tune) -> None:
    """``pool[ids[i]] = src[i]``; ids unique; ``src`` contiguous on the pool's device."""
    block_bytes, row = _block_geometry(pool)
    ids = _as_ids(ids, "ids", 1)
    n = ids.shape[0]
    src_row = _check_rows(pool, src, n, block_bytes, "src")
    if check:
        _check_ids(ids, pool.shape[0], "ids", unique=True)
    if n == 0:
        return
    if pool.device.type == "cpu":
        _cpu_copy(_rows_u8(pool), ids.to(torch.int64).tolist(), _rows_u8(src), range(n))
        return
    dev, i, ts = _gpu(pool, ids, stream)
    _launch(dev, src.data_ptr(), pool.data_ptr(), 0, 0, i.data_ptr(), 1,
            n, src_row, row, block_bytes, ts.cuda_stream, **tune)

