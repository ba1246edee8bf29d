"""Curves of a vgrpo run from its metrics.jsonl, as one PNG: no server, no account.

    python examples/tools/plot_metrics.py runs/sd3.5-medium-pickscore-20261202-101500   # → its metrics.png
    python examples/tools/plot_metrics.py RUN_DIR --out curves.png

It reads the file a run appends to after every iteration, so it works while the run goes on, after
it ends, and after a crash. Four panels: the training reward and the held-out evaluations; |log ρ|
and the clip fraction; the surrogate CV (batch and group); seconds per phase of an iteration.
For live curves in TensorBoard: examples/tools/tensorboard_curves.py RUN_DIR --follow.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    """The lines of run_dir/metrics.jsonl, in order, each a dict; a line cut short by a kill is
    skipped. ValueError if there is no such file."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl: pass a vgrpo run folder")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def plot_metrics(run_dir: Path, out: Path | None = None) -> Path:
    """run_dir/metrics.jsonl → out (default run_dir/metrics.png), written atomically. ValueError if
    the file holds no iteration yet."""
    from matplotlib.figure import Figure                   # matplotlib's object API: no GUI
    path, out = run_dir / "metrics.jsonl", out or run_dir / "metrics.png"
    rows = read_metrics(run_dir)
    its, evs = [m for m in rows if "reward_mean" in m], [m for m in rows if "eval_reward_mean" in m]
    if not its:
        raise ValueError(f"{str(path)!r} holds no iteration yet")
    panels = {"reward": [("reward_mean", its, "training"), ("eval_reward_mean", evs, "held-out")],
              "|log ρ| and clip fraction": [("abs_log_ratio", its, "|log ρ|"),
                                            ("clip_frac", its, "clip fraction")],
              "surrogate CV": [("surrogate_cv", its, "batch"), ("surrogate_cv_group", its, "group")],
              "seconds per phase": [(f"time_{k}", its, k)
                                    for k in ("rollout", "reward", "old", "update")]}
    fig = Figure(figsize=(11, 7), layout="constrained")
    for ax, (title, series) in zip(fig.subplots(2, 2).flatten(), panels.items()):
        for key, ms, label in series:
            ax.plot([m["iter"] for m in ms], [m.get(key, math.nan) for m in ms], label=label,
                    marker="o" if ms is evs else None)
        ax.set(title=title, xlabel="iteration")
        ax.legend(fontsize=8)
    fig.axes[0].set_ylabel(its[-1]["reward_unit"])
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=90)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a vgrpo run folder (holds metrics.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="the PNG (default RUN_DIR/metrics.png)")
    a = p.parse_args(argv)
    try:
        print(plot_metrics(a.run_dir, a.out))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
