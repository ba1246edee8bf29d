"""Flow-GRPO (the MDP baseline) next to V-GRPO on the SD3 path: one update each, and what it costs.

Flow-GRPO (Liu et al. 2025; peer X1) turns the sampler into an MDP: rollouts are SDE solves
(Euler–Maruyama, noise level a = 0.7) whose every step is a Gaussian policy π_θ(x_{i+1} | x_i),
the per-step log-probs are stored during the rollout, and training recomputes the log-prob of
every stored step with gradients and applies a PPO-clipped per-step ratio (ε = 1e-4).
V-GRPO (vgrpo.py) treats the whole generation as ONE action: deterministic ODE rollouts, then
N_MC surrogate forwards for θ_old and N_MC forwards with grad for θ (paper P10).

This script runs a few iterations of each on the same model, batch (P prompts × G images), prompts
and initial noises, from the same LoRA initialisation, and prints the per-iteration cost side by
side: NFE per sample of each phase and the wall time of each phase (rollout, reward, old-policy
pass, update), plus the held-out ODE reward before and after (do not over-read this on the tiny
random model: it only shows that both update code paths run and move the policy).

    python examples/flow_grpo_sd3.py                   # tiny SD3 pipeline, CPU, ~30 s
    python examples/flow_grpo_sd3.py --model sd3.5-medium --reward pickscore --num_steps 10   # one GPU

Any other vgrpo.py flag is passed through (--resolution, --n_mc, --micro_batch, --lr, ...); both
methods use the same LoRA, optimizer, learning rate, grad-norm clip and micro-batch. Output: a
markdown table on stdout and in --out (default examples/flow_grpo_sd3.md); `main(argv)` returns
the rows (used by the tests).

What is Flow-GRPO here, and what is not (peer X1; flow_grpo scripts/train_sd3.py):
  * SDE step, log-prob as a MEAN over latent elements, σ = 1 replaced by sigmas[1] in the
    denominator of the noise scale — as in flow_grpo's sd3_sde_with_logprob.py.
  * old log-probs are the ones stored by the rollout (no extra old-policy pass); the training pass
    recomputes steps 0 … ⌊K·timestep_fraction⌋ − 1 (fraction 0.99: all but the last), in order.
  * advantages: group mean, global std (vgrpo.group_advantages), clamped at ±5, NO soft-clip;
    per-step ratio clipped at 1 ± 1e-4; 2 optimizer steps per iteration (gradient accumulation over
    half the samples × all trained steps), as Flow-GRPO's default config.
  * CFG-free (Flow-GRPO uses CFG 4.5 in rollout and training, which doubles every NFE below) and
    no KL to the reference (β > 0 would add one no-grad forward per trained step); both left out
    to compare like with like against CFG-free, KL-free V-GRPO (SD3.5 Stage 1, paper P11).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # never wait on a hub look-up for the tiny model
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import vgrpo as V


# ------------------------------------------------------------------------------------------------
# Command line: the script's own flags; everything else goes to vgrpo's parser (same names).
# ------------------------------------------------------------------------------------------------
def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | sd3.5-medium | hub id | local diffusers folder")
    p.add_argument("--reward", default="jpeg", help="reward (pickscore | jpeg | ...)")
    p.add_argument("--prompts_per_iter", type=int, default=None, help="P (default: vgrpo's per-model preset)")
    p.add_argument("--group_size", type=int, default=None, help="G (default: vgrpo's per-model preset)")
    p.add_argument("--num_steps", type=int, default=None, help="sampling steps K of both methods (default: preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cuda | cpu | auto")
    p.add_argument("--iterations", type=int, default=5, help="iterations of each method")
    p.add_argument("--noise_level", type=float, default=0.7, help="Flow-GRPO's SDE noise level a")
    p.add_argument("--clip_range", type=float, default=1e-4, help="Flow-GRPO's per-step ratio clip ε")
    p.add_argument("--timestep_fraction", type=float, default=0.99, help="fraction of the K steps trained")
    p.add_argument("--flow_mu", type=int, default=2, help="Flow-GRPO optimizer steps per iteration")
    p.add_argument("--out", default=str(Path(__file__).with_name("flow_grpo_sd3.md")), help="markdown output")
    mine, rest = p.parse_known_args(argv)
    given = ["--model", mine.model, "--reward", mine.reward, "--seed", str(mine.seed), "--device", mine.device]
    for k in ("prompts_per_iter", "group_size", "num_steps"):
        if getattr(mine, k) is not None:
            given += [f"--{k}", str(getattr(mine, k))]
    args = V.parse_args(given + rest)              # vgrpo.Args with the per-model presets applied
    if mine.iterations < 1 or not 1 <= mine.flow_mu <= args.prompts_per_iter * args.group_size:
        raise ValueError("need --iterations ≥ 1 and 1 ≤ --flow_mu ≤ P·G")
    return mine, args


# ------------------------------------------------------------------------------------------------
# Rewards → advantages, as vgrpo.iteration() computes them (Alg. step 2).
# ------------------------------------------------------------------------------------------------
def score_and_advantages(adapter, rewards, args, x0, sample_prompts, P, G, eta):
    """Decode + score N latents, group-relative advantages (soft-clip η; 0 = off). Returns raw, A (N,)."""
    kw = dict(global_std=args.global_std, std_eps=args.std_eps, clamp=args.adv_clamp, eta=eta)
    names = [n for n, _ in rewards.train]
    raw_all, _ = V.score(adapter, rewards, names, x0, sample_prompts, args.reward_batch)
    values = rewards.training_values(raw_all, rewards.train).view(-1, P, G)          # (K, P, G)
    weights = torch.tensor([w for _, w in rewards.train])
    agg = V.per_reward_advantages if args.reward_aggregation == "per_reward" else V.weighted_sum_advantages
    adv, _ = agg(values, weights, **kw)                                                # (P, G)
    return rewards.summary(raw_all, rewards.train), adv.flatten()                      # (N,), (N,)


# ------------------------------------------------------------------------------------------------
# Flow-GRPO's SDE step and log-prob (pure).                                       [peer X1]
#   s_t = a·sqrt(σ/(1−σ)),  Δ = σ' − σ < 0,
#   μ_θ = x·(1 + s_t²Δ/(2σ)) + v_θ·(1 + s_t²(1−σ)/(2σ))·Δ,     x' = μ_θ + s_t·sqrt(−Δ)·ξ,
#   log p_θ(x' | x) = mean_elements[ −(x' − μ_θ)²/(2 s_t²(−Δ)) − log(s_t sqrt(−Δ)) − ½ log 2π ].
# ------------------------------------------------------------------------------------------------
def sde_step(x: torch.Tensor, v: torch.Tensor, s: float, s_next: float, noise_level: float, sigma_max: float,
             x_next: torch.Tensor | None = None, noise: torch.Tensor | None = None):
    """One Euler–Maruyama step from σ = s to σ' = s_next (< s) and its per-sample log-prob.

    x, v: (M, *D); the step is sampled with `noise` (M, *D) when x_next is None, else x_next is
    the stored next state whose log-prob is evaluated (the training pass).
    Returns x_next (M, *D) fp32, log_prob (M,) fp32 (differentiable through v), the mean μ_θ.
    """
    x, v = x.float(), v.float()
    dt = s_next - s                                                          # < 0
    std_t = noise_level * math.sqrt(s / (1 - (sigma_max if s == 1.0 else s)))   # σ = 1 → sigmas[1]
    mean = x * (1 + std_t ** 2 / (2 * s) * dt) + v * (1 + std_t ** 2 * (1 - s) / (2 * s)) * dt
    step_std = std_t * math.sqrt(-dt)
    if x_next is None:
        x_next = mean + step_std * noise.float()
    log_prob = (-(x_next.detach().float() - mean) ** 2 / (2 * step_std ** 2)
                - math.log(step_std) - 0.5 * math.log(2 * math.pi))
    return x_next, log_prob.flatten(1).mean(dim=1), mean


@torch.no_grad()
def sde_rollout(adapter, x1, cond, prompt_idx, sigmas, noise_level, batch, ctx, generator):
    """SDE-solve every row of x1 (N, *D), `batch` rows at a time, storing the trajectory.

    Returns traj (N, K + 1, *D) fp32 (traj[:, 0] = x1, traj[:, -1] = the sample) and the old
    log-probs (N, K) fp32 of every step — Flow-GRPO's θ_old terms come free with the rollout.
    """
    sig = [float(s) for s in sigmas]
    K = len(sig) - 1
    noise = torch.randn((len(x1), K) + tuple(x1.shape[1:]), generator=generator).to(x1.device)   # (N, K, *D)
    trajs, logps = [], []
    for rows in torch.arange(len(x1), device=x1.device).split(batch):
        c = V.select(cond, prompt_idx[rows])
        x, traj, lp = x1[rows].float(), [x1[rows].float()], []
        for i in range(K):
            t = torch.full((len(rows),), sig[i], device=x.device)
            with ctx:
                v = adapter.velocity(x, t, c)
            x, logp, _ = sde_step(x, v, sig[i], sig[i + 1], noise_level, sig[1], noise=noise[rows, i])
            traj.append(x)
            lp.append(logp)
        trajs.append(torch.stack(traj, dim=1))
        logps.append(torch.stack(lp, dim=1))
    return torch.cat(trajs), torch.cat(logps)


def flow_grpo_loss(logp_new, logp_old, adv, clip_range):
    """PPO-clip on ONE step's ratio r = exp(log p_θ − log p_old), mean over samples (minimise)."""
    ratio = torch.exp(logp_new - logp_old.detach())                                  # (m,)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range)).mean()
    return loss, ratio


