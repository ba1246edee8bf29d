"""
vgrpo.py — V-GRPO in one file: online RL for flow-matching image models, where the
model's own (variance-reduced) flow-matching loss stands in for log π_θ(image | prompt).

Paper: "V-GRPO: Online Reinforcement Learning for Denoising Generative Models Is Easier than
You Think", Tang et al., 2026, arXiv 2604.23380. Equation numbers of the paper are not quoted
here (the full text was not available to us); tags such as [PAPER §1.4] point into the
project's method spec PAPER.md, whose sections carry the sources ([CY], [VRL], ...).

What this file IS: a readable reference of the algorithm plus a working single-GPU trainer for
Stable Diffusion 3 / 3.5 (diffusers) with a PickScore or JPEG reward, and an offline tiny model
so everything runs on a laptop CPU. What it is NOT: a framework. Multi-GPU, FLUX and further
rewards are deliberately kept out of the core math so the loss can be copied into any trainer.

Quickstart
    pip install -r requirements.txt
    python vgrpo.py --model tiny --reward jpeg                 # CPU, offline, ~2 min
    python vgrpo.py --model sd3.5-medium --reward pickscore    # one CUDA GPU, hub weights

ALGORITHM (one iteration; "→ §k" points into this file)            [PAPER §4]
    0. θ_old ← θ  (nothing to copy: everything θ_old is needed for is cached in steps 1 and 4)
    1. rollout: for each of P prompts, G images by a deterministic ODE solve of v_θold  → §4, §9
    2. rewards r (N = P·G), group-relative advantages A, clamp ±5, soft-clip η·tanh(A/η) → §5, §6
    3. draw N_MC stratified (t, ε) pairs, shared across the batch (or per group)        → §7
    4. S_old[n] = mean_j s_θold(o_n; t_j, ε_j), s = −MSE_x / sg(MAE_x)   (no grad)      → §7
    5. μ optimizer steps over disjoint minibatches:
          ρ_n = exp(S_θ[n] − S_old[n]);  loss = mean_n max(−A ρ, −A clip(ρ, 1±ε)) + β KL_x → §8
    Rollouts carry no per-step log-probs: the whole generation is one atomic action.

NOTATION
    code name     paper          shape            meaning
    P             —              int              prompts per iteration
    G             G              int              group size (images per prompt)
    N             —              int              P·G samples per iteration
    J / n_mc      N_MC           int              (t, ε) pairs per sample
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
    * Math functions (§3–§8) are pure: tensors in, tensors out, no globals, no .item().

CONTENTS
    §1  imports                      §6  group-relative advantages
    §2  configuration (Args, CLI)    §7  shared stratified pairs + ELBO surrogate
    §3  flow-matching math           §8  GRPO loss and diagnostics
    §4  ODE samplers                 §9  models: loading, tiny SD3, LoRA, adapter
    §5  rewards                      §10 training loop, checkpoints, main()
"""

# ------------------------------------------------------------------------------------------------
# §1  Imports. Heavy libraries (diffusers, transformers, peft) are imported inside the functions
#     that need them, so `import vgrpo` is fast and the math core works with torch alone.
# ------------------------------------------------------------------------------------------------
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# §2  Configuration. One dataclass is the single source of truth: every field is a CLI flag of
#     the same name, and its `src` says where the default comes from ([PAPER §x] or "our choice").
#     Resolution order: explicit flag > --preset > per-model preset (MODEL_PRESETS) > default.
# ------------------------------------------------------------------------------------------------
def _f(default, help: str, src: str = "our choice", choices=None):
    return field(default=default, metadata=dict(help=help, src=src, choices=choices))


