"""What the CLI prints besides the run's own output: a subcommand's ``--help`` is a summary that names the config
sections and where to see every option; a run prints no Lightning cloud tip nor the LeafSpec FutureWarning that
Lightning's ``_pytree`` sets off, and still every other warning (a user module's, Lightning's own INFO lines)."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from scgrpo.cli import LIGHTNING_TIPS, MOST_USED, lightning_noise_silenced, main
from scgrpo.lightning_internals import rank_zero_logger

USER_WARNING = "warning_reward: a warning of the user's own"


def warning_reward(completions, **kwargs):
    """A reward function of the user's that warns (by its import path, ``tests.test_cli_noise.warning_reward``)."""
    warnings.warn(USER_WARNING)
    return [0.0 for _ in completions]


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 0
    return capsys.readouterr().out


def test_fit_help_is_a_summary_that_names_the_sections_and_the_full_listing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # (argparse wraps at the terminal's width)
    listed = _help(capsys, "fit", "--help")
    lines = listed.splitlines()
    assert 30 < len(lines) < 150  # (jsonargparse's listing of every option: about 900)
    assert lines[0].startswith("usage: ") and "fit" in lines[0]
    for section in ("model", "data", "trainer", "checkpoint"):
        assert re.search(rf"^  {section} +\d+ options: ", listed, re.M), section
    for key in MOST_USED:  # each named option is one that fit takes
        assert re.search(rf"^  --{re.escape(key)} ", listed, re.M), key
    for pointer in ("--help_all", "--print_config", "--model.objective.help", "--config"):
        assert pointer in listed


def test_help_all_lists_every_option_and_validates_help_is_a_summary_too(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    listing = _help(capsys, "fit", "--help_all")
    assert len(listing.splitlines()) > 500
    for option in ("--model.generation.temperature", "--data.max_prompt_tokens", "--trainer.precision",
                   "--checkpoint.dirpath", "--ckpt_path", "--trainer.logger.help"):
        assert option in listing
    summary = _help(capsys, "validate", "--help")
    assert len(summary.splitlines()) < 150 and "--help_all" in summary
    assert "Perform one evaluation epoch over the validation set." in summary
    assert "fit" in _help(capsys, "--help")  # the top-level help: its subcommands, as Lightning prints it


def test_a_class_help_still_lists_that_class_options(capsys):
    listed = _help(capsys, "fit", "--model.objective.help", "GRPO")
    assert "--model.objective.eps_low" in listed and "--model.objective.beta" in listed


@pytest.mark.parametrize("origin", ["lightning.pytorch.utilities._pytree", "my_pkg.module"])
def test_the_leafspec_warning_is_silenced_only_where_lightning_sets_it_off(origin):
    """The filter is the one message from the one module: the same text from elsewhere, and any other warning, pass."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lightning_noise_silenced():
            warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning,
                                   "x.py", 1, module=origin)
            warnings.warn_explicit("something else is deprecated", FutureWarning, "x.py", 2,
                                   module="lightning.pytorch.utilities._pytree")
    messages = [str(w.message) for w in caught]
    assert "something else is deprecated" in messages
    assert any("LeafSpec" in m for m in messages) == (origin != "lightning.pytorch.utilities._pytree")


def test_a_run_prints_no_lightning_tip_nor_leafspec_warning_and_keeps_the_rest(tiny_model_dir, tmp_path, monkeypatch,
                                                                                recwarn):
    monkeypatch.chdir(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = rank_zero_logger()  # (where Lightning's rank_zero_info logs: the tips, "GPU available: ...")
    logger.addHandler(handler)
    try:
        main(["fit", f"--model.model={tiny_model_dir}", "--model.dtype=float32",
              "--model.generation.max_new_tokens=4", "--model.generation.num_generations=2",
              "--trainer.accelerator=cpu", "--trainer.max_steps=1", "--data.batch_size=2", "--data.eval_splits=[]",
              "--model.validate_before_training=false", "--model.log_completions_every_n_steps=0",
              "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
              "--model.reward_funcs=[tests.test_cli_noise.warning_reward]"])
    finally:
        logger.removeHandler(handler)
    logged = [record.getMessage() for record in records]
    assert any(message.startswith("GPU available") for message in logged), logged  # Lightning's INFO lines stay
    assert not any(message.startswith(LIGHTNING_TIPS) for message in logged), logged
    warned = [str(w.message) for w in recwarn]  # (recwarn: every warning, pytest's ini filters aside)
    assert USER_WARNING in warned
    assert not any("LeafSpec" in message for message in warned), warned
    assert rank_zero_logger().filter(logging.makeLogRecord({"msg": LIGHTNING_TIPS + "..."}))  # (only within main)
