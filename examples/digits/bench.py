"""The digits benchmark's runs: the plan, each method's trainer, one JSON per run, the workers.

    python examples/digits.py benchmark              # the plan below; resumable, 2 workers
    python examples/digits.py benchmark --quick      # the same in miniature (runs/digits-quick)
    python examples/digits.py benchmark --plan_only  # write plan.json and base.json, run nothing

A plan is fixed before any run and written to the results folder's plan.json. Every run is one
method at one lr and seed on the pretrained digits model of examples/digits.py, built by
vgrpo.setup (the same LoRA, AdamW, rewards, prompts and P × G for every method), evaluated on the
held-out set every `eval_every` iterations and on the validation set at the end. Workers (one
process each) take the next job whose inputs are finished; a killed benchmark resumes where it
stopped. The statistics are in digits_stats.py, the report in digits_report.py.

The plan ("regime", the default), in the order the workers take it:
  select    every method of `methods` at every lr of `lrs` on the selection seeds, B iterations;
            each method's lr is chosen from these runs on the validation set (digits_stats.choose)
  confirm   every method at its chosen lr on the confirmation seeds, which the choice never saw;
            the claims are measured on these runs
  variant   a variant of a method (MixGRPO's old squeezed window schedule, DiffusionNFT's old-policy
            decay scaled to B) at that method's chosen lr, on the confirmation seeds
  timing    seconds per iteration: one iteration of each method in turn, in one process
  swap      B = 32, lr 3e-3: V-GRPO given one of DiffusionNFT's knobs at a time, and DiffusionNFT
  nmc       B = 32: V-GRPO's N_MC at 2, 4, 8 and 10, at V-GRPO's chosen lr and at 3e-3

The follow-up ("followup"; results in examples/digits_results_followup, its plan.md):

    python examples/digits.py benchmark --plan followup --workers 1 --threads 1

  timing    seconds per iteration of V-GRPO (GenEval-stage) and DiffusionNFT, in one process
  fixed     runs at an lr and budget fixed in the plan, on fresh seeds 7–11: V-GRPO (GenEval-stage)
            at 1e-3 for 160 iterations (shared by Run A and Run B), DiffusionNFT at 1e-3 for 160
            (Run A: the same lr), DiffusionNFT at 3e-4 for 384, evaluated every 16 (Run B: each
            method at the lr the B = 128 plan chose)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from examples import digits as D

V = D.V
RESULTS = Path(__file__).with_name("digits_results")

# ------------------------------------------------------------------------------------------------
# The methods. Each is a spec: which trainer ("kind") and its knobs. Every method trains the same
# LoRA from vgrpo.setup; the published lr of each is 3e-4 for LoRA on SD3.5-M (MixGRPO publishes
# 1e-5 for a full fine-tune of FLUX.1-dev), all at a far larger batch than this benchmark's 4 × 8.
# ------------------------------------------------------------------------------------------------
# V-GRPO's GenEval-stage recipe (vgrpo.py --preset geneval-stage) at the benchmark's batch: the
# paper trains its correctness rewards (GenEval, OCR) with N_MC 10, μ 2 and a ratio clip of 1e-2,
# without soft clipping.
GENEVAL_FLAGS = ["--n_mc", "10", "--mu", "2", "--clip_eps", "1e-2", "--soft_clip_eta", "0"]
CONFIGS = {
    "V-GRPO": dict(kind="vgrpo", flags=[]),                    # the shipped preference recipe
    "V-GRPO (GenEval-stage)": dict(kind="vgrpo", flags=GENEVAL_FLAGS),
    "DiffusionNFT": dict(kind="nft"),                           # config/nft.py sd3_pickscore
    "DiffusionNFT (decay scaled)": dict(kind="nft", decay="scaled"),
    "MixGRPO": dict(kind="mix", schedule="in_range"),
    "MixGRPO (old scaled schedule)": dict(kind="mix", schedule="scaled"),
    "Flow-GRPO (no CFG)": dict(kind="flow", mdp="nocfg"),
    # V-GRPO given one of DiffusionNFT's knobs; the evaluation EMA is tracked in the V-GRPO run
    "V-GRPO, soft clip off": dict(kind="vgrpo", flags=["--soft_clip_eta", "0"]),
    "V-GRPO, 9 per-sample pairs": dict(kind="vgrpo", flags=["--n_mc", "9", "--pair_sharing",
                                                             "none"]),
    **{f"V-GRPO, N_MC {j}": dict(kind="vgrpo", flags=["--n_mc", str(j)]) for j in (2, 4, 8, 10)},
}
# DiffusionNFT's evaluation EMA (train_nft_sd3.py: decay 0.9, every optimizer step), given to
# V-GRPO in the knob swap
EVAL_EMA = dict(decay=0.9, interval=1)
# DiffusionNFT's published count of gradient steps over the SD3.5-M curriculum (about 1.7K); its
# old-policy decay min(0.001·step, 0.5) reaches the plateau 0.5 at step 500 of them. The scaled
# variant runs the same schedule on a time axis shrunk by 1.7K / B.
NFT_PUBLISHED_STEPS = 1700

# ------------------------------------------------------------------------------------------------
# The plans. "regime" is the one the README reports; "quick" and "smoke" are miniatures.
# ------------------------------------------------------------------------------------------------
REGIME_METHODS = ["V-GRPO (GenEval-stage)", "V-GRPO", "DiffusionNFT", "MixGRPO"]
PLANS = {
    "regime": dict(
        iterations=128, lrs=[3e-4, 1e-3, 3e-3, 1e-2], selection_seeds=[0, 1],
        confirmation_seeds=[2, 3, 4, 5, 6], eval_every=8, n_heldout=40, n_val=20,
        methods=REGIME_METHODS, claims_vgrpo="V-GRPO (GenEval-stage)",
        claims_vgrpo_reason=("the digits reward is a correctness reward, like GenEval, and the "
                             "paper trains such rewards with its GenEval-stage knobs"),
        variants={"MixGRPO (old scaled schedule)": "MixGRPO",
                  "DiffusionNFT (decay scaled)": "DiffusionNFT"},
        timing_rounds=8,
        swap=dict(iterations=32, lr=3e-3, seeds=[0, 1, 2], eval_every=8,
                  configs=["V-GRPO", "V-GRPO, soft clip off", "V-GRPO, 9 per-sample pairs",
                           "DiffusionNFT"]),
        nmc=dict(iterations=32, lrs=["chosen", 3e-3], seeds=[0, 1, 2], eval_every=8,
                 values=[2, 4, 8, 10])),
    "quick": dict(
        iterations=8, lrs=[1e-3, 3e-3], selection_seeds=[0], confirmation_seeds=[1],
        eval_every=4, n_heldout=40, n_val=20, methods=REGIME_METHODS,
        claims_vgrpo="V-GRPO (GenEval-stage)", claims_vgrpo_reason="as the full plan",
        variants={}, timing_rounds=2, swap=None, nmc=None),
    "smoke": dict(
        iterations=2, lrs=[3e-3], selection_seeds=[0], confirmation_seeds=[1],
        eval_every=2, n_heldout=4, n_val=2, methods=["V-GRPO", "DiffusionNFT", "MixGRPO"],
        claims_vgrpo="V-GRPO", claims_vgrpo_reason="a test of the machinery",
        variants={"MixGRPO (old scaled schedule)": "MixGRPO"}, timing_rounds=1,
        swap=dict(iterations=2, lr=3e-3, seeds=[0], eval_every=2, configs=["V-GRPO"]),
        nmc=dict(iterations=2, lrs=["chosen"], seeds=[0], eval_every=2, values=[2])),
}
# The follow-up: does the DiffusionNFT claim hold when the lr and the budget no longer
# decide it? Every run's lr and budget are fixed here, before any run; nothing is chosen from them.
VGEN = "V-GRPO (GenEval-stage)"
FOLLOWUP_UNIT = (
    "The paper's 580 and ~1.7K count iterations (rollout rounds), for both methods. Sources: "
    "METHOD.md P11 (lines 161-162: stage lengths 150 / 200 / 150 / 50 / 30 = 580 iterations) "
    "and C9 (lines 336-338: iterations are what is counted against the paper's 580); PAPER.md "
    "§1.7 (lines 127-132: the same stage lengths, DiffusionNFT ≈ 800/300/200/200/100 ≈ 1.7K, "
    "and NFE_θ 6.9 as the stage-length-weighted mean of N_MC), Table 5 (lines 187-195: 48 NFE "
    "per step in the preference stages = 40 rollout + 4 + 4, 60 in the GenEval stages = 40 + "
    "10 + 10, so each step pays one 40-step rollout: a step is a rollout round) and §3 item 9 "
    "(line 258: count steps as iterations against the 580). PAPER.md line 211 paraphrases the "
    "headline as gradient steps; in Stage 1 (μ = 1) the two are the same, and only V-GRPO "
    "(GenEval-stage)'s μ = 2 separates them here. The verdict is given in iterations; every "
    "table also gives gradient steps.")
FOLLOWUP_RULES = dict(
    settled=("Budget sensitivity. For each comparison the speed-up is measured with the "
             "baseline cut off at the last evaluation at or before ½, ¾ and all of its budget "
             "B: the target is the baseline's seed-mean held-out reward there, the speed-up "
             "cut-off·u_b / (h·u_v) with h V-GRPO's iterations to that target (u: the unit's "
             "count per iteration). Where V-GRPO's seed-mean curve does not reach a target in "
             "its own budget, that cut-off's speed-up is taken at its bound, cut-off·u_b / "
             "(Bv·u_v). The baseline has settled when the speed-ups at ½ and ¾ of B lie inside "
             "the 95 % interval of the speed-up at B."),
    verdict=("A baseline that did not improve on the base model (its gain's interval reaches "
             "0): not tested, no target. A baseline that has settled: agrees (the interval at "
             "B lies above 1 and reaches the claimed 1700/580 = 2.9×), disagrees (it lies "
             "wholly below 2.9×), not resolved (it includes both 1 and 2.9×). A baseline that "
             "has not settled: not tested, and the report says which way the interval leans: "
             "where the interval at B lies against 2.9× and 1, and how the speed-up moved "
             "from ½ to all of the budget."),
    ladder=("Targets: the base model's held-out reward plus 25, 50, 75, 90 and 100 % of the "
            "final gain of the claim's baseline (DiffusionNFT at 3e-4, the lr the B = 128 plan "
            "chose, after its 384 iterations) over the base model. The same target rewards in "
            "every table, for both runs and every unit."),
    seeds=("Every reported number is on seeds 7-11, which no earlier run used; nothing in "
           "this plan is chosen from its runs."),
)
FOLLOWUP = dict(
    iterations=160, lrs=[], selection_seeds=[], confirmation_seeds=[7, 8, 9, 10, 11],
    eval_every=8, n_heldout=40, n_val=20, methods=[VGEN, "DiffusionNFT"], claims_vgrpo=VGEN,
    claims_vgrpo_reason="as in the B = 128 plan, whose claims it used", variants={},
    timing_rounds=8, swap=None, nmc=None,
    # the runs, in the order the worker takes them (seed by seed: a finished pair is paired)
    runs=[dict(method=VGEN, lr=1e-3, iterations=160, eval_every=8),
          dict(method="DiffusionNFT", lr=1e-3, iterations=160, eval_every=8),
          dict(method="DiffusionNFT", lr=3e-4, iterations=384, eval_every=16)],
    comparisons=[
        dict(name="Run A", what="both methods at the same lr, 1e-3", vgrpo=[VGEN, 1e-3, 160],
             baseline=["DiffusionNFT", 1e-3, 160]),
        dict(name="Run B", what="each method at the lr the B = 128 plan chose for it",
             vgrpo=[VGEN, 1e-3, 160], baseline=["DiffusionNFT", 3e-4, 384])],
    ladder_baseline=["DiffusionNFT", 3e-4, 384],
    chosen_lrs={VGEN: 1e-3, "DiffusionNFT": 3e-4},           # the B = 128 plan's choice
    cutoffs=[0.5, 0.75, 1.0], ladder=[0.25, 0.5, 0.75, 0.9, 1.0],
    claim=dict(factor=1700 / 580, unit="iters", label="3× fewer iterations than DiffusionNFT",
               paper="SD3.5-M: about 1.7K steps down to 580"),
    unit=FOLLOWUP_UNIT, rules=FOLLOWUP_RULES,
    model_from="examples/digits_results/cache")             # the model of the B = 128 runs
PLANS["followup"] = FOLLOWUP
# the same in miniature, for the tests: one seed, 1 × 4 rollouts per iteration
PLANS["followup-smoke"] = dict(
    FOLLOWUP, iterations=2, confirmation_seeds=[0], eval_every=1, n_heldout=4, n_val=2,
    timing_rounds=1, extra_flags=["--prompts_per_iter", "1", "--group_size", "4"],
    runs=[dict(method=VGEN, lr=1e-3, iterations=2, eval_every=1),
          dict(method="DiffusionNFT", lr=1e-3, iterations=2, eval_every=1),
          dict(method="DiffusionNFT", lr=3e-4, iterations=4, eval_every=2)],
    comparisons=[dict(c, vgrpo=[VGEN, 1e-3, 2], baseline=[*c["baseline"][:2], b])
                 for c, b in zip(FOLLOWUP["comparisons"], (2, 4))],
    ladder_baseline=["DiffusionNFT", 3e-4, 4], model_from=None)
DEFAULT_OUT = {"quick": Path("runs/digits-quick"),
               "followup": Path(__file__).with_name("digits_results_followup")}
DIVERSITY_KEEP = 0.9      # an lr is eligible if its validation diversity ≥ 0.9 × the base model's
# Seconds per training iteration measured on the 2-core machine (1 thread per process, another
# process on the other core) and per 400-image held-out evaluation; the plan's estimate uses them.
MEASURED = dict(sec_per_iter={"vgrpo": 1.65, "nft": 3.78, "mix": 1.29, "flow": 2.0},
                sec_per_eval_400=8.0, sec_setup=5.0)
# Seconds per iteration of the B = 128 plan's finished runs (examples/digits_results: each run's
# seconds / iterations, its held-out evaluation every 8 iterations included; 2 workers of 1 thread
# on the 2-core machine), per (method, lr): the follow-up's estimate uses them.
MEASURED_B128 = {(VGEN, 1e-3): 11.13, ("DiffusionNFT", 1e-3): 13.76, ("DiffusionNFT", 3e-4): 11.96}


def sec_per_iter(name: str) -> float:
    """The estimate's seconds per iteration of a method: its kind's, times N_MC / 4 for V-GRPO
    (its θ forwards dominate; μ = 2 adds N_MC / 2 no-grad forwards for θ_old)."""
    spec = CONFIGS[name]
    s = MEASURED["sec_per_iter"][spec["kind"]]
    if spec["kind"] == "vgrpo":
        fl = spec["flags"]
        j = int(fl[fl.index("--n_mc") + 1]) if "--n_mc" in fl else 4
        mu = int(fl[fl.index("--mu") + 1]) if "--mu" in fl else 1
        s *= (0.5 + 0.5 * j / 4) * (1 + 0.25 * (mu - 1))
    return s


def slug(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower()).strip("_")


def _lr_id(lr) -> str:
    return "chosen" if lr in (None, "chosen") else f"lr{lr:g}"


def jobs_of(plan: dict) -> list[dict]:
    """Every run of the plan, in the order workers take them. lr None: the method's chosen lr,
    known once its selection runs are finished. "parent": the method whose chosen lr a run takes."""
    B, jobs = plan["iterations"], []
    if plan.get("runs"):
        return fixed_jobs(plan)
    sel = [dict(kind="select", method=m, lr=lr, seed=s, iterations=B, parent=None)
           for s in plan["selection_seeds"] for lr in plan["lrs"] for m in plan["methods"]]
    jobs += sel
    jobs += [dict(kind="confirm", method=m, lr=None, seed=s, iterations=B, parent=m)
             for s in plan["confirmation_seeds"] for m in plan["methods"]]
    jobs += [dict(kind="variant", method=v, lr=None, seed=s, iterations=B, parent=p)
             for s in plan["confirmation_seeds"] for v, p in plan["variants"].items()]
    jobs.append(dict(kind="timing", method="all", lr=None, seed=0, iterations=0, parent="all"))
    sw = plan.get("swap")
    if sw:
        jobs += [dict(kind="swap", method=m, lr=sw["lr"], seed=s, iterations=sw["iterations"],
                      parent=None) for s in sw["seeds"] for m in sw["configs"]]
    nm = plan.get("nmc")
    if nm:
        jobs += [dict(kind="nmc", method=f"V-GRPO, N_MC {j}", lr=None if lr == "chosen" else lr,
                      seed=s, iterations=nm["iterations"],
                      parent="V-GRPO" if lr == "chosen" else None)
                 for s in nm["seeds"] for lr in nm["lrs"] for j in nm["values"]]
    for j in jobs:
        j["id"] = f"{j['kind']}__{slug(j['method'])}__{_lr_id(j['lr'])}__s{j['seed']}"
    return jobs


def fixed_jobs(plan: dict) -> list[dict]:
    """A plan whose runs are all fixed (the follow-up), in the order the worker takes them: the
    timing job; the runs of budget plan["iterations"] (Run A: both methods at 1e-3) seed by seed,
    so that each finished pair of seeds is a paired comparison; then the longer runs, seed by
    seed. Ids name method, lr, budget and seed."""
    spec = lambda r, s: dict(kind="fixed", method=r["method"], lr=r["lr"], seed=s,
                             iterations=r["iterations"], eval_every=r["eval_every"], parent=None)
    short = [r for r in plan["runs"] if r["iterations"] == plan["iterations"]]
    long_ = [r for r in plan["runs"] if r["iterations"] != plan["iterations"]]
    jobs = [dict(kind="timing", method="all", lr=None, seed=0, iterations=0, parent=None,
                 id="timing__all__fixed__s0")]
    for group in (short, long_):
        jobs += [spec(r, s) for s in plan["confirmation_seeds"] for r in group]
    for j in jobs[1:]:
        j["id"] = f"fixed__{slug(j['method'])}__{_lr_id(j['lr'])}__B{j['iterations']}__s{j['seed']}"
    return jobs


def fixed_chosen(plan: dict) -> dict:
    """{method: {"lr"}} of a plan that fixes its lrs (the timing job times them)."""
    return {m: {"lr": lr} for m, lr in (plan.get("chosen_lrs") or {}).items()}


def needs(job: dict, jobs: list[dict]) -> list[str]:
    """Ids of the runs a job's lr is chosen from (the timing job: every method's)."""
    if job["parent"] is None:
        return []
    return [j["id"] for j in jobs if j["kind"] == "select"
            and (job["parent"] == "all" or j["method"] == job["parent"])]


def eval_every_of(plan: dict, job: dict) -> int:
    if "eval_every" in job:
        return job["eval_every"]
    return plan[job["kind"]]["eval_every"] if job["kind"] in ("swap", "nmc") else plan["eval_every"]


def estimate(plan: dict, workers: int = 2) -> dict:
    """Seconds the plan takes, from MEASURED: each run's iterations, its held-out evaluations
    (an EMA method also evaluates its other weights at the end), the validation set and the
    setup; wall-clock = worker-seconds / workers."""
    M, e400 = MEASURED, MEASURED["sec_per_eval_400"] * plan["n_heldout"] / 40
    per, by_run = {}, {}
    for j in jobs_of(plan):
        if j["kind"] == "timing":
            c = plan["timing_rounds"] * sum(sec_per_iter(m) for m in plan["methods"])
        elif (j["method"], j["lr"]) in MEASURED_B128 and plan.get("runs"):
            c = M["sec_setup"] + j["iterations"] * MEASURED_B128[(j["method"], j["lr"])]
        else:
            n_ev = j["iterations"] // eval_every_of(plan, j) + 2
            c = M["sec_setup"] + j["iterations"] * sec_per_iter(j["method"]) + n_ev * e400
        per[j["kind"]] = per.get(j["kind"], 0.0) + c
        key = f"{j['method']} lr {j['lr']:g} B {j['iterations']}" if j["kind"] == "fixed" \
            else j["kind"]
        by_run[key] = by_run.get(key, 0.0) + c
    total = sum(per.values())
    out = {"worker_seconds": round(total), "wall_seconds": round(total / max(workers, 1)),
           "by_kind": {k: round(v) for k, v in per.items()}, "from": M}
    if plan.get("runs"):
        out.update(by_run={k: round(v) for k, v in by_run.items()}, from_b128={
            f"{m} lr {lr:g}": s for (m, lr), s in MEASURED_B128.items()})
    return out


def new_plan(mode: str, workers: int, threads: int) -> dict:
    """The plan.json of a new results folder: the plan, the rules and the recipes it fixes."""
    plan = dict(PLANS[mode])
    names = set(plan["methods"]) | set(plan["variants"])
    names |= set((plan.get("swap") or {}).get("configs", []))
    return dict(plan, mode=mode, version=2, common_flags=D.COMMON,
                configs={m: CONFIGS[m] for m in sorted(names)}, eval_ema=EVAL_EMA,
                recipes=recipes_of(plan), diversity_keep=DIVERSITY_KEEP, lr_beats_base=True,
                heldout_templates=D.EVAL_TEMPLATES, val_templates=D.VAL_TEMPLATES,
                heldout_seed=D.HELDOUT_SEED, val_seed=D.VAL_SEED, workers=workers,
                threads=threads, estimate=estimate(plan, workers),
                written=time.strftime("%Y-%m-%d %H:%M:%S"), commit=commit())


def recipes_of(plan: dict) -> dict:
    """The baselines' recipes as they run at budget B: DiffusionNFT's published sd3_pickscore (its
    K = 10 dpm2 steps are the benchmark's 10) and its decay-scaled variant; MixGRPO's window
    schedule in the published σ range and the old squeezed one, with the σ each trains."""
    NFT, MIX = example("diffusion_nft_sd3"), example("mix_grpo_sd3")
    K, B = int(D.COMMON[D.COMMON.index("--num_steps") + 1]), plan["iterations"]
    sig = grid_sigmas(K)
    rec = {k: v for k, v in NFT.RECIPE.items() if k not in NFT.RUN_LEVEL}
    out = {"DiffusionNFT": dict(rec, decay_at_B=NFT.return_decay(
        B, rec["decay_flat"], rec["decay_uprate"], rec["decay_uphold"]))}
    up = nft_overrides(dict(kind="nft", decay="scaled"), B)
    out["DiffusionNFT (decay scaled)"] = dict(rec, **up, decay_at_B=NFT.return_decay(
        B, rec["decay_flat"], up["decay_uprate"], rec["decay_uphold"]))
    for name, schedule in (("MixGRPO", "in_range"), ("MixGRPO (old scaled schedule)", "scaled")):
        r = mix_recipe(MIX, schedule, K, B, sig)
        out[name] = dict(r, sigma_trained=MIX.sigmas_trained(r, sig, B))
    out["MixGRPO"]["published_sigma_range"] = MIX.published_sigma_range()
    return out


def grid_sigmas(K: int) -> list[float]:
    """The rollout grid (K + 1 values) of the digits pipeline, as every method samples it."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    cfg = json.loads((D.CACHE / "pipeline" / "scheduler" / "scheduler_config.json").read_text())
    sch = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    sch.set_timesteps(K)
    return [float(s) for s in sch.sigmas]


def nft_overrides(spec: dict, B: int) -> dict:
    """DiffusionNFT's recipe overrides for a spec: the decay-scaled variant's uprate."""
    if spec.get("decay") != "scaled":
        return {}
    return {"decay_uprate": 0.001 * NFT_PUBLISHED_STEPS / B}


def mix_recipe(MIX, schedule: str, K: int, B: int, sigmas) -> dict:
    if schedule == "in_range":
        return MIX.in_range_recipe(K, B, sigmas)
    return MIX.scaled_recipe(K, B)


def example(name: str):
    """examples/<name>.py as a module (the baselines import each other by their file names)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import importlib
    return importlib.import_module(name)


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(D.ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except Exception:
        return "?"


# ------------------------------------------------------------------------------------------------
# One method at one lr and seed. `step(it)` trains one iteration and returns its metrics with the
# iteration's transformer forwards (nfe_total) and optimizer steps (opt_steps); `evaluated(which)`
# holds the weights to evaluate: "main" (what the method evaluates: DiffusionNFT's and Flow-GRPO's
# EMA, V-GRPO's and MixGRPO's trained weights) or "other" (the trained weights of an EMA method,
# the tracked EMA of V-GRPO in the knob swap).
# ------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, folder: Path, name: str, seed: int, lr: float, budget: int,
                 track_ema: bool = False, plan_flags: list | tuple = ()):
        self.name, self.spec = name, CONFIGS[name]
        self.kind = self.spec["kind"]
        self.ema = self.recipe = None
        self.track_ema = track_ema                       # V-GRPO: an evaluation EMA beside it
        extra = ["--lr", repr(float(lr)), *plan_flags]   # plan_flags: a miniature plan's P × G
        if self.kind == "flow":
            self.FG = example("flow_grpo_sd3")
            self.mine, self.args = self.FG.parse(D.vgrpo_flags(
                folder, seed, ["--recipe", self.spec["mdp"], "--methods", "flow_grpo", *extra]))
        else:
            self.args = V.parse_args(D.vgrpo_flags(folder, seed,
                                                   [*self.spec.get("flags", []), *extra]))
        self.run = V.setup(self.args)
        self.N = self.args.prompts_per_iter * self.args.group_size
        getattr(self, "_init_" + self.kind)(budget)

    def _init_vgrpo(self, budget: int) -> None:
        if self.track_ema:
            if self.args.mu != 1:
                raise ValueError("the evaluation EMA steps once per iteration: μ = 1 only")
            self.ema = example("flow_grpo_sd3").LoraEMA(self.run.params, **EVAL_EMA)
            self.ema_steps = 0

    def _init_nft(self, budget: int) -> None:
        self.M = example("diffusion_nft_sd3")
        self.state = self.M.init_state(self.run, **nft_overrides(self.spec, budget))
        if self.state["recipe"]["num_steps"] != self.args.num_steps:
            raise ValueError(f"DiffusionNFT's rollout has {self.state['recipe']['num_steps']} "
                             f"steps, the benchmark's {self.args.num_steps}")
        self.ema = self.state["ema"]
        self.recipe = dict(self.state["recipe"])

    def _init_mix(self, budget: int) -> None:
        self.M = example("mix_grpo_sd3")
        sig = self.run.adapter.sigmas(self.args.num_steps)
        self.recipe = mix_recipe(self.M, self.spec["schedule"], self.args.num_steps, budget, sig)
        self.state = self.M.init_state(self.run, self.recipe)
        self.recipe["sigma_trained"] = self.M.sigmas_trained(self.recipe, sig, budget)

    def _init_flow(self, budget: int) -> None:
        r = self.run
        if self.mine.rec["guidance"] != 1:
            raise ValueError("the benchmark runs Flow-GRPO without CFG (recipe nocfg)")
        self.guided = self.FG.Guided(r.adapter, r.adapter.encode([""]), 1.0)
        self.f_sigmas = r.adapter.sigmas(self.mine.flow_steps)
        self.state = {"step": 0, "ema": self.FG.LoraEMA(r.params)}
        self.ema = self.state["ema"]

    @property
    def adapter(self):
        return self.run.adapter

    @property
    def main_key(self) -> str:
        """"ema" if the method evaluates an EMA, else "raw" (its trained weights)."""
        return "ema" if self.ema is not None and not self.track_ema else "raw"

    def step(self, it: int) -> dict:
        m = getattr(self, "_step_" + self.kind)(it)
        out = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out["nfe_total"], out["opt_steps"] = int(m["nfe_total"]), int(m["opt_steps"])
        return out

    def _step_vgrpo(self, it: int) -> dict:
        """vgrpo.iteration; NFE = rollout + θ_old's no-grad pass (N_MC·(μ − 1)/μ per sample: the
        first minibatch takes S_old from its own pass) + θ's pass, per sample."""
        m = V.iteration(self.run, it)
        m["nfe_total"] = self.N * (m["nfe_rollout"] + m["nfe_old"] + m["nfe_theta"])
        m["opt_steps"] = 0 if m.get("skipped") else self.args.mu
        if self.track_ema and not m.get("skipped"):
            self.ema_steps += 1
            self.ema.step(self.ema_steps)          # as DiffusionNFT: after each optimizer step
        return m

    def _step_nft(self, it: int) -> dict:
        return self.M.nft_iteration(self.run, it, self.state)

    def _step_mix(self, it: int) -> dict:
        m = self.M.mix_iteration(self.run, it, self.state)
        m["window_start"] = m["window"][0] if m["window"] else -1
        m["window_len"] = len(m["window"])
        return m

    def _step_flow(self, it: int) -> dict:
        r = self.run
        m = self.FG.flow_grpo_iteration(self.mine, self.args, r.adapter, self.guided, r.rewards,
                                        r.opt, r.params, r.train_prompts, it, r.D,
                                        self.f_sigmas, r.dev, r.ctx, self.state)
        m["nfe_total"] = (self.N * m["nfe_rollout"]     # the SDE rollout (θ_old terms free)
                          + m["n_trained_samples"] * (m["nfe_theta"] + m["nfe_ref"]))
        return m

    def evaluated(self, which: str = "main"):
        """A context holding the weights to evaluate ("main" or "other", see above)."""
        import contextlib
        ema_in = (which == "main") != self.track_ema      # the EMA's weights inside?
        if self.ema is None or not ema_in:
            return contextlib.nullcontext()
        if self.kind == "nft":
            return self.M.eval_weights(self.run, self.state)
        return _swapped(self.ema)


