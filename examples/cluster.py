"""
examples/cluster.py — vgrpo.py for a job scheduler and for several GPUs: the same flags, what a
job that can be preempted and requeued needs, and torchrun's processes. Run it as vgrpo.py:

    python examples/cluster.py --model sd3.5-medium --run_dir runs/a --resume auto
    torchrun --nproc_per_node=8 examples/cluster.py --model sd3.5-medium --preset paper \
        --run_dir runs/a --resume auto

What it adds to `python vgrpo.py` (docs/training.md, "On a cluster"):
  * SIGTERM (a scheduler's preemption; under torchrun Ctrl-C too, which its agent forwards)
    saves within a fraction of an iteration and exits 75. An iteration that has not yet taken
    its first optimizer step is saved as not begun and redone on resume; one that has, finishes.
  * --resume auto: the same command, submitted again, starts the run or continues it.
  * One trainer per run folder (vgrpo.py's lock), under torchrun held by rank 0 for all.
  * Out of GPU memory, a reward that fails, a write that fails: one line that names the phase or
    the file and the command that continues, after saving what can still be saved.
  * A first Ctrl-C finishes the iteration, saves it and exits 130; a second stops at once.
  * Under torchrun (WORLD_SIZE > 1; docs/scaling.md): FSDP2 over the transformer, every process
    holding whole groups, checkpoints gathered to rank 0 that any process count resumes.

It fills in the hooks of vgrpo.Run (poll, guard, go_on; under torchrun rank, world, gather,
broadcast, sync, whole, save, and setup's shard) and reads the phase that vgrpo.timed puts on an
out-of-memory error. Nothing of vgrpo.py's method changes.
"""
import contextlib
import datetime
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
    """vgrpo.train with the signals caught and the hooks filled in, in this process or in each of
    torchrun's; the run folder is locked (vgrpo.hold_run_dir) from before anything loads to the
    end."""
    procs = Torchrun(args) if dist_info()[1] > 1 else None  # checks the split, joins them
    try:
        run_dir = V.plan_run_dir(args, fresh_ok)
        lock = V.hold_run_dir               # a second trainer is refused before it loads
        if procs:
            run_dir = procs.same(run_dir)   # rank 0's folder (its time stamp) for all
            lock = lock if procs.rank == 0 else contextlib.nullcontext  # rank 0's, for all
        with lock(run_dir):
            try:
                run = V.setup(args, resumed=resumed, shard=procs.shard if procs else None)
            except torch.cuda.OutOfMemoryError as e:
                raise V.RunError(f"out of GPU memory while loading ({str(e).splitlines()[0]}); "
                                 "try --offload_text_encoders or fewer --reward models") from None
            if procs:
                procs.fill(run)
            with Cluster(run, run_dir):
                return V.run_iterations(run, run_dir)
    finally:
        if procs:
            torch.distributed.destroy_process_group()


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
            saved = self.run.save(self.run, it + 1)
            if self.any_rank("term" in self.stop):
                raise self.preempted(f"after iteration {it}", saved)
            raise V.Interrupted(f"after iteration {it}: {how_to_go_on(self.run_dir, saved)}")

    def ended(self, e: Exception, it: int) -> V.RunError:
        """The one-line end of iteration `it` stopped by e, saved first where that is safe (a
        save is a collective that processes other than a preempted set would not join)."""
        saved = None
        if not self.stepped and (isinstance(e, Preempted) or self.run.world == 1):
            saved = self.run.save(self.run, it)
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


# ---- torchrun: `torchrun --nproc_per_node=N examples/cluster.py ...` (docs/scaling.md) ----------
# WORLD_SIZE > 1 ⇒ torch.distributed and FSDP2. Every process draws the same prompts, noise and
# pairs and keeps its whole groups (vgrpo.Run.local); collectives wait 1 h, for rank 0's longest
# saves.
def dist_info() -> tuple[int, int, int]:  # (rank, world, local rank); (0, 1, 0) alone
    return tuple(int(os.getenv(k, v)) for k, v in dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0).items())


