"""Whether kvpool.hf can run a transformers model, decided when it connects (before any real forward).

``check_model(model)`` runs the model a few times on a handful of token ids
with a recording attention function (``"kvpool_probe"``, registered beside
``"kvpool"``) that returns zeros instead of attending, and refuses the model
(``UnsupportedModel``, naming the class and the reason) unless everything
kvpool's paged attention relies on holds:

* **Every attention goes through the function.**  The model takes a pluggable
  attention (transformers' ``AttentionInterface``) and each attention layer
  calls it with its own ``layer_idx``, once per forward (a layer run twice,
  e.g. weight-shared or looped blocks, would overwrite its own K/V).
* **One KV layout.**  Query, key and value share one head_dim and every layer
  the same number of KV heads (the pool has one layout); so multi-head latent
  attention, whose values are narrower than its keys, is refused.
* **The attention is what the kernels compute**: causal, with the layer's own
  ``sliding_window`` / ``softcap`` / ``scaling``.  The probe lets transformers
  build the boolean mask it would build for SDPA and compares it, layer by
  layer, with the kernels' (causal, the passed window); a mask that is not
  (bidirectional, prefix-LM, chunked, a window the attention is not told of)
  or that carries a float bias (ALiBi) is refused, and so are inputs the
  kernels have no place for (attention sinks ``s_aux`` / ``sinks``, relative
  ``position_bias``, sparse ``indices``).
* **Nothing else mixes tokens or needs a cache.**  kvpool packs the new tokens
  of all sequences into one row and keeps only K/V between forwards.  With the
  attention returning zeros, a token's query / key / value in every layer and
  its logits must depend on the token and its ``position_ids`` alone: the
  probe changes a neighbouring token, and moves the tokens along the row with
  their positions kept, and refuses a model whose outputs move (state-space /
  recurrent / convolution layers, positions counted along the row instead of
  read from ``position_ids``).

A sliding window longer than the probe (64 tokens at most) cannot show in its
mask; for those the layer types say where windows must be passed (a
``"sliding_attention"`` layer that passes none is refused).
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field

import torch

from transformers import AttentionInterface

try:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
except ImportError:  # pragma: no cover - transformers without mask functions per implementation
    ALL_MASK_ATTENTION_FUNCTIONS = AttentionMaskInterface = None
try:
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # pragma: no cover - older transformers: the config's own layer_types
    get_layer_types_and_kwargs = None

__all__ = ["PROBE_IMPLEMENTATION", "ModelGeometry", "UnsupportedModel", "check_gpu_kernels", "check_model"]

#: the recording attention the check switches the model to for its forwards
PROBE_IMPLEMENTATION = "kvpool_probe"
#: the layer types kvpool.hf runs (the names of transformers' caches); "dummy": a layer that keeps no
#: cache of its own (an MLP-only layer, or one that reads another layer's K/V)
LAYER_TYPES = ("full_attention", "sliding_attention", "dummy")
#: what the other layer types are, for the refusal
_LAYER_KINDS = {
    "linear_attention": "linear-attention or state-space (Mamba) layers",
    "conv": "convolution layers",
    "hybrid": "layers running attention beside a state-space path",
    "hybrid_sliding": "layers running attention beside a state-space path",
    "chunked_attention": "chunked attention",
    "indexed_attention": "sparse (indexed) attention",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed attention",
}
#: attention inputs the kernels have no place for, by the keyword transformers passes them under
_UNSUPPORTED_INPUTS = {
    "s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "a relative position bias",
    "indices": "sparse attention indices", "block_indices": "sparse attention blocks",
}
#: tokens of the probe: shorter than every window it should see cut, long enough to show a short one
_MIN_PROBE, _MAX_PROBE = 8, 64


class UnsupportedModel(NotImplementedError):
    """kvpool.hf cannot run this model; the message names the model class and why."""


@dataclass(frozen=True)
class ModelGeometry:
    """What the check saw of the model's attention: the KV layout the pool must have."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class _Call:
    """One call of the probe attention: the layer, its inputs and the mask transformers built for it."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    sliding_window: int | None
    kwargs: dict = field(default_factory=dict)


_RECORD: contextvars.ContextVar[list[_Call] | None] = contextvars.ContextVar("kvpool_probe_calls", default=None)


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, **kwargs):
    """Records the call and returns zeros: every token's later layers then see nothing of other tokens."""
    calls = _RECORD.get()
    if calls is None:
        raise RuntimeError("the 'kvpool_probe' attention runs only inside kvpool.hf's connect-time check")
    calls.append(_Call(module, query.detach().clone(), key.detach().clone(), value.detach().clone(),
                       attention_mask, sliding_window, kwargs))
    batch, heads, tokens, _ = query.shape
    return query.new_zeros(batch, tokens, heads, value.shape[-1]), None


