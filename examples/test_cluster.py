"""Tests of examples/cluster.py: what a job scheduler does to a run (preemption, requeue, a full
disk, out of GPU memory, a reward that fails) and one trainer per run folder. CPU only, offline.

Every run here goes through the companion (`cluster.main`, or `examples/cluster.py` as a process)
with the same flags as vgrpo.py; the tiny pipeline, the same process and thread count, so an
interrupted and resumed run is compared with an uninterrupted one exactly.
"""
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import vgrpo as V
from conftest import (ROOT, TINY, _load_example, _metrics, _stop_while_torch_imports,
                      _strip_times, _trained)

C = _load_example("cluster")
SCRIPT = str(ROOT / "examples" / "cluster.py")


def _same_run(a_dir, b_dir, it):
    """Identical metrics (times aside) and identical trained weights after `it` iterations: the
    same process and thread count, so the same float operations."""
    assert _strip_times(_metrics(a_dir)) == _strip_times(_metrics(b_dir))
    a, b = _trained(a_dir, it), _trained(b_dir, it)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _error_lines(err: str) -> list:
    """The lines main() ends a run with ("error:", "preempted:", "interrupted:")."""
    return [l for l in err.splitlines() if re.match(r"(error|preempted|interrupted): ", l)]


# ------------------------------------------------------------------------------------------------
# Preemption and requeue: SIGTERM saves and exits 75; the same command continues exactly
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["rollout", "update"])
@pytest.mark.examples
def test_sigterm_saves_and_the_requeued_command_continues_exactly(tmp_path, monkeypatch, capsys,
                                                                  where):
    """SIGTERM in iteration 1's rollout abandons it (its first optimizer step has not run: the
    parameters are iteration 0's) and saves after 1 iteration; SIGTERM inside iteration 1's
    first optimizer step (μ = 2, one step still to go) finishes the iteration and saves after 2.
    Either exits with 75, and the same command with --resume auto then ends exactly where an
    uninterrupted run does."""
    argv = TINY + ["--iterations", "4", "--save_every", "10", "--mu", "2", "--eval_every", "2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    real_rollout, real_step, sent = V.collect_rollouts, V.optimizer_step, []

    def rollout(r, it):
        if it == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_rollout(r, it)

    def step(r):
        if not sent and len(_metrics(run)) == 2:            # iteration 1's first step
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(r)
    monkeypatch.setattr(V, *(("collect_rollouts", rollout) if where == "rollout"
                             else ("optimizer_step", step)))
    again = argv + ["--run_dir", str(run), "--resume", "auto"]
    assert C.main(again) == C.PREEMPTED
    err = capsys.readouterr().err
    saved = 1 if where == "rollout" else 2
    assert f"saved {run / 'checkpoints' / f'iter_{saved:06d}'}" in err and "--resume auto" in err
    assert len(_error_lines(err)) == 1 and "Traceback" not in err, err
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{saved:06d}"
    monkeypatch.undo()
    assert C.main(again) == 0                                  # the requeued job, same command
    _same_run(run, ref, 4)


@pytest.mark.examples
def test_ctrl_c_under_torchrun_saves_at_once_like_sigterm(tmp_path, monkeypatch):
    """torchrun's agent forwards Ctrl-C and SIGKILLs its workers after --shutdown_timeout (30 s),
    so under torchrun SIGINT takes the preemption path: saved at once, exit 75."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    real = V.collect_rollouts

    def rollout(r, it):
        if it == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(r, it)
    monkeypatch.setattr(V, "collect_rollouts", rollout)
    run = tmp_path / "run"
    argv = TINY + ["--iterations", "3", "--save_every", "10", "--run_dir", str(run)]
    assert C.main(argv) == C.PREEMPTED
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"


@pytest.mark.examples
def test_first_ctrl_c_finishes_the_iteration_saves_and_exits_130(tmp_path, monkeypatch, capsys):
    """Outside torchrun the first Ctrl-C (a real SIGINT) lets the iteration in flight finish,
    saves it and exits 130 with one line; the same command then continues exactly as the
    uninterrupted run (same process: same float ops)."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    argv = TINY + ["--iterations", "4", "--save_every", "10"]
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    real = V.iteration

    def ctrl_c_in_1(r, it):
        if it == 1:
            os.kill(os.getpid(), signal.SIGINT)              # arrives mid-iteration
        return real(r, it)

    monkeypatch.setattr(V, "iteration", ctrl_c_in_1)
    again = argv + ["--run_dir", str(run), "--resume", "auto"]
    assert C.main(again) == 130
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("interrupted: after iteration 1: saved"), lines
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"
    assert [m["iter"] for m in _metrics(run)] == [0, 1]
    monkeypatch.setattr(V, "iteration", real)
    assert C.main(again) == 0
    assert _strip_times(_metrics(run)) == _strip_times(_metrics(ref))


@pytest.mark.examples
def test_second_ctrl_c_stops_at_once(tmp_path, monkeypatch, capsys):
    """A first Ctrl-C (a real SIGINT) in iteration 1's rollout, a second in its update: the run
    stops there, in iteration 1 (not after finishing and saving it, which a third Ctrl-C would
    be needed for), with one line and exit 130; iteration 1 is neither logged nor saved, `latest`
    stays on iteration 1's checkpoint, and --resume then ends where an uninterrupted run does."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    argv = TINY + ["--iterations", "3", "--save_every", "1"]
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    real_rollout, real_step = V.collect_rollouts, V.optimizer_step

    def rollout(r, it):
        if it == 1:
            os.kill(os.getpid(), signal.SIGINT)              # the first: finish, then save
        return real_rollout(r, it)

    def step(r):
        if len(_metrics(run)) == 1:                         # iteration 1's update
            os.kill(os.getpid(), signal.SIGINT)              # the second: stop now
        return real_step(r)
    monkeypatch.setattr(V, "collect_rollouts", rollout)
    monkeypatch.setattr(V, "optimizer_step", step)
    capsys.readouterr()
    assert C.main(argv + ["--run_dir", str(run)]) == 130
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("interrupted: checkpoints/latest (iter_000001)"), lines
    assert [m["iter"] for m in _metrics(run)] == [0]
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
    assert not (run / "checkpoints" / "iter_000002").exists()
    monkeypatch.undo()
    assert C.main(["--resume", str(run)]) == 0
    _same_run(run, ref, 3)


@pytest.mark.examples
def test_sigterm_twice_still_exits_75(tmp_path):
    """Schedulers repeat SIGTERM. A second one 0.3 s after the first, and more every 50 ms until
    the process is gone, still end the run with 75 (not 143, SIGTERM's own status) and one
    "preempted" line, with `latest` on the checkpoint that line names."""
    run, log = tmp_path / "run", tmp_path / "stderr.txt"
    argv = [sys.executable, SCRIPT, *TINY, "--iterations", "1000", "--save_every", "1000",
            "--run_dir", str(run)]
    with open(log, "w") as err:
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.time() + 600
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)                                   # iteration 0 is logged
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        while p.poll() is None:                                # Popen ignores a finished process
            p.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    text = log.read_text()
    assert p.returncode == C.PREEMPTED, (p.returncode, text[-3000:])
    said = re.findall(r"^preempted: (?:at|after) iteration \d+: saved (\S+);", text, re.M)
    assert len(said) == 1 and "Traceback" not in text, text[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == Path(said[0]).name


@pytest.mark.examples
def test_every_resume_hint_works_as_printed(tmp_path, monkeypatch, capsys):
    """A run started without --run_dir (so in runs/<model>-<reward>-<time>) gets SIGTERM in
    iteration 1. Its line names `--resume RUN` and, for a requeued job, the same command with
    `--resume auto --run_dir RUN`: each, run exactly as printed (on its own copy of the folder),
    ends where an uninterrupted run does."""
    argv = TINY + ["--iterations", "3", "--save_every", "10"]
    assert V.main(argv + ["--run_dir", str(tmp_path / "ref")]) == 0
    monkeypatch.chdir(tmp_path)
    real = V.collect_rollouts

    def rollout(r, it):
        if it == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(r, it)
    monkeypatch.setattr(V, "collect_rollouts", rollout)
    capsys.readouterr()
    assert C.main(argv) == C.PREEMPTED
    err = capsys.readouterr().err
    monkeypatch.setattr(V, "collect_rollouts", real)
    resume = re.search(r"continue with (--resume \S+); a requeued job", err)
    requeue = re.search(r"the same command and (--resume auto --run_dir \S+)", err)
    assert resume and requeue, err
    run = Path(resume.group(1).split()[1])
    assert run.parent.name == "runs" and requeue.group(1).split()[-1] == str(run)
    shutil.copytree(run, tmp_path / "copy")
    assert V.main(resume.group(1).split()) == 0                # plain vgrpo.py continues it
    _same_run(run, tmp_path / "ref", 3)
    shutil.rmtree(run)
    shutil.move(tmp_path / "copy", run)
    assert C.main(argv + requeue.group(1).split()) == 0
    _same_run(run, tmp_path / "ref", 3)


# ------------------------------------------------------------------------------------------------
# One-line ends: a failing reward, a full disk, each writer, out of GPU memory
# ------------------------------------------------------------------------------------------------
FLAKY_REWARD = """\
import os
from examples.rewards.jpeg import score as jpeg
calls = []


def score(images, prompts):              # the JPEG reward, served by a server that may go away
    calls.append(len(images))
    if len(calls) == int(os.environ.get("FLAKY_FAIL_AT", "0")):
        raise ConnectionError("reward server at 10.0.0.7:8000 went away")
    return jpeg(images, prompts)
"""


@pytest.mark.examples
def test_a_reward_that_fails_mid_run_ends_in_one_line_and_loses_nothing(tmp_path, monkeypatch,
                                                                        capsys):
    """A plug-in reward that passes the start-up probe and raises in iteration 2 (a reward server
    gone): one line naming the reward, its error, the iteration, what was saved and the command
    that continues, and exit status 69. Iteration 2 had taken no optimizer step, so the state
    after 2 iterations is saved, and the printed command, once the reward is back, ends where an
    uninterrupted run does."""
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = TINY + ["--reward", "flaky:score", "--iterations", "4", "--save_every", "10"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    monkeypatch.delitem(sys.modules, "flaky")                  # a fresh import, a fresh count
    monkeypatch.setenv("FLAKY_FAIL_AT", "4")                   # the probe, iterations 0, 1, 2
    capsys.readouterr()
    assert C.main(argv + ["--run_dir", str(run)]) == V.RewardError.status == 69
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(r"reward 'flaky:score' failed: ConnectionError: reward server .* went away, "
                     r"in iteration 2; saved \S*iter_000002; continue with --resume (\S+)$",
                     lines[0]), lines[0]
    assert (run / "checkpoints" / "latest").read_text() == "iter_000002"
    assert [m["iter"] for m in _metrics(run)] == [0, 1]
    monkeypatch.delenv("FLAKY_FAIL_AT")                         # the server is back
    assert C.main(lines[0].rsplit("continue with ", 1)[1].split()) == 0
    _same_run(run, ref, 4)


def _tmpfs(path: Path, size: str):
    """A real small filesystem (root on Linux), or None where it cannot be mounted."""
    path.mkdir(parents=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0
    return path if ok else None


@pytest.mark.examples
def test_a_full_disk_is_one_line_and_resume_after_freeing_space_logs_each_iteration_once(
        tmp_path, monkeypatch, capsys):
    """The run folder on a 2 MB filesystem, filled up after the first checkpoint: the second
    checkpoint fails (safetensors' own error type, not OSError) with one line naming it, no
    temporary file is left, `latest` still names the first checkpoint, and --resume after
    freeing space logs every iteration once. Where no filesystem can be mounted, writers that
    raise stand in for it."""
    mnt = _tmpfs(tmp_path / "small", "2m")
    run = (mnt or tmp_path) / "run"
    argv = TINY + ["--iterations", "2", "--save_every", "1", "--eval_every", "1",
                   "--run_dir", str(run)]
    real_ckpt = V.save_checkpoint
    filler = (mnt or tmp_path) / "filler"

    def fill_then_checkpoint(r, it):
        if it == 2:
            if mnt is not None:                                 # take every free byte
                subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"],
                               capture_output=True)
            else:
                from safetensors import SafetensorError

                def boom(*a, **k):
                    raise SafetensorError("Error while serializing: I/O error: No space left "
                                          "on device")
                monkeypatch.setattr("safetensors.torch.save_file", boom)
                monkeypatch.setattr(r.adapter, "save_lora", boom)
        return real_ckpt(r, it)
    monkeypatch.setattr(V, "save_checkpoint", fill_then_checkpoint)
    try:
        capsys.readouterr()
        assert C.main(argv) == 2
        err = capsys.readouterr().err
        lines = [l for l in err.splitlines() if l.strip() and not l.startswith("V-GRPO")
                 and "it/s" not in l and "s/it" not in l]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert re.search(r"error: could not write .*checkpoints .*(space|Space).*--resume",
                         lines[0]), err
        ck = run / "checkpoints"
        assert (ck / "latest").read_text() == "iter_000001"
        assert sorted(p.name for p in ck.iterdir()) == ["iter_000001", "latest"]   # no .tmp-*
        monkeypatch.undo()
        filler.unlink(missing_ok=True)                          # space freed
        assert C.main(["--resume", str(run)]) == 0
        assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1]
        assert [m["iter"] for m in _metrics(run) if "eval_reward_mean" in m] == [0, 1, 2]
    finally:
        if mnt is not None:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("entry", ["vgrpo", "cluster"])
@pytest.mark.parametrize("writer", ["png", "metrics", "torch.save"])
@pytest.mark.examples
def test_every_writer_fails_in_one_line_and_resume_logs_each_iteration_once(
        tmp_path, monkeypatch, capsys, writer, entry):
    """The disk fills up right after the first checkpoint, seen by each writer of the run folder in
    turn: the evaluation grid (PIL), the metrics line, torch.save (whose error is a RuntimeError,
    not an OSError). In both entry points, one line names what failed and --resume; `latest`
    still names the complete first checkpoint, no temporary folder is left, and --resume then
    logs every iteration and evaluation once."""
    main = {"vgrpo": V.main, "cluster": C.main}[entry]
    named = {"png": r"eval/iter_000001\.png \(OSError", "metrics": r"metrics\.jsonl \(OSError",
             "torch.save": r"checkpoints \(RuntimeError: .*inline_container"}[writer]
    run = tmp_path / "run"
    latest = run / "checkpoints" / "latest"
    full = lambda: OSError(errno.ENOSPC, "No space left on device")   # noqa: E731
    if writer == "png":
        from PIL import Image
        real_png = Image.Image.save

        def save_png(self, fp, *a, **k):
            if latest.exists() and isinstance(fp, (str, Path)):
                raise full()
            return real_png(self, fp, *a, **k)
        monkeypatch.setattr(Image.Image, "save", save_png)
    elif writer == "metrics":
        real_open = V.open_run_dir

        class Full:                                  # metrics.jsonl, full once a save exists
            def __init__(self, f):
                self.f, self.failed = f, False

            def write(self, text):
                if latest.exists():
                    self.failed = True
                    raise full()
                return self.f.write(text)

            def flush(self):
                self.f.flush()

            def close(self):                         # as a real file: the unwritten line again
                self.f.close()
                if self.failed:
                    raise full()
        monkeypatch.setattr(V, "open_run_dir", lambda r, d: Full(real_open(r, d)))
    else:
        real_save = torch.save

        def save(obj, f, *a, **k):
            if latest.exists() and str(f).endswith(V.OPTIM_FILE):
                raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter "
                                   "failed writing file data/0: file write failed")
            return real_save(obj, f, *a, **k)
        monkeypatch.setattr(torch, "save", save)
    argv = TINY + ["--save_every", "1", "--eval_every", "1", "--run_dir", str(run)]  # 2 iterations
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith(("V-GRPO", "eval at"))
             and "it/s" not in l and "s/it" not in l]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(r"^error: could not write .*" + named + r".*continue with --resume ",
                     lines[0]), err
    assert latest.read_text() == "iter_000001"
    assert sorted(p.name for p in latest.parent.iterdir()) == ["iter_000001", "latest"]
    V.read_checkpoint(str(run))
    monkeypatch.undo()                                          # space freed
    assert main(["--resume", str(run)]) == 0
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1]
    assert [m["iter"] for m in _metrics(run) if "eval_reward_mean" in m] == [0, 1, 2]


@pytest.mark.parametrize("phase, knob", [("rollout", "--rollout_batch"),
                                         ("reward", "--reward_batch"),
                                         ("old", "--micro_batch"),
                                         ("update", "--micro_batch"),
                                         ("eval", "--rollout_batch or --reward_batch")])
@pytest.mark.examples
def test_out_of_gpu_memory_names_the_phase_and_its_knob_and_loses_nothing(tmp_path, monkeypatch,
                                                                          capsys, phase, knob):
    """torch.cuda.OutOfMemoryError (raised here from a patched call on the CPU) in iteration 1:
    one line naming the phase (vgrpo.timed puts it on the error) and the knob that lowers its
    memory; the parameters are still iteration 0's (the step had not run), so they are saved and
    --resume continues exactly as an uninterrupted run. The θ_old pass ("old") runs at μ = 2
    only, before the first step; the evaluation ("eval", every iteration) runs before the
    iteration, after iteration 0's two lines."""
    argv = TINY + ["--iterations", "3", "--save_every", "10"] + ["--mu", "2"] * (phase == "old")
    argv += ["--eval_every", "1"] * (phase == "eval")
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    target = {"rollout": "rollout", "reward": "decode_and_reward", "old": "surrogate_pass",
              "update": "vgrpo_loss", "eval": "evaluate"}[phase]
    real, calls = getattr(V, target), []

    def oom(*a, **k):
        if len(_metrics(run)) == 1 + (phase == "eval") and not calls:   # in iteration 1
            calls.append(1)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a, **k)
    monkeypatch.setattr(V, target, oom)
    capsys.readouterr()
    assert C.main(argv + ["--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    line = _error_lines(err)
    assert len(line) == 1 and "Traceback" not in err, err
    said = {"rollout": "the rollout", "reward": "decoding and rewards", "old": "the θ_old pass",
            "update": "the update", "eval": "the evaluation"}
    assert f"out of GPU memory in {said[phase]}" in line[0]
    assert knob in line[0] and "saved" in line[0] and "--resume" in line[0]
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
    monkeypatch.undo()
    assert C.main(["--resume", str(run)]) == 0
    _same_run(run, ref, 3)


@pytest.mark.parametrize("save_every", [1, 10])
@pytest.mark.examples
def test_out_of_gpu_memory_after_the_first_step_saves_nothing_and_the_run_continues(
        tmp_path, monkeypatch, capsys, save_every):
    """μ = 2, out of memory in iteration 1's second optimizer step: the first step has changed the
    weights, so no consistent state is in memory and nothing is saved. The line names the last
    complete checkpoint (or says there is none) and the command that goes on from there:
    --resume RUN, or --resume auto, which starts over; either ends where an uninterrupted run
    does."""
    argv = TINY + ["--iterations", "3", "--save_every", str(save_every), "--mu", "2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert V.main(argv + ["--run_dir", str(ref)]) == 0
    real, calls = V.vgrpo_loss, []

    def oom(*a, **k):
        if len(_metrics(run)) == 1:                             # iteration 1: one per step
            calls.append(1)
            if len(calls) == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a, **k)
    monkeypatch.setattr(V, "vgrpo_loss", oom)
    capsys.readouterr()
    assert C.main(argv + ["--run_dir", str(run)]) == 2
    err = capsys.readouterr().err
    line = _error_lines(err)
    assert len(line) == 1 and "Traceback" not in err, err
    assert "out of GPU memory in the update" in line[0] and "--micro_batch" in line[0]
    assert "saved" not in line[0]
    monkeypatch.undo()
    if save_every == 1:
        assert f"checkpoints/latest (iter_000001) is the last complete one; continue with " \
               f"--resume {run}" in line[0], line[0]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "latest"]
        assert C.main(["--resume", str(run)]) == 0
    else:
        assert f"no checkpoint yet; continue with --resume auto --run_dir {run}" in line[0], line[0]
        assert list((run / "checkpoints").iterdir()) == []
        assert C.main(argv + ["--run_dir", str(run), "--resume", "auto"]) == 0
    _same_run(run, ref, 3)


# ------------------------------------------------------------------------------------------------
# --resume auto and one trainer per run folder
# ------------------------------------------------------------------------------------------------
@pytest.mark.examples
def test_resume_auto_starts_or_continues_the_same_command(tmp_path, capsys):
    """--resume auto continues a folder that holds a run (each iteration logged once), starts one
    in an empty folder, and starts over in a folder a run left before its first checkpoint."""
    run = tmp_path / "run"
    argv = TINY + ["--iterations", "3", "--run_dir", str(run)]
    assert C.main(argv + ["--resume", "auto"]) == 0
    assert C.main(argv + ["--resume", "auto", "--iterations", "4"]) == 0
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2, 3]
    fresh = tmp_path / "fresh"
    assert C.main(TINY + ["--iterations", "1", "--run_dir", str(fresh), "--resume", "auto"]) == 0
    (fresh / "checkpoints" / "latest").unlink()                 # as if killed before a save
    shutil.rmtree(fresh / "checkpoints" / "iter_000001")
    assert C.main(TINY + ["--iterations", "2", "--run_dir", str(fresh), "--resume", "auto"]) == 0
    assert [m["iter"] for m in _metrics(fresh) if "reward_mean" in m] == [0, 1]
    capsys.readouterr()
    assert C.main(TINY + ["--resume", "auto"]) == 2                # needs --run_dir
    assert "--resume auto needs --run_dir" in capsys.readouterr().err


GATED_REWARD = """\
import os
import time
from pathlib import Path
calls = []


def score(images, prompts):          # the mean colour; the call of iteration 1 waits for a file
    calls.append(len(images))
    if len(calls) == 3:              # 1: the start-up probe, 2: iteration 0, 3: iteration 1
        Path(os.environ["GATE"] + ".waiting").write_text("")
        for _ in range(3000):
            if Path(os.environ["GATE"]).exists():
                break
            time.sleep(0.1)
    return images.float().mean(dim=(1, 2, 3)).cpu()
"""


@pytest.mark.examples
def test_a_second_trainer_on_a_live_run_folder_is_refused_and_the_first_finishes(tmp_path, capsys,
                                                                                  monkeypatch):
    """One trainer per run folder: while a trainer runs (here held inside iteration 1, after the
    checkpoint of iteration 0), a second on its folder, by `--resume RUN`, `--resume auto` or the
    same `--run_dir`, exits with status 2 and one line naming the first's pid, and changes no
    file; the first then finishes: status 0, every iteration logged once, `latest` on its last
    save."""
    (tmp_path / "gated.py").write_text(GATED_REWARD)
    run, gate = tmp_path / "run", tmp_path / "go"
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([sys.executable, SCRIPT] + TINY +
                                 ["--reward", "gated:score", "--iterations", "3", "--run_dir", str(run)],
                                 cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1", GATE=str(gate)),
                                 stdout=subprocess.DEVNULL, stderr=err)
    try:
        for _ in range(1200):                       # until iteration 1 waits at the gate
            if Path(str(gate) + ".waiting").exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "first.err").read_text()
        assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
        assert (run / ".lock").read_text().strip() == str(first.pid)
        files = {f: f.read_bytes() for f in run.rglob("*") if f.is_file()}
        in_use = (rf"error: --run_dir .* is in use by a running trainer \(pid {first.pid}\); "
                  r"wait for it to end, or pass another --run_dir\n")
        for argv, said in ((["--resume", str(run)], in_use),
                           (TINY + ["--run_dir", str(run), "--resume", "auto"], in_use),
                           (TINY + ["--run_dir", str(run)], r"error: .* already holds a run: .*\n")):
            assert C.main(argv) == 2
            err = capsys.readouterr().err
            assert re.fullmatch(said, err), err
        assert {f: f.read_bytes() for f in run.rglob("*") if f.is_file()} == files
        gate.write_text("")
        assert first.wait(timeout=300) == 0, (tmp_path / "first.err").read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2]
    assert (run / "checkpoints" / "latest").read_text() == "iter_000003"
    monkeypatch.chdir(tmp_path)                                          # where gated.py is
    assert C.main(["--resume", str(run), "--iterations", "4"]) == 0      # the folder is free again


