"""The trainer's pieces against their definitions: LR schedules against transformers.get_scheduler,
the step plan, batching, stage-pt packing, and RoPE scaling read from either config form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.data.batches import StepPlan, collate
from trainer.model.config import model_config_from_dict
from trainer.run.schedule import lr_factor, warmup_steps

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("total,warm", [(10, 0), (10, 3), (7, 7), (1, 0)])
def test_schedules_match_get_scheduler(kind, total, warm):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = transformers.get_scheduler(kind, opt, num_warmup_steps=warm, num_training_steps=total)
    for step in range(total):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(kind, step, total, warm), abs=1e-12), step
        opt.step()
        sched.step()


def test_warmup_ratio_rounds_up_and_steps_win():
    assert warmup_steps(100, 0, 0.05) == 5 and warmup_steps(101, 0, 0.05) == 6 and warmup_steps(100, 7, 0.5) == 7


def test_step_plan_covers_each_epoch_once_in_a_seeded_order():
    plan = StepPlan(n_rows=9, batch_size=2, accum=2, seed=3)
    assert plan.batches_per_epoch == 5 and plan.steps_per_epoch == 3
    assert plan.total_steps(2.0, -1) == 6 and plan.total_steps(0.5, -1) == 2 and plan.total_steps(9, 5) == 5
    for epoch in (0, 1):
        seen = [i for s in range(3) for mb in plan.rows_of_step(epoch * 3 + s) for i in mb]
        assert sorted(seen) == list(range(9))
    assert [len(mb) for mb in plan.rows_of_step(1)] == [2, 2]
    assert [len(mb) for mb in plan.rows_of_step(2)] == [1]  # the epoch's last step takes what is left
    assert plan.rows_of_step(0) != plan.rows_of_step(3)  # a new order each epoch
    assert plan.rows_of_step(0) == StepPlan(9, 2, 2, 3).rows_of_step(0)


def test_collate_pads_right_and_masks_padding():
    ids, labels, n, mask = collate([[5, 6, 7], [8]], [None, [-100]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert labels.tolist() == [[5, 6, 7], [-100, -100, -100]]
    assert n == 4
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_stage_pt_packs_texts_with_eos_into_blocks(tmp_path):
    from tokenizers import Tokenizer

    from trainer.config import TrainConfig
    from trainer.data.prepare import build_rows
    from trainer.model.config import load_model_config

    model = str(Path(__file__).resolve().parent.parent / "models" / "tiny-llama")
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in ["one two three", "four five"]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "t.jsonl",
                                                                  "columns": {"prompt": "body"}}}))
    cfg = TrainConfig(model_name_or_path=model, output_dir="x", dataset="d", dataset_dir=str(tmp_path), stage="pt",
                      cutoff_len=3)
    rows = build_rows(cfg.dataset, cfg, load_model_config(model), model)
    tok = Tokenizer.from_file(f"{model}/tokenizer.json")
    eos = tok.token_to_id("</s>")
    stream = tok.encode("one two three", add_special_tokens=False).ids + [eos]
    stream += tok.encode("four five", add_special_tokens=False).ids + [eos]
    blocks = [stream[i: i + 3] for i in range(0, len(stream) - len(stream) % 3, 3)]
    assert rows.input_ids == blocks and rows.labels == [None] * len(blocks)


def test_rope_parameters_and_rope_scaling_give_the_same_frequencies():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    old = model_config_from_dict(dict(base, rope_theta=5e5, rope_scaling=scaling))
    new = model_config_from_dict(dict(base, rope_parameters=dict(scaling, rope_theta=5e5)))
    plain = model_config_from_dict(dict(base, rope_theta=5e5))
    assert torch.equal(old.inv_freq(), new.inv_freq())
    assert not torch.equal(old.inv_freq(), plain.inv_freq())
    cfg = transformers.LlamaConfig(**{k: v for k, v in base.items() if k != "architectures"}, rope_theta=5e5,
                                   rope_scaling=scaling)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(old.inv_freq(), want.float())


@pytest.mark.parametrize("every,killed_after,resume", [(3, 5, 5), (3, 6, 6), (1, 3, 3), (3, 5, 4), (3, 8, 8)])
def test_a_resumed_run_logs_the_steps_its_killed_trainer_took_but_did_not_log(tmp_path, every, killed_after,
                                                                              resume):
    """trainer_log.jsonl of a run killed after taking step ``killed_after`` (its figures kept as pending, no
    line for it yet) and resumed at step ``resume`` (the service's last committed step, or a checkpoint)
    equals the uninterrupted run's: the pending steps up to ``resume`` are logged as they would have been."""
    from trainer.outputs.report import Reporter
    from trainer.run.executor import StepResult

    total = 8
    result = lambda n: StepResult(1.0 / n, float(n), 100 * n, 0.5, 0.0, 0.0, {})

    def run(out: Path, steps: range, resume_step: int = 0) -> None:
        rep = Reporter(out, total, 1000, lambda text: None, resume_step=resume_step)
        rep.replay(every)
        for n in steps:
            rep.pending(n, result(n), 0.1, n / total, float(n))
            if n == killed_after and out.name == "killed" and not resume_step:
                return  # killed: the step was taken (committed), its line never written
            rep.step(n, result(n), 0.1, n / total, float(n), n == total, every)

    def lines(out: Path) -> list:
        rows = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
        return [(r["current_steps"], r["loss"], r["grad_norm"], r["total_tokens"] > 0) for r in rows]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    run(straight, range(1, total + 1))
    run(killed, range(1, total + 1))
    run(killed, range(resume + 1, total + 1), resume_step=resume)
    assert lines(killed) == lines(straight)
    assert (killed / "trainer_log.pending.jsonl").read_text() == ""


def test_trainer_log_says_where_the_gpu_waited_longest(tmp_path):
    """A record's ``waits_at``: the phase and group of the line's last step where the GPU stood idle longest,
    waiting for weights or an update (both summed), largest first, 1 ms or more; none when it did not wait."""
    from trainer.outputs.report import Reporter
    from trainer.run.executor import StepResult

    waits = {"forward 3": {"transfer": 0.0, "optimizer": 0.020},
             "forward embed": {"transfer": 0.004, "optimizer": 0.003},
             "backward 5": {"transfer": 0.0004, "optimizer": 0.0}}
    rep = Reporter(tmp_path, 2, 1000, lambda text: None)
    rep.step(1, StepResult(1.0, 1.0, 100, 0.5, 0.0044, 0.023, waits), 0.1, 0.5, 1.0, False, 1)
    rep.step(2, StepResult(1.0, 1.0, 100, 0.5, 0.0, 0.0, {}), 0.1, 1.0, 2.0, True, 1)
    rows = [json.loads(line) for line in (tmp_path / "trainer_log.jsonl").read_text().splitlines()]
    assert rows[0]["waits_at"] == {"forward 3": 0.02, "forward embed": 0.007}
    assert "waits_at" not in rows[1]


def test_an_out_of_memory_line_says_where_in_the_step():
    """The GPU's out-of-memory line names the phase, the layer and the pass it ran out in (the 14B run's said
    only "in step 1")."""
    from types import SimpleNamespace

    from trainer.run.stepping import _where

    assert _where(SimpleNamespace(layer=7, at_pass=2, last_passes=13)) == " of layer 7, pass 2 of 13"
    assert _where(SimpleNamespace(layer="head", at_pass=1, last_passes=1)) == " (head)"
    assert _where(SimpleNamespace(layer=None, at_pass=1, last_passes=1)) == ""
