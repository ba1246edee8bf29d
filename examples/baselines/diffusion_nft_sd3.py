"""DiffusionNFT (the forward-process baseline) at its own published settings, on the SD3 path.

DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; peer X5 of METHOD.md) never scores a sampled
trajectory. It samples clean images with any deterministic solver, splits them softly into a
"positive" and a "negative" set by an optimality weight r ∈ [0, 1] computed from the advantage,
and trains v_θ with the ordinary flow-matching objective on noised copies of those images: the
positive branch v⁺ = β·v_θ + (1 − β)·v_old is pulled towards each image in proportion to r, the
implicit negative branch v⁻ = (1 + β)·v_old − β·v_θ in proportion to 1 − r. The sampling policy
v_old is a second LoRA adapter that trails θ by a soft update with a ramped decay.

    python examples/baselines/diffusion_nft_sd3.py             # tiny SD3 pipeline, CPU, jpeg
    python examples/baselines/diffusion_nft_sd3.py --model DIR --reward mymod:fn --prompts train.txt \\
        --eval_prompts test.txt --iterations 30 --out runs/nft
    python examples/baselines/diffusion_nft_sd3.py --model sd3.5-medium --reward pickscore   # one GPU

Output folder (--out, default runs/diffusion_nft_sd3-<model>-<reward>-<date>/): metrics.jsonl (one
line per iteration and per evaluation, each with "method": "diffusion_nft"), recipe.json (the
settings used), lora_diffusion_nft/ (the EMA of the trained LoRA, as upstream saves it, in
diffusers' format). Any vgrpo.py flag not listed under --help here goes to vgrpo's parser
(--micro_batch, --resolution, --eval_steps, --lora_targets, ...). From Python, the digits
benchmark and the tests use: RECIPE, init_state(run, **overrides), nft_iteration(run, it, state),
eval_weights(run, state), main(argv).

Read from NVlabs/DiffusionNFT (the upstream files every tag below names):
  scripts/train_nft_sd3.py   main() (sampling, advantages, the training loop, the loss, the
                             old-adapter soft update), return_decay, eval_fn, save_ckpt
  config/nft.py              _get_config, sd3_pickscore / sd3_hpsv2 / sd3_geneval /
                             sd3_multi_reward / sd3_ocr
  config/base.py             the defaults the configs above do not override
  flow_grpo/diffusers_patch/pipeline_with_logprob.py, flow_grpo/diffusers_patch/solver.py
                             run_sampling, dpm_step, ddim_update,
                             multistep_dpm_solver_second_order_update (the "dpm2" solver)
  flow_grpo/stat_tracking.py PerPromptStatTracker      flow_grpo/ema.py  EMAModuleWrapper
  flow_grpo/rewards.py       multi_score (the weighted sum "avg" that the advantages see)

One iteration (= one upstream epoch with num_inner_epochs = 1):
  1. rollout: P prompts × G images, CFG-free, deterministic "dpm2" solve of the OLD adapter
     (train_nft_sd3.py calls set_adapter("old") around pipeline_with_logprob)
  2. rewards: weighted sum of training-scaled rewards (multi_score's "avg"); advantages from the
     per-prompt stat tracker: A = (r − mean of the prompt's samples) / (population std of ALL
     rewards of the iteration + 1e-4)
  3. training: samples shuffled; each gets T = int(K · 0.99) of the K rollout times, distinct, in
     random order; per (micro-batch, time): fresh noise ε, x_t = (1 − t)·x0 + t·ε, three forwards
     (old adapter, θ with grad, adapters off for the reference), the loss below, backward;
     gradients accumulated over (samples / opt_steps) × T, then one AdamW step; EMA after each
  4. old ← d·old + (1 − d)·θ, d = min(uprate · (step − flat), uphold) (0 before `flat`), step =
     optimizer steps so far
  loss (per sample, then mean over the batch):
     r = clamp(clamp(A, ±A_max)/A_max/2 + 1/2, 0, 1)
     x̂± = x_t − t·v±,  e± = mean_d (x̂± − x0)² / sg(clamp(mean_d |x̂± − x0|, ≥ 1e-5))   (float64)
     L = A_max · [r·e⁺ + (1 − r)·e⁻] / β  +  β_KL · mean_d (v_θ − v_ref)²

Recipes (--recipe; `RECIPES`, every number named with its file below):
  sd3_pickscore (default; also sd3_hpsv2, sd3_geneval: the same numbers, another reward)
                K = 10 dpm2 steps, β = 1, decay type 1 (d = min(0.001·step, 0.5)), 1 optimizer
                step per iteration, β_KL = 1e-4, A_max = 5, T = int(0.99·K) = 9, EMA 0.9
  sd3_multi_reward  K = 25, β = 0.1 (pickscore:1,hpsv2:1,clipscore:1: pass it with --reward)
  sd3_ocr           β = 0.1, decay type 2 (0 for 75 steps, then 0.0075 per step up to 0.999),
                    2 optimizer steps per iteration
Run-level settings of upstream that vgrpo's own flags carry (its SD3.5 defaults already match
except P): lr 3e-4, AdamW (0.9, 0.999), eps 1e-8, weight decay 1e-4, grad-norm clip 1.0, LoRA
r 32 / α 64 Gaussian init, 512 px, G = 24, 48 prompts per iteration over 8 GPUs (vgrpo's
one-GPU default P = 6), evaluation by a 40-step deterministic Euler solve (vgrpo --eval_steps 40,
--solver euler) of the EMA weights; fp16 autocast with loss scaling (--dtype auto here: fp16
on CUDA, fp32 on CPU).

Deviations from upstream, each with its reason (also in examples/baselines/diffusion_nft_sd3.md):
  D1 One process. Upstream shards every sampling batch over 8 GPUs (9 samples each) and DDP
     averages the gradient; here the P·G samples live on one device and are cut into
     --micro_batch rows; the accumulated gradient is the same mean over samples and times.
  D2 Prompts and noise come from vgrpo's streams (V.Stream.PROMPTS for the prompt permutation,
     ROLLOUT_NOISE for x1), so every method of a comparison sees the same ones; upstream's
     DistributedKRepeatSampler draws 48 distinct prompts per sampling round and may repeat a
     prompt across the 16 rounds of an epoch (the stat tracker then pools those groups: so does
     the one used here, which groups by prompt text). The shuffles, training times and noises use
     their own streams (vgrpo's MINIBATCHES; baseline_cli.Stream.TIMES, STEP_NOISE), not the global RNG.
  D3 Rollout precision: the latent stays fp32 between solver steps and the timestep is the
     float σ·1000. Upstream casts the latent to the fp16 of its text embeddings after every step
     and truncates σ·1000 to an integer (torch.long) in the rollout and evaluation, but not in
     training. Both are rounding effects of its sampling wrapper, not part of the method; the
     clean latents it trains on are therefore fp16, here fp32.
  D4 Loss arithmetic in fp32 (float64 where upstream is): the three velocities are cast to fp32
     before v± are formed and before the KL; upstream mixes them in the autocast output dtype
     (fp16) and computes the KL in it. The self-normalised errors divide by a float64 MAE and are
     float64, as upstream.
  D5 With kl_coef = 0 the reference forward is skipped (upstream runs it regardless, and only
     logs it); at every published recipe kl_coef = 1e-4, and it runs.
  D6 LoRA targets: vgrpo's default list also reaches the second attention (attn2) of SD3.5's
     MMDiT-X blocks, which upstream's "attn.to_q", ... names leave out; pass
     --lora_targets attn.to_q,attn.to_k,attn.to_v,attn.to_out.0,attn.add_q_proj,attn.add_k_proj,\\
     attn.add_v_proj,attn.to_add_out to match.
  D7 Evaluation through vgrpo.evaluate: held-out prompts, one image each, fixed noise, the
     --solver (euler: upstream's deterministic "flow" step) at --eval_steps, every --eval_every
     iterations and at the end; upstream's test-set files and batch sizes are not reproduced.
  D8 Not implemented: adv_mode other than "all" (every published config uses "all"), full
     fine-tuning (upstream asserts LoRA too), resuming, FLUX, torchrun. Non-finite rewards are
     not dropped (nor are they upstream).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # never wait on a hub look-up (tiny model)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import vgrpo as V
import baseline_cli
from baseline_cli import add_run_flags
import flow_grpo_sd3 as FG          # its stat tracker and EMA are DiffusionNFT's too (see below)

OLD = "old"                         # the sampling policy's adapter (train_nft_sd3.py: "old")
# Upstream's published settings (config/nft.py on top of config/base.py; see the docstring).
RECIPES = {
    "sd3_pickscore": dict(
        num_steps=10,           # config/nft.py _get_config: sample.num_steps = 10 (sd3)
        solver="dpm2",          # config/nft.py: sample.solver = "dpm2", sample.deterministic = True
        beta=1.0,               # config/nft.py _get_config: config.beta = 1.0 (the mixing β)
        adv_clip_max=5.0,       # config/base.py: train.adv_clip_max = 5 (A_max)
        kl_coef=1e-4,           # config/nft.py _get_config: train.beta = 0.0001 (β_KL)
        decay_flat=0,           # config/nft.py: decay_type = 1 → train_nft_sd3.py return_decay:
        decay_uprate=0.001,     #   flat 0, uprate 0.001, uphold 0.5
        decay_uphold=0.5,
        timestep_fraction=0.99,  # config/base.py: train.timestep_fraction → T = int(0.99 K)
        opt_steps=1,            # config/nft.py sd3_pickscore: gradient_step_per_epoch = 1
        global_std=True,        # config/base.py: sample.global_std = True
        std_eps=1e-4,           # flow_grpo/stat_tracking.py: np.std(rewards) + 1e-4
        mae_floor=1e-5,         # train_nft_sd3.py: weight_factor .clip(min=0.00001)
        ema=True,               # config/base.py: train.ema = True (evaluated and saved)
        ema_decay=0.9,          # train_nft_sd3.py: EMAModuleWrapper(decay=0.9,
        ema_interval=1,         #   update_step_interval=1)
        # run-level: carried by vgrpo's Args (vgrpo.setup builds the optimizer and sizes from
        # them); listed for reference, not read by init_state
        lr=3e-4,                # config/base.py: train.learning_rate
        weight_decay=1e-4,      # config/base.py: train.adam_weight_decay (betas 0.9/0.999,
        max_grad_norm=1.0,      #   eps 1e-8, train.max_grad_norm)
        resolution=512,         # config/nft.py: config.resolution = 512
        group_size=24,          # config/nft.py: sample.num_image_per_prompt = 24
        prompts_per_iter=48,    # config/nft.py: num_groups = 48 (over 8 GPUs)
        lora_rank=32, lora_alpha=64,   # train_nft_sd3.py: LoraConfig(r=32, lora_alpha=64, gaussian)
        eval_steps=40,          # config/nft.py: sample.eval_num_steps = 40 (eval_fn: "flow")
        guidance_scale=1.0,     # config/nft.py: sample.guidance_scale = 1.0 (CFG-free)
        mixed_precision="fp16",  # config/base.py: mixed_precision = "fp16"
    ),
}
RECIPES["sd3_multi_reward"] = dict(RECIPES["sd3_pickscore"],
                                   num_steps=25,   # config/nft.py sd3_multi_reward
                                   beta=0.1)       # config/nft.py sd3_multi_reward
RECIPES["sd3_ocr"] = dict(RECIPES["sd3_pickscore"],
                          beta=0.1,                # config/nft.py sd3_ocr
                          decay_flat=75, decay_uprate=0.0075, decay_uphold=0.999,  # decay_type 2
                          opt_steps=2)             # config/nft.py sd3_ocr: gradient_step_per_epoch
RECIPE = RECIPES["sd3_pickscore"]
RUN_LEVEL = ("lr", "weight_decay", "max_grad_norm", "resolution", "group_size", "prompts_per_iter",
             "lora_rank", "lora_alpha", "eval_steps", "guidance_scale", "mixed_precision")
# train_nft_sd3.py return_decay: decay_type → (flat, uprate, uphold)
DECAY_TYPES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}


# ------------------------------------------------------------------------------------------------
# The pure parts: the loss, the decay schedule and soft update, the dpm2 solver.
# Time convention as vgrpo.py: t = σ ∈ [0, 1], t = 1 noise, t = 0 data, x_t = (1 − t)·x0 + t·ε,
# v ≈ ε − x0, x̂0 = x_t − t·v.
# ------------------------------------------------------------------------------------------------
def optimality_weight(adv: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clamp(A, ±A_max) / A_max / 2 + 1/2, 0, 1) [train_nft_sd3.py main(), "normalize
    advantage"]: A ≥ A_max → 1 (all positive), A ≤ −A_max → 0 (all negative), A = 0 → 1/2.
    adv (M,) → r (M,) in adv's dtype (float64 upstream: the stat tracker's numpy output)."""
    a = adv.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def self_normalised_error(x0_hat: torch.Tensor, x0: torch.Tensor, mae_floor: float) -> torch.Tensor:
    """e = mean_d (x̂0 − x0)² / sg(max(mean_d |x̂0 − x0|, floor)) per sample [train_nft_sd3.py
    main(), "adaptive weighting"]. The denominator is computed in float64 without gradient; the
    division promotes the squared error to float64, as upstream's. (M, *D) → (M,) float64."""
    dims = tuple(range(1, x0.dim()))
    with torch.no_grad():
        w = (x0_hat.detach().double() - x0.double()).abs().mean(dim=dims, keepdim=True)
        w = w.clamp(min=mae_floor)                                          # (M, 1, ...)
    return ((x0_hat - x0) ** 2 / w).mean(dim=dims)                          # (M,) float64


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_ref, x0: torch.Tensor,
             x_t: torch.Tensor, t: torch.Tensor, adv: torch.Tensor, *, beta: float,
             adv_clip_max: float, kl_coef: float, mae_floor: float = 1e-5):
    """DiffusionNFT's loss on one batch at one time per sample [train_nft_sd3.py main(), the
    "Policy Gradient Loss" block]:

        r   = optimality_weight(A)
        v⁺  = β·v_θ + (1 − β)·sg(v_old)          (the implicit positive policy)
        v⁻  = (1 + β)·sg(v_old) − β·v_θ          (the implicit negative policy)
        e±  = self_normalised_error(x_t − t·v±, x0)
        L   = mean_batch( A_max·[r·e⁺ + (1 − r)·e⁻] / β ) + β_KL·mean_batch mean_d (v_θ − v_ref)²

    At θ = old both branches coincide and dL/dv_θ ∝ −(2r − 1)·t·(x̂0 − x0)/w: samples with A > 0
    pull x̂0 towards their image, samples with A < 0 push it away, with weight |A|/A_max ≤ 1.

    Args:
        v_theta: (M, *D) velocity of θ, with grad. v_old: (M, *D) of the old adapter (detached
            here). v_ref: (M, *D) with the adapters off, or None when kl_coef = 0.
        x0: (M, *D) the rollout images' latents. x_t: (M, *D) their noised copies. t: (M,) times.
        adv: (M,) advantages (float64 upstream). beta: the mixing β (> 0); adv_clip_max: A_max;
        kl_coef: β_KL; mae_floor: clamp of the MAE denominator.
    Returns: loss () float64, and stats {name: () detached}.
    Notes: the velocities are cast to fp32 first (upstream mixes them in fp16; DEV D4). Reductions
        are means over latent elements and over the batch, as upstream's.
    Reference form (M = 1, one element d = 1, A inside ±A_max):
        r = A/(2A_max) + 1/2;  e± = (x_t − t·v± − x0)² / |x_t − t·v± − x0|;
        L = A_max (r e⁺ + (1 − r) e⁻)/β + β_KL (v_θ − v_ref)²."""
    assert v_theta.shape == v_old.shape == x0.shape == x_t.shape
    assert t.shape == adv.shape == x0.shape[:1]
    assert beta > 0, "β = 0 makes both branches the old policy and the loss divides by β"
    dims = tuple(range(1, x0.dim()))
    v, v_old = v_theta.float(), v_old.detach().float()                      # (M, *D) fp32
    x0, x_t = x0.float(), x_t.float()
    tb = V.bcast(t.float(), x0)                                             # (M, 1, ...)
    r = optimality_weight(adv, adv_clip_max)                                # (M,)
    v_pos = beta * v + (1 - beta) * v_old                                   # (M, *D)
    v_neg = (1 + beta) * v_old - beta * v                                   # (M, *D)
    e_pos = self_normalised_error(x_t - tb * v_pos, x0, mae_floor)          # (M,) float64
    e_neg = self_normalised_error(x_t - tb * v_neg, x0, mae_floor)          # (M,) float64
    per_sample = r * e_pos / beta + (1.0 - r) * e_neg / beta                # (M,) float64
    policy = (per_sample * adv_clip_max).mean()                             # () float64
    stats = {"policy_loss": policy.detach(), "unweighted_policy_loss": per_sample.mean().detach(),
             "positive_loss": e_pos.mean().detach(), "negative_loss": e_neg.mean().detach(),
             "r_mean": r.mean().detach(),
             "old_deviate": (v - v_old).square().mean().detach()}       # upstream's log name
    loss = policy
    if v_ref is not None:
        v_ref = v_ref.detach().float()
        kl = (v - v_ref).square().mean(dim=dims).mean()                    # () fp32
        loss = loss + kl_coef * kl
        stats["kl_div"] = kl.detach()
        stats["old_kl_div"] = (v_old - v_ref).square().mean().detach()
    stats["loss"] = loss.detach()
    return loss, stats


