"""The V-GRPO paper's SD3.5-Medium curriculum: five training runs in a row, each starting from the
final weights of the one before (paper P11, which follows DiffusionNFT's five-stage curriculum).

    python examples/sd35_curriculum.py --model sd3.5-medium --dry_run    # print the five commands
    python examples/sd35_curriculum.py --model sd3.5-medium              # one GPU, in this process
    python examples/sd35_curriculum.py --model sd3.5-medium --launcher 'torchrun --nproc_per_node=8'
    python examples/sd35_curriculum.py --model tiny --stage_iterations 2,2,2,2,2 \\
        --stage_rewards 'jpeg;my_geneval:score;jpeg;my_geneval:score;my_ocr:score' -- --device cpu

| stage | reward                                | iterations | --preset      | prompts              |
|-------|---------------------------------------|------------|---------------|----------------------|
| 1     | HPSv2.1 + PickScore + CLIPScore       | 150        | paper         | --preference_prompts |
| 2     | GenEval (examples/rewards/geneval.py) | 200        | geneval-stage | prompts/geneval_*    |
| 3     | HPSv2.1 + PickScore + CLIPScore       | 150        | paper         | --preference_prompts |
| 4     | GenEval                               | 50         | geneval-stage | prompts/geneval_*    |
| 5     | OCR (examples/rewards/ocr.py)         | 30         | ocr-stage     | prompts/ocr_*        |

The preference reward is `hpsv2:1,pickscore:1,clipscore:1` (README's Stage-1 command): equal
weights on the training-scaled rewards, summed, then group-normalised (METHOD.md P11, C3). `paper`
gives Stage 1's 48 prompts × 24 images; the stage presets add the controls of METHOD.md C6 and C9
(docs/training.md "Presets"). The prompt files are examples/prompts/make_prompts.py's
(--prompt_dir); the paper's preference prompts (Pick-a-Pic) are not shipped, so stages 1 and 3 use
vgrpo's default prompts unless --preference_prompts is given. Stage k runs in
RUN_ROOT/stage<k>-<kind> through examples/cluster.py (vgrpo.py with requeue and preemption) as

    python examples/cluster.py --model M --reward R --preset P --iterations N
        --run_dir RUN_ROOT/stage<k>-<kind> --resume auto --init <stage k-1's final checkpoint>
        [--prompts F --eval_prompts E] [flags after --]

With `--resume auto` one command both starts and continues a stage: with a checkpoint in the
stage's folder it resumes it (and ignores --init); without one it starts afresh, also in a
folder a killed start left behind. A stage is finished when its folder's latest checkpoint has done
the stage's iterations (vgrpo saves one after the last iteration); finished stages are skipped.
So after any interruption (Ctrl-C, SIGTERM, a crash, a kill) the same command continues where it
stopped. Before anything runs, every stage's command is checked by vgrpo's own parser and
configuration pass, its prompt files must exist, and a stage already started must have started
from the final checkpoint of the stage before it; otherwise one line names the folder to remove.

By default the stages run in this process (cluster.main): its signal handling applies unchanged
(first Ctrl-C: finish the iteration, save, exit 130; SIGTERM: save and exit 75, passed on for a
requeue). With --launcher each stage is a new process, `LAUNCHER examples/cluster.py ...`: a
terminal's Ctrl-C reaches it directly, SIGTERM sent to this script is passed on, and the exit status is the
launcher's. Multi-GPU needs --launcher: this script refuses to run under torchrun itself, because
vgrpo ends each run by destroying its process group, and a second one made in the same job can
connect to the first one's stale addresses (seen here with gloo at stage 3).

Flags after `--` go to every stage (e.g. `-- --device cpu --prompts_per_iter 6`); the flags this
script sets per stage (--model, --reward, --preset, --iterations, --run_dir, --resume, --init,
--prompts, --eval_prompts) are refused there: use --stage_iterations, --stage_rewards, the prompt
flags and --run_root.
"""
import argparse
import contextlib
import ctypes
import dataclasses
import gc
import io
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent           # the repository: vgrpo.py
sys.path.insert(0, str(ROOT))
import torch                                             # noqa: E402
import vgrpo as V                                        # noqa: E402
from examples import cluster                             # noqa: E402

PREFERENCE = "hpsv2:1,pickscore:1,clipscore:1"


@dataclass
class Stage:
    kind: str            # preference, geneval or ocr: the folder name and the default prompts
    reward: str          # --reward
    preset: str          # --preset
    iterations: int      # --iterations


STAGES = [Stage("preference", PREFERENCE, "paper", 150),             # [paper P11] Stage 1
          Stage("geneval", "geneval", "geneval-stage", 200),         # Stage 2
          Stage("preference", PREFERENCE, "paper", 150),             # Stage 3
          Stage("geneval", "geneval", "geneval-stage", 50),          # Stage 4
          Stage("ocr", "ocr", "ocr-stage", 30)]                      # Stage 5: 580 in all
