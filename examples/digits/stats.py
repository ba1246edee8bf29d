"""The digits benchmark's statistics: the lr choice, bootstrap intervals, crossings and verdicts.

Pure functions of the runs' JSON (digits_bench.py writes them); numpy only.

How the data were drawn, and so how they are resampled:
  * every run evaluates the SAME held-out images (prompts and initial noises); a run's seed moves
    its training (prompts, rollout noise, pairs), not the images. So one bootstrap draw takes one
    resample of the images and applies it to every seed and every method, and resamples the seeds
    (with replacement) on top. The same draws serve every method: differences are paired.
  * each method's lr is chosen on the validation set from its selection runs; the claims are
    measured on confirmation seeds that the choice never saw (plans of version 2). Older plans
    chose and reported on the same seeds; the report says so.
Intervals are 95 % percentile intervals over N_BOOT draws.
"""
from __future__ import annotations

import math

import numpy as np

N_BOOT = 1000
_DRAWS: dict = {}


# ------------------------------------------------------------------------------------------------
# The runs of a results folder, by role.
# ------------------------------------------------------------------------------------------------
def select_kind(plan: dict) -> str:
    """The job kind the lr is chosen from: "select" (version 2) or "sweep" (version 1)."""
    return "select" if plan.get("version") == 2 else "sweep"


def selection_seeds(plan: dict) -> list[int]:
    return plan.get("selection_seeds") or plan["seeds"]


def runs_of(results: dict, kind: str, method: str, lr=None) -> list[dict]:
    rs = [r for r in results.values() if r.get("kind") == kind and r["method"] == method
          and (lr is None or abs(r["lr"] - lr) < 1e-12)]
    return sorted(rs, key=lambda r: r["seed"])


def confirm_runs(results: dict, plan: dict, chosen: dict, method: str) -> list[dict]:
    """The runs a method's claims are measured on: its confirmation runs (version 2), or its
    sweep runs at the chosen lr (version 1: the seeds the lr was chosen on)."""
    if method not in chosen:
        return []
    if plan.get("version") == 2:
        return runs_of(results, "confirm", method)
    return runs_of(results, "sweep", method, chosen[method]["lr"])


def final_eval(r: dict, split: str = "heldout", variant: str | None = None):
    """A run's final evaluation on `split` ("heldout" / "val") of `variant` ("raw" the trained
    weights, "ema" an EMA; default the weights the run evaluates), or None."""
    v = variant or r["eval_key"]
    return r["final"].get(f"{split}_{v}") or (r["evals"][-1].get(v) if split == "heldout"
                                               and v == r["eval_key"] else None)


# ------------------------------------------------------------------------------------------------
# The lr choice.
# ------------------------------------------------------------------------------------------------
def choose(results: dict, plan: dict, base: dict) -> dict:
    """Each method's lr: the best mean final validation reward over its selection runs among the
    lrs whose mean validation diversity is ≥ plan["diversity_keep"] × the base model's (if none
    is, the most diverse lr, flagged "fallback"). With plan["lr_beats_base"] (the regime plan's
    amendment) only lrs whose mean validation reward is above the base model's take part, when
    any is. An EMA method is judged by the weights it evaluates. Returns {method: {"lr",
    "variant", "fallback", "rows": [per-lr means]}}."""
    keep = plan["diversity_keep"] * base["val"]["diversity"]
    kind, chosen = select_kind(plan), {}
    for m in plan["methods"]:
        rows = []
        for lr in plan["lrs"]:
            rs = runs_of(results, kind, m, lr)
            vals = [final_eval(r, "val") for r in rs]
            if not rs or any(v is None for v in vals):
                continue
            rows.append({"lr": lr, "seeds": len(rs),
                         "val_reward": float(np.mean([v["reward"] for v in vals])),
                         "val_diversity": float(np.mean([v["diversity"] for v in vals]))})
        if not rows:
            continue
        pick, fallback = pick_lr(rows, plan, base)
        r0 = runs_of(results, kind, m, pick["lr"])[0]
        chosen[m] = {"lr": pick["lr"], "variant": r0["eval_key"], "fallback": fallback,
                     "rows": rows, "diversity_floor": keep}
        if r0["eval_key"] == "ema":          # what its trained weights would have chosen
            chosen[m]["lr_raw"] = _choose_raw(results, kind, m, plan, base)
    return chosen


def pick_lr(rows: list, plan: dict, base: dict) -> tuple[dict, bool]:
    """The rule of `choose` on per-lr means {lr, val_reward, val_diversity}: (the row, fallback).
    A run that ends below the base model's reward has not learnt the task, and the diversity of
    its broken images is no sign of kept diversity (plan.json "amendments")."""
    if plan.get("lr_beats_base"):
        rows = [r for r in rows if r["val_reward"] > base["val"]["reward"]] or rows
    floor = plan["diversity_keep"] * base["val"]["diversity"]
    ok = [r for r in rows if r["val_diversity"] >= floor]
    if ok:
        return max(ok, key=lambda r: r["val_reward"]), False
    return max(rows, key=lambda r: r["val_diversity"]), True


