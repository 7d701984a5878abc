"""A model, not a measurement: how close each page-aware decode item order comes to the best
makespan on this benchmark's mixed batches, on the CPU.

    python3 benchmarks/model_item_order.py [--grid quick|full] [--slots 33] [--overhead 256] [--json PATH]

The batches are ``bench_mixed_decode.py``'s; the division is the planner's (``work_items``,
``decode_work`` on an H200's 132 SMs and 8 KV heads); each order is ``work_order`` with 1
(batch order), 2 (long items first) or 8 size classes, against all items sorted largest first.
List scheduling: ``--slots`` CTAs of one KV head run at once (33: two CTAs per SM), each item
costs its keys plus ``--overhead``, and an item starts on the first free slot in grid order.
The figure is the makespan over the ideal (all cost spread evenly over the slots). It ignores
that a CTA alone on an SM streams faster than one in a full wave, so it ranks orders; the GPU
run (``bench_mixed_decode.py --sweep ::2,::8``) decides.
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path

from bench_mixed_decode import cases

from kvpool.kernels import cuda_attention as ca

ORDERS = {"batch order": 1, "long first": 2, "8 classes": 8}


def makespan(costs: list[int], slots: int) -> float:
    free_at = [0.0] * slots
    for cost in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at)


def model_case(lens: list[int], slots: int, overhead: int) -> dict[str, float]:
    capacity = 1 << 18
    target = ca.decode_work(len(lens), 8, max(lens) // 16 + 1, 132)
    c, per_item, counts = ca.work_items(lens, target=target, capacity=capacity)
    keys = ca.tile_keys(lens, capacity=capacity)

    def cost(i: int, s: int) -> int:
        return max(0, min(per_item[i], keys[i] - s * per_item[i])) + overhead

    everything = [(i, s) for i, n in enumerate(counts) for s in range(n)]
    ideal = sum(cost(i, s) for i, s in everything) / slots
    out = {name: makespan([cost(*x) for x in ca.work_order(keys, c, counts, target=target, classes=k)], slots) / ideal
           for name, k in ORDERS.items()}  # fmt: skip
    out["sorted"] = makespan(sorted((cost(*x) for x in everything), reverse=True), slots) / ideal
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=["quick", "full"], default="quick")
    p.add_argument("--slots", type=int, default=33, help="CTAs of one KV head that run at once")
    p.add_argument("--overhead", type=int, default=ca.DECODE_ITEM_OVERHEAD, help="an item's fixed cost in keys")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "model-item-order.json"))
    args = p.parse_args()
    names = [*ORDERS, "sorted"]
    print(f"# makespan / ideal, {args.slots} slots per KV head, item cost = keys + {args.overhead} (a model)")
    print(f"{'case':>22} " + " ".join(f"{n:>12}" for n in names))
    rows = []
    for name, lens in cases(args.grid):
        got = model_case(lens, args.slots, args.overhead)
        rows.append({"case": name, **got})
        print(f"{name:>22} " + " ".join(f"{got[n]:>12.3f}" for n in names))
    Path(args.json).write_text(json.dumps(dict(slots=args.slots, overhead=args.overhead, rows=rows), indent=1))
    print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
