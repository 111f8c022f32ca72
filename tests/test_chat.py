"""Prompts as chat messages (TRL's conversational format): checks, rendering, the self-teacher's view, files."""

import json

import pytest

from scgrpo.data import FileSource
from scgrpo.chat import as_prompt, messages, prompt_fault, prompt_key, prompt_text, render
from scgrpo.data.lengths import _token_counts
from scgrpo.selfteacher import SelfTeacher
from scgrpo.rollout.types import TeacherSpec
from tests.conftest import build_tokenizer

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 3?"}]
TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
         {"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize("prompt, fault", [
    ("", "an empty prompt"), (None, "no prompt"), (3, "a prompt that is a int"), ([], "an empty list of messages"),
    (["hi"], "message 1 is a str"), ([{"role": "robot", "content": "x"}], "message 1 has role 'robot'"),
    ([{"role": "user"}], "message 1 has no text content"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "message 1's content is a list"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "message 2 is a system message"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "the last message is the assistant's"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": " "}], "no message with text"),
])
def test_a_malformed_prompt_says_why(prompt, fault):
    assert prompt_fault(prompt).startswith(fault)
    with pytest.raises(ValueError, match=fault.split("'")[0]):
        as_prompt(prompt)


def test_a_row_system_message_replaces_the_runs_and_turns_are_kept():
    assert prompt_fault(CHAT) is None and prompt_fault(TURNS) is None
    assert messages(CHAT, "Run's system.") == CHAT
    assert messages(TURNS, "Run's system.") == [{"role": "system", "content": "Run's system."}, *TURNS]
    assert messages("What?", None) == [{"role": "user", "content": "What?"}]
    assert prompt_text(TURNS) == "What is 2 + 3?" and prompt_text("x") == "x"
    assert prompt_key(CHAT) == prompt_key([dict(m) for m in CHAT]) != prompt_key(TURNS)


def test_rendering_goes_through_the_chat_template():
    tok = build_tokenizer()
    text = render(tok, CHAT, "ignored, the row has its own")
    assert text == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "You are terse." in text and "ignored" not in text
    # a question as text renders as before: the run's system message, then the user's turn
    assert render(tok, "What?", "Sys.") == tok.apply_chat_template(
        [{"role": "system", "content": "Sys."}, {"role": "user", "content": "What?"}], tokenize=False,
        add_generation_prompt=True)
    tok.chat_template = None
    assert render(tok, TURNS, "Sys.") == "Sys.\n\nHi\n\nHello.\n\nWhat is 2 + 3?"


class _Policy:
    def __init__(self, tokenizer, system_prompt=None):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt


def test_the_teacher_puts_the_reference_in_the_rows_own_system_message():
    tok = build_tokenizer()
    teacher = SelfTeacher(TeacherSpec(template="Solution: {reference}"))
    (with_own, with_turns, text) = teacher.teacher_prompts(_Policy(tok, "Run's system."), [CHAT, TURNS, "What?"],
                                                           ["5", "five", "5!"])
    assert with_own == tok.apply_chat_template(
        [{"role": "system", "content": "You are terse.\n\nSolution: 5"}, CHAT[1]], tokenize=False,
        add_generation_prompt=True)
    assert with_turns == tok.apply_chat_template(
        [{"role": "system", "content": "Run's system.\n\nSolution: five"}, *TURNS], tokenize=False,
        add_generation_prompt=True)
    assert text == tok.apply_chat_template(
        [{"role": "system", "content": "Run's system.\n\nSolution: 5!"}, {"role": "user", "content": "What?"}],
        tokenize=False, add_generation_prompt=True)


DROPS_SYSTEM = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_without_a_system_role_student_and_teacher_both_open_the_first_turn_with_the_system_text():
    """A template that renders no system message: the row's system text is not lost for the student while the
    teacher sees it, so the divergence measures the reference alone."""
    from scgrpo.policy import Policy

    tok = build_tokenizer()
    tok.chat_template = DROPS_SYSTEM
    policy = Policy.__new__(Policy)  # (only what format_prompts reads)
    policy.tokenizer, policy.system_prompt, policy._system_role = tok, "Run's system.", None
    (student,) = policy.format_prompts([CHAT])
    (teacher,) = SelfTeacher(TeacherSpec(template="Solution: {reference}")).teacher_prompts(policy, [CHAT], ["5"])
    assert "<|im_start|>user\nYou are terse.\n\nWhat is 2 + 3?<|im_end|>" in student
    assert "<|im_start|>user\nYou are terse.\n\nSolution: 5\n\nWhat is 2 + 3?<|im_end|>" in teacher
    (plain,) = policy.format_prompts(["What?"])
    assert "<|im_start|>user\nRun's system.\n\nWhat?<|im_end|>" in plain


def test_token_counts_of_messages_are_exact():
    tok = build_tokenizer()

    def rendered(prompts):
        return [render(tok, p, "Sys.") for p in prompts]

    prompts = [CHAT, "What is 2 + 3?", TURNS]
    exact = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in rendered(prompts)]
    counts = _token_counts(tok, rendered, prompts, limit=exact[0])  # the first decides against the limit: exact
    assert counts[0] == exact[0] and counts[2] == exact[2] and counts[1] >= exact[1]


def test_a_trl_conversational_file_loads_with_its_columns(tmp_path, caplog):
    rows = [{"prompt": CHAT, "solution": "5", "question": "What is 2 + 3?", "completion": "5"},
            {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "solution": "2"},
            {"prompt": [{"role": "user"}], "solution": "3"},
            {"prompt": "What is 4 + 4?", "solution": "8"},
            {"prompt": [{"role": "user", "content": "Hi", "name": "ann"}], "solution": "0"}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = FileSource(str(path))
    loaded = source.rows("train")
    # (the table gives every message every key of any, None where absent: those are dropped)
    assert [r["question"] for r in loaded] == [CHAT, rows[1]["prompt"], "What is 4 + 4?", rows[4]["prompt"]]
    # TRL's prompt is read where a plain question sits beside it; a reference completion reaches no reward function
    assert [r["columns"] for r in loaded] == [{"solution": "5", "question": "What is 2 + 3?"},
                                              {"solution": "2", "question": None}, {"solution": "8", "question": None},
                                              {"solution": "0", "question": None}]
    assert all(r["answer"] is None for r in loaded) and "no column 'answer'" in source.answer_fault()
    assert "skipped 1 of 5 rows" in caplog.text and "row 3: message 1 has no text content" in caplog.text


def test_an_eval_only_file_source_has_no_train_split(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"question": "1 + 1?", "answer": 2}) + "\n")
    source = FileSource({"test": str(path)})
    assert source.splits() == ["test"] and source.eval_splits() == ["test"]
    assert source.rows("test")[0]["answer"] == 2
    with pytest.raises(ValueError, match="no file for split 'train'"):
        source.rows("train")