def _swapped(ema):
    import contextlib

    @contextlib.contextmanager
    def ctx():
        ema.swap()
        try:
            yield
        finally:
            ema.swap()
    return ctx()


# ------------------------------------------------------------------------------------------------
# Evaluation: the held-out set (every reported number) and the validation set (the lr choice).
# ------------------------------------------------------------------------------------------------
def eval_sets(plan: dict) -> dict:
    return {"heldout": D.eval_set(plan["n_heldout"], D.HELDOUT_SEED, D.EVAL_TEMPLATES),
            "val": D.eval_set(plan["n_val"], D.VAL_SEED, D.VAL_TEMPLATES)}


def pack(m: dict, full: bool) -> dict:
    """An evaluation for the JSON: means, the image count and the per-image reward and
    correctness (for the bootstrap); the per-image div and nn too if `full` (final evaluations)."""
    out = {"n": int(len(m["reward"])), "acc": float(m["correct"].mean()),
           "reward": float(m["reward"].mean()), "diversity": float(m["div"].mean()),
           "nn_real": float(m["nn"].mean()),
           "img_reward": [round(float(x), 4) for x in m["reward"]],
           "img_correct": "".join("1" if c else "0" for c in m["correct"])}
    if full:
        out["img_div"] = [round(float(x), 4) for x in m["div"]]
        out["img_nn"] = [round(float(x), 4) for x in m["nn"]]
    return out


