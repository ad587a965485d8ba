"""Chat prompts for ``concept chat`` and ``concept serve``'s ``/v1/chat/completions``.

A conversation is a list of ``{"role": "system" | "user" | "assistant", "content": str}`` messages.
It becomes a prompt through the backbone's own chat template (``tokenizer.apply_chat_template`` with
the generation prompt: SmolLM2-Instruct's ``<|im_start|>role ... <|im_end|>`` turns), and the reply
ends at the tokenizer's end-of-sequence token (``<|im_end|>`` there). A backbone without a template
(the tiny byte-level test backbones) gets plain turns instead, ``System: ...`` / ``User: ...`` /
``Assistant:`` one per line, and the reply stops before a new ``\\nUser:`` line.

:func:`fit` drops the oldest turns (never the system message or the last user turn) until the prompt
and the reply fit the backbone's context.
"""
from __future__ import annotations

from .errors import ConceptError

ROLES = ("system", "user", "assistant")
PLAIN_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOP = "\nUser:"


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and callable(getattr(tokenizer, "apply_chat_template", None))


def check(messages) -> list[str]:
    """Problems with a conversation (empty list: fine)."""
    if not isinstance(messages, list) or not messages:
        return ["messages: expected a non-empty list of {role, content} objects"]
    problems = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            problems.append(f"messages[{i}]: expected {{'role': one of {', '.join(ROLES)}, 'content': a string}}")
    if not problems and messages[-1]["role"] != "user":
        problems.append("messages: the last message must be the user's (the reply is the assistant's next turn)")
    return problems


def prompt(tokenizer, messages: list[dict]) -> str:
    """The conversation as the prompt text of the assistant's next turn."""
    problems = check(messages)
    if problems:
        raise ConceptError("; ".join(problems))
    if has_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{PLAIN_NAMES[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


def stop_strings(tokenizer) -> tuple[str, ...]:
    """Where a reply ends besides the end-of-sequence token: nothing more with a chat template."""
    return () if has_template(tokenizer) else (PLAIN_STOP,)


def encode(tokenizer, text: str) -> list[int]:
    """The prompt's ids (a template writes its own special tokens: none are added)."""
    if has_template(tokenizer):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer.encode(text))


def fit(tokenizer, messages: list[dict], limit: int | None, reserve: int) -> tuple[list[dict], list[int]]:
    """The newest turns whose prompt leaves ``reserve`` positions for the reply within ``limit`` (the
    context), and its ids; the system message and the last user message are always kept."""
    kept = list(messages)
    while True:
        ids = encode(tokenizer, prompt(tokenizer, kept))
        if limit is None or len(ids) + reserve <= limit:
            return kept, ids
        first = next((i for i, m in enumerate(kept[:-1]) if m["role"] != "system"), None)
        if first is None:
            raise ConceptError(f"the conversation's last message alone takes {len(ids)} tokens, and the reply "
                               f"{reserve} more, past the backbone's context of {limit}; shorten it (or the system "
                               f"message), or ask for fewer new tokens")
        del kept[first]