def _probe_mask(*args, **kwargs):
    """transformers' SDPA mask, always materialised (never skipped as 'just causal')."""
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention)
if AttentionMaskInterface is not None:
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, _probe_mask)


def text_config(config):
    """The decoder's config (a multimodal or composite model's text part)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older transformers
        return get()


def layer_windows(cfg) -> list[tuple[str, int | None]]:
    """Each layer's type and sliding window, as transformers' own cache reads them from the config.

    Without ``layer_types``, a config with a ``sliding_window`` makes every
    layer a sliding one: transformers' ``DynamicCache`` keeps only that window
    of keys there, whatever the model's mask says, so generate sees a window.
    """
    if get_layer_types_and_kwargs is not None:
        try:
            types, kwargs = get_layer_types_and_kwargs(cfg)
            return [(t, kw.get("sliding_window")) for t, kw in zip(types, kwargs)]
        except AttributeError:  # a layer type whose size the config lacks (e.g. chunked without a chunk)
            pass
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return [(t, getattr(cfg, "sliding_window", None) if t == "sliding_attention" else None) for t in types]


def _refuse(model, reason: str) -> UnsupportedModel:
    return UnsupportedModel(f"{type(model).__name__}: {reason}; kvpool.hf cannot run it")


# -- what the config alone shows ------------------------------------------------------------------
def _check_config(model) -> None:
    cfg = text_config(model.config)
    if getattr(model.config, "is_encoder_decoder", False):
        raise _refuse(model, "an encoder-decoder model (kvpool.hf runs decoder-only models)")
    if not isinstance(getattr(cfg, "num_hidden_layers", None), int):
        raise _refuse(model, f"its text config ({type(cfg).__name__}) has no num_hidden_layers: not one stack of "
                             "decoder layers, which the pool's layout takes")
    other = sorted({t for t, _ in layer_windows(cfg)} - set(LAYER_TYPES))
    if other:
        kinds = sorted({_LAYER_KINDS.get(t, t) for t in other})
        raise _refuse(model, f"layer types {other}: {', '.join(kinds)} (kvpool.hf keeps the K/V of full and "
                             "sliding-window attention layers, and no other state)")
    # "vision": bidirectional among image tokens only, and kvpool.hf takes token ids
    if getattr(cfg, "use_bidirectional_attention", None) in (True, "all"):
        raise _refuse(model, "bidirectional attention (use_bidirectional_attention is set; kvpool.hf runs "
                             "causal attention only)")


def _probe_length(cfg) -> int:
    """Long enough that the shortest window of the config cuts inside the probe (up to ``_MAX_PROBE``)."""
    windows = [w for _, w in layer_windows(cfg) if isinstance(w, int) and w > 0]
    return max(_MIN_PROBE, min(_MAX_PROBE, min(windows, default=0) + 2))


# -- the probe forwards ---------------------------------------------------------------------------------
@torch.no_grad()
def _run(model, ids: list[int], positions: list[int], rows: list[int]) -> tuple[torch.Tensor, list[_Call]]:
    """One forward as kvpool.hf makes it (one packed row, position_ids, no cache); the logits of ``rows``."""
    device = next(model.parameters()).device
    calls: list[_Call] = []
    token = _RECORD.set(calls)
    try:
        out = model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
                    use_cache=False, logits_to_keep=torch.tensor(rows, device=device))
    finally:
        _RECORD.reset(token)
    return out.logits[0], calls


def _forward_or_refuse(model, ids, positions, rows=None):
    rows = list(range(len(ids))) if rows is None else rows
    try:
        return _run(model, ids, positions, rows)
    except Exception as exc:  # the model's own code failed on kvpool.hf's inputs
        raise _refuse(model, f"its forward fails on kvpool.hf's inputs (one packed row, position_ids, "
                             f"use_cache=False, logits_to_keep): {type(exc).__name__}: {exc}") from exc


def _probe_tokens(model, n: int) -> list[int]:
    vocab = getattr(text_config(model.config), "vocab_size", None) or model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    return torch.randint(min(4, vocab - 1), vocab, (n,), generator=g).tolist()


# -- what the probe shows ------------------------------------------------------------------------------
def _kernel_mask(n: int, window: int | None, device) -> torch.Tensor:
    """Keys each query of one sequence of ``n`` tokens sees in kvpool's kernels (``[n, n]`` bool)."""
    q = torch.arange(n, device=device)[:, None]
    k = torch.arange(n, device=device)[None, :]
    seen = k <= q
    return seen & (q - k < window) if window else seen


