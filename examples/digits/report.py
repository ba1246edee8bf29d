"""examples/digits/report.md and curves.png, written from the committed runs alone (no training).

    python -m examples.digits report                  # report.md and curves.png beside this file
    python -m examples.digits report --out DIR        # both into DIR (the test's regeneration)
    python -m examples.digits report --results runs/digits-quick --followup none --b32 none

The report is tables and a few fixed sentences; stats.py computes every number.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from examples.digits import stats as ST

HERE = Path(__file__).resolve().parent
VGEN = "V-GRPO (GenEval-stage)"
NAMES = {VGEN: "V-GRPO (GenEval-stage recipe)", "V-GRPO": "V-GRPO (vgrpo.py's shipped defaults)"}
# The paper's two speed-up claims (its abstract): V-GRPO reaches the baseline's final reward in
# 1/factor of the baseline's training.
CLAIMS = {
    "DiffusionNFT": dict(factor=1700 / 580, paper="V-GRPO reaches DiffusionNFT's reward in about "
                         "a third of the steps (SD3.5-M: 580 against about 1.7K, 2.9×)"),
    "MixGRPO": dict(factor=2.0, paper="V-GRPO reaches MixGRPO's reward in half the iterations "
                    "(FLUX.1-dev: 150 against 300, 2×)"),
}
COLORS = {VGEN: "tab:cyan", "V-GRPO": "tab:blue", "DiffusionNFT": "tab:green",
          "MixGRPO": "tab:purple"}


# ------------------------------------------------------------------------------------------------
# Formatting.
# ------------------------------------------------------------------------------------------------
def name(m: str) -> str:
    return NAMES.get(m, m)


def lr_s(x) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def ci_s(t, fmt="{:.3f}") -> str:
    """(point, lo, hi) as "p [lo, hi]"; an end that is never reached is said in words."""
    p, lo, hi = (fmt.format(x) if math.isfinite(x) else "not reached" for x in t[:3])
    return f"{p} [{lo}, {hi}]"


def diff_s(t) -> str:
    return ci_s(t, "{:+.3f}")


def seeds_s(seeds: list[int]) -> str:
    s = sorted(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}–{s[-1]}"
    return ", ".join(map(str, s))


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def speed_s(c: dict, u: str) -> str:
    """A speed-up with its interval; where V-GRPO's seed-mean curve (or some draws) missed the
    target, the bound it lies below and the interval's upper end."""
    p, lo, hi = c["ratio"][u]
    if not c["reached"]:
        return f"below {c['bound'][u]:.2f}× (interval up to {hi:.2f}×)"
    if lo <= 0:
        return f"{p:.2f}× (interval up to {hi:.2f}×)"
    return f"{p:.2f}× [{lo:.2f}, {hi:.2f}]"


def hits_s(c: dict) -> str:
    its = ci_s(c["vgrpo_iters"], "{:.1f}") if c["reached"] else \
        f"not within its {c['Bv']}"
    return f"{its}; {c['seeds_reached']} of {c['seeds']} seeds"


# ------------------------------------------------------------------------------------------------
# The numbers.
# ------------------------------------------------------------------------------------------------
def load(folder: Path | None) -> dict | None:
    if folder is None or not (Path(folder) / "plan.json").is_file():
        return None
    from examples.digits import bench
    folder = Path(folder)
    plan = json.loads((folder / "plan.json").read_text())
    base = json.loads((folder / "base.json").read_text()) if (folder / "base.json").is_file() \
        else None
    return dict(folder=folder, plan=plan, base=base, results=bench.load_results(folder))


def base_row(S: dict) -> dict:
    """The base model's held-out measures as final_stats gives a method's."""
    return ST.final_stats([{"final": {"heldout_raw": S["base"]["heldout"]}, "eval_key": "raw"}])


def confirm(S: dict, m: str) -> list[dict]:
    return ST.runs_of(S["results"], "confirm", m)


def fixed(S: dict, spec: list) -> list[dict]:
    m, lr, B = spec
    return ST.runs_of(S["results"], "fixed", m, lr, B)


