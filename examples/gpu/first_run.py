"""The first-run acceptance run: `python vgrpo.py --model sd3.5-medium --reward pickscore`, as a
user runs it, on real-size random weights, measured phase by phase. One command, one GPU, at most
one 10-minute call.

    python examples/gpu/first_run.py                  # one H100/H200: 2 iterations, evaluation 0
    python examples/gpu/first_run.py --cpu_smoke      # the whole script, tiny models, on the CPU
    python examples/gpu/first_run.py --iterations 1 --n_eval 8 --extra="--reward_batch 16"

What runs: vgrpo.main with the headline command's flags and nothing else (plus --run_dir, a
temporary folder unless given). Every default stays: --compile on (one CUDA GPU), P × G = 6 × 24,
40 Euler steps, μ = 1, micro-batch 4, rollout batch 16, reward batch 32, gradient checkpointing
and 40-step evaluations from the SD3 family preset, an evaluation at iteration 0, bf16 autocast,
150 iterations in the run's config. Only two things are replaced, from outside the trainer:
  * vgrpo.load_pipeline returns gpu_check.build_sd35m_random's pipeline (the SD3.5-Medium
    transformer, VAE, CLIP-L, CLIP-G and T5-XXL at full size, random weights, built on the GPU),
    through vgrpo.freeze_and_cast as a hub load would be;
  * vgrpo.Rewards.load returns gpu_check.build_pickscore_random's CLIP ViT-H/14 as "pickscore".
Nothing is downloaded, so vgrpo.check_hub_access (the Hub access check) is skipped. The rest is the trainer's own path: main → start → train → plan_run_dir →
setup (LoRA, checkpointing, compile_blocks) → run_iterations (evaluation at 0, the iterations,
metrics.jsonl, the evaluation grid). The images and rewards are meaningless; the times, memory
and |log ρ| are those of the real shapes.

What it records, after every phase, in --out (JSON, and a markdown twin; default
results/gpu/first_run.json on a GPU, none in --cpu_smoke unless given):
  setup        seconds of vgrpo.setup, of its compile step (run.time_compile) and peak memory
  phases       per iteration: rollout, reward decode, θ_old pass, update (vgrpo.timed's blocks),
               and each evaluation: seconds, peak GPU memory (torch.cuda.reset_peak_memory_stats
               at every phase boundary), memory held at the phase's start, graphs dynamo compiled
               during the phase (0 once setup has compiled everything)
  iterations   each iteration's time and phase times, |log ρ| (abs_log_ratio, and
               abs_log_ratio_first: 0 by construction at μ = 1), reward, gradient norm, peak memory
  evaluations  each evaluation's seconds, rows and reward
  stopped      why the run ended: completed (the iterations asked for), the time guard (what it
               skipped), or an error; an out-of-memory is a row naming its phase, never a traceback
Exit status: 0 when the iterations asked for ran, 3 when a phase failed or the time guard cut
them (both recorded).

Time guard (--budget_s, default 540 s from the script's start, model build included): before each
iteration (and the evaluation due with it) the script stops if the last iteration's wall time
× 1.15 (before the first: ITER_EST_S) would end past the budget less --reserve_s. Setup, its
compilation and an iteration already started are never cut. The evaluation at iteration 0 runs
before iteration 0, as in the trainer, so it is skipped only with iteration 0.
"""
import argparse
import contextlib
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()                  # the time guard's clock starts before torch is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

import torch

import gpu_check as GC                    # examples/gpu/gpu_check.py: the real-size builders
import vgrpo as V

HEADLINE = ["--model", "sd3.5-medium", "--reward", "pickscore"]
# the CPU smoke's sizes (the tiny pipeline's), with --compile forced on so that its step runs
SMOKE = ["--device", "cpu", "--compile", "--resolution", "64", "--num_steps", "4",
         "--eval_steps", "4", "--max_sequence_length", "32", "--lora_rank", "4", "--lora_alpha", "8",
         "--prompts_per_iter", "2", "--group_size", "4", "--n_eval", "2"]
# vgrpo.timed's keys → the phase names of the report; "eval" is recorded by the evaluate wrapper
PHASES = {"time_rollout": "rollout", "time_reward": "reward decode", "time_old": "θ_old pass",
          "time_update": "update"}
# the flag that lowers each phase's peak (vgrpo's memory knobs; docs/gpu.md), for an out-of-memory
KNOBS = {"setup": "--offload_text_encoders", "compile": "--micro_batch 2 --rollout_batch 8",
         "evaluation": "--rollout_batch 8 --reward_batch 8", "rollout": "--rollout_batch 8",
         "reward decode": "--reward_batch 8", "θ_old pass": "--micro_batch 2",
         "update": "--micro_batch 2"}