class Torchrun:
    """This process among torchrun's: the checks of the split, the process group, FSDP2 over the
    transformer (setup's `shard`) and vgrpo.Run's hooks for collectives and checkpoints."""

    def __init__(self, args: V.Args):
        self.rank, self.world, local_rank = dist_info()
        P, G, mu = args.prompts_per_iter, args.group_size, args.mu
        # each process holds whole groups, split into μ equal minibatches (one rule for any count)
        if P % self.world:
            raise V.ConfigError(f"--prompts_per_iter {P} must be divisible by the {self.world} "
                                "processes")
        if P // self.world * G % mu:
            raise V.ConfigError(f"each process's {P // self.world * G} samples must split into "
                                f"--mu {mu} equal minibatches")
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)   # this process's GPU: vgrpo's "cuda"
        dev = V.setup_device(args)[0]
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                                 timeout=datetime.timedelta(hours=1))

    def same(self, run_dir: Path) -> Path:
        """Rank 0's run folder on every process."""
        box = [str(run_dir)]
        torch.distributed.broadcast_object_list(box, src=0)
        return Path(box[0])

    @staticmethod
    def shard(tr, dtype: torch.dtype) -> None:
        """FSDP2: each block a unit, then the root; parameters gathered in bf16 / fp16, gradients
        reduced in fp32; inputs not cast (autocast casts op by op; bf16 would round SD3's
        1000·t)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                   cast_forward_inputs=False)
              if dtype != torch.float32 else MixedPrecisionPolicy())
        model_class = type(tr)
        for blk in V.transformer_blocks(tr):
            fully_shard(blk, mp_policy=mp)
        fully_shard(tr, mp_policy=mp)
        type(tr).__name__ = model_class.__name__  # FSDP<class>: the saved config names the model

    def fill(self, run: V.Run) -> None:
        """Run's hooks for these processes; the loss scaler skips a step everywhere (fp16)."""
        tr = run.adapter.transformer
        run.rank, run.world = self.rank, self.world
        run.gather, run.broadcast, run.whole = self.gather, self.broadcast, whole
        run.save = self.save
        # a LoRA's micro-batches accumulate locally, reduced at the last; a full fine-tune's
        # every one (accumulating would hold the whole gradient unsharded on every process)
        run.sync = lambda last: tr.set_requires_gradient_sync(last or run.args.full_finetune)
        if run.scaler.is_enabled():             # fp16: a step skipped on one is skipped on all
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
            scaler = ShardedGradScaler(run.dev.type)
            scaler.load_state_dict(run.scaler.state_dict())
            run.scaler = scaler

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's x, concatenated along the last dim (rank order)."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def broadcast(x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, in place on every process."""
        torch.distributed.broadcast(x, src=0)
        return x

    def save(self, run: V.Run, it: int) -> Path:
        """vgrpo.save_checkpoint on rank 0; every other process joins its two gathers (the
        weights, then the optimizer state) and all wait until it is written."""
        tr = run.adapter.transformer
        tr.reshard()  # forwards without a backward (a skipped update) leave the root unsharded,
                      # and the optimizer state would not map onto it
        final = run.run_dir / "checkpoints" / f"iter_{it:06d}"
        if self.rank == 0:
            final = V.save_checkpoint(run, it)
        elif not V.is_latest(final):            # rank 0 saves it (not a save done already)
            V.full_state(tr), V.full_state(tr, run.opt)
        torch.distributed.barrier()
        return final


def whole(x: torch.Tensor) -> torch.Tensor:  # a DTensor (FSDP's gradient norm) as one tensor
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def exit_process(status: int) -> None:
    """sys.exit; os._exit under torchrun, where gloo threads can abort an exit (docs/tests.md)."""
    if dist_info()[1] > 1:
        sys.stdout.flush()  # stderr is line-buffered; stdout may sit in a pipe buffer
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # vgrpo.main's Ctrl-C from here
    exit_process(main())