def _choose_raw(results: dict, kind: str, m: str, plan: dict, base: dict):
    """The lr an EMA method's trained weights would have chosen (the report shows it beside)."""
    rows = []
    for lr in plan["lrs"]:
        vals = [final_eval(r, "val", "raw") for r in runs_of(results, kind, m, lr)]
        if vals and all(v is not None for v in vals):
            rows.append({"lr": lr, "val_reward": np.mean([v["reward"] for v in vals]),
                         "val_diversity": np.mean([v["diversity"] for v in vals])})
    return pick_lr(rows, plan, base)[0]["lr"] if rows else None


# ------------------------------------------------------------------------------------------------
# The bootstrap: one image resample per draw, shared by every seed and method; seeds resampled.
# ------------------------------------------------------------------------------------------------
def draws(S: int, n: int):
    """(seed draws (N_BOOT, S) ints, image weights (N_BOOT, n): how often each image is drawn,
    over n). Fixed per (S, n), so every statistic of a report uses the same draws (paired)."""
    if (S, n) not in _DRAWS:
        rng = np.random.default_rng(0)
        si = rng.integers(0, S, (N_BOOT, S))
        ii = rng.integers(0, n, (N_BOOT, n))
        w = np.stack([np.bincount(row, minlength=n) for row in ii]) / n
        _DRAWS[(S, n)] = (si, w)
    return _DRAWS[(S, n)]


def per_seed_reps(X) -> np.ndarray:
    """X (S, E, n) per seed, evaluation and image → (N_BOOT, S, E): each draw's image resample
    applied to every seed, then the drawn seeds."""
    X = np.asarray(X, dtype=np.float64)
    si, w = draws(X.shape[0], X.shape[-1])
    M = np.einsum("sen,bn->bse", X, w)                                 # (B, S, E)
    return np.take_along_axis(M, si[:, :, None], axis=1)


def boot_curve(X) -> tuple[np.ndarray, np.ndarray]:
    """X (S, E, n) → (seed- and image-mean curve (E,), its replicates (N_BOOT, E))."""
    X = np.asarray(X, dtype=np.float64)
    return X.mean(axis=(0, 2)), per_seed_reps(X).mean(axis=1)


def boot_mean(X) -> tuple[float, np.ndarray]:
    """X (S, n) → (mean, replicates (N_BOOT,))."""
    p, reps = boot_curve(np.asarray(X, dtype=np.float64)[:, None, :])
    return float(p[0]), reps[:, 0]


def interval(reps) -> tuple[float, float]:
    """95 % percentile interval of replicates (nan dropped; inf kept, it sorts last)."""
    reps = np.sort(np.asarray(reps, dtype=np.float64))
    reps = reps[~np.isnan(reps)]
    if not len(reps):
        return math.nan, math.nan
    return (float(reps[int(0.025 * (len(reps) - 1))]),
            float(reps[int(round(0.975 * (len(reps) - 1)))]))


def ci(point: float, reps) -> tuple[float, float, float]:
    return (float(point), *interval(reps))


def arrays(evs: list[dict], key: str) -> np.ndarray:
    """Per-image values of evaluations: key "correct", "reward", "div" or "nn" → (len(evs), n)."""
    if key == "correct":
        return np.array([[c == "1" for c in e["img_correct"]] for e in evs], dtype=np.float64)
    name = {"reward": "img_reward", "div": "img_div", "nn": "img_nn"}[key]
    return np.array([e[name] for e in evs], dtype=np.float64)


def curves(rs: list[dict], key: str = "reward") -> tuple[np.ndarray, np.ndarray]:
    """(evaluation iterations (E,), per-image values (S, E, n)) of runs on the same schedule."""
    k = rs[0]["eval_key"]
    its = np.array([e["iter"] for e in rs[0]["evals"]], dtype=np.float64)
    return its, np.stack([arrays([e[k] for e in r["evals"]], key) for r in rs])


def final_stats(rs: list[dict], split: str = "heldout", variant: str | None = None) -> dict:
    """{acc, reward, diversity, nn_real: (point, lo, hi)} of the runs' final evaluations, with
    the replicates under "_reps" and the image count "n"; {} if a run lacks the evaluation."""
    evs = [final_eval(r, split, variant) for r in rs]
    if not evs or any(e is None for e in evs):
        return {}
    out, reps = {"n": evs[0]["n"], "seeds": len(evs)}, {}
    for name, key in (("acc", "correct"), ("reward", "reward"), ("diversity", "div"),
                      ("nn_real", "nn")):
        if key in ("div", "nn") and "img_div" not in evs[0]:
            continue
        p, b = boot_mean(arrays(evs, key))
        out[name], reps[name] = ci(p, b), b
    out["_reps"] = reps
    return out


