"""From the config's datasets to training rows of (input_ids, labels).

- ``formatting: tokenized``: each row gives ``input_ids`` (a list of token ids) and optionally
  ``labels`` (aligned with input_ids, -100 masked; absent = train on every token); rows are cut at
  ``cutoff_len``.
- ``stage: pt`` over text: every text gets the eos token appended, all are concatenated and cut into
  blocks of ``cutoff_len`` tokens (the remainder is dropped); with a tokenizer that adds bos, each block
  starts with it. Labels are the input ids.

``max_samples`` caps the rows read from each dataset. Rows with nothing left to predict (fewer than two
tokens, or every label after the first masked) are dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.data.registry import DataError, DatasetEntry, read_rows, resolve


@dataclass
class Rows:
    input_ids: list[list[int]]
    labels: list[list[int] | None]
    dropped: int = 0
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def _tokenized(entry: DatasetEntry, cutoff: int, max_samples: int | None, out: Rows, vocab: int) -> None:
    n = 0
    for path in entry.files:
        for i, row in read_rows(path):
            if max_samples is not None and n >= max_samples:
                return
            where = f"{path}: row {i}"
            if not isinstance(row, dict) or "input_ids" not in row:
                raise DataError(f"{where}: expected an object with 'input_ids' (formatting: tokenized)")
            ids = row["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise DataError(f"{where}: input_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise DataError(f"{where}: token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
            labels = row.get("labels")
            if labels is not None:
                if not isinstance(labels, list) or len(labels) != len(ids):
                    raise DataError(f"{where}: labels must be a list as long as input_ids ({len(ids)})")
                if not all(isinstance(t, int) and (t == -100 or 0 <= t < vocab) for t in labels):
                    raise DataError(f"{where}: labels must be token ids or -100")
                labels = labels[:cutoff]
            ids = ids[:cutoff]
            n += 1
            if len(ids) < 2 or (labels is not None and all(t == -100 for t in labels[1:])):
                out.dropped += 1
                continue
            out.input_ids.append(ids)
            out.labels.append(labels)


def _texts(entry: DatasetEntry, max_samples: int | None) -> list[str]:
    column = entry.columns.get("prompt", "text")
    texts = []
    for path in entry.files:
        for i, row in read_rows(path):
            if max_samples is not None and len(texts) >= max_samples:
                return texts
            if not isinstance(row, dict) or not isinstance(row.get(column), str):
                raise DataError(f"{path}: row {i}: expected a string in column '{column}'")
            texts.append(row[column])
    return texts


def prepare_rows(cfg, model_cfg, model_dir) -> Rows:
    """The training rows for ``cfg`` (a TrainConfig)."""
    entries = resolve(cfg.dataset, cfg.dataset_dir)
    out = Rows([], [], sources=[e.name for e in entries])
    texts: list[str] = []
    for e in entries:
        if e.formatting == "tokenized":
            _tokenized(e, cfg.cutoff_len, cfg.max_samples, out, model_cfg.vocab_size)
        elif cfg.stage == "pt" and e.formatting == "alpaca":
            texts += _texts(e, cfg.max_samples)
        else:
            raise DataError(f"dataset '{e.name}' (formatting: {e.formatting}) needs the chat-template data system, "
                            "which is not supported yet (issue 4); use stage: pt over text or a tokenized dataset")
    if texts:
        _pack(texts, cfg.cutoff_len, model_dir, out)
    if not out.input_ids:
        raise DataError(f"dataset {cfg.dataset}: no usable rows ({out.dropped} dropped: fewer than two tokens "
                        "or no trained label)")
    return out


def _pack(texts: list[str], cutoff: int, model_dir, out: Rows) -> None:
    from trainer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    stream: list[int] = []
    for ids in tok.encode_batch(texts):
        stream += ids
        stream.append(tok.eos_id)
    n_blocks = len(stream) // cutoff
    if n_blocks == 0:
        raise DataError(f"stage pt: the texts hold {len(stream)} tokens, fewer than cutoff_len ({cutoff}); "
                        "lower cutoff_len or add text")
    for b in range(n_blocks):
        block = stream[b * cutoff: (b + 1) * cutoff]
        if tok.add_bos and tok.bos_id is not None:
            block[0] = tok.bos_id
        out.input_ids.append(block)
        out.labels.append(None)
