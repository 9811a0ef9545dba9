"""Stage dpo with several ranks (torchrun, CPU, gloo) against one process with the same global batch, fp32: each
rank takes whole pairs of every micro-batch, its head weighting them by 1 / (the whole step's pairs), so two ranks
end with the same weights (<= 1e-5) with accumulation and clipping that triggers; the logged figures are the
world's means; the reference's pass is split over the ranks and gathered, so the lead's checkpoint holds every
pair's figure, and two ranks resumed from it end as the straight run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.test_preference_parity import write_pairs
from tests.test_train_dp import assert_same_weights, ranks
from tests.tiny_models import save_tiny_model
from trainer.cli import main

STEP = re.compile(r"^step (\d+)/\d+ \| loss (\S+) \| grad_norm (\S+)", re.M)
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "sft_loss")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A tiny Llama and 14 tokenized pairs (a global micro-batch of 4: the epoch's last one holds 2, so one of
    two ranks takes none in it)."""
    d = tmp_path_factory.mktemp("dpo-ranks")
    save_tiny_model("llama", d / "model")
    write_pairs(d / "data", n_pairs=14, seed=3)
    return d


def _config(tmp_path: Path, shared: Path, name: str, per_device: int, **over) -> Path:
    cfg = dict(model_name_or_path=str(shared / "model"), stage="dpo", dataset="pairs", dataset_dir=str(shared / "data"),
               output_dir=str(tmp_path / name), per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
               max_steps=6, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1, weight_decay=0.1,
               max_grad_norm=0.5, seed=7, logging_steps=1, bf16=False, pref_beta=0.5, pref_ftx=0.3,
               tiermem={"tiers": {"gpu": {"device": "cpu"}, "dram": {"budget": "64MiB"}}})
    cfg.update(over)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(x)) for x, y in zip(a, b))


@pytest.mark.slow
def test_two_ranks_match_one_process_and_resume_from_the_leads_checkpoint(tmp_path, shared, capsys):
    assert main([str(_config(tmp_path, shared, "one", 4, save_steps=3))]) == 0
    printed = capsys.readouterr().out
    one = STEP.findall(printed)
    assert len(one) == 6 and "reference log-probabilities of 14 pairs" in printed
    r = ranks(_config(tmp_path, shared, "two", 2, save_steps=3), 2)
    assert r.returncode == 0, r.stderr[-3000:]
    two = STEP.findall(r.stdout)
    assert [s for s, _, _ in two] == [s for s, _, _ in one]
    assert _close([float(x) for _, x, _ in two], [float(x) for _, x, _ in one], 1e-4)  # (as printed: 4 digits)
    assert r.stdout.count("reference log-probabilities of 14 pairs") == 1
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert_same_weights(tmp_path / "one" / "checkpoint-3", tmp_path / "two" / "checkpoint-3")
    clipped = [x["grad_norm"] for x in _log(tmp_path / "one") if x["grad_norm"] > 0.5]
    assert clipped, "the clipping triggers"
    for a, b in zip(_log(tmp_path / "one"), _log(tmp_path / "two"), strict=True):  # the world's means
        assert _close([a[k] for k in ("loss", "grad_norm", *FIGURES)], [b[k] for k in ("loss", "grad_norm", *FIGURES)])
    refs = [json.loads((tmp_path / d / "checkpoint-3" / "tiermem_reference.json").read_text()) for d in ("one", "two")]
    assert len(refs[1]["sums"]) == 28 and refs[1]["digest"] == refs[0]["digest"]
    assert _close(refs[1]["sums"], refs[0]["sums"])  # every pair's figure, gathered from both ranks
    # two ranks resumed from the lead's checkpoint: the figures read back, the straight run's weights
    r = ranks(_config(tmp_path, shared, "resumed", 2, resume_from_checkpoint=str(tmp_path / "two" / "checkpoint-3")),
              2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "reference log-probabilities of" not in r.stdout
    assert [s for s, _, _ in STEP.findall(r.stdout)] == ["4", "5", "6"]
    assert_same_weights(tmp_path / "two", tmp_path / "resumed", tol=0)


@pytest.mark.slow
def test_two_ranks_with_a_ref_model_of_their_own_match_one_process(tmp_path, shared, capsys):
    """ref_model: the host's first rank loads its weights into the shared store for the pass, the starting ones
    back after it, the ranks waiting for each other around it; IPO, a piece of one pair (two passes of the head)."""
    other = save_tiny_model("llama", tmp_path / "ref", seed=11)
    over = dict(ref_model=str(other), pref_loss="ipo", pref_ftx=0.0, tiermem_physical_batch_size=2)
    assert main([str(_config(tmp_path, shared, "one", 4, **over))]) == 0
    assert f"reference: {other}" in capsys.readouterr().out
    r = ranks(_config(tmp_path, shared, "two", 2, **over), 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_weights(tmp_path / "one", tmp_path / "two")