def paired_difference(a: dict, b: dict, key: str = "reward") -> tuple:
    """a − b of two final_stats on the same seeds and images, with its paired interval."""
    return ci(a[key][0] - b[key][0], a["_reps"][key] - b["_reps"][key])


# Student t's 97.5 % quantile by degrees of freedom (1-10), for seed-level intervals.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def seed_interval(d) -> tuple[float, float, float]:
    """(mean, lo, hi) of per-seed differences d (S,): the 95 % Student t interval over seeds,
    mean ± t(S − 1)·sd/√S. It treats the seeds as the only source of variation, which is what a
    comparison on 2 or 3 seeds cannot pin down; the bootstrap's seed resample (with only 2-3
    seeds to draw from) understates it."""
    d = np.asarray(d, dtype=np.float64)
    if len(d) < 2:
        return (float(d.mean()), math.nan, math.nan)
    half = T975[min(len(d) - 1, 10)] * d.std(ddof=1) / math.sqrt(len(d))
    return (float(d.mean()), float(d.mean() - half), float(d.mean() + half))


def seed_difference(rs_a: list[dict], rs_b: list[dict], var_a: str | None = None,
                    var_b: str | None = None) -> tuple[float, float, float]:
    """seed_interval of the per-seed differences of two run sets' final held-out rewards (the
    same seeds, in the same order; var_*: the weights evaluated, as in final_eval)."""
    a = [np.mean(final_eval(r, "heldout", var_a)["img_reward"]) for r in rs_a]
    b = [np.mean(final_eval(r, "heldout", var_b)["img_reward"]) for r in rs_b]
    return seed_interval(np.array(a) - np.array(b))


def choice_stability(results: dict, plan: dict, base: dict, method: str) -> dict:
    """How often `choose`'s rule picks each lr for `method` when its selection runs' validation
    images and seeds are resampled (the draws of every other interval; the base model's
    validation reward and diversity floor resampled with the same images). {"picks": {lr: share
    of draws}, "fallback": share of draws that took the fallback branch}."""
    kind = select_kind(plan)
    per_lr = {}
    for lr in plan["lrs"]:
        rs = runs_of(results, kind, method, lr)
        vals = [final_eval(r, "val") for r in rs]
        if rs and all(v is not None and "img_div" in v for v in vals):
            per_lr[lr] = (np.array([v["img_reward"] for v in vals]),
                          np.array([v["img_div"] for v in vals]))
    if not per_lr:
        return {}
    S, n = next(iter(per_lr.values()))[0].shape
    si, w = draws(S, n)
    bv = base["val"]
    b_rew, b_div = w @ np.asarray(bv["img_reward"]), w @ np.asarray(bv["img_div"])
    means = {lr: ((w @ R.T)[np.arange(N_BOOT)[:, None], si].mean(1),
                  (w @ Dv.T)[np.arange(N_BOOT)[:, None], si].mean(1))
             for lr, (R, Dv) in per_lr.items()}                     # (N_BOOT,) each
    picks, fb = {}, 0
    for b in range(N_BOOT):
        rows = [{"lr": lr, "val_reward": m[0][b], "val_diversity": m[1][b]}
                for lr, m in means.items()]
        row, fallback = pick_lr(rows, plan, {"val": {"reward": b_rew[b], "diversity": b_div[b]}})
        picks[row["lr"]] = picks.get(row["lr"], 0) + 1
        fb += fallback
    return {"picks": {lr: k / N_BOOT for lr, k in sorted(picks.items())}, "fallback": fb / N_BOOT}


# ------------------------------------------------------------------------------------------------
# Crossings: when a curve first reaches a threshold.
# ------------------------------------------------------------------------------------------------
def crossing(curve, its, thr):
    """The first iteration at which `curve` (..., E), evaluated at iterations `its` (E,), reaches
    `thr` (scalar or (...,)), linearly interpolated between the evaluation before and the first
    one at or above it; its[0] if the first evaluation already does; inf if none does."""
    curve = np.asarray(curve, dtype=np.float64)
    thr = np.broadcast_to(np.asarray(thr, dtype=np.float64), curve.shape[:-1])
    ok = curve >= thr[..., None]
    e = ok.argmax(-1)
    prev = np.maximum(e - 1, 0)
    a1 = np.take_along_axis(curve, e[..., None], -1)[..., 0]
    a0 = np.take_along_axis(curve, prev[..., None], -1)[..., 0]
    frac = np.where(e > 0, (thr - a0) / np.maximum(a1 - a0, 1e-12), 0.0)
    h = its[prev] + frac * (its[e] - its[prev])
    return np.where(ok.any(-1), h, np.inf)