def comparisons(R: dict, F: dict | None) -> list[dict]:
    """Every measurement of a claim: the B = 128 plan's at the chosen lrs (still improving: the
    baseline's last-quarter change lies above 0), the follow-up's Run A and Run B (its own rule:
    not settled)."""
    out, v = [], confirm(R, R["plan"]["claims_vgrpo"])
    ch = R["chosen"]
    for b in CLAIMS:
        if b not in ch or not confirm(R, b) or not v:
            continue
        c = ST.claim(v, confirm(R, b))
        lq = c["last_quarter"]
        still = {u: lq[1] > 0 for u in ST.UNITS}
        what = (f"B = {c['B']} plan: {b} lr {lr_s(ch[b]['lr'])}, V-GRPO lr "
                f"{lr_s(ch[R['plan']['claims_vgrpo']]['lr'])}, {c['B']} iterations each")
        out.append(dict(baseline=b, what=what, c=c, still=still, comment="each at its chosen lr",
                        seeds=sorted(r["seed"] for r in confirm(R, b))))
    for comp in (F["plan"].get("comparisons", []) if F else []):
        vr, br = fixed(F, comp["vgrpo"]), fixed(F, comp["baseline"])
        if not vr or not br:
            continue
        (_, lv, bv), (b, lb, bb) = comp["vgrpo"], comp["baseline"]
        what = (f"follow-up {comp['name']}: {b} lr {lr_s(lb)}, {bb} iterations; V-GRPO lr "
                f"{lr_s(lv)}, {bv} iterations")
        out.append(dict(baseline=b, what=what, c=ST.claim(vr, br), comment=comp["what"],
                        still={u: not ST.settled(vr, br, u) for u in ST.UNITS},
                        seeds=sorted(r["seed"] for r in br)))
    for x in out:
        factor = CLAIMS[x["baseline"]]["factor"]
        x["verdict"] = {u: ST.verdict(x["c"], factor, u, x["still"][u]) for u in ST.UNITS}
    return out


def claim_verdict(rows: list[dict]) -> tuple[str, dict | None]:
    """A claim's verdict: that of its measurements that are not inconclusive, in both units, if
    they all say the same (the first of them backs it); inconclusive if none is; else mixed."""
    words = {x["verdict"][u][0] for x in rows for u in ST.UNITS} - {"inconclusive"}
    if not words:
        return "inconclusive", rows[0] if rows else None
    if len(words) > 1:
        return "mixed", None
    w = words.pop()
    return w, next(x for x in rows if {x["verdict"][u][0] for u in ST.UNITS} == {w})


def same_lr_rows(R: dict, F: dict | None) -> list[dict]:
    """V-GRPO (each recipe) minus DiffusionNFT at the same lr and seeds, where both ended above
    the base model's held-out reward."""
    base, rows, ch = R["base"]["heldout"]["reward"], [], R["chosen"]
    for v in (VGEN, "V-GRPO"):
        for kind in ("select", "confirm"):
            for lr in R["plan"]["lrs"]:
                # confirmation runs only where both methods chose this lr
                if kind == "confirm" and not (ch.get(v, {}).get("lr") == lr
                                              == ch.get("DiffusionNFT", {}).get("lr")):
                    continue
                rows.append(dict(v=v, lr=lr, kind=kind, vr=ST.runs_of(R["results"], kind, v, lr),
                                 br=ST.runs_of(R["results"], kind, "DiffusionNFT", lr)))
        for comp in (F["plan"].get("comparisons", []) if F else []):
            if comp["vgrpo"][0] == v and comp["vgrpo"][1:] == comp["baseline"][1:]:
                rows.append(dict(v=v, lr=comp["vgrpo"][1], kind=comp["name"],
                                 vr=fixed(F, comp["vgrpo"]), br=fixed(F, comp["baseline"])))
    out = []
    for r in rows:
        vr, br = ST.paired(r["vr"], r["br"])
        if not vr or min(ST.final_stats(x)["reward"][0] for x in (vr, br)) <= base:
            continue
        out.append(dict(r, vr=vr, br=br, seeds=sorted(x["seed"] for x in vr),
                        v_final=ST.final_stats(vr)["reward"], b_final=ST.final_stats(br)["reward"],
                        d=ST.same_spend(vr, br)))
    return out


