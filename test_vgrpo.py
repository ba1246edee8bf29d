"""Tests for vgrpo.py. CPU only, offline: `python -m pytest -q`.

Every test carries one tier marker (registered in pytest.ini; `python -m pytest -q -m math`):
math — pure math against closed forms, analytic velocity fields and slow reference loops;
trainer — end to end on tiny randomly initialised SD3/FLUX pipelines, rewards, CLI, bad input;
examples — the scripts in examples/; multiprocess — data parallelism under torchrun;
docs — the README's snippet, the quoted algorithm box and the style of vgrpo.py.

The numbered sections below are the rows of docs/tests.md's table "Where each guarantee is
tested", in the same order (a test checks it): find a guarantee there, then its section here.

The tests of the scripts in examples/ sit beside them, in the same tiers: examples/test_examples.py
(toy_2d.py, evaluate.py, the prompt sets, the curriculum), examples/rewards/test_rewards.py,
examples/baselines/test_baselines.py, examples/gpu/test_gpu.py and examples/tools/test_tools.py
(docs/tests.md, "Tests beside the examples"); `python -m pytest -q` runs them all. What the files
share (ROOT, TM, TINY, _load_example, _trained, the `ev` fixture, the autouse fixtures,
HF_HUB_OFFLINE) is in conftest.py.
"""
import ast
import builtins
import contextlib
import copy
import dataclasses
import errno
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

import vgrpo as V
from conftest import (ROOT, TINY, TM, _load_example, _metrics, _stop_while_torch_imports,
                      _strip_times, _trained)


# ------------------------------------------------------------------------------------------------
# 1. Math §4: group-relative advantages and the reward aggregation
# ------------------------------------------------------------------------------------------------
@pytest.mark.math
def test_advantages_zero_mean_per_group_and_unit_std():
    r = torch.tensor([[1.0, 2.0, 3.0, 6.0], [10.0, 10.5, 9.0, 8.0]], dtype=torch.float64)
    a, _ = V.group_advantages(r, global_std=False, std_eps=0.0, clamp=100.0, eta=0.0)
    torch.testing.assert_close(a.mean(dim=1), torch.zeros(2, dtype=torch.float32), atol=1e-6, rtol=0)
    torch.testing.assert_close(a.std(dim=1, unbiased=False), torch.ones(2), atol=1e-5, rtol=0)
    # hand-computed: group 0 mean 3, population std sqrt(3.5)
    torch.testing.assert_close(a[0], torch.tensor([-2.0, -1.0, 0.0, 3.0]) / math.sqrt(3.5), atol=1e-6, rtol=0)


@pytest.mark.math
def test_advantages_global_std_is_flow_grpo_batch_std():
    """Flow-GRPO's PerPromptStatTracker(global_std=True): group-mean centred, divided by
    np.std(all rewards) + 1e-4 (around the BATCH mean, population std)."""
    np = pytest.importorskip("numpy")
    r = torch.tensor([[0.0, 2.0], [10.0, 14.0]])
    a, _ = V.group_advantages(r, global_std=True, std_eps=0.0, clamp=100.0, eta=0.0)
    std = math.sqrt((6.5**2 + 4.5**2 + 3.5**2 + 7.5**2) / 4)     # batch mean 6.5
    torch.testing.assert_close(a, torch.tensor([[-1.0, 1.0], [-2.0, 2.0]]) / std)
    # the tracker's formula on a random batch, in float64 numpy
    g = torch.Generator().manual_seed(0)
    r = torch.randn(4, 6, generator=g, dtype=torch.float64) * 3 + torch.arange(4.0)[:, None]
    ref = (r.numpy() - r.numpy().mean(1, keepdims=True)) / (np.std(r.numpy()) + 1e-4)
    a, _ = V.group_advantages(r, global_std=True, std_eps=1e-4, clamp=100.0, eta=0.0)
    torch.testing.assert_close(a, torch.from_numpy(ref).float(), atol=1e-5, rtol=1e-5)
    # a non-finite reward leaves the batch statistics of the others
    r2 = r.clone()
    r2[0, 0] = float("nan")
    keep = torch.isfinite(r2)
    rr = r2.numpy()
    std2 = np.std(rr[keep.numpy()]) + 1e-4
    m0 = np.nanmean(rr[0])
    a2, _ = V.group_advantages(r2, global_std=True, std_eps=1e-4, clamp=100.0, eta=0.0)
    assert a2[0, 0] == 0
    torch.testing.assert_close(a2[0, 1:].double(), torch.from_numpy((rr[0, 1:] - m0) / std2),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.math
def test_advantages_soft_clip_bound_and_clamp():
    r = torch.tensor([[0.0] * 15 + [1000.0]])
    a, _ = V.group_advantages(r, global_std=False, clamp=5.0, eta=3.0)
    assert a.abs().max() <= 3.0
    # the outlier's raw z-score is sqrt(15) ≈ 3.87 → η·tanh(3.87/η)
    torch.testing.assert_close(a[0, -1], torch.tensor(3 * math.tanh(math.sqrt(15) / 3)), atol=1e-3, rtol=0)
    a2, _ = V.group_advantages(r, global_std=False, clamp=2.0, eta=0.0)
    assert a2.max() == pytest.approx(2.0)


@pytest.mark.math
def test_clamp_acts_before_the_soft_clip_under_global_std():
    """The ±5 clamp is not inert at η = 3: under the global std (the SD3 default) one outlier in
    a 6 × 24 batch has A = (1 − 1/24) / 0.0830 ≈ 11.5, clamped to 5, soft-clipped to
    3·tanh(5/3) = 2.79 instead of 3·tanh(11.5/3) = 3.00 (clip_advantages' docstring)."""
    r = torch.zeros(6, 24, dtype=torch.float64)
    r[2, 7] = 1.0
    p = 1 / 144
    z = (1 - 1 / 24) / (math.sqrt(p * (1 - p)) + 1e-4)                # the outlier's raw A
    assert z == pytest.approx(11.5, abs=0.05)
    a, _ = V.group_advantages(r)                                       # clamp 5, η 3, global std
    assert a[2, 7].item() == pytest.approx(3 * math.tanh(5 / 3), abs=1e-5)
    assert a[2, 7].item() == pytest.approx(2.79, abs=5e-3)
    free, _ = V.group_advantages(r, clamp=math.inf)
    assert free[2, 7].item() == pytest.approx(3 * math.tanh(z / 3), abs=1e-5)
    assert free[2, 7].item() == pytest.approx(3.00, abs=5e-3)
    # a per-group std bounds |A| by √(G − 1) < 5: there the clamp never acts
    g, _ = V.group_advantages(r, global_std=False, eta=0.0)
    assert g.abs().max().item() == pytest.approx(math.sqrt(23), rel=1e-3) and g.abs().max() < 5


@pytest.mark.math
def test_constant_group_gives_zeros_not_nan():
    r = torch.tensor([[3.0, 3.0, 3.0], [1.0, 2.0, 3.0]])
    for g in (True, False):
        a, _ = V.group_advantages(r, global_std=g)
        assert torch.isfinite(a).all()
        assert (a[0] == 0).all()
    a, _ = V.group_advantages(torch.full((2, 4), 7.0))     # every group constant, global std 0
    assert (a == 0).all()


@pytest.mark.math
def test_nonfinite_rewards_are_dropped():
    r = torch.tensor([[1.0, float("nan"), 3.0, 5.0], [float("inf"), 2.0, float("nan"), float("nan")]])
    a, st = V.group_advantages(r, global_std=False, std_eps=0.0, clamp=100.0, eta=0.0)
    assert torch.isfinite(a).all()
    assert a[0, 1] == 0 and (a[1] == 0).all()                # dropped, and a group with < 2 finite
    ref, _ = V.group_advantages(torch.tensor([[1.0, 3.0, 5.0]]), global_std=False, std_eps=0.0,
                                clamp=100.0, eta=0.0)
    torch.testing.assert_close(a[0, [0, 2, 3]], ref[0])
    assert st["frac_dropped"] == pytest.approx(4 / 8)


@pytest.mark.math
def test_weighted_sum_aggregation_by_hand():
    r = torch.tensor([[[1.0, 3.0]], [[10.0, 0.0]]])                 # K=2 rewards, P=1, G=2
    w = torch.tensor([1.0, 0.5])
    a, _ = V.weighted_sum_advantages(r, w, global_std=False, std_eps=0.0, clamp=100.0, eta=0.0)
    # totals 6 and 3 → mean 4.5, std 1.5 → ±1
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0]]))


@pytest.mark.math
def test_per_reward_aggregation_by_hand():
    r = torch.tensor([[[1.0, 3.0, 5.0]], [[0.0, 0.0, 9.0]]])        # K=2, P=1, G=3
    w = torch.tensor([3.0, 1.0])                                     # normalised to 0.75, 0.25
    a, _ = V.per_reward_advantages(r, w, std_eps=0.0, clamp=100.0, eta=0.0)
    # MixGRPO's advantage_aggr uses torch.std(): the UNBIASED group std (divide by G − 1)
    z1 = torch.tensor([-2.0, 0.0, 2.0]) / math.sqrt(8 / 2)          # mean 3, sample std 2
    z2 = torch.tensor([-3.0, -3.0, 6.0]) / math.sqrt(54 / 2)        # mean 3, sample std sqrt(27)
    torch.testing.assert_close(a[0], 0.75 * z1 + 0.25 * z2)
    # a sample with one non-finite component is dropped from every reward's statistics
    r2 = r.clone()
    r2[1, 0, 0] = float("nan")
    a2, st = V.per_reward_advantages(r2, w, std_eps=0.0, clamp=100.0, eta=0.0)
    assert a2[0, 0] == 0 and st["frac_dropped"] == pytest.approx(1 / 3)
    # two finite samples each: ±d / (|2d| / sqrt(2)) = ±1/sqrt(2) per reward
    z = torch.tensor([-1.0, 1.0]) / math.sqrt(2)
    torch.testing.assert_close(a2[0, 1:], 0.75 * z + 0.25 * z)
    # soft-clip bound holds after aggregation
    a3, _ = V.per_reward_advantages(r * 100, w, eta=0.5)
    assert a3.abs().max() <= 0.5


