"""The digits benchmark's report: its text, tables and figures, and the README's digits section.

    python examples/digits.py report                          # examples/digits_results → digits.md
    python examples/digits.py report --out examples/digits_results_b32   # the B = 32 benchmark
    python examples/digits.py report --out runs/digits-quick  # any other folder: its report.md

`analyse` turns a results folder into one dict of numbers (written as summary.json); the
functions after it write that dict as prose and tables, one section each. Numbers go in tables;
sentences are short and state one thing. digits_stats.py computes every number.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from examples import digits as D
from examples import digits_bench as BENCH
from examples import digits_stats as ST

RESULTS = BENCH.RESULTS
RESULTS_B32 = Path(__file__).with_name("digits_results_b32")
README_SECTION = "## Results on real handwritten digits"
README_END = "<!-- the digits summary above is written by `python examples/digits.py report` -->"
# The paper's two speed-up claims (its abstract): the baseline trains B iterations; V-GRPO's
# count to the baseline's final held-out reward; the claim is the ratio in the paper's unit.
CLAIMS = {
    "MixGRPO": dict(factor=2.0, unit="iters", label="2× fewer iterations than MixGRPO",
                    paper="FLUX.1-dev: MixGRPO's reward after 300 iterations in 150"),
    "DiffusionNFT": dict(factor=1700 / 580, unit="steps",
                         label="3× fewer gradient steps than DiffusionNFT",
                         paper="SD3.5-M: about 1.7K steps down to 580 (its Tables 1, 3, 5)"),
}
EMA_METHODS = ("DiffusionNFT", "DiffusionNFT (decay scaled)", "Flow-GRPO (no CFG)")


# ------------------------------------------------------------------------------------------------
# Formatting.
# ------------------------------------------------------------------------------------------------
def lr_s(x) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def num(x, fmt="{:.3f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return "not reached" if math.isinf(x) else fmt.format(x)


def ci_s(t, fmt="{:.3f}") -> str:
    """(point, lo, hi) as "p [lo, hi]"; an unreached point or end is said in words."""
    if not t or any(isinstance(x, float) and math.isnan(x) for x in t[:3]):
        return "—"
    p, lo, hi = t[:3]
    if math.isinf(p):
        return "not reached"
    return f"{fmt.format(p)} [{num(lo, fmt)}, {num(hi, fmt)}]"


def table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def and_join(items: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def label(m: str, variant: str = "main") -> str:
    """A method's name in the report; an EMA method's trained weights are named as such."""
    return f"{m}, trained weights" if variant == "raw" and m in EMA_METHODS else m


def _ci_or_reached(t, reached: int, seeds: int, fmt="{:.1f}") -> str:
    if math.isinf(t[0]):
        return f"not reached by the seed mean ({reached_words(reached, seeds)})"
    return f"{ci_s(t, fmt)} ({reached_words(reached, seeds)})"


def reached_words(reached: int, seeds: int) -> str:
    """How many seeds' own curves reached the target, in words."""
    return ("no seed reached it" if reached == 0 else f"{reached} of {plural(seeds, 'seed')} "
            f"reached it")


# ------------------------------------------------------------------------------------------------
# Analysis: the folder's runs → one dict of numbers.
# ------------------------------------------------------------------------------------------------
def analyse(out: Path) -> dict:
    """Everything the report shows, from the runs in `out`."""
    plan = json.loads((out / "plan.json").read_text())
    base = json.loads((out / "base.json").read_text())
    results = BENCH.load_results(out)
    timing = next((r for r in results.values() if r.get("kind") == "timing"), None)
    chosen = ST.choose(results, plan, base)
    S = {"plan": plan, "base": base, "results": results, "timing": timing, "chosen": chosen,
         "chosen_as_written": ST.choose(results, dict(plan, lr_beats_base=False), base),
         "vgrpo": plan.get("claims_vgrpo", "V-GRPO"), "out": out,
         "base_reward": ST.ci(*ST.boot_mean(ST.arrays([base["heldout"]], "reward")))}
    S["selection"] = selection_rows(S)
    S["choice_stability"] = {m: ST.choice_stability(results, plan, base, m) for m in chosen} \
        if ST.select_kind(plan) == "select" else {}
    S["claims"] = claims_of(S)
    S["cutoffs"] = cutoffs_of(S)
    S["same_lr"] = same_lr_rows(S)
    S["ladder"] = ladder_of(S)
    S["variants"] = variant_rows(S)
    S["swaps"] = swap_rows(S)
    S["nmc"] = nmc_rows(S)
    if plan.get("version") != 2:
        S["frontier"] = ST.frontier(S["selection"], base_point(S))
        S["ablations"] = ablation_rows(S)
        S["long"] = [r for r in results.values() if r.get("kind") == "long"]
    planned = {j["id"] for j in BENCH.jobs_of(plan)} if plan.get("version") == 2 else set()
    S["failed"] = sorted(p.stem for p in out.glob("*.failed"))
    S["not_finished"] = sorted(planned - set(results) - set(S["failed"]))
    return S


def base_point(S: dict) -> dict:
    """The base model as a frontier point (lr 0: where every method starts)."""
    bh = S["base"]["heldout"]
    reps, held = {}, {}
    for name, key in (("reward", "reward"), ("diversity", "div")):
        p, b = ST.boot_mean(ST.arrays([bh], key))
        held[name], reps[name] = ST.ci(p, b), b
    return {"heldout": held, "_reps": reps}


def selection_rows(S: dict) -> list[dict]:
    """Every (method, lr) of the selection runs: validation means, held-out final with intervals."""
    plan, rows = S["plan"], []
    for m in plan["methods"]:
        for lr in plan["lrs"]:
            rs = ST.runs_of(S["results"], ST.select_kind(plan), m, lr)
            fs = ST.final_stats(rs)
            if not fs:
                continue
            vs = ST.final_stats(rs, "val")
            rows.append(dict(method=m, lr=lr, variant=rs[0]["eval_key"], seeds=len(rs),
                             heldout=fs, val=vs, _reps=fs["_reps"],
                             chosen=m in S["chosen"] and S["chosen"][m]["lr"] == lr))
    return rows


def baselines(S: dict) -> list[str]:
    return [m for m in S["plan"]["methods"] if not m.startswith("V-GRPO")]


RUN_KINDS = {"confirm": "confirmation", "variant": "variant", "swap": "knob-swap",
             "nmc": "N_MC"}


def planned_ids(S: dict, kind: str, method: str | None = None) -> list[str]:
    return [j["id"] for j in BENCH.jobs_of(S["plan"])
            if j["kind"] == kind and method in (None, j["method"])]


def finished_all(S: dict, kind: str, *methods: str) -> bool:
    """Whether every planned run of `kind` (of each of `methods`, or of all) has finished; always
    true for a plan of version 1. A section measured on such runs waits for all of them: no
    number, and no verdict, is read off a part of the seeds the plan fixed."""
    if S["plan"].get("version") != 2:
        return True
    return all(i in S["results"] for m in (methods or [None]) for i in planned_ids(S, kind, m))


def waiting(S: dict, kind: str) -> str:
    """'Not measured yet: 2 of the 20 confirmation runs are finished; ...' for a section."""
    ids = planned_ids(S, kind)
    done = sum(i in S["results"] for i in ids)
    return (f"Not measured yet: {done} of the {len(ids)} {RUN_KINDS[kind]} runs are finished, "
            "and this section waits for all of them.\n")


def claims_of(S: dict) -> dict:
    """The claim measurement against every baseline (the paper's two marked with their verdict),
    once every confirmation run of both methods has finished."""
    v = S["vgrpo"]
    v_rs = ST.confirm_runs(S["results"], S["plan"], S["chosen"], v)
    out = {}
    for m in baselines(S):
        b_rs = ST.confirm_runs(S["results"], S["plan"], S["chosen"], m)
        if not v_rs or not b_rs or not finished_all(S, "confirm", v, m):
            continue
        c = ST.claim(v_rs, b_rs, S["timing"], m, v)
        c.update(lr=S["chosen"][m]["lr"], vgrpo_lr=S["chosen"][v]["lr"])
        if m in CLAIMS:
            c["claim"] = CLAIMS[m]
            c["verdict"], c["reason"] = ST.verdict(c, CLAIMS[m]["factor"], CLAIMS[m]["unit"])
        out[m] = c
    return out


def cutoffs_of(S: dict) -> dict:
    """Each measured claim with its baseline cut off at ½, ¾ and all of B (the follow-up plan's
    budget-sensitivity rule, applied after the fact: it shows which way the data lean and changes
    no verdict of this plan). {baseline: {"bs", "words": {unit: reason}}}."""
    v = S["vgrpo"]
    v_rs = ST.confirm_runs(S["results"], S["plan"], S["chosen"], v)
    out = {}
    for m, c in S["claims"].items():
        if "claim" not in c or S["plan"].get("version") != 2:
            continue
        b_rs = ST.confirm_runs(S["results"], S["plan"], S["chosen"], m)
        bs = ST.budget_sensitivity(v_rs, b_rs, S["timing"], m, v)
        out[m] = {"bs": bs, "words": {u: ST.budget_verdict(bs, c["claim"]["factor"], u)[1]
                                      for u in ("iters", "steps")}}
    return out


def cutoffs_text(S: dict) -> str:
    if not S.get("cutoffs"):
        return ""
    parts = [f"The B = {S['plan']['iterations']} plan asked whether the baseline's reward was "
             f"still rising over its last quarter. The follow-up plan "
             f"(examples/digits_results_followup/plan.md) replaces that rule with budget "
             f"sensitivity: the speed-up with the baseline cut off at ½, ¾ and all of its "
             f"budget, settled when the earlier ones lie inside the interval at B. Here it is "
             f"applied after the fact, to show which way these runs lean; it changes none of "
             f"this plan's verdicts.\n"]
    for m, x in S["cutoffs"].items():
        rows = [[f"{k['fraction']:.0%}: iteration {k['B']}", ci_s(k["baseline_final"]),
                 _ci_or_reached(k["vgrpo_iters"], k["seeds_reached"], k["seeds"]),
                 ratio_s(k, "iters"), ratio_s(k, "steps")] for k in x["bs"]["cutoffs"]]
        parts.append(f"**{m}, lr {lr_s(S['claims'][m]['lr'])}.**\n\n" + table(
            ["cut-off of its budget", "its reward there (the target)",
             f"{S['vgrpo']}'s iterations to it", "speed-up in iterations",
             "in gradient steps"], rows) + "\n" + cutoffs_finding(S, m) + "\n")
    return "\n".join(parts)


def cutoffs_finding(S: dict, m: str) -> str:
    """The budget-sensitivity reading of one claim, in both units, as sentences."""
    return " ".join(_cutoff_sentence(S, m, u) for u in ("iters", "steps"))


def _cutoff_sentence(S: dict, m: str, u: str) -> str:
    """'In gradient steps, DiffusionNFT had not settled: ...' (the subject named once)."""
    w = S["cutoffs"][m]["words"][u]
    if not w.startswith(m):
        w = f"against {m}, {w}"
    return f"In {ST.UNITS[u]}, {w}."


