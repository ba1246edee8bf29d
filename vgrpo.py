"""
vgrpo.py — V-GRPO in one file: online RL for flow-matching image models, where the
model's own (variance-reduced) flow-matching loss stands in for log π_θ(image | prompt).

Paper: "V-GRPO: Online Reinforcement Learning for Denoising Generative Models Is Easier than
You Think", Tang et al., 2026, arXiv 2604.23380. Tags resolve in METHOD.md, beside this file:
[paper P3] stated by the paper, [peer X5] another codebase's convention, [ours C4] our choice
where the paper is silent, [Alg. step 4] a step of the box below; a bare "§k" is a section here.

What this file IS: a readable reference of the algorithm (this overview, the pure math §2–§6,
`iteration` and its steps in §7) plus a working trainer for SD3 / SD3.5 and FLUX.1 (diffusers) with
built-in or plug-in rewards (§8), on one GPU (several: examples/cluster.py under torchrun, FSDP2);
tiny offline models run it all on a laptop CPU. What it is NOT: a framework; the loss can be
copied into any trainer.

Quickstart (after `pip install -r requirements.txt`)
    python vgrpo.py --model tiny --reward jpeg                 # CPU, offline, < 1 min
    python vgrpo.py --model sd3.5-medium --reward pickscore    # one CUDA GPU, hub weights
    python vgrpo.py --model flux.1-dev --reward hpsv2:1,pickscore:1
    torchrun --nproc_per_node=8 examples/cluster.py --model sd3.5-medium --preset paper

ALGORITHM (one iteration; "→ §k" points into this file; METHOD.md and the README quote it)
    0. θ_old ← θ: nothing is copied; all θ_old is needed for is computed in steps 1, 4 and 5
    1. rollout: P prompts, G images each, by a deterministic ODE solve of v_θold        → §3, §7
    2. rewards r (N = P·G), group-relative advantages A, clamp ±5, soft-clip η·tanh(A/η) → §8, §4
    3. draw N_MC stratified (t, ε) pairs, shared across the batch (or per group)        → §5
    4. S_old[n] = mean_j s_θold(o_n; t_j, ε_j), s = −MSE_x / sg(MAE_x)   (no grad)      → §5
    5. μ optimizer steps over disjoint minibatches:
          ρ_n = exp(S_θ[n] − S_old[n]);  loss = mean_n max(−A ρ, −A clip(ρ, 1±ε)) + β KL_x → §6
       The first step runs at θ = θ_old, so its own forward gives S_old = sg(S_θ) (ρ ≡ 1):
       step 4 runs only for the other μ − 1 minibatches, and not at all when μ = 1 [ours C18].
    Rollouts carry no per-step log-probs: the whole generation is one atomic action.
    At the default μ = 1 that first step is the only one: ρ ≡ 1 on every sample, the clip is
    inert, and the update is the policy gradient −A·∇S of the surrogate with group-relative
    advantages. The ratio, the clip and the KL to θ_old act only at μ > 1 (FLUX's μ = 4).

NOTATION
    code name     paper          shape            meaning
    P, G          —, G           int              prompts per iteration, images per prompt (group)
    N             —              int              P·G samples per iteration
    J / n_mc      N_MC           int              (t, ε) pairs per sample
    K / num_steps —              int              ODE steps per rollout (grid of K + 1 times)
    n_scopes      —              int              independent (t, ε) pair sets (1 = batch-shared)
    x0 / o        o              (N, C, H, W)     rollout result, a clean latent (the "action")
    x1            x_1 / ε        (N, C, H, W)     initial noise of the rollout
    t             t = σ          (...,)           time; 1 = noise, 0 = data
    z             z_t            (..., C, H, W)   (1 − t)·x0 + t·ε
    v             NN^θ_t         (..., C, H, W)   velocity prediction ≈ ε − x0
    s             −ℓ^θ(t_j, ε_j) (N, J)           per-pair surrogate log-likelihood (≤ 0)
    S             −L̂(θ | o, c)   (N,)             mean_j s; the stand-in for log π_θ(o | c)
    A             A_i            (N,)             advantage
    ρ / ratio     ρ_i            (N,)             exp(S_θ − S_old), one per sample

CONVENTIONS
    * Time: t = σ ∈ [0, 1], t = 1 is pure noise, t = 0 is data; x_t = (1 − t)·x0 + t·ε; the
      network predicts v = ε − x0; x̂0 = x_t − t·v̂; ODE solves run t: 1 → 0.
    * Losses are minimised; loss = −objective. Reductions over latent elements are MEANS (the
      paper's code does this; a sum would only rescale log ρ by d = C·H·W).
    * All surrogate, ratio and loss arithmetic is fp32, even under bf16 autocast.

CONTENTS: §2–§6 the pure math (flow matching, samplers, advantages, pairs and surrogate, loss);
    §7 one iteration, step by step; §8 rewards; §9 models and LoRA; §10 the run (setup, loop,
    evaluation, run folder, checkpoints); §11 configuration. Cluster and torchrun (FSDP2):
    examples/cluster.py
"""

# ------------------------------------------------------------------------------------------------
# §1  Imports. diffusers, transformers and peft only inside the functions that need them.
# ------------------------------------------------------------------------------------------------
from __future__ import annotations

import argparse, contextlib, dataclasses, enum, errno, functools, importlib.util, json
import math, os, random, shutil, sys, tempfile, time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol


def _stopped_at_start(*_) -> None:  # Ctrl-C while torch imports: main()'s line, not a traceback
    print("interrupted before the first iteration: nothing written", file=sys.stderr)
    os._exit(130)


if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGINT, _stopped_at_start)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class ConfigError(ValueError):  # bad input (a flag, file, model, plug-in, prompt): one line, 2
    status, label = 2, "error"  # found before anything is written, but for a prompt missing
                                # from the --offload_text_encoders cache (SD3Adapter.encode)


class RunError(Exception):  # a run that cannot go on: where it stands, how to go on
    status, label = 2, "error"


# === pure math: begin === (from here to the end marker: torch, math, dataclasses, typing only)
# ------------------------------------------------------------------------------------------------
# §2  Flow-matching math (pure).                                          [peer X8]
#     Rectified flow: x_t = (1 − t)·x0 + t·ε,  v = dx_t/dt = ε − x0,  t = 1 noise → t = 0 data.
#     The three "parameterisations" of paper P12 are one prediction seen in three spaces.
# ------------------------------------------------------------------------------------------------
def bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample t (M,) to (M, 1, 1, ...) so it broadcasts against `like` (M, *D)."""
    return t.reshape(t.shape + (1,) * (like.dim() - t.dim()))


def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε, t = 1 noise → 0 data. x0, eps: (M, *D); t: (M,); returns (M, *D)."""
    tb = bcast(t, x0)
    return (1 - tb) * x0 + tb * eps