SET_HERE = ("model", "reward", "preset", "iterations", "run_dir", "resume", "init", "prompts",
            "eval_prompts")


class CurriculumError(Exception):
    """Bad input or a run folder that does not fit: one line, exit status 2."""


def parse(argv: Optional[list]) -> tuple[argparse.Namespace, list]:
    """(this script's flags, the flags after `--` for every stage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description="The SD3.5-M five-stage V-GRPO curriculum "
                                "(flags after -- go to every vgrpo.py stage).")
    p.error = lambda message: p.exit(2, f"error: {message} (--help lists every flag)\n")
    p.add_argument("--model", default="sd3.5-medium", help="vgrpo --model of every stage")
    p.add_argument("--run_root", help="folder of the five stage folders "
                   "(default runs/curriculum-<model>); the same value continues a stopped run")
    p.add_argument("--stage_iterations", help="five iteration counts, e.g. 2,2,2,2,2 "
                   "(default 150,200,150,50,30)")
    p.add_argument("--stage_rewards", help="';'-separated --reward of each stage (five, empty = "
                   "the stage's own), or one for all, e.g. 'jpeg;;jpeg;;'")
    p.add_argument("--preference_prompts", help="training prompts of stages 1 and 3 (the paper: "
                   "Pick-a-Pic; default vgrpo's examples/prompts.txt)")
    p.add_argument("--preference_eval_prompts", help="held-out prompts of stages 1 and 3")
    p.add_argument("--prompt_dir", default=str(Path(__file__).resolve().parent / "prompts"),
                   help="folder of geneval_{train,eval}.jsonl and ocr_{train,eval}.jsonl "
                   "(examples/prompts/make_prompts.py)")
    p.add_argument("--launcher", help="run each stage as `LAUNCHER vgrpo.py ...` in a new process, "
                   "e.g. 'torchrun --nproc_per_node=8' (default: in this process)")
    p.add_argument("--dry_run", action="store_true", help="print each stage's state and command")
    return p.parse_args(own), extra


def plan(args: argparse.Namespace, extra: list) -> list[Stage]:
    """The five stages with the overrides applied. Raises CurriculumError."""
    stages = [Stage(**vars(s)) for s in STAGES]
    if args.stage_iterations:
        items = args.stage_iterations.split(",")
        if len(items) != 5 or not all(i.strip().isdigit() and int(i) >= 1 for i in items):
            raise CurriculumError(f"--stage_iterations {args.stage_iterations!r}: give five "
                                  "whole numbers ≥ 1, e.g. 150,200,150,50,30")
        for s, n in zip(stages, items):
            s.iterations = int(n)
    if args.stage_rewards is not None:
        items = args.stage_rewards.split(";")
        if len(items) not in (1, 5):
            raise CurriculumError(f"--stage_rewards {args.stage_rewards!r}: give one reward for "
                                  f"every stage or five separated by ';' (got {len(items)})")
        for s, r in zip(stages, items * 5 if len(items) == 1 else items):
            s.reward = r.strip() or s.reward
    fields = {f.name for f in dataclasses.fields(V.Args)}
    for flag in extra:
        name = flag.split("=")[0].removeprefix("--")     # argparse also takes a prefix: --iter
        if flag.startswith("--") and name and (name in SET_HERE or name not in fields
                                      and any(n.startswith(name) for n in SET_HERE)):
            name = next(n for n in SET_HERE if n.startswith(name))
            raise CurriculumError(f"--{name} after '--': this script sets it for each stage; use "
                                  + {"model": "--model", "run_dir": "--run_root",
                                     "iterations": "--stage_iterations",
                                     "reward": "--stage_rewards"}.get(name, "its own flags")
                                  + " (--help)")
    return stages


def stage_dir(root: Path, k: int, s: Stage) -> Path:
    return root / f"stage{k}-{s.kind}"


def final_checkpoint(d: Path, iterations: int) -> Optional[Path]:
    """d's latest checkpoint if it has done `iterations` (the stage is finished), else None."""
    if not (d / "checkpoints" / "latest").is_file():
        return None
    ckpt, state = V.read_checkpoint(str(d))            # ConfigError: an unreadable checkpoint
    return ckpt if state["iteration"] >= iterations else None


def prompt_flags(args: argparse.Namespace, s: Stage) -> list:
    if s.kind == "preference":
        files = [("--prompts", args.preference_prompts), ("--eval_prompts",
                                                          args.preference_eval_prompts)]
    else:
        files = [("--prompts", Path(args.prompt_dir, f"{s.kind}_train.jsonl")),
                 ("--eval_prompts", Path(args.prompt_dir, f"{s.kind}_eval.jsonl"))]
    out = []
    for flag, f in files:
        if f is not None and not Path(f).is_file():
            raise CurriculumError(f"{flag} of the {s.kind} stages: {str(f)!r} does not exist"
                                  + (" (make it with examples/prompts/make_prompts.py)"
                                     if s.kind != "preference" else ""))
        out += [flag, str(f)] if f is not None else []
    return out


