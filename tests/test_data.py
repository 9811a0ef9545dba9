"""LLaMA-Factory's data system: templates (golden token ids built here by hand from each template's
definition), alpaca and sharegpt reading, label masking, cutoff_len truncation, mask_history,
train_on_prompt, the cache, evaluation data, and bad input."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from trainer.cli import main
from trainer.data.sft import infer_seqlen

SPECIAL = ["<unk>", "<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
           "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"]
TEXT = ("Be brief. What is two plus two? Four. And three plus three? Six. Human System Assistant INST SYS "
        "user model assistant system the quick brown fox jumps over the lazy dog")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory whose tokenizer knows every template's special tokens (bos <s>, eos </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                             show_progress=False))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": tok.get_vocab_size(), "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512}))
    return d


@pytest.fixture(scope="module")
def tk(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok


def E(tk, text: str) -> list[int]:
    return tk.encode(text, add_special_tokens=False).ids


def write_data(d: Path, name: str, rows, entry: dict, suffix: str = ".json") -> None:
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{name}{suffix}"
    if suffix == ".jsonl":
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        f.write_text(json.dumps(rows))
    info = d / "dataset_info.json"
    entries = json.loads(info.read_text()) if info.is_file() else {}
    entries[name] = {"file_name": f.name, **entry}
    info.write_text(json.dumps(entries))


def preview(tmp_path, model_dir, capsys, n=10, **cfg) -> list[dict]:
    conf = {"model_name_or_path": str(model_dir), "dataset_dir": str(tmp_path / "data"),
            "output_dir": str(tmp_path / "out"), "cutoff_len": 1024, **cfg}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(conf))
    capsys.readouterr()
    assert main([str(path), "--preview", str(n), "--ids"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


CHAT = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is two plus two?"},
        {"from": "gpt", "value": "Four."}, {"from": "human", "value": "And three plus three?"},
        {"from": "gpt", "value": "Six."}]
Q1, A1, Q2, A2, SYS = "What is two plus two?", "Four.", "And three plus three?", "Six.", "Be brief."


def golden(template: str, tk) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per turn, written out from each template's definition."""
    e = lambda s: E(tk, s)
    bos, eos = [tk.token_to_id("<s>")], [tk.token_to_id("</s>")]
    if template == "default":
        return [(e(f"System: {SYS}") + eos + e("\n") + e(f"Human: {Q1}") + eos + e("\nAssistant:"),
                 e(A1) + eos + e("\n")),
                (e(f"Human: {Q2}") + eos + e("\nAssistant:"), e(A2) + eos + e("\n"))]
    if template == "empty":
        return [(e(SYS) + e(Q1), e(A1)), (e(Q2), e(A2))]
    if template == "llama2":
        return [(bos + e(f"[INST] <<SYS>>\n{SYS}\n<</SYS>>\n\n{Q1} [/INST]"), e(A1) + eos),
                (bos + e(f"[INST] {Q2} [/INST]"), e(A2) + eos)]
    if template == "llama3":
        head = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"
        return [(bos + e(head("system") + SYS + "<|eot_id|>") + e(head("user") + Q1 + "<|eot_id|>" + head("assistant")),
                 e(A1 + "<|eot_id|>")),
                (e(head("user") + Q2 + "<|eot_id|>" + head("assistant")), e(A2 + "<|eot_id|>"))]
    if template == "mistral":
        return [(bos + e(f"[INST] {SYS}\n\n{Q1}[/INST]"), e(f" {A1}") + eos),
                (e(f"[INST] {Q2}[/INST]"), e(f" {A2}") + eos)]
    if template == "qwen":
        user = lambda q: f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        return [(e(f"<|im_start|>system\n{SYS}<|im_end|>\n") + e(user(Q1)), e(f"{A1}<|im_end|>\n")),
                (e(user(Q2)), e(f"{A2}<|im_end|>\n"))]
    if template == "gemma":
        user = lambda q: f"<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n"
        return [(bos + e(user(f"{SYS}\n\n{Q1}")), e(f"{A1}<end_of_turn>\n")),
                (e(user(Q2)), e(f"{A2}<end_of_turn>\n"))]
    raise ValueError(template)


@pytest.mark.parametrize("template", ["default", "empty", "llama2", "llama3", "mistral", "qwen", "gemma"])
def test_template_golden_ids_and_labels(tmp_path, model_dir, tk, capsys, template):
    write_data(tmp_path / "data", "chat", [{"conversations": CHAT}], {"formatting": "sharegpt"})
    (row,) = preview(tmp_path, model_dir, capsys, dataset="chat", template=template)
    turns = golden(template, tk)
    assert row["input_ids"] == [t for p, r in turns for t in p + r]
    assert row["labels"] == [t for p, r in turns for t in [-100] * len(p) + r]


