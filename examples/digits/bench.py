"""The digits benchmark's runs: the plans, each method's trainer, one JSON per run, the workers.

    python -m examples.digits benchmark                 # the B = 128 plan, 2 workers, resumable
    python -m examples.digits benchmark --plan followup --workers 1 --threads 1
    python -m examples.digits benchmark --quick         # the B = 128 plan in miniature
    python -m examples.digits benchmark --plan_only     # write plan.json and base.json only

A plan is fixed before any run and written to its results folder's plan.json. Every run is one
method at one lr and seed on the committed model (model.CACHE), built by vgrpo.setup (the same
LoRA, AdamW, reward, prompts and P × G for every method), evaluated on the held-out set every
`eval_every` iterations and on both sets at the end. Workers (one process each) take the next job
whose inputs are finished; a killed benchmark resumes where it stopped. Every run checks the
model against the fingerprint in base.json, so runs on another build are never mixed.

The B = 128 plan ("regime"; results/), in the order the workers take it:
  select    every method at every lr of the grid on the selection seeds; each method's lr is
            chosen from these on the validation set (stats.choose)
  confirm   every method at its chosen lr on the confirmation seeds, which the choice never saw
  variant   MixGRPO's old squeezed window schedule and DiffusionNFT's old-policy decay scaled to
            B, at that method's chosen lr, on the confirmation seeds
  timing    seconds per iteration: one iteration of each method in turn, in one process
  swap      B = 32, lr 3e-3: V-GRPO given one of DiffusionNFT's knobs at a time, and DiffusionNFT
  nmc       B = 32: V-GRPO's N_MC at 2, 4, 8 and 10, at V-GRPO's chosen lr and at 3e-3
The follow-up ("followup"; results_followup/, its plan.md) fixes every lr and budget in advance:
V-GRPO (GenEval-stage) at 1e-3 and DiffusionNFT at 1e-3 for 160 iterations, DiffusionNFT at 3e-4
for 384, on fresh seeds 7-11, and a timing run.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from examples.digits import model as D

V = D.V
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
BASELINES = D.ROOT / "examples" / "baselines"

# ------------------------------------------------------------------------------------------------
# The methods: which trainer ("kind") and its knobs. Every method trains the same LoRA from
# vgrpo.setup.
# ------------------------------------------------------------------------------------------------
# V-GRPO's GenEval-stage recipe (vgrpo.py --preset geneval-stage) at the benchmark's batch: the
# paper trains its correctness rewards (GenEval, OCR) with N_MC 10, μ 2 and a ratio clip of 1e-2,
# without soft clipping.
GENEVAL_FLAGS = ["--n_mc", "10", "--mu", "2", "--clip_eps", "1e-2", "--soft_clip_eta", "0"]
VGEN = "V-GRPO (GenEval-stage)"
CONFIGS = {
    "V-GRPO": dict(kind="vgrpo", flags=[]),                    # vgrpo.py's shipped defaults
    VGEN: dict(kind="vgrpo", flags=GENEVAL_FLAGS),
    "DiffusionNFT": dict(kind="nft"),                           # config/nft.py sd3_pickscore
    "DiffusionNFT (decay scaled)": dict(kind="nft", decay="scaled"),
    "MixGRPO": dict(kind="mix", schedule="in_range"),
    "MixGRPO (old scaled schedule)": dict(kind="mix", schedule="scaled"),
    # V-GRPO given one of DiffusionNFT's knobs; the evaluation EMA is tracked in the V-GRPO run
    "V-GRPO, soft clip off": dict(kind="vgrpo", flags=["--soft_clip_eta", "0"]),
    "V-GRPO, 9 per-sample pairs": dict(kind="vgrpo", flags=["--n_mc", "9", "--pair_sharing",
                                                             "none"]),
    **{f"V-GRPO, N_MC {j}": dict(kind="vgrpo", flags=["--n_mc", str(j)]) for j in (2, 4, 8, 10)},
}
# DiffusionNFT's evaluation EMA (decay 0.9 after every optimizer step), given to V-GRPO in the
# knob swap
EVAL_EMA = dict(decay=0.9, interval=1)
# DiffusionNFT's published gradient steps over the SD3.5-M curriculum (about 1.7K); its old-policy
# decay min(0.001·step, 0.5) plateaus at step 500. The scaled variant shrinks that axis by 1.7K / B.
NFT_PUBLISHED_STEPS = 1700
DIVERSITY_KEEP = 0.9      # an lr is eligible if its validation diversity ≥ 0.9 × the base model's

# ------------------------------------------------------------------------------------------------
# The plans. "regime" and "followup" produced the committed runs; the others are miniatures.
# ------------------------------------------------------------------------------------------------
REGIME_METHODS = [VGEN, "V-GRPO", "DiffusionNFT", "MixGRPO"]
PLANS = {
    "regime": dict(
        iterations=128, lrs=[3e-4, 1e-3, 3e-3, 1e-2], selection_seeds=[0, 1],
        confirmation_seeds=[2, 3, 4, 5, 6], eval_every=8, n_heldout=40, n_val=20,
        methods=REGIME_METHODS, claims_vgrpo=VGEN,
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
        eval_every=4, n_heldout=40, n_val=20, methods=REGIME_METHODS, claims_vgrpo=VGEN,
        variants={}, timing_rounds=2, swap=None, nmc=None),
    "smoke": dict(
        iterations=2, lrs=[3e-3], selection_seeds=[0], confirmation_seeds=[1],
        eval_every=2, n_heldout=4, n_val=2, methods=["V-GRPO", "DiffusionNFT", "MixGRPO"],
        claims_vgrpo="V-GRPO", variants={"MixGRPO (old scaled schedule)": "MixGRPO"},
        timing_rounds=1, extra_flags=["--prompts_per_iter", "1", "--group_size", "4"],
        swap=dict(iterations=2, lr=3e-3, seeds=[0], eval_every=2, configs=["V-GRPO"]),
        nmc=dict(iterations=2, lrs=["chosen"], seeds=[0], eval_every=2, values=[2])),
}
# The follow-up: the DiffusionNFT claim with every lr and budget fixed before any run, on seeds no
# earlier run used (its rules and the unit it counts: results_followup/plan.md).
FOLLOWUP = dict(
    iterations=160, lrs=[], selection_seeds=[], confirmation_seeds=[7, 8, 9, 10, 11],
    eval_every=8, n_heldout=40, n_val=20, methods=[VGEN, "DiffusionNFT"], claims_vgrpo=VGEN,
    variants={}, timing_rounds=8, swap=None, nmc=None,
    # the runs, in the order the worker takes them (seed by seed: a finished pair is paired)
    runs=[dict(method=VGEN, lr=1e-3, iterations=160, eval_every=8),
          dict(method="DiffusionNFT", lr=1e-3, iterations=160, eval_every=8),
          dict(method="DiffusionNFT", lr=3e-4, iterations=384, eval_every=16)],
    comparisons=[
        dict(name="Run A", what="both methods at the same lr, 1e-3", vgrpo=[VGEN, 1e-3, 160],
             baseline=["DiffusionNFT", 1e-3, 160]),
        dict(name="Run B", what="each method at the lr the B = 128 plan chose for it",
             vgrpo=[VGEN, 1e-3, 160], baseline=["DiffusionNFT", 3e-4, 384])],
    chosen_lrs={VGEN: 1e-3, "DiffusionNFT": 3e-4},           # the B = 128 plan's choice
    cutoffs=[0.5, 0.75, 1.0],
    claim=dict(factor=1700 / 580, unit="iters", label="3× fewer iterations than DiffusionNFT"))
PLANS["followup"] = FOLLOWUP
# the same in miniature, for the tests: one seed, 1 × 4 rollouts per iteration
PLANS["followup-smoke"] = dict(
    FOLLOWUP, iterations=2, confirmation_seeds=[0], eval_every=1, n_heldout=4, n_val=2,
    timing_rounds=1, extra_flags=["--prompts_per_iter", "1", "--group_size", "4"],
    runs=[dict(method=VGEN, lr=1e-3, iterations=2, eval_every=1),
          dict(method="DiffusionNFT", lr=1e-3, iterations=2, eval_every=1),
          dict(method="DiffusionNFT", lr=3e-4, iterations=4, eval_every=2)],
    comparisons=[dict(c, vgrpo=[VGEN, 1e-3, 2], baseline=[*c["baseline"][:2], b])
                 for c, b in zip(FOLLOWUP["comparisons"], (2, 4))])
DEFAULT_OUT = {"regime": RESULTS, "followup": HERE / "results_followup",
               "quick": Path("runs/digits-quick")}


def slug(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower()).strip("_")


def _lr_id(lr) -> str:
    return "chosen" if lr in (None, "chosen") else f"lr{lr:g}"


def jobs_of(plan: dict) -> list[dict]:
    """Every run of the plan, in the order workers take them. lr None: the method's chosen lr,
    known once its selection runs are finished. "parent": the method whose chosen lr a run takes."""
    if plan.get("runs"):
        return fixed_jobs(plan)
    B, seeds = plan["iterations"], plan["confirmation_seeds"]
    job = lambda kind, m, lr, s, b, parent: dict(kind=kind, method=m, lr=lr, seed=s,
                                                 iterations=b, parent=parent)
    jobs = [job("select", m, lr, s, B, None) for s in plan["selection_seeds"]
            for lr in plan["lrs"] for m in plan["methods"]]
    jobs += [job("confirm", m, None, s, B, m) for s in seeds for m in plan["methods"]]
    jobs += [job("variant", v, None, s, B, p) for s in seeds for v, p in plan["variants"].items()]
    jobs.append(job("timing", "all", None, 0, 0, "all"))
    if sw := plan.get("swap"):
        jobs += [job("swap", m, sw["lr"], s, sw["iterations"], None)
                 for s in sw["seeds"] for m in sw["configs"]]
    if nm := plan.get("nmc"):
        jobs += [job("nmc", f"V-GRPO, N_MC {j}", None if lr == "chosen" else lr, s,
                     nm["iterations"], "V-GRPO" if lr == "chosen" else None)
                 for s in nm["seeds"] for lr in nm["lrs"] for j in nm["values"]]
    for j in jobs:
        j["id"] = f"{j['kind']}__{slug(j['method'])}__{_lr_id(j['lr'])}__s{j['seed']}"
    return jobs


def fixed_jobs(plan: dict) -> list[dict]:
    """A plan whose runs are all fixed (the follow-up): the timing job; the runs of budget
    plan["iterations"] seed by seed (each finished pair of seeds is a paired comparison); then
    the longer runs. Ids name method, lr, budget and seed."""
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
                threads=threads, written=time.strftime("%Y-%m-%d %H:%M:%S"))


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
    """examples/baselines/<name>.py as a module (the baselines import each other by file name)."""
    if str(BASELINES) not in sys.path:
        sys.path.insert(0, str(BASELINES))
    return importlib.import_module(name)


# ------------------------------------------------------------------------------------------------
# One method at one lr and seed. `step(it)` trains one iteration and returns its metrics with the
# iteration's transformer forwards (nfe_total) and optimizer steps (opt_steps); `evaluated(which)`
# holds the weights to evaluate: "main" (what the method evaluates: DiffusionNFT's EMA, V-GRPO's
# and MixGRPO's trained weights) or "other" (DiffusionNFT's trained weights, the EMA tracked
# beside V-GRPO in the knob swap).
# ------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, folder: Path, name: str, seed: int, lr: float, budget: int,
                 track_ema: bool = False, plan_flags: list | tuple = ()):
        self.name, self.spec = name, CONFIGS[name]
        self.kind = self.spec["kind"]
        self.ema = self.recipe = None
        self.track_ema = track_ema                       # V-GRPO: an evaluation EMA beside it
        extra = ["--lr", repr(float(lr)), *plan_flags]   # plan_flags: a miniature plan's P × G
        self.args = V.parse_args(D.vgrpo_flags(folder, seed, [*self.spec.get("flags", []), *extra]))
        self.run = V.setup(self.args)
        self.N = self.args.prompts_per_iter * self.args.group_size
        if self.kind == "vgrpo" and track_ema:
            if self.args.mu != 1:
                raise ValueError("the evaluation EMA steps once per iteration: μ = 1 only")
            self.ema = example("flow_grpo_sd3").LoraEMA(self.run.params, **EVAL_EMA)
            self.ema_steps = 0
        elif self.kind == "nft":
            self.M = example("diffusion_nft_sd3")
            self.state = self.M.init_state(self.run, **nft_overrides(self.spec, budget))
            if self.state["recipe"]["num_steps"] != self.args.num_steps:
                raise ValueError(f"DiffusionNFT's rollout has {self.state['recipe']['num_steps']}"
                                 f" steps, the benchmark's {self.args.num_steps}")
            self.ema = self.state["ema"]
            self.recipe = dict(self.state["recipe"])
        elif self.kind == "mix":
            self.M = example("mix_grpo_sd3")
            sig = self.run.adapter.sigmas(self.args.num_steps)
            self.recipe = mix_recipe(self.M, self.spec["schedule"], self.args.num_steps, budget,
                                     sig)
            self.state = self.M.init_state(self.run, self.recipe)
            self.recipe["sigma_trained"] = self.M.sigmas_trained(self.recipe, sig, budget)

    @property
    def adapter(self):
        return self.run.adapter

    @property
    def main_key(self) -> str:
        """"ema" if the method evaluates an EMA, else "raw" (its trained weights)."""
        return "ema" if self.ema is not None and not self.track_ema else "raw"

    def step(self, it: int) -> dict:
        if self.kind == "vgrpo":
            # NFE = rollout + θ_old's no-grad pass + θ's pass, per sample
            m = V.iteration(self.run, it)
            m["nfe_total"] = self.N * (m["nfe_rollout"] + m["nfe_old"] + m["nfe_theta"])
            m["opt_steps"] = 0 if m.get("skipped") else self.args.mu
            if self.track_ema and not m.get("skipped"):
                self.ema_steps += 1
                self.ema.step(self.ema_steps)      # as DiffusionNFT: after each optimizer step
        elif self.kind == "nft":
            m = self.M.nft_iteration(self.run, it, self.state)
        else:
            m = self.M.mix_iteration(self.run, it, self.state)
            m["window_start"] = m["window"][0] if m["window"] else -1
            m["window_len"] = len(m["window"])
        out = {k: v for k, v in m.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out["nfe_total"], out["opt_steps"] = int(m["nfe_total"]), int(m["opt_steps"])
        return out

    @contextlib.contextmanager
    def evaluated(self, which: str = "main"):
        """The weights to evaluate ("main" or "other", see above) held in place."""
        ema_in = (which == "main") != self.track_ema      # the EMA's weights inside?
        if self.ema is None or not ema_in:
            yield
        elif self.kind == "nft":
            with self.M.eval_weights(self.run, self.state):
                yield
        else:
            self.ema.swap()
            try:
                yield
            finally:
                self.ema.swap()


# ------------------------------------------------------------------------------------------------
# Evaluation: the held-out set (every reported number) and the validation set (the lr choice).
# ------------------------------------------------------------------------------------------------
def eval_sets(plan: dict) -> dict:
    return {"heldout": D.eval_set(plan["n_heldout"], D.HELDOUT_SEED, D.EVAL_TEMPLATES),
            "val": D.eval_set(plan["n_val"], D.VAL_SEED, D.VAL_TEMPLATES)}


def evaluate(adapter, data, full: bool = True) -> tuple[dict, torch.Tensor]:
    """An evaluation for the JSON: means, the image count and the per-image reward and
    correctness (for the bootstrap); the per-image div and nn too if `full` (final evaluations)."""
    prompts, digits, x1 = data
    imgs = D.generate(adapter, prompts, x1)
    m = D.image_metrics(imgs, digits)
    out = {"n": int(len(m["reward"])), "acc": float(m["correct"].mean()),
           "reward": float(m["reward"].mean()), "diversity": float(m["div"].mean()),
           "nn_real": float(m["nn"].mean()),
           "img_reward": [round(float(x), 4) for x in m["reward"]],
           "img_correct": "".join("1" if c else "0" for c in m["correct"])}
    if full:
        out["img_div"] = [round(float(x), 4) for x in m["div"]]
        out["img_nn"] = [round(float(x), 4) for x in m["nn"]]
    return out, imgs


def evaluate_base(folder: Path, plan: dict, grids: Path, log=print) -> dict:
    """The base model (LoRA B = 0, so iteration 0 of every run) on both sets, and its grid."""
    tr = Trainer(folder, "V-GRPO", 0, 1e-3, plan["iterations"])
    base = {}
    for name, data in eval_sets(plan).items():
        base[name], imgs = evaluate(tr.adapter, data)
        if name == "heldout":
            D.save_grid(imgs, data[1], grids / "base.png")
    log(f"base model: held-out reward {base['heldout']['reward']:.3f}, validation reward "
        f"{base['val']['reward']:.3f}")
    return base


def run_job(job: dict, folder: Path, plan: dict, base: dict, lr: float, grids: Path,
            log=print) -> dict:
    """One training run: held-out evaluations of the weights the method evaluates every
    `eval_every` iterations; at the end both sets with per-image measures and, for an EMA method
    (or V-GRPO with a tracked EMA), the other weights on both sets too."""
    iters, every = job["iterations"], eval_every_of(plan, job)
    at = set(range(0, iters + 1, every)) | {iters}
    sets = eval_sets(plan)
    t0 = time.perf_counter()
    tr = Trainer(folder, job["method"], job["seed"], lr, iters,
                 track_ema=job["kind"] == "swap" and job["method"] == "V-GRPO",
                 plan_flags=plan.get("extra_flags", ()))
    key, evals, log_iters, final = tr.main_key, [], [], {}
    strip = lambda e: {k: v for k, v in e.items() if k not in ("img_div", "img_nn")}
    for it in range(iters + 1):
        if it == 0:                                   # the base model (LoRA B = 0)
            evals.append({"iter": 0, key: strip(base["heldout"])})
        elif it == iters:
            for which, name in (("main", key), ("other", "raw" if key == "ema" else "ema")):
                if which == "other" and tr.ema is None:
                    break
                with tr.evaluated(which):
                    final[f"heldout_{name}"], imgs = evaluate(tr.adapter, sets["heldout"])
                    final[f"val_{name}"], _ = evaluate(tr.adapter, sets["val"])
                if which == "main":
                    D.save_grid(imgs, sets["heldout"][1], grids / f"{job['id']}__{key}.png")
            evals.append({"iter": it, key: strip(final[f"heldout_{key}"])})
        elif it in at:
            with tr.evaluated("main"):
                evals.append({"iter": it, key: evaluate(tr.adapter, sets["heldout"], False)[0]})
        if it in at:
            e = evals[-1][key]
            log(f"{job['id']:52s} iter {it:3d}  held-out acc {e['acc']:.3f}  reward "
                f"{e['reward']:.3f}  diversity {e['diversity']:.3f}")
        if it == iters:
            break
        log_iters.append(tr.step(it))
    return dict(job, lr=lr, evals=evals, final=final, iters=log_iters, ema=tr.ema is not None,
                eval_key=key, nfe_n=tr.N, n_heldout=len(sets["heldout"][0]),
                n_val=len(sets["val"][0]), spec=tr.spec, recipe=tr.recipe,
                seconds=time.perf_counter() - t0, threads=torch.get_num_threads(),
                finished=time.strftime("%Y-%m-%d %H:%M:%S"))


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
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))
            if p.name not in ("plan.json", "base.json")}


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
    from examples.digits import stats as ST
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
            chosen = ST.choose(load_results(out), plan, base) if needs(job, jobs) else \
                {m: {"lr": lr} for m, lr in (plan.get("chosen_lrs") or {}).items()}
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
    """SHA-256 of the files that define the model and the reward (the pipeline's weights and the
    classifier in D.CACHE), named relative to it."""
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
    """Build (or reuse) the model (`build`: model.build's budgets, default its own); write
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
    check_model(json.loads((out / "base.json").read_text()))
    return plan


def benchmark(out: Path, mode: str = "regime", workers: int = 2, threads: int = 1,
              log=print, build: dict | None = None) -> None:
    """prepare, then every job with `workers` processes of `threads` threads each."""
    prepare(out, mode, workers, threads, log, build)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VGRPO_DIGITS_CACHE=str(D.CACHE))
    procs = [subprocess.Popen([sys.executable, "-m", "examples.digits", "worker", "--out",
                               str(Path(out).resolve()), "--threads", str(threads)],
                              env=env, cwd=D.ROOT) for _ in range(workers - 1)]
    torch.set_num_threads(threads)
    worker(out, log)
    for p in procs:
        p.wait()
    log("done; the report: python -m examples.digits report")


