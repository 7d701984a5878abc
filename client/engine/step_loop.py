"""The engine thread's half of ``Engine``: one step at a time, and what each sampled token ends."""

from __future__ import annotations

import logging
import time

from .request import Request, Status
from .timings import StepTimings

log = logging.getLogger("kvpool.engine")


class StepLoop:
    """Steps for ``Engine``: take the inbox, plan, run the forward, sample, stream, free.

    Only the engine thread (or a caller stepping by hand) runs these; the
    state they share with the request side (``_inbox``, ``_aborts``, ``_ids``)
    is read and written under ``_lock``.
    """

    def step(self) -> StepTimings:
        """One scheduler step: take new requests and aborts, plan, run the forward, sample, stream.

        Returns:
            The step's ``StepTimings`` (also kept in ``timings``).
        """
        t, t0 = StepTimings(), time.perf_counter()
        try:
            with t.phase("schedule"):
                self._take_inbox(t)
                self.scheduler.timings = t
                plan = self.scheduler.plan()
        except Exception as exc:  # noqa: BLE001 - the daemon is gone or refused: end every request, keep the thread
            log.exception("scheduling failed; every request ends with an error")
            self._fail(list(self._requests.values()), f"the pool refused the step: {exc!r}")
            t.total = time.perf_counter() - t0
            return t
        t.schedule -= t.daemon  # report the two apart
        for req, message in plan.failed:
            self._finish(req, "error", error=message)
        if plan.items:
            try:
                self._run(plan, t)
            except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
                log.exception("a step failed; its requests end with an error")
                self._fail(plan.requests, f"the step failed: {exc!r}")
        t.total = time.perf_counter() - t0
        self._counts["steps"] += 1
        self.timings.add(t)
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
        self._counts["generation_tokens"] += 1
        reason, text, hit = None, "", False
        if token in req.stop_ids:
            reason = "stop"
        if req.text is not None:
            text, hit = req.text.update(req.output)
            reason = "stop" if hit else reason
        if reason is None and (len(req.output) >= req.params.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            req.finish_reason, req.finish_time, req.status = reason, now, Status.FINISHED
            if req.text is not None and not hit:
                text += req.text.flush()
            self._forget(req)
        req.stream.put(req.snapshot([token], text))
        return reason is not None

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
        self._requests.pop(req.id, None)
        self._counts["finished_requests"] += 1
        with self._lock:
            self._ids.discard(req.id)

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
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in new:
            self._requests[req.id] = req
            self._counts["prompt_tokens"] += len(req.prompt)
            self.scheduler.add(req)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None:
                self.scheduler.remove(req)
                with t.phase("daemon"):
                    self._finish(req, "abort")

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work):
                    self._wake.wait()
                if self._stopping:
                    return
            if not self.step().num_seqs:
                time.sleep(0.005)  # nothing could run (the pool is held by others): do not spin on the daemon