@pytest.mark.math
def test_per_reward_global_std_is_the_unbiased_batch_std_by_hand():
    """--reward_aggregation per_reward --global_std: each reward's deviations from its group mean
    divided by that reward's UNBIASED std over the whole batch (all P·G rewards around the batch
    mean, n − 1 = 5), as MixGRPO's torch.std(); with the population std (÷ 6) every advantage
    would be sqrt(6/5) = 1.095 times larger, far outside the fp32 tolerance."""
    r = torch.tensor([[[1.0, 3.0, 5.0], [0.0, 2.0, 1.0]],              # K=2, P=2, G=3
                      [[4.0, 0.0, 2.0], [6.0, 9.0, 0.0]]])
    w = torch.tensor([1.0, 3.0])                                      # normalised to 0.25, 0.75
    a, _ = V.per_reward_advantages(r, w, global_std=True, std_eps=0.0, clamp=100.0, eta=0.0)
    # reward 1: group means 3, 1; batch mean 2; Σ(r − 2)² = 1+1+9+4+0+1 = 16 → std sqrt(16/5)
    z1 = torch.tensor([[-2.0, 0.0, 2.0], [-1.0, 1.0, 0.0]]) / math.sqrt(16 / 5)
    # reward 2: group means 2, 5; batch mean 3.5; Σ(r − 3.5)² = 0.25+12.25+2.25+6.25+30.25+12.25
    #   = 63.5 → std sqrt(63.5/5)
    z2 = torch.tensor([[2.0, -2.0, 0.0], [1.0, 4.0, -5.0]]) / math.sqrt(63.5 / 5)
    torch.testing.assert_close(a, 0.25 * z1 + 0.75 * z2, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# 2. Math §5: the shared, stratified (t, ε) pairs
# ------------------------------------------------------------------------------------------------
@pytest.mark.math
def test_stratified_pairs_one_t_per_stratum():
    grid = V.sigma_grid(40, 3.0)[:-1]                           # 40 points, no terminal 0
    chunks = torch.tensor_split(grid, 4)
    for seed in range(20):
        p = V.draw_pairs(grid, 4, (2, 3, 3), torch.zeros(6, dtype=torch.long),
                         generator=torch.Generator().manual_seed(seed))
        assert p.t.shape == (1, 4) and p.eps.shape == (1, 4, 2, 3, 3)
        for j in range(4):
            assert any(torch.isclose(p.t[0, j].double(), chunks[j]).tolist()), (j, p.t)
    # every grid point of a stratum is reachable
    seen = {float(V.draw_pairs(grid, 4, (1,), torch.zeros(1, dtype=torch.long),
                               generator=torch.Generator().manual_seed(s)).t[0, 0]) for s in range(400)}
    assert len(seen) == len(chunks[0])


@pytest.mark.math
def test_pair_sharing_scopes():
    N, G = 12, 4
    grid = V.sigma_grid(10)[:-1]
    g = lambda: torch.Generator().manual_seed(0)
    batch = V.draw_pairs(grid, 4, (3,), torch.zeros(N, dtype=torch.long), generator=g())
    t, e = batch.take(torch.arange(N))
    assert (t == t[:1]).all() and (e == e[:1]).all()                       # one set for all samples
    group = V.draw_pairs(grid, 4, (3,), torch.arange(N) // G, generator=g())
    t, e = group.take(torch.arange(N))
    for k in range(N // G):
        assert (e[k * G:(k + 1) * G] == e[k * G]).all() and (t[k * G:(k + 1) * G] == t[k * G]).all()
    assert not torch.equal(e[0], e[G])                                     # groups differ
    none = V.draw_pairs(grid, 4, (3,), torch.arange(N), generator=g())
    _, e = none.take(torch.arange(N))
    assert not torch.equal(e[0], e[1])


@pytest.mark.math
def test_unstratified_pairs_cover_grid():
    grid = V.sigma_grid(8)[:-1]
    p = V.draw_pairs(grid, 4, (1,), torch.arange(500), stratified=False, generator=torch.Generator().manual_seed(0))
    assert set(p.t.flatten().tolist()) == set(grid.float().tolist())


# ------------------------------------------------------------------------------------------------
# 3. Math §5–§6: the surrogate, the ratio and the loss
# ------------------------------------------------------------------------------------------------
@pytest.mark.math
def test_surrogate_matches_official_x_prediction_form():
    torch.manual_seed(0)
    x0, eps, v = torch.randn(5, 4, 3, 3), torch.randn(5, 4, 3, 3), torch.randn(5, 4, 3, 3)
    t = torch.rand(5)
    z = V.interpolate(x0, eps, t)
    x0_pred = z - V.bcast(t, z) * v                                        # paper P7
    ref = -((x0_pred - x0) ** 2).flatten(1).mean(1) / (x0_pred - x0).abs().flatten(1).mean(1)
    s = V.surrogate_from_velocity(v, x0, eps, t)
    torch.testing.assert_close(s, ref, atol=1e-5, rtol=1e-5)
    plain = V.surrogate_from_velocity(v, x0, eps, t, parameterization="v", adaptive=False)
    torch.testing.assert_close(plain, -((v - (eps - x0)) ** 2).flatten(1).mean(1))
    e_pred = z + V.bcast(1 - t, z) * v                                     # ε̂ = z + (1 − t)·v̂
    ref_e = -((e_pred - eps) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(V.surrogate_from_velocity(v, x0, eps, t, parameterization="eps", adaptive=False),
                               ref_e, atol=1e-5, rtol=1e-5)


@pytest.mark.math
def test_adaptive_weighting_gradient_is_mse_over_detached_mae():
    torch.manual_seed(0)
    x0, eps, t = torch.randn(2, 8), torch.randn(2, 8), torch.tensor([0.3, 0.8])
    v = torch.randn(2, 8, requires_grad=True)
    V.surrogate_from_velocity(v, x0, eps, t).sum().backward()
    e = (V.bcast(t, v) * (v - (eps - x0))).detach()
    mae = e.abs().mean(1, keepdim=True)
    # d/dv [−mean(e²)/sg(mae)] = −2·e·t / (d·mae)
    torch.testing.assert_close(v.grad, -2 * e * V.bcast(t, v) / (8 * mae), atol=1e-6, rtol=1e-5)


class LinearVelocity(torch.nn.Module):
    """v(x, t, c) = W[c] x + b[c]·t: separate parameters per condition, so per-sample effects of an
    update can be read off without cross-talk."""

    def __init__(self, n_cond: int, d: int):
        super().__init__()
        self.W = torch.nn.Parameter(0.1 * torch.randn(n_cond, d, d, dtype=torch.float64))
        self.b = torch.nn.Parameter(0.1 * torch.randn(n_cond, d, dtype=torch.float64))

    def forward(self, x, t, c):
        return torch.einsum("nij,nj->ni", self.W[c], x) + self.b[c] * t[:, None]


def _toy_batch(m=4, d=6, J=4, seed=0):
    torch.manual_seed(seed)
    model = LinearVelocity(m, d)
    x0 = torch.randn(m, d, dtype=torch.float64)
    pairs = V.draw_pairs(V.sigma_grid(16)[:-1], J, (d,), torch.zeros(m, dtype=torch.long),
                         generator=torch.Generator().manual_seed(seed))
    t, e = pairs.take(torch.arange(m))
    return model, x0, torch.arange(m), t.double(), e.double()


@pytest.mark.math
def test_ratio_is_one_when_theta_equals_theta_old():
    model, x0, c, t, e = _toy_batch()
    with torch.no_grad():
        s_old = V.pair_surrogates(model, x0, c, t, e)[0]
    s_new = V.pair_surrogates(model, x0, c, t, e)[0]                # same pairs, same θ
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    loss, st = V.vgrpo_loss(s_new, s_old, adv, clip_eps=0.01)
    assert st["ratio"] == 1.0 and st["abs_log_ratio"] == 0.0 and st["clip_frac"] == 0.0
    assert torch.isclose(loss, -adv.mean().float())
    # antisymmetry with θ = θ_old and β = 0 (ours C18)
    loss_neg, _ = V.vgrpo_loss(s_new, s_old, -adv, clip_eps=0.01)
    assert torch.isclose(loss, -loss_neg)


@pytest.mark.math
@pytest.mark.parametrize("sign", [+1.0, -1.0])
def test_one_step_follows_advantage_sign(sign):
    model, x0, c, t, e = _toy_batch()
    with torch.no_grad():
        s_old = V.pair_surrogates(model, x0, c, t, e)[0]
    adv = torch.tensor([sign, 0.0, 0.0, 0.0])
    loss, _ = V.vgrpo_loss(V.pair_surrogates(model, x0, c, t, e)[0], s_old, adv)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-2 * p.grad
        s_after = V.pair_surrogates(model, x0, c, t, e)[0]
    _, st = V.vgrpo_loss(s_after[:1], s_old[:1], adv[:1])
    # surrogate loss of sample 0 = −mean_j s: falls for A > 0, rises for A < 0; ratio the other way
    assert sign * (s_after[0].mean() - s_old[0].mean()) > 0
    assert sign * (st["ratio"] - 1) > 0
    torch.testing.assert_close(s_after[1:], s_old[1:])          # A = 0 samples are untouched


@pytest.mark.math
def test_loss_equals_slow_reference_loop():
    torch.manual_seed(1)
    m, J = 6, 4
    s_old = -torch.rand(m, J, dtype=torch.float64)
    s_new = (s_old + 0.05 * torch.randn(m, J, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(m, dtype=torch.float64)
    kl = torch.rand(m, J, dtype=torch.float64)
    eps_c, beta = 0.02, 0.3
    loss, st = V.vgrpo_loss(s_new, s_old, adv, clip_eps=eps_c, kl=kl, kl_coef=beta)
    ref, n_clip = 0.0, 0
    for n in range(m):
        r = math.exp(sum(s_new[n].tolist()) / J - sum(s_old[n].tolist()) / J)
        pg = max(-adv[n].item() * r, -adv[n].item() * min(max(r, 1 - eps_c), 1 + eps_c))
        ref += (pg + beta * sum(kl[n].tolist()) / J) / m
        n_clip += abs(r - 1) > eps_c
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert st["clip_frac"].item() == pytest.approx(n_clip / m)
    assert 0 < n_clip < m                                          # the test exercises both branches
    loss.backward()
    # a clipped sample whose clip branch wins has zero policy gradient
    r = torch.exp(s_new.detach().mean(1) - s_old.mean(1))
    dead = ((r > 1 + eps_c) & (adv > 0)) | ((r < 1 - eps_c) & (adv < 0))
    assert dead.any() and (s_new.grad[dead] == 0).all()


@pytest.mark.math
def test_pair_surrogates_equals_per_pair_loop():
    model, x0, c, t, e = _toy_batch(m=3, J=5)
    s, x0h = V.pair_surrogates(model, x0, c, t, e)
    for n in range(3):
        for j in range(5):
            z = (1 - t[n, j]) * x0[n] + t[n, j] * e[n, j]
            v = model(z[None], t[n, j][None], c[n:n + 1])[0]
            xh = z - t[n, j] * v
            ref = -((xh - x0[n]) ** 2).mean() / (xh - x0[n]).abs().mean()
            assert s[n, j].item() == pytest.approx(ref.item(), rel=1e-5)
            torch.testing.assert_close(x0h[n, j], xh.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.math
def test_surrogate_cv():
    S = torch.tensor([[-1.0, -3.0], [-2.0, -2.0]])
    cv = V.surrogate_cv(S)
    assert cv["surrogate_cv"].item() == pytest.approx(math.sqrt(0.5) / 2)
    assert cv["surrogate_cv_group"].item() == pytest.approx((1 / 2 + 0) / 2)


def _readme_block(after: str, nth: int = 0) -> str:
    """The nth ```python block of README.md after the heading/text `after`."""
    section = (ROOT / "README.md").read_text().split(after, 1)[1]
    return re.findall(r"```python\n(.*?)```", section, re.S)[nth]


@pytest.mark.math
def test_math_block_runs_alone(monkeypatch):
    """The pure math (§2–§6, between the `# === pure math: begin/end ===` markers) lifts out:
    executed from the file text with only the imports the README lists, it runs the README's
    "Use the loss in your own trainer" snippet, with the same loss as `import vgrpo`."""
    text = (ROOT / "vgrpo.py").read_text()
    begin, end = "# === pure math: begin ===", "# === pure math: end ==="
    assert text.count(begin) == 1 and text.count(end) == 1
    block = text[text.index(begin):text.index(end)]
    assert "# §2" in block and "# §6" in block and "# §7" not in block
    tree = ast.parse(block)
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    heading = "## Use the loss in your own trainer"
    imports = _readme_block(heading, 1)                       # the README's list of imports
    assert set(re.findall(r"^(?:import|from)\s+(\S+)", imports, re.M)) <= {
        "__future__", "math", "dataclasses", "typing", "torch"}
    mod = types.ModuleType("vgrpo_math_only")
    monkeypatch.setitem(sys.modules, "vgrpo_math_only", mod)
    exec(compile(imports + block, "vgrpo.py[pure math]", "exec"), mod.__dict__)
    defined = {k for k in mod.__dict__ if not k.startswith("__")}
    # statically too: every name the block reads is its own, an import above, or a builtin
    nodes = list(ast.walk(tree))
    local = {a.arg for a in nodes if isinstance(a, ast.arg)} | {
        n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | {
        n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    read = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert read - local - defined - set(dir(builtins)) == set()
    listed = set(re.findall(r"`(\w+)`", (ROOT / "README.md").read_text().split(
        "It defines ", 1)[1].split("The snippet above", 1)[0]))
    assert listed == defined - {"annotations", "math", "dataclass", "Callable", "Optional", "torch"}

    snippet = _readme_block(heading, 0)
    results = {}
    for name, module in (("lifted", mod), ("vgrpo", V)):
        monkeypatch.setitem(sys.modules, "vgrpo", module)
        torch.manual_seed(0)
        ns = {}
        exec(compile(snippet, "README.md", "exec"), ns)
        assert torch.isfinite(ns["loss"]) and ns["net"].weight.grad.abs().sum() > 0
        results[name] = (ns["loss"].detach(), ns["net"].weight.grad.clone())
    # same process, same ops in the same order: the two runs agree bit for bit
    assert torch.equal(results["lifted"][0], results["vgrpo"][0])
    assert torch.equal(results["lifted"][1], results["vgrpo"][1])


# ------------------------------------------------------------------------------------------------
# 4. Math §3: the samplers on an analytic field
#    Data N(μ, s²) per coordinate ⇒ the exact ODE map is x0 = μ + s·x1, and
#    v(x, t) = m'(t) + σ'(t)/σ(t)·(x − m(t)) with m = (1 − t)μ, σ² = (1 − t)²s² + t².
# ------------------------------------------------------------------------------------------------
MU, SD = 1.5, 0.8


def gaussian_velocity(x, t, cond):
    t = V.bcast(t.double(), x)
    m, sig = (1 - t) * MU, ((1 - t) ** 2 * SD ** 2 + t ** 2).sqrt()
    return -MU + (-(1 - t) * SD ** 2 + t) / sig ** 2 * (x - m)


@pytest.mark.math
@pytest.mark.parametrize("solver,order", [("euler", 1), ("dpmpp2m", 2)])
def test_sampler_reaches_closed_form_endpoint(solver, order):
    x1 = torch.linspace(-3, 3, 61, dtype=torch.float64)[:, None]
    err = []
    for K in (40, 80, 160):
        out = V.SOLVERS[solver](gaussian_velocity, x1, V.sigma_grid(K))
        err.append((out - (MU + SD * x1)).abs().max().item())
    assert err[-1] < (2e-2 if order == 1 else 1e-3)
    # convergence order: halving the step divides the error by ~2 (Euler) or ~4 (2nd order)
    assert err[1] / err[2] > (1.8 if order == 1 else 3.2), err


@pytest.mark.math
@pytest.mark.parametrize("solver", ["euler", "dpmpp2m"])
def test_samplers_accumulate_a_bf16_x1_in_fp32(solver):
    """A bf16 x1 (a user's bf16 noise): the solve accumulates in ≥ fp32 and returns bf16, so it
    stays within bf16's own rounding of the fp64 solve from the same x1. K = 40 steps, |x0| < 4:
    the endpoint's rounding to bf16 alone is up to half an ulp, 2⁻⁸·4 = 0.0078, plus x rounded
    to bf16 at each velocity input, which the contracting field damps (measured 0.0075 here,
    ≤ 0.0093 for K = 10…80): 0.02. Accumulating x itself in bf16 rounds every one of the K
    updates and drifts: 0.046 (Euler) and 0.086 (DPM++ 2M) measured at K = 40."""
    x1 = torch.linspace(-3, 3, 61, dtype=torch.float64)[:, None].bfloat16()
    fp64 = V.SOLVERS[solver](gaussian_velocity, x1.double(), V.sigma_grid(40))
    out = V.SOLVERS[solver](gaussian_velocity, x1, V.sigma_grid(40))
    assert out.dtype == torch.bfloat16
    err = (out.double() - fp64).abs().max().item()
    assert err < 0.02, err


@pytest.mark.math
def test_samplers_exact_for_point_mass():
    # data = a point μ: v = (x − μ)/t is linear in t along trajectories, every solver is exact
    mu = torch.tensor([[0.5, -2.0]], dtype=torch.float64)
    x1 = torch.randn(3, 2, dtype=torch.float64)
    f = lambda x, t, c: (x - mu) / V.bcast(t.double(), x)
    for solver in V.SOLVERS.values():
        torch.testing.assert_close(solver(f, x1, V.sigma_grid(7, 3.0)), mu.expand(3, 2))


@pytest.mark.math
def test_sigma_grid_is_the_shifted_uniform_grid():
    """FLUX's rollout grid: K + 1 times from exactly 1 to exactly 0, SD3's resolution shift of
    linspace(1, 0, K + 1) (checked in float64 against the closed form σ = 3s / (1 + 2s))."""
    for K in (6, 16):
        s = torch.linspace(1, 0, K + 1, dtype=torch.float64)
        g = V.sigma_grid(K, 3.0)
        assert g.dtype == torch.float64 and g[0] == 1.0 and g[-1] == 0.0
        torch.testing.assert_close(g, 3 * s / (1 + 2 * s), atol=1e-15, rtol=0)
        assert (g[1:] < g[:-1]).all()


# ------------------------------------------------------------------------------------------------
# 5. The trainer end to end on the tiny SD3 pipeline
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_two_iterations_change_lora_and_nothing_else(tmp_path, monkeypatch):
    captured = {}
    real_add_lora = V.add_lora

    def spy(transformer, *a, **k):
        captured["tr"] = transformer
        captured["before"] = {n: p.detach().clone() for n, p in transformer.named_parameters()}
        return real_add_lora(transformer, *a, **k)

    monkeypatch.setattr(V, "add_lora", spy)
    args = V.parse_args(TINY + ["--run_dir", str(tmp_path / "run")])
    hist = V.train(args)
    assert len(hist) == 2 and all(math.isfinite(m["reward_mean"]) for m in hist)
    after = dict(captured["tr"].named_parameters())
    lora = [n for n in after if "lora_" in n]
    assert lora, "no LoRA parameters were added"
    # B starts at zero, A Gaussian: after two steps every LoRA B matrix has moved off zero, except
    # the last block's context query, whose output SD3 discards (context_pre_only) — no gradient
    last = captured["tr"].config.num_layers - 1
    unused = {n for n in lora if n.startswith(f"transformer_blocks.{last}.attn.add_q_proj.")}
    assert all(after[n].abs().sum() > 0 for n in lora if "lora_B" in n and n not in unused)
    base = {n.replace(".base_layer", ""): p for n, p in after.items() if "lora_" not in n}
    assert set(base) == set(captured["before"])                    # peft only wrapped, added nothing else
    for n, p in captured["before"].items():
        assert torch.equal(base[n], p), f"frozen weight {n} changed"
        assert not base[n].requires_grad
    assert all(after[n].requires_grad for n in lora)


@pytest.mark.trainer
def test_tiny_pipeline_roundtrips_through_the_hub_loading_path(tmp_path):
    pipe = TM.build_tiny_sd3_pipeline()
    pipe.save_pretrained(tmp_path / "tiny")
    loaded = V.load_pipeline(str(tmp_path / "tiny"), torch.float32)
    assert type(loaded).__name__ == "StableDiffusion3Pipeline"
    a, b = V.SD3Adapter(pipe, torch.device("cpu"), 16), V.SD3Adapter(loaded, torch.device("cpu"), 16)
    x = torch.randn(2, 16, 8, 8)
    t = torch.tensor([0.3, 0.9])
    with torch.no_grad():
        torch.testing.assert_close(a.velocity(x, t, a.encode(["a cat", "a dog"])),
                                   b.velocity(x, t, b.encode(["a cat", "a dog"])))
    # and the CLI runs on it like on a hub model
    sizes = ["--resolution", "64", "--max_sequence_length", "32", "--lora_rank", "8", "--lora_alpha", "16"]
    assert V.main(TINY + sizes + ["--model", str(tmp_path / "tiny"), "--iterations", "1",
                                  "--run_dir", str(tmp_path / "run")]) == 0


@pytest.mark.trainer
def test_checkpoint_lora_loads_into_a_fresh_pipeline(tmp_path):
    run = tmp_path / "run"
    assert V.main(TINY + ["--run_dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "iter_000002"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["iteration"] == 2 and state["config"]["model"] == "tiny" and state["optimizer_saved"]
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)    # keyed by parameter name
    assert optim["state"] and all("lora_" in k for k in optim["state"])
    # trained velocity, reconstructed by the trainer's own loader
    trained = V.load_pipeline("tiny", torch.float32)
    V.add_lora(trained.transformer, 8, 16, V.Args.lora_targets.split(","))
    V.load_trainable(V.SD3Adapter(trained, torch.device("cpu"), 32), ckpt, False)
    # the same LoRA through diffusers' public API
    fresh = V.load_pipeline("tiny", torch.float32)
    base = V.SD3Adapter(V.load_pipeline("tiny", torch.float32), torch.device("cpu"), 32)
    fresh.load_lora_weights(str(ckpt))
    x, t = torch.randn(2, 16, 8, 8), torch.tensor([0.5, 0.7])
    with torch.no_grad():
        ad_f, ad_t = V.SD3Adapter(fresh, torch.device("cpu"), 32), V.SD3Adapter(trained, torch.device("cpu"), 32)
        c = ad_f.encode(["a", "b"])
        v_f, v_t, v_0 = ad_f.velocity(x, t, c), ad_t.velocity(x, t, c), base.velocity(x, t, c)
    torch.testing.assert_close(v_f, v_t, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(v_f, v_0)                              # the LoRA does something


@pytest.mark.trainer
def test_metrics_line_has_every_documented_field(tmp_path):
    assert V.main(TINY + ["--iterations", "1", "--eval_every", "1", "--run_dir", str(tmp_path)]) == 0
    ms = _metrics(tmp_path)
    train_m = [m for m in ms if "reward_mean" in m][0]
    for k in ("reward_mean", "reward_std", "adv_mean", "adv_std", "adv_absmax", "abs_log_ratio", "clip_frac",
              "approx_kl", "surrogate_cv", "surrogate_cv_group", "grad_norm", "lr", "time_rollout",
              "time_reward", "time_old", "time_update", "nfe_rollout", "nfe_old", "nfe_theta"):
        assert k in train_m and train_m[k] == train_m[k], k        # present and not NaN
    assert train_m["abs_log_ratio"] < 1e-5                           # μ = 1: ratio ≡ 1 (fp32, CPU)
    evals = [m for m in ms if "eval_reward_mean" in m]
    assert [e["iter"] for e in evals] == [0, 1]
    assert Path(tmp_path, "eval", "iter_000000.png").is_file() and Path(tmp_path, "eval", "iter_000001.png").is_file()


@pytest.mark.trainer
def test_off_policy_controls_run(tmp_path):
    """μ = 2 with ratio clip and x-space KL: the second step is off-policy, so ρ ≠ 1 there."""
    assert V.main(TINY + ["--iterations", "1", "--mu", "2", "--clip_eps", "1e-4", "--kl_coef", "0.3",
                          "--solver", "dpmpp2m", "--pair_sharing", "group", "--run_dir", str(tmp_path)]) == 0
    m = _metrics(tmp_path)[0]
    assert m["abs_log_ratio"] > 0 and m["kl_x"] > 0 and math.isfinite(m["grad_norm"])


def _smooth_reward(folder, monkeypatch=None) -> str:
    """A plug-in reward that moves smoothly with the pixels (mean colour), for comparisons across
    reduction orders (processes, batch splits, cached embeddings). JPEG size is a step function of
    the pixels: a float-rounding difference can flip whole bytes, so it is never compared there."""
    (folder / "meancolour.py").write_text(
        "def mean_colour(images, prompts):\n    return images.float().mean(dim=(1, 2, 3))\n")
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(folder))
    return "meancolour:mean_colour"


@pytest.mark.trainer
def test_offloaded_text_encoders_give_the_same_run(tmp_path, monkeypatch):
    """--offload_text_encoders embeds every prompt once and answers from the cache afterwards."""
    smooth = TINY + ["--reward", _smooth_reward(tmp_path, monkeypatch), "--eval_every", "1"]
    assert V.main(smooth + ["--run_dir", str(tmp_path / "a")]) == 0
    assert V.main(smooth + ["--offload_text_encoders", "--run_dir", str(tmp_path / "b")]) == 0
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    # The cache embeds prompts in other batch sizes than the loop does: the same embeddings up to
    # fp32 rounding (~1e-7 relative), which two Adam steps at lr 1e-2 carry into the images at
    # ≲ 1e-5. A smooth reward (mean colour ≈ 0.5) moves as little: 1e-4 absolute; the gradient
    # norm and surrogate CV, smooth in the same numbers, 1e-3 relative.
    assert a and [m["iter"] for m in a] == [m["iter"] for m in b]   # zip below: both whole
    for x, y in zip(a, b):
        for k in ("reward_mean", "eval_reward_mean"):
            if k in x:
                assert x[k] == pytest.approx(y[k], abs=1e-4), (x["iter"], k)
        for k in ("grad_norm", "surrogate_cv"):
            if k in x:
                assert x[k] == pytest.approx(y[k], rel=1e-3), (x["iter"], k)
    ad = V.SD3Adapter(TM.build_tiny_sd3_pipeline(), torch.device("cpu"), 32)
    ad.cache_prompts(["a cat", "a dog"])
    with pytest.raises(ValueError, match="not among the cached embeddings"):
        ad.encode(["a bird"])


@pytest.mark.trainer
def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert V.main(TINY + ["--iterations", "1", "--run_dir", str(tmp_path / "run")]) == 0
    finally:
        os.umask(old)
    ck = tmp_path / "run" / "checkpoints" / "iter_000001"
    assert ck.stat().st_mode & 0o777 == 0o755
    files = list(ck.iterdir())
    assert files                                                   # the loop checks something
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o644, f

@pytest.mark.trainer
def test_the_last_line_names_the_run_folder_and_the_final_checkpoint(tmp_path, capsys):
    """A finished run ends with its folder, its final checkpoint and the diffusers call that loads it;
    --keep_checkpoints 2 keeps the two newest, and the run goes on from the newest."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "4", "--keep_checkpoints", "2", "--run_dir", str(run)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    ckpt = run / "checkpoints" / "iter_000004"
    assert last == (f"done: run folder {run}, final checkpoint {ckpt}; in diffusers: "
                    f"pipe.load_lora_weights({str(ckpt)!r}) (docs/training.md, \"Using the trained model\")")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000003", "iter_000004", "latest"]
    assert V.main(["--resume", str(run), "--iterations", "5"]) == 0
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000004", "iter_000005", "latest"]


# ------------------------------------------------------------------------------------------------
# 6. The first step: ρ ≡ 1 at θ = θ_old, S_old completed from its forward
# ------------------------------------------------------------------------------------------------
def _count_surrogate_passes(monkeypatch):
    """Wrap V.surrogate_pass: every call's (grad enabled?, rows) in order."""
    calls, real = [], V.surrogate_pass

    def spy(run, ro, pairs, rows):
        calls.append((torch.is_grad_enabled(), rows.clone()))
        return real(run, ro, pairs, rows)
    monkeypatch.setattr(V, "surrogate_pass", spy)
    return calls


@pytest.mark.trainer
def test_mu_one_runs_no_separate_theta_old_pass_and_its_ratio_is_exactly_one(tmp_path, monkeypatch):
    """At μ = 1 the update pass is θ_old's pass (θ = θ_old): no no-grad surrogate forward runs,
    S_old = sg(S_θ), so ρ is exactly 1 (the same tensor on both sides of the subtraction)."""
    calls = _count_surrogate_passes(monkeypatch)
    assert V.main(TINY + ["--iterations", "2", "--micro_batch", "4", "--run_dir", str(tmp_path)]) == 0
    assert calls and all(grad for grad, _ in calls)                 # only the update's passes
    assert len(calls) == 2 * 2                                      # 6 samples in 4 + 2, twice
    ms = _strip_times(_metrics(tmp_path))
    assert [m["iter"] for m in ms] == [0, 1]                        # the loop below checks both
    for m in ms:
        assert m["ratio"] == 1.0 and m["abs_log_ratio"] == 0.0 and m["approx_kl"] == 0.0
        assert m["nfe_old"] == 0 and m["nfe_theta"] == 4


@pytest.mark.trainer
def test_mu_two_first_step_equals_a_separate_no_grad_pass(tmp_path, monkeypatch):
    """At μ = 2 only the second minibatch gets the no-grad θ_old pass; the first step's S_old and
    the x̂0_old of its KL, taken from its own pass with grad, equal a separate no-grad pass at
    θ_old on the same rows (same process, same micro-batch shapes: the same float operations, so
    exactly), and `iteration` completes S_old with them."""
    calls = _count_surrogate_passes(monkeypatch)
    seen, real_update, real_kl, kl_old = {}, V.update_steps, V.xspace_kl, []

    def kl(x0_hat, x0_hat_old):
        kl_old.append(x0_hat_old.clone())
        return real_kl(x0_hat, x0_hat_old)
    monkeypatch.setattr(V, "xspace_kl", kl)

    def update(run, ro, sc, pairs, mbs, s_old):
        seen["n_step4"] = len(calls)                # the passes of step 4, before this one
        with torch.no_grad():                       # θ = θ_old still: a separate pass, all rows
            sep = V.old_surrogates(run, ro, pairs, mbs, True)
        seen["s_sep"], seen["x_sep"] = sep.s, sep.x0_hat
        seen["mbs"], seen["s_old"] = mbs, s_old.s
        return real_update(run, ro, sc, pairs, mbs, s_old)
    monkeypatch.setattr(V, "update_steps", update)
    assert V.main(TINY + ["--iterations", "1", "--mu", "2", "--micro_batch", "2", "--kl_coef", "0.1",
                          "--group_size", "4", "--run_dir", str(tmp_path)]) == 0
    first, later = seen["mbs"]                                            # the μ = 2 minibatches
    own = calls[:seen["n_step4"]]                                         # step 4's pass
    assert not any(grad for grad, _ in own)
    assert sorted(torch.cat([r for _, r in own]).tolist()) == sorted(later.tolist())  # k = 1 only
    assert torch.equal(seen["s_old"][first], seen["s_sep"][first])        # written by step 5
    micro = [(k, rows) for k, mb in enumerate(seen["mbs"]) for rows in mb.split(2)]
    assert len(kl_old) == len(micro)
    for (k, rows), x_old in zip(micro, kl_old):                           # what each KL used
        assert torch.equal(x_old, seen["x_sep"][rows]), k
    m = _metrics(tmp_path)[0]
    assert m["abs_log_ratio_first"] == 0.0 and m["abs_log_ratio"] > 0     # step 2 is off-policy
    assert m["nfe_old"] == 2.0                                          # N_MC · (μ − 1)/μ


@pytest.mark.trainer
def test_first_step_ratio_is_one_for_mu_above_one(tmp_path):
    """The first step's S_old is its own pass at θ = θ_old (ours C18): ρ ≡ 1 there for μ = 3 and
    uneven micro-batches too (4 samples per step in micro-batches of 3 + 1)."""
    assert V.main(TINY + ["--iterations", "1", "--mu", "3", "--micro_batch", "3",
                          "--group_size", "6", "--run_dir", str(tmp_path)]) == 0
    m = _metrics(tmp_path)[0]
    assert m["abs_log_ratio_first"] == 0.0
    assert m["abs_log_ratio"] > 1e-6                                 # later steps are off-policy


# ------------------------------------------------------------------------------------------------
# 7. The iteration's steps one by one: what the update receives
#    On one tiny run reset before each test.
# ------------------------------------------------------------------------------------------------
STEPS = ["--model", "tiny", "--reward", "jpeg", "--prompts_per_iter", "2", "--group_size", "3",
         "--num_steps", "4", "--eval_every", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny_run():
    """One tiny SD3 Run (no run folder), its iteration-0 rollouts and rewards, and reset(*flags):
    the LoRA back to its initial values, a fresh AdamW state and run.args = STEPS + flags. Only
    flags that the iteration reads from run.args may change (not the model, lr or resolution).
    The rollouts and rewards of iteration 0 depend on θ0 and the seed alone, so a test that
    replaces steps 1–2 by them (`_replay`) runs the same iteration as a fresh run would."""
    run = V.setup(V.parse_args(STEPS), pipe=TM.build_tiny_sd3_pipeline())
    theta0 = [p.detach().clone() for p in run.params]
    opt0 = copy.deepcopy(run.opt.state_dict())
    ro = V.collect_rollouts(run, 0)
    sc = V.reward_and_advantages(run, ro)

    def reset(*flags):
        run.args = V.parse_args(STEPS + [str(f) for f in flags])
        with torch.no_grad():
            for p, p0 in zip(run.params, theta0):
                p.copy_(p0)
                p.grad = None
        run.opt.load_state_dict(copy.deepcopy(opt0))
        run.run_dir, run.start = None, 0
        return run
    return types.SimpleNamespace(run=run, theta0=theta0, ro=ro, sc=sc, reset=reset)


def _replay(monkeypatch, tiny):
    """Steps 1–2 of every iteration answered by the cached rollouts and rewards of iteration 0."""
    monkeypatch.setattr(V, "collect_rollouts", lambda run, it: tiny.ro)
    monkeypatch.setattr(V, "reward_and_advantages", lambda run, ro: tiny.sc)


def _global_norm(params) -> float:
    grads = [p.grad.detach().double().flatten() for p in params if p.grad is not None]
    return torch.cat(grads).norm().item() if grads else 0.0


@contextlib.contextmanager
def _optimizer_steps(run):
    """The global norm of the gradient each optimizer step receives (after the clip), in order."""
    norms = []
    handle = run.opt.register_step_pre_hook(
        lambda opt, a, k: norms.append(_global_norm(run.params)))
    try:
        yield norms
    finally:
        handle.remove()


def _loss_calls(monkeypatch):
    """Wrap V.vgrpo_loss: every call's (loss, s_new, s_old), detached, in order."""
    calls, real = [], V.vgrpo_loss

    def spy(s_new, s_old, adv, **kw):
        loss, st = real(s_new, s_old, adv, **kw)
        calls.append((loss.detach(), s_new.detach().clone(), s_old.detach().clone()))
        return loss, st
    monkeypatch.setattr(V, "vgrpo_loss", spy)
    return calls


@pytest.mark.trainer
def test_micro_batches_change_memory_not_the_update(tiny_run, monkeypatch):
    """One micro-batch against unequal ones (6 vs 4 + 2 vs 5 + 1 at μ = 1; 3 vs 2 + 1 per step at
    μ = 2): the same minibatch loss, the same pre-clip gradient norm of every step, the same
    weights after the iteration. Tolerances: fp32 on the CPU, and the micro-batches only reorder
    the sums (rows per network call, gradient accumulation): measured ≤ 1e-7 relative on the
    gradient norm, so 1e-5. Adam's first step moves each weight by lr·g/(|g| + 1e-8) ≈ ±lr
    (1e-2): a weight whose gradient is near 1e-8 moves by a rounding-sensitive fraction of it
    (measured ≤ 1.3e-5), so 1e-4, 1 % of a step; a wrong weighting of micro-batches flips signs,
    i.e. moves weights by up to 2·lr. Also: exactly μ optimizer steps, the logged grad_norm is
    the mean of the steps' norms, no gradient is left behind, nfe_old and nfe_theta are the
    network rows run per sample, and with one micro-batch per step the logged |log ρ| is the
    mean over the samples (0 on the first step)."""
    _replay(monkeypatch, tiny_run)
    calls = _loss_calls(monkeypatch)
    rows, real_velocity = [], tiny_run.run.adapter.velocity

    def velocity(x, t, c):
        rows.append((torch.is_grad_enabled(), len(x)))
        return real_velocity(x, t, c)
    monkeypatch.setattr(tiny_run.run.adapter, "velocity", velocity)
    mbs_seen, real_mbs = [], V.minibatches

    def minibatches(run, it):
        mbs_seen.append(real_mbs(run, it))
        return mbs_seen[-1]
    monkeypatch.setattr(V, "minibatches", minibatches)
    for mu, sizes in ((1, (6, 4, 5)), (2, (3, 2))):
        results = []
        for mb in sizes:
            run = tiny_run.reset("--mu", mu, "--micro_batch", mb)
            calls.clear()
            rows.clear()
            with _optimizer_steps(run) as norms:
                m = V.iteration(run, 0)
            mbs = [(k, r) for k, step in enumerate(mbs_seen[-1]) for r in step.split(mb)]
            N, J = run.N, run.args.n_mc
            assert sum(n for grad, n in rows if grad) == m["nfe_theta"] * N == J * N
            assert (sum(n for grad, n in rows if not grad) == m["nfe_old"] * N
                    == J * N * (mu - 1) / mu)
            if mb == N // mu:                              # one micro-batch per step
                log_ratio = torch.cat([s.mean(dim=1) - o.mean(dim=1) for _, s, o in calls])
                assert m["abs_log_ratio"] == pytest.approx(log_ratio.abs().mean().item(), rel=1e-5)
                assert m["abs_log_ratio_first"] == 0.0 and (mu == 1) == (m["abs_log_ratio"] == 0)
            assert [len(r) for _, r in mbs] == {6: [6], 4: [4, 2], 5: [5, 1], 3: [3, 3],
                                                2: [2, 1, 2, 1]}[mb]
            # the loss the optimizer minimises: each step's mean over its samples
            step_loss = [sum(loss * len(s) for (k, _), (loss, s, _) in zip(mbs, calls) if k == j)
                         / sum(len(r) for k, r in mbs if k == j)
                         for j in range(mu)]
            assert len(norms) == mu                                   # one step per minibatch
            assert m["grad_norm"] == pytest.approx(sum(norms) / mu, rel=1e-5)   # under the clip
            assert all(p.grad is None for p in run.params)            # zeroed after every step
            results.append((mb, torch.stack(step_loss), norms,
                            [p.detach().clone() for p in run.params]))
        _, loss0, norms0, w0 = results[0]
        step = max((a - b).abs().max().item() for a, b in zip(w0, tiny_run.theta0))
        assert step == pytest.approx(mu * 1e-2, rel=0.1)               # the weights did move
        for mb, loss, norms, w in results[1:]:
            torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-7, msg=f"μ={mu} mb={mb}")
            assert norms == pytest.approx(norms0, rel=1e-5), (mu, mb)
            dw = max((a - b).abs().max().item() for a, b in zip(w, w0))
            assert dw < 1e-4, (mu, mb, dw)


@pytest.mark.trainer
def test_mu_two_gradient_is_each_minibatch_mean_loss_computed_directly(tiny_run, monkeypatch):
    """μ = 2 in micro-batches of 1: each step's pre-clip gradient norm, and the logged grad_norm
    (their mean), equal the norm of ∇ of the minibatch's mean loss computed here directly in one
    pass, at the weights that step saw (θ0, then θ1 recorded after the first step), on the same
    pairs and samples, with S_old from one no-grad pass at θ0. A micro-batch weighted by the
    process's samples instead of its minibatch's halves every norm (and --max_grad_norm would act
    at μ times the value asked). Tolerance: one pass of 3 samples against 3 accumulated passes
    of 1 reorders fp32 sums (≈ 1e-7 relative), so 1e-4; the fault is a factor of 2."""
    _replay(monkeypatch, tiny_run)
    run = tiny_run.reset("--mu", 2, "--micro_batch", 1, "--max_grad_norm", 1e9)
    ro, adv, a = tiny_run.ro, tiny_run.sc.adv, run.args
    pairs, mbs = V.draw_iteration_pairs(run, 0), V.minibatches(run, 0)
    with torch.no_grad():                                        # S_old of every sample at θ0
        s_old = V.surrogate_pass(run, ro, pairs, torch.arange(run.Nl))[0]
    pre_clip, theta, real_step = [], [], V.optimizer_step

    def step(r):
        theta.append([p.detach().clone() for p in r.params])     # the weights this step saw
        pre_clip.append(real_step(r).item())
        return torch.tensor(pre_clip[-1])
    monkeypatch.setattr(V, "optimizer_step", step)
    m = V.iteration(run, 0)
    assert len(pre_clip) == len(theta) == 2
    direct = []
    for weights, rows in zip(theta, mbs):
        with torch.no_grad():
            for p, w in zip(run.params, weights):
                p.copy_(w)
        s_new, _ = V.surrogate_pass(run, ro, pairs, rows)        # the whole minibatch at once
        loss, _ = V.vgrpo_loss(s_new, s_old[rows], adv[rows], clip_eps=a.clip_eps)
        grads = torch.autograd.grad(loss, run.params, allow_unused=True)
        direct.append(torch.cat([g.double().flatten() for g in grads if g is not None]).norm().item())
    assert len(direct) == 2 and all(d > 0 for d in direct)
    assert pre_clip == pytest.approx(direct, rel=1e-4)
    assert m["grad_norm"] == pytest.approx(sum(direct) / 2, rel=1e-4)


@pytest.mark.trainer
def test_theta_old_pass_runs_micro_batch_rows_per_call(tiny_run, monkeypatch):
    """Step 4's no-grad θ_old pass, like the update, runs --micro_batch samples per call (m·J
    network rows): the knob that an out-of-memory line in that phase advises. μ = 2 over 6
    samples, micro-batches of 1, --rollout_batch 16: the pass over the second minibatch is 3
    calls of 1 sample (J rows each), never one call of 3, and the update 6 calls of 1."""
    _replay(monkeypatch, tiny_run)
    run = tiny_run.reset("--mu", 2, "--micro_batch", 1, "--rollout_batch", 16)
    calls, rows_of, real_v, real_sur = [], [], run.adapter.velocity, V.surrogate_pass

    def velocity(x, t, c):
        calls.append((torch.is_grad_enabled(), len(x)))
        return real_v(x, t, c)

    def sur(r, ro, pairs, rows):
        rows_of.append((torch.is_grad_enabled(), len(rows)))
        return real_sur(r, ro, pairs, rows)
    monkeypatch.setattr(run.adapter, "velocity", velocity)
    monkeypatch.setattr(V, "surrogate_pass", sur)
    V.iteration(run, 0)
    J = run.args.n_mc
    assert [n for grad, n in rows_of if not grad] == [1, 1, 1]
    assert [n for grad, n in calls if not grad] == [J, J, J]
    assert [n for grad, n in rows_of if grad] == [1] * 6
    assert [n for grad, n in calls if grad] == [J] * 6


@pytest.mark.trainer
@pytest.mark.parametrize("sharing", ["batch", "group", "none"])
def test_pair_sharing_scope_reaches_the_update(tiny_run, monkeypatch, sharing):
    """--pair_sharing: the (t, ε) pairs each sample is scored on in the update (what the network
    sees) are shared by the whole batch, by each group of G, or by no two samples; and the
    iteration's pairs are redrawn every iteration, the same for the same iteration (resume)."""
    _replay(monkeypatch, tiny_run)
    run = tiny_run.reset("--pair_sharing", sharing, "--micro_batch", 4)
    rows_of, seen = [], []
    real_sur, real_pair = V.surrogate_pass, V.pair_surrogates

    def sur(run, ro, pairs, rows):
        rows_of.append(rows.clone())
        return real_sur(run, ro, pairs, rows)

    def pair(velocity_fn, x0, cond, t, eps, **kw):
        seen.append((t.clone(), eps.clone()))
        return real_pair(velocity_fn, x0, cond, t, eps, **kw)
    monkeypatch.setattr(V, "surrogate_pass", sur)
    monkeypatch.setattr(V, "pair_surrogates", pair)
    V.iteration(run, 0)
    assert len(rows_of) == len(seen) == 2                            # 4 + 2, μ = 1
    N, G, J = run.N, run.args.group_size, run.args.n_mc
    t, eps = torch.empty(N, J), torch.empty((N, J) + run.D)
    for rows, (tj, ej) in zip(rows_of, seen):
        t[rows], eps[rows] = tj, ej
    assert sorted(torch.cat(rows_of).tolist()) == list(range(N))
    scope = {"batch": [0] * N, "group": [n // G for n in range(N)], "none": list(range(N))}[sharing]
    for a in range(N):
        for b in range(a + 1, N):
            same = torch.equal(eps[a], eps[b])
            assert same == (scope[a] == scope[b]), (sharing, a, b)
            if same:
                assert torch.equal(t[a], t[b])
    p0, p0_again, p1 = (V.draw_iteration_pairs(run, it) for it in (0, 0, 1))
    assert torch.equal(p0.eps, p0_again.eps) and torch.equal(p0.t, p0_again.t)
    assert not torch.equal(p0.eps, p1.eps)


# Each ablation switch (README "Map from the paper to the code"), as the pure function of §3–§6 that
# must receive it, with a value other than its default: a flag the trainer dropped on its way would
# silently run the shipped recipe (the digits ablations would measure nothing).
ABLATIONS = {
    "stratified": (["--no-stratified"], "draw_pairs", {"stratified": False}),
    "parameterization": (["--parameterization", "v"], "pair_surrogates", {"parameterization": "v"}),
    "adaptive_weighting": (["--no-adaptive_weighting"], "pair_surrogates", {"adaptive": False}),
    "mae_floor": (["--mae_floor", "0.5"], "pair_surrogates", {"mae_floor": 0.5}),
    "advantages": (["--no-global_std", "--std_eps", "0.25", "--adv_clamp", "1.5", "--soft_clip_eta",
                    "0"], "weighted_sum_advantages",
                   {"global_std": False, "std_eps": 0.25, "clamp": 1.5, "eta": 0.0}),
    "per_reward": (["--reward_aggregation", "per_reward", "--global_std", "--std_eps", "0.25",
                    "--adv_clamp", "1.5", "--soft_clip_eta", "2"], "per_reward_advantages",
                   {"global_std": True, "std_eps": 0.25, "clamp": 1.5, "eta": 2.0}),
    "off_policy": (["--clip_eps", "0.02", "--kl_coef", "0.3"], "vgrpo_loss",
                   {"clip_eps": 0.02, "kl_coef": 0.3}),
}


@pytest.mark.parametrize("ablation", list(ABLATIONS))
@pytest.mark.trainer
def test_every_ablation_switch_reaches_the_math(tiny_run, monkeypatch, ablation):
    """Each switch's value arrives at the pure function that implements it, at every call of the
    iteration (real rewards: the advantages are computed, not replayed), and the default run
    passes the defaults there; the values asked differ from the defaults, so a switch that is
    dropped fails here."""
    flags, fn, want = ABLATIONS[ablation]
    monkeypatch.setattr(V, "collect_rollouts", lambda run, it: tiny_run.ro)
    real, seen = getattr(V, fn), []

    def spy(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)
    monkeypatch.setattr(V, fn, spy)
    # weighted_sum_advantages passes its keywords on to group_advantages, whose defaults apply
    default = inspect.signature(V.group_advantages if fn == "weighted_sum_advantages"
                                else real).parameters
    V.iteration(tiny_run.reset(), 0)                      # the default run: the defaults arrive
    if fn == "per_reward_advantages":
        assert seen == []                                 # "sum" is the default aggregation
    else:
        got = {k: seen[0].get(k, default[k].default) for k in want}
        assert got == {k: getattr(V.Args(), {"adaptive": "adaptive_weighting", "clamp": "adv_clamp",
                                             "eta": "soft_clip_eta"}.get(k, k)) for k in want}
        assert all(got[k] != v for k, v in want.items())
    seen.clear()
    V.iteration(tiny_run.reset(*flags), 0)
    assert seen and all({k: kw.get(k) for k in want} == want for kw in seen), (ablation, seen)
    if fn == "vgrpo_loss":                                # β > 0: the x-space KL is passed
        assert all(kw.get("kl") is not None for kw in seen)


@pytest.mark.trainer
def test_max_grad_norm_clips_what_the_optimizer_receives(tiny_run, monkeypatch):
    """--max_grad_norm 1e-4 (the tiny run's pre-clip norm is ≈ 3e-3): the gradient AdamW steps
    on has norm 1e-4 (clip_grad_norm_ scales by max/(norm + 1e-6): within 1e-3 below it), while
    the logged grad_norm is the pre-clip norm, the same as an unclipped run's (exactly: the norm
    is computed before the clip acts, on the same gradients)."""
    _replay(monkeypatch, tiny_run)
    got = {}
    for clip in (1.0, 1e-4):
        run = tiny_run.reset("--max_grad_norm", clip)
        with _optimizer_steps(run) as norms:
            got[clip] = (V.iteration(run, 0)["grad_norm"], norms)
    logged, (received,) = got[1e-4]
    assert received <= 1e-4 * (1 + 1e-5) and received == pytest.approx(1e-4, rel=1e-3)
    assert logged == got[1.0][0] and logged > 10 * 1e-4
    assert got[1.0][1] == [pytest.approx(logged, rel=1e-5)]         # unclipped: what it received


@pytest.mark.trainer
def test_nonfinite_gradient_skips_the_optimizer_step(tiny_run, monkeypatch):
    """A NaN loss (hence NaN gradients): the step is skipped, the weights stay as they were
    (AdamW would write NaN into them), the gradients are still zeroed, and the metrics say so."""
    _replay(monkeypatch, tiny_run)
    real = V.vgrpo_loss

    def nan_loss(*a, **k):
        loss, st = real(*a, **k)
        return loss * math.nan, st
    monkeypatch.setattr(V, "vgrpo_loss", nan_loss)
    run = tiny_run.reset()
    m = V.iteration(run, 0)
    assert m["nonfinite_grad_steps"] == 1.0 and math.isnan(m["grad_norm"])
    assert all(torch.equal(p, p0) for p, p0 in zip(run.params, tiny_run.theta0))
    assert all(p.grad is None for p in run.params) and not run.opt.state


@pytest.mark.trainer
def test_advantages_reach_their_own_samples(tiny_run, monkeypatch):
    """A reward that prefers one known sample per group (rows 0 and 4 of 2 groups of 3, another
    position in each group): one step at μ = 1 raises the surrogate S of that sample more than
    of any other sample of its group, on the same pairs (advantages permuted, rolled or
    transposed within the batch fail this). The reward sees each sample with its own prompt
    (prompt-major), and the network evaluations per sample are the logged nfe_rollout and
    nfe_theta."""
    run = tiny_run.reset()
    N, G = run.N, run.args.group_size
    preferred = torch.zeros(N)
    preferred[[0, 4]] = 1.0
    scored = {}

    def rewards(adapter, rw, names, latents, prompts, chunk, keep_images=False):
        scored["prompts"], scored["n"] = list(prompts), len(latents)
        return {n: preferred.clone() for n in names}, None
    monkeypatch.setattr(V, "decode_and_reward", rewards)
    got, real_update = {}, V.update_steps

    def update(run, ro, sc, pairs, mbs, s_old):
        out = real_update(run, ro, sc, pairs, mbs, s_old)
        got["done"] = True                                  # the iteration's own calls end here
        with torch.no_grad():                               # θ after the step, the same pairs
            got["after"] = V.surrogate_pass(run, ro, pairs, torch.arange(N))[0].mean(dim=1)
        got["s_old"], got["prompts"] = s_old, ro.prompts    # S_old = S at θ_old, once complete
        return out
    monkeypatch.setattr(V, "update_steps", update)
    rows, real_velocity = [], run.adapter.velocity

    def velocity(x, t, c):
        if "done" not in got:
            rows.append((torch.is_grad_enabled(), len(x)))
        return real_velocity(x, t, c)
    monkeypatch.setattr(run.adapter, "velocity", velocity)
    m = V.iteration(run, 0)
    assert scored["n"] == N and scored["prompts"] == [got["prompts"][n // G] for n in range(N)]
    dS = (got["after"] - got["s_old"].s.mean(dim=1)).view(-1, G)          # iteration completed it
    for g, best in enumerate(preferred.view(-1, G).argmax(dim=1).tolist()):
        others = [j for j in range(G) if j != best]
        assert dS[g, best] > 0 and (dS[g, best] > dS[g, others]).all(), (g, dS)
    assert sum(n for grad, n in rows if not grad) == m["nfe_rollout"] * N == run.args.num_steps * N
    assert sum(n for grad, n in rows if grad) == m["nfe_theta"] * N == run.args.n_mc * N


@pytest.mark.trainer
def test_as_many_prompts_as_there_are_draws_each_exactly_once(tiny_run, monkeypatch):
    """--prompts_per_iter equal to the number of training prompts: every prompt exactly once per
    iteration (without replacement, as for any P up to that number), in a new order each time.
    (The ODE solve is replaced by the identity here.)"""
    monkeypatch.setattr(V, "rollout", lambda adapter, x1, *a, **k: x1.float())
    train = tiny_run.run.train_prompts
    run = tiny_run.reset("--prompts_per_iter", len(train), "--group_size", 2)
    orders = [V.collect_rollouts(run, it).prompts for it in (0, 1)]
    for prompts in orders:
        assert sorted(prompts) == sorted(train)                  # each one, once
    assert orders[0] != orders[1]


@pytest.mark.trainer
def test_rollout_draws_prompts_and_independent_noise(tiny_run, monkeypatch):
    """Step 1: P distinct training prompts (without replacement; with replacement when P exceeds
    them), redrawn each iteration and the same for the same iteration; G samples per prompt in
    prompt-major order; one independent standard-normal initial noise per sample, redrawn each
    iteration. (The ODE solve itself is replaced by the identity here.)"""
    calls = []

    def solve(adapter, x1, cond, prompt_idx, sigmas, solver, chunk, ctx, poll=None):
        calls.append(x1.clone())
        return x1.float()
    monkeypatch.setattr(V, "rollout", solve)
    run = tiny_run.reset("--prompts_per_iter", 4)
    P, G, train = 4, run.args.group_size, run.train_prompts
    draws = []
    for it in (0, 1, 2, 3, 0):
        ro = V.collect_rollouts(run, it)
        assert len(ro.prompts) == P and len(set(ro.prompts)) == P and set(ro.prompts) <= set(train)
        assert ro.prompt_idx.tolist() == [n // G for n in range(P * G)]
        assert torch.equal(ro.x0, calls[-1]) and ro.x0.shape == (P * G,) + run.D
        draws.append((ro.prompts, calls[-1]))
    assert draws[0][0] == draws[-1][0] and torch.equal(draws[0][1], draws[-1][1])   # reproducible
    assert len({tuple(p) for p, _ in draws[:4]}) == 4                # new prompts every iteration
    x = torch.stack([x1 for _, x1 in draws[:4]]).flatten(2)          # (iterations, N, d)
    assert x.mean().abs() < 0.05 and (x.std() - 1).abs() < 0.05      # 49k N(0, 1) draws
    corr = torch.corrcoef(x.flatten(0, 1))                           # 48 samples, d = 1024 each
    assert (corr - torch.eye(len(corr))).abs().max() < 0.2           # pairwise independent
    run = tiny_run.reset("--prompts_per_iter", len(train) + 8, "--group_size", 2)
    ro = V.collect_rollouts(run, 0)
    assert len(ro.prompts) == len(train) + 8 and set(ro.prompts) <= set(train)


@pytest.mark.trainer
def test_minibatches_partition_the_samples_each_iteration(tiny_run):
    """μ = 3 on 12 samples in micro-batches of 3: each step k gets 4 samples (as 3 + 1, visited
    in step order), every sample in exactly one step; the partition is redrawn each iteration
    and the same for the same iteration. μ = 1: every sample in order."""
    run = tiny_run.reset("--prompts_per_iter", 4, "--mu", 3, "--micro_batch", 3)
    parts = []
    for it in (0, 1, 2, 3, 0):
        mbs = V.minibatches(run, it)                    # one index tensor per optimizer step
        assert [len(r) for r in mbs] == [4, 4, 4]
        assert [len(r) for step in mbs for r in step.split(3)] == [3, 1] * 3   # update_steps's
        steps = [sorted(step.tolist()) for step in mbs]
        assert sorted(sum(steps, [])) == list(range(12))
        parts.append(steps)
    assert parts[0] == parts[-1] and len({str(p) for p in parts[:4]}) == 4
    run = tiny_run.reset("--micro_batch", 4)
    assert [r.tolist() for r in V.minibatches(run, 5)] == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.trainer
def test_skipped_iteration_takes_no_step_and_still_measures_the_surrogate(tiny_run, monkeypatch):
    """Equal rewards in every group: every advantage is 0, so the update is skipped: no optimizer
    step (AdamW's weight decay would move the weights even on a zero gradient), the weights are
    unchanged, θ_old's pass covers every sample (nfe_old = N_MC) and the surrogate CV (batch,
    within groups) is that of S on the iteration's pairs. 1e-5: the pass here is one batch,
    the loop's runs in micro-batches (fp32 reordering only)."""
    monkeypatch.setattr(V, "collect_rollouts", lambda run, it: tiny_run.ro)
    monkeypatch.setattr(V, "decode_and_reward", lambda ad, rw, names, *a, **k: (
        {n: torch.ones(len(tiny_run.ro.x0)) for n in names}, None))
    run = tiny_run.reset("--micro_batch", 4)
    with _optimizer_steps(run) as norms:
        m = V.iteration(run, 0)
    assert m["skipped"] is True and norms == [] and m["grad_norm"] == 0.0
    assert all(torch.equal(p, p0) for p, p0 in zip(run.params, tiny_run.theta0))
    assert m["nfe_old"] == run.args.n_mc and math.isnan(m["abs_log_ratio"])
    with torch.no_grad():
        S = V.surrogate_pass(run, tiny_run.ro, V.draw_iteration_pairs(run, 0),
                         torch.arange(run.N))[0].mean(dim=1).double()
    Sg = S.view(run.args.prompts_per_iter, run.args.group_size)
    cv = (S.std(unbiased=False) / S.mean().abs()).item()
    assert m["surrogate_cv"] == pytest.approx(cv, rel=1e-5)
    cv_group = (Sg.std(dim=1, unbiased=False) / Sg.mean(dim=1).abs()).mean().item()
    assert m["surrogate_cv_group"] == pytest.approx(cv_group, rel=1e-5)


@pytest.mark.trainer
def test_logged_ratio_statistics_are_means_over_the_samples(tiny_run, monkeypatch):
    """README "Logged metrics": ratio, |log ρ| and approx_kl are means over the update's samples.
    μ = 2, 3 samples per step in micro-batches of 2 + 1: each sample counts once, whatever the
    micro-batch it fell in (1e-5 relative: fp32 means of the same numbers in another order)."""
    _replay(monkeypatch, tiny_run)
    calls = _loss_calls(monkeypatch)
    run = tiny_run.reset("--mu", 2, "--micro_batch", 2)
    m = V.iteration(run, 0)
    log_ratio = torch.cat([s.mean(dim=1) - s_old.mean(dim=1) for _, s, s_old in calls]).double()
    assert len(calls) == 4 and len(log_ratio) == run.N and log_ratio.abs().max() > 1e-4
    assert m["abs_log_ratio"] == pytest.approx(log_ratio.abs().mean().item(), rel=1e-5)
    assert m["ratio"] == pytest.approx(log_ratio.exp().mean().item(), rel=1e-5)
    assert m["approx_kl"] == pytest.approx((0.5 * log_ratio.square()).mean().item(), rel=1e-5)


@pytest.mark.trainer
def test_evaluation_noise_is_the_same_at_every_evaluation(tiny_run, monkeypatch):
    """evaluate(): one fixed initial noise per held-out prompt, the same at every iteration (only
    the weights change what it shows), distinct across prompts and from the training noise."""
    calls, real = [], V.rollout

    def spy(adapter, x1, *a, **k):
        calls.append(x1.clone())
        return real(adapter, x1, *a, **k)
    monkeypatch.setattr(V, "rollout", spy)
    run = tiny_run.reset("--n_eval", 3)
    first, later = V.evaluate(run, 0), V.evaluate(run, 7)
    assert len(calls) == 2 and calls[0].shape == (3,) + run.D and torch.equal(calls[0], calls[1])
    assert first == {**later, "iter": 0}                             # same weights: same numbers
    x = calls[0].flatten(1)
    assert not torch.equal(x[0], x[1]) and not torch.equal(x[0], x[2])
    train = torch.randn((run.N,) + run.D, generator=V.generator(run.args.seed, 0, V.Stream.ROLLOUT_NOISE))
    assert not any(torch.equal(x[0], r) for r in train.flatten(1))


@pytest.mark.trainer
def test_the_evaluation_sees_only_held_out_prompts(tiny_run, tmp_path, monkeypatch):
    """README: evaluation on held-out prompts. --prompts is split into two disjoint lists that
    cover it, ⌈--eval_holdout · n⌉ held out, the same split for every --seed (examples/prompts.txt:
    every fifth held out); `evaluate` renders and scores held-out prompts only, never a training
    one (the rollout is replaced by the identity, the scoring by a recorder)."""
    lines = [f"a photo of object number {i}" for i in range(20)]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n")
    splits = []
    for seed in ("0", "1"):
        train, held = V.load_prompts(V.parse_args(STEPS + ["--prompts", str(tmp_path / "p.txt"),
                                                           "--eval_holdout", "0.25", "--seed", seed]))
        assert len(held) == 5 and not set(train) & set(held) and sorted(train + held) == sorted(lines)
        splits.append((train, held))
    assert splits[0] == splits[1]
    seen = []

    def scored(adapter, rewards, names, latents, prompts, chunk, keep_images=False):
        seen.extend(prompts)
        return {n: torch.zeros(len(prompts)) for n in names}, None
    monkeypatch.setattr(V, "rollout", lambda adapter, x1, *a, **k: x1.float())
    monkeypatch.setattr(V, "decode_and_reward", scored)
    run = tiny_run.reset("--n_eval", 16)
    V.evaluate(run, 0)
    assert len(run.eval_prompts) == 8 and not set(run.train_prompts) & set(run.eval_prompts)
    assert seen == run.eval_prompts                                 # all 8, fewer than --n_eval


@pytest.mark.trainer
def test_random_streams_are_independent(tiny_run, monkeypatch):
    """Prompts, rollout noise, pairs, minibatches and the evaluation noise each come from a
    generator of their own: over two iterations, the nine generators these draws use have nine
    different seeds (drawing the pairs from the rollout noise's stream, or the minibatches from
    the prompts', fails here). The rollout itself is replaced by the identity."""
    seeds, real_gen, now = {}, V.generator, [None]

    def gen(seed, it, stream):
        g = real_gen(seed, it, stream)
        seeds.setdefault(now[0], []).append(g.initial_seed())
        return g
    monkeypatch.setattr(V, "generator", gen)
    monkeypatch.setattr(V, "rollout", lambda adapter, x1, *a, **k: x1.float())
    run = tiny_run.reset("--mu", 2, "--n_eval", 3)
    for it in (0, 1):
        for name, draw in (("prompts, then rollout noise", V.collect_rollouts),
                           ("pairs", V.draw_iteration_pairs), ("minibatches", V.minibatches)):
            now[0] = (name, it)
            draw(run, it)
    now[0] = ("evaluation noise", 0)
    V.evaluate(run, 0)
    assert [len(v) for v in seeds.values()] == [2, 1, 1, 2, 1, 1, 1], seeds
    every = [s for v in seeds.values() for s in v]
    assert len(set(every)) == len(every), seeds


@pytest.mark.trainer
def test_loop_schedule_of_evaluations_checkpoints_and_metrics_lines(tiny_run, monkeypatch,
                                                                   tmp_path):
    """The outer loop with the iteration and evaluation stubbed: 5 iterations, --eval_every 2,
    --save_every 2: evaluations before iterations 0, 2, 4 and after the last; checkpoints after
    2, 4 and 5 iterations, `latest` the last; metrics.jsonl one line per evaluation and per
    iteration, in order; the lines the loop returns are the iterations'."""
    keys = ("reward_mean", "reward_std", "grad_norm", "surrogate_cv", "surrogate_cv_group",
            "time_iter", "abs_log_ratio")
    monkeypatch.setattr(V, "iteration", lambda run, it: {"iter": it, "reward_unit": "raw",
                                                         **dict.fromkeys(keys, 0.0)})
    monkeypatch.setattr(V, "evaluate", lambda run, it: {"iter": it, "eval_reward_mean": 0.0})
    run = tiny_run.reset("--iterations", 5, "--eval_every", 2, "--save_every", 2)
    hist = V.run_iterations(run, tmp_path)
    assert [m["iter"] for m in hist] == list(range(5))
    lines = [(m["iter"], "eval_reward_mean" in m) for m in _metrics(tmp_path)]
    assert lines == [(0, True), (0, False), (1, False), (2, True), (2, False), (3, False),
                     (4, True), (4, False), (5, True)]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert saved == ["iter_000002", "iter_000004", "iter_000005"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "iter_000005"


@pytest.mark.math
def test_no_two_random_streams_share_a_seed_at_any_iteration():
    """Every stream of vgrpo.py and of the baselines, at every iteration a run may reach (the
    first 3000 and the last below MAX_ITERATIONS) for three seeds, plus the once-per-run ones:
    all seeds distinct. The held-out split (HOLDOUT) once was iteration 77's pairs at --seed 0."""
    BC = _load_example("baselines/baseline_cli")
    per_iter = [int(s) for S in (V.Stream, BC.Stream) for s in S if s < 16]
    once = [int(s) for S in (V.Stream, BC.Stream) for s in S if s >= 16]
    assert once and len(per_iter) >= 9
    its = [*range(3000), *range(V.MAX_ITERATIONS - 1000, V.MAX_ITERATIONS)]
    seeds = [V.stream_seed(sd, it, s) for sd in (0, 1, 2**31 - 1) for it in its for s in per_iter]
    seeds += [V.stream_seed(0, 0, s) for s in once]
    assert len(set(seeds)) == len(seeds)
    assert V.stream_seed(0, 77, V.Stream.PAIRS) != V.stream_seed(0, 0, V.Stream.HOLDOUT)
    with pytest.raises(V.ConfigError, match="--iterations must be below 1000003"):
        V.parse_args(["--model", "tiny", "--iterations", str(V.MAX_ITERATIONS)])
    with pytest.raises(V.ConfigError, match=r"--seed must lie in \[0, 2\^31\)"):
        V.parse_args(["--model", "tiny", "--seed", "-1"])


# ------------------------------------------------------------------------------------------------
# 8. Rewards: every code path on tiny models built offline
# ------------------------------------------------------------------------------------------------
_tiny_pickscore = TM.save_tiny_clip  # a tiny CLIP as PickScore's model and processor


@pytest.mark.trainer
def test_pickscore_scoring_code_on_tiny_clip(tmp_path):
    from transformers import AutoModel, AutoProcessor
    _tiny_pickscore(tmp_path / "ps")
    ps = str(tmp_path / "ps")
    rw = V.build_reward("pickscore", V.Args(pickscore_model=ps, pickscore_processor=ps), torch.device("cpu"),
                        torch.float32)
    torch.manual_seed(0)
    imgs = torch.rand(3, 3, 48, 64)
    prompts = ["a red fox", "a blue car", "a cat"]
    got = rw(imgs, prompts)
    assert got.shape == (3,) and torch.isfinite(got).all()
    # reference: the processor's own preprocessing + logits_per_image diagonal
    proc, model = AutoProcessor.from_pretrained(tmp_path / "ps"), AutoModel.from_pretrained(tmp_path / "ps")
    px = proc(images=list(imgs), return_tensors="pt", do_rescale=False)["pixel_values"]
    ti = proc(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        ref = model(input_ids=ti.input_ids, attention_mask=ti.attention_mask, pixel_values=px).logits_per_image.diag()
    # torch preprocessing vs the processor's own (its backends differ by ≤ 0.04 [ours C19])
    torch.testing.assert_close(V.clip_pixels(imgs, proc.image_processor), px, atol=0.05, rtol=0)
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0)


@pytest.mark.trainer
def test_pickscore_end_to_end_on_tiny_models(tmp_path):
    _tiny_pickscore(tmp_path / "ps")
    assert V.main(TINY + ["--reward", "pickscore", "--pickscore_model", str(tmp_path / "ps"),
                          "--pickscore_processor", str(tmp_path / "ps"), "--iterations", "1",
                          "--run_dir", str(tmp_path / "run")]) == 0
    m = _metrics(tmp_path / "run")[0]
    assert m["reward_unit"] == "raw" and math.isfinite(m["reward_mean"])


def _fails(argv, tmp_path, capsys, pattern):
    run = tmp_path / "should_not_exist"
    assert V.main(argv + ["--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert err.count("error:") == 1
    assert not run.exists()
    return err


@pytest.mark.trainer
def test_hpsv2_without_its_weights_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Offline, `hpsv2` (the plug-in examples/rewards/hpsv2.py) fails at its probe and names HPSV2_CHECKPOINT."""
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setenv("HPSV2_CHECKPOINT", "nobody/nothing/missing.pt")
    _fails(TINY + ["--reward", "hpsv2"], tmp_path, capsys,
           r"reward 'examples.rewards.hpsv2:score' failed: .*HPSV2_CHECKPOINT=/path/to/file")


def _tiny_open_clip(folder):
    """A tiny open_clip config + an HPS-style checkpoint ({'state_dict': ...}) of random weights."""
    import open_clip
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "tiny-hps.json"
    cfg.write_text(json.dumps({"embed_dim": 16,
                               "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
                               "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}))
    open_clip.add_model_config(str(cfg))
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps", pretrained=None)
    torch.save({"state_dict": model.state_dict()}, folder / "hps.pt")
    return cfg, folder / "hps.pt", model


@pytest.mark.trainer
def test_hpsv2_reward_matches_open_clip_reference(tmp_path, monkeypatch):
    """`hpsv2` is the plug-in examples/rewards/hpsv2.py, its weights named by HPSV2_ARCH / HPSV2_CHECKPOINT."""
    import open_clip
    from PIL import Image
    import examples.rewards.hpsv2 as HP
    cfg, ckpt, ref_model = _tiny_open_clip(tmp_path)
    monkeypatch.setenv("HPSV2_ARCH", str(cfg))
    monkeypatch.setenv("HPSV2_CHECKPOINT", str(ckpt))
    rw = V.build_reward("hpsv2", V.Args(), torch.device("cpu"), torch.float32)
    torch.manual_seed(1)
    imgs = torch.rand(3, 3, 40, 64)                                  # non-square: exercises the padding
    prompts = ["a red fox", "a blue car", "a cat"]
    got = rw(imgs, prompts)
    assert got.shape == (3,) and torch.isfinite(got).all() and (got.abs() <= 1 + 1e-5).all()
    # reference: open_clip's own "resize longest side + pad" transform on PIL images (HPS's ResizeMaxSize)
    tf = open_clip.transform.image_transform(32, is_train=False, mean=open_clip.OPENAI_DATASET_MEAN,
                                             std=open_clip.OPENAI_DATASET_STD, resize_mode="longest", fill_color=0)
    pil = [Image.fromarray((im.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()) for im in imgs]
    px = torch.stack([tf(p) for p in pil])
    mine = HP.hps_pixels((imgs * 255).round() / 255, 32)
    assert (mine - px).abs().mean() < 0.02 and (mine - px).abs().max() < 0.5     # resampler kernels differ a bit
    with torch.no_grad():
        ref = (ref_model.encode_image(px, normalize=True) *
               ref_model.encode_text(open_clip.get_tokenizer("tiny-hps")(prompts), normalize=True)).sum(-1)
    torch.testing.assert_close(got, ref, atol=0.02, rtol=0)


@pytest.mark.trainer
def test_clipscore_is_cosine_on_tiny_clip(tmp_path):
    from transformers import AutoModel, AutoProcessor
    _tiny_pickscore(tmp_path / "clip")
    rw = V.build_reward("clipscore", V.Args(clip_model=str(tmp_path / "clip")), torch.device("cpu"), torch.float32)
    imgs, prompts = torch.rand(2, 3, 32, 32), ["a dog", "a tree"]
    got = rw(imgs, prompts)
    proc, model = AutoProcessor.from_pretrained(tmp_path / "clip"), AutoModel.from_pretrained(tmp_path / "clip")
    px = proc(images=list(imgs), return_tensors="pt", do_rescale=False)["pixel_values"]
    ti = proc(text=prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=ti.input_ids, attention_mask=ti.attention_mask, pixel_values=px)
    torch.testing.assert_close(got, out.logits_per_image.diag() / model.logit_scale.exp(), atol=2e-3, rtol=0)


@pytest.mark.trainer
def test_aesthetic_reward_is_mlp_on_normalised_clip_features(tmp_path, capsys, monkeypatch):
    """examples/rewards/aesthetic.py: the LAION MLP (the original's key names) on the L2-normalised CLIP
    image features of vgrpo's CLIP preprocessing, from AESTHETIC_CLIP and AESTHETIC_WEIGHTS; it
    trains through --reward as a plug-in, by its module path and by its short name `aesthetic`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    d = tmp_path / "clip"
    d.mkdir()
    tok = TM.tiny_clip_tokenizer(str(d))
    n = len(tok)
    cfg = CLIPConfig(text_config=dict(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=77, bos_token_id=n - 2,
                                      eos_token_id=n - 1, pad_token_id=n - 1),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, image_size=32, patch_size=8),
                     projection_dim=768)                            # the LAION head takes ViT-L/14's 768
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(d)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                  tokenizer=tok).save_pretrained(d)
    monkeypatch.chdir(ROOT)
    from examples.rewards import aesthetic as AE
    head = AE.head()
    torch.save(head.state_dict(), tmp_path / "aesthetic.pth")
    monkeypatch.setenv("AESTHETIC_CLIP", str(d))
    monkeypatch.setenv("AESTHETIC_WEIGHTS", str(tmp_path / "aesthetic.pth"))
    monkeypatch.setattr(AE, "_LOADED", {})
    imgs = torch.rand(4, 3, 32, 32)
    got = AE.score(imgs, ["x"] * 4)
    assert got.shape == (4,) and torch.isfinite(got).all()
    with torch.no_grad():
        px = V.clip_pixels(imgs, CLIPProcessor.from_pretrained(d).image_processor)
        f = CLIPModel.from_pretrained(d).get_image_features(pixel_values=px)
        f = f if torch.is_tensor(f) else f.pooler_output                # transformers ≥ 5 wraps it
        torch.testing.assert_close(got, head.eval()(torch.nn.functional.normalize(f, dim=-1)).squeeze(-1))
    assert sorted(k for k in head.state_dict()) == sorted(
        f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))   # the original's key names
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--reward", "examples.rewards.aesthetic:score",
                          "--run_dir", str(run)]) == 0
    assert torch.isfinite(torch.tensor(_metrics(run)[0]["reward_mean"]))
    assert V.main(TINY + ["--iterations", "1", "--reward", "aesthetic",      # the short name
                          "--run_dir", str(tmp_path / "short")]) == 0
    assert _metrics(tmp_path / "short")[0]["reward_unit"] == "raw"


@pytest.mark.trainer
def test_imagereward_plugin_scores_pairs_and_without_package_says_how_to_install(
        tmp_path, capsys, monkeypatch):
    """examples/rewards/imagereward.py: without the package, one line saying how to install it (from the
    plug-in probe, before the model loads); with it (a stand-in module here), one score per
    (prompt, image) pair from the images as uint8 PIL images, the model loaded once per device."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(sys.modules, "ImageReward", None)               # import fails
    monkeypatch.delitem(sys.modules, "examples.rewards.imagereward", raising=False)
    _fails(TINY + ["--reward", "examples.rewards.imagereward:score"], tmp_path, capsys,
           r"reward 'examples.rewards.imagereward:score' failed: .*pip install image-reward")
    loads, seen = [], []

    class FakeModel:
        def score(self, prompt, image):
            seen.append((prompt, image.size, image.getpixel((0, 0))))
            return len(prompt) + image.getpixel((0, 0))[0] / 255

    fake = types.SimpleNamespace(load=lambda name, device: loads.append((name, device)) or FakeModel())
    monkeypatch.setitem(sys.modules, "ImageReward", fake)
    monkeypatch.setenv("IMAGEREWARD_MODEL", "/local/ImageReward.pt")
    from examples.rewards import imagereward as IR
    monkeypatch.setattr(IR, "_MODEL", {})
    images = torch.zeros(2, 3, 8, 6)
    images[1, 0] = 1.0                                                  # red
    out = IR.score(images, ["ab", "abcd"])
    assert out.tolist() == pytest.approx([2.0, 5.0])
    assert seen == [("ab", (6, 8), (0, 0, 0)), ("abcd", (6, 8), (255, 0, 0))]
    IR.score(images, ["ab", "abcd"])
    assert loads == [("/local/ImageReward.pt", "cpu")]


@pytest.mark.trainer
def test_reward_spec_parsing():
    assert V.parse_reward_spec("pickscore") == [("pickscore", 1.0)]
    assert V.parse_reward_spec("pickscore:1,hpsv2:0.5") == [("pickscore", 1.0), ("hpsv2", 0.5)]
    assert V.parse_reward_spec("examples.custom_reward:colour_match:2, jpeg") == [
        ("examples.custom_reward:colour_match", 2.0), ("jpeg", 1.0)]
    assert V.parse_reward_spec("my.mod:fn") == [("my.mod:fn", 1.0)]
    for bad in ("pickscor", "pickscore:-1", "jpeg,jpeg", "", "jpeg:nan"):
        with pytest.raises(ValueError):
            V.parse_reward_spec(bad)


@pytest.mark.trainer
def test_plugin_reward_loading_and_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rw = V.plugin_reward("examples.custom_reward:colour_match")
    imgs = torch.zeros(3, 3, 8, 8)
    imgs[0, 0] = 1.0                                                 # pure red
    got = rw(imgs, ["a red apple", "a blue sky", "a cat"])
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="could not import module 'no_such_module'"):
        V.plugin_reward("no_such_module:fn")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        V.plugin_reward("examples.custom_reward:nope")
    (tmp_path / "badreward.py").write_text("import torch\ndef two(images, prompts):\n    return torch.zeros(len(prompts), 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"returned shape \(3, 2\), expected \(3,\)"):
        V.plugin_reward("badreward:two")(imgs, ["a", "b", "c"])


@pytest.mark.trainer
def test_multi_reward_run_logs_each_reward_and_eval_rewards(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    _tiny_pickscore(tmp_path / "clip")
    assert V.main(TINY + ["--reward", "jpeg:1,examples.custom_reward:colour_match:0.5", "--reward_aggregation",
                          "per_reward", "--eval_rewards", "jpeg,clipscore", "--clip_model", str(tmp_path / "clip"),
                          "--iterations", "1", "--eval_every", "1", "--run_dir", str(tmp_path / "run")]) == 0
    ms = _metrics(tmp_path / "run")
    tr = [m for m in ms if "reward_mean" in m][0]
    assert {"reward_jpeg_mean", "reward_examples.custom_reward:colour_match_mean"} <= set(tr)
    j, c = tr["reward_jpeg_mean"], tr["reward_examples.custom_reward:colour_match_mean"]
    assert tr["reward_mean"] == pytest.approx(j + 0.5 * c, rel=1e-5)          # weighted headline value
    ev = [m for m in ms if "eval_reward_mean" in m]
    assert all({"eval_jpeg_mean", "eval_clipscore_mean"} <= set(e) for e in ev) and len(ev) == 2


def _first_reward_nan(images, prompts):
    """The JPEG reward with the first image of every call scored NaN."""
    from examples.rewards.jpeg import score as jpeg
    r = jpeg(images, prompts)
    r[0] = float("nan")
    return r


@pytest.mark.trainer
def test_nonfinite_reward_is_dropped_and_logged(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(V, "build_reward", lambda *a, **k: _first_reward_nan)
    monkeypatch.setattr(V, "probe_reward", lambda *a, **k: None)   # a reward that turns bad mid-run
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(tmp_path)]) == 0
    m = _metrics(tmp_path)[0]
    assert m["n_nonfinite_reward"] == 1 and math.isfinite(m["reward_mean"]) and math.isfinite(m["grad_norm"])
    assert not m["skipped"] and "non-finite reward" in capsys.readouterr().err


@pytest.mark.trainer
def test_all_rewards_nonfinite_skips_the_step(tmp_path, monkeypatch):
    def broken(images, prompts):
        return torch.full((len(images),), float("inf"))

    monkeypatch.setattr(V, "build_reward", lambda *a, **k: broken)
    monkeypatch.setattr(V, "probe_reward", lambda *a, **k: None)   # a reward that turns bad mid-run
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(tmp_path)]) == 0
    assert _metrics(tmp_path)[0]["skipped"] is True


@pytest.mark.trainer
def test_nonfinite_warning_has_its_own_line_and_eval_drops_nonfinite(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(V, "build_reward", lambda *a, **k: _first_reward_nan)
    monkeypatch.setattr(V, "probe_reward", lambda *a, **k: None)   # a reward that turns bad mid-run
    assert V.main(TINY + ["--iterations", "1", "--eval_every", "1",
                          "--run_dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    # tqdm.write clears the bar ("\r   \r") first: the warning starts a line of its own
    assert re.search(r"(^|\n|\r)warning: iteration 0: 1 non-finite[^\r\n]*\n", err), err
    ev = [m for m in _metrics(tmp_path) if "eval_reward_mean" in m]
    assert ev and all(math.isfinite(e["eval_reward_mean"]) for e in ev)
    assert all(e["eval_n_nonfinite"] == 1 for e in ev)


# ------------------------------------------------------------------------------------------------
# 9. Prompts with metadata, reward URLs and --init
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_jsonl_prompts_carry_their_metadata_and_a_bad_line_is_named(tmp_path):
    """A .jsonl prompt file gives Prompt strings whose .metadata is the line's JSON object; a line
    that is not JSON, or has no "prompt" string, is one error naming the file and the line."""
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "a photo of a cat", "tag": "single_object",
             "include": [{"class": "cat", "count": 1}]}, {"prompt": 'a sign that says "hi"'}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = V.read_prompt_file(str(f), "--prompts")
    assert got == [r["prompt"] for r in rows] and [p.metadata for p in got] == rows
    assert isinstance(got[0], str) and V.read_prompt_file(str(ROOT / "examples" / "prompts.txt"),
                                                          "--prompts")[0].__class__ is str
    for bad, line, what in (('{"prompt": "ok"}\n{oops\n', 2, "not JSON"),
                            ('{"prompt": "ok"}\n\n["a list"]\n', 3, "JSON object"),
                            ('{"text": "no prompt"}\n', 1, "JSON object")):
        f.write_text(bad)
        with pytest.raises(V.ConfigError, match=f"line {line}: .*{what}"):
            V.read_prompt_file(str(f), "--prompts")


@pytest.mark.trainer
def test_bad_jsonl_and_unscorable_prompts_fail_in_one_line_before_anything_is_written(
        tmp_path, monkeypatch, capsys):
    """main() refuses a .jsonl line that is not JSON (naming its line), and a plug-in's
    check_prompts refusal (e.g. GenEval prompts without metadata), with one line, exit 2, and no
    run folder."""
    (tmp_path / "needsmeta.py").write_text(
        "import torch\n"
        "def check_prompts(prompts):\n"
        "    for i, p in enumerate(prompts):\n"
        "        if getattr(p, 'metadata', None) is None:\n"
        "            raise ValueError(f'prompt {i} has no metadata: {p!r}')\n"
        "def score(images, prompts):\n"
        "    return torch.tensor([float(p.metadata['w']) for p in prompts])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "w": 1}\nnot json\n')
    for prompts, reward, want in ((bad, "jpeg", "line 2: not JSON"),
                                  (ROOT / "examples" / "prompts.txt", "needsmeta:score",
                                   "reward 'needsmeta:score': prompt 0 has no metadata")):
        run = tmp_path / f"run-{reward}"
        code = V.main(["--model", "tiny", "--reward", reward, "--prompts", str(prompts),
                       "--iterations", "1", "--run_dir", str(run)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and want in err and len(err.splitlines()) == 1, err
        assert not run.exists()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"p{i}", "w": i}) + "\n" for i in range(8)))
    assert V.main(["--model", "tiny", "--reward", "needsmeta:score", "--prompts", str(good),
                   "--iterations", "1", "--eval_every", "0", "--run_dir", str(tmp_path / "ok")]) == 0
    m = json.loads((tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < m["reward_mean"] < 7 and m["reward_std"] > 0    # scored from each .metadata["w"]


@pytest.mark.trainer
def test_reward_urls_parse_with_and_without_a_weight():
    """http(s)://HOST:PORT/NAME is one reward (the port's ':' is not a weight); ':w' after the path
    is its weight; a URL without a path is refused."""
    P = V.parse_reward_spec
    assert P("http://127.0.0.1:18085/geneval") == [("http://127.0.0.1:18085/geneval", 1.0)]
    assert P("pickscore:1,https://h:1/ocr:0.5") == [("pickscore", 1.0), ("https://h:1/ocr", 0.5)]
    with pytest.raises(V.ConfigError, match="needs a path"):
        P("http://127.0.0.1:18085")


TINY_JPEG = ["--model", "tiny", "--reward", "jpeg", "--eval_every", "0"]


@pytest.mark.trainer
def test_init_starts_a_new_run_from_a_checkpoints_weights(tmp_path, capsys):
    """--init RUN: a new run (iteration 0, its own folder, fresh optimizer) whose transformer starts
    from RUN's final trained weights: with a negligible lr its final weights equal RUN's, and
    differ from a run without --init. A missing checkpoint is one line naming --init."""
    from safetensors.torch import load_file
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert V.main([*TINY_JPEG, "--iterations", "3", "--save_every", "3", "--run_dir", str(a)]) == 0
    for run, extra in ((b, ["--init", str(a)]), (c, [])):
        assert V.main([*TINY_JPEG, "--iterations", "1", "--save_every", "1", "--lr", "1e-12",
                       "--weight_decay", "0", "--run_dir", str(run), *extra]) == 0
    w = {r: load_file(str(next((r / "checkpoints").glob("iter_*")) / V.LORA_FILE))
         for r in (a, b, c)}
    assert (b / "checkpoints" / "iter_000001").is_dir()          # counted from 0 again
    for k in w[a]:
        torch.testing.assert_close(w[b][k], w[a][k], atol=1e-8, rtol=0)
    assert any((w[c][k] - w[a][k]).abs().max() > 1e-4 for k in w[a])
    capsys.readouterr()
    assert V.main([*TINY_JPEG, "--iterations", "1", "--run_dir", str(tmp_path / "d"),
                   "--init", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --init") and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# 10. Bad input: one clear message, exit code 2, nothing written
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_unknown_alias(tmp_path, capsys):
    _fails(["--model", "sd9-ultra", "--reward", "jpeg"], tmp_path, capsys, r"unknown model 'sd9-ultra'.*alias")


@pytest.mark.trainer
def test_hub_id_offline_says_how_to_use_local_files(tmp_path, capsys):
    err = _fails(["--model", "stabilityai/stable-diffusion-3.5-medium", "--reward", "jpeg", "--device", "cpu"],
                 tmp_path, capsys, r"the model '.*' is not in the local cache .* HF_HUB_OFFLINE is set")
    assert "--model /path/to/dir" in err and "`hf download stabilityai/stable-diffusion-3.5-medium`" in err


@pytest.mark.trainer
def test_pickscore_offline_names_the_flag(tmp_path, capsys):
    _fails(TINY[:-2] + ["--reward", "pickscore"], tmp_path, capsys, r"--pickscore_(processor|model) /path/to/dir")


@pytest.mark.trainer
def test_group_size_below_two(tmp_path, capsys):
    _fails(TINY + ["--group_size", "1"], tmp_path, capsys, r"--group_size must be ≥ 2")


@pytest.mark.trainer
def test_empty_prompt_file(tmp_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("\n   \n")
    _fails(TINY + ["--prompts", str(f)], tmp_path, capsys, r"--prompts .* holds no prompts")


@pytest.mark.trainer
def test_missing_and_corrupt_checkpoint(tmp_path, capsys):
    _fails(["--resume", str(tmp_path / "nope")], tmp_path, capsys, r"no checkpoint there")
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
    capsys.readouterr()
    ck = run / "checkpoints" / "iter_000001"
    (ck / "trainer_state.pt").write_bytes(b"not a checkpoint")
    _fails(["--resume", str(run)], tmp_path, capsys, r"unreadable or incomplete")


EXITING_REWARD = """
import sys
calls = []


def score(images, prompts):          # sys.exit(3) at call number EXIT_AT
    calls.append(1)
    if len(calls) == int(__import__("os").environ["EXIT_AT"]):
        sys.exit(3)
    return images.float().mean(dim=(1, 2, 3)).cpu()
"""


@pytest.mark.trainer
def test_a_plugin_calling_sys_exit_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """A reward plug-in that calls sys.exit(3) ends the run in one line naming the plug-in: at
    the start-up probe with status 2 (nothing written), mid-run with status 69."""
    (tmp_path / "exiting.py").write_text(EXITING_REWARD)
    monkeypatch.chdir(tmp_path)
    for at, status in (("1", 2), ("2", 69)):
        sys.modules.pop("exiting", None)             # a fresh count of calls
        monkeypatch.setenv("EXIT_AT", at)
        run = tmp_path / f"run{at}"
        assert V.main(TINY + ["--reward", "exiting:score", "--run_dir", str(run)]) == status
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if line.startswith("error")]
        assert len(said) == 1 and "Traceback" not in err, err
        assert "reward 'exiting:score' failed: SystemExit: 3" in said[0], err
        assert run.exists() == (status == 69)
    sys.modules.pop("exiting", None)


class _RunsCode:
    """Pickled, it calls os.system: a crafted checkpoint file that would leave a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.trainer
def test_a_checkpoint_file_that_would_run_code_is_refused_in_one_line(tmp_path, capsys, ev):
    """trainer_state.pt and optimizer.pt are read with weights_only: a pickle that would run code
    (here os.system creating a marker) ends in one line naming the file, status 2, and never runs,
    through --resume, --init and examples/evaluate.py; the files the trainer writes load as data."""
    run, marker = tmp_path / "run", tmp_path / "ran"
    assert V.main(TINY + ["--iterations", "1", "--mu", "1", "--run_dir", str(run)]) == 0
    capsys.readouterr()
    ck = run / "checkpoints" / "iter_000001"
    state = torch.load(ck / V.CKPT_STATE, weights_only=True)   # RNG, scaler, config: plain data
    assert state["optimizer_saved"] and torch.load(ck / V.OPTIM_FILE, weights_only=True)["state"]
    good = (ck / V.CKPT_STATE).read_bytes()
    for name in (V.CKPT_STATE, V.OPTIM_FILE):
        torch.save(_RunsCode(marker), ck / name)
        for argv in (["--resume", str(run), "--iterations", "2"],
                     TINY + ["--init", str(run), "--run_dir", str(tmp_path / "new")]):
            if name == V.OPTIM_FILE and "--init" in argv:
                continue                                        # --init reads no optimizer
            assert V.main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and name in err and "run code" in err, err
            assert not marker.exists() and not (tmp_path / "new").exists()
        if name == V.CKPT_STATE:
            with pytest.raises(V.ConfigError, match="--checkpoints"):
                ev.read_models([str(run)])
            (ck / V.CKPT_STATE).write_bytes(good)
    assert not marker.exists()
    assert _metrics(run)[-1]["iter"] == 0                       # the run's record is untouched


@pytest.mark.trainer
def test_a_failed_checkpoint_write_leaves_latest_on_the_last_complete_one(tmp_path, monkeypatch,
                                                                          capsys):
    """A checkpoint whose write fails (a full disk) leaves nothing half-written: `latest` still
    names the last complete checkpoint, no temporary folder is left, and that checkpoint loads.
    The failure is one line naming the folder (in examples/cluster.py too: its tests)."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
    real_save = torch.save

    def boom(obj, f, *a, **k):
        if str(f).endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", boom)
    capsys.readouterr()
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 2    # one line names it
    assert re.search(r"could not write .*No space left.*free space", capsys.readouterr().err)
    monkeypatch.setattr(torch, "save", real_save)
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "latest"]
    V.read_checkpoint(str(run))                                      # the old one is intact
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0


def _one_line(argv, tmp_path, capsys, pattern):
    """_fails, and the message is a single line without a traceback."""
    err = _fails(argv, tmp_path, capsys, pattern)
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("V-GRPO")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("body, pattern", [
    ("raise KeyError('no such key')", r"'badplug:fn' failed: KeyError.*on a probe batch"),
    ("return None", r"'badplug:fn' returned NoneType; return a tensor"),
    ("return torch.zeros(len(prompts), 2)",
     r"'badplug:fn' returned shape \(2, 2\), expected \(2,\)"),
    ("return torch.full((len(prompts),), float('nan'))", r"'badplug:fn' returned non-finite"),
])
@pytest.mark.trainer
def test_broken_plugin_fails_before_training_in_one_line(tmp_path, capsys, monkeypatch, body,
                                                         pattern):
    (tmp_path / "badplug.py").write_text(f"import torch\ndef fn(images, prompts):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "badplug", raising=False)   # a fresh import
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("loaded before probe"))
    _one_line(TINY + ["--reward", "badplug:fn"], tmp_path, capsys, pattern)


@pytest.mark.trainer
def test_unwritable_run_dir_fails_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "afile").write_text("x")
    err = V.main(TINY + ["--run_dir", str(tmp_path / "afile" / "run")])
    assert err == 2 and re.search(r"--run_dir .*afile' is a file, not a folder",
                                  capsys.readouterr().err)
    if os.geteuid() == 0:                    # root writes through mode bits: use a read-only fs
        ro = Path("/sys/vgrpo-test-run")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        ro = tmp_path / "ro" / "run"
    assert V.main(TINY + ["--run_dir", str(ro)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--run_dir .*cannot write in .*pass a writable --run_dir", err), err
    assert not ro.exists()


@pytest.mark.trainer
def test_local_folder_without_transformer_says_so(tmp_path, capsys):
    import shutil
    TM.build_tiny_sd3_pipeline().save_pretrained(tmp_path / "p")
    shutil.rmtree(tmp_path / "p" / "transformer")
    _one_line(TINY + ["--model", str(tmp_path / "p")], tmp_path, capsys,
              r"model_index.json lists 'transformer' but there is no transformer/ folder")


@pytest.mark.trainer
def test_reward_weight_typo_is_an_argument_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("model loaded"))
    _one_line(TINY + ["--reward", "pickscore:abc"], tmp_path, capsys,
              r"the weight of 'pickscore' must be a number \(got 'abc'\)")


@pytest.mark.trainer
def test_tiny_model_without_its_builders_is_one_line(tmp_path, capsys, monkeypatch):
    """vgrpo.py copied alone: --model tiny names the missing examples/tools/tiny_models.py."""
    monkeypatch.delitem(sys.modules, "vgrpo_tiny_models")
    monkeypatch.setattr(V, "__file__", str(tmp_path / "vgrpo.py"))
    (tmp_path / "p.txt").write_text("a cat\n")
    _one_line(TINY + ["--prompts", str(tmp_path / "p.txt")], tmp_path, capsys,
              r"--model tiny / tiny-flux needs .*examples/tools/tiny_models.py")


@pytest.mark.trainer
def test_default_prompts_and_their_missing_file(tmp_path, capsys, monkeypatch):
    """Without --prompts: examples/prompts.txt, every 5th prompt held out; vgrpo.py copied alone
    says in one line how to go on."""
    train, held = V.load_prompts(V.Args())
    assert (len(train), len(held)) == (32, 8)
    assert train[0] == "a lighthouse on a rocky cliff during a thunderstorm, dramatic sky"
    assert held[0] == "a red fox curled up asleep in fresh snow, soft morning light"
    assert held[-1] == "a plate of sushi arranged on a slate board"
    assert train[-1] == "a portrait of a woman with freckles in natural light"
    monkeypatch.setattr(V, "__file__", str(tmp_path / "vgrpo.py"))
    _one_line(TINY, tmp_path, capsys, r"--prompts not given, and the default .*examples/prompts.txt"
                                      r"' does not exist")


@pytest.mark.trainer
def test_bad_prompt_files_name_the_flag(tmp_path, capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    _one_line(TINY + ["--prompts", str(f)], tmp_path, capsys,
              r"--prompts .*latin1.txt' is not UTF-8")
    _one_line(TINY + ["--eval_prompts", str(tmp_path)], tmp_path, capsys,
              r"--eval_prompts .* is a folder; pass a text file")


@pytest.mark.parametrize("lr", ["-1", "nan", "0", "inf"])
@pytest.mark.trainer
def test_bad_learning_rate_before_loading(tmp_path, capsys, monkeypatch, lr):
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("model loaded"))
    _one_line(TINY + ["--lr", lr], tmp_path, capsys, r"--lr must be a finite number > 0")


# Every numeric flag, at 0, at −1 and at nan, on a run short enough to try them all: a flag that
# passes the checks must then run (evaluation on, so --n_eval is used), one that does not must be
# refused in one line with status 2 before anything is written.
NUMERIC_FLAGS = [f.name for f in dataclasses.fields(V.Args)
                 if str(f.type).replace("Optional[", "").rstrip("]") in ("int", "float")]


EDGE = ["--model", "tiny", "--reward", "jpeg", "--iterations", "1", "--prompts_per_iter", "2",
        "--group_size", "2", "--num_steps", "2", "--n_mc", "2", "--eval_every", "1", "--n_eval",
        "2", "--eval_steps", "2", "--save_every", "1", "--resolution", "32"]


@pytest.mark.parametrize("flag", NUMERIC_FLAGS)
@pytest.mark.trainer
def test_every_numeric_flag_at_zero_negative_and_nan_is_one_line_or_a_run(tmp_path, capsys, flag):
    """--FLAG 0, -1 and nan: either exit status 2 with exactly one line (`error: ...`, no
    traceback) and no run folder, or a run that ends with status 0, its iteration logged with a
    finite reward and its checkpoint saved."""
    assert len(NUMERIC_FLAGS) >= 30                       # the list really is read from Args
    for value in ("0", "-1", "nan"):
        run = tmp_path / f"run{value}"
        try:
            status = V.main(EDGE + [f"--{flag}", value, "--run_dir", str(run)])
        except SystemExit as e:                           # argparse: an int flag given nan
            status = e.code
        err = capsys.readouterr().err
        assert "Traceback" not in err, (flag, value, err)
        if status == 2:
            lines = [l for l in err.splitlines() if l.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), (flag, value, err)
            assert f"--{flag}" in lines[0], (flag, value, lines)
            assert not run.exists(), (flag, value)
        else:
            assert status == 0, (flag, value, status, err)
            ms = [m for m in _metrics(run) if "reward_mean" in m]
            assert len(ms) == 1 and math.isfinite(ms[0]["reward_mean"]), (flag, value)
            assert (run / "checkpoints" / "latest").read_text() == "iter_000001", (flag, value)


@pytest.mark.trainer
def test_a_prompt_longer_than_the_encoders_read_is_cut_before_it_is_held(tmp_path):
    """A 300 KB prompt line (and a .jsonl one with metadata) is held cut where the longest-reading
    tokenizer stops (T5 at --max_sequence_length; the CLIPs read less), past the next word: the
    pipeline's embeddings of the cut prompt equal those of the whole line, the metadata stays, a
    prompt every encoder reads whole is not touched, and the offload cache holds the cut one."""
    import random
    rng = random.Random(0)
    long = " ".join(rng.choice(["a", "red", "cat", "photograph", "of", "the", "über", "🐱"])
                    for _ in range(60_000))
    short = "a photo of a cat"
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": long, "tag": "t"}) + "\n"
                                      + json.dumps({"prompt": short, "tag": "s"}) + "\n")
    args = V.parse_args(TINY + ["--prompts", str(tmp_path / "p.jsonl"), "--eval_holdout", "0",
                                "--offload_text_encoders"])
    run = V.setup(args, pipe=TM.build_tiny_sd3_pipeline())
    cut, kept = run.train_prompts
    assert kept == short and cut.metadata["tag"] == "t" and long.startswith(cut)
    assert 20 < len(cut) < 2000 and long[len(cut)] == " ", len(cut)
    assert set(run.adapter._cache) == {cut, short}
    pipe = TM.build_tiny_sd3_pipeline()

    @torch.no_grad()
    def embed(text):                                  # (prompt_embeds, pooled)
        out = pipe.encode_prompt(text, None, None, do_classifier_free_guidance=False,
                                 max_sequence_length=args.max_sequence_length)
        return out[0], out[2]
    for a, b in zip(embed(long), embed(str(cut))):
        assert torch.equal(a, b)


INT_FLAGS = [n for n in NUMERIC_FLAGS if "int" in str(V.Args.__dataclass_fields__[n].type)]


@pytest.mark.trainer
def test_every_integer_flag_oversized_is_one_line_before_anything_loads(tmp_path, capsys,
                                                                         monkeypatch):
    """--FLAG 2^31 and 10^30 (a grid of 2^31 steps alone would be 17 GB): exit status 2, one
    line naming the flag and its bound, no model or reward loaded, no run folder."""
    assert len(INT_FLAGS) >= 19                          # the list really is read from Args
    for name in ("load_pipeline", "build_reward"):
        monkeypatch.setattr(V, name, lambda *a, **k: pytest.fail("loaded"))
    for flag in INT_FLAGS:
        for value in (str(2 ** 31), str(10 ** 30)):
            run = tmp_path / "run"
            assert V.main(EDGE + [f"--{flag}", value, "--run_dir", str(run)]) == 2, flag
            err = capsys.readouterr().err
            lines = [l for l in err.splitlines() if l.strip()]
            assert len(lines) == 1 and "Traceback" not in err, (flag, err)
            assert re.search(rf"--{flag} must (be ≤ [\d,]+|lie in \[0, 2\^31\)|be below)",
                             lines[0]), (flag, lines[0])
            assert not run.exists()


@pytest.mark.trainer
def test_resume_with_changed_lora_rank_is_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("model loaded"))
    before = sorted(p.name for p in run.rglob("*"))
    assert V.main(["--resume", str(run), "--lora_rank", "4"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--lora_rank 4 differs from the checkpoint's 8 .*drop --lora_rank", err), err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in run.rglob("*")) == before

@pytest.mark.trainer
def test_a_real_model_without_usable_cuda_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    """--device auto and a hub model with no usable CUDA: one line naming what torch sees and --device cpu,
    before the Hub is asked or a reward loads. A GPU that the torch build cannot run (a V100 under a CUDA 13
    build) is named by its compute capability; one it can run (same major, or PTX) is used."""
    monkeypatch.setattr(V, "check_hub_access", lambda ids: pytest.fail("the Hub was asked"))
    monkeypatch.setattr(V, "build_reward", lambda *a, **k: pytest.fail("a reward loaded"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _fails(["--model", "sd3.5-medium", "--reward", "pickscore"], tmp_path, capsys,
                 r"^error: --device auto: torch \S+ \(built for CUDA 13\.0\) sees no usable GPU.*--device cpu")
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_80", "sm_90", "sm_100", "sm_120"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    _fails(["--model", "sd3.5-medium", "--reward", "pickscore"], tmp_path, capsys,
           r"the GPU Tesla V100-SXM2-32GB \(compute capability 7\.0\) is not among .*sm_80.*--device cpu")
    for cap, archs in (((8, 6), ["sm_80"]), ((12, 1), ["sm_120"]), ((9, 0), ["sm_80", "compute_80"])):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=cap: c)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda a=archs: a)
        assert V.cuda_problem() is None, cap
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "compute capability 8.0" in V.cuda_problem()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = V.resolve_args({"model": "tiny", "reward": "jpeg"})
    assert V.setup_device(args)[0].type == "cpu"                  # a tiny model runs on the CPU


@pytest.mark.trainer
def test_a_mistyped_alias_is_refused_before_any_reward_or_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(V, "build_reward", lambda *a, **k: pytest.fail("a reward loaded"))
    monkeypatch.setattr(V, "setup", lambda *a, **k: pytest.fail("setup ran"))
    _fails(["--model", "sd3.5-medum", "--reward", "pickscore", "--device", "cpu"], tmp_path, capsys,
           r"^error: unknown model 'sd3\.5-medum': pass an alias")
    with pytest.raises(V.ConfigError, match="unknown model"):
        V.resolve_args({"model": "sd3.5-medum"})


@pytest.mark.trainer
def test_offline_the_model_missing_from_the_cache_is_named_before_the_rewards(tmp_path, capsys, monkeypatch):
    """HF_HUB_OFFLINE=1 (conftest) and nothing cached: the model is named, not PickScore's processor."""
    monkeypatch.setattr(V, "build_reward", lambda *a, **k: pytest.fail("a reward loaded"))
    err = _fails(["--model", "sd3.5-medium", "--reward", "pickscore", "--device", "cpu"], tmp_path, capsys,
                 r"^error: the model 'stabilityai/stable-diffusion-3\.5-medium' is not in the local cache")
    assert "HF_HUB_OFFLINE is set" in err and "huggingface-cli" not in err


@pytest.mark.trainer
def test_a_reward_checkpoint_missing_weights_is_one_line(tmp_path):
    """A PickScore folder whose projection weights are missing would load them random: refused instead."""
    from safetensors.torch import load_file, save_file
    _tiny_pickscore(tmp_path / "ps")
    f = tmp_path / "ps" / "model.safetensors"
    sd = load_file(str(f))
    save_file({k: v for k, v in sd.items() if "projection" not in k}, str(f), metadata={"format": "pt"})
    ps = str(tmp_path / "ps")
    with pytest.raises(V.ConfigError, match=r"the pickscore model .* lacks weights \[.*projection"):
        V.build_reward("pickscore", V.Args(pickscore_model=ps, pickscore_processor=ps),
                       torch.device("cpu"), torch.float32)


# ------------------------------------------------------------------------------------------------
# 11. Interruptions: Ctrl-C, a kill and resume lose and double nothing
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_resume_reproduces_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    assert V.main(TINY + ["--iterations", "3", "--run_dir", str(full)]) == 0
    part = tmp_path / "part"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(part)]) == 0
    assert V.main(["--resume", str(part), "--iterations", "3", "--eval_every", "1"]) == 0
    assert _strip_times(_metrics(part)) == _strip_times(_metrics(full))
    evals = [m["iter"] for m in _metrics(part) if "eval_reward_mean" in m]
    assert evals == [1, 2, 3]                       # resumed at 1: evaluated once per iteration, no repeats
    assert Path(part, "checkpoints", "latest").read_text() == "iter_000003"


@pytest.mark.trainer
def test_the_metrics_comparison_tells_two_runs_apart(tmp_path):
    """_strip_times, through which every exact-resume comparison goes: the same command twice
    (same process, same float operations) compares equal although the wall times differ, another
    seed compares unequal, and a result with no iteration line (an empty log, evaluations only),
    on either side, is refused rather than compared."""
    runs = {name: tmp_path / name for name in ("a", "again", "seed1")}
    for name, d in runs.items():
        assert V.main(TINY + ["--iterations", "1", "--eval_every", "1", "--run_dir", str(d)]
                      + ["--seed", "1"] * (name == "seed1")) == 0
    a, again, seed1 = (_metrics(d) for d in runs.values())
    assert a != again                                               # the times differ...
    assert _strip_times(a) == _strip_times(again)                   # ...and only the times
    assert [m["iter"] for m in _strip_times(a)] == [0]
    assert _strip_times(a) != _strip_times(seed1)
    evals_only = [m for m in a if "eval_reward_mean" in m]
    assert [m["iter"] for m in evals_only] == [0, 1]
    for vacuous in ([], evals_only):                                # [] == [] would pass
        with pytest.raises(AssertionError, match="no iteration line"):
            _strip_times(vacuous)
    with pytest.raises(AssertionError, match="no iteration line"):  # one side empty
        assert _strip_times(a) == _strip_times(evals_only)


@pytest.mark.trainer
def test_resume_with_fewer_gpus_than_at_the_save(tmp_path, monkeypatch):
    """The trainer draws from CPU generators only, so a checkpoint holds no CUDA RNG state; an
    older one that holds the states of 8 GPUs resumes where fewer are visible (simulated: one GPU,
    whose torch.cuda.set_rng_state_all raises on 8 states)."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--device", "cpu", "--run_dir", str(run)]) == 0
    saved = run / "checkpoints" / "iter_000001" / V.CKPT_STATE
    state = torch.load(saved, weights_only=True)
    assert "cuda" not in state["rng"]
    state["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 8
    torch.save(state, saved)

    def one_gpu(states):
        if len(states) > 1:
            raise IndexError("list index out of range")

    # a GPU is visible to vgrpo.py's own checks (torch's, such as AdamW's, still see none)
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: sys._getframe(1).f_globals.get("__name__") == "vgrpo")
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", one_gpu)
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"


@pytest.mark.trainer
def test_kill_and_resume_logs_each_iteration_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = V.iteration

    def killed_at_3(r, it):
        if it == 3:
            raise SystemExit("killed")                   # not Ctrl-C: no checkpoint on the way out
        return real(r, it)

    monkeypatch.setattr(V, "iteration", killed_at_3)
    with pytest.raises(SystemExit):
        V.main(TINY + ["--iterations", "4", "--save_every", "2", "--eval_every", "2",
                       "--run_dir", str(run)])
    monkeypatch.setattr(V, "iteration", real)
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2]  # 2: after ckpt
    (run / "checkpoints" / ".tmp-iter_000003-1-1").mkdir()                          # a killed save
    assert V.main(["--resume", str(run)]) == 0
    ms = _metrics(run)
    assert [m["iter"] for m in ms if "reward_mean" in m] == [0, 1, 2, 3]
    assert [m["iter"] for m in ms if "eval_reward_mean" in m] == [0, 2, 4]
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.trainer
def test_ctrl_c_is_one_line_naming_the_last_checkpoint_and_resume_is_exact(tmp_path, monkeypatch,
                                                                          capsys):
    """Ctrl-C (a real SIGINT) in iteration 2 stops `python vgrpo.py` at once: one line naming
    the last complete checkpoint and the command that continues, no traceback, exit 130; that
    command, run as printed, ends exactly as the uninterrupted run (same process, same float
    operations). examples/cluster.py's gentler Ctrl-C is tested beside it."""
    import signal
    run, ref = tmp_path / "run", tmp_path / "ref"
    argv = TINY + ["--iterations", "4", "--save_every", "1"]
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    real = V.iteration

    def ctrl_c_in_2(r, it):
        if it == 2:
            os.kill(os.getpid(), signal.SIGINT)              # arrives mid-iteration
        return real(r, it)

    monkeypatch.setattr(V, "iteration", ctrl_c_in_2)
    capsys.readouterr()
    assert V.main(argv + ["--run_dir", str(run)]) == 130
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith(("interrupted", "error", "Traceback"))]
    assert lines == [f"interrupted: checkpoints/latest (iter_000002) is the last complete one; "
                     f"continue with --resume {run}"], err
    monkeypatch.setattr(V, "iteration", real)
    assert V.main(lines[0].rsplit("continue with ", 1)[1].split()) == 0
    assert _strip_times(_metrics(run)) == _strip_times(_metrics(ref))


@pytest.mark.trainer
def test_ctrl_c_while_loading_exits_130_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the model loads (before the first iteration): one line, exit 130, never 0
    (a scheduler, or a shell's `&&`, would take the run for finished), and no run folder."""
    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(V, "load_pipeline", ctrl_c)
    run = tmp_path / "run"
    assert V.main(TINY + ["--run_dir", str(run)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted before the first iteration: nothing written"
    assert "Traceback" not in err and not run.exists()


@pytest.mark.parametrize("stop", ["ctrl_c", "kill"])
@pytest.mark.trainer
def test_resume_from_an_older_checkpoint_moves_latest_there(tmp_path, monkeypatch, capsys, stop):
    """A run of 4 iterations saved after each; --resume of its iteration-2 checkpoint (an older
    one of the same folder) cuts metrics.jsonl back to iterations 0–1 and points `latest` at
    iteration 2 before anything else, so a stop in iteration 2, before the next save (Ctrl-C:
    exit 130; a kill), leaves `latest` there, and `--resume RUN` continues from iteration 2,
    not from the abandoned iteration 4: every iteration logged once, and the same metrics as
    the uninterrupted run (same process, same float operations)."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "4", "--run_dir", str(run)]) == 0
    ref = _strip_times(_metrics(run))
    assert (run / "checkpoints" / "latest").read_text() == "iter_000004"
    real = V.iteration

    def stopped_in_2(r, it):
        if it == 2:
            if stop == "ctrl_c":
                raise KeyboardInterrupt
            raise SystemExit("killed")                    # no handler runs: nothing saved
        return real(r, it)
    monkeypatch.setattr(V, "iteration", stopped_in_2)
    again = ["--resume", str(run / "checkpoints" / "iter_000002")]
    if stop == "ctrl_c":
        assert V.main(again) == 130
        said = [l for l in capsys.readouterr().err.splitlines() if l.startswith("interrupted")]
        assert said == [f"interrupted: checkpoints/latest (iter_000002) is the last complete "
                        f"one; continue with --resume {run}"], said
    else:
        with pytest.raises(SystemExit):
            V.main(again)
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"
    assert [m["iter"] for m in _metrics(run)] == [0, 1]
    monkeypatch.setattr(V, "iteration", real)
    assert V.main(["--resume", str(run)]) == 0
    ms = _strip_times(_metrics(run))
    assert [m["iter"] for m in ms] == [0, 1, 2, 3]
    assert ms == ref
    assert (run / "checkpoints" / "latest").read_text() == "iter_000004"


@pytest.mark.parametrize("where", ["latest_switch", "second_ctrl_c"])
@pytest.mark.trainer
def test_a_kill_leaves_latest_on_a_complete_checkpoint(tmp_path, monkeypatch, capsys, where):
    """Killed inside the save of iteration 2 just before `latest` is switched, or stopped by a
    second Ctrl-C in the middle of iteration 2's update: `latest` still names iteration 1's
    complete checkpoint, and --resume carries on from it."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("latest") and "iter_000002" in Path(src).read_text():
            raise SystemExit("killed")
        return real_replace(src, dst)

    if where == "latest_switch":
        monkeypatch.setattr(V.os, "replace", replace)
        with pytest.raises(SystemExit):
            V.main(["--resume", str(run), "--iterations", "2"])
    else:
        monkeypatch.setattr(V, "optimizer_step", lambda r: (_ for _ in ()).throw(KeyboardInterrupt))
        assert V.main(["--resume", str(run), "--iterations", "2"]) == 130
        assert "interrupted" in capsys.readouterr().err
    monkeypatch.undo()
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
    ckpt, state = V.read_checkpoint(str(run))                     # complete and readable
    assert ckpt.name == "iter_000001" and state["iteration"] == 1
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"


@pytest.mark.trainer
def test_ctrl_c_while_torch_imports_is_one_line_with_130(tmp_path):
    """Ctrl-C at the very start of `python vgrpo.py` (during `import torch`, before main()) is
    main()'s one line and status 130, not a traceback."""
    import signal
    status, err = _stop_while_torch_imports(tmp_path, ROOT / "vgrpo.py", signal.SIGINT)
    assert status == 130, err
    assert err == "interrupted before the first iteration: nothing written\n", err


@pytest.mark.trainer
def test_a_stop_inside_the_final_evaluation_is_made_up_on_continuing(tmp_path, capsys,
                                                                     monkeypatch):
    """Ctrl-C inside the evaluation after the last iteration (every checkpoint saved) exits 130
    in one line; `--resume RUN` then runs that evaluation, which the run's record lacked."""
    run = tmp_path / "run"
    real, stops = V.evaluate, []

    def evaluate(r, it):
        if it == 2 and not stops:
            stops.append(it)
            raise KeyboardInterrupt
        return real(r, it)
    monkeypatch.setattr(V, "evaluate", evaluate)
    argv = TINY + ["--eval_every", "2", "--n_eval", "2", "--run_dir", str(run)]
    assert V.main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("interrupted:") == 1 and "Traceback" not in err, err
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"
    assert [m["iter"] for m in _metrics(run) if "eval_reward_mean" in m] == [0]
    assert V.main(["--resume", str(run)]) == 0
    evals = [m["iter"] for m in _metrics(run) if "eval_reward_mean" in m]
    assert evals == [0, 2] and stops == [2]
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1]


@pytest.mark.trainer
def test_resume_drops_options_removed_since_the_checkpoint(tmp_path, capsys):
    """A checkpoint whose config holds options this version no longer has (ImageReward's built-in
    location, the trainer's own TensorBoard or W&B tracking, the aesthetic MLP's location)
    resumes: those are dropped, the run continues; none of them is a flag any more."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
    ckpt, state = V.read_checkpoint(str(run))
    removed = dict(imagereward_model="ImageReward-v1.0", report_to="tensorboard",
                   aesthetic_weights="trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth")
    state["config"].update(removed)
    torch.save(state, ckpt / V.CKPT_STATE)
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1]
    assert not set(removed) & set(json.loads((run / "config.json").read_text()))
    for flag in removed:
        with pytest.raises(SystemExit):
            V.given_flags([f"--{flag}", "x"])
        assert f"unrecognized arguments: --{flag}" in capsys.readouterr().err


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.trainer
def test_a_resume_reads_each_checkpoint_file_once(tmp_path, monkeypatch, full):
    """--resume reads the weights file once (load_trainable; read_checkpoint checks its header and
    keys with safetensors.safe_open, which reads no tensor), the trainer state once (main reads
    it for the config and setup takes it from there) and the optimizer state once: one read of
    a full FLUX fine-tune's 48 GB of weights per process, not three."""
    import safetensors.torch
    run = tmp_path / "run"
    extra = ["--full_finetune", "--lr", "1e-4"] * full
    assert V.main(TINY + extra + ["--iterations", "1", "--run_dir", str(run)]) == 0
    reads, real_load_file, real_load = [], safetensors.torch.load_file, torch.load

    def load_file(path, *a, **k):
        reads.append(Path(path).relative_to(run / "checkpoints" / "iter_000001").as_posix())
        return real_load_file(path, *a, **k)

    def load(f, *a, **k):
        reads.append(Path(f).relative_to(run / "checkpoints" / "iter_000001").as_posix())
        return real_load(f, *a, **k)
    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    monkeypatch.setattr(torch, "load", load)
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0
    weights = V.FULL_FILE if full else V.LORA_FILE
    assert sorted(reads) == sorted([weights, V.CKPT_STATE, V.OPTIM_FILE]), reads

@pytest.mark.trainer
def test_out_of_gpu_memory_is_one_line_naming_the_phase_and_the_flag(tmp_path, capsys, monkeypatch):
    """Plain vgrpo.py: out of memory in iteration 1's decode is one line with the phase, its flag, the last
    complete checkpoint and the command that continues (exit 2); the continued run equals an unbroken one.
    Out of memory while loading says that nothing was written."""
    run, calls, real = tmp_path / "run", [], V.decode_and_reward

    def decode_and_reward(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")
        return real(*a, **k)
    monkeypatch.setattr(V, "decode_and_reward", decode_and_reward)
    assert V.main(TINY + ["--iterations", "3", "--run_dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: out of GPU memory in decoding and rewards: lower --reward_batch (or "
                       "--offload_text_encoders), iteration 1; checkpoints/latest (iter_000001) is the last "
                       f"complete one; continue with --resume {run}")
    assert not any("Traceback" in line for line in err)
    monkeypatch.setattr(V, "decode_and_reward", real)
    assert V.main(["--resume", str(run)]) == 0
    assert V.main(TINY + ["--iterations", "3", "--run_dir", str(tmp_path / "plain")]) == 0
    assert _strip_times(_metrics(run)) == _strip_times(_metrics(tmp_path / "plain"))

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(V, "load_pipeline", oom)
    capsys.readouterr()
    assert V.main(TINY + ["--run_dir", str(tmp_path / "never")]) == 2
    assert capsys.readouterr().err.strip() == ("error: out of GPU memory in loading and setup: fewer --reward "
                                               "models, or --no-compile (or --offload_text_encoders); nothing "
                                               "written yet")
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------------------
# 12. One run per run folder
#     What a cluster does to a run (preemption, requeue, a full disk, out of GPU memory, one
#     trainer per folder) is examples/cluster.py's, tested in examples/test_cluster.py.
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_the_same_command_twice_never_mixes_two_runs(tmp_path, capsys):
    """A folder that holds a run is refused in one line naming its latest checkpoint and the
    command that continues it, and nothing in it changes; that command continues it, each
    iteration logged once."""
    run = tmp_path / "run"
    argv = TINY + ["--iterations", "3", "--run_dir", str(run)]
    assert V.main(argv) == 0
    before = {f: (run / f).read_bytes() for f in ("metrics.jsonl", "config.json",
                                                   "checkpoints/latest")}
    capsys.readouterr()
    assert V.main(argv[:-4] + ["--iterations", "2", "--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    said = re.fullmatch(r"error: --run_dir .* already holds a run: checkpoints/latest "
                        r"\(iter_000003\) is the last complete one; continue with (--resume \S+)\n",
                        err)
    assert said, err
    assert {f: (run / f).read_bytes() for f in before} == before
    assert V.main(said.group(1).split() + ["--iterations", "4"]) == 0
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2, 3]


SLOW_PROBE = """
import os, time
from pathlib import Path
calls = []


def score(images, prompts):           # the start-up probe (the first call) waits for a file
    calls.append(len(images))
    if len(calls) == 1:
        Path(os.environ["GATE"] + ".waiting").write_text("")
        for _ in range(3000):
            if Path(os.environ["GATE"]).exists():
                break
            time.sleep(0.1)
    return images.float().mean(dim=(1, 2, 3)).cpu()
"""


@pytest.mark.trainer
def test_a_second_trainer_is_refused_while_the_first_is_still_loading(tmp_path, capsys,
                                                                      monkeypatch):
    """The lock is taken before anything loads: while `python vgrpo.py` is inside its reward's
    start-up probe (nothing written yet but RUN/.lock), a second trainer on that folder, plain
    or through examples/cluster.py, exits 2 in one line naming the first's pid and loads
    nothing; the first then finishes alone."""
    import subprocess
    import time
    (tmp_path / "slowprobe.py").write_text(SLOW_PROBE)
    run, gate = tmp_path / "run", tmp_path / "go"
    argv = TINY + ["--iterations", "1", "--run_dir", str(run)]
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([sys.executable, str(ROOT / "vgrpo.py")] + argv
                                 + ["--reward", "slowprobe:score"], cwd=tmp_path,
                                 env=dict(os.environ, GATE=str(gate)),
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        for _ in range(1200):
            if Path(str(gate) + ".waiting").exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "first.err").read_text()
        assert sorted(f.name for f in run.iterdir()) == [".lock"]
        monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("model loaded"))
        in_use = (rf"error: --run_dir .* is in use by a running trainer \(pid {first.pid}\); "
                  r"wait for it to end, or pass another --run_dir\n")
        for main in (V.main, _load_example("cluster").main):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert re.fullmatch(in_use, err), err
        assert sorted(f.name for f in run.iterdir()) == [".lock"]
        gate.write_text("")
        assert first.wait(timeout=300) == 0, (tmp_path / "first.err").read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [m["iter"] for m in _metrics(run)] == [0]


@pytest.mark.trainer
def test_default_run_folders_differ_within_a_second_and_stay_under_runs(tmp_path, monkeypatch):
    """Without --run_dir the folder is runs/<model>-<reward>-<date>-<random>: two trainers
    started in the same second get two folders, and a model path or a reward URL with slashes,
    dots or other characters cannot name one outside runs/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(V.time, "strftime", lambda *a: "20260101-000000")   # the same second
    args = V.parse_args(TINY)
    assert V.plan_run_dir(args) != V.plan_run_dir(args)
    hostile = V.parse_args(TINY[:2] + ["--reward", "http://127.0.0.1:9/../../../tmp/x y;$(id)"]
                           + TINY[4:])
    for a in (args, hostile):
        d = V.plan_run_dir(a)
        assert d.parent == Path("runs") and d.name not in ("", ".", ".."), d
        assert re.fullmatch(r"[A-Za-z0-9+\-._]+-20260101-000000-[0-9a-f]{6}", d.name), d
        assert not d.name.startswith(".")
    assert not (tmp_path / "runs").exists()                                   # none made


@pytest.mark.trainer
def test_links_planted_in_the_run_folder_are_never_followed(tmp_path, capsys):
    """A symbolic link planted as RUN/.lock is refused in one line (status 2); links planted as
    metrics.tmp, config.json or checkpoints/.latest.tmp are replaced, not written through: their
    targets keep their bytes and metrics.jsonl stays a plain file."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
    victims = {}
    for planted in ("metrics.tmp", "config.json", "checkpoints/.latest.tmp", ".lock"):
        victim = tmp_path / f"victim-{Path(planted).name}"
        victim.write_text("keep me")
        (run / planted).unlink(missing_ok=True)
        (run / planted).symlink_to(victim)
        victims[planted] = victim
    capsys.readouterr()
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ".lock" in err and "link" in err, err
    (run / ".lock").unlink()
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0
    assert all(v.read_text() == "keep me" for v in victims.values())
    assert not (run / "metrics.jsonl").is_symlink() and not (run / "config.json").is_symlink()
    assert [m["iter"] for m in _metrics(run)] == [0, 1]


@pytest.mark.parametrize("script", ["vgrpo.py", "examples/cluster.py"])
@pytest.mark.parametrize("stdout", ["closed pipe", "/dev/full"])
@pytest.mark.trainer
def test_a_closed_or_full_stdout_never_stops_training(tmp_path, script, stdout):
    """stdout a pipe whose reader left after the first line (`| head -1`, a dead `tee`), or
    /dev/full (every write: ENOSPC): the run trains to the end, exit 0, both checkpoints and
    every metrics line written, and stderr says so once, without a traceback."""
    import subprocess
    import sys
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / script)] + TINY + ["--run_dir", str(run)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if stdout == "/dev/full":
        with open("/dev/full", "w") as full:
            p = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, env=env,
                               timeout=600)
        status, err = p.returncode, p.stderr
    else:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
        assert p.stdout.readline().startswith("V-GRPO")          # the banner, then the reader goes
        p.stdout.close()
        err = p.stderr.read()
        status = p.wait(timeout=600)
    assert status == 0 and "Traceback" not in err, err
    why = "No space left on device" if stdout == "/dev/full" else "Broken pipe"
    assert err.count("stdout failed") == 1 and f"stdout failed ({why})" in err, err
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"
    assert [m["iter"] for m in _metrics(run)] == [0, 1]


@pytest.mark.trainer
def test_damaged_run_state_files_are_one_line_each(tmp_path, capsys):
    """A checkpoints/latest of non-UTF-8 bytes: --resume is one line naming it and the fix, and a
    new run in the folder one line; metrics.jsonl with undecodable, non-object and cut lines:
    the resume drops them in one warning and keeps every good line."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--run_dir", str(run)]) == 0
    latest = run / "checkpoints" / "latest"
    latest.write_bytes(b"\xff\xfe\x00")
    capsys.readouterr()
    assert V.main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoints/latest names" in err and "iter_000002" in err
    assert V.main(TINY + ["--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a run" in err, err
    latest.write_text("iter_000002")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'\xff\xfe not json\n5\n[1]\n{"no iter": 1}\n{"iter": 1, "cut sh')
    assert V.main(["--resume", str(run / "checkpoints" / "iter_000001")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "5 unreadable line(s) dropped" in err, err
    assert [m["iter"] for m in _metrics(run)] == [0, 1]


@pytest.mark.parametrize("where", ["new run", "resume"])
@pytest.mark.trainer
def test_an_unreadable_run_folder_is_one_line(tmp_path, monkeypatch, capsys, where):
    """PermissionError (injected: the suite may run as root, which reads every folder) making the
    run folder's checkpoints/ on a new run, or reading a checkpoint's trainer_state.pt on a
    resume: one line naming the path, status 2, no traceback."""
    run = tmp_path / "run"
    denied = PermissionError(errno.EACCES, "Permission denied")
    if where == "resume":
        assert V.main(TINY + ["--iterations", "1", "--run_dir", str(run)]) == 0
        real_load = torch.load
        monkeypatch.setattr(torch, "load", lambda f, *a, **k: (
            (_ for _ in ()).throw(denied) if str(f).endswith(V.CKPT_STATE) else
            real_load(f, *a, **k)))
        argv, pattern = ["--resume", str(run)], r"iter_000001' is unreadable .*PermissionError"
    else:
        real_mkdir = Path.mkdir

        def mkdir(self, *a, **k):
            if self.name == "checkpoints":
                raise denied
            return real_mkdir(self, *a, **k)
        monkeypatch.setattr(Path, "mkdir", mkdir)
        argv, pattern = TINY + ["--run_dir", str(run)], (
            r"could not write .*run \(PermissionError: .*\); free space or fix permissions")
    capsys.readouterr()
    assert V.main(argv) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("V-GRPO")]
    assert len(lines) == 1 and "Traceback" not in err and re.search(pattern, lines[0]), err


# ------------------------------------------------------------------------------------------------
# 13. --help: the sections of Args and the values each model gets
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_help_shows_what_each_family_gets_in_the_sections_of_args(capsys):
    """--help without --model: the flags in the sections of Args, in order; the value the default
    model (SD3.5-medium) gets with its source, and FLUX.1-dev's with FLUX's own source where they
    differ; --resume says that the checkpoint's config overrides them; every model alias and
    reward name. With --model tiny the value is the tiny run's (every flag: the test below)."""
    with pytest.raises(SystemExit):
        V.given_flags(["--help"])
    out = capsys.readouterr().out
    sections = re.split(r"\n    # --- (\w+) -+\n", inspect.getsource(V.Args).split("\n\n    @")[0])[1:]
    want = {name: re.findall(r"^    (\w+): ", body, re.M) for name, body in zip(sections[::2], sections[1::2])}
    got = {m.group(1): re.findall(r"^  --(\w+)", m.group(2), re.M)
           for m in re.finditer(r"^(\w+):\n((?:  .*\n)+)", out, re.M) if m.group(1) != "options"}
    assert got == want and len(sum(want.values(), [])) == len(dataclasses.fields(V.Args))
    flat = " ".join(out.split())
    flux = "flux preset ([ours C1–C3, C8, C17] MixGRPO protocol)"
    assert f"image side in pixels [SD3 512; [ours C7] DiffusionNFT's 512] [FLUX 720; {flux}]" in flat
    assert f"(disjoint minibatches) [SD3 1; [paper P11] 1 step] [FLUX 4; {flux}]" in flat
    assert "(less memory) [True; sd3 preset" in flat             # both families' presets turn it on
    assert "checkpoint or run folder; its config overrides these values [None;" in flat
    for name in [*V.TINY_MODELS, *V.MODEL_ALIASES, *V.BUILTIN_REWARDS]:
        assert re.search(rf"[( ]{re.escape(name)}[,) ]", flat), name
    with pytest.raises(SystemExit):
        V.given_flags(["--model", "tiny", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "image side in pixels [64; tiny preset (examples/tools/tiny_models.py)]" in flat


@pytest.mark.trainer
@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_help_with_a_tiny_model_prints_what_its_run_gets(model, capsys):
    """--model tiny / tiny-flux --help: every flag's bracket is the value resolve_args gives that
    model, and the source it names (the tiny preset, FLUX's family preset, the dataclass)."""
    with pytest.raises(SystemExit):
        V.given_flags(["--model", model, "--help"])
    entries = re.findall(r"^  --(\w+)(.*\n(?:   .*\n)*)", capsys.readouterr().out, re.M)
    args = V.resolve_args({"model": model})
    assert args.resolution == 64 and args.lr == 1e-2
    assert [name for name, _ in entries] == [f.name for f in dataclasses.fields(V.Args)]
    for name, text in entries:                        # argparse may wrap inside a long value
        shown = f"[{getattr(args, name)!r}; {args.origin[name]}]"
        assert "".join(text.split()).endswith("".join(shown.split())), (name, shown, text)


# ------------------------------------------------------------------------------------------------
# 14. Conventions against their sources: presets, LoRA init and targets, SD3 without T5, fp16
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_paper_and_stage_presets_follow_the_family():
    s = V.parse_args(["--model", "sd3.5-medium", "--preset", "paper"])
    f = V.parse_args(["--model", "flux.1-dev", "--preset", "paper"])
    assert (s.prompts_per_iter, s.group_size) == (48, 24)          # SD3.5-M Stage 1
    assert (f.prompts_per_iter, f.group_size) == (32, 12)          # MixGRPO: 32 prompts × 12
    assert (s.eval_steps, f.eval_steps) == (40, 16)                # the peers' evaluation steps
    g = V.parse_args(["--model", "sd3.5-medium", "--preset", "geneval-stage"])
    assert (g.n_mc, g.mu, g.clip_eps, g.soft_clip_eta, g.kl_coef) == (10, 2, 1e-2, 0.0, 0.0)
    o = V.parse_args(["--model", "sd3.5-medium", "--preset", "ocr-stage"])
    assert (o.n_mc, o.mu, o.kl_coef, o.clip_eps, o.iterations) == (10, 2, 0.3, 0.0, 30)


@pytest.mark.trainer
def test_lora_init_comes_from_the_seed_alone(tmp_path, monkeypatch):
    """A reward that initialises a model on first use (the digits classifier, HPSv2's
    create_model) draws from the global RNG during setup's probe, but only in the first setup
    of a process: the LoRA initialisation must not depend on that (nor on anything run before)."""
    mod = tmp_path / "lazy_reward.py"
    mod.write_text("import torch\n_net = []\n"
                   "def score(images, prompts):\n"
                   "    if not _net:\n"
                   "        _net.append(torch.nn.Linear(64, 64))      # random init, global RNG\n"
                   "    return images.mean(dim=(1, 2, 3))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = V.parse_args(TINY + ["--reward", "lazy_reward:score"])
    lora = lambda run: {n: p.detach().clone() for n, p in
                        run.adapter.transformer.named_parameters() if "lora_A" in n}
    # pipelines passed in, as from a local folder (the tiny builder would reseed by itself)
    pipes = [TM.build_tiny_sd3_pipeline(), TM.build_tiny_sd3_pipeline()]
    first = lora(V.setup(args, pipe=pipes[0]))
    torch.rand(1000)                                            # anything else run before
    second = lora(V.setup(args, pipe=pipes[1]))
    assert first.keys() == second.keys() and first
    assert all(torch.equal(first[n], second[n]) for n in first)


@pytest.mark.trainer
def test_flux_lora_wraps_blocks_not_the_top_level_projection():
    pipe = TM.build_tiny_flux_pipeline()
    V.add_lora(pipe.transformer, 4, 8, FX.LORA_TARGETS.split(","))
    wrapped = {n for n, m in pipe.transformer.named_modules() if hasattr(m, "lora_A")}
    assert "single_transformer_blocks.0.proj_out" in wrapped and "proj_out" not in wrapped
    assert {"transformer_blocks.0.ff.net.2", "transformer_blocks.0.attn.to_q"} <= wrapped
    blocks = ("transformer_blocks", "single_transformer_blocks")
    assert all(n.split(".")[0] in blocks for n in wrapped)


@pytest.mark.trainer
def test_sd3_folder_saved_without_t5_loads_and_trains(tmp_path):
    pipe = TM.build_tiny_sd3_pipeline()
    pipe.text_encoder_3, pipe.tokenizer_3 = None, None
    pipe.register_modules(text_encoder_3=None, tokenizer_3=None)
    pipe.save_pretrained(tmp_path / "no_t5")
    index = json.loads((tmp_path / "no_t5" / "model_index.json").read_text())
    assert index["text_encoder_3"] in (None, [None, None])           # how diffusers saves it
    loaded = V.load_pipeline(str(tmp_path / "no_t5"), torch.float32)
    assert loaded.text_encoder_3 is None
    sizes = ["--resolution", "64", "--max_sequence_length", "32", "--lora_rank", "8",
             "--lora_alpha", "16"]
    assert V.main(TINY + sizes + ["--model", str(tmp_path / "no_t5"), "--iterations", "1",
                                  "--run_dir", str(tmp_path / "run")]) == 0
    assert math.isfinite(_metrics(tmp_path / "run")[0]["grad_norm"])


@pytest.mark.trainer
def test_fp16_trains_with_loss_scaling(tmp_path):
    """--dtype fp16 uses a GradScaler: the loss is scaled before backward (initial scale 2^16) and
    gradients unscaled before the clip, so the LoRA still moves and the logged grad norm is the
    true one, finite."""
    assert V.main(TINY + ["--iterations", "1", "--dtype", "fp16", "--device", "cpu",
                          "--run_dir", str(tmp_path)]) == 0
    m = _metrics(tmp_path)[0]
    assert m["grad_scale"] >= 2.0 ** 10 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    state = torch.load(tmp_path / "checkpoints" / "iter_000001" / "trainer_state.pt",
                       weights_only=True)
    assert state["scaler"]["scale"] == m["grad_scale"]                 # resumes with the same scale
    assert V.main(TINY + ["--iterations", "1", "--run_dir", str(tmp_path / "fp32")]) == 0
    assert _metrics(tmp_path / "fp32")[0]["grad_scale"] == 1.0          # fp32: no scaling


@pytest.mark.trainer
def test_fp16_resume_keeps_the_saved_loss_scale(tmp_path, monkeypatch):
    """A run resumed under fp16 continues with the loss scale its checkpoint holds, not the
    initial 2^16: a scale brought down to 1,024 before the save (as overflows do) scales the
    resumed run's first step, whose gradients would otherwise overflow again."""
    run = tmp_path / "run"
    assert V.main(TINY + ["--iterations", "1", "--dtype", "fp16", "--device", "cpu",
                          "--run_dir", str(run)]) == 0
    ckpt, state = V.read_checkpoint(str(run))
    assert state["scaler"]["scale"] == 2.0 ** 16                 # one step: no overflow yet
    state["scaler"]["scale"] = 1024.0
    torch.save(state, ckpt / V.CKPT_STATE)
    scales, real = [], V.optimizer_step

    def step(r):
        scales.append(r.scaler.get_scale())                       # the scale of this backward
        return real(r)
    monkeypatch.setattr(V, "optimizer_step", step)
    assert V.main(["--resume", str(run), "--iterations", "2"]) == 0
    assert scales == [1024.0] and _metrics(run)[-1]["grad_scale"] == 1024.0


# ------------------------------------------------------------------------------------------------
# 15. FLUX: packing, the tiny pipeline end to end, the local loading path
# ------------------------------------------------------------------------------------------------
FX = V.model_plugins()["flux"]  # examples/models/flux.py


@pytest.mark.math
def test_flux_unpacking_inverts_diffusers_packing():
    from diffusers import FluxPipeline
    lat = torch.randn(2, 16, 6, 10, dtype=torch.float64)
    packed = FluxPipeline._pack_latents(lat, 2, 16, 6, 10)
    assert packed.shape == (2, 15, 64)
    assert torch.equal(FX.unpack_latents(packed, 6, 10), lat)                 # exact: a permutation
    assert torch.equal(FX.unpack_latents(packed, 6, 10), FluxPipeline._unpack_latents(packed, 48, 80, 8))


@pytest.mark.trainer
def test_flux_image_ids_match_diffusers():
    from diffusers import FluxPipeline
    ad = FX.Adapter(TM.build_tiny_flux_pipeline(), torch.device("cpu"), V.Args(max_sequence_length=32))
    torch.testing.assert_close(ad._img_ids(16).float(),
                               FluxPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32))


@pytest.mark.trainer
def test_flux_defaults_follow_the_paper_protocol():
    a = V.parse_args(["--model", "flux.1-dev"])
    assert (a.num_steps, a.solver, a.n_mc, a.clip_eps, a.soft_clip_eta, a.guidance) == (16, "dpmpp2m", 4, 1e-2, 3.0, 3.5)
    assert a.mu > 1 and a.reward_aggregation == "per_reward" and "ff.net.0.proj" in a.lora_targets
    assert V.parse_args(["--model", "flux.1-dev", "--mu", "1"]).mu == 1            # flags still win
    s = V.parse_args(["--model", "sd3.5-medium"])
    assert (s.num_steps, s.solver, s.mu, s.clip_eps) == (40, "euler", 1, 0.0)
    # every value says where it comes from
    assert a.origin["clip_eps"].startswith("flux preset") and "[ours C" in a.origin["clip_eps"]
    assert s.origin["num_steps"] == "[paper P11] 40-step ODE rollouts" and s.origin["model"] == "command line"
    assert V.parse_args(["--model", "tiny"]).origin["lr"] == "tiny preset (examples/tools/tiny_models.py)"


@pytest.mark.trainer
def test_tiny_flux_two_iterations_and_local_loading(tmp_path):
    pipe = TM.build_tiny_flux_pipeline()
    pipe.save_pretrained(tmp_path / "flux")
    assert V.model_family(str(tmp_path / "flux")) == "flux"
    loaded = V.load_pipeline(str(tmp_path / "flux"), torch.float32)
    assert type(loaded).__name__ == "FluxPipeline"
    a, b = (FX.Adapter(p, torch.device("cpu"), V.Args(max_sequence_length=16)) for p in (pipe, loaded))
    x, t = torch.randn(2, 16, 64), torch.tensor([0.2, 0.9])
    with torch.no_grad():
        torch.testing.assert_close(a.velocity(x, t, a.encode(["a", "b"])), b.velocity(x, t, b.encode(["a", "b"])))
    small = ["--reward", "jpeg", "--iterations", "2", "--prompts_per_iter", "2", "--group_size", "4",
             "--num_steps", "4", "--eval_every", "1", "--save_every", "1", "--resolution", "64",
             "--max_sequence_length", "32", "--lora_rank", "4", "--lora_alpha", "8", "--no-gradient_checkpointing"]
    assert V.main(["--model", str(tmp_path / "flux"), "--run_dir", str(tmp_path / "run")] + small) == 0
    ms = [m for m in _metrics(tmp_path / "run") if "reward_mean" in m]
    assert len(ms) == 2 and all(math.isfinite(m["grad_norm"]) for m in ms)
    assert ms[0]["abs_log_ratio"] > 0                     # μ = 4 (FLUX default): later steps are off-policy
    from diffusers import FluxPipeline
    fresh = FluxPipeline.from_pretrained(str(tmp_path / "flux"))
    fresh.load_lora_weights(str(tmp_path / "run" / "checkpoints" / "iter_000002"))   # diffusers' own loader


# ------------------------------------------------------------------------------------------------
# 15b. Model plug-ins (examples/models/): --model resolves them as --reward resolves its plug-ins
# ------------------------------------------------------------------------------------------------
PLUGINS = sorted(V.model_plugins())


@pytest.mark.trainer
def test_model_plugins_are_found_and_their_names_resolve():
    assert "qwen_image" in PLUGINS                          # the plug-ins in examples/models/
    for name in PLUGINS:
        mod = V.model_plugins()[name]
        for alias, hub_id in mod.ALIASES.items():           # an alias: the real model's hub id
            assert V.resolve_model(alias) == hub_id and V.model_family(alias) == name
            assert V.model_family(hub_id) == name and V.is_real_model(alias)
        for tiny in mod.TINY:                                # a tiny alias: built offline
            assert V.resolve_model(tiny) == tiny and not V.is_real_model(tiny)
            a = V.parse_args(["--model", tiny])              # each default says where it is from
            for k, (value, src) in mod.DEFAULTS.items():
                if k not in mod.TINY_PRESET:
                    assert getattr(a, k) == value and src in a.origin[k], k
    with pytest.raises(V.ConfigError, match="unknown model 'tiny-qwen-imag'.*tiny-qwen-image"):
        V.resolve_model("tiny-qwen-imag")


USER_PLUGIN = """
import vgrpo as V
PIPELINES, ALIASES, TINY = ("StableDiffusion3Pipeline",), {}, {"tiny-mine": "build"}
TINY_PRESET = V.tiny_models().PRESETS["tiny"]
DEFAULTS = {"kl_coef": (0.05, "my own KL")}
CALLS = []


class Adapter(V.SD3Adapter):          # SD3's, counting its velocity calls
    def __init__(self, pipe, device, args):
        super().__init__(pipe, device, args.max_sequence_length)

    def velocity(self, x, t, cond):
        CALLS.append(x.shape[0])
        return super().velocity(x, t, cond)


def build(seed=0):
    return V.tiny_models().build_tiny_sd3_pipeline(seed)
"""


@pytest.mark.trainer
def test_a_users_model_plugin_module_colon_name_trains_and_bad_ones_are_one_line(tmp_path, capsys, monkeypatch):
    """--model module:NAME, as --reward module:function: the user's module beside the run (the
    contract of examples/models/) trains through its own Adapter; a module that does not import
    or lacks the contract is one line, exit 2, before anything loads."""
    (tmp_path / "my_sd3.py").write_text(USER_PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    a = V.parse_args(["--model", "my_sd3:tiny-mine"])
    assert a.kl_coef == 0.05 and "my own KL" in a.origin["kl_coef"] and a.resolution == 64
    assert V.main(["--model", "my_sd3:tiny-mine", "--reward", "jpeg", "--iterations", "1",
                   "--run_dir", str(tmp_path / "run")]) == 0
    import my_sd3
    assert my_sd3.CALLS and len(_metrics(tmp_path / "run")) >= 1
    (tmp_path / "half.py").write_text("PIPELINES = ()\n")
    for model, says in (("no_such_module:x", "could not import module 'no_such_module'"),
                        ("half:x", "'half' lacks ALIASES, TINY, DEFAULTS, Adapter")):
        capsys.readouterr()
        assert V.main(["--model", model, "--reward", "jpeg", "--run_dir", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and not (tmp_path / "b").exists(), err


@pytest.mark.trainer
@pytest.mark.parametrize("name", PLUGINS)
def test_a_model_plugin_trains_from_its_tiny_alias_and_its_saved_folder(name, tmp_path, capsys):
    """`--model tiny-…` trains through main; the same pipeline saved to a folder loads through
    load_pipeline (the hub ids' path) as that family; its LoRA loads in the stock pipeline; a
    folder missing a part is one line before anything loads."""
    mod = V.model_plugins()[name]
    tiny = next(iter(mod.TINY))
    small = ["--reward", "jpeg", "--iterations", "2", "--save_every", "1", "--eval_every", "2",
             "--mu", "1"]                                 # one step per iteration: θ = θ_old
    assert V.main(["--model", tiny, "--run_dir", str(tmp_path / "a")] + small) == 0
    ms = [m for m in _metrics(tmp_path / "a") if "reward_mean" in m]
    assert len(ms) == 2 and all(math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in ms)
    assert [m["abs_log_ratio"] for m in ms] == [0.0, 0.0]
    folder = tmp_path / "pipe"
    getattr(mod, mod.TINY[tiny])().save_pretrained(folder)
    assert V.model_family(str(folder)) == name
    pipe = V.load_pipeline(str(folder), torch.float32)
    assert type(pipe).__name__ in mod.PIPELINES
    pipe.load_lora_weights(str(tmp_path / "a" / "checkpoints" / "iter_000002"))  # diffusers' own
    (folder / "vae" / "config.json").unlink()
    capsys.readouterr()
    assert V.main(["--model", str(folder), "--run_dir", str(tmp_path / "b")] + small) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vae" in err[0] and not (tmp_path / "b").exists(), err


# ------------------------------------------------------------------------------------------------
# 16. Data parallelism: 2 processes under torchrun (gloo, CPU) = 1 process
#    The same global batch on each side: torchrun runs examples/cluster.py (FSDP2), the one process
#    vgrpo.py.
# ------------------------------------------------------------------------------------------------
DDP = ["--model", "tiny", "--reward", "jpeg", "--prompts_per_iter", "2", "--group_size", "3", "--num_steps", "4",
       "--eval_every", "0", "--save_every", "1", "--mu", "1", "--device", "cpu"]


def _close_runs(a_dir, b_dir, it, full=False):
    """Two runs that differ only in how the batch is split over processes. Each process runs the
    transformer on half the rows and FSDP reduce-scatters the gradients: another summation
    order, fp32 rounding ~1e-7 relative per operation. The gradient norm is a smooth function of
    it (measured: equal to 8 digits), so 1e-3 relative is a wide margin; the mean-colour reward
    moves by ≲ 1e-5 (measured 0.0): 1e-4 absolute. Adam moves each weight by ≈ lr·sign(g) per
    step, and a weight whose gradient is at rounding level may take the other sign: the largest
    difference may reach lr = 1e-2 per step, but the weights as a whole (relative norm of the
    difference, measured ≤ 4e-7) must agree to 1e-4."""
    xs, ys = _strip_times(_metrics(a_dir)), _strip_times(_metrics(b_dir))
    assert [x["iter"] for x in xs] == [y["iter"] for y in ys]     # zip below: both sides whole
    for x, y in zip(xs, ys):
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-4)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-3)
        assert x["surrogate_cv_group"] == pytest.approx(y["surrogate_cv_group"], rel=1e-3)
    a, b = _trained(a_dir, it, full), _trained(b_dir, it, full)
    assert set(a) == set(b) and a
    diff = math.sqrt(sum((a[k].double() - b[k].double()).square().sum().item() for k in a))
    norm = math.sqrt(sum(a[k].double().square().sum().item() for k in a))
    assert diff / norm < 1e-4 and max((a[k] - b[k]).abs().max().item() for k in a) < 2e-2


CLUSTER = ROOT / "examples" / "cluster.py"          # vgrpo.py with preemption, requeue and FSDP2


def _launch(args, cwd, script=CLUSTER, timeout=600, **env_extra):
    """`torchrun --nproc_per_node=2 script args` in cwd, one thread per process; the finished run."""
    import subprocess
    import sys
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)] + args, env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _torchrun(args, tmp_path, script=CLUSTER, **env_extra):
    p = _launch(args, tmp_path, script, **env_extra)
    assert p.returncode == 0, p.stderr[-3000:]


# Under bf16 autocast (what every GPU run uses), one torchrun launch runs every 2-process run: a
# launch spends ~15 s importing, a tiny run 1–3 s. The runs share one process group. FLUX at 128 px:
# the rotary angles of its 64 px 4 × 4 token grid are too small for a bf16 rounding of cos/sin to
# show; SD3 at 64 px.
BF16 = DDP + ["--dtype", "bf16", "--iterations", "1"]


BF16_RUNS = {"sd3-lora": ["--model", "tiny"],
             "sd3-lora-group": ["--model", "tiny", "--pair_sharing", "group"],
             "sd3-full": ["--model", "tiny", "--full_finetune", "--lr", "1e-4"],
             "flux-lora": ["--model", "tiny-flux", "--resolution", "128"],
             "flux-full": ["--model", "tiny-flux", "--resolution", "128", "--full_finetune", "--lr", "1e-4"]}


RUNS_SCRIPT = """\
import json, sys
import torch
sys.path.insert(0, {root!r} + "/examples")
import cluster
import vgrpo
torch.distributed.destroy_process_group = lambda: None      # one process group for every run
setup, state, live = vgrpo.setup, vgrpo.full_state, {{}}


def setup_and_keep(*a, **kw):
    live["run"] = setup(*a, **kw)
    return live["run"]


def gathered(tr, opt=None):  # "skip" also gathers AdamW's state first, before the weights: either
    run = live["run"]                              # order must work after no-grad forwards
    if opt is None and run.run_dir.name == "skip":
        state(tr, run.opt)
    return state(tr, opt)


vgrpo.setup, vgrpo.full_state = setup_and_keep, gathered
for run_dir, argv in json.loads(sys.argv[1]).items():
    assert cluster.main(argv + ["--run_dir", run_dir]) == 0, run_dir
cluster.exit_process(0)          # as `torchrun examples/cluster.py` ends (docs/tests.md "A clean exit under torchrun")
"""


SKIP_REWARD = """\
calls = []


def reward(images, prompts):     # the probe and iteration 0: the mean colour; iteration 1: constant
    calls.append(len(images))
    return images.float().mean(dim=(1, 2, 3)) * (len(calls) != 3)
"""


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> Path:
    """The folder of every 2-process run of the tests below, each in its subfolder, all run by one
    launch: the bf16 runs of BF16_RUNS, a bf16 full fine-tune whose second iteration skips its
    update ("skip"), and fp32 runs: LoRA for 2 iterations and for 1 (resumed by 1 process in its
    test), a full fine-tune for 2, and a 1-process full fine-tune of 1 iteration (run here,
    before the launch) resumed by the launch to 2."""
    d = tmp_path_factory.mktemp("runs")
    reward = _smooth_reward(d)
    runs = {str(d / name): BF16 + ["--reward", reward] + extra for name, extra in BF16_RUNS.items()}
    (d / "skipping.py").write_text(SKIP_REWARD)
    runs[str(d / "skip")] = BF16 + ["--reward", "skipping:reward", "--full_finetune", "--lr", "1e-4",
                                    "--iterations", "2"]
    fp32, full = DDP + ["--reward", reward], ["--full_finetune", "--lr", "1e-4"]
    runs[str(d / "fp32-lora")] = fp32 + ["--iterations", "2"]
    runs[str(d / "fp32-lora-part")] = fp32 + ["--iterations", "1"]
    runs[str(d / "fp32-full")] = fp32 + full + ["--iterations", "2"]
    sys.path.insert(0, str(d))                                  # the reward, for this process
    try:
        assert V.main(fp32 + full + ["--iterations", "1", "--run_dir", str(d / "fp32-full-part")]) == 0
    finally:
        sys.path.remove(str(d))
    runs[str(d / "fp32-full-part")] = ["--resume", str(d / "fp32-full-part"), "--iterations", "2"]
    (d / "runs.py").write_text(RUNS_SCRIPT.format(root=str(ROOT)))
    _torchrun([json.dumps(runs)], d, script=d / "runs.py")
    return d


@pytest.mark.multiprocess
def test_fsdp_two_processes_equal_one_and_resume_two_to_one(two_process_runs, tmp_path, monkeypatch):
    """LoRA under FSDP2: 2 processes (half the groups each) compute what 1 process computes; a
    2-process run resumed by 1 process continues like the uninterrupted 2-process run."""
    smooth = DDP + ["--reward", _smooth_reward(tmp_path, monkeypatch)]
    assert V.main(smooth + ["--iterations", "2", "--run_dir", str(tmp_path / "single")]) == 0
    _close_runs(two_process_runs / "fp32-lora", tmp_path / "single", 2)
    part = two_process_runs / "fp32-lora-part"                                    # 1 iteration
    assert V.main(["--resume", str(part), "--iterations", "2"]) == 0              # 2 → 1
    _close_runs(part, two_process_runs / "fp32-lora", 2)


@pytest.mark.multiprocess
def test_fsdp_full_finetune_equals_one_process_and_resumes_one_to_two(two_process_runs, tmp_path,
                                                                       monkeypatch):
    """Full fine-tuning under FSDP2 (fp32 master weights and AdamW state sharded): 2 processes
    equal 1, and a 1-process run resumed by 2 processes equals the uninterrupted 1-process run."""
    full = DDP + ["--reward", _smooth_reward(tmp_path, monkeypatch), "--full_finetune",
                  "--lr", "1e-4"]
    assert V.main(full + ["--iterations", "2", "--run_dir", str(tmp_path / "single")]) == 0
    _close_runs(two_process_runs / "fp32-full", tmp_path / "single", 2, full=True)
    from diffusers import AutoModel              # reads the class from config.json: not FSDP's
    tr = AutoModel.from_pretrained(str(two_process_runs / "fp32-full/checkpoints/iter_000002/transformer"))
    assert type(tr).__name__ == "SD3Transformer2DModel"
    _close_runs(two_process_runs / "fp32-full-part", tmp_path / "single", 2, full=True)   # 1 → 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(BF16_RUNS))
def test_fsdp_bf16_two_processes_equal_one(name, two_process_runs, tmp_path, monkeypatch):
    """In bf16 autocast 2 processes compute what 1 computes, SD3 and FLUX, LoRA and full: FSDP
    casts no input to bf16 (SD3's timestep 1000·t, FLUX's rotary cos/sin stay fp32). With
    --pair_sharing group each process scores its own groups on their own pairs (indexed
    globally), as one process does."""
    one, two = tmp_path / "one", two_process_runs / name
    assert V.main(BF16 + ["--reward", _smooth_reward(tmp_path, monkeypatch), "--run_dir", str(one)]
                  + BF16_RUNS[name]) == 0
    x, y = _metrics(one)[0], _metrics(two)[0]
    # Iteration 0 runs the same weights through the same operations in the same dtypes; only the
    # rows are split over the processes. Its forward quantities (the rollouts' mean colour ≈ 0.55,
    # S_old's CV) measured equal to 7 digits: 1e-5 absolute and 2e-4 relative leave room for a
    # kernel that rounds a split batch otherwise. One bf16 rounding more of an input (8 mantissa
    # bits: 2^-9 ≈ 2e-3 relative), what a cast of FSDP's adds, moved them by 1e-4 (SD3: the
    # timestep) and 2e-3 relative (FLUX: the CV, through cos/sin). SD3's full fine-tune: FSDP
    # gathers the attention's RMSNorm scales in bf16, where one process keeps them fp32, and
    # diffusers' RMSNorm then rounds q and k to bf16: the CV moved by 2.4e-3, so 1e-2 there.
    assert y["reward_mean"] == pytest.approx(x["reward_mean"], abs=1e-5)
    assert y["surrogate_cv"] == pytest.approx(x["surrogate_cv"], rel=1e-2 if name == "sd3-full" else 2e-4)
    # The gradient: each process's weight gradients come out of bf16 matmuls over its own rows and
    # are added in fp32, one bf16 rounding (2e-3) per element that the norm averages (measured ≤
    # 3.2e-4; 2.1e-2 with the input cast): 2e-3. The weights after the step: Adam moves each by
    # ≈ lr·sign(g), a sign that rounding may flip where g ≈ 0 (measured ≤ 1.7e-3 in relative norm
    # of the difference; 2.3e-2 with the input cast): 1e-2.
    assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=2e-3)
    a, b = _trained(one, 1, "full" in name), _trained(two, 1, "full" in name)
    assert set(a) == set(b) and a
    diff = math.sqrt(sum((a[k].double() - b[k].double()).square().sum().item() for k in a))
    assert diff / math.sqrt(sum(a[k].double().square().sum().item() for k in a)) < 1e-2


@pytest.mark.multiprocess
def test_fsdp_full_finetune_saves_after_a_skipped_update(two_process_runs):
    """A full fine-tune under FSDP checkpoints after an iteration whose advantages were all 0, after
    an earlier optimizer step: forwards without a backward leave the root's parameters unsharded,
    which the optimizer state's gather could not map (KeyError: 0 when it is gathered before the
    weights, as RUNS_SCRIPT does here too). The skipped update changed nothing, and
    diffusers' AutoModel loads the saved transformer (its config names the model's class, not
    the FSDP class that wraps it)."""
    from diffusers import AutoModel
    run = two_process_runs / "skip"
    assert [m["skipped"] for m in _metrics(run)] == [False, True]
    a, b = _trained(run, 1, full=True), _trained(run, 2, full=True)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert V.read_checkpoint(str(run))[1]["optimizer_saved"]
    tr = AutoModel.from_pretrained(str(run / "checkpoints" / "iter_000002" / "transformer"))
    assert type(tr).__name__ == "SD3Transformer2DModel"
    assert all(torch.equal(p.detach(), b[n]) for n, p in tr.named_parameters())


@pytest.mark.multiprocess
def test_sigkill_during_a_sharded_checkpoint_write_leaves_latest_loadable(tmp_path, monkeypatch):
    """Rank 0 is SIGKILLed in the middle of writing iteration 2's checkpoint (after the gather,
    inside torch.save of the optimizer state; injected through sitecustomize in every process):
    torchrun ends the run, `latest` still names iteration 1, and a resume finishes the run."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal, torch\n"
        "_save = torch.save\n"
        "def save(obj, f, *a, **k):\n"
        "    if str(f).endswith('iter_000002/optimizer.pt'):\n"
        "        _save(obj, f, *a, **k)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return _save(obj, f, *a, **k)\n"
        "torch.save = save\n")
    smooth = DDP + ["--reward", _smooth_reward(tmp_path, monkeypatch)]
    run = tmp_path / "run"
    with pytest.raises(AssertionError):
        _torchrun(smooth + ["--iterations", "3", "--run_dir", str(run)], tmp_path,
                  PYTHONPATH=str(hook))
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
    assert V.read_checkpoint(str(run))[1]["iteration"] == 1
    assert not (run / "checkpoints" / "iter_000002").exists()        # only its temporary folder
    assert V.main(["--resume", str(run)]) == 0
    assert (run / "checkpoints" / "latest").read_text() == "iter_000003"
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2]


@pytest.mark.multiprocess
def test_sigterm_to_torchrun_saves_on_every_process_and_the_run_continues(tmp_path):
    """SIGTERM to the torchrun agent (what SLURM and Kubernetes send) is forwarded to both
    workers, which agree at the next preemption point, save within the agent's shutdown window
    and exit with 75 (examples/cluster.py); the same command with --resume auto then continues, and the two
    2-process runs end with the same metrics (same processes, same float operations)."""
    (tmp_path / "term_reward.py").write_text(
        "import os, signal\nfrom pathlib import Path\n"
        "def score(images, prompts):\n"
        "    calls = Path(f'calls{os.environ.get(\"RANK\", \"0\")}')\n"
        "    n = int(calls.read_text()) + 1 if calls.exists() else 1\n"
        "    calls.write_text(str(n))\n"
        "    if os.environ.get('TERM_AT') and n == int(os.environ['TERM_AT']) and os.environ.get('RANK') == '0':\n"
        "        os.kill(os.getppid(), signal.SIGTERM)          # the agent, as a scheduler would\n"
        "    return images.float().mean(dim=(1, 2, 3))\n")
    args = DDP + ["--reward", "term_reward:score", "--iterations", "4", "--save_every", "10"]
    launch = lambda run, **e: _launch(args + ["--run_dir", str(run), "--resume", "auto"], tmp_path,
                                      script=CLUSTER, PYTHONPATH=str(tmp_path), **e)
    ref = launch(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    for f in tmp_path.glob("calls*"):
        f.unlink()
    # call 1 is the start-up probe, 2 the reward of iteration 0, 3 of iteration 1
    cut = launch(tmp_path / "run", TERM_AT="3")
    # the workers stop at the first preemption point both reach after the agent forwards the
    # signal: inside iteration 1 (saving 1 iteration), or after its step when the forwarding is
    # slow, as on a loaded machine (saving 2); either way the resumed run must end as `ref` does
    when = re.search(r"preempted: (at|after) iteration 1\b", cut.stderr)
    assert when, cut.stderr[-3000:]
    assert cut.returncode != 0                      # the agent itself dies of its SIGTERM
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == \
        {"at": "iter_000001", "after": "iter_000002"}[when.group(1)]
    again = launch(tmp_path / "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _strip_times(_metrics(tmp_path / "run")) == _strip_times(_metrics(tmp_path / "ref"))


@pytest.mark.multiprocess
def test_torchrun_processes_exit_cleanly_while_gloo_still_holds_tensors(tmp_path):
    """The end of a 2-process run: torch keeps the process group alive past
    destroy_process_group (DTensor's caches hold FSDP's mesh), and a gloo worker thread that lets
    go of the last collective's tensors while Python shuts down needs the GIL there, which aborts
    the process ("terminate called without an active exception"; once in CI, in the last second
    of a 2-process run). Here collectives end just before the exit, as at the end of a save on the
    process that does not write: `exit_process`, what examples/cluster.py ends with, must still exit
    cleanly. It is a race: with `sys.exit` in its place 12 launches of 30 aborted on a 2-core
    machine, so 5 launches catch that with probability ≈ 0.92; with `exit_process`, 0 of 40."""
    (tmp_path / "ends.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "import torch, torch.distributed as dist, cluster\n"
        "dist.init_process_group('gloo')\n"
        "kept = dist.group.WORLD          # alive past destroy, as FSDP's mesh is in DTensor's caches\n"
        "xs = [torch.randn(20000) for _ in range(8)]\n"
        "for _ in range(20):\n"
        "    for work in [dist.all_reduce(x, async_op=True) for x in xs]:\n"
        "        work.wait()\n"
        "    dist.all_gather([torch.empty(20000) for _ in range(2)], xs[0])\n"
        "dist.destroy_process_group()\n"
        "cluster.exit_process(0)\n")
    for launch in range(5):
        p = _launch([], tmp_path, script=tmp_path / "ends.py", timeout=300)
        assert p.returncode == 0 and "terminate called" not in p.stderr, (launch, p.stderr[-3000:])


@pytest.mark.multiprocess
def test_out_of_gpu_memory_in_one_process_ends_the_run_without_a_hang(tmp_path, monkeypatch):
    """Out of memory in one process of two under examples/cluster.py (rank 1's reward of
    iteration 3, after the save of iteration 2): that process ends in one line and saves nothing (a save is a collective that
    the other process, waiting in its own, would never join: NCCL would hang for the 1-h
    timeout), torchrun stops the other, `latest` names the last complete checkpoint, and
    --resume (here by one process) continues, logging each iteration once."""
    (tmp_path / "oom_reward.py").write_text(
        "import os\nimport torch\ncalls = []\n"
        "def score(images, prompts):\n"
        "    calls.append(1)             # call 1: the start-up probe, then iteration len(calls) - 2\n"
        "    if os.environ.get('OOM') and os.environ.get('RANK') == '1' and len(calls) == 5:\n"
        "        raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "    return images.float().mean(dim=(1, 2, 3))\n")
    args = DDP + ["--reward", "oom_reward:score", "--iterations", "4", "--save_every", "2"]
    cut = _launch(args + ["--run_dir", str(tmp_path / "run")], tmp_path, timeout=180,  # ~15 s;
                  script=CLUSTER, PYTHONPATH=str(tmp_path), OOM="1")              # a hang fails
    assert cut.returncode != 0
    said = [l for l in cut.stderr.splitlines() if "out of GPU memory" in l]
    assert len(said) == 1 and "error: out of GPU memory in decoding and rewards" in said[0]
    assert "saved" not in said[0] and "checkpoints/latest (iter_000002)" in said[0], said[0]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "iter_000002"
    monkeypatch.syspath_prepend(str(tmp_path))                  # the reward, for this process
    assert V.main(["--resume", str(tmp_path / "run")]) == 0
    assert [m["iter"] for m in _metrics(tmp_path / "run")] == [0, 1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "iter_000004"


@pytest.mark.multiprocess
def test_prompts_must_split_evenly_across_processes(tmp_path, capsys, monkeypatch):
    """examples/cluster.py under torchrun: whole groups per process, μ equal minibatches of each
    process's samples; one line each, before the process group is joined."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cluster = _load_example("cluster")
    for flags, said in ((["--prompts_per_iter", "3"], "must be divisible by the 2 processes"),
                        (["--mu", "2"], "each process's 3 samples must split into --mu 2")):
        run = tmp_path / "should_not_exist"
        assert cluster.main(TINY + flags + ["--run_dir", str(run)]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("error:") == 1 and not run.exists(), err


@pytest.mark.multiprocess
def test_vgrpo_under_torchrun_names_the_companion_in_one_line(tmp_path, capsys, monkeypatch):
    """vgrpo.py trains in one process: under torchrun (WORLD_SIZE > 1) it says to run
    examples/cluster.py with the same flags, exits 2 and writes nothing."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    _fails(TINY, tmp_path, capsys, r"^error: vgrpo\.py trains in one process; under torchrun run "
           r"examples/cluster\.py with the same flags\n$")


# ------------------------------------------------------------------------------------------------
# 17. Compilation: --compile keeps ρ ≡ 1, the eager run's numbers, and compiles once
# ------------------------------------------------------------------------------------------------
# Every pass of these runs has 8 rows (rollout and evaluation chunks of 8, micro-batches of 2
# samples × 4 pairs), so each block kind compiles one no-grad graph and one graph with its
# backward, during setup; nothing may compile after that.
COMPILED = ["--iterations", "2", "--mu", "1", "--prompts_per_iter", "2", "--group_size", "4", "--num_steps", "4",
            "--rollout_batch", "8", "--micro_batch", "2", "--n_mc", "4", "--n_eval", "8",
            "--eval_every", "1", "--save_every", "1"]


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    import torch._dynamo.utils
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _cache_entries() -> int:
    """Compiled variants of nn.Module._call_impl, the code every compiled block runs: what torch's
    recompile limit counts (beyond it dynamo silently falls back to eager)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(torch.nn.Module._call_impl.__code__))


@pytest.mark.trainer
@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_compiled_run_equals_the_eager_run_and_compiles_once(model, tmp_path, monkeypatch):
    """--compile on the CPU (inductor, gcc): the same rewards, surrogate CV and gradient norms as
    the eager run, the first step's |log ρ| exactly 0, and after setup's compilation nothing
    compiles again: not in later iterations, not in an evaluation, not in a resume."""
    flags = ["--model", model, "--reward", _smooth_reward(tmp_path, monkeypatch)] + COMPILED
    assert V.main(flags + ["--no-compile", "--run_dir", str(tmp_path / "eager")]) == 0
    after_setup, real = [], V.compile_blocks

    def compile_blocks(*a, **k):
        out = real(*a, **k)
        after_setup.append(_graphs())
        return out
    monkeypatch.setattr(V, "compile_blocks", compile_blocks)
    assert V.main(flags + ["--compile", "--run_dir", str(tmp_path / "compiled")]) == 0
    assert _graphs() == after_setup[0]                  # iterations 0–1, evaluations 0–2: none
    eager, compiled = _metrics(tmp_path / "eager"), _metrics(tmp_path / "compiled")
    # inductor fuses the blocks' elementwise ops and reorders some fp32 reductions: each result
    # moves by rounding (~1e-6 relative), carried through 4 ODE steps and two Adam steps at lr
    # 1e-2 into the images; the smooth reward (mean colour ≈ 0.5) moves ≲ 1e-5: 1e-4 absolute;
    # gradient norms and the surrogate CV, smooth in the same numbers, 1e-3 relative
    assert eager and [m["iter"] for m in eager] == [m["iter"] for m in compiled]
    for a, b in zip(eager, compiled):
        for k in ("reward_mean", "eval_reward_mean"):
            if k in a:
                assert b[k] == pytest.approx(a[k], abs=1e-4), (a["iter"], k)
        for k in ("grad_norm", "surrogate_cv"):
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-3), (a["iter"], k)
        if "abs_log_ratio_first" in b:
            assert b["abs_log_ratio_first"] == 0.0 and b["abs_log_ratio"] == 0.0     # μ = 1
    n = _graphs()
    assert V.main(["--resume", str(tmp_path / "compiled"), "--iterations", "3"]) == 0
    assert _graphs() == n                               # a resume: setup's passes hit the cache
    assert _metrics(tmp_path / "compiled")[-1]["iter"] == 3
    import torch._dynamo
    assert _cache_entries() < torch._dynamo.config.recompile_limit


@pytest.mark.trainer
def test_a_compile_failure_is_one_line_naming_no_compile_and_nothing_is_written(tmp_path, capsys,
                                                                                 monkeypatch):
    """A backend that cannot compile (here every compiled block raises as a missing C compiler
    would) fails in setup, before the first iteration: one line naming --no-compile, status 2,
    no run folder; --no-compile then runs."""
    def broken(self, *a, **k):
        def call(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        self._compiled_call_impl = call
    monkeypatch.setattr(torch.nn.Module, "compile", broken)
    run = tmp_path / "run"
    capsys.readouterr()
    assert V.main(TINY + ["--compile", "--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: torch\.compile failed \(RuntimeError: .*No working C\+\+ compiler"
                        r".*\); run with --no-compile\n", err), err
    assert not run.exists()
    assert V.main(TINY + ["--no-compile", "--iterations", "1", "--run_dir", str(run)]) == 0


@pytest.mark.trainer
@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_compiled_grad_and_no_grad_passes_agree_at_the_same_weights(model, tmp_path, monkeypatch):
    """At μ = 4 the θ_old pass (no grad) and θ's pass (with grad) run different compiled graphs;
    at the same weights they must give the same surrogate, or every later step's ratio is biased.
    Also the first step of a compiled μ = 4 iteration has ρ ≡ 1 exactly."""
    flags = ["--model", model, "--reward", _smooth_reward(tmp_path, monkeypatch)]
    run = V.setup(V.parse_args(flags + COMPILED + ["--mu", "4", "--compile"]))
    ro = V.collect_rollouts(run, 0)
    pairs = V.draw_iteration_pairs(run, 0)
    rows = torch.arange(2)
    s_grad, x_grad = V.surrogate_pass(run, ro, pairs, rows)
    with torch.no_grad():
        s_old, x_old = V.surrogate_pass(run, ro, pairs, rows)
    # the same operations on the same numbers in two fused graphs: fp32 rounding of their
    # reductions only, |s| ≈ 0.1–1: 1e-5 absolute on each pair, 1e-6 on the ratio's log
    torch.testing.assert_close(s_grad.detach(), s_old, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_grad.detach(), x_old, atol=1e-5, rtol=1e-5)
    log_ratio = (s_grad.detach().mean(dim=1) - s_old.mean(dim=1)).abs().max().item()
    assert log_ratio < 1e-6
    blocks = V.transformer_blocks(run.adapter.transformer)
    for blk in blocks:                                  # the same pass, eager: S itself agrees
        blk._compiled_call_impl = None
    with torch.no_grad():
        s_eager, _ = V.surrogate_pass(run, ro, pairs, rows)
    torch.testing.assert_close(s_old, s_eager, atol=1e-5, rtol=1e-5)
    for blk in blocks:
        blk.compile()
    m = V.iteration(run, 0)
    assert m["abs_log_ratio_first"] == 0.0 and m["nfe_old"] == 3.0      # N_MC · (μ − 1)/μ


# ------------------------------------------------------------------------------------------------
# 18. Documentation and style (tier docs)
# ------------------------------------------------------------------------------------------------
@pytest.mark.docs
def test_readme_loss_snippet_runs():
    """The README's "Use the loss in your own trainer" block, as written (CPU) and with its one
    device line set to the meta device, where an operation that mixes in a CPU tensor raises: so
    the pairs and everything else follow that line (what a GPU user needs)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use the loss in your own trainer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    line = 'device = torch.device("cpu")'
    assert code.count(line) == 1 and code.count("torch.device(") == 1
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert torch.isfinite(ns["loss"]) and torch.isfinite(ns["loss_kl"])
    assert ns["net"].weight.grad is not None and ns["net"].weight.grad.abs().sum() > 0
    assert ns["stats"]["ratio"].item() == pytest.approx(1.0)
    meta = {}
    exec(compile(code.replace(line, 'device = torch.device("meta")'), "README.md", "exec"), meta)
    assert meta["loss"].device.type == "meta" and meta["net"].weight.grad.device.type == "meta"
    assert meta["t"].device.type == "meta" and meta["eps"].device.type == "meta"


@pytest.mark.docs
def test_the_algorithm_box_is_quoted_word_for_word():
    """The algorithm box opens vgrpo.py (§0); METHOD.md "Algorithm" and the README's "One
    iteration" quote it word for word, in their first code block, so the three never drift."""
    doc = V.__doc__.splitlines()
    start = next(i for i, line in enumerate(doc) if line.startswith("ALGORITHM"))
    box = [line[4:] for line in doc[start + 1:doc.index("", start)]]
    assert len(box) >= 9 and box[0].startswith("0. θ_old ← θ")
    assert any(l.startswith("Rollouts") for l in box) and box[-1].endswith("act only at μ > 1 (FLUX's μ = 4).")
    for name, heading in (("METHOD.md", "\n## Algorithm (one iteration)\n"),
                          ("README.md", "\n### One iteration\n")):
        section = (ROOT / name).read_text().split(heading, 1)[1]
        assert section.split("```", 2)[1].strip("\n").splitlines() == box, name


@pytest.mark.docs
def test_vgrpo_reads_plainly():
    """How vgrpo.py reads, counted with ast: every function at most 60 lines; at most 3
    conditional expressions per 100 code lines (non-blank lines outside comments and
    docstrings); no conditional iteration (`for x in (...) if c else ()`); at most 3 walrus
    operators."""
    import io
    import tokenize
    src = (ROOT / "vgrpo.py").read_text()
    tree, lines = ast.parse(src), src.splitlines()
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline)
                if t.type == tokenize.COMMENT and lines[t.start[0] - 1].lstrip().startswith("#")}
    code = [i for i, line in enumerate(lines, 1) if line.strip() and i not in docs | comments]
    nodes = list(ast.walk(tree))
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in nodes
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 60]
    assert long == []
    if_exps = sum(isinstance(n, ast.IfExp) for n in nodes)
    assert if_exps <= 0.03 * len(code), (if_exps, len(code))
    assert not [n.lineno for n in nodes if isinstance(n, (ast.For, ast.comprehension))
                and isinstance(n.iter, ast.IfExp)]
    assert sum(isinstance(n, ast.NamedExpr) for n in nodes) <= 3


HARNESS = re.compile(r"run\.local|run\.gather|run\.broadcast|torch\.distributed|run\.world"
                     r"|run\.rank|scaler|run\.poll|run\.backward|n_old_pass|log\.append")


@pytest.mark.docs
def test_the_harness_lines_inside_the_steps_are_marked():
    """The §7 banner, kept true: in `iteration` and its steps, every statement that belongs to
    the harness (preemption points, a process's share of the batch, the collectives that
    examples/cluster.py fills in, fp16 and FSDP in the backward, the statistics kept for the
    log) carries `# harness:` and its reason, on one of its lines; a block carries it on its
    first line."""
    lines = (ROOT / "vgrpo.py").read_text().splitlines()
    steps = ("iteration", "collect_rollouts", "reward_and_advantages", "draw_iteration_pairs",
             "minibatches", "old_surrogates", "update_steps", "surrogate_pass")
    unmarked = []

    def visit(body):
        for st in body:
            inner = [b for b in (getattr(st, "body", None), getattr(st, "orelse", None)) if b]
            head = lines[st.lineno - 1:(inner[0][0].lineno - 1 if inner else st.end_lineno)]
            if any("# harness:" in line for line in head):
                continue
            if inner:
                visit(sum(inner, []))
            elif HARNESS.search(" ".join(head)):
                unmarked.append(head[0].strip())
    funcs = [n for n in ast.parse("\n".join(lines)).body if isinstance(n, ast.FunctionDef)]
    assert {n.name for n in funcs} >= set(steps)
    for fn in funcs:
        if fn.name in steps:
            visit(fn.body)
    assert unmarked == []


TIERS = ("math", "trainer", "examples", "multiprocess", "docs")      # registered in pytest.ini


@pytest.mark.docs
def test_every_test_has_one_tier():
    """Each test of every test file (this one and examples/**/test_*.py) carries exactly one tier
    marker, so `pytest -m <tier>` partitions the suite."""
    files = sorted([*ROOT.glob("test_*.py"), *(ROOT / "examples").rglob("test_*.py")])
    assert Path(__file__).resolve() in [f.resolve() for f in files] and len(files) > 1
    bad = []
    for file in files:
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                tiers = [d.attr for d in node.decorator_list if isinstance(d, ast.Attribute)
                         and ast.unparse(d.value) == "pytest.mark" and d.attr in TIERS]
                if len(tiers) != 1:
                    bad.append(f"{file.relative_to(ROOT)}::{node.name}: {tiers}")
    assert not bad, f"mark each with exactly one of @pytest.mark.{'/'.join(TIERS)}: {bad}"
    ini = (ROOT / "pytest.ini").read_text()
    assert all(re.search(rf"^\s+{t}:", ini, re.M) for t in TIERS)


@pytest.mark.docs
def test_sections_follow_the_guarantees_table():
    """The numbered section banners of this file are the rows of docs/tests.md's table "Where
    each guarantee is tested", with the same numbers and titles in the same order, and every
    test sits under one of them."""
    doc = (ROOT / "docs" / "tests.md").read_text()
    table = doc.split("## Where each guarantee is tested", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([^|]+?) \|", table, re.M)
    src = Path(__file__).read_text()
    banners = re.findall(r"^# (\d+)\. (.+)$", src, re.M)
    assert rows and rows == banners
    first_banner = src.index(f"# 1. {banners[0][1]}")
    assert all(m.start() > first_banner for m in re.finditer(r"^def test_", src, re.M))


# ------------------------------------------------------------------------------------------------
# 19. The Hub as a first run meets it: every failure one line
# ------------------------------------------------------------------------------------------------
# `python vgrpo.py --model OWNER/NAME --reward pickscore`, a fresh process as a user runs it, with
# the real huggingface_hub, diffusers and transformers talking to examples/tools/fake_hub.py on
# 127.0.0.1 (HF_ENDPOINT), a fresh HF_HOME, HF_HUB_OFFLINE unset: the Hub's own status codes,
# headers and messages for gated repositories, tokens, unknown ids, and a download that breaks off.
FH = _load_example("tools/fake_hub")
SD3, GATED, PICK, PROC = "acme/sd3-tiny", "acme/sd3-gated", "acme/pick-model", "acme/pick-proc"
TOKEN_OK, TOKEN_NO_LICENCE = "hf_accepted0000", "hf_notaccepted0"      # tokens the fake Hub knows
# TINY's sizes spelled out: --model tiny's presets apply to the alias only (and no family preset's
# gradient checkpointing)
HUB_RUN = ["--reward", "pickscore", "--pickscore_model", PICK, "--pickscore_processor", PROC,
           "--device", "cpu", "--resolution", "64", "--num_steps", "4", "--max_sequence_length", "32",
           "--prompts_per_iter", "2", "--group_size", "3", "--n_mc", "2", "--iterations", "1",
           "--eval_every", "0", "--save_every", "1", "--lora_rank", "8", "--lora_alpha", "16",
           "--micro_batch", "6", "--rollout_batch", "6", "--reward_batch", "6",
           "--no-gradient_checkpointing"]


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory):
    """The files the fake Hub serves, saved once: the tiny SD3 pipeline, the tiny PickScore."""
    d = tmp_path_factory.mktemp("hub_repos")
    TM.build_tiny_sd3_pipeline().save_pretrained(d / "sd3")
    _tiny_pickscore(d / "pick")
    return d


@pytest.fixture
def hub(hub_repos):
    """A fake Hub for one test: the SD3 pipeline public and gated, PickScore's model and processor
    public; a token that accepted the gated licence and one that did not."""
    h = FH.FakeHub()
    h.add_repo(SD3, hub_repos / "sd3")
    h.add_repo(GATED, hub_repos / "sd3", gated=True)
    h.add_repo(PICK, hub_repos / "pick")
    h.add_repo(PROC, hub_repos / "pick")
    h.add_token(TOKEN_OK, accepted=[GATED])
    h.add_token(TOKEN_NO_LICENCE)
    with h:
        yield h


def _hub_env(tmp_path, endpoint, token=None, **extra):
    """A first run's environment: a fresh HF_HOME, HF_HUB_OFFLINE unset, no token but `token`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update({"HF_HOME": str(tmp_path / "hf_home"), "HF_ENDPOINT": endpoint,
                "HF_HUB_DISABLE_XET": "1", **extra})
    if token:
        env["HF_TOKEN"] = token
    return env


def _vgrpo(argv, env, timeout=240):
    """`python vgrpo.py ARGV` in a fresh process: (status, stdout, stderr, wall seconds)."""
    import subprocess
    import time
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(ROOT / "vgrpo.py"), *argv], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _hub_fails(tmp_path, hub_or_endpoint, model, *phrases, token=None, **extra):
    """The run ends in one line: status 2, the last stderr line `error: …` holding every phrase,
    no traceback, no `huggingface-cli`, no run folder. Returns (that line, wall seconds)."""
    endpoint = getattr(hub_or_endpoint, "endpoint", hub_or_endpoint)
    run = tmp_path / "run"
    rc, out, err, wall = _vgrpo(["--model", model, *HUB_RUN, "--run_dir", str(run)],
                                _hub_env(tmp_path, endpoint, token, **extra))
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert rc == 2, (rc, err[-3000:])
    assert last.startswith("error: "), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "huggingface-cli" not in err + out
    missing = [p for p in phrases if p not in last]
    assert not missing, (missing, last)
    assert not run.exists()
    return last, wall


def _fetched(hub, repo, since=0) -> set:
    """The files of `repo` whose bytes were asked for (GET) since log entry `since`: from
    /resolve/, or from the CDN for the large ones."""
    by_blob = {f"/blob/{f.sha256}": k for k, f in hub.repos[repo].files.items() if f.lfs}
    got = set()
    for method, path, _, _ in hub.log[since:]:
        if method == "GET" and path.startswith(f"/{repo}/resolve/"):
            got.add(path.split("/resolve/", 1)[1].split("/", 1)[1])
        elif method == "GET" and path in by_blob:
            got.add(by_blob[path])
    return got


def _pick_files_requested(hub):
    return [r for r in hub.requests(contains="/resolve/") if r[1].startswith((f"/{PICK}/", f"/{PROC}/"))]


@pytest.mark.trainer
def test_the_fake_hub_answers_the_real_clients_as_the_hub_does(hub, hub_repos, tmp_path):
    """Before the trainer's tests rest on it: huggingface_hub, diffusers and transformers, in a
    fresh process behind HF_ENDPOINT, raise against the fake Hub what they raise against the
    real one (GatedRepoError with the Hub's messages for 401 and 403, RepositoryNotFoundError,
    the rejected token's 401, EntryNotFoundError), download every file byte for byte, and load
    StableDiffusion3Pipeline and CLIPModel/CLIPProcessor from it; the large files come from the
    CDN origin without the Authorization header."""
    import subprocess
    script = f"""
import json, sys
import huggingface_hub as H
from huggingface_hub import errors as E
out = {{}}
def outcome(key, f):
    try:
        f(); out[key] = ["ok", ""]
    except Exception as e:
        out[key] = [type(e).__name__, str(e), getattr(getattr(e, "response", None), "status_code", None)]
outcome("gated_no_token", lambda: H.hf_hub_download({GATED!r}, "model_index.json"))
outcome("gated_no_licence", lambda: H.hf_hub_download({GATED!r}, "model_index.json", token={TOKEN_NO_LICENCE!r}))
outcome("bad_token", lambda: H.HfApi().model_info({SD3!r}, token="hf_wrong"))
outcome("unknown_no_token", lambda: H.HfApi().model_info("acme/nope"))
outcome("unknown_token", lambda: H.hf_hub_download("acme/nope", "config.json", token={TOKEN_OK!r}))
outcome("missing_file", lambda: H.hf_hub_download({SD3!r}, "nope.json"))
outcome("auth_check_gated", lambda: H.HfApi().auth_check({GATED!r}))
outcome("auth_check_ok", lambda: H.HfApi().auth_check({GATED!r}, token={TOKEN_OK!r}))
out["gated_info"] = H.HfApi().model_info({GATED!r}).gated
out["snapshot"] = H.snapshot_download({GATED!r}, token={TOKEN_OK!r})
import torch
from diffusers import StableDiffusion3Pipeline
from transformers import CLIPModel, CLIPProcessor
pipe = StableDiffusion3Pipeline.from_pretrained({SD3!r})
out["sd3"] = {{k: v.sum().item() for k, v in pipe.transformer.state_dict().items()}}
clip, proc = CLIPModel.from_pretrained({PICK!r}), CLIPProcessor.from_pretrained({PROC!r})
out["clip"] = {{k: v.sum().item() for k, v in clip.state_dict().items()}}
out["proc"] = type(proc.tokenizer).__name__
print(json.dumps(out))
"""
    p = subprocess.run([sys.executable, "-c", script], env=_hub_env(tmp_path, hub.endpoint), cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    name, msg, status = out["gated_no_token"]
    assert (name, status) == ("GatedRepoError", 401)
    assert f"Access to model {GATED} is restricted. You must have access to it and be authenticated" in msg
    name, msg, status = out["gated_no_licence"]
    assert (name, status) == ("GatedRepoError", 403)
    assert f"not in the authorized list. Visit https://huggingface.co/{GATED} to ask for access" in msg
    name, msg, status = out["bad_token"]
    assert (name, status) == ("HfHubHTTPError", 401) and "Invalid credentials in Authorization header" in msg
    assert out["unknown_no_token"][::2] == ["RepositoryNotFoundError", 401]
    assert out["unknown_token"][::2] == ["RepositoryNotFoundError", 404]
    assert out["missing_file"][0] == "RemoteEntryNotFoundError"
    assert out["auth_check_gated"][::2] == ["GatedRepoError", 401] and out["auth_check_ok"][0] == "ok"
    assert out["gated_info"] == "manual"
    snap = Path(out["snapshot"])
    files = sorted(p.relative_to(hub_repos / "sd3") for p in (hub_repos / "sd3").rglob("*") if p.is_file())
    assert files and sorted(p.relative_to(snap) for p in snap.rglob("*") if p.is_file()) == files
    assert all((snap / f).read_bytes() == (hub_repos / "sd3" / f).read_bytes() for f in files)
    from safetensors.torch import load_file
    from transformers import CLIPModel
    ref = load_file(str(hub_repos / "sd3" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert out["sd3"] == {k: v.sum().item() for k, v in ref.items()}
    clip = CLIPModel.from_pretrained(hub_repos / "pick")
    assert out["clip"] == {k: v.sum().item() for k, v in clip.state_dict().items()}
    assert out["proc"].startswith("CLIPTokenizer")
    # large files: a redirect from /resolve/, fetched from the CDN origin without the token
    cdn = hub.requests("GET", "/blob/")
    assert cdn and not any(r[2] for r in cdn)
    assert any(r[2] for r in hub.requests("HEAD", f"/{GATED}/resolve/"))


@pytest.mark.trainer
def test_a_public_model_downloads_and_trains_then_a_wrong_token_names_the_model(hub, tmp_path):
    """Everything public and reachable: the first run downloads the model and PickScore from the
    Hub and trains (status 0, a checkpoint). Then, with everything cached, a token the Hub
    rejects (HF_TOKEN) ends in one line that names the model, not the PickScore processor."""
    run = tmp_path / "trained"
    rc, out, err, _ = _vgrpo(["--model", SD3, *HUB_RUN, "--run_dir", str(run)], _hub_env(tmp_path, hub.endpoint))
    assert rc == 0, err[-3000:]
    assert (run / "checkpoints" / "iter_000001").is_dir() and len(_metrics(run)) >= 1
    for repo in (SD3, PICK, PROC):     # every repository's files came from the Hub
        assert hub.requests("GET", f"/{repo}/resolve/"), repo
    assert "huggingface-cli" not in err + out
    last, _ = _hub_fails(tmp_path, hub, SD3, "rejected your token", "hf auth login", SD3,
                         token="hf_wrongtoken1")
    assert PROC not in last and PICK not in last


@pytest.mark.trainer
def test_a_gated_model_without_a_token_is_one_line_before_any_reward_download(hub, tmp_path):
    """A gated --model and no token (the Hub: 401 GatedRepo): one line naming the model's page
    and `hf auth login`; the model's access is checked before the rewards load, so no file of
    PickScore's repositories was requested."""
    _hub_fails(tmp_path, hub, GATED, "is gated", f"https://huggingface.co/{GATED}", "hf auth login")
    assert hub.requests(contains=GATED)          # the Hub was asked about the model
    assert _pick_files_requested(hub) == []


@pytest.mark.trainer
def test_a_gated_model_with_the_licence_not_accepted_is_one_line(hub, tmp_path):
    """A valid token whose user has not accepted the licence (the Hub: 403 GatedRepo): one line
    saying so, with the page to accept it on."""
    _hub_fails(tmp_path, hub, GATED, "no access to the gated", f"https://huggingface.co/{GATED}",
               token=TOKEN_NO_LICENCE)
    assert _pick_files_requested(hub) == []


@pytest.mark.trainer
def test_a_rejected_token_is_one_line(hub, tmp_path):
    """A token the Hub does not know (401, Invalid credentials in Authorization header), on
    public repositories and a fresh cache: one line saying the Hub rejected it, and the fix."""
    _hub_fails(tmp_path, hub, SD3, "rejected your token", "hf auth login", token="hf_wrongtoken1")


@pytest.mark.trainer
def test_an_unknown_hub_id_is_one_line(hub, tmp_path):
    """A mistyped hub id (the Hub: 401 RepoNotFound without a token): one line."""
    _hub_fails(tmp_path, hub, "acme/sd3-tinny", "not found on the Hub", "acme/sd3-tinny")
    assert _pick_files_requested(hub) == []


@pytest.mark.trainer
def test_no_network_is_one_line_within_seconds(tmp_path):
    """HF_ENDPOINT on a 127.0.0.1 port nothing listens on, HF_HUB_OFFLINE unset: one line saying
    the Hub cannot be reached, within seconds (the clients' retries alone take minutes)."""
    _, wall = _hub_fails(tmp_path, f"http://127.0.0.1:{FH.closed_port()}", SD3, "cannot reach the Hub")
    assert wall < 20, wall


def _tmpfs(path: Path, size: str):
    """A real small filesystem (root on Linux), or None where it cannot be mounted."""
    import subprocess
    path.mkdir(parents=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0
    return path if ok else None


@pytest.mark.trainer
def test_a_full_disk_during_the_download_is_one_line(hub, tmp_path):
    """HF_HOME on a real 256 KB filesystem, smaller than the model (about 0.9 MB): the download
    fails with ENOSPC and the run ends in one line naming the cache folder and HF_HOME."""
    import subprocess
    small = _tmpfs(tmp_path / "small", "256k")
    if small is None:
        pytest.skip("no small filesystem can be mounted here (needs root): a full disk cannot be made")
    try:
        env_home = small / "hf_home"
        last, _ = _hub_fails(tmp_path, hub, SD3, "no space left", "HF_HOME", str(env_home),
                             HF_HOME=str(env_home))
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


@pytest.mark.trainer
def test_a_download_that_breaks_off_is_one_line_and_the_same_command_then_trains(hub, tmp_path):
    """The transformer's weights break off halfway (Content-Length sent, then half the bytes,
    then the network down through the client's own retries): one line, status 2. On that partial
    cache, HF_HUB_OFFLINE=1 is one line saying what is missing from the local cache. Then, the
    network back, the same command downloads what is missing, keeps what was complete, and
    trains (status 0)."""
    name = "transformer/diffusion_pytorch_model.safetensors"
    hub.break_off(name)
    _hub_fails(tmp_path, hub, SD3, "broke off", "run the same command again: it resumes")
    size = hub.repos[SD3].files[name].size
    blob = [r for r in hub.log if r[1] == f"/blob/{hub.repos[SD3].files[name].sha256}"]
    assert blob[0][3] is None                     # the download, then the client's own retries
    # the client's own retries (from the start: the half it got arrived in one unfinished read)
    assert len(blob) > 1 and {r[3] for r in blob[1:]} <= {None, f"bytes={size // 2}-"}, blob
    snap = next((tmp_path / "hf_home" / "hub" / f"models--{SD3.replace('/', '--')}" / "snapshots").iterdir())
    cached = {p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()}
    assert "model_index.json" in cached and name not in cached
    hub.restore()
    n = len(hub.log)
    _hub_fails(tmp_path, hub, SD3, "not in the local cache", "HF_HUB_OFFLINE", HF_HUB_OFFLINE="1")
    assert len(hub.log) == n                      # offline: not one request
    run = tmp_path / "run"
    rc, _, err, _ = _vgrpo(["--model", SD3, *HUB_RUN, "--run_dir", str(run)], _hub_env(tmp_path, hub.endpoint))
    assert rc == 0, err[-3000:]
    assert (run / "checkpoints" / "iter_000001").is_dir()
    again = _fetched(hub, SD3, n)
    assert name in again and not again & cached, again   # what was complete is not fetched again
