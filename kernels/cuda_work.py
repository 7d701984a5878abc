"""How page-aware attention divides the keys among CTAs: splits of a fixed grid
(``choose_splits``), the wave of work items (``decode_work``), the items per sequence
(``work_items``) and the order the kernel runs them in (``work_order``)."""

from __future__ import annotations

import functools
import math

from kvpool.protocol.sizes import cdiv

from .cuda_pipelines import (
    DECODE_ITEM_CLASSES, DECODE_ITEM_KEYS, DECODE_ITEM_OVERHEAD, DECODE_MAX_CTA_KEYS, DECODE_SPLIT_CTAS_PER_SM,
    WARPS,
)
from .cuda_source import ORDER_CLASSES


@functools.lru_cache(maxsize=4096)
def choose_splits(ctas: int, tiles: int, warps_kv: int, slots: int) -> int:
    """Split count minimizing (waves of CTAs) x (tiles per CTA), the fewest on ties.

    ``slots`` CTAs run at once; a CTA's time grows with its tiles. Splitting
    only pays while it fills idle slots: beyond one wave it adds merge work
    and shortens nothing. Each warp keeps at least one tile.
    """
    best, best_cost = 1, math.inf
    max_s = max(1, min(tiles // warps_kv, 2 * cdiv(slots, max(ctas, 1)), 256))
    for s in range(1, max_s + 1):
        cost = cdiv(ctas * s, slots) * cdiv(tiles, s)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def decode_work(num_seqs: int, num_kv_heads: int, tiles: int, num_sms: int, *, per_sm: int | None = None) -> int:
    """Page-aware decode: the wave, in CTAs per KV head, that one call's work division aims at
    (``work_items`` states the division; the kernel's ``locate_item`` makes it from the
    lengths on the device).

    ``per_sm`` CTAs per SM over all KV heads; by default ``DECODE_SPLIT_CTAS_PER_SM``, or one
    where that already gives a uniform batch of this size 8 or more splits (small batches:
    fewer partials to merge; ``tiles`` is the longest sequence's 16-key tiles, the shape
    bound). The grid holds ``target + num_seqs`` items per head; the merge is fused (a row's
    last item merges).
    """
    if per_sm is None:
        ctas = num_seqs * num_kv_heads
        per_sm = 1 if choose_splits(ctas, tiles, WARPS, num_sms) >= 8 else DECODE_SPLIT_CTAS_PER_SM
    return max(1, num_sms * per_sm // num_kv_heads)


def tile_keys(seq_lens, q_lens=None, *, tokens_per_tile: int = 1, capacity: int, window: int = 0) -> list[int]:
    """The keys each query tile sees, in the order ``locate_item`` enumerates the tiles: decode
    (``q_lens`` None) one tile per sequence; prefill ``ceil(q_len / tokens_per_tile)`` per
    sequence, its last tile (the most keys) first. A tile's keys run from its first token's
    window start (rounded down to 8) to its last token's position, within ``capacity``."""
    out = []
    for j, n in enumerate(seq_lens):
        n = max(0, int(n))
        ql = 1 if q_lens is None else int(q_lens[j])
        tiles = 1 if q_lens is None else cdiv(ql, tokens_per_tile)
        for t in reversed(range(tiles)):
            first, tok0 = n - ql, t * tokens_per_tile
            hi = min(min(n, capacity), first + tok0 + min(tokens_per_tile, ql - tok0))
            lo = max(0, first + tok0 - window + 1) & ~7 if window else 0
            out.append(max(0, hi - lo))
    return out


def work_items(
    seq_lens,
    q_lens=None,
    *,
    target: int,
    capacity: int,
    tokens_per_tile: int = 1,
    window: int = 0,
    min_chunk: int = DECODE_ITEM_KEYS,
    max_chunk: int = DECODE_MAX_CTA_KEYS,
    overhead: int = DECODE_ITEM_OVERHEAD,
):
    """Page-aware attention's work division: what ``locate_item`` makes on the device, here from
    host lengths (tests and benchmarks). Returns ``(c, keys per item of each tile, items per
    tile)``, tiles as ``tile_keys`` lists them (decode: one per sequence).

    In units of 64 keys: tile i sees ``w_i`` units. With ``u`` units per item it gets ``n_i =
    max(1, ceil(w_i / u))`` items, its keys shared evenly between them (a multiple of 64 each).
    It is *long* when ``2 w_i > u``. With ``S = target`` (the CTAs per KV head that run at once)
    and ``a = overhead / 64`` (an item's fixed cost), ``u`` is the smallest, at least
    ``min_chunk / 64``, such that the long tiles' items fit one wave (``sum n_i <= S`` over long
    i) and all the work fits S slots of one item's time (``sum (w_i + a n_i) <= S (u + a)``).
    With S or more tiles there are several waves whatever the split: decode takes ``u =
    ceil(sum w_i / S)``, lowered to ``max_chunk`` where the grid of ``target + B`` items still
    holds the items; prefill splits none (one item per tile). Decode's items run in the order
    ``work_order`` states (in one wave the long sequences' items first); prefill runs the long
    tiles' items first, then one item per short tile.
    """
    keys = tile_keys(seq_lens, q_lens, tokens_per_tile=tokens_per_tile, capacity=capacity, window=window)
    if q_lens is not None and len(keys) >= target:
        return 1 << 35, keys, [1] * len(keys)
    units = [cdiv(k, 64) for k in keys]
    n_units, total = len(units), sum(units)
    a, s = overhead // 64, max(1, target)
    min_u = max(1, min_chunk // 64)
    max_u = max(min_u, max_chunk // 64)

    def items(u: int) -> list[int]:
        return [max(1, cdiv(w, u)) for w in units]

    def fits(u: int) -> bool:
        counts = items(u)
        n_long = sum(n for n, w in zip(counts, units) if 2 * w > u)
        return n_long <= s and total + a * sum(counts) <= s * (u + a)

    if n_units >= target:  # decode of S or more sequences: several waves whatever the split
        u = max(min_u, cdiv(total, s))
        if u > max_u and sum(items(max_u)) <= target + n_units:
            u = max_u
    else:
        lo = max(min_u, (total + a * n_units) // s - a)
        u = lo
        if not fits(lo):
            hi = max(2 * max(units, default=0), cdiv(total + a * n_units, s)) + 1
            probe = max(lo + 1, cdiv(3 * total, s))
            if probe < hi and fits(probe):
                hi = probe
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid, hi)
            u = hi
    counts = items(u)
    per_item = [(cdiv(k, n) + 63) & ~63 for k, n in zip(keys, counts)]
    return 64 * u, per_item, counts


def work_order(keys: list[int], c: int, counts: list[int], *, target: int,
               classes: int | None = None) -> list[tuple[int, int]]:
    """The (sequence, item) that each CTA of one KV head runs in page-aware decode, in grid
    order, for a division that ``work_items`` returned (``c`` keys per item, ``counts`` items
    per sequence; ``keys`` per sequence as ``tile_keys`` lists them; ``target`` the wave).

    Largest items first, by size class: a sequence's items, of ``p`` units each (its units over
    its items, rounded up; ``u = c / 64``), fall in class 0 when ``2 p > u`` (the long
    sequences'), else ``floor(log2(u // max(p, 1)))``, at least 1 and at most
    ``classes - 1`` (default ``DECODE_ITEM_CLASSES``; at least two classes with fewer sequences
    than ``target``): class 1 holds items of (u/4, u/2] units, and so on. The classes in order,
    each in batch order (one class: batch order)."""
    classes = DECODE_ITEM_CLASSES if classes is None else classes
    last = min(ORDER_CLASSES, max(2 if len(keys) < target else 1, classes)) - 1
    u = c // 64

    def size_class(i: int) -> int:
        w = cdiv(keys[i], 64)
        p = cdiv(w, counts[i])
        return 0 if 2 * p > u else min(last, max(1, (u // max(p, 1)).bit_length() - 1))

    of = [size_class(i) for i in range(len(keys))]
    return [(i, s) for k in range(last + 1) for i, n in enumerate(counts) if of[i] == k for s in range(n)]


def even_batch(min_seq_len: int | None, max_kv: int, window: int = 0) -> bool:
    """Whether every sequence sees within 1/8 as many keys as the longest (``min_seq_len`` and
    ``max_kv`` bound the lengths; a window caps what each sees): a fixed grid of splits then
    leaves no CTA much longer than another."""
    if min_seq_len is None:
        return False
    lo, hi = min_seq_len, max_kv
    if window:
        lo, hi = min(lo, window), min(hi, window)
    return 8 * lo >= 7 * hi