ITER_EST_S = 150.0      # first-iteration allowance on a GPU: the eager default took 99.7 s on an
                        # H200 (docs/gpu.md), × 1.5; compiled it should take less
GUARD_MARGIN = 1.15     # a later iteration: the last one's wall time × this
GIB = 2 ** 30


class Stop(BaseException):
    """Ends the trainer's loop from its run.guard hook (BaseException: no handler inside catches
    it); the run folder is closed by run_iterations' own `finally`."""


def is_oom(e: BaseException) -> bool:
    """An out-of-memory, raw or as the trainer reports it (a compile failure, a RunError line)."""
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "outofmemory" in text


def stopped_line(s) -> str:
    """The report's `stopped` in words."""
    if not s:
        return "still running (or killed)"
    return (s["reason"] + (f" at {s['phase']}" if s.get("phase") else "")
            + (f", iteration {s['iter']}" if s.get("iter") is not None else "")
            + (f" ({s['detail']})" if s.get("detail") else "")
            + (f"; the trainer said: {s['trainer_said']}" if s.get("trainer_said") else "")
            + (f"; the flags that lower it: `--extra=\"{s['lower_with']}\"`"
               if s.get("lower_with") else ""))


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


# ------------------------------------------------------------------------------------------------
# The record: one JSON and its markdown twin, rewritten after every row
# ------------------------------------------------------------------------------------------------
class Report:
    def __init__(self, path, info):
        self.path, self.info = (Path(path) if path else None), info
        self.setup, self.phases, self.iterations, self.evaluations = {}, [], [], []
        self.stopped = None

    def data(self) -> dict:
        return {"info": self.info, "setup": self.setup, "phases": self.phases,
                "iterations": self.iterations, "evaluations": self.evaluations,
                "stopped": self.stopped}

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data(), indent=2, ensure_ascii=False))
        os.replace(tmp, self.path)
        self.path.with_suffix(".md").write_text(self.markdown())

    def markdown(self) -> str:
        def cell(v):
            if isinstance(v, float):
                return "—" if not math.isfinite(v) else (f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}")
            return "—" if v is None else str(v)

        def table(rows, cols):
            out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            return out + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
        i, s = self.info, self.stopped or {}
        out = [f"# examples/gpu/first_run.py: {i.get('device')}, torch {i.get('torch')}", "",
               f"Command: `{i.get('command')}`. The trainer ran `{i.get('trainer_command')}` "
               f"with {i.get('weights')}. Times in seconds, memory in GiB (peak allocated by "
               "torch's caching allocator within the phase). Written "
               f"{i.get('date')}; vgrpo.py sha256 {str(i.get('vgrpo_sha256'))[:12]}.", "",
               f"**Stopped:** {stopped_line(s)}", "", "## setup", ""]
        out += table([self.setup], ["build_s", "setup_s", "compiled", "time_compile",
                                    "peak_GiB", "error"]) if self.setup else ["—"]
        out += ["", "## iterations", ""]
        out += table(self.iterations, ["iter", "time_iter", "time_rollout", "time_reward",
                                       "time_old", "time_update", "abs_log_ratio",
                                       "abs_log_ratio_first", "reward_mean", "grad_norm",
                                       "peak_GiB"])
        out += ["", "## evaluations", ""]
        out += table(self.evaluations, ["iter", "seconds", "rows", "eval_reward_mean",
                                        "peak_GiB", "new_graphs"])
        out += ["", "## phases", ""]
        out += table(self.phases, ["iter", "phase", "seconds", "peak_GiB", "reserved_GiB",
                                   "start_GiB", "new_graphs", "error"])
        cfg = i.get("config") or {}
        if cfg:
            out += ["", "## the run's settings (vgrpo.Args after presets)", "",
                    ", ".join(f"{k} {v}" for k, v in cfg.items())]
        return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# Phases: seconds, peak memory and compiled graphs between phase boundaries
# ------------------------------------------------------------------------------------------------
def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 — a torch without the counter: not recorded
        return -1


