"""
examples/toy_2d.py — V-GRPO and its ablations on a 2-D toy, on a laptop CPU in ~2 minutes.

    python examples/toy_2d.py                      # 3 seeds × 9 methods, writes examples/toy_2d.{png,md}
    python examples/toy_2d.py --quick              # 1 seed, fewer iterations (~20 s)
    python examples/toy_2d.py --seeds 5 --iters 200 --out runs/toy.png

What it does
    1. Pretrains a small conditional flow-matching model v_θ(x, t, c) on 2-D data: for each of
       4 conditions c, a mixture of 4 Gaussians (std 0.15) on a circle of radius 1.5, rotated by
       c·π/8. Plain rectified-flow loss, a few seconds on a CPU.
    2. Fine-tunes it with RL towards a reward that is maximised ON the data: for condition c a
       Gaussian bump (width 0.3) on ONE of its modes, m_c. The ideal policy moves all mass to
       that mode and keeps the mode's shape.
    3. Compares, with the same rollouts per iteration (P = 8 prompts × G = 16), the same optimizer
       and learning rate, and one optimizer step per iteration (μ = 1; (g): Flow-GRPO's own 2):
         (a) V-GRPO as shipped in vgrpo.py (x-param, adaptive weighting, stratified, batch-shared
             pairs, η = 3, N_MC = 4)
         (b) − group/batch sharing of the (t, ε) pairs          (c) − stratified t
         (d) − adaptive weighting                              (e) v-param   (e') ε-param
         (f) naive FPO-style surrogate (peer X3): plain v-space flow-matching loss, independent
             pairs per sample, no stratification, no advantage soft-clip
         (g) Flow-GRPO, the MDP baseline (peer X1): SDE rollouts, per-step Gaussian log-probs,
             per-step clipped ratio — implemented HERE, because vgrpo.py deliberately has no
             per-step log-probs — at its own published schedule: first 99 % of the steps
             trained, 2 optimizer steps, ε = 1e-4, KL to the pretrained model (β = 0.04)
         (h) the same MDP update at aggressive settings: all steps, μ = 1, no KL
    4. Reports reward after N iterations, iterations / wall time to a reward threshold, distance of
       samples to the nearest data mode (does the policy stay on the data?), and the within-group
       coefficient of variation of the surrogate (paper P8), as a markdown table and a PNG.

Everything V-GRPO-specific is imported from vgrpo.py (sigma_grid, euler_sample, draw_pairs,
Pairs.take, pair_surrogates, group_advantages, vgrpo_loss, surrogate_cv); this file only adds the
toy data, the model, the loop and the Flow-GRPO baseline. Time convention as in vgrpo.py:
x_t = (1 − t)·x0 + t·ε, v = ε − x0, t = 1 is noise, t = 0 is data, ODE solves run t: 1 → 0.

Fast entry point for tests:  run_method(name, seed, iters, ...) -> dict  (see its docstring).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the repo root holds vgrpo.py
import vgrpo as V                                                   # noqa: E402

# ------------------------------------------------------------------------------------------------
# §1  The toy task: conditional 2-D mixtures of Gaussians and an on-manifold reward.
# ------------------------------------------------------------------------------------------------
N_COND = 4            # conditions ("prompts")
N_MODES = 4           # Gaussian modes per condition
RADIUS = 1.5          # modes lie on a circle of this radius ...
MODE_STD = 0.15       # ... each an isotropic Gaussian of this std
REWARD_WIDTH = 0.3    # reward = exp(−‖x − m_c‖² / (2·0.3²))
# Best reward a policy can get while keeping the data's shape: all mass in the target mode,
# x − m_c ~ N(0, 0.15² I) ⇒ E[reward] = w² / (w² + std²) = 0.09 / 0.1125 = 0.8 (2-D Gaussian
# integral). A policy that also shrinks the mode can go up to 1.0.
REWARD_ON_DATA_MAX = REWARD_WIDTH ** 2 / (REWARD_WIDTH ** 2 + MODE_STD ** 2)
THRESHOLD = 0.9 * REWARD_ON_DATA_MAX      # = 0.72, "90 % of the best on-data reward"


def mode_centres() -> torch.Tensor:
    """(N_COND, N_MODES, 2): mode k of condition c at angle c·π/8 + k·π/2 on the circle."""
    c = torch.arange(N_COND, dtype=torch.float32)[:, None]                     # (C, 1)
    k = torch.arange(N_MODES, dtype=torch.float32)[None, :]                    # (1, M)
    ang = c * math.pi / 8 + k * 2 * math.pi / N_MODES                          # (C, M)
    return RADIUS * torch.stack([ang.cos(), ang.sin()], dim=-1)                # (C, M, 2)


MODES = mode_centres()                                                         # (C, M, 2)
TARGET = MODES[torch.arange(N_COND), torch.arange(N_COND) % N_MODES]           # (C, 2) m_c


def sample_data(cond: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Data x0 ~ p(x | c): a uniformly chosen mode of condition c plus N(0, MODE_STD² I). cond (B,) long."""
    k = torch.randint(N_MODES, cond.shape, generator=generator)                # (B,)
    return MODES[cond, k] + MODE_STD * torch.randn(cond.shape + (2,), generator=generator)   # (B, 2)