def test_alpaca_with_and_without_input_history_and_system(tmp_path, model_dir, tk, capsys):
    rows = [{"instruction": "Add.", "input": "2 and 2", "output": "4"},
            {"instruction": "Say hi.", "output": "hi"},
            {"instruction": "Again?", "input": "", "output": "yes", "history": [["Q0", "A0"]], "sys": "S"}]
    write_data(tmp_path / "data", "alp", rows, {"columns": {"prompt": "instruction", "query": "input",
                                                             "response": "output", "history": "history",
                                                             "system": "sys"}})
    got = preview(tmp_path, model_dir, capsys, dataset="alp", template="empty")
    e = lambda s: E(tk, s)
    assert got[0]["input_ids"] == e("Add.\n2 and 2") + e("4")
    assert got[0]["labels"] == [-100] * len(e("Add.\n2 and 2")) + e("4")
    assert got[1]["input_ids"] == e("Say hi.") + e("hi")
    assert got[2]["input_ids"] == e("S") + e("Q0") + e("A0") + e("Again?") + e("yes")
    assert got[2]["labels"] == [-100] * len(e("S") + e("Q0")) + e("A0") + [-100] * len(e("Again?")) + e("yes")


def test_infer_seqlen_cases():
    assert infer_seqlen(10, 5, 100) == (10, 5)  # both fit
    assert infer_seqlen(40, 6, 20) == (14, 6)  # short response: the prompt is cut
    assert infer_seqlen(6, 40, 20) == (6, 14)  # short prompt: the response is cut
    assert infer_seqlen(10, 30, 20) == (5, 15)  # both long: in proportion, int(20 * 30 / 40) = 15


def test_cutoff_len_truncates_turns_in_proportion(tmp_path, model_dir, tk, capsys):
    write_data(tmp_path / "data", "chat", [{"conversations": CHAT}], {"formatting": "sharegpt"})
    (p1, r1), (p2, r2) = golden("empty", tk)
    cutoff = len(p1) + len(r1) + 2  # the second turn gets 2 tokens: split by infer_seqlen
    (row,) = preview(tmp_path, model_dir, capsys, dataset="chat", template="empty", cutoff_len=cutoff)
    s, t = infer_seqlen(len(p2), len(r2), 2)
    assert row["input_ids"] == p1 + r1 + p2[:s] + r2[:t]
    assert row["labels"] == [-100] * len(p1) + r1 + [-100] * s + r2[:t]


def test_mask_history_trains_the_last_turn_and_keeps_it_when_cutting(tmp_path, model_dir, tk, capsys):
    write_data(tmp_path / "data", "chat", [{"conversations": CHAT}], {"formatting": "sharegpt"})
    (p1, r1), (p2, r2) = golden("empty", tk)
    (row,) = preview(tmp_path, model_dir, capsys, dataset="chat", template="empty", mask_history=True)
    assert row["input_ids"] == p1 + r1 + p2 + r2
    assert row["labels"] == [-100] * (len(p1) + len(r1) + len(p2)) + r2
    (row,) = preview(tmp_path, model_dir, capsys, dataset="chat", template="empty", mask_history=True,
                     cutoff_len=len(p2) + len(r2), overwrite_cache=True)
    assert row["input_ids"] == p2 + r2  # the last turn first; nothing left for the first


def test_train_on_prompt(tmp_path, model_dir, tk, capsys):
    write_data(tmp_path / "data", "chat", [{"conversations": CHAT}], {"formatting": "sharegpt"})
    (row,) = preview(tmp_path, model_dir, capsys, dataset="chat", template="qwen", train_on_prompt=True)
    assert row["labels"] == row["input_ids"]