class Probe:
    """Nested phases: each resets the peak-memory counter at its start and reads it at its end;
    an enclosing phase keeps the peaks of the phases inside it."""

    def __init__(self, report, cuda):
        self.report, self.cuda = report, cuda
        self.stack, self.iter, self.failed = [], None, None

    def _peak(self) -> float:
        return torch.cuda.max_memory_allocated() / GIB if self.cuda else 0.0

    @contextlib.contextmanager
    def phase(self, name, rows=None):
        if self.cuda:
            peak = self._peak()
            for f in self.stack:
                f["peak"] = max(f["peak"], peak)
            torch.cuda.reset_peak_memory_stats()
        f = {"peak": 0.0, "t": time.perf_counter(), "graphs": compiled_graphs(),
             "start": torch.cuda.memory_allocated() / GIB if self.cuda else None}
        self.stack.append(f)
        error = None
        try:
            yield f
        except BaseException as e:
            if not isinstance(e, Stop):
                error = e
            raise
        finally:
            if self.cuda and error is None:
                torch.cuda.synchronize()
            self.stack.pop()
            peak = max(f["peak"], self._peak())
            for g in self.stack:
                g["peak"] = max(g["peak"], peak)
            graphs = compiled_graphs()
            row = {"iter": self.iter, "phase": name, "seconds": time.perf_counter() - f["t"],
                   "peak_GiB": peak if self.cuda else None,
                   "reserved_GiB": (torch.cuda.max_memory_reserved() / GIB if self.cuda
                                    else None),
                   "start_GiB": f["start"],
                   "new_graphs": graphs - f["graphs"] if graphs >= 0 else None}
            if rows is not None:
                row["rows"] = rows
            if error is not None and self.failed is None:      # the innermost phase names it
                row["error"] = ("out of memory: " if is_oom(error) else "") + one_line(error)
                self.failed = (name, self.iter, error)
            f["row"] = row
            self.report.phases.append(row)
            self.report.write()


