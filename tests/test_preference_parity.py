"""Streamed preference training is exact: N steps of ``tiermem-train`` with ``stage: dpo`` in fp32 (gradient
accumulation, clipping that triggers, warmup + cosine, weight decay, Adam's moments on the NVMe tier) end with
the weights of plain PyTorch training whose loss is written here from LLaMA-Factory's definitions, on the same
token ids: DPO (sigmoid, with label smoothing and an SFT term), hinge, IPO (average log-probabilities), ORPO and
SimPO (averages, no reference); a reference model that is another model (ref_model); pieces of one pair, a pass
each."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
import torch.nn.functional as F

from tests.test_train_parity import HP, assert_same_weights, nvme_moments, run_cli
from tests.tiny_models import save_tiny_model
from trainer.data.batches import StepPlan

transformers = pytest.importorskip("transformers")
VOCAB = 96


def write_pairs(data_dir, n_pairs: int = 10, seed: int = 0, name: str = "pairs") -> list[dict]:
    """Tokenized pairs: a prompt of 3..8 ids (masked) and two responses of 2..9 ids, labels given or not."""
    rng = random.Random(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    pairs = []
    for _pair in range(n_pairs):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 9))]
        row = {}
        for which in ("chosen", "rejected"):
            resp = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 10))]
            row[f"{which}_input_ids"] = prompt + resp
            row[f"{which}_labels"] = [-100] * len(prompt) + resp
        pairs.append(row)
    (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    (data_dir / "dataset_info.json").write_text(json.dumps({name: {"file_name": f"{name}.jsonl",
                                                                   "formatting": "tokenized", "ranking": True}}))
    return pairs


def logps(model, ids, labels):
    """Each row's summed log-probability of its labels (shifted by one), and its count of them."""
    logits = model(input_ids=ids).logits.float()[:, :-1]
    lab = labels[:, 1:]
    mask = lab != -100
    per_token = torch.gather(logits.log_softmax(-1), 2, lab.clamp_min(0).unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1), mask.sum(-1)


def pair_loss(kind, pc, pr, rc, rr, beta, smoothing=0.0, gamma=0.5):
    """LLaMA-Factory's losses (TRL's dpo_loss for sigmoid, hinge and ipo; its own odds-ratio and SimPO)."""
    if kind in ("sigmoid", "hinge", "ipo"):
        z = (pc - pr) - (rc - rr)
        if kind == "sigmoid":
            return -F.logsigmoid(beta * z) * (1 - smoothing) - F.logsigmoid(-beta * z) * smoothing
        if kind == "hinge":
            return torch.relu(1 - beta * z)
        return (z - 1 / (2 * beta)) ** 2
    if kind == "orpo":
        log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
        return -pc + beta * -F.logsigmoid(log_odds)
    return -F.logsigmoid(beta * (pc - pr - gamma / beta))


