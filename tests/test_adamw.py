"""The out-of-place AdamW the service's CPU worker runs gives the in-place fused kernel's bits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.optim import OptimSettings
from tiermem.optim.kernels import adamw_out_of_place, fused_adamw

HP = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=4), chunk=st.integers(1, 40).map(lambda n: 64 * n),
       scale=st.sampled_from([None, 1.7]), first=st.booleans(), step=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_out_of_place_is_bit_identical_to_in_place(sizes, chunk, scale, first, step, seed):
    gen = torch.Generator().manual_seed(seed)
    p, g = [torch.randn(n, generator=gen) for n in sizes], [torch.randn(n, generator=gen) for n in sizes]
    m = [torch.zeros(n) if first else torch.randn(n, generator=gen) * 0.1 for n in sizes]
    v = [torch.zeros(n) if first else torch.rand(n, generator=gen) * 0.01 for n in sizes]
    old = [[t.clone() for t in ts] for ts in (p, g, m, v)]
    new = [[torch.full_like(t, float("nan")) for t in p] for _ in range(3)]
    rows = [(p[i], g[i], None if first else m[i], None if first else v[i], new[0][i], new[1][i], new[2][i])
            for i in range(len(sizes))]
    adamw_out_of_place(rows, step, **HP, grad_scale=scale, chunk=chunk)
    for ts, was in zip((p, g, m, v), old):  # the old state and the gradient keep their bytes
        assert all(torch.equal(a, b) for a, b in zip(ts, was))
    fused_adamw(p, g, m, v, step, **HP, grad_scale=scale, device="cpu")
    for got, want in zip(new, (p, m, v)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_optim_settings_that_make_the_update_undefined_are_refused():
    """A peer's settings (a service reads them from its trainer's hello): eps 0 makes 0/0 = NaN where a gradient is
    0, a beta of 1 divides by 0 in the bias correction."""
    good = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "has_master": False, "decay": {},
            "groups": [0]}
    assert OptimSettings.from_json(good).adamw.eps == 1e-8
    for bad in ({"eps": 0}, {"eps": -1e-8}, {"eps": float("nan")}, {"beta1": 1.0}, {"beta2": -0.1},
                {"weight_decay": float("inf")}):
        with pytest.raises(ValueError, match="bad optim settings"):
            OptimSettings.from_json(dict(good, **bad))


def test_the_check_of_new_weights_tells_overflowing_squares_from_inf_and_nan():
    """The optimizer's check of a group's new compute copy: a fast norm (finite means every weight is), and where it
    is not, the exact look that tells huge-but-finite weights (their squares overflow fp32) from inf and NaN."""
    from tiermem.optim.store_adamw import all_finite, weights_norm

    huge = [torch.full((64,), 1e30), torch.ones(3, dtype=torch.bfloat16).float()]
    assert not torch.isfinite(weights_norm(huge)) and all_finite(huge)
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.ones(100, dtype=torch.bfloat16)
        t[57] = bad
        assert not torch.isfinite(weights_norm([torch.ones(5, dtype=torch.bfloat16), t])) and not all_finite([t])
    assert torch.isfinite(weights_norm([torch.randn(1000)]))
