"""The digits benchmark's statistics: the lr choice, bootstrap intervals, speed-ups, verdicts.

Pure functions of the runs' JSON (bench.py writes them); numpy only.

How the data were drawn, and so how they are resampled: every run evaluates the SAME held-out
images (prompts and initial noises); a run's seed moves its training, not the images. So one
bootstrap draw takes one resample of the images, applies it to every seed and every method, and
resamples the seeds (with replacement) on top. The same draws serve every method of a report, so
differences are paired. Intervals are 95 % percentile intervals over N_BOOT draws.
"""
from __future__ import annotations

import math

import numpy as np

N_BOOT = 1000
_DRAWS: dict = {}


# ------------------------------------------------------------------------------------------------
# The runs of a results folder, by role.
# ------------------------------------------------------------------------------------------------
def runs_of(results: dict, kind: str, method: str, lr=None, iterations=None) -> list[dict]:
    rs = [r for r in results.values() if r.get("kind") == kind and r["method"] == method
          and (lr is None or abs(r["lr"] - lr) < 1e-12)
          and (iterations is None or r["iterations"] == iterations)]
    return sorted(rs, key=lambda r: r["seed"])


def final_eval(r: dict, split: str = "heldout", variant: str | None = None):
    """A run's final evaluation on `split` ("heldout" / "val") of `variant` ("raw" the trained
    weights, "ema" an EMA; default the weights the run evaluates), or None. Runs of the B = 32
    plan kept the final held-out evaluation only as their last curve point."""
    v = variant or r["eval_key"]
    return r["final"].get(f"{split}_{v}") or (r["evals"][-1].get(v) if split == "heldout"
                                               and v == r["eval_key"] else None)


# ------------------------------------------------------------------------------------------------
# The lr choice.
# ------------------------------------------------------------------------------------------------
def choose(results: dict, plan: dict, base: dict) -> dict:
    """Each method's lr from its selection runs (pick_lr on the per-lr means of the final
    validation reward and diversity; an EMA method is judged by the weights it evaluates).
    {method: {"lr", "fallback", "rows": [{lr, seeds, val_reward, val_diversity}]}}."""
    kind = "select" if plan.get("version") == 2 else "sweep"        # B = 32: "sweep"
    chosen = {}
    for m in plan["methods"]:
        rows = []
        for lr in plan["lrs"]:
            vals = [final_eval(r, "val") for r in runs_of(results, kind, m, lr)]
            if vals and all(v is not None for v in vals):
                rows.append({"lr": lr, "seeds": len(vals),
                             "val_reward": float(np.mean([v["reward"] for v in vals])),
                             "val_diversity": float(np.mean([v["diversity"] for v in vals]))})
        if rows:
            pick, fallback = pick_lr(rows, plan, base)
            chosen[m] = {"lr": pick["lr"], "fallback": fallback, "rows": rows}
    return chosen


def pick_lr(rows: list, plan: dict, base: dict) -> tuple[dict, bool]:
    """(the row, fallback): the best validation reward among the lrs whose validation diversity
    is ≥ plan["diversity_keep"] × the base model's; if none is, the most diverse lr ("fallback").
    With plan["lr_beats_base"] (the B = 128 plan's amendment, made before any confirmation run)
    only lrs that end above the base model's validation reward take part, when any does: a run
    that has not learnt the task can look diverse."""
    if plan.get("lr_beats_base"):
        rows = [r for r in rows if r["val_reward"] > base["val"]["reward"]] or rows
    floor = plan["diversity_keep"] * base["val"]["diversity"]
    ok = [r for r in rows if r["val_diversity"] >= floor]
    if ok:
        return max(ok, key=lambda r: r["val_reward"]), False
    return max(rows, key=lambda r: r["val_diversity"]), True


# ------------------------------------------------------------------------------------------------
# The bootstrap: one image resample per draw, shared by every seed and method; seeds resampled.
# ------------------------------------------------------------------------------------------------
def draws(S: int, n: int):
    """(seed draws (N_BOOT, S) ints, image weights (N_BOOT, n): how often each image is drawn,
    over n). Fixed per (S, n), so every statistic uses the same draws (paired)."""
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
    """Per-image values of evaluations: key "correct", "reward" or "div" → (len(evs), n)."""
    if key == "correct":
        return np.array([[c == "1" for c in e["img_correct"]] for e in evs], dtype=np.float64)
    return np.array([e["img_" + key] for e in evs], dtype=np.float64)