def reward_fn(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """r(x, c) = exp(−‖x − m_c‖² / (2·REWARD_WIDTH²)) ∈ (0, 1]. x (B, 2), cond (B,) → (B,)."""
    return torch.exp(-(x - TARGET[cond]).square().sum(-1) / (2 * REWARD_WIDTH ** 2))


def dist_to_nearest_mode(x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """‖x − nearest mode of condition c‖ (B,). Data itself gives MODE_STD·√(π/2) ≈ 0.188."""
    return (x[:, None, :] - MODES[cond]).norm(dim=-1).min(dim=1).values


# ------------------------------------------------------------------------------------------------
# §2  The model: an MLP velocity field, and plain flow-matching pretraining.
# ------------------------------------------------------------------------------------------------
class VelocityMLP(nn.Module):
    """v_θ(x, t, c): x (B, 2), t (B,) in [0, 1], c (B,) long → v (B, 2) ≈ ε − x0.

    Inputs: x, Fourier features of t, a learned embedding of c; 3 hidden layers of 128, SiLU.
    """

    def __init__(self, hidden: int = 128, n_freq: int = 8, emb: int = 16):
        super().__init__()
        self.register_buffer("freq", math.pi * 2.0 ** torch.arange(n_freq // 2, dtype=torch.float32))
        self.emb = nn.Embedding(N_COND, emb)
        self.net = nn.Sequential(
            nn.Linear(2 + 1 + n_freq + emb, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        tf = t.float()[:, None] * self.freq                                    # (B, n_freq/2)
        h = torch.cat([x, t.float()[:, None], tf.sin(), tf.cos(), self.emb(c)], dim=-1)   # (B, in)
        return self.net(h)                                                     # (B, 2)


_PRETRAINED: dict = {}          # (seed, steps) → state_dict, so methods of one seed share it


def pretrain(seed: int, steps: int = 1500, batch: int = 256, lr: float = 3e-3) -> dict:
    """Plain conditional flow matching: min E‖v_θ(x_t, t, c) − (ε − x0)‖², t ~ U(0, 1).

    Cached per (seed, steps): every RL method of one seed starts from the SAME weights.
    Returns a state_dict (the caller loads it into a fresh VelocityMLP).
    """
    key = (seed, steps)
    if key not in _PRETRAINED:
        torch.manual_seed(seed)
        model = VelocityMLP()
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        for _ in range(steps):
            c = torch.randint(N_COND, (batch,))                                # (B,)
            x0 = sample_data(c)                                                # (B, 2)
            eps = torch.randn_like(x0)                                         # (B, 2)
            t = torch.rand(batch)                                              # (B,)
            xt = V.interpolate(x0, eps, t)                                     # (B, 2)
            loss = (model(xt, t, c) - (eps - x0)).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        _PRETRAINED[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _PRETRAINED[key]


# ------------------------------------------------------------------------------------------------
# §3  The methods. One dict per method; V-GRPO variants differ only in vgrpo.py switches.
# ------------------------------------------------------------------------------------------------
VGRPO_DEFAULTS = dict(kind="vgrpo", parameterization="x", adaptive=True, stratified=True,
                      pair_sharing="batch", eta=3.0, n_mc=4)
METHODS: dict[str, dict] = {
    "vgrpo":      dict(VGRPO_DEFAULTS, label="(a) V-GRPO (as shipped)"),
    "no_share":   dict(VGRPO_DEFAULTS, label="(b) − pair sharing", pair_sharing="none"),
    "no_strat":   dict(VGRPO_DEFAULTS, label="(c) − stratified t", stratified=False),
    "no_adapt":   dict(VGRPO_DEFAULTS, label="(d) − adaptive weighting", adaptive=False),
    "v_param":    dict(VGRPO_DEFAULTS, label="(e) v-param", parameterization="v"),
    "eps_param":  dict(VGRPO_DEFAULTS, label="(e') ε-param", parameterization="eps"),
    # peer X3: FPO's plain CFM loss, pairs drawn per sample, no stratification, no soft-clip.
    "naive":      dict(VGRPO_DEFAULTS, label="(f) naive FPO-style", parameterization="v", adaptive=False,
                       stratified=False, pair_sharing="none", eta=0.0),
    # peer X1: Flow-GRPO's SDE/MDP formulation (own code below, §5), at its own published
    # schedule (yifan123/flow_grpo config/grpo.py, geneval_sd3 / general_ocr_sd3; train_sd3.py;
    # stat_tracking.py): train the first int(0.99·K) steps, 2 optimizer steps per iteration,
    # per-step clip ε = 1e-4, KL to the pretrained model β = 0.04 (their pickscore config: 0.01),
    # advantages = (r − group mean) / (std of all rewards + 1e-4), clamp ±5.
    "flow_grpo":  dict(kind="flowgrpo", label="(g) Flow-GRPO (its schedule)", noise_level=0.7, clip_eps=1e-4,
                       timestep_fraction=0.99, mu=2, beta=0.04, adv="tracker"),
    # The same MDP update with this file's earlier, aggressive settings: all K steps, μ = 1 (so the
    # clip is inert), no KL, vgrpo.group_advantages (pooled within-group std), no soft-clip.
    "mdp_aggr":   dict(kind="flowgrpo", label="(h) MDP, aggressive", noise_level=0.7, clip_eps=0.2,
                       timestep_fraction=1.0, mu=1, beta=0.0, adv="vgrpo", eta=0.0),
}


# Shared by every method, chosen once before the comparison and not tuned afterwards:
#   P = 8 prompts (each condition twice) × G = 16 samples = 128 rollouts per iteration,
#   K = 16 Euler steps (the FLUX setting of paper P11), μ = 1 optimizer step per iteration
#   (except (g), which takes Flow-GRPO's own 2), AdamW(lr 1e-3, weight decay 1e-4) and
#   grad-norm clip 1.0 as in vgrpo.py, no KL penalty (except (g): Flow-GRPO's β = 0.04).
#   The budget of 150 iterations was set after one 200-iteration look at (a), (f) and the
#   aggressive MDP (h) on seed 0, where (a) had plateaued by iteration ~100.
# With μ = 1 every ratio is exactly 1 at the (only) step, so ratio clipping — V-GRPO's or the
# MDP's per-step clip — is inert; only (g)'s second optimizer step meets its ε = 1e-4.


# ------------------------------------------------------------------------------------------------
# §4  One V-GRPO iteration — Alg. steps 1–5 in order, using vgrpo.py's pure functions.
# ------------------------------------------------------------------------------------------------
def prompt_conditions(P: int, G: int):
    """The P prompts of an iteration (each condition in turn) and the N = P·G per-sample conditions."""
    cond_p = torch.arange(P) % N_COND                                          # (P,)
    return cond_p, cond_p.repeat_interleave(G)                                 # (P,), (N,)


def vgrpo_iteration(model: nn.Module, opt: torch.optim.Optimizer, cfg: dict, *, P: int, G: int, K: int,
                    mu: int, gen: torch.Generator, max_grad_norm: float = 1.0, clip_eps: float = 0.0) -> dict:
    """Rollout → rewards → advantages → shared pairs → S_old → μ optimizer steps. Returns stats."""
    N = P * G
    vel = lambda x, t, c: model(x, t, c)                                       # velocity_fn of vgrpo.py
    sigmas = V.sigma_grid(K)                                                   # (K+1,) 1 → 0
    _, cond = prompt_conditions(P, G)                                          # (N,)

    # [Alg. step 1] rollout by the deterministic ODE of θ_old (= θ now), no grad, no log-probs.
    with torch.no_grad():
        x1 = torch.randn(N, 2, generator=gen)                                  # (N, 2) independent noise
        x0 = V.euler_sample(vel, x1, sigmas, cond)                             # (N, 2) the "actions" o
    r = reward_fn(x0, cond)                                                    # (N,)

    # [Alg. step 2] group-relative advantages (global std, clamp ±5, soft-clip η·tanh(A/η) if η > 0).
    adv, _ = V.group_advantages(r.view(P, G), eta=cfg["eta"])                  # (P, G)
    adv = adv.flatten()                                                        # (N,)

    # [Alg. step 3] N_MC (t, ε) pairs, drawn ONCE per iteration; `index` says who shares them.
    index = {"batch": torch.zeros(N, dtype=torch.long),                        # one set for all (paper code)
             "group": torch.arange(N) // G,                                    # one set per group (paper text)
             "none": torch.arange(N)}[cfg["pair_sharing"]]                     # one set per sample (FPO)
    pairs = V.draw_pairs(sigmas[:-1], cfg["n_mc"], (2,), index,               # grid without t = 0
                         stratified=cfg["stratified"], generator=gen)
    surr = dict(parameterization=cfg["parameterization"], adaptive=cfg["adaptive"])

    # [Alg. step 4] S_old with θ_old, no grad, on the stored pairs.
    with torch.no_grad():
        t_all, eps_all = pairs.take(torch.arange(N))                           # (N, J), (N, J, 2)
        s_old, _ = V.pair_surrogates(vel, x0, cond, t_all, eps_all, **surr)    # (N, J)
    cv = V.surrogate_cv(s_old.mean(dim=1).view(P, G))                          # paper P8 diagnostic

    # [Alg. step 5] μ optimizer steps over disjoint minibatches (μ = 1: the whole batch, ρ ≡ 1).
    perm = torch.randperm(N, generator=gen)
    log_ratio = []
    for rows in perm.chunk(mu):                                                # (m,) each
        t, eps = pairs.take(rows)                                              # (m, J), (m, J, 2)
        s_new, _ = V.pair_surrogates(vel, x0[rows], cond[rows], t, eps, **surr)  # (m, J), grad
        loss, st = V.vgrpo_loss(s_new, s_old[rows], adv[rows], clip_eps=clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        log_ratio.append(st["abs_log_ratio"])
    return {"reward": r.mean().item(), "cv_group": cv["surrogate_cv_group"].item(),
            "cv": cv["surrogate_cv"].item(), "grad_norm": gn.item(),
            "abs_log_ratio_first": log_ratio[0].item(),        # must be ~0: θ = θ_old at step 1
            "finite": bool(torch.isfinite(x0).all())}


# ------------------------------------------------------------------------------------------------
# §5  Flow-GRPO-style MDP baseline (peer X1), written here because V-GRPO needs none of it.
#     Every denoising step is an action with a Gaussian policy; the rollout is an SDE with the
#     same marginals as the ODE; the loss is a per-step clipped ratio times the sample's advantage.
# ------------------------------------------------------------------------------------------------
def sde_step_gaussian(model: nn.Module, x: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                      cond: torch.Tensor, *, noise_level: float, sigma_max: float):
    """Mean and std of the Euler–Maruyama step σ → σ' of Flow-GRPO's reverse SDE.   [peer X1]

        s_t = a·sqrt(σ / (1 − σ))      with σ = 1 replaced by sigma_max (= sigmas[1]) in the denominator
        μ_θ = x·(1 + s_t²·Δ/(2σ)) + v_θ·(1 + s_t²·(1 − σ)/(2σ))·Δ,   Δ = σ' − σ < 0
        std = s_t·sqrt(−Δ)
    Args: x (B, 2); sigma, sigma_next (B,) float; cond (B,) long.
    Returns: mean (B, 2), std (B, 1).
    """
    s, dt = sigma[:, None], (sigma_next - sigma)[:, None]                      # (B, 1), (B, 1)
    s_t = noise_level * torch.sqrt(s / (1 - torch.where(s == 1, torch.full_like(s, sigma_max), s)))
    v = model(x, sigma, cond)                                                  # (B, 2)
    mean = x * (1 + s_t ** 2 / (2 * s) * dt) + v * (1 + s_t ** 2 * (1 - s) / (2 * s)) * dt
    return mean, s_t * torch.sqrt(-dt)


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x_next; mean, std² I), MEAN over the 2 elements as in Flow-GRPO's code. Returns (B,)."""
    lp = -(x_next.detach() - mean).square() / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=-1)


def tracker_advantages(r: torch.Tensor, P: int, G: int) -> torch.Tensor:
    """Flow-GRPO's PerPromptStatTracker(global_std=True) (flow_grpo/stat_tracking.py): (r − mean of
    the prompt's group) / (population std of ALL N rewards + 1e-4), then clamp ±5 (train_sd3.py).
    r (N,) → (N,). (Its zero-advantage filter is not needed here: the reward is continuous.)"""
    g = r.view(P, G)
    return ((g - g.mean(dim=1, keepdim=True)) / (r.std(unbiased=False) + 1e-4)).clamp(-5, 5).flatten()


def flowgrpo_iteration(model: nn.Module, opt: torch.optim.Optimizer, cfg: dict, *, P: int, G: int, K: int,
                       mu: int, gen: torch.Generator, max_grad_norm: float = 1.0,
                       ref: Optional[nn.Module] = None) -> dict:
    """SDE rollout with per-step log-probs → rewards → advantages → per-step clipped ratio loss
    (+ β·KL to the frozen reference `ref` if cfg["beta"] > 0) on the first T = int(K·fraction) steps."""
    N = P * G
    sigmas = V.sigma_grid(K).float()                                           # (K+1,)
    _, cond = prompt_conditions(P, G)                                          # (N,)
    step_kw = dict(noise_level=cfg["noise_level"], sigma_max=float(sigmas[1]))
    T = max(1, int(K * cfg["timestep_fraction"]))                              # trained steps 0 … T−1

    # Rollout: x_{k+1} = μ_θ(x_k) + std_k·ξ, storing the trajectory and log p_old(x_{k+1} | x_k).
    traj = [torch.randn(N, 2, generator=gen)]                                  # x_0 at t = 1
    logp_old = []
    with torch.no_grad():
        for k in range(K):
            sk, sk1 = sigmas[k].expand(N), sigmas[k + 1].expand(N)             # (N,), (N,)
            mean, std = sde_step_gaussian(model, traj[-1], sk, sk1, cond, **step_kw)
            x_next = mean + std * torch.randn(N, 2, generator=gen)             # (N, 2)
            logp_old.append(gaussian_logprob(x_next, mean, std))               # (N,)
            traj.append(x_next)
    traj = torch.stack(traj)                                                   # (K+1, N, 2)
    logp_old = torch.stack(logp_old)                                           # (K, N)
    r = reward_fn(traj[-1], cond)                                              # (N,) reward of the SDE sample

    if cfg["adv"] == "tracker":
        adv = tracker_advantages(r, P, G)                                      # (N,)
    else:
        adv = V.group_advantages(r.view(P, G), eta=cfg["eta"])[0].flatten()    # η = 0: clamp ±5 only

    # Training: the T trained steps of a minibatch in one batched forward (T·m rows); one loss
    # term per step, averaged over steps and samples (Flow-GRPO accumulates the per-step
    # gradients the same way), μ minibatches → μ optimizer steps.
    perm = torch.randperm(N, generator=gen)
    sig_k = sigmas[:T, None].expand(T, N)                                      # (T, N)
    sig_k1 = sigmas[1:T + 1, None].expand(T, N)                                # (T, N)
    eps_clip, beta = cfg["clip_eps"], cfg.get("beta", 0.0)
    first_logr, clipped = None, []
    for rows in perm.chunk(mu):                                                # (m,) each
        m = len(rows)
        x_k = traj[:T, rows].reshape(T * m, 2)                                 # (T·m, 2)
        x_k1 = traj[1:T + 1, rows].reshape(T * m, 2)                           # (T·m, 2)
        step_args = (x_k, sig_k[:, rows].reshape(-1), sig_k1[:, rows].reshape(-1), cond[rows].repeat(T))
        mean, std = sde_step_gaussian(model, *step_args, **step_kw)
        logp = gaussian_logprob(x_k1, mean, std).view(T, m)                    # (T, m)
        logr = logp - logp_old[:T, rows]
        ratio = torch.exp(logr)                                                # (T, m) per-step ratio
        a = adv[rows][None, :]                                                 # (1, m)
        pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps_clip, 1 + eps_clip))   # (T, m)
        loss = pg.mean()
        if beta > 0:
            # train_sd3.py: mean_elements (μ_θ − μ_ref)² / (2·std_dev_t²), std_dev_t = a·sqrt(σ/(1−σ))
            with torch.no_grad():
                mean_ref, _ = sde_step_gaussian(ref, *step_args, **step_kw)
            s_t = std / torch.sqrt(step_args[1] - step_args[2])[:, None]      # (T·m, 1)
            loss = loss + beta * ((mean - mean_ref).square().mean(dim=-1, keepdim=True) / (2 * s_t ** 2)).mean()
        if first_logr is None:
            first_logr = logr.detach().abs().max().item()                      # θ = θ_old: ≈ 0
        clipped.append(((ratio.detach() - 1).abs() > eps_clip).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
    return {"reward": r.mean().item(), "cv_group": float("nan"), "cv": float("nan"),
            "grad_norm": gn.item(), "abs_log_ratio_first": first_logr, "clip_frac": sum(clipped) / len(clipped),
            "finite": bool(torch.isfinite(traj).all())}


# ------------------------------------------------------------------------------------------------
# §6  One run of one method: pretrained model → `iters` RL iterations, evaluated on fixed noise.
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: nn.Module, x1: torch.Tensor, cond: torch.Tensor, K: int):
    """Deterministic ODE samples from fixed noise (the same sampler for EVERY method, including
    Flow-GRPO, whose policy is trained through SDE rollouts). Returns (samples, reward, dist)."""
    x0 = V.euler_sample(lambda x, t, c: model(x, t, c), x1, V.sigma_grid(K), cond)   # (E, 2)
    return x0, reward_fn(x0, cond).mean().item(), dist_to_nearest_mode(x0, cond).mean().item()


DIVERGED_DIST = 1.0     # mean distance to the nearest mode above this (modes sit 1.5 from the origin,
                        # 2.1 from each other): the samples have left the data — counted as diverged
CV_ITERS = 20           # surrogate CV is averaged over the first 20 iterations, while every method's
                        # model is still close to the pretrained one (a like-for-like comparison)


def run_method(name: str, seed: int, iters: int, *, P: int = 8, G: int = 16, K: int = 16,
               lr: float = 1e-3, mu: int = 1, eval_every: int = 5, n_eval: int = 256,
               pretrain_steps: int = 1500) -> dict:
    """Fine-tune the seed's pretrained model with method `name` (a key of METHODS) for `iters`
    iterations of P·G rollouts each. Deterministic for a given seed on a given machine.

    Returns a dict:
        curve_iters, curve: eval reward (ODE, n_eval fixed noises per condition) at iteration 0 and
            every eval_every iterations (and at `iters`); 0 after a non-finite divergence;
        rollout_reward: mean rollout reward per iteration (SDE rollouts for Flow-GRPO);
        start_reward, final_reward, peak_reward (max of curve), final_dist (mean distance of the
            final samples to the nearest mode of their condition);
        iters_to_threshold, time_to_threshold: first eval with reward ≥ THRESHOLD, and the training
            seconds (rollouts + updates, no evaluation) spent until then; None if never;
        diverged: non-finite samples/weights, or final_dist > DIVERGED_DIST;
        cv_group: mean within-group surrogate CV over the first CV_ITERS iterations (nan for Flow-GRPO);
        train_time, iters_done, samples (final ODE samples (E, 2)), cond (E,).
    """
    cfg = METHODS[name]
    mu = cfg.get("mu", mu)                                  # (g) takes Flow-GRPO's own 2 steps
    model = VelocityMLP()
    model.load_state_dict(pretrain(seed, pretrain_steps))
    kw = {}
    if cfg.get("beta", 0.0) > 0:                            # frozen reference for the KL term
        kw["ref"] = VelocityMLP()
        kw["ref"].load_state_dict(pretrain(seed, pretrain_steps))
        kw["ref"].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)                         # rollouts and pairs
    g_eval = torch.Generator().manual_seed(20_000 + seed)                      # fixed evaluation noise
    cond_e = torch.arange(N_COND).repeat_interleave(n_eval)                    # (E,)
    x1_e = torch.randn(len(cond_e), 2, generator=g_eval)                       # (E, 2)
    eval_at = sorted(set(range(eval_every, iters + 1, eval_every)) | {iters})

    _, r0, _ = evaluate(model, x1_e, cond_e, K)
    out = dict(name=name, seed=seed, curve_iters=[0], curve=[r0], rollout_reward=[], start_reward=r0,
               iters_to_threshold=None, time_to_threshold=None, diverged=False)
    cvs = []
    step = vgrpo_iteration if cfg["kind"] == "vgrpo" else flowgrpo_iteration
    train_time, it = 0.0, 0
    for it in range(1, iters + 1):
        t0 = time.perf_counter()
        st = step(model, opt, cfg, P=P, G=G, K=K, mu=mu, gen=gen, **kw)
        train_time += time.perf_counter() - t0
        if not st["finite"] or not all(torch.isfinite(p).all() for p in model.parameters()):
            out["diverged"] = True                          # nothing left to train: stop, pad the curve
            rest = [i for i in eval_at if i >= it]
            out["curve_iters"] += rest
            out["curve"] += [0.0] * len(rest)
            break
        out["rollout_reward"].append(st["reward"])
        if it <= CV_ITERS:
            cvs.append(st["cv_group"])
        if it in eval_at:
            _, r, _ = evaluate(model, x1_e, cond_e, K)
            out["curve_iters"].append(it)
            out["curve"].append(r)
            if out["iters_to_threshold"] is None and r >= THRESHOLD:
                out["iters_to_threshold"], out["time_to_threshold"] = it, train_time
    x0, r, d = evaluate(model, x1_e, cond_e, K)
    finite = math.isfinite(r) and math.isfinite(d)
    out["diverged"] = out["diverged"] or not finite or d > DIVERGED_DIST
    out.update(final_reward=r if finite else 0.0,       # a non-finite sample earns nothing
               final_dist=d if finite else float("inf"), peak_reward=max(out["curve"]),
               samples=x0, cond=cond_e, train_time=train_time, iters_done=it,
               cv_group=sum(cvs) / len(cvs) if cvs else float("nan"))
    return out


def pretrained_reference(seed: int, K: int = 16, n_eval: int = 256, pretrain_steps: int = 1500) -> dict:
    """Reward / mode distance of the pretrained model and of the data itself (table reference rows)."""
    model = VelocityMLP()
    model.load_state_dict(pretrain(seed, pretrain_steps))
    g = torch.Generator().manual_seed(20_000 + seed)
    cond = torch.arange(N_COND).repeat_interleave(n_eval)                      # (E,)
    x0, r, d = evaluate(model, torch.randn(len(cond), 2, generator=g), cond, K)
    xd = sample_data(cond, g)                                                  # (E, 2)
    return dict(samples=x0, cond=cond, reward=r, dist=d, data=xd,
                data_reward=reward_fn(xd, cond).mean().item(), data_dist=dist_to_nearest_mode(xd, cond).mean().item())


# ------------------------------------------------------------------------------------------------
# §7  Reporting: markdown table and a PNG drawn with Pillow (no matplotlib dependency).
# ------------------------------------------------------------------------------------------------
def _ms(xs: list, fmt: str = "{:.3f}") -> str:
    """'mean ± std' (population std) of the finite values, '—' if none."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "—"
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    return (fmt + " ± " + fmt).format(m, s)


def make_table(results: dict, refs: list, iters: int) -> str:
    n_seeds = len(refs)
    T = f"{THRESHOLD:.2f}"
    head = (f"| method | reward @ it {iters} | per seed | peak reward | iters to ≥ {T} (reached) | train s to ≥ {T} "
            f"| diverged | dist. to nearest mode (non-diverged) | within-group surrogate CV (it 1–{CV_ITERS}) "
            f"| train s / iter |\n" + "|---" * 10 + "|\n")
    rows = [f"| data (reference) | {_ms([r['data_reward'] for r in refs])} | — | — | — | — | — | "
            f"{_ms([r['data_dist'] for r in refs])} | — | — |",
            f"| pretrained model | {_ms([r['reward'] for r in refs])} | — | — | — | — | — | "
            f"{_ms([r['dist'] for r in refs])} | — | — |"]
    for name, runs in results.items():
        hit = [r for r in runs if r["iters_to_threshold"] is not None]
        ok = [r for r in runs if not r["diverged"]]
        its = (_ms([r["iters_to_threshold"] for r in hit], "{:.0f}") if hit else "never") + f" ({len(hit)}/{n_seeds})"
        secs = _ms([r["time_to_threshold"] for r in hit], "{:.1f}") if hit else "—"
        cv = _ms([r["cv_group"] for r in runs], "{:.3f}") if METHODS[name]["kind"] == "vgrpo" else "n/a (no surrogate)"
        spi = _ms([r["train_time"] / max(r["iters_done"], 1) for r in runs], "{:.3f}")
        per_seed = " / ".join(f"{r['final_reward']:.2f}" for r in runs)
        rows.append(f"| {METHODS[name]['label']} | {_ms([r['final_reward'] for r in runs])} | {per_seed} "
                    f"| {_ms([r['peak_reward'] for r in runs])} | {its} | {secs} | {len(runs) - len(ok)}/{n_seeds} "
                    f"| {_ms([r['final_dist'] for r in ok])} | {cv} | {spi} |")
    return head + "\n".join(rows) + "\n"


COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (90, 90, 90), (188, 189, 34)]
COND_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def _font(size: int):
    """DejaVu Sans if Pillow finds it (it has −, ε, ×), else Pillow's built-in font."""
    from PIL import ImageFont
    try:
        return ImageFont.truetype("DejaVuSans.ttf", size)
    except OSError:
        try:
            return ImageFont.load_default(size=size)        # Pillow ≥ 10.1: scalable, ASCII only
        except TypeError:
            return ImageFont.load_default()


def _txt(s: str, font) -> str:
    """Keep labels printable with the ASCII-only fallback font."""
    if "DejaVu" in str(getattr(font, "path", "")):
        return s
    return s.replace("−", "w/o").replace("ε", "eps").replace("×", "x").replace("…", "...").replace("≥", ">=")


def save_png(path: Path, results: dict, refs: list, iters: int) -> None:
    """Left: eval reward vs iteration (mean over seeds) per method. Right: final samples (seed 0)."""
    from PIL import Image, ImageDraw
    W, H = 1680, 900
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    f12, f14, f18 = _font(12), _font(14), _font(18)

    # ---- reward curves --------------------------------------------------------------------------
    x0, y0, pw, ph = 80, 60, 640, 560                        # plot box (left, top, width, height)
    d.text((x0, 20), f"eval reward (ODE, fixed noise) vs iteration, mean over {len(refs)} seed(s)", fill="black", font=f18)
    d.rectangle([x0, y0, x0 + pw, y0 + ph], outline="black")
    X = lambda i: x0 + pw * i / max(iters, 1)
    Y = lambda r: y0 + ph * (1 - r)                          # reward axis 0 … 1
    for v in [0, 0.2, 0.4, 0.6, 0.8, 1.0]:
        d.line([x0 - 5, Y(v), x0, Y(v)], fill="black")
        d.text((x0 - 40, Y(v) - 7), f"{v:.1f}", fill="black", font=f12)
    for i in range(0, iters + 1, max(iters // 5, 1)):
        d.line([X(i), y0 + ph, X(i), y0 + ph + 5], fill="black")
        d.text((X(i) - 10, y0 + ph + 8), str(i), fill="black", font=f12)
    d.text((x0 + pw / 2 - 30, y0 + ph + 26), "iteration", fill="black", font=f14)
    for xx in range(x0, x0 + pw, 12):                        # dashed threshold line
        d.line([xx, Y(THRESHOLD), min(xx + 6, x0 + pw), Y(THRESHOLD)], fill=(120, 120, 120))
    d.text((x0 + pw - 100, Y(THRESHOLD) + 4), f"threshold {THRESHOLD:.2f}", fill=(120, 120, 120), font=f12)
    for ci, (name, runs) in enumerate(results.items()):
        col = COLORS[ci % len(COLORS)]
        its = runs[0]["curve_iters"]
        n = min(len(r["curve"]) for r in runs)
        mean = [sum(r["curve"][k] for r in runs) / len(runs) for k in range(n)]
        d.line([(X(its[k]), Y(max(0.0, min(1.0, mean[k])))) for k in range(n)], fill=col, width=3)
        ly = y0 + ph + 55 + 20 * (ci // 2)                   # legend below the plot, two columns
        lx = x0 + 330 * (ci % 2)
        d.rectangle([lx, ly + 2, lx + 20, ly + 14], fill=col)
        d.text((lx + 26, ly), _txt(METHODS[name]["label"], f14), fill="black", font=f14)

    # ---- final samples, seed 0: pretrained + each method ---------------------------------------
    panels = [("pretrained", refs[0]["samples"], refs[0]["cond"], False, refs[0]["reward"], refs[0]["dist"])] + \
             [(METHODS[n]["label"], runs[0]["samples"], runs[0]["cond"], runs[0]["diverged"],
               runs[0]["final_reward"], runs[0]["final_dist"]) for n, runs in results.items()]
    cols, size, gap, left, top = 4, 205, 12, 780, 40
    lim = RADIUS + 0.8
    for pi, (title, xs, cs, diverged, rew, dist) in enumerate(panels):
        px, py = left + (pi % cols) * (size + gap), top + (pi // cols) * (size + gap + 6)
        d.rectangle([px, py, px + size, py + size], outline="black")
        d.text((px + 4, py + 3), _txt(title, f12), fill="black", font=f12)
        P = lambda p: (px + size * (p[0] + lim) / (2 * lim), py + size * (1 - (p[1] + lim) / (2 * lim)))
        for c in range(N_COND):
            for m in MODES[c]:                                # data modes: small grey circles
                u, v = P(m.tolist())
                d.ellipse([u - 4, v - 4, u + 4, v + 4], outline=(200, 200, 200))
            u, v = P(TARGET[c].tolist())                      # rewarded mode: circle of radius 0.3
            rr = size * REWARD_WIDTH / (2 * lim)
            d.ellipse([u - rr, v - rr, u + rr, v + rr], outline="black")
        for p, c in zip(xs.tolist(), cs.tolist()):            # samples on top
            if all(math.isfinite(q) for q in p) and abs(p[0]) < lim and abs(p[1]) < lim:
                u, v = P(p)
                d.point([(u, v), (u + 1, v), (u, v + 1)], fill=COND_COLORS[c])
        if diverged:
            d.text((px + 8, py + size / 2 - 16), "diverged\n(samples off the plot)", fill=(200, 0, 0),
                   font=f12)
        d.text((px + 4, py + size - 16), f"reward {rew:.2f}, dist. to mode {dist:.3g}", fill="black", font=f12)
    d.text((left, H - 30), _txt("final ODE samples, seed 0; colour = condition c; black circle: rewarded "
                                "mode m_c (radius 0.3); grey: data modes", f14), fill="black", font=f14)
    img.save(path)


# ------------------------------------------------------------------------------------------------
# §8  main
# ------------------------------------------------------------------------------------------------
def main(argv: Optional[list] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seeds", type=int, default=None, help="number of seeds 0, 1, … (default 3; 1 with --quick)")
    p.add_argument("--iters", type=int, default=None, help="RL iterations per run (default 150; 40 with --quick)")
    p.add_argument("--out", default=str(Path(__file__).with_name("toy_2d.png")), help="PNG path; the table goes to .md")
    p.add_argument("--quick", action="store_true", help="1 seed (unless --seeds is given) and 40 iterations")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, the same for every method")
    a = p.parse_args(argv)
    iters = a.iters or (40 if a.quick else 150)
    seeds = a.seeds or (1 if a.quick else 3)
    pre_steps = 1500
    eval_every = 5
    # Tiny MLP, batches of ≤ 2048 rows: one thread is as fast as two and, unlike two, does not
    # collapse when another process shares the CPU (OpenMP threads then wait on each other).
    torch.set_num_threads(1)

    t_start = time.perf_counter()
    refs, results = [], {n: [] for n in a.methods.split(",")}
    for seed in range(seeds):
        t0 = time.perf_counter()
        pretrain(seed, pre_steps)
        refs.append(pretrained_reference(seed, pretrain_steps=pre_steps))
        print(f"seed {seed}: pretrained in {time.perf_counter() - t0:.1f} s, reward {refs[-1]['reward']:.3f}, "
              f"dist to mode {refs[-1]['dist']:.3f} (data {refs[-1]['data_dist']:.3f})", flush=True)
        for name in results:
            r = run_method(name, seed, iters, lr=a.lr, eval_every=eval_every, pretrain_steps=pre_steps)
            results[name].append(r)
            print(f"  {METHODS[name]['label']:<28} reward {r['start_reward']:.3f} → {r['final_reward']:.3f} "
                  f"(peak {r['peak_reward']:.3f})  threshold at it {r['iters_to_threshold']}  "
                  f"dist {r['final_dist']:.3g}{'  DIVERGED' if r['diverged'] else ''}  "
                  f"cv_group {r['cv_group']:.3f}  {r['train_time']:.1f} s", flush=True)

    table = make_table(results, refs, iters)
    notes = (f"\nSetup: {N_COND} conditions × {N_MODES} modes (std {MODE_STD}), reward width {REWARD_WIDTH}; "
             f"P = 8 prompts × G = 16 = 128 rollouts / iteration, K = 16 Euler steps, μ = 1 (except (g): 2), AdamW lr {a.lr} "
             f"(the same for all methods), grad clip 1.0, {iters} iterations, seeds 0…{seeds - 1}, each seed "
             f"its own pretrained model ({pre_steps} flow-matching steps) shared by all methods.\n"
             f"Reward threshold {THRESHOLD:.2f} = 0.9 × {REWARD_ON_DATA_MAX:.2f}, the best mean reward reachable "
             f"while keeping the data's mode shape (a policy that also shrinks the mode can reach 1.0); checked "
             f"every {eval_every} iterations. Rewards and distances come from deterministic ODE samples of fixed "
             f"noise ({N_COND} × 256 per seed) for every method, the MDP rows included (they train on SDE "
             f"rollouts, noise level 0.7). Distance to the nearest mode: data ≈ 0.19; much smaller = the rewarded mode "
             f"shrank towards a point, much larger = samples off the data. Diverged = non-finite samples "
             f"(reward counted as 0) or mean distance > {DIVERGED_DIST}. Surrogate CV = std/|mean| of S_old "
             f"within each group (vgrpo.surrogate_cv), averaged over groups and iterations 1–{CV_ITERS}. "
             f"With μ = 1 every ratio is 1 at the only step, so ratio clipping is inert. (g) is Flow-GRPO at "
             f"its own published schedule (yifan123/flow_grpo config/grpo.py geneval_sd3, train_sd3.py, "
             f"stat_tracking.py): the first int(0.99·16) = 15 steps trained, 2 optimizer steps per iteration, "
             f"per-step clip ε = 1e-4, KL to the pretrained model with β = 0.04, advantages over the std of "
             f"all rewards; (h) is the same MDP update at this file's earlier, aggressive settings (all 16 "
             f"steps, μ = 1, no KL). No other method uses a KL term. Total wall time "
             f"{time.perf_counter() - t_start:.0f} s.\n")
    print("\n" + table + notes)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + notes)
    save_png(out, results, refs, iters)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    main()
