"""Stage dpo's head in isolation (quick): the preference head's loss and gradients (each row's cross-entropy
weighted by the loss's derivative by its log-probability, row by row, chunked) equal autograd through the whole
loss written out here; the losses' values at the start (the reference equal to the policy)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from trainer.model.config import load_model_config
from trainer.model.pref_loss import PrefLoss
from trainer.model.stages import TemplateStages
from trainer.model.weights import LM_HEAD, NORM
from trainer.run.preference import PreferenceHead, pair_pieces


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 40, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}))
    return TemplateStages(load_model_config(d), torch.float32, torch.device("cpu"))


def whole_loss(loss: PrefLoss, h, targets, norm_w, head_w, ref, n_pairs, eps):
    """The step's loss over these rows (pairs: rows 2k, 2k+1), through the whole logits at once."""
    x = h.float()
    normed = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    logp = F.linear(normed, head_w).log_softmax(-1)
    mask = targets != -100
    sums = (torch.gather(logp, 2, targets.clamp_min(0).unsqueeze(2)).squeeze(2) * mask).sum(-1)
    lens = mask.sum(-1)
    p = sums / lens if loss.averages else sums
    r = ref / lens if loss.averages else ref
    pc, pr, rc, rr = p[0::2], p[1::2], r[0::2], r[1::2]
    b, z = loss.beta, (pc - pr) - (rc - rr)
    per_pair = {"sigmoid": lambda: -F.logsigmoid(b * z) * 0.9 - F.logsigmoid(-b * z) * 0.1,
                "hinge": lambda: torch.relu(1 - b * z), "ipo": lambda: (z - 1 / (2 * b)) ** 2,
                "orpo": lambda: -pc - b * F.logsigmoid((pc - pr) - (torch.log1p(-pc.exp()) - torch.log1p(-pr.exp()))),
                "simpo": lambda: -F.logsigmoid(b * (pc - pr) - loss.simpo_gamma)}[loss.kind]()
    per_pair = per_pair + loss.ftx * -(sums[0::2] / lens[0::2])
    return per_pair.sum() / n_pairs


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo", "orpo", "simpo"])
def test_the_head_gives_the_whole_losss_gradients(stages, kind):
    torch.manual_seed(0)
    loss = PrefLoss(kind, beta=0.7, ftx=0.3, label_smoothing=0.1 if kind == "sigmoid" else 0.0)
    rows, t, hidden, vocab = 4, 9, 16, 40
    h = torch.randn(rows, t, hidden)
    targets = torch.randint(0, vocab, (rows, t))
    targets[:, :3] = -100  # (the prompt)
    targets[1, 7:] = -100  # (a shorter rejected row: padding)
    w = {NORM: torch.rand(hidden) + 0.5, LM_HEAD: torch.randn(vocab, hidden) * 0.3}
    ref = torch.randn(rows) - 20.0
    head = PreferenceHead(loss)
    n_pairs = 3  # (the step holds another pair elsewhere: the scale is the step's)
    scale = 1.0 / n_pairs
    total, gh, grads, _ = head.head_loss_backward(stages, (None, None, 0, None, ref))(
        h, targets, w, None, scale, 5)  # (chunks of 5 tokens: a row's split across chunks)
    leaves = [h.clone().requires_grad_(), w[NORM].clone().requires_grad_(), w[LM_HEAD].clone().requires_grad_()]
    expected = whole_loss(loss, *leaves[:1], targets, *leaves[1:], ref, n_pairs, stages.cfg.rms_norm_eps)
    want = torch.autograd.grad(expected, leaves)
    assert float(total) * scale == pytest.approx(float(expected.detach()), rel=1e-5)
    for got, exp in zip((gh, grads[NORM], grads[LM_HEAD]), want):
        assert torch.allclose(got, exp, rtol=1e-4, atol=1e-6), (got - exp).abs().max()


def test_the_losses_at_the_start():
    """With the policy equal to its reference: DPO's loss is log 2, IPO's 1 / (2 beta)^2, hinge's 1; no reward."""
    sums, lens = torch.tensor([-30.0, -40.0]), torch.tensor([10, 8])
    for kind, value in (("sigmoid", math.log(2)), ("ipo", 1 / (2 * 0.1) ** 2), ("hinge", 1.0)):
        losses, figures = PrefLoss(kind).pair_losses(sums, lens, sums)
        assert float(losses[0]) == pytest.approx(value) and float(figures["rewards/margins"][0]) == 0.0
    losses, figures = PrefLoss("simpo", beta=2.0, simpo_gamma=0.5).pair_losses(sums, lens, None)
    assert float(losses[0]) == pytest.approx(-math.log(1 / (1 + math.exp(-(2.0 * (-3.0 + 5.0) - 0.5)))))
    assert float(figures["rewards/chosen"][0]) == pytest.approx(-6.0)  # (beta times the average, no reference)


