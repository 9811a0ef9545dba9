"""The model's tokenizer, read from ``tokenizer.json`` with the ``tokenizers`` library, and its special
tokens (eos, bos, pad) from tokenizer_config.json / config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiermem.errors import ConfigError
from tiermem.files import is_regular, read_json


@dataclass
class Tokenizer:
    backend: object
    eos_id: int
    bos_id: int | None
    pad_id: int
    add_bos: bool

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)


def _token(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _settings(path: Path) -> dict:
    """A JSON object of settings (tokenizer_config.json, config.json), {} when the file is absent."""
    if not is_regular(path, path.name):
        return {}
    data = read_json(path, path.name)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of settings")
    return data


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not is_regular(path, "tokenizer.json"):
        raise ConfigError(f"model_name_or_path: {d} has no tokenizer.json (needed to tokenize text)")
    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
        raise ConfigError(f"{path}: not a tokenizer the tokenizers library can read ({str(e)[:120]})") from None
    tcfg, mcfg = _settings(d / "tokenizer_config.json"), _settings(d / "config.json")

    def tid(key: str) -> int | None:
        tok = _token(tcfg.get(key))
        if isinstance(tok, str) and backend.token_to_id(tok) is not None:
            return backend.token_to_id(tok)
        val = mcfg.get(f"{key}_id")
        first = val[0] if isinstance(val, list) and val else None if isinstance(val, list) else val
        if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
            raise ConfigError(f"{d / 'config.json'}: {key}_id must be a token id or a list of them, got {val!r}"[:300])
        return first

    eos = tid("eos_token")
    if eos is None:
        raise ConfigError(f"{d}: no eos token in tokenizer_config.json or config.json")
    bos = tid("bos_token")
    pad = tid("pad_token")
    return Tokenizer(backend, eos, bos, eos if pad is None else pad, bool(tcfg.get("add_bos_token", False)))