def evaluate(adapter, data, full: bool = True) -> tuple[dict, torch.Tensor]:
    prompts, digits, x1 = data
    imgs = D.generate(adapter, prompts, x1)
    return pack(D.image_metrics(imgs, digits), full), imgs


def evaluate_base(folder: Path, plan: dict, grids: Path, log=print) -> dict:
    """The base model (LoRA B = 0, so iteration 0 of every run) on both sets, and its grid."""
    tr = Trainer(folder, "V-GRPO", 0, 1e-3, plan["iterations"])
    base = {}
    for name, data in eval_sets(plan).items():
        base[name], imgs = evaluate(tr.adapter, data)
        if name == "heldout":
            D.save_grid(imgs, data[1], grids / "base.png")
    log(f"base model: held-out acc {base['heldout']['acc']:.3f} reward "
        f"{base['heldout']['reward']:.3f} diversity {base['heldout']['diversity']:.3f}; "
        f"validation reward {base['val']['reward']:.3f} diversity {base['val']['diversity']:.3f}")
    return base


def run_job(job: dict, folder: Path, plan: dict, base: dict, lr: float, grids: Path,
            log=print) -> dict:
    """One training run: held-out evaluations of the weights the method evaluates every
    `eval_every` iterations and at the end; at the end also the validation set and, for an EMA
    method (or V-GRPO with a tracked EMA), the other weights on both sets."""
    iters, every = job["iterations"], eval_every_of(plan, job)
    at = set(range(0, iters + 1, every)) | {iters}
    sets = eval_sets(plan)
    t0 = time.perf_counter()
    track = job["kind"] == "swap" and CONFIGS[job["method"]]["kind"] == "vgrpo" \
        and job["method"] == "V-GRPO"
    tr = Trainer(folder, job["method"], job["seed"], lr, iters, track_ema=track,
                 plan_flags=plan.get("extra_flags", ()))
    key, evals, log_iters = tr.main_key, [], []
    for it in range(iters + 1):
        if it == iters:                      # the last evaluation is the final one's held-out part
            final = _final_evaluations(tr, sets, key, grids / f"{job['id']}__{key}.png")
            evals.append({"iter": it, key: {k: v for k, v in final[f"heldout_{key}"].items()
                                            if k not in ("img_div", "img_nn")}})
        elif it in at:
            evals.append(_evaluation(tr, it, base, sets["heldout"], key))
        if it in at:
            e = evals[-1][key]
            log(f"{job['id']:52s} iter {it:3d}  held-out acc {e['acc']:.3f}  reward "
                f"{e['reward']:.3f}  diversity {e['diversity']:.3f}  nn-real {e['nn_real']:.3f}")
        if it == iters:
            break
        log_iters.append(tr.step(it))
    return dict(job, lr=lr, evals=evals, final=final, iters=log_iters, ema=tr.ema is not None,
                eval_key=key, nfe_n=tr.N, n_heldout=len(sets["heldout"][0]),
                n_val=len(sets["val"][0]), spec=tr.spec, recipe=tr.recipe,
                seconds=time.perf_counter() - t0, threads=torch.get_num_threads(),
                finished=time.strftime("%Y-%m-%d %H:%M:%S"))