@dataclass
class Args:
    # --- io --------------------------------------------------------------------------------------
    run_dir: Optional[str] = _f(None, "output folder (default runs/<model>-<reward>-<date>)")
    prompts: Optional[str] = _f(None, "training prompts, one per line (default: built-in list)")
    eval_prompts: Optional[str] = _f(None, "held-out prompts (default: split off --prompts)")
    eval_holdout: float = _f(0.1, "fraction of --prompts held out for evaluation if no --eval_prompts")
    resume: Optional[str] = _f(None, "checkpoint folder, or a run folder (takes its latest checkpoint)")
    save_every: int = _f(10, "checkpoint every k iterations (and at the end / on Ctrl-C)")
    eval_every: int = _f(10, "evaluate on held-out prompts every k iterations (0 = never)")
    n_eval: int = _f(16, "held-out prompts per evaluation (one image each, fixed noise)")
    # --- model -----------------------------------------------------------------------------------
    model: str = _f("sd3.5-medium", "alias (tiny, sd3.5-medium, sd3.5-large, sd3-medium), hub id or local dir")
    resolution: int = _f(512, "image side in pixels", "[PAPER §3 item 7] DiffusionNFT's 512")
    max_sequence_length: int = _f(128, "T5 tokens per prompt", "Flow-GRPO/DiffusionNFT [FACTS (d)]")
    lora_rank: int = _f(32, "LoRA rank r", "[PAPER §1.7] SD3.5-M Stage 1")
    lora_alpha: int = _f(64, "LoRA alpha", "[PAPER §1.7] SD3.5-M Stage 1")
    lora_targets: str = _f("to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out",
                           "comma-separated module names that get LoRA (attn and attn2)", "[PAPER §7]")
    full_finetune: bool = _f(False, "train all transformer weights instead of LoRA")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward (less memory)")
    dtype: str = _f("auto", "compute dtype; auto = bf16 on CUDA, fp32 on CPU", "[PAPER §3 item 10]",
                    choices=("auto", "bf16", "fp16", "fp32"))
    # --- sampler ---------------------------------------------------------------------------------
    num_steps: int = _f(40, "ODE steps per rollout (K)", "[PAPER §1.7] 40-step ODE rollouts")
    solver: str = _f("euler", "deterministic ODE solver for rollouts and eval", "[PAPER §1.1, §7]",
                     choices=("euler", "dpmpp2m"))
    eval_steps: Optional[int] = _f(None, "ODE steps for evaluation (default 2 × num_steps)")
    rollout_batch: int = _f(16, "samples per batched ODE solve (memory knob, no effect on results)")
    # --- reward ----------------------------------------------------------------------------------
    reward: str = _f("pickscore", "reward model", choices=("pickscore", "jpeg"))
    pickscore_model: str = _f("yuvalkirstain/PickScore_v1", "PickScore weights: hub id or local dir",
                              "[FACTS (e)]")
    pickscore_processor: str = _f("laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
                                  "PickScore processor: hub id or local dir", "[FACTS (e)]")
    reward_batch: int = _f(32, "images per reward-model call (memory knob)")
    # --- objective -------------------------------------------------------------------------------
    prompts_per_iter: int = _f(6, "P: prompts per iteration (paper: 48; 6 = one GPU's share of 8)")
    group_size: int = _f(24, "G: images per prompt", "[PAPER §1.7] group 24")
    n_mc: int = _f(4, "N_MC: (t, eps) pairs per sample", "[PAPER §1.7] N_MC = 4")
    pair_sharing: str = _f("batch", "scope of shared (t, eps) pairs", "[PAPER §1.4, §3 item 4]",
                           choices=("batch", "group", "none"))
    stratified: bool = _f(True, "one t per stratum of the rollout sigma grid", "[PAPER §1.4 (2)]")
    parameterization: str = _f("x", "space of the surrogate's error", "[PAPER §1.4 (3a), §1.8]",
                               choices=("x", "v", "eps"))
    adaptive_weighting: bool = _f(True, "divide each pair's MSE by its detached MAE", "[PAPER §1.4 (3b)]")
    mae_floor: float = _f(1e-5, "lower clamp of the MAE denominator", "[PAPER §3 item 5]")
    global_std: bool = _f(True, "advantage std over the whole batch (else per group)", "[PAPER §3 item 3]")
    std_eps: float = _f(1e-4, "added to the advantage std", "[PAPER §3 item 3] DiffusionNFT")
    adv_clamp: float = _f(5.0, "hard clamp |A| ≤ this before soft-clip", "[PAPER §3 item 1]")
    soft_clip_eta: float = _f(3.0, "η of A ← η·tanh(A/η); 0 = off", "[PAPER §1.5] η = 3, SD3.5 Stage 1")
    clip_eps: float = _f(0.0, "ratio clip ε; 0 = off", "[PAPER §1.5] SD3.5 Stage 1: no clip")
    kl_coef: float = _f(0.0, "β of the x-space KL to θ_old; 0 = off", "[PAPER §1.5] Stage 1: no KL")
    mu: int = _f(1, "optimizer steps per iteration (disjoint minibatches)", "[PAPER §1.7] 1 step")
    micro_batch: int = _f(4, "samples per forward/backward (× n_mc forwards; memory knob)")
    # --- optimisation ----------------------------------------------------------------------------
    iterations: int = _f(150, "rollout-and-update iterations", "[PAPER §1.7] Stage 1: 150")
    lr: float = _f(3e-4, "AdamW learning rate", "[PAPER §1.7]")
    weight_decay: float = _f(1e-4, "AdamW weight decay", "[PAPER §3 item 10]")
    max_grad_norm: float = _f(1.0, "gradient-norm clip", "[PAPER §3 item 10]")
    # --- system ----------------------------------------------------------------------------------
    seed: int = _f(0, "seed of every random stream (prompts, noise, pairs, LoRA init)")
    device: str = _f("auto", "cuda, cpu, or auto")
    preset: Optional[str] = _f(None, "bundle of overrides", choices=("paper", "smoke"))