@contextlib.contextmanager
def patched(obj, **attrs):
    """obj.<name> = value for the body; the originals back afterwards, whatever happens."""
    saved = {k: obj.__dict__[k] for k in attrs}
    try:
        for k, v in attrs.items():
            setattr(obj, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def instrumented(a, report, probe, pipe, reward_models, t0):
    """The trainer, with the built models in place of the hub's and every phase measured."""
    real = {k: getattr(V, k) for k in ("setup", "compile_blocks", "timed", "iteration", "evaluate")}
    state = {"last_iter_s": None, "eval_s": 0.0}

    def load_pipeline(name, dtype, *rest, **kw):     # as a hub load ends: frozen, cast
        return V.freeze_and_cast(pipe, dtype)

    def load_rewards(cls, args, device, dtype, *rest, **kw):
        names = dict.fromkeys(n for n, _ in args.train_terms + args.eval_terms)
        missing = [n for n in names if n not in reward_models]
        if missing:
            raise V.ConfigError(f"first_run.py builds only {sorted(reward_models)}, not {missing}")
        return cls({n: reward_models[n] for n in names}, args.train_terms, args.eval_terms)

    @contextlib.contextmanager
    def timed(times, key, *rest, **kw):
        name = PHASES.get(key)
        with (probe.phase(name) if name else contextlib.nullcontext()):
            with real["timed"](times, key, *rest, **kw):
                yield

    def compile_blocks(*args, **kw):
        with probe.phase("compile"):
            return real["compile_blocks"](*args, **kw)

    def evaluate(run, it, *rest, **kw):
        n = len(run.eval_prompts[:run.args.n_eval])
        with probe.phase("evaluation", rows=n) as f:
            ev = real["evaluate"](run, it, *rest, **kw)
        state["eval_s"] = max(state["eval_s"], f["row"]["seconds"])
        row = {"iter": it, "seconds": f["row"]["seconds"], "rows": n,
               "peak_GiB": f["row"]["peak_GiB"], "new_graphs": f["row"]["new_graphs"],
               "eval_reward_mean": ev.get("eval_reward_mean"),
               "eval_n_nonfinite": ev.get("eval_n_nonfinite")}
        report.evaluations.append(row)
        report.write()
        return ev

    def iteration(run, it, *rest, **kw):
        start = len(report.phases)
        t = time.perf_counter()
        m = real["iteration"](run, it, *rest, **kw)
        wall = time.perf_counter() - t
        state["last_iter_s"] = wall
        peaks = [r["peak_GiB"] for r in report.phases[start:] if r["peak_GiB"] is not None]
        keep = ("time_iter", "time_rollout", "time_reward", "time_old", "time_update",
                "abs_log_ratio", "abs_log_ratio_first", "ratio", "reward_mean", "reward_std",
                "grad_norm", "surrogate_cv", "nfe_rollout", "nfe_old", "nfe_theta",
                "n_nonfinite_reward", "skipped")
        report.iterations.append({"iter": it, "wall_s": wall, **{k: m.get(k) for k in keep},
                                  "peak_GiB": max(peaks) if peaks else None})
        report.write()
        return m

    def guard_for(inner):
        @contextlib.contextmanager
        def guard(it):
            probe.iter = it
            if it >= a.iterations:                    # the iterations asked for have run
                raise Stop("completed")
            need = ((state["last_iter_s"] or 0.0) * GUARD_MARGIN if state["last_iter_s"]
                    else (ITER_EST_S if probe.cuda else 0.0))
            due = run_args.eval_every and it % run_args.eval_every == 0
            need += state["eval_s"] * GUARD_MARGIN if due else 0.0
            left = a.budget_s - (time.perf_counter() - t0) - a.reserve_s
            if left < need:
                skipped = [f"iterations {it}–{a.iterations - 1}" if it < a.iterations - 1
                           else f"iteration {it}"]
                raise Stop(f"time guard: {', '.join(skipped)}"
                           + (f" and the evaluation at {it}" if due else "")
                           + f" skipped ({left:.0f} s left before the reserve, ~{need:.0f} s "
                           "needed)")
            with inner(it):
                yield
            if it + 1 >= a.iterations:
                raise Stop("completed")
        return guard

    run_args = None

    def setup(args, *rest, **kw):
        nonlocal run_args
        run_args = args
        report.info["config"] = {k: getattr(args, k) for k in (
            "model", "reward", "prompts_per_iter", "group_size", "num_steps", "eval_steps",
            "eval_every", "n_eval", "mu", "n_mc", "micro_batch", "rollout_batch", "reward_batch",
            "gradient_checkpointing", "offload_text_encoders", "compile", "dtype", "resolution",
            "max_sequence_length", "lora_rank", "lora_alpha", "iterations", "device")}
        t = time.perf_counter()
        with GC.compile_backend(a.compile_backend), probe.phase("setup") as f:
            run = real["setup"](args, *rest, **kw)
        report.setup.update(setup_s=time.perf_counter() - t, compiled=run.compiled,
                            time_compile=run.time_compile, peak_GiB=f["row"]["peak_GiB"])
        report.info["device_used"], report.info["dtype_used"] = str(run.dev), str(run.dtype)
        report.info["eval_rows"] = len(run.eval_prompts[:args.n_eval])
        report.write()
        run.guard = guard_for(run.guard)
        return run

    no_hub = lambda ids: None  # noqa: E731 — the built weights stand in for the hub ids
    with patched(V, load_pipeline=load_pipeline, setup=setup, compile_blocks=compile_blocks,
                 timed=timed, iteration=iteration, evaluate=evaluate,
                 check_hub_access=no_hub), \
            patched(V.Rewards, load=classmethod(load_rewards)):
        yield


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def build(cpu_smoke: bool, dev, dtype):
    """(pipeline, {"pickscore": reward_fn}): the real architectures at full size with random
    weights on the GPU, or the tiny ones on the CPU."""
    if cpu_smoke:
        return GC.TM.build_tiny_sd3_pipeline(), GC.build_pickscore_random(dev, dtype, tiny=True).models
    return GC.build_sd35m_random(dev, dtype), GC.build_pickscore_random(dev, dtype).models


def code_info() -> dict:
    out = {"vgrpo_sha256": hashlib.sha256((ROOT / "vgrpo.py").read_bytes()).hexdigest()}
    try:
        out["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                           capture_output=True, text=True, timeout=10,
                                           check=True).stdout.strip()
    except Exception:  # noqa: BLE001 — a copy without .git
        out["git_commit"] = None
    import diffusers, peft, transformers
    out.update(diffusers=diffusers.__version__, transformers=transformers.__version__,
               peft=peft.__version__)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=2,
                    help="iterations to run before stopping (the run's config keeps 150)")
    ap.add_argument("--n_eval", type=int, default=None,
                    help="the trainer's --n_eval (held-out prompts per evaluation); default its own")
    ap.add_argument("--extra", default="",
                    help="more vgrpo flags (then it is no longer the defaults, and says so)")
    ap.add_argument("--budget_s", type=float, default=540.0,
                    help="time guard: no iteration starts that would end past this many seconds "
                         "after the script's start (less --reserve_s)")
    ap.add_argument("--reserve_s", type=float, default=20.0, help="seconds kept free at the end")
    ap.add_argument("--out", default=None, help="JSON output (a .md twin beside it); default "
                    "results/gpu/first_run.json on a GPU, none in --cpu_smoke")
    ap.add_argument("--run_dir", default=None,
                    help="the trainer's run folder (default: a temporary one, removed at the end)")
    ap.add_argument("--compile_backend", default=None,
                    help="torch.compile backend of the trainer's compile step (default inductor, "
                         "the trainer's; --cpu_smoke: eager, since inductor takes minutes there)")
    ap.add_argument("--cpu_smoke", action="store_true",
                    help="the whole script on the tiny models on the CPU")
    a = ap.parse_args(argv)
    if a.iterations < 1:
        ap.error("--iterations must be ≥ 1")
    if a.cpu_smoke:
        dev, dtype = torch.device("cpu"), torch.float32
        a.compile_backend = a.compile_backend or "eager"
    else:
        if not torch.cuda.is_available():
            sys.exit("error: this run needs a CUDA GPU (or pass --cpu_smoke)")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        a.out = a.out or str(ROOT / "results" / "gpu" / "first_run.json")
    getattr(V, "_quiet_hf", lambda: None)()
    flags = HEADLINE + (SMOKE if a.cpu_smoke else [])
    flags += ["--n_eval", str(a.n_eval)] if a.n_eval is not None else []
    flags += shlex.split(a.extra)
    own_dir = a.run_dir is None
    run_dir = Path(a.run_dir) if a.run_dir else Path(tempfile.mkdtemp(prefix="first_run-")) / "run"
    cmd = "python examples/gpu/first_run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = {"device": (torch.cuda.get_device_name() if dev.type == "cuda"
                       else "CPU (smoke: tiny models)"),
            "torch": torch.__version__, "command": cmd.strip(),
            "trainer_command": "python vgrpo.py " + " ".join(flags),
            "defaults": not (a.cpu_smoke or a.n_eval is not None or a.extra.strip()),
            "weights": ("tiny random models (--cpu_smoke)" if a.cpu_smoke else
                        "random weights of the real SD3.5-Medium architecture and a "
                        "PickScore-shaped CLIP ViT-H/14 (no downloads)"),
            "iterations_asked": a.iterations, "budget_s": a.budget_s,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), **code_info()}
    if dev.type == "cuda":
        info["gpu_total_GiB"] = torch.cuda.get_device_properties(0).total_memory / GIB
    report = Report(a.out, info)
    probe = Probe(report, dev.type == "cuda")
    print(f"{info['device']}  torch {torch.__version__}  trainer: {info['trainer_command']}",
          flush=True)
    status = 3
    try:
        t = time.perf_counter()
        torch.manual_seed(0)
        try:
            pipe, rewards = build(a.cpu_smoke, dev, dtype)
        except BaseException as e:
            report.setup.update(error=("out of memory: " if is_oom(e) else "") + one_line(e))
            report.stopped = {"reason": "error", "phase": "build", "detail": one_line(e)}
            raise
        report.setup["build_s"] = time.perf_counter() - t
        report.write()
        print(f"built in {report.setup['build_s']:.0f}s", flush=True)
        code, caught = None, None

        def command(given):                 # vgrpo.start, with what it raises kept
            nonlocal caught
            try:
                return V.start(given)
            except Stop:
                raise
            except BaseException as e:
                caught = e
                raise
        with instrumented(a, report, probe, pipe, rewards, T0):
            try:
                code = V.main(flags + ["--run_dir", str(run_dir)], command=command)
            except Stop as s:
                report.stopped = {"reason": "completed" if str(s) == "completed" else "time guard",
                                  "detail": None if str(s) == "completed" else str(s)}
                status = 0 if str(s) == "completed" else 3
            except Exception as e:  # noqa: BLE001 — a failure the trainer does not catch
                caught = caught or e
        if report.stopped is None:           # a phase failed, or the trainer refused to start
            where, it, e = probe.failed or ("setup", None, caught)
            report.stopped = {"reason": "out of memory" if e is not None and is_oom(e) else "error",
                              "phase": where, "iter": it,
                              "detail": (one_line(e) if e is not None
                                         else f"vgrpo.main returned {code}"),
                              "trainer_exit": code}
            if caught is not None and caught is not e:     # how the trainer reported it
                report.stopped["trainer_said"] = one_line(caught)
            if e is not None and is_oom(e) and where in KNOBS:
                report.stopped["lower_with"] = KNOBS[where]
    except BaseException as e:  # noqa: BLE001 — recorded, one line
        report.stopped = report.stopped or {"reason": "error", "detail": one_line(e)}
    finally:
        report.info["total_s"] = time.perf_counter() - T0
        report.write()
        if own_dir:
            shutil.rmtree(run_dir.parent, ignore_errors=True)
    print(report.markdown(), flush=True)
    print(f"stopped: {stopped_line(report.stopped)}", flush=True)
    if a.out:
        print(f"wrote {a.out} and {Path(a.out).with_suffix('.md')}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