def same_lr_rows(S: dict) -> list[dict]:
    """V-GRPO (each of its recipes) against each baseline at every lr, on the selection runs."""
    plan, kind, rows = S["plan"], ST.select_kind(S["plan"]), []
    vs = [m for m in plan["methods"] if m.startswith("V-GRPO")]
    for lr in plan["lrs"]:
        for v in vs:
            v_rs = ST.runs_of(S["results"], kind, v, lr)
            for m in baselines(S):
                b_rs = ST.runs_of(S["results"], kind, m, lr)
                if v_rs and b_rs:
                    rows.append(dict(lr=lr, vgrpo=v, method=m,
                                     **ST.same_spend(v_rs, b_rs, S["timing"], v, m)))
    return rows


def ladder_of(S: dict) -> dict:
    groups = {m: ST.confirm_runs(S["results"], S["plan"], S["chosen"], m)
              for m in S["plan"]["methods"]}
    groups = {m: rs for m, rs in groups.items() if rs}
    if S["vgrpo"] not in groups or len(groups) < 2 or not finished_all(S, "confirm"):
        return {}
    seeds = set.intersection(*[{r["seed"] for r in rs} for rs in groups.values()])
    groups = {m: [r for r in rs if r["seed"] in seeds] for m, rs in groups.items()}
    L = ST.ladder(groups, S["base_reward"][0], S["timing"])
    L["rates"] = {m: ST.rates(rs, S["timing"], m) for m, rs in groups.items()}
    return L


def variant_rows(S: dict) -> list[dict]:
    """Each variant against its method at the method's chosen lr, on the confirmation seeds."""
    rows = []
    for v, parent in (S["plan"].get("variants") or {}).items():
        v_rs = ST.runs_of(S["results"], "variant", v)
        p_rs = [r for r in ST.confirm_runs(S["results"], S["plan"], S["chosen"], parent)
                if r["seed"] in {x["seed"] for x in v_rs}]
        if not v_rs or len(p_rs) != len(v_rs) or not finished_all(S, "variant", v):
            continue
        a, b = ST.final_stats(v_rs), ST.final_stats(p_rs)
        rows.append(dict(variant=v, parent=parent, seeds=len(v_rs), lr=v_rs[0]["lr"],
                         final=a["reward"], parent_final=b["reward"],
                         diff=ST.paired_difference(a, b), recipe=v_rs[0].get("recipe") or {},
                         parent_recipe=p_rs[0].get("recipe") or {},
                         decay=[r["iters"][-1].get("old_decay") for r in v_rs + p_rs]))
    return rows


def swap_rows(S: dict) -> list[dict]:
    """The one-knob swaps at B = 32: each against its reference on the same seeds (paired)."""
    sw = S["plan"].get("swap")
    if not sw or not finished_all(S, "swap"):
        return []
    get = lambda m: ST.runs_of(S["results"], "swap", m)
    ref_v, ref_n = get("V-GRPO"), get("DiffusionNFT")
    cases = [("V-GRPO with an evaluation EMA", ref_v, "ema", ref_v, "raw", "V-GRPO")]
    cases += [(m, get(m), None, ref_v, None, "V-GRPO") for m in sw["configs"]
              if m not in ("V-GRPO", "DiffusionNFT")]
    cases += [("DiffusionNFT without its EMA", ref_n, "raw", ref_n, "ema", "DiffusionNFT"),
              ("DiffusionNFT against V-GRPO", ref_n, None, ref_v, None, "V-GRPO")]
    rows = []
    for name, rs, var, ref, ref_var, ref_name in cases:
        if not rs or len(rs) != len(ref):
            continue
        a, b = ST.final_stats(rs, variant=var), ST.final_stats(ref, variant=ref_var)
        if a and b:
            rows.append(dict(name=name, ref=ref_name, seeds=len(rs), final=a["reward"],
                             ref_final=b["reward"], diff=ST.paired_difference(a, b),
                             seed=ST.seed_difference(rs, ref, var, ref_var)))
    return rows


def nmc_rows(S: dict) -> list[dict]:
    """V-GRPO's held-out reward at B = 32 for each N_MC and lr (N_MC 4 is the shipped value)."""
    nm, rows = S["plan"].get("nmc"), []
    if not nm or not finished_all(S, "nmc"):
        return rows
    for lr in nm["lrs"]:
        at_lr = []
        for j in nm["values"]:
            rs = [r for r in S["results"].values() if r.get("kind") == "nmc"
                  and r["method"] == f"V-GRPO, N_MC {j}"
                  and (r.get("parent") == "V-GRPO" if lr == "chosen"
                       else r.get("parent") is None and abs(r["lr"] - lr) < 1e-12)]
            rs = sorted(rs, key=lambda r: r["seed"])
            fs = ST.final_stats(rs)
            if fs:
                at_lr.append(dict(n_mc=j, lr=rs[0]["lr"], lr_rule=lr, seeds=len(rs), final=fs,
                                  nfe=np.mean([ST.nfe_per_iter(r) for r in rs]),
                                  cv=_mean_metric(rs, "surrogate_cv"),
                                  _seeds=[r["seed"] for r in rs], _runs=rs))
        shipped = [r for r in at_lr if r["n_mc"] == 4]
        for r in at_lr:                  # paired against N_MC 4 at the same lr, on the same seeds
            if shipped and r["n_mc"] != 4 and r["_seeds"] == shipped[0]["_seeds"]:
                r["diff"] = ST.paired_difference(r["final"], shipped[0]["final"])
                r["seed"] = ST.seed_difference(r["_runs"], shipped[0]["_runs"])
        rows += at_lr
    return rows


def ablation_rows(S: dict) -> list[dict]:
    """Version-1 ablations at V-GRPO's chosen lr, paired against the shipped recipe."""
    ref = ST.confirm_runs(S["results"], S["plan"], S["chosen"], "V-GRPO")
    ref_fs = ST.final_stats(ref) if ref else {}
    rows = []
    for m in S["plan"].get("ablations", []):
        rs = ST.runs_of(S["results"], "ablation", m)
        fs = ST.final_stats(rs)
        if not fs or len(rs) != len(ref):
            continue
        rows.append(dict(method=m, seeds=len(rs), final=fs, diff=ST.paired_difference(fs, ref_fs),
                         cv=_mean_metric(rs, "surrogate_cv"),
                         cv_group=_mean_metric(rs, "surrogate_cv_group")))
    if rows:
        rows.insert(0, dict(method="V-GRPO (shipped)", seeds=len(ref), final=ref_fs, diff=None,
                            cv=_mean_metric(ref, "surrogate_cv"),
                            cv_group=_mean_metric(ref, "surrogate_cv_group")))
    return rows


def _mean_metric(rs: list[dict], key: str):
    xs = [x[key] for r in rs for x in r["iters"] if x.get(key) is not None
          and math.isfinite(x[key])]
    return sum(xs) / len(xs) if xs else None


# ------------------------------------------------------------------------------------------------
# The sections.
# ------------------------------------------------------------------------------------------------
def regime(S: dict, m: str) -> str:
    """"B = 128, MixGRPO at lr 1e-3, V-GRPO (GenEval-stage) at lr 3e-3": the regime of a claim."""
    c, v = S["claims"][m], S["vgrpo"]
    v = "V-GRPO (shipped recipe)" if v == "V-GRPO" else v
    return f"B = {c['B']}, {m} at lr {lr_s(c['lr'])}, {v} at lr {lr_s(c['vgrpo_lr'])}"


def claim_statement(S: dict, m: str) -> str:
    """One paragraph per claim: the verdict, the regime, what V-GRPO reached, why the verdict."""
    c = S["claims"][m]
    cl, u = c["claim"], c["claim"]["unit"]
    seeds = f"{plural(c['seeds'], 'seed')} ({'confirmation seeds' if S['plan'].get('version') == 2 else 'the seeds the lrs were chosen on'})"
    s = (f"**{cl['label']}: {c['verdict']}.** Measured at {regime(S, m)}, on {seeds}. "
         f"{m} ends at a held-out reward of {ci_s(c['baseline_final'])}. ")
    if c["reached"]:
        s += (f"V-GRPO reaches it after {ci_s(c['vgrpo_iters'], '{:.1f}')} iterations; the "
              f"speed-up in {ST.UNITS[u]} is {ratio_s(c, u)}. ")
    elif c["verdict"] != "disagrees":          # a disagreement's reason says it already
        s += (f"V-GRPO does not reach it in its {c['Bv']} iterations "
              f"({c['seeds_reached']} of {c['seeds']} seeds do). ")
    return s + reason_s(c) + unit_note(c)


def unit_note(c: dict) -> str:
    """For a claim this plan measured in gradient steps: the speed-up in iterations, the unit that
    METHOD.md counts against the paper's 580, and where the follow-up measures it."""
    if c.get("claim", {}).get("unit") != "steps" or "iters" not in c["ratio"] or not c["reached"]:
        return ""                        # not reached: the same in every unit, said already
    return (f" This plan measured the claim in gradient steps. In iterations, the unit METHOD.md "
            f"counts against the paper's 580 (P11, C9), the speed-up is {ratio_s(c, 'iters')}. "
            f"The follow-up plan (examples/digits_results_followup/plan.md) fixes the unit as "
            f"iterations before its runs.")


def reason_s(c: dict) -> str:
    """A claim's verdict reason as a sentence."""
    return c["reason"][0].upper() + c["reason"][1:] + "."


def ratio_s(c: dict, u: str) -> str:
    """A claim's speed-up in unit u: "2.96× [2.08, 7.77]", or in words where V-GRPO did not reach
    the target; an upper end bounded by unreached draws is marked †."""
    if u not in c["ratio"]:
        return "—"
    if not c["gain_over_base"][1] > 0:
        return "— (the baseline did not improve)"
    if not c["reached"]:
        return f"not reached by the seed mean ({reached_words(c['seeds_reached'], c['seeds'])})"
    p, lo, hi = c["ratio"][u]
    mark = "†" if c["hi_is_bound"].get(u) else ""
    f = lambda x: "∞" if math.isinf(x) else f"{x:.2f}"
    if lo <= 0:                         # 0 only from missed draws: a lower end with no direction
        return f"{f(p)}× [up to {f(hi)}{mark}]"
    return f"{f(p)}× [{f(lo)}, {f(hi)}{mark}]"


def verdicts_text(S: dict) -> str:
    rows, paras = [], []
    for m, c in S["claims"].items():
        if "claim" not in c:
            continue
        cl = c["claim"]
        rows.append([cl["label"], cl["paper"], regime(S, m),
                     ratio_s(c, cl["unit"]), f"{cl['factor']:.2g}×", f"**{c['verdict']}**"])
        paras.append(claim_statement(S, m))
    for m in baselines(S):
        if m in CLAIMS and m not in S["claims"] and S["plan"].get("version") == 2:
            ids = planned_ids(S, "confirm", S["vgrpo"]) + planned_ids(S, "confirm", m)
            paras.append(f"**{CLAIMS[m]['label']}: not measured yet.** "
                         f"{sum(i in S['results'] for i in ids)} of the {len(ids)} confirmation "
                         f"runs of {S['vgrpo']} and {m} are finished; the claim waits for all.")
    if not rows:
        return "\n\n".join(paras) + "\n" if paras else "Not measured yet.\n"
    note = ("\n† The interval's upper end counts the draws in which V-GRPO did not reach the "
            "target at the largest speed-up they allow.\n"
            if any("†" in r[3] for r in rows) else "")
    return (table(["claim", "in the paper", "measured at", "speed-up", "claimed", "verdict"], rows)
            + note + "\n" + "\n\n".join(paras) + "\n")


