"""Rows of an alpaca or sharegpt dataset into conversations, as LLaMA-Factory reads them.

alpaca: ``prompt`` (+ "\\n" + ``query`` when present) is the user turn, ``response`` the assistant turn;
``history`` ([[user, assistant], ...]) comes before; ``system`` optional. sharegpt: ``messages`` is a list
of {role_tag: ..., content_tag: ...}; a first message with the system tag is the system prompt; then
user (or observation) and assistant turns must alternate and end with the assistant.

A row that does not fit raises ``BadRow`` with what was expected; the caller names the file and row.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPACA_DEFAULTS = {"prompt": "instruction", "query": "input", "response": "output", "history": None,
                   "system": None, "tools": None}
SHAREGPT_DEFAULTS = {"messages": "conversations", "system": None, "tools": None}
TAG_DEFAULTS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}


class BadRow(ValueError):
    """A row that does not have the shape its dataset's formatting needs."""


@dataclass
class Conversation:
    messages: list[dict]  # {"role": "user" | "assistant" | "observation", "content": str}, alternating
    system: str


def columns_of(formatting: str, columns: dict | None) -> dict:
    """Column names as LLaMA-Factory resolves them: the defaults when ``columns`` is absent, else exactly
    the columns given (an unnamed column is absent)."""
    defaults = ALPACA_DEFAULTS if formatting == "alpaca" else SHAREGPT_DEFAULTS
    if columns is None:
        return dict(defaults)
    return {k: columns.get(k) for k in defaults}


def tags_of(tags: dict | None) -> dict:
    return dict(TAG_DEFAULTS) if tags is None else {k: tags.get(k) for k in TAG_DEFAULTS}


def _text(row: dict, col: str | None, what: str, required: bool) -> str:
    if col is None:
        return ""
    if col not in row or row[col] is None:
        if required:
            raise BadRow(f"missing column '{col}' ({what})")
        return ""
    if not isinstance(row[col], str):
        raise BadRow(f"column '{col}' ({what}) must be a string")
    return row[col]


def _no_tools(row: dict, cols: dict) -> None:
    if cols.get("tools") and row.get(cols["tools"]):
        raise BadRow(f"column '{cols['tools']}' holds tools; tool use is not supported yet")


def alpaca(row: dict, cols: dict, prompt_only: bool = False) -> Conversation:
    if not isinstance(row, dict):
        raise BadRow("expected a JSON object")
    _no_tools(row, cols)
    messages = []
    if cols.get("history") and row.get(cols["history"]) is not None:
        hist = row[cols["history"]]
        if not isinstance(hist, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str)
                                                                                       for x in p) for p in hist):
            raise BadRow(f"column '{cols['history']}' must be a list of [user, assistant] string pairs")
        for q, a in hist:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    parts = [t for t in (_text(row, cols.get("prompt"), "the instruction", True),
                         _text(row, cols.get("query"), "the input", False)) if t]
    messages.append({"role": "user", "content": "\n".join(parts)})
    if not prompt_only:
        messages.append({"role": "assistant", "content": _text(row, cols.get("response"), "the response", True)})
    return Conversation(messages, _text(row, cols.get("system"), "the system prompt", False))


def sharegpt(row: dict, cols: dict, tags: dict) -> Conversation:
    if not isinstance(row, dict):
        raise BadRow("expected a JSON object")
    _no_tools(row, cols)
    key = cols.get("messages")
    msgs = row.get(key) if key else None
    if not isinstance(msgs, list):
        raise BadRow(f"missing column '{key}' (a list of messages)")
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get(role_tag), str) or not isinstance(m.get(content_tag), str):
            raise BadRow(f"each message needs string '{role_tag}' and '{content_tag}'")
    system = _text(row, cols.get("system"), "the system prompt", False)
    if tags["system_tag"] and msgs and msgs[0][role_tag] == tags["system_tag"]:
        system, msgs = msgs[0][content_tag], msgs[1:]
    odd = {tags["user_tag"]: "user", tags["observation_tag"]: "observation"}
    even = {tags["assistant_tag"]: "assistant"}
    out = []
    for i, m in enumerate(msgs):
        role = m[role_tag]
        if i % 2 == 1 and role == tags["function_tag"]:
            raise BadRow("function calls are not supported yet")
        allowed = odd if i % 2 == 0 else even
        if role not in allowed:
            want = " or ".join(repr(t) for t in allowed if t)
            raise BadRow(f"message {i + 1} has role '{role}' where {want} was expected (roles must alternate "
                         f"user, assistant, ...)")
        out.append({"role": allowed[role], "content": m[content_tag]})
    if not out or len(out) % 2:
        raise BadRow(f"a conversation must end with an assistant message ({len(out)} messages after the system one)")
    return Conversation(out, system)