def reference_dpo(model_dir, pairs, kind, beta, ftx=0.0, smoothing=0.0, ref_dir=None, log=None):
    """Plain PyTorch preference training under the Hugging Face Trainer's semantics; ``log``: each step's
    (loss, grad_norm, mean reward margin)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_model = (transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32) if ref_dir
                 else copy.deepcopy(model)).eval()
    model.train()
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decayed], "weight_decay": HP["weight_decay"]},
              {"params": [p for n, p in model.named_parameters() if n not in decayed], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=HP["learning_rate"], betas=(HP["adam_beta1"], HP["adam_beta2"]),
                            eps=HP["adam_epsilon"])
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=HP["warmup_steps"],
                                       num_training_steps=HP["max_steps"])
    plan = StepPlan(len(pairs), HP["per_device_train_batch_size"], HP["gradient_accumulation_steps"], HP["seed"])
    averages = kind in ("ipo", "orpo", "simpo")
    for step in range(HP["max_steps"]):
        mbs = plan.rows_of_step(step)
        n_pairs = sum(len(idx) for idx in mbs)
        total, margins = 0.0, 0.0
        for idx in mbs:  # (as LLaMA-Factory's collator: every chosen row, then every rejected one)
            rows = [pairs[i][f"{w}_input_ids"] for w in ("chosen", "rejected") for i in idx]
            labs = [pairs[i][f"{w}_labels"] for w in ("chosen", "rejected") for i in idx]
            t = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), t, dtype=torch.long)
            lab = torch.full((len(rows), t), -100)
            for k, (r, lb) in enumerate(zip(rows, labs)):
                ids[k, : len(r)], lab[k, : len(r)] = torch.tensor(r), torch.tensor(lb)
            sums, lens = logps(model, ids, lab)
            with torch.no_grad():
                ref_sums, _ = logps(ref_model, ids, lab)
            lp, rp = (sums / lens, ref_sums / lens) if averages else (sums, ref_sums)
            dl = lp.detach()
            b = len(idx)
            losses = pair_loss(kind, lp[:b], lp[b:], rp[:b], rp[b:], beta, smoothing)
            if ftx:
                losses = losses + ftx * -(sums[:b] / lens[:b])
            loss = losses.sum() / n_pairs
            loss.backward()
            total += float(loss.detach())
            if kind in ("orpo", "simpo"):
                margins += float((beta * (dl[:b] - dl[b:])).sum()) / n_pairs
            else:
                margins += float((beta * ((dl[:b] - rp[:b]) - (dl[b:] - rp[b:]))).sum()) / n_pairs
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), HP["max_grad_norm"])
        if log is not None:
            log.append((total, float(norm), margins))
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.state_dict().items()}


def check_run(tmp_path, family, kind, ftx=0.0, smoothing=0.0, ref=False, tiermem=None, **over):
    model_dir = save_tiny_model(family, tmp_path / "model")
    ref_dir = save_tiny_model(family, tmp_path / "ref", seed=1) if ref else None
    pairs = write_pairs(tmp_path / "data")
    beta = 0.5
    log: list = []
    expected = reference_dpo(model_dir, pairs, kind, beta, ftx, smoothing, ref_dir, log)
    assert max(n for _, n, _ in log) > HP["max_grad_norm"], "the test must make clipping trigger"
    keys = dict(stage="dpo", pref_loss=kind, pref_beta=beta, pref_ftx=ftx, dpo_label_smoothing=smoothing, **over)
    if ref:
        keys["ref_model"] = str(ref_dir)
    tiermem = tiermem or nvme_moments(tmp_path)
    assert run_cli(tmp_path, model_dir, tmp_path / "data", "pairs", tiermem, **keys) == 0
    out = tmp_path / "out"
    assert_same_weights(out, expected, tied=family == "qwen3")
    got = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in got] == pytest.approx([x for x, _, _ in log], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([n for _, n, _ in log], rel=1e-5)
    assert [r["rewards/margins"] for r in got] == pytest.approx([m for _, _, m in log], rel=1e-4, abs=1e-6)
    return got


@pytest.mark.slow
def test_dpo_sigmoid_trains_as_plain_pytorch(tmp_path):
    got = check_run(tmp_path, "llama", "sigmoid")
    assert got[0]["loss"] == pytest.approx(0.6931472, rel=1e-6)  # (the reference is the starting model: log 2)
    assert got[0]["rewards/margins"] == 0.0 and "sft_loss" not in got[0]


@pytest.mark.slow
@pytest.mark.parametrize("family,kind,ftx,smoothing", [
    ("llama", "ipo", 0.0, 0.0), ("llama", "orpo", 0.0, 0.0), ("llama", "simpo", 0.0, 0.0),
    ("llama", "hinge", 0.0, 0.0), ("llama", "sigmoid", 0.3, 0.1), ("qwen3", "sigmoid", 0.0, 0.0),
    ("qwen3", "ipo", 0.0, 0.0), ("qwen3", "orpo", 0.0, 0.0), ("qwen3", "simpo", 0.0, 0.0)])
def test_each_loss_trains_as_plain_pytorch(tmp_path, family, kind, ftx, smoothing):
    got = check_run(tmp_path, family, kind, ftx, smoothing)
    assert ("sft_loss" in got[0]) == (ftx > 0 or kind == "orpo")


@pytest.mark.slow
def test_a_reference_model_of_its_own(tmp_path, capsys):
    """ref_model: another model's log-probabilities are the reference; the trained model starts from its own."""
    check_run(tmp_path, "llama", "sigmoid", ref=True)
    assert f"reference: {tmp_path / 'ref'}" in capsys.readouterr().out


@pytest.mark.slow
def test_pieces_of_one_pair_a_pass_each(tmp_path, capsys):
    """Micro-batches of 2 pairs computed as pieces of one pair (2 rows), each its own layer-major pass: the
    pairs' losses are whole in their pieces and the step's gradient is the whole step's."""
    check_run(tmp_path, "llama", "sigmoid", tiermem_physical_batch_size=2, tiermem_activation_budget="1KiB")
    out = capsys.readouterr().out
    assert "each micro-batch of 4 rows runs as 2 pieces of 2 rows" in out, out  # (2 pairs: 4 rows)
    assert "each step runs as 4 layer-major passes" in out, out


@pytest.mark.slow
def test_pieces_of_two_micro_batches_merged_hold_whole_pairs(tmp_path, capsys):
    """tiermem_physical_batch_size 8 with micro-batches of 2 pairs (4 rows): each piece merges a step's 2
    micro-batches (4 whole pairs); the reference's forward, the losses and the step are plain PyTorch's."""
    check_run(tmp_path, "llama", "sigmoid", tiermem_physical_batch_size=8)
    out = capsys.readouterr().out
    assert "pieces of 8 rows, each 2 micro-batches of 4 rows merged" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigmoid", "simpo"])
def test_the_generic_path_trains_as_plain_pytorch(tmp_path, kind):
    """The preference head over the generic path's stages (transformers' own modules for the head)."""
    check_run(tmp_path, "qwen3", kind, tiermem_model_path="generic")


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, "1KiB"])
def test_state_in_hbm_summed_at_home(tmp_path, capsys, budget):
    """Placement auto with room for all of it in the (CPU-backed) GPU tier: the head's and the embedding's gradients
    summed in their homes there (the preference head adds every row's into them), in one pass or a pass a pair."""
    tiermem = {"tiers": {"gpu": {"device": "cpu", "slots": 2}, "dram": {"budget": "64MiB"}}, "placement": "auto",
               "optimizer": {"gpu_share": 0.0}}
    over = {"tiermem_activation_budget": budget} if budget else {}
    check_run(tmp_path, "qwen3", "ipo", tiermem=tiermem, **over)
    assert ("layer-major passes" in capsys.readouterr().out) == (budget is not None)
    stats = json.loads((tmp_path / "out" / "store_stats.json").read_text())
    assert "gradient_partials" not in stats["waits_s"]  # (summed at home: nothing read back between passes)
