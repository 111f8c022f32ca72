"""The threads that run an environment's calls, each within its time limit (:class:`CallPool`), and the stop when
too many of them hang."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from scgrpo.errors import InputError

log = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


MAX_STUCK = 256
"""Calls still running past their time limit (each holds a thread) at which the run stops: the environment hangs"""


class EnvironmentHangs(InputError):
    """Too many environment calls are stuck past their time limit: the environment hangs, it does not just fault."""


class CallPool:
    """Daemon threads that run environment calls, kept between batches of calls (an episode batch makes a few
    hundred), and the count of calls left behind past their time limit.

    Args:
        clock: seconds on a monotonic clock (``time.monotonic``): time limits are read from it, so a test can pass
            one that runs faster than real time instead of waiting.
        rate: clock seconds per real second (how long to wait for the next limit: its clock seconds / ``rate``).
        max_stuck: calls still running past their limit at which :meth:`call_all` raises :class:`EnvironmentHangs`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, rate: float = 1.0,
                 max_stuck: int = MAX_STUCK) -> None:
        self.clock, self.rate, self.max_stuck = clock, rate, max_stuck
        self.idle: "queue.SimpleQueue" = queue.SimpleQueue()  # inboxes of the worker threads free for work
        self.stuck = 0  # calls abandoned past their limit and still running
        self.stuck_lock = threading.Lock()

    def call_all(self, calls: Sequence[Callable[[], Any]], timeout_s: float, max_workers: int) -> list[tuple[str, Any]]:
        """Runs ``calls`` in daemon threads, at most ``max_workers`` at a time (not counting those left behind past
        their time limit), each within ``timeout_s`` seconds of its own start. Returns per call, in the calls' order,
        ``("ok", value)``, ``("error", exception)`` or ``("timeout", None)``; a call that hangs is left behind in its
        daemon thread (it cannot hold the process at exit) and the others go on in other threads. Each thread runs
        calls one after the other, so that calls that return at once cost no thread hand-over each (see
        :class:`_Calls`)."""
        if not calls:
            return []
        batch = _Calls(calls, max_workers, self)
        with batch.lock:
            try:
                self.engage(batch)
                batch.engaged = 1
                self._wait_all(batch, timeout_s)
            finally:  # (a caller that leaves early, interrupted or out of threads: the workers take no more calls)
                if batch.finished < len(calls):
                    batch.stopped = True
        if self.stuck > self.max_stuck:
            raise EnvironmentHangs(f"{self.stuck} environment calls are still running past their {timeout_s:g} s time "
                                   "limit, each holding a thread: the environment hangs. Fix it, or raise its timeout_s")
        return batch.results

    def engage(self, calls: "_Calls") -> None:
        """One more thread on ``calls``: a free one, or a new one where none is free."""
        try:
            inbox = self.idle.get_nowait()
        except queue.Empty:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._worker, args=(inbox,), daemon=True, name="scgrpo-env").start()
        inbox.put(calls)

    def count_stuck(self, change: int) -> None:
        with self.stuck_lock:
            self.stuck += change

    def _worker(self, inbox: "queue.SimpleQueue") -> None:
        """Works on the batches of calls put in its ``inbox`` one after the other, and offers itself again after each."""
        while True:
            inbox.get().work()
            self.idle.put(inbox)

    def _wait_all(self, batch: "_Calls", timeout_s: float) -> None:
        """Under ``batch.lock``: waits until every call returned or ran past its time limit (those are abandoned,
        their threads replaced), or until ``max_stuck`` calls are stuck."""
        calls = batch.calls
        while batch.finished < len(calls):
            now = self.clock()
            late = [k for k, start in batch.running.items() if now - start >= timeout_s]
            if not late:  # until the first limit passes (a call not taken yet starts later)
                wait = (min(batch.running.values(), default=now) + timeout_s - now) / self.rate  # (real seconds)
                batch.all_finished.wait(min(max(wait, 1e-4), threading.TIMEOUT_MAX))
                continue
            for k in late:  # abandoned: its result stays a timeout, its thread is left behind
                del batch.running[k]
                batch.engaged -= 1
                batch.finished += 1
                self.count_stuck(1)
            if self.stuck > self.max_stuck:
                return
            batch.engage_one()  # in place of the threads left behind


class _Calls:
    """The calls of one :meth:`CallPool.call_all`, taken in order by the threads engaged on it; a thread takes the
    next call when it is done with its last. Before it runs a call, a thread engages one more when every thread
    engaged is inside a call and calls are left (up to ``max_workers`` at once), so that a call that hangs holds up
    no other. ``running`` maps each call being run to the time it was taken (its time limit runs from there); the
    caller abandons those past their limit (the thread leaves them behind, and is no longer counted as engaged)."""

    def __init__(self, calls: Sequence[Callable[[], Any]], max_workers: int, pool: CallPool) -> None:
        self.calls, self.max_workers, self.pool = calls, max_workers, pool
        self.results: list[tuple[str, Any]] = [(TIMEOUT, None)] * len(calls)
        self.running: dict[int, float] = {}
        self.next = self.finished = self.engaged = 0  # finished: returned or abandoned
        self.stopped = False  # the caller gave up on the rest (the environment hangs): take no more calls
        self.lock = threading.Lock()
        self.all_finished = threading.Condition(self.lock)

    def engage_one(self) -> None:
        """Under the lock: a thread more where every engaged one is inside a call and calls are left."""
        if (self.next < len(self.calls) and len(self.running) == self.engaged and self.engaged < self.max_workers
                and not self.stopped):
            self.pool.engage(self)  # (it cannot take a call before the lock is released)
            self.engaged += 1

    def work(self) -> None:
        """Runs calls until none is left; a call that ran past its time limit (abandoned) ends the thread's work."""
        calls, lock, running = self.calls, self.lock, self.running
        with lock:
            while True:
                k = self.next
                if k >= len(calls) or self.stopped:
                    self.engaged -= 1
                    return
                self.next = k + 1
                running[k] = self.pool.clock()
                try:
                    self.engage_one()
                except RuntimeError as err:  # no thread could be started: this one still runs its call
                    log.debug("no thread more for environment calls: %s", err)
                lock.release()
                try:
                    result = (OK, calls[k]())
                except BaseException as err:  # noqa: BLE001 - a user's environment may raise anything
                    result = (ERROR, err)
                finally:
                    lock.acquire()
                if running.pop(k, None) is None:  # it came back after its caller gave up on it
                    self.pool.count_stuck(-1)
                    return
                self.results[k] = result
                self.finished += 1
                if self.finished == len(calls):
                    self.all_finished.notify()
