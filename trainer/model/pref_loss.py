"""The preference losses of LLaMA-Factory's ``stage: dpo`` over a batch of pairs, as functions of each pair's
log-probabilities (the sum over a response's trained tokens of log p(token)).

    sigmoid (DPO)  -logsigmoid(beta z) (1 - eps) - logsigmoid(-beta z) eps,   z = (pc - pr) - (rc - rr)
    hinge          relu(1 - beta z)
    ipo            (z - 1 / (2 beta))^2,  over average log-probabilities (the sum over the response's length)
    orpo           -pc + beta (-logsigmoid(log-odds)),  log-odds = (pc - pr) - (log(1 - e^pc) - log(1 - e^pr)),
                   over averages, no reference
    simpo          -logsigmoid(beta (pc - pr) - gamma),  over averages, no reference

(pc, pr: the policy's chosen and rejected log-probabilities; rc, rr: the reference model's, in the same form;
eps: ``dpo_label_smoothing``; gamma: ``simpo_gamma``.) With ``pref_ftx`` > 0 each pair's loss adds ``pref_ftx``
times the SFT loss of its chosen response, the negated average log-probability of its tokens. The rewards are
``beta (p - r)`` (beta p without a reference). A step's loss is the mean of its pairs' losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("sigmoid", "hinge", "ipo", "orpo", "simpo")
NAMES = {"sigmoid": "DPO (sigmoid)", "hinge": "DPO (hinge)", "ipo": "IPO", "orpo": "ORPO", "simpo": "SimPO"}
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "sft_loss", "odds_ratio_loss")


@dataclass(frozen=True)
class PrefLoss:
    kind: str = "sigmoid"
    beta: float = 0.1
    ftx: float = 0.0
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares with a reference model (ORPO and SimPO do not)."""
        return self.kind not in ("orpo", "simpo")

    @property
    def averages(self) -> bool:
        """Whether the log-probabilities are averaged over the response's tokens (IPO, ORPO, SimPO) or summed."""
        return self.kind in ("ipo", "orpo", "simpo")

    def logged(self) -> tuple[str, ...]:
        """The figures a step logs: the rewards and log-probabilities; the SFT loss with pref_ftx > 0 or ORPO;
        ORPO's odds-ratio loss."""
        keep = FIGURES[:6] + (("sft_loss",) if self.ftx > 0 or self.kind == "orpo" else ())
        return keep + (("odds_ratio_loss",) if self.kind == "orpo" else ())

    def pair_losses(self, sums: torch.Tensor, lengths: torch.Tensor, ref_sums: torch.Tensor | None):
        """Each pair's loss and its figures, from rows in pairs (row 2k chosen, 2k+1 rejected): ``sums`` the
        policy's summed log-probabilities [2n] (with a gradient), ``lengths`` the rows' trained tokens [2n],
        ``ref_sums`` the reference's sums [2n] (None without a reference). Returns (losses [n], figures: name ->
        per-pair values [n], detached)."""
        lengths = lengths.to(sums.dtype)
        logps = sums / lengths if self.averages else sums
        pc, pr = logps[0::2], logps[1::2]
        beta = self.beta
        if self.uses_reference:
            if ref_sums is None:
                raise ValueError(f"pref_loss {self.kind} needs the reference's log-probabilities")
            ref = ref_sums.to(sums.dtype)
            ref = ref / lengths if self.averages else ref
            rc, rr = ref[0::2], ref[1::2]
            z = (pc - pr) - (rc - rr)
            if self.kind == "sigmoid":
                eps = self.label_smoothing
                losses = -F.logsigmoid(beta * z) * (1 - eps) - F.logsigmoid(-beta * z) * eps
            elif self.kind == "hinge":
                losses = torch.relu(1 - beta * z)
            else:  # ipo
                losses = (z - 1 / (2 * beta)) ** 2
            chosen, rejected = beta * (pc - rc).detach(), beta * (pr - rr).detach()
        else:
            if self.kind == "orpo":
                log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
                odds = -F.logsigmoid(log_odds)
                losses = -pc + beta * odds
            else:  # simpo
                losses = -F.logsigmoid(beta * ((pc - pr) - self.simpo_gamma / beta))
            chosen, rejected = beta * pc.detach(), beta * pr.detach()
        sft = -(sums[0::2] / lengths[0::2])  # the chosen response's average negated log-probability
        if self.ftx > 0:
            losses = losses + self.ftx * sft
        figures = {"rewards/chosen": chosen, "rewards/rejected": rejected,
                   "rewards/accuracies": (chosen > rejected).to(sums.dtype), "rewards/margins": chosen - rejected,
                   "logps/chosen": pc.detach(), "logps/rejected": pr.detach(), "sft_loss": sft.detach()}
        if self.kind == "orpo":
            figures["odds_ratio_loss"] = odds.detach()
        return losses, figures