def x0_from_v(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_t − t·v̂ (the x-prediction of paper P6; t = 1 noise). x_t, v (M, *D), t (M,)."""
    return x_t - bcast(t, x_t) * v


PARAM_SCALE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # error in space p = PARAM_SCALE[p](t) · (v̂ − v), up to a sign that ² and |·| drop [peer X6]
    "x": lambda t: t,                   # x̂0 − x0 = −t (v̂ − v)          [paper P6]
    "eps": lambda t: 1 - t,             # ε̂ − ε  = (1 − t)(v̂ − v)       [paper P12]
    "v": lambda t: torch.ones_like(t),  # plain flow-matching error       [paper P12]
}


def time_shift(s: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's resolution shift σ = shift·s / (1 + (shift − 1)·s); shift 1 is the identity."""
    return shift * s / (1 + (shift - 1) * s)


def sigma_grid(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """A rollout grid (K + 1,) float64 on the CPU, t = 1 (noise) → exactly 0 (data): K equal
    steps, linspace(1, 0, K + 1), time-shifted. FLUX's grid [ours C8]; SD3's: SD3Adapter.sigmas."""
    return time_shift(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift)


# ------------------------------------------------------------------------------------------------
# §3  Deterministic ODE samplers (pure, given a velocity function).        [paper P1; ours C8]
#     Any deterministic solver will do: the generation is ONE action, scored by §5's surrogate,
#     not by per-step log-probs. velocity_fn(x (M, *D), t (M,), cond) -> v: model or analytic field.
# ------------------------------------------------------------------------------------------------
def euler_sample(velocity_fn: Callable, x1: torch.Tensor, sigmas: torch.Tensor,
                 cond=None) -> torch.Tensor:
    """Euler solve of dx/dt = v(x, t) from t = sigmas[0] = 1 (noise) to sigmas[-1] = 0 (data):
    x_{k+1} = x_k + (σ_{k+1} − σ_k)·v(x_k, σ_k), diffusers' FlowMatchEuler step; K network calls.

    Args: velocity_fn (x (M, *D), t (M,), cond) -> v (M, *D); x1 (M, *D) the initial noise;
        sigmas (K + 1,) the decreasing grid, a CPU tensor or a list.
    Returns: x0 (M, *D) in x1's dtype."""
    sig = [float(s) for s in sigmas]                         # floats: no device syncs in the loop
    x = x1.to(torch.promote_types(x1.dtype, torch.float32))  # accumulate in ≥ fp32
    for s, s_next in zip(sig[:-1], sig[1:]):
        t = torch.full((x.shape[0],), s, device=x.device, dtype=torch.float32)  # (M,)
        v = velocity_fn(x.to(x1.dtype), t, cond)
        x = x + (s_next - s) * v.to(x.dtype)  # (M, *D)
    return x.to(x1.dtype)


def dpmpp2m_sample(velocity_fn: Callable, x1: torch.Tensor, sigmas: torch.Tensor,
                   cond=None) -> torch.Tensor:
    """DPM-Solver++(2M), the 2nd-order multistep data-prediction solver, for rectified flow;
    with α_t = 1 − t, σ_t = t, λ = log(α/σ), h = λ_{k+1} − λ_k and x̂0 = x − t·v̂:
        x_{k+1} = (σ_{k+1}/σ_k)·x_k + α_{k+1}·(1 − e^{−h})·D_k
        D_k = x̂0_k                                    (first step, and the final step to t = 0)
        D_k = (1 + 1/(2r))·x̂0_k − 1/(2r)·x̂0_{k−1},   r = h_{k−1}/h_k          (otherwise)
    e^{−h} = σ_{k+1}α_k / (σ_k α_{k+1}) is finite even at t = 1 (α = 0, λ = −∞), so the first
    step is the DDIM step x = (1 − σ')·x̂0 + σ'·x1. K network calls; the rest as euler_sample."""
    sig = [float(s) for s in sigmas]
    x = x1.to(torch.promote_types(x1.dtype, torch.float32))  # accumulate in ≥ fp32
    prev_x0, prev_h = None, None
    for k, (s, s_next) in enumerate(zip(sig[:-1], sig[1:])):
        t = torch.full((x.shape[0],), s, device=x.device, dtype=torch.float32)  # (M,)
        x0_hat = x - s * velocity_fn(x.to(x1.dtype), t, cond).to(x.dtype)       # (M, *D)
        if s_next == 0.0:                               # final step: e^{-h} = 0, first order
            x = x0_hat
            break
        alpha, alpha_next = 1.0 - s, 1.0 - s_next
        exp_neg_h = (s_next * alpha) / (s * alpha_next)
        h = math.inf if alpha == 0.0 else math.log(alpha_next / s_next) - math.log(alpha / s)
        if prev_x0 is None or math.isinf(prev_h):  # no usable history → first order
            d = x0_hat
        else:
            r = prev_h / h
            d = (1 + 1 / (2 * r)) * x0_hat - (1 / (2 * r)) * prev_x0
        x = (s_next / s) * x + alpha_next * (1 - exp_neg_h) * d
        prev_x0, prev_h = x0_hat, h
    return x.to(x1.dtype)


SOLVERS = {"euler": euler_sample, "dpmpp2m": dpmpp2m_sample}


# ------------------------------------------------------------------------------------------------
# §4  Group-relative advantages (pure).                       [paper P9; ours C1, C3; Alg. step 2]
# ------------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, *, global_std: bool = True, std_eps: float = 1e-4,
                     clamp: float = 5.0, eta: float = 3.0, unbiased: bool = False):
    """A = soft_clip(clamp((r − mean_group) / (std + std_eps))).

    Args:
        rewards: (P, G) float; non-finite entries mark dropped samples.
        global_std: population std of ALL finite rewards of the batch around the BATCH mean (so
            it includes the spread between prompts) instead of each group's own std: Flow-GRPO's
            `PerPromptStatTracker(global_std=True)`, which DiffusionNFT inherits [ours C3; peer X1].
        std_eps: added to the std, so a group of equal rewards gets A = 0, never NaN.
        clamp, eta: see clip_advantages. unbiased: divide by n − 1 (torch.std, MixGRPO), not n.
    Returns: adv (P, G) fp32, 0 for dropped samples and for groups with < 2 finite rewards; and
        stats, detached scalars (mean, std, max |A|, fraction of dropped samples)."""
    r = rewards.float()
    ok = torch.isfinite(r)                                # (P, G)
    n = ok.sum(dim=1, keepdim=True)                       # (P, 1)
    r0 = torch.where(ok, r, torch.zeros_like(r))          # (P, G)
    mean = r0.sum(dim=1, keepdim=True) / n.clamp(min=1)   # (P, 1)
    dev = torch.where(ok, r - mean, torch.zeros_like(r))  # (P, G)
    ddof = 1 if unbiased else 0
    if global_std:  # around the batch mean
        n_all = ok.sum()
        dev_all = torch.where(ok, r - r0.sum() / n_all.clamp(min=1), torch.zeros_like(r))
        std = (dev_all.square().sum() / (n_all - ddof).clamp(min=1)).sqrt()  # ()
    else:
        std = (dev.square().sum(dim=1, keepdim=True) / (n - ddof).clamp(min=1)).sqrt()  # (P, 1)
    return clip_advantages(dev / (std + std_eps), ok & (n >= 2), ok, clamp=clamp, eta=eta)


def clip_advantages(adv: torch.Tensor, keep: torch.Tensor, ok: torch.Tensor, *, clamp: float,
                    eta: float):
    """The tail every aggregation shares: A ← clamp(A, ±clamp), then A ← η·tanh(A/η), 0 where not
    `keep` [ours C1; paper P9, Eq. 17]. The clamp (Flow-GRPO's ±5) acts BEFORE the soft-clip: one
    outlier under global_std can exceed it (C1's worked example); a per-group std never.
    Args: adv, keep (samples that get an advantage), ok (finite rewards): all (P, G).
    Returns: adv (P, G) fp32 with |A| ≤ min(clamp, η) (eta = 0: no soft-clip), detached stats."""
    adv = adv.clamp(-clamp, clamp)
    if eta > 0:
        adv = eta * torch.tanh(adv / eta)
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    return adv, {"adv_mean": adv.mean().detach(), "adv_std": adv.std(unbiased=False).detach(),
                 "adv_absmax": adv.abs().max().detach(),
                 "frac_dropped": (~ok).float().mean().detach()}


def weighted_sum_advantages(rewards: torch.Tensor, weights: torch.Tensor, **kw):
    """Several rewards, "sum then normalise" (DiffusionNFT's SD3.5 convention) [ours C3]:
    group_advantages(Σ_k w_k r_k) of rewards (R, P, G), training-scaled, and weights (R,); a
    sample with a non-finite component is dropped; kw as group_advantages. Returns (P, G), stats."""
    total = (weights.float().view(-1, 1, 1) * rewards.float()).sum(dim=0)  # (P, G)
    return group_advantages(total, **kw)


def per_reward_advantages(rewards: torch.Tensor, weights: torch.Tensor, *, global_std: bool = False,
                          std_eps: float = 1e-8, clamp: float = 5.0, eta: float = 3.0):
    """Several rewards, "normalise each then sum" (MixGRPO's advantage_aggr) [ours C3]:
    A = soft_clip(clamp(Σ_k ŵ_k · (r_k − mean_group) / (std_k + std_eps))),  ŵ = w / Σ w,
    of rewards (R, P, G) and weights (R,); a sample with any non-finite component is dropped.
    std_k: the UNBIASED group std, MixGRPO's torch.std() [peer X2]. Returns (P, G) fp32 A, stats."""
    r = rewards.float()
    ok = torch.isfinite(r).all(dim=0)                             # (P, G)
    r = torch.where(ok, r, torch.full_like(r, float("nan")))      # drop whole sample
    w = weights.float() / weights.float().sum().clamp(min=1e-12)  # (R,)
    parts = [group_advantages(rk, global_std=global_std, std_eps=std_eps, clamp=math.inf, eta=0.0,
                              unbiased=True)[0] for rk in r]
    adv = (w.view(-1, 1, 1) * torch.stack(parts)).sum(dim=0)  # (P, G)
    return clip_advantages(adv, ok, ok, clamp=clamp, eta=eta)


# ------------------------------------------------------------------------------------------------
# §5  Shared, stratified (t, ε) pairs and the ELBO surrogate (pure).          [paper P2–P8]
#   log π_θ(o | c)  ←  S_θ(o) = (1/J) Σ_j s_θ(o; t_j, ε_j)
#   s_θ(o; t, ε)    = − mean_d (x̂0 − o)²  /  sg( max(mean_d |x̂0 − o|, floor) ),
#   x̂0 = z − t·v_θ(z, t, c),  z = (1 − t)·o + t·ε.
#   Three variance-reduction techniques, each one switch:
#   (1) shared pairs: all members of a group (or of the batch) are scored on the SAME (t_j, ε_j),
#       so differences inside a group reflect the images, not the dice      (pair_sharing);
#   (2) stratified t: one t per contiguous chunk of the rollout grid       (stratified);
#   (3) adaptive weighting: the x-space MSE divided by its own detached MAE, which flattens the
#       orders-of-magnitude spread of loss scale across t                  (adaptive_weighting).
# ------------------------------------------------------------------------------------------------
@dataclass
class Pairs:
    """The (t, ε) pairs of one iteration, reused by θ_old and by every θ step [ours C4]."""
    t: torch.Tensor      # (n_scopes, J) times; n_scopes independent pair sets (1 = batch-wide)
    eps: torch.Tensor    # (n_scopes, J, *D) noises
    index: torch.Tensor  # (N,) long: which set each of the N samples uses

    def take(self, rows: torch.Tensor):
        """Pairs of samples `rows` (m,): returns t (m, J), eps (m, J, *D)."""
        i = self.index[rows]
        return self.t[i], self.eps[i]


def draw_pairs(grid: torch.Tensor, n_mc: int, latent_shape: tuple, index: torch.Tensor, *,
               stratified: bool = True, generator: Optional[torch.Generator] = None,
               device: Optional[torch.device] = None) -> Pairs:
    """Draw J = n_mc (t, ε) pairs for each of n_scopes = index.max() + 1 sharing scopes.

    Args:
        grid: (K,) candidate times, t = 1 noise → 0 data: the rollout grid WITHOUT its terminal 0
            (there the error vanishes and the MAE normalisation is 0/0)               [ours C5].
        latent_shape: D = (C, H, W) of one latent.
        index: (N,) long, each sample's scope: zeros = batch-wide (the paper's code,
            `grpo_init_same="batch"`), sample // G = per group (the paper's text), arange(N) = none.
        stratified: split the grid into J contiguous, (near-)equal chunks (torch.tensor_split) and
            pick one grid point uniformly inside each; else J uniform picks from the whole grid.
        generator: CPU; pairs are drawn there (device-independent), moved to `device` (None: CPU).
    Returns: Pairs, t (n_scopes, J) and eps (n_scopes, J, *D) float32, index (N,), on `device`."""
    grid = torch.as_tensor(grid, dtype=torch.float64).flatten()
    n_scopes = int(index.max()) + 1
    if stratified:
        chunks = torch.tensor_split(torch.arange(len(grid)), n_mc)          # J chunks of indices
        lo = torch.tensor([int(c[0]) for c in chunks])                      # (J,) first index
        size = torch.tensor([len(c) for c in chunks])                       # (J,) chunk length
        u = torch.rand(n_scopes, n_mc, generator=generator, dtype=torch.float64)  # (n_scopes, J)
        idx = lo + (u * size).long().clamp(max=size - 1)                    # (n_scopes, J)
    else:
        idx = torch.randint(len(grid), (n_scopes, n_mc), generator=generator)  # (n_scopes, J)
    t = grid[idx].float()                                                      # (n_scopes, J)
    eps = torch.randn((n_scopes, n_mc) + tuple(latent_shape),
                      generator=generator)  # (n_scopes, J, *D)
    return Pairs(t=t.to(device), eps=eps.to(device), index=index.long().to(device))


def surrogate_from_velocity(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor,
                            t: torch.Tensor, *, parameterization: str = "x", adaptive: bool = True,
                            mae_floor: float = 1e-5) -> torch.Tensor:
    """Per-pair surrogate log-likelihood s = −‖e‖²_mean / sg(max(‖e‖₁_mean, floor)). [paper P6, P7]

    e is the prediction error in the chosen space (§2): with x-prediction e = x̂0 − x0 =
    −t·(v̂ − (ε − x0)), the official code's form [paper P7]. adaptive=False returns −‖e‖²_mean.
    Args: v_pred (M, *D) the network velocity at z = (1 − t)·x0 + t·ε (any dtype); x0 (M, *D)
        rollout latents; eps (M, *D) pair noises; t (M,) pair times, t = 1 noise → 0 data.
    Returns: s (M,) fp32, differentiable through v_pred only."""
    v_err = v_pred.float() - (eps.float() - x0.float())                # v̂ − v, (M, *D)
    err = PARAM_SCALE[parameterization](bcast(t.float(), x0)) * v_err  # (M, *D)
    mse = err.square().flatten(1).mean(dim=1)                          # (M,)
    if not adaptive:
        return -mse
    mae = err.detach().abs().flatten(1).mean(dim=1).clamp(min=mae_floor)  # (M,) stop-gradient
    return -mse / mae


def _repeat_rows(cond, J: int):
    """Each row of cond (a batch-first tensor, a dict of them, or None) repeated J times."""
    if isinstance(cond, dict):
        return {k: v.repeat_interleave(J, dim=0) for k, v in cond.items()}
    if cond is None:
        return None
    return cond.repeat_interleave(J, dim=0)


def pair_surrogates(velocity_fn: Callable, x0: torch.Tensor, cond, t: torch.Tensor,
                    eps: torch.Tensor, *, parameterization: str = "x", adaptive: bool = True,
                    mae_floor: float = 1e-5):
    """s[m, j] for m samples × J pairs in ONE batched network call of m·J rows, and the
    x-prediction x̂0 that the KL term needs (discard it when β = 0).          [Alg. steps 4, 5]

    Args: velocity_fn (z (m·J, *D), t (m·J,), cond repeated) -> v (m·J, *D); x0 (m, *D) latents;
        cond a batch-first tensor, a dict of them or None, m rows; t (m, J) times, t = 1
        noise → 0 data; eps (m, J, *D) noises (Pairs.take), on x0's device.
    Returns: s (m, J) and x̂0 (m, J, *D), fp32, both differentiable through velocity_fn.
    Reference form: for m, j: z = (1 − t)·x0[m] + t·eps[m, j]; v = velocity_fn(z, t, cond[m]);
                              s[m, j] = surrogate_from_velocity(v, x0[m], eps[m, j], t)"""
    (m, J), D = t.shape, x0.shape[1:]
    x0r = x0.unsqueeze(1).expand(m, J, *D).reshape(m * J, *D)          # (m·J, *D)
    tr, er = t.reshape(m * J), eps.reshape(m * J, *D)                  # (m·J,), (m·J, *D)
    z = interpolate(x0r.float(), er.float(), tr.float()).to(x0.dtype)  # (m·J, *D)
    v = velocity_fn(z, tr, _repeat_rows(cond, J))                      # (m·J, *D)
    s = surrogate_from_velocity(v, x0r, er, tr, parameterization=parameterization,
                                adaptive=adaptive, mae_floor=mae_floor).reshape(m, J)
    return s, x0_from_v(z.float(), v.float(), tr.float()).reshape(m, J, *D)


def surrogate_cv(S: torch.Tensor) -> dict:
    """Coefficient of variation CV = std / |mean| (population std) of the surrogate S (P, G), over
    the batch and within groups; detached scalars (the paper's values: [paper P8])."""
    S = S.float()
    cv_all = S.std(unbiased=False) / S.mean().abs().clamp(min=1e-12)
    cv_grp = (S.std(dim=1, unbiased=False) / S.mean(dim=1).abs().clamp(min=1e-12)).mean()
    return {"surrogate_cv": cv_all.detach(), "surrogate_cv_group": cv_grp.detach()}


# ------------------------------------------------------------------------------------------------
# §6  The V-GRPO loss (pure).                                       [paper P3, P9; Alg. step 5]
#   ρ = exp(S_θ − S_old), ONE ratio per sample: the mean over pairs sits inside the exp (the
#   official code's `exp(new.mean(1) − old.mean(1))`, GSPO-like).                  [paper P3]
#   loss_n = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) + β·mean_j ‖x̂θ − x̂θold‖²_mean    [paper P9]
# ------------------------------------------------------------------------------------------------
def xspace_kl(x0_hat: torch.Tensor, x0_hat_old: torch.Tensor) -> torch.Tensor:
    """"Simple" KL of paper P9 (Eq. 16 per [source S6]): mean_d (x̂θ − x̂θold)² per pair.
    x0_hat, x0_hat_old: (m, J, *D). Returns (m, J) fp32, differentiable through x0_hat only."""
    return (x0_hat.float() - x0_hat_old.detach().float()).square().flatten(2).mean(dim=2)


def vgrpo_loss(s_new: torch.Tensor, s_old: torch.Tensor, adv: torch.Tensor, *,
               clip_eps: float = 0.0, kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0):
    """V-GRPO policy loss for m samples, mean_n loss_n of the banner above; minimise it.

    Args:
        s_new, s_old: (m, J) surrogates of θ (with grad) and of θ_old on the SAME pairs (no grad).
        adv: (m,) advantages, already normalised and clipped (§4).
        clip_eps: ratio clip ε; 0 disables the clip (then loss = −A·ρ).
        kl: (m, J) per-pair x-space KL to θ_old (xspace_kl), used when kl_coef = β > 0.
    Returns: loss () fp32 and stats, detached scalars: ratio mean, mean |log ρ|, clip fraction,
        approx KL k2 = ½(log ρ)² [peer X7] and the x-space KL.
    Notes: with θ = θ_old, ρ ≡ 1 and ∇loss = −A·∇S: REINFORCE with a group baseline on the
        surrogate (ours C18): the whole update when μ = 1 (§0's algorithm box)."""
    log_ratio = s_new.float().mean(dim=1) - s_old.detach().float().mean(dim=1)  # (m,)
    ratio = torch.exp(log_ratio)                                                # (m,)
    A = adv.detach().float()
    pg = -A * ratio  # (m,)
    if clip_eps > 0:
        pg = torch.maximum(pg, -A * ratio.clamp(1 - clip_eps, 1 + clip_eps))
        clipped = ((ratio - 1).abs() > clip_eps).float()
    else:
        clipped = torch.zeros_like(ratio)
    loss = pg.mean()
    kl_mean = kl.float().mean() if kl is not None else torch.zeros((), device=s_new.device)
    if kl_coef > 0:  # mean over pairs, then samples = mean over (m, J)
        loss = loss + kl_coef * kl_mean
    stats = {"ratio": ratio.mean().detach(), "abs_log_ratio": log_ratio.abs().mean().detach(),
             "clip_frac": clipped.mean().detach(),
             "approx_kl": (0.5 * log_ratio.square()).mean().detach(), "kl_x": kl_mean.detach()}
    return loss, stats

# === pure math: end === (§2–§6 above run with torch alone; test_vgrpo.py lifts them out)
# ------------------------------------------------------------------------------------------------
# §7  One iteration: the algorithm box of §0, step by step.                     [Alg. steps 1–5]
#     Run, `iteration`, then its five steps. In the steps each harness line (a process's share,
#     the collectives, fp16, the log's statistics, examples/cluster.py's poll) ends in `# harness:`.
# ------------------------------------------------------------------------------------------------
class Stream(enum.IntEnum):
    """Each a CPU generator(seed, it, stream) of its own: a resume redraws what the run drew.
    Below 16, one per iteration (4–8 and 11–15 are examples/baselines/'); 16 and up, once per
    run whatever --seed (generator(0, 0, ·)). No two streams share a seed (`stream_seed`)."""
    PROMPTS = 0        # step 1: which P training prompts
    ROLLOUT_NOISE = 1  # step 1: the initial noise x1 of the N rollouts
    PAIRS = 2          # step 3: the (t, ε) pairs
    MINIBATCHES = 3    # step 5: the μ minibatches
    EVAL_NOISE = 9     # evaluate: one fixed noise per held-out prompt
    PROBE = 10         # probe_reward: the two random images of a reward's start-up probe
    HOLDOUT = 16       # load_prompts: which lines of --prompts are held out


MAX_ITERATIONS = 1_000_003  # check_args: --iterations below it keeps the seeds apart


def stream_seed(seed: int, it: int, stream: int) -> int:
    """(seed·1_000_003 + it)·16 + stream ≥ 0 for stream < 16: distinct for 0 ≤ it < 1_000_003;
    a once-per-run stream's is −stream, below them all."""
    return (seed * MAX_ITERATIONS + it) * 16 + stream if stream < 16 else -stream


def generator(seed: int, it: int, stream: int) -> torch.Generator:
    """The CPU generator of (seed, iteration, stream), apart from every other (`stream_seed`)."""
    return torch.Generator().manual_seed(stream_seed(seed, it, stream))


class Model(Protocol):
    """What the iteration asks of a model family: SD3Adapter (§9) is the worked example, FLUX's
    and examples/models/'s plug-ins implement the same. Time t = 1 noise → 0 data, v = ε − x0;
    D is one ODE latent's shape (SD3: (C, H, W); packed families: (seq, channels))."""
    transformer: torch.nn.Module  # the trained network: LoRA goes here (its numbered blocks)

    def latent_shape(self, resolution: int) -> tuple:
        """D, the shape of one latent the ODE solves in, at this image side."""

    def encode(self, prompts: list[str]) -> dict:
        """CFG-free conditioning of B prompts: a dict of batch-first tensors, B rows each."""

    def cache_prompts(self, prompts: list[str]) -> None:
        """--offload_text_encoders: embed each prompt once, then move the encoders off the GPU."""

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v_θ(x, t, c): x (M, *D), t (M,) in [0, 1], cond's rows of the M samples → (M, *D)."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (M, *D) → images (M, 3, H, W), fp32 in [0, 1]."""

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The rollout grid (K + 1,) float64 on the CPU, 1 → exactly 0: the pipeline's own."""

    def blocks(self) -> list:
        """The transformer's repeated blocks (compiled one by one; FSDP units)."""

    def save_lora(self, folder: str, state: dict, lora_config) -> None:
        """Write the LoRA so that the stock pipeline's load_lora_weights(folder) reads it."""


@dataclass
class Run:
    """Everything an iteration needs, built by `setup` (§10); `local`: a process's groups."""
    args: Args
    adapter: Model    # SD3Adapter (§9) or a plug-in's Adapter (examples/models/: FLUX.1, …)
    rewards: Rewards  # §8
    opt: torch.optim.Optimizer
    params: list      # the trainable parameters (LoRA, or the whole transformer)
    lora_cfg: object  # peft LoraConfig; None for --full_finetune
    train_prompts: list
    eval_prompts: list
    dev: torch.device
    dtype: torch.dtype  # compute dtype of the autocast `ctx`
    ctx: object
    sigmas: torch.Tensor                 # (K + 1,) rollout grid, ends in 0
    eval_sigmas: torch.Tensor            # (K_eval + 1,)
    D: tuple                             # latent shape: (C, H, W) for SD3, (seq, 64) for FLUX
    start: int = 0                       # first iteration (> 0 when resumed)
    resumed_from: Optional[Path] = None  # the checkpoint folder resumed from
    run_dir: Optional[Path] = None
    scaler: object = field(default_factory=lambda: torch.amp.GradScaler("cpu", enabled=False))
    compiled: bool = False     # the transformer blocks compiled (--compile)
    time_compile: float = 0.0  # seconds it took, before the first iteration
    # Hooks for examples/cluster.py: preemption, and torchrun's processes. In one process a
    # collective is the identity, this process's share (`local`) is the whole batch, and a
    # hook does nothing, or saves the checkpoint (§10).
    rank: int = 0                                          # this process; rank 0 writes
    world: int = 1                                         # processes, each N / world samples
    poll: Callable = lambda: None                          # may a SIGTERM stop it (no step yet)?
    guard: Callable = lambda it: contextlib.nullcontext()  # around iteration `it`, its log
    go_on: Callable = lambda run_dir: how_to_go_on(run_dir)  # ends `writing`'s line (requeue)
    gather: Callable = lambda x: x         # every process's x, concatenated along the last dim
    broadcast: Callable = lambda x: x      # rank 0's x on every process
    sync: Callable = lambda last: None     # before a backward (`last`: FSDP reduces after it)
    whole: Callable = lambda x: x          # a tensor whole on this process (FSDP's: DTensors)
    save: Callable = lambda run, it: save_checkpoint(run, it)  # checkpoint `it` (torchrun: all)

    N = property(lambda self: self.args.prompts_per_iter * self.args.group_size)   # P·G
    Nl = property(lambda self: self.N // self.world)          # the samples of this process

    def local(self, x):
        """This process's share of a global batch-first tensor (N, ...) or prompt list (P)."""
        n = len(x) // self.world
        return x[self.rank * n:(self.rank + 1) * n]

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """loss.backward(), scaled for fp16; `last`: the optimizer step's last micro-batch."""
        self.sync(last)
        self.scaler.scale(loss).backward()

    @contextlib.contextmanager
    def writing(self, what: Path):
        """Around each write to the run folder: any writer's failure (OSError, torch.save's
        RuntimeError, PIL's) ends the run in one line naming the file and the fix."""
        try:
            yield what
        except (ConfigError, RunError, torch.cuda.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 — every writer's error, one message
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RunError(f"could not write {what} ({type(e).__name__}: {why}); free space "
                           f"or fix permissions there; {self.go_on(self.run_dir)}") from None


@dataclass
class Rollouts:
    """[Alg. step 1] This process's rollouts: Pl = P / world prompts, Nl samples."""
    prompts: list             # Pl prompts
    cond: object              # their encodings, Pl rows
    prompt_idx: torch.Tensor  # (Nl,) row of cond per sample
    x0: torch.Tensor          # (Nl, *D) fp32 actions o


@dataclass
class Scored:
    """[Alg. step 2] Rewards of the whole batch (every process), this process's advantages."""
    raw: dict               # {reward name: (N,) raw values}, CPU
    headline: torch.Tensor  # (N,) the logged reward (Rewards.headline)
    adv: torch.Tensor       # (Nl,) advantages, on the device
    adv_stats: dict
    skipped: bool  # every advantage is 0: nothing to learn, no optimizer step


@dataclass
class OldSurrogates:
    """[Alg. step 4] S_old (and θ_old's x̂0 for the KL) of the Nl samples: step 4 writes
    minibatches k ≥ 1, step 5's first step (θ = θ_old) minibatch 0 from its forward [ours C18]."""
    s: torch.Tensor                 # (Nl, J) per-pair s_θold
    x0_hat: Optional[torch.Tensor]  # (Nl, J, *D) θ_old's x̂0; None if β = 0
    n_old_pass: int = 0             # rows of step 4's own pass (nfe_old)

    def write(self, rows: torch.Tensor, s: torch.Tensor, x0_hat: torch.Tensor) -> None:
        """S_old (and x̂0_old) of local samples `rows`, detached."""
        self.s[rows] = s.detach()
        if self.x0_hat is not None:
            self.x0_hat[rows] = x0_hat.detach()


def iteration(run: Run, it: int) -> dict:
    """Alg. steps 1–5 of §0 and the metrics; host syncs: rewards, each step, metrics, timers."""
    times, t0 = {}, time.perf_counter()
    with timed(times, "time_rollout", run.dev):
        ro = collect_rollouts(run, it)  # step 1
    with timed(times, "time_reward"):
        sc = reward_and_advantages(run, ro)  # step 2
    pairs = draw_iteration_pairs(run, it)    # step 3
    mbs = minibatches(run, it)
    with timed(times, "time_old", run.dev):
        s_old = old_surrogates(run, ro, pairs, mbs, sc.skipped)  # step 4: k ≥ 1
    log, grad_norms = [], []
    with timed(times, "time_update", run.dev):
        if not sc.skipped:  # step 5
            log, grad_norms = update_steps(run, ro, sc, pairs, mbs, s_old)
    # S_old is complete: step 4 wrote minibatches k ≥ 1, step 5's first step minibatch 0
    m = iteration_metrics(run, it, sc, s_old, log, grad_norms, times)
    return {**m, "time_iter": time.perf_counter() - t0}


def collect_rollouts(run: Run, it: int) -> Rollouts:
    """[Alg. step 1] G images per prompt of this process's groups, ODE-solved by θ_old (= θ)."""
    args, ad = run.args, run.adapter
    P, n_tr = args.prompts_per_iter, len(run.train_prompts)
    g = generator(args.seed, it, Stream.PROMPTS)
    if P <= n_tr:  # P distinct prompts
        pick = torch.randperm(n_tr, generator=g)[:P]
    else:  # more than there are: with replacement
        pick = torch.randint(n_tr, (P,), generator=g)
    prompts = run.local([run.train_prompts[i] for i in pick.tolist()])  # harness: its share
    cond = ad.encode(prompts)                                           # Pl rows
    prompt_idx = (torch.arange(run.Nl) // args.group_size).to(run.dev)  # (Nl,)
    noise = torch.randn((run.N,) + run.D, generator=generator(args.seed, it,
                                                                Stream.ROLLOUT_NOISE))  # (N, *D)
    x1 = run.local(noise).to(run.dev)                   # harness: torchrun's share; (Nl, *D)
    x0 = rollout(ad, x1, cond, prompt_idx, run.sigmas, args.solver, args.rollout_batch,
                 run.ctx, poll=run.poll)                # harness: the companion's poll
    return Rollouts(prompts=prompts, cond=cond, prompt_idx=prompt_idx, x0=x0)  # x0 (Nl, *D)


def reward_and_advantages(run: Run, ro: Rollouts) -> Scored:
    """[Alg. step 2] Rewards, all-gathered so that the advantages (§4) see the global batch."""
    args, G, rw = run.args, run.args.group_size, run.rewards
    names = [n for n, _ in rw.train_terms]
    prompts = [ro.prompts[i // G] for i in range(run.Nl)]  # one per sample
    mine, _ = decode_and_reward(run.adapter, rw, names, ro.x0, prompts, args.reward_batch)
    mine = torch.stack([mine[n] for n in names]).to(run.dev)  # (R, Nl)
    every = run.gather(mine)                                  # harness: every process's; (R, N)
    raw = dict(zip(names, every.cpu()))                       # {name: (N,)}
    values = training_values(raw, rw.train_terms).view(-1, args.prompts_per_iter, G)
    aggregate = {"sum": weighted_sum_advantages,
                 "per_reward": per_reward_advantages}[args.reward_aggregation]
    adv, stats = aggregate(values, torch.tensor([w for _, w in rw.train_terms]),  # (R,P,G), (R,)
                           global_std=args.global_std, std_eps=args.std_eps,
                           clamp=args.adv_clamp, eta=args.soft_clip_eta)  # (P, G)
    # adv.flatten() is prompt-major (sample n belongs to prompt n // G), as the rollouts are
    mine = run.local(adv.flatten()).to(run.dev)  # harness: torchrun's share; (Nl,)
    return Scored(raw=raw, headline=headline(raw, rw.train_terms), adv=mine,
                  adv_stats=stats, skipped=bool((adv == 0).all()))


# Step 2's arithmetic of rewards: `raw` is {reward name: (N,) raw values}; the advantages see
# raw · train_scale (§8's REWARD_UNITS: name → (logged unit, train_scale)).
def training_values(raw: dict, terms) -> torch.Tensor:
    """raw {name: (N,)} → (R, N) values the advantages see: raw[name] · train_scale."""
    return torch.stack([raw[n] * REWARD_UNITS.get(n, ("raw", 1.0))[1] for n, _ in terms])


def headline(raw: dict, terms) -> torch.Tensor:
    """(N,): raw[name] when there is one term, else Σ_k w_k · raw[k] · train_scale_k."""
    if len(terms) == 1:
        return raw[terms[0][0]]
    w = torch.tensor([wt for _, wt in terms])[:, None]  # (R, 1)
    return (training_values(raw, terms) * w).sum(0)


def reward_unit(terms) -> str:
    """The unit of headline(raw, terms)."""
    return (REWARD_UNITS.get(terms[0][0], ("raw",))[0] if len(terms) == 1
            else "weighted sum of training-scaled rewards")


def draw_iteration_pairs(run: Run, it: int) -> Pairs:
    """[Alg. step 3] One set of stratified (t, ε) pairs per sharing scope [ours C4], for θ_old
    and every θ step; rank 0's on every process (another CPU may round the draws otherwise)."""
    args, N = run.args, run.N
    scope = {"batch": torch.zeros(N, dtype=torch.long), "none": torch.arange(N),
             "group": torch.arange(N) // args.group_size}[args.pair_sharing]  # (N,)
    pairs = draw_pairs(run.sigmas[:-1], args.n_mc, run.D, scope, stratified=args.stratified,
                       generator=generator(args.seed, it, Stream.PAIRS), device=run.dev)
    pairs.t, pairs.eps = run.broadcast(pairs.t), run.broadcast(pairs.eps)  # harness: rank 0's
    pairs.index = run.local(pairs.index)  # harness: torchrun's share; (Nl,)
    return pairs


def minibatches(run: Run, it: int) -> list:
    """μ disjoint equal minibatches of local rows, drawn before step 4 [ours C14]: (μ, ...)."""
    perm = torch.arange(run.Nl)  # μ = 1: every sample, in order
    if run.args.mu > 1:
        perm = torch.randperm(run.Nl, generator=generator(run.args.seed, it, Stream.MINIBATCHES))
    return list(perm.to(run.dev).tensor_split(run.args.mu))


@torch.no_grad()
def old_surrogates(run: Run, ro: Rollouts, pairs: Pairs, mbs: list,
                   skipped: bool) -> OldSurrogates:
    """[Alg. step 4] S_old, θ_old's no-grad pass over minibatches k ≥ 1 (every minibatch when
    the update is skipped; none when μ = 1): step 5's first step gives minibatch 0's."""
    a, x0_hat = run.args, None
    if a.kl_coef:
        x0_hat = torch.empty((run.Nl, a.n_mc) + run.D, device=run.dev)
    s_old = OldSurrogates(torch.empty(run.Nl, a.n_mc, device=run.dev), x0_hat)
    for k, mb in enumerate(mbs):
        if k == 0 and not skipped:
            continue  # step 5's first step computes these
        for rows in mb.split(a.micro_batch):
            run.poll()  # harness: no step has run yet, so a SIGTERM may stop
            s_old.write(rows, *surrogate_pass(run, ro, pairs, rows))
            s_old.n_old_pass += len(rows)  # harness: for the logged nfe_old
    return s_old


def update_steps(run: Run, ro: Rollouts, sc: Scored, pairs: Pairs, mbs: list,
                 s_old: OldSurrogates):
    """[Alg. step 5] μ optimizer steps, one per minibatch, each accumulated over micro-batches.

    The first step runs at θ = θ_old, so its forward gives minibatch 0's S_old = sg(S_θ) (and
    x̂0_old = sg(x̂0)) and ρ ≡ 1 on its samples [ours C18]; at μ = 1 it is the only one (§0).
    Returns the log [(step k, samples, stats)] and the μ pre-clip gradient norms."""
    a, log, grad_norms = run.args, [], []
    for k, mb in enumerate(mbs):  # one optimizer step per minibatch
        micro = mb.split(a.micro_batch)
        for i, rows in enumerate(micro):  # its micro-batches, gradients summed
            if k == 0:
                run.poll()                                     # harness: a SIGTERM before any step
            s_new, x0h = surrogate_pass(run, ro, pairs, rows)  # (m, J), (m, J, *D)
            if k == 0:                                         # θ = θ_old: S_old is this forward's
                s_old.write(rows, s_new, x0h)
            kl = None
            if a.kl_coef:
                kl = xspace_kl(x0h, s_old.x0_hat[rows])  # (m, J)
            loss, st = vgrpo_loss(s_new, s_old.s[rows], sc.adv[rows], clip_eps=a.clip_eps,
                                  kl=kl, kl_coef=a.kl_coef)
            loss = loss * len(rows) / len(mb)             # the minibatch's mean [ours C16]
            run.backward(loss, last=i == len(micro) - 1)  # harness: fp16 scale, FSDP sync
            log.append((k, len(rows), st))                # harness: for iteration_metrics
        grad_norms.append(optimizer_step(run))
    return log, grad_norms


def surrogate_pass(run: Run, ro: Rollouts, pairs: Pairs, rows: torch.Tensor):
    """(s (m, J), x̂0 (m, J, *D)) of local samples `rows` on their pairs (§5), in one pass."""
    a, (t, eps) = run.args, pairs.take(rows)
    cond = select(ro.cond, ro.prompt_idx[rows])
    with run.ctx:
        return pair_surrogates(run.adapter.velocity, ro.x0[rows], cond, t, eps,
                               parameterization=a.parameterization,
                               adaptive=a.adaptive_weighting, mae_floor=a.mae_floor)


def optimizer_step(run: Run) -> torch.Tensor:
    """Unscale (fp16), clip, step unless the norm is non-finite; returns the pre-clip norm."""
    run.scaler.unscale_(run.opt)  # fp16: the true gradients before the clip
    gn = run.whole(torch.nn.utils.clip_grad_norm_(run.params, run.args.max_grad_norm))
    if torch.isfinite(gn):  # host sync: step, or skip a bad step
        run.scaler.step(run.opt)
    run.scaler.update()  # fp16: halve the scale after an overflow
    run.opt.zero_grad(set_to_none=True)
    return gn.detach().float()


def iteration_metrics(run: Run, it: int, sc: Scored, s_old: OldSurrogates, log: list,
                      grad_norms: list, times: dict) -> dict:
    """Everything logged, in one host sync: means over samples and processes, and S_old's CV."""
    a, stats = run.args, {}
    for k, n, st in log:  # each micro-batch weighted by its samples
        if k == 0:
            st = {**st, "abs_log_ratio_first": st["abs_log_ratio"]}
        for name, v in st.items():
            stats.setdefault(name, []).append((v * n, n))
    scal = {k: torch.stack([x for x, _ in v]).sum() / sum(n for _, n in v)
            for k, v in stats.items()}
    gn = torch.stack(grad_norms) if grad_norms else torch.zeros(1, device=run.dev)  # (μ,)
    scal.update(grad_norm=gn.mean(), nonfinite_grad_steps=(~torch.isfinite(gn)).sum().float())
    vec = torch.stack([v.float().to(run.dev) for v in scal.values()])  # (n,)
    vec = run.gather(vec[:, None]).mean(dim=1)  # the mean over processes; (n,)
    S_all = run.gather(s_old.s.mean(dim=1))     # (N,)
    cv = surrogate_cv(S_all.view(a.prompts_per_iter, a.group_size))
    scal = {**dict(zip(scal, vec)), **sc.adv_stats, **cv}
    host = dict(zip(scal, torch.stack([v.float().to(run.dev) for v in scal.values()]).tolist()))
    bad = int((~torch.isfinite(sc.headline)).sum())
    m = {"iter": it, **dict(zip(("reward_mean", "reward_std"), _finite_mean_std(sc.headline))),
         "reward_unit": reward_unit(run.rewards.train_terms), "n_nonfinite_reward": bad,
         "skipped": sc.skipped, **host, **times, "lr": run.opt.param_groups[0]["lr"],
         "grad_scale": run.scaler.get_scale(),  # 1.0 when disabled
         "nfe_rollout": a.num_steps, "nfe_old": a.n_mc * s_old.n_old_pass / run.Nl,
         "nfe_theta": a.n_mc}
    if len(sc.raw) > 1:  # several rewards: each one's too
        for n, r in sc.raw.items():
            m[f"reward_{n}_mean"], m[f"reward_{n}_std"] = _finite_mean_std(r)
    for k in ("ratio", "abs_log_ratio", "abs_log_ratio_first", "clip_frac", "approx_kl", "kl_x"):
        m.setdefault(k, math.nan)  # skipped: no update, no ratio statistics
    if bad and run.rank == 0:
        _warn(f"iteration {it}: {bad} non-finite reward(s) dropped (advantage 0)"
              + "; update skipped" * sc.skipped)
    return m


def _finite_mean_std(r: torch.Tensor) -> tuple[float, float]:
    f = r[torch.isfinite(r)]  # mean and population std of the finite entries
    return (f.mean().item(), f.std(unbiased=False).item()) if len(f) else (math.nan, math.nan)


def _warn(msg: str, prefix: str = "warning: ") -> None:
    from tqdm.auto import tqdm  # tqdm.write: not overwritten by the bar
    tqdm.write(prefix + msg, file=sys.stderr)


def say(line: str) -> None:
    """A line on stdout, above the bar. A closed or full stdout (`| head`, a dead `tee`,
    `> /dev/full`) never stops a run: stdout goes to os.devnull, said once on stderr."""
    from tqdm.auto import tqdm
    try:
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    except OSError as e:  # EPIPE, ENOSPC, EIO; the unwritten text is flushed to os.devnull
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        _warn(f"stdout failed ({e.strerror or type(e).__name__}); training goes on without "
              "it: metrics.jsonl in the run folder has every number")


@torch.no_grad()
def rollout(adapter, x1: torch.Tensor, cond, prompt_idx: torch.Tensor, sigmas: torch.Tensor,
            solver: str, chunk: int, ctx, poll: Callable = lambda: None) -> torch.Tensor:
    """ODE-solve x1 (N, *D), `chunk` rows at a time, poll() before each: o (N, *D) fp32."""
    out = []
    for rows in torch.arange(len(x1)).split(chunk):
        poll()
        with ctx:
            x0 = SOLVERS[solver](adapter.velocity, x1[rows], sigmas, select(cond, prompt_idx[rows]))
        out.append(x0.float())
    return torch.cat(out)


@torch.no_grad()
def decode_and_reward(adapter, rewards, names: list[str], latents: torch.Tensor,
                      prompts: list[str], chunk: int, keep_images: bool = False):
    """Decode once and score with every named reward, `chunk` at a time: (raw, uint8 images)."""
    raw, imgs = {n: [] for n in names}, []
    for rows in torch.arange(len(latents)).split(chunk):
        im, chunk_prompts = adapter.decode(latents[rows]), [prompts[i] for i in rows.tolist()]
        for n in names:
            raw[n].append(rewards.models[n](im, chunk_prompts).float().reshape(-1))
        if keep_images:
            imgs.append((im * 255).round().to(torch.uint8).cpu())
    return {n: torch.cat(v) for n, v in raw.items()}, (torch.cat(imgs) if keep_images else None)


def select(cond, rows: torch.Tensor):  # rows of every tensor in a (dict of) batch-first
    return {k: v[rows] for k, v in cond.items()} if isinstance(cond, dict) else cond[rows]


@contextlib.contextmanager
def timed(times: dict, key: str, dev: Optional[torch.device] = None):
    """times[key] = the block's seconds (after its work on `dev`); an OOM inside names the phase."""
    t = time.perf_counter()
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        e.vgrpo_phase = getattr(e, "vgrpo_phase", key)  # the innermost phase names it
        raise
    if dev is not None and dev.type == "cuda":  # wait for the GPU before the clock
        torch.cuda.synchronize(dev)
    times[key] = time.perf_counter() - t


# ------------------------------------------------------------------------------------------------
# §8  Rewards. The contract: reward_fn(images (N, 3, H, W) in [0, 1], prompts) -> scores (N,),
#     CPU fp32. The pure math sees only the rewards (P, G), and masks non-finite ones (§4).
# ------------------------------------------------------------------------------------------------
# Bad input and runs that cannot go on: main() (§11) prints them as one line, no traceback.
# `raw` is {reward name: (N,) raw values}; REWARD_UNITS: name → (logged unit, train_scale); the
# advantages see raw · train_scale (only sums and std_eps notice): PickScore's /26 [ours C17].
REWARD_UNITS = {"pickscore": ("raw", 1 / 26), "hpsv2": ("cos", 1.0), "clipscore": ("cos", 1.0),
                "jpeg": ("-kB", 1.0), "geneval": ("score", 1.0), "ocr": ("score", 1.0),
                "aesthetic": ("raw", 1.0), "imagereward": ("raw", 1.0),
                "unifiedreward": ("of 5", 1.0)}
BUILTIN_REWARDS = tuple(REWARD_UNITS)
REWARD_PLUGINS = {n: f"examples.rewards.{n}:score" for n in BUILTIN_REWARDS[1:]  # examples/rewards/
                  if n != "clipscore"}
REMOTE = ("http://", "https://")  # a reward served elsewhere: examples/rewards/remote_reward.py


def clip_pixels(images: torch.Tensor, image_processor) -> torch.Tensor:
    """A CLIPImageProcessor in torch: shortest edge (bicubic), centre crop, normalise; fp32."""
    ip, x, (h, w) = image_processor, images.float(), images.shape[-2:]
    # sizes are dicts in transformers 4.x and SizeDicts in 5.x (both .get); crop_size may be an int
    get = lambda d, k: d if isinstance(d, int) else d.get(k)
    size = int(get(ip.size, "shortest_edge") or get(ip.size, "height"))
    ch, cw = int(get(ip.crop_size, "height")), int(get(ip.crop_size, "width"))
    scale = size / min(h, w)
    nh, nw = max(size, int(h * scale)), max(size, int(w * scale))  # HF floors
    x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
    top, left = (nh - ch) // 2, (nw - cw) // 2
    x = x[..., top:top + ch, left:left + cw]  # (N, 3, ch, cw)
    mean, std = (x.new_tensor(v).view(1, 3, 1, 1) for v in (ip.image_mean, ip.image_std))
    return (x - mean) / std


def clip_reward(model, processor, device: torch.device, dtype: torch.dtype, *,
                logit_scale: bool = False) -> Callable:
    """A CLIPModel + CLIPProcessor as a reward [peer X10]: cos(image, text), × logit_scale.exp()."""
    model = model.eval().requires_grad_(False).to(device, dtype)
    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        px = clip_pixels(images.to(device), processor.image_processor).to(dtype)
        text = processor.tokenizer(prompts, padding=True, truncation=True, max_length=77,
                                   return_tensors="pt").to(device)
        out = model(input_ids=text.input_ids, attention_mask=text.attention_mask, pixel_values=px)
        cos = F.cosine_similarity(out.image_embeds.float(), out.text_embeds.float())  # (N,)
        return (model.logit_scale.exp().float() * cos if logit_scale else cos).cpu()
    return score


class RewardError(RunError, ValueError):
    """A plug-in reward that raised or broke the contract mid-run, after the start-up probe."""
    status = 69                         # main() exits with it (docs/training.md)


def user_import_path() -> None:
    """Plug-ins import as examples.… and as the user's modules beside the run (the cwd)."""
    for where in (str(Path(__file__).resolve().parent), os.getcwd()):
        if where not in sys.path:
            sys.path.insert(0, where)


def plugin_reward(spec: str) -> Callable:
    """`module.path:function` or a reward server's URL; a call that breaks the contract raises."""
    module, _, fn_name = ("examples.rewards.remote_reward:client" if spec.startswith(REMOTE)
                          else spec).partition(":")
    user_import_path()
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"reward {spec!r}: could not import module {module!r} ({e})") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: module {module!r} has no callable {fn_name!r}")
    if spec.startswith(REMOTE):
        try:
            fn = fn(spec)                        # the client of that URL
        except (RuntimeError, ValueError) as e:  # a malformed URL or client setting
            raise ConfigError(f"reward {spec!r}: {e}") from None

    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        try:
            out = fn(images, prompts)
        except (torch.cuda.OutOfMemoryError, RunError):
            raise  # not the plug-in's fault: the run's (a stop, out of memory)
        except (Exception, SystemExit) as e:  # noqa: BLE001 — the user's code: named
            raise RewardError(f"reward {spec!r} failed: {type(e).__name__}: {e}") from e
        try:
            out = torch.as_tensor(out).detach().float().cpu()
        except (TypeError, ValueError, RuntimeError):
            raise RewardError(f"reward {spec!r} returned {type(out).__name__}; return a tensor, "
                              f"array or list of {len(prompts)} numbers") from None
        if out.shape != (len(prompts),):
            raise RewardError(f"reward {spec!r} returned shape {tuple(out.shape)}, "
                              f"expected ({len(prompts)},)")
        return out
    score.check_prompts = getattr(fn, "check_prompts", None) or getattr(mod, "check_prompts", None)
    return score


def probe_reward(name: str, fn: Callable, size: int, device: torch.device, prompts: list[str]):
    """Before the model loads: the plug-in's check_prompts on its prompts, then a trial call."""
    try:
        (getattr(fn, "check_prompts", None) or (lambda p: None))(prompts)
    except ValueError as e:
        raise ConfigError(f"reward {name!r}: {e}") from None
    images = torch.rand(2, 3, size, size, generator=generator(0, 0, Stream.PROBE))
    batch = f"a probe batch of 2 random {size}×{size} images"
    try:
        out = fn(images.to(device), (prompts * 2)[:2])
    except RewardError as e:
        raise ConfigError(f"{e} (on {batch})") from None
    if not torch.isfinite(out).all():
        raise ConfigError(f"reward {name!r} returned non-finite values {out.tolist()} on {batch}")


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """'pickscore:1,hpsv2:0.5,my.mod:fn:2' → [(name, weight), ...]. Raises ConfigError."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        head, sep, tail = item.rpartition(":")
        if item.startswith(REMOTE) and "@" in item.split("//", 1)[1].split("/", 1)[0]:
            raise ConfigError("a reward URL holds a user name or password (…@HOST), which the "
                              "reward-server protocol never sends: drop it (it is not printed)")
        if item.startswith(REMOTE) and "/" not in item.split("//", 1)[1]:
            raise ConfigError(f"reward URL {item!r} needs a path: http://HOST:PORT/NAME")
        if item.startswith(REMOTE) and item.rfind(":") < item.rfind("/"):
            head, sep, tail = item, "", ""  # a URL without a weight (its port's ':')
        try:
            name, weight = (head, float(tail)) if sep else (item, 1.0)
        except ValueError:                          # 'module:function' without a weight,
            if head in BUILTIN_REWARDS or ":" in head:  # unless it is a whole name
                raise ConfigError(f"--reward {spec!r}: the weight of {head!r} must be a number "
                                  f"(got {tail!r}), e.g. {head}:1") from None
            name, weight = item, 1.0
        if name not in BUILTIN_REWARDS and ":" not in name:
            raise ConfigError(f"unknown reward {name!r}: use one of {', '.join(BUILTIN_REWARDS)}, "
                              "module.path:function, or a reward server's http://HOST:PORT/NAME")
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"reward {name!r}: weight must be a finite number ≥ 0 (got {weight})")
        out.append((name, weight))
    if not out:
        raise ConfigError(f"--reward {spec!r} names no reward")
    if len({n for n, _ in out}) != len(out):
        raise ConfigError(f"--reward {spec!r} names a reward twice")
    return out


def build_reward(name: str, args: Args, device: torch.device, dtype: torch.dtype) -> Callable:
    """One reward by name, from the locations in args; offline failures name the flag to use."""
    if name in ("pickscore", "clipscore"):
        from transformers import AutoModel, AutoProcessor
        _quiet_hf()
        mf, pf = {"pickscore": ("pickscore_model", "pickscore_processor"),
                  "clipscore": ("clip_model", "clip_model")}[name]
        proc = _from_pretrained(AutoProcessor, getattr(args, pf), f"the {name} processor",
                                f"--{pf}")
        model, info = _from_pretrained(AutoModel, getattr(args, mf), f"the {name} model",
                                       f"--{mf}", output_loading_info=True)
        if info["missing_keys"]:  # random weights in their place would score nonsense
            raise ConfigError(f"the {name} model {getattr(args, mf)!r} lacks weights "
                              f"{sorted(info['missing_keys'])[:3]}; check --{mf}")
        return clip_reward(model, proc, device, dtype, logit_scale=name == "pickscore")
    return plugin_reward(REWARD_PLUGINS.get(name, name))


class Rewards:
    """A run's rewards {name: reward_fn}, each loaded once, and its [(name, weight)] terms."""

    def __init__(self, models: dict, train_terms: list, eval_terms: Optional[list] = None):
        self.models, self.train_terms = dict(models), train_terms
        self.eval_terms = eval_terms or train_terms

    @classmethod
    def load(cls, args: Args, device: torch.device, dtype: torch.dtype) -> "Rewards":
        """Every reward the train and eval terms name, each built once."""
        names = dict.fromkeys(n for n, _ in args.train_terms + args.eval_terms)
        return cls({n: build_reward(n, args, device, dtype) for n in names},
                   args.train_terms, args.eval_terms)


# ------------------------------------------------------------------------------------------------
# §9  Models: pipelines, the SD3 adapter, model plug-ins, LoRA (diffusers, transformers, peft).
# ------------------------------------------------------------------------------------------------
MODEL_ALIASES = {"sd3.5-medium": "stabilityai/stable-diffusion-3.5-medium",
                 "sd3.5-large": "stabilityai/stable-diffusion-3.5-large",
                 "sd3-medium": "stabilityai/stable-diffusion-3-medium-diffusers"}
TINY_MODELS = {"tiny": "StableDiffusion3Pipeline"}
SUPPORTED_PIPELINES = ("StableDiffusion3Pipeline",)  # FLUX.1 and the others: examples/models/


# Model plug-ins beside the reward plug-ins: examples/models/<name>.py, each a module with
# PIPELINES, ALIASES, TINY, TINY_PRESET, DEFAULTS and an Adapter class (examples/models/README.md).
@functools.cache
def model_plugins() -> dict:
    """{name: module} of examples/models/*.py (not its tests), each imported by path once."""
    found = {}
    for path in sorted(Path(__file__).resolve().parent.glob("examples/models/*.py")):
        if not path.name.startswith(("test_", "_")):
            sys.modules.setdefault("vgrpo", sys.modules[__name__])  # `import vgrpo`: this file
            spec = importlib.util.spec_from_file_location(f"vgrpo_models_{path.stem}", path)
            found[path.stem] = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = found[path.stem]
            spec.loader.exec_module(found[path.stem])
    return found


def model_plugin(name: str):
    """The plug-in module that --model NAME names (an alias, tiny alias or pipeline folder)."""
    module, colon, _ = name.partition(":")
    if colon and not os.path.exists(name):  # a user's: --model module:(alias|hub id|folder)
        return user_model_plugin(module)
    if name in TINY_MODELS or name in MODEL_ALIASES:
        return None
    for mod in model_plugins().values():
        if name in mod.ALIASES or name in mod.TINY or name in mod.ALIASES.values():
            return mod
    if os.path.isdir(name):
        return pipeline_plugin(check_local_pipeline(name)[0])
    hints = [(h, m) for m in model_plugins().values() for h in getattr(m, "HUB_HINTS", ())
             if "/" in name and h in name.lower()]  # another hub id of a plug-in's family
    return max(hints, key=lambda hm: len(hm[0]), default=(None, None))[1]


@functools.cache
def user_model_plugin(module: str):
    """A plug-in module of the user's (the contract of examples/models/), imported by name."""
    user_import_path()
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"--model {module}:…: could not import module {module!r} ({e})") from e
    missing = [a for a in ("PIPELINES", "ALIASES", "TINY", "DEFAULTS", "Adapter")
               if not hasattr(mod, a)]
    if missing:
        raise ConfigError(f"--model {module}:…: {module!r} lacks {', '.join(missing)} "
                          "(examples/models/README.md: the plug-in contract)")
    return mod


def pipeline_plugin(cls_name: str):  # the plug-in that drives a diffusers pipeline class
    return next((m for m in model_plugins().values() if cls_name in m.PIPELINES), None)


def model_family(name: str) -> str:
    """'sd3' or a plug-in's name ('flux', …), from the alias, the folder's class or the id."""
    plugin = model_plugin(name)
    if plugin is not None:
        return plugin.__name__.removeprefix("vgrpo_models_")
    if Path(name).is_dir():
        check_local_pipeline(name)  # one-line errors
    return "sd3"


def _quiet_hf():
    """Silence the libraries' per-load bars and chatter, but keep the Hub's download bars."""
    for lib in map(importlib.import_module, ("diffusers", "transformers")):
        lib.utils.logging.disable_progress_bar()  # transformers' also turns off the Hub's bars:
        lib.utils.logging.set_verbosity_error()
    from huggingface_hub.utils import enable_progress_bars
    enable_progress_bars()                        # a first run's download is minutes of them


# ---- the Hub: every id checked before anything downloads; each failure one line with its fix ---
HUB_TIMEOUT = 10  # seconds for the access check: no network is said at once, not after retries
HUB_STATE = {"unreachable": False}  # set by check_hub_access: the cache only, and why
HUB_SIZES = {"stabilityai/stable-diffusion-3.5-medium": "about 16 GB",  # what the loaders read
             "yuvalkirstain/PickScore_v1": "about 4 GB"}


def is_hub_id(location: str) -> bool:
    return location not in TINY_MODELS and not os.path.exists(location) and "/" in location


def check_hub_access(ids: list[tuple[str, str, str]]) -> None:
    """Before any download: may this machine read each (hub id, what, flag)? A gated, unknown
    or token failure is one ConfigError; an unreachable Hub leaves the local cache, checked."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    for repo, what, flag in ids:
        if constants.HF_HUB_OFFLINE:
            break
        url = f"{constants.ENDPOINT}/api/models/{repo}/auth-check"
        try:
            hf_raise_for_status(get_session().get(url, headers=build_hf_headers(),
                                                  timeout=HUB_TIMEOUT))
        except Exception as e:  # noqa: BLE001 — classified below; a bug would still show
            if not _hub_unreachable(e):
                raise ConfigError(hub_failure(e, repo, what, flag) or
                                  f"{what} {repo!r}: the Hub's access check failed ({e})") from None
            _warn(f"cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}); "
                  "loading from the local cache only")  # at once: no minutes of retries
            constants.HF_HUB_OFFLINE = HUB_STATE["unreachable"] = True
    for repo, what, flag in ids:  # offline: each in the cache, the model's first
        if not constants.HF_HUB_OFFLINE:
            break
        try:
            snapshot_download(repo, local_files_only=True)
        except OSError as e:
            raise ConfigError(hub_failure(e, repo, what, flag) or str(e)) from None


def hub_ids(args: Args, model: bool = True, rewards: bool = True) -> list:
    """(hub id, what, flag) of each weight the run reads from the Hub, the model's first."""
    ids = [(resolve_model(args.model), "the model", "--model")] if model else []
    names = {n for n, _ in args.train_terms + args.eval_terms} if rewards else set()
    for name, flags in (("pickscore", ("pickscore_processor", "pickscore_model")),
                        ("clipscore", ("clip_model",))):
        if name in names:
            ids += [(getattr(args, f), f"the {name} {f.split('_')[-1]}", f"--{f}") for f in flags]
    return [i for i in dict.fromkeys(ids) if is_hub_id(i[0])]


def _chain(e: BaseException):  # e and every exception it was raised from, innermost last
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def _hub_unreachable(e: BaseException) -> bool:
    from huggingface_hub.utils import httpx
    return any(isinstance(x, (httpx.ConnectError, httpx.ConnectTimeout)) for x in _chain(e))


def hub_failure(e: BaseException, repo: str, what: str, flag: str) -> Optional[str]:
    """The one line for a failure to fetch `repo` from the Hub, from the exception chain; None
    when nothing in the chain is the Hub's (a bug or a damaged local folder)."""
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import httpx
    page, login = f"https://huggingface.co/{repo}", "`hf auth login` (or set HF_TOKEN)"
    local = f"or `hf download {repo}` where there is access, then `{flag} /path/to/dir`"
    for x in _chain(e):
        status = getattr(getattr(x, "response", None), "status_code", None)
        if isinstance(x, errors.GatedRepoError) and status == 403:
            return (f"your token has no access to the gated {what} {repo!r}: accept its licence "
                    f"at {page} (logged in as the token's user), then run the same command")
        if isinstance(x, errors.GatedRepoError):
            return (f"{what} {repo!r} is gated: accept its licence at {page} while logged in, "
                    f"then {login}")
        if isinstance(x, errors.HfHubHTTPError) and "Invalid credentials" in str(x):
            return (f"the Hub rejected your token (invalid credentials) for {what} {repo!r}: "
                    f"{login} with a valid one, or unset HF_TOKEN")
        if isinstance(x, errors.RepositoryNotFoundError):
            return (f"{what} {repo!r} was not found on the Hub (a typo, or a private repository "
                    f"you have no access to); check {flag}")
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return (f"no space left on the device while downloading {what} {repo!r} into the "
                    f"Hub cache {constants.HF_HUB_CACHE}: free space there, or move the cache "
                    "with HF_HOME=/a/bigger/disk")
        if isinstance(x, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
            why = "HF_HUB_OFFLINE is set: unset it where the Hub is reachable"
            if HUB_STATE["unreachable"]:
                why = (f"this machine cannot reach the Hub at {constants.ENDPOINT}: check "
                       "the network")
            return (f"{what} {repo!r} is not in the local cache ({constants.HF_HUB_CACHE}) and "
                    f"{why}, {local}")
        if _hub_unreachable(x):
            return f"cannot reach the Hub at {constants.ENDPOINT} for {what} {repo!r}: {local}"
        if isinstance(x, httpx.TransportError):
            return (f"the download of {what} {repo!r} broke off ({type(x).__name__}): run the "
                    "same command again: it resumes where it stopped")
    return None


def _from_pretrained(loader, location: str, what: str, flag: str, **kwargs):
    """loader.from_pretrained(location), saying first what loads; a Hub failure is one line."""
    size = f", {HUB_SIZES[location]} on first use" if location in HUB_SIZES else ""
    where = "the local folder" if os.path.isdir(location) else "the Hub cache or the Hub"
    say(f"loading {what} {location} from {where}{size}")  # stdout: stderr errs
    from huggingface_hub.utils import httpx
    try:
        return loader.from_pretrained(location, **kwargs)
    except (OSError, httpx.HTTPError) as e:
        line = hub_failure(e, location, what, flag)
        raise ConfigError(line or f"could not load {what} from {location!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e


def resolve_model(name: str) -> str:
    """'tiny' | alias | local diffusers dir | hub id (owner/name) → what from_pretrained gets."""
    if ":" in name and not os.path.exists(name):  # module:NAME, a user's plug-in
        inner = name.partition(":")[2]
        return model_plugin(name).ALIASES.get(inner, inner)
    parts = name.split("/")
    if name in TINY_MODELS or os.path.isdir(name) or (
            len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))):
        return name
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name]
    plugin = model_plugin(name)
    if plugin is not None:  # a plug-in's tiny alias is itself; its alias, a hub id
        return plugin.ALIASES.get(name, name)
    aliases = ", ".join([*TINY_MODELS, *MODEL_ALIASES, *(a for m in model_plugins().values()
                                                        for a in (*m.ALIASES, *m.TINY))])
    raise ConfigError(f"unknown model {name!r}: pass an alias ({aliases}), hub id or local folder")


@functools.cache  # once per folder: for the model family, then for loading
def check_local_pipeline(location: str, also: tuple = ()) -> tuple[str, dict]:
    """A local folder checked before loading: (its class, {part: None} for null parts, e.g. T5)."""
    index, where = Path(location, "model_index.json"), f"--model {location!r}"
    if not index.is_file():
        raise ConfigError(f"{where} has no model_index.json: pass a diffusers pipeline folder")
    try:
        spec = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: model_index.json is unreadable ({e})") from None
    cls_name = spec.get("_class_name")
    if cls_name not in SUPPORTED_PIPELINES + also and pipeline_plugin(str(cls_name)) is None:
        raise ConfigError(f"{where} holds a {cls_name}: neither SD3 nor a pipeline of "
                          "examples/models/ (examples/models/README.md)")
    parts = [k for k, v in spec.items() if not k.startswith("_") and (v is None or type(v) is list)]
    null = {k: None for k in parts if spec[k] is None or None in spec[k]}
    for k in parts:
        if k not in null and not Path(location, k).is_dir():
            raise ConfigError(f"{where}: model_index.json lists {k!r} but there is no {k}/ "
                              f"folder; copy the complete pipeline (or set {k} to null)")
    if "transformer" in null:
        raise ConfigError(f"{where}: the pipeline was saved without its transformer")
    return spec["_class_name"], null


def load_pipeline(name: str, dtype: torch.dtype):
    """Load a diffusers pipeline (SD3, a plug-in's): one code path for hub ids and folders."""
    import diffusers
    _quiet_hf()
    location, plugin = resolve_model(name), model_plugin(name)
    if plugin is not None and location in plugin.TINY:  # its offline builder
        return freeze_and_cast(getattr(plugin, plugin.TINY[location])(), dtype)
    if location in TINY_MODELS:
        return freeze_and_cast(tiny_models().build_tiny_sd3_pipeline(), dtype)
    also = tuple(getattr(plugin, "PIPELINES", ()))  # a user's plug-in's pipelines
    cls_name, null = (check_local_pipeline(location, also) if os.path.isdir(location)
                      else (None, {}))
    # diffusers 0.42 renamed `torch_dtype` (to be removed at 1.0) `dtype`; older ones lack `dtype`
    version = tuple(int(v) for v in diffusers.__version__.split(".")[:2])
    kw = {**null, {True: "dtype", False: "torch_dtype"}[version >= (0, 42)]: dtype}
    pipe = _from_pretrained(getattr(diffusers, cls_name or "DiffusionPipeline"), location,
                            "the model", "--model", **kw)
    cls_name = type(pipe).__name__
    if cls_name not in SUPPORTED_PIPELINES + also and pipeline_plugin(cls_name) is None:
        raise ConfigError(f"{location!r} is a {cls_name}: neither SD3 nor a pipeline of "
                          "examples/models/ (examples/models/README.md)")
    return freeze_and_cast(pipe, dtype)


def freeze_and_cast(pipe, dtype: torch.dtype):
    """Every part frozen, eval, in the compute dtype; the VAE fp32 (bf16 ones band) [peer X11]."""
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        if (m := getattr(pipe, part, None)) is not None:
            m.requires_grad_(False).eval().to(torch.float32 if part == "vae" else dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_models():
    """examples/tools/tiny_models.py, by path: the offline --model tiny and tiny-flux."""
    if "vgrpo_tiny_models" in sys.modules:
        return sys.modules["vgrpo_tiny_models"]
    path = Path(__file__).resolve().parent / "examples" / "tools" / "tiny_models.py"
    if not path.is_file():
        raise ConfigError(f"--model tiny / tiny-flux needs {path}; or pass a real --model")
    spec = importlib.util.spec_from_file_location("vgrpo_tiny_models", path)
    mod = sys.modules["vgrpo_tiny_models"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The seam between the algorithm and a pipeline: the loop, samplers, surrogate and loss only call
# encode / latent_shape / velocity / decode / sigmas. The two models differ exactly here [peer X9]:
#                SD3 / SD3.5                         FLUX.1-dev
#   text         CLIP-L + CLIP-G (+ T5) → 77 + L     CLIP-L pooled + T5 → L tokens, txt_ids
#   ODE latent   (16, H/8, W/8)                      packed 2×2: ((H/16)(W/16), 64), img_ids
#   t, guidance  1000·t; none (CFG-free)             t (scaled ×1000 inside); distilled, 3.5
#   rollout grid the scheduler's (shift 3)           linspace shifted by 3 (MixGRPO) [ours C8]
class SD3Adapter:
    """A diffusers SD3 / SD3.5 pipeline behind the seam above; FLUX's overrides its rows."""

    def __init__(self, pipe, device: torch.device, max_sequence_length: int):
        self.pipe, self.device, self.L = pipe, device, max_sequence_length
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)  # 8 for SD3
        self._cache: Optional[dict] = None                   # prompt → embeddings (cache_prompts)

    def latent_shape(self, resolution: int) -> tuple:
        r = resolution // self.vae_scale
        return (self.transformer.config.in_channels, r, r)  # (C, H, W)

    def encode(self, prompts: list[str]) -> dict:
        """Text conditioning of B prompts: from the cache (cache_prompts) or the text encoders."""
        if self._cache is None:
            return self._encode(prompts)
        if missing := [p for p in prompts if p not in self._cache]:
            raise ConfigError("prompt not among the cached embeddings (--offload_text_encoders): "
                              f"{missing[0]!r}")
        return {k: torch.stack([self._cache[p][k] for p in prompts]).to(self.device)
                for k in self._cache[prompts[0]]}

    @torch.no_grad()
    def cache_prompts(self, prompts: list[str], batch: int = 16) -> None:
        """Embed every prompt once (kept on the CPU), then move the text encoders off the GPU."""
        uniq, self._cache = list(dict.fromkeys(prompts)), {}
        for i in range(0, len(uniq), batch):
            for k, v in self._encode(uniq[i:i + batch]).items():
                for p, row in zip(uniq[i:i + batch], v):
                    self._cache.setdefault(p, {})[k] = row.cpu()
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(self.pipe, name, None) is not None:
                getattr(self.pipe, name).to("cpu")
        torch.cuda.empty_cache()  # a no-op when CUDA is unused

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> dict:
        """CFG-free conditioning [paper P11]: prompt_embeds (B, 77 + L, 4096), pooled (B, 2048)."""
        pe, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.L)
        return {"prompt_embeds": pe, "pooled": pooled}

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v_θ(x, t, c); SD3 takes the timestep as 1000·t [peer X9]. x (M, C, H, W), t (M,)."""
        dt = x.dtype if torch.is_autocast_enabled(x.device.type) else self.transformer.dtype
        return self.transformer(hidden_states=x.to(dt), timestep=(t * 1000).to(dt),
                                encoder_hidden_states=cond["prompt_embeds"],
                                pooled_projections=cond["pooled"], return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (M, C, H, W) → images (M, 3, 8H, 8W) in [0, 1], fp32."""
        cfg = self.vae.config
        z = latents.float() / cfg.scaling_factor + cfg.shift_factor
        return (self.vae.decode(z).sample.float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The rollout grid (K + 1,) ending in 0, from the model's scheduler (SD3.5: shift 3)."""
        sched = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sched.set_timesteps(num_steps)
        return sched.sigmas.detach().double().cpu()

    def blocks(self) -> list:
        return transformer_blocks(self.transformer)

    def save_lora(self, folder: str, state: dict, lora_config) -> None:
        """Write the LoRA in diffusers' format (StableDiffusion3Pipeline.load_lora_weights)."""
        type(self.pipe).save_lora_weights(folder, transformer_lora_layers=state,
                                          transformer_lora_adapter_metadata=lora_config.to_dict())


def make_adapter(pipe, args: "Args", device: torch.device) -> Model:
    """The adapter of the pipeline's family: SD3's, FLUX's, or a plug-in's (examples/models/)."""
    plugin = (model_plugin(args.model) if ":" in args.model else None) or pipeline_plugin(
        type(pipe).__name__)
    if plugin is not None:
        try:
            return plugin.Adapter(pipe, device, args)
        except ValueError as e:  # the plug-in's refusal of this pipeline or these flags
            raise ConfigError(f"--model {args.model}: {e}") from None
    return SD3Adapter(pipe, device, args.max_sequence_length)


def cut_prompts(pipe, prompts: list, max_len: int) -> list:
    """A prompt longer than every tokenizer of the pipeline reads is cut where the longest-
    reading one stops, by the tokenizer's own truncation, then on to the next whitespace. Each
    reads at most min(its limit, max_len + 77): CLIP's 77, T5's max_len, a chat template's
    prefix within the margin. What each encoder and a 77-token reward reads stays the same,
    and a 5 MB line is not held, re-tokenized each draw or logged whole by the pipeline."""
    toks = [getattr(pipe, n) for n in ("tokenizer", "tokenizer_2", "tokenizer_3")
            if getattr(pipe, n, None) is not None]
    reads = [min(t.model_max_length, max_len + 77) for t in toks]
    long = [i for i, p in enumerate(prompts) if len(p.encode()) >= max(reads, default=1e30)]
    ends, out = dict.fromkeys(long, 0), list(prompts)  # UTF-8 bytes ≥ tokens
    if not long:  # nothing any tokenizer could cut
        return out
    for t, n in zip(toks, reads):
        spans = t([str(prompts[i]) for i in long], add_special_tokens=False, truncation=True,
                  max_length=n, return_offsets_mapping=True)["offset_mapping"]
        for i, s in zip(long, spans):  # where t stops reading; all of it if it reads it all
            ends[i] = max(ends[i], s[-1][1] if len(s) == n else len(prompts[i]))
    for i, end in ends.items():
        p = prompts[i]
        end += next((k for k, c in enumerate(p[end:]) if c.isspace()), len(p) - end)
        if end < len(p):
            out[i] = type(p)(p[:end])
            if hasattr(p, "metadata"):
                out[i].metadata = p.metadata
    return out


def add_lora(transformer, rank: int, alpha: int, targets: list[str]):
    """A peft LoRA on `targets` inside the numbered blocks, fp32 params [ours C17]; its config."""
    import re
    from peft import LoraConfig
    alts = "|".join(re.escape(t.strip()) for t in targets if t.strip())
    pattern = rf"(?:.*\.)?\d+\.(?:.*\.)?(?:{alts})"  # <blocks>.<i>.[...].<target>
    cfg = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=pattern)
    transformer.add_adapter(cfg)
    for n, p in transformer.named_parameters():
        if "lora_" in n:  # fp32 master weights; compute runs under autocast
            p.data, p.requires_grad = p.data.float(), True
    return cfg


def transformer_blocks(transformer) -> list:
    """The repeated blocks: SD3's joint blocks; FLUX's double- and single-stream blocks."""
    return [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", [])]


# ------------------------------------------------------------------------------------------------
# §10  The run around the iteration: setup, the loop, evaluation; then the run folder and
#      checkpoints. examples/cluster.py fills in Run's hooks (preemption, requeue, one trainer
#      per folder, one-line out-of-memory and write failures; torchrun's processes, FSDP2).
# ------------------------------------------------------------------------------------------------
class Interrupted(RunError):  # Ctrl-C: where the run stands; exit 130, no traceback
    status, label = 130, "interrupted"


def train(args: Args, resumed: Optional[tuple] = None, fresh_ok: bool = False) -> list[dict]:
    """Run V-GRPO in this process; returns the per-iteration metrics (also in metrics.jsonl)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's processes: FSDP2 is the companion's
        raise ConfigError("vgrpo.py trains in one process; under torchrun run examples/cluster.py "
                          "with the same flags")
    run_dir = plan_run_dir(args, fresh_ok)          # checked writable; nothing created yet
    with hold_run_dir(run_dir):                     # one trainer per folder, before loading
        try:
            run = setup(args, resumed=resumed)      # bad input fails in setup
        except torch.cuda.OutOfMemoryError as e:
            e.vgrpo_phase = "setup"
            raise RunError(f"{out_of_memory(e, args)}; nothing written yet") from None
        return run_iterations(run, run_dir)


def run_iterations(run: Run, run_dir: Path) -> list[dict]:
    """The iterations from run.start, evaluations and checkpoints; a stop says how to go on."""
    a, history, it = run.args, [], run.start
    metrics = open_run_dir(run, run_dir)  # the folder prepared, metrics.jsonl open (rank 0)
    if run.rank == 0:
        say(banner(run))
    log = RunLog(run, metrics)  # the progress bar starts here
    try:
        for it in log.bar:
            with run.guard(it):  # examples/cluster.py: a stop saves and says so
                if a.eval_every and it % a.eval_every == 0:
                    log.evaluation(it)
                m = iteration(run, it)
                history.append(m)
                log.iteration(m)
            if (it + 1) % a.save_every == 0 or it + 1 == a.iterations:
                run.save(run, it + 1)
        if a.eval_every:  # also on continuing a finished run: a stop inside it is made up
            with run.guard(a.iterations):
                log.evaluation(a.iterations)
    except KeyboardInterrupt:
        raise Interrupted(how_to_go_on(run_dir)) from None
    except RewardError as e:
        raise RewardError(f"{e}; {how_to_go_on(run_dir)}") from None
    except torch.cuda.OutOfMemoryError as e:
        raise RunError(f"{out_of_memory(e, a)}, iteration {it}; {how_to_go_on(run_dir)}") from None
    finally:
        log.close()
    if run.rank == 0:
        say(closing_line(run, run_dir))
    return history


# Out of GPU memory: the phase (timed() puts it on the error) and the flag that lowers it.
OOM_KNOBS = {"time_rollout": "the rollout: lower --rollout_batch",
             "time_reward": "decoding and rewards: lower --reward_batch",
             "time_old": "the θ_old pass: lower --micro_batch",
             "time_update": "the update: lower --micro_batch or use --gradient_checkpointing",
             "eval": "the evaluation: lower --rollout_batch or --reward_batch",
             "setup": "loading and setup: fewer --reward models, or --no-compile"}


def out_of_memory(e: Exception, args: Args) -> str:
    """'out of GPU memory in <phase>: <what lowers it>' (docs/scaling.md, "Memory")."""
    phase = OOM_KNOBS.get(getattr(e, "vgrpo_phase", ""), "the run")
    if not args.offload_text_encoders:  # the text encoders (T5: about 9 GB) leave the GPU
        phase += " (or --offload_text_encoders)"
    return f"out of GPU memory in {phase}"


def closing_line(run: Run, run_dir: Path) -> str:
    """The run's last line: where its weights are and how a stock diffusers pipeline loads them."""
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    use = f"pipe.load_lora_weights({str(ckpt)!r})"
    if run.args.full_finetune:
        cls = type(run.adapter.transformer).__name__
        use = f"{cls}.from_pretrained({str(ckpt)!r}, subfolder='transformer')"
    return (f"done: run folder {run_dir}, final checkpoint {ckpt}; in diffusers: {use} "
            "(docs/training.md, \"Using the trained model\")")


def how_to_go_on(run_dir: Path, saved: Optional[Path] = None) -> str:
    """What the run folder holds and the command that continues it."""
    latest = run_dir / "checkpoints" / "latest"
    if saved is not None:
        return f"saved {saved}; continue with --resume {run_dir}"
    if latest.is_file():
        return (f"checkpoints/latest ({_latest(latest)}) is the last complete one; "
                f"continue with --resume {run_dir}")
    return f"no checkpoint yet; start a new run with another --run_dir than {run_dir}"


def setup(args: Args, pipe=None, rewards: Optional[Rewards] = None,
          resumed: Optional[tuple] = None, shard: Optional[Callable] = None) -> Run:
    """Load the model and rewards, add LoRA, make the optimizer, resume; writes nothing.
    `shard(transformer, dtype)`: examples/cluster.py's FSDP2 under torchrun (None: one process)."""
    train_prompts, eval_prompts = load_prompts(args)
    ckpt, state, init = read_starts(args, resumed)
    dev, dtype, ctx = setup_device(args)
    check_hub_access(hub_ids(args, model=pipe is None, rewards=rewards is None))  # before any
    rewards = setup_rewards(args, rewards, dev, dtype, train_prompts, eval_prompts)  # download
    adapter, train_prompts, eval_prompts = setup_model(args, pipe, dev, dtype, train_prompts,
                                                       eval_prompts)
    params, lora_cfg = setup_trainable(adapter, args, ckpt or init, dtype, shard)
    compiled, time_compile = args.compile, 0.0
    if compiled is None:  # the default: on with CUDA, unsharded
        compiled = dev.type == "cuda" and shard is None
    if compiled:  # one line if it fails; nothing written yet
        time_compile = compile_blocks(adapter, args, ctx, train_prompts[:1], params,
                                      len(eval_prompts[:args.n_eval]))  # evaluate's rows
    opt, scaler = setup_optimizer(args, params, dev, dtype)
    if ckpt is not None:  # optimizer, loss scale, RNG states
        restore_state(adapter.transformer, opt, scaler, ckpt, state)
    return Run(args=args, adapter=adapter, rewards=rewards, opt=opt, params=params,
               lora_cfg=lora_cfg, train_prompts=train_prompts, eval_prompts=eval_prompts,
               dev=dev, dtype=dtype, ctx=ctx, sigmas=adapter.sigmas(args.num_steps),
               eval_sigmas=adapter.sigmas(args.eval_steps or args.num_steps),
               D=adapter.latent_shape(args.resolution), scaler=scaler, compiled=compiled,
               time_compile=time_compile, start=state["iteration"] if state else 0,
               resumed_from=ckpt)


def setup_model(args: Args, pipe, dev, dtype, train_prompts: list, eval_prompts: list):
    """The pipeline (given, or loaded) on `dev` behind its family's adapter; the prompts cut to
    what its text encoders read, and with --offload_text_encoders embedded once:
    (adapter, train_prompts, eval_prompts)."""
    pipe = freeze_and_cast(pipe, dtype) if pipe is not None else load_pipeline(args.model, dtype)
    adapter = make_adapter(pipe.to(dev), args, dev)
    train_prompts, eval_prompts = (cut_prompts(pipe, ps, args.max_sequence_length)
                                   for ps in (train_prompts, eval_prompts))
    if args.offload_text_encoders:  # embed every prompt once, free the encoders
        adapter.cache_prompts(train_prompts + eval_prompts[:args.n_eval])
    return adapter, train_prompts, eval_prompts


def setup_optimizer(args: Args, params: list, dev, dtype) -> tuple:
    """AdamW over the trainable parameters, and the loss scaler: (opt, scaler)."""
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    # fp16 gradients underflow without loss scaling; bf16 and fp32 get a no-op scaler
    return opt, torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)


def setup_rewards(args: Args, rewards: Optional[Rewards], dev, dtype, train_prompts: list,
                  eval_prompts: list) -> Rewards:
    """The run's rewards, loaded once (unless given), each plug-in probed: fails in one line."""
    if rewards is None:
        rewards = Rewards.load(args, dev, dtype)
    for name, fn in rewards.models.items():
        scored = train_prompts if name in dict(args.train_terms) else []
        if name in dict(args.eval_terms):
            scored = scored + eval_prompts[:args.n_eval]
        if name not in BUILTIN_REWARDS or name in REWARD_PLUGINS:
            probe_reward(name, fn, min(args.resolution, 256), dev, scored)
    return rewards


def setup_trainable(adapter: Model, args: Args, start: Optional[Path], dtype, shard=None):
    """LoRA (or the whole transformer) from the seed, a start's weights, `shard` (setup):
    (params, the LoRA config or None). `start`: the checkpoint resumed or --init's."""
    tr, lora_cfg = adapter.transformer, None
    torch.manual_seed(args.seed)  # the LoRA init from the seed alone, on every rank: rewards
    random.seed(args.seed)        # and pipelines that initialise randomly drew before this
    if args.full_finetune:
        tr.to(torch.float32).requires_grad_(True)  # fp32 master weights, bf16 autocast compute
    else:
        lora_cfg = add_lora(tr, args.lora_rank, args.lora_alpha, args.lora_targets.split(","))
    if start:  # resumed, or a new run's start
        load_trainable(adapter, start, args.full_finetune)
    if args.gradient_checkpointing:
        tr.enable_gradient_checkpointing()
    if shard is not None:
        shard(tr, dtype)  # replaces the parameters: before AdamW
    return [p for p in tr.parameters() if p.requires_grad], lora_cfg


def read_starts(args: Args, resumed: Optional[tuple]) -> tuple:
    """(checkpoint, its state, --init's checkpoint), read once, checked against RESUME_FIXED."""
    if resumed is None and args.resume:
        resumed = read_checkpoint(args.resume)
    ckpt, state = resumed or (None, None)
    init = read_checkpoint(args.init, "--init") if args.init and not ckpt else (None, None)
    for where, st in (resumed or (None, None), init):
        saved = (st or {}).get("config", {})
        bad = [k for k in RESUME_FIXED if saved.get(k, getattr(args, k)) != getattr(args, k)]
        if bad:
            k = bad[0]
            raise ConfigError(f"--{k} {getattr(args, k)!r} differs from the checkpoint's "
                              f"{saved[k]!r} ({where}); drop --{k} to use it, or pick another")
    return ckpt, state, init[0]


def compile_blocks(adapter, args: Args, ctx, prompts: list, params: list, n_eval: int) -> float:
    """Regional torch.compile [ours C20]: each block in place (same modules and state-dict keys),
    one graph per block class and pass kind, compiled here on stand-ins at the run's shapes so
    a failure is one line before anything is written. Returns its seconds (gains: docs/gpu.md)."""
    say("compiling the transformer blocks (once, about a minute on a GPU; --no-compile skips it)")
    t0, N, J = time.perf_counter(), args.prompts_per_iter * args.group_size, args.n_mc
    rows = min(args.micro_batch, N // args.mu) * J  # rows of a θ_old or θ pass
    shapes = [(False, min(args.rollout_batch, N)), (False, min(args.rollout_batch, n_eval)),
              (False, rows), (True, rows)]  # rollout, eval, θ_old, θ
    g, cond = generator(0, 0, Stream.PROBE), adapter.encode(prompts)
    try:
        import torch._dynamo  # SD3.5's 3 block variants × 2 pass kinds × static and dynamic
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for blk in adapter.blocks():
            blk.compile()
        for grad, n in shapes:                          # the blocks compile here
            x = torch.randn((n,) + adapter.latent_shape(args.resolution), generator=g)
            x, t = x.to(adapter.device), torch.full((n,), 0.5, device=adapter.device)
            with torch.set_grad_enabled(grad), ctx:
                v = adapter.velocity(x, t, select(cond, torch.zeros(n, dtype=torch.long)))
            if grad:
                v.float().mean().backward()
    except torch.cuda.OutOfMemoryError:
        raise  # not the compiler's fault: train() names the phase
    except Exception as e:  # noqa: BLE001 — a missing compiler, an unsupported operation, ...
        raise ConfigError(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]!r}); run "
                          "with --no-compile") from None
    for p in params:
        p.grad = None
    return time.perf_counter() - t0

def setup_device(args: Args) -> tuple:
    """Device, compute dtype, the one autocast context; "cuda" is the current GPU."""
    device, precision = args.device, args.dtype
    if device == "auto":
        problem = cuda_problem()
        if problem and is_real_model(args.model):  # before anything downloads
            raise ConfigError(f"--device auto: {problem}; --model {args.model} needs a CUDA GPU: "
                              "install a torch build for this machine's driver (README, "
                              "Install), or pass --device cpu to run on the CPU (slow)")
        device = "cpu" if problem else "cuda"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # examples/cluster.py sets it per process
        dev = torch.device("cuda", torch.cuda.current_device())
    if precision == "auto":
        precision = "bf16" if dev.type == "cuda" else "fp32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        # cuDNN's fused attention failed in FLUX.1-dev's backward on an H200 (docs/gpu.md)
        torch.backends.cuda.enable_cudnn_sdp(False)
    return dev, dtype, (torch.autocast(dev.type, dtype=dtype) if dtype != torch.float32
                        else contextlib.nullcontext())


def cuda_problem() -> Optional[str]:
    """Why torch cannot use a CUDA GPU on this machine, in words; None when it can."""
    import re
    built = f"torch {torch.__version__} (built for CUDA {torch.version.cuda})"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return (f"{built} sees no usable GPU: none here, or a driver older than CUDA "
                f"{torch.version.cuda} needs")
    cap, archs = torch.cuda.get_device_capability(), torch.cuda.get_arch_list()
    for arch in archs:  # sm_XY runs on X.Y' ≥ X.Y of the same major; compute_XY (PTX) on ≥ X.Y
        kind, major, minor = re.fullmatch(r"(sm|compute)_(\d+?)(\d)[a-z]?", arch).groups()
        have = (int(major), int(minor))
        if have == cap or (have <= cap and (kind == "compute" or have[0] == cap[0])):
            return None
    return (f"the GPU {torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]}) is "
            f"not among the architectures of {built}: {', '.join(archs)}")


def is_real_model(name: str) -> bool:
    """A hub model, or a local folder with more than 1 GiB of weights (not a tiny test model)."""
    location, plugin = resolve_model(name), model_plugin(name)
    if plugin is not None and location in plugin.TINY:
        return False
    if not os.path.isdir(location):
        return location not in TINY_MODELS
    files = [*Path(location).rglob("*.safetensors"), *Path(location).rglob("*.bin")]
    return sum(f.stat().st_size for f in files) > 2 ** 30


class Prompt(str):  # from a .jsonl: .metadata is its line (GenEval's tag...)
    metadata: dict


def read_prompt_file(path: str, flag: str) -> list[str]:
    """The prompts of a text file, one per line, or of a .jsonl file (Prompts with .metadata)."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a folder; pass a text file of prompts or a .jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path!r} does not exist")
    try:
        lines = [(i, l) for i, l in enumerate(open(path, encoding="utf-8").read().splitlines(), 1)
                 if l.strip()]
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag} {path!r} is not UTF-8 text (byte {e.start}); save it as "
                          "UTF-8, one prompt per line") from None
    except OSError as e:
        raise ConfigError(f"{flag} {path!r} cannot be read ({e.strerror})") from None
    if not lines:
        raise ConfigError(f"{flag} {path!r}: the file holds no prompts (one per line)")
    if not path.endswith(".jsonl"):
        return [l.strip() for _, l in lines]
    prompts = []
    for i, line in lines:
        try:
            meta = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} {path!r}, line {i}: not JSON ({e.msg})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("prompt"), str):
            raise ConfigError(f"{flag} {path!r}, line {i}: expected a JSON object with a "
                              '"prompt" string, e.g. {"prompt": "a photo of a cat", "tag": ...}')
        prompts.append(Prompt(meta["prompt"]))
        prompts[-1].metadata = meta
    return prompts


def load_prompts(args: Args) -> tuple[list[str], list[str]]:
    """(train, eval) prompts: --prompts and --eval_prompts, or examples/prompts.txt."""
    if args.prompts is None:
        path = Path(__file__).resolve().parent / "examples" / "prompts.txt"
        allp = read_prompt_file(str(path), "--prompts not given, and the default")
        train, held = [p for i, p in enumerate(allp) if i % 5], allp[::5]
    else:
        allp = read_prompt_file(args.prompts, "--prompts")
        n_eval = math.ceil(args.eval_holdout * len(allp)) if len(allp) > 1 else 0
        order = torch.randperm(len(allp), generator=generator(0, 0, Stream.HOLDOUT)).tolist()
        held, train = ([allp[i] for i in sorted(order[:n_eval])],
                       [allp[i] for i in sorted(order[n_eval:])])
    if args.eval_prompts:
        held = read_prompt_file(args.eval_prompts, "--eval_prompts")
    return train, held or train[:1]


@torch.no_grad()
def evaluate(run: Run, it: int) -> dict:
    """Held-out prompts, one image each from fixed noise, on every process (FSDP needs them all)."""
    args, ad, rw = run.args, run.adapter, run.rewards
    prompts = run.eval_prompts[:args.n_eval]
    noise = generator(args.seed, 0, Stream.EVAL_NOISE)  # the same at every evaluation
    x1 = torch.randn((len(prompts),) + run.D, generator=noise).to(run.dev)
    lat = rollout(ad, x1, ad.encode(prompts), torch.arange(len(prompts), device=run.dev),
                  run.eval_sigmas, args.solver, args.rollout_batch, run.ctx,
                  poll=run.poll)  # the cluster companion's poll
    raw, imgs = decode_and_reward(ad, rw, [n for n, _ in rw.eval_terms], lat, prompts,
                                  args.reward_batch, keep_images=True)
    if run.run_dir is not None and run.rank == 0:
        from PIL import Image
        from torchvision.utils import make_grid  # ⌈√n⌉ per row, black where none is
        grid = make_grid(imgs, nrow=math.ceil(math.sqrt(len(imgs))), padding=0).permute(1, 2, 0)
        path = run.run_dir / "eval" / f"iter_{it:06d}.png"
        with run.writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid.numpy()).save(path)
    head = headline(raw, rw.eval_terms)
    ev = {"iter": it, "eval_reward_unit": reward_unit(rw.eval_terms),
          "eval_nfe": len(run.eval_sigmas) - 1, "eval_n_nonfinite": int((~head.isfinite()).sum())}
    for n, r in {"reward": head, **raw}.items():  # non-finite rewards dropped, counted above
        ev[f"eval_{n}_mean"], ev[f"eval_{n}_std"] = _finite_mean_std(r)
    if ev["eval_n_nonfinite"] and run.rank == 0:
        _warn(f"evaluation at iteration {it}: {ev['eval_n_nonfinite']} non-finite rewards dropped")
    return ev


class RunLog:
    """Rank 0's record of the run: metrics.jsonl lines, and one line each above the progress bar."""

    def __init__(self, run: Run, file):  # file: metrics.jsonl from open_run_dir (rank > 0: None)
        from tqdm.auto import tqdm
        self.run, self.file = run, file
        self.bar = tqdm(range(run.start, run.args.iterations), initial=run.start,
                        total=run.args.iterations, desc="V-GRPO", unit="it", disable=run.rank != 0)

    def evaluation(self, it: int) -> None:
        """evaluate(run, it), recorded; out of GPU memory in there names the evaluation."""
        with timed({}, "eval"):
            m = evaluate(self.run, it)
            self.record(m, f"eval at iteration {it}: reward {m['eval_reward_mean']:.4f}")

    def iteration(self, m: dict) -> None:
        self.record(m, f"iter {m['iter']:4d}  reward {m['reward_mean']:.4f} ± "
                       f"{m['reward_std']:.4f} ({m['reward_unit']})  grad {m['grad_norm']:.3g}  "
                       f"cv {m['surrogate_cv']:.3f}"
                       f"/{m['surrogate_cv_group']:.3f}  {m['time_iter']:.1f}s")
        self.bar.set_postfix(reward=f"{m['reward_mean']:.4g}", logrho=f"{m['abs_log_ratio']:.1e}")

    def record(self, m: dict, line: str) -> None:
        if self.run.rank > 0:
            return
        with self.run.writing(self.run.run_dir / "metrics.jsonl"):
            print(json.dumps(m), file=self.file, flush=True)
        say(line)

    def close(self) -> None:
        """The bar, and on rank 0 metrics.jsonl."""
        self.bar.close()
        if self.file is not None:
            with contextlib.suppress(OSError):  # a failed write, named already, retried
                self.file.close()


# ---- the run folder: planned before anything loads, one run per folder -------------------------
def plan_run_dir(args: Args, fresh_ok: bool = False) -> Path:
    """The run folder, checked writable, not holding another run (unless fresh_ok); none made."""
    resumed = find_checkpoint(args.resume).parent.parent if args.resume else None
    if resumed is not None and args.run_dir is None:
        run_dir = resumed
    else:
        tag = "+".join(n.split(":")[-1] for n, _ in args.train_terms)
        name = "".join(c if c.isascii() and (c.isalnum() or c in "+-._") else "_"
                       for c in f"{Path(args.model).name}-{tag}")  # one name, inside runs/
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"  # job arrays
        run_dir = Path(args.run_dir or f"runs/{name.lstrip('.')}-{stamp}")
    top = next(q for q in (run_dir.absolute(), *run_dir.absolute().parents) if q.exists())
    if not top.is_dir():
        raise ConfigError(f"--run_dir {str(run_dir)!r}: {str(top)!r} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=top).close()
    except OSError as e:
        raise ConfigError(f"--run_dir {str(run_dir)!r}: cannot write in {str(top)!r} "
                          f"({e.strerror}); pass a writable --run_dir") from None
    held = any((run_dir / f).exists() for f in ("config.json", "metrics.jsonl", "checkpoints"))
    same = resumed is not None and resumed.resolve() == run_dir.resolve()
    if held and not (fresh_ok or same):
        raise ConfigError(f"--run_dir {str(run_dir)!r} already holds a run: "
                          f"{how_to_go_on(run_dir)}")
    return run_dir


@contextlib.contextmanager
def hold_run_dir(run_dir: Path):
    """One trainer per run folder: an exclusive flock on run_dir/.lock, its pid inside, for the
    run; the system drops it when the process dies. A folder made here and left empty goes."""
    import fcntl  # POSIX: Linux and macOS
    made = [q for q in (run_dir, *run_dir.parents) if not q.exists()]  # deepest first
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:  # full, read-only, or .lock planted as a link
        raise ConfigError(f"--run_dir {str(run_dir)!r}: cannot open {str(run_dir / '.lock')!r} "
                          f"({e.strerror}); remove it if it is a link, or pass another "
                          "--run_dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(f"--run_dir {str(run_dir)!r} is in use by a running trainer (pid "
                          f"{holder}); wait for it to end, or pass another --run_dir") from None
    with contextlib.suppress(OSError):  # the pid informs only; a full disk is named later
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if made and [q.name for q in run_dir.iterdir()] == [".lock"]:  # bad input
                (run_dir / ".lock").unlink()
                for q in made:
                    q.rmdir()
        os.close(fd)


def open_run_dir(run: Run, run_dir: Path):
    """The run folder for every process; rank 0 prepares it and returns metrics.jsonl to append."""
    run.run_dir, mpath = run_dir, run_dir / "metrics.jsonl"
    if run.rank > 0:
        return None
    with run.writing(run_dir):
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        for stale in (run_dir / "checkpoints").glob(".tmp-*"):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        for planted in ("config.json", "metrics.tmp"):  # a link is replaced, never followed
            (run_dir / planted).unlink(missing_ok=True)
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(run.args), indent=2))
        if run.resumed_from and run.resumed_from.parent == run_dir / "checkpoints":
            _point_latest(run.resumed_from)  # `latest` names the resumed checkpoint
        text = mpath.read_bytes().decode(errors="replace") if mpath.exists() else ""
        keep, bad = [], 0
        for line in text.splitlines():
            try:
                if json.loads(line)["iter"] < run.start:
                    keep.append(line)
            except (ValueError, TypeError, KeyError, IndexError):
                bad += 1  # a line cut short by a kill, or damaged
        if bad:
            _warn(f"{mpath}: {bad} unreadable line(s) dropped (cut short by a kill, or damaged)")
        mpath.with_suffix(".tmp").write_text("".join(l + "\n" for l in keep))
        os.replace(mpath.with_suffix(".tmp"), mpath)
    return open(mpath, "a")


# ---- checkpoints: one folder per save, `latest` switched atomically once it is complete --------
CKPT_STATE, OPTIM_FILE = "trainer_state.pt", "optimizer.pt"
LORA_FILE = "pytorch_lora_weights.safetensors"
FULL_FILE = "transformer/diffusion_pytorch_model.safetensors"
# flags that change the shape of what a checkpoint holds: they cannot change on --resume
RESUME_FIXED = ("full_finetune", "lora_rank", "lora_alpha", "lora_targets")


def find_checkpoint(path: str, flag: str = "--resume") -> Path:
    """A checkpoint folder, or a run folder (→ its latest checkpoint). Raises ConfigError."""
    p, latest = Path(path), Path(path, "checkpoints", "latest")
    if not (p / CKPT_STATE).is_file() and latest.is_file():
        p = latest.parent / _latest(latest)
        if not (p / CKPT_STATE).is_file():
            raise ConfigError(f"{flag} {path!r}: checkpoints/latest names {p.name[:60]!r}, not "
                              "a checkpoint there; write a checkpoint folder's name into it "
                              "(e.g. iter_000002), or pass that folder")
    if (p / CKPT_STATE).is_file():
        return p
    raise ConfigError(f"{flag} {path!r}: no checkpoint there ({CKPT_STATE} or checkpoints/latest)")


def read_checkpoint(path: str, flag: str = "--resume") -> tuple[Path, dict]:
    """(folder, trainer state) of a checkpoint, validated; only the weights' header is read."""
    ckpt = find_checkpoint(path, flag)
    try:
        state = load_data(ckpt / CKPT_STATE, flag)
        need = [CKPT_STATE + ": " + k for k in ("iteration", "config", "optimizer_saved", "rng")
                if k not in state]
        if not need:
            weights = FULL_FILE if state["config"]["full_finetune"] else LORA_FILE
            need = [f for f in [weights] + [OPTIM_FILE] * state["optimizer_saved"]
                    if not (ckpt / f).is_file()]
        if need:
            raise ValueError(f"missing {', '.join(need)}")
        from safetensors import safe_open
        with safe_open(str(ckpt / weights), framework="pt") as f:  # checks the layout too
            if not list(f.keys()):
                raise ValueError(f"{weights} holds no tensors")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — any failure here means the checkpoint is unusable
        why = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"checkpoint {str(ckpt)!r} is unreadable or incomplete "
                          f"({type(e).__name__}: {why}); pick another with {flag}") from e
    return ckpt, state


def load_data(path: Path, flag: str, **kw):
    """torch.load with weights_only: tensors and plain data, so a crafted file runs no code."""
    import pickle
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except pickle.UnpicklingError:  # torch's multi-line message: one line here
        raise ConfigError(f"checkpoint file {str(path)!r} is unreadable or incomplete, or "
                          "holds more than tensors and plain data (a file that could run code "
                          f"is never loaded); pick another with {flag}") from None


def save_checkpoint(run: Run, it: int) -> Path:
    """checkpoints/iter_X, written whole into a temporary folder and then renamed."""
    tr, ckdir = run.adapter.transformer, run.run_dir / "checkpoints"
    final, tmp = ckdir / f"iter_{it:06d}", ckdir / f".tmp-iter_{it:06d}"
    if is_latest(final):
        return final  # saved already: a stop right after a save
    try:
        with run.writing(ckdir):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)                           # umask applies (not 0700)
            weights, cfg = full_state(tr), dataclasses.asdict(run.args)   # optimizer's: later
            if run.args.full_finetune:
                from safetensors.torch import save_file
                tr.save_config(tmp / "transformer")
                save_file(weights, str(tmp / FULL_FILE))
            else:
                from peft.utils import get_peft_model_state_dict
                lora = get_peft_model_state_dict(tr, state_dict=weights)
                run.adapter.save_lora(str(tmp), lora, run.lora_cfg)
            del weights  # host memory: never the weights and AdamW's at once
            optim = full_state(tr, run.opt)
            if optim:
                torch.save(optim, tmp / OPTIM_FILE)
            rng = {"torch": torch.get_rng_state(), "python": random.getstate()}  # all draws: CPU
            torch.save({"iteration": it, "config": cfg, "optimizer_saved": bool(optim),
                        "rng": rng, "scaler": run.scaler.state_dict()}, tmp / CKPT_STATE)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            mode = (tmp / "config.json").stat().st_mode & 0o777  # a file's mode (umask)
            for f in tmp.rglob("*.safetensors"):                 # safetensors writes 0600
                f.chmod(mode)
            shutil.rmtree(final, ignore_errors=True)  # never `latest`'s: saves move on from it
            os.replace(tmp, final)
            _point_latest(final)
            prune_checkpoints(ckdir, final, run.args.keep_checkpoints)
    finally:  # after a failed write nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        (ckdir / ".latest.tmp").unlink(missing_ok=True)
    return final


