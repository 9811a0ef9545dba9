"""The files a Hugging Face Trainer (and so LLaMA-Factory) leaves behind, made from tiermem's own record
of the run (``trainer_log.jsonl``), so that scripts and LLaMA-Factory's plotting read a tiermem run as
theirs:

    output_dir/trainer_state.json            TrainerState's fields: log_history, global_step, best_metric...
    output_dir/checkpoint-N/trainer_state.json   the same, as of step N
    output_dir/train_results.json            train_loss, train_runtime, ... (HF's train metrics)
    output_dir/eval_results.json             eval_loss, ... of the final evaluation (do_eval)
    output_dir/all_results.json              both merged

tiermem's own checkpoint state (the RNG state, the resolved config) is ``checkpoint-N/tiermem_state.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainer.model.pref_loss import FIGURES as PREF_FIGURES

LOG = "trainer_log.jsonl"


def log_rows(out_dir: Path, upto: int | None = None) -> list[dict]:
    """The run's trainer_log.jsonl records (those up to step ``upto``)."""
    path = Path(out_dir) / LOG
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                break
            if upto is None or r.get("current_steps", 0) <= upto:
                rows.append(r)
    return rows


def log_history(rows: list[dict]) -> list[dict]:
    """TrainerState.log_history entries of trainer_log.jsonl records, in HF's field names."""
    out = []
    for r in rows:
        step, epoch = r["current_steps"], r.get("epoch")
        if "loss" in r:
            out.append({"epoch": epoch, "grad_norm": r.get("grad_norm"), "learning_rate": r.get("lr"),
                        "loss": r["loss"], "num_input_tokens_seen": r.get("total_tokens"),
                        **{k: r[k] for k in PREF_FIGURES if k in r}, "step": step})  # (stage dpo's rewards...)
        if "eval_loss" in r:
            entry = {"epoch": epoch, "eval_loss": r["eval_loss"]}
            entry.update({k: r[k] for k in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
                          if k in r})
            out.append(dict(entry, step=step))
    return out


def best(rows: list[dict], checkpoints: dict[int, str] | None = None) -> dict:
    """best_metric (the lowest evaluation loss), its step and the checkpoint saved at that step, if any."""
    evals = [(r["eval_loss"], r["current_steps"]) for r in rows if "eval_loss" in r]
    if not evals:
        return {"best_metric": None, "best_global_step": None, "best_model_checkpoint": None}
    loss, step = min(evals)
    return {"best_metric": loss, "best_global_step": step,
            "best_model_checkpoint": (checkpoints or {}).get(step)}


def trainer_state(cfg, rows: list[dict], step: int, total: int, epoch: float, steps_per_epoch: int,
                  n_params: int, final: dict | None = None, checkpoints: dict[int, str] | None = None) -> dict:
    """A TrainerState as JSON (``transformers.TrainerState.load_from_json`` reads it) after ``step`` steps;
    ``final``: the train results the history ends with."""
    tokens = max((r.get("total_tokens", 0) for r in rows if "loss" in r), default=0)
    history = log_history(rows)
    if final is not None:
        history.append({"epoch": final["epoch"], "step": step, "total_flos": final["total_flos"],
                        "train_loss": final["train_loss"], "train_runtime": final["train_runtime"],
                        "train_samples_per_second": final["train_samples_per_second"],
                        "train_steps_per_second": final["train_steps_per_second"]})
    return {**best(rows, checkpoints), "epoch": epoch, "eval_steps": cfg.eval_steps or cfg.logging_steps,
            "global_step": step, "is_hyper_param_search": False, "is_local_process_zero": True,
            "is_world_process_zero": True, "log_history": history, "logging_steps": cfg.logging_steps,
            "max_steps": total, "num_input_tokens_seen": tokens,
            "num_train_epochs": math.ceil(total / max(steps_per_epoch, 1)), "save_steps": cfg.save_steps or 0,
            "stateful_callbacks": {}, "total_flos": float(6 * n_params * tokens),
            "train_batch_size": cfg.per_device_train_batch_size, "trial_name": None, "trial_params": None}


def eval_metrics(loss: float, seconds: float, rows: int, batches: int, epoch: float, stage: str) -> dict:
    """HF's evaluation metrics (``eval_`` prefixed), and LLaMA-Factory's perplexity for stage pt."""
    out = {"epoch": epoch, "eval_loss": loss, "eval_runtime": round(seconds, 4),
           "eval_samples_per_second": round(rows / max(seconds, 1e-9), 3),
           "eval_steps_per_second": round(batches / max(seconds, 1e-9), 3)}
    if stage == "pt":
        out["perplexity"] = math.exp(loss) if loss < 700 else float("inf")
    return out


def save_metrics(out_dir: Path, split: str, metrics: dict) -> None:
    """``{split}_results.json``, and the metrics merged into ``all_results.json`` (as Trainer.save_metrics)."""
    out_dir = Path(out_dir)
    (out_dir / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True) + "\n")
    path = out_dir / "all_results.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update(metrics)
    path.write_text(json.dumps(merged, indent=4, sort_keys=True) + "\n")


def write_state(path: Path, state: dict) -> None:
    Path(path).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