def at_spend(curve, x, budget):
    """The value of `curve` (..., E) at spend `budget` along x (E,) (iterations × a count per
    iteration), linearly interpolated; nan beyond x's range."""
    curve = np.asarray(curve, dtype=np.float64)
    if budget > x[-1] + 1e-9:
        return np.full(curve.shape[:-1], np.nan)
    flat = curve.reshape(-1, curve.shape[-1])
    return np.array([np.interp(budget, x, c) for c in flat]).reshape(curve.shape[:-1])


def hit_times(rs: list[dict], thr, key: str = "correct"):
    """Iterations each seed's curve needs to reach thr (inf if never): (per seed (S,), replicates
    (N_BOOT, S) with the seeds and images drawn)."""
    its, X = curves(rs, key)
    return crossing(X.mean(-1), its, thr), crossing(per_seed_reps(X), its, thr)


# ------------------------------------------------------------------------------------------------
# Counts per iteration: gradient steps, NFE, seconds.
# ------------------------------------------------------------------------------------------------
def opt_steps_per_iter(r: dict) -> float:
    """Mean optimizer (gradient) steps per training iteration, as logged (runs logged before the
    count was: V-GRPO's μ from its flags, 1 by default)."""
    its = r["iters"]
    if its and all("opt_steps" in x for x in its):
        return sum(x["opt_steps"] for x in its) / len(its)
    fl = r.get("flags") or []
    return float(fl[fl.index("--mu") + 1]) if isinstance(fl, list) and "--mu" in fl else 1.0


def _mu(r: dict) -> int:
    f = r.get("flags") or (r.get("spec") or {}).get("flags") or []
    return int(f[f.index("--mu") + 1]) if isinstance(f, list) and "--mu" in f else 1


def nfe_per_iter(r: dict) -> float:
    """Mean training forwards per iteration. V-GRPO runs logged before θ_old's pass was folded
    into the first step (nfe_old an int, N_MC) are recounted as it runs now: N_MC·(μ − 1)/μ."""
    its = r["iters"]
    if its and "n_trained_samples" not in its[0] and "nfe_rollout" in its[0]:
        N, mu = r.get("nfe_n", 32), _mu(r)
        old = lambda x: x["nfe_old"] if isinstance(x["nfe_old"], float) \
            else x["nfe_theta"] * (mu - 1) / mu
        tot = [N * (x["nfe_rollout"] + old(x) + x["nfe_theta"]) for x in its]
    else:
        tot = [x["nfe_total"] for x in its]
    return sum(tot) / max(len(tot), 1)


def seconds_reps(timing: dict | None, method: str):
    """(mean seconds per iteration, replicates (N_BOOT,) over the timing rounds) or None."""
    if not timing or method not in timing.get("seconds_per_iter", {}):
        return None
    s = np.array(timing["seconds_per_iter"][method], dtype=np.float64)
    k = np.random.default_rng(1).integers(0, len(s), (N_BOOT, len(s)))
    return float(s.mean()), s[k].mean(1)


def rates(rs: list[dict], timing: dict | None, method: str) -> dict:
    """{unit: (per-iteration count, replicates or None)} for iters, steps, nfe and seconds."""
    out = {"iters": (1.0, None),
           "steps": (float(np.mean([opt_steps_per_iter(r) for r in rs])), None),
           "nfe": (float(np.mean([nfe_per_iter(r) for r in rs])), None)}
    sec = seconds_reps(timing, method)
    if sec:
        out["seconds"] = sec
    return out


UNITS = {"iters": "iterations", "steps": "gradient steps", "nfe": "NFE", "seconds": "seconds"}


# ------------------------------------------------------------------------------------------------
# The paper's claims: V-GRPO's speed-up to a baseline's final held-out reward.
# ------------------------------------------------------------------------------------------------
def last_quarter_gain(rs: list[dict]) -> tuple:
    """A run set's final held-out reward minus its reward at the last evaluation at or before
    3/4 of its budget (seed-mean, with its interval): whether it was still improving at B."""
    its, X = curves(rs)
    p, reps = boot_curve(X)
    q = int(np.nonzero(its <= 0.75 * its[-1] + 1e-9)[0][-1])
    return ci(p[-1] - p[q], reps[:, -1] - reps[:, q]) + (int(its[q]),)


