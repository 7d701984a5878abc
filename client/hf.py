"""Hugging Face transformers models generating with their KV cache in kvpool.

    import kvpool, kvpool.hf
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float16).cuda()
    with kvpool.hf.PagedModel.connect(model, socket, name="worker-0", model_id=name) as pm:
        out = pm.generate([prompt_a, prompt_b], max_new_tokens=32)
        print(out.tokens, out.num_cached_tokens)

How it hooks in (no model code is copied or patched):

* **Attention.** ``kvpool_attention`` is registered in transformers'
  ``AttentionInterface`` under the name ``"kvpool"`` and the model is switched
  to it (``model.set_attn_implementation("kvpool")``).  transformers still
  runs its own projections, RoPE, norms and MLPs; for every attention layer it
  calls our function with the new tokens' query / key / value (RoPE applied).
  The function writes the new K/V into the pool (``kvpool.kernels.write_kv``)
  and computes paged attention over the sequences' blocks
  (``paged_decode_attention`` when every sequence brings one token,
  ``paged_prefill_attention`` otherwise).  transformers builds no mask for an
  implementation it does not know, so none is materialised.
* **Cache.** The pool *is* the cache: the model runs with ``use_cache=False``
  (transformers allocates no ``DynamicCache``) and each forward's
  ``PagedBatch`` (slot mapping, block tables, lengths, the pool tensor) reaches
  the attention function through a context variable set around the forward,
  so it does not depend on every decoder layer passing its keyword arguments
  on (StableLM's does not).
* **Batching.** The new tokens of all sequences are packed into one row
  (``input_ids [1, T]``, no padding), like vLLM's varlen batches.
  ``position_ids`` hold each token's position in its own sequence, so RoPE is
  right for mixed lengths and for prompts whose first ``num_cached_tokens``
  were found in the pool (their prefill starts at that position).  Logits are
  computed for each sequence's last token only (``logits_to_keep``).
* **Per-layer attention.**  Each layer hands its own ``scaling``,
  ``sliding_window`` (``None`` on full-attention layers) and ``softcap`` to the
  attention function, as transformers does for every implementation; they go
  to the kernels unchanged, so Mistral, Qwen2 with ``use_sliding_window``,
  Gemma 2 (alternating windows, logit soft cap) and Gemma 3 (``layer_types``)
  run without knowing their configs.  What transformers computes itself
  (final logit soft cap, RoPE per layer type) stays there.  A
  float32 model on an fp8 pool runs on the CPU only (the GPU kernels read fp8 with
  a 16-bit query).
* **What runs.**  ``layout_for`` (so ``PagedModel.connect`` and
  ``kvpool.engine.Engine.connect``) and ``PagedModel`` first check the model
  with a few recorded forwards (``kvpool.hf_support.check_model``) and raise
  ``UnsupportedModel``, naming the class and the reason, for what the kernels
  cannot compute exactly: encoder-decoders, layers other than attention that
  keep state or mix tokens (state-space, recurrent, convolution), masks other
  than causal with the layer's window (bidirectional, prefix-LM, chunked, ALiBi
  biases), attention sinks, keys and values of different head_dims (multi-head
  latent attention) or of different shapes per layer, layers run twice.  The
  K/V layout (KV heads, head_dim) is the one the attention layers really make.
* **Windows keep their blocks.**  A sequence holds all its blocks for its
  whole life, also those that have left every layer's window: nothing is
  freed early, so a sliding-window model takes as many pool blocks as a
  full-attention one of the same geometry.
* **fp8 KV.**  A ``float8_e4m3fn`` layout stores K/V quantized by ``write_kv``
  (``x / scale``, per-layer ``kv_scales``, default 1.0); attention reads it
  with the query in the model's own dtype.
* **Prefix hits.** A prompt whose whole length is cached still needs the last
  token's logits: that token is recomputed as a query at its position, but its
  K/V is not written again (slot -1), so blocks shared with other sequences or
  processes are never written.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence as Seq

import numpy as np
import torch

from kvpool.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from kvpool.kernels.warm_up import warm_up_cpu_kernels

from .batch import host_arrays, pack
from .client import Client, Sequence, connect
from .errors import InvalidArgument
from .layout import Layout
from .protocol.sizes import cdiv

try:
    from transformers import AttentionInterface
except ImportError as exc:  # pragma: no cover - the extra is missing or too old
    raise ImportError(
        "kvpool.hf needs transformers >= 4.57 (its AttentionInterface; tested 4.57, 5.17, 5.24): "
        "pip install 'kvpool[hf]'"
    ) from exc

from .hf_support import UnsupportedModel, check_gpu_kernels, check_model, text_config

__all__ = [
    "ATTN_IMPLEMENTATION", "Generation", "PagedBatch", "PagedModel", "UnsupportedModel", "kvpool_attention",
    "layout_for",
]

#: the name under which kvpool's attention is registered in transformers
ATTN_IMPLEMENTATION = "kvpool"

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
#: pool dtypes the model may store its K/V in besides its own (quantized by write_kv)
_KV_ONLY_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn"}


@dataclass
class PagedBatch:
    """Where one forward's tokens live in the pool; read by every attention layer.

    ``kv``: the pool, ``[num_blocks, num_layers, 2, num_kv_heads, block_size,
    head_dim]``.  Per new token (packed, ``T`` in all): ``slot_mapping`` (int64,
    -1 = attend but do not write its K/V).  Per sequence (``B``):
    ``block_tables`` (int32 ``[B, max_blocks]``), ``seq_lens`` (int32, tokens
    in the pool after this forward, the new ones included) and
    ``cu_seqlens_q`` (int32 ``[B+1]``, where each sequence's new tokens start
    in the packed row).  ``max_seq_len`` / ``min_seq_len``: bounds on ``seq_lens``
    (``min_seq_len`` 0: none known; the GPU decodes an even batch on a fixed grid,
    see ``kvpool.kernels.paged_decode_attention``).  ``decode``: every sequence
    brings exactly one token.
    ``kv_scales``: per layer ``(k_scale, v_scale)`` of an fp8 pool (``None``:
    all 1.0; ``PagedModel.run_batch`` fills in the model's).
    """

    kv: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seq_len: int
    decode: bool
    kv_scales: Seq[tuple[float, float]] | None = None
    min_seq_len: int = 0


#: the batch of the forward running on this thread (set by ``PagedModel.run_batch``): not every
#: decoder layer passes its keyword arguments on to the attention (StableLM's does not)
_CURRENT_BATCH: contextvars.ContextVar[PagedBatch | None] = contextvars.ContextVar("kvpool_batch", default=None)


def kvpool_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvpool_batch: PagedBatch | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: write the new K/V into the pool, attend over its blocks.

    ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` (the packed new
    tokens, RoPE applied); returns ``[1, T, Hq, D]`` as transformers expects.
    Each layer passes its own ``scaling``, ``sliding_window`` (``None`` on
    full-attention layers) and ``softcap`` (Gemma 2's attention logit cap);
    they go to the kernels as ``scale``, ``sliding_window`` and ``logits_soft_cap``.
    The pool and the sequences' blocks: ``kvpool_batch``, else the batch of the
    ``PagedModel.run_batch`` running on this thread.
    """
    b = kvpool_batch if kvpool_batch is not None else _CURRENT_BATCH.get()
    if b is None:
        raise RuntimeError(
            "the 'kvpool' attention runs inside kvpool.hf.PagedModel only (no kvpool_batch was passed); "
            "use PagedModel.forward / generate, or switch the model back with set_attn_implementation('eager')"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvpool.hf does not support attention sinks (s_aux)")
    if query.shape[0] != 1:
        raise ValueError(f"kvpool.hf packs a batch into one row; got query batch {query.shape[0]}")
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out = paged_attention(b, module.layer_idx, q, k, v, scaling=scaling, sliding_window=sliding_window,
                          softcap=softcap)
    return out.unsqueeze(0), None


def paged_attention(b: PagedBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    scaling: float | None, sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Write layer ``layer``'s new K/V (``[T, Hkv, D]``) into the pool and attend: ``q [T, Hq, D]`` -> ``[T, Hq, D]``."""
    k_cache, v_cache = b.kv[:, layer, 0], b.kv[:, layer, 1]
    k_scale, v_scale = (1.0, 1.0) if b.kv_scales is None else b.kv_scales[layer]
    # an fp8 pool: write_kv quantizes (x / scale); attention dequantizes with q in the model's dtype
    write_kv(k, v, k_cache, v_cache, b.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if sliding_window is not None and sliding_window >= b.max_seq_len:
        sliding_window = None  # no sequence is long enough for the window to hide a key
    extra = dict(scale=scaling, sliding_window=sliding_window, logits_soft_cap=softcap,
                 k_scale=k_scale, v_scale=v_scale, max_seq_len=b.max_seq_len)
    out = torch.empty_like(q)
    if b.decode:
        paged_decode_attention(q, k_cache, v_cache, b.block_tables, b.seq_lens, out=out,
                               min_seq_len=b.min_seq_len or None, **extra)
    else:
        paged_prefill_attention(q, k_cache, v_cache, b.block_tables, b.seq_lens, b.cu_seqlens_q, out=out, **extra)
    return out


AttentionInterface.register(ATTN_IMPLEMENTATION, kvpool_attention)


def layout_for(
    model, model_id: str, *, revision: str = "", block_size: int = 16, kv_dtype: str | torch.dtype | None = None
) -> Layout:
    """The pool layout of a transformers causal LM (layers, KV heads, head dim, dtype).

    ``model_id`` (and ``revision``) must name the *weights*: blocks are shared
    between processes whose layouts have the same id, so two processes with
    different weights under one id would read each other's K/V.  ``kv_dtype``:
    the pool's dtype when it is not the model's, i.e. ``"float8_e4m3fn"``
    (K/V quantized on write, attention still in the model's dtype).

    Raises:
        UnsupportedModel: kvpool.hf cannot run the model exactly (see
            ``kvpool.hf_support``; the message names the class and the reason).
    """
    cfg = text_config(model.config)
    dtype = _TORCH_DTYPES.get(model.dtype)
    if dtype is None:
        raise InvalidArgument(f"kvpool.hf supports float16, bfloat16 and float32 models; got {model.dtype}")
    if kv_dtype is not None:
        names = {**_TORCH_DTYPES, **_KV_ONLY_DTYPES}
        name = names.get(kv_dtype, kv_dtype)
        if name not in names.values():
            raise InvalidArgument(f"kv_dtype must be one of {sorted(names.values())}; got {kv_dtype!r}")
        if name != dtype and name in _TORCH_DTYPES.values():
            raise InvalidArgument(f"a {dtype} model keeps a {dtype} or float8_e4m3fn KV cache; got {name}")
        dtype = name
    geometry = check_model(model)  # the K/V shapes the attention layers really make
    return Layout(model_id, num_layers=cfg.num_hidden_layers, num_kv_heads=geometry.num_kv_heads,
                  head_dim=geometry.head_dim, dtype=dtype, block_size=block_size, revision=revision)


def _layer_scales(scales, num_layers: int, fp8: bool) -> list[tuple[float, float]] | None:
    """``kv_scales`` as one ``(k_scale, v_scale)`` per layer; ``None`` when every scale is 1.0."""
    if scales is None:
        return None
    if not fp8:
        raise InvalidArgument("kv_scales apply to a float8_e4m3fn pool only")
    arr = np.asarray(scales, dtype=np.float64)
    if arr.shape == (2,):
        arr = np.broadcast_to(arr, (num_layers, 2))
    if arr.shape != (num_layers, 2):
        raise InvalidArgument(f"kv_scales must be one (k_scale, v_scale) pair or {num_layers} of them")
    if not np.all(np.isfinite(arr) & (arr > 0)):
        raise InvalidArgument("kv_scales must be finite and > 0")
    return None if np.all(arr == 1.0) else [(float(k), float(v)) for k, v in arr]


@dataclass
class Generation:
    """What a greedy generation produced, per sequence.

    ``tokens[i]``: the generated tokens of sequence ``i`` (the eos token
    included when it stopped on one).  ``num_cached_tokens[i]``: prompt tokens
    whose K/V was found in the pool (the prefill skipped them); ``logits[i]``
    (with ``output_logits=True``): float32 ``[len(tokens[i]), vocab]``, row
    ``j`` the logits that chose ``tokens[i][j]``.  ``sequences`` are the live
    pool sequences when ``free=False`` (the last generated token is not in
    them yet: it is the next step's input), else ``None``.
    """

    tokens: list[list[int]]
    num_cached_tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    sequences: list[Sequence] | None = None


class PagedModel:
    """A transformers causal LM whose KV cache lives in the kvpool pool.

    ``client``'s layout must match the model (``layout_for``); the model must
    sit on the pool's device (CPU shared memory or the CUDA device).  Making a
    ``PagedModel`` switches the model's attention to ``"kvpool"``; switch back
    with ``model.set_attn_implementation("eager")`` (or ``"sdpa"``).

    A ``float8_e4m3fn`` layout stores K/V quantized (``x / scale``) for a
    float16 / bfloat16 / float32 model.  ``kv_scales``: ``(k_scale, v_scale)``
    for every layer or a list of one pair per layer (default 1.0).  They are
    part of what the blocks mean: processes sharing a ``model_id`` must use the
    same scales.
    """

    def __init__(
        self,
        model,
        client: Client,
        *,
        kv_scales: tuple[float, float] | Seq[tuple[float, float]] | None = None,
        owns_client: bool = False,
    ) -> None:
        self.model = model
        self.client = client
        self.layout = client.layout
        self._owns_client = owns_client
        cfg = text_config(model.config)
        fp8 = self.layout.dtype in _KV_ONLY_DTYPES.values()
        want = layout_for(model, self.layout.model_id, revision=self.layout.revision,
                          block_size=self.layout.block_size, kv_dtype=self.layout.dtype if fp8 else None)
        if want != self.layout:
            raise InvalidArgument(f"the client's layout {self.layout} does not match the model ({want})")
        self.kv_scales = _layer_scales(kv_scales, cfg.num_hidden_layers, fp8)
        self.kv = client.kv_cache()
        device = next(model.parameters()).device
        if device != self.kv.device:
            raise InvalidArgument(
                f"the model is on {device} but the pool is on {self.kv.device}; move the model there "
                "(a CPU daemon serves CPU models, a CUDA daemon CUDA models)"
            )
        if device.type == "cuda":
            check_gpu_kernels(model, self.layout.head_dim, self.layout.dtype)
        self.device = device
        #: a replacement forward with fused layers (``kvpool.fused.install``), ``None``: transformers' own
        self.fused = None
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:  # older transformers
            model.config._attn_implementation = ATTN_IMPLEMENTATION
        model.eval()

    @classmethod
    def connect(
        cls,
        model,
        address: str | None = None,
        *,
        name: str,
        model_id: str,
        revision: str = "",
        block_size: int = 16,
        kv_dtype: str | torch.dtype | None = None,
        kv_scales: tuple[float, float] | Seq[tuple[float, float]] | None = None,
        **connect_kwargs,
    ) -> "PagedModel":
        """Attach to kvpoold with the model's layout; ``close()`` detaches.

        ``kv_dtype="float8_e4m3fn"`` keeps the cache in fp8 (see ``layout_for``),
        with ``kv_scales`` as in the constructor.
        """
        layout = layout_for(model, model_id, revision=revision, block_size=block_size, kv_dtype=kv_dtype)
        device = next(model.parameters()).device
        if device.type == "cuda":  # the pool of the model's own GPU, whatever the current device is
            connect_kwargs.setdefault("device", device)
        else:  # compiled before the session's lease starts: a compile holds the GIL, and the heartbeat with it
            warm_up_cpu_kernels()
        client = connect(address, name=name, layout=layout, **connect_kwargs)
        try:
            return cls(model, client, kv_scales=kv_scales, owns_client=True)
        except BaseException:
            client.close()
            raise

    # -- one forward over a batch -------------------------------------------------------
    @torch.no_grad()
    def _run(self, seqs: list[Sequence], starts: list[int], new_tokens: list[list[int]],
             write_from: list[int]) -> torch.Tensor:
        """Compute tokens ``starts[i]..`` of each sequence (already in its table); last-token logits.

        ``new_tokens[i]`` are the tokens at positions ``starts[i]..seq.num_tokens-1``;
        those before ``write_from[i]`` already have K/V in the pool (attend, do not write).
        """
        client = self.client
        counts = [len(t) for t in new_tokens]
        if any(c < 1 for c in counts):
            raise InvalidArgument("every sequence in a forward needs at least one token")
        if not np.array_equal(client.seq_lens(seqs), np.asarray(starts) + np.asarray(counts)):
            raise InvalidArgument("new tokens must end each sequence (compute them right after extend)")
        bs = self.layout.block_size
        arrays = host_arrays(sum(counts), len(seqs), cdiv(max(s + c for s, c in zip(starts, counts)), bs))

        def fill_table(row: int, num_blocks: int) -> None:
            arrays["block_tables"][row, :num_blocks] = client.block_ids(seqs[row])[:num_blocks]

        total, lens = pack(arrays, new_tokens, starts, write_from, block_size=bs, fill_table=fill_table)
        on_device = {name: torch.from_numpy(a).to(self.device) for name, a in arrays.items()}
        return self.run_packed(on_device, total, len(seqs), max_seq_len=int(lens.max()), decode=total == len(seqs),
                               min_seq_len=int(lens.min()))

    def run_packed(self, arrays: Mapping[str, torch.Tensor], num_tokens: int, num_seqs: int, *, max_seq_len: int,
                   decode: bool, min_seq_len: int = 0) -> torch.Tensor:
        """``run_batch`` on the leading ``num_tokens`` tokens and ``num_seqs`` sequences of a batch's arrays.

        Args:
            arrays: the arrays ``kvpool.batch.pack`` fills, by its names, on the model's device.
            num_tokens, num_seqs: how much of them this forward uses.
            max_seq_len, decode, min_seq_len: as in ``PagedBatch``.
        """
        batch = PagedBatch(
            kv=self.kv, slot_mapping=arrays["slot_mapping"][:num_tokens],
            block_tables=arrays["block_tables"][:num_seqs], seq_lens=arrays["seq_lens"][:num_seqs],
            cu_seqlens_q=arrays["cu_seqlens_q"][:num_seqs + 1], max_seq_len=max_seq_len, decode=decode,
            min_seq_len=min_seq_len,
        )
        return self.run_batch(arrays["input_ids"][:num_tokens], arrays["positions"][:num_tokens], batch,
                              arrays["logits_index"][:num_seqs])

    @torch.no_grad()
    def run_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                  logits_index: torch.Tensor) -> torch.Tensor:
        """One forward over packed tokens whose slots and tables are already in ``batch``.

        ``run_packed`` calls this with views of a batch's arrays: the engine's
        step runner with its persistent buffers, ``_run`` with arrays it builds per call.

        Args:
            input_ids: int64 ``[T]`` on the model's device, the packed new tokens.
            positions: int64 ``[T]``, each token's position in its own sequence.
            batch: where the tokens live in the pool (``PagedBatch``).
            logits_index: int64 ``[N]``, the packed rows whose logits are wanted.

        Returns:
            The logits of those rows, ``[N, vocab]``.
        """
        if batch.kv_scales is None and self.kv_scales is not None:
            batch = replace(batch, kv_scales=self.kv_scales)
        if self.fused is not None:
            return self.fused(input_ids, positions, batch, logits_index)
        token = _CURRENT_BATCH.set(batch)
        try:
            out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                             logits_to_keep=logits_index)
        finally:
            _CURRENT_BATCH.reset(token)
        return out.logits[0]

    # -- sequences ------------------------------------------------------------------------
    def prefill(self, prompts: Iterable[Seq[int]]) -> tuple[list[Sequence], torch.Tensor]:
        """New pool sequences for ``prompts`` (one call), computing only what the pool lacks.

        Returns the sequences and the logits of each prompt's last token
        (``[B, vocab]``).  Each sequence's ``num_cached_tokens`` says how many
        prompt tokens were found in the pool; their K/V is not recomputed.
        """
        prompts = [list(map(int, p)) for p in prompts]
        if any(not p for p in prompts):
            raise InvalidArgument("a prompt must hold at least one token")
        seqs = self.client.create_sequences(prompts)
        try:
            starts, news, write_from = [], [], []
            for seq, p in zip(seqs, prompts):
                cached = seq.num_cached_tokens
                start = min(cached, len(p) - 1)  # a fully cached prompt recomputes its last query
                starts.append(start)
                news.append(p[start:])
                write_from.append(cached)
            logits = self._run(seqs, starts, news, write_from)
            self.client.mark_written(seqs)  # the prompts' KV is in the pool: other processes may reuse it
            return seqs, logits
        except BaseException:
            self.client.free(seqs, written=False)  # a forward may have stopped half way: never prefix hits
            raise

    def forward(self, seqs: Seq[Sequence], tokens: Seq[int] | Seq[Seq[int]]) -> torch.Tensor:
        """Append tokens to each sequence (one ``extend`` for the batch) and compute them.

        ``tokens``: one token per sequence (a decode step) or a list per
        sequence (chunks of any length, e.g. a forced continuation).  Returns
        the logits of each sequence's last new token, ``[B, vocab]``.
        """
        seqs = list(seqs)
        news = [[int(t)] if np.ndim(t) == 0 else [int(x) for x in t] for t in tokens]
        if len(news) != len(seqs):
            raise InvalidArgument(f"{len(seqs)} sequences but {len(news)} token lists")
        starts = [s.num_tokens for s in seqs]
        self.client.extend(dict(zip(seqs, news)))
        return self._run(seqs, starts, news, starts)

    def fork(self, seq: Sequence) -> Sequence:
        """A second continuation of ``seq``: shares every block (copy-on-write on the first write)."""
        return self.client.fork(seq)

    def free(self, seqs: Sequence | Iterable[Sequence]) -> None:
        """Free sequences; their full blocks stay in the pool's prefix cache."""
        self.client.free(seqs)

    # -- greedy generation -----------------------------------------------------------------------
    def continue_greedy(
        self,
        seqs: Seq[Sequence],
        next_tokens: Seq[int],
        max_new_tokens: int,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        output_logits: bool = False,
    ) -> Generation:
        """Greedy decoding from live sequences whose next input tokens are already chosen.

        ``tokens[i]`` of the result starts with ``next_tokens[i]`` and holds at
        most ``max_new_tokens`` tokens; ``logits[i]`` has one row fewer (the
        first token was chosen by the caller).  The batch shrinks as sequences
        hit ``eos_token_id``.
        """
        seqs = list(seqs)
        eos = set() if eos_token_id is None else (
            {int(eos_token_id)} if np.ndim(eos_token_id) == 0 else {int(e) for e in eos_token_id})
        tokens = [[int(t)] for t in next_tokens]
        rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        live = [i for i, t in enumerate(tokens) if t[-1] not in eos]
        for _ in range(max_new_tokens - 1):
            if not live:
                break
            logits = self.forward([seqs[i] for i in live], [tokens[i][-1] for i in live])
            chosen = logits.argmax(-1).tolist()
            for i, row, tok in zip(live, logits, chosen):
                tokens[i].append(tok)
                if output_logits:
                    rows[i].append(row.float().cpu())
            live = [i for i in live if tokens[i][-1] not in eos]
        logits_out = None
        if output_logits:
            logits_out = [torch.stack(r) if r else torch.zeros(0, self._vocab()) for r in rows]
        return Generation(tokens=tokens, logits=logits_out, sequences=seqs)

    def generate(
        self,
        prompts: Iterable[Seq[int]],
        max_new_tokens: int,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        output_logits: bool = False,
        free: bool = True,
    ) -> Generation:
        """Greedy generation for a batch of prompts of any lengths (one prefill, then decode steps)."""
        if max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")
        seqs, logits = self.prefill(prompts)
        try:
            first = logits.argmax(-1).tolist()
            gen = self.continue_greedy(seqs, first, max_new_tokens, eos_token_id=eos_token_id,
                                       output_logits=output_logits)
        except BaseException:
            self.client.free(seqs, written=False)  # a forward may have stopped half way: never prefix hits
            raise
        gen.num_cached_tokens = [s.num_cached_tokens for s in seqs]
        if output_logits:
            gen.logits = [torch.cat([l0.float().cpu()[None], rest]) for l0, rest in zip(logits, gen.logits)]
        if free:
            self.client.free(seqs)
            gen.sequences = None
        return gen

    def _vocab(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach when this object made the client (``connect``)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "PagedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