def full_state(tr, opt=None) -> dict:
    """The trainable weights, or with `opt` the optimizer state keyed by parameter name, whole on
    the CPU (examples/cluster.py: gathered from every process). An optimizer that never stepped
    gives {}: torch's DCP would first take a hidden lr-0 step."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    o = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    if opt is None:
        return get_model_state_dict(tr, options=o)
    return get_optimizer_state_dict(tr, opt, options=o) if opt.state else {}


def prune_checkpoints(ckdir: Path, latest: Path, keep: int) -> None:
    """--keep_checkpoints: the `keep` newest up to `latest` stay (0: all); later ones, left by a
    run resumed from an older checkpoint, are replaced as the run reaches them."""
    if keep == 0:
        return
    done = sorted(p for p in ckdir.glob("iter_*") if p.name <= latest.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _latest(latest: Path) -> str:  # the name in checkpoints/latest, whatever its bytes
    return latest.read_bytes().decode(errors="replace").strip().replace("\0", "")


def is_latest(ckpt: Path) -> bool:  # checkpoints/latest names ckpt: saved, and complete
    latest = ckpt.parent / "latest"
    return latest.is_file() and _latest(latest) == ckpt.name


def _point_latest(ckpt: Path) -> None:  # checkpoints/latest ← ckpt's name, atomically
    (ckpt.parent / ".latest.tmp").unlink(missing_ok=True)  # a planted link: not followed
    (ckpt.parent / ".latest.tmp").write_text(ckpt.name)
    os.replace(ckpt.parent / ".latest.tmp", ckpt.parent / "latest")


def load_trainable(adapter, ckpt: Path, full: bool) -> None:
    """Trained weights back into the live, still unsharded transformer (any process count)."""
    from safetensors.torch import load_file
    if full:
        adapter.transformer.load_state_dict(load_file(str(ckpt / FULL_FILE)))
        return
    from peft.utils import set_peft_model_state_dict
    sd = {k.removeprefix("transformer."): v for k, v in load_file(str(ckpt / LORA_FILE)).items()}
    loaded = set_peft_model_state_dict(adapter.transformer, sd)
    unexpected = getattr(loaded, "unexpected_keys", None)
    if unexpected:
        raise ConfigError(f"checkpoint {str(ckpt)!r} does not match this model: {unexpected[:3]}")


def restore_state(tr, opt, scaler, ckpt: Path, state: dict) -> None:
    """Optimizer (memory-mapped: processes share its pages), loss scale and RNG of a checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    if state["optimizer_saved"]:  # False when saved before the first step
        optim = load_data(ckpt / OPTIM_FILE, "--resume", mmap=True)
        set_optimizer_state_dict(tr, opt, optim, options=StateDictOptions(full_state_dict=True))
    if state["scaler"]:  # {} from a disabled (non-fp16) scaler
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])  # an older checkpoint's "cuda" entry is ignored