def _check_mask(model, call: _Call, layer: int, n: int) -> None:
    mask = call.mask
    is_causal = call.kwargs.get("is_causal", getattr(call.module, "is_causal", True))
    if mask is None:
        if is_causal is False:
            raise _refuse(model, f"attention layer {layer} is not causal")
        return  # the model builds no mask: the attention itself is causal
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or tuple(mask.shape[-2:]) != (n, n):
        raise _refuse(model, f"attention layer {layer} gets a mask kvpool.hf does not understand "
                             f"({type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}, expected [.., {n}, {n}])")
    m = mask[0]  # [heads or 1, n, n]
    if m.dtype == torch.bool:
        seen = m
    else:
        seen = m > torch.finfo(m.dtype).min / 2
        if (m[seen] != 0).any():
            raise _refuse(model, f"attention layer {layer} adds a bias to the attention scores (e.g. ALiBi), "
                                 "which kvpool's kernels do not apply")
    want = _kernel_mask(n, call.sliding_window, m.device)
    if not torch.equal(seen, want.expand_as(seen)):
        what = f"a causal window of {call.sliding_window}" if call.sliding_window else "causal attention"
        raise _refuse(model, f"attention layer {layer}'s mask is not {what}, which is all kvpool's kernels "
                             "apply (bidirectional, prefix-LM or chunked attention, or a sliding window "
                             "the layer does not pass to the attention function)")


def _max_positions(cfg) -> float:
    """Positions the model takes: a window at least this long never hides a key."""
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else float("inf")


def _check_windows(model, cfg, layers: dict[int, _Call]) -> None:
    """Each sliding layer (as transformers' cache sees it) passes its window to the attention.

    Also where the window is too long to show in the probe's mask.
    """
    windows = [w if w is None or w < _max_positions(cfg) else None for _, w in layer_windows(cfg)]
    wrong = {i: (w, c.sliding_window) for i, c in layers.items()
             if i < len(windows) and (w := windows[i]) is not None and c.sliding_window != w}
    if wrong:
        window = sorted({w for w, _ in wrong.values()})
        types = sorted({layer_windows(cfg)[i][0] for i in wrong})
        passed = sorted({str(p) for _, p in wrong.values()})
        raise _refuse(model, f"a sliding window of {', '.join(map(str, window))} on layer types {types} (layers "
                             f"{sorted(wrong)}) that its attention layers do not pass to the attention function "
                             f"(they pass {', '.join(passed)}); kvpool's kernels apply the window they are passed")


