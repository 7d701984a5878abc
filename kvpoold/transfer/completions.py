"""The completions of asynchronous copies: queued from worker threads, run on the loop's thread.

Disk I/O threads and the CUDA event watcher report through one queue; the
completions run on the caller's thread in ``poll`` (the daemon's event loop:
``notify`` wakes it), so the bookkeeping they do is single-threaded.
"""

from __future__ import annotations

import queue
import threading


class Completions:
    """The queue of completions and the count of asynchronous copies still in flight (``inflight``)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.notify = None  # called (from any thread) after a completion was queued
        self.inflight = 0  # asynchronous copies whose completion has not run yet
        self._watch_q: queue.SimpleQueue | None = None
        self._watcher: threading.Thread | None = None

    def post(self, fn) -> None:
        """Queue ``fn`` to run on the loop's thread (from any thread)."""
        self._q.put(fn)
        notify = self.notify
        if notify is not None:
            notify()

    def tracked(self, fn):
        """``fn`` as the completion of an asynchronous copy (counted in flight until it runs)."""
        self.inflight += 1

        def done(*args):
            self.inflight -= 1
            fn(*args)

        return done

    def poll(self) -> int:
        """Run the completions queued so far; returns how many."""
        n = 0
        while True:
            try:
                fn = self._q.get_nowait()
            except queue.Empty:
                return n
            fn()
            n += 1

    def wait_one(self, timeout: float | None = None) -> bool:
        """Block until one completion ran; False if nothing is in flight (or the timeout passed)."""
        if self.inflight == 0 and self._q.empty():
            return False
        try:
            fn = self._q.get(timeout=timeout)
        except queue.Empty:
            return False
        fn()
        return True

    def idle(self) -> bool:
        return self.inflight == 0 and self._q.empty()

    def drain(self) -> None:
        """Wait for every copy in flight."""
        while self.wait_one():
            pass

    def watch(self, event, meter, nbytes: int, blocks: int, fn) -> None:
        """Post ``fn`` once the copy ``event`` is done, stopping ``meter`` with ``nbytes`` and ``blocks`` then."""
        if self._watcher is None:
            self._watch_q = queue.SimpleQueue()
            self._watcher = threading.Thread(target=self._watch, name="kvpool-copy-events", daemon=True)
            self._watcher.start()
        self._watch_q.put((event, meter, nbytes, blocks, fn))

    def _watch(self) -> None:
        """Wait for copy events in order and report them (a thread: nothing else blocks on the GPU)."""
        while True:
            item = self._watch_q.get()
            if item is None:
                return
            event, meter, nbytes, blocks, fn = item
            try:
                event.synchronize()
            finally:
                meter.stop(nbytes, blocks)
                self.post(fn)

    def stop_watching(self) -> None:
        """End the watcher thread after the events queued so far."""
        if self._watcher is not None:
            self._watch_q.put(None)
            self._watcher.join(timeout=30)


class Countdown:
    """Per-block completions of one batch of disk reads: in flight until the last, then ``last()``."""

    __slots__ = ("completions", "left", "last")

    def __init__(self, completions: Completions, n: int, last=None) -> None:
        self.completions = completions
        self.left = n
        self.last = last
        if n:
            completions.inflight += 1

    def one(self, fn, i, ok, corrupt) -> None:
        fn(i, ok, corrupt)
        self.left -= 1
        if self.left == 0:
            self.completions.inflight -= 1
            if self.last is not None:
                self.last()
