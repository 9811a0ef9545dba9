"""Ranking datasets for stage dpo, as LLaMA-Factory reads and encodes them: sharegpt and alpaca with ranking: true
(chosen / rejected columns), tokenized pairs, the prompt shared by both rows, cutoff_len split between the prompt
and the longer response (both responses cut alike), pairs with nothing to predict dropped, stages and datasets
that do not go together refused."""

from __future__ import annotations

import json

import pytest

from tests import test_data
from tests.test_data import E, preview, write_data
from trainer.cli import main
from trainer.data.sft import infer_seqlen

SYS, Q0, A0, Q1 = "Be brief.", "What is two plus two?", "Four.", "And three plus three?"
GOOD, BAD = "Six.", "the quick brown fox"
model_dir, tk = test_data.model_dir, test_data.tk  # (its fixtures: a tokenizer of every template's tokens)
SHAREGPT = {"formatting": "sharegpt", "ranking": True,
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}


def pair_row(**extra):
    return {"conversations": [{"from": "system", "value": SYS}, {"from": "human", "value": Q0},
                              {"from": "gpt", "value": A0}, {"from": "human", "value": Q1}],
            "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD}, **extra}


def test_sharegpt_pair_shares_the_prompt_earlier_answers_included(tmp_path, model_dir, tk, capsys):
    write_data(tmp_path / "data", "prefs", [pair_row()], SHAREGPT)
    chosen, rejected = preview(tmp_path, model_dir, capsys, dataset="prefs", template="empty", stage="dpo")
    e = lambda s: E(tk, s)
    prompt = e(SYS) + e(Q0) + e(A0) + e(Q1)  # (the empty template: each slot's text, tokenized alone)
    assert chosen["input_ids"] == prompt + e(GOOD) and rejected["input_ids"] == prompt + e(BAD)
    assert chosen["labels"] == [-100] * len(prompt) + e(GOOD)
    assert rejected["labels"] == [-100] * len(prompt) + e(BAD)


def test_alpaca_pair(tmp_path, model_dir, tk, capsys):
    rows = [{"instruction": "Add.", "input": "2 and 2", "chosen": "4", "rejected": "5"}]
    write_data(tmp_path / "data", "alp", rows, {"ranking": True, "columns": {
        "prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}})
    chosen, rejected = preview(tmp_path, model_dir, capsys, dataset="alp", template="empty", stage="dpo")
    e = lambda s: E(tk, s)
    assert chosen["input_ids"] == e("Add.\n2 and 2") + e("4") and rejected["input_ids"] == e("Add.\n2 and 2") + e("5")
    assert rejected["labels"] == [-100] * len(e("Add.\n2 and 2")) + e("5")


@pytest.mark.parametrize("cutoff", [6, 9, 14])
def test_cutoff_len_counts_the_longer_response_and_cuts_both_alike(tmp_path, model_dir, tk, capsys, cutoff):
    write_data(tmp_path / "data", "prefs", [pair_row()], SHAREGPT)
    chosen, rejected = preview(tmp_path, model_dir, capsys, dataset="prefs", template="empty", stage="dpo",
                               cutoff_len=cutoff)
    e = lambda s: E(tk, s)
    prompt, good, bad = e(SYS) + e(Q0) + e(A0) + e(Q1), e(GOOD), e(BAD)
    assert len(bad) > len(good)
    s, t = infer_seqlen(len(prompt), len(bad), cutoff)  # (LLaMA-Factory's rule: the longer response's length)
    assert chosen["input_ids"] == prompt[:s] + good[:t] and rejected["input_ids"] == prompt[:s] + bad[:t]
    assert chosen["labels"] == [-100] * s + good[:t]


def test_tokenized_pairs_and_pairs_with_nothing_to_predict_dropped(tmp_path, model_dir, capsys):
    rows = [{"chosen_input_ids": [5, 6, 7, 8], "chosen_labels": [-100, -100, 7, 8], "rejected_input_ids": [5, 6, 9]},
            {"chosen_input_ids": [5, 6], "chosen_labels": [-100, -100], "rejected_input_ids": [5, 6, 9]}]
    write_data(tmp_path / "data", "tok", rows, {"formatting": "tokenized", "ranking": True}, ".jsonl")
    got = preview(tmp_path, model_dir, capsys, dataset="tok", stage="dpo", cutoff_len=3)
    assert [r["input_ids"] for r in got] == [[5, 6, 7], [5, 6, 9]]
    assert got[0]["labels"] == [-100, -100, 7] and got[1]["labels"] == [5, 6, 9]


@pytest.mark.parametrize("stage,entry,words", [
    ("dpo", {"formatting": "sharegpt"}, "is not a ranking dataset"),
    ("sft", SHAREGPT, "is a ranking (preference) dataset: it trains stage dpo, not sft")])
def test_stage_and_dataset_must_agree(tmp_path, model_dir, capsys, stage, entry, words):
    rows = [pair_row()] if entry.get("ranking") else [{"conversations": pair_row()["conversations"][1:3]}]
    write_data(tmp_path / "data", "d", rows, entry)
    conf = tmp_path / "c.yaml"
    conf.write_text(json.dumps({"model_name_or_path": str(model_dir), "dataset_dir": str(tmp_path / "data"),
                                "output_dir": str(tmp_path / "out"), "dataset": "d", "stage": stage,
                                "template": "empty"}))
    assert main([str(conf), "--preview", "1"]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_pair_names_the_file_and_row(tmp_path, model_dir, capsys):
    bad = pair_row(rejected={"from": "human", "value": "x"})
    write_data(tmp_path / "data", "prefs", [pair_row(), bad], SHAREGPT)
    conf = tmp_path / "c.yaml"
    conf.write_text(json.dumps({"model_name_or_path": str(model_dir), "dataset_dir": str(tmp_path / "data"),
                                "output_dir": str(tmp_path / "out"), "dataset": "prefs", "stage": "dpo",
                                "template": "empty"}))
    assert main([str(conf), "--preview", "1"]) == 2
    err = capsys.readouterr().err
    assert "prefs.json: row 2: the rejected response has role 'human' where 'gpt' was expected" in err, err
