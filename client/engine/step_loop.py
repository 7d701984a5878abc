"""The engine thread's part of ``Engine``: one step at a time, and what each sampled token ends."""

from __future__ import annotations

import logging
import time

from .inbox import Inbox
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

    Args:
        client: the ``kvpool.Client`` (frees, marks prompts written).
        scheduler, runner, sampler: the step's parts.
        inbox: where new requests and aborts come from.
        timings: the log each step's ``StepTimings`` goes to.
        max_model_len: the longest a sequence may grow (prompt and output).
    """

    def __init__(self, client, *, scheduler: Scheduler, runner: StepRunner, sampler: Sampler, inbox: Inbox,
                 timings: TimingLog, max_model_len: int) -> None:
        self.client, self.scheduler, self.runner, self.sampler = client, scheduler, runner, sampler
        self._inbox, self._timings, self._max_model_len = inbox, timings, max_model_len
        self.requests: dict[str, Request] = {}
        self.counts = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0, "steps": 0}
        self._post_mortem_done = False

    def step(self) -> StepTimings:
        """One scheduler step: take new requests and aborts, plan, run the forward, sample, stream.

        Returns:
            The step's ``StepTimings`` (also kept in ``timings``).
        """
        t, t0 = StepTimings(), time.perf_counter()
        waited = self.client.device_wait_seconds
        try:
            with t.phase("schedule"):
                self._take_inbox(t)
                plan = self.scheduler.plan(t)
        except Exception as exc:  # noqa: BLE001 - the daemon is gone or refused: end every request, keep the thread
            log.exception("scheduling failed; every request ends with an error")
            self._post_mortem(exc)  # a CUDA fault of the last step surfaces here, at the synchronize before a call
            self._fail(list(self.requests.values()), f"the pool refused the step: {exc!r}")
            return self._close(t, t0, waited)
        t.schedule -= t.daemon  # report the two apart
        for req, message in plan.failed:
            self._finish(req, "error", error=message)
        if plan.items:
            try:
                self._run(plan, t)
            except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
                log.exception("a step failed; its requests end with an error")
                self._post_mortem(exc)
                self._fail(plan.requests, f"the step failed: {exc!r}")
        self.counts["steps"] += 1
        self._timings.add(self._close(t, t0, waited))
        return t

    def _post_mortem(self, exc: Exception) -> None:
        """After the first CUDA error: whether the inputs of the last step that ran kernels were sound (the fault
        is reported at the next synchronize: in that step's sampling, or in the next step's first daemon call)."""
        if "CUDA error" in str(exc) and not self._post_mortem_done:
            self._post_mortem_done = True
            log.error("%s", self.runner.post_mortem())

    def _close(self, t: StepTimings, t0: float, waited: float) -> StepTimings:
        """The step's total, and how long its daemon calls waited for the GPU."""
        t.gpu_wait = self.client.device_wait_seconds - waited
        t.total = time.perf_counter() - t0
        return t

    def _run(self, plan, t: StepTimings) -> None:
        with t.phase("prepare"):
            num_tokens, max_len = self.runner.prepare(plan.items)
        t.num_tokens, t.num_seqs = num_tokens, len(plan.items)
        t.num_prefill_tokens = sum(len(it.tokens) for it in plan.items if len(it.tokens) > 1)
        with t.phase("forward"):
            logits = self.runner.forward(len(plan.items), num_tokens, max_len)
        with t.phase("sample"):
            rows, prefilled = [], []
            for row, (req, item) in enumerate(zip(plan.requests, plan.items)):
                req.num_computed = item.start + len(item.tokens)
                if req.num_computed == req.num_tokens:
                    rows.append(row)
                    if len(item.tokens) > 1:
                        prefilled.append(req)
            chosen = self.sampler.sample(logits[rows], [plan.requests[r] for r in rows]) if rows else []
            done = [req for req, tok in zip((plan.requests[r] for r in rows), chosen) if self._append(req, tok)]
        live = [r.seq for r in prefilled if r.finish_reason is None]
        with t.phase("daemon"):
            if live:  # other processes may reuse these prompts' blocks from now on
                self.client.mark_written(live)
            self._release(done)

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
        self._take_inbox(StepTimings())
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
        for req in reqs:
            if req.finish_reason is None:
                try:
                    self._finish(req, "error", error=message)
                except Exception:  # noqa: BLE001 - the daemon may be the thing that failed
                    req.seq = None
                    req.stream.put(req.snapshot([], "", message))

    def _take_inbox(self, t: StepTimings) -> None:
        new, aborts = self._inbox.take()
        for req in new:
            self.requests[req.id] = req
            self.counts["prompt_tokens"] += len(req.prompt)
            self.scheduler.add(req)
        for rid in aborts:
            req = self.requests.get(rid)
            if req is not None:
                self.scheduler.remove(req)
                with t.phase("daemon"):
                    self._finish(req, "abort")

    def run(self) -> None:
        """Step whenever there is work, until the inbox stops (the engine's background thread)."""
        while self._inbox.wait_for_work(lambda: self.scheduler.has_work):
            if not self.step().num_seqs:
                time.sleep(0.005)  # nothing could run (the pool is held by others): do not spin on the daemon