def setup_text(S: dict) -> str:
    p, b = S["plan"], S["base"]
    info = next((json.loads(f.read_text()) for f in (S["out"] / "build.json", D.CACHE / "build.json")
                 if f.is_file()), {})                    # the build record kept with the runs
    v2 = p.get("version") == 2
    seeds = (f"selection seeds {_seeds(p['selection_seeds'])}, confirmation seeds "
             f"{_seeds(p['confirmation_seeds'])}" if v2 else
             f"seeds {_seeds(p['seeds'])}, used both to choose the lr and to report")
    lines = [
        f"* **Model.** The tiny SD3 pipeline of `examples/digits.py build` "
        f"({info.get('transformer_params', 0) / 1e6:.2f}M-parameter transformer), pretrained on "
        f"real digits. Reward: the probability a conv classifier gives the prompted digit "
        f"({info.get('classifier_heldout_acc', math.nan):.1%} accurate on held-out real digits).",
        f"* **Every run.** P × G = 4 × 8 rollouts per iteration, 10 sampler steps, LoRA rank 32 "
        f"from vgrpo's `setup`, B = {p['iterations']} iterations. Held-out evaluation every "
        f"{p['eval_every']} iterations.",
        f"* **Held-out set** (every reported number): {b['heldout']['n']} images, 4 unseen "
        f"phrasings × 10 digits × {plural(p['n_heldout'] // 4, 'noise')}, the same for every run. "
        f"**Validation set** (only to choose the lr): {b['val']['n']} images from 4 other "
        f"phrasings and other noises.",
        f"* **lr choice.** Grid {', '.join(lr_s(x) for x in p['lrs'])}; {seeds}. " + (
            f"The lr with the best final validation reward among those that end above the base "
            f"model's validation reward and keep ≥ {p['diversity_keep']:.0%} of its validation "
            f"diversity; if none keeps it, the most diverse of those above the base."
            if p.get("lr_beats_base") else
            f"The lr with the best final validation reward among those that keep ≥ "
            f"{p['diversity_keep']:.0%} of the base model's validation diversity."),
        *[f"* **Amendment to the plan** ({a['written']}, commit {a['commit']}). {a['text']}"
          for a in p.get("amendments", [])],
        f"* **Intervals.** 95 % percentile bootstrap, {ST.N_BOOT} draws. Each draw resamples the "
        f"held-out images once for every seed and method, and resamples the seeds. Differences "
        f"between methods are paired.",
    ]
    lines += methods_lines(S)
    return "\n".join(lines) + "\n"


def _seeds(xs: list[int]) -> str:
    return ", ".join(map(str, xs))


def methods_lines(S: dict) -> list[str]:
    """One bullet per method: the trainer it runs through and the recipe it runs with."""
    p, rec = S["plan"], S["plan"].get("recipes", {})
    out = []
    for m in p["methods"] + list(p.get("variants") or {}):
        spec = (p.get("configs") or {}).get(m) or {}
        r = rec.get(m, {})
        if m.startswith("V-GRPO"):
            fl = " ".join(spec.get("flags", [])) or "the shipped recipe (N_MC 4, μ 1, soft clip 3)"
            s = f"vgrpo's `iteration`, {fl}"
        elif m.startswith("DiffusionNFT"):
            s = (f"examples/diffusion_nft_sd3.py, recipe sd3_pickscore; "
                 f"{decay_words(r, p['iterations'])}; evaluated through its EMA")
        elif m.startswith("MixGRPO"):
            sig = r.get("sigma_trained") or BENCH.example("mix_grpo_sd3").sigmas_trained(
                r, BENCH.grid_sigmas(r["num_steps"]), p["iterations"])
            s = (f"examples/mix_grpo_sd3.py, a {r.get('window', '?')}-step window moved every "
                 f"{r.get('shift_interval', '?')} iterations; trains σ "
                 f"{min(sig, default=math.nan):.2f}–{max(sig, default=math.nan):.2f}")
        else:
            s = "examples/flow_grpo_sd3.py, recipe nocfg; evaluated through its EMA"
        out.append(f"* **{m}.** {s}.")
    if p.get("claims_vgrpo"):
        out.append(f"* **The claims use {p['claims_vgrpo']}**, named in the plan before any run: "
                   f"{p['claims_vgrpo_reason']}.")
    return out


def decay_words(r: dict, B: int) -> str:
    """DiffusionNFT's old-policy decay min(uprate·step, uphold) in words: where it stands at B,
    or the step at which it reaches its plateau (one optimizer step per iteration)."""
    up, hold, flat = r.get("decay_uprate", 0.001), r.get("decay_uphold", 0.5), r.get("decay_flat", 0)
    plateau = flat + math.ceil(hold / up - 1e-9)
    at_b = BENCH.example("diffusion_nft_sd3").return_decay(B, flat, up, hold)
    if plateau <= B:
        return (f"old-policy decay min({up:.4g}·step, {hold:g}), which reaches {hold:g} at step "
                f"{plateau} and stays there to B = {B}")
    return (f"old-policy decay min({up:.4g}·step, {hold:g}), {at_b:.3f} at B = {B} (its plateau "
            f"{hold:g} would come at step {plateau})")


def selection_text(S: dict) -> str:
    rows = []
    for r in S["selection"]:
        v, h = r["val"], r["heldout"]
        rows.append([label(r["method"]) + (" **(chosen)**" if r["chosen"] else ""), lr_s(r["lr"]),
                     str(r["seeds"]), num(v.get("reward", (math.nan,))[0]),
                     num(v.get("diversity", (math.nan,))[0]), ci_s(h.get("reward")),
                     ci_s(h.get("acc")), ci_s(h.get("diversity"))])
    notes = selection_notes(S)
    return (f"The base model's held-out reward is {ci_s(S['base_reward'])}. Final numbers after "
            f"{S['plan']['iterations']} iterations.\n\n"
            + table(["method", "lr", "seeds", "val reward", "val diversity", "held-out reward",
                     "held-out accuracy", "held-out diversity"], rows)
            + ("\n" + "\n\n".join(notes) + "\n" if notes else ""))


def selection_notes(S: dict) -> list[str]:
    """What the lr choice did, in sentences: the lrs that took no part, the lrs chosen by the
    diversity floor (and what the floor turned away), the fallback branch with its margin, how
    often the choice stands in bootstrap draws, and choices at an edge of the grid."""
    C, lrs, vbase = S["chosen"], S["plan"]["lrs"], S["base"]["val"]["reward"]
    beats = bool(S["plan"].get("lr_beats_base"))
    below = {m: [r["lr"] for r in c["rows"] if beats and r["val_reward"] <= vbase]
             for m, c in C.items()}
    below = {m: x for m, x in below.items() if len(x) < len(C[m]["rows"])}  # all below: all used
    notes = []
    if any(below.values()):
        notes.append(f"These lrs ended below the base model's validation reward ({vbase:.3f}) and "
                     f"took no part in the choice: " + and_join(
                         [f"{m} at {and_join([lr_s(y) for y in x])}" for m, x in below.items()
                          if x]) + ".")
    for m, c in C.items():
        floor, rows = c["diversity_floor"], c["rows"]
        if c["fallback"]:
            used = sorted([r for r in rows if r["lr"] not in below.get(m, [])],
                          key=lambda r: -r["val_diversity"])
            s = (f"No lr kept {m}'s diversity floor ({floor:.3f}), so the rule's fallback branch "
                 f"took the most diverse lr above the base: {lr_s(used[0]['lr'])} at "
                 f"{used[0]['val_diversity']:.3f}")
            if len(used) > 1:
                gap = used[0]["val_diversity"] - used[1]["val_diversity"]
                s += (f", against {used[1]['val_diversity']:.3f} at {lr_s(used[1]['lr'])}"
                      + (f", a near tie (a difference of {gap:.3f})" if gap < 0.02 else ""))
            if m == S["vgrpo"]:
                s += ". Every claim uses this recipe at this lr"
            notes.append(s + ".")
        else:
            kept_below = [r for r in rows if r["lr"] in below.get(m, [])
                          and r["val_diversity"] >= floor]
            ok = [r for r in rows if r["lr"] not in below.get(m, [])
                  and r["val_diversity"] >= floor]
            if len(ok) == 1 and len(rows) > 1:
                s = (f"For {m}, {lr_s(c['lr'])} is the only lr that both ended above the base "
                     f"model's validation reward and kept its diversity floor ({floor:.3f})")
                higher = [r for r in rows if r["val_reward"] > ok[0]["val_reward"]]
                if higher:
                    s += (f"; {and_join([lr_s(r['lr']) for r in higher])} ended with a higher "
                          f"validation reward but below the floor")
                if kept_below:
                    s += (f"; {and_join([lr_s(r['lr']) for r in kept_below])} kept the floor but "
                          f"ended below the base model's reward")
                notes.append(s + ".")
    stab = S.get("choice_stability") or {}
    moves = {m: 1 - st["picks"].get(C[m]["lr"], 0.0) for m, st in stab.items() if st}
    if moves:
        other = lambda m: and_join([lr_s(lr) for lr, v in stab[m]["picks"].items()
                                    if lr != C[m]["lr"] and v > 0])
        flips = [f"{v:.0%} of draws for {m} (it then picks {other(m)})"
                 for m, v in sorted(moves.items(), key=lambda x: -x[1]) if v > 0]
        never = [m for m, v in moves.items() if v == 0]
        notes.append(
            f"How firm each choice is: in {ST.N_BOOT} bootstrap draws of the validation images "
            f"and the selection seeds, the rule picks another lr in "
            + (and_join(flips) if flips else "no draw")
            + (f", and never for {and_join(never)}" if flips and never else "") + ".")
    top = [m for m, c in C.items() if c["lr"] == max(lrs)]
    bottom = [m for m, c in C.items() if c["lr"] == min(lrs)]
    notes += [f"{m}'s chosen lr is the top of the grid; its best lr may lie above it."
              for m in top]
    if bottom:
        words = {2: "Two", 3: "Three", 4: "Four", 5: "Five"}
        who = (f"{words.get(len(bottom), len(bottom))} methods chose the bottom of the grid, "
               f"{lr_s(min(lrs))}: {and_join(bottom)}" if len(bottom) > 1 else
               f"{bottom[0]} chose the bottom of the grid, {lr_s(min(lrs))}")
        held = [m for m in bottom if m in baselines(S)]
        notes.append(
            f"{who}. The grid has no smaller lr, so it does not bracket "
            f"{'these choices' if len(bottom) > 1 else 'this choice'}: a smaller lr might keep "
            f"more diversity and would likely learn more slowly, and the grid cannot say "
            f"whether it would have been chosen."
            + (f" The claims compare {S['vgrpo']} at {lr_s(C[S['vgrpo']]['lr'])} with "
               f"{and_join(held)} at the smallest lr tried." if held and S["vgrpo"] in C
               and S["vgrpo"] not in bottom else ""))
    moved = [f"{m} {lr_s(c['lr'])}" for m, c in S["chosen_as_written"].items()
             if any(below.values()) and c["lr"] != C[m]["lr"]]
    if moved:
        notes.append(f"The rule as first written would have chosen {and_join(moved)}.")
    return notes


