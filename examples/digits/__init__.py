"""The digits benchmark: V-GRPO on a small SD3 pipeline pretrained on real handwritten digits.

    model.py   the pretrained model (committed in model/), its data, the reward, the quickstart
    bench.py   the plans, each method's trainer, one JSON per run, the workers
    stats.py   the lr choice, bootstrap intervals, speed-ups and verdicts
    report.py  report.md and its figure, written from the committed runs alone

The commands: `python -m examples.digits --help`. The reward plug-in is `examples.digits:reward`.
"""


def reward(images, prompts):
    """The vgrpo reward plug-in `examples.digits:reward`: model.reward, imported on first use."""
    from .model import reward as score
    return score(images, prompts)
