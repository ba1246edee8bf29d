"""MFU of the stored GPU rows (results/gpu/gpu_check_h200*.json) recomputed from their stored times
and settings with gpu_check.py's FLOP count, which counts only the passes that ran. Nothing is
re-measured: the seconds are the stored ones, only the FLOP count changes.

    python examples/gpu/mfu_restate.py             # one markdown table per file
    python examples/gpu/mfu_restate.py > results/gpu/mfu_restated.md           # the stored copy

Per sample, with fwd the stored FLOPs of one forward (fwd_TFLOP_per_sample):
    rollout FLOPs = N·fwd·K,  update FLOPs = N·fwd·(nfe_old + 3·J),  J = N_MC = 4
    rollout MFU = rollout FLOPs / time_rollout / peak
    update MFU  = update FLOPs / (time_old + time_update) / peak
    MFU         = (rollout + update FLOPs) / time_iter / peak,  peak = 989 TFLOP/s
nfe_old, the θ_old forwards per sample that ran, is not stored in these rows; it follows from the
code each file was measured on (OLD_PASS below) and is checked against the stored time_old (a pass
that ran takes seconds, one that did not takes ~0.1 ms). The stored MFU counted K + J + 3·J
forwards per sample in every row; the flow stage's rows counted the update only (the rollout was
left out) and are recomputed by adding the rollout: fwd·N·nfe_rollout.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import BF16_PEAK_TFLOPS, mfu_fields  # noqa: E402  the same count as the script

J = 4                   # N_MC: the default in every stored row
K_DEFAULT = {"sd3": 40, "flux": 16}   # rows without a stored K ran at the model's default
# θ_old's no-grad pass per sample, by file. Before the pass was folded into the first optimizer
# step (METHOD.md C18) it ran over every sample (J forwards), at μ = 1 too; after it, it runs
# N_MC·(μ − 1)/μ forwards, 0 at the μ = 1 of these SD3.5-M rows.
OLD_PASS = {
    "gpu_check_h200.json": J,                  # commit 8e08538, before C18
    "gpu_check_h200_rb48.json": J,             # commit 8e08538, before C18
    "gpu_check_h200_flux.json": J,             # commit b0f8c0a, before C18 (μ = 4)
    "gpu_check_h200_flux_g4.json": J,          # commit b0f8c0a, before C18 (μ = 4)
    "gpu_check_h200_levers_memory.json": 0,    # commit e5a64bb, after C18, μ = 1
    "gpu_check_h200_levers_flow.json": 0,      # commit 3f3da04, after C18, μ = 1
}


def restate_row(row: dict, nfe_old: float, peak: float = BF16_PEAK_TFLOPS) -> dict:
    """One stored V-GRPO row: its stored MFU beside the recomputed ones."""
    fwd = row["fwd_TFLOP_per_sample"] * 1e12
    family = "flux" if fwd > 1e13 else "sd3"
    K = row.get("K", K_DEFAULT[family])
    P, G = (int(v) for v in row["P×G"].split("×"))
    ran = row["time_old"] > 0.01 * row["time_update"]
    if ran != (nfe_old > 0):
        raise ValueError(f"{row['config']}: time_old {row['time_old']:.3g} s disagrees with "
                         f"nfe_old {nfe_old}")
    m = {"nfe_rollout": K, "nfe_old": nfe_old, "nfe_theta": J,
         **{k: row[k] for k in ("time_rollout", "time_old", "time_update")}}
    new = mfu_fields(fwd, P * G, m, row["time_iter"], peak)
    old_count = K + J + 3 * J                     # what the stored MFU counted
    stored_check = 100 * P * G * fwd * old_count / row["time_iter"] / (peak * 1e12)
    assert abs(stored_check - row["MFU_%"]) < 1e-6 * max(1.0, row["MFU_%"]), row["config"]
    return {"config": row["config"], "P×G": row["P×G"], "K": K, "nfe_old": nfe_old,
            "time_iter": row["time_iter"], "stored_MFU_%": row["MFU_%"],
            "rollout_MFU_%": new["rollout_MFU_%"], "update_MFU_%": new["update_MFU_%"],
            "MFU_%": new["MFU_%"]}


def restate_flow_row(row: dict, fwd: float, peak: float = BF16_PEAK_TFLOPS) -> dict:
    """One stored flow-stage row: the stored count was fwd·(N·nfe_old + n_tr·(3·nfe_theta +
    nfe_ref)), the rollout missing; n_tr (trained samples, not stored) follows from it."""
    N, peak_f = row["images_per_iter"], peak * 1e12
    stored = row["MFU_%"] / 100 * peak_f * row["time_iter"]
    per_trained = 3 * row["nfe_theta"] + row["nfe_ref"]
    n_tr = (stored / fwd - N * row["nfe_pi_old"]) / per_trained
    if abs(n_tr - round(n_tr)) > 1e-6:
        raise ValueError(f"{row['config']}: trained samples {n_tr} not a whole number")
    roll = fwd * N * row["nfe_rollout"]
    upd = fwd * (N * row["nfe_pi_old"] + round(n_tr) * per_trained)
    upd_s = row["time_old"] + row["time_update"] if "time_old" in row else row["time_update"]
    return {"config": row["config"], "P×G": f"1×{N}", "K": row["nfe_rollout"],
            "nfe_old": row["nfe_pi_old"], "time_iter": row["time_iter"],
            "stored_MFU_%": row["MFU_%"], "rollout_MFU_%": 100 * roll / row["time_rollout"] / peak_f,
            "update_MFU_%": 100 * upd / upd_s / peak_f,
            "MFU_%": 100 * (roll + upd) / row["time_iter"] / peak_f}


def restate_file(path: Path) -> list:
    """(section, restated row) for every measured row of one stored file."""
    data = json.loads(path.read_text())
    sections = {"configs": data} if isinstance(data, list) else {
        k: v for k, v in data.items() if k not in ("info", "warmup")}
    out, fwd = [], None
    for sec, rows in sections.items():
        for r in rows:
            if "time_iter" not in r:
                continue                              # skipped or failed
            if sec == "flow":
                continue                              # below, with the levers' fwd
            out.append((sec, restate_row(r, OLD_PASS[path.name])))
            fwd = fwd or r["fwd_TFLOP_per_sample"] * 1e12
    for r in sections.get("flow", []):
        if "time_iter" in r:
            assert data["info"]["flow"]["resolution"] == 512 and fwd is not None
            out.append(("flow", restate_flow_row(r, fwd)))
    return out


def main(argv=None) -> list:
    files = [Path(p) for p in (argv if argv else sorted(
        str(p) for p in (ROOT / "results" / "gpu").glob("gpu_check_h200*.json")))]
    cols = ["config", "P×G", "K", "nfe_old", "time_iter", "stored_MFU_%", "rollout_MFU_%",
            "update_MFU_%", "MFU_%"]
    everything = []
    print("# MFU of the stored GPU rows, recomputed\n\n`python examples/gpu/mfu_restate.py`: the "
          "stored times and settings, only the passes that ran counted (the formula in the "
          "script's docstring); nothing re-measured. stored_MFU_% is the stored count's "
          "(K + J + 3·J forwards per sample; the flow rows without the rollout). Percent of "
          f"{BF16_PEAK_TFLOPS:g} TFLOP/s.\n")
    for f in files:
        rows = restate_file(f)
        everything += [(f.name, s, r) for s, r in rows]
        print(f"## {f.name}\n\n| section | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 1))
        for sec, r in rows:
            cells = [f"{r[c]:.2f}" if c.endswith(("_%", "time_iter")) else f"{r[c]:g}"
                     if isinstance(r[c], (int, float)) else str(r[c]) for c in cols]
            print(f"| {sec} | " + " | ".join(cells) + " |")
        print()
    return everything


if __name__ == "__main__":
    main(sys.argv[1:])
