"""Incremental text equals decoding the whole output; stop strings cut it; deltas add up to it."""

import pytest

transformers = pytest.importorskip("transformers")

from kvpool.engine.detok import TextTracker  # noqa: E402
from kvpool.serve.demo_model import demo_tokenizer  # noqa: E402


def feed(tracker, ids):
    deltas, hit = [], False
    for n in range(1, len(ids) + 1):
        delta, hit = tracker.update(ids[:n])
        deltas.append(delta)
        if hit:
            break
    if not hit:
        deltas.append(tracker.flush())
    return "".join(deltas), hit


def test_incremental_text_is_the_whole_decode():
    tok = demo_tokenizer()
    ids = tok("the quick brown fox jumps over the lazy dog")["input_ids"]
    text, hit = feed(TextTracker(tok, ()), ids)
    assert not hit and text == tok.decode(ids)


def test_a_stop_string_ends_the_text_before_it_and_skip_ids_are_not_text():
    tok = demo_tokenizer()
    ids = tok("the quick brown fox jumps over the lazy dog")["input_ids"]
    tracker = TextTracker(tok, ("fox jumps", "dog"), frozenset({2}))
    text, hit = feed(tracker, ids[:2] + [2] + ids[2:])
    assert hit and text == tracker.text == "the quick brown "
