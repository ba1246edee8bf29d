"""
Which lines of vgrpo.py a command runs: a line tracer and a report, for auditing what the file's
lines are for (docs/code.md, "What the lines are for"). A maintainer's tool, not part of the method.

    # the CPU quickstart
    python examples/tools/trace_lines.py run quick.json -- --model tiny --reward jpeg \\
        --iterations 2 --eval_every 1 --save_every 1 --run_dir "$(mktemp -d)/run"
    # the headline command's loading path on the CPU: `--model sd3.5-medium --reward pickscore`
    # against examples/tools/fake_hub.py serving tiny random models at the default hub ids
    python examples/tools/trace_lines.py run hub.json --fake_hub
    python examples/tools/trace_lines.py report quick.json hub.json --keep compile_blocks,…

`run` runs `python vgrpo.py ARGS` in this process under sys.settrace (its threads too) and
writes the line numbers of vgrpo.py that executed, with the file's sha256. `--fake_hub` builds
the tiny SD3 pipeline and a tiny CLIP, serves them at stabilityai/stable-diffusion-3.5-medium,
yuvalkirstain/PickScore_v1 and laion/CLIP-ViT-H-14-laion2B-s32B-b79K on 127.0.0.1 (HF_ENDPOINT,
a fresh HF_HOME, HF_HUB_OFFLINE unset), and traces the headline command at tiny sizes
(FAKE_HUB_RUN; ARGS after them override) on the CPU: the Hub's access check, the downloads and
PickScore run as on a GPU machine; the CUDA-only lines (setup_device's, cuda_problem's,
compile_blocks') do not.

`report` reads traces of the same vgrpo.py and sorts each physical line: blank, comment,
docstring or code; a code line by its innermost statement: it ran in some trace; it is on an
error path (a raise, an except clause, or inside an `if` whose body raises) and did not run; or
neither, counted per function. Its last line is a floor: what would be left if every line no
trace ran left vgrpo.py, but for the functions named in --keep (what a GPU run or a failure runs)
and the unrun error paths of the functions that ran.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VGRPO = ROOT / "vgrpo.py"
# the headline command (README) at the tiny models' sizes, on the CPU
FAKE_HUB_RUN = ["--model", "sd3.5-medium", "--reward", "pickscore", "--device", "cpu",
                "--resolution", "64", "--num_steps", "4", "--max_sequence_length", "32",
                "--prompts_per_iter", "2", "--group_size", "3", "--n_mc", "2", "--lora_rank", "8",
                "--lora_alpha", "16", "--micro_batch", "6", "--rollout_batch", "6",
                "--reward_batch", "6", "--iterations", "1", "--eval_every", "1", "--n_eval", "2",
                "--save_every", "1"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def trace(out: str, argv: list[str]) -> int:
    """`python vgrpo.py argv` here, under the tracer; writes {sha256, argv, lines} to `out`."""
    path, hit = str(VGRPO), set()

    def lines(frame, event, arg):  # local tracer: every line event in vgrpo.py
        if event == "line":
            hit.add(frame.f_lineno)
        return lines

    def calls(frame, event, arg):  # global tracer: only vgrpo.py's frames get a local one
        if frame.f_code.co_filename != path:
            return None
        hit.add(frame.f_lineno)
        return lines

    sys.argv, status = [path, *argv], 0
    sys.settrace(calls)
    threading.settrace(calls)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        sys.settrace(None)
        threading.settrace(None)
    Path(out).write_text(json.dumps({"sha256": sha256(VGRPO), "argv": argv, "status": status,
                                     "lines": sorted(hit)}))
    print(f"{len(hit)} lines of vgrpo.py ran; exit {status}; written to {out}", file=sys.stderr)
    return status


def trace_fake_hub(out: str, argv: list[str]) -> int:
    """The headline command against a fake Hub of tiny models, traced in a fresh process."""
    sys.path[:0] = [str(ROOT / "examples" / "tools"), str(ROOT)]
    import fake_hub
    import tiny_models
    import vgrpo
    hub = fake_hub.FakeHub()
    with tempfile.TemporaryDirectory(prefix="trace_hub_") as tmp:
        repos = Path(tmp)
        tiny_models.build_tiny_sd3_pipeline().save_pretrained(repos / "sd3")
        tiny_models.save_tiny_clip(repos / "clip")
        hub.add_repo(vgrpo.MODEL_ALIASES["sd3.5-medium"], repos / "sd3")
        for repo in (vgrpo.Args.pickscore_model, vgrpo.Args.pickscore_processor):
            hub.add_repo(repo, repos / "clip")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        with hub:
            env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(repos / "hf_home"),
                       HF_HUB_DISABLE_XET="1")
            cmd = [sys.executable, __file__, "run", str(Path(out).absolute()), "--",
                   *FAKE_HUB_RUN, "--run_dir", str(repos / "run"), *argv]
            return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def report(traces: list[str], keep: tuple = ()) -> dict:
    """The sorted lines of vgrpo.py (see the module docstring), printed and returned; and the
    floor: the lines left when every line no trace ran leaves the file, but those of the
    functions named in `keep` and the unrun error paths of functions that ran (a function never
    called leaves whole: its docstring, its checks, the blank lines after it)."""
    src = VGRPO.read_text()
    text, tree, hit = src.splitlines(), ast.parse(src), set()
    for t in traces:
        data = json.loads(Path(t).read_text())
        if data["sha256"] != sha256(VGRPO):
            raise SystemExit(f"{t} traced another vgrpo.py (sha256 {data['sha256'][:12]}…)")
        hit |= set(data["lines"])
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    doc = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n):
            doc |= set(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    kind = {i: "blank" if not l.strip() else "comment" if l.strip().startswith("#") else
            "docstring" if i in doc else "code" for i, l in enumerate(text, 1)}
    owner = {}  # physical line → the innermost statement whose lines hold it (a compound one
    for n in ast.walk(tree):  # owns its header and `else:` lines); breadth first: inner ones win
        if isinstance(n, (ast.stmt, ast.ExceptHandler)):
            start = min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])
            owner.update(dict.fromkeys(range(start, n.end_lineno + 1), n))

    def on_error_path(n) -> bool:
        while n is not None:
            if isinstance(n, (ast.Raise, ast.ExceptHandler)) or (
                    isinstance(n, ast.If) and any(isinstance(s, ast.Raise) for s in n.body)):
                return True
            n = parent.get(n)
        return False

    def function(n) -> str:
        while n is not None and not isinstance(n, ast.FunctionDef):
            n = parent.get(n)
        return n.name if n is not None else "<module>"

    counts = {k: sum(v == k for v in kind.values()) for k in ("code", "docstring", "comment",
                                                            "blank")}
    ran, error, other, unrun = 0, 0, {}, set()
    for i in (i for i, k in kind.items() if k == "code" and i in owner):
        if owner[i].lineno in hit:
            ran += 1
        elif on_error_path(owner[i]):
            error += 1
        else:
            name = function(owner[i])
            other[name] = other.get(name, 0) + 1
            unrun |= {i} if name not in keep else set()
    gone = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef) and n.name not in keep:
            body = n.body[1:] if ast.get_docstring(n) else n.body
            if body and not any(s.lineno in hit for s in body):  # never called
                start = min([n.lineno] + [d.lineno for d in n.decorator_list])
                gone |= set(range(start, n.end_lineno + 1 + (2 if n in tree.body else 1)))
    stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)
             and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    r = dict(lines=len(text), **counts, statements=len(stmts),
             statements_run=sum(n.lineno in hit for n in stmts), code_ran=ran,
             code_error_not_run=error, code_other_not_run=sum(other.values()),
             other_by_function=dict(sorted(other.items(), key=lambda kv: (-kv[1], kv[0]))),
             floor=len(text) - len(gone | unrun), keep=sorted(keep))
    print(f"vgrpo.py: {r['lines']:,} lines = {r['code']:,} code + {r['docstring']} docstring + "
          f"{r['comment']} comment + {r['blank']} blank")
    print(f"statements run: {r['statements_run']:,} of {r['statements']:,}")
    print(f"code lines: {ran:,} ran; {error} on error paths that did not run; "
          f"{r['code_other_not_run']} other")
    print("other code lines not run, by function: " + ", ".join(
        f"{k} {v}" for k, v in r["other_by_function"].items()))
    print(f"floor: {r['floor']:,} lines, keeping " + (", ".join(r["keep"]) or "no unrun function"))
    return r


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    vgrpo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="trace `python vgrpo.py ARGS` (ARGS after --)")
    r.add_argument("out")
    r.add_argument("--fake_hub", action="store_true", help="the headline command, fake Hub")
    rep = sub.add_parser("report", help="sort vgrpo.py's lines by the traces")
    rep.add_argument("traces", nargs="+")
    rep.add_argument("--keep", default="", help="functions kept whole in the floor, a,b,c")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.cmd == "report":
        report(a.traces, tuple(filter(None, a.keep.split(","))))
        return 0
    return (trace_fake_hub if a.fake_hub else trace)(a.out, vgrpo_args)


if __name__ == "__main__":
    sys.exit(main())
