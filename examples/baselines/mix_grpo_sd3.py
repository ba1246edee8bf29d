"""MixGRPO (mixed ODE–SDE rollouts with a sliding SDE window) on the SD3 path of vgrpo.py.

MixGRPO (Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE",
arXiv 2507.21802; code Tencent-Hunyuan/MixGRPO, read at commit e5cdd6a; peer X2 of METHOD.md)
is an MDP method like Flow-GRPO, but only a few consecutive sampler steps, the *window*, are
stochastic and trained: the rollout is a deterministic Euler ODE outside the window and an SDE
inside it, whose per-step Gaussian log-probs are stored; training recomputes the window's
log-probs with gradients and applies a PPO-clipped per-step ratio. The window starts at the
first step and moves one step later every `shift_interval` iterations. V-GRPO (vgrpo.py) instead
treats the whole generation as one action scored by its ELBO surrogate.

Published for FLUX.1-dev; here it runs on any vgrpo.Run built by vgrpo.setup(args) (an SD3 /
SD3.5 diffusers pipeline with vgrpo's LoRA, AdamW, rewards and prompts):

    python examples/baselines/mix_grpo_sd3.py                         # tiny SD3 pipeline, CPU
    python examples/baselines/mix_grpo_sd3.py --model DIR --reward mymod:fn --prompts train.txt \\
        --num_steps 10 --iterations 30 --out runs/mix
    python examples/baselines/mix_grpo_sd3.py --model sd3.5-medium --reward pickscore --num_steps 25 \\
        --iterations 300                                              # the published schedule

From Python (the shape examples/digits/bench.py calls):
    run = vgrpo.setup(vgrpo.parse_args([...]))
    state = init_state(run, scaled_recipe(num_steps=10, iterations=30))
    for it in range(30): metrics = mix_iteration(run, it, state)
    with eval_weights(run, state): ...                                # evaluate

THE PUBLISHED RECIPE (`RECIPE`; every number from scripts/finetune/finetune_flux_grpo_MixGRPO.sh
and the code paths of fastvideo/train_grpo_flux.py, fastvideo/utils/sampling_utils.py and
fastvideo/utils/grpo_states.py that its flags select):
  * K = 25 sampler steps; the SDE step is `flow_grpo_step` (the script passes
    --flow_grpo_sampling, whose help reads "True for MixGRPO, False for DanceGRPO"): Flow-GRPO's
    Euler–Maruyama step with η = 0.7, noise scale η·sqrt(σ/(1−σ))·sqrt(σ−σ'). DanceGRPO's step
    (`dance_grpo_step`, the flag's other branch) is available as recipe["sde"] = "dance".
  * outside the window: plain Euler (dpm_algorithm_type "null"; DPM-Solver++ after the window is
    the separate MixGRPO-Flash script, not reproduced).
  * window: 4 steps (group_size), starting at step 0, moved by 1 step (prog_overlap,
    prog_overlap_step 1) every 25 iterations (iters_per_group, sample_strategy "progressive"),
    window steps < K − 2 (max_timesteps = sampling_steps − 2; the samples drop the last step),
    rolled back to step 0 past the end (roll_back). In 300 iterations the window starts at steps
    0, 1, …, 11 and never wraps. Only the window's steps are trained, in order, all of them
    (training_strategy "part": no timestep shuffling, timestep_fraction unused).
  * one initial noise per group (--init_same_noise): the G samples of a prompt differ only by
    the window's SDE noise.
  * advantages: per prompt group, (r − mean)/(std + 1e-8) with torch's unbiased std, each reward
    normalised on its own and summed with weights normalised to 1 (multi_reward_mix
    "advantage_aggr"); clamped to ±5 in the loss (adv_clip_max); no soft-clip.
  * loss per (sample, window step): max(−A·ρ, −A·clip(ρ, 1 ± 1e-4)), ρ = exp(log p_θ − log p_old);
    mean over the optimizer step's samples and window steps (each term / (accumulation · T));
    kl_coeff 0 (its KL would be ½(log ρ)² to θ_old, no reference model).
  * optimizer steps: each GPU holds one prompt's 12 samples and steps after every 3
    (gradient_accumulation_steps 3; FSDP averages the 32 GPUs' gradients): 4 optimizer steps per
    iteration, step k taking samples 3k … 3k+2 of every group; grad-norm clip 1.0; AdamW lr 1e-5,
    β (0.9, 0.999), weight decay 1e-4, constant schedule, bf16 autocast over fp32 weights.
  * no EMA (--ema_decay is parsed but never used): the trained weights are what it evaluates.

SCALING (`scaled_recipe(K, iterations)`): window = max(1, round½(4·K/25)), shift interval =
max(1, round½(25·iterations/300)) (round½: halves round up), stride 1 and every other number as
published; so the number of window positions over the budget stays ≈ 300/25 = 12. On a short
grid 12 positions may pass the last trainable step; the window then rolls back to step 0 as
upstream's roll_back does (K = 10, 30 iterations: window 2, interval 3, starts 0…7, 0, 1).
The published run trains only σ ≥ 0.70 (steps 0–14 of its shift-3 grid); such a squeezed schedule
trains far lower σ. `in_range_recipe(K, iterations, sigmas)` keeps the window inside the published
range instead: the same window width, its last start the last one whose steps all have σ ≥ 0.702,
and the shift interval chosen so that the window visits each position once over the budget (on
the digits benchmark's 10-step grid: window 2, starts 0 and 1, σ 1.0–0.78).

DEVIATIONS from upstream, each with its reason:
  1. Model: an SD3 pipeline through vgrpo's adapter, no CFG (upstream: FLUX.1-dev with its
     distilled guidance embedding 3.5 and --cfg 0.0, i.e. no CFG either; SD3 has no guidance
     embedding). Time grid: the pipeline scheduler's own (adapter.sigmas, SD3.5: shift 3) rather
     than upstream's shift-3 linspace(1, 0, K + 1) written for FLUX (on vgrpo's FLUX adapter the
     grid is upstream's), so that MixGRPO and V-GRPO sample the same grid.
  2. The transformer gets the exact σ (SD3: 1000·σ, as diffusers' pipeline) where upstream feeds
     int(1000·σ)/1000; both use one value in the rollout and in training.
  3. LoRA through vgrpo.setup with vgrpo's --lr, instead of full fine-tuning at lr 1e-5.
  4. One process holds all P prompts × G samples (upstream: 32 GPUs × 1 prompt); optimizer step k
     takes the k-th of 4 contiguous shares of every group, so each step sees the same samples as
     upstream's (3 of 12 per prompt, gradients averaged). The 4 steps per iteration are kept for
     any G (upstream's accumulation of 3 is tied to G = 12); shares differ by one sample when G is
     not a multiple of 4 (upstream would leave the remainder's gradients unused).
  5. Batching: the ODE steps run --rollout_batch rows per forward, the window steps and training
     --micro_batch rows (upstream: one sample per forward); the rollout's window steps visit
     exactly the training micro-batches, so the ratio is exactly 1 before the first optimizer
     step.
  6. Window end: rolled back when its start reaches K − 2, one step earlier than upstream's
     state machine, whose window at start K − 2 is empty (its code would then fail on an
     undefined ratio); the published 300 iterations never get there (starts ≤ 11 of 23).
  7. Random streams: prompts and initial noise as vgrpo's collect_rollouts (V.Stream.PROMPTS
     and ROLLOUT_NOISE); the group's shared noise is the group's first row of that draw; the SDE
     noise comes from baseline_cli.Stream.STEP_NOISE; all fp32 (upstream: global RNG seeded
     seed + rank, bf16 initial noise).
  8. Robustness from vgrpo: a non-finite reward gets A = 0 (upstream has no such path), an
     optimizer step with a non-finite gradient norm is skipped, fp16 runs use vgrpo's loss scaler.
  9. Logged grad_norm is the mean over the iteration's steps (upstream logs the last one);
     evaluation is vgrpo's held-out ODE evaluation (upstream evaluates checkpoints with its
     separate inference script).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
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

# MixGRPO's published numbers that this script uses (scripts/finetune/finetune_flux_grpo_MixGRPO.sh
# and the defaults of fastvideo/train_grpo_flux.py for the flags it leaves unset).
RECIPE = dict(
    num_steps=25,            # .sh: sampling_steps=25
    iterations=300,          # .sh: --max_train_steps 300
    window=4,                # .sh: group_size=4 ("sliding window size")
    shift_interval=25,       # .sh: iters_per_group=25 ("moving the window after … iterations")
    stride=1,                # .sh: --prog_overlap --prog_overlap_step 1
    roll_back=True,          # .sh: --roll_back (grpo_states.py: restart at the initial step)
    sde="flow",              # .sh: --flow_grpo_sampling → sampling_utils.py flow_grpo_step
    eta=0.7,                 # .sh: eta=0.7
    ode="euler",             # .sh: dpm_algorithm_type="null" → Euler outside the window
    init_same_noise=True,    # .sh: --init_same_noise (one initial noise per group)
    clip_range=1e-4,         # .sh: --clip_range 1e-4
    adv_clip_max=5.0,        # .sh: --adv_clip_max 5.0
    std_eps=1e-8,            # train_grpo_flux.py: group_rewards.std() + 1e-8
    kl_coeff=0.0,            # .sh: kl_coeff=0.0
    opt_steps=4,             # .sh: --num_generations 12 / gradient_accumulation_steps=3
)
# The rest of the published setup, for reference: vgrpo's own flags set these here.
PUBLISHED_SETUP = dict(
    model="FLUX.1-dev", resolution=720, shift=3.0, group_size=12,   # .sh: --h/--w 720, --shift 3
    prompts_per_iter=32,                    # .sh: 4 nodes × 8 GPUs × --train_batch_size 1
    full_finetune=True, lr=1e-5, weight_decay=1e-4, max_grad_norm=1.0,   # .sh
    rewards="hpsv2:1,examples.rewards.imagereward:score:1,pickscore:1",   # .sh: "multi_reward", weights 1
    advantage_aggregation="advantage_aggr", precision="bf16")      # .sh: multi_reward_mix, bf16
METHOD = "mix_grpo"


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def scaled_recipe(num_steps: int, iterations: int) -> dict:
    """RECIPE on a K-step grid and an iteration budget: window = max(1, round½(4·K/25)),
    shift interval = max(1, round½(25·iterations/300)) (halves round up), everything else as
    published. scaled_recipe(25, 300) is RECIPE."""
    if num_steps < 3 or iterations < 1:
        raise ValueError(f"need num_steps ≥ 3 (window steps are < K − 2) and iterations ≥ 1, got "
                         f"{num_steps}, {iterations}")
    R = RECIPE
    return dict(R, num_steps=num_steps, iterations=iterations,
                window=max(1, _round_half_up(R["window"] * num_steps / R["num_steps"])),
                shift_interval=max(1, _round_half_up(R["shift_interval"] * iterations
                                                     / R["iterations"])))


# The σ range the published run trains (PUBLISHED_SETUP: shift 3 on upstream's linspace(1, 0, K + 1)
# grid): its window starts at steps 0, 1, …, 11 of 25 in 300 iterations, so it trains steps 0–14,
# σ from 1 down to σ_14 = 0.702. A schedule squeezed into a short grid and budget (scaled_recipe)
# visits steps far below that; in_range_recipe keeps the window inside it.
def published_sigma_range() -> tuple[float, float]:
    """(lowest, highest) σ at which the published run trains a window step."""
    R, K = RECIPE, RECIPE["num_steps"]
    grid = V.time_shift(1 - torch.arange(K + 1, dtype=torch.float64) / K,
                        PUBLISHED_SETUP["shift"])                               # (K + 1,)
    steps = sorted({j for it in range(R["iterations"]) for j in window_at(it, R)})
    return float(grid[steps[-1]]), float(grid[steps[0]])


def in_range_recipe(num_steps: int, iterations: int, sigmas) -> dict:
    """RECIPE on a K-step grid `sigmas` (K + 1,) and an iteration budget, with every trained σ
    inside the published range: the window as scaled_recipe (max(1, round½(4·K/25)) steps), its
    last start the last one whose steps all have σ ≥ the published lowest (published_sigma_range),
    and the shift interval round½(iterations / positions), so that the window visits each of its
    positions once in the budget, as the published run visits its 12 in 300 iterations. Raises
    ValueError if not even the first window fits in the range."""
    rec = scaled_recipe(num_steps, iterations)
    low = published_sigma_range()[0]
    sig = [float(x) for x in sigmas]
    W, K = rec["window"], num_steps
    starts = [s for s in range(0, K - 2, rec["stride"])
              if all(sig[j] >= low - 1e-9 for j in range(s, min(s + W, K - 2)))]
    if not starts:
        raise ValueError(f"no {W}-step window of this grid lies at σ ≥ {low:.3f}")
    rec["last_start"] = starts[-1]
    rec["shift_interval"] = max(1, _round_half_up(iterations / len(starts)))
    return rec


def sigmas_trained(recipe: dict, sigmas, iterations: int) -> list[float]:
    """The σ at which the window trains over `iterations` iterations, highest first."""
    steps = sorted({j for it in range(iterations) for j in window_at(it, recipe)})
    return [float(sigmas[j]) for j in steps]


# ------------------------------------------------------------------------------------------------
# The sliding window (fastvideo/utils/grpo_states.py, GRPOTrainingStates, sample_strategy
# "progressive", prog_overlap): iteration `it` trains steps [start, min(start + window, K − 2)).
# ------------------------------------------------------------------------------------------------
def window_at(it: int, recipe: dict) -> list[int]:
    """The trained (= stochastic) step indices at iteration `it` (0-based).

    Upstream's state machine: read the window, then count the iteration; after `shift_interval`
    iterations the start moves by `stride`; a start past the last trainable step rolls back to 0
    (roll_back) or stays at the last one. Since the start only moves on an interval boundary this
    is start = stride · (it // shift_interval), taken modulo the number of positions.
    Positions: 0, stride, … ≤ last = recipe["last_start"] if given (in_range_recipe), else K − 3
    (deviation 6: upstream also visits K − 2, an empty window).

    Reference form (equal for every it):
        start, n = 0, 0
        for _ in range(it):
            n += 1
            if n >= shift_interval: n, start = 0, start + stride
            if start > last: start = 0 if roll_back else last
        return list(range(start, min(start + window, K - 2)))
    """
    K, W, S, s = recipe["num_steps"], recipe["window"], recipe["shift_interval"], recipe["stride"]
    last = recipe.get("last_start", K - 3)      # last window start (K − 3: the last trainable step)
    moves = it // S
    if recipe["roll_back"]:
        start = (moves % (last // s + 1)) * s
    else:
        start = min(moves * s, last)
    return list(range(start, min(start + W, K - 2)))


# ------------------------------------------------------------------------------------------------
# The stochastic steps and their log-probs (pure; fastvideo/utils/sampling_utils.py).
#   t = σ ∈ [0, 1], 1 = noise, 0 = data; a step goes from σ to σ' < σ; dt = σ' − σ < 0.
#   Arithmetic in ≥ fp32 (the inputs' dtype if wider, so float64 tests are exact).
# ------------------------------------------------------------------------------------------------
def flow_grpo_step(x: torch.Tensor, v: torch.Tensor, s: float, s_next: float, eta: float,
                   sigma_max: float, x_next: torch.Tensor | None = None,
                   noise: torch.Tensor | None = None):
    """MixGRPO's SDE step, sampling_utils.py `flow_grpo_step` (Flow-GRPO's Euler–Maruyama step):
        s_t  = η·sqrt(σ / (1 − σ))          (σ = 1 → σ_max = sigmas[1] in the denominator)
        μ_θ  = x·(1 + s_t²·dt/(2σ)) + v_θ·(1 + s_t²·(1 − σ)/(2σ))·dt
        std  = s_t·sqrt(−dt),   x' = μ_θ + std·ξ
        log p = mean_elements[ −(x' − μ_θ)²/(2 std²) − log std − ½ log 2π ]

    Args: x, v (M, *D) state and velocity at σ = s; s, s_next floats; eta η; sigma_max = sigmas[1];
        x_next (M, *D) the stored next state to evaluate (training) or None to sample one with
        `noise` ξ (M, *D) (rollout).
    Returns: x_next (M, *D), log_prob (M,) (differentiable through v), mean μ_θ (M, *D),
        std (float).
    Notes: per-element MEAN, as upstream (a sum would scale log ρ by the latent size)."""
    ft = torch.promote_types(x.dtype, torch.float32)                        # ≥ fp32
    x, v = x.to(ft), v.to(ft)
    step = s_next - s                                                         # dt < 0
    s_t = eta * math.sqrt(s / (1 - (sigma_max if s == 1.0 else s)))
    mean = x * (1 + s_t ** 2 / (2 * s) * step) + v * (1 + s_t ** 2 * (1 - s) / (2 * s)) * step
    std = s_t * math.sqrt(-step)
    if x_next is None:
        x_next = mean + std * noise.to(ft)
    sq = (x_next.detach().to(ft) - mean) ** 2                                 # (M, *D)
    log_prob = -sq / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return x_next, log_prob.flatten(1).mean(dim=1), mean, std


def dance_grpo_step(x: torch.Tensor, v: torch.Tensor, s: float, s_next: float, eta: float,
                    sigma_max: float, x_next: torch.Tensor | None = None,
                    noise: torch.Tensor | None = None):
    """DanceGRPO's SDE step, sampling_utils.py `dance_grpo_step` (sde_solver=True; the branch
    MixGRPO's code takes without --flow_grpo_sampling):
        x̂0 = x − σ·v_θ,   score = −(x − (1 − σ)·x̂0)/σ²
        μ_θ = x + dt·v_θ − ½η²·score·dt,   std = η·sqrt(σ − σ'),   x' = μ_θ + std·ξ
        log p = mean_elements[ −(x' − μ_θ)²/(2 std²) ]
    The constants −log std − ½ log 2π sit on a separate statement in upstream's code and never
    reach its log-prob; they cancel in the ratio either way. sigma_max is unused (same signature
    as flow_grpo_step). Args and returns as flow_grpo_step."""
    ft = torch.promote_types(x.dtype, torch.float32)                        # ≥ fp32
    x, v = x.to(ft), v.to(ft)
    step = s_next - s                                                         # dt < 0
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s ** 2
    mean = x + step * v - 0.5 * eta ** 2 * score * step
    std = eta * math.sqrt(-step)
    if x_next is None:
        x_next = mean + std * noise.to(ft)
    sq = (x_next.detach().to(ft) - mean) ** 2
    return x_next, (-sq / (2 * std ** 2)).flatten(1).mean(dim=1), mean, std


SDE_STEPS = {"flow": flow_grpo_step, "dance": dance_grpo_step}


def mix_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, *, clip_range: float,
             adv_clip_max: float, kl_coeff: float = 0.0):
    """Per-sample loss of ONE window step (train_grpo_flux.py `train_one_step`), to minimise:
        A ← clamp(A, ±adv_clip_max),   ρ = exp(log p_θ − log p_old)
        loss_n = max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)) + kl_coeff·½(log p_θ − log p_old)²
    logp, logp_old, adv: (m,). Returns loss (m,) — the caller divides by the samples of the
    optimizer step and the window length — and detached stats: clip_frac, abs_log_ratio (means)."""
    a = adv.clamp(-adv_clip_max, adv_clip_max)
    log_ratio = logp - logp_old.detach()
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range))
    if kl_coeff:
        loss = loss + kl_coeff * 0.5 * log_ratio ** 2
    return loss, {"clip_frac": ((ratio.detach() - 1).abs() > clip_range).float().mean(),
                  "abs_log_ratio": log_ratio.detach().abs().mean()}


def step_rows(P: int, G: int, n_steps: int) -> list[torch.Tensor]:
    """Rows of each optimizer step: the k-th of n_steps contiguous shares of every group (sample n
    belongs to prompt n // G), as upstream's step after every 3 of a GPU's 12 samples, over all
    GPUs. Returns n_steps index tensors covering 0 … P·G − 1 once."""
    groups = torch.arange(P * G).view(P, G)                                   # (P, G)
    shares = [c for c in groups.tensor_split(n_steps, dim=1) if c.shape[1]]   # (P, ≈G/n) each
    return [c.reshape(-1) for c in shares]


# ------------------------------------------------------------------------------------------------
# One MixGRPO iteration on a vgrpo.Run.
# ------------------------------------------------------------------------------------------------
def init_state(run: V.Run, recipe: dict) -> dict:
    """Check the recipe against the run and build what carries across iterations: the grid,
    optimizer steps so far (train_grpo_flux.py counts them for its lr schedule) and the EMA
    (None: upstream evaluates the trained weights)."""
    rec = dict(recipe)
    problems = []
    if run.world > 1:
        problems.append("one process only (MixGRPO here holds every group on one device)")
    if rec["num_steps"] < 3:
        problems.append(f"num_steps {rec['num_steps']} < 3: no trainable window step")
    if rec["window"] < 1 or rec["shift_interval"] < 1 or rec["stride"] < 1 or rec["opt_steps"] < 1:
        problems.append("window, shift_interval, stride and opt_steps must be ≥ 1")
    if rec["sde"] not in SDE_STEPS or rec["ode"] != "euler":
        problems.append(f"sde must be one of {sorted(SDE_STEPS)} and ode 'euler'")
    if problems:
        raise ValueError("invalid MixGRPO recipe:\n  " + "\n  ".join(problems))
    return {"recipe": rec, "sigmas": run.adapter.sigmas(rec["num_steps"]), "step": 0, "ema": None}


@contextlib.contextmanager
def eval_weights(run: V.Run, state: dict):
    """The weights MixGRPO evaluates with: the trained ones (upstream keeps no EMA)."""
    yield


def micro_batches(run: V.Run, rec: dict) -> list[tuple[int, torch.Tensor]]:
    """[(optimizer step k, rows), ...]: each step's rows in --micro_batch chunks, in training order.
    The rollout's window steps run in these same chunks (deviation 5)."""
    P, G = run.args.prompts_per_iter, run.args.group_size
    shares = step_rows(P, G, min(rec["opt_steps"], G))
    return [(k, rows.to(run.dev)) for k, share in enumerate(shares)
            for rows in share.split(run.args.micro_batch)]


@torch.no_grad()
def euler_steps(run: V.Run, x, cond, prompt_idx, sig: list, steps: range) -> torch.Tensor:
    """Plain Euler x ← x + (σ' − σ)·v_θ(x, σ) over `steps`, --rollout_batch rows at a time
    (flow_grpo_step's determistic branch). x (N, *D) fp32, updated in place and returned."""
    for rows in torch.arange(len(x), device=run.dev).split(run.args.rollout_batch):
        c, xr = V.select(cond, prompt_idx[rows]), x[rows]                     # (m, *D)
        for i in steps:
            t = torch.full((len(rows),), sig[i], device=run.dev)
            with run.ctx:
                xr = xr + (sig[i + 1] - sig[i]) * run.adapter.velocity(xr, t, c).float()
        x[rows] = xr
    return x


@torch.no_grad()
def window_rollout(run: V.Run, x1, cond, prompt_idx, sig: list, window: list, rec: dict, mbs,
                   noise):
    """Euler ODE before and after the window, the SDE step inside it (sampling_utils.py
    `run_sample_step`). The ODE parts run --rollout_batch rows at a time; the window steps run in
    the training micro-batches `mbs`, so their forwards see exactly the rows and shapes that
    training will recompute (ratio 1 at θ = θ_old). x1 (N, *D) initial noise; noise (N, T, *D)
    the window's ξ. Returns x0 (N, *D) fp32 (the last state: upstream's drop_last_sample False),
    the window's states traj (N, T + 1, *D) fp32 (traj[:, i] before window step i, traj[:, T]
    after the last) and its old log-probs (N, T) fp32."""
    N, T, K = len(x1), len(window), len(sig) - 1
    step_fn = SDE_STEPS[rec["sde"]]
    first, end = (window[0], window[-1] + 1) if T else (K, K)
    x = euler_steps(run, x1.float().clone(), cond, prompt_idx, sig, range(first))   # (N, *D)
    traj = torch.empty((N, T + 1) + run.D, device=run.dev)                    # (N, T + 1, *D)
    logp_old = torch.zeros(N, T, device=run.dev)                              # (N, T)
    traj[:, 0] = x
    for _, rows in mbs:                           # no window (T = 0): nothing to step
        c, xr = V.select(cond, prompt_idx[rows]), x[rows]
        for w, i in enumerate(window):
            t = torch.full((len(rows),), sig[i], device=run.dev)
            with run.ctx:
                v = run.adapter.velocity(xr, t, c).float()
            xr, logp_old[rows, w], _, _ = step_fn(xr, v, sig[i], sig[i + 1], rec["eta"], sig[1],
                                                  noise=noise[rows, w])
            traj[rows, w + 1] = xr
    x = euler_steps(run, traj[:, T].clone(), cond, prompt_idx, sig, range(end, K))
    return x, traj, logp_old


def mix_iteration(run: V.Run, it: int, state: dict) -> dict:
    """One MixGRPO iteration (train_grpo_flux.py `train_one_step`): window, rollout with stored
    window log-probs, rewards, per-group advantages, then rec["opt_steps"] optimizer steps, each
    accumulating its samples × window steps. Returns host-side metrics."""
    rec, args, ad = state["recipe"], run.args, run.adapter
    P, G, N = args.prompts_per_iter, args.group_size, run.N
    sig = [float(s) for s in state["sigmas"]]
    K = len(sig) - 1
    window = window_at(it, rec)
    T = len(window)
    times, t0 = {}, time.perf_counter()

    # 1. prompts and initial noise exactly as vgrpo's collect_rollouts; then one noise per group
    n_tr, g = len(run.train_prompts), V.generator(args.seed, it, V.Stream.PROMPTS)
    pick = (torch.randperm(n_tr, generator=g)[:P] if P <= n_tr
            else torch.randint(n_tr, (P,), generator=g))
    prompts = [run.train_prompts[i] for i in pick.tolist()]
    cond = ad.encode(prompts)                                                 # P rows
    prompt_idx = (torch.arange(N) // G).to(run.dev)                           # (N,)
    g = V.generator(args.seed, it, V.Stream.ROLLOUT_NOISE)
    x1 = torch.randn((N,) + run.D, generator=g)                               # (N, *D)
    if rec["init_same_noise"]:
        x1 = x1[(torch.arange(N) // G) * G]                                   # group's first row
    x1 = x1.to(run.dev)
    g = V.generator(args.seed, it, baseline_cli.Stream.STEP_NOISE)
    noise = torch.randn((N, T) + run.D, generator=g).to(run.dev)             # (N, T, *D)
    mbs = micro_batches(run, rec)
    x0, traj, logp_old = window_rollout(run, x1, cond, prompt_idx, sig, window, rec, mbs, noise)
    if run.dev.type == "cuda":                    # the GPU's work, before the clock
        torch.cuda.synchronize(run.dev)
    times["time_rollout"] = time.perf_counter() - t0

    # 2. rewards, advantages per group and per reward, weighted sum (advantage_aggr)
    t1 = time.perf_counter()
    rw = run.rewards
    names = [n for n, _ in rw.train_terms]
    raw, _ = V.decode_and_reward(ad, rw, names, x0, [prompts[i // G] for i in range(N)],
                                 args.reward_batch)
    values = V.training_values(raw, rw.train_terms).view(-1, P, G)           # (R, P, G)
    adv, _ = V.per_reward_advantages(values, torch.tensor([w for _, w in rw.train_terms]),
                                     global_std=False, std_eps=rec["std_eps"],
                                     clamp=math.inf, eta=0.0)   # clamp ±5 acts in the loss
    adv = adv.flatten().to(run.dev)                                           # (N,) prompt-major
    head = V.headline(raw, rw.train_terms)
    times["time_reward"] = time.perf_counter() - t1

    # 3. training: per micro-batch and window step, recompute log p_θ with grad; backward each
    t3 = time.perf_counter()
    step_fn = SDE_STEPS[rec["sde"]]
    size = {k: sum(len(r) for j, r in mbs if j == k) for k, _ in mbs}         # samples per step
    clip, logr, grad_norms, first = [], [], [], []
    for i, (k, rows) in enumerate(mbs if T else []):
        c = V.select(cond, prompt_idx[rows])
        for w, j in enumerate(window):
            t = torch.full((len(rows),), sig[j], device=run.dev)
            with run.ctx:
                v = ad.velocity(traj[rows, w], t, c).float()
            _, logp, _, _ = step_fn(traj[rows, w], v, sig[j], sig[j + 1], rec["eta"], sig[1],
                                    x_next=traj[rows, w + 1])
            loss, st = mix_loss(logp, logp_old[rows, w], adv[rows], clip_range=rec["clip_range"],
                                adv_clip_max=rec["adv_clip_max"], kl_coeff=rec["kl_coeff"])
            run.scaler.scale(loss.sum() / (size[k] * T)).backward()
            clip.append(st["clip_frac"])
            logr.append(st["abs_log_ratio"])
            if k == 0:                                    # θ = θ_old before the first step
                first.append((logp - logp_old[rows, w]).detach().abs().max())
        if i + 1 == len(mbs) or mbs[i + 1][0] != k:       # the step's last micro-batch
            grad_norms.append(V.optimizer_step(run))
            state["step"] += 1
    if run.dev.type == "cuda":                    # the GPU's work, before the clock
        torch.cuda.synchronize(run.dev)
    times["time_update"] = time.perf_counter() - t3

    mean_of = lambda xs: float(torch.stack(xs).float().mean()) if xs else math.nan
    r_mean, r_std = V._finite_mean_std(head)
    n_trained = N if T else 0
    return {"method": METHOD, "iter": it, "reward_mean": r_mean, "reward_std": r_std, **times,
            "time_iter": time.perf_counter() - t0, "grad_norm": mean_of(grad_norms),
            "opt_steps": len(grad_norms), "opt_steps_total": state["step"],
            "nfe_rollout": K, "nfe_old": 0, "nfe_theta": T, "nfe_ref": 0,
            "nfe_total": N * K + n_trained * T, "window": window,
            "clip_frac": mean_of(clip), "abs_log_ratio": mean_of(logr),
            "abs_log_ratio_first": float(torch.stack(first).max()) if first else math.nan,
            "n_trained_samples": n_trained, "adv_absmax": float(adv.abs().max())}


# ------------------------------------------------------------------------------------------------
# Command line: this script's flags; anything else goes to vgrpo's parser (same names there).
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    a = p.add_argument
    add_run_flags(p, dtype_help="compute dtype; auto = bf16 on CUDA (MixGRPO's), fp32 on CPU",
                  iterations_help="MixGRPO iterations (scales the window schedule)",
                  out_default="runs/mix_grpo_sd3-<model>-<reward>-<date>")
    a("--mix_steps", type=int, default=None,
      help="MixGRPO's sampler steps K (default: vgrpo's --num_steps; published 25)")
    a("--window", type=int, default=None, help="override the scaled window size")
    a("--shift_interval", type=int, default=None, help="override the scaled shift interval")
    a("--sde", default=None, choices=tuple(SDE_STEPS), help="SDE step (published: flow)")
    a("--eta", type=float, default=None, help="override the SDE noise level η (published 0.7)")
    a("--clip_range", type=float, default=None, help="override the ratio clip ε (published 1e-4)")
    a("--kl_coeff", type=float, default=None, help="override the ½(log ρ)² coefficient (0)")
    a("--no_same_noise", action="store_true", help="an independent initial noise per sample")
    return p


def parse(argv=None):
    """argv → (options with .rec, the MixGRPO recipe; vgrpo.Args): baseline_cli.parse."""
    return baseline_cli.parse(build_parser(), recipe, argv)


def recipe(mine, args) -> dict:
    """The published recipe scaled to K and the iterations (scaled_recipe), with the overrides."""
    rec = scaled_recipe(mine.mix_steps or args.num_steps, mine.iterations)
    for k in ("window", "shift_interval", "sde", "eta", "clip_range", "kl_coeff"):
        if getattr(mine, k) is not None:
            rec[k] = getattr(mine, k)
    if mine.no_same_noise:
        rec["init_same_noise"] = False
    return rec


def main(argv=None) -> list[dict]:
    """Train MixGRPO from an argument list; returns the metrics lines (also in
    <out>/metrics.jsonl, with a held-out evaluation before and after) and saves the LoRA to
    <out>/lora_mix_grpo/ (diffusers format: pipe.load_lora_weights(folder))."""
    mine, args = parse(argv)
    tag = "+".join(n.split(":")[-1] for n, _ in V.parse_reward_spec(args.reward))
    out = Path(mine.out or f"runs/mix_grpo_sd3-{Path(args.model).name}-{tag}-"
                           f"{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    run = V.setup(args)
    state = init_state(run, mine.rec)
    lines = []

    def emit(m: dict) -> None:
        lines.append(m)
        with open(out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(m) + "\n")

    rec = state["recipe"]
    print(f"MixGRPO: K = {rec['num_steps']}, window {rec['window']} ({rec['sde']} SDE, "
          f"η = {rec['eta']:g}) moved every {rec['shift_interval']} iterations, ε = "
          f"{rec['clip_range']:g}, {rec['opt_steps']} optimizer steps per iteration, "
          f"P×G = {args.prompts_per_iter}×{args.group_size}")
    with eval_weights(run, state):
        emit({"method": METHOD, **V.evaluate(run, 0)})
    for it in range(mine.iterations):
        m = mix_iteration(run, it, state)
        emit(m)
        print(f"iter {it}  window {m['window']}  reward {m['reward_mean']:.4f}  "
              f"|log ρ| {m['abs_log_ratio']:.2e}  clip {m['clip_frac']:.2f}  "
              f"grad {m['grad_norm']:.3g}  {m['time_iter']:.2f}s")
    with eval_weights(run, state):
        emit({"method": METHOD, **V.evaluate(run, mine.iterations)})
        from peft.utils import get_peft_model_state_dict
        if run.lora_cfg is not None:
            run.adapter.save_lora(str(out / "lora_mix_grpo"),
                                  get_peft_model_state_dict(run.adapter.transformer), run.lora_cfg)
    (out / "recipe.json").write_text(json.dumps(rec, indent=2))
    print(f"wrote {out}/ (metrics.jsonl, recipe.json, lora_mix_grpo/)")
    return lines


if __name__ == "__main__":
    main()
