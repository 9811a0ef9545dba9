"""Errors that reach the user.

A ``UserError`` is a mistake the user can fix (bad config, missing path, budget too small, disk full).
The command-line entry points print its one-line message and exit with code 2, without a traceback.
Anything else is an internal error and keeps its traceback.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """A user-fixable problem; its message is one line that says what is wrong and how to fix it."""

    exit_code = 2
    quiet = False  # another process of the run says it (several ranks): this one exits without a word
    rank_prefix = ""  # "rank N: " before each line, where the run has several ranks

    def lines(self) -> list[str]:
        """The lines an entry point prints, one problem each."""
        return [str(self)]


class ConfigError(UserError):
    """The configuration is malformed or inconsistent."""


class ConfigProblems(ConfigError):
    """Several problems of one config, found in one pass: each is one line (the message joins them)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = list(problems)

    def lines(self) -> list[str]:
        return list(self.problems)


class BudgetError(UserError):
    """A placement does not fit under the tier budgets."""


class StorageError(UserError):
    """A tier's backing storage cannot be used (missing path, no space, I/O failure)."""


def nearest(name: str, valid: list[str] | tuple[str, ...] | set[str]) -> str:
    """A ' (did you mean X?)' hint for an unknown name, or '' when nothing is close."""
    match = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


# the bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069): they reorder what is read
_BIDI = {*range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def _escaped(c: str, keep: str) -> str:
    n = ord(c)
    if c in keep or not (n < 0x20 or 0x7F <= n <= 0x9F or n in _BIDI):
        return c
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (f"\\x{n:02x}" if n <= 0xFF else f"\\u{n:04x}")


def printable(text: str, keep: str = "") -> str:
    """``text`` as a terminal may show it: its control characters (C0, DEL, C1, the bidirectional controls) but
    those in ``keep`` written as escapes (``\\x1b``, ``\\r``, ``\\u202e``), so that text from a dataset, a path or
    a peer cannot drive the terminal (ESC sequences, a carriage return over the line, BEL) nor break a one-line
    message (a newline)."""
    return "".join(_escaped(c, keep) for c in text)


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` for a one-line message, cut to about ``limit`` characters (a config value may be large)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