# ------------------------------------------------------------------------------------------------
# The commands: `benchmark` and its hidden `worker`.
# ------------------------------------------------------------------------------------------------
def add_commands(sub) -> None:
    k = sub.add_parser("benchmark", help="V-GRPO against the baselines on a plan fixed before "
                       "its runs (resumable)")
    k.add_argument("--plan", default=None, choices=tuple(PLANS),
                   help="regime (the default: B = 128, results/), followup (results_followup/), "
                   "quick (runs/digits-quick) or a miniature for the tests")
    k.add_argument("--quick", action="store_true", help="the same as --plan quick")
    k.add_argument("--out", default=None, help="results folder (default: the plan's)")
    k.add_argument("--workers", type=int, default=2, help="worker processes")
    k.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    k.add_argument("--plan_only", action="store_true",
                   help="write plan.json and base.json, then stop (no training run)")
    w = sub.add_parser("worker", help="one worker process of a running benchmark (internal)")
    w.add_argument("--out", required=True)
    w.add_argument("--threads", type=int, default=1)


def run_command(a) -> None:
    if a.cmd == "worker":
        torch.set_num_threads(a.threads)
        worker(Path(a.out))
        return
    if a.workers < 1 or a.threads < 1:
        raise ValueError("--workers and --threads must be ≥ 1")
    mode = a.plan or ("quick" if a.quick else "regime")
    out = Path(a.out or DEFAULT_OUT.get(mode, Path("runs") / f"digits-{mode}"))
    if a.plan_only:
        prepare(out, mode, a.workers, a.threads)
        print(f"wrote {out / 'plan.json'} and {out / 'base.json'}")
    else:
        benchmark(out, mode, a.workers, a.threads)