def claim(v_rs: list[dict], b_rs: list[dict], timing: dict | None, method: str,
          vgrpo_name: str = "V-GRPO") -> dict:
    """V-GRPO's speed-up to a baseline's final held-out reward, as the paper states its claims.
    The baseline ran B iterations; the target is its final seed-mean held-out reward; h = the
    iterations V-GRPO's seed-mean curve needs to reach it (crossing). Ratio in unit u:
    B·u_b / (h·u_v), u the count per iteration (1; gradient steps; NFE; seconds). Paired draws:
    the target recomputed in each. Where V-GRPO does not reach the target within its own budget
    Bv, the ratio is below bound = B·u_b / (Bv·u_v): such a draw counts 0 for the interval's
    lower end and the bound for its upper end ("hi_is_bound"). Only seeds both finished."""
    seeds, v_rs, b_rs = paired(v_rs, b_rs)
    its, Xv = curves(v_rs)
    _, Xb = curves(b_rs)
    pv, rv = boot_curve(Xv)
    pb, rb = boot_curve(Xb)
    B, Bv = b_rs[0]["iterations"], v_rs[0]["iterations"]
    thr, thr_b = pb[-1], rb[:, -1]
    h, h_b = float(crossing(pv, its, thr)), crossing(rv, its, thr_b)
    per_seed = crossing(Xv.mean(-1), its, thr)                      # (S,) each seed's own curve
    out = {"method": method, "vgrpo": vgrpo_name, "B": B, "Bv": Bv, "seeds": len(seeds),
           "reached": bool(np.isfinite(h)), "seeds_reached": int(np.isfinite(per_seed).sum()),
           "baseline_final": ci(thr, thr_b), "vgrpo_final": ci(pv[-1], rv[:, -1]),
           "gain_over_base": ci(pb[-1] - pb[0], rb[:, -1] - rb[:, 0]),
           "last_quarter": last_quarter_gain(b_rs), "vgrpo_iters": ci(h, h_b),
           "per_iter": {}, "ratio": {}, "bound": {}, "hi_is_bound": {}}
    rb_, rv_ = rates(b_rs, timing, method), rates(v_rs, timing, vgrpo_name)
    for u in UNITS:
        if u not in rb_ or u not in rv_:
            continue
        (ub, ub_b), (uv, uv_b) = rb_[u], rv_[u]
        ub_b = ub if ub_b is None else ub_b
        uv_b = uv if uv_b is None else uv_b
        with np.errstate(divide="ignore", invalid="ignore"):
            r_b = B * ub_b / (h_b * uv_b)
            bound_b = B * ub_b / (Bv * uv_b) * np.ones(N_BOOT)
        miss = ~np.isfinite(h_b)
        out["per_iter"][u] = {"baseline": ub, "vgrpo": uv}
        out["bound"][u] = B * ub / (Bv * uv)
        pt = B * ub / (h * uv) if np.isfinite(h) and h > 0 else (math.inf if h == 0 else math.nan)
        lo = interval(np.where(miss, 0.0, r_b))[0]
        hi = interval(np.where(miss, bound_b, r_b))[1]
        out["ratio"][u] = (pt, lo, hi)
        out["hi_is_bound"][u] = bool(miss.mean() > 0.025)
    return out


def verdict(c: dict, factor: float, unit: str) -> tuple[str, str]:
    """(verdict, reason in words) of a claimed speed-up `factor` in `unit`. Symmetric:
    not tested  the regime cannot test it: the baseline did not improve on the base model, or was
                still improving at B (its last-quarter gain's interval excludes 0);
    agrees      the interval lies above 1 and does not lie wholly below the factor;
    disagrees   the interval lies wholly below the factor;
    not resolved otherwise."""
    g, q = c["gain_over_base"], c["last_quarter"]
    if not g[1] > 0:
        return "not tested", (f"{c['method']} did not improve on the base model in {c['B']} "
                              f"iterations, so its final reward is no target")
    if q[1] > 0 or q[2] < 0:
        word = "rising" if q[1] > 0 else "falling"
        lo, hi = c["ratio"][unit][1:]
        return "not tested", (f"{c['method']} had not settled at B = {c['B']}: its reward was "
                              f"still {word} over its last {c['B'] - q[3]} iterations, so its "
                              f"final reward is a target that more iterations would move. At "
                              f"this budget the interval {interval_position(lo, hi, factor)}")
    p, lo, hi = c["ratio"][unit]
    if lo > 1 and hi >= factor:
        return "agrees", f"the interval {interval_position(lo, hi, factor)}"
    if hi < factor:
        if not c["reached"]:
            return "disagrees", (f"V-GRPO did not reach it in its {c['Bv']} iterations "
                                 f"({c['seeds_reached']} of {c['seeds']} seeds did), so the "
                                 f"speed-up in {UNITS[unit]} is below {c['bound'][unit]:.2f}×, "
                                 f"short of the claimed {factor:.2g}×")
        return "disagrees", f"the whole interval lies below {factor:.2g}×"
    return "not resolved", f"the interval includes both 1 and {factor:.2g}×" if lo <= 1 else \
        "the interval is too wide"