# ------------------------------------------------------------------------------------------------
# §11  Configuration: Args (each field a --flag; `src`: its default's source), presets, main().
# ------------------------------------------------------------------------------------------------
SD3_LORA_TARGETS = "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"  # attn


def _f(default, help: str, src: str = "our choice", choices=None):
    return field(default=default, metadata=dict(help=help, src=src, choices=choices))


@dataclass
class Args:
    # --- io ---
    run_dir: Optional[str] = _f(None, "output folder (default runs/<model>-<reward>-<date>)")
    prompts: Optional[str] = _f(None, "training prompts file (default: examples/prompts.txt)")
    eval_prompts: Optional[str] = _f(None, "held-out prompts (default: split off --prompts)")
    eval_holdout: float = _f(0.1, "fraction of --prompts held out for evaluation, never trained on")
    resume: Optional[str] = _f(None, "checkpoint or run folder; its config overrides these values")
    init: Optional[str] = _f(None, "a new run from a checkpoint's (or run folder's) weights")
    save_every: int = _f(10, "checkpoint every k iterations, and after the last")
    keep_checkpoints: int = _f(0, "keep the k newest checkpoints (0 = all; SD3.5-M LoRA: about "
                               "0.3 GB each)")
    eval_every: int = _f(10, "evaluate on held-out prompts every k iterations (0 = never)")
    n_eval: int = _f(16, "held-out prompts per evaluation (one image each, fixed noise)")
    # --- model ---
    model: str = _f("sd3.5-medium", f"{', '.join([*TINY_MODELS, *MODEL_ALIASES])}, "
                    "examples/models/'s aliases, hub id, folder")
    resolution: int = _f(512, "image side in pixels", "[ours C7] DiffusionNFT's 512")
    max_sequence_length: int = _f(128, "T5 tokens per prompt", "Flow-GRPO/DiffusionNFT [peer X9]")
    guidance: float = _f(3.5, "FLUX: distilled guidance (no true CFG)", "[ours C1] [peer X9]")
    flux_shift: float = _f(3.0, "FLUX: time shift of the rollout grid", "[ours C8] MixGRPO")
    lora_rank: int = _f(32, "LoRA rank r", "[paper P11] SD3.5-M Stage 1")
    lora_alpha: int = _f(64, "LoRA alpha", "[paper P11] SD3.5-M Stage 1")
    lora_targets: str = _f(SD3_LORA_TARGETS, "module names given LoRA (in blocks)", "[ours C17]")
    full_finetune: bool = _f(False, "train all transformer weights instead of LoRA")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward (less memory)")
    offload_text_encoders: bool = _f(False, "embed all prompts once, text encoders to the CPU; "
                                     "host RAM ≈ 1.7 MB per prompt at SD3.5's shapes")
    compile: Optional[bool] = _f(None, "torch.compile the blocks; default: on with CUDA, in one "
                                 "process; off on the CPU", "[ours C20] docs/gpu.md")
    dtype: str = _f("auto", "auto: bf16 on CUDA, fp32 on CPU", "[ours C10]",
                    choices=("auto", "bf16", "fp16", "fp32"))
    # --- sampler ---
    num_steps: int = _f(40, "ODE steps per rollout (K)", "[paper P11] 40-step ODE rollouts")
    solver: str = _f("euler", "deterministic ODE solver", "[paper P1; ours C17]",
                     choices=("euler", "dpmpp2m"))
    eval_steps: Optional[int] = _f(None, "ODE steps of evaluations (None: num_steps)")
    rollout_batch: int = _f(16, "samples per batched ODE solve (memory knob, same results)")
    # --- reward ---
    reward: str = _f("pickscore", f"weighted rewards, e.g. pickscore:1,hpsv2:1: "
                     f"{', '.join(BUILTIN_REWARDS)}, module.path:function or a reward server's URL")
    reward_aggregation: str = _f("sum", "several rewards: sum then normalise, or the reverse",
                                 "[ours C3]", choices=("sum", "per_reward"))
    eval_rewards: Optional[str] = _f(None, "rewards scored at evaluation (default: training's)")
    pickscore_model: str = _f("yuvalkirstain/PickScore_v1", "PickScore: id or dir", "[peer X10]")
    pickscore_processor: str = _f("laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "its processor",
                                  "[peer X10]")
    clip_model: str = _f("openai/clip-vit-large-patch14", "CLIP of clipscore", "[peer X10]")
    reward_batch: int = _f(32, "images per decode and reward-model call (memory knob)")
    # --- objective ---
    prompts_per_iter: int = _f(6, "P: prompts per iteration (paper: 48; 6 = one GPU's share of 8)")
    group_size: int = _f(24, "G: images per prompt", "[paper P11] group 24")
    n_mc: int = _f(4, "N_MC: (t, eps) pairs per sample", "[paper P11] N_MC = 4")
    pair_sharing: str = _f("batch", "scope of shared (t, eps) pairs", "[paper P4, P5; ours C4]",
                           choices=("batch", "group", "none"))
    stratified: bool = _f(True, "one t per stratum of the rollout sigma grid", "[paper P5]")
    parameterization: str = _f("x", "space of the surrogate's error", "[paper P6, P12]",
                               choices=("x", "v", "eps"))
    adaptive_weighting: bool = _f(True, "divide each pair's MSE by its detached MAE", "[paper P7]")
    mae_floor: float = _f(1e-5, "lower clamp of the MAE denominator", "[ours C5]")
    global_std: bool = _f(True, "advantage std over the batch (else per group)",
                          "[ours C3] flow_grpo/stat_tracking.py")
    std_eps: float = _f(1e-4, "added to the advantage std", "[ours C3] DiffusionNFT")
    adv_clamp: float = _f(5.0, "hard clamp |A| ≤ this before soft-clip", "[ours C1]")
    soft_clip_eta: float = _f(3.0, "η of A ← η·tanh(A/η); 0 = off", "[paper P9] η = 3, Stage 1")
    clip_eps: float = _f(0.0, "ratio clip ε; 0 = off", "[paper P9] SD3.5 Stage 1: no clip")
    kl_coef: float = _f(0.0, "β of the x-space KL to θ_old; 0 = off", "[paper P9] Stage 1: no KL")
    mu: int = _f(1, "optimizer steps per iteration (disjoint minibatches)", "[paper P11] 1 step")
    micro_batch: int = _f(4, "samples per forward/backward (× n_mc rows; memory knob)")
    # --- optimisation ---
    iterations: int = _f(150, "rollout-and-update iterations", "[paper P11] Stage 1: 150")
    lr: float = _f(3e-4, "AdamW learning rate", "[paper P11]")
    weight_decay: float = _f(1e-4, "AdamW weight decay", "[ours C10]")
    max_grad_norm: float = _f(1.0, "gradient-norm clip", "[ours C10]")
    # --- system ---
    seed: int = _f(0, "seed of every random stream (prompts, noise, pairs, LoRA init)")
    device: str = _f("auto", "cuda, cpu, or auto")
    preset: Optional[str] = _f(None, "bundle of overrides (docs/training.md)",
                               choices=("paper", "geneval-stage", "ocr-stage", "smoke"))

    @functools.cached_property
    def train_terms(self) -> list[tuple[str, float]]:  # --reward parsed once: [(name, w), ...]
        return parse_reward_spec(self.reward)

    @functools.cached_property
    def eval_terms(self) -> list[tuple[str, float]]:  # --eval_rewards, or the training terms
        return parse_reward_spec(self.eval_rewards) if self.eval_rewards else self.train_terms

    # not a flag: each field's source (resolve_args: a preset, a resumed config, the command
    # line; else its `src`), for the banner and --help
    origin: dataclasses.InitVar[Optional[dict]] = None

    def __post_init__(self, origin: Optional[dict]) -> None:
        self.origin = {f.name: f.metadata["src"] for f in dataclasses.fields(self)} | (origin or {})