# ------------------------------------------------------------------------------------------------
# The sections.
# ------------------------------------------------------------------------------------------------
def main_table(R: dict) -> str:
    plan, ch = R["plan"], R["chosen"]
    b = base_row(R)
    rows = [["base model (before training)", "—", "—", "—", ci_s(b["reward"]), ci_s(b["acc"]),
             ci_s(b["diversity"])]]
    for m in plan["methods"]:
        rs = confirm(R, m)
        if not rs:
            continue
        f = ST.final_stats(rs)
        rows.append([name(m), lr_s(ch[m]["lr"]), seeds_s([r["seed"] for r in rs]),
                     f"{ST.steps_per_iter(rs):g}", ci_s(f["reward"]), ci_s(f["acc"]),
                     ci_s(f["diversity"])])
    B = plan["iterations"]
    head = ["model", "lr", "seeds", "gradient steps per iteration",
            f"held-out reward after {B} iterations", f"prompt accuracy after {B} iterations",
            f"diversity after {B} iterations (higher = more varied)"]
    return table(head, rows)


def claims_text(R: dict, F: dict | None) -> str:
    comps = comparisons(R, F)
    verdict_rows, detail = [], []
    for b, cl in CLAIMS.items():
        rows = [x for x in comps if x["baseline"] == b]
        if not rows:
            continue
        w, x = claim_verdict(rows)
        verdict_rows.append([cl["paper"], f"**{w}**", why(w, x, cl["factor"])])
        for x in rows:
            vd = x["verdict"]
            word = f"{vd['iters'][0]} ({vd['iters'][1]})" if vd["iters"] == vd["steps"] else \
                "; ".join(f"{ST.UNITS[u]}: {vd[u][0]} ({vd[u][1]})" for u in ST.UNITS)
            detail.append([f"{b} ({CLAIMS[b]['factor']:.2g}×)", x["what"],
                           seeds_s(x["seeds"]), ci_s(x["c"]["baseline_final"]),
                           diff_s(x["c"]["last_quarter"]), hits_s(x["c"]),
                           speed_s(x["c"], "iters"), speed_s(x["c"], "steps"), word])
    head = ["claim", "comparison", "seeds", "baseline's final held-out reward",
            "its change over the last quarter of its iterations",
            "V-GRPO's iterations to reach it", "speed-up in iterations",
            "speed-up in gradient steps", "verdict"]
    return "\n\n".join([
        table(["the paper's claim", "verdict here", "why"], verdict_rows),
        "Each comparison below pits V-GRPO (GenEval-stage recipe) against one baseline. The "
        "target is the baseline's final held-out reward; the speed-up is the baseline's count "
        "over its whole budget divided by V-GRPO's count to the target, in iterations (rollout "
        "rounds, what the paper's 580 and 1.7K count; [METHOD.md](../../METHOD.md) C9) and in "
        "gradient steps (> 1: V-GRPO needs less). A baseline still improving at the end has no "
        "fixed target, so its comparison is inconclusive: for the B = 128 plan, its change over "
        "the last quarter of its iterations lies above 0; for the follow-up, by the rule its "
        "plan fixed before its runs ([results_followup/plan.md](results_followup/plan.md)), the "
        "speed-up moves outside its interval when the baseline is cut off at ½ or ¾ of its "
        "budget.",
        table(head, detail)])


