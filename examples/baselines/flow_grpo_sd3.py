"""Flow-GRPO (the MDP baseline) at its own published settings, next to V-GRPO, on the SD3 path.

Flow-GRPO (Liu et al. 2025; peer X1) turns the sampler into an MDP: rollouts are SDE solves
whose every step is a Gaussian policy π_θ(x_{i+1} | x_i); the per-step log-probs are stored during
the rollout, and training recomputes the log-prob of every trained step with gradients and applies
a PPO-clipped per-step ratio. V-GRPO (vgrpo.py) treats the whole generation as ONE action:
deterministic ODE rollouts, then N_MC surrogate forwards for θ_old and N_MC with grad for θ.

This script trains either or both from the same LoRA initialisation, on the same prompts and
initial noises, and writes the per-iteration cost of each phase side by side.

    python examples/baselines/flow_grpo_sd3.py              # tiny SD3 pipeline, CPU, both methods
    python examples/baselines/flow_grpo_sd3.py --methods flow_grpo --model DIR --reward mymod:fn \\
        --prompts train.txt --eval_prompts test.txt --iterations 30 --out runs/flow
    python examples/baselines/flow_grpo_sd3.py --model sd3.5-medium --reward pickscore      # one GPU

Output folder (--out, default runs/flow_grpo_sd3-<model>-<reward>-<date>/): metrics.jsonl (one
line per iteration and per evaluation, each with its "method"), table.md and summary.json (the
cost table), lora_<method>/ (the trained LoRA in diffusers' format, loadable with
StableDiffusion3Pipeline.load_lora_weights or vgrpo.load_trainable). `main(argv)` runs it in-process
and returns the metrics lines. Any vgrpo.py flag not listed under --help here is passed through to
V-GRPO's own parser (--num_steps, --n_mc, --micro_batch, --resolution, ...).

Recipes (--recipe), every number from yifan123/flow_grpo (config/base.py, config/grpo.py,
scripts/train_sd3.py, flow_grpo/stat_tracking.py, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py,
README FAQ):
  cfg4.5  the paper's SD3.5-M recipe (grpo.py: pickscore_sd3 / geneval_sd3 / general_ocr_sd3):
          10 SDE steps ("sde", noise level a = 0.7), CFG 4.5 with the empty prompt as negative in
          rollouts AND in the recomputed log-probs (one batched [uncond; cond] forward; the
          unconditional half detached in training as train_sd3.py's compute_log_prob did in
          July 2025 — its later versions let the gradient through both halves: --cfg_grad both),
          trains
          the first int(0.99·K) steps, clip ε = 1e-4, KL to the reference (LoRA off) with
          β = 0.01 (pickscore), 0.02 (clipscore), 0.04 (geneval, ocr; used for any other reward).
  nocfg   their no-CFG "fast" recipe (grpo.py: pickscore_sd3_fast_nocfg / geneval_sd3_fast_nocfg):
          guidance 1 in rollout and training, coefficients-preserving sampling ("cps", a = 0.8)
          inside a window of 3 consecutive SDE steps placed in the first K/2 steps (ODE outside),
          only the window trained, clip ε = 1e-5, β = 0.
  plain   this script's earlier, aggressive variant (kept for comparison, not Flow-GRPO's): no CFG,
          "sde" a = 0.7, ε = 1e-4, int(0.99·K) steps, β = 0, zero-advantage samples kept.
Common to all (config/base.py, grpo.py, train_sd3.py): per-prompt stat tracker advantages — mean of
the prompt's group, std of ALL rewards of the iteration (population std) + 1e-4 — clamped at ±5 in
the loss; samples whose advantage is exactly 0 are dropped before training (then random dropped
ones re-admitted until the count divides into the batches, as train_sd3.py); 2 optimizer steps per
iteration (gradient_accumulation_steps = num_batches_per_epoch // 2); AdamW lr 3e-4 (base.py;
here --lr, default vgrpo's per-model preset, 3e-4 at SD3.5), wd 1e-4, grad-norm clip 1.0;
the SAME batch size for sampling and training (README FAQ; --batch); fp16 autocast on CUDA (README
FAQ: "use fp16 … whenever possible", bf16 only for FLUX/Wan), fp32 on CPU; an EMA of the LoRA
(flow_grpo/ema.py, decay 0.9 every 8 optimizer steps; grpo.py train.ema = True) is what the final
evaluation scores and what lora_flow_grpo/ holds (--no_ema: the trained weights; both are logged).
Not reproduced: its rollout casts the two CFG halves to fp16 before combining them while its
training pass combines them in fp32 — here both passes run the same code, so the ratio is exactly
1 before the first optimizer step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # never wait on a hub look-up (tiny model)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import vgrpo as V
import baseline_cli
from baseline_cli import add_run_flags

# Flow-GRPO's published recipes (module docstring for the sources).
RECIPES = {
    "cfg4.5": dict(guidance=4.5, sde_type="sde", noise_level=0.7, clip_range=1e-4, beta=None,
                   timestep_fraction=0.99, window=0, filter_zero_adv=True),
    "nocfg": dict(guidance=1.0, sde_type="cps", noise_level=0.8, clip_range=1e-5, beta=0.0,
                  timestep_fraction=1.0, window=3, filter_zero_adv=True),
    "plain": dict(guidance=1.0, sde_type="sde", noise_level=0.7, clip_range=1e-4, beta=0.0,
                  timestep_fraction=0.99, window=0, filter_zero_adv=False),
}
# β of the KL to the reference per reward in config/grpo.py (pickscore_sd3 0.01, clipscore_sd3 0.02,
# geneval_sd3 and general_ocr_sd3 0.04); any other reward gets the prompt-alignment value 0.04.
KL_BETA = {"pickscore": 0.01, "clipscore": 0.02}
KL_BETA_OTHER = 0.04
METHODS = ("vgrpo", "flow_grpo")
LABEL = {"vgrpo": "V-GRPO", "flow_grpo": "Flow-GRPO"}


# ------------------------------------------------------------------------------------------------
# Command line: this script's flags; anything else goes to vgrpo's parser (same names there).
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    a = p.add_argument
    a("--methods", default="vgrpo,flow_grpo",
      help="comma-separated: vgrpo, flow_grpo (run in this order)")
    a("--recipe", default="cfg4.5", choices=tuple(RECIPES),
      help="Flow-GRPO recipe (see the docstring)")
    add_run_flags(p, dtype_help="compute dtype; auto = Flow-GRPO fp16 and V-GRPO bf16 on CUDA, "
                  "fp32 on CPU", iterations_help="iterations of each method",
                  out_default="runs/flow_grpo_sd3-<model>-<reward>-<date>")
    a("--flow_steps", type=int, default=10,
      help="Flow-GRPO's SDE steps K (grpo.py: sample.num_steps = 10); V-GRPO's: --num_steps")
    a("--batch", type=int, default=None,
      help="Flow-GRPO samples per rollout AND per training forward (README FAQ: the same); "
      "default: the largest divisor of P·G/2 that is ≤ vgrpo's --micro_batch")
    a("--flow_mu", type=int, default=2, help="Flow-GRPO optimizer steps per iteration (grpo.py: 2)")
    a("--guidance", type=float, default=None, help="override the recipe's CFG scale (1 = no CFG)")
    a("--noise_level", type=float, default=None, help="override the recipe's SDE noise level a")
    a("--clip_range", type=float, default=None, help="override the recipe's per-step ratio clip ε")
    a("--beta", type=float, default=None, help="override the recipe's KL coefficient β")
    a("--timestep_fraction", type=float, default=None,
      help="override: train the first int(f·K) steps")
    a("--no_filter_zero_adv", action="store_true", help="keep samples whose advantage is exactly 0")
    a("--no_ema", action="store_true", help="evaluate and save the trained LoRA instead of "
      "Flow-GRPO's EMA of it (grpo.py: train.ema = True)")
    a("--cfg_grad", default="detached", choices=("detached", "both"),
      help="with CFG, gradient through the conditional half only (train_sd3.py, July 2025) or "
      "through both halves (its later versions)")
    return p


def parse(argv=None):
    """argv → (options with .rec, the Flow-GRPO recipe; vgrpo.Args): baseline_cli.parse."""
    return baseline_cli.parse(build_parser(), recipe, argv)


def recipe(mine, args) -> dict:
    """The --recipe with this script's overrides; also resolves --methods and --batch on mine.
    Raises ValueError with one line per problem."""
    rec = dict(RECIPES[mine.recipe])
    for k in ("guidance", "noise_level", "clip_range", "beta", "timestep_fraction"):
        if getattr(mine, k) is not None:
            rec[k] = getattr(mine, k)
    if mine.no_filter_zero_adv:
        rec["filter_zero_adv"] = False
    if rec["beta"] is None:
        names = [n for n, _ in V.parse_reward_spec(mine.reward)]
        rec["beta"] = max(KL_BETA.get(n, KL_BETA_OTHER) for n in names)
    mine.methods = [m.strip() for m in mine.methods.split(",") if m.strip()]
    N = args.prompts_per_iter * args.group_size
    problems = []
    if not mine.methods or any(m not in METHODS for m in mine.methods):
        problems.append(f"--methods must name some of {', '.join(METHODS)} (got {mine.methods})")
    if mine.iterations < 1 or mine.flow_steps < 2:
        problems.append("need --iterations ≥ 1 and --flow_steps ≥ 2")
    if not 1 <= mine.flow_mu <= N or N % mine.flow_mu:
        problems.append(f"--flow_mu {mine.flow_mu} must divide the {N} samples of an iteration")
    if mine.batch is None and 1 <= mine.flow_mu <= N:
        per = N // mine.flow_mu
        mine.batch = max(d for d in range(1, per + 1)
                         if per % d == 0 and d <= max(1, args.micro_batch))
    if mine.batch is not None and (mine.batch < 1 or N % (mine.batch * mine.flow_mu)):
        problems.append(f"--batch {mine.batch} × --flow_mu {mine.flow_mu} must divide the {N} "
                        "samples")
    if rec["window"] and rec["window"] > mine.flow_steps // 2:
        problems.append(f"the nocfg recipe's SDE window of {rec['window']} steps needs "
                        f"--flow_steps ≥ {2 * rec['window']}")
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))
    return rec


# ------------------------------------------------------------------------------------------------
# Flow-GRPO's advantages (flow_grpo/stat_tracking.py, PerPromptStatTracker with global_std=True).
# ------------------------------------------------------------------------------------------------
def stat_tracker_advantages(prompts: list[str], rewards: torch.Tensor, global_std: bool = True,
                            eps: float = 1e-4) -> torch.Tensor:
    """(r − mean of the samples with the same prompt string) / (std + eps), std over ALL rewards
    (global_std) or over the prompt's samples, population std (numpy's default). rewards (N,) →
    advantages (N,) fp64. No clamp here: train_sd3.py clamps at ±adv_clip_max in the loss."""
    r = rewards.double()
    adv = torch.empty_like(r)
    glob = r.std(unbiased=False) + eps
    for p in dict.fromkeys(prompts):
        rows = torch.tensor([i for i, q in enumerate(prompts) if q == p])
        g = r[rows]
        adv[rows] = (g - g.mean()) / (glob if global_std else g.std(unbiased=False) + eps)
    return adv


def keep_mask(adv: torch.Tensor, num_batches: int, generator: torch.Generator) -> torch.Tensor:
    """train_sd3.py's filter: drop samples whose advantage is exactly 0, then re-admit random
    dropped ones until the kept count divides by the number of batches (if enough were dropped).
    Returns (N,) bool."""
    mask = adv != 0
    short = (-int(mask.sum())) % num_batches
    dropped = torch.nonzero(~mask).flatten()
    if short and len(dropped) >= short:
        mask[dropped[torch.randperm(len(dropped), generator=generator)[:short]]] = True
    return mask


# ------------------------------------------------------------------------------------------------
# Flow-GRPO's SDE steps and log-probs (pure; flow_grpo/diffusers_patch/sd3_sde_with_logprob.py).
#   "sde": s_t = a·sqrt(σ/(1−σ)) (σ = 1 → sigmas[1] in the denominator), Δ = σ' − σ < 0,
#     μ_θ = x·(1 + s_t²Δ/(2σ)) + v_θ·(1 + s_t²(1−σ)/(2σ))·Δ,     x' = μ_θ + s_t·sqrt(−Δ)·ξ,
#     log p = mean_elements[ −(x' − μ_θ)²/(2 s_t²(−Δ)) − log(s_t sqrt(−Δ)) − ½ log 2π ].
#   "cps" (coefficients-preserving): s_t = σ'·sin(aπ/2), x̂0 = x − σv, x̂1 = x + (1−σ)v,
#     μ_θ = (1−σ')·x̂0 + sqrt(σ'² − s_t²)·x̂1,   x' = μ_θ + s_t·ξ,
#     log p = −mean_elements (x' − μ_θ)²
#     (their code drops every constant and the 1/(2 s_t²) — hence the smaller ε = 1e-5).
#   Returned kl_std is their std_dev_t, the denominator of the KL term in train_sd3.py.
# ------------------------------------------------------------------------------------------------
def sde_step(x: torch.Tensor, v: torch.Tensor, s: float, s_next: float, noise_level: float,
             sigma_max: float, x_next: torch.Tensor | None = None,
             noise: torch.Tensor | None = None, sde_type: str = "sde"):
    """One stochastic step from σ = s to σ' = s_next (< s) and its per-sample log-prob.

    x, v: (M, *D); the step is sampled with `noise` (M, *D) when x_next is None, else x_next is the
    stored next state whose log-prob is evaluated (the training pass).
    Returns x_next (M, *D) fp32, log_prob (M,) fp32 (differentiable through v), the mean μ_θ
    (M, *D), kl_std (float).
    """
    x, v = x.float(), v.float()
    if sde_type == "sde":
        dt = s_next - s                                                          # < 0
        std_t = noise_level * math.sqrt(s / (1 - (sigma_max if s == 1.0 else s)))
        mean = x * (1 + std_t ** 2 / (2 * s) * dt) + v * (1 + std_t ** 2 * (1 - s) / (2 * s)) * dt
        step_std = std_t * math.sqrt(-dt)
    elif sde_type == "cps":
        std_t = s_next * math.sin(noise_level * math.pi / 2)
        mean = (x - s * v) * (1 - s_next) + (x + (1 - s) * v) * math.sqrt(s_next ** 2 - std_t ** 2)
        step_std = std_t
    else:
        raise ValueError(f"unknown sde_type {sde_type!r}")
    if x_next is None:
        x_next = mean + step_std * noise.float()
    sq = (x_next.detach().float() - mean) ** 2
    if sde_type == "sde":
        log_prob = -sq / (2 * step_std ** 2) - math.log(step_std) - 0.5 * math.log(2 * math.pi)
    else:
        log_prob = -sq
    return x_next, log_prob.flatten(1).mean(dim=1), mean, std_t


def flow_grpo_loss(logp_new, logp_old, adv, clip_range):
    """PPO-clip on ONE step's ratio r = exp(log p_θ − log p_old), mean over samples (minimise)."""
    ratio = torch.exp(logp_new - logp_old.detach())                                  # (m,)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)).mean()
    return loss, ratio