# SD3's family preset, under the per-model presets (a plug-in's: its DEFAULTS and PRESETS).
FAMILY_PRESET_SRC = {"sd3": "our choice: memory; the peers' 40-step evaluation"}
FAMILY_PRESETS: dict[str, dict] = {"sd3": dict(gradient_checkpointing=True, eval_steps=40)}
# --preset NAME: "paper" is SD3.5-M Stage 1's 48 × 24 [paper P11] (a plug-in may override it:
# FLUX MixGRPO's 32 × 12 [ours C1–C3]); the stages' take their controls [ours C9]
# (docs/training.md "Presets").
PRESETS: dict[str, dict] = {
    "paper": dict(prompts_per_iter=48, group_size=24),
    "geneval-stage": dict(prompts_per_iter=48, group_size=24, n_mc=10, mu=2, clip_eps=1e-2,
                          soft_clip_eta=0.0, iterations=200),  # Stages 2 / 4 (4: 50 its)
    "ocr-stage": dict(prompts_per_iter=48, group_size=24, n_mc=10, mu=2, kl_coef=0.3,
                      clip_eps=0.0, iterations=30),  # Stage 5
    "smoke": dict(iterations=2, prompts_per_iter=2, group_size=4, eval_every=1, save_every=1,
                  n_eval=2)}


