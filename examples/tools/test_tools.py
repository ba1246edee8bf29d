"""Tests of the run-watching tools in examples/tools/: tensorboard_curves.py --follow through a kill
and a resume, and plot_metrics.py's PNG. tiny_models.py, the offline tiny pipelines, is what every
tiny test runs on. CPU only, offline: `python -m pytest -q examples/tools`.

Every test carries one tier marker (pytest.ini); shared helpers (ROOT, TINY, _load_example) are in
the repository's conftest.py.
"""
import re
import sys

import pytest

import vgrpo as V
from conftest import ROOT, TINY, _load_example


# ------------------------------------------------------------------------------------------------
# Watching a run: TensorBoard and examples/tools/plot_metrics.py
# ------------------------------------------------------------------------------------------------
@pytest.mark.trainer
def test_tensorboard_curves_and_metrics_png_survive_a_kill_and_resume(tmp_path, monkeypatch,
                                                                       capsys):
    """examples/tools/tensorboard_curves.py --follow, started before the run: TensorBoard's own reader
    finds reward_mean once per iteration, also after a kill (iteration 2 was logged, then lost
    with the kill) and --resume, and the evaluation grids as images; run once after the run, the
    same curves; a disk that fills up is one line, exit 2. examples/tools/plot_metrics.py draws the run's
    metrics.jsonl as a real image, skipping a line cut short by a kill; a folder without metrics
    is one line, exit 2."""
    import errno
    import signal
    import subprocess
    import time
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, real = tmp_path / "run", V.iteration

    def steps():
        acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
        acc.Reload()
        tags = acc.Tags()
        return {t: [e.step for e in (acc.Images(t) if t == "eval_grid" else acc.Scalars(t))]
                for t in ("reward_mean", "eval_reward_mean", "eval_grid")
                if t in tags["scalars"] + tags["images"]}

    def follower_reaches(want):                     # the follower reads metrics.jsonl every 0.2 s
        for _ in range(300):
            if (run / "tensorboard").is_dir() and steps() == want:
                return True
            time.sleep(0.2)
        return steps()

    def killed_at_3(r, it):
        if it == 3:
            raise SystemExit("killed")
        return real(r, it)

    follower = subprocess.Popen([sys.executable, str(ROOT / "examples" / "tools" / "tensorboard_curves.py"),
                                 str(run), "--follow", "--every", "0.2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        monkeypatch.setattr(V, "iteration", killed_at_3)
        with pytest.raises(SystemExit):
            V.main(TINY + ["--iterations", "5", "--save_every", "2", "--eval_every", "2",
                           "--run_dir", str(run)])
        monkeypatch.setattr(V, "iteration", real)
        assert follower_reaches({"reward_mean": [0, 1, 2], "eval_reward_mean": [0, 2],
                                 "eval_grid": [0, 2]}) is True
        assert V.main(["--resume", str(run)]) == 0
        done = {"reward_mean": [0, 1, 2, 3, 4], "eval_reward_mean": [0, 2, 4, 5],
                "eval_grid": [0, 2, 4, 5]}
        assert follower_reaches(done) is True
    finally:
        follower.send_signal(signal.SIGINT)                           # Ctrl-C stops it
        err = follower.communicate(timeout=60)[1]
    assert follower.returncode == 0 and err == "", err
    tb = _load_example("tools/tensorboard_curves")
    assert tb.main([str(run)]) == 0 and steps() == done               # once, after the run
    from torch.utils.tensorboard import SummaryWriter
    monkeypatch.setattr(SummaryWriter, "add_scalar", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    capsys.readouterr()
    assert tb.main([str(run)]) == 2
    assert re.fullmatch(r"error: .*No space left on device\n", capsys.readouterr().err)
    monkeypatch.undo()
    pm = _load_example("tools/plot_metrics")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iter": 5, "rew')                                  # cut short by a kill
    assert pm.main([str(run)]) == 0
    with Image.open(run / "metrics.png") as im:
        assert im.format == "PNG" and im.size[0] > 500 and im.size[1] > 300
    assert tb.main([str(run)]) == 0 and steps() == done
    capsys.readouterr()
    assert pm.main([str(tmp_path)]) == 2
    assert re.fullmatch(r"error: .*has no metrics.jsonl.*\n", capsys.readouterr().err)
    assert tb.main([str(tmp_path)]) == 2
    assert re.fullmatch(r"error: .*has no metrics.jsonl.*\n", capsys.readouterr().err)


# ------------------------------------------------------------------------------------------------
# Auditing vgrpo.py's lines: examples/tools/trace_lines.py
# ------------------------------------------------------------------------------------------------
@pytest.mark.examples
def test_trace_lines_sorts_every_line_of_vgrpo_by_what_a_command_ran(tmp_path):
    """A traced `vgrpo.py --model tiny --help` in a fresh process: the report's kinds add up to
    `wc -l`, and its code lines to ran + error paths + other; check_args' lines ran, a raise
    that --help never reaches is an error path, dpmpp2m_sample's body (its signature ran: the
    definition) is "other", line for line, and leaves the floor whole unless kept; a trace of
    another vgrpo.py is refused."""
    import ast
    import json
    import subprocess
    tool = ROOT / "examples" / "tools" / "trace_lines.py"
    out = tmp_path / "help.json"
    p = subprocess.run([sys.executable, str(tool), "run", str(out), "--", "--model", "tiny",
                        "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--num_steps" in p.stdout, p.stderr[-2000:]
    tl = _load_example("tools/trace_lines")
    r = tl.report([str(out)])
    text = (ROOT / "vgrpo.py").read_text().splitlines()
    assert r["lines"] == len(text) == r["code"] + r["docstring"] + r["comment"] + r["blank"]
    assert r["code"] == r["code_ran"] + r["code_error_not_run"] + r["code_other_not_run"]
    hit = set(json.loads(out.read_text())["lines"])
    problems = next(i for i, l in enumerate(text, 1) if "problems += [msg for failed" in l)
    assert problems in hit                                    # check_args ran
    no_index = next(i for i, l in enumerate(text, 1) if "has no model_index.json" in l)
    assert no_index not in hit and 0 < r["code_error_not_run"]
    fn = next(n for n in ast.parse("\n".join(text)).body
              if getattr(n, "name", "") == "dpmpp2m_sample")
    body = [i for i in range(fn.body[1].lineno, fn.end_lineno + 1)  # after its docstring
            if text[i - 1].strip() and not text[i - 1].strip().startswith("#")]
    assert fn.lineno in hit and not hit & set(body)  # defined at import, never called
    assert r["other_by_function"]["dpmpp2m_sample"] == len(body) > 10
    kept = tl.report([str(out)], keep=("dpmpp2m_sample",))  # the floor keeps it whole
    assert kept["floor"] - r["floor"] == fn.end_lineno - fn.lineno + 1 + 2  # and its 2 blanks
    assert r["floor"] < r["lines"]
    data = json.loads(out.read_text())
    data["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="traced another vgrpo.py"):
        tl.report([str(tmp_path / "other.json")])