# ------------------------------------------------------------------------------------------------
# Budget sensitivity (the follow-up plan's settled rule): the claim measured with the baseline cut
# off at fractions of its budget. A baseline has settled when the speed-up does not depend on
# where it is cut off: the speed-ups at the earlier cut-offs lie inside the interval at B.
# ------------------------------------------------------------------------------------------------
def cut_off(rs: list[dict], at: float) -> list[dict]:
    """The runs as if they had stopped at the last evaluation at or before iteration `at`."""
    out = []
    for r in rs:
        evs = [e for e in r["evals"] if e["iter"] <= at + 1e-9]
        out.append(dict(r, evals=evs, iterations=evs[-1]["iter"]))
    return out


def budget_sensitivity(v_rs: list[dict], b_rs: list[dict], timing: dict | None, method: str,
                       vgrpo_name: str = "V-GRPO", fractions=(0.5, 0.75, 1.0)) -> dict:
    """`claim` with the baseline cut off at each fraction of its budget B (the last at B).
    {"cutoffs": [claim dicts with "fraction"], "final": the one at B}."""
    B = b_rs[0]["iterations"]
    cuts = []
    for f in fractions:
        c = claim(v_rs, cut_off(b_rs, f * B), timing, method, vgrpo_name)
        c["fraction"] = f
        cuts.append(c)
    return {"cutoffs": cuts, "final": cuts[-1]}


def cut_point(c: dict, unit: str) -> float:
    """A cut-off's speed-up in `unit`: its point, or its bound where V-GRPO's seed-mean curve
    does not reach that cut-off's target (the speed-up is below it)."""
    return c["ratio"][unit][0] if c["reached"] else c["bound"][unit]


def settled(bs: dict, unit: str) -> bool:
    """Whether every earlier cut-off's speed-up lies inside the interval of the one at B."""
    lo, hi = bs["final"]["ratio"][unit][1:]
    pts = [cut_point(c, unit) for c in bs["cutoffs"][:-1]]
    tol = 1e-9 * max(abs(hi), 1.0)                     # an interval of no width holds its point
    return all(math.isfinite(x) and lo - tol <= x <= hi + tol for x in pts)


def interval_position(lo: float, hi: float, factor: float) -> str:
    """Where an interval lies against 1 and a claimed factor, in words."""
    if hi < factor:
        return f"lies wholly below the claimed {factor:.2g}×"
    if lo > factor:
        return f"lies wholly above the claimed {factor:.2g}×"
    if lo > 1:
        return f"lies above 1 and includes the claimed {factor:.2g}×"
    return f"includes both 1 and the claimed {factor:.2g}×"


def budget_verdict(bs: dict, factor: float, unit: str) -> tuple[str, str]:
    """(verdict, reason in words) under the follow-up's rule. Symmetric:
    not tested  the baseline did not improve on the base model (no target), or it has not
                settled (see `settled`); the reason says how the speed-up moved with the
                budget and where the interval at B lies against the factor;
    agrees      settled, and the interval at B lies above 1 and reaches the factor;
    disagrees   settled, and it lies wholly below the factor;
    not resolved  settled, and it includes both 1 and the factor."""
    c = bs["final"]
    if not c["gain_over_base"][1] > 0:
        return "not tested", (f"{c['method']} did not improve on the base model in {c['B']} "
                              f"iterations, so its final reward is no target")
    p, lo, hi = c["ratio"][unit]
    cuts = bs["cutoffs"]
    at = (f"with the baseline cut off at {', '.join(str(cc['B']) for cc in cuts[:-1])} and "
          f"{c['B']} iterations: {', '.join(_speed_s(cc, unit) for cc in cuts[:-1])} and "
          f"{_speed_s(c, unit)}")
    if not settled(bs, unit):
        first, last = cut_point(cuts[0], unit), cut_point(c, unit)
        way = "fell" if last < first else "rose"
        out = [cc for cc in cuts[:-1] if not (lo <= cut_point(cc, unit) <= hi)]
        return "not tested", (f"{c['method']} had not settled: the speed-up in {UNITS[unit]} "
                              f"{way} as its budget grew ({at}); at "
                              f"{and_words([str(cc['B']) for cc in out])} iterations it lies "
                              f"outside the interval at B = {c['B']}, {interval_words(lo, hi)}, "
                              f"which {interval_position(lo, hi, factor)}")
    where = (f"the speed-up in {UNITS[unit]} stays inside its interval at B = {c['B']} at every "
             f"cut-off ({at})")
    if lo > 1 and hi >= factor:
        return "agrees", f"{where}; the interval, {interval_words(lo, hi)}, " \
                         f"{interval_position(lo, hi, factor)}"
    if hi < factor:
        return "disagrees", f"{where}; the interval, {interval_words(lo, hi)}, lies wholly " \
                            f"below {factor:.2g}×"
    return "not resolved", f"{where}; the interval, {interval_words(lo, hi)}, includes both " \
                           f"1 and {factor:.2g}×"


