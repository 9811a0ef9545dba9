"""Checking what a peer sends: each field a request reads is taken through these, so a malformed one is
refused with an error naming it (``RequestError``: the message goes back to the client), never an
internal error."""

from __future__ import annotations

import math


class RequestError(Exception):
    """A request the service refuses; the message goes back to the client."""


def field_of(msg: dict, key: str, types):
    """``msg[key]``, of one of ``types`` (never a bool), or a RequestError naming the field."""
    value = msg.get(key)
    if not isinstance(value, types) or isinstance(value, bool):
        raise RequestError(f"'{key}' is missing or of the wrong type")
    return value


def is_key(value) -> bool:
    """Whether ``value`` may name a group or a request: a number or a short string."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and len(value) <= 64)


def finite_of(msg: dict, key: str) -> float:
    value = field_of(msg, key, (int, float))
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise RequestError(f"'{key}' must be a finite number")
    return value


def object_of(msg: dict, key: str, inner: dict) -> dict:
    """``msg[key]``, an object ({} when absent) whose keys named in ``inner`` are objects too (or absent), as
    deep as ``inner`` says: what the service reads of a trainer's figures."""
    def check(value, where: str, shape: dict) -> None:
        if not isinstance(value, dict):
            raise RequestError(f"'{where}' must be an object")
        for k, sub in shape.items():
            if value.get(k) is not None:
                check(value[k], f"{where}.{k}", sub)

    value = {} if msg.get(key) is None else msg[key]
    check(value, key, inner)
    return dict(value)
