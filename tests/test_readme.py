"""The README's configuration table against the code: every option of the module, its generation settings and the
data module has a row, and every row names an option that exists."""

import dataclasses
import inspect
import os
import re

from scgrpo.callbacks import StepCheckpoint
from scgrpo.data.datamodule import PromptDataModule
from scgrpo.module import RLVRModule
from scgrpo.rollout.engine import GenerationSettings

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _arguments(cls) -> list[str]:
    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


def _options() -> dict[str, set[str]]:
    """The options of each YAML section the table covers. ``model.generation`` is covered by its fields' rows."""
    return {
        "model": set(_arguments(RLVRModule)) - {"generation"},
        "model.generation": {f.name for f in dataclasses.fields(GenerationSettings)},
        "data": set(_arguments(PromptDataModule)),
        "checkpoint": set(_arguments(StepCheckpoint)),  # (the table has some, not all)
    }


def table_keys(text: str) -> list[str]:
    """The keys of the configuration table (the one under "## Configuration reference" headed ``| key | default |
    meaning |``): a row ``| `model.generation.compile` / `keep_workspace` | ...`` holds two keys of one section."""
    section = text.split("\n## Configuration reference\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("| key | default | meaning |\n|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    keys = []
    for row in table.splitlines():
        names = re.findall(r"`([^`]+)`", row.split(" | ")[0])
        assert names, f"a row without a key: {row}"
        section_name = names[0].rsplit(".", 1)[0]
        keys += [names[0], *(f"{section_name}.{name}" for name in names[1:])]
    return keys


def test_the_table_reads_keys_as_written():
    text = ("\n## Configuration reference\n\n| key | default | meaning |\n|---|---|---|\n"
            "| `model.model` | `smollm2` | m |\n| `model.generation.compile` / `keep_workspace` | `auto` / true | c |\n"
            "\nObjectives:\n\n| objective | options |\n|---|---|\n| `GRPO` | g |\n\n## Next\n")
    assert table_keys(text) == ["model.model", "model.generation.compile", "model.generation.keep_workspace"]


def test_every_option_is_in_the_readme_table_and_every_row_is_an_option():
    keys = table_keys(open(README, encoding="utf-8").read())
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    options = _options()
    missing = sorted(f"{section}.{name}" for section, names in options.items() if section != "checkpoint"
                     for name in names if f"{section}.{name}" not in keys)
    assert not missing, f"options without a row in README.md's configuration table: {missing}"
    unknown = [k for k in keys if k.rsplit(".", 1)[1] not in options.get(k.rsplit(".", 1)[0], set())]
    assert not unknown, f"rows of README.md's configuration table that name no option: {unknown}"
