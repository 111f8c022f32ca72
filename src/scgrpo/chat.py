"""Prompts as text or as chat messages (TRL's conversational format), rendered through the model's chat template.

A prompt is either a string (the user's turn) or a list of messages ``[{"role": ..., "content": ...}, ...]``. A
list may open with its own system message, which then replaces ``model.system_prompt`` for that row; it may hold
earlier turns of a conversation (user and assistant), and ends with a turn the model answers (user or tool).
Everything that turns a prompt into tokens goes through :func:`messages` and :func:`render`: the student's prompt,
the self-teacher's view (whose system message gains the verified solution) and the length checks.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

Message = dict[str, str]
Prompt = Union[str, list[Message]]

ROLES = ("system", "user", "assistant", "tool")
"""Roles a prompt's messages may have"""


def is_chat(prompt: Any) -> bool:
    """The prompt is a list of messages (not a string)."""
    return isinstance(prompt, (list, tuple))


def prompt_fault(prompt: Any) -> Optional[str]:
    """Why ``prompt`` is not a usable prompt (a few words), or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "an empty prompt"
    if not is_chat(prompt):
        return "no prompt" if prompt is None else f"a prompt that is a {type(prompt).__name__}, not text or messages"
    if not prompt:
        return "an empty list of messages"
    for k, message in enumerate(prompt, 1):
        if not isinstance(message, dict):
            return f"message {k} is a {type(message).__name__}, not an object with role and content"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"message {k} has role {role!r}, expected one of {list(ROLES)}"
        if not isinstance(content, str):
            return (f"message {k} has no text content" if content is None else
                    f"message {k}'s content is a {type(content).__name__}, not text")
        if role == "system" and k > 1:
            return f"message {k} is a system message after the first"
    if prompt[-1]["role"] in ("system", "assistant"):
        return f"the last message is the {prompt[-1]['role']}'s; a prompt ends with a turn the model answers"
    if not any(m["content"].strip() for m in prompt if m["role"] != "system"):
        return "no message with text besides the system message"
    return None


def as_prompt(prompt: Any) -> Prompt:
    """A valid prompt as the rest of the package holds it: a string, or a list of message dicts (copies, without the
    keys whose value is None: a Parquet or Arrow table gives every message every key of any). Raises ValueError with
    :func:`prompt_fault`'s reason."""
    fault = prompt_fault(prompt)
    if fault is not None:
        raise ValueError(fault)
    if isinstance(prompt, str):
        return prompt
    return [{key: value for key, value in m.items() if value is not None} for m in prompt]


def split_system(prompt: Prompt) -> tuple[Optional[str], list[Message]]:
    """(the prompt's own system message or None, the other messages); a string is one user message."""
    if isinstance(prompt, str):
        return None, [{"role": "user", "content": prompt}]
    if prompt and prompt[0]["role"] == "system":
        return prompt[0]["content"], [dict(m) for m in prompt[1:]]
    return None, [dict(m) for m in prompt]


def messages(prompt: Prompt, system_prompt: Optional[str] = None, system_role: bool = True) -> list[Message]:
    """The chat messages of ``prompt``: its own system message if it has one, else ``system_prompt`` (None: none,
    the template's default applies), then its turns. ``system_role`` False (a template that renders no system
    message): the system text opens the first turn instead, between it and the turn a blank line."""
    own, turns = split_system(prompt)
    system = own if own is not None else system_prompt
    if system is None:
        return turns
    if not system_role:
        return [{**turns[0], "content": f"{system}\n\n{turns[0]['content']}"}, *turns[1:]]
    return [{"role": "system", "content": system}, *turns]


def render(tokenizer, prompt: Prompt, system_prompt: Optional[str] = None, system_role: bool = True) -> str:
    """``prompt`` as the model reads it before its answer: through the chat template with the assistant's header
    (``system_role``: as :func:`messages`), or, for a tokenizer without one, the messages' texts between blank
    lines."""
    chat = messages(prompt, system_prompt, system_role)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in chat)


def prompt_text(prompt: Prompt) -> str:
    """A prompt as one text, for verifiers that read the question and for logs: a string as it is; for messages,
    the last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return users[-1] if users else prompt[-1]["content"]


def prompt_key(prompt: Prompt) -> str:
    """A hashable stand-in that is equal for equal prompts (a string is its own key; messages as JSON)."""
    return prompt if isinstance(prompt, str) else "\x00chat" + json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def system_prompt_layout(tokenizer, system_prompt: Optional[str]) -> tuple[bool, str]:
    """(does the chat template render a system message, the base system prompt the student sees).

    With ``system_prompt`` None the student sees the template's default system message, if it has one
    (SmolLM2's does); it is found by rendering one user turn with and without a system message."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False, system_prompt or ""
    sentinel = "\x00SYSTEM\x00"
    user = {"role": "user", "content": "\x00USER\x00"}
    try:
        with_system = tokenizer.apply_chat_template([{"role": "system", "content": sentinel}, user], tokenize=False)
    except Exception:  # noqa: BLE001 - templates that raise on a system role
        return False, system_prompt or ""
    if sentinel not in with_system:
        return False, system_prompt or ""
    if system_prompt is not None:
        return True, system_prompt
    without = tokenizer.apply_chat_template([user], tokenize=False)
    head, tail = with_system.split(sentinel)
    if without.startswith(head) and without.endswith(tail) and len(without) >= len(head) + len(tail):
        return True, without[len(head) : len(without) - len(tail)]  # the template's default system message
    return True, ""
