"""Ctrl-C held back until Lightning has logged the rows that a checkpoint already counts."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from lightning.pytorch.callbacks import Callback

log = logging.getLogger("scgrpo.callbacks.checkpoint")  # (one logger for all of checkpointing's messages)


class HeldInterrupt:
    """Ctrl-C (SIGINT) held back while Lightning has yet to log rows that a checkpoint already counts.

    A step's checkpoint is written at its end (every ``every_n_train_steps``, or by the Ctrl-C itself) before
    Lightning hands the step's row to the loggers, and a validation is marked done before its row is logged; a
    Ctrl-C in between left a checkpoint without the row, which the resumed run never logs. Held, the Ctrl-C takes
    effect once the rows are logged: at the next step's start or a validation's start; at the end of training it
    is dropped (the run ends anyway). A second Ctrl-C while one is held interrupts at once. Nothing is held off the
    main thread or where SIGINT has another handler than Python's default (ignored, the application's own, or
    another hold's: one holds at a time in a process)."""

    def __init__(self) -> None:
        self._previous: Any = None
        self._pending = False

    @property
    def holding(self) -> bool:
        return self._previous is not None

    def hold(self) -> None:
        if (self.holding or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            return
        self._pending = False
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except (ValueError, OSError):  # (not the main interpreter's main thread)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self._pending:  # the second: at once
            self.release(deliver=False)
            raise KeyboardInterrupt
        self._pending = True
        log.warning("Ctrl-C: stopping once this step's metrics are logged (Ctrl-C again to stop at once)")

    def release(self, deliver: bool = True) -> bool:
        """Puts Python's default handler back; with ``deliver``, a Ctrl-C met meanwhile then raises
        KeyboardInterrupt here. Returns whether one was met."""
        if not self.holding:
            return False
        signal.signal(signal.SIGINT, self._previous)  # (first: a Ctrl-C from here on is the default handler's)
        self._previous = None
        pending, self._pending = self._pending, False
        if pending and deliver:
            raise KeyboardInterrupt
        return pending


def trainer_holds(trainer) -> list[HeldInterrupt]:
    """The holds of the trainer's callbacks that keep one as ``interrupt_hold``
    (:class:`~scgrpo.callbacks.StepCheckpoint`)."""
    holds = (getattr(callback, "interrupt_hold", None) for callback in trainer.callbacks)
    return [hold for hold in holds if isinstance(hold, HeldInterrupt)]


class ReleaseHeldInterrupt(Callback):
    """Lets a Ctrl-C held by :class:`~scgrpo.callbacks.StepCheckpoint` (its ``interrupt_hold``, found among the
    trainer's callbacks) through once the rows are logged: at the next step's start before any rollout (the module
    lists it before its rollout callback), at a validation's start; at the end of training the run ends anyway, and
    it is dropped."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for hold in trainer_holds(trainer):
            hold.release()

    def on_validation_start(self, trainer, pl_module) -> None:
        for hold in trainer_holds(trainer):
            hold.release()

    def on_train_end(self, trainer, pl_module) -> None:
        dropped = [hold.release(deliver=False) for hold in trainer_holds(trainer)]
        if any(dropped) and trainer.is_global_zero:
            log.info("Ctrl-C in the last step: the run ends as planned")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        for hold in trainer_holds(trainer):
            hold.release(deliver=False)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for hold in trainer_holds(trainer):
            hold.release(deliver=False)