def _evaluation(tr: Trainer, it: int, base: dict, data, key: str) -> dict:
    """One held-out evaluation {"iter", key: metrics}; iteration 0 is the base model (LoRA B = 0)."""
    if it == 0:
        return {"iter": 0, key: {k: v for k, v in base["heldout"].items()
                                 if k not in ("img_div", "img_nn")}}
    with tr.evaluated("main"):
        ev, _ = evaluate(tr.adapter, data, full=False)
    return {"iter": it, key: ev}


def _final_evaluations(tr: Trainer, sets: dict, key: str, grid: Path) -> dict:
    """The end of a run: both sets with full per-image measures, the held-out grid; the other
    weights too where there are two."""
    final = {}
    other = "raw" if key == "ema" else "ema"
    for which, name in (("main", key), ("other", other)):
        if which == "other" and tr.ema is None:
            break
        with tr.evaluated(which):
            final[f"heldout_{name}"], imgs = evaluate(tr.adapter, sets["heldout"])
            final[f"val_{name}"], _ = evaluate(tr.adapter, sets["val"])
        if which == "main":
            D.save_grid(imgs, sets["heldout"][1], grid)
    return final


def timing_job(folder: Path, plan: dict, chosen: dict, log=print) -> dict:
    """Wall-clock as a ratio within one process: every method at its chosen lr, one iteration of
    each in turn, `timing_rounds` times (all see the same machine load)."""
    methods = [m for m in plan["methods"] if m in chosen]
    trainers = {m: Trainer(folder, m, 0, chosen[m]["lr"], plan["iterations"],
                           plan_flags=plan.get("extra_flags", ())) for m in methods}
    secs = {m: [] for m in methods}
    for r in range(plan["timing_rounds"]):
        for m, tr in trainers.items():
            t0 = time.perf_counter()
            tr.step(r)
            secs[m].append(time.perf_counter() - t0)
        log(f"timing round {r}: " + ", ".join(f"{m} {s[-1]:.2f} s" for m, s in secs.items()))
    return dict(kind="timing", method="all", seed=0, rounds=plan["timing_rounds"],
                seconds_per_iter=secs, lrs={m: chosen[m]["lr"] for m in methods},
                threads=torch.get_num_threads(), finished=time.strftime("%Y-%m-%d %H:%M:%S"))