def curves(rs: list[dict], key: str = "reward") -> tuple[np.ndarray, np.ndarray]:
    """(evaluation iterations (E,), per-image values (S, E, n)) of runs on the same schedule."""
    k = rs[0]["eval_key"]
    its = np.array([e["iter"] for e in rs[0]["evals"]], dtype=np.float64)
    return its, np.stack([arrays([e[k] for e in r["evals"]], key) for r in rs])


def final_stats(rs: list[dict]) -> dict:
    """{reward, acc, diversity: (point, lo, hi)} of the runs' final held-out evaluations, the
    replicates under "_reps"; diversity only where the runs kept it per image."""
    evs = [final_eval(r) for r in rs]
    out, reps = {"seeds": len(evs)}, {}
    for name, key in (("reward", "reward"), ("acc", "correct"), ("diversity", "div")):
        if key == "div" and any("img_div" not in e for e in evs):
            continue
        p, b = boot_mean(arrays(evs, key))
        out[name], reps[name] = ci(p, b), b
    out["_reps"] = reps
    return out


# ------------------------------------------------------------------------------------------------
# Crossings and spends.
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


def at_spend(curve, x, spend):
    """The value of `curve` (..., E) at `spend` along x (E,), linearly interpolated."""
    flat = np.asarray(curve, dtype=np.float64).reshape(-1, len(x))
    return np.array([np.interp(spend, x, c) for c in flat]).reshape(np.shape(curve)[:-1])


def steps_per_iter(rs: list[dict]) -> float:
    """Mean optimizer (gradient) steps per training iteration, as the runs logged them."""
    return float(np.mean([np.mean([x["opt_steps"] for x in r["iters"]]) for r in rs]))


UNITS = {"iters": "iterations", "steps": "gradient steps"}


def rates(rs: list[dict]) -> dict:
    """{unit: count per iteration}."""
    return {"iters": 1.0, "steps": steps_per_iter(rs)}


