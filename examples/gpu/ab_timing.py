"""Seconds per iteration of vgrpo.py at another git revision against the working tree, as a
ratio measured within ONE process: both versions are set up on the same flags and run one
iteration each in turn, so both see the same machine load.

    python examples/gpu/ab_timing.py --before HEAD~1 --rounds 8 -- --model tiny --reward jpeg
    python examples/gpu/ab_timing.py --before HEAD~1 --digits --rounds 8     # the digits benchmark's
                                                                             # V-GRPO settings

Everything after `--` is vgrpo.py flags (both versions parse them). `--digits` uses the flags of
`python -m examples.digits benchmark`'s V-GRPO runs on its cached pretrained model (built if missing).
Prints each round, then the median seconds of each version and the median of the per-round
ratios after / before with a 95 % bootstrap interval over rounds. Round 0 (warm-up) is left out
of the statistics.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import vgrpo as V  # noqa: E402  (the working tree's)


def load_revision(rev: str):
    """vgrpo.py as it was at `rev`, imported as its own module (its examples/ is today's)."""
    d = Path(tempfile.mkdtemp(prefix="vgrpo_rev_"))
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:vgrpo.py"], check=True,
                         capture_output=True, text=True).stdout
    (d / "vgrpo.py").write_text(src)
    (d / "examples").symlink_to(ROOT / "examples")
    spec = importlib.util.spec_from_file_location("vgrpo_before", d / "vgrpo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vgrpo_before"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="git revision of the 'before' vgrpo.py")
    p.add_argument("--rounds", type=int, default=8, help="iterations of each version")
    p.add_argument("--digits", action="store_true", help="the digits benchmark's V-GRPO flags")
    a = p.parse_args(own)
    if a.digits:
        from examples.digits import model as DG
        folder = DG.build()
        flags = DG.vgrpo_flags(folder, 0, ["--lr", "3e-3"]) + flags
    versions = {"before": load_revision(a.before), "after": V}
    runs = {k: m.setup(m.parse_args(flags)) for k, m in versions.items()}
    secs = {k: [] for k in versions}
    for r in range(a.rounds + 1):
        for k, m in versions.items():
            t0 = time.perf_counter()
            m.iteration(runs[k], r)
            secs[k].append(time.perf_counter() - t0)
        print(f"round {r}: " + ", ".join(f"{k} {s[-1]:.3f} s" for k, s in secs.items()),
              flush=True)
    b, f = secs["before"][1:], secs["after"][1:]
    ratios = [y / x for x, y in zip(b, f)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    out = {"before_median_s": statistics.median(b), "after_median_s": statistics.median(f),
           "ratio_median": statistics.median(ratios), "ratio_ci": (boot[25], boot[974]),
           "rounds": len(ratios), "threads": V.torch.get_num_threads()}
    print(f"median s/iteration: before {out['before_median_s']:.3f}, after "
          f"{out['after_median_s']:.3f}; after / before {out['ratio_median']:.3f} "
          f"[{out['ratio_ci'][0]:.3f}, {out['ratio_ci'][1]:.3f}] over {len(ratios)} rounds, "
          f"{out['threads']} thread(s)")
    return out


if __name__ == "__main__":
    main()