def commands(args: argparse.Namespace, stages: list, extra: list, root: Path) -> list:
    """[(stage folder, vgrpo argv, state)] of every stage; state: 'done', 'resume' or 'start'.
    Each argv is checked by vgrpo's own parser and configuration pass. Raises CurriculumError."""
    out, prev_final = [], None
    for k, s in enumerate(stages, 1):
        d = stage_dir(root, k, s)
        argv = ["--model", args.model, "--reward", s.reward, "--preset", s.preset,
                "--iterations", str(s.iterations), "--run_dir", str(d), "--resume", "auto"]
        if k > 1:
            argv += ["--init", str(prev_final)]
        argv += prompt_flags(args, s) + extra
        said = io.StringIO()                             # vgrpo's own line, said once below
        try:
            with contextlib.redirect_stderr(said):
                V.resolve_args(V.given_flags(argv))
        except SystemExit:
            raise CurriculumError(f"stage {k}'s vgrpo flags: "
                                  f"{said.getvalue().strip().removeprefix('error: ')}") from None
        except V.ConfigError as e:
            raise CurriculumError(f"stage {k} ({s.kind}): {e}") from None
        final = final_checkpoint(d, s.iterations)
        started = (d / "checkpoints" / "latest").is_file()
        if started and k > 1 and out[-1][2] != "done":
            raise CurriculumError(f"stage {k} ({d}) has started but stage {k - 1} has not "
                                  f"finished: remove {d} to run stage {k} again once it has")
        if started and k > 1:
            init = V.read_checkpoint(str(d))[1]["config"].get("init")
            if not init or not Path(init).exists() or \
                    V.find_checkpoint(init, "--init").resolve() != Path(prev_final).resolve():
                raise CurriculumError(f"stage {k} ({d}) was started from {init}, not from stage "
                                      f"{k - 1}'s final checkpoint {prev_final}: remove {d} to "
                                      "run it again from there")
        out.append((d, argv, "done" if final else "resume" if started else "start"))
        prev_final = final or d / "checkpoints" / f"iter_{s.iterations:06d}"   # where it will be
    return out


def launch(launcher: str, argv: list) -> int:
    """Run one stage as `LAUNCHER examples/cluster.py ARGV` and return its exit status. A terminal's Ctrl-C
    reaches the launched processes directly (one process group), so it is ignored here; SIGTERM
    sent to this process is passed on; the child gets SIGTERM if this process dies (Linux)."""
    def die_with_parent():                               # no orphan writing into the stage folder
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    script = str(ROOT / "examples" / "cluster.py")
    child = subprocess.Popen(shlex.split(launcher) + [script] + argv,
                             preexec_fn=die_with_parent if sys.platform == "linux" else None)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: child.terminate())}
    try:
        while True:        # wait in slices: a signal that lands in another thread (torch's)
            try:           # runs its handler only once this thread runs Python again
                return child.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Optional[list] = None) -> int:
    args, extra = parse(argv)
    root = Path(args.run_root or f"runs/curriculum-{Path(args.model).name}")
    try:
        if cluster.dist_info()[1] > 1:  # cluster.py would re-create its process group per
            raise CurriculumError(      # stage in one torchrun job, which torch does not support
                "run this script as one process and let it start each stage under torchrun: "
                "--launcher 'torchrun --nproc_per_node=N'")
        stages = plan(args, extra)
        todo = commands(args, stages, extra, root)
    except (CurriculumError, V.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    script = str(ROOT / "examples" / "cluster.py")
    prefix = shlex.join([*shlex.split(args.launcher or "python"), script])
    for k, ((d, cmd, state), s) in enumerate(zip(todo, stages), 1):
        what = {"done": "finished, skipped",
                "resume": "started: resumes from its latest checkpoint",
                "start": "starts" + (f" from stage {k - 1}'s final weights" if k > 1 else "")}
        print(f"== stage {k}/5: {s.kind}, {s.iterations} iterations, {d}: {what[state]}",
              flush=True)
        if args.dry_run:
            print(f"{prefix} {shlex.join(cmd)}")
            continue
        if state == "done":
            continue
        try:
            if args.launcher:
                status = launch(args.launcher, cmd)
            else:
                status = cluster.main(cmd)
                gc.collect()                             # the stage's model and optimizer
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            finished = final_checkpoint(d, s.iterations) is not None
        except KeyboardInterrupt:                        # between stages: nothing half-written
            status, finished = 130, False
        except V.ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not finished:
            print(f"curriculum stopped in stage {k} ({d}); run the same command to continue",
                  file=sys.stderr)
            return 128 - status if status < 0 else status or 130   # unfinished is never 0
    if not args.dry_run:
        print(f"curriculum finished: final weights in {todo[-1][0]}/checkpoints/latest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