def kl_to_reference(mean: torch.Tensor, mean_ref: torch.Tensor, kl_std: float) -> torch.Tensor:
    """train_sd3.py's KL term: mean over samples of mean_elements (μ_θ − μ_ref)² / (2·s_t²)."""
    return ((mean - mean_ref.detach()) ** 2).flatten(1).mean(dim=1).div(2 * kl_std ** 2).mean()


class LoraEMA:
    """Flow-GRPO's EMA of the trainable weights, as read in yifan123/flow_grpo:
    scripts/train_sd3.py builds `EMAModuleWrapper(transformer_trainable_parameters, decay=0.9,
    update_step_interval=8)` (flow_grpo/ema.py) and calls `ema.step(params, global_step)` after
    every training batch, global_step counting optimizer steps; its eval() and save_ckpt() copy
    the EMA into the model first (`copy_ema_to`) and back after; config/grpo.py sets
    `train.ema = True` for its SD3 configs (config/base.py's default is False).
    step(n) moves the copy by (1 − min((1 + n)/(10 + n), 0.9)) when (n + 1) % 8 == 0 (ema.py's
    get_current_decay); swap() exchanges trained and EMA weights in place (evaluate, swap back)."""

    def __init__(self, params: list, decay: float = 0.9, interval: int = 8):
        self.params, self.decay, self.interval = params, decay, interval
        self.ema = [q.detach().clone() for q in params]

    @torch.no_grad()
    def step(self, n: int) -> None:
        if (n + 1) % self.interval == 0:
            w = 1 - min((1 + n) / (10 + n), self.decay)
            for e, q in zip(self.ema, self.params):
                e.add_(w * (q.detach() - e))

    @torch.no_grad()
    def swap(self) -> None:
        for e, q in zip(self.ema, self.params):
            tmp = q.detach().clone()
            q.copy_(e)
            e.copy_(tmp)