def why(w: str, x: dict | None, factor: float) -> str:
    """The verdict's reason in a few words, from the comparison that backs it."""
    if x is None:
        return "the comparisons disagree with each other"
    c, b = x["c"], x["baseline"]
    if w == "inconclusive" and any(x["still"].values()):
        if not c["reached"]:
            return f"{b} was still improving at the end of its {c['B']} iterations"
        return (f"{b} was still improving at the end of its {c['B']} iterations; V-GRPO "
                f"reached {b}'s final reward in {c['vgrpo_iters'][0]:.0f} iterations against "
                f"{b}'s {c['B']} ({speed_s(c, 'iters')})")
    head = (f"{x['what'].split(':')[0]} ({x['comment']}; seeds {seeds_s(x['seeds'])}): "
            f"{b} ended at {c['baseline_final'][0]:.3f}, V-GRPO at {c['vgrpo_final'][0]:.3f}")
    if w == "disagrees":
        return (f"{head}; V-GRPO's speed-up to {b}'s final reward is at most "
                f"{c['ratio']['iters'][2]:.2f}× in iterations and {c['ratio']['steps'][2]:.2f}× "
                f"in gradient steps, below the claimed {factor:.2g}×")
    if w == "agrees":
        return f"{head}; V-GRPO's speed-up is {speed_s(c, 'iters')} in iterations"
    return x["verdict"]["iters"][1]


def same_lr_text(rows: list[dict]) -> str:
    out = []
    for r in rows:
        seeds = {"select": "selection", "confirm": "confirmation"}.get(r["kind"], r["kind"])
        out.append([name(r["v"]), lr_s(r["lr"]), f"{seeds_s(r['seeds'])} ({seeds})",
                    str(r["vr"][0]["iterations"]), ci_s(r["v_final"]), ci_s(r["b_final"]),
                    diff_s(r["d"]["iters"]), diff_s(r["d"]["steps"])])
    head = ["V-GRPO recipe", "lr (both)", "seeds", "iterations each",
            "V-GRPO's final held-out reward", "DiffusionNFT's final held-out reward",
            "difference at the same iterations", "difference at the same gradient steps"]
    text = ("V-GRPO's final held-out reward minus DiffusionNFT's, both at the same lr and seeds, "
            "at every lr where both ended above the base model. The differences are taken at the "
            "largest spend both reached, in iterations and in gradient steps; the intervals are "
            "paired.")
    for v in (VGEN, "V-GRPO"):
        ds = [r["d"]["iters"] for r in rows if r["v"] == v]
        n = {w: sum(1 for d in ds if k(d)) for w, k in (
            ("ahead", lambda d: d[1] > 0), ("level", lambda d: d[1] <= 0 <= d[2]),
            ("behind", lambda d: d[2] < 0))}
        if ds:
            text += (f" {name(v)}, at the same iterations: ahead in {n['ahead']}, level in "
                     f"{n['level']} and behind in {n['behind']} of {len(ds)} comparisons.")
    return text + "\n\n" + table(head, out)


def lr_text(R: dict) -> str:
    plan, ch, base = R["plan"], R["chosen"], R["base"]["val"]
    rows = []
    for m in plan["methods"]:
        if m not in ch:
            continue
        got = {r["lr"]: r for r in ch[m]["rows"]}
        cell = lambda lr: "—" if lr not in got else (
            f"{got[lr]['val_reward']:.3f} / {got[lr]['val_diversity']:.3f}")
        rows.append([name(m)] + [f"**{cell(lr)}**" if lr == ch[m]["lr"] else cell(lr)
                                 for lr in plan["lrs"]] + [lr_s(ch[m]["lr"])])
    fb = [name(m) for m in plan["methods"] if ch.get(m, {}).get("fallback")]
    head = ["method"] + [f"lr {lr_s(lr)}" for lr in plan["lrs"]] + ["chosen lr"]
    floor = plan["diversity_keep"] * base["diversity"]
    text = (f"Each method's lr was chosen on the selection seeds "
            f"{seeds_s(plan['selection_seeds'])} from the final validation set "
            f"({10 * plan['n_val']} images of other phrasings and noises): the best validation "
            f"reward among the lrs that end above the base model's ({base['reward']:.3f}) and "
            f"keep at least {plan['diversity_keep']:.0%} of its validation diversity "
            f"(≥ {floor:.3f}); if none keeps it, the most diverse of them.")
    if plan.get("amendments"):
        text += (" The condition to end above the base model was added to the plan during the "
                 "selection runs, before any confirmation run (plan.json, amendments).")
    if fb:
        text += (f" For {' and '.join(fb)} no lr kept the diversity floor, so the most diverse "
                 "lr above the base model was chosen.")
    return text + " Cells: validation reward / validation diversity after " \
        f"{plan['iterations']} iterations, on {len(plan['selection_seeds'])} seeds.\n\n" + \
        table(head, rows)