# ------------------------------------------------------------------------------------------------
# Stops while loading, and a reward call that does not return
# ------------------------------------------------------------------------------------------------
SLOW_PROBE = """
import os, time
from pathlib import Path


def score(images, prompts):          # the start-up probe announces itself and waits
    Path(os.environ["GATE"] + ".waiting").write_text("")
    time.sleep(120)
    return images.float().mean(dim=(1, 2, 3)).cpu()
"""


@pytest.mark.examples
def test_a_stop_while_loading_is_one_line_75_on_sigterm_130_on_ctrl_c(tmp_path):
    """Before Cluster's handlers, while torch imports or the model and rewards load (here inside
    the reward's start-up probe): SIGTERM exits 75 in one line, so a requeue rule keyed on 75
    keeps the job, and Ctrl-C exits 130 in one line; the same command then starts the run."""
    status, err = _stop_while_torch_imports(tmp_path / "a", SCRIPT, signal.SIGTERM)
    assert status == C.PREEMPTED and err.startswith("preempted: while loading"), err
    assert err.count("\n") == 1, err
    status, err = _stop_while_torch_imports(tmp_path / "b", SCRIPT, signal.SIGINT)
    assert (status, err) == (130, "interrupted before the first iteration: nothing written\n")
    (tmp_path / "slowprobe.py").write_text(SLOW_PROBE)
    run, gate = tmp_path / "run", tmp_path / "go"
    argv = TINY + ["--iterations", "1", "--run_dir", str(run), "--resume", "auto"]
    p = subprocess.Popen([sys.executable, SCRIPT] + argv + ["--reward", "slowprobe:score"],
                         cwd=tmp_path, env=dict(os.environ, GATE=str(gate)),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):
        if Path(str(gate) + ".waiting").exists() or p.poll() is not None:
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == C.PREEMPTED and err.startswith("preempted: while loading"), err
    assert len(_error_lines(err)) == 1 and "Traceback" not in err, err
    assert C.main(argv) == 0                                  # the requeued job starts it
    assert [m["iter"] for m in _metrics(run)] == [0]


