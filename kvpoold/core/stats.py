"""Pool statistics (``kvpoolctl stats``, the metrics endpoint)."""

from __future__ import annotations

from .block_pool import ChunkBudget
from .results import ClassStats, ManagerStats, TierStats
from .seq_table import SeqTable
from .state import Owners
from .tiers import TierPlacement


def collect(*, registry, seqs: SeqTable, owners: Owners, swapped_slots, placement: TierPlacement,
            budget: ChunkBudget) -> ManagerStats:
    """Sizes and counters per class and per lower tier (``kvpoolctl stats``, the metrics endpoint).

    Args:
        registry: the ``classes.ClassRegistry``.
        swapped_slots: the slots of the swapped-out sequences.
    """
    reserved = [0] * len(registry.classes)
    swapped = [0] * len(registry.classes)
    for slot in swapped_slots:
        swapped[int(seqs.cls[slot])] += 1
    for state in owners.values():
        for cls, r in state.reserves.items():
            reserved[cls] += len(r)
    classes = []
    for pool, c in zip(registry.classes, registry.counters):
        if pool.geometry is None:  # a dropped class (``classes.VacantClass``)
            continue
        classes.append(
            ClassStats(
                class_id=pool.class_id,
                geometry=pool.geometry.describe(),
                block_bytes=pool.block_bytes,
                capacity_blocks=pool.num_block_ids,
                total_blocks=pool.total_blocks,
                used_blocks=pool.held_blocks,
                reserved_blocks=reserved[pool.class_id],
                cached_blocks=len(pool.cached),
                free_blocks=len(pool.free),
                cow_copies=c.cow_copies,
                evictions=pool.evictions,
                prefix_queries=c.prefix_queries,
                prefix_hits=c.prefix_hits,
                prefix_query_tokens=c.prefix_query_tokens,
                prefix_hit_tokens=c.prefix_hit_tokens,
                promoted_blocks=c.promoted_blocks,
                demoted_blocks=c.demoted_blocks,
                swapped_out_blocks=c.swapped_out_blocks,
                swapped_in_blocks=c.swapped_in_blocks,
                swapped_sequences=swapped[pool.class_id],
                lost_blocks=c.lost_blocks,
                mapped_bytes=len(pool.slots) * pool.slab_bytes,
                released_bytes=pool.released_slabs * pool.slab_bytes,
                remote_hit_blocks=c.remote_hit_blocks,
                tenant=pool.geometry.tenant,
                taken_bytes=pool.taken_slabs * pool.slab_bytes,
            )
        )
    tiers = tuple(
        TierStats(t.tier.name.lower(), t.capacity, t.used, len(t), pinned_bytes=t.pinned,
                  blocks_in=t.blocks_in, blocks_out=t.blocks_out, dropped_blocks=t.dropped)
        for t in placement.lower
    )
    return ManagerStats(
        pool_bytes=budget.total * budget.chunk_bytes,
        chunk_bytes=budget.chunk_bytes,
        free_chunks=budget.free,
        sequences=seqs.live,
        owners=len(owners),
        classes=tuple(classes),
        tiers=tiers,
        max_pool_bytes=budget.limit * budget.chunk_bytes,
    )