def figure_caption(R: dict, F: dict | None) -> str:
    left = ", ".join(f"{name(m)} lr {lr_s(R['chosen'][m]['lr'])}" for m in R["plan"]["methods"]
                     if confirm(R, m))
    text = (f"Held-out reward against iterations: the mean over seeds, the band from the lowest "
            f"to the highest seed; dotted: the base model. Left, the B = "
            f"{R['plan']['iterations']} plan's confirmation seeds "
            f"{seeds_s(R['plan']['confirmation_seeds'])}: {left}.")
    if F:
        right = ", ".join(f"{name(m)} lr {lr_s(lr)} ({B} iterations)"
                          for m, lr, B in follow_groups(F))
        text += f" Right, the follow-up's seeds {seeds_s(F['plan']['confirmation_seeds'])}: " \
                f"{right}."
    return text


def follow_groups(F: dict) -> list[tuple]:
    return [(r["method"], r["lr"], r["iterations"]) for r in F["plan"]["runs"]
            if fixed(F, [r["method"], r["lr"], r["iterations"]])]


def inventory(parts: list[tuple]) -> str:
    """Every other committed run group: final held-out reward and accuracy."""
    rows = []
    for label, S, kinds in parts:
        if not S:
            continue
        groups = {}
        for r in S["results"].values():
            if r.get("kind") in kinds:
                groups.setdefault((kinds.index(r["kind"]), r["kind"], r["method"], r["lr"],
                                   r["iterations"]), []).append(r)
        for (_, kind, m, lr, B), rs in sorted(groups.items()):
            f = ST.final_stats(sorted(rs, key=lambda r: r["seed"]))
            rows.append([label, kind, name(m), lr_s(lr), str(B),
                         seeds_s([r["seed"] for r in rs]), ci_s(f["reward"]), ci_s(f["acc"])])
    head = ["folder", "runs", "method", "lr", "iterations", "seeds", "final held-out reward",
            "final prompt accuracy"]
    return table(head, rows)


