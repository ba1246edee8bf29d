"""The command-line front that examples/baselines/flow_grpo_sd3.py, diffusion_nft_sd3.py and
mix_grpo_sd3.py share: the run-level flags each adds to its own parser, the vgrpo.Args built from
them and from every flag the script does not know (passed through to vgrpo's parser, same names
there), and `parse`, which each script's parse() calls: one return shape, (options with .rec,
vgrpo.Args)."""
from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import vgrpo as V


class Stream(enum.IntEnum):
    """The baselines' own random streams: vgrpo.generator(seed, it, stream) with values that
    vgrpo.Stream leaves to the examples, so no baseline draw repeats one of vgrpo.py's."""
    TIMES = 4              # diffusion_nft_sd3.py: its training times t
    STEP_NOISE = 5         # the SDE steps' noise (Flow-GRPO, MixGRPO), DiffusionNFT's ε
    SDE_WINDOW = 6         # flow_grpo_sd3.py: where the nocfg recipe's SDE window sits


# distinct by construction (vgrpo.stream_seed): a per-iteration stream (< 16) seeds at
# (seed·1_000_003 + it)·16 + stream, a once-per-run one (≥ 16) at −stream; these are
# per-iteration values that none of vgrpo.Stream's takes
assert all(s < 16 for s in Stream) and not {int(s) for s in Stream} & {int(s) for s in V.Stream}

# The flags a baseline script passes to vgrpo's parser when given (None: vgrpo's per-model preset)
PASSED = ("prompts", "eval_prompts", "prompts_per_iter", "group_size", "lr")


def add_run_flags(p, *, dtype_help: str, iterations_help: str, out_default: str) -> None:
    """The flags every baseline script has: model, reward, prompts, P, G, iterations, seed,
    device, dtype, lr and the output folder."""
    a = p.add_argument
    a("--model", default="tiny",
      help="vgrpo alias (tiny, sd3.5-medium, ...), hub id or local diffusers folder")
    a("--reward", default="jpeg",
      help="as vgrpo.py: pickscore | jpeg | ... | module.path:function; weights a:1,b:1")
    a("--prompts", default=None,
      help="training prompts file, one per line (default: examples/prompts.txt)")
    a("--eval_prompts", default=None,
      help="held-out prompts file (default: split off --prompts, as vgrpo)")
    a("--prompts_per_iter", type=int, default=None, help="P (default: vgrpo's per-model preset)")
    a("--group_size", type=int, default=None, help="G (default: vgrpo's per-model preset)")
    a("--iterations", type=int, default=5, help=iterations_help)
    a("--seed", type=int, default=0)
    a("--device", default="auto", help="cuda | cpu | auto")
    a("--dtype", default="auto", choices=("auto", "fp16", "bf16", "fp32"), help=dtype_help)
    a("--lr", type=float, default=None, help="AdamW lr (default: vgrpo's per-model preset)")
    a("--out", default=None, help=f"output folder (default {out_default})")


def vgrpo_args(mine, rest: list[str], cuda_dtype: str | None = None) -> V.Args:
    """vgrpo.Args from the script's run-level options `mine` and the flags it did not parse.
    --dtype auto leaves vgrpo's choice, except on CUDA where `cuda_dtype` is given (DiffusionNFT's
    fp16, config/base.py)."""
    given = ["--model", mine.model, "--reward", mine.reward, "--seed", str(mine.seed),
             "--device", mine.device]
    for k in PASSED:
        if getattr(mine, k) is not None:
            given += [f"--{k}", str(getattr(mine, k))]
    cuda = mine.device.startswith("cuda") or (mine.device == "auto" and torch.cuda.is_available())
    if mine.dtype != "auto":
        given += ["--dtype", mine.dtype]
    elif cuda_dtype is not None and cuda:
        given += ["--dtype", cuda_dtype]
    return V.parse_args(given + rest)


def parse(parser, recipe: Callable, argv=None, cuda_dtype: str | None = None):
    """argv → (the script's options, vgrpo.Args): the options hold .rec, the method's settings
    after the script's overrides, which recipe(options, args) returns (and may complete options,
    such as Flow-GRPO's --batch). A bad flag or value raises ValueError (vgrpo's ConfigError is
    one) in one line per problem; from the command line (argv None) it exits with that message."""
    try:
        mine, rest = parser.parse_known_args(argv)
        args = vgrpo_args(mine, rest, cuda_dtype)
        mine.rec = recipe(mine, args)
    except ValueError as e:
        if argv is None:
            sys.exit(f"error: {e}")
        raise
    return mine, args
