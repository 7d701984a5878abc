"""``KvpoolConnector``: vLLM's ``KVConnectorBase_V1`` over kvpoold (imports vLLM).

Scheduler side (the engine-core process): one kvpool client (a session of the
model's layout) answers ``get_num_new_matched_tokens`` with
``Client.lookup`` (the daemon's content hash chain, keyed by the model id and
an ``extra_key`` that carries what else changes the KV: ``cache_salt``, the
LoRA, the quantization).  ``build_connector_meta`` tells the workers, per
step, which of a request's blocks to load from the pool and which newly
computed full blocks to save into it: prompt and generated tokens alike (the
request's token ids, read as it runs), hashed as lookups hash them, so a
later prompt that repeats a request's prompt and answer finds both.

Worker side (each worker process): its own kvpool client maps the pool
(``Client.kv_cache()``).  ``start_load_kv`` pins the cached prefix in the pool
(``create_sequence``: the blocks cannot be evicted while copied, and lower
tiers are brought back first); ``wait_for_layer_load`` copies a layer's
blocks into vLLM's; saves take pool blocks for the new full blocks
(``create_sequence`` of the request's full blocks: the cached ones are shared,
the rest are new; asked for in a background thread while the forward runs)
and ``save_kv_layer`` fills them layer by layer; ``wait_for_save`` finishes
the copies (vLLM may reuse a block once the step is over) and leaves the free
of the sequences, which tells the daemon their KV is written (other processes
see the blocks from then on), to that thread.

A load that cannot be done (daemon gone, blocks evicted between lookup and
load, a lower tier's read failed) reports its vLLM blocks in
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"``
vLLM recomputes from there.  Nothing a failed load left unwritten reaches other
sessions: a save whose blocks include a failed one is dropped (a request that
shares the block computed over it), and a load's sequence that came back short
is never freed (its blocks past the hit are new and unwritten, and a free
publishes them): the session detaches instead, which drops them.

While kvpoold is away every call fails over to computing, and a new session
is tried at most every ``retry_seconds``.

Statistics: a request is one prefix query in kvpoold (the scheduler's lookup,
counted from vLLM's own prefix-cache hit on); the workers' creates for loads
and saves are not counted, so ``kvpoolctl stats`` agrees with vLLM's
``external_prefix_cache_queries`` / ``_hits``.

STATUS (see benchmarks/NOTES-vllm.md): CPU_ATTN layout only, synchronous
loads, save copies inside the step, no tensor parallelism.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from ..client import Client, connect
from ..errors import SessionExpired, Unavailable
from ..layout import Layout
from ..protocol.sizes import cdiv
from .blocks import copy_pool_to_vllm, copy_vllm_to_pool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.kvpool_connector")  # under "vllm": vLLM's log handlers show it

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass
class LoadSpec:
    """Copy pool blocks into vLLM blocks ``block_ids[first:last]`` of one request."""

    req_id: str
    tokens: list[int]  # the prompt through block ``last`` (what the pool's sequence is created from)
    extra_key: str
    block_ids: list[int]  # vLLM block ids by position in the request
    first: int
    last: int


@dataclass
class SaveSpec:
    """Copy vLLM blocks ``block_ids[:len(tokens) // block_size]`` into the pool (those it lacks)."""

    req_id: str
    tokens: list[int]  # the request's whole blocks (prompt and generated tokens)
    extra_key: str
    block_ids: list[int]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Track:
    """Scheduler-side state of one running request."""

    tokens: Any  # the Request's all_token_ids: a live view, generated tokens are appended as they are sampled
    extra_key: str
    block_ids: list[int]
    saved_blocks: int = 0  # blocks known to be in the pool (loaded or saved)


def _locked(method):
    """Runs ``method`` under the connector's lock: the shutdown watcher never drops the session mid-call."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


def layout_for_vllm(vllm_config: "VllmConfig") -> Layout:
    """kvpool's layout for a vLLM engine: the model's geometry, vLLM's block size.

    ``model_id``: ``kv_connector_extra_config["model_id"]``, else the model name
    or path vLLM loaded; ``revision`` likewise.  Two engines share blocks only
    when both are equal (and the geometry, which follows).
    """
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    if cc.cache_dtype not in ("auto", None):
        raise NotImplementedError(f"KvpoolConnector: kv_cache_dtype {cc.cache_dtype!r} is not supported yet")
    dtype = _DTYPES.get(mc.dtype)
    if dtype is None:
        raise NotImplementedError(f"KvpoolConnector: model dtype {mc.dtype} is not supported")
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise NotImplementedError("KvpoolConnector: tensor / pipeline parallelism is not supported yet")
    return Layout(
        str(extra.get("model_id") or mc.model),
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        dtype=dtype,
        block_size=cc.block_size,
        revision=str(extra.get("revision") or mc.revision or ""),
    )


def extra_key_for(request: "Request", vllm_config: "VllmConfig") -> str:
    """What besides the model and the tokens changes a request's KV, as the pool's ``extra_key``."""
    parts = []
    quant = getattr(vllm_config.model_config, "quantization", None)
    if quant:
        parts.append(f"q={quant}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}:{lora.lora_int_id}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    return "|".join(parts)


class KvpoolConnector(KVConnectorBase_V1):
    """vLLM KV connector over kvpoold (scheduler and worker roles)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._socket = extra.get("socket") or os.environ.get("KVPOOL_SOCKET")
        self._layout = layout_for_vllm(vllm_config)
        self._block_size = self._layout.block_size
        self._name = f"vllm-{'scheduler' if role == KVConnectorRole.SCHEDULER else 'worker'}-{os.getpid()}"
        self._timeout = float(extra.get("timeout", 10.0))  # seconds per daemon call
        self._retry_seconds = float(extra.get("retry_seconds", 5.0))  # between attaches while kvpoold is away
        self._retry_at = 0.0
        self._client: Client | None = None
        self._lock = threading.RLock()  # the vLLM thread's calls vs the shutdown watcher
        # scheduler side
        self._pending: dict[str, tuple["Request", str, int]] = {}  # req_id -> (request, extra_key, tokens to load)
        self._looked_up: dict[str, int] = {}  # req_id -> pool hit (tokens) of a request still waiting
        self._reqs: dict[str, _Track] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._pool: torch.Tensor | None = None
        self._step_loads: list[tuple[list[int], list[int]]] = []  # (pool block ids, vLLM block ids)
        # per save group: ([(pool block ids, vLLM block ids)], the layers copied)
        self._save_groups: list[tuple[list[tuple[list[int], list[int]]], set[str]]] = []
        self._save_plan: Future | None = None  # the saves' creates, in the RPC thread
        # this step's sequences: (sequence, the vLLM blocks its new pool blocks were computed from)
        self._step_seqs: list[tuple[Any, list[int]]] = []
        self._step_unwritten: list = []  # this step's sequences holding pool blocks nobody writes: never freed
        self._loaded_layers: set[str] = set()
        # the worker's daemon calls that leave the step (the saves' creates, the frees), in order
        self._rpc = ThreadPoolExecutor(1, thread_name_prefix="kvpool-connector-rpc")
        self._failed: set[int] = set()
        self._attach(wait=True)  # kvpoold must be there at start-up (a wrong socket is an error)
        logger.info("KvpoolConnector %s attached to kvpoold at %s as %s", self._name, self._socket, self._layout)

    # ============================== the session ==============================
    def _attach(self, wait: bool) -> Client:
        c = connect(self._socket, name=self._name, layout=self._layout, timeout=self._timeout, reconnect=wait)
        if self._kv_caches:  # a worker: map this daemon's pool
            try:
                self._pool = c.kv_cache()
            except BaseException:
                c.close()
                raise
        self._client = c
        threading.Thread(target=self._watch_shutdown, args=(c,), name="kvpool-connector-watch", daemon=True).start()
        return c

    def _watch_shutdown(self, c: Client) -> None:
        """Detach as soon as kvpoold says it is stopping: it waits for its clients (``--shutdown-timeout``),
        and an idle engine makes no call that would notice.  vLLM computes without it meanwhile; the
        next call after ``retry_seconds`` attaches to the restarted daemon."""
        while self._client is c:
            if c.daemon_shutting_down.wait(1.0):
                with self._lock:
                    if self._client is c:
                        logger.info("KvpoolConnector %s: kvpoold is stopping; detached", self._name)
                        self._retry_at = time.monotonic() + self._retry_seconds
                        self._drop()
                return

    def _live(self) -> Client | None:
        """The kvpool session, or None while kvpoold is away (a new attach is tried every retry_seconds)."""
        c = self._client
        if c is not None and not c.session_expired.is_set():
            return c
        now = time.monotonic()
        if now < self._retry_at:
            return None
        self._retry_at = now + self._retry_seconds
        self._drop()
        try:
            c = self._attach(wait=False)
        except Exception as exc:  # noqa: BLE001 - still away: vLLM computes meanwhile
            logger.warning("KvpoolConnector: kvpoold at %s is away (%s); computing without it", self._socket, exc)
            return None
        logger.info("KvpoolConnector %s attached to kvpoold again", self._name)
        return c

    def _failed_call(self, what: str, exc: Exception) -> None:
        logger.warning("KvpoolConnector: %s failed (%s)", what, exc)
        if isinstance(exc, (Unavailable, SessionExpired)):
            self._drop()  # the next step attaches again (a restarted daemon is a new session)

    def _drop(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            # closing unmaps the pool: this step's copies are abandoned (their loads recomputed)
            for _, vllm_ids in self._step_loads:
                self._failed.update(vllm_ids)
            self._step_loads, self._save_groups, self._step_seqs, self._pool = [], [], [], None
            self._step_unwritten, self._save_plan = [], None
            try:
                c.close()
            except Exception:  # noqa: BLE001 - the daemon is gone
                pass

    # ============================== scheduler side ==============================
    @_locked
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        # all_token_ids: the prompt for a new request; prompt and generated tokens for a preempted one
        prompt = list(request.all_token_ids)
        key = extra_key_for(request, self._vllm_config)
        self._pending[request.request_id] = (request, key, 0)
        hit = self._looked_up.get(request.request_id)
        if hit is None:
            # One lookup per admission: vLLM asks again each step a request waits for room, and
            # counts the query once (when it is scheduled); the daemon counts each lookup, so a
            # waiting request reuses its answer (a prefix evicted meanwhile fails the load,
            # which vLLM recomputes).  known_tokens: vLLM's own hit, which it does not ask us for.
            client = self._live() if prompt else None
            if client is None:
                return 0, False
            try:
                hit = client.lookup(prompt, extra_key=key, known_tokens=num_computed_tokens)
            except Exception as exc:  # noqa: BLE001 - the daemon away: no hit, vLLM computes
                self._failed_call("lookup", exc)
                return 0, False
            self._looked_up[request.request_id] = hit
        hit = min(hit, len(prompt) - 1)  # vLLM computes at least the last prompt token
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        _, key, _ = self._pending.get(request.request_id, (request, "", 0))
        self._pending[request.request_id] = (request, key, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvpoolConnectorMetadata()
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            if not new.prompt_token_ids:
                continue
            pending = self._pending.pop(new.req_id, None)
            self._looked_up.pop(new.req_id, None)
            if pending is None:
                continue  # not seen by get_num_new_matched_tokens: its token ids are not at hand
            request, key, ext = pending
            t = self._reqs[new.req_id] = _Track(request.all_token_ids, key, list(new.block_ids[0]))
            self._plan(meta, new.req_id, t, new.num_computed_tokens, ext, so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            ext = 0
            if req_id in cached.resumed_req_ids:  # preempted and back: all its blocks are new
                t.block_ids = list(new_ids[0]) if new_ids is not None else []
                t.saved_blocks = 0
                ext = self._pending.pop(req_id, (None, "", 0))[2]
                self._looked_up.pop(req_id, None)
            elif new_ids is not None:
                t.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, t, cached.num_computed_tokens[i], ext, so.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _plan(self, meta: KvpoolConnectorMetadata, req_id: str, t: _Track, computed: int, ext: int,
              scheduled: int) -> None:
        """This step's load (``ext`` tokens before ``computed``) and save (new full blocks).

        After the step the KV of positions ``[0, computed + scheduled)`` is written.  A block is
        saved once its KV is written and its token ids are known (with asynchronous scheduling a
        sampled token is known a step after its position is scheduled: its block is saved then,
        from the request's blocks, which stay put while it runs)."""
        bs = self._block_size
        if ext > 0:
            first = (computed - ext) // bs
            last = cdiv(computed, bs)
            meta.loads.append(LoadSpec(req_id, list(t.tokens[:last * bs]), t.extra_key, t.block_ids[:last], first,
                                       last))
            t.saved_blocks = max(t.saved_blocks, computed // bs)
        full = min(computed + scheduled, len(t.tokens), len(t.block_ids) * bs) // bs
        if full > t.saved_blocks:
            meta.saves.append(SaveSpec(req_id, list(t.tokens[:full * bs]), t.extra_key, t.block_ids[:full]))
            t.saved_blocks = full

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._looked_up.pop(request.request_id, None)
        return False, None

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self._layout.num_layers:
            raise NotImplementedError(
                f"KvpoolConnector: {len(names)} KV cache layers but the model has {self._layout.num_layers}")
        self._kv_caches = dict(kv_caches)
        self._layer_index = {n: i for i, n in enumerate(names)}
        first = kv_caches[names[0]]
        logger.info("KvpoolConnector: vLLM KV cache per layer %s %s (%d layers)", tuple(first.shape), first.dtype,
                    len(names))
        self._pool = self._client.kv_cache()  # the session attached in __init__ (not yet mapped)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._begin_step(connector_metadata)

    @_locked
    def _begin_step(self, meta: KVConnectorMetadata) -> None:
        """Runs before every step's forward (``start_load_kv`` runs after it when nothing loads
        synchronously).  The pool blocks of the saves are asked for here, in the RPC thread, so the
        daemon's round trip overlaps the forward and its ``save_kv_layer`` hooks copy each layer as
        soon as it is written.  A step that loads leaves its saves to ``start_load_kv``: a load must
        be created before the step's saves (see ``_plan_saves``)."""
        self._step_loads, self._save_groups, self._step_seqs, self._step_unwritten = [], [], [], []
        self._loaded_layers = set()
        self._save_plan = None
        if not getattr(meta, "loads", ()):
            self._plan_saves(getattr(meta, "saves", ()))

    def _plan_saves(self, saves) -> None:
        """Asks the RPC thread for the pool blocks of this step's saves, leaving out a save whose
        blocks include one that failed to load this step: those vLLM blocks hold no KV, nor does
        what was computed after them (vLLM recomputes both).

        After this step's loads were created: this session sees the blocks its own sequences
        registered as cached before they are written (a save's are copied during the forward,
        after the loads' copies read the pool), so a load created after a save of the same
        prefix would take those unwritten blocks for loaded ones."""
        saves = [sv for sv in saves if self._failed.isdisjoint(self._save_sources(sv))]
        client = self._live() if saves else None
        if client is not None and self._pool is not None:
            self._save_plan = self._rpc.submit(self._create_saves, client, saves)

    def _save_sources(self, sv: SaveSpec) -> list[int]:
        """The vLLM blocks a save's KV was computed from: all the request's blocks through its last saved one."""
        return sv.block_ids[:len(sv.tokens) // self._block_size]

    @staticmethod
    def _create_saves(client: Client, saves: list[SaveSpec]):
        """In the RPC thread (never under the connector's lock: the vLLM thread waits for this
        while holding it).  Returns the client and, per save, (save, sequence or None, pool block
        ids or the error)."""
        out = []
        for sv in saves:
            try:
                seq = client.create_sequence(sv.tokens, extra_key=sv.extra_key, counted=False)
                out.append((sv, seq, client.block_ids(seq)))
            except Exception as exc:  # noqa: BLE001 - reported by the vLLM thread
                out.append((sv, None, exc))
        return client, out

    def _take_saves(self, wait: bool) -> None:
        """Adds the background creates' copies to this step's saves once the daemon answered
        (``wait``: waits for it)."""
        plan = self._save_plan
        if plan is None or not (wait or plan.done()):
            return
        self._save_plan = None
        client, created = plan.result()
        bs, pairs = self._block_size, []
        for sv, seq, ids in created:
            if client is not self._client:
                return  # the session was dropped meanwhile: its pool is unmapped
            if seq is None:
                self._failed_call(f"save of {sv.req_id} (skipped)", ids)
                continue
            self._step_seqs.append((seq, self._save_sources(sv)))
            cached, n = seq.num_cached_tokens // bs, len(sv.tokens) // bs
            if cached < n:
                pairs.append((ids[cached:n], sv.block_ids[cached:n]))
        if pairs:
            self._save_groups.append((pairs, set()))

    @_locked
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata)
        if not meta.loads:
            return  # the saves were planned in _begin_step
        bs = self._block_size
        client = self._live()
        for ld in meta.loads:
            want = ld.block_ids[ld.first:ld.last]
            try:
                if client is None:
                    raise Unavailable("kvpoold is away")
                # counted=False: the scheduler's lookup was this request's prefix query
                seq = client.create_sequence(ld.tokens, extra_key=ld.extra_key, counted=False)
            except Exception as exc:  # noqa: BLE001 - recompute these blocks
                self._failed_call(f"load of {ld.req_id} (recomputed)", exc)
                client = self._client
                self._failed.update(want)
                continue
            have = min(seq.num_cached_tokens // bs, ld.last)
            if have < ld.last:
                # Came back short (evicted since the lookup, or a lower tier's read failed): the
                # sequence's blocks past ``have`` are new and registered to this session as
                # unwritten, for it to write.  It writes none of them, so it must not free the
                # sequence: a free tells the daemon they are written (every session's hits).
                self._failed.update(ld.block_ids[max(have, ld.first):ld.last])
                self._step_unwritten.append(seq)
            else:
                self._step_seqs.append((seq, []))  # holds cached blocks only: its free confirms nothing
            if have > ld.first:
                self._step_loads.append((client.block_ids(seq)[ld.first:have], ld.block_ids[ld.first:have]))
        self._plan_saves(meta.saves)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._copy_layer(layer_name, self._step_loads, self._loaded_layers, to_vllm=True)

    @_locked
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._take_saves(wait=False)
        for pairs, done in self._save_groups:
            self._copy_layer(layer_name, pairs, done, to_vllm=False)

    @_locked
    def _copy_layer(self, layer_name: str, pairs, done: set[str], to_vllm: bool) -> None:
        """One layer's blocks of this step's loads (pool -> vLLM) or saves (vLLM -> pool), once."""
        layer = self._layer_index.get(layer_name)
        if not pairs or layer is None or layer_name in done or self._pool is None:
            return
        kv, bs = self._kv_caches[layer_name], self._block_size
        for pool_ids, vllm_ids in pairs:
            if to_vllm:
                copy_pool_to_vllm(self._pool, layer, kv, bs, pool_ids, vllm_ids)
            else:
                copy_vllm_to_pool(kv, bs, self._pool, layer, vllm_ids, pool_ids)
        done.add(layer_name)

    @_locked
    def wait_for_save(self):
        """Every save copy is done when this returns: vLLM may reuse a block as soon as the step
        ends (a finished or preempted request's blocks are reallocated, and zeroed, before any
        hook of the next step runs), so the copies cannot outlive the step.  Only the daemon call
        that publishes the copied blocks (``free``) is left to the RPC thread; the next step's
        calls queue behind it."""
        if self._step_loads and len(self._loaded_layers) < len(self._layer_index):
            # a layer ran without wait_for_layer_load: its copy is missing, recompute those blocks
            for _, vllm_ids in self._step_loads:
                self._failed.update(vllm_ids)
        self._take_saves(wait=True)
        for name in self._layer_index:  # the layers whose hook ran before the pool blocks were known
            for pairs, done in self._save_groups:
                self._copy_layer(name, pairs, done, to_vllm=False)
        written = [seq for seq, sources in self._step_seqs if self._failed.isdisjoint(sources)]
        unwritten = self._step_unwritten + [seq for seq, sources in self._step_seqs
                                            if not self._failed.isdisjoint(sources)]
        self._step_seqs, self._step_unwritten, self._step_loads, self._save_groups = [], [], [], []
        client = self._client
        if client is None:
            return
        if written:
            self._rpc.submit(self._free, client, written)
        if unwritten:
            self._leave_unwritten(client, len(unwritten))

    def _leave_unwritten(self, client: Client, n: int) -> None:
        """Ends the session without freeing the sequences whose blocks hold no KV: detaching frees
        them as unwritten, so the daemon forgets their blocks' hashes (a free would publish them).
        In the RPC thread, after the step's free; the next step attaches a new session, which
        (unlike this one) never takes those blocks for cached ones."""
        logger.warning("KvpoolConnector: %d sequence(s) hold blocks a failed load left unwritten; "
                       "detaching so kvpoold drops them", n)
        self._client, self._pool, self._retry_at = None, None, 0.0
        self._rpc.submit(client.close)

    def _free(self, client: Client, seqs: list) -> None:
        """In the RPC thread: tells the daemon the saved KV is written (other processes may read it
        from then on) and unpins the loaded blocks."""
        try:
            client.free(seqs)
        except Exception as exc:  # noqa: BLE001 - a daemon gone is noticed by the next call
            logger.warning("KvpoolConnector: free failed (%s)", exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self):
        self._rpc.shutdown(wait=True)  # the last step's free: its saves reach the pool
        with self._lock:
            self._drop()