def return_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """The old adapter's decay after `step` optimizer steps [train_nft_sd3.py return_decay]:
    0 while step < flat, else min((step − flat)·uprate, uphold). DECAY_TYPES holds upstream's
    three (flat, uprate, uphold); its published configs use type 1 (type 2 for OCR)."""
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


@torch.no_grad()
def soft_update_(old: list, new: list, decay: float) -> None:
    """old ← decay·old + (1 − decay)·new, in place, tensor by tensor [train_nft_sd3.py main(),
    after each epoch's training]. decay = 0 copies new (upstream's initial sync before the loop)."""
    assert len(old) == len(new)
    for o, n in zip(old, new):
        o.copy_(o * decay + n.detach() * (1.0 - decay))


def dpm2_sample(velocity_fn, x1: torch.Tensor, sigmas, cond=None) -> torch.Tensor:
    """DiffusionNFT's deterministic "dpm2" rollout [flow_grpo/diffusers_patch/solver.py
    run_sampling(solver="dpm2", determistic=True) → dpm_step(order=2)], with x̂0 = x − σ·v̂,
    α = 1 − σ, λ = log(α/σ), h = λ_{k+1} − λ_k:
        step 0 and the last step: DDIM with η = 0 (ddim_update): x' = (1 − σ')·x̂0 + σ'·ε̂,
            ε̂ = (x − (1 − σ)·x̂0)/σ  (the last step lands on x̂0 since σ' = 0)
        every other step: second-order multistep (multistep_dpm_solver_second_order_update):
            x' = (σ'/σ)·x + α'(1 − e^{−h})·(D0 + D1/2),
            D0 = x̂0_k,  D1 = (h/h_prev)·(x̂0_k − x̂0_{k−1})
    When the previous time is σ = 1 (α = 0, λ = −∞), h_prev = ∞ and D1 = 0: step 1 is first
    order, as upstream's arithmetic gives (1/∞ = 0). Upstream's "lower_order_second" flag never
    lowers the order here (its `order == 2` test comes first): the second-to-last step is second
    order. This equals vgrpo.dpmpp2m_sample (tested).

    Args: velocity_fn (x (M, *D), t (M,), cond) → v (M, *D); x1 (M, *D) initial noise; sigmas
        (K + 1,) decreasing from 1 to 0. Returns x0 (M, *D), accumulated in fp32 as upstream's
        (float64 for float64 input, as the tests use). K network calls."""
    sig = [float(s) for s in sigmas]
    K = len(sig) - 1
    lam = lambda s: -math.inf if s >= 1.0 else math.log((1.0 - s) / s)      # noqa: E731
    x, prev = x1.to(torch.promote_types(x1.dtype, torch.float32)), None
    for i in range(K):
        s, s_next = sig[i], sig[i + 1]
        t = torch.full((x.shape[0],), s, device=x.device, dtype=torch.float32)           # (M,)
        x0_hat = x - s * velocity_fn(x, t, cond).to(x.dtype)                             # (M, *D)
        if i == 0 or i == K - 1:                                    # ddim_update, η = 0
            eps_hat = (x - (1.0 - s) * x0_hat) / s
            x = (1.0 - s_next) * x0_hat + s_next * eps_hat
        else:                                                       # second-order multistep
            h, h_prev = lam(s_next) - lam(s), lam(s) - lam(sig[i - 1])
            d1 = 0.0 if math.isinf(h_prev) else (h / h_prev) * (x0_hat - prev)
            c = (1.0 - s_next) * (1.0 - math.exp(-h))               # −α'(e^{−h} − 1)
            x = (s_next / s) * x + c * x0_hat + 0.5 * c * d1
        prev = x0_hat
    return x