def _check_calls(model, calls: list[_Call], n: int, dtype: torch.dtype) -> dict[int, _Call]:
    """The structure of one single-sequence forward's attention calls; the calls by layer."""
    cfg = text_config(model.config)
    if not calls:
        raise _refuse(model, "no layer calls transformers' attention interface (no attention layers: a "
                             "state-space or recurrent model, or attention the model computes itself)")
    layers: dict[int, _Call] = {}
    for call in calls:
        layer = getattr(call.module, "layer_idx", None)
        if not isinstance(layer, int):
            raise _refuse(model, f"its attention module {type(call.module).__name__} has no layer_idx")
        if layer in layers:
            raise _refuse(model, f"attention layer {layer} runs more than once per forward (shared or looped "
                                 "layers would overwrite their own K/V in the pool)")
        layers[layer] = call
        inputs = [name for name in _UNSUPPORTED_INPUTS if call.kwargs.get(name) is not None]
        if inputs:
            raise _refuse(model, f"its attention takes {_UNSUPPORTED_INPUTS[inputs[0]]} ({inputs[0]}), "
                                 "which kvpool's kernels do not apply")
        q, k, v = call.query, call.key, call.value
        if q.shape[0] != 1 or q.shape[2] != n or k.shape[2] != n or v.shape[2] != n:
            raise _refuse(model, f"attention layer {layer} attends over other tokens than the ones it was given "
                                 f"(query {tuple(q.shape)}, key {tuple(k.shape)} for {n} tokens: cross-attention "
                                 "or memory tokens)")
        if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
            raise _refuse(model, f"query/key head_dim {k.shape[-1]} and value head_dim {v.shape[-1]} differ "
                                 "(e.g. multi-head latent attention); the pool has one head_dim")
        if k.shape[1] < 1 or q.shape[1] % k.shape[1] or v.shape[1] != k.shape[1]:
            raise _refuse(model, f"attention layer {layer} has {q.shape[1]} query heads over {k.shape[1]} key and "
                                 f"{v.shape[1]} value heads")
        if {q.dtype, k.dtype, v.dtype} != {dtype}:
            raise _refuse(model, f"attention layer {layer} attends in {q.dtype}, the model is {dtype}")
    if max(layers) >= cfg.num_hidden_layers:
        raise _refuse(model, f"its attention layers {sorted(layers)} are not among the {cfg.num_hidden_layers} "
                             "layers of its config (num_hidden_layers), which the pool's layout takes")
    shapes = {(c.key.shape[1], c.key.shape[-1]) for c in layers.values()}
    if len(shapes) > 1:
        raise _refuse(model, f"its layers have different KV shapes (heads, head_dim) {sorted(shapes)}; "
                             "the pool has one layout")
    _check_windows(model, cfg, layers)
    for layer, call in layers.items():
        _check_mask(model, call, layer, n)
    return layers


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Equal up to rounding: ``tol`` of ``a``'s largest magnitude."""
    if a.shape != b.shape:
        return False
    if not a.numel():
        return True
    return (a.float() - b.float()).abs().max().item() <= tol * a.abs().max().item() + 1e-6


def _check_token_independence(model, ids: list[int], tol: float) -> None:
    """With the attention returning zeros, each token's q/k/v and logits depend on it and its position only.

    ``ids`` at positions 0.. follow another one-token sequence (as kvpool packs
    sequences into one row); changing that token, or moving ``ids`` to the
    front of the row with their positions kept, must change none of them.
    """
    n = len(ids)
    positions = [0] + list(range(n))
    base_logits, base = _forward_or_refuse(model, [ids[0]] + ids, positions)
    other = next((t for t in ids if t != ids[0]), ids[0])
    variants = (
        ("a neighbouring token changes", [other] + ids, positions, slice(1, None)),
        ("the tokens move along the row, their position_ids kept", ids + [ids[0]], list(range(n)) + [0],
         slice(0, n)),
    )
    for what, v_ids, v_pos, rows in variants:
        logits, calls = _forward_or_refuse(model, v_ids, v_pos)
        same = len(calls) == len(base) and _close(base_logits[1:], logits[rows], tol) and all(
            _close(getattr(c0, t)[:, :, 1:], getattr(c1, t)[:, :, rows], tol)
            for c0, c1 in zip(base, calls) for t in ("query", "key", "value"))
        if not same:
            raise _refuse(model, f"a token's outputs change when {what}: its layers mix tokens outside the "
                                 "attention or count positions along the row (state-space, recurrent or "
                                 "convolution layers, or position_ids ignored), which kvpool.hf's packed rows "
                                 "and K/V-only cache cannot reproduce")