# ------------------------------------------------------------------------------------------------
# Workers: several processes share one results folder; each claims a job with an exclusive file.
# ------------------------------------------------------------------------------------------------
def load_results(out: Path) -> dict:
    """{job id: result dict} of every finished run in `out`."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))
            if p.name not in ("plan.json", "base.json", "build.json", "summary.json")}


def claim(path: Path) -> bool:
    """Take a job for this process. A claim whose process is gone is taken over, so an interrupted
    benchmark resumes."""
    mark = path.with_suffix(".claim")
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(mark.read_text() or 0), 0)
            return False                                   # another live process runs it
        except (ProcessLookupError, ValueError):
            mark.write_text(str(os.getpid()))
            return True
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def next_job(out: Path, jobs: list[dict]):
    """The first unclaimed job whose inputs are finished; None when every job is done; "wait"
    while the remaining ones wait on another worker's runs."""
    done = {p.stem for p in out.glob("*.json")} | {p.stem for p in out.glob("*.failed")}
    todo = [j for j in jobs if j["id"] not in done]
    if not todo:
        return None
    ready = [j for j in todo if all(n in done for n in needs(j, jobs))]
    return next((j for j in ready if claim(out / f"{j['id']}.json")), "wait")


def worker(out: Path, log=print) -> None:
    """Run jobs until none is left; a failed run is recorded (.failed) and the others go on."""
    from examples import digits_stats as ST
    plan = json.loads((out / "plan.json").read_text())
    base = json.loads((out / "base.json").read_text())
    folder, jobs, grids = D.CACHE / "pipeline", jobs_of(plan), out / "grids"
    while (job := next_job(out, jobs)) is not None:
        if job == "wait":
            time.sleep(5)                                   # another worker's run is needed
            continue
        path = out / f"{job['id']}.json"
        try:
            check_model(base)                   # the model every run shares: else stop here
        except RuntimeError:
            path.with_suffix(".claim").unlink(missing_ok=True)
            raise
        try:
            chosen = ST.choose(load_results(out), plan, base) if needs(job, jobs) \
                else fixed_chosen(plan)
            if job["kind"] == "timing":
                res = timing_job(folder, plan, chosen, log)
            else:
                lr = job["lr"] if job["lr"] is not None else chosen[job["parent"]]["lr"]
                res = run_job(job, folder, plan, base, lr, grids, log)
        except Exception as e:
            traceback.print_exc()
            path.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}\n")
        else:
            path.with_suffix(".tmp").write_text(json.dumps(res))
            path.with_suffix(".tmp").rename(path)
            log(f"-> {path.name} ({res.get('seconds', 0):.0f} s)")
        path.with_suffix(".claim").unlink(missing_ok=True)