def given_flags(argv: Optional[list[str]] = None) -> dict:
    """The flags given, and only those (flag name == field name); --help as its epilog says."""
    p = argparse.ArgumentParser(
        description="V-GRPO for flow-matching image models (arXiv 2604.23380)",
        epilog="In brackets: what a run of --model gets (SD3.5-M's, and FLUX's where it differs) "
               "and its source (METHOD.md: [paper Pk], [peer Xk] a peer's, [ours Ck]).")
    p.error = lambda message: p.exit(2, f"error: {message} (--help lists every flag)\n")  # one line
    peek = argparse.ArgumentParser(add_help=False)        # --help, and the --model it is for
    peek.add_argument("--model")
    peek.add_argument("-h", "--help", action="store_true")
    peek.error = p.error
    asked = peek.parse_known_args(argv)[0]
    wants = [("SD3 ", {}), ("FLUX ", {"model": "flux.1-dev"})][:1 + ("flux" in model_plugins())]
    if asked.model is not None:                                   # (label, a run's flags)
        wants = [("", {"model": asked.model})]
    views = [(label, resolve_args(given)) for label, given in wants if asked.help]
    for _, a in views[1:]:  # the second view's model is --help's, not the command line's
        a.origin["model"] = "--help's FLUX.1 view (examples/models/flux.py)"
    # --help's groups are the sections of Args, each named here by its first field
    sections = {"run_dir": "io", "model": "model", "num_steps": "sampler", "reward": "reward",
                "prompts_per_iter": "objective", "iterations": "optimisation", "seed": "system"}
    types, group = {"int": int, "float": float, "str": str}, p
    for f in dataclasses.fields(Args):
        if f.name in sections:
            group = p.add_argument_group(sections[f.name])
        shown = [(label, getattr(a, f.name), a.origin[f.name]) for label, a in views]
        if shown and shown[-1][1] == shown[0][1]:  # what every view gets: one bracket
            shown = [("", *shown[0][1:])]
        text = f.metadata["help"].replace("examples/models/'s aliases", ", ".join(
            a for m in model_plugins().values() for a in (*m.ALIASES, *m.TINY)))
        kw = dict(default=argparse.SUPPRESS, help=" ".join(
            [text] + [f"[{label}{v!r}; {src}]" for label, v, src in shown]))
        if "bool" in str(f.type):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = types[str(f.type).replace("Optional[", "").rstrip("]")]
            kw["choices"] = f.metadata["choices"]
        group.add_argument(f"--{f.name}", **kw)
    return vars(p.parse_args(argv))


