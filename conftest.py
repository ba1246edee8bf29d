"""What the test files share: test_vgrpo.py and the tests beside the examples (examples/**/test_*.py).
pytest loads this file before any of them, so the offline switch below holds for every import.

Kept to what more than one file needs: ROOT, the tiny pipelines (TM), the tiny run's flags (TINY),
`_load_example` for the scripts in examples/, `_trained` (a checkpoint's trained weights),
`_stop_while_torch_imports` (a signal at an entry point's first seconds), the `ev`
fixture (examples/evaluate.py), and two autouse fixtures that undo what a test leaves
process-wide. A test file imports the plain names (`from conftest import ROOT, TINY`); pytest
finds the fixtures by name.
"""
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")      # never wait on a hub look-up (20–50 s each)

import signal

import pytest
import torch

# A shell starts a background job (`pytest &`, nohup) with SIGINT ignored, and Python then keeps
# it ignored: the Ctrl-C tests would wait for a KeyboardInterrupt that never comes. Ctrl-C as a
# terminal delivers it, here and in every child process (exec resets a handled signal).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import vgrpo as V

ROOT = Path(__file__).parent

TM = V.tiny_models()                 # examples/tools/tiny_models.py: the offline tiny pipelines

# The tiny SD3 run most trainer tests start from (2 iterations of 2 prompts × 3 images, 4 steps)
TINY = ["--model", "tiny", "--reward", "jpeg", "--iterations", "2", "--prompts_per_iter", "2",
        "--group_size", "3", "--num_steps", "4", "--eval_every", "0", "--save_every", "1"]


def _load_example(rel):
    """Import examples/<rel>.py by path (examples/ is not a package), e.g. "baselines/flow_grpo_sd3"."""
    path = ROOT / "examples" / f"{rel}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _metrics(run_dir) -> list:
    """A run's metrics.jsonl, one dict per line."""
    import json
    return [json.loads(l) for l in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _strip_times(ms) -> list:
    """The iterations' metrics without their wall times: what two equal runs share exactly.
    Refuses a result with no iteration line (an empty log, or evaluations only), on either side
    of a comparison: two different runs would otherwise compare as `[] == []`."""
    out = [{k: v for k, v in m.items() if not k.startswith("time")} for m in ms if "reward_mean" in m]
    assert out, "no iteration line to compare (metrics.jsonl empty, or evaluations only)"
    return out


def _trained(run_dir, it, full=False) -> dict:
    """The trained weights saved after `it` iterations: the LoRA file, or the full transformer."""
    from safetensors.torch import load_file
    ck = Path(run_dir, "checkpoints", f"iter_{it:06d}")
    return load_file(str(ck / (V.FULL_FILE if full else V.LORA_FILE)))


FAKE_TORCH = """
import os, time
open(os.environ["STARTED"], "w").close()    # `import torch` has begun: it takes seconds
time.sleep(120)
"""


def _stop_while_torch_imports(tmp_path, script, sig):
    """Run `script --help` with a torch that announces its import and hangs; send `sig` then:
    (status, stderr)."""
    import subprocess
    import sys
    import time
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    started = tmp_path / "started"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), STARTED=str(started))
    p = subprocess.Popen([sys.executable, str(script), "--help"], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if started.exists() or p.poll() is not None:
            break
        time.sleep(0.05)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return p.returncode, err


@pytest.fixture(scope="module")
def ev():
    """examples/evaluate.py, imported once per test file."""
    return _load_example("evaluate")


@pytest.fixture(autouse=True)
def _restore_sdpa_switches():
    """examples/gpu/gpu_check.py's attention levers set torch's process-wide SDPA switches. Tests share
    one process, so restore them after each test even if a lever's own restore failed: a run that
    ended on `flash` alone must not leave later code, such as a CLIP text encoder with an
    attention mask, without a usable kernel."""
    b = torch.backends.cuda
    saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
             b.cudnn_sdp_enabled())
    yield
    for enable, on in zip((b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp,
                           b.enable_cudnn_sdp), saved):
        enable(on)


@pytest.fixture(autouse=True)
def _restore_sigterm_handler():
    """A preempted run leaves SIGTERM ignored (examples/cluster.py: the process is on its way out
    with status 75). Tests share one process, so put the handler back after each test."""
    import signal
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)
