"""Building a module, data module and trainer around the tiny model."""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Optional

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

import torch

from scgrpo import GenerationSettings, LoraSettings, PromptDataModule, RLVRModule
from tests.verifiers.helpers import ParityVerifier

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def readme_section(heading: str) -> str:
    """README.md's section under ``heading`` as written (``## Train an agent``, ``### A calculator tool``), its
    subsections included, up to the next heading of its level or above (``#`` lines inside code blocks are not
    headings)."""
    level, lines, inside, fenced = len(heading) - len(heading.lstrip("#")), [], False, False
    for line in open(README, encoding="utf-8").read().splitlines(keepends=True):
        fenced = fenced != line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            if inside:
                break
            inside = line.rstrip("\n") == heading
        if inside:
            lines.append(line)
    assert lines, f"README.md has no section {heading!r}"
    return "".join(lines)


class CodeBlock(NamedTuple):
    language: str
    body: str
    file: Optional[str]
    """The file it shows: named by a ``<!-- trl-example: PATH -->`` line above it or by its first line, ``# PATH``
    (``# my_pkg/guess.py``, ``# corridor.yaml``); None for a fragment"""


def code_blocks(text: str) -> list[CodeBlock]:
    """The fenced code blocks of ``text`` (a README section), in order."""
    blocks = []
    for marker, language, body in re.findall(r"(?:<!-- trl-example: (\S+) -->\n)?```(\w*)\n(.*?)```", text, re.S):
        named = re.fullmatch(r"# ([\w./-]+\.\w+)", body.split("\n", 1)[0])
        blocks.append(CodeBlock(language, body, marker or (named[1] if named else None)))
    return blocks


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package)."""
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def tiny_module(model_dir: str, **kwargs) -> RLVRModule:
    defaults = dict(
        model=model_dir,
        lora=LoraSettings(r=4, alpha=8, extra={"init_lora_weights": False}),
        generation=GenerationSettings(num_generations=4, max_new_tokens=8),
        verifier=ParityVerifier(),
        validate_before_training=False,
        eval_samples=2,
    )
    defaults.update(kwargs)
    return RLVRModule(**defaults)


def tiny_data(**kwargs) -> PromptDataModule:
    defaults = dict(source="arithmetic", batch_size=4, eval_batch_size=8, eval_splits=["id"], max_eval_prompts=8)
    defaults.update(kwargs)
    return PromptDataModule(**defaults)


def tiny_trainer(root, max_steps: int = 1, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=CSVLogger(str(root), name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def sampler_vs_trainer(module: RLVRModule, generated) -> tuple[torch.Tensor, torch.Tensor]:
    """``|log p_trainer - log p_sampler|`` ``[N, C]`` of a ``module.sample`` result's tokens (the trainer's side from
    the module's own log-prob pass, eval mode), and the completion mask as bool."""
    c = generated.completion_ids.shape[1]
    ids = torch.cat([generated.prompt_ids, generated.completion_ids], 1)
    attention = torch.cat([generated.prompt_mask, generated.completion_mask.long()], 1)
    module.policy.eval()
    with torch.no_grad():
        trainer = module.actor.token_logprobs(ids, attention, c, entropy=False)[0]
    return (trainer - generated.sampler_logprobs).abs(), generated.completion_mask.bool()