# Per-model defaults. "tiny" is sized so `--model tiny --reward jpeg` learns visibly in ~2 CPU
# minutes; its numbers are our choice, measured on a 2-core machine (README "Quickstart").
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(resolution=64, num_steps=8, max_sequence_length=32, prompts_per_iter=4, group_size=8,
                 lora_rank=8, lora_alpha=16, lr=1e-2, iterations=30, micro_batch=32, rollout_batch=32,
                 eval_every=10, save_every=10, n_eval=8),
    "sd3.5-medium": dict(gradient_checkpointing=True),
    "sd3.5-large": dict(gradient_checkpointing=True),
    "sd3-medium": dict(gradient_checkpointing=True),
}
PRESETS: dict[str, dict] = {
    "paper": dict(prompts_per_iter=48, group_size=24),          # [PAPER §1.7] 48 × 24 = 1,152 images
    "smoke": dict(iterations=2, prompts_per_iter=2, group_size=4, eval_every=1, save_every=1, n_eval=2),
}


def parse_args(argv: Optional[list[str]] = None) -> Args:
    """CLI → Args. Flag name == field name; bools get --name / --no-name."""
    p = argparse.ArgumentParser(description="V-GRPO for flow-matching image models (arXiv 2604.23380)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Args):
        kw = dict(default=argparse.SUPPRESS, help=f"{f.metadata['help']} [default {f.default!r}; "
                                                   f"{f.metadata['src']}]")
        if f.type in ("bool", bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            base = str(f.type).replace("Optional[", "").rstrip("]")
            kw["type"] = {"int": int, "float": float, "str": str}[base]
            if f.metadata["choices"]:
                kw["choices"] = f.metadata["choices"]
        p.add_argument(f"--{f.name}", **kw)
    given = vars(p.parse_args(argv))
    return resolve_args(given)


def resolve_args(given: dict) -> Args:
    """Apply per-model and named presets under the explicitly given values; validate."""
    model = given.get("model", Args.model)
    values = dict(MODEL_PRESETS.get(model, {}))
    if given.get("preset"):
        values.update(PRESETS[given["preset"]])
    values.update(given)
    names = {f.name for f in dataclasses.fields(Args)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown option(s): {sorted(unknown)}")
    args = Args(**values)
    check_args(args)
    return args


def check_args(a: Args) -> None:
    """One clear message per bad combination, before anything is loaded or written."""
    problems = []
    if a.group_size < 2:
        problems.append(f"--group_size must be ≥ 2 (got {a.group_size}): a group-relative advantage "
                        "needs at least two images per prompt")
    for name in ("prompts_per_iter", "n_mc", "mu", "micro_batch", "rollout_batch", "num_steps",
                 "iterations", "reward_batch", "resolution"):
        if getattr(a, name) < 1:
            problems.append(f"--{name} must be ≥ 1 (got {getattr(a, name)})")
    n = a.prompts_per_iter * a.group_size
    if a.mu > n:
        problems.append(f"--mu {a.mu} exceeds the {n} samples of an iteration")
    if a.stratified and a.n_mc > a.num_steps:
        problems.append(f"--n_mc {a.n_mc} > --num_steps {a.num_steps}: stratification needs one "
                        "grid point per stratum (or pass --no-stratified)")
    if a.resolution % 16:
        problems.append(f"--resolution must be a multiple of 16 (got {a.resolution})")
    if not 0 <= a.eval_holdout < 1:
        problems.append(f"--eval_holdout must lie in [0, 1) (got {a.eval_holdout})")
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))

# ------------------------------------------------------------------------------------------------
# §3  Flow-matching math (pure).                                          [PAPER conventions]
#     Rectified flow: x_t = (1 − t)·x0 + t·ε,  v = dx_t/dt = ε − x0,  t = 1 noise → t = 0 data.
#     The three "parameterisations" of PAPER §1.8 are the same prediction seen in three spaces:
#         x̂0 − x0 = −t·(v̂ − v)      ε̂ − ε = (1 − t)·(v̂ − v)      (v̂ − v) itself
#     so an error in x-, ε- or v-space is the v-error times t, (1 − t) or 1.        [PAPER §5.6]
# ------------------------------------------------------------------------------------------------
def bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample t (M,) to (M, 1, 1, ...) so it broadcasts against `like` (M, *D)."""
    return t.reshape(t.shape + (1,) * (like.dim() - t.dim()))


def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε.  x0, eps: (M, *D); t: (M,) in [0, 1]; returns (M, *D)."""
    tb = bcast(t, x0)
    return (1 - tb) * x0 + tb * eps


def x0_from_v(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x̂0 = x_t − t·v̂ (the x-prediction reparameterisation of PAPER §1.4 (3a)). Shapes (M, *D), t (M,)."""
    return x_t - bcast(t, x_t) * v


PARAM_SCALE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # error in space p = PARAM_SCALE[p](t) · (v̂ − v), up to sign (squared and |·| drop the sign)
    "x": lambda t: t,                       # x̂0 − x0 = −t (v̂ − v)          [PAPER §1.4 (3a)]
    "eps": lambda t: 1 - t,                 # ε̂ − ε  = (1 − t)(v̂ − v)       [PAPER §1.8 ablation]
    "v": lambda t: torch.ones_like(t),      # plain flow-matching error       [PAPER §1.8 ablation]
}


def time_shift(s: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's resolution shift σ = shift·s / (1 + (shift − 1)·s); shift 1 is the identity."""
    return shift * s / (1 + (shift - 1) * s)


def sigma_grid(num_steps: int, shift: float = 1.0, sigma_min: Optional[float] = None) -> torch.Tensor:
    """A rollout grid: K + 1 decreasing times from 1 to exactly 0 (float64, CPU).

    sigma_min=None: K equal steps of the unshifted time, linspace(1, 0, K + 1), then time-shifted.
    sigma_min=σ: diffusers' FlowMatchEulerDiscreteScheduler grid — linspace(1, σ, K) shifted, then
    a terminal 0 appended — with σ = the shifted time of its first training step (a test checks
    the match). The trainer reads the grid from the model's own scheduler.
    Returns: (K + 1,) tensor.
    """
    if sigma_min is None:
        return time_shift(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift)
    s = torch.linspace(1.0, sigma_min, num_steps, dtype=torch.float64)
    return torch.cat([time_shift(s, shift), torch.zeros(1, dtype=torch.float64)])


# ------------------------------------------------------------------------------------------------
# §4  Deterministic ODE samplers (pure, given a velocity function).        [PAPER §1.1, §3 item 8]
#     V-GRPO never needs per-step log-probs: the generation is ONE action whose log-likelihood is
#     replaced by the surrogate of §7, so any deterministic solver works for rollouts.
#     `velocity_fn(x, t, cond) -> v` with x (M, *D), t (M,) — the model or an analytic field.
# ------------------------------------------------------------------------------------------------
def euler_sample(velocity_fn: Callable, x1: torch.Tensor, sigmas: torch.Tensor, cond=None) -> torch.Tensor:
    """Euler solve of dx/dt = v(x, t) from t = sigmas[0] (= 1) down to sigmas[-1] (= 0).

    Args:
        velocity_fn: (x (M, *D), t (M,), cond) -> v (M, *D).
        x1: (M, *D) initial noise.
        sigmas: (K + 1,) decreasing grid, CPU tensor or list; K network evaluations.
    Returns: x0 (M, *D) in x1's dtype.
    Notes: x_{k+1} = x_k + (σ_{k+1} − σ_k)·v(x_k, σ_k) — diffusers' FlowMatchEuler step.
    """
    sig = [float(s) for s in sigmas]          # python floats: no device syncs inside the loop
    x = x1.to(torch.promote_types(x1.dtype, torch.float32))      # accumulate in ≥ fp32
    for s, s_next in zip(sig[:-1], sig[1:]):
        t = torch.full((x.shape[0],), s, device=x.device, dtype=torch.float32)     # (M,)
        v = velocity_fn(x.to(x1.dtype), t, cond)
        x = x + (s_next - s) * v.to(x.dtype)                                       # (M, *D)
    return x.to(x1.dtype)


def dpmpp2m_sample(velocity_fn: Callable, x1: torch.Tensor, sigmas: torch.Tensor, cond=None) -> torch.Tensor:
    """DPM-Solver++(2M), the 2nd-order multistep data-prediction solver, for rectified flow.

    With α_t = 1 − t, σ_t = t, λ = log(α/σ), h = λ_{k+1} − λ_k and x̂0 = x − t·v̂:
        x_{k+1} = (σ_{k+1}/σ_k)·x_k + α_{k+1}·(1 − e^{−h})·D_k
        D_k = x̂0_k                                    (first step, and the final step to t = 0)
        D_k = (1 + 1/(2r))·x̂0_k − 1/(2r)·x̂0_{k−1},   r = h_{k−1}/h_k          (otherwise)
    e^{−h} = σ_{k+1}α_k / (σ_k α_{k+1}) is finite even at t = 1 (α = 0, λ = −∞), so the first
    step is the DDIM step x = (1 − σ')·x̂0 + σ'·x1. One network evaluation per step (K in all).
    Args/Returns: as euler_sample.
    """
    sig = [float(s) for s in sigmas]
    x = x1.to(torch.promote_types(x1.dtype, torch.float32))      # accumulate in ≥ fp32
    prev_x0, prev_h = None, None
    for k, (s, s_next) in enumerate(zip(sig[:-1], sig[1:])):
        t = torch.full((x.shape[0],), s, device=x.device, dtype=torch.float32)
        x0_hat = x - s * velocity_fn(x.to(x1.dtype), t, cond).to(x.dtype)                # (M, *D)
        if s_next == 0.0:                               # final step: e^{-h} = 0, first order
            x = x0_hat
            break
        a, a_next = 1.0 - s, 1.0 - s_next
        exp_neg_h = (s_next * a) / (s * a_next)
        h = math.inf if a == 0.0 else math.log(a_next / s_next) - math.log(a / s)
        if prev_x0 is None or math.isinf(prev_h):       # no usable history → first order
            d = x0_hat
        else:
            r = prev_h / h
            d = (1 + 1 / (2 * r)) * x0_hat - (1 / (2 * r)) * prev_x0
        x = (s_next / s) * x + a_next * (1 - exp_neg_h) * d
        prev_x0, prev_h = x0_hat, h
    return x.to(x1.dtype)


SOLVERS = {"euler": euler_sample, "dpmpp2m": dpmpp2m_sample}


# ------------------------------------------------------------------------------------------------
# §5  Rewards live with the models (§9): they need weights. The math below only sees a tensor of
#     rewards (P, G). Non-finite rewards are masked, never allowed to poison a group.
# ------------------------------------------------------------------------------------------------

# ------------------------------------------------------------------------------------------------
# §6  Group-relative advantages (pure).                       [PAPER §1.5, §3 items 1 and 3, §4 step 2]
# ------------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, *, global_std: bool = True, std_eps: float = 1e-4,
                     clamp: float = 5.0, eta: float = 3.0):
    """A = soft_clip(clamp((r − mean_group) / (std + std_eps))).

    Args:
        rewards: (P, G) float; non-finite entries mark dropped samples.
        global_std: divide by the std of all finite rewards of the batch (DiffusionNFT convention,
            PAPER §3 item 3) instead of each group's own std.
        std_eps: added to the std, so a group of equal rewards gets A = 0, never NaN.
        clamp: hard clamp |A| ≤ clamp (PAPER §3 item 1; inert at η = 3, kept for parity).
        eta: soft-clip A ← η·tanh(A/η) (PAPER §1.5, Eq. 17 per [VRL]); 0 disables it.
    Returns:
        adv: (P, G) fp32; 0 for dropped samples and for groups with < 2 finite rewards.
        stats: dict of detached scalars (mean, std, max |A|, fraction of dropped samples).
    Notes: std is the population std (divide by n). |A| ≤ η < clamp after soft-clipping.
    Reference form: for each group g: m = mean(r[g]); A[g] = (r[g] − m) / (std + std_eps).
    """
    r = rewards.float()
    ok = torch.isfinite(r)                                                   # (P, G)
    n = ok.sum(dim=1, keepdim=True)                                          # (P, 1)
    r0 = torch.where(ok, r, torch.zeros_like(r))
    mean = r0.sum(dim=1, keepdim=True) / n.clamp(min=1)                      # (P, 1)
    dev = torch.where(ok, r - mean, torch.zeros_like(r))                     # (P, G)
    if global_std:
        std = (dev.square().sum() / ok.sum().clamp(min=1)).sqrt()            # () pooled around group means
    else:
        std = (dev.square().sum(dim=1, keepdim=True) / n.clamp(min=1)).sqrt()   # (P, 1)
    adv = dev / (std + std_eps)
    adv = adv.clamp(-clamp, clamp)
    if eta > 0:
        adv = eta * torch.tanh(adv / eta)
    adv = torch.where(ok & (n >= 2), adv, torch.zeros_like(adv))
    stats = {"adv_mean": adv.mean().detach(), "adv_std": adv.std(unbiased=False).detach(),
             "adv_absmax": adv.abs().max().detach(), "frac_dropped": (~ok).float().mean().detach()}
    return adv, stats


# ------------------------------------------------------------------------------------------------
# §7  Shared, stratified (t, ε) pairs and the ELBO surrogate (pure).          [PAPER §1.2–§1.4]
#
#   log π_θ(o | c)  ←  S_θ(o) = (1/J) Σ_j s_θ(o; t_j, ε_j)
#   s_θ(o; t, ε)    = − mean_d (x̂0 − o)²  /  sg( max(mean_d |x̂0 − o|, floor) ),
#   x̂0 = z − t·v_θ(z, t, c),  z = (1 − t)·o + t·ε.
#
#   Three variance-reduction techniques, each one switch:
#   (1) group/batch-shared pairs: every member of a group is scored on the SAME (t_j, ε_j), so
#       differences inside a group reflect the images, not the dice  (pair_sharing);
#   (2) stratified t: one t per contiguous chunk of the rollout grid       (stratified);
#   (3) adaptive weighting: the x-space MSE is divided by its own detached MAE, flattening the
#       orders-of-magnitude spread of loss scale across t                  (adaptive_weighting).
# ------------------------------------------------------------------------------------------------
@dataclass
class Pairs:
    """The (t, ε) pairs of one iteration, reused by θ_old and by every θ step [PAPER §3 item 4].

    t:     (S, J) times, S = number of independent pair sets (1 = batch-wide sharing).
    eps:   (S, J, *D) noises.
    index: (N,) long, which set each of the N samples uses.
    """
    t: torch.Tensor
    eps: torch.Tensor
    index: torch.Tensor

    def take(self, rows: torch.Tensor):
        """Pairs of samples `rows` (m,): returns t (m, J), eps (m, J, *D)."""
        i = self.index[rows]
        return self.t[i], self.eps[i]


def draw_pairs(grid: torch.Tensor, n_mc: int, latent_shape: tuple, index: torch.Tensor, *,
               stratified: bool = True, generator: Optional[torch.Generator] = None) -> Pairs:
    """Draw J = n_mc (t, ε) pairs for each of S = index.max() + 1 sharing scopes.

    Args:
        grid: (K,) candidate times — the rollout sigma grid WITHOUT its terminal 0 (at t = 0 the
            error vanishes and the MAE normalisation is 0/0)                 [PAPER §3 item 5].
        n_mc: J, pairs per sample (N_MC).
        latent_shape: D = (C, H, W) of one latent.
        index: (N,) long, the scope of each sample: zeros = batch-wide sharing (the paper's code,
            `grpo_init_same="batch"`), sample // G = per group (the paper's text), arange(N) = none.
        stratified: split the grid into J contiguous, (near-)equal chunks (torch.tensor_split) and
            pick one grid point uniformly inside each; else J uniform picks from the whole grid.
        generator: CPU generator; the pairs are drawn on the CPU so they do not depend on device.
    Returns: Pairs with t (S, J) float32 and eps (S, J, *D) float32, on the CPU.
    """
    grid = torch.as_tensor(grid, dtype=torch.float64).flatten()
    S = int(index.max()) + 1
    if stratified:
        chunks = torch.tensor_split(torch.arange(len(grid)), n_mc)          # J chunks of indices
        lo = torch.tensor([int(c[0]) for c in chunks])                      # (J,) first index
        size = torch.tensor([len(c) for c in chunks])                       # (J,) chunk length
        u = torch.rand(S, n_mc, generator=generator, dtype=torch.float64)   # (S, J)
        idx = lo + (u * size).long().clamp(max=size - 1)                    # (S, J)
    else:
        idx = torch.randint(len(grid), (S, n_mc), generator=generator)      # (S, J)
    t = grid[idx].float()                                                   # (S, J)
    eps = torch.randn((S, n_mc) + tuple(latent_shape), generator=generator)  # (S, J, *D)
    return Pairs(t=t, eps=eps, index=index.cpu().long())


def surrogate_from_velocity(v_pred: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, *,
                            parameterization: str = "x", adaptive: bool = True,
                            mae_floor: float = 1e-5) -> torch.Tensor:
    """Per-pair surrogate log-likelihood s = −‖e‖²_mean / sg(max(‖e‖₁_mean, floor)).   [PAPER §1.4 (3)]

    e is the prediction error in the chosen space (§3): with x-prediction e = x̂0 − x0 =
    −t·(v̂ − (ε − x0)). The official code: `x0_pred = z − σ·pred; s = −mean((x0_pred − x0)²);
    s = s / mean(|x0_pred.detach() − x0|)` [PAPER §1.4, CY]. adaptive=False returns −‖e‖²_mean.
    Args:
        v_pred: (M, *D) network velocity at z = (1 − t)·x0 + t·ε (any dtype).
        x0: (M, *D) rollout latents; eps: (M, *D) pair noises; t: (M,) pair times.
    Returns: s (M,) fp32, differentiable through v_pred only.
    Reference form: for m: e = scale(t[m])*(v_pred[m] − eps[m] + x0[m]); s[m] = −(e**2).mean()/max(|e|.mean(), floor)
    """
    err = PARAM_SCALE[parameterization](bcast(t.float(), x0)) * (v_pred.float() - (eps.float() - x0.float()))
    mse = err.square().flatten(1).mean(dim=1)                                 # (M,)
    if not adaptive:
        return -mse
    mae = err.detach().abs().flatten(1).mean(dim=1).clamp(min=mae_floor)     # (M,) stop-gradient
    return -mse / mae


def _repeat_rows(tree, J: int):
    """Repeat every tensor in a (nested dict/tuple of) batch-first tensors J times per row."""
    if torch.is_tensor(tree):
        return tree.repeat_interleave(J, dim=0)
    if isinstance(tree, dict):
        return {k: _repeat_rows(v, J) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_repeat_rows(v, J) for v in tree)
    return tree


def pair_surrogates(velocity_fn: Callable, x0: torch.Tensor, cond, t: torch.Tensor, eps: torch.Tensor, *,
                    parameterization: str = "x", adaptive: bool = True, mae_floor: float = 1e-5,
                    return_x0_hat: bool = False):
    """s[m, j] for m samples × J pairs in ONE batched network call of m·J rows.   [PAPER §4 step 4/5]

    Args:
        velocity_fn: (z (m·J, *D), t (m·J,), cond repeated) -> v (m·J, *D).
        x0: (m, *D) latents; cond: batch-first tensors (or dict/tuple of them) with m rows.
        t: (m, J) times; eps: (m, J, *D) noises (from Pairs.take).
    Returns: s (m, J) fp32, and if return_x0_hat the x-prediction (m, J, *D) fp32 (for the KL).
    """
    m, J = t.shape
    D = x0.shape[1:]
    x0r = x0.unsqueeze(1).expand(m, J, *D).reshape(m * J, *D)                # (m·J, *D)
    tr, er = t.reshape(m * J), eps.reshape(m * J, *D)                        # (m·J,), (m·J, *D)
    z = interpolate(x0r.float(), er.float(), tr.float()).to(x0.dtype)        # (m·J, *D)
    v = velocity_fn(z, tr, _repeat_rows(cond, J))                            # (m·J, *D)
    s = surrogate_from_velocity(v, x0r, er, tr, parameterization=parameterization,
                                adaptive=adaptive, mae_floor=mae_floor).reshape(m, J)
    if return_x0_hat:
        return s, x0_from_v(z.float(), v.float(), tr.float()).reshape(m, J, *D)
    return s


def surrogate_cv(S: torch.Tensor) -> dict:
    """Coefficient of variation of the surrogate S (P, G): over the batch and within groups.

    CV = std / |mean| (population std). The paper reports 0.230 → 0.128 (batch) and 0.170 → 0.038
    (within group) when the three techniques are switched on [PAPER §1.4]. Returns detached scalars.
    """
    S = S.float()
    cv_all = S.std(unbiased=False) / S.mean().abs().clamp(min=1e-12)
    cv_grp = (S.std(dim=1, unbiased=False) / S.mean(dim=1).abs().clamp(min=1e-12)).mean()
    return {"surrogate_cv": cv_all.detach(), "surrogate_cv_group": cv_grp.detach()}


# ------------------------------------------------------------------------------------------------
# §8  The V-GRPO loss (pure).                                       [PAPER §1.3, §1.5, §4 step 5]
#   ρ = exp(S_θ − S_old), ONE ratio per sample: the mean over pairs sits inside the exp (the
#   official code's `exp(new.mean(1) − old.mean(1))`, GSPO-like).                  [PAPER §1.3]
#   loss_n = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) + β·mean_j ‖x̂θ − x̂θold‖²_mean    [PAPER §1.5]
# ------------------------------------------------------------------------------------------------
def xspace_kl(x0_hat: torch.Tensor, x0_hat_old: torch.Tensor) -> torch.Tensor:
    """"Simple" KL of PAPER §1.5 (Eq. 16 per [VRL]): mean_d (x̂θ − x̂θold)² per pair.

    x0_hat, x0_hat_old: (m, J, *D). Returns (m, J) fp32, differentiable through x0_hat only.
    """
    return (x0_hat.float() - x0_hat_old.detach().float()).square().flatten(2).mean(dim=2)


def vgrpo_loss(s_new: torch.Tensor, s_old: torch.Tensor, adv: torch.Tensor, *, clip_eps: float = 0.0,
               kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0):
    """V-GRPO policy loss for m samples (mean over samples; minimise it).

    Args:
        s_new: (m, J) surrogate of the current θ (with grad).
        s_old: (m, J) surrogate of θ_old on the SAME pairs (no grad; stored with the rollout).
        adv:   (m,) advantages (already normalised / clipped, §6).
        clip_eps: ratio clip ε; 0 disables the clip (then loss = −A·ρ).
        kl: (m, J) per-pair x-space KL to θ_old (xspace_kl), used when kl_coef > 0.
    Returns:
        loss: () fp32.
        stats: detached scalars — ratio mean, mean |log ρ|, clip fraction, approx KL
            k2 = ½(log ρ)² [PAPER §5.7], and the x-space KL.
    Notes: with θ = θ_old, ρ ≡ 1 and ∇loss = −A·∇S: REINFORCE with a group baseline on the
        surrogate (PAPER §4 notes), which is the whole update when μ = 1.
    Reference form:
        for n: r = exp(mean_j s_new[n] − mean_j s_old[n]); pg = −A[n]·r
               if ε: pg = max(pg, −A[n]·clamp(r, 1−ε, 1+ε));  loss += (pg + β·mean_j kl[n]) / m
    """
    log_ratio = s_new.float().mean(dim=1) - s_old.detach().float().mean(dim=1)   # (m,)
    ratio = torch.exp(log_ratio)                                                 # (m,)
    a = adv.detach().float()
    pg = -a * ratio                                                              # (m,)
    if clip_eps > 0:
        pg = torch.maximum(pg, -a * ratio.clamp(1 - clip_eps, 1 + clip_eps))
        clipped = ((ratio - 1).abs() > clip_eps).float()
    else:
        clipped = torch.zeros_like(ratio)
    loss = pg.mean()
    kl_mean = torch.zeros((), device=s_new.device)
    if kl is not None and kl_coef > 0:
        kl_mean = kl.float().mean()
        loss = loss + kl_coef * kl.float().mean(dim=1).mean()
    stats = {"ratio": ratio.mean().detach(), "abs_log_ratio": log_ratio.abs().mean().detach(),
             "clip_frac": clipped.mean().detach(), "approx_kl": (0.5 * log_ratio.square()).mean().detach(),
             "kl_x": kl_mean.detach()}
    return loss, stats