SAMPLERS = {"dpm2": dpm2_sample,
            "flow": V.euler_sample}   # solver.py flow_grpo_step with η = 0 is an Euler step


# ------------------------------------------------------------------------------------------------
# The two adapters: "default" is θ (trained), "old" the sampling policy (soft-updated).
# ------------------------------------------------------------------------------------------------
def add_old_adapter(transformer, lora_cfg) -> tuple[list, list]:
    """A second LoRA named "old" with the same config, holding a copy of "default"
    [train_nft_sd3.py main(): transformer.add_adapter("old", transformer_lora_config), then the
    copy before the loop]. diffusers' add_adapter makes the new adapter active; "default" is made
    active again (peft's set_adapter also gives requires_grad to the active adapter only).
    Returns (θ tensors, old tensors), matched by name."""
    if OLD not in getattr(transformer, "peft_config", {}):
        with warnings.catch_warnings():          # peft warns that a second adapter is added
            warnings.simplefilter("ignore", UserWarning)
            transformer.add_adapter(copy.deepcopy(lora_cfg), adapter_name=OLD)
    transformer.set_adapter("default")
    named = dict(transformer.named_parameters())
    theta = [p for n, p in named.items() if ".lora_" in n and ".default." in n]
    old = [named[n.replace(".default.", f".{OLD}.")] for n, p in named.items()
           if ".lora_" in n and ".default." in n]
    for o in old:
        o.data = o.data.float()                      # fp32, as vgrpo.add_lora keeps "default"
    soft_update_(old, theta, 0.0)
    return theta, old