class Guided:
    """Velocity with classifier-free guidance, Flow-GRPO's layout: one forward on [uncond; cond],
    v = v_u + w·(v_c − v_u), the unconditional half detached if detach_uncond (train_sd3.py
    compute_log_prob, July 2025; later versions keep its gradient). w = 1 is the plain
    conditional velocity (their guidance 1: no unconditional forward)."""

    def __init__(self, adapter, uncond: dict, scale: float, detach_uncond: bool = True):
        self.adapter, self.uncond, self.scale = adapter, uncond, scale
        self.detach_uncond = detach_uncond

    @property
    def forwards(self) -> int:
        """Transformer forwards per sample per step (2 with CFG)."""
        return 1 if self.scale == 1.0 else 2

    def velocity(self, x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:
        if self.scale == 1.0:
            return self.adapter.velocity(x, t, c).float()
        m = len(x)
        cc = {k: torch.cat([self.uncond[k].expand(m, *self.uncond[k].shape[1:]), c[k]]) for k in c}
        vu, vc = self.adapter.velocity(torch.cat([x, x]), torch.cat([t, t]), cc).float().chunk(2)
        if self.detach_uncond:
            vu = vu.detach()
        return vu + self.scale * (vc - vu)


def step_plan(K: int, rec: dict, generator: torch.Generator) -> tuple[list[bool], list[int]]:
    """Which of the K steps are stochastic, and which are trained.
    Full SDE: all stochastic, the first int(K·timestep_fraction) trained (train_sd3.py).
    Window (nocfg): `window` consecutive steps from a start drawn uniformly in [0, K//2 − window]
    (grpo.py: sde_window_range = (0, num_steps//2)), ODE elsewhere; the window is trained."""
    if rec["window"]:
        start = int(torch.randint(0, K // 2 - rec["window"] + 1, (1,), generator=generator))
        sde = [start <= i < start + rec["window"] for i in range(K)]
        return sde, [i for i in range(K) if sde[i]]
    return [True] * K, list(range(max(1, int(K * rec["timestep_fraction"]))))


@torch.no_grad()
def sde_rollout(guided, x1, cond, prompt_idx, sigmas, rec, sde, batch, ctx, generator):
    """Solve every row of x1 (N, *D), `batch` rows at a time, storing the trajectory.
    Returns traj (N, K + 1, *D) fp32 (traj[:, 0] = x1) and the old log-probs (N, K) fp32 (0 on the
    deterministic steps) — Flow-GRPO's θ_old terms come free with the rollout."""
    sig = [float(s) for s in sigmas]
    K = len(sig) - 1
    noise = torch.randn((len(x1), K) + tuple(x1.shape[1:]), generator=generator).to(x1.device)
    trajs, logps = [], []
    for rows in torch.arange(len(x1), device=x1.device).split(batch):
        c = V.select(cond, prompt_idx[rows])
        x, traj, lp = x1[rows].float(), [x1[rows].float()], []
        for i in range(K):
            t = torch.full((len(rows),), sig[i], device=x.device)
            with ctx:
                v = guided.velocity(x, t, c)
            if sde[i]:
                x, logp, _, _ = sde_step(x, v, sig[i], sig[i + 1], rec["noise_level"], sig[1],
                                         noise=noise[rows, i], sde_type=rec["sde_type"])
            else:
                x = x + v.float() * (sig[i + 1] - sig[i])                     # ODE step
                logp = torch.zeros(len(rows), device=x.device)
            traj.append(x)
            lp.append(logp)
        trajs.append(torch.stack(traj, dim=1))
        logps.append(torch.stack(lp, dim=1))
    return torch.cat(trajs), torch.cat(logps)


# ------------------------------------------------------------------------------------------------
# One Flow-GRPO iteration (same prompt and x1 streams as vgrpo.iteration()).
# ------------------------------------------------------------------------------------------------
def flow_grpo_iteration(mine, args, adapter, guided, rewards, opt, params, train_prompts, it, D,
                        sigmas, dev, ctx, state: dict | None = None) -> dict:
    """One iteration; `state` carries {"step": optimizer steps so far, "ema": LoraEMA or None}
    across iterations (train_sd3.py's global_step and EMA)."""
    state = state if state is not None else {"step": 0, "ema": None}
    rec = mine.rec
    P, G = args.prompts_per_iter, args.group_size
    N, K = P * G, len(sigmas) - 1
    sig = [float(s) for s in sigmas]
    times = {}
    t0 = time.perf_counter()
    S, B = V.Stream, baseline_cli.Stream                  # vgrpo's streams, the baselines' own
    g_prompt, g_noise, g_perm, g_sde, g_win = (V.generator(args.seed, it, s) for s in (
        S.PROMPTS, S.ROLLOUT_NOISE, S.MINIBATCHES, B.STEP_NOISE, B.SDE_WINDOW))
    sde, trained = step_plan(K, rec, g_win)
    T = len(trained)

    # 1. rollout: SDE (or ODE + SDE window), storing every state and every step's log p_θold
    pick = torch.randperm(len(train_prompts), generator=g_prompt)[:P] if P <= len(train_prompts) \
        else torch.randint(len(train_prompts), (P,), generator=g_prompt)
    prompts = [train_prompts[i] for i in pick.tolist()]
    cond = adapter.encode(prompts)
    prompt_idx = (torch.arange(N) // G).to(dev)
    x1 = torch.randn((N,) + D, generator=g_noise).to(dev)
    traj, logp_old = sde_rollout(guided, x1, cond, prompt_idx, sigmas, rec, sde, mine.batch, ctx,
                                 g_sde)                          # (N, K+1, *D), (N, K)
    if dev.type == "cuda":                    # the GPU's work, before the clock
        torch.cuda.synchronize(dev)
    times["time_rollout"] = time.perf_counter() - t0

    # 2. rewards (weighted sum, as their multi_score), stat-tracker advantages, zero-adv. filter
    t1 = time.perf_counter()
    names = [n for n, _ in rewards.train_terms]
    sample_prompts = [prompts[i // G] for i in range(N)]
    raw_all, _ = V.decode_and_reward(adapter, rewards, names, traj[:, -1], sample_prompts, args.reward_batch)
    w = torch.tensor([wt for _, wt in rewards.train_terms])
    r = (V.training_values(raw_all, rewards.train_terms) * w[:, None]).sum(0)    # (N,)
    adv = stat_tracker_advantages(sample_prompts, r)                                   # (N,) fp64
    n_zero = int((adv == 0).sum())
    num_batches = N // mine.batch
    keep = (keep_mask(adv, num_batches, g_perm) if rec["filter_zero_adv"]
            else torch.ones(N, dtype=torch.bool))
    adv = adv.float().clamp(-args.adv_clamp, args.adv_clamp).to(dev)       # adv_clip_max 5
    raw = V.headline(raw_all, rewards.train_terms)
    times["time_reward"] = time.perf_counter() - t1
    times["time_old"] = 0.0                          # old log-probs were stored by the rollout

    # 3. training: kept samples shuffled, cut into num_batches batches (same count as the rollout's
    #    when nothing is filtered), num_batches/μ batches × T steps accumulated per optimizer step;
    #    per (batch, step): recompute log p_θ with grad, per-step clipped ratio, + β·KL.
    t3 = time.perf_counter()
    idx = torch.nonzero(keep).flatten()
    idx = idx[torch.randperm(len(idx), generator=g_perm)].to(dev)
    clipped, clipped_first, abs_logr, kls, grad_norms = [], [], [], [], []
    first_abs_logr = None
    # fp16 autocast needs loss scaling (Flow-GRPO gets it from accelerate's mixed_precision="fp16")
    fp16 = (dev.type == "cuda" and isinstance(ctx, torch.autocast)
            and ctx.fast_dtype == torch.float16)
    scaler = torch.amp.GradScaler("cuda", enabled=fp16)
    if len(idx):
        for s_i, chunk_group in enumerate(idx.tensor_split(mine.flow_mu)):
            opt.zero_grad(set_to_none=True)
            n_chunks = max(1, num_batches // mine.flow_mu)
            chunks = [c for c in chunk_group.tensor_split(n_chunks) if len(c)]
            for ci, rows in enumerate(chunks):
                c = V.select(cond, prompt_idx[rows])
                for j in trained:
                    t = torch.full((len(rows),), sig[j], device=dev)
                    with ctx:
                        v = guided.velocity(traj[rows, j], t, c)
                    step_kw = dict(x_next=traj[rows, j + 1], sde_type=rec["sde_type"])
                    _, logp, mean, kl_std = sde_step(traj[rows, j], v, sig[j], sig[j + 1],
                                                     rec["noise_level"], sig[1], **step_kw)
                    loss, ratio = flow_grpo_loss(logp, logp_old[rows, j], adv[rows],
                                                 rec["clip_range"])
                    if rec["beta"] > 0:
                        with torch.no_grad(), ctx:
                            adapter.transformer.disable_adapters()   # the reference: LoRA off
                            try:
                                v_ref = guided.velocity(traj[rows, j], t, c)
                            finally:
                                adapter.transformer.enable_adapters()
                        _, _, mean_ref, _ = sde_step(traj[rows, j], v_ref, sig[j], sig[j + 1],
                                                     rec["noise_level"], sig[1], **step_kw)
                        kl = kl_to_reference(mean, mean_ref, kl_std)
                        loss = loss + rec["beta"] * kl
                        kls.append(kl.detach())
                    scaler.scale(loss / (len(chunks) * T)).backward()  # mean: batches, steps
                    logr = (logp - logp_old[rows, j]).detach().abs()
                    if first_abs_logr is None:
                        first_abs_logr = logr.max()          # θ = θ_old here: 0 expected
                    abs_logr.append(logr.mean())
                    frac = ((ratio.detach() - 1).abs() > rec["clip_range"]).float().mean()
                    clipped.append(frac)
                    if s_i == 0:
                        clipped_first.append(frac)           # before the 1st step: 0 expected
                if ci == len(chunks) - 1:                    # accumulation complete: one step
                    scaler.unscale_(opt)
                    gn = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                    if scaler.is_enabled():
                        scaler.step(opt)                  # skips the step on inf/nan grads
                        scaler.update()
                    elif torch.isfinite(gn):
                        opt.step()
                    grad_norms.append(gn.detach().float())
                    state["step"] += 1
                if state["ema"] is not None:                 # after every batch, as train_sd3.py
                    state["ema"].step(state["step"])
    opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":                    # the GPU's work, before the clock
        torch.cuda.synchronize(dev)
    times["time_update"] = time.perf_counter() - t3
    f = guided.forwards
    mean_or = lambda xs: float(torch.stack(xs).mean()) if xs else float("nan")
    return {"method": "flow_grpo", "iter": it, "reward_mean": float(raw.mean()),
            "reward_std": float(raw.std(unbiased=False)), **times,
            "time_iter": time.perf_counter() - t0, "nfe_rollout": K * f,
            "nfe_old": 0,                             # its old log-probs come with the rollout
            "nfe_theta": T * f, "nfe_ref": T * f if rec["beta"] > 0 else 0,
            "trained_steps": trained, "n_trained_samples": int(len(idx)), "n_zero_adv": n_zero,
            "clip_frac": mean_or(clipped), "clip_frac_first_step": mean_or(clipped_first),
            "abs_log_ratio": mean_or(abs_logr),
            "abs_log_ratio_first": (float(first_abs_logr) if first_abs_logr is not None
                                    else float("nan")),
            "kl_ref": mean_or(kls), "grad_norm": mean_or(grad_norms), "opt_steps": len(grad_norms)}


# ------------------------------------------------------------------------------------------------
# Held-out evaluation: fixed prompts and noise, deterministic ODE at the method's guidance.
# ------------------------------------------------------------------------------------------------
def evaluate(guided, rewards, args, eval_prompts, D, dev, ctx) -> float:
    prompts = eval_prompts[:args.n_eval]
    n = len(prompts)
    x1 = torch.randn((n,) + D, generator=V.generator(args.seed, 0, V.Stream.EVAL_NOISE)).to(dev)
    cond = guided.adapter.encode(prompts)
    lat = V.rollout(guided, x1, cond, torch.arange(n, device=dev),
                    guided.adapter.sigmas(args.eval_steps or args.num_steps), args.solver,
                    args.rollout_batch, ctx)
    names = [name for name, _ in rewards.eval_terms]
    raw, _ = V.decode_and_reward(guided.adapter, rewards, names, lat, prompts, args.reward_batch)
    return float(V.headline(raw, rewards.eval_terms).mean())


def setup_dtype(mine, args):
    """Device and per-method (dtype, autocast). --dtype auto: Flow-GRPO fp16 on CUDA (its README
    FAQ: fp16 "whenever possible", smaller log-prob errors than bf16), V-GRPO vgrpo's own default
    (bf16 on CUDA); fp32 on CPU. Weights stay fp32 and autocast casts them, as in Flow-GRPO's
    LoRA training."""
    dev, _, _ = V.setup_device(args)
    cuda = dev.type == "cuda"
    names = {"flow_grpo": mine.dtype if mine.dtype != "auto" else ("fp16" if cuda else "fp32"),
             "vgrpo": mine.dtype if mine.dtype != "auto" else ("bf16" if cuda else "fp32")}
    out = {}
    for method, name in names.items():
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
        ctx = (torch.autocast(dev.type, dtype=dtype) if dtype != torch.float32
               else contextlib.nullcontext())
        out[method] = (dtype, ctx)
    return dev, out


def run(mine, args, log=print, pipe=None, rewards=None, out: Path | None = None):
    """Every method in mine.methods, one after the other, from the same LoRA init.
    Returns (summary rows, info, metrics lines). `pipe` / `rewards` may be passed in already built
    (e.g. examples/gpu/gpu_check.py's random-weight SD3.5-M); else loaded from args."""
    t_start = time.perf_counter()
    dev, prec = setup_dtype(mine, args)
    torch.manual_seed(args.seed)
    pipe = pipe if pipe is not None else V.load_pipeline(args.model, torch.float32)
    pipe.to(dev)
    pipe.vae.to(torch.float32)
    adapter = V.make_adapter(pipe, args, dev)
    if type(adapter) is not V.SD3Adapter:  # FLUX.1 and the other plug-ins subclass or differ
        raise ValueError("examples/baselines/flow_grpo_sd3.py supports SD3 pipelines only "
                         "(Flow-GRPO's SD3 script); --model names a FLUX pipeline")
    torch.manual_seed(args.seed)              # the LoRA init from the seed alone (as vgrpo.setup)
    lora_cfg = V.add_lora(adapter.transformer, args.lora_rank, args.lora_alpha,
                          args.lora_targets.split(","))
    if args.gradient_checkpointing:
        adapter.transformer.enable_gradient_checkpointing()
    named = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    init = {n: p.detach().clone() for n, p in named.items()}          # every method starts here
    params = list(named.values())
    rewards = rewards if rewards is not None else V.Rewards.load(args, dev, prec["vgrpo"][0])
    train_prompts, eval_prompts = V.load_prompts(args)
    D = adapter.latent_shape(args.resolution)
    v_sigmas, f_sigmas = adapter.sigmas(args.num_steps), adapter.sigmas(mine.flow_steps)
    uncond = adapter.encode([""])                                      # Flow-GRPO's negative prompt
    rec = mine.rec

    rows, lines = [], []
    mpath = out / "metrics.jsonl" if out is not None else None

    def emit(m: dict) -> None:
        lines.append(m)
        if mpath is not None:
            with open(mpath, "a") as fh:
                fh.write(json.dumps(m) + "\n")

    for method in mine.methods:
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(init[n])
        dtype, ctx = prec[method]
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999),
                                weight_decay=args.weight_decay)
        guided = Guided(adapter, uncond, rec["guidance"] if method == "flow_grpo" else 1.0,
                        detach_uncond=mine.cfg_grad == "detached")
        before = evaluate(guided, rewards, args, eval_prompts, D, dev, ctx)
        emit({"method": method, "iter": 0, "eval_reward_mean": before})
        hist = []
        use_ema = method == "flow_grpo" and not mine.no_ema
        state = {"step": 0, "ema": LoraEMA(params) if use_ema else None}
        vrun = V.Run(args=args, adapter=adapter, rewards=rewards, opt=opt, params=params,
                     lora_cfg=lora_cfg, train_prompts=train_prompts, eval_prompts=eval_prompts,
                     dev=dev, dtype=dtype, ctx=ctx, sigmas=v_sigmas, eval_sigmas=v_sigmas, D=D)
        for it in range(mine.iterations):
            if method == "vgrpo":
                m = {"method": "vgrpo", **V.iteration(vrun, it), "nfe_ref": 0, "opt_steps": args.mu}
            else:
                m = flow_grpo_iteration(mine, args, adapter, guided, rewards, opt, params,
                                        train_prompts, it, D, f_sigmas, dev, ctx, state)
            hist.append(m)
            emit(m)
            log(f"{LABEL[method]:9s} iter {it}  reward {m['reward_mean']:.4f}  "
                f"|log ρ| {m['abs_log_ratio']:.2e}  clip {m['clip_frac']:.2f}  "
                f"grad {m['grad_norm']:.3g}  {m['time_iter']:.2f}s")
        after = after_raw = evaluate(guided, rewards, args, eval_prompts, D, dev, ctx)
        if use_ema:                                     # Flow-GRPO evaluates and saves its EMA
            state["ema"].swap()
            after = evaluate(guided, rewards, args, eval_prompts, D, dev, ctx)
        emit({"method": method, "iter": mine.iterations, "eval_reward_mean": after,
              **({"eval_reward_mean_raw": after_raw, "ema": True} if use_ema else {})})
        if out is not None:
            from peft.utils import get_peft_model_state_dict
            adapter.save_lora(str(out / f"lora_{method}"),
                              get_peft_model_state_dict(adapter.transformer), lora_cfg)
        if use_ema:
            state["ema"].swap()                         # back to the trained weights
        moved = torch.sqrt(sum((p.detach().float() - init[n].float()).square().sum()
                               for n, p in named.items()))
        med = lambda k: statistics.median(h[k] for h in hist)     # robust to a warm-up iteration
        K = args.num_steps if method == "vgrpo" else mine.flow_steps
        if method == "vgrpo":
            desc = f"{K}-step {args.solver} ODE, no CFG"
        else:
            noise = f"{rec['sde_type']} a = {rec['noise_level']:g}"
            desc = (f"{K}-step ODE, {rec['window']}-step {noise} window" if rec["window"]
                    else f"{K}-step SDE ({noise})")
            desc += f", CFG {rec['guidance']:g}" if rec["guidance"] != 1 else ", no CFG"
        rows.append({
            "method": LABEL[method], "rollout": desc,
            "nfe_rollout": hist[0]["nfe_rollout"],
            "nfe_old_extra": hist[0]["nfe_old"],          # θ_old's evaluations beyond the rollout
            "nfe_pi_old": hist[0]["nfe_rollout"] + hist[0]["nfe_old"], "nfe_theta": hist[0]["nfe_theta"],
            "nfe_ref": hist[0]["nfe_ref"],
            "opt_steps": hist[0]["opt_steps"],
            **{k: med(k) for k in ("time_rollout", "time_reward", "time_old", "time_update",
                                   "time_iter")},
            "clip_frac": statistics.mean(h["clip_frac"] for h in hist),
            "clip_frac_first_step": hist[0].get("clip_frac_first_step", 0.0),
            "abs_log_ratio_first": hist[0].get("abs_log_ratio_first", hist[0]["abs_log_ratio"]),
            "train_reward_first": hist[0]["reward_mean"],
            "train_reward_last": hist[-1]["reward_mean"],
            "eval_reward_before": before, "eval_reward_after": after,
            "eval_reward_after_raw": after_raw if use_ema else None, "lora_change": float(moved),
        })
    info = {"model": args.model, "reward": args.reward, "device": str(dev),
            "dtype": ", ".join(f"{LABEL[m]} {str(prec[m][0]).split('.')[-1]}"
                               for m in mine.methods),
            "P": args.prompts_per_iter, "G": args.group_size, "K_vgrpo": args.num_steps,
            "K_flow": mine.flow_steps, "J": args.n_mc, "resolution": args.resolution,
            "iterations": mine.iterations, "seed": args.seed, "lr": args.lr,
            "micro_batch": args.micro_batch, "batch": mine.batch, "recipe": mine.recipe,
            **{f"flow_{k}": v for k, v in rec.items()},
            "n_eval": min(args.n_eval, len(eval_prompts)), "seconds": time.perf_counter() - t_start}
    return rows, info, lines


def to_markdown(rows, info) -> str:
    r_ = {k.removeprefix("flow_"): v for k, v in info.items() if k.startswith("flow_")}
    head = (f"Per-iteration cost (examples/baselines/flow_grpo_sd3.py --recipe {info['recipe']}): "
            f"model `{info['model']}`, reward `{info['reward']}`, {info['device']} {info['dtype']}; "
            f"P×G = {info['P']}×{info['G']} at {info['resolution']} px; "
            f"V-GRPO K = {info['K_vgrpo']}, "
            f"N_MC = {info['J']}; Flow-GRPO K = {info['K_flow']}, guidance {r_['guidance']:g}, "
            f"{r_['sde_type']} a = {r_['noise_level']:g}, clip ε = {r_['clip_range']:g}, "
            f"β = {r_['beta']:g}, batch {info['batch']} for rollout and training; same LoRA init, "
            f"lr {info['lr']:g}, seed {info['seed']}; {info['iterations']} iterations each "
            f"(times: median over them); {info['seconds']:.0f} s in all.\n\n")
    cols = ("| method | rollout | NFE rollout | NFE old (extra) | NFE π_θold | NFE π_θ (with grad) "
            "| NFE ref | opt. steps | rollout s | reward s | old s | update s | iteration s "
            "| clip frac (1st step) | \\|log ρ\\| at θ=θ_old | ‖Δθ_LoRA‖ "
            "| train reward first → last "
            "| eval reward before → after |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['method']} | {r['rollout']} | {r['nfe_rollout']} | {r['nfe_old_extra']} | "
             f"{r['nfe_pi_old']} | {r['nfe_theta']} | {r['nfe_ref']} | {r['opt_steps']} | "
             f"{r['time_rollout']:.2f} | {r['time_reward']:.2f} | {r['time_old']:.2f} | "
             f"{r['time_update']:.2f} | {r['time_iter']:.2f} | {r['clip_frac']:.2f} "
             f"({r['clip_frac_first_step']:.2f}) | {r['abs_log_ratio_first']:.1e} | "
             f"{r['lora_change']:.3g} | "
             f"{r['train_reward_first']:.4f} → {r['train_reward_last']:.4f} | "
             f"{r['eval_reward_before']:.4f} → {r['eval_reward_after']:.4f}"
             + (f" (EMA; raw {r['eval_reward_after_raw']:.4f})"
                if r.get("eval_reward_after_raw") is not None else "") + " |" for r in rows]
    foot = ("\n\nNFE per sample = transformer forwards; with CFG every step is one batched forward "
            "of 2 rows (unconditional + conditional) and counts 2. π_θold = rollout + extra "
            "old-policy pass (the paper's Table 1 convention, paper P10); π_θ = forwards with "
            "grad (each also one backward); ref = no-grad forwards of the reference policy (LoRA "
            "off) for the KL. "
            "Flow-GRPO's old log-probs come with its rollout (0 extra), V-GRPO needs N_MC·(μ − 1)/μ "
            "extra surrogate forwards (its first optimizer step is θ_old's pass). Clip frac (1st step): fraction of per-step ratios outside 1 ± ε "
            "before the first optimizer step (θ = θ_old: 0 expected). Train reward: Flow-GRPO's is "
            "of its (SDE) rollouts, V-GRPO's of ODE rollouts; eval reward: deterministic ODE on "
            f"{info['n_eval']} held-out prompts with fixed noise, at each method's own guidance.\n")
    return head + cols + "\n".join(lines) + foot


def main(argv=None) -> list[dict]:
    """Run from an argument list; returns the metrics lines (also in <out>/metrics.jsonl)."""
    mine, args = parse(argv)
    tag = "+".join(n.split(":")[-1] for n, _ in V.parse_reward_spec(args.reward))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(mine.out or f"runs/flow_grpo_sd3-{Path(args.model).name}-{tag}-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    rows, info, lines = run(mine, args, out=out)
    md = to_markdown(rows, info)
    print("\n" + md)
    (out / "table.md").write_text(md)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "info": info}, indent=2))
    print(f"wrote {out}/ (metrics.jsonl, table.md, summary.json, lora_*/)")
    return lines


if __name__ == "__main__":
    main()