def parse_args(argv: Optional[list[str]] = None) -> Args:
    """CLI → Args (presets applied, validated)."""
    return resolve_args(given_flags(argv))


def resolve_args(given: dict, resumed: Optional[dict] = None) -> Args:
    """The one configuration pass: presets, a resumed config, then the flags given (later wins)."""
    model = given.get("model", (resumed or {}).get("model", Args.model))
    family, preset = model_family(model), given.get("preset")
    fields = {f.name: f for f in dataclasses.fields(Args)}
    resumed = {k: v for k, v in (resumed or {}).items()  # options removed since: dropped
               if k in fields and v in (fields[k].metadata["choices"] or [v])}
    own = getattr(model_plugin(model), "PRESETS", {})  # a plug-in's own version of a preset
    layers = family_layers(model, family) + [
        (f"--preset {preset}", own.get(preset, PRESETS[preset]) if preset else {}),
        ("the resumed run's config", resumed), ("command line", given)]
    values, origin = {}, {}
    for where, layer in layers:
        values.update(layer)
        origin.update({k: where for k in layer})
    args = Args(**values, origin=origin)
    check_args(args)
    return args


def family_layers(model: str, family: str) -> list:
    """[(source, {field: value})] of the model's family and of its tiny alias, in that order."""
    plugin = model_plugin(model)
    if plugin is None:
        tiny = tiny_models().PRESETS[model] if model in TINY_MODELS else {}
        return [(f"{family} preset ({FAMILY_PRESET_SRC[family]})", FAMILY_PRESETS[family]),
                (f"{model} preset (examples/tools/tiny_models.py)", tiny)]
    layers = [(f"{family} preset ({src})", {k: v}) for k, (v, src) in plugin.DEFAULTS.items()]
    if resolve_model(model) in plugin.TINY:  # each default above with its own source
        where = f"examples/models/{family}" if family in model_plugins() else family
        layers.append((f"{model} preset ({where}.py)", plugin.TINY_PRESET))
    return layers


