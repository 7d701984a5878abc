"""transformers' own Llama and Qwen2 generating through kvpool match transformers' eager path.

Reference: the same weights with ``attn_implementation="eager"`` and transformers'
DynamicCache (``model.generate``, greedy), one prompt at a time, no padding.
kvpool: KV cache in the daemon's pool (CPU shared memory), attention by
``kvpool.kernels`` (Numba), the whole batch packed into one forward.

Tolerances (float32 on the CPU): generated tokens are equal; every step's
logits agree within ``atol=1e-4, rtol=1e-4`` (seen: max |diff| ~1e-5 for
logits of magnitude ~6; the two paths differ only in summation order).
The random models are initialised wide enough that the greedy margins are
>= 0.02, far above that, so the token comparison is not at the mercy of rounding.
bfloat16 (teacher-forced against the float32 weights, see
``teacher_forced_errors``): kvpool's max logit error <= 1.5x eager bfloat16's + 0.05.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import ARCHS, eager_copy, make_model, reference_generate, start_daemon, teacher_forced_errors

import kvpool
import kvpool.hf as kvpool_hf  # after hf_models, which skips the module without transformers
from kvpool.kernels import cpu_work

ATOL = RTOL = 1e-4
BLOCK_SIZES = (8, 16, 32)


@pytest.fixture(scope="module")
def pool(request):
    return start_daemon(request)


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    model = make_model(request.param)
    return request.param, model, eager_copy(model)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def paged(model, pool, model_id: str, block_size: int = 16):
    return kvpool_hf.PagedModel.connect(model, pool.socket, name=model_id, model_id=model_id, block_size=block_size)


def assert_matches_reference(ref, prompt, got_tokens, got_logits, max_new_tokens):
    want_tokens, want_logits = reference_generate(ref, prompt, max_new_tokens)
    assert got_tokens == want_tokens
    assert got_logits.shape == want_logits.shape
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_length_batch_matches_eager(pool, models, block_size):
    arch, model, ref = models
    bs = block_size
    # on a block boundary (bs, 2bs) and not; decode crosses a boundary in every length
    lengths = [bs, 2 * bs, bs + 3, 2 * bs - 4, 5]
    prompts = [tokens(n, seed=i) for i, n in enumerate(lengths)]
    with paged(model, pool, f"{arch}-mixed-bs{bs}", bs) as pm:
        gen = pm.generate(prompts, max_new_tokens=10, output_logits=True)
        assert gen.num_cached_tokens == [0] * len(prompts)
        assert pm.client.stats().sequences == 0  # generate freed its sequences
    for p, t, lg in zip(prompts, gen.tokens, gen.logits):
        assert_matches_reference(ref, p, t, lg, 10)


def test_cached_prefix_is_skipped_and_positions_start_there(pool, models):
    """A later prompt reuses the blocks of an earlier one; its prefill starts at num_cached_tokens."""
    arch, model, ref = models
    system = tokens(40, seed=10)  # 2.5 blocks of 16
    first = system + tokens(8, seed=11)  # 48 tokens: exactly 3 blocks
    other = system + tokens(7, seed=12)
    with paged(model, pool, f"{arch}-prefix") as pm:
        gen1 = pm.generate([first], max_new_tokens=6, output_logits=True)
    assert gen1.num_cached_tokens == [0]
    with paged(model, pool, f"{arch}-prefix") as pm:  # a new session: the pool kept the blocks
        gen2 = pm.generate([other, first], max_new_tokens=6, output_logits=True)
    # other: the system prompt's two full blocks; first: every token (only its last is recomputed)
    assert gen2.num_cached_tokens == [32, 48]
    assert gen2.tokens[1] == gen1.tokens[0]
    assert_matches_reference(ref, other, gen2.tokens[0], gen2.logits[0], 6)
    assert_matches_reference(ref, first, gen2.tokens[1], gen2.logits[1], 6)


def test_prefix_shared_inside_one_batch(pool, models):
    """Prompts of one prefill that share blocks: the later ones read K/V the earlier write in that forward."""
    arch, model, ref = models
    head = tokens(20, seed=20)
    exact = tokens(24, seed=21)  # 3 blocks of 8, twice in the batch
    prompts = [head + [3, 4], head + [5], exact, exact]
    with paged(model, pool, f"{arch}-inbatch", 8) as pm:
        gen = pm.generate(prompts, max_new_tokens=5, output_logits=True)
    assert gen.num_cached_tokens == [0, 16, 0, 24]
    for p, t, lg in zip(prompts, gen.tokens, gen.logits):
        assert_matches_reference(ref, p, t, lg, 5)


def test_decode_over_a_long_shared_prefix(pool, models, monkeypatch):
    """Prompts behind one prefix of 9 blocks (72 keys): decode attention takes the kernel's
    shared-prefix pass (its common keys for all of them at once), and greedy decoding and logits
    still match eager transformers."""
    arch, model, ref = models
    passes = []
    real = cpu_work.shared_prefixes

    def counting(*args):
        found = real(*args)
        passes.append(found.items.shape[0])
        return found

    monkeypatch.setattr(cpu_work, "shared_prefixes", counting)
    head = tokens(72, seed=50)
    prompts = [head + tokens(n, seed=51 + n) for n in (1, 5, 9)] + [list(head)]
    with paged(model, pool, f"{arch}-longshared", 8) as pm:
        gen = pm.generate(prompts, max_new_tokens=4, output_logits=True)
    assert gen.num_cached_tokens[1:] == [72, 72, 72]
    assert max(passes) > 0
    for p, t, lg in zip(prompts, gen.tokens, gen.logits):
        assert_matches_reference(ref, p, t, lg, 4)


@pytest.mark.parametrize("prompt_len", [13, 16])
def test_fork_two_continuations(pool, models, prompt_len):
    """Fork after the prompt; each branch takes a different first token (copy-on-write of a partial tail)."""
    arch, model, ref = models
    prompt = tokens(prompt_len, seed=30)
    with paged(model, pool, f"{arch}-fork-{prompt_len}", 8) as pm:
        cow_copies = lambda: pm.client.stats().classes[pm.client.class_id].cow_copies  # noqa: E731
        (seq,), logits = pm.prefill([prompt])
        a, b = logits[0].topk(2).indices.tolist()
        cow_before = cow_copies()
        child = pm.fork(seq)
        gen = pm.continue_greedy([seq, child], [a, b], max_new_tokens=9, output_logits=True)
        cow = cow_copies() - cow_before
        pm.free([seq, child])
    # a partly filled tail is shared: writing into it copies it (today the core copies it for
    # both branches when both extend in one step); a full tail needs no copy
    assert cow >= 1 if prompt_len % 8 else cow == 0
    for first, t, lg in zip((a, b), gen.tokens, gen.logits):
        assert t[0] == first
        assert_matches_reference(ref, prompt + [first], t[1:], lg, 8)


def test_chunked_prefill_mixed_with_decode(pool, models):
    """forward() with several tokens for one sequence and one for another, in one batch."""
    arch, model, ref = models
    long, short = tokens(30, seed=40), tokens(9, seed=41)
    with paged(model, pool, f"{arch}-chunked", 8) as pm:
        (s_long, s_short), first = pm.prefill([long[:11], short])
        nxt = int(first[1].argmax())
        logits = pm.forward([s_long, s_short], [long[11:], [nxt]])  # 19 tokens and 1 token
        want_long = reference_generate(ref, long, 1)[1][0]
        want_short = reference_generate(ref, short, 2)[1][1]
        torch.testing.assert_close(logits[0].float(), want_long, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(logits[1].float(), want_short, atol=ATOL, rtol=RTOL)
        pm.free([s_long, s_short])


def test_eos_stops_a_sequence_and_the_batch_goes_on(pool, models):
    arch, model, ref = models
    prompts = [tokens(12, seed=50), tokens(7, seed=51)]
    want = [reference_generate(ref, p, 8)[0] for p in prompts]
    eos = want[0][3]
    if eos in want[1]:
        pytest.skip("the chosen eos token also ends the other sequence")
    with paged(model, pool, f"{arch}-eos", 8) as pm:
        gen = pm.generate(prompts, max_new_tokens=8, eos_token_id=eos)
    assert gen.tokens[0] == want[0][: want[0].index(eos) + 1]
    assert gen.tokens[1] == want[1]


def test_bfloat16_no_worse_than_eager(pool, models):
    arch = models[0]
    model = make_model(arch, dtype=torch.bfloat16)
    prompts = [tokens(n, seed=60 + i) for i, n in enumerate([16, 37, 5])]
    with paged(model, pool, f"{arch}-bf16") as pm:
        ours, eager = teacher_forced_errors(pm, model, prompts)
    assert ours <= 1.5 * eager + 0.05, (ours, eager)


def test_layout_and_device_mismatches_are_clear(pool, models):
    arch, model, _ = models
    layout = kvpool.Layout(f"{arch}-wrong", num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")
    with kvpool.connect(pool.socket, name="wrong", layout=layout) as client:
        with pytest.raises(kvpool.InvalidArgument, match="does not match the model"):
            kvpool_hf.PagedModel(model, client)
    fresh = make_model(arch)
    fresh.set_attn_implementation(kvpool_hf.ATTN_IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="inside kvpool.hf.PagedModel"):
        fresh(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_each_forward_carries_the_bounds_of_its_lengths(pool, models, monkeypatch):
    """The attention kernels get each eager forward's true length bounds (the GPU runs an even
    decode batch on a fixed grid from them)."""
    arch, model, _ = models
    seen = []
    with paged(model, pool, f"{arch}-bounds") as pm:
        run_batch = pm.run_batch

        def spy(input_ids, positions, batch, logits_index):
            seen.append((batch.min_seq_len, batch.max_seq_len, batch.seq_lens.tolist(), batch.decode))
            return run_batch(input_ids, positions, batch, logits_index)

        monkeypatch.setattr(pm, "run_batch", spy)
        pm.generate([tokens(n, seed=n) for n in (3, 40, 17)], max_new_tokens=3)
    assert seen and any(decode for *_, decode in seen)
    for lo, hi, lens, _ in seen:
        assert (lo, hi) == (min(lens), max(lens))
