"""What a run shows and leaves behind: the dense per-step line, ``trainer_log.jsonl`` (LLaMA-Factory's
fields), the train results and the loss plot ``training_loss.png``. After a resume the ETA counts the steps
left at the rate since the resume, and ``train_loss`` is the mean over every step of the run."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tiermem.sizes import format_duration as _hms
from trainer.run.executor import StepResult

PENDING = "trainer_log.pending.jsonl"  # the steps taken since the last trainer_log line (see Reporter)
FIGURES = ("loss", "grad_norm", "tokens", "seconds", "wait_transfer", "wait_optimizer")


class Reporter:
    """Prints and logs a line every ``logging_steps`` steps, averaging the steps since the last one.

    Each step's figures are also appended to ``trainer_log.pending.jsonl`` before the optimizer takes the
    step (``pending``) and dropped once a line covers them: a run resumed at a step a killed trainer had
    committed but not logged (the service's last committed step, or a checkpoint between two lines) still
    logs those steps, and its lines equal an uninterrupted run's."""

    def __init__(self, out_dir: Path, total_steps: int, n_params: int, print_fn, resume_step: int = 0,
                 sink=None, first_step: bool = False, attention_flops: float = 0.0):
        """``sink(record)`` also receives every trainer_log.jsonl record (TensorBoard); ``first_step``: log
        step 1 too (logging_first_step); ``attention_flops``: attention's FLOPs a token (``trainer.planning.flops``,
        at the run's cutoff_len), for TFLOP/s counted with attention beside 6·N."""
        self.out_dir, self.total, self.n_params, self.print = out_dir, total_steps, n_params, print_fn
        self.attention_flops = attention_flops
        self.start, self.sink, self.first_step = resume_step, sink, first_step
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
        self.pauses = None  # a trainer.run.gc_pauses.GcPauses: the collector's pauses, logged a step
        self._gc_logged = 0.0
        self.losses: list[tuple[int, float]] = [(r["current_steps"], r["loss"]) for r in rows if "loss" in r]
        self.eval_losses: list[tuple[int, float]] = [(r["current_steps"], r["eval_loss"]) for r in rows
                                                     if "eval_loss" in r]
        self.all_losses: list[float] = []
        # the steps logged before the resume: each line's loss is the mean of the steps since the line before
        self.prior_loss_sum, self.prior_steps, last = 0.0, 0, 0
        for r in rows:
            if "loss" in r:
                self.prior_loss_sum += r["loss"] * (r["current_steps"] - last)
                self.prior_steps, last = r["current_steps"], r["current_steps"]
        self.total_tokens = max((r.get("total_tokens", 0) for r in rows if "loss" in r), default=0)
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
        r = {"step": step, **{k: getattr(result, k) for k in FIGURES}, "lr": lr, "epoch": epoch, "elapsed": elapsed,
             **({"figures": result.figures} if result.figures else {})}
        self._kept.append(r)
        with self.pending_path.open("a") as f:
            f.write(json.dumps(r) + "\n")

    def replay(self, every: int) -> None:
        """Log the steps a killed trainer took (committed) but had not logged yet, as it would have."""
        backlog, self._backlog = self._backlog, []
        for r in backlog:
            self.step(r["step"], StepResult(*(r[k] for k in FIGURES), {}, r.get("figures", {})), r["lr"], r["epoch"],
                      r["elapsed"], r["step"] == self.total, every)

    def step(self, step: int, result, lr: float, epoch: float, elapsed: float, force: bool, every: int) -> None:
        self.window.append(result)
        self.live.update(step=step, epoch=round(epoch, 4), loss=result.loss, grad_norm=result.grad_norm, lr=lr,
                         step_s=result.seconds, tokens_per_s=result.tokens / max(result.seconds, 1e-9),
                         split={"compute": result.compute, "wait_transfer": result.wait_transfer,
                                "wait_optimizer": result.wait_optimizer},
                         eta_s=self.remaining(step, elapsed), elapsed_s=elapsed)
        self.total_tokens += result.tokens
        self.train_seconds += result.seconds
        self.all_losses.append(result.loss)
        if not force and step % every and not (self.first_step and step == 1):
            return
        w, self.window = self.window, []
        secs = sum(r.seconds for r in w)
        toks = sum(r.tokens for r in w)
        loss = sum(r.loss for r in w) / len(w)
        tps = toks / secs if secs else 0.0
        tflops = 6 * self.n_params * tps / 1e12
        with_attention = tflops + self.attention_flops * tps / 1e12
        remaining = self.remaining(step, elapsed)
        compute, xfer, opt = (sum(getattr(r, k) for r in w) / len(w)
                              for k in ("compute", "wait_transfer", "wait_optimizer"))
        self.losses.append((step, loss))
        predicted = f" (predicted {self.predicted:.3f})" if self.predicted is not None else ""
        figures = {k: sum(r.figures.get(k, 0.0) for r in w) / len(w) for k in w[-1].figures}  # (stage dpo's)
        self.print(f"step {step}/{self.total} | loss {loss:.4f} | grad_norm {w[-1].grad_norm:.3f} | lr {lr:.3e} | "
                   f"{tps:,.0f} tok/s | {tflops:.3g} TFLOP/s ({with_attention:.3g} with attention) | "
                   f"step {secs / len(w):.3f}s{predicted} = compute "
                   f"{compute:.3f} + wait transfer {xfer:.3f} + wait optimizer {opt:.3f} | ETA {_hms(remaining)}"
                   + figures_text(figures))
        record = {"current_steps": step, "total_steps": self.total, "loss": loss,
                  "grad_norm": round(w[-1].grad_norm, 6), "lr": lr, "epoch": round(epoch, 4),
                  "percentage": round(step / self.total * 100, 2), "elapsed_time": _hms(elapsed),
                  "remaining_time": _hms(remaining), "throughput": round(tps, 2), "total_tokens": self.total_tokens,
                  "tflops": round(tflops, 3), "tflops_attention": round(with_attention, 3),
                  "step_seconds": round(secs / len(w), 4),
                  "compute_seconds": round(compute, 4), "wait_transfer_seconds": round(xfer, 4),
                  "wait_optimizer_seconds": round(opt, 4)}
        record.update(figures)
        waits = sorted(((round(v["transfer"] + v["optimizer"], 4), k) for k, v in w[-1].waits_by_phase.items()),
                       reverse=True)
        if waits and waits[0][0] >= 0.001:  # where the GPU stood idle the longest in the line's last step
            record["waits_at"] = {k: v for v, k in waits[:6] if v >= 0.001}
        if self.predicted is not None:
            record["predicted_step_seconds"] = round(self.predicted, 4)
        if self.pauses is not None:  # (the garbage collector's pauses since the line before, a step)
            record["gc_seconds"] = round((self.pauses.total - self._gc_logged) / len(w), 4)
            self._gc_logged = self.pauses.total
        self._append(record)
        self._kept = [r for r in self._kept if r["step"] > step]  # the line covers the others
        self.pending_path.write_text("".join(json.dumps(r) + "\n" for r in self._kept))

    def remaining(self, step: int, elapsed: float) -> float:
        """Seconds left: the steps still to go at the rate of the steps taken since this process started
        (or resumed)."""
        return elapsed / max(step - self.start, 1) * (self.total - step)

    def _append(self, record: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.sink is not None:
            self.sink(record)

    def eval(self, step: int, loss: float, epoch: float, elapsed: float, extra: dict | None = None) -> None:
        """Log an evaluation loss (``extra``: more fields of the record, such as eval_runtime)."""
        self.eval_losses.append((step, loss))
        self.live["eval_loss"] = loss
        self.print(f"step {step}/{self.total} | eval_loss {loss:.4f}")
        record = {"current_steps": step, "total_steps": self.total, "eval_loss": loss,
                  "epoch": round(epoch, 4), "percentage": round(step / self.total * 100, 2),
                  "elapsed_time": _hms(elapsed), "remaining_time": _hms(self.remaining(step, elapsed)),
                  **(extra or {})}
        self._append(record)

    @property
    def train_loss(self) -> float:
        """The mean loss of every step of the run, those before a resume included."""
        steps = self.prior_steps + len(self.all_losses)
        return (self.prior_loss_sum + sum(self.all_losses)) / max(steps, 1)

    def results(self, epoch: float, runtime: float, steps: int, rows_seen: int) -> dict:
        """The train results (Hugging Face's train metrics, plus tokens per second); the run is whole."""
        res = {"epoch": round(epoch, 4), "total_flos": float(6 * self.n_params * self.total_tokens),
               "train_loss": self.train_loss, "train_runtime": round(runtime, 4),
               "train_samples_per_second": round(rows_seen / runtime, 3),
               "train_steps_per_second": round(steps / runtime, 3),
               "train_tokens_per_second": round(self.total_tokens / max(self.train_seconds, 1e-9), 2)}
        self.pending_path.unlink(missing_ok=True)  # the run is whole: every step has its line
        return res


def figures_text(figures: dict) -> str:
    """Stage dpo's figures for the step line: " | rewards chosen .. rejected .. accuracy .. margin .. | logps
    chosen .. rejected ..", and the SFT and odds-ratio losses when logged ("" without figures)."""
    if not figures:
        return ""
    f = figures
    text = (f" | rewards chosen {f['rewards/chosen']:.4f} rejected {f['rewards/rejected']:.4f} accuracy "
            f"{f['rewards/accuracies']:.2f} margin {f['rewards/margins']:.4f} | logps chosen {f['logps/chosen']:.3f} "
            f"rejected {f['logps/rejected']:.3f}")
    for k in ("sft_loss", "odds_ratio_loss"):
        if k in f:
            text += f" | {k} {f[k]:.4f}"
    return text


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


def progress_bar(console: Console) -> Progress:
    """A transient progress bar on the run's console (tokenizing, loading, training, exporting); none where the
    console is not a terminal (a file, a pipe: each bar would leave an empty line there)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=console, transient=True, disable=not console.is_terminal)
