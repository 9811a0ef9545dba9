"""The out-of-place AdamW the service's CPU worker runs gives the in-place fused kernel's bits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