def interval_words(lo: float, hi: float) -> str:
    """'[1.03, 2.04]'; where draws in which V-GRPO missed the target put the lower end at 0, only
    the upper end (a lower end of 0 says nothing about the direction)."""
    if lo > 0:
        return f"[{lo:.2f}, {hi:.2f}]"
    return f"up to {hi:.2f}× (V-GRPO missed the target in some draws, so it has no lower end)"


def and_words(items: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _speed_s(c: dict, unit: str) -> str:
    """A cut-off's speed-up in words: '1.26×', or 'below 2.40×' where V-GRPO did not reach it."""
    return f"{c['ratio'][unit][0]:.2f}×" if c["reached"] else f"below {c['bound'][unit]:.2f}×"


# ------------------------------------------------------------------------------------------------
# The ladder: the spend each method needs to reach a series of held-out rewards.
# ------------------------------------------------------------------------------------------------
LADDER = (0.25, 0.5, 0.75, 0.9)


def ladder(groups: dict, base_reward: float, timing: dict | None, gain_of: str | None = None,
           fractions=LADDER, rate_of: dict | None = None) -> dict:
    """groups {name: runs, same seeds}. Targets: base + f·gain, f in `fractions`, gain the final
    gain over the base of the group `gain_of` (default: the best of any group). Per target and
    group: iterations to reach it (seed-mean curve, with interval), seeds whose own curve reaches
    it, and the counts in each unit (iterations × the count per iteration; `rate_of` maps a group
    to the method name its timing is under)."""
    finals = {m: boot_curve(curves(rs)[1])[0][-1] for m, rs in groups.items()}
    best = (finals[gain_of] if gain_of else max(finals.values())) - base_reward
    out = {"best_gain": best, "gain_of": gain_of, "targets": []}
    for f in fractions:
        thr = base_reward + f * best
        row = {"fraction": f, "reward": thr, "methods": {}}
        for m, rs in groups.items():
            its, X = curves(rs)
            p, reps = boot_curve(X)
            h, h_b = float(crossing(p, its, thr)), crossing(reps, its, thr)
            seeds = crossing(X.mean(-1), its, thr)
            counts = {u: ci(h * v[0], h_b * (v[0] if v[1] is None else v[1]))
                      for u, v in rates(rs, timing, (rate_of or {}).get(m, m)).items()}
            row["methods"][m] = {"reached": int(np.isfinite(seeds).sum()), "seeds": len(rs),
                                 "counts": counts, "_h_b": h_b}
        out["targets"].append(row)
    return out


def speedup(a: dict, b: dict, unit: str, ra: dict, rb: dict) -> tuple:
    """b's count ÷ a's count in `unit` at one ladder target, paired: ra, rb are the methods'
    rates(); draws where neither reaches are dropped, where only b misses the ratio is inf."""
    pa, pb = a["counts"][unit][0], b["counts"][unit][0]
    ua = ra[unit][0] if ra[unit][1] is None else ra[unit][1]
    ub = rb[unit][0] if rb[unit][1] is None else rb[unit][1]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (b["_h_b"] * ub) / (a["_h_b"] * ua)
        pt = pb / pa if pa > 0 else math.inf
    return ci(pt, r)


# ------------------------------------------------------------------------------------------------
# At the same learning rate: two methods' rewards at the same spend.
# ------------------------------------------------------------------------------------------------
def paired(v_rs: list[dict], b_rs: list[dict]) -> tuple[list, list[dict], list[dict]]:
    """(seeds both methods finished, V-GRPO's runs of those seeds, the baseline's): the runs a
    paired comparison uses."""
    seeds = sorted({r["seed"] for r in v_rs} & {r["seed"] for r in b_rs})
    return seeds, [r for r in v_rs if r["seed"] in seeds], [r for r in b_rs if r["seed"] in seeds]


def same_spend(v_rs: list[dict], b_rs: list[dict], timing: dict | None, v_name: str,
               b_name: str) -> dict:
    """V-GRPO minus a baseline at the same lr and seeds: the final held-out rewards and, per unit,
    the difference at the largest spend both reached (min of the two budgets in that unit; each
    curve interpolated at that spend). {unit: (difference, lo, hi), "spend": {unit: value}}."""
    seeds, v_rs, b_rs = paired(v_rs, b_rs)
    its_v, Xv = curves(v_rs)
    its_b, Xb = curves(b_rs)
    pv, rv = boot_curve(Xv)
    pb, rb = boot_curve(Xb)
    out = {"seeds": len(seeds), "vgrpo_final": ci(pv[-1], rv[:, -1]),
           "baseline_final": ci(pb[-1], rb[:, -1]), "spend": {}, "diff": {}, "seed_diff": {}}
    ra, rbb = rates(v_rs, timing, v_name), rates(b_rs, timing, b_name)
    for u in UNITS:
        if u not in ra or u not in rbb:
            continue
        xv, xb = its_v * ra[u][0], its_b * rbb[u][0]
        spend = min(xv[-1], xb[-1])
        a = at_spend(np.concatenate([pv[None], rv]), xv, spend)
        b = at_spend(np.concatenate([pb[None], rb]), xb, spend)
        out["spend"][u] = spend
        out["diff"][u] = ci(a[0] - b[0], a[1:] - b[1:])
        out["seed_diff"][u] = seed_interval(at_spend(Xv.mean(-1), xv, spend)
                                            - at_spend(Xb.mean(-1), xb, spend))
    return out


# ------------------------------------------------------------------------------------------------
# The reward–diversity frontier (not a claim of the paper).
# ------------------------------------------------------------------------------------------------
def frontier_margin(v_pts, d: float):
    """Height of V-GRPO's reward–diversity frontier at diversity d: the upper envelope of its
    (diversity, reward) points (Pareto points joined linearly; at lower diversity than all of
    them, the best reward). None beyond its most diverse point."""
    pareto = sorted([p for p in v_pts if not any(q[0] >= p[0] and q[1] >= p[1] and q != p
                                                 for q in v_pts)])
    if d > pareto[-1][0]:
        return None
    if d <= pareto[0][0]:
        return max(p[1] for p in pareto)
    for (d0, r0), (d1, r1) in zip(pareto, pareto[1:]):
        if d0 <= d <= d1:
            return r0 + (r1 - r0) * (d - d0) / max(d1 - d0, 1e-12)
    return None


def frontier(sweep: list[dict], base: dict) -> dict:
    """Each baseline point's distance below V-GRPO's reward–diversity frontier (positive: below),
    with its interval. sweep: rows {method, lr, variant, heldout: {reward, diversity: (p, lo,
    hi)}, _reps: {reward, diversity: (N_BOOT,)}}; base: the base model's row (where every method
    starts, part of V-GRPO's frontier)."""
    vpts = [base] + [r for r in sweep if r["method"] == "V-GRPO" and r["_reps"]]
    if len(vpts) < 2:
        return {}
    pts = lambda rows: [(r["heldout"]["diversity"][0], r["heldout"]["reward"][0]) for r in rows]
    out = {"vgrpo_points": pts(vpts), "points": []}
    for r in sweep:
        if r["method"] == "V-GRPO" or not r["_reps"]:
            continue
        d, rew = r["heldout"]["diversity"][0], r["heldout"]["reward"][0]
        item = dict(method=r["method"], lr=r["lr"], variant=r["variant"], diversity=d, reward=rew)
        f = frontier_margin(pts(vpts), d)
        if f is not None:
            reps = []
            for b in range(N_BOOT):
                fb = frontier_margin([(q["_reps"]["diversity"][b], q["_reps"]["reward"][b])
                                      for q in vpts], r["_reps"]["diversity"][b])
                reps.append(np.nan if fb is None else fb - r["_reps"]["reward"][b])
            item["margin"] = ci(f - rew, reps)
            m = item["margin"]
            item["position"] = "below" if m[1] > 0 else "above" if m[2] < 0 else "level"
        out["points"].append(item)
    return out


def frontier_groups(F: dict, methods: list[str], variants: dict) -> list[tuple]:
    """[(method, variant, points, summary)] per baseline and the weights it evaluates: how many of
    its points lie below V-GRPO's frontier, level with it, above it, beyond it, and the verdict
    "above" (V-GRPO's frontier lies above every comparable point), "not above" (some point lies
    above the frontier), "level" (none is resolved) or "mixed" (some below, the rest level)."""
    out = []
    for m in methods:
        pts = [p for p in F.get("points", []) if p["method"] == m
               and p["variant"] == variants.get(m, "raw")]
        if not pts:
            continue
        by = {k: [p for p in pts if p.get("position") == k] for k in ("below", "level", "above")}
        beyond = [p for p in pts if "margin" not in p]
        v = ("not above" if by["above"] else "above" if by["below"] and not by["level"]
             else "mixed" if by["below"] else "level" if by["level"] else "beyond")
        out.append((m, variants.get(m, "raw"), pts, dict(by, beyond=beyond, verdict=v)))
    return out