def test_sharegpt_custom_tags_and_observation(tmp_path, model_dir, tk, capsys):
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "A2"}]
    write_data(tmp_path / "data", "oa", [{"messages": msgs}],
               {"formatting": "sharegpt", "columns": {"messages": "messages"},
                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                         "assistant_tag": "assistant", "observation_tag": "tool"}})
    (row,) = preview(tmp_path, model_dir, capsys, dataset="oa", template="qwen")
    e = lambda s: E(tk, s)
    sys_ = e("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    obs = e("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    want = sys_ + e("<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n") + e("A1<|im_end|>\n") + obs \
        + e("A2<|im_end|>\n")
    assert row["input_ids"] == want


def test_pt_stage_over_alpaca_text_uses_the_template_eos(tmp_path, model_dir, tk, capsys):
    write_data(tmp_path / "data", "txt", [{"text": "the quick brown fox"}, {"text": "jumps over the lazy dog"}],
               {"columns": {"prompt": "text"}})
    rows = preview(tmp_path, model_dir, capsys, dataset="txt", stage="pt", template="qwen", cutoff_len=4)
    stream = E(tk, "the quick brown fox") + [tk.token_to_id("<|im_end|>")]
    stream += E(tk, "jumps over the lazy dog") + [tk.token_to_id("<|im_end|>")]
    assert [r["input_ids"] for r in rows] == [stream[i: i + 4] for i in range(0, len(stream) // 4 * 4, 4)]


def test_csv_parquet_and_folders(tmp_path, model_dir, tk, capsys):
    d = tmp_path / "data"
    (d / "many").mkdir(parents=True)
    (d / "many" / "a.csv").write_text("instruction,input,output\nSay hi.,,hi\n")
    (d / "many" / "b.jsonl").write_text(json.dumps({"instruction": "Say yo.", "output": "yo"}) + "\n")
    (d / "dataset_info.json").write_text(json.dumps({"many": {"file_name": "many"}}))
    got = preview(tmp_path, model_dir, capsys, dataset="many", template="empty")
    assert [r["input_ids"] for r in got] == [E(tk, "Say hi.") + E(tk, "hi"), E(tk, "Say yo.") + E(tk, "yo")]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"instruction": ["Say hey."], "output": ["hey"]}), d / "p.parquet")
    (d / "dataset_info.json").write_text(json.dumps({"p": {"file_name": "p.parquet"}}))
    (row,) = preview(tmp_path, model_dir, capsys, dataset="p", template="empty")
    assert row["input_ids"] == E(tk, "Say hey.") + E(tk, "hey")


def test_cache_reuses_and_invalidates(tmp_path, model_dir, capsys, monkeypatch):
    import trainer.data.prepare as prep

    write_data(tmp_path / "data", "chat", [{"conversations": CHAT}], {"formatting": "sharegpt"})
    builds = []
    real = prep.build_rows
    monkeypatch.setattr(prep, "build_rows", lambda *a, **k: builds.append(1) or real(*a, **k))
    first = preview(tmp_path, model_dir, capsys, dataset="chat", template="qwen")
    assert preview(tmp_path, model_dir, capsys, dataset="chat", template="qwen") == first and len(builds) == 1
    preview(tmp_path, model_dir, capsys, dataset="chat", template="llama3")  # another template: another key
    assert len(builds) == 2
    f = tmp_path / "data" / "chat.json"
    time.sleep(0.01)
    f.write_text(json.dumps([{"conversations": CHAT[1:3]}]))
    os.utime(f)
    changed = preview(tmp_path, model_dir, capsys, dataset="chat", template="qwen")
    assert len(builds) == 3 and changed != first
    preview(tmp_path, model_dir, capsys, dataset="chat", template="qwen", overwrite_cache=True)
    assert len(builds) == 4


@pytest.mark.slow  # (issue 40: among the quick subset's slowest on 2 cores; the whole suite runs it)
def test_workers_give_the_same_rows(tmp_path, model_dir, capsys, monkeypatch):
    import trainer.data.prepare as prep

    write_data(tmp_path / "data", "chat", [{"conversations": CHAT}] * 300, {"formatting": "sharegpt"})
    one = preview(tmp_path, model_dir, capsys, n=300, dataset="chat", template="llama3")
    chosen = []
    monkeypatch.setattr(prep, "WORKER_START_SECONDS", 0.0)  # a pool for so little work: the pool's path
    monkeypatch.setattr(prep.os, "sched_getaffinity", lambda pid: {0, 1})
    real = prep.useful_workers
    monkeypatch.setattr(prep, "useful_workers", lambda n, s: chosen.append(real(n, s)) or chosen[-1])
    two = preview(tmp_path, model_dir, capsys, n=300, dataset="chat", template="llama3", preprocessing_num_workers=2,
                  overwrite_cache=True)
    assert one == two and len(one) == 300 and chosen == [2]


