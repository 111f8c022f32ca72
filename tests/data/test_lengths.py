"""The prompt-length policy: rows whose prompt (or self-teacher view) does not fit the model are skipped and counted
when a split is loaded. The tiny model's context is 512 positions and its tokenizer has no merges (one token per
byte), so questions of a given token count are easy to write."""

import json
import logging
import os

import pytest

from scgrpo.data.lengths import drop_long_rows, prompt_limits
from scgrpo.errors import InputError
from scgrpo.objectives import GRPO, SCGRPO
from scgrpo.rollout import GenerationSettings
from tests.helpers import tiny_module


@pytest.fixture(scope="module")
def modules(tiny_model_dir):
    """A GRPO and an SC-GRPO module on the tiny model (context 512), max_new_tokens 8."""
    out = {}
    for name, objective in (("grpo", GRPO()), ("scgrpo", SCGRPO())):
        module = tiny_module(tiny_model_dir, objective=objective,
                             generation=GenerationSettings(num_generations=4, max_new_tokens=8))
        module.configure_model()
        out[name] = module
    return out


def _exact(module, question: str) -> int:
    return len(module.tokenizer(module.actor.format_prompts([question]), add_special_tokens=False)["input_ids"][0])


def _teacher_exact(module, question: str) -> int:
    prompt = module.self_teacher.teacher_prompts(module.actor, [question], [""])
    return len(module.tokenizer(prompt, add_special_tokens=False)["input_ids"][0])


def test_limits_are_the_context_minus_the_completion_and_for_the_teacher_a_reference_too(modules):
    grpo, scgrpo = prompt_limits(modules["grpo"].prompt_fit(), None), prompt_limits(modules["scgrpo"].prompt_fit(), None)
    assert (grpo.prompt, grpo.teacher) == (512 - 8, None)
    assert (scgrpo.prompt, scgrpo.teacher) == (512 - 8, 512 - 8 - 8)
    assert prompt_limits(modules["grpo"].prompt_fit(), 100).prompt == 100
    assert prompt_limits(modules["grpo"].prompt_fit(), 100_000).prompt == 504  # capped by the context
    scgrpo_module = modules["scgrpo"]
    try:
        scgrpo_module.generation.max_new_tokens = 300  # no room for a whole reference: the teacher's view fits empty
        limits = prompt_limits(scgrpo_module.prompt_fit(), None)
        assert (limits.prompt, limits.teacher, limits.reference) == (212, 212, 0)
        scgrpo_module.generation.max_new_tokens = 600
        with pytest.raises(InputError, match="max_new_tokens=600 leaves no room for a prompt"):
            prompt_limits(scgrpo_module.prompt_fit(), None)
    finally:
        scgrpo_module.generation.max_new_tokens = 8


def test_rows_are_kept_exactly_when_their_prompt_fits(modules, caplog):
    module = modules["grpo"]
    overhead = _exact(module, "")
    limit = 200
    # questions whose prompts have limit - 9 .. limit + 9 tokens, and a multi-byte one near the limit
    rows = [{"id": str(k), "question": "x" * (limit - overhead + k), "answer": 1} for k in range(-9, 10)]
    rows.append({"id": "multibyte", "question": "é" * ((limit - overhead) // 2 + 1), "answer": 1})
    with caplog.at_level(logging.WARNING, logger="scgrpo.data.lengths"):
        kept = drop_long_rows(module.prompt_fit(), rows, prompt_limits(module.prompt_fit(), limit), "rows.jsonl")
    assert [r["id"] for r in kept] == [r["id"] for r in rows if _exact(module, r["question"]) <= limit]
    assert len(kept) == 10
    (record,) = caplog.records
    assert record.getMessage() == (
        f"rows.jsonl: skipped 10 of 20 rows whose prompt is too long for the model: the longest (id 9) has "
        f"{limit + 9} tokens, over the 200 a prompt may have (data.max_prompt_tokens)")


def test_a_row_whose_teacher_view_does_not_fit_is_skipped_only_with_a_self_teacher(modules, caplog):
    scgrpo = modules["scgrpo"]
    teacher_overhead = _teacher_exact(scgrpo, "")
    question = "y" * (496 - teacher_overhead + 1)  # the teacher's view is one token over its 496
    assert _exact(scgrpo, question) <= 504  # while the student's prompt fits
    rows = [{"id": "a", "question": "short", "answer": 1}, {"id": "b", "question": question, "answer": 1}]
    assert drop_long_rows(modules["grpo"].prompt_fit(), rows, prompt_limits(modules["grpo"].prompt_fit(), None), "t") == rows
    with caplog.at_level(logging.WARNING, logger="scgrpo.data.lengths"):
        assert drop_long_rows(scgrpo.prompt_fit(), rows, prompt_limits(scgrpo.prompt_fit(), None), "t") == rows[:1]
    assert "skipped 1 of 2 rows" in caplog.text and "497 for the self-teacher's view" not in caplog.text
    assert f"self-teacher's view of it {_teacher_exact(scgrpo, question)}" in caplog.text


def test_a_split_with_no_row_that_fits_is_one_error(modules):
    rows = [{"id": "0", "question": "z" * 1000, "answer": 1}]
    with pytest.raises(InputError, match="^long.jsonl: no row fits the model \\(1 too long\\): the longest"):
        drop_long_rows(modules["grpo"].prompt_fit(), rows, prompt_limits(modules["grpo"].prompt_fit(), None), "long.jsonl")


def test_a_200kb_question_is_skipped_and_counted_when_the_run_starts(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Before the policy, the sampler tried to allocate a 200,000 x 200,000 attention mask for this row."""
    from scgrpo.cli import main

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": 2}, {"question": "x " * 100_000, "answer": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.yaml")
    with caplog.at_level(logging.WARNING, logger="scgrpo.data.lengths"):
        main(["fit", f"--config={config}", f"--model.model={tiny_model_dir}", "--model.dtype=float32",
              "--model.generation.max_new_tokens=6", "--model.validate_before_training=false",
              "--trainer.accelerator=cpu", "--trainer.max_steps=1", "--trainer.enable_progress_bar=false",
              "--trainer.enable_checkpointing=false", "--data.source=scgrpo.data.FileSource",
              f"--data.source.files={path}", "--data.eval_splits=[]", "--data.batch_size=2"])
    warnings = [r.getMessage() for r in caplog.records if r.name == "scgrpo.data.lengths"]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{path}: skipped 1 of 2 rows whose prompt is too long for the model: the longest "
                                  "(id 1) has 200,0")
    assert "the limits are 506 for a prompt (the model's context of 512 minus generation.max_new_tokens 6)" in warnings[0]
