"""TensorBoard curves of a vgrpo run, from its metrics.jsonl: once, or live as the run goes.

    python examples/tools/tensorboard_curves.py runs/<run>             # → runs/<run>/tensorboard
    python examples/tools/tensorboard_curves.py runs/<run> --follow    # keeps it up to date; Ctrl-C stops
    tensorboard --logdir runs/

Every number of each metrics.jsonl line becomes a scalar at step = its "iter" (the rewards, |log ρ|,
the clip fraction, the surrogate CV, the gradient norm, seconds per phase: docs/training.md
"Logged metrics"), and each evaluation's grid, eval/iter_XXXXXX.png, the image "eval_grid". The
trainer needs no flag for it: it appends a line to metrics.jsonl after every iteration and every
evaluation, and this script reads the file as examples/tools/plot_metrics.py does (a line cut
short by a kill is skipped; it is read whole the next time).

A resumed run drops the lines logged after its checkpoint and logs them again. The curves follow
it: from the first line that changed, the steps are purged (SummaryWriter's purge_step, which
TensorBoard's reader honours) and written again, so every step appears once. A new start of this
script purges everything before it writes, so running it twice doubles nothing. W&B can sync
these event files with its TensorBoard integration.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_metrics import read_metrics  # noqa: E402  (examples/ is not a package)


class Curves:
    """RUN_DIR/tensorboard, brought up to date with RUN_DIR/metrics.jsonl by each update()."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.written, self.board = run_dir, [], None

    def update(self) -> int:
        """Write the lines not yet written (all of them on the first call); returns how many."""
        rows = read_metrics(self.run_dir)
        same = 0                                        # lines written and unchanged since
        while same < min(len(rows), len(self.written)) and rows[same] == self.written[same]:
            same += 1
        start = len(self.written)
        if self.board is None or same < len(self.written):
            # the first write (purge from step 0), or lines logged again by a resumed run: purge
            # from the first changed line's step, and write every line from that step on
            step = 0
            if self.board is not None:
                step = self.written[same]["iter"]
            start = next((i for i, m in enumerate(rows) if m["iter"] >= step), len(rows))
            self.reopen(step)
        for m in rows[start:]:
            self.draw(m)
        self.board.flush()
        self.written = rows
        return len(rows) - start

    def reopen(self, purge_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.close()
        self.board = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)

    def draw(self, m: dict) -> None:
        """One metrics line: its numbers as scalars; an evaluation's line also its grid."""
        step, grid = m["iter"], self.run_dir / "eval" / f"iter_{m['iter']:06d}.png"
        for k, v in m.items():
            if k != "iter" and isinstance(v, (int, float)):
                self.board.add_scalar(k, v, step)
        if "eval_reward_mean" in m and grid.is_file():
            import numpy as np
            from PIL import Image
            with Image.open(grid) as im:
                self.board.add_image("eval_grid", np.asarray(im.convert("RGB")), step,
                                     dataformats="HWC")

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def follow(curves: Curves, every: float) -> None:
    """update() every `every` seconds until Ctrl-C, waiting for metrics.jsonl if there is none yet
    (a run still loading its models). Ctrl-C is taken between two updates, never inside one: a
    KeyboardInterrupt raised inside TensorBoard's writer can leave its lock held, and closing the
    writer then waits forever."""
    stop = []
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        while not stop:
            if (curves.run_dir / "metrics.jsonl").is_file():
                curves.update()
            wake = time.monotonic() + every
            while not stop and time.monotonic() < wake:    # Ctrl-C answered within 0.1 s
                time.sleep(min(0.1, every))
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a vgrpo run folder (holds metrics.jsonl)")
    p.add_argument("--follow", action="store_true",
                   help="keep the curves up to date while the run goes on, until Ctrl-C")
    p.add_argument("--every", type=float, default=10.0,
                   help="seconds between two reads of metrics.jsonl with --follow [default 10]")
    a = p.parse_args(argv)
    try:
        with contextlib.closing(Curves(a.run_dir)) as curves:
            if a.follow:
                print(f"{a.run_dir / 'tensorboard'}: following {a.run_dir / 'metrics.jsonl'} "
                      "(Ctrl-C stops)")
                follow(curves, a.every)
            else:
                print(f"{a.run_dir / 'tensorboard'}: {curves.update()} metrics lines")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
