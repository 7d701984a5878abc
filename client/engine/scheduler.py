"""Which requests compute which tokens this step, and the pool calls that make room for them.

The rule that keeps other processes (and this one) from reading K/V that is
not there: the daemon hears of a token only in the step that computes it.
A prompt longer than the step's budget is created with its cached prefix
plus the first chunk (``lookup`` says how long the prefix is) and extended
chunk by chunk, so every call that says "written" (``extend`` reaching the
daemon, ``free``, ``swap_out``) comes after the forward that wrote.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..errors import OutOfBlocks
from ..mirror import UNKNOWN_TOKEN
from ..protocol.sizes import cdiv
from .request import Request, Status
from .runner import StepItem
from .timings import StepTimings


@dataclass
class Plan:
    """One step: what each scheduled request computes, and what the pool calls did."""

    items: list[StepItem] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # could never fit: finish with an error
    preempted: int = 0


class Scheduler:
    """Continuous batching over the pool: decode first, then prefill chunks, under a token budget.

    Args:
        client: the ``kvpool.Client`` (one per engine; only the engine thread calls it).
        max_num_seqs, max_num_batched_tokens: the step's limits.
        swap: preempt by ``swap_out`` to the host tier; else free and recompute.
    """

    def __init__(self, client, max_num_seqs: int, max_num_batched_tokens: int, swap: bool) -> None:
        self.client = client
        self.max_num_seqs, self.max_tokens, self.swap = max_num_seqs, max_num_batched_tokens, swap
        self.waiting: list[Request] = []  # by arrival: preempted requests go back in front of newer ones
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # by arrival: resumed oldest first
        self.num_preemptions = self.num_swaps = self.num_recomputes = 0
        self.prefix_hit_tokens = 0
        self._admission_refused = False  # a create planned ahead found no room: plan the next step the usual way

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def remove(self, req: Request) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def plan(self, timings: StepTimings) -> Plan:
        """Decide this step and make the pool calls for it (extend, preempt, swap in, create).

        Args:
            timings: the step's timings; the pool calls count in its ``daemon`` phase.
        """
        plan, budget = Plan(), self.max_tokens
        self._admission_refused = False
        wants = self._extend_running(plan, budget, timings)
        for req in self.running:
            if wants.get(req):
                self._add_item(plan, req, req.token_slice(req.num_computed, req.num_computed + wants[req]))
                budget -= wants[req]
        if not plan.preempted and not plan.failed:  # a failed request frees its blocks after this step
            self._resume_swapped(plan, timings)
            if not self.swapped:
                budget = self._admit(plan, budget, timings)
        return plan

    def can_plan_ahead(self, reqs: list[Request], ending: int = 0) -> bool:
        """Whether the next step can be planned before the tokens ``reqs`` are sampling now are read back.

        That step is ``reqs``' next decode tokens, and waiting prompts that fit it whole: it needs every
        running request to be one of them or one of the ``ending`` ones the step in flight ends, nothing
        swapped out, blocks for the decodes from the reserve alone, and no call that carries tokens (a
        ``Step``: the daemon must not hear of a token whose id is still on the device).  A ``Create``
        carries none, so whole prompts may join; a prompt that needs a chunked create, or a create the pool
        refused, waits for a step planned the usual way.
        """
        if (self.swapped or self._admission_refused or len(self.running) != len(reqs) + ending
                or len(reqs) > self.max_tokens):
            return False
        if self._wants_admission() and not self._whole_prompts(self.max_tokens - len(reqs)):
            return False
        return self.client.can_extend_ahead([r.seq for r in reqs])

    def plan_ahead(self, reqs: list[Request], timings: StepTimings) -> Plan:
        """The step after the one sampling ``reqs``' tokens now: one token each, its id still on the device
        (``Client.extend_ahead`` queues it as unknown; the step loop fills it in once read), then the waiting
        prompts that fit the rest of the budget whole, in one ``Create``."""
        with timings.phase("daemon"):
            self.client.extend_ahead([r.seq for r in reqs])
        plan = Plan()
        for req in reqs:
            self._add_item(plan, req, [UNKNOWN_TOKEN])
        budget = self.max_tokens - len(reqs)
        group = self._whole_prompts(budget) if self._wants_admission() else []
        if group:
            try:
                with timings.phase("daemon"):
                    seqs = self.client.create_sequences([r.all_tokens for r in group])
            except OutOfBlocks:
                self._admission_refused = True  # room comes back with frees: the next plan made the usual way
            else:
                for req, seq in zip(group, seqs):
                    budget = self._start(plan, req, seq, budget)
        return plan

    def _wants_admission(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _wants(self, budget: int) -> dict[Request, int]:
        """Tokens each running request computes this step: decodes first, prefill chunks after."""
        wants = {}
        for req in sorted(self.running, key=lambda r: r.in_prefill):
            want = min(req.num_tokens - req.num_computed, budget)
            if want > 0:
                wants[req] = want
                budget -= want
        return wants

    def _extend_running(self, plan: Plan, budget: int, timings: StepTimings) -> dict[Request, int]:
        """One ``extend`` for the running requests' new tokens; on OutOfBlocks preempt the newest and retry."""
        while True:
            wants = self._wants(budget)
            batch = {}
            for req, want in wants.items():
                end, known = req.num_computed + want, req.seq.num_tokens
                if end > known:
                    batch[req.seq] = req.token_slice(known, end)
            try:
                with timings.phase("daemon"):
                    self.client.extend(batch)
                return wants
            except OutOfBlocks as exc:
                if not self.running:
                    return {}
                if len(self.running) == 1:
                    req = self.running[0]
                    if self._never_fits(max(req.seq.num_tokens, req.num_computed + wants.get(req, 0))):
                        plan.failed.append((self.running.pop(), self._too_big(exc)))
                        continue
                    if self.client.return_reserve():
                        continue
                # the newest goes; alone, it makes way for other processes' sequences and is resumed later
                self._preempt(max(self.running, key=lambda r: r.arrival), timings)
                plan.preempted += 1

    def _add_item(self, plan: Plan, req: Request, tokens: list[int]) -> None:
        """``req`` computes ``tokens`` from its first position not computed yet."""
        start = req.num_computed
        plan.items.append(StepItem(seq=req.seq, table_key=(req.id, req.num_preemptions), start=start,
                                   tokens=tokens, write_from=max(start, req.write_from)))
        plan.requests.append(req)

    def _preempt(self, req: Request, timings: StepTimings) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        with timings.phase("daemon"):
            if self.swap:
                try:
                    self.client.swap_out(req.seq)
                    req.status = Status.SWAPPED
                    bisect.insort(self.swapped, req, key=lambda r: r.arrival)
                    self.num_swaps += 1
                    return
                except OutOfBlocks:
                    pass  # the host tier is full: recompute this one
            self.client.free(req.seq)
        req.seq, req.status, req.num_computed, req.write_from = None, Status.WAITING, 0, 0
        self.num_recomputes += 1
        self.add(req)

    def _resume_swapped(self, plan: Plan, timings: StepTimings) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            try:
                with timings.phase("daemon"):
                    self.client.swap_in(req.seq)
            except OutOfBlocks as exc:
                if not self.running and self._never_fits(req.seq.num_tokens):
                    self.swapped.pop(0)
                    plan.failed.append((req, self._too_big(exc)))
                    continue
                if not self.running and self.client.return_reserve():
                    continue
                return  # other processes hold the room it needs: it waits for them
            self.swapped.pop(0)
            # bytes lost on the way back (a bad checksum) are recomputed from there
            req.num_computed = min(req.num_computed, req.seq.num_cached_tokens)
            req.status = Status.RUNNING
            self.running.append(req)

    def _admit(self, plan: Plan, budget: int, timings: StepTimings) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            group = self._whole_prompts(budget)
            if len(group) > 1:  # prompts that fit the budget whole: one Create call for all of them
                try:
                    with timings.phase("daemon"):
                        seqs = self.client.create_sequences([r.all_tokens for r in group])
                except OutOfBlocks:
                    pass  # all or none: admit one at a time below, as far as the pool goes
                else:
                    for req, seq in zip(group, seqs):
                        budget = self._start(plan, req, seq, budget)
                    continue
            req = self.waiting[0]
            try:
                with timings.phase("daemon"):
                    seq = self._create_chunk(req.all_tokens, budget)
            except OutOfBlocks as exc:
                if self._never_fits(req.num_tokens):
                    self.waiting.pop(0)
                    plan.failed.append((req, self._too_big(exc)))
                    continue
                if not self.running and not self.swapped and self.client.return_reserve():
                    continue
                return budget  # room comes back as requests finish (here or in other processes)
            budget = self._start(plan, req, seq, budget)
        return budget

    def _create_chunk(self, tokens: list[int], budget: int):
        """A sequence of ``tokens``' cached prefix and the first chunk after it, ``budget`` tokens at most.

        The daemon must know no token this step does not compute: it would take the tokens for written at
        the sequence's next call, before the forward that computes them.  When the create finds less cached
        than the lookup did (another process evicted some meanwhile), the sequence is made again up to what
        it found.
        """
        cached = self.client.lookup(tokens) if len(tokens) > budget else 0
        while True:
            seq = self.client.create_sequence(tokens[:min(len(tokens), cached + budget)])
            if seq.num_tokens - min(seq.num_cached_tokens, len(tokens) - 1) <= budget:
                return seq
            cached = seq.num_cached_tokens
            self.client.free(seq, written=False)

    def _never_fits(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` needs more blocks than the session could ever hold."""
        return cdiv(num_tokens, self.client.layout.block_size) > self.client.max_blocks

    def _too_big(self, exc: OutOfBlocks) -> str:
        return (f"the request does not fit in the pool (at most {self.client.max_blocks} blocks of "
                f"{self.client.layout.block_size} tokens for this model): {exc.message}")

    def _whole_prompts(self, budget: int) -> list[Request]:
        """The leading waiting requests whose tokens fit the budget together (and the sequence slots)."""
        group, room = [], budget
        for req in self.waiting:
            if len(self.running) + len(group) >= self.max_num_seqs or req.num_tokens > room:
                break
            group.append(req)
            room -= req.num_tokens
        return group

    def _start(self, plan: Plan, req: Request, seq, budget: int) -> int:
        """A waiting request got its sequence: it runs, and computes what the pool lacks from this step on."""
        self.waiting.remove(req)
        req.seq = seq
        hit = seq.num_cached_tokens
        if not req.first_admitted:
            req.first_admitted, req.num_cached_tokens = True, hit
            self.prefix_hit_tokens += hit
        req.write_from = hit
        req.num_computed = min(hit, req.num_tokens - 1)  # a fully cached prompt recomputes its last query
        req.status = Status.RUNNING
        self.running.append(req)
        want = min(seq.num_tokens - req.num_computed, budget)
        self._add_item(plan, req, req.token_slice(req.num_computed, req.num_computed + want))
        return budget - want
