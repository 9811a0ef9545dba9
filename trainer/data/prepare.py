"""From the config's datasets to training rows of (input_ids, labels), cached.

- ``formatting: tokenized`` rows give ``input_ids`` and optionally ``labels`` (aligned, -100 masked;
  absent = train on every token), cut at ``cutoff_len``.
- ``alpaca`` / ``sharegpt`` rows become conversations (``convert``); with ``stage: sft`` they are
  rendered by the chat ``template`` and labelled per turn (``sft``); with ``stage: pt`` the first user
  message's text is the document: every document gets the eos token, all are concatenated and cut into
  ``cutoff_len`` blocks (the remainder is dropped), each block starting with bos when the tokenizer adds one.
- ranking datasets (``ranking: true``) are stage dpo's, and stage dpo takes only them: each pair becomes two
  rows, chosen then rejected (``trainer.data.pairs``); a pair either of whose rows has nothing to predict is
  dropped (both rows).

``max_samples`` caps the rows read from each dataset. A bad row stops with one line naming the file and
row, unless ``tiermem_skip_bad_rows`` is set (then it is skipped and counted). Rows left with nothing to
predict are dropped and counted. The result is cached under a key of everything it depends on (the
files with their sizes and mtimes, the tokenizer, template, cutoff_len, stage and options), so a second
run starts at once; ``overwrite_cache`` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainer.data.convert import BadRow, alpaca, columns_of, sharegpt, tags_of
from trainer.data.pairs import (
    alpaca_pair,
    check_tokenized_pair,
    encode_pair,
    response_columns,
    sharegpt_pair,
    trains_something,
)
from trainer.data.registry import DataError, DatasetEntry, read_rows, resolve
from trainer.data.sft import IGNORE, encode_example

CACHE_VERSION = 1


@dataclass
class Rows:
    input_ids: list[list[int]]
    labels: list[list[int] | None]
    dropped: int = 0  # nothing left to predict
    skipped: int = 0  # bad rows skipped (tiermem_skip_bad_rows)
    sources: list[str] = field(default_factory=list)
    from_cache: bool = False
    pairs: bool = False  # preference pairs: rows 2k (chosen) and 2k+1 (rejected) are example k

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def examples(self) -> int:
        """The examples the steps draw from: the rows, or the pairs of a preference dataset."""
        return len(self.input_ids) // 2 if self.pairs else len(self.input_ids)

    def rows_of(self, idx: list[int]) -> list[int]:
        """The row indices of examples ``idx`` (a pair's: chosen, rejected)."""
        return [r for i in idx for r in (2 * i, 2 * i + 1)] if self.pairs else list(idx)

    def subset(self, idx: list[int]) -> Rows:
        """Examples ``idx`` (indices of examples: of pairs for preference data)."""
        rows = self.rows_of(idx)
        return Rows([self.input_ids[i] for i in rows], [self.labels[i] for i in rows], 0, 0, self.sources,
                    pairs=self.pairs)


# -- reading ------------------------------------------------------------------------------------------
def _parsed_rows(entry: DatasetEntry, cfg, out: Rows, parse):
    """``parse(row)`` for each row of ``entry`` up to max_samples; a row it rejects (BadRow) stops the run
    with the file and row named, or is skipped and counted with tiermem_skip_bad_rows."""
    n = 0
    for path in entry.files:
        for i, row in read_rows(path):
            if cfg.max_samples is not None and n >= cfg.max_samples:
                return
            try:
                parsed = parse(row)
            except BadRow as e:
                if not cfg.tiermem_skip_bad_rows:
                    raise DataError(f"{path}: row {i}: {e}") from None
                out.skipped += 1
                continue
            n += 1
            yield parsed


def _tokenized(entry: DatasetEntry, cfg, vocab: int, out: Rows) -> None:
    if entry.ranking:
        check = lambda row: check_tokenized_pair(row, vocab, cfg.cutoff_len)
        for pair in _parsed_rows(entry, cfg, out, check):
            _keep_pair(out, pair)
        return
    for ids, labels in _parsed_rows(entry, cfg, out, lambda row: _check_tokenized(row, vocab)):
        _keep(out, ids[: cfg.cutoff_len], None if labels is None else labels[: cfg.cutoff_len])


def _check_tokenized(row, vocab: int):
    if not isinstance(row, dict) or "input_ids" not in row:
        raise BadRow("expected an object with 'input_ids' (formatting: tokenized)")
    ids = row["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRow("input_ids must be a list of integers")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRow(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
    labels = row.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise BadRow(f"labels must be a list as long as input_ids ({len(ids)})")
        if not all(isinstance(t, int) and (t == IGNORE or 0 <= t < vocab) for t in labels):
            raise BadRow("labels must be token ids or -100")
    return ids, labels


def _keep(out: Rows, ids: list[int], labels: list[int] | None) -> None:
    if len(ids) < 2 or (labels is not None and all(t == IGNORE for t in labels[1:])):
        out.dropped += 1
        return
    out.input_ids.append(ids)
    out.labels.append(labels)


def _keep_pair(out: Rows, pair: tuple) -> None:
    """A pair's two rows (chosen ids, labels, rejected ids, labels), unless either has nothing to predict."""
    if not (trains_something(pair[0], pair[1]) and trains_something(pair[2], pair[3])):
        out.dropped += 1
        return
    out.input_ids += [pair[0], pair[2]]
    out.labels += [pair[1], pair[3]]


def _conversations(entry: DatasetEntry, cfg, out: Rows):
    """The conversations of the good rows of an alpaca/sharegpt entry (of a ranking entry: (conversation, chosen,
    rejected))."""
    cols = columns_of(entry.formatting, entry.columns)
    tags = tags_of(entry.tags)
    if entry.ranking:
        responses = response_columns(entry.columns)
        if entry.formatting == "alpaca":
            return _parsed_rows(entry, cfg, out, lambda row: alpaca_pair(row, cols, responses))
        return _parsed_rows(entry, cfg, out, lambda row: sharegpt_pair(row, cols, tags, responses))
    if entry.formatting == "alpaca":
        return _parsed_rows(entry, cfg, out, lambda row: alpaca(row, cols, prompt_only=cfg.stage == "pt"))
    return _parsed_rows(entry, cfg, out, lambda row: sharegpt(row, cols, tags))


# -- tokenizing (in this process or a pool) ------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(model_dir: str, template: str | None, cutoff: int, train_on_prompt: bool, mask_history: bool):
    from trainer.data.templates import get_template
    from trainer.data.tokenizer import load_tokenizer

    _WORKER.update(tok=load_tokenizer(model_dir), template=get_template(template) if template else None,
                   cutoff=cutoff, train_on_prompt=train_on_prompt, mask_history=mask_history)


def _encode_sft_chunk(items: list[tuple[list[dict], str]]) -> list[tuple[list[int], list[int]]]:
    w = _WORKER
    return [encode_example(w["template"], w["tok"], m, s, w["cutoff"], w["train_on_prompt"], w["mask_history"])
            for m, s in items]


def _encode_pair_chunk(items: list[tuple[list[dict], str, str, str]]) -> list[tuple]:
    w = _WORKER
    return [encode_pair(w["template"], w["tok"], m, s, c, r, w["cutoff"]) for m, s, c, r in items]


def _encode_text_chunk(texts: list[str]) -> list[list[int]]:
    return _WORKER["tok"].encode_batch(texts)


# A tokenizer worker's start: a fresh interpreter importing torch and the tokenizer (4-5 s for 2 workers on
# a 2-core machine, where one process tokenizes ~16k short rows a second: a pool pays off only for much work)
WORKER_START_SECONDS = 5.0
CHUNK = 256  # rows a worker takes at a time


def useful_workers(requested: int, seconds_left: float) -> int:
    """How many processes to tokenize with: at most ``requested`` and the cores this process may use, and
    only as many as make the estimated time (a pool's start plus the work shared out) shorter than one
    process's ``seconds_left``: never slower than 1 worker."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    best, best_s = 1, seconds_left
    for w in range(2, max(1, min(requested, cores)) + 1):
        if WORKER_START_SECONDS + seconds_left / w < best_s:
            best, best_s = w, WORKER_START_SECONDS + seconds_left / w
    return best


def _map(fn, items: list, init_args: tuple, workers: int, progress, status=None) -> list:
    """``fn`` over ``items`` in chunks: the first chunk here (timing it), the rest here or in a pool of
    worker processes when ``workers`` > 1 and a pool would be faster (``useful_workers``); ``status(text)``
    says when a pool starts."""
    chunks = [items[i: i + CHUNK] for i in range(0, len(items), CHUNK)]
    if not chunks:
        return []
    _init_worker(*init_args)
    t0 = time.perf_counter()
    out: list = fn(chunks[0])
    progress(len(chunks[0]))
    left = sum(len(c) for c in chunks[1:]) * (time.perf_counter() - t0) / len(chunks[0])
    n = useful_workers(workers, left) if workers > 1 else 1
    if n <= 1:
        for c in chunks[1:]:
            out += fn(c)
            progress(len(c))
        return out
    if status is not None:
        status(f"starting {n} worker processes")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(n, initializer=_init_worker, initargs=init_args) as pool:
        for i, (c, res) in enumerate(zip(chunks[1:], pool.imap(fn, chunks[1:]))):
            if i == 0 and status is not None:
                status(f"{n} worker processes")
            out += res
            progress(len(c))
    return out


# -- the whole dataset ---------------------------------------------------------------------------------
def build_rows(names: str, cfg, model_cfg, model_dir, progress=None, status=None) -> Rows:
    """Read, convert and tokenize the datasets ``names`` (comma-separated) of ``cfg`` (a TrainConfig);
    ``progress(rows)`` as rows are done, ``status(text)`` when a pool of workers starts."""
    progress = progress or (lambda n: None)
    entries = resolve(names, cfg.dataset_dir)
    check_ranking(entries, cfg.stage)
    out = Rows([], [], sources=[e.name for e in entries], pairs=cfg.stage == "dpo")
    convs, texts = [], []
    for e in entries:
        if e.formatting == "tokenized":
            _tokenized(e, cfg, model_cfg.vocab_size, out)
        else:
            for conv in _conversations(e, cfg, out):
                if e.ranking:
                    conv, chosen, rejected = conv
                    convs.append((conv.messages, conv.system, chosen, rejected))
                elif cfg.stage == "pt":
                    texts.append(conv.messages[0]["content"])
                else:
                    convs.append((conv.messages, conv.system))
    init = (str(model_dir), cfg.template, cfg.cutoff_len, cfg.train_on_prompt, cfg.mask_history)
    workers = cfg.preprocessing_num_workers or 1
    if convs:
        if cfg.template is None:
            raise DataError("stage sft over alpaca/sharegpt data needs a chat template: set template: (one of "
                            "default, empty, alpaca, llama2, llama3, mistral, qwen, gemma)")
        if out.pairs:
            for pair in _map(_encode_pair_chunk, convs, init, workers, progress, status):
                _keep_pair(out, pair)
        else:
            for ids, labels in _map(_encode_sft_chunk, convs, init, workers, progress, status):
                _keep(out, ids, labels)
    if texts:
        _pack(_map(_encode_text_chunk, texts, init, workers, progress, status), cfg, model_dir, out)
    if convs or texts:
        _check_vocab(out, model_cfg.vocab_size, model_dir)
    if not out.input_ids:
        raise DataError(f"dataset {names}: no usable rows ({out.dropped} dropped with nothing to predict, "
                        f"{out.skipped} bad rows skipped)")
    return out


def check_ranking(entries: list[DatasetEntry], stage: str) -> None:
    """Stage dpo takes ranking datasets only, and the other stages none."""
    for e in entries:
        if e.ranking and stage != "dpo":
            raise DataError(f"dataset '{e.name}' is a ranking (preference) dataset: it trains stage dpo, not {stage}")
        if not e.ranking and stage == "dpo":
            raise DataError(f"dataset '{e.name}' is not a ranking dataset: stage dpo trains on pairs (ranking: true "
                            "in dataset_info.json, with chosen and rejected columns)")


def _check_vocab(rows: Rows, vocab: int, model_dir) -> None:
    """Every id the tokenizer and its special tokens gave within the model's embedding (vocab_size): a
    tokenizer of another model, or an eos/bos/pad id past the vocabulary, is refused in one line here (the
    embedding's lookup would fail mid-step)."""
    top = max((max(r) for r in rows.input_ids if r), default=-1)
    low = min((min(r) for r in rows.input_ids if r), default=0)
    if top >= vocab or low < 0:
        bad = top if top >= vocab else low
        raise DataError(f"the tokenizer of {model_dir} gives token id {bad}, outside the model's vocabulary "
                        f"(vocab_size {vocab} in config.json): the tokenizer or a special token's id (eos, bos, pad) "
                        "is not this model's")


def _pack(docs: list[list[int]], cfg, model_dir, out: Rows) -> None:
    from trainer.data.templates import eos_id, get_template
    from trainer.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if cfg.template == "llama3" and tok.backend.token_to_id("<|end_of_text|>") is not None:
        eos = tok.backend.token_to_id("<|end_of_text|>")  # as LLaMA-Factory: documents end with end_of_text
    elif cfg.template is not None:
        eos = eos_id(get_template(cfg.template), tok)
    else:
        eos = tok.eos_id
    stream: list[int] = []
    for ids in docs:
        stream += ids
        stream.append(eos)
    n_blocks = len(stream) // cfg.cutoff_len
    if n_blocks == 0:
        raise DataError(f"stage pt: the texts hold {len(stream)} tokens, fewer than cutoff_len ({cfg.cutoff_len}); "
                        "lower cutoff_len or add text")
    for b in range(n_blocks):
        block = stream[b * cfg.cutoff_len: (b + 1) * cfg.cutoff_len]
        if tok.add_bos and tok.bos_id is not None:
            block[0] = tok.bos_id
        out.input_ids.append(block)
        out.labels.append(None)


# -- the cache -----------------------------------------------------------------------------------------
def cache_dir(cfg) -> Path:
    return Path(cfg.tiermem_cache_dir or os.environ.get("TIERMEM_CACHE") or Path.home() / ".cache" / "tiermem"
                ) / "datasets"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def cache_key(names: str, cfg, model_dir) -> str:
    entries = resolve(names, cfg.dataset_dir)
    files = []
    for e in entries:
        for f in e.files:
            st = f.stat()
            files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    md = Path(model_dir)
    key = {"v": CACHE_VERSION, "entries": [[e.name, e.formatting, e.columns, e.tags, e.ranking] for e in entries],
           "files": files, "tokenizer": [_digest(md / n) for n in ("tokenizer.json", "tokenizer_config.json",
                                                                   "config.json")],
           "stage": cfg.stage, "template": cfg.template, "cutoff_len": cfg.cutoff_len, "max_samples": cfg.max_samples,
           "train_on_prompt": cfg.train_on_prompt, "mask_history": cfg.mask_history,
           "skip_bad_rows": cfg.tiermem_skip_bad_rows}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _save(path: Path, rows: Rows) -> None:
    lens = np.array([len(r) for r in rows.input_ids], dtype=np.int64)
    has = np.array([lab is not None for lab in rows.labels], dtype=bool)
    ids = np.fromiter((t for r in rows.input_ids for t in r), dtype=np.int32, count=int(lens.sum()))
    labels = np.fromiter((t for r, lab in zip(rows.input_ids, rows.labels) for t in (lab if lab is not None else r)),
                         dtype=np.int32, count=int(lens.sum()))
    meta = json.dumps({"dropped": rows.dropped, "skipped": rows.skipped, "sources": rows.sources,
                       "pairs": rows.pairs})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    try:
        with open(tmp, "wb") as f:  # (written whole and on the disk before it takes the cache's name)
            np.savez(f, ids=ids, labels=labels, lens=lens, has=has, meta=np.array(meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Damaged(Exception):
    """A cache file that is there but cannot be what _save wrote (cut short, overwritten): rebuilt."""


def _load(path: Path, vocab: int) -> Rows | None:
    """The cached rows (None when there are none); a file that is not whole or not consistent is _Damaged."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _Damaged("not a regular file")
    try:
        with np.load(path, allow_pickle=False) as z:
            ids, labels, lens, has = z["ids"], z["labels"], z["lens"], z["has"]
            meta = json.loads(str(z["meta"]))
        total = int(lens.sum()) if lens.size else 0
        ok = (ids.ndim == labels.ndim == lens.ndim == has.ndim == 1 and len(has) == len(lens)
              and (lens.size == 0 or int(lens.min()) >= 0) and len(ids) == len(labels) == total
              and (total == 0 or (0 <= int(ids.min()) and int(ids.max()) < vocab
                                  and bool(np.all((labels == -100) | ((labels >= 0) & (labels < vocab))))))
              and isinstance(meta, dict) and isinstance(meta.get("dropped"), int)
              and isinstance(meta.get("skipped"), int) and isinstance(meta.get("sources"), list))
    except Exception as e:  # noqa: BLE001 - whatever a damaged file makes numpy, zipfile or json raise
        raise _Damaged(f"{type(e).__name__}: {str(e)[:80]}") from None
    if not ok:
        raise _Damaged("its arrays do not agree with each other or with the model's vocabulary")
    bounds = np.concatenate([[0], np.cumsum(lens)])
    rows = Rows([], [], meta["dropped"], meta["skipped"], meta["sources"], from_cache=True,
                pairs=bool(meta.get("pairs")))
    for n in range(len(lens)):
        a, b = bounds[n], bounds[n + 1]
        rows.input_ids.append(ids[a:b].tolist())
        rows.labels.append(labels[a:b].tolist() if has[n] else None)
    return rows


def load_rows(names: str, cfg, model_cfg, model_dir, progress=None, status=None, note=None) -> Rows:
    """``build_rows`` through the cache; a damaged cache file is rebuilt, and ``note(line)`` says so."""
    path = cache_dir(cfg) / f"{cache_key(names, cfg, model_dir)}.npz"
    if not cfg.overwrite_cache:
        try:
            rows = _load(path, model_cfg.vocab_size)
        except _Damaged as e:
            (note or print)(f"note: the tokenized-data cache {path} is damaged ({e}); rebuilding it")
            rows = None
        if rows is not None:
            return rows
    rows = build_rows(names, cfg, model_cfg, model_dir, progress, status)
    try:
        _save(path, rows)
    except OSError:
        pass  # an unwritable cache only costs the next run its head start
    return rows


def split_eval(rows: Rows, val_size: float, seed: int) -> tuple[Rows, Rows]:
    """Hold out ``val_size`` of the rows (a fraction below 1, or a count) for evaluation, by a seeded draw."""
    n = rows.examples
    n_eval = math.ceil(val_size * n) if val_size < 1 else int(val_size)
    if not 0 < n_eval < n:
        raise DataError(f"val_size {val_size} leaves {n - n_eval} of {n} rows for training; lower it")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return rows.subset(sorted(perm[n_eval:])), rows.subset(sorted(perm[:n_eval]))