def claims_table_text(S: dict) -> str:
    C = S["claims"]
    if not C:
        return waiting(S, "confirm") if S["plan"].get("version") == 2 else "Not measured yet.\n"
    rows = []
    for m, c in C.items():
        lq = c["last_quarter"]
        rows.append([f"{m}, lr {lr_s(c['lr'])}", ci_s(c["baseline_final"]),
                     ci_s(lq[:3], "{:+.3f}"),
                     _ci_or_reached(c["vgrpo_iters"], c["seeds_reached"], c["seeds"]),
                     *[ratio_s(c, u) for u in ("iters", "steps", "nfe", "seconds")]])
    v = next(iter(C.values()))
    return (f"{S['vgrpo']} at lr {lr_s(v['vgrpo_lr'])} against each baseline at its chosen lr, "
            f"B = {v['B']}. Target: the baseline's final held-out reward. Speed-up: the "
            f"baseline's count over B iterations divided by V-GRPO's count to the target (> 1: "
            f"V-GRPO needs less). The last-quarter gain is the baseline's reward change over "
            f"its last quarter of iterations; an interval that excludes 0 means it had not "
            f"settled, and the claim is then not tested.\n\n"
            + table(["baseline", "its final reward", "its last-quarter gain",
                     "V-GRPO's iterations to it", "speed-up in iterations",
                     "in gradient steps", "in NFE", "in seconds"], rows))


def same_lr_text(S: dict) -> str:
    rows = []
    for r in S["same_lr"]:
        d = r["diff"]
        rows.append([lr_s(r["lr"]), r["vgrpo"], r["method"], ci_s(r["vgrpo_final"]),
                     ci_s(r["baseline_final"])]
                    + [ci_s(d[u], "{:+.3f}") if u in d else "—"
                       for u in ("iters", "steps", "nfe", "seconds")])
    if not rows:
        return "Not measured yet.\n"
    n = S["same_lr"][0]["seeds"]
    wait = ""
    if any("seconds" not in r["diff"] for r in S["same_lr"]):
        wait = " A dash in the seconds column: the timing run it needs is not finished yet."
    return (f"Both methods at the same lr, on the {plural(n, 'selection seed')}. The last four "
            f"columns give V-GRPO's held-out reward minus the baseline's at the same spend: the "
            f"largest number of iterations, gradient steps, NFE or seconds both runs reached "
            f"(each curve interpolated there). Positive: V-GRPO is ahead.{wait}\n\n"
            + table(["lr", "V-GRPO recipe", "baseline", "V-GRPO final", "baseline final",
                     "at the same iterations", "gradient steps", "NFE", "seconds"], rows)
            + "\n" + same_lr_finding(S) + "\n")


def _side(t, what: str) -> str:
    """'ahead at the same iterations (+0.037 [+0.014, +0.060])' from a difference's interval."""
    word = "ahead" if t[1] > 0 else "behind" if t[2] < 0 else "level"
    return f"{word} at the same {what} ({ci_s(t, '{:+.3f}')})"


def same_lr_finding(S: dict) -> str:
    """What the same-lr table shows, in sentences: for each V-GRPO recipe and baseline, lr by lr,
    whether V-GRPO is ahead at the same iterations and at the same gradient steps (or which run
    ended below the base model), then what the seed-level intervals say."""
    base = S["base_reward"][0]
    pairs = {}
    for r in S["same_lr"]:
        pairs.setdefault((r["vgrpo"], r["method"]), []).append(r)
    out = []
    for (v, m), rows in pairs.items():
        parts = []
        for r in rows:
            fv, fb = r["vgrpo_final"][0], r["baseline_final"][0]
            if fv < base and fb < base:
                parts.append(f"at {lr_s(r['lr'])}, both ended below the base model")
            elif fv < base or fb < base:
                low, high = (v, m) if fv < base else (m, v)
                parts.append(f"at {lr_s(r['lr'])}, {low} ended below the base model "
                             f"({min(fv, fb):.3f}) and {high} at {max(fv, fb):.3f}")
            else:
                parts.append(f"at {lr_s(r['lr'])}, V-GRPO is {_side(r['diff']['iters'], 'iterations')}"
                             f" and {_side(r['diff']['steps'], 'gradient steps')}")
        text = "; ".join(parts)
        out.append(f"**{v} against {m}.** " + text[0].upper() + text[1:] + ".")
    n = S["same_lr"][0]["seeds"]
    both = [r for r in S["same_lr"] if min(r["vgrpo_final"][0], r["baseline_final"][0]) >= base]
    sep = [(r, u) for r in both for u in ("iters", "steps")
           if u in r.get("seed_diff", {}) and excludes_zero(r["seed_diff"][u])]
    if n <= 3 and both:
        seed = (f"These are {plural(n, 'seed')}, and the intervals above resample them together "
                f"with the images. A seed-level interval (Student t over the "
                f"{plural(n, 'per-seed difference')}, {plural(n - 1, 'degree')} of freedom) ")
        if sep:
            seed += ("excludes 0 only for " + and_join(
                [f"{r['vgrpo']} against {r['method']} at {lr_s(r['lr'])}, at the same "
                 f"{ST.UNITS[u]} ({ci_s(r['seed_diff'][u], '{:+.3f}')})" for r, u in sep])
                + f". For every other comparison in which both runs ended above the base model, "
                  f"{n} seeds cannot separate the two methods.")
        else:
            seed += (f"includes 0 for every comparison in which both runs ended above the base "
                     f"model: {n} seeds cannot separate the two methods.")
        out.append(seed)
    return "\n\n".join(out)


def ladder_text(S: dict) -> str:
    L = S["ladder"]
    if not L:
        return waiting(S, "confirm") if S["plan"].get("version") == 2 else "Not measured yet.\n"
    v, parts = S["vgrpo"], []
    parts.append(f"Targets: the base model's held-out reward plus 25, 50, 75 and 90 % of the "
                 f"largest final gain of any method ({L['best_gain']:+.3f}). Each method at its "
                 f"chosen lr. A count is the iterations to the target times the method's count "
                 f"per iteration. The speed-up columns divide the row's count by {v}'s (> 1: "
                 f"{v} needs less). A cell that says “not reached”: that row's seed-mean curve "
                 f"did not reach the target.\n")
    for t in L["targets"]:
        rows = []
        a = t["methods"][v]
        for m, e in t["methods"].items():
            c = e["counts"]
            sp = ["—"] * 4 if m == v else [_speedup_s(a, e, u, L["rates"][v], L["rates"][m])
                                           for u in ("iters", "steps", "nfe", "seconds")]
            rows.append([m, f"{e['reached']} of {e['seeds']}",
                         ci_s(c["iters"], "{:.1f}"), ci_s(c["steps"], "{:.1f}"),
                         ci_s(c["nfe"], "{:,.0f}"), ci_s(c.get("seconds"), "{:.0f}"), *sp])
        parts.append(f"**Target {t['fraction']:.0%} of the gain: held-out reward "
                     f"{t['reward']:.3f}.**\n\n" + table(
                         ["method", "seeds reaching", "iterations", "gradient steps", "NFE",
                          "seconds", "speed-up in iterations", "in gradient steps", "in NFE",
                          "in seconds"], rows))
    return "\n".join(parts)


def _speedup_s(a: dict, b: dict, u: str, ra: dict, rb: dict) -> str:
    """A ladder speed-up cell: the ratio with its interval, or who did not reach the target."""
    if u not in a["counts"] or u not in b["counts"]:
        return "—"
    if math.isinf(a["counts"][u][0]):
        return "— (V-GRPO did not reach it)"   # a: the claims' V-GRPO
    if math.isinf(b["counts"][u][0]):
        return "— (not reached)"
    return ci_s(ST.speedup(a, b, u, ra, rb), "{:.2f}")


def variants_text(S: dict) -> str:
    if not S["variants"]:
        return waiting(S, "variant") if S["plan"].get("version") == 2 else "Not measured yet.\n"
    rows, notes = [], []
    for r in S["variants"]:
        rows.append([r["variant"], r["parent"], lr_s(r["lr"]), str(r["seeds"]),
                     ci_s(r["final"]), ci_s(r["parent_final"]), ci_s(r["diff"], "{:+.3f}")])
        sig = r["recipe"].get("sigma_trained")
        if sig:
            notes.append(f"* {r['variant']} trains σ {min(sig):.2f}–{max(sig):.2f}; {r['parent']} "
                         f"trains σ {min(r['parent_recipe']['sigma_trained']):.2f}–"
                         f"{max(r['parent_recipe']['sigma_trained']):.2f}, inside the published "
                         f"run's 0.70–1.")
        if "decay_uprate" in r["recipe"]:
            d = [x for x in r["decay"] if x is not None]
            notes.append(f"* {r['variant']}: {decay_words(r['recipe'], S['plan']['iterations'])}. "
                         f"The published schedule reaches {min(d, default=math.nan):.3f} at B. A "
                         f"decay d lets the old policy lag θ by d/(1 − d) optimizer steps on "
                         f"average.")
    return (table(["variant", "of", "lr", "seeds", "its final reward", "the method's",
                   "difference"], rows) + "\n" + "\n".join(notes) + "\n")


def swaps_text(S: dict) -> str:
    if not S["swaps"]:
        return waiting(S, "swap") if S["plan"].get("swap") else "Not measured yet.\n"
    sw = S["plan"]["swap"]
    rows = [[r["name"], r["ref"], str(r["seeds"]), ci_s(r["final"]), ci_s(r["ref_final"]),
             ci_s(r["diff"], "{:+.3f}"), ci_s(r["seed"], "{:+.3f}")] for r in S["swaps"]]
    n = len(sw["seeds"])
    return (f"At θ = old, DiffusionNFT's gradient equals V-GRPO's μ = 1 gradient on the same "
            f"(t, ε) pairs with advantages clamped at ±5 (`test_vgrpo.py::"
            f"test_nft_gradient_identity_at_theta_old`). What is left are knobs. Here each knob "
            f"is swapped alone, at B = {sw['iterations']} and lr {lr_s(sw['lr'])}, on "
            f"{plural(n, 'seed')}; the difference is paired. Its first interval resamples the "
            f"images and the {n} seeds; the seed-level interval is Student t over the "
            f"{plural(n, 'per-seed difference')} ({plural(n - 1, 'degree')} of freedom).\n\n"
            + table(["run", "against", "seeds", "its final reward", "the reference's",
                     "difference", "seed-level interval"], rows) + "\n" + swaps_finding(S)
            + "\n")


def excludes_zero(t) -> bool:
    return t[1] > 0 or t[2] < 0


# What the knob swaps leave as they are: DiffusionNFT's side of each (examples/diffusion_nft_sd3.py
# RECIPE) against V-GRPO's, and the two knobs both methods share.
NOT_SWAPPED = ("Not swapped: the rollout solver (DiffusionNFT's dpm2, V-GRPO's Euler), the KL "
               "term (DiffusionNFT's β_KL = 1e-4; V-GRPO has none), the timestep fraction "
               "(DiffusionNFT trains each sample at int(0.99·K) = 9 of its K = 10 grid times, "
               "with fresh noise at each) and the old policy's lag (DiffusionNFT's old adapter "
               "trails θ with the decay min(0.001·step, 0.5); V-GRPO's θ_old is θ at the start "
               "of each iteration). The global-std advantages and the ±5 clamp were not swapped "
               "either: both methods use them (vgrpo's SD3 defaults --global_std and "
               "--adv_clamp 5), so neither can carry the difference.")


