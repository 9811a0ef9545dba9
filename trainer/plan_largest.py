"""``tiermem plan --machine FILE --largest TRAIN.yaml``: the largest depth of the YAML's model family
(num_hidden_layers varied, every other setting as config.json has it) that trains on the machine the file
describes, with its plan and predicted step; the depth above it and the line that refuses it.

The state grows with the layers and the step's activations do not shrink, so a depth that does not fit has no
deeper one that does: the answer is found by doubling from one layer and halving back (a dozen plans).
Depths are searched up to ``DEEPEST_OF_CONFIG`` times the config's own (an answer at that bound says "at least").
"""

from __future__ import annotations

from pathlib import Path

from tiermem.errors import BudgetError

DEEPEST_OF_CONFIG = 8


def largest(args, plan) -> tuple[dict, list[str]]:
    """(the plan at the largest depth as data, its lines led by the answer). ``plan(args, depth)``:
    ``trainer.plan_cli.plan``; BudgetError at one layer (nothing of the family fits) is the answer."""
    from trainer.config import load_train_config
    from trainer.run.job import model_config

    cfg = load_train_config(args.largest, args.overrides, here=False)
    own = model_config(Path(cfg.model_name_or_path), cfg).num_layers
    tried: dict[int, tuple | str] = {}

    def fits(depth: int) -> bool:
        if depth not in tried:
            try:
                tried[depth] = plan(args, depth)
            except BudgetError as e:
                tried[depth] = str(e)
        return isinstance(tried[depth], tuple)

    if not fits(1):
        raise BudgetError(f"not one layer of this model trains on that machine: {tried[1]}")
    top = own * DEEPEST_OF_CONFIG
    good, bad = 1, None
    d = 1
    while bad is None and d < top:  # (doubling while it fits)
        d = min(d * 2, top)
        if fits(d):
            good = d
        else:
            bad = d
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    data, text = tried[good]
    return with_answer(data, text, good, own, bad, tried.get(bad) if bad else None, top)


def with_answer(data: dict, text: list[str], depth: int, own: int, bad: int | None, why: str | None,
                top: int) -> tuple[dict, list[str]]:
    """The plan of the largest depth led by the answer's lines (and the answer in its data)."""
    pred = data["prediction"]
    n = data["model"]["params"]
    answer = (f"largest: {depth} layers ({n / 1e9:.1f} B params; the config's own: {own}) train on this machine: "
              f"{pred['step_seconds']:.2f} s a step, {pred['tokens_per_s']:,.0f} tokens/s, "
              f"{pred['tflops']:.0f} TFLOP/s ({pred['tflops_attention']:.0f} with attention), "
              f"MFU {pred['mfu']:.0%}")
    beyond = (f"  {bad} layers do not: {why}" if bad is not None else
              f"  (at least: {top} layers, {DEEPEST_OF_CONFIG}x the config's, is as deep as it searches)")
    data["largest"] = {"layers": depth, "config_layers": own, "refused_layers": bad, "refused": why,
                       "searched_to": top}
    return data, [answer, beyond, *text]