def _reward_server(hold_after: int):
    """A loopback reward server (Flow-GRPO's protocol, "outputs") that answers the first
    `hold_after` requests and then holds every other one open without an answer; (url, stop)."""
    import http.server
    import pickle
    import threading
    served = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
            served.append(time.monotonic())
            if len(served) > hold_after:
                os.kill(os.getpid(), signal.SIGTERM)         # preempted while the call runs
                time.sleep(300)
                return
            data = pickle.dumps({"outputs": [0.5] * len(body["prompts"])})
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    def stop():
        server.shutdown()
        server.server_close()
    return f"http://127.0.0.1:{server.server_port}/deqa", stop, served


@pytest.mark.examples
def test_sigterm_waits_at_most_the_grace_for_a_running_reward_call(tmp_path, monkeypatch, capsys):
    """A reward server that holds iteration 1's request (its read timeout 120 s): SIGTERM during
    that call stops the run REWARD_GRACE s later (2 s here), not when the server lets go; the
    iteration had not stepped, so it is saved as not begun, status 75 in one line, and the
    requeued command ends with every iteration logged once."""
    monkeypatch.setattr(C, "REWARD_GRACE", 2.0)
    url, stop, served = _reward_server(hold_after=2)         # the probe and iteration 0
    try:
        run = tmp_path / "run"
        argv = TINY + ["--iterations", "3", "--save_every", "10", "--run_dir", str(run),
                       "--resume", "auto"]
        assert C.main(argv + ["--reward", url]) == C.PREEMPTED
        took = time.monotonic() - served[-1]                  # since the SIGTERM
    finally:
        stop()
    err = capsys.readouterr().err
    assert len(_error_lines(err)) == 1 and "Traceback" not in err and "at iteration 1" in err, err
    assert len(served) == 3 and 2.0 <= took < 30, took        # not the server's 300 s hold
    assert (run / "checkpoints" / "latest").read_text() == "iter_000001"
    url, stop, served = _reward_server(hold_after=100)
    try:
        assert C.main(argv + ["--reward", url]) == 0
    finally:
        stop()
    assert [m["iter"] for m in _metrics(run) if "reward_mean" in m] == [0, 1, 2]