def swaps_finding(S: dict) -> str:
    """What the knob swaps found, in words: the gap between DiffusionNFT and V-GRPO at the swap's
    lr with both intervals, which swaps moved the final reward (an interval that excludes 0) at
    each level, and what was not swapped."""
    sw = S["plan"]["swap"]
    n = len(sw["seeds"])
    gap = [r for r in S["swaps"] if r["name"] == "DiffusionNFT against V-GRPO"]
    knobs = [r for r in S["swaps"] if r["name"] != "DiffusionNFT against V-GRPO"]
    if not knobs:
        return ""
    text = ""
    if gap:
        g = gap[0]
        text = (f"At lr {lr_s(sw['lr'])}"
                + (f" and B = {sw['iterations']}" if "iterations" in sw else "")
                + f", DiffusionNFT's final reward minus V-GRPO's is {ci_s(g['diff'], '{:+.3f}')} with the images and seeds "
                f"resampled")
        if "seed" in g and not math.isnan(g["seed"][1]):
            text += (f"; its seed-level interval is {_bounds(g['seed'])}"
                     + ("" if excludes_zero(g["seed"]) else
                        f", so {n} seeds cannot separate the two methods at this lr"))
        text += ". "
    moved = [r for r in knobs if excludes_zero(r["diff"])]
    if not moved:
        big = max(knobs, key=lambda r: abs(r["diff"][0]))
        text += (f"No single swap moves the final reward by an interval that excludes 0; the "
                 f"largest is “{big['name']}”: {ci_s(big['diff'], '{:+.3f}')}. On "
                 f"{plural(n, 'seed')} these swaps do not show which knob, if any, carries the "
                 f"difference.")
    else:
        text += ("Swaps whose interval excludes 0: " + and_join(
            [f"{r['name']} ({ci_s(r['diff'], '{:+.3f}')}"
             + (f", seed-level {_bounds(r['seed'])}" if "seed" in r else "") + ")"
             for r in moved]) + ".")
    return text + " " + NOT_SWAPPED


def _bounds(t) -> str:
    return f"[{t[1]:+.3f}, {t[2]:+.3f}]"


def nmc_text(S: dict) -> str:
    if not S["nmc"]:
        return waiting(S, "nmc") if S["plan"].get("nmc") else "Not measured yet.\n"
    rows = [[str(r["n_mc"]) + (" (shipped)" if r["n_mc"] == 4 else ""),
             lr_s(r["lr"]) + (" (V-GRPO's chosen)" if r["lr_rule"] == "chosen" else ""),
             str(r["seeds"]), ci_s(r["final"]["reward"]), ci_s(r.get("diff"), "{:+.3f}"),
             ci_s(r.get("seed"), "{:+.3f}"), ci_s(r["final"]["acc"]), f"{r['nfe']:,.0f}",
             num(r["cv"])] for r in S["nmc"]]
    nm = S["plan"]["nmc"]
    n = len(nm["seeds"])
    return (f"V-GRPO's shipped recipe with another number of (t, ε) pairs, B = "
            f"{nm['iterations']}, on {plural(n, 'seed')}. The paper (its Fig. 4f): 2 fails, 4 is "
            f"the trade-off, 8 is marginal; 10 is its GenEval and OCR value. The difference "
            f"from N_MC 4 is paired; its first interval resamples the images and the seeds, the "
            f"seed-level one is Student t over the {plural(n, 'per-seed difference')}. The "
            f"surrogate's coefficient of variation is the standard deviation of the per-sample "
            f"surrogate S_old over an iteration's {S['results'] and _batch(S)} samples divided by "
            f"the absolute value of its mean (vgrpo's `surrogate_cv`), averaged over the run's "
            f"iterations.\n\n"
            + table(["N_MC", "lr", "seeds", "held-out reward", "difference from N_MC 4",
                     "seed-level interval", "held-out accuracy", "NFE per iteration",
                     "surrogate's coefficient of variation"], rows)
            + "\n" + nmc_finding(S) + "\n")


def _batch(S: dict) -> int:
    """P × G of the plan's runs (the digits benchmark's COMMON flags)."""
    f = D.COMMON
    return int(f[f.index("--prompts_per_iter") + 1]) * int(f[f.index("--group_size") + 1])


def nmc_finding(S: dict) -> str:
    """What the N_MC runs found, in words: per lr, which N_MC ends apart from the shipped 4."""
    out = []
    for lr in S["plan"]["nmc"]["lrs"]:
        rs = [r for r in S["nmc"] if r["lr_rule"] == lr and "diff" in r]
        if not rs:
            continue
        at = f"lr {lr_s(rs[0]['lr'])}" + (" (V-GRPO's chosen)" if lr == "chosen" else "")
        apart = [r for r in rs if excludes_zero(r["diff"])]
        if not apart:
            out.append(f"At {at}, no N_MC ends apart from N_MC 4: every paired interval includes "
                       f"0 (" + and_join([f"N_MC {r['n_mc']} {ci_s(r['diff'], '{:+.3f}')}"
                                          for r in rs]) + ").")
        else:
            out.append(f"At {at}, " + and_join(
                [f"N_MC {r['n_mc']} ends {'above' if r['diff'][0] > 0 else 'below'} N_MC 4 "
                 f"({ci_s(r['diff'], '{:+.3f}')})" for r in apart]) + "; the others' intervals "
                "include 0.")
        seeded = [r for r in apart if "seed" in r and not math.isnan(r["seed"][1])]
        if seeded:                       # apart by the bootstrap: does the seed level agree?
            n, keep = seeded[0]["seeds"], [r for r in seeded if excludes_zero(r["seed"])]
            lost = [r for r in seeded if not excludes_zero(r["seed"])]
            s = []
            if keep:
                s.append(and_join([f"N_MC {r['n_mc']}'s" for r in keep]) + " seed-level "
                         + ("interval also excludes 0 (" if len(keep) == 1 else
                            "intervals also exclude 0 (") + ", ".join(_bounds(r["seed"])
                                                                for r in keep) + ")")
            if lost:
                s.append(and_join([f"N_MC {r['n_mc']}'s ({_bounds(r['seed'])})" for r in lost])
                         + f" {'does' if len(lost) == 1 else 'do'} not: {n} seeds cannot "
                           f"separate {'it' if len(lost) == 1 else 'them'} from N_MC 4")
            out.append("; ".join(s)[0].upper() + "; ".join(s)[1:] + ".")
    return " ".join(out)


def session_spans(sessions: list, finished: list) -> tuple[list, int]:
    """Seconds each invocation of `benchmark` ran, and how many recorded no end: those are
    counted from their start to the last run that finished before the next invocation began."""
    stamp = lambda s: time.mktime(time.strptime(s, "%Y-%m-%d %H:%M:%S"))
    spans, cut = [], 0
    for i, s in enumerate(sessions):
        if s.get("ended"):
            spans.append(stamp(s["ended"]) - stamp(s["started"]))
            continue
        cut += 1
        until = sessions[i + 1]["started"] if i + 1 < len(sessions) else "9999-12-31 23:59:59"
        mine = [stamp(f) for f in finished if s["started"] <= f < until]
        spans.append(max(mine) - stamp(s["started"]) if mine else 0.0)
    return spans, cut


def estimate_by_kind(rs: list, plan: dict, hours) -> str:
    """For each kind of run: how long its finished runs took, and the plan's estimate for every
    run of that kind ('32 of 32 selection runs took 10.0 h; the estimate for the 32: 4.3 h')."""
    names = {"select": "selection", "confirm": "confirmation", "variant": "variant",
             "timing": "timing", "swap": "knob-swap", "nmc": "N_MC"}
    by_kind = (plan.get("estimate") or {}).get("by_kind", {})
    parts = []
    for kind, name in names.items():
        mine = [r["seconds"] for r in rs if r["kind"] == kind]
        n = sum(j["kind"] == kind for j in BENCH.jobs_of(plan))
        if mine:
            parts.append(f"{len(mine)} of {n} {name} runs took {hours(sum(mine))}, against "
                         f"{hours(by_kind.get(kind, 0))} estimated for the {n}")
    return "; ".join(parts)


def cost_text(S: dict) -> str:
    rs = [r for r in S["results"].values() if r.get("kind") and "seconds" in r]
    if not rs:
        return ""
    p = S["plan"]
    hours = lambda x: f"{x / 3600:.1f} h" if x >= 3600 else f"{x / 60:.0f} min"
    finished = [r["finished"] for r in rs if "finished" in r]
    spans, cut = session_spans(p.get("sessions", []), finished)
    wall = (f"{hours(sum(spans))} of wall-clock time over "
            f"{plural(len(spans), 'invocation')} of `benchmark`")
    if cut:
        wall += (f" ({cut} of them stopped when their sitting ended, without recording an end: "
                 "each is counted up to the last run it finished)")
    est = p.get("estimate") or {}
    return (f"{plural(len(rs), 'training run')}, {hours(sum(r['seconds'] for r in rs))} of "
            f"run time in {p['workers']} worker processes of {plural(p['threads'], 'thread')}; "
            f"{wall}. The plan estimated {hours(est.get('worker_seconds', 0))} of run time for "
            f"all {plural(len(BENCH.jobs_of(p)), 'run')} (the timing run among them); "
            f"{estimate_by_kind(rs, p, hours)}. "
            f"Seconds per iteration come from the timing run: one process runs one iteration of "
            f"each method in turn, so every method sees the same machine load.\n")


def status_text(S: dict) -> str:
    out = ""
    if S["failed"]:
        out += f"\nFailed runs: {', '.join(S['failed'])}.\n"
    if S["not_finished"]:
        out += (f"\n**Not finished when this report was written** "
                f"({plural(len(S['not_finished']), 'run')}): sections that need them say "
                f"\"Not measured yet\". `python examples/digits.py benchmark` continues.\n")
    return out


# ------------------------------------------------------------------------------------------------
# Sections of plans of version 1 (the B = 32 benchmark): frontier, ablations, long runs.
# ------------------------------------------------------------------------------------------------
FRONTIER_WORDS = {"above": "V-GRPO's frontier lies above all its points",
                  "not above": "some of its points lie above V-GRPO's frontier",
                  "mixed": "its points lie below V-GRPO's frontier or level with it",
                  "level": "its points are level with V-GRPO's frontier within noise",
                  "beyond": "its points are all more diverse than V-GRPO's"}


