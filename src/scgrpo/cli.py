"""``scgrpo fit|validate|test --config run.yaml``: LightningCLI over :class:`RLVRModule` and
:class:`PromptDataModule`."""

from __future__ import annotations

import logging
import os
import sys

from lightning.pytorch.cli import LightningCLI

from scgrpo.callbacks import StepCheckpoint
from scgrpo.data import PromptDataModule
from scgrpo.module import RLVRModule
from scgrpo.runs import DEFAULT_NAME, DEFAULT_ROOT, share_run_folder


class ScgrpoCLI(LightningCLI):
    def instantiate_classes(self) -> None:
        # A bad value in the YAML (unknown task, missing file, G < 2, ...) ends in one line, not a traceback.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, ModuleNotFoundError, NotImplementedError) as err:
            if os.environ.get("SCGRPO_DEBUG"):
                raise
            print(f"scgrpo: error: {err}", file=sys.stderr)
            raise SystemExit(2) from err

    def before_instantiate_classes(self) -> None:
        # one folder per run for all file loggers, following trainer.default_root_dir; a resumed fit goes on in
        # the folder of its checkpoint (scgrpo.runs)
        config = self.config[self.subcommand] if self.subcommand else self.config
        resumed = share_run_folder(config.trainer, config.get("ckpt_path") if self.subcommand == "fit" else None)
        if resumed is not None:
            logging.getLogger(__name__).info("resuming in %s", resumed)

    def instantiate_trainer(self, **kwargs):
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        checkpoint = config.get("checkpoint")  # by step, unless checkpointing is off
        if checkpoint is not None and config.trainer.get("enable_checkpointing") is not False:
            callbacks = config.trainer.get("callbacks") or []
            kwargs["callbacks"] = [*(callbacks if isinstance(callbacks, list) else [callbacks]), checkpoint]
        trainer = super().instantiate_trainer(**kwargs)
        # Fix every logger's version before any of them creates its folder, so that the CSV and TensorBoard
        # loggers of one run share <root>/<name>/version_N instead of taking consecutive numbers.
        for logger in trainer.loggers:
            _ = logger.version
        return trainer

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(StepCheckpoint, "checkpoint", instantiate=True, sub_configs=True)
        parser.set_defaults(
            {
                "trainer.logger": [
                    {
                        "class_path": "scgrpo.runs.RunCSVLogger",
                        "init_args": {"save_dir": DEFAULT_ROOT, "name": DEFAULT_NAME, "flush_logs_every_n_steps": 10},
                    },
                    {
                        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": DEFAULT_ROOT, "name": DEFAULT_NAME},
                    },
                ],
                "trainer.max_steps": 100,
                "trainer.val_check_interval": 50,  # the prompt stream is endless: validate every N steps
                "trainer.check_val_every_n_epoch": None,
                "trainer.log_every_n_steps": 1,
                "trainer.num_sanity_val_steps": 0,
                "trainer.enable_model_summary": False,
            }
        )


def main(args=None) -> None:
    logging.basicConfig(level=os.environ.get("SCGRPO_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    cli = ScgrpoCLI(
        RLVRModule,
        PromptDataModule,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )
    if getattr(cli.model, "diverged", False):  # the divergence guard stopped the run (its message is logged)
        raise SystemExit(1)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
