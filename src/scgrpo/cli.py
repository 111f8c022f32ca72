"""``scgrpo fit|validate|test --config run.yaml``: LightningCLI over :class:`RLVRModule` and
:class:`PromptDataModule`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterator, NoReturn, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from scgrpo.callbacks import StepCheckpoint
from scgrpo.callbacks.progress import count_steps
from scgrpo.data import PromptDataModule
from scgrpo.distributed import RankFailed
from scgrpo.errors import InputError
from scgrpo.lightning_internals import rank_zero_logger
from scgrpo.module import RLVRModule
from scgrpo.runs import (DEFAULT_NAME, DEFAULT_ROOT, FOLDER_LOGGERS, new_run_folders, remove_unused_folders,
                         share_run_folder)


_NOISE = re.compile(r"^(- )?(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Given value type:|Given "
                    r"value:)|^- (Expected a <class '[\w.]+'>|Expected a path but)")
# a list given where a union also takes one object (trainer.logger: Logger | Iterable[Logger]): the object member's
# error, with the forms it takes nested under it, is a mere type mismatch too
_NOT_ONE_OBJECT = re.compile(r"^(- )?Not a valid subclass of [\w.]+(\. Got value: .*)?$")
# a class whose package is missing (Lightning's RequirementCache, e.g. WandbLogger without wandb)
_MISSING_PACKAGE = re.compile(r"(?:Problem with given class_path '(?P<cls>[^']+)': )?"
                              r"Requirement '(?P<req>[^']+)' not met\. HINT: Try running `[^`]*`")


def _missing_package(match: re.Match) -> str:
    who = f"{match['cls']} needs" if match["cls"] else "needs"
    return f"{who} {match['req']}, which is not installed: pip install '{match['req']}'"


def plain_message(message: str) -> str:
    """``message`` on one line. jsonargparse reports a value of a union type (``Optional[Objective]``,
    ``str | PromptSource``, ``Logger | Iterable[Logger]``) that fails as every member's error, the members and the
    whole value: only the errors that are not a mere type mismatch are kept (``c_quantile must be in (0, 1), got
    2.0``, not ``Expected a <class 'NoneType'>``; a list of loggers' failing class and its cause, not the list)."""
    kept, lines, mismatch_depth = [], [], None
    for line in message.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        line = line.strip()
        lines.append(line)
        if mismatch_depth is not None and depth > mismatch_depth:
            continue  # nested under a type mismatch
        mismatch_depth = depth if _NOT_ONE_OBJECT.match(line) else None
        if mismatch_depth is None and not _NOISE.match(line):
            kept.append(line.removeprefix("- "))
    return _MISSING_PACKAGE.sub(_missing_package, " ".join(" ".join(kept if kept else lines).split()))


def fail(err: BaseException) -> NoReturn:
    """End the run with ``scgrpo: error: <message>`` on one line (exit code 2), or re-raise with SCGRPO_DEBUG."""
    if os.environ.get("SCGRPO_DEBUG"):
        raise err
    message = plain_message(str(err)) or type(err).__name__
    print(f"scgrpo: error: {message}", file=sys.stderr)
    raise SystemExit(2) from err


UNKNOWN_KEY = re.compile(r"unrecognized arguments: --([\w.]+)|does not accept options? '([\w.]+)'|"
                         r"Key '([\w.]+)' is not expected")
"""The forms in which jsonargparse names a key it does not know"""


def known_keys(parser) -> list[str]:
    """Every option key of ``parser`` and of its subcommands' parsers (``model.generation.max_new_tokens``)."""
    keys, parsers = [], [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            keys += [option[2:] for option in action.option_strings if option.startswith("--")]
            parsers += list(getattr(action, "_name_parser_map", {}).values())  # (the subcommands)
    return keys


def did_you_mean(message: str, parser) -> str:
    """"; did you mean --model.generation.max_new_tokens?" for a message about an unknown key close to known ones
    (difflib's ratio, over the whole dotted key), else ""."""
    import difflib

    found = UNKNOWN_KEY.search(message)
    if found is None:
        return ""
    key = next(group for group in found.groups() if group)
    close = difflib.get_close_matches(key, sorted(set(known_keys(parser))), n=3, cutoff=0.8)
    return f"; did you mean {' or '.join('--' + c for c in close)}?" if close else ""


MOST_USED = {"model.model": None, "model.objective": None, "model.lora": None, "model.dtype": None,
             "model.verifier": None, "model.reward_funcs": None, "model.environment": None, "model.optimizer": None,
             "model.generation.num_generations": "G, the completions sampled per prompt",
             "model.generation.max_new_tokens": "the longest completion, in tokens",
             "model.memory_budget_gib": None, "model.validate_before_training": None, "data.source": None,
             "data.batch_size": None, "data.eval_splits": None, "data.final_splits": None, "trainer.max_steps": None,
             "trainer.val_check_interval": None, "trainer.devices": None, "trainer.default_root_dir": None,
             "checkpoint.every_n_train_steps": None, "checkpoint.monitor": None, "ckpt_path": None}
"""The options a subcommand's ``--help`` describes (those its parser has: ``ckpt_path`` is fit's, validate's and
test's), with the first sentence of their help or, for one that has none, the text given here; ``--help_all`` lists
all of them (about 900 lines)"""

SECTION_NOTES = {
    "model": "the policy and how it trains: model folder, objective, LoRA, verifier, rewards, environment, optimiser",
    "data": "the prompts: their source (a task, a file, a hub dataset), batch size, evaluation splits",
    "trainer": "Lightning's Trainer: steps, devices, precision, loggers, validation interval",
    "checkpoint": "last.ckpt every N steps, and the best one by a validation metric",
}
"""What each config section holds, in the summary ``--help`` prints (a section without a note: its group's title)"""


def _option_actions(parser) -> list[argparse.Action]:
    """The options of ``parser`` that take a value of the config: not ``--help``, ``--config``, ``--print_config``,
    a class's ``--X.help`` nor a section's ``--X CONFIG`` (a file of that section)."""
    from jsonargparse import ActionConfigFile

    return [action for action in parser._actions
            if action.option_strings and action.dest not in (argparse.SUPPRESS, "print_config")
            and not isinstance(action, (argparse._HelpAction, ActionConfigFile)) and not action.dest.endswith(".help")
            and action.metavar != "CONFIG"]


def _first_sentence(text: Optional[str]) -> str:
    """The first sentence of a docstring's text, its reST markup read as plain text (``x`` and :mod:`x` as x)."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", " ".join((text or "").split())).replace("``", "")
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", text, maxsplit=1)[0]


def help_summary(parser) -> str:
    """A subcommand's ``--help``: its sections with their sizes, the most used options and where to see the others
    (``--help_all``: jsonargparse's listing of every option, about 900 lines)."""
    prog = parser.prog.replace(" [options]", "")
    head = argparse.HelpFormatter(prog, max_help_position=14)  # (the sections' names are short)
    head.add_usage(f"{prog} [-h] [--help_all] [-c CONFIG] [--print_config[=flags]] [--SECTION.KEY VALUE ...]",
                   [], [], prefix="usage: ")
    head.add_text(parser.description)

    def entry(option: str, text: str, metavar: Optional[str] = None) -> argparse.Action:
        return argparse.Action([option], dest=argparse.SUPPRESS, metavar=metavar, nargs=None if metavar else 0,
                               help=text.replace("%", "%%"))

    actions = _option_actions(parser)
    sections: dict[str, list[str]] = {}
    for action in actions:
        if "." in action.dest:
            sections.setdefault(action.dest.split(".", 1)[0], []).append(action.dest)
    titles = {group.dest: group.title for group in parser._action_groups if getattr(group, "dest", None)}
    head.start_section("sections (--SECTION.KEY VALUE, or SECTION: {KEY: VALUE} in a --config YAML)")
    for name, keys in sections.items():
        nested = sorted({key.rsplit(".", 1)[0] for key in keys if key.count(".") > 1})
        note = SECTION_NOTES.get(name) or _first_sentence(titles.get(name)).rstrip(":.")
        if nested:
            note += f"; within it {', '.join(nested)}"
        head.add_argument(entry(name, f"{len(keys)} options: {note}" if note else f"{len(keys)} options"))
    others = [action for action in actions if "." not in action.dest]
    if others:
        head.add_argument(entry("others", ", ".join("--" + action.dest for action in others)))
    head.end_section()

    formatter = argparse.HelpFormatter(prog, max_help_position=34)
    by_key = {action.dest: action for action in actions}
    formatter.start_section("most used options")
    for key, note in MOST_USED.items():
        action = by_key.get(key)
        if action is None:
            continue
        text = _first_sentence(action.help) or note or ""
        if isinstance(action.default, (str, int, float, bool)) and "default" not in text:
            shown = str(action.default).lower() if isinstance(action.default, bool) else action.default
            text += f" (default: {shown})"  # (as YAML writes it)
        metavar = "{true,false}" if action.default in (True, False) else key.rsplit(".", 1)[-1].upper()
        formatter.add_argument(entry(f"--{key}", text.strip(), metavar=metavar))
    formatter.end_section()

    formatter.start_section("the rest")
    example = "--model.objective.help" if any(a.dest == "model.objective.help" for a in parser._actions) else None
    for option, text in (("-c, --config CONFIG", "a YAML file of the sections above (repeatable: later files win)"),
                         ("--help_all", f"every option of `{prog}`, with its type and default"),
                         ("--SECTION.KEY.help CLASS", "the options of one class a key takes"
                                                      + (f", e.g. {example} GRPO" if example else "")),
                         ("--print_config", "the whole configuration these arguments make, as YAML, and exit")):
        formatter.add_argument(entry(option, text))
    formatter.end_section()
    return head.format_help() + "\n" + formatter.format_help()


class _HelpAll(argparse._HelpAction):
    """``--help_all``: jsonargparse's listing of every option (``--help`` prints :func:`help_summary`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        parser.print_help_all()
        parser.exit()


class ScgrpoArgumentParser(LightningArgumentParser):
    """A config error (a value of the wrong type, an unknown key) prints the error and where to find the options,
    not the 90 lines of usage first. A subcommand's ``--help`` prints a summary (:func:`help_summary`), its
    ``--help_all`` the whole listing."""

    summary_help = False
    """Whether ``--help`` prints the summary: set on the subcommands' parsers (``ScgrpoCLI.add_arguments_to_parser``),
    not on the top parser (its subcommands) nor on the parsers that jsonargparse makes for ``--X.help CLASS``"""

    def format_help(self, *args, **kwargs) -> str:
        return help_summary(self) if self.summary_help else super().format_help(*args, **kwargs)

    def print_help_all(self, file=None) -> None:
        self._print_message(super().format_help(), file or sys.stdout)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("SCGRPO_DEBUG"):
            super().error(message, ex)  # nested parsers raise, and the outer one reports
        parser = getattr(ex, "subcommand_parser", None) or self
        subcommand = parser.prog.replace(" [options]", "").split()[1:]  # the prog is "scgrpo fit" or "cli.py fit"
        print(f"scgrpo: error: {plain_message(message)}{did_you_mean(message, self)}", file=sys.stderr)
        print(f"scgrpo: `{' '.join(['scgrpo', *subcommand, '--help'])}` lists the options", file=sys.stderr)
        self.exit(2)


def check_output_folder(folder: str) -> None:
    """Fail before the run starts when ``folder`` cannot be made: a file stands where it or a parent should be."""
    path = Path(folder).absolute()
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{parent} is a file, where the run's folder {folder} should be; move it away or "
                                 "set the loggers' save_dir")
            return


class ScgrpoCLI(LightningCLI):
    def __init__(self, *args, **kwargs) -> None:
        self.new_run_folders: list[str] = []  # the run folders this run makes (scgrpo.runs.new_run_folders), rank 0
        super().__init__(*args, **kwargs)  # (which runs the subcommand)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's subcommands less ``predict``: a policy's outputs are sampled completions, which ``validate``
        and ``test`` score and log; Lightning's predict loop has no forward pass to call here."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def instantiate_classes(self) -> None:
        # A bad value in the YAML (unknown task, missing file, G < 2, ...) ends in one line, not a traceback.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, ModuleNotFoundError, NotImplementedError) as err:
            fail(err)

    def before_instantiate_classes(self) -> None:
        # one folder per run for all file loggers, following trainer.default_root_dir; a resumed fit goes on in
        # the folder of its checkpoint (scgrpo.runs)
        config = self.config[self.subcommand] if self.subcommand else self.config
        resumed = share_run_folder(config.trainer, config.get("ckpt_path") if self.subcommand == "fit" else None)
        if resumed is not None:
            logging.getLogger("scgrpo.cli").info("resuming in %s", resumed)  # (also as __main__)

    def instantiate_trainer(self, **kwargs):
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        checkpoint = config.get("checkpoint")  # by step, unless checkpointing is off
        if checkpoint is not None and config.trainer.get("enable_checkpointing") is not False:
            callbacks = config.trainer.get("callbacks") or []
            kwargs["callbacks"] = [*(callbacks if isinstance(callbacks, list) else [callbacks]), checkpoint]
        trainer = super().instantiate_trainer(**kwargs)
        # Lightning puts config.yaml and checkpoints in the first logger's folder, and scgrpo its own files: a logger
        # without one (W&B, MLflow) listed first would scatter them, so the file loggers go first
        trainer.loggers = sorted(trainer.loggers, key=lambda logger: not isinstance(logger, FOLDER_LOGGERS))
        for logger in trainer.loggers:
            if getattr(logger, "root_dir", None):
                check_output_folder(logger.root_dir)
        count_steps(trainer)  # "Step 3/10", not "Epoch 0/-2"
        # Fix every logger's version before any of them creates its folder, so that the CSV and TensorBoard
        # loggers of one run share <root>/<name>/version_N instead of taking consecutive numbers.
        for logger in trainer.loggers:
            _ = logger.version
        self.new_run_folders = new_run_folders(trainer.loggers) if trainer.is_global_zero else []
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        # a run that fails before it has done anything (a bad value met at setup, a missing file, an error before the
        # first step) takes away the run folder it made: no empty version_N is left behind
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            removed = remove_unused_folders(self.new_run_folders, logged=bool(self.trainer.logged_metrics))
            if removed:
                logging.getLogger("scgrpo.cli").info("the run failed before it wrote anything: removed %s", removed[0])
            raise

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--help_all", action=_HelpAll, help="Show every option, its type and default, and exit.")
        parser.summary_help = True
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


LIGHTNING_TIPS = "💡 Tip: For seamless cloud "
"""How Lightning's advertisements for its cloud services begin (litlogger, in the logger connector; litmodels, in the
callback connector), logged by ``rank_zero_info`` at INFO on every run without LitLogger"""

LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
"""The FutureWarning (torch's ``utils/_pytree.py``, 2.13 here) that Lightning's ``utilities/_pytree.py`` sets off on
every run: it makes a ``LeafSpec()`` for each ``CombinedLoader`` of the fit's and evaluations' data"""


class _NotATip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIPS)


_NOT_A_TIP = _NotATip()


@contextlib.contextmanager
def lightning_noise_silenced() -> Iterator[None]:
    """Within: no Lightning cloud tip (its other INFO lines, "GPU available: ...", stay) and no LeafSpec
    FutureWarning from Lightning's ``_pytree`` module (the same warning from anywhere else, and every other warning,
    still shows)."""
    logger = rank_zero_logger()
    logger.addFilter(_NOT_A_TIP)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning,
                                    module=r"lightning\.pytorch\.utilities\._pytree$")
            yield
    finally:
        logger.removeFilter(_NOT_A_TIP)


def working_folder_importable() -> None:
    """The working folder first on the import path, as ``python -m scgrpo.cli`` has it: a module of the user's beside
    the config (an environment, a verifier, a reward function: ``my_pkg.guess.Guess``) is found by its class path when
    the ``scgrpo`` console script runs (whose own folder is the one Python puts there)."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)


SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
"""The repository's ``configs/`` folder, beside ``src/`` (there in an install from a clone, ``pip install -e .``)"""


def shipped_configs(args: list[str], shipped: Path = SHIPPED_CONFIGS) -> list[str]:
    """``args`` with each ``--config configs/NAME.yaml`` (``--config=...``, ``-c ...``) that is not in the working
    folder replaced by the shipped ``configs/NAME.yaml``, with one log line: README's commands run from the user's
    own folder. A ``configs/`` path found in neither place ends in one line; any other value is left to the parser."""
    resolved = list(args)
    for i, arg in enumerate(args):
        if arg.startswith("--config="):
            flag, value = "--config=", arg.removeprefix("--config=")
        elif i > 0 and args[i - 1] in ("--config", "-c"):
            flag, value = "", arg
        else:
            continue
        path = Path(value)
        if path.is_absolute() or path.parts[:1] != ("configs",) or path.exists():
            continue
        candidate = shipped.joinpath(*path.parts[1:])
        if not candidate.is_file():
            missing = "" if shipped.is_dir() else ", which this install does not have"
            fail(InputError(f"no config {value} in the working folder {os.getcwd()}, nor among the configs shipped "
                            f"with scgrpo ({shipped}{missing})"))
        logging.getLogger("scgrpo.cli").info("%s is not in the working folder: the shipped one, %s", value, candidate)
        resolved[i] = flag + str(candidate)
    return resolved


def main(args=None) -> None:
    working_folder_importable()
    logging.basicConfig(level=os.environ.get("SCGRPO_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args is None:  # (in place: LightningCLI warns when given args beside a command line)
        sys.argv[1:] = shipped_configs(sys.argv[1:])
    elif isinstance(args, list):
        args = shipped_configs(args)
    try:
        with lightning_noise_silenced():
            cli = ScgrpoCLI(
                RLVRModule,
                PromptDataModule,
                parser_class=ScgrpoArgumentParser,
                save_config_kwargs={"overwrite": True},
                seed_everything_default=0,
                args=args,
            )
    except (InputError, RankFailed) as err:  # a bad data file or model folder found during the run, or another
        fail(err)  # rank's failure before the ranks' first collective: one line, not a traceback
    if getattr(cli.model, "diverged", False):  # the divergence guard stopped the run (its message is logged)
        raise SystemExit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
