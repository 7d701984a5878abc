"""The engine: requests arrive at any time and join the running batch at the next step."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Callable, Iterable, Sequence as Seq

from ..errors import InvalidArgument
from ..fused import install as install_fused
from ..hf import PagedModel
from ..protocol.sizes import cdiv
from .detok import TextTracker
from .graphs import GraphRunner
from .inbox import Inbox
from .params import EngineConfig, SamplingParams
from .request import Request, RequestOutput
from .runner import StepRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .step_loop import StepLoop
from .stats import EngineStats, eos_token_ids, has_host_tier
from .stream import RequestStream
from .timings import StepTimings, TimingLog


class Engine:
    """Continuous batching of generation requests over a ``PagedModel`` whose KV lives in kvpool.

    Thread-safe entry points: ``add_request`` / ``add_request_async``,
    ``abort``, ``stats``.  The steps run either on a background thread
    (``start``) or when the caller calls ``step`` (tests, benchmarks).

    Parts: requests and aborts wait in an ``Inbox`` (the one thing the
    request threads and the engine thread share); the ``step_loop``
    (``StepLoop``) takes them and runs each step with its ``scheduler``,
    ``runner`` and sampler.

    Figures: ``stats()`` snapshots the counters (``after - before`` of two
    snapshots is the work between them, see ``EngineStats``); ``timings`` is
    the ``TimingLog`` of the steps (``timings.reset()`` starts a new stretch,
    ``timings.summary()`` sums it).

    Args:
        model: the ``PagedModel`` (model, client, pool).
        tokenizer: a transformers tokenizer, needed for text prompts, text
            outputs and stop strings; optional otherwise.
        config: the step limits (``EngineConfig``).
    """

    def __init__(self, model: PagedModel, *, tokenizer=None, config: EngineConfig | None = None,
                 owns_model: bool = False) -> None:
        cfg = config or EngineConfig()
        self.model, self.client, self.tokenizer, self.config = model, model.client, tokenizer, cfg
        self._owns_model = owns_model
        limit = getattr(model.model.config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        self.vocab_size = model._vocab()
        self.eos_token_ids = frozenset(cfg.eos_token_ids or eos_token_ids(model.model, tokenizer))
        self.swap = has_host_tier(self.client)
        install_fused(model, max_positions=self.max_model_len, mode=cfg.fused_layers)
        runner = GraphRunner if cfg.cuda_graphs and model.device.type == "cuda" else StepRunner
        self.timings = TimingLog()
        self._inbox = Inbox()
        self.step_loop = StepLoop(
            self.client, inbox=self._inbox, timings=self.timings, max_model_len=self.max_model_len,
            scheduler=Scheduler(self.client, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.swap),
            runner=runner(model, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                          cdiv(self.max_model_len, model.layout.block_size)),
            sampler=Sampler(),
            overlap=cfg.overlap_steps if cfg.overlap_steps is not None else model.device.type == "cuda",
        )
        self._thread: threading.Thread | None = None

    @property
    def scheduler(self) -> Scheduler:
        """The step loop's scheduler (its queues and counters)."""
        return self.step_loop.scheduler

    @property
    def runner(self) -> StepRunner:
        """The step loop's runner (a ``GraphRunner`` on a GPU with ``cuda_graphs``)."""
        return self.step_loop.runner

    @classmethod
    def connect(cls, model, address: str | None = None, *, name: str, model_id: str, revision: str = "",
                block_size: int = 16, tokenizer=None, config: EngineConfig | None = None, **connect_kwargs):
        """Attach ``model`` to kvpoold (``PagedModel.connect``) and make an engine on it; ``close()`` detaches."""
        cfg = config or EngineConfig()
        pm = PagedModel.connect(model, address, name=name, model_id=model_id, revision=revision,
                                block_size=block_size, flush_every=cfg.flush_every, **connect_kwargs)
        try:
            return cls(pm, tokenizer=tokenizer, config=cfg, owns_model=True)
        except BaseException:
            pm.close()
            raise

    def warm_up(self) -> "Engine":
        """On a GPU with ``cuda_graphs``, capture every decode graph now rather than on first use; returns self.

        Call before ``start``: a capture takes the model's forward about
        twice per batch-size bucket (``graph_batch_sizes``).
        """
        if isinstance(self.runner, GraphRunner):
            self.runner.capture_all()
        return self

    # -- requests (any thread) -------------------------------------------------------------------
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, callback: Callable | None = None,
                    _loop: asyncio.AbstractEventLoop | None = None):
        """Queue a request; it joins the batch at the next step.

        Args:
            prompt: token ids, or text (needs the tokenizer).
            params: sampling and stopping (``SamplingParams``; default: its defaults).
            request_id: a unique name (default: a fresh one).
            callback: called on the engine thread with each ``RequestOutput``.

        Returns:
            The request's ``RequestStream``: iterate it for the updates, or ``result()``.

        Raises:
            InvalidArgument: an empty or too long prompt, unknown token ids,
                text or stop strings without a tokenizer, a duplicate id.
        """
        params = params or SamplingParams()
        ids = self.prompt_ids(prompt)
        self._check_params(params)
        rid = request_id or uuid.uuid4().hex
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        needs_text = self.tokenizer is not None
        stream = RequestStream(rid, loop=_loop, callback=callback)
        text = TextTracker(self.tokenizer, params.stop, stops) if needs_text else None
        req = Request(rid, ids, params, stream, text)
        req.stop_ids = stops
        self._inbox.put(req)
        return stream

    def add_request_async(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                          request_id: str | None = None, callback: Callable | None = None):
        """``add_request`` from a coroutine: the returned stream is an async iterator on the running loop."""
        return self.add_request(prompt, params, request_id=request_id, callback=callback,
                                _loop=asyncio.get_running_loop())

    def abort(self, request_id: str) -> None:
        """Cancel a request: its sequence is freed at the start of the next step (at once when idle)."""
        self._inbox.abort(request_id)

    def generate(self, prompts: Iterable[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to the end (stepping here unless the background thread runs); final outputs in order.

        Args:
            prompts: token ids or texts, as ``add_request`` takes them.
            params: one ``SamplingParams`` for every prompt (default: its
                defaults), or a list or tuple of one per prompt.

        Raises:
            InvalidArgument: ``params`` is neither, or its length is not the
                prompts'; or a prompt or its params are refused as by
                ``add_request``.  Every prompt is checked first: on an error,
                none is queued.
        """
        prompts = list(prompts)
        per_prompt = self._params_per_prompt(params, len(prompts))
        ids = [self.prompt_ids(p) for p in prompts]
        for p in per_prompt:
            self._check_params(p)
        streams = [self.add_request(i, p) for i, p in zip(ids, per_prompt)]
        if self._thread is None:
            while any(s.last is None or not s.last.finished for s in streams):
                self.step()
        return [s.result() for s in streams]

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidArgument("params must be a SamplingParams or a list of one SamplingParams per prompt")
        if len(params) != count:
            raise InvalidArgument(f"{len(params)} SamplingParams for {count} prompts; pass one per prompt")
        return list(params)

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need the engine's tokenizer")

    def prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        """The checked token ids of a prompt (text is tokenized).

        Raises:
            InvalidArgument: what ``add_request`` would refuse the prompt for.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument("a text prompt needs the engine's tokenizer; pass token ids")
            prompt = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidArgument("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidArgument(f"the prompt has {len(ids)} tokens; this model takes at most "
                                  f"{self.max_model_len - 1} (max_model_len {self.max_model_len} with one to generate)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidArgument(f"token ids must be in [0, {self.vocab_size})")
        return ids

    # -- stepping --------------------------------------------------------------------------------------
    def step(self) -> StepTimings:
        """One step here (``StepLoop.step``): requests join, the batch runs; its timings (kept in ``timings``)."""
        return self.step_loop.step()

    def start(self) -> "Engine":
        """Run steps on a background thread whenever there is work."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.step_loop.run, name="kvpool-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether the background thread is stepping."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the background thread after its step; requests still queued end with ``"abort"``."""
        self._inbox.stop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.step_loop.end_all()

    def close(self) -> None:
        """``stop``, then detach when the engine made the client (``connect``)."""
        try:
            self.stop()
        finally:
            if self._owns_model:
                self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> EngineStats:
        """Queue lengths and counters (read from any thread; a moment's snapshot; subtract two for deltas)."""
        s = self.scheduler
        return EngineStats(
            waiting=len(s.waiting) + self._inbox.num_requests, running=len(s.running), swapped=len(s.swapped),
            preemptions=s.num_preemptions, swaps=s.num_swaps, recomputes=s.num_recomputes,
            prefix_hit_tokens=s.prefix_hit_tokens, **self.step_loop.counts,
        )