# Upper bounds of integer flags, checked before anything allocates from them (a 2^31-step grid
# is 17 GB); every other integer flag ≤ 2^31 − 1. Each is far above any published recipe.
INT_CAPS = dict(num_steps=1000, eval_steps=1000, n_mc=1000,  # the schedulers' 1000 timesteps
                resolution=4096, max_sequence_length=1024, lora_rank=4096, n_eval=10_000,
                prompts_per_iter=4096, group_size=1024)


def check_args(args: Args) -> None:
    """Every bad value or combination, in one message, before anything is loaded or written."""
    v, N = vars(args), args.prompts_per_iter * args.group_size
    counts = ("prompts_per_iter", "n_mc", "mu", "micro_batch", "rollout_batch", "num_steps",
              "n_eval", "iterations", "reward_batch", "resolution", "eval_steps", "save_every",
              "max_sequence_length", "lora_rank", "lora_alpha")
    rates = ("weight_decay", "std_eps", "mae_floor", "clip_eps", "kl_coef", "soft_clip_eta")
    problems = [f"--{k} must be ≥ 1 (got {v[k]})" for k in counts
                if v[k] is not None and v[k] < 1]
    problems += [f"--{k} must be ≤ {INT_CAPS.get(k, 2**31 - 1):,} (got {v[k]})"
                 for k in counts + ("group_size", "eval_every", "keep_checkpoints")
                 if v[k] is not None and v[k] > INT_CAPS.get(k, 2**31 - 1)]
    problems += [f"--{k} must be a finite number > 0 (got {v[k]})"
                 for k in ("lr", "max_grad_norm", "flux_shift")
                 if not (math.isfinite(v[k]) and v[k] > 0)]
    problems += [f"--{k} must be a finite number ≥ 0 (got {v[k]})" for k in rates
                 if not (math.isfinite(v[k]) and v[k] >= 0)]
    checks = [
        (args.group_size < 2, f"--group_size must be ≥ 2 (got {args.group_size}): a "
         "group-relative advantage needs at least two images per prompt"),
        (not args.adv_clamp >= 0, f"--adv_clamp must be ≥ 0 or inf (got {args.adv_clamp})"),
        (args.eval_every < 0, f"--eval_every must be ≥ 0, 0 = never (got {args.eval_every})"),
        (args.keep_checkpoints < 0,
         f"--keep_checkpoints must be ≥ 0, 0 = all (got {args.keep_checkpoints})"),
        (not math.isfinite(args.guidance), f"--guidance must be finite (got {args.guidance})"),
        (args.stratified and args.n_mc > args.num_steps, f"--n_mc {args.n_mc} > --num_steps "
         f"{args.num_steps}: stratification needs one grid point per stratum (or --no-stratified)"),
        (args.resolution % 16, f"--resolution must be a multiple of 16 (got {args.resolution})"),
        (not 0 <= args.seed < 2**31, f"--seed must lie in [0, 2^31) (got {args.seed})"),
        (args.iterations >= MAX_ITERATIONS, f"--iterations must be below {MAX_ITERATIONS} "
         f"(got {args.iterations}): the random streams' seeds stay apart below it"),
        (not 0 <= args.eval_holdout < 1,
         f"--eval_holdout must lie in [0, 1) (got {args.eval_holdout})"),
        (args.mu >= 1 and N % args.mu,
         f"the {N} samples must split into --mu {args.mu} equal minibatches")]
    problems += [msg for failed, msg in checks if failed]
    for check in (lambda: resolve_model(args.model), lambda: args.train_terms,
                  lambda: args.eval_terms):  # the terms are parsed here, once, and kept
        try:
            check()
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))  # each once (eval = train terms)


def banner(run: Run) -> str:
    """The start-up summary, and each value a preset or a flag changed, with its source."""
    a, N = run.args, run.N
    lines = [f"V-GRPO  model={a.model}  reward={a.reward}  device={run.dev}  dtype={run.dtype}"
             f"  processes={run.world}  compiled={run.compiled} ({run.time_compile:.1f} s)",
             f"  {a.prompts_per_iter} prompts × {a.group_size} images = {N} rollouts "
             f"({N // run.world} per process), {a.mu} optimizer step(s) of {N // a.mu}; NFE per "
             f"sample: rollout {a.num_steps}, θ_old {a.n_mc * (a.mu - 1) / a.mu:g}, θ {a.n_mc}",
             f"  run_dir {run.run_dir}"]
    changed = [f.name for f in dataclasses.fields(Args) if getattr(a, f.name) != f.default]
    if changed:
        lines.append("  set by presets or flags (`--help` shows each default and its source):")
        lines += [f"    {k} = {getattr(a, k)!r}  ← {a.origin[k]}" for k in changed]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None, command: Optional[Callable] = None) -> int:
    """The command line; every end but a bug (1, a traceback) is one line: 0 done, 2 bad input
    (nothing written), 69 a reward failed, 130 Ctrl-C; examples/cluster.py's command adds 75."""
    try:
        (command or start)(given_flags(argv))
    except (ConfigError, RunError) as e:
        print(f"{e.label}: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:  # while loading: nothing was written yet
        print("interrupted before the first iteration: nothing written", file=sys.stderr)
        return 130
    return 0


def start(given: dict, trainer: Optional[Callable] = None, fresh_ok: bool = False) -> list:
    """The flags given → `train`. A resumed run keeps its checkpoint's config; flags override."""
    resumed, config = None, None  # read once: the config here, the state in setup
    if given.get("resume"):
        resumed = read_checkpoint(given["resume"])
        config = resumed[1]["config"]
    return (trainer or train)(resolve_args(given, resumed=config), resumed, fresh_ok)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main() says it from here on
    sys.exit(main())