def test_workers_only_where_they_help(monkeypatch):
    import trainer.data.prepare as prep

    monkeypatch.setattr(prep.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    start = prep.WORKER_START_SECONDS
    assert prep.useful_workers(16, 0.5) == 1, "a pool's start would cost more than the work"
    assert prep.useful_workers(16, 1.2 * start) == 1, "4 workers: start + 0.3 start > 1.2 start"
    assert prep.useful_workers(16, 1.5 * start) == 4, "4 workers: start + 0.375 start < 1.5 start; no more: cores"
    assert prep.useful_workers(2, 1.5 * start) == 1, "2 workers: start + 0.75 start > 1.5 start"
    assert prep.useful_workers(3, 100 * start) == 3, "no more than asked for"


def _error(tmp_path, model_dir, capsys, **cfg) -> str:
    conf = {"model_name_or_path": str(model_dir), "dataset_dir": str(tmp_path / "data"),
            "output_dir": str(tmp_path / "out"), "template": "qwen", **cfg}
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(conf))
    capsys.readouterr()
    assert main([str(path), "--preview", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tiermem-train: error: ")
    return err


def test_bad_rows_name_the_file_and_row(tmp_path, model_dir, capsys):
    d = tmp_path / "data"
    write_data(d, "alp", [{"instruction": "a", "output": "b"}, {"instruction": "c"}], {})
    assert "alp.json: row 2: missing column 'output'" in _error(tmp_path, model_dir, capsys, dataset="alp")
    bad = [{"from": "human", "value": "x"}, {"from": "human", "value": "y"}]
    write_data(d, "sg", [{"conversations": CHAT}, {"conversations": bad}], {"formatting": "sharegpt"})
    err = _error(tmp_path, model_dir, capsys, dataset="sg")
    assert "sg.json: row 2" in err and "roles must alternate" in err
    assert "unknown template 'qwen3x'" in _error(tmp_path, model_dir, capsys, dataset="sg", template="qwen3x")
    (d / "broken.json").write_text("[{")
    (d / "dataset_info.json").write_text(json.dumps({"broken": {"file_name": "broken.json"},
                                                     "hub": {"hf_hub_url": "org/data"}}))
    assert "broken.json: not valid JSON" in _error(tmp_path, model_dir, capsys, dataset="broken")
    assert "download the data" in _error(tmp_path, model_dir, capsys, dataset="hub")


def test_empty_after_filtering_and_skipping_bad_rows(tmp_path, model_dir, capsys):
    d = tmp_path / "data"
    write_data(d, "alp", [{"instruction": "a", "output": "b"}, {"instruction": "c"}, {"output": "d"}], {})
    conf = {"model_name_or_path": str(model_dir), "dataset_dir": str(d), "output_dir": str(tmp_path / "out"),
            "template": "qwen", "dataset": "alp", "tiermem_skip_bad_rows": True}
    rows = preview(tmp_path, model_dir, capsys, **{k: v for k, v in conf.items()
                                                   if k not in ("model_name_or_path", "dataset_dir", "output_dir")})
    assert len(rows) == 1
    write_data(d, "none", [{"instruction": "c"}], {})
    err = _error(tmp_path, model_dir, capsys, dataset="none", tiermem_skip_bad_rows=True)
    assert "no usable rows" in err and "1 bad rows skipped" in err


@pytest.mark.parametrize("source", ["val_size", "eval_dataset"])
def test_training_with_evaluation_logs_and_plots_eval_loss(tmp_path, capsys, source):
    from tests.tiny_models import save_tiny_model

    model_dir = save_tiny_model("llama", tmp_path / "model")
    d = tmp_path / "data"
    write_data(d, "toy", [{"input_ids": list(range(1, 12)), "labels": [-100] * 3 + list(range(4, 12))}] * 10,
               {"formatting": "tokenized"}, suffix=".jsonl")
    conf = {"model_name_or_path": str(model_dir), "dataset": "toy", "dataset_dir": str(d),
            "output_dir": str(tmp_path / "out"), "max_steps": 4, "per_device_train_batch_size": 2,
            "eval_strategy": "steps", "eval_steps": 2, "plot_loss": True,
            "tiermem": {"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}}}
    if source == "val_size":
        conf["val_size"] = 0.2
    else:
        write_data(d, "held", [{"input_ids": list(range(5, 20))}] * 2, {"formatting": "tokenized"}, suffix=".jsonl")
        write_data(d, "toy", [{"input_ids": list(range(1, 12)), "labels": [-100] * 3 + list(range(4, 12))}] * 8,
                   {"formatting": "tokenized"}, suffix=".jsonl")
        conf["eval_dataset"] = "held"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(conf))
    assert main([str(tmp_path / "c.yaml")]) == 0
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval_loss" in r]
    assert [r["current_steps"] for r in evals] == [2, 4] and all(r["eval_loss"] > 0 for r in evals)
    assert (tmp_path / "out" / "training_eval_loss.png").is_file()
    assert "8 training rows, 2 evaluation rows" in capsys.readouterr().out
