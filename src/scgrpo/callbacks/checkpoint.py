"""Checkpoints by optimiser step (``last.ckpt``, ``best-step=N.ckpt``) that a run resumes from as if never stopped."""

from __future__ import annotations

import copy
import logging
import os
import re
import warnings
from typing import Any, Literal, Optional

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from scgrpo import lightning_internals as internals
from scgrpo.callbacks.interrupt import HeldInterrupt
from scgrpo.callbacks.validation import run_validation
from scgrpo.distributed import world_size
from scgrpo.errors import InputError

log = logging.getLogger(__name__)


def guarded(pl_module, flag: str) -> bool:
    """The module's divergence guard's ``flag`` ("diverged", "last_step_skipped"); False for a module without one."""
    return bool(getattr(getattr(pl_module, "guard", None), flag, False))


class StepCheckpoint(ModelCheckpoint):
    """The run's checkpoints, in ``<run folder>/checkpoints``: ``last.ckpt`` every ``every_n_train_steps``
    optimiser steps, at the end of training and, with ``save_on_exception``, when training stops on Ctrl-C or
    an error (one process only: with several, the others may wait in a collective); and ``best-step=N.ckpt``,
    the step with the best ``monitor`` so far, written after each validation.

    No checkpoint is taken from a step the divergence guard skipped (non-finite values), after it stopped the
    run, in the middle of an optimiser step, or of weights whose log-probs on a probe text are not finite, so
    ``last.ckpt`` always holds weights that give finite values.
    Unlike ``ModelCheckpoint(every_n_train_steps=...)`` it is made for the module's manual optimisation (a step
    is complete when ``on_train_batch_end`` runs) and does not warn about it.

    A run resumed from any of its checkpoints goes on as the uninterrupted run would have, wherever it stopped:

    - a Ctrl-C at a step's end or a validation's end is held until Lightning has logged its row (by
      ``interrupt_hold``, a :class:`HeldInterrupt`, also released by :class:`~scgrpo.callbacks.ReleaseHeldInterrupt`),
      so no checkpoint that a Ctrl-C leaves counts a row that is not logged (one process; a killed process can still
      lose the logger's unflushed rows);

    - every checkpoint holds the training loop's state as it was at the end of its step (Lightning's own, taken
      on an exception, would count a batch whose rollout was under way as begun: the resumed run's logger steps
      and validation schedule would be one ahead);
    - it records the last step validated (``validated_step``). A validation due after the checkpoint's step and
      not finished (``last.ckpt`` of that step is written before it: the run was stopped during it) is run when
      the resumed run starts, where Lightning would skip it; when that step is ``max_steps`` (Lightning then
      skips training altogether) it is run, and the end-of-training hooks (final checkpoint, adapter) after it.
      ``last.ckpt`` written before a validation is written again after it, marked validated.

    Args:
        every_n_train_steps: period of ``last.ckpt`` in optimiser steps (0: only at the end and on interruption).
        monitor: the validation metric of ``best-step=N.ckpt``; None: the first evaluation split's
            ``val/<split>/avg@k``. A ``val/...`` name the run will not log (another split, another ``k``) is an
            :class:`InputError` before training starts.
        mode: "max" or "min" for ``monitor``.
        save_on_exception: write ``last.ckpt`` when training stops on an exception or Ctrl-C.
        dirpath: where to write (default: the run folder's ``checkpoints``).
    """

    def __init__(self, every_n_train_steps: int = 50, monitor: Optional[str] = None,
                 mode: Literal["min", "max"] = "max",
                 save_on_exception: bool = True, dirpath: Optional[str] = None) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must be >= 0 (0 = only at the end), got {every_n_train_steps}")
        super().__init__(dirpath=dirpath, filename="best-{step}", monitor=monitor, mode=mode, save_last=True,
                         save_top_k=1, every_n_train_steps=every_n_train_steps, save_on_exception=save_on_exception,
                         enable_version_counter=False)
        self._monitor_setting = monitor
        self._last_step_saved: Optional[int] = None
        self.validated_step: Optional[int] = -1  # the step of the last validation finished in fitting (-1: none yet;
        # None: restored from a checkpoint that predates this record, where nothing is redone)
        self._loop_state: Optional[tuple[int, dict]] = None  # (step, the fit loop's state at the end of that step)
        self._train_started = False
        self.interrupt_hold = HeldInterrupt()  # a Ctrl-C at a step's or validation's end, until its row is logged
        # (released here and, before the next step's rollout, by ReleaseHeldInterrupt)

    @property
    def state_key(self) -> str:  # independent of the monitor found at the first validation
        every = internals.every_n_train_steps(self)
        return internals.checkpoint_state_key(self, monitor=self._monitor_setting, every_n_train_steps=every)

    @staticmethod
    def validation_metrics(pl_module, datamodule) -> Optional[list[str]]:
        """The ``val/<split>/...`` keys the module logs after each validation (its
        :class:`~scgrpo.evaluation.Evaluation`'s); None when the module or data module is not one that says."""
        evaluation = getattr(pl_module, "evaluation", None)
        splits = getattr(datamodule, "eval_splits", None)
        if evaluation is None or splits is None:
            return None
        return evaluation.metric_names(list(splits))

    def check_monitor(self, pl_module, datamodule) -> None:
        """A ``val/...`` ``monitor`` must be one of the run's validation metrics (else :class:`InputError`, before
        training rather than at the first validation); other names (a training metric) are left to Lightning."""
        monitor = self._monitor_setting
        if monitor is None or not monitor.startswith("val/"):
            return
        keys = self.validation_metrics(pl_module, datamodule)
        final = list(getattr(datamodule, "final_splits", None) or [])
        if monitor.split("/")[1:2] and monitor.split("/")[1] in final:
            raise InputError(f"checkpoint.monitor={monitor!r} is on a split of data.final_splits {final}, evaluated "
                             "at the fit's last step only: monitor a split evaluated on the way")
        if keys is None or monitor in keys:
            return
        logged = f"its validation metrics are {', '.join(keys)}" if keys else \
            "it logs no validation metrics (data.eval_splits is empty)"
        raise InputError(f"checkpoint.monitor={monitor!r} is not a metric this run logs; {logged}")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.check_monitor(pl_module, getattr(trainer, "datamodule", None))
        with warnings.catch_warnings():  # a resumed run goes on in its own folder
            warnings.filterwarnings("ignore", message=".*exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validated_step": self.validated_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("dirpath")  # the same folder, written relative or absolute
        if saved and self.dirpath and os.path.realpath(saved) == os.path.realpath(self.dirpath):
            state_dict = {**state_dict, "dirpath": self.dirpath}
        super().load_state_dict(state_dict)
        self.validated_step = state_dict.get("validated_step")  # None (a checkpoint without it): nothing is redone

    # ------------------------------------------------------------------------------------ resuming
    def _keep_loop_state(self, trainer) -> None:
        self._loop_state = (trainer.global_step, copy.deepcopy(trainer.fit_loop.state_dict()))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """The fit loop's state as at the end of the checkpoint's step, wherever the checkpoint is written: the
        state Lightning resumes from as written (its ``restarted_on_train_batch_end``: the step counted once, the
        logger's step one on, the step's validation fast-forwarded; see :meth:`on_train_start` for one that did
        not happen). Lightning's own state of the moment, taken on an exception during the next step's rollout,
        counts that batch as begun: the resumed run's logger steps and validations would be one ahead."""
        loops = checkpoint.get("loops")
        if trainer.state.fn != TrainerFn.FITTING or not isinstance(loops, dict) or self._loop_state is None:
            return
        step, state = self._loop_state
        if step == trainer.global_step:  # (always so: no checkpoint is written between an update and its step end)
            loops["fit_loop"] = copy.deepcopy(state)

    def _validation_left_pending(self, trainer) -> bool:
        """The run resumed from a checkpoint whose step is due a validation (Lightning's own test, on the loop state
        of that step's end) that did not finish before the checkpoint was written."""
        step = trainer.global_step
        if self.validated_step is None or step == 0 or self.validated_step >= step:
            return False
        return internals.validation_due(trainer)

    def on_fit_start(self, trainer, pl_module) -> None:
        """At ``max_steps`` Lightning skips the fit loop, and with it ``on_train_start``: the fit loop's ``run`` is
        followed, when it was skipped and a validation is left pending, by its ``on_train_start`` hooks (the
        validation runs in this callback's) and ``on_train_end`` hooks (the final checkpoint and adapter), which
        the interrupted run did not reach."""
        self._train_started = False
        internals.after_fit_loop_run(trainer, lambda: self._finish_skipped_training(trainer))

    def _finish_skipped_training(self, trainer) -> None:
        if not self._train_started and self._validation_left_pending(trainer):
            internals.run_train_start_and_end(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        internals.restore_fit_loop_run(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        """Runs the validation a resumed run's checkpoint left pending (see the class), before Lightning's loop
        fast-forwards over it; logged where the uninterrupted run logged it."""
        super().on_train_start(trainer, pl_module)
        self._train_started = True
        self._keep_loop_state(trainer)  # the restored state (or a new run's): checkpoints before the first step end
        if self._validation_left_pending(trainer):
            if trainer.is_global_zero:
                log.info("resumed at step %d: running its validation, which did not finish", trainer.global_step)
            run_validation(trainer)

    def _may_save(self, trainer, pl_module, step_whole: bool = False) -> bool:
        """``step_whole``: called where the step's bookkeeping is known to be done (this callback's
        on_train_batch_end runs after every other callback's: Lightning orders checkpoint callbacks last)."""
        return not (trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking
                    or guarded(pl_module, "diverged") or guarded(pl_module, "last_step_skipped")
                    or (getattr(pl_module, "updating", False) and not step_whole))

    def _holds(self, trainer, pl_module) -> bool:
        """Whether a Ctrl-C is held until the rows are logged: only where a checkpoint may be written now or on
        that Ctrl-C, in a single process (with several, each would hold alone; none writes on an exception)."""
        return (world_size() == 1 and self.dirpath is not None and self._may_save(trainer, pl_module, step_whole=True)
                and (self.save_on_exception or bool(internals.every_n_train_steps(self))))

    def _finite(self, trainer, pl_module) -> bool:
        """The weights' log-probs are finite (an update can leave finite weights that overflow: the next step
        would only find out when sampling). Every rank must call it when sharded."""
        actor = getattr(pl_module, "actor", None)  # (a module without a policy: nothing to probe)
        if actor is None or actor.is_finite():
            return True
        if trainer.is_global_zero:
            log.warning("no checkpoint written at step %d: the policy's log-probs are not finite", trainer.global_step)
        return False

    def write_last(self, trainer, pl_module, step_whole: bool = False) -> bool:
        """Writes ``last.ckpt`` unless this step's is written or it may not be (see the class); True if written."""
        if not self._may_save(trainer, pl_module, step_whole) or self._last_step_saved == trainer.global_step:
            return False
        if not self._finite(trainer, pl_module):
            return False
        internals.save_last(self, trainer)
        self._last_step_saved = trainer.global_step
        return True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.interrupt_hold.release()  # (ReleaseHeldInterrupt, listed before the rollout, has done it already)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._holds(trainer, pl_module):
            self.interrupt_hold.hold()  # until the step's row is logged (see HeldInterrupt)
        self._keep_loop_state(trainer)  # (the step is whole: the other callbacks' on_train_batch_end ran)
        every = internals.every_n_train_steps(self)
        if every and trainer.global_step % every == 0:
            self.write_last(trainer, pl_module, step_whole=True)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # the prompt stream has no epochs to speak of: by step and at the end only

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # marked here, before any on_validation_end: other checkpoint callbacks write theirs there, and a checkpoint
        # of this step must not send the resumed run to make this validation again
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.validated_step = trainer.global_step
            if self._holds(trainer, pl_module):  # a checkpoint from here on says validated: held until its row is
                self.interrupt_hold.hold()  # logged and the module took its RNG state (released at the next step)

    def on_validation_start(self, trainer, pl_module) -> None:
        self.interrupt_hold.release()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.interrupt_hold.release(deliver=False)
        super().teardown(trainer, pl_module, stage)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.global_step == 0 or not self._may_save(trainer, pl_module):
            return  # (step 0: the untrained weights, the base model)
        monitored = self._find_monitor(trainer) is not None
        again = self._last_step_saved == trainer.global_step  # last.ckpt written before this validation: again,
        if (monitored or again) and self._finite(trainer, pl_module):  # validated, with the best so far (a resume's)
            if monitored:
                internals.save_top_k(self, trainer)
            if again:
                internals.save_last(self, trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.interrupt_hold.release(deliver=False)  # (the run ends here anyway)
        if not self.write_last(trainer, pl_module) and guarded(pl_module, "last_step_skipped") \
                and not guarded(pl_module, "diverged") and trainer.is_global_zero:
            log.warning("the last step met non-finite values: no checkpoint written at the end (the last one: %s)",
                        self.last_model_path or "none")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.interrupt_hold.release(deliver=False)
        if not self.save_on_exception or world_size() > 1 or trainer.global_step == 0 or self.dirpath is None:
            return  # (step 0: nothing trained yet, or the run did not get as far as setting up)
        try:
            if self.write_last(trainer, pl_module):
                log.info("training stopped by %s at step %d: saved %s", type(exception).__name__,
                         trainer.global_step, self.last_model_path)
        except Exception as err:  # noqa: BLE001 - the original exception is the one to report
            log.warning("could not save a checkpoint after %s: %s", type(exception).__name__, err)

    def _find_monitor(self, trainer) -> Optional[str]:
        """``monitor``, or (unset) the first evaluation split's ``val/<split>/avg@k`` once validation logged it."""
        if self.monitor is None:
            names = [k for k in trainer.callback_metrics if re.fullmatch(r"val/[^/]+/avg@\d+", k)]
            splits = list(getattr(getattr(trainer, "datamodule", None), "eval_splits", None) or [])

            def order(name: str) -> tuple:
                split = name.split("/")[1]
                return (splits.index(split) if split in splits else len(splits), name)

            self.monitor = min(names, key=order) if names else None
        return self.monitor
