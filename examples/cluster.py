"""
examples/cluster.py — vgrpo.py for a job scheduler: the same flags, and what a job that can be
preempted and requeued needs. Run it exactly as vgrpo.py:

    python examples/cluster.py --model sd3.5-medium --run_dir runs/a --resume auto
    torchrun --nproc_per_node=8 examples/cluster.py --model sd3.5-medium --preset paper \
        --run_dir runs/a --resume auto

What it adds to `python vgrpo.py` (docs/training.md, "On a cluster"):
  * SIGTERM (a scheduler's preemption; under torchrun Ctrl-C too, which its agent forwards)
    saves within a fraction of an iteration and exits 75. An iteration that has not yet taken
    its first optimizer step is saved as not begun and redone on resume; one that has, finishes.
  * --resume auto: the same command, submitted again, starts the run or continues it.
  * One trainer per run folder: a second is refused in one line; the first goes on untouched.
  * Out of GPU memory, a reward that fails, a write that fails: one line that names the phase or
    the file and the command that continues, after saving what can still be saved.
  * A first Ctrl-C finishes the iteration, saves it and exits 130; a second stops at once.

It fills in the hooks of vgrpo.Run (poll, guard, go_on) and reads the phase that vgrpo.timed
puts on an out-of-memory error. Nothing of vgrpo.py's method changes.
"""
import contextlib
import os
import signal
import sys
from pathlib import Path


def _stopped_while_loading(signum, _frame):
    """Until Cluster's handlers: nothing is written yet, so a stop is one line and its status."""
    if signum == signal.SIGTERM:
        print("preempted: while loading, before the first iteration: nothing written; a "
              "requeued job starts with the same command", file=sys.stderr)
        os._exit(PREEMPTED)
    print("interrupted before the first iteration: nothing written", file=sys.stderr)
    os._exit(130)


PREEMPTED = 75                       # EX_TEMPFAIL: saved; the same command continues
if __name__ == "__main__":           # from before `import torch` (seconds)
    signal.signal(signal.SIGTERM, _stopped_while_loading)
    signal.signal(signal.SIGINT, _stopped_while_loading)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vgrpo as V  # noqa: E402

REWARD_GRACE = 10.0                  # s a running call may go on after SIGTERM (on_alarm)


class Preempted(V.RunError):
    """SIGTERM: raised on every process alike; main() prints where the run stands."""
    status, label = PREEMPTED, "preempted"


def main(argv=None) -> int:
    """vgrpo.main with this file's command: exit statuses as vgrpo.py's, and 75."""
    return V.main(argv, command=command)


def command(given: dict) -> list:
    """--resume auto: --run_dir's run if it has a checkpoint, else a new run in that folder."""
    auto = given.get("resume") == "auto"
    if auto and not given.get("run_dir"):
        raise V.ConfigError("--resume auto needs --run_dir: the folder to start or continue")
    if auto:
        latest = Path(given["run_dir"], "checkpoints", "latest").is_file()
        given["resume"] = given["run_dir"] if latest else None
    return V.start(given, trainer=train, fresh_ok=auto)


def train(args: V.Args, resumed=None, fresh_ok: bool = False) -> list:
    """vgrpo.train with the signals caught and the hooks filled in; the run folder is locked
    (vgrpo.hold_run_dir) from before anything loads to the end."""
    run_dir = V.plan_run_dir(args, fresh_ok)
    with V.hold_run_dir(run_dir):           # a second trainer is refused before it loads
        try:
            run = V.setup(args, resumed=resumed)
        except torch.cuda.OutOfMemoryError as e:
            raise V.RunError(f"out of GPU memory while loading ({str(e).splitlines()[0]}); try "
                             "--offload_text_encoders or fewer --reward models") from None
        with Cluster(run, run_dir):
            return V.run_iterations(run, run_dir)


def how_to_go_on(run_dir: Path, saved=None) -> str:
    """vgrpo.how_to_go_on, and before the first checkpoint the requeue command."""
    if saved is None and not (run_dir / "checkpoints" / "latest").is_file():
        return (f"no checkpoint yet; continue with --resume auto --run_dir {run_dir} in the "
                "same command (it starts over)")
    return V.how_to_go_on(run_dir, saved)