def frontier_text(S: dict) -> str:
    F = S.get("frontier") or {}
    if not F.get("points"):
        return "Not enough runs.\n"
    variants = {m: c["variant"] for m, c in S["chosen"].items()}
    rows, lines = [], []
    for m, v, pts, g in ST.frontier_groups(F, baselines(S), variants):
        lines.append(f"* **{label(m)}:** {FRONTIER_WORDS[g['verdict']]}.")
        for q in pts:
            rows.append([label(m), lr_s(q["lr"]), f"{q['reward']:.3f}", f"{q['diversity']:.3f}",
                         ci_s(q["margin"], "{:+.3f}") if "margin" in q else "beyond its range",
                         q.get("position", "—")])
    return ("V-GRPO's frontier joins its (diversity, reward) points at every lr and the base model. "
            "The gap is V-GRPO's frontier minus the point's reward at the point's diversity: "
            "positive when the point lies below the frontier. A point is below, above or level "
            "with it as the gap's interval lies above 0, below 0 or across 0.\n\n"
            + table(["method", "lr", "held-out reward", "held-out diversity",
                     "gap to V-GRPO's frontier", "position"], rows) + "\n" + "\n".join(lines)
            + "\n")


def ablations_text(S: dict) -> str:
    if not S.get("ablations"):
        return "Not run.\n"
    rows = [[a["method"], str(a["seeds"]), ci_s(a["final"]["reward"]),
             ci_s(a["diff"], "{:+.3f}") if a["diff"] else "—", ci_s(a["final"].get("diversity")),
             num(a["cv"]), num(a["cv_group"])] for a in S["ablations"]]
    worse = [a["method"] for a in S["ablations"] if a["diff"] and a["diff"][2] < 0]
    better = [a["method"] for a in S["ablations"] if a["diff"] and a["diff"][1] > 0]
    said = (f"The difference's interval lies below 0 for {and_join(worse) if worse else 'none'} "
            f"and above 0 for {and_join(better) if better else 'none'}; for the others it "
            "includes 0.")
    return (f"V-GRPO one switch away from the shipped recipe, at its chosen lr "
            f"{lr_s(S['chosen']['V-GRPO']['lr'])}; the difference is paired with the shipped "
            f"runs.\n\n" + table(["run", "seeds", "held-out reward", "difference",
                                  "held-out diversity", "surrogate CV", "CV within group"], rows)
            + "\n" + said + "\n")


def long_text(S: dict) -> str:
    if not S.get("long"):
        return "Not run.\n"
    rows = []
    for r in sorted(S["long"], key=lambda r: r["method"]):
        c = [e[r["eval_key"]] for e in r["evals"]]
        peak = max(range(len(c)), key=lambda i: c[i]["acc"])
        rows.append([r["method"] + (", EMA" if r["ema"] else ""), lr_s(r["lr"]),
                     str(r["iterations"]), f"{c[0]['acc']:.3f}",
                     f"{c[peak]['acc']:.3f} (iteration {r['evals'][peak]['iter']})",
                     f"{c[-1]['acc']:.3f}", f"{c[-1]['diversity']:.2f}", f"{c[-1]['nn_real']:.2f}"])
    b = S["base"]["heldout"]
    return (f"One seed each. The base model's held-out diversity is {b['diversity']:.2f} and its "
            f"distance to the nearest real digit {b['nn_real']:.2f}. Real digits score 1 on "
            f"both.\n\n"
            + table(["run", "lr", "iterations", "start accuracy", "peak accuracy",
                     "final accuracy", "final diversity", "final nn-real"], rows))


# ------------------------------------------------------------------------------------------------
# The documents: the report, summary.json, the README's section.
# ------------------------------------------------------------------------------------------------
def write_report(S: dict, cmd: str, figs: dict) -> str:
    p = S["plan"]
    img = lambda k, alt: f"\n![{alt}]({figs[k]})\n" if k in figs else ""
    v2 = p.get("version") == 2
    title = ("V-GRPO against DiffusionNFT and MixGRPO on handwritten digits" if v2 else
             f"V-GRPO and its baselines on handwritten digits at B = {p['iterations']}")
    parts = [f"# {title}\n",
             f"Produced by `{cmd}` (plan `{p['mode']}`, written at commit {p.get('commit', '?')}). "
             f"This report was written by `python examples/digits.py report` from the code of "
             f"commit {report_commit()}. All numbers are held-out rewards unless a column says "
             f"otherwise.\n"
             + status_text(S),
             "## Verdicts\n", verdicts_text(S) + img("curves", "held-out reward curves"),
             "## Setup\n", setup_text(S),
             "## Learning-rate selection\n", selection_text(S),
             "## The paper's claims\n", claims_table_text(S)]
    if S.get("cutoffs"):
        parts += ["## The claims at other cut-offs of the baseline's budget (after the fact)\n",
                  cutoffs_text(S)]
    parts += ["## At the same learning rate\n", same_lr_text(S),
              "## Speed-up at every target\n", ladder_text(S)]
    if v2:
        sw, nm = p.get("swap") or {}, p.get("nmc") or {}
        parts += ["## Variants of the baselines\n", variants_text(S),
                  f"## Why DiffusionNFT leads at 3e-3, if it does: {runs_label(sw)}\n",
                  swaps_text(S),
                  f"## The number of (t, ε) pairs: {runs_label(nm)}\n", nmc_text(S),
                  "## Flow-GRPO\n", flow_b32_text()]
    else:
        parts += ["## The reward–diversity frontier\n", frontier_text(S) + img("frontier", "frontier"),
                  "## Ablations\n", ablations_text(S), "## Long runs\n", long_text(S)]
    parts += ["## Cost\n", cost_text(S), img("samples", "samples")]
    return "\n".join(parts)


def runs_label(part: dict) -> str:
    """'B = 32 runs on 3 seeds' for a part of the plan with its own budget and seeds."""
    return f"B = {part.get('iterations', '?')} runs on {plural(len(part.get('seeds', [])), 'seed')}"


