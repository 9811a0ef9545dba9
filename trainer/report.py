"""What a run shows and leaves behind: the dense per-step line, ``trainer_log.jsonl`` (LLaMA-Factory's
fields), ``train_results.json`` and the loss plot ``training_loss.png``."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

from trainer.executor import StepResult


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


PENDING = "trainer_log.pending.jsonl"  # the steps taken since the last trainer_log line (see Reporter)
FIGURES = ("loss", "grad_norm", "tokens", "seconds", "wait_transfer", "wait_optimizer")


class Reporter:
    """Prints and logs a line every ``logging_steps`` steps, averaging the steps since the last one.

    Each step's figures are also appended to ``trainer_log.pending.jsonl`` before the optimizer takes the
    step (``pending``) and dropped once a line covers them: a run resumed at a step a killed trainer had
    committed but not logged (the service's last committed step, or a checkpoint between two lines) still
    logs those steps, and its lines equal an uninterrupted run's."""

    def __init__(self, out_dir: Path, total_steps: int, n_params: int, print_fn, resume_step: int = 0):
        self.out_dir, self.total, self.n_params, self.print = out_dir, total_steps, n_params, print_fn
        self.log_path = out_dir / "trainer_log.jsonl"
        self.pending_path = out_dir / PENDING
        kept, rows = [], []
        if resume_step and self.log_path.is_file():  # keep the history up to the step resumed at
            for line in self.log_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break
                if row.get("current_steps", 0) <= resume_step:
                    kept.append(line)
                    rows.append(row)
        self.log_path.write_text("".join(line + "\n" for line in kept))
        logged = max((r["current_steps"] for r in rows if "loss" in r), default=0)
        backlog = [r for r in self._read_pending() if logged < r["step"] <= resume_step]
        self.pending_path.write_text("".join(json.dumps(r) + "\n" for r in backlog))
        self._kept = backlog  # what the pending file holds
        self._backlog = list(backlog)  # for replay
        self.window: list = []
        self.losses: list[tuple[int, float]] = [(r["current_steps"], r["loss"]) for r in rows if "loss" in r]
        self.eval_losses: list[tuple[int, float]] = [(r["current_steps"], r["eval_loss"]) for r in rows
                                                     if "eval_loss" in r]
        self.all_losses: list[float] = []
        self.total_tokens = 0
        self.train_seconds = 0.0
        self.live: dict = {"total_steps": total_steps}  # the latest figures, for the stats file
        self.predicted: float | None = None  # the planner's predicted step seconds, logged beside the measured

    def _read_pending(self) -> list[dict]:
        out = []
        if self.pending_path.is_file():
            for line in self.pending_path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by a kill: the step was not committed
                if isinstance(r, dict) and isinstance(r.get("step"), int) and \
                        all(k in r for k in (*FIGURES, "lr", "epoch", "elapsed")):
                    out.append(r)
        return out

    def pending(self, step: int, result, lr: float, epoch: float, elapsed: float) -> None:
        """Keep ``step``'s figures until a line covers them (call before the optimizer takes the step)."""
        r = {"step": step, **{k: getattr(result, k) for k in FIGURES}, "lr": lr, "epoch": epoch, "elapsed": elapsed}
        self._kept.append(r)
        with self.pending_path.open("a") as f:
            f.write(json.dumps(r) + "\n")

    def replay(self, every: int) -> None:
        """Log the steps a killed trainer took (committed) but had not logged yet, as it would have."""
        backlog, self._backlog = self._backlog, []
        for r in backlog:
            self.step(r["step"], StepResult(*(r[k] for k in FIGURES), {}), r["lr"], r["epoch"], r["elapsed"],
                      r["step"] == self.total, every)

    def step(self, step: int, result, lr: float, epoch: float, elapsed: float, force: bool, every: int) -> None:
        self.window.append(result)
        self.live.update(step=step, epoch=round(epoch, 4), loss=result.loss, grad_norm=result.grad_norm, lr=lr,
                         step_s=result.seconds, tokens_per_s=result.tokens / max(result.seconds, 1e-9),
                         split={"compute": result.compute, "wait_transfer": result.wait_transfer,
                                "wait_optimizer": result.wait_optimizer},
                         eta_s=elapsed / max(step, 1) * (self.total - step), elapsed_s=elapsed)
        self.total_tokens += result.tokens
        self.train_seconds += result.seconds
        self.all_losses.append(result.loss)
        if not force and step % every:
            return
        w, self.window = self.window, []
        secs = sum(r.seconds for r in w)
        toks = sum(r.tokens for r in w)
        loss = sum(r.loss for r in w) / len(w)
        tps = toks / secs if secs else 0.0
        tflops = 6 * self.n_params * tps / 1e12
        remaining = elapsed / step * (self.total - step)
        compute, xfer, opt = (sum(getattr(r, k) for r in w) / len(w)
                              for k in ("compute", "wait_transfer", "wait_optimizer"))
        self.losses.append((step, loss))
        predicted = f" (predicted {self.predicted:.3f})" if self.predicted is not None else ""
        self.print(f"step {step}/{self.total} | loss {loss:.4f} | grad_norm {w[-1].grad_norm:.3f} | lr {lr:.3e} | "
                   f"{tps:,.0f} tok/s | {tflops:.3g} TFLOP/s | step {secs / len(w):.3f}s{predicted} = compute "
                   f"{compute:.3f} + wait transfer {xfer:.3f} + wait optimizer {opt:.3f} | ETA {_hms(remaining)}")
        record = {"current_steps": step, "total_steps": self.total, "loss": round(loss, 6),
                  "grad_norm": round(w[-1].grad_norm, 6), "lr": lr, "epoch": round(epoch, 4),
                  "percentage": round(step / self.total * 100, 2), "elapsed_time": _hms(elapsed),
                  "remaining_time": _hms(remaining), "throughput": round(tps, 2), "total_tokens": self.total_tokens,
                  "tflops": round(tflops, 3), "step_seconds": round(secs / len(w), 4),
                  "compute_seconds": round(compute, 4), "wait_transfer_seconds": round(xfer, 4),
                  "wait_optimizer_seconds": round(opt, 4)}
        if self.predicted is not None:
            record["predicted_step_seconds"] = round(self.predicted, 4)
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._kept = [r for r in self._kept if r["step"] > step]  # the line covers the others
        self.pending_path.write_text("".join(json.dumps(r) + "\n" for r in self._kept))

    def eval(self, step: int, loss: float, epoch: float, elapsed: float) -> None:
        self.eval_losses.append((step, loss))
        self.live["eval_loss"] = loss
        self.print(f"step {step}/{self.total} | eval_loss {loss:.4f}")
        record = {"current_steps": step, "total_steps": self.total, "eval_loss": round(loss, 6),
                  "epoch": round(epoch, 4), "percentage": round(step / self.total * 100, 2),
                  "elapsed_time": _hms(elapsed), "remaining_time": _hms(elapsed / step * (self.total - step))}
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def results(self, epoch: float, runtime: float, steps: int, rows_seen: int) -> dict:
        res = {"epoch": round(epoch, 4), "train_loss": sum(self.all_losses) / max(len(self.all_losses), 1),
               "train_runtime": round(runtime, 4), "train_samples_per_second": round(rows_seen / runtime, 3),
               "train_steps_per_second": round(steps / runtime, 3),
               "train_tokens_per_second": round(self.total_tokens / max(self.train_seconds, 1e-9), 2)}
        (self.out_dir / "train_results.json").write_text(json.dumps(res, indent=2) + "\n")
        self.pending_path.unlink(missing_ok=True)  # the run is whole: every step has its line
        return res


def smooth(values: list[float]) -> list[float]:
    """An exponential moving average whose weight grows with the curve's length (as TensorBoard's)."""
    if not values:
        return []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for v in values:
        last = last * weight + (1 - weight) * v
        out.append(last)
    return out


def plot_loss(out_dir: Path, losses: list[tuple[int, float]], key: str = "loss") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in losses]
    values = [v for _, v in losses]
    fig = plt.figure()
    plt.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
    plt.plot(steps, smooth(values), color="#1f77b4", label="smoothed")
    plt.title(f"training {key} of {out_dir}")
    plt.xlabel("step")
    plt.ylabel(key)
    plt.legend()
    path = out_dir / f"training_{key}.png"
    plt.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path
