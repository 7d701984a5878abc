"""The engine thread's part of ``Engine``: one step at a time, and what each sampled token ends."""

from __future__ import annotations

import logging
import time

from .inbox import Inbox
from .launched import Launched
from .request import Request, Status
from .runner import StepRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .timings import StepTimings, TimingLog

log = logging.getLogger("kvpool.engine")


class StepLoop:
    """Steps for ``Engine``: take the inbox, plan, run the forward, sample, stream, free.

    Only the engine thread (or a caller stepping by hand) runs these; what
    it shares with the threads that send requests is the ``Inbox``.
    ``requests`` are the requests taken from the inbox and not ended yet;
    ``counts`` the figures ``Engine.stats`` adds to the scheduler's.

    Overlapped steps (``overlap``): a step's tokens are read back during the
    next ``step`` call, after that call has queued its own forward, so the
    host's work (planning, filling buffers, streaming tokens) runs while the
    device computes.  When the next step is the running requests' next
    decode tokens, and waiting prompts that fit it whole, with no call that
    carries tokens (``Scheduler.can_plan_ahead``), it is planned before the
    last tokens are known: the decode rows' input ids come from the last
    step's sampled ids on the device, their positions are queued as tokens
    of unknown id (``Client.extend_ahead``) and filled in when read.
    Anything else (chunked admissions, swap-ins, aborts, a ``Step`` call)
    first reads the step in flight, so the daemon hears only of tokens that
    are known and computed.  A request that stopped at step n was already in
    step n+1: that step's token for it is dropped, the others go on ahead
    without it, and its sequence is freed at the next step that reads first.

    Args:
        client: the ``kvpool.Client`` (frees, marks prompts written).
        scheduler, runner, sampler: the step's parts.
        inbox: where new requests and aborts come from.
        timings: the log each step's ``StepTimings`` goes to.
        max_model_len: the longest a sequence may grow (prompt and output).
        overlap: overlapped steps (see above).
    """

    def __init__(self, client, *, scheduler: Scheduler, runner: StepRunner, sampler: Sampler, inbox: Inbox,
                 timings: TimingLog, max_model_len: int, overlap: bool = False) -> None:
        self.client, self.scheduler, self.runner, self.sampler = client, scheduler, runner, sampler
        self._inbox, self._timings, self._max_model_len = inbox, timings, max_model_len
        self.overlap = overlap
        self.requests: dict[str, Request] = {}
        self.counts = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0, "steps": 0,
                       "steps_ahead": 0}
        self._post_mortem_done = False
        self._in_flight: Launched | None = None
        self._owed_marks: list[Request] = []  # prompts to mark written once the step in flight is read
        self._owed_frees: list[Request] = []  # finished requests to free once the step in flight is read

    @property
    def has_work(self) -> bool:
        """Requests to run, a step in flight, or daemon calls owed."""
        return self.scheduler.has_work or self._in_flight is not None or bool(self._owed_frees)

    def step(self) -> StepTimings:
        """One scheduler step: take new requests and aborts, plan, run the forward, sample, stream.

        Returns:
            The step's ``StepTimings`` (also kept in ``timings``).
        """
        t, t0 = StepTimings(), time.perf_counter()
        before = self._daemon_counters()
        aborts = self._take_inbox()
        ahead = None if aborts else self._ahead()
        if self._in_flight is not None and ahead is None:
            self._read(self._in_flight, t, successor=None)
        try:
            with t.phase("schedule"):
                self._abort(aborts, t)
                if not ahead:  # (a daemon call now would wait for the step in flight)
                    self._settle(t)
                plan = self.scheduler.plan_ahead(ahead, t) if ahead else self.scheduler.plan(t)
        except Exception as exc:  # noqa: BLE001 - the daemon is gone or refused: end every request, keep the thread
            # (a CUDA fault of the last step surfaces here, at the synchronize before a call)
            self._step_failed(exc, "scheduling failed", list(self.requests.values()), "the pool refused the step")
            return self._close(t, t0, before)
        t.schedule -= t.daemon  # report the two apart
        self.counts["steps_ahead"] += bool(ahead)
        for req, message in plan.failed:
            self._finish(req, "error", error=message)
        launched = self._launch(plan, t, feed=self._in_flight if ahead else None) if plan.items else None
        if self._in_flight is not None:
            self._read(self._in_flight, t, successor=launched)
        self._in_flight = launched
        if launched is not None and not self.overlap:
            self._read(launched, t, successor=None)
        self.counts["steps"] += 1
        self._timings.add(self._close(t, t0, before))
        return t

    def _ahead(self) -> list[Request] | None:
        """The requests of the next step when it can be planned before the step in flight is read, else None.

        Left out: requests that stopped before the step in flight, and those its token ends by length.  Their
        frees (and prompts to mark written) wait for the next step that reads first, at the latest the
        ``flush_every``-th.
        """
        flight = self._in_flight
        if flight is None or (self._owed_frees and self.scheduler.waiting):
            return None  # waiting requests need the room those frees give back first
        reqs, ending = [], 0
        for req in flight.sampling:
            if req.finish_reason is not None:
                continue
            if req.unread != 1 or req.num_computed != req.num_tokens:
                return None  # a prefill chunk
            if len(req.output) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= self._max_model_len:
                ending += 1
            else:
                reqs.append(req)
        return reqs if reqs and self.scheduler.can_plan_ahead(reqs, ending=ending) else None

    def _step_failed(self, exc: Exception, what: str, reqs: list[Request], message: str = "the step failed") -> None:
        """Log ``what`` failed (and, after a CUDA error, whether the last step's inputs were sound); end ``reqs``."""
        log.exception("%s; its requests end with an error", what)
        self._post_mortem(exc)
        self._fail(reqs, f"{message}: {exc!r}")

    def _post_mortem(self, exc: Exception) -> None:
        """After the first CUDA error: whether the inputs of the last step that ran kernels were sound (the fault
        is reported at the next synchronize: in that step's sampling, or in the next step's first daemon call)."""
        if "CUDA error" in str(exc) and not self._post_mortem_done:
            self._post_mortem_done = True
            log.error("%s", self.runner.post_mortem())

    def _daemon_counters(self) -> tuple[float, float, int]:
        c = self.client
        return c.device_wait_seconds, c.chunk_sync_seconds, c.rpcs

    def _close(self, t: StepTimings, t0: float, before: tuple[float, float, int]) -> StepTimings:
        """The step's total; how long its daemon calls waited for the GPU and mapped chunks, and how many."""
        now = self._daemon_counters()
        t.gpu_wait, t.chunk_sync, t.daemon_calls = (a - b for a, b in zip(now, before))
        t.total = time.perf_counter() - t0
        return t

    def _launch(self, plan, t: StepTimings, feed: Launched | None) -> Launched | None:
        """Queue the step's forward and sampling on the device; ``feed``: the step whose sampled ids are this
        one's input ids (row for row)."""
        try:
            with t.phase("prepare"):
                num_tokens, max_len = self.runner.prepare(plan.items)
                if feed is not None:  # the rows of feed's requests that this step continues, in order
                    going_on = {id(r) for r in plan.requests}
                    keep = [i for i, r in enumerate(feed.sampling) if id(r) in going_on]
                    self.runner.feed(feed.tokens, None if len(keep) == len(feed.rows) else keep)
            t.num_tokens, t.num_seqs = num_tokens, len(plan.items)
            t.num_prefill_tokens = sum(len(it.tokens) for it in plan.items if len(it.tokens) > 1)
            with t.phase("forward"):
                logits = self.runner.forward(len(plan.items), num_tokens, max_len)
                rows, prefilled, positions = [], [], []
                for row, (req, item) in enumerate(zip(plan.requests, plan.items)):
                    req.num_computed = item.start + len(item.tokens)
                    if req.num_computed == req.num_tokens + req.unread:
                        rows.append(row)
                        positions.append(len(req.output) + req.unread)
                        if len(item.tokens) > 1:
                            prefilled.append(req)
                sampling = [plan.requests[r] for r in rows]
                rows_logits = logits if len(rows) == len(plan.items) else logits[rows]
                tokens = self.sampler.choose(rows_logits, sampling, positions) if rows else None
                for req in sampling:
                    req.unread += 1
                return Launched.queue(plan, rows, tokens, prefilled)
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
            self._step_failed(exc, "a step failed", plan.requests)
            return None

    def _read(self, launched: Launched, t: StepTimings, successor: Launched | None) -> None:
        """Read a step's tokens back and hand them over; daemon calls wait until no step is in flight."""
        if launched is self._in_flight:
            self._in_flight = None
        with t.phase("sample"):
            try:
                tokens = launched.read()
            except Exception as exc:  # noqa: BLE001 - the device failed: this step's and the next one's requests end
                self._step_failed(exc, "a step failed",
                                  launched.plan.requests + (successor.plan.requests if successor else []))
                return
            done = []
            for req, tok in zip(launched.sampling, tokens):
                req.unread -= 1
                if req.finish_reason is not None:
                    continue  # it stopped at the last step: this token was computed ahead, and is dropped
                if req.num_computed > req.num_tokens:  # the step in flight already computes this position
                    self.client.fill_token(req.seq, req.num_tokens, tok)
                if self._append(req, tok):
                    done.append(req)
        self._owed_marks += [r for r in launched.prefilled if r.finish_reason is None]
        self._owed_frees += done
        if successor is None:
            try:
                self._settle(t)
            except Exception as exc:  # noqa: BLE001 - the daemon is gone or refused: end this step's requests
                self._step_failed(exc, "a daemon call after a step failed", launched.plan.requests)

    def _settle(self, t: StepTimings) -> None:
        """The daemon calls owed: prompts other processes may reuse from now on, and finished requests' frees."""
        if not (self._owed_marks or self._owed_frees):
            return
        marks, frees = self._owed_marks, self._owed_frees
        self._owed_marks, self._owed_frees = [], []
        with t.phase("daemon"):
            live = [r.seq for r in marks if r.seq is not None and r.finish_reason is None]
            if live:
                self.client.mark_written(live)
            self._release(frees)

    def _append(self, req: Request, token: int) -> bool:
        """Add a sampled token, check the stop conditions, stream the update; whether it finished."""
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        req.output.append(token)
        self.counts["generation_tokens"] += 1
        reason, text, hit = None, "", False
        if token in req.stop_ids:
            reason = "stop"
        if req.text is not None:
            text, hit = req.text.update(req.output)
            reason = "stop" if hit else reason
        if reason is None and (len(req.output) >= req.params.max_tokens or req.num_tokens >= self._max_model_len):
            reason = "length"
        if reason is not None:
            req.finish_reason, req.finish_time, req.status = reason, now, Status.FINISHED
            if req.text is not None and not hit:
                text += req.text.flush()
            self._forget(req)
        req.stream.put(req.snapshot([token], text))
        return reason is not None

    def end_all(self) -> None:
        """End every request, queued or running, with ``"abort"`` (the engine stopped)."""
        t = StepTimings()
        self._take_inbox()
        if self._in_flight is not None:
            self._read(self._in_flight, t, successor=None)
        self._settle(t)
        for req in list(self.requests.values()):
            self._finish(req, "abort")

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request that is out of the scheduler's queues (abort, error); free its sequence.

        A request that ends in an error may have had its tokens announced to the daemon without the
        forward that writes them, so its blocks are freed as unwritten (never prefix hits).
        """
        req.finish_reason, req.finish_time, req.status = reason, time.monotonic(), Status.FINISHED
        self._forget(req)
        if req.seq is not None:
            self._release([req], written=reason != "error")
        req.stream.put(req.snapshot([], req.text.flush() if req.text and reason != "error" else "", error))

    def _forget(self, req: Request) -> None:
        self.scheduler.remove(req)
        self.requests.pop(req.id, None)
        self.counts["finished_requests"] += 1
        self._inbox.release(req.id)

    def _release(self, reqs: list[Request], *, written: bool = True) -> None:
        seqs = [r.seq for r in reqs if r.seq is not None]
        for r in reqs:
            r.seq = None
        if seqs:
            self.client.free(seqs, written=written)

    def _fail(self, reqs: list[Request], message: str) -> None:
        try:  # positions queued ahead for a step that did not run (the daemon must never hear of them)
            self.client.drop_unknown([r.seq for r in reqs if r.seq is not None and r.finish_reason is None])
        except Exception:  # noqa: BLE001 - ending the requests comes first
            log.exception("could not take back the positions queued ahead")
        for req in reqs:
            if req.finish_reason is None:
                try:
                    self._finish(req, "error", error=message)
                except Exception:  # noqa: BLE001 - the daemon may be the thing that failed
                    req.seq = None
                    req.stream.put(req.snapshot([], "", message))

    def _take_inbox(self) -> list[str]:
        """Queue the new requests; returns the ids to abort."""
        new, aborts = self._inbox.take()
        for req in new:
            self.requests[req.id] = req
            self.counts["prompt_tokens"] += len(req.prompt)
            self.scheduler.add(req)
        return aborts

    def _abort(self, aborts: list[str], t: StepTimings) -> None:
        for rid in aborts:
            req = self.requests.get(rid)
            if req is not None:
                self.scheduler.remove(req)
                with t.phase("daemon"):
                    self._finish(req, "abort")

    def run(self) -> None:
        """Step whenever there is work, until the inbox stops (the engine's background thread)."""
        while self._inbox.wait_for_work(lambda: self.has_work):
            t = self.step()
            if not t.num_seqs and not t.sample:
                time.sleep(0.005)  # nothing could run (the pool is held by others): do not spin on the daemon