def paired(v_rs: list[dict], b_rs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The two run sets restricted to the seeds both finished."""
    seeds = {r["seed"] for r in v_rs} & {r["seed"] for r in b_rs}
    return [r for r in v_rs if r["seed"] in seeds], [r for r in b_rs if r["seed"] in seeds]


def same_spend(v_rs: list[dict], b_rs: list[dict]) -> dict:
    """V-GRPO minus a baseline at the same seeds: per unit, the held-out reward difference at the
    largest spend both reached (each seed-mean curve interpolated there), paired interval."""
    v_rs, b_rs = paired(v_rs, b_rs)
    (its_v, Xv), (its_b, Xb) = curves(v_rs), curves(b_rs)
    pv, rv = boot_curve(Xv)
    pb, rb = boot_curve(Xb)
    out = {"seeds": len(v_rs)}
    ra, rbb = rates(v_rs), rates(b_rs)
    for u in UNITS:
        xv, xb = its_v * ra[u], its_b * rbb[u]
        spend = min(xv[-1], xb[-1])
        a = at_spend(np.concatenate([pv[None], rv]), xv, spend)
        b = at_spend(np.concatenate([pb[None], rb]), xb, spend)
        out[u] = ci(a[0] - b[0], a[1:] - b[1:])
    return out


# ------------------------------------------------------------------------------------------------
# The paper's claims: V-GRPO's speed-up to a baseline's final held-out reward.
# ------------------------------------------------------------------------------------------------
def last_quarter_gain(rs: list[dict]) -> tuple:
    """The final held-out reward minus the reward at the last evaluation at or before 3/4 of the
    budget (seed-mean, with its interval): whether the runs were still improving at the end."""
    its, X = curves(rs)
    p, reps = boot_curve(X)
    q = int(np.nonzero(its <= 0.75 * its[-1] + 1e-9)[0][-1])
    return ci(p[-1] - p[q], reps[:, -1] - reps[:, q])


def claim(v_rs: list[dict], b_rs: list[dict]) -> dict:
    """V-GRPO's speed-up to a baseline's final held-out reward. The baseline ran B iterations; the
    target is its final seed-mean held-out reward; h = the iterations V-GRPO's seed-mean curve
    needs to reach it (crossing), the target recomputed in each draw (paired). Speed-up in unit
    u: B·u_b / (h·u_v), u the count per iteration. Where V-GRPO does not reach the target within
    its own budget Bv, the speed-up is below bound = B·u_b / (Bv·u_v): such a draw counts 0 for
    the interval's lower end and the bound for its upper end."""
    v_rs, b_rs = paired(v_rs, b_rs)
    its, Xv = curves(v_rs)
    _, Xb = curves(b_rs)
    pv, rv = boot_curve(Xv)
    pb, rb = boot_curve(Xb)
    B, Bv = b_rs[0]["iterations"], v_rs[0]["iterations"]
    h, h_b = float(crossing(pv, its, pb[-1])), crossing(rv, its, rb[:, -1])
    per_seed = crossing(Xv.mean(-1), its, pb[-1])                  # each seed's own curve
    out = {"B": B, "Bv": Bv, "seeds": len(v_rs), "reached": bool(np.isfinite(h)),
           "seeds_reached": int(np.isfinite(per_seed).sum()),
           "baseline_final": ci(pb[-1], rb[:, -1]), "vgrpo_final": ci(pv[-1], rv[:, -1]),
           "gain_over_base": ci(pb[-1] - pb[0], rb[:, -1] - rb[:, 0]),
           "last_quarter": last_quarter_gain(b_rs), "vgrpo_iters": ci(h, h_b),
           "ratio": {}, "bound": {}}
    ub, uv = rates(b_rs), rates(v_rs)
    miss = ~np.isfinite(h_b)
    for u in UNITS:
        bound = B * ub[u] / (Bv * uv[u])
        with np.errstate(divide="ignore", invalid="ignore"):
            r_b = B * ub[u] / (h_b * uv[u])
        pt = B * ub[u] / (h * uv[u]) if np.isfinite(h) and h > 0 else math.nan
        out["ratio"][u] = (pt, interval(np.where(miss, 0.0, r_b))[0],
                           interval(np.where(miss, bound, r_b))[1])
        out["bound"][u] = bound
    return out


def cut_off(rs: list[dict], at: float) -> list[dict]:
    """The runs as if they had stopped at the last evaluation at or before iteration `at`."""
    out = []
    for r in rs:
        evs = [e for e in r["evals"] if e["iter"] <= at + 1e-9]
        out.append(dict(r, evals=evs, iterations=evs[-1]["iter"]))
    return out


def cut_point(c: dict, unit: str) -> float:
    """A claim's speed-up: its point, or its bound where V-GRPO's seed-mean curve does not reach
    the target (the speed-up is below it)."""
    return c["ratio"][unit][0] if c["reached"] else c["bound"][unit]


def settled(v_rs: list[dict], b_rs: list[dict], unit: str, fractions=(0.5, 0.75)) -> bool:
    """The follow-up plan's rule: the baseline has settled when the speed-ups with it cut off at
    ½ and ¾ of its budget lie inside the 95 % interval of the speed-up at its whole budget."""
    lo, hi = claim(v_rs, b_rs)["ratio"][unit][1:]
    B = b_rs[0]["iterations"]
    pts = [cut_point(claim(v_rs, cut_off(b_rs, f * B)), unit) for f in fractions]
    tol = 1e-9 * max(abs(hi), 1.0)
    return all(math.isfinite(x) and lo - tol <= x <= hi + tol for x in pts)


def verdict(c: dict, factor: float, unit: str, still_improving: bool) -> tuple[str, str]:
    """(verdict, why in a few words) for a claimed speed-up `factor` in `unit`:
    inconclusive  the baseline did not improve on the base model or was still improving at the
                  end (its final reward is no fixed target), or the interval holds 1 and factor;
    agrees        the interval lies above 1 and reaches the factor;
    disagrees     the interval lies wholly below the factor."""
    lo, hi = c["ratio"][unit][1:]
    if not c["gain_over_base"][1] > 0:
        return "inconclusive", "the baseline did not improve on the base model"
    if still_improving:
        return "inconclusive", "the baseline was still improving at the end of its budget"
    if hi < factor:
        return "disagrees", f"the interval lies below {factor:.2g}×"
    if lo > 1:
        return "agrees", f"the interval lies above 1× and reaches {factor:.2g}×"
    return "inconclusive", f"the interval holds both 1× and {factor:.2g}×"