class Cluster:
    """The hooks of one run: signals in, a poll and a guard for the loop, the requeue hint."""

    def __init__(self, run: V.Run, run_dir: Path):
        self.run, self.run_dir = run, run_dir
        self.stop = []                      # signals received: "term" (preempt), "int" (Ctrl-C)
        self.stepped = False                # an optimizer step of this iteration has run
        self.cuttable = False               # inside an iteration: SIGTERM's alarm may stop it
        run.poll, run.guard, run.go_on = self.poll, self.guard, how_to_go_on  # + requeue

    def __enter__(self):
        # stepped, from the optimizer itself (a step skipped for a non-finite gradient is none)
        self.on_step = self.run.opt.register_step_pre_hook(
            lambda *_: setattr(self, "stepped", True))
        torchrun = "TORCHELASTIC_RUN_ID" in os.environ     # its agent forwards Ctrl-C, then kills
        on = {signal.SIGTERM: self.on_term, signal.SIGALRM: self.on_alarm,
              signal.SIGINT: self.on_term if torchrun else self.on_int}
        try:
            self.previous = {sig: signal.signal(sig, fn) for sig, fn in on.items()}
        except ValueError:                  # not the main thread: no handlers
            self.previous = {}
        return self

    def __exit__(self, *exc):
        self.on_step.remove()
        if self.previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if "term" in self.stop:             # on its way out with 75, never 143
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def on_term(self, *_):
        if "term" not in self.stop and self.run.rank == 0:
            V._warn("SIGTERM: saving at once (an iteration not yet stepped is redone on resume)")
        if "term" not in self.stop and self.run.world == 1:  # one process: no collective waits
            signal.setitimer(signal.ITIMER_REAL, REWARD_GRACE)
        self.stop.append("term")

    def on_alarm(self, *_):
        """REWARD_GRACE s after SIGTERM, inside an iteration not yet stepped: a call that is
        still running (a reward server's answer, an ODE solve between polls) is abandoned."""
        if self.cuttable and not self.stepped:
            self.cuttable = False
            raise Preempted("SIGTERM")

    def on_int(self, *_):
        if self.stop:
            raise KeyboardInterrupt
        self.stop.append("int")
        V._warn("Ctrl-C: finishing this iteration, then saving (Ctrl-C again: stop now)")

    def any_rank(self, flag: bool) -> bool:
        """True on every process if on any (a signal may reach only some)."""
        if self.run.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.run.dev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def poll(self) -> None:
        """vgrpo's poll: stop everywhere if a process got SIGTERM before this iteration stepped."""
        if not self.stepped and self.any_rank("term" in self.stop):
            raise Preempted("SIGTERM")

    @contextlib.contextmanager
    def guard(self, it: int):
        """Around iteration `it` and its record: a stop inside saves if no step has run (a lone
        process, or every process on SIGTERM) and ends in one line; after it, a signal saves."""
        self.stepped, self.cuttable = False, True
        try:
            yield
        except (Preempted, torch.cuda.OutOfMemoryError, V.RewardError) as e:
            self.cuttable = False           # the save below is never cut
            raise self.ended(e, it) from None
        finally:
            self.cuttable = False
        if it < self.run.args.iterations and self.any_rank(bool(self.stop)):   # after `it`
            saved = V.save_checkpoint(self.run, it + 1)
            if self.any_rank("term" in self.stop):
                raise self.preempted(f"after iteration {it}", saved)
            raise V.Interrupted(f"after iteration {it}: {how_to_go_on(self.run_dir, saved)}")

    def ended(self, e: Exception, it: int) -> V.RunError:
        """The one-line end of iteration `it` stopped by e, saved first where that is safe (a
        save is a collective that processes other than a preempted set would not join)."""
        saved = None
        if not self.stepped and (isinstance(e, Preempted) or self.run.world == 1):
            saved = V.save_checkpoint(self.run, it)
        if isinstance(e, Preempted):
            return self.preempted(f"at iteration {it}", saved)
        go_on = how_to_go_on(self.run_dir, saved)
        if isinstance(e, V.RewardError):
            err = V.RunError(f"{e}, in iteration {it}; {go_on}")
            err.status = V.RewardError.status
            return err
        return V.RunError(f"{V.out_of_memory(e, self.run.args)}, iteration {it}; {go_on}")

    def preempted(self, when: str, saved) -> Preempted:
        """Where the run stopped, and the command a requeued job runs."""
        return Preempted(f"{when}: {how_to_go_on(self.run_dir, saved)}; a requeued job continues "
                         f"with the same command and --resume auto --run_dir {self.run_dir}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # vgrpo.main's Ctrl-C from here
    V.exit_process(main())