def write_report(R: dict, F: dict | None, B32: dict | None, fig: str | None) -> str:
    R["chosen"] = ST.choose(R["results"], R["plan"], R["base"])
    plan = R["plan"]
    parts = [
        "# The digits benchmark: V-GRPO against DiffusionNFT and MixGRPO",
        "A small SD3 pipeline (a 2.28M-parameter transformer, committed in `model/`) pretrained "
        "on the 1,797 real handwritten digits that ship with scikit-learn; the reward is the "
        "probability a small classifier gives the prompted digit. Every run trains a LoRA on a "
        "CPU with 4 prompts × 8 images per iteration and 10 sampler steps. Every number is "
        f"measured on the same {10 * plan['n_heldout']} held-out images (phrasings and noises "
        "never used in training, the same for every run); intervals are 95 % bootstrap "
        "intervals that resample the seeds and the images, paired between methods.",
        "This report and `curves.png` are written from the committed runs alone, without "
        "training, by `python -m examples.digits report`.",
        f"## Each method at its chosen lr ({plan['iterations']} iterations)",
        main_table(R),
        "The seeds are the plan's confirmation seeds, which the lr choice never saw. "
        "Prompt accuracy: the share of images the classifier reads as the prompted digit. "
        "Diversity: the mean distance between images of the same digit in the classifier's "
        "features, relative to real handwriting (1.00 = as varied as real handwriting; lower "
        "= the samples of a digit look more alike). The V-GRPO rows differ only in their "
        "recipe: `--preset geneval-stage`, this project's reading of the paper's GenEval "
        "stages for correctness rewards such as this one (N_MC 10, μ 2, ratio clip 1e-2, no soft "
        "clip; METHOD.md C6, C9); the shipped defaults are vgrpo.py's (N_MC 4, μ 1, soft clip 3).",
        "## The paper's claims",
        claims_text(R, F),
        "## V-GRPO against DiffusionNFT at the same lr",
        same_lr_text(same_lr_rows(R, F)),
        "## How each lr was chosen",
        lr_text(R),
    ]
    if fig:
        parts += ["## Held-out reward during training", f"![held-out reward curves]({fig})",
                  figure_caption(R, F)]
    parts += [
        "## The committed runs",
        "* `results/`: the B = 128 plan (`plan.json`, fixed before its runs): selection, "
        "confirmation, baseline variants, knob swaps and N_MC runs, and a timing run. "
        "`python -m examples.digits benchmark` runs it (with `--out DIR`, afresh).",
        "* `results_followup/`: the follow-up on fresh seeds, its plan and rules in "
        "[plan.md](results_followup/plan.md), written before its runs. "
        "`python -m examples.digits benchmark --plan followup --workers 1 --threads 1`.",
        "* `results_b32/`: an earlier plan at B = 32 that also ran Flow-GRPO, on an earlier "
        "build of the model (not committed), with the lrs chosen and reported on the same "
        "seeds; the code that ran it is in the repository's history.",
        "Every other committed run group, by its final held-out evaluation:",
        inventory([("results", R, ["variant", "swap", "nmc"]),
                   ("results_b32", B32, ["sweep", "ablation", "long"])]),
    ]
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------
# The figure.
# ------------------------------------------------------------------------------------------------
def figure(R: dict, F: dict | None, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    main = [(m, confirm(R, m), R["chosen"][m]["lr"]) for m in R["plan"]["methods"]
            if confirm(R, m)]
    panels = [(f"B = {R['plan']['iterations']} plan, confirmation seeds "
               f"{seeds_s(R['plan']['confirmation_seeds'])}, each method at its chosen lr", main)]
    if F:
        fu = [(m, fixed(F, [m, lr, B]), lr) for m, lr, B in follow_groups(F)]
        panels.append((f"follow-up, fresh seeds {seeds_s(F['plan']['confirmation_seeds'])}", fu))
    fig, axs = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    base = R["base"]["heldout"]["reward"]
    for ax, (title, groups) in zip(axs[0], panels):
        seen = set()
        for m, rs, lr in groups:
            its, X = ST.curves(rs)
            y = X.mean(-1)                                           # (S, E) per seed
            col = COLORS.get(m, "gray") if m not in seen else "tab:olive"
            seen.add(m)
            ax.plot(its, y.mean(0), color=col, marker="o", ms=3,
                    label=f"{name(m)}, lr {lr_s(lr)}")
            ax.fill_between(its, y.min(0), y.max(0), color=col, alpha=0.15)
        ax.axhline(base, color="black", ls=":", lw=0.8, label="base model")
        ax.set_xlabel("iterations")
        ax.set_ylabel("held-out reward")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(out: Path = HERE, results: Path | None = HERE / "results",
           followup: Path | None = HERE / "results_followup",
           b32: Path | None = HERE / "results_b32", with_figure: bool = True) -> str:
    """Write report.md (and curves.png) into `out`; returns the markdown."""
    R = load(results)
    if R is None:
        raise ValueError(f"{results} holds no benchmark (no plan.json)")
    F, B32 = load(followup), load(b32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = write_report(R, F, B32, "curves.png")
    if with_figure:
        figure(R, F, out / "curves.png")
    (out / "report.md").write_text(md)
    return md


def add_command(sub) -> None:
    r = sub.add_parser("report", help="report.md and curves.png from the committed runs")
    r.add_argument("--out", default=str(HERE), help="folder for report.md and curves.png")
    r.add_argument("--results", default=str(HERE / "results"))
    r.add_argument("--followup", default=str(HERE / "results_followup"), help="or none")
    r.add_argument("--b32", default=str(HERE / "results_b32"), help="or none")


def run_command(a) -> None:
    opt = lambda p: None if p == "none" else Path(p)
    report(Path(a.out), Path(a.results), opt(a.followup), opt(a.b32))
    print(f"wrote {Path(a.out) / 'report.md'} and {Path(a.out) / 'curves.png'}")