@contextlib.contextmanager
def adapter_active(transformer, name: str):
    """Forwards inside run with adapter `name`; "default" is active again afterwards."""
    transformer.set_adapter(name)
    try:
        yield
    finally:
        transformer.set_adapter("default")


@contextlib.contextmanager
def adapters_off(transformer):
    """The reference policy: the base weights, every adapter disabled [train_nft_sd3.py main():
    `with transformer.disable_adapter()`]; enabling them again restores "default"'s grads."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


# ------------------------------------------------------------------------------------------------
# State, one iteration, the evaluation weights.
# ------------------------------------------------------------------------------------------------
def init_state(run, **overrides) -> dict:
    """Everything DiffusionNFT carries across iterations, for a vgrpo.Run from vgrpo.setup:
    the recipe (RECIPE with `overrides`), the old adapter (created on run.adapter.transformer
    and synced to θ), the EMA of θ (flow_grpo_sd3.LoraEMA at decay 0.9, every step: ema.py as
    train_nft_sd3.py builds it), the optimizer-step counter and the rollout grid. Calling it again
    on the same run re-syncs the old adapter and starts a new count."""
    unknown = sorted(set(overrides) - set(RECIPE))
    run_level = sorted(set(overrides) & set(RUN_LEVEL))
    if unknown or run_level:
        raise ValueError(f"unknown recipe keys {unknown}" if unknown else
                         f"{run_level} are vgrpo flags (vgrpo.setup builds the run from them)")
    rec = {**RECIPE, **overrides}
    if run.world > 1:
        raise V.ConfigError("examples/baselines/diffusion_nft_sd3.py runs in one process "
                            "(not torchrun)")
    if run.lora_cfg is None or type(run.adapter) is not V.SD3Adapter:
        raise V.ConfigError("DiffusionNFT here needs an SD3 pipeline with LoRA (no "
                            "--full_finetune, no FLUX): its old policy is a second adapter")
    if rec["solver"] not in SAMPLERS:
        raise ValueError(f"solver {rec['solver']!r}: one of {sorted(SAMPLERS)}")
    T = int(rec["num_steps"] * rec["timestep_fraction"])
    N = run.args.prompts_per_iter * run.args.group_size
    if T < 1 or rec["beta"] <= 0 or not 1 <= rec["opt_steps"] <= N:
        raise ValueError(f"need int(num_steps · timestep_fraction) ≥ 1 (got {T}), beta > 0 (got "
                         f"{rec['beta']}) and 1 ≤ opt_steps ≤ {N} (got {rec['opt_steps']})")
    theta, old = add_old_adapter(run.adapter.transformer, run.lora_cfg)
    ema = (FG.LoraEMA(run.params, decay=rec["ema_decay"], interval=rec["ema_interval"])
           if rec["ema"] else None)
    return {"recipe": rec, "step": 0, "theta": theta, "old": old, "ema": ema, "T": T,
            "sigmas": run.adapter.sigmas(rec["num_steps"])}


def nft_iteration(run, it: int, state: dict) -> dict:
    """One DiffusionNFT iteration (steps 1–4 of the docstring) on a vgrpo.Run; state from
    init_state (its "step" counts optimizer steps). Returns host-side metrics."""
    args, ad, rec = run.args, run.adapter, state["recipe"]
    tr = ad.transformer
    P, G = args.prompts_per_iter, args.group_size
    N, K, T = P * G, len(state["sigmas"]) - 1, state["T"]
    times, t0 = {}, time.perf_counter()

    # 1. rollout: the old adapter, deterministic solve, no CFG; prompts and x1 as vgrpo draws them
    with V.timed(times, "time_rollout", run.dev):
        n_tr, g = len(run.train_prompts), V.generator(args.seed, it, V.Stream.PROMPTS)
        pick = (torch.randperm(n_tr, generator=g)[:P] if P <= n_tr
                else torch.randint(n_tr, (P,), generator=g))
        prompts = [run.train_prompts[i] for i in pick.tolist()]
        cond = ad.encode(prompts)                                           # P rows
        prompt_idx = (torch.arange(N) // G).to(run.dev)                     # (N,)
        g = V.generator(args.seed, it, V.Stream.ROLLOUT_NOISE)
        x1 = torch.randn((N,) + run.D, generator=g).to(run.dev)
        with adapter_active(tr, OLD), torch.no_grad():
            x0 = torch.cat([_solve(rec["solver"], ad, x1[rows], V.select(cond, prompt_idx[rows]),
                                   state["sigmas"], run.ctx)
                            for rows in torch.arange(N).split(args.rollout_batch)])   # (N, *D)

    # 2. rewards (multi_score's weighted sum "avg"), per-prompt stat-tracker advantages
    with V.timed(times, "time_reward"):
        rw, sample_prompts = run.rewards, [prompts[i // G] for i in range(N)]
        raw, _ = V.decode_and_reward(ad, rw, [n for n, _ in rw.train_terms], x0, sample_prompts,
                                     args.reward_batch)
        w = torch.tensor([wt for _, wt in rw.train_terms])[:, None]        # (R, 1)
        total = (V.training_values(raw, rw.train_terms) * w).sum(0)       # (N,)
        adv = FG.stat_tracker_advantages(sample_prompts, total, global_std=rec["global_std"],
                                         eps=rec["std_eps"])               # (N,) float64
        group_std = total.view(P, G).double().std(dim=1, unbiased=False)   # (P,), for logging
        adv = adv.to(run.dev)

    # 3. training, 4. the old adapter's soft update
    with V.timed(times, "time_update", run.dev):
        stats, grad_norms = _train(run, state, x0, cond, prompt_idx, adv, it)
        decay = return_decay(state["step"], rec["decay_flat"], rec["decay_uprate"],
                             rec["decay_uphold"])
        soft_update_(state["old"], state["theta"], decay)

    host = {k: torch.stack(v).double().mean() for k, v in stats.items()}
    host["grad_norm"] = torch.stack(grad_norms).double().mean()
    host = dict(zip(host, torch.stack(list(host.values())).cpu().tolist()))     # one host copy
    mean, std = V._finite_mean_std(V.headline(raw, rw.train_terms))
    nfe_ref = T if rec["kl_coef"] > 0 else 0
    return {"method": "diffusion_nft", "iter": it, "reward_mean": mean, "reward_std": std,
            "reward_unit": V.reward_unit(rw.train_terms), **times,
            "time_iter": time.perf_counter() - t0, **host, "opt_steps": len(grad_norms),
            "optimizer_steps_total": state["step"], "old_decay": decay,
            "adv_abs_mean": float(adv.abs().mean()),
            "zero_std_ratio": float((group_std == 0).double().mean()),
            "nfe_rollout": K, "nfe_theta": T, "nfe_old": T, "nfe_ref": nfe_ref,
            "nfe_total": N * (K + 2 * T + nfe_ref), "n_trained_samples": N,
            "lr": run.opt.param_groups[0]["lr"]}


@torch.no_grad()
def _solve(solver: str, ad, x1: torch.Tensor, cond, sigmas, ctx) -> torch.Tensor:
    with ctx:
        return SAMPLERS[solver](ad.velocity, x1, sigmas, cond).float()


def _train(run, state: dict, x0: torch.Tensor, cond, prompt_idx: torch.Tensor, adv: torch.Tensor,
           it: int):
    """Step 3 [train_nft_sd3.py main(), TRAINING]: shuffled samples, T of the K rollout times per
    sample (a random permutation's first T), opt_steps optimizer steps each accumulating over its
    share of the samples × T times; three forwards per (micro-batch, time): old, θ, reference.
    The EMA moves after every optimizer step. Returns ({stat: [tensors]}, [grad norms])."""
    args, ad, rec = run.args, run.adapter, state["recipe"]
    tr, N, T = ad.transformer, len(x0), state["T"]
    times = state["sigmas"][:-1].float()                                   # (K,) the rollout's
    perm = torch.randperm(N, generator=V.generator(args.seed, it, V.Stream.MINIBATCHES))  # shuffle
    g_t = V.generator(args.seed, it, baseline_cli.Stream.TIMES)
    g_eps = V.generator(args.seed, it, baseline_cli.Stream.STEP_NOISE)
    t_all = torch.stack([times[torch.randperm(len(times), generator=g_t)[:T]]
                         for _ in range(N)])                               # (N, T) per sample
    stats, grad_norms = {}, []
    for part in perm.tensor_split(rec["opt_steps"]):
        for rows in part.split(args.micro_batch):
            c, xr = V.select(cond, prompt_idx[rows.to(run.dev)]), x0[rows.to(run.dev)]
            for j in range(T):
                t = t_all[rows, j].to(run.dev)                              # (m,)
                eps = torch.randn(xr.shape, generator=g_eps).to(run.dev)   # (m, *D) fresh noise
                x_t = V.interpolate(xr, eps, t)                            # (m, *D)
                with torch.no_grad(), adapter_active(tr, OLD), run.ctx:
                    v_old = ad.velocity(x_t, t, c)
                with run.ctx:
                    v = ad.velocity(x_t, t, c)
                v_ref = None
                if rec["kl_coef"] > 0:
                    with torch.no_grad(), adapters_off(tr), run.ctx:
                        v_ref = ad.velocity(x_t, t, c)
                loss, st = nft_loss(v, v_old, v_ref, xr, x_t, t, adv[rows.to(run.dev)],
                                    beta=rec["beta"], adv_clip_max=rec["adv_clip_max"],
                                    kl_coef=rec["kl_coef"], mae_floor=rec["mae_floor"])
                # the mean over the step's samples and the T times (upstream: loss / accumulation)
                run.scaler.scale(loss * (len(rows) / (len(part) * T))).backward()
                for k, s in st.items():
                    stats.setdefault(k, []).append(s)
        grad_norms.append(V.optimizer_step(run))          # unscale, clip 1.0, AdamW, zero grads
        state["step"] += 1
        if state["ema"] is not None:
            state["ema"].step(state["step"])              # train_nft_sd3.py: ema.step(global_step)
    return stats, grad_norms


@contextlib.contextmanager
def eval_weights(run, state: dict):
    """Inside, "default" holds what DiffusionNFT evaluates and saves: the EMA of θ
    [train_nft_sd3.py eval_fn / save_ckpt: ema.copy_ema_to(...), then copy_temp_to(...)], or θ
    itself when the recipe has ema=False; θ is restored on exit."""
    run.adapter.transformer.set_adapter("default")
    ema = state.get("ema")
    if ema is not None:
        ema.swap()
    try:
        yield
    finally:
        if ema is not None:
            ema.swap()


# ------------------------------------------------------------------------------------------------
# Command line: this script's flags; anything else goes to vgrpo's parser (same names there).
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    a = p.add_argument
    a("--recipe", default="sd3_pickscore", choices=tuple(RECIPES),
      help="upstream config (config/nft.py)")
    add_run_flags(p, dtype_help="compute dtype; auto = fp16 on CUDA (config/base.py), fp32 on CPU",
                  iterations_help="iterations (upstream epochs)",
                  out_default="runs/diffusion_nft_sd3-<model>-<reward>-<date>")
    a("--nft_steps", type=int, default=None, help="override the recipe's rollout steps K")
    a("--beta", type=float, default=None, help="override the recipe's mixing β")
    a("--kl_coef", type=float, default=None, help="override the recipe's β_KL")
    a("--decay_type", type=int, default=None, choices=tuple(DECAY_TYPES),
      help="override the recipe's old-adapter decay schedule (return_decay's type)")
    a("--opt_steps", type=int, default=None, help="override: optimizer steps per iteration")
    a("--timestep_fraction", type=float, default=None, help="override: T = int(f · K)")
    a("--adv_clip_max", type=float, default=None, help="override A_max")
    a("--no_ema", action="store_true", help="evaluate and save θ instead of its EMA")
    return p


def parse(argv=None):
    """argv → (options with .rec, the recipe's overrides for init_state; vgrpo.Args):
    baseline_cli.parse, with upstream's fp16 on CUDA for --dtype auto."""
    return baseline_cli.parse(build_parser(), recipe, argv, cuda_dtype="fp16")


def recipe(mine, args) -> dict:
    """The --recipe's settings for init_state (its run-level ones are vgrpo's flags), with this
    script's overrides."""
    over = {k: v for k, v in RECIPES[mine.recipe].items() if k not in RUN_LEVEL}
    for flag, key in (("nft_steps", "num_steps"), ("beta", "beta"), ("kl_coef", "kl_coef"),
                      ("opt_steps", "opt_steps"), ("timestep_fraction", "timestep_fraction"),
                      ("adv_clip_max", "adv_clip_max")):
        if getattr(mine, flag) is not None:
            over[key] = getattr(mine, flag)
    if mine.decay_type is not None:
        flat, uprate, uphold = DECAY_TYPES[mine.decay_type]
        over.update(decay_flat=flat, decay_uprate=uprate, decay_uphold=uphold)
    if mine.no_ema:
        over["ema"] = False
    return over


def main(argv=None) -> list[dict]:
    """Train, evaluate (every --eval_every iterations and at the end, through eval_weights), write
    metrics.jsonl, recipe.json and lora_diffusion_nft/. Returns the metrics lines."""
    mine, args = parse(argv)
    over = mine.rec
    tag = "+".join(n.split(":")[-1] for n, _ in V.parse_reward_spec(args.reward))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(mine.out or f"runs/diffusion_nft_sd3-{Path(args.model).name}-{tag}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    run = V.setup(args)
    state = init_state(run, **over)
    (out / "recipe.json").write_text(json.dumps(
        {"recipe": mine.recipe, **state["recipe"], "P": args.prompts_per_iter,
         "G": args.group_size, "lr_used": args.lr, "dtype_used": str(run.dtype),
         "T": state["T"], "micro_batch": args.micro_batch}, indent=2))
    lines, mpath = [], out / "metrics.jsonl"
    mpath.write_text("")

    def emit(m: dict) -> None:
        lines.append(m)
        with open(mpath, "a") as fh:
            fh.write(json.dumps(m) + "\n")

    def evaluation(it: int) -> None:
        with eval_weights(run, state):
            ev = V.evaluate(run, it)
        emit({"method": "diffusion_nft", **ev, "ema": state["ema"] is not None})
        print(f"eval at iteration {it}: reward {ev['eval_reward_mean']:.4f}")

    for it in range(mine.iterations):
        if args.eval_every and it % args.eval_every == 0:
            evaluation(it)
        m = nft_iteration(run, it, state)
        emit(m)
        print(f"DiffusionNFT iter {it}  reward {m['reward_mean']:.4f}  loss {m['loss']:.4g}  "
              f"kl {m.get('kl_div', 0.0):.2e}  grad {m['grad_norm']:.3g}  old decay "
              f"{m['old_decay']:.3f}  {m['time_iter']:.2f}s")
    evaluation(mine.iterations)
    from peft.utils import get_peft_model_state_dict
    with eval_weights(run, state):                # upstream's save_ckpt saves the EMA
        run.adapter.save_lora(str(out / "lora_diffusion_nft"),
                              get_peft_model_state_dict(run.adapter.transformer,
                                                        adapter_name="default"), run.lora_cfg)
    print(f"wrote {out}/ (metrics.jsonl, recipe.json, lora_diffusion_nft/)")
    return lines


if __name__ == "__main__":
    main()
