"""Ranking (preference) datasets as LLaMA-Factory reads them, for ``stage: dpo``: each row is a prompt and two
responses, ``chosen`` and ``rejected`` (its ``dpo_en_demo``).

- alpaca with ``ranking: true``: the prompt as for SFT (``prompt`` + "\\n" + ``query``, ``history`` before it,
  ``system``), the responses in the ``chosen`` and ``rejected`` columns (strings);
- sharegpt with ``ranking: true``: ``messages`` end with a user turn (an odd number of them after the system
  one), ``chosen`` and ``rejected`` are messages of the assistant's role (``{"from": "gpt", "value": ...}``);
- ``formatting: tokenized`` with ``ranking: true`` (ours): ``chosen_input_ids``, ``rejected_input_ids`` and
  optionally ``chosen_labels``, ``rejected_labels`` (-100 masked; absent: every token trained), cut at
  ``cutoff_len`` each.

A pair is encoded as LLaMA-Factory's pairwise processor does: the conversation up to the response is the prompt
(rendered by the chat template, earlier turns' answers included), each response its own ids; ``cutoff_len`` is
shared between the prompt and the longer response by ``infer_seqlen`` (the response counted first), and both
responses are cut to the same length. The chosen row is ``prompt + chosen`` (the prompt's labels -100), the
rejected row ``prompt + rejected``: a pair is two rows sharing the prompt, kept next to each other (row 2k chosen,
2k+1 rejected).
"""

from __future__ import annotations

from trainer.data.convert import BadRow, Conversation, alpaca, sharegpt
from trainer.data.sft import IGNORE, infer_seqlen
from trainer.data.templates import Template, encode_turns

RESPONSES = ("chosen", "rejected")


def response_columns(columns: dict | None) -> dict:
    """The columns of the two responses: as named under ``columns``, else ``chosen`` and ``rejected``."""
    columns = columns or {}
    return {k: columns.get(k, k) for k in RESPONSES}


def alpaca_pair(row: dict, cols: dict, responses: dict) -> tuple[Conversation, str, str]:
    """(the prompt's conversation, the chosen text, the rejected text) of an alpaca ranking row."""
    conv = alpaca(row, cols, prompt_only=True)
    texts = []
    for which in RESPONSES:
        col = responses[which]
        if not isinstance(row.get(col), str):
            raise BadRow(f"column '{col}' (the {which} response) must be a string")
        texts.append(row[col])
    return conv, texts[0], texts[1]


def sharegpt_pair(row: dict, cols: dict, tags: dict, responses: dict) -> tuple[Conversation, str, str]:
    """(the prompt's conversation, the chosen text, the rejected text) of a sharegpt ranking row: its messages
    end with the user's turn, and both responses are messages of the assistant's role."""
    if not isinstance(row, dict):
        raise BadRow("expected a JSON object")
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    texts = []
    for which in RESPONSES:
        m = row.get(responses[which])
        if not isinstance(m, dict) or not isinstance(m.get(content_tag), str):
            raise BadRow(f"column '{responses[which]}' (the {which} response) must be a message with a string "
                         f"'{content_tag}'")
        if m.get(role_tag) != tags["assistant_tag"]:
            raise BadRow(f"the {which} response has role {m.get(role_tag)!r} where '{tags['assistant_tag']}' was "
                         "expected")
        texts.append(m[content_tag])
    key = cols.get("messages")
    if not key or not isinstance(row.get(key), list):
        raise BadRow(f"missing column '{key}' (a list of messages)")
    whole = sharegpt({**row, key: [*row[key], row[responses["chosen"]]]}, cols, tags)  # (checks the turns)
    return Conversation(whole.messages[:-1], whole.system), texts[0], texts[1]


def encode_pair(template: Template, tok, messages: list[dict], system: str, chosen: str, rejected: str,
                cutoff_len: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen ids, chosen labels, rejected ids, rejected labels) of a prompt (``messages``, ending with the
    user's turn) and its two responses, cut to ``cutoff_len`` as LLaMA-Factory's pairwise processor cuts them."""
    ids = []
    for text in (chosen, rejected):
        turns = encode_turns(template, tok, [*messages, {"role": "assistant", "content": text}], system)
        prompt = [t for source, target in turns[:-1] for t in source + target] + turns[-1][0]
        ids.append((prompt, turns[-1][1]))
    prompt, chosen_ids, rejected_ids = ids[0][0], ids[0][1], ids[1][1]
    source_len, target_len = infer_seqlen(len(prompt), max(len(chosen_ids), len(rejected_ids)), cutoff_len)
    prompt = prompt[:source_len]
    chosen_ids, rejected_ids = chosen_ids[:target_len], rejected_ids[:target_len]
    masked = [IGNORE] * source_len
    return prompt + chosen_ids, masked + chosen_ids, prompt + rejected_ids, masked + rejected_ids


def check_tokenized_pair(row, vocab: int, cutoff_len: int):
    """(chosen ids, chosen labels, rejected ids, rejected labels) of a tokenized ranking row, each cut at
    ``cutoff_len`` (labels None: every token trained); a row that does not fit raises BadRow."""
    if not isinstance(row, dict):
        raise BadRow("expected an object with 'chosen_input_ids' and 'rejected_input_ids' (formatting: tokenized, "
                     "ranking: true)")
    out = []
    for which in RESPONSES:
        ids, labels = row.get(f"{which}_input_ids"), row.get(f"{which}_labels")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRow(f"{which}_input_ids must be a list of integers")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRow(f"token id {bad[0]} in {which}_input_ids is outside the model's vocabulary (0..{vocab - 1})")
        if labels is not None:
            if not isinstance(labels, list) or len(labels) != len(ids):
                raise BadRow(f"{which}_labels must be a list as long as {which}_input_ids ({len(ids)})")
            if not all(isinstance(t, int) and (t == IGNORE or 0 <= t < vocab) for t in labels):
                raise BadRow(f"{which}_labels must be token ids or -100")
            labels = labels[:cutoff_len]
        out += [ids[:cutoff_len], labels]
    return tuple(out)


def trains_something(ids: list[int], labels: list[int] | None) -> bool:
    """Whether a row has a token to predict (a label after its first position)."""
    return len(ids) >= 2 and (labels is None or any(t != IGNORE for t in labels[1:]))