def model_fingerprint() -> str:
    """SHA-256 of the files that define the benchmark's model and reward (the pretrained
    transformer, VAE, text encoders and the classifier in D.CACHE): every run checks it against
    the one base.json was evaluated with, so runs on another build are never mixed."""
    import hashlib
    h = hashlib.sha256()
    files = sorted((D.CACHE / "pipeline").rglob("*.safetensors")) + [D.CACHE / "classifier.pt"]
    for f in files:
        h.update(str(f.relative_to(D.CACHE)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def check_model(base: dict) -> None:
    want = base.get("model_fingerprint")
    if want is not None and model_fingerprint() != want:
        raise RuntimeError(f"the model in {D.CACHE} is not the one this benchmark's base.json was "
                           f"evaluated with (fingerprint {want}): it was rebuilt or replaced; "
                           "restore it, or start the benchmark in a new --out folder")


def prepare(out: Path, mode: str, workers: int, threads: int, log=print,
            build: dict | None = None) -> dict:
    """Build (or reuse) the model (`build`: digits.build's budgets, default its own); write
    plan.json and base.json if the folder has none (both are fixed before any training run).
    Returns the plan."""
    D.build(log=log, **(build or {}))
    (out / "grids").mkdir(parents=True, exist_ok=True)
    path = out / "plan.json"
    if path.is_file():
        plan = json.loads(path.read_text())
        if plan.get("mode") != mode or plan.get("version") != 2:
            raise ValueError(f"{out} holds another benchmark (plan {plan.get('mode')!r}); pass "
                             "another --out")
    else:
        plan = new_plan(mode, workers, threads)
        path.write_text(json.dumps(plan, indent=1))
    if not (out / "base.json").is_file():
        torch.set_num_threads(max(threads, 1) * max(workers, 1))
        base = evaluate_base(D.CACHE / "pipeline", plan, out / "grids", log)
        base["model_fingerprint"] = model_fingerprint()
        (out / "base.json").write_text(json.dumps(base))
        (out / "build.json").write_text((D.CACHE / "build.json").read_text())   # its record
    check_model(json.loads((out / "base.json").read_text()))
    return plan


def benchmark(out: Path, mode: str = "regime", workers: int = 2, threads: int = 1,
              log=print, build: dict | None = None) -> None:
    """prepare, then every job with `workers` processes of `threads` threads each, then the
    report. Each invocation's span is recorded in plan.json (the report's cost section)."""
    prepare(out, mode, workers, threads, log, build)
    path = out / "plan.json"
    plan = json.loads(path.read_text())
    plan.setdefault("sessions", []).append(dict(started=time.strftime("%Y-%m-%d %H:%M:%S"),
                                                commit=commit()))
    path.write_text(json.dumps(plan, indent=1))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VGRPO_DIGITS_CACHE=str(D.CACHE))
    procs = [subprocess.Popen([sys.executable, str(Path(D.__file__).resolve()), "worker",
                               "--out", str(out), "--threads", str(threads)], env=env)
             for _ in range(workers - 1)]
    torch.set_num_threads(threads)
    worker(out, log)
    for p in procs:
        p.wait()
    plan = json.loads(path.read_text())
    plan["sessions"][-1]["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path.write_text(json.dumps(plan, indent=1))
    if plan.get("runs"):               # the follow-up runs from a frozen copy of the code: its
        log(f"done; the report: python examples/digits.py report --out {out}")   # report is
        return                         # made from the working tree
    from examples import digits_report
    digits_report.report(out, log=log)


# ------------------------------------------------------------------------------------------------
# The commands (examples/digits.py's `benchmark` and its hidden `worker`).
# ------------------------------------------------------------------------------------------------
def add_commands(sub) -> None:
    import argparse
    k = sub.add_parser("benchmark", help="V-GRPO against the baselines on a fixed plan, then the "
                       "report (resumable)")
    k.add_argument("--quick", action="store_true",
                   help="the plan in miniature: 1 selection and 1 confirmation seed, 2 lrs, "
                   "8 iterations (default out: runs/digits-quick)")
    k.add_argument("--out", default=None, help="results folder (default examples/digits_results)")
    k.add_argument("--workers", type=int, default=2, help="worker processes")
    k.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    k.add_argument("--plan_only", action="store_true",
                   help="write plan.json and base.json, then stop (no training run)")
    k.add_argument("--plan", default=None, choices=tuple(PLANS),
                   help="a named plan: regime (the default), quick, followup (the DiffusionNFT "
                   "follow-up; default out examples/digits_results_followup), or a miniature")
    w = sub.add_parser("worker", help="one worker process of a running benchmark (internal)")
    w.add_argument("--out", required=True)
    w.add_argument("--threads", type=int, default=1)


def use_kept_model(out: Path) -> None:
    """A results folder may keep the model its runs share (out/cache, a copy of examples/digits.py
    build's folder, about 12 MB): then every run, on any machine and in any later invocation, uses
    that one, and base.json's fingerprint still matches. VGRPO_DIGITS_CACHE, if set, wins."""
    if (out / "cache" / "build.json").is_file() and "VGRPO_DIGITS_CACHE" not in os.environ:
        D.CACHE = out / "cache"


def keep_model(out: Path, model_from: str | None) -> None:
    """A plan that names the model of earlier runs (the follow-up: the B = 128 runs' kept model)
    gets a copy of it in out/cache, once, so its runs use that very model (same fingerprint)."""
    src = D.ROOT / model_from if model_from else None
    if src is None or (out / "cache" / "build.json").is_file() or "VGRPO_DIGITS_CACHE" in os.environ:
        return
    if not (src / "build.json").is_file():
        raise ValueError(f"the plan runs on the model kept in {src}, which is not there")
    import shutil
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, out / "cache", ignore=shutil.ignore_patterns("*.tmp"))


def run_command(a) -> None:
    if a.cmd == "worker":
        torch.set_num_threads(a.threads)
        use_kept_model(Path(a.out))
        worker(Path(a.out))
        return
    if a.workers < 1 or a.threads < 1:
        raise ValueError("--workers and --threads must be ≥ 1")
    mode = a.plan or ("quick" if a.quick else "regime")
    out = Path(a.out or DEFAULT_OUT.get(mode, RESULTS))
    keep_model(out, PLANS[mode].get("model_from"))
    use_kept_model(out)
    if a.plan_only:
        prepare(out, mode, a.workers, a.threads)
        print(f"wrote {out / 'plan.json'} and {out / 'base.json'}")
    else:
        benchmark(out, mode, a.workers, a.threads)