def test_pieces_hold_whole_pairs():
    assert [pair_pieces(r) for r in (None, 1, 2, 3, 8)] == [None, 2, 2, 4, 8]


def test_tensorboard_and_trainer_state_carry_the_figures():
    from trainer.outputs.hf_outputs import log_history
    from trainer.outputs.tensorboard import tags_of

    record = {"current_steps": 3, "loss": 0.6, "rewards/margins": 0.25, "logps/chosen": -12.5, "sft_loss": 1.5}
    assert tags_of(record) == {"train/loss": 0.6, "train/rewards/margins": 0.25, "train/logps/chosen": -12.5,
                               "train/sft_loss": 1.5}
    (entry,) = log_history([record])
    assert entry["rewards/margins"] == 0.25 and entry["sft_loss"] == 1.5 and entry["step"] == 3


def test_pref_keys_with_another_stage_are_noted(tmp_path):
    from trainer.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": str(tmp_path / "o"), "dataset": "d",
                                "pref_beta": 0.2, "pref_loss": "ipo"}))
    cfg = load_train_config(path, here=False)  # (no model or data: the keys alone)
    assert "note: pref_beta, pref_loss have no effect here: used only by stage dpo" in cfg.notes
    assert cfg.micro_rows == cfg.per_device_train_batch_size
    dpo = load_train_config(path, ["stage=dpo"], here=False)
    assert not dpo.notes and dpo.micro_rows == 2 * dpo.per_device_train_batch_size


def test_the_planner_cuts_pairs_whole():
    """The planner's pieces of a micro-batch of pairs are whole pairs: halves of the pairs, down to one pair."""
    from trainer.run import pieces

    assert pieces.candidates(8, 2) == [8, 4, 2] and pieces.candidates(6, 2) == [6, 4, 2]
    assert pieces.candidates(2, 2) == [2] and pieces.candidates(6) == [6, 3, 2, 1]


def test_the_planner_never_splits_a_pair():
    """A micro-batch of one pair (2 rows) refused whole where HBM is short: cut into rows for SFT, refused for stage
    dpo (a piece holds whole pairs), rather than planned at pieces it cannot run."""
    import dataclasses

    from tests.test_planner import GiB, machine, plan_step, specs_for, store_cfg, workload
    from tiermem.errors import BudgetError
    from trainer.planning.run_plan import search_pieces

    specs = specs_for(8, 200_000_000, 100_000_000)
    w = dataclasses.replace(workload(8, micro_batches=4), micro_rows=2, layer_work_bytes=60 * GiB,
                            head_work_bytes=2 * GiB, working_bytes=60 * GiB + 2 * GiB)
    tight = lambda wk: plan_step(specs, store_cfg(), wk, machine(gpu_memory=80 * GiB),
                                 {"gpu": None, "dram": 4 * GiB, "nvme": 4 * GiB}, cuda=True)
    assert search_pieces(2, w, tight).piece_rows == 1
    with pytest.raises(BudgetError):
        search_pieces(2, w, tight, unit=2)


def test_a_killed_runs_pending_steps_log_their_figures(tmp_path):
    """Stage dpo's figures of a step a killed trainer took but did not log (kept as pending) are logged on the
    resume as the straight run logged them."""
    from trainer.outputs.report import Reporter
    from trainer.run.executor import StepResult

    figures = lambda n: {k: n / 10 for k in PrefLoss().logged()}
    result = lambda n: StepResult(1.0 / n, float(n), 100 * n, 0.5, 0.0, 0.0, {}, figures(n))
    logs = {}
    for name in ("straight", "killed"):
        out = tmp_path / name
        out.mkdir()
        rep = Reporter(out, 4, 1000, lambda text: None)
        for n in range(1, 5):
            rep.pending(n, result(n), 0.1, n / 4, float(n))
            if name == "killed" and n == 3:
                break
            rep.step(n, result(n), 0.1, n / 4, float(n), n == 4, 2)
        if name == "killed":  # (resumed at step 3, which it took but did not log)
            rep = Reporter(out, 4, 1000, lambda text: None, resume_step=3)
            rep.replay(2)
            rep.pending(4, result(4), 0.1, 1.0, 4.0)
            rep.step(4, result(4), 0.1, 1.0, 4.0, True, 2)
        logs[name] = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    figs = lambda rows: [(r["current_steps"], r["rewards/margins"], r["logps/chosen"]) for r in rows]
    assert figs(logs["killed"]) == figs(logs["straight"])
    assert figs(logs["straight"]) == [(2, pytest.approx(0.15), pytest.approx(0.15)), (4, 0.35, 0.35)]
