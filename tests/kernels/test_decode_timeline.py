"""The decode timeline diagnostic (``benchmarks/bench_decode_timeline.py``) on the CPU: its
instrumentation still finds every line it stamps in the shipped kernel source, and its
per-call and per-SM analysis reads stamps right."""

import importlib
import sys
from pathlib import Path

import pytest

from kvpool.kernels import cuda_runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
timeline = importlib.import_module("bench_decode_timeline")


def test_instrumentation_finds_every_line_it_stamps():
    src = timeline.instrumented(cuda_runtime.SOURCE, 0x7F0000000000)
    assert src.startswith("#define STAMP_ADDR 139637976727552ULL\n")
    # once each, but for the ends of the epilogue (split merge by counter; pair split 1; pair
    # split 0) and of the merge (by counter; in a pair)
    for slot, n in enumerate([1, 1, 1, 3, 2, 1]):
        assert src.count(f"STAMP[{slot}] =") == n
    # nothing else changes: the source is the shipped one plus the stamps
    stripped = src.split("\n", 2)[2]
    assert stripped.count("paged_attention_kernel(") == cuda_runtime.SOURCE.count("paged_attention_kernel(")
    assert len(stripped) > len(cuda_runtime.SOURCE)


def test_instrumentation_refuses_a_source_without_its_lines():
    with pytest.raises(SystemExit, match="exactly one"):
        timeline.instrumented(cuda_runtime.SOURCE.replace("// the rings are free: reuse them", "// changed"), 1)


def _call(slow_sms, jitter, t0=10_000):
    """Stamps (ns) of 20 CTAs on SMs 0-9, two per SM; CTAs on slow SMs end their loop 10 µs later.
    CTA 0 also runs the fused merge."""
    rows = []
    for i in range(20):
        sm = i % 10
        start = t0 + 100 * i
        loop_end = start + 60_000 + (10_000 if sm in slow_sms else 0) + jitter * i
        epi_end = loop_end + 1_000
        merge_end = epi_end + 2_000 if i == 0 else 0
        rows.append([start, start + 3_000, loop_end, epi_end, merge_end, sm + 1] + [0] * 10)
    rows.append([0] * 16)  # a CTA that returned before stamping (a skipped split)
    return rows


def test_call_summary_reads_the_stamps():
    s = timeline.call_summary(_call({5, 6, 7, 8, 9}, 0))
    assert s["ctas"] == 20
    assert s["first_tile"] == pytest.approx(3.0) and s["epilogue"] == pytest.approx(1.0) and s["merge"] == pytest.approx(2.0)
    assert s["loop_end_p10"] == pytest.approx(60.2)  # the 3rd of 20: 60.0, 60.1, 60.2, ...
    assert s["loop_end_max"] == pytest.approx(71.9)  # CTA 19: started 1.9 µs in, on slow SM 9
    assert s["span"] == pytest.approx(72.9)
    assert sorted({sm for sm, _ in s["per_cta"]}) == list(range(10))


def test_sm_classes_find_fixed_slow_sms():
    calls = [timeline.call_summary(_call({5, 6, 7, 8, 9}, jitter)) for jitter in (0, 5, 10, 15, 20, 25)]
    sm = timeline.sm_classes(calls)
    assert sm["sms"] == 10 and sm["slow_sms"] == [5, 6, 7, 8, 9]
    assert sm["slow_half_loop_end"] - sm["fast_half_loop_end"] == pytest.approx(10.0, abs=0.6)
    assert sm["even_odd_correlation"] > 0.99
    # no fixed classes: the halves end together
    even = timeline.sm_classes([timeline.call_summary(_call(set(), j)) for j in (0, 5, 10, 15)])
    assert even["slow_half_loop_end"] - even["fast_half_loop_end"] < 0.6