# ------------------------------------------------------------------------------------------------
# One Flow-GRPO iteration, phase for phase like vgrpo.iteration() (same prompts and x1 streams).
# ------------------------------------------------------------------------------------------------
def flow_grpo_iteration(mine, args, adapter, rewards, opt, params, train_prompts, it, P, G, D, sigmas,
                        dev, ctx) -> dict:
    N, K = P * G, len(sigmas) - 1
    T = max(1, int(K * mine.timestep_fraction))           # trained steps: 0 … T − 1
    sig = [float(s) for s in sigmas]
    times = {}
    t0 = time.perf_counter()
    g_prompt, g_noise, g_perm, g_sde = (V._gen(args.seed, it, s) for s in (0, 1, 3, 5))

    # 1. rollout: SDE, storing every state and every step's log-prob under θ_old (= θ now)
    pick = torch.randperm(len(train_prompts), generator=g_prompt)[:P] if P <= len(train_prompts) \
        else torch.randint(len(train_prompts), (P,), generator=g_prompt)
    prompts = [train_prompts[i] for i in pick.tolist()]
    cond = adapter.encode(prompts)
    prompt_idx = (torch.arange(N) // G).to(dev)
    x1 = torch.randn((N,) + D, generator=g_noise).to(dev)
    traj, logp_old = sde_rollout(adapter, x1, cond, prompt_idx, sigmas, mine.noise_level, args.rollout_batch,
                                 ctx, g_sde)                              # (N, K+1, *D), (N, K)
    V._sync(dev)
    times["time_rollout"] = time.perf_counter() - t0

    # 2. rewards of the final states; advantages: group mean, global std, clamp ±5, no soft-clip
    t1 = time.perf_counter()
    raw, adv = score_and_advantages(adapter, rewards, args, traj[:, -1], [prompts[i // G] for i in range(N)],
                                    P, G, eta=0.0)
    adv = adv.to(dev)
    times["time_reward"] = time.perf_counter() - t1
    times["time_old"] = 0.0                                # old log-probs were stored by the rollout

    # 3. training: per minibatch, recompute log p_θ(x_{j+1} | x_j) for every trained step j with
    #    grad, per-step clipped ratio, gradients accumulated over samples × steps, then one step.
    t3 = time.perf_counter()
    perm = torch.randperm(N, generator=g_perm).to(dev)
    clipped, abs_logr, first_abs_logr, grad_norms = [], [], None, []
    for mb in perm.tensor_split(mine.flow_mu):
        opt.zero_grad(set_to_none=True)
        for rows in mb.split(args.micro_batch):
            c = V.select(cond, prompt_idx[rows])
            for j in range(T):
                t = torch.full((len(rows),), sig[j], device=dev)
                with ctx:
                    v = adapter.velocity(traj[rows, j], t, c)
                _, logp, _ = sde_step(traj[rows, j], v, sig[j], sig[j + 1], mine.noise_level, sig[1],
                                      x_next=traj[rows, j + 1])
                loss, ratio = flow_grpo_loss(logp, logp_old[rows, j], adv[rows], mine.clip_range)
                (loss * len(rows) / len(mb) / T).backward()        # mean over samples and steps
                logr = (logp - logp_old[rows, j]).detach().abs()
                if first_abs_logr is None:
                    first_abs_logr = logr.mean()                   # θ = θ_old here: should be ~0
                abs_logr.append(logr.mean())
                clipped.append(((ratio.detach() - 1).abs() > mine.clip_range).float().mean())
        gn = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        if torch.isfinite(gn):
            opt.step()
        grad_norms.append(gn.detach().float())
    opt.zero_grad(set_to_none=True)
    V._sync(dev)
    times["time_update"] = time.perf_counter() - t3
    return {"iter": it, "reward_mean": float(raw.mean()), "reward_std": float(raw.std(unbiased=False)),
            **times, "time_iter": time.perf_counter() - t0,
            "nfe_rollout": K, "nfe_old": K, "nfe_theta": T,
            "clip_frac": float(torch.stack(clipped).mean()), "abs_log_ratio": float(torch.stack(abs_logr).mean()),
            "abs_log_ratio_first": float(first_abs_logr), "grad_norm": float(torch.stack(grad_norms).mean())}


# ------------------------------------------------------------------------------------------------
# Held-out evaluation: fixed prompts and noise, deterministic ODE, the same for both methods.
# ------------------------------------------------------------------------------------------------
def evaluate(adapter, rewards, args, eval_prompts, D, dev, ctx) -> float:
    prompts = eval_prompts[:args.n_eval]
    n = len(prompts)
    x1 = torch.randn((n,) + D, generator=V._gen(args.seed, 0, 9)).to(dev)
    cond = adapter.encode(prompts)
    lat = V.rollout(adapter, x1, cond, torch.arange(n, device=dev), adapter.sigmas(args.eval_steps or 2 * args.num_steps),
                    args.solver, args.rollout_batch, ctx)
    raw, _ = score_and_advantages(adapter, rewards, args, lat, prompts, 1, n, eta=0.0)
    return float(raw.mean())


def run(mine, args, log=print, pipe=None, rewards=None) -> tuple[list[dict], dict]:
    """Both methods, one after the other, from the same LoRA init. `pipe` / `rewards` may be passed
    in already built (e.g. examples/gpu_check.py's random-weight SD3.5-M); else loaded from args."""
    t_start = time.perf_counter()
    dev, dtype, ctx = V.setup_device(args)
    torch.manual_seed(args.seed)
    pipe = pipe if pipe is not None else V.load_pipeline(args.model, dtype)
    pipe.to(dev)
    pipe.vae.to(torch.float32)
    adapter = V.make_adapter(pipe, args, dev)
    V.add_lora(adapter.transformer, args.lora_rank, args.lora_alpha, args.lora_targets.split(","))
    if args.gradient_checkpointing:
        adapter.transformer.enable_gradient_checkpointing()
    named = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    init = {n: p.detach().clone() for n, p in named.items()}          # both methods start here
    params = list(named.values())
    rewards = rewards if rewards is not None else V.Rewards(args, dev, dtype)
    train_prompts, eval_prompts = V.load_prompts(args)

    P, G, J = args.prompts_per_iter, args.group_size, args.n_mc
    D = adapter.latent_shape(args.resolution)
    sigmas = adapter.sigmas(args.num_steps)

    rows = []
    for method in ("V-GRPO", "Flow-GRPO"):
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(init[n])
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
        before = evaluate(adapter, rewards, args, eval_prompts, D, dev, ctx)
        hist = []
        vrun = V.Run(args=args, adapter=adapter, rewards=rewards, opt=opt, params=params, lora_cfg=None,
                     train_prompts=train_prompts, eval_prompts=eval_prompts, dev=dev, dtype=dtype, ctx=ctx,
                     sigmas=sigmas, eval_sigmas=sigmas, D=D)
        for it in range(mine.iterations):
            if method == "V-GRPO":
                m = V.iteration(vrun, it)
            else:
                m = flow_grpo_iteration(mine, args, adapter, rewards, opt, params, train_prompts, it, P, G, D,
                                        sigmas, dev, ctx)
            hist.append(m)
            log(f"{method:9s} iter {it}  reward {m['reward_mean']:.4f}  |log ρ| {m['abs_log_ratio']:.2e}  "
                f"clip {m['clip_frac']:.2f}  grad {m['grad_norm']:.3g}  {m['time_iter']:.2f}s")
        after = evaluate(adapter, rewards, args, eval_prompts, D, dev, ctx)
        moved = torch.sqrt(sum((p.detach().float() - init[n].float()).square().sum() for n, p in named.items()))
        med = lambda k: statistics.median(h[k] for h in hist)       # robust to a first-iteration warm-up
        rows.append({
            "method": method,
            "rollout": f"{args.num_steps}-step {args.solver} ODE" if method == "V-GRPO"
                       else f"{args.num_steps}-step SDE (a = {mine.noise_level})",
            "nfe_rollout": hist[0]["nfe_rollout"],
            "nfe_old_extra": hist[0]["nfe_old"] - hist[0]["nfe_rollout"],
            "nfe_pi_old": hist[0]["nfe_old"], "nfe_theta": hist[0]["nfe_theta"],
            "opt_steps": args.mu if method == "V-GRPO" else mine.flow_mu,
            **{k: med(k) for k in ("time_rollout", "time_reward", "time_old", "time_update", "time_iter")},
            "clip_frac": statistics.mean(h["clip_frac"] for h in hist),
            "abs_log_ratio_first": hist[0].get("abs_log_ratio_first", hist[0]["abs_log_ratio"]),
            "train_reward_first": hist[0]["reward_mean"], "train_reward_last": hist[-1]["reward_mean"],
            "eval_reward_before": before, "eval_reward_after": after, "lora_change": float(moved),
        })
    info = {"model": args.model, "reward": args.reward, "device": str(dev), "dtype": str(dtype).split(".")[-1],
            "P": P, "G": G, "K": args.num_steps, "J": J, "resolution": args.resolution,
            "iterations": mine.iterations, "seed": args.seed, "lr": args.lr, "micro_batch": args.micro_batch,
            "T_train": max(1, int(args.num_steps * mine.timestep_fraction)), "clip_range": mine.clip_range,
            "n_eval": min(args.n_eval, len(eval_prompts)), "seconds": time.perf_counter() - t_start}
    return rows, info


def to_markdown(rows, info) -> str:
    head = (f"Flow-GRPO vs V-GRPO, per-iteration cost (examples/flow_grpo_sd3.py): model `{info['model']}`, "
            f"reward `{info['reward']}`, {info['device']} {info['dtype']}; P×G = {info['P']}×{info['G']} at "
            f"{info['resolution']} px, K = {info['K']} sampling steps, V-GRPO N_MC = {info['J']}, Flow-GRPO "
            f"trains {info['T_train']} of {info['K']} steps with clip ε = {info['clip_range']:g}; same LoRA init, "
            f"lr {info['lr']:g}, micro-batch {info['micro_batch']}, seed {info['seed']}; {info['iterations']} "
            f"iterations each (times: median over them); {info['seconds']:.0f} s in all.\n\n")
    cols = ("| method | rollout | NFE rollout | NFE old (extra) | NFE π_θold | NFE π_θ (with grad) | opt. steps | "
            "rollout s | reward s | old s | update s | iteration s | clip frac | \\|log ρ\\| at θ=θ_old | "
            "‖Δθ_LoRA‖ | train reward first → last | eval reward before → after |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['method']} | {r['rollout']} | {r['nfe_rollout']} | {r['nfe_old_extra']} | {r['nfe_pi_old']} | "
             f"{r['nfe_theta']} | {r['opt_steps']} | {r['time_rollout']:.2f} | {r['time_reward']:.2f} | "
             f"{r['time_old']:.2f} | {r['time_update']:.2f} | {r['time_iter']:.2f} | {r['clip_frac']:.2f} | "
             f"{r['abs_log_ratio_first']:.1e} | {r['lora_change']:.3g} | {r['train_reward_first']:.4f} → {r['train_reward_last']:.4f} | "
             f"{r['eval_reward_before']:.4f} → {r['eval_reward_after']:.4f} |" for r in rows]
    foot = ("\n\nNFE per sample (transformer forwards; CFG-free): π_θold = rollout + extra old-policy pass "
            "(the paper's Table 1 convention, paper P10); π_θ = forwards with grad (each also one backward). "
            "Flow-GRPO's old log-probs come with its SDE rollout (0 extra), V-GRPO needs N_MC extra "
            "surrogate forwards. Train reward: Flow-GRPO's is of SDE samples, V-GRPO's of ODE samples; eval "
            f"reward: deterministic ODE on {info['n_eval']} held-out prompts with fixed noise, same for both.\n")
    return head + cols + "\n".join(lines) + foot


def main(argv=None) -> list[dict]:
    mine, args = parse(argv)
    rows, info = run(mine, args)
    md = to_markdown(rows, info)
    print("\n" + md)
    if mine.out:
        Path(mine.out).write_text(md)
    return rows


if __name__ == "__main__":
    main()
