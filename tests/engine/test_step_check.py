"""The step check (KVPOOL_CHECK_STEPS): a step whose tables name blocks its sequences do not hold never runs."""

from __future__ import annotations

import pytest

from hf_models import eager_copy, make_model, reference_generate
from test_engine import engine, run_staggered, tokens

import kvpool.engine as ke
from kvpool.engine.runner import StepItem
from kvpool.engine.step_check import StepCheckError, check_step

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama")
    return "llama", model, eager_copy(model)


def test_checked_steps_give_the_reference_tokens(daemon_factory, llama, monkeypatch):
    monkeypatch.setenv("KVPOOL_CHECK_STEPS", "1")
    arch, model, ref = llama
    d = daemon_factory()
    prompts = [tokens(n, seed=970 + i) for i, n in enumerate([7, 30, 12, 4])]
    with engine(model, d, f"{arch}-checked") as eng:
        assert eng.runner._check_steps
        outs = run_staggered(eng, prompts, [0, 0, 2, 5])
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_generate(ref, p, 8)[0]


def prepared(eng, lengths):
    """Two live sequences packed into the runner's buffers as a prefill step; (items, tokens)."""
    client = eng.client
    seqs = [client.create_sequence(tokens(n, seed=n)) for n in lengths]
    items = [StepItem(seq=s, table_key=(i, 0), start=0, tokens=tokens(n, seed=n), write_from=0)
             for i, (s, n) in enumerate(zip(seqs, lengths))]
    total, _ = eng.runner.prepare(items)
    return items, total


def stale_column(arrays):
    arrays["block_tables"][0, 1] = arrays["block_tables"][1, 0]


def foreign_slot(arrays):
    arrays["slot_mapping"][3] = int(arrays["block_tables"][1, 0]) * 8


@pytest.mark.parametrize("corrupt, message", [(stale_column, "row 0 .* holds blocks"),
                                              (foreign_slot, "token 3 of row 0 writes slot .*, not its own")])
def test_a_step_that_names_another_sequences_block_is_refused(daemon_factory, llama, corrupt, message):
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-{corrupt.__name__}") as eng:
        items, total = prepared(eng, [20, 9])
        arrays = eng.runner.buffers.np
        check_step(arrays, items, total, eng.client, 8)  # as filled: passes
        corrupt(arrays)
        with pytest.raises(StepCheckError, match=message):
            check_step(arrays, items, total, eng.client, 8)


def test_a_table_row_never_keeps_columns_the_sequence_does_not_have(daemon_factory, llama):
    """The mirror lacks a block the step needs: filling the row fails instead of leaving a stale column."""
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-short") as eng:
        seq = eng.client.create_sequence(tokens(9, seed=1))  # 2 blocks of 8
        rows = eng.runner.rows
        rows.fill(0, (0, 0), eng.client, seq, 2)
        with pytest.raises(ValueError, match="has 2 blocks; the step needs 3"):
            rows.fill(0, (0, 0), eng.client, seq, 3)


def test_a_step_whose_kernels_fault_logs_what_it_read(daemon_factory, llama, caplog, monkeypatch):
    """A CUDA fault is reported after the fact: the log says whether the failed step's inputs were sound, once."""
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-fault") as eng:
        runner = eng.runner

        def fault(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(runner, "forward", fault)
        streams = [eng.add_request(tokens(n, seed=n), ke.SamplingParams(max_tokens=4, temperature=0)) for n in (11, 5)]
        with caplog.at_level("ERROR", logger="kvpool.engine"):
            eng.step()
            eng.add_request(tokens(7, seed=7), ke.SamplingParams(max_tokens=4, temperature=0))
            eng.step()
        assert all(s.last and s.last.finish_reason == "error" for s in streams)
        notes = [r.getMessage() for r in caplog.records if "the failed step had" in r.getMessage()]
        assert notes == ["the failed step had 2 sequences and 16 tokens, 2 rows run; "
                         "its inputs pass the step check (tables, mapping, slots)"]


def test_a_fault_reported_at_the_next_daemon_call_is_checked_too(daemon_factory, llama, caplog, monkeypatch):
    """A fault surfaces at the synchronize before the next call: the scheduling path logs the check, once."""
    arch, model, _ = llama
    d = daemon_factory()
    with engine(model, d, f"{arch}-late") as eng:
        stream = eng.add_request(tokens(9, seed=9), ke.SamplingParams(max_tokens=6, temperature=0))
        eng.step()  # the prompt's step ran its kernels

        def fault(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(eng.scheduler, "plan", fault)
        with caplog.at_level("ERROR", logger="kvpool.engine"):
            eng.step()
            eng.step()
        assert stream.last.finish_reason == "error"
        notes = [r.getMessage() for r in caplog.records if "the failed step had" in r.getMessage()]
        assert notes == ["the failed step had 1 sequences and 9 tokens, 1 rows run; "
                         "its inputs pass the step check (tables, mapping, slots)"]