def report_commit() -> str:
    """The commit whose code writes the report, and whether the report's code differs from it."""
    import subprocess
    files = [f"examples/{f}.py" for f in ("digits", "digits_bench", "digits_stats", "digits_report")]
    try:
        dirty = subprocess.run(["git", "-C", str(D.ROOT), "status", "--porcelain", "--", *files],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        dirty = ""
    return BENCH.commit() + (" with uncommitted changes to the report's code" if dirty else "")


# The B = 32 plan's verdicts as first reported (commit 5f090f2), under the rule of that plan; the
# rule that asks first whether the baseline had settled came with commit 0cb6551.
B32_FIRST = {"commit": "5f090f2", "rule_commit": "0cb6551",
             "MixGRPO": "agrees (2.96× [2.08, 7.77] in iterations)",
             "DiffusionNFT": "disagrees (V-GRPO did not reach DiffusionNFT's final reward in its "
                             "32 iterations)"}


def b32_history(m: str, c: dict) -> str:
    """Why a B = 32 verdict changed: its first verdict, the rule that changed it, and what that
    plan's rule says of the present interval (the settled test left out)."""
    if m not in B32_FIRST or c.get("verdict") != "not tested" or "claim" not in c:
        return ""
    old = ST.verdict(dict(c, last_quarter=(0.0, -1.0, 1.0, c["last_quarter"][3])),
                     c["claim"]["factor"], c["claim"]["unit"])[0]
    return (f" First reported (commit {B32_FIRST['commit']}) as “{B32_FIRST[m].split(' (')[0]}” "
            f"({B32_FIRST[m].split(' (', 1)[1]}, under that plan's rule, which did not ask "
            f"whether the baseline had settled. That rule gives “{old}” on the present numbers "
            f"too; the verdict changed because the rule now asks it (since commit "
            f"{B32_FIRST['rule_commit']}).")


def flow_b32_text() -> str:
    rel = "digits_b32.md"
    return (f"Flow-GRPO was not run at this budget. Its results at B = 32 are in [{rel}]({rel}) "
            f"(the earlier plan, lrs chosen and reported on the same three seeds).\n")


def readme_text(S: dict, link: str, fig: str | None, earlier: dict | None = None) -> str:
    """The README's digits section: a short table of the claims' verdicts (this plan's and the
    earlier B = 32 plan's), a figure and the links."""
    rows = []
    for T in (earlier, S):
        for m, c in (T or {}).get("claims", {}).items():
            if "claim" in c:
                rows.append([c["claim"]["label"], regime(T, m), ratio_s(c, c["claim"]["unit"]),
                             f"**{c['verdict']}**"])
    p = S["plan"]
    body = (f"`python examples/digits.py benchmark` trains V-GRPO and the baselines on the "
            f"pretrained digits model, on a CPU, for B = {p['iterations']} iterations; each "
            f"method's lr is chosen on a validation set from "
            f"{plural(len(p['selection_seeds']), 'seed')}, and the claims are measured on "
            f"{plural(len(p['confirmation_seeds']), 'other seed')}. The earlier plan ran B = 32 "
            f"and chose and reported on the same seeds.\n\n")
    body += table(["claim of the paper", "measured at", "speed-up", "verdict"], rows) \
        if rows else "No claim is measured yet.\n"
    reasons = [f"* **{c['claim']['label']}, B = {p['iterations']}: {c['verdict']}.** "
               + reason_s(c) + unit_note(c) for c in S.get("claims", {}).values() if "claim" in c]
    if reasons and S.get("cutoffs"):
        reasons.append(f"* **The B = {p['iterations']} claims at ½, ¾ and all of the baseline's "
                       f"budget (the follow-up's budget-sensitivity rule, after the fact; no "
                       f"verdict changes).** " + " ".join(
                           _cutoff_sentence(S, m, u) for m in S["cutoffs"]
                           for u in (("iters", "steps") if CLAIMS[m]["unit"] == "steps"
                                     else ("iters",))))
    if reasons and S["chosen"].get(S["vgrpo"], {}).get("fallback"):
        lrs = [n for n in selection_notes(S) if n.startswith(f"No lr kept {S['vgrpo']}'s")
               or n.startswith("How firm") or "bottom of the grid" in n]
        reasons.append(f"* **The lrs (B = {p['iterations']}).** " + " ".join(lrs))
    for m, c in ((earlier or {}).get("claims") or {}).items():
        if "claim" in c:
            reasons.append(f"* **{c['claim']['label']}, B = {earlier['plan']['iterations']}: "
                           f"{c['verdict']}.** " + reason_s(c) + b32_history(m, c))
    if reasons and S["swaps"]:
        reasons.append(f"* **DiffusionNFT against V-GRPO at lr {lr_s(p['swap']['lr'])}, one knob "
                       f"swapped at a time ({runs_label(p['swap'])}).** " + swaps_finding(S))
    if reasons and S["nmc"]:
        reasons.append(f"* **The number of (t, ε) pairs ({runs_label(p['nmc'])}).** "
                       + nmc_finding(S))
    fu = BENCH.DEFAULT_OUT["followup"]
    if (fu / "plan.json").is_file():
        reasons.append(followup_summary(analyse_followup(fu), os.path.join(
            os.path.dirname(link), os.path.relpath(fu, Path(__file__).parent))))
    if reasons:
        body += "\n" + "\n".join(reasons) + "\n"
    if S["not_finished"]:
        wait = ("the report's sections that need them say so" if reasons else
                "its claims are stated when their runs are")
        body += (f"\n{plural(len(S['not_finished']), 'run')} of the B = {p['iterations']} plan "
                 f"are not finished yet; {wait}.\n")
    if fig:
        body += f"\n![held-out reward at each method's chosen lr]({fig})\n"
    b32 = os.path.join(os.path.dirname(link), "digits_b32.md")
    return body + (f"\nThe statements, every table and the set-up: [{link}]({link}) (B = "
                   f"{p['iterations']}) and [{b32}]({b32}) (B = 32, with Flow-GRPO). This section "
                   f"was written by `python examples/digits.py report` from the code of commit "
                   f"{report_commit()}.\n")


def replace_readme_section(readme: Path, body: str) -> None:
    """The README's digits section, from its heading to README_END; the rest is kept."""
    text = readme.read_text()
    start = text.index(README_SECTION)
    start = text.index("\n", start) + 1
    end = text.index(README_END, start)
    readme.write_text(text[:start] + "\n" + body.rstrip("\n") + "\n\n" + text[end:])


def strip(x):
    """JSON-ready copy: numpy → float, private keys (leading _) and infinities dropped."""
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if not str(k).startswith("_")
                and k not in ("results", "out", "base")}
    if isinstance(x, (list, tuple)):
        return [strip(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return None
    return x


def report(out: Path = RESULTS, md: Path | None = None, readme: Path | None = None,
           log=print) -> str:
    """summary.json, the markdown and the figures of the runs in `out`. The shipped folders
    write examples/digits.md (digits_b32.md for the B = 32 folder) and their figures beside it;
    the regime folder also rewrites the README's section. Any other folder: report.md inside it."""
    out = Path(out)
    here = Path(__file__).parent
    shipped = {RESULTS.resolve(): "digits", RESULTS_B32.resolve(): "digits_b32"}.get(out.resolve())
    md = Path(md) if md else (here / f"{shipped}.md" if shipped else out / "report.md")
    if readme is None and shipped == "digits":
        readme = D.ROOT / "README.md"
    if json.loads((out / "plan.json").read_text()).get("runs"):
        return followup_report(out, md, log)
    S = analyse(out)
    cmd = "python examples/digits.py benchmark" + (
        " --quick" if S["plan"]["mode"] == "quick" else "") + (
        "" if shipped == "digits" else f" --out {os.path.relpath(out, D.ROOT)}")
    figs = figures(S, md.parent, shipped or "report")
    text = write_report(S, cmd, {k: os.path.relpath(v, md.parent) for k, v in figs.items()})
    md.write_text(text)
    (out / "summary.json").write_text(json.dumps(strip(S), indent=1))
    if readme:
        rel = lambda f: os.path.relpath(f, Path(readme).parent)
        earlier = analyse(RESULTS_B32) if (RESULTS_B32 / "plan.json").is_file() else None
        fig = figs.get("curves") or (here / "digits_b32_curves.png" if earlier else None)
        replace_readme_section(Path(readme), readme_text(
            S, rel(md), rel(fig) if fig and Path(fig).is_file() else None, earlier))
    log(f"wrote {md}, {out / 'summary.json'}" + "".join(f", {v}" for v in figs.values()))
    return text


# ------------------------------------------------------------------------------------------------
# The follow-up plan (digits_bench.PLANS["followup"]): runs at fixed lrs and budgets,
# the claim in the plan's unit under the budget-sensitivity rule, the ladder from the baseline's
# gain. A comparison, and the ladder, wait for every one of their runs.
# ------------------------------------------------------------------------------------------------
def group_name(method: str, lr: float, iterations: int) -> str:
    return f"{method}, lr {lr_s(lr)}, B = {iterations}"


def analyse_followup(out: Path) -> dict:
    """The follow-up folder's runs → numbers: each planned group's runs, each comparison's
    budget sensitivity and verdict (when all its runs are in), Run A's same-spend differences,
    the ladder (when every group is complete)."""
    plan = json.loads((out / "plan.json").read_text())
    base = json.loads((out / "base.json").read_text())
    results = BENCH.load_results(out)
    timing = next((r for r in results.values() if r.get("kind") == "timing"), None)
    jobs = BENCH.jobs_of(plan)
    S = {"plan": plan, "base": base, "results": results, "timing": timing, "out": out,
         "base_reward": ST.ci(*ST.boot_mean(ST.arrays([base["heldout"]], "reward"))),
         "failed": sorted(p.stem for p in out.glob("*.failed")),
         "not_finished": sorted({j["id"] for j in jobs} - set(results)
                                - {p.stem for p in out.glob("*.failed")}),
         "groups": {}, "comparisons": [], "ladder": {}}
    for spec in plan["runs"]:
        ids = [j["id"] for j in jobs if j["kind"] == "fixed" and j["method"] == spec["method"]
               and j["lr"] == spec["lr"] and j["iterations"] == spec["iterations"]]
        rs = sorted([results[i] for i in ids if i in results], key=lambda r: r["seed"])
        S["groups"][group_name(spec["method"], spec["lr"], spec["iterations"])] = dict(
            spec, runs=rs, planned=len(ids), complete=len(rs) == len(ids))
    cl = plan["claim"]
    for comp in plan["comparisons"]:
        v, b = group_name(*comp["vgrpo"]), group_name(*comp["baseline"])
        gv, gb = S["groups"][v], S["groups"][b]
        row = dict(comp, v=v, b=b, done=sum(len(g["runs"]) for g in (gv, gb)),
                   planned=gv["planned"] + gb["planned"])
        if gv["complete"] and gb["complete"]:
            label_b = f"DiffusionNFT at lr {lr_s(comp['baseline'][1])}"
            bs = ST.budget_sensitivity(gv["runs"], gb["runs"], timing, comp["baseline"][0],
                                       comp["vgrpo"][0], plan["cutoffs"])
            for c in bs["cutoffs"]:
                c["method"] = label_b
            row.update(bs=bs, verdict=ST.budget_verdict(bs, cl["factor"], cl["unit"]),
                       in_steps=ST.budget_verdict(bs, cl["factor"], "steps"))
            if comp["vgrpo"][1] == comp["baseline"][1]:
                row["same_spend"] = ST.same_spend(gv["runs"], gb["runs"], timing,
                                                  comp["vgrpo"][0], comp["baseline"][0])
        S["comparisons"].append(row)
    if all(g["complete"] for g in S["groups"].values()):
        groups = {n: g["runs"] for n, g in S["groups"].items()}
        seeds = set.intersection(*[{r["seed"] for r in rs} for rs in groups.values()])
        groups = {n: [r for r in rs if r["seed"] in seeds] for n, rs in groups.items()}
        L = ST.ladder(groups, S["base_reward"][0], timing,
                      gain_of=group_name(*plan["ladder_baseline"]), fractions=plan["ladder"],
                      rate_of={n: g["method"] for n, g in S["groups"].items()})
        L["rates"] = {n: ST.rates(rs, timing, S["groups"][n]["method"])
                      for n, rs in groups.items()}
        S["ladder"] = L
    return S


def followup_verdicts_text(S: dict) -> str:
    cl, rows, paras = S["plan"]["claim"], [], []
    for c in S["comparisons"]:
        if "bs" not in c:
            paras.append(f"**{c['name']} ({c['what']}): not measured yet.** {c['done']} of its "
                         f"{c['planned']} runs are finished; the comparison waits for all.")
            continue
        f, u = c["bs"]["final"], cl["unit"]
        rows.append([c["name"], f"{c['b']}; {c['v']}", ratio_s(f, u), ratio_s(f, "steps"),
                     f"{cl['factor']:.2g}×", f"**{c['verdict'][0]}**"])
        paras.append(f"**{c['name']} ({c['what']}): {c['verdict'][0]}.** "
                     f"{c['verdict'][1][0].upper()}{c['verdict'][1][1:]}. In gradient steps, the "
                     f"same rule gives “{c['in_steps'][0]}”: {c['in_steps'][1]}.")
    head = ""
    if rows:
        head = table(["run", "measured at", f"speed-up in {ST.UNITS[cl['unit']]} (the verdict's "
                      f"unit)", "in gradient steps", "claimed", "verdict"], rows) + "\n"
    return head + "\n\n".join(paras) + "\n"


def followup_cutoffs_text(S: dict) -> str:
    parts = []
    for c in S["comparisons"]:
        if "bs" not in c:
            continue
        rows = []
        for k in c["bs"]["cutoffs"]:
            rows.append([f"{k['fraction']:.0%}: iteration {k['B']}", ci_s(k["baseline_final"]),
                         _ci_or_reached(k["vgrpo_iters"], k["seeds_reached"], k["seeds"]),
                         *[ratio_s(k, u) if k["reached"] else
                           f"below {k['bound'][u]:.2f}× (not reached)" for u in
                           ("iters", "steps", "nfe", "seconds") if u in k["ratio"]]])
        units = [u for u in ("iters", "steps", "nfe", "seconds") if u in c["bs"]["final"]["ratio"]]
        lq = c["bs"]["final"]["last_quarter"]
        parts.append(f"**{c['name']}: {c['b']} against {c['v']}.** The baseline's last-quarter "
                     f"gain (no part of the verdict): {ci_s(lq[:3], '{:+.3f}')}.\n\n" + table(
                         ["cut-off of the baseline's budget", "its reward there (the target)",
                          "V-GRPO's iterations to it"] + [f"speed-up in {ST.UNITS[u]}"
                                                         for u in units], rows))
    return "\n".join(parts) if parts else "Not measured yet.\n"


def followup_ladder_text(S: dict) -> str:
    L = S["ladder"]
    if not L:
        done = sum(len(g["runs"]) for g in S["groups"].values())
        n = sum(g["planned"] for g in S["groups"].values())
        return (f"Not measured yet: {done} of the {n} runs are finished, and the ladder waits "
                f"for all of them.\n")
    names, v = list(L["targets"][0]["methods"]), group_name(*S["plan"]["comparisons"][0]["vgrpo"])
    others = [n for n in names if n != v]
    out = [f"Targets: the base model's held-out reward plus "
           f"{and_join([f'{f:.0%}' for f in S['plan']['ladder']])} of the final gain of "
           f"{L['gain_of']} over the base model ({L['best_gain']:+.3f}). The same targets in "
           f"every table. Speed-up: the DiffusionNFT run's count to the target divided by "
           f"V-GRPO's (> 1: V-GRPO needs less).\n"]
    for unit in ("iters", "steps"):
        rows = []
        for t in L["targets"]:
            e = t["methods"]
            fmt = "{:.1f}"
            rows.append([f"{t['fraction']:.0%}: {t['reward']:.3f}"]
                        + [_ci_or_reached(e[n]["counts"][unit], e[n]["reached"], e[n]["seeds"],
                                          fmt) for n in names]
                        + [_speedup_s(e[v], e[n], unit, L["rates"][v], L["rates"][n])
                           for n in others])
        out.append(f"**{ST.UNITS[unit].capitalize()} to each target.**\n\n" + table(
            ["target"] + names + [f"speed-up against {n}" for n in others], rows))
    return "\n".join(out)


def followup_finals_text(S: dict) -> str:
    rows = []
    for n, g in S["groups"].items():
        if not g["complete"]:
            rows.append([n, f"{len(g['runs'])} of {g['planned']}", "—", "—"])
            continue
        fs = ST.final_stats(g["runs"])
        lq = ST.last_quarter_gain(g["runs"])
        rows.append([n, f"{len(g['runs'])} of {g['planned']}", ci_s(fs["reward"]),
                     ci_s(lq[:3], "{:+.3f}")])
    return (f"The base model's held-out reward is {ci_s(S['base_reward'])}.\n\n"
            + table(["runs", "seeds finished", "final held-out reward", "last-quarter gain"],
                    rows))


def followup_same_spend_text(S: dict) -> str:
    rows = []
    for c in S["comparisons"]:
        d = c.get("same_spend")
        if not d:
            continue
        rows.append([c["name"], c["v"], c["b"], ci_s(d["vgrpo_final"]), ci_s(d["baseline_final"])]
                    + [ci_s(d["diff"][u], "{:+.3f}") if u in d["diff"] else "—"
                       for u in ("iters", "steps", "nfe", "seconds")])
    if not rows:
        return "Not measured yet.\n"
    return ("V-GRPO's held-out reward minus DiffusionNFT's at the largest spend both reached "
            "(each curve interpolated there). Positive: V-GRPO is ahead.\n\n"
            + table(["run", "V-GRPO", "DiffusionNFT", "V-GRPO final", "DiffusionNFT final",
                     "at the same iterations", "gradient steps", "NFE", "seconds"], rows))


def followup_cost_text(S: dict) -> str:
    rs = [r for r in S["results"].values() if r.get("kind") == "fixed"]
    est = (S["plan"].get("estimate") or {}).get("by_run", {})
    if not rs:
        return "No run has finished yet.\n"
    hours = lambda x: f"{x / 3600:.1f} h" if x >= 3600 else f"{x / 60:.0f} min"
    rows = []
    for n, g in S["groups"].items():
        key = f"{g['method']} lr {g['lr']:g} B {g['iterations']}"
        took = [r["seconds"] for r in g["runs"]]
        rows.append([n, f"{len(took)} of {g['planned']}", hours(sum(took)) if took else "—",
                     f"{sum(took) / max(sum(r['iterations'] for r in g['runs']), 1):.1f} s"
                     if took else "—", hours(est.get(key, 0))])
    return ("Each run is one worker process of one thread, under nice, on a shared 2-core machine; "
            "some sittings ran two workers side by side, and other work at times, so these run "
            "times are upper bounds. Speed-ups in seconds use the timing run, not these times.\n\n"
            + table(["runs", "finished", "run time", "per iteration", "estimated for all"],
                    rows))


def write_followup(S: dict, cmd: str) -> str:
    p = S["plan"]
    status = ""
    if S["failed"]:
        status += f"\nFailed runs: {', '.join(S['failed'])}.\n"
    if S["not_finished"]:
        jobs = BENCH.jobs_of(p)
        timing = sum(j["kind"] == "timing" for j in jobs)
        status += (f"\n**Not finished when this report was written**: {len(S['not_finished'])} of "
                   f"the plan's {len(jobs)} jobs ({len(jobs) - timing} training runs and "
                   f"{plural(timing, 'timing run')}). Sections that need them say \"Not measured "
                   f"yet\". `{cmd}` continues.\n")
    return "\n".join([
        "# Follow-up: V-GRPO (GenEval-stage) against DiffusionNFT on fresh seeds\n",
        f"Produced by `{cmd}` (plan `{p['mode']}`, written at commit {p.get('commit', '?')} before "
        f"any of its runs; the plan: [plan.md](plan.md)). This report was written by `python "
        f"examples/digits.py report --out {os.path.relpath(S['out'], D.ROOT)}` from the code of "
        f"commit {report_commit()}. Seeds {_seeds(p['confirmation_seeds'])}. All numbers are "
        f"held-out rewards unless a column says otherwise.\n" + status,
        "## Verdicts\n",
        f"The claim: {p['claim']['label']} (the paper: {p['claim']['paper']}). The rules are "
        f"the plan's, quoted below the tables.\n",
        followup_verdicts_text(S),
        "## The speed-up at each cut-off of the baseline's budget\n", followup_cutoffs_text(S),
        "## Final rewards\n", followup_finals_text(S),
        "## Run A at the same spend\n", followup_same_spend_text(S),
        "## Speed-up at every target\n", followup_ladder_text(S),
        "## Cost\n", followup_cost_text(S),
        "## The unit and the rules, as the plan fixed them before any run\n",
        f"**The unit** (the line numbers are those of commit {p.get('commit', '?')}, where the "
        f"plan was written; \"PAPER.md\" there is a summary of the paper, arXiv 2604.23380, not "
        f"shipped: its §1.7 and Table 5 are the paper's stage lengths and per-stage steps and NFE, "
        f"which METHOD.md P11 restates, and its §3 item 9 is this project's choice, METHOD.md C9). "
        f"{p['unit']}\n\n**Settled.** {p['rules']['settled']}\n\n**The verdict.** "
        f"{p['rules']['verdict']}\n\n**The ladder.** {p['rules']['ladder']}\n"])


def followup_summary(F: dict, folder: str) -> str:
    """The follow-up in one bullet for the README: each comparison's verdict with its reason once
    all its runs are in, else how many runs are finished."""
    p, cl = F["plan"], F["plan"]["claim"]
    s = (f"* **Follow-up: the DiffusionNFT claim in {ST.UNITS[cl['unit']]}, on seeds "
         f"{_seeds(p['confirmation_seeds'])}** ([plan]({folder}/plan.md), [report]({folder}/"
         f"report.md)). ")
    for c in F["comparisons"]:
        if "verdict" in c:
            s += (f"{c['name']} ({c['what']}): **{c['verdict'][0]}**; "
                  f"{c['verdict'][1]}. ")
        else:
            s += f"{c['name']} ({c['what']}): not measured yet. "
    if F["not_finished"]:
        s += ("The runs are in progress; the report lists those finished, and nothing is "
              "concluded from a comparison before all its runs are in.")
    return s.rstrip()


def followup_report(out: Path, md: Path | None = None, log=print) -> str:
    """The follow-up folder's report.md (or `md`) and summary.json."""
    S = analyse_followup(out)
    md = Path(md) if md else out / "report.md"
    cmd = (f"python examples/digits.py benchmark --plan {S['plan']['mode']} --workers 1 "
           f"--threads 1" + ("" if out.resolve() == BENCH.DEFAULT_OUT["followup"].resolve()
                             else f" --out {os.path.relpath(out, D.ROOT)}"))
    text = write_followup(S, cmd)
    md.write_text(text)
    groups = {n: {k: v for k, v in g.items() if k != "runs"} for n, g in S["groups"].items()}
    (out / "summary.json").write_text(json.dumps(strip(dict(S, groups=groups)), indent=1))
    log(f"wrote {md}, {out / 'summary.json'}")
    return text


def add_command(sub) -> None:
    r = sub.add_parser("report", help="the report, summary.json and figures of a results folder")
    r.add_argument("--out", default=str(RESULTS), help="results folder (default "
                   "examples/digits_results)")
    r.add_argument("--md", default=None, help="markdown path (default: see report())")
    r.add_argument("--readme", default=None, help="also rewrite this README's digits section")


def run_command(a) -> None:
    if not (Path(a.out) / "plan.json").is_file():
        raise ValueError(f"{a.out} holds no benchmark (no plan.json)")
    BENCH.use_kept_model(Path(a.out))
    report(Path(a.out), md=a.md, readme=a.readme)


# ------------------------------------------------------------------------------------------------
# Figures (matplotlib): held-out curves at the chosen lrs with sample grids; the frontier.
# ------------------------------------------------------------------------------------------------
COLORS = {"V-GRPO": "tab:blue", "V-GRPO (GenEval-stage)": "tab:cyan", "DiffusionNFT": "tab:green",
          "MixGRPO": "tab:purple", "Flow-GRPO (no CFG)": "tab:orange"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def figures(S: dict, fig_dir: Path, prefix: str) -> dict:
    figs = {}
    groups = {m: ST.confirm_runs(S["results"], S["plan"], S["chosen"], m)
              for m in S["plan"]["methods"]}
    groups = {m: rs for m, rs in groups.items() if rs}
    if groups and finished_all(S, "confirm"):
        figs["curves"] = curves_figure(S, groups, fig_dir / f"{prefix}_curves.png")
        figs["samples"] = samples_figure(S, groups, fig_dir / f"{prefix}_samples.png")
    if S.get("frontier", {}).get("points"):
        figs["frontier"] = frontier_figure(S, fig_dir / f"{prefix}_frontier.png")
    return {k: v for k, v in figs.items() if v}


def curves_figure(S: dict, groups: dict, path: Path) -> Path:
    """Held-out reward against iterations and against training NFE, seed means, band min–max."""
    plt = _plt()
    fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
    for m, rs in groups.items():
        its, X = ST.curves(rs)
        y = X.mean(-1)                                               # (S, E) per seed
        nfe = its * np.mean([ST.nfe_per_iter(r) for r in rs])
        lab = f"{m}, lr {lr_s(rs[0]['lr'])} ({plural(len(rs), 'seed')})"
        for ax, x in zip(axs, (its, nfe)):
            ax.plot(x, y.mean(0), color=COLORS.get(m, "gray"), marker="o", ms=3, label=lab)
            ax.fill_between(x, y.min(0), y.max(0), color=COLORS.get(m, "gray"), alpha=0.15)
    for ax, xl in zip(axs, ("iteration", "training NFE (transformer forwards)")):
        ax.axhline(S["base_reward"][0], color="black", ls=":", lw=0.8, label="base model")
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
    axs[0].legend(fontsize=7)
    axs[0].set_title("held-out reward at each method's chosen lr (band: min–max over seeds)",
                     fontsize=9)
    axs[1].set_title("the same against training network evaluations", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def samples_figure(S: dict, groups: dict, path: Path):
    """The base model's held-out samples and each method's after B (its first seed)."""
    from PIL import Image
    grids = [("base model", S["out"] / "grids" / "base.png")]
    grids += [(f"{m} @{rs[0]['iterations']}", S["out"] / "grids" / f"{rs[0]['id']}__"
               f"{rs[0]['eval_key']}.png") for m, rs in groups.items()]
    grids = [(t, p) for t, p in grids if p.is_file()]
    if not grids:
        return None
    plt = _plt()
    fig, axs = plt.subplots(1, len(grids), figsize=(2.6 * len(grids), 3.0), squeeze=False)
    for ax, (t, p) in zip(axs[0], grids):
        ax.imshow(np.asarray(Image.open(p)), cmap="gray", vmin=0, vmax=255)
        ax.set_title(t, fontsize=8)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def frontier_figure(S: dict, path: Path) -> Path:
    """Every (method, lr) point of the sweep, final held-out diversity and reward with intervals."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    for m in S["plan"]["methods"]:
        rows = sorted([r for r in S["selection"] if r["method"] == m], key=lambda r: r["lr"])
        if not rows:
            continue
        xs = [r["heldout"]["diversity"][0] for r in rows]
        ys = [r["heldout"]["reward"][0] for r in rows]
        ax.plot(xs, ys, color=COLORS.get(m, "gray"), marker="o", label=label(m))
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(lr_s(r["lr"]) + (" ★" if r["chosen"] else ""), (x, y), fontsize=7,
                        textcoords="offset points", xytext=(5, 4), color=COLORS.get(m, "gray"))
    b = base_point(S)["heldout"]
    ax.plot([b["diversity"][0]], [b["reward"][0]], "kD", label="base model")
    ax.axvline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("held-out diversity (within-digit; real handwriting = 1)")
    ax.set_ylabel("held-out reward")
    ax.set_title(f"Reward and diversity after {S['plan']['iterations']} iterations (★ chosen lr)",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