# -- the check ---------------------------------------------------------------------------------------------------
_CHECKED_GEOMETRY: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def check_model(model) -> ModelGeometry:
    """Refuse a model kvpool.hf cannot run exactly (``UnsupportedModel``); its attention geometry otherwise.

    Runs four forwards of at most ``_MAX_PROBE + 1`` tokens; the result is kept
    per model (and its dtype and device) so ``layout_for`` and ``PagedModel``
    check once.
    """
    device = next(model.parameters()).device
    key = (model.dtype, device)
    seen = _CHECKED_GEOMETRY.get(model)
    if seen is not None and seen[0] == key:
        return seen[1]
    geometry = _check_uncached(model)
    _CHECKED_GEOMETRY[model] = (key, geometry)
    return geometry


def _check_uncached(model) -> ModelGeometry:
    _check_config(model)
    cfg = text_config(model.config)
    before, training = model.config._attn_implementation, model.training
    _switch_to_probe(model, before)
    try:
        model.eval()
        n = _probe_length(cfg)
        ids = _probe_tokens(model, n)
        logits, calls = _forward_or_refuse(model, ids, list(range(n)), rows=[n - 1])
        layers = _check_calls(model, calls, n, model.dtype)
        if logits.shape[0] != 1:
            raise _refuse(model, f"its forward does not take logits_to_keep as a tensor of rows (asked for 1 row "
                                 f"of {n}, got {logits.shape[0]})")
        _check_token_independence(model, ids, 1e-4 if model.dtype == torch.float32 else 1e-2)
    finally:
        model.set_attn_implementation(before)
        model.train(training)
    call = next(iter(layers.values()))
    return ModelGeometry(num_q_heads=call.query.shape[1], num_kv_heads=call.key.shape[1], head_dim=call.key.shape[-1])


def _switch_to_probe(model, before: str) -> None:
    """The probe's attention for the model; a model that does not take it is refused (and left on ``before``)."""
    try:
        model.set_attn_implementation(PROBE_IMPLEMENTATION)
    except ValueError:  # transformers refuses custom attention for the model
        switched = False
    else:  # or warns and keeps the model's own
        switched = text_config(model.config)._attn_implementation == PROBE_IMPLEMENTATION
    if not switched:
        model.set_attn_implementation(before)
        raise _refuse(model, "it does not take a pluggable attention (transformers' AttentionInterface)")


def check_gpu_kernels(model, head_dim: int, pool_dtype: str) -> None:
    """What kvpool's GPU kernels take beyond the CPU's, checked when a CUDA model connects (not at its first
    forward): their head_dims, GQA groups, and a 16-bit query on a float8 pool."""
    from kvpool.kernels.cuda_attention import HEAD_DIMS, MAX_GROUP

    geometry = check_model(model)
    if head_dim not in HEAD_DIMS:
        raise _refuse(model, f"head_dim {head_dim} (kvpool's GPU kernels take {', '.join(map(str, HEAD_DIMS))})")
    group = geometry.num_q_heads // geometry.num_kv_heads
    if group > MAX_GROUP:
        raise _refuse(model, f"{group} query heads per KV head (kvpool's GPU kernels take up to {MAX_GROUP})")
    if pool_dtype == "float8_e4m3fn" and model.dtype == torch.float32:
        raise _refuse(model, "a float32 model on a float8_e4m3fn pool (kvpool's GPU kernels read float8 with a "
                             "float16 or bfloat16 query)")
