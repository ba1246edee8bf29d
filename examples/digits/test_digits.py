"""Tests of the digits benchmark (examples/digits/): a V-GRPO run on the committed model, the
build path, the statistics and plans on synthetic runs, both plans' machinery in miniature, and
report.md regenerated from the committed runs. `python -m pytest -q examples/digits`."""
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import vgrpo as V  # noqa: E402

HERE = ROOT / "examples" / "digits"
quiet = lambda s: None                                                      # noqa: E731


def _modules(monkeypatch, cache: Path | None = None):
    """examples.digits.model with its cache in `cache`, and bench, stats and report."""
    pytest.importorskip("sklearn")
    D = importlib.import_module("examples.digits.model")
    if cache is not None:
        monkeypatch.setattr(D, "CACHE", cache)
        monkeypatch.setattr(D, "_CLF", None)
        monkeypatch.setattr(D, "_REAL_FEAT", None)
    return (D, importlib.import_module("examples.digits.bench"),
            importlib.import_module("examples.digits.stats"),
            importlib.import_module("examples.digits.report"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: the small model gains nothing from a second, and on a
    loaded 2-core machine two threads made the V-GRPO run about 5× slower (182 s against 32 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    """A V-GRPO run of model.FAST_RL through vgrpo.py's command line on the committed model: its
    run folder (one checkpoint, at the last iteration)."""
    run = tmp_path_factory.mktemp("digits_run")
    with pytest.MonkeyPatch.context() as mp:
        D = _modules(mp, HERE / "model")[0]
        n = D.FAST_RL["iterations"]
        flags = D.vgrpo_flags(D.CACHE / "pipeline", 0, [
            "--iterations", str(n), "--run_dir", str(run), "--save_every", str(n),
            *D.FAST_RL["flags"]])
        assert V.main(flags) == 0
    return run


@pytest.mark.examples
def test_committed_model_loads_and_vgrpo_raises_heldout_accuracy(fast_run, monkeypatch):
    """The committed model loads through a stock StableDiffusion3Pipeline, is far above chance
    (0.10) on unseen phrasings and noise, and the V-GRPO run's LoRA, loaded through diffusers,
    raises held-out prompt accuracy on the same 200 prompts and noises (measured: +0.095 to
    +0.145 over seeds 0-2, see model.FAST_RL; asked: +0.06)."""
    from diffusers import StableDiffusion3Pipeline
    D = _modules(monkeypatch, HERE / "model")[0]
    pipe = StableDiffusion3Pipeline.from_pretrained(str(D.CACHE / "pipeline"),
                                                    torch_dtype=torch.float32)
    out = pipe(prompt="a handwritten digit 3", height=32, width=32, num_inference_steps=4,
               guidance_scale=1.0, max_sequence_length=D.SEQ_LEN, output_type="pt",
               generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()
    before = D.heldout_metrics(pipe, n_per=20)
    assert before["acc"] >= 0.5, before
    pipe.load_lora_weights(str(V.find_checkpoint(fast_run)))
    after = D.heldout_metrics(pipe, n_per=20)
    assert after["acc"] >= before["acc"] + 0.06, (before, after)


@pytest.mark.examples
def test_evaluate_digits_checkpoint_above_base(fast_run, tmp_path, monkeypatch):
    """examples/evaluate.py on the run's checkpoint and the unseen phrasings puts it above the
    base on the digit reward (the plug-in examples.digits:reward), its paired interval's lower
    end above +0.03."""
    D = _modules(monkeypatch, HERE / "model")[0]
    spec = importlib.util.spec_from_file_location("evaluate", ROOT / "examples" / "evaluate.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    out, n = tmp_path / "eval", D.FAST_RL["iterations"]
    assert ev.main(["--model", str(D.CACHE / "pipeline"), "--checkpoints", str(fast_run),
                    "--prompts", str(D.CACHE / "eval_prompts.txt"), "--rewards",
                    "examples.digits:reward", "--images_per_prompt", "4", "--num_steps", "10",
                    "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["resolution"] == 32 and res["settings"]["max_sequence_length"] == 32
    r = next(m for k, m in res["models"].items() if k.endswith(f"-it{n}"))
    r = r["rewards"]["examples.digits:reward"]
    assert r["diff"] > 0 and r["diff_ci"][0] > 0.03, r


@pytest.mark.examples
def test_build_writes_a_diffusers_folder_once(tmp_path, monkeypatch):
    """model.build (at model.TINY_BUILD's budgets) writes a folder that vgrpo's loader and a stock
    StableDiffusion3Pipeline load, with its classifier and prompt files; a second call with the
    same recipe reuses it; the committed build is never overwritten."""
    from diffusers import StableDiffusion3Pipeline
    D = _modules(monkeypatch, tmp_path)[0]
    folder = D.build(**D.TINY_BUILD, log=quiet)
    assert folder == tmp_path / "pipeline"
    info = json.loads((tmp_path / "build.json").read_text())
    assert info["recipe"]["pretrain_steps"] == D.TINY_BUILD["pretrain_steps"]
    assert 0 <= info["base"]["acc"] <= 1 and (tmp_path / "classifier.pt").is_file()
    assert len((tmp_path / "eval_prompts.txt").read_text().split()) >= 40
    assert D.load_pipe(folder).transformer.config.num_layers == 1
    StableDiffusion3Pipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    stamp = (tmp_path / "pipeline" / "model_index.json").stat().st_mtime_ns
    assert D.build(**D.TINY_BUILD, log=quiet) == folder
    assert (tmp_path / "pipeline" / "model_index.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="committed build"):
        D.build(D.MODEL, **D.TINY_BUILD, log=quiet)


# ------------------------------------------------------------------------------------------------
# The statistics on synthetic runs (no model)
# ------------------------------------------------------------------------------------------------
def _eval(r: float, n: int = 40, acc: float = 0.5, div: float = 1.0) -> dict:
    """A synthetic evaluation of n images: image i scores r + (i − (n − 1)/2)·1e-4 (mean r)."""
    img = [r + (i - (n - 1) / 2) * 1e-4 for i in range(n)]
    k = round(acc * n)
    return {"n": n, "acc": k / n, "reward": r, "diversity": div, "img_reward": img,
            "img_correct": "1" * k + "0" * (n - k), "img_div": [div] * n}


def _run(method, seed, its, rewards, steps=1, lr=1e-3, kind="confirm", key="raw", val=None):
    """A synthetic run: held-out reward curve `rewards` at iterations `its`, `steps` optimizer
    steps per iteration, a final validation evaluation `val`."""
    return {"kind": kind, "method": method, "lr": lr, "seed": seed, "eval_key": key,
            "iterations": its[-1], "final": {f"val_{key}": val} if val else {},
            "iters": [{"opt_steps": steps}] * its[-1],
            "evals": [{"iter": i, key: _eval(r)} for i, r in zip(its, rewards)]}


@pytest.mark.examples
def test_lr_choice_diversity_floor_amendment_and_fallback(monkeypatch):
    """The lr choice skips an lr whose validation diversity fell below 90 % of the base model's
    even though its reward is best; an EMA method is judged by the weights it evaluates; under
    the B = 128 plan's amendment an lr that ends below the base model's reward takes no part,
    and where no lr keeps the floor the most diverse of those above the base is chosen."""
    ST = _modules(monkeypatch)[2]
    plan = {"lrs": [1e-3, 3e-3], "diversity_keep": 0.9, "version": 2,
            "methods": ["V-GRPO", "DiffusionNFT"]}
    base = {"val": {"diversity": 1.0, "reward": 0.5}}
    results = {}
    for s in (0, 1):
        for m, lr, r, d, key in (("V-GRPO", 1e-3, 0.7, 0.95, "raw"),
                                 ("V-GRPO", 3e-3, 0.9, 0.8, "raw"),
                                 ("DiffusionNFT", 1e-3, 0.6, 1.0, "ema"),
                                 ("DiffusionNFT", 3e-3, 0.7, 1.0, "ema")):
            results[f"{m}{lr}{s}"] = _run(m, s, (0, 4), (0.5, r), lr=lr, kind="select", key=key,
                                          val=_eval(r, div=d))
    ch = ST.choose(results, plan, base)
    assert ch["V-GRPO"]["lr"] == 1e-3 and not ch["V-GRPO"]["fallback"]
    assert ch["DiffusionNFT"]["lr"] == 3e-3
    # a run broken below the base model's reward whose noisy images look diverse (1.3 ≥ 0.9)
    rows = [{"lr": 1e-3, "val_reward": 0.8, "val_diversity": 0.85},
            {"lr": 3e-3, "val_reward": 0.1, "val_diversity": 1.3}]
    assert ST.pick_lr(rows, plan, base) == (rows[1], False)
    assert ST.pick_lr(rows, dict(plan, lr_beats_base=True), base) == (rows[0], True)
    rows[0]["val_reward"] = 0.4                          # nothing above the base: the rule as is
    assert ST.pick_lr(rows, dict(plan, lr_beats_base=True), base) == (rows[1], False)


@pytest.mark.examples
def test_bootstrap_draws_one_image_resample_for_every_seed(monkeypatch):
    """One bootstrap draw resamples the images once and applies that resample to every seed and
    method; the seeds are resampled on top. Identical seeds get the same value in a draw; two
    methods that differ by a constant on every image differ by it in every draw (paired); the
    interval holds the mean."""
    import numpy as np
    ST = _modules(monkeypatch)[2]
    row = np.random.default_rng(1).random(60)
    X = np.stack([row, row, row])[:, None, :]                              # (S, E, n) = (3, 1, 60)
    M = ST.per_seed_reps(X)                                               # (B, S, E)
    assert np.allclose(M, M[:, :1]) and M[:, 0, 0].std() > 0
    assert np.allclose(ST.boot_curve(X + 0.25)[1] - ST.boot_curve(X)[1], 0.25)
    Z = np.stack([row, row + 0.5, row + 1.0])[:, None, :]
    spread = lambda W: np.diff(ST.interval(ST.boot_curve(W)[1][:, 0]))[0]
    assert spread(Z) > 5 * spread(X)
    p, reps = ST.boot_mean(X[:, 0])
    lo, hi = ST.interval(reps)
    assert p == pytest.approx(row.mean()) and lo < p < hi


@pytest.mark.examples
def test_claim_speedups_bounds_and_verdicts(monkeypatch):
    """V-GRPO's iterations to a baseline's final held-out reward are interpolated on its seed-mean
    curve; the speed-up B·u_b / (h·u_v) in iterations and gradient steps; a target V-GRPO never
    reaches bounds the speed-up by B·u_b / (Bv·u_v). Verdicts: agrees (above 1, reaching the
    factor), disagrees (below the factor, reached or not), inconclusive (the baseline still
    improving, never improving, or an interval holding 1 and the factor). The difference at the
    same spend compares the curves at the same iterations and at the same gradient steps."""
    ST = _modules(monkeypatch)[2]
    v = [_run("V", s, (0, 4, 8), (0.5, 0.7, 0.9), steps=2) for s in (0, 1)]
    base_line = lambda final, mid=None, steps=4: [
        _run("B", s, (0, 6, 8), (0.5, final if mid is None else mid, final), steps=steps)
        for s in (0, 1)]
    c = ST.claim(v, base_line(0.6))            # 0.6 crossed at h = 2: 8/2 = 4×, 8·4/(2·2) = 8×
    assert c["reached"] and c["vgrpo_iters"][0] == pytest.approx(2.0, rel=1e-3)
    assert c["ratio"]["iters"][0] == pytest.approx(4.0, rel=1e-3)
    assert c["ratio"]["steps"][0] == pytest.approx(8.0, rel=1e-3)
    assert c["vgrpo_final"][0] == pytest.approx(0.9)
    rule = lambda b, factor, still=False: ST.verdict(ST.claim(v, b), factor, "iters", still)[0]
    assert rule(base_line(0.6), 2.0) == "agrees"
    assert rule(base_line(0.8), 2.0) == "disagrees"                      # h = 6: 1.33×
    assert rule(base_line(0.6), 2.0, still=True) == "inconclusive"
    assert rule(base_line(0.5), 2.0) == "inconclusive"                   # never improved
    never = ST.claim(v, base_line(0.95))
    assert not never["reached"] and never["seeds_reached"] == 0
    assert never["bound"]["steps"] == pytest.approx(8 * 4 / (8 * 2))
    assert never["ratio"]["iters"][1:] == pytest.approx((0.0, 1.0))
    assert ST.verdict(never, 2.0, "iters", False)[0] == "disagrees"
    # one seed reaches 0.7 at iteration 2, the other never: the draws span 0 to 4
    split = [_run("V", 0, (0, 4, 8), (0.5, 0.9, 0.9)), _run("V", 1, (0, 4, 8), (0.5,) * 3)]
    c = ST.claim(split, base_line(0.7))
    assert c["ratio"]["iters"][1] <= 1 and c["ratio"]["iters"][2] >= 2.0
    assert ST.verdict(c, 2.0, "iters", False)[0] == "inconclusive"
    # the last-quarter change: 0.55 → 0.6 over the last 2 of 8 iterations
    assert ST.last_quarter_gain(base_line(0.6, mid=0.55))[0] == pytest.approx(0.05)
    # at the same spend: both ran 8 iterations (0.9 against 0.6); in gradient steps both reached
    # 16, V's whole run (2 per iteration) and B's first 4 iterations (4 per iteration)
    d = ST.same_spend(v, base_line(0.6))
    assert d["iters"][0] == pytest.approx(0.9 - 0.6, abs=1e-6)
    assert d["steps"][0] == pytest.approx(0.9 - (0.5 + 0.1 * 4 / 6), abs=1e-6)


@pytest.mark.examples
def test_verdict_reads_the_gain_over_base_by_its_lower_end(monkeypatch):
    """"The baseline did not improve on the base model" is judged by the lower end of the gain's
    interval: a gain whose point is above 0 but whose interval reaches below 0 is inconclusive,
    even where the speed-up's interval alone (above 1, reaching the factor) would agree; with
    the lower end above 0 the same claim agrees."""
    ST = _modules(monkeypatch)[2]
    claim = lambda gain: {"gain_over_base": gain, "ratio": {"iters": (3.0, 1.5, 4.0)}}
    assert ST.verdict(claim((0.05, -0.01, 0.11)), 2.0, "iters", False) == (
        "inconclusive", "the baseline did not improve on the base model")
    assert ST.verdict(claim((0.05, 0.01, 0.09)), 2.0, "iters", False)[0] == "agrees"
    assert ST.verdict(claim((-0.02, -0.05, 0.01)), 2.0, "iters", False)[0] == "inconclusive"


@pytest.mark.examples
def test_follow_up_settled_rule(monkeypatch):
    """The follow-up's rule: the speed-up with the baseline cut off at ½ and ¾ of its budget lies
    inside the interval of the speed-up at the whole budget. A V-GRPO curve that is the
    baseline's compressed 2× gives 2× at every cut-off: settled. One that creeps while the
    baseline still rises gives 4× at ½ and 2× at the end: not settled. One V-GRPO never lifts
    off the base is below its bound at every cut-off: settled, and the claim disagrees."""
    ST = _modules(monkeypatch)[2]
    curve = (0.5, 0.6, 0.7, 0.8, 0.9)
    base = [_run("N", s, (0, 4, 8, 12, 16), curve) for s in (0, 1)]
    fast = [_run("V", s, (0, 2, 4, 6, 8), curve) for s in (0, 1)]
    assert [ST.cut_off(base, f * 16)[0]["iterations"] for f in (0.5, 0.75)] == [8, 12]
    assert ST.settled(fast, base, "iters")
    slow = [_run("V", s, (0, 2, 4, 6, 8), (0.5, 0.7, 0.75, 0.85, 0.9)) for s in (0, 1)]
    pts = [ST.cut_point(ST.claim(slow, ST.cut_off(base, f * 16)), "iters") for f in (0.5, 1)]
    assert pts == pytest.approx([4.0, 2.0], rel=1e-3)
    assert not ST.settled(slow, base, "iters")
    flat = [_run("V", s, (0, 2, 4, 6, 8), (0.5,) * 5) for s in (0, 1)]
    assert ST.settled(flat, base, "iters")
    assert ST.verdict(ST.claim(flat, base), 1700 / 580, "iters", False)[0] == "disagrees"


# ------------------------------------------------------------------------------------------------
# The plans, fixed in code before their runs
# ------------------------------------------------------------------------------------------------
@pytest.mark.examples
def test_plans_fixed_before_their_runs(monkeypatch):
    """The B = 128 plan: B ≥ 128, the lr grid, selection and confirmation seeds apart, every
    selection run before any confirmation run, which waits only for its own method's; MixGRPO's
    window inside the published σ range; DiffusionNFT's scaled decay reaching the published
    plateau in B. The follow-up: fresh seeds 7-11, Run A at one lr, Run B at the B = 128 plan's
    choices, the V-GRPO runs shared, the timing run first, every cut-off an evaluation."""
    _, BENCH, _, _ = _modules(monkeypatch)
    mix, nft = BENCH.example("mix_grpo_sd3"), BENCH.example("diffusion_nft_sd3")
    P = BENCH.PLANS["regime"]
    assert P["iterations"] >= 128 and P["lrs"] == [3e-4, 1e-3, 3e-3, 1e-2]
    assert not set(P["selection_seeds"]) & set(P["confirmation_seeds"])
    assert len(P["confirmation_seeds"]) >= 5 and P["claims_vgrpo"] in P["methods"]
    assert BENCH.CONFIGS[BENCH.VGEN]["flags"] == [
        "--n_mc", "10", "--mu", "2", "--clip_eps", "1e-2", "--soft_clip_eta", "0"]
    jobs = BENCH.jobs_of(P)
    kinds = [j["kind"] for j in jobs]
    assert kinds.index("confirm") > max(i for i, k in enumerate(kinds) if k == "select")
    conf = next(j for j in jobs if j["kind"] == "confirm" and j["method"] == "MixGRPO")
    need = BENCH.needs(conf, jobs)
    assert len(need) == 8 and all(i.startswith("select__mixgrpo__") for i in need)
    assert len({j["id"] for j in jobs}) == len(jobs)
    low, high = mix.published_sigma_range()
    sig = torch.tensor([1 - i * 0.999 / 9 for i in range(10)] + [0.0])   # the digits grid
    trained = mix.sigmas_trained(mix.in_range_recipe(10, 128, sig), sig, 128)
    assert min(trained) >= low and high == 1.0 and len(trained) >= 2
    over = BENCH.nft_overrides(BENCH.CONFIGS["DiffusionNFT (decay scaled)"], 128)
    assert nft.return_decay(128, 0, nft.RECIPE["decay_uprate"], 0.5) < 0.2
    assert nft.return_decay(128, 0, over["decay_uprate"], 0.5) == 0.5
    F = BENCH.PLANS["followup"]
    assert F["confirmation_seeds"] == [7, 8, 9, 10, 11]
    assert not set(F["confirmation_seeds"]) & set(P["selection_seeds"] + P["confirmation_seeds"])
    comps = {c["name"]: c for c in F["comparisons"]}
    v = [BENCH.VGEN, 1e-3, 160]
    assert comps["Run A"]["vgrpo"] == comps["Run B"]["vgrpo"] == v
    assert comps["Run A"]["baseline"] == ["DiffusionNFT", 1e-3, 160]
    assert comps["Run B"]["baseline"] == ["DiffusionNFT", 3e-4, 384]
    jobs = BENCH.jobs_of(F)
    assert len({j["id"] for j in jobs}) == len(jobs) == 1 + 3 * 5 and jobs[0]["kind"] == "timing"
    fixed = jobs[1:]
    assert [(j["method"], j["lr"], j["seed"]) for j in fixed[:2]] == [
        (BENCH.VGEN, 1e-3, 7), ("DiffusionNFT", 1e-3, 7)]
    assert all(j["iterations"] == 384 for j in fixed[10:])
    for j in fixed:
        assert all((f * j["iterations"]) % BENCH.eval_every_of(F, j) == 0 for f in F["cutoffs"])


# ------------------------------------------------------------------------------------------------
# Both plans' machinery in miniature, on the committed model
# ------------------------------------------------------------------------------------------------
@pytest.mark.examples
def test_smoke_plan_end_to_end(tmp_path, monkeypatch):
    """The B = 128 plan's machinery in miniature (every kind of run: selection, confirmation, a
    variant, timing, a knob swap with V-GRPO's tracked EMA, an N_MC run) in one worker, then a
    report on its folder; a second invocation finds nothing to do; every run checks the model
    against base.json's fingerprint."""
    D, BENCH, _, REP = _modules(monkeypatch, HERE / "model")
    out = tmp_path / "bench"
    BENCH.benchmark(out, "smoke", workers=1, threads=1, log=quiet)
    plan = json.loads((out / "plan.json").read_text())
    res = BENCH.load_results(out)
    assert {j["id"] for j in BENCH.jobs_of(plan)} == set(res) and not list(out.glob("*.failed"))
    mix = res["confirm__mixgrpo__chosen__s1"]
    assert min(mix["recipe"]["sigma_trained"]) >= 0.70
    swap = res["swap__v_grpo__lr0.003__s0"]
    assert swap["eval_key"] == "raw" and {"heldout_raw", "heldout_ema"} <= set(swap["final"])
    assert swap["final"]["heldout_raw"]["img_reward"] != swap["final"]["heldout_ema"]["img_reward"]
    BENCH.benchmark(out, "smoke", workers=1, threads=1, log=quiet)
    assert BENCH.load_results(out) == res
    md = REP.report(tmp_path / "rep", out, None, None, with_figure=False)
    for head in ("## Each method at its chosen lr", "## The paper's claims",
                 "## V-GRPO against DiffusionNFT at the same lr", "## How each lr was chosen"):
        assert head in md, head
    assert "| DiffusionNFT (2.9×) | B = 2 plan" in md and "| MixGRPO (2×) | B = 2 plan" in md
    base = json.loads((out / "base.json").read_text())
    assert base["model_fingerprint"] == BENCH.model_fingerprint()
    with pytest.raises(RuntimeError, match="not the one this benchmark"):
        BENCH.check_model(dict(base, model_fingerprint="0" * 16))


@pytest.mark.examples
def test_followup_plan_end_to_end(tmp_path, monkeypatch):
    """The follow-up's machinery in miniature: the timing run of both methods at the lrs the
    B = 128 plan chose, every fixed run with its own budget, lr and evaluation schedule (the
    longer run evaluated at its cut-offs), V-GRPO (GenEval-stage) taking μ = 2 steps."""
    D, BENCH, ST, _ = _modules(monkeypatch, HERE / "model")
    out = tmp_path / "followup"
    BENCH.benchmark(out, "followup-smoke", workers=1, threads=1, log=quiet)
    plan = json.loads((out / "plan.json").read_text())
    res = BENCH.load_results(out)
    assert {j["id"] for j in BENCH.jobs_of(plan)} == set(res) and not list(out.glob("*.failed"))
    assert set(res["timing__all__fixed__s0"]["lrs"]) == {BENCH.VGEN, "DiffusionNFT"}
    long_ = res["fixed__diffusionnft__lr0.0003__B4__s0"]
    assert [e["iter"] for e in long_["evals"]] == [0, 2, 4] and long_["lr"] == 3e-4
    v = res["fixed__v_grpo__geneval_stage__lr0.001__B2__s0"]
    assert [e["iter"] for e in v["evals"]] == [0, 1, 2] and v["lr"] == 1e-3
    assert sum(x["opt_steps"] for x in v["iters"]) == 2 * 2
    assert len(v["final"]["heldout_raw"]["img_reward"]) == 40                # 4 × 10 images
    assert ST.cut_off([long_], 0.75 * 4)[0]["iterations"] == 2
    assert ST.claim([v], [long_])["B"] == 4


# ------------------------------------------------------------------------------------------------
# The committed model and report
# ------------------------------------------------------------------------------------------------
@pytest.mark.examples
def test_committed_runs_used_the_committed_model(monkeypatch):
    """Both committed plans' base.json name the fingerprint of the one committed model (model/),
    the default cache of every command."""
    D, BENCH, _, _ = _modules(monkeypatch)
    monkeypatch.setattr(D, "CACHE", D.MODEL)
    fp = BENCH.model_fingerprint()
    for folder in ("results", "results_followup"):
        assert json.loads((HERE / folder / "base.json").read_text())["model_fingerprint"] == fp
    with pytest.raises(ValueError, match="committed build"):
        D.build(D.MODEL, pretrain_steps=1, log=quiet)


@pytest.mark.examples
def test_report_regenerates_from_the_committed_runs(tmp_path, monkeypatch):
    """report.md, written again from the committed runs into a temporary folder, is the committed
    one to the byte, and gives each claim its verdict."""
    REP = _modules(monkeypatch)[3]
    md = REP.report(tmp_path)
    assert md == (HERE / "report.md").read_text()
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    claims = md.split("## The paper's claims", 1)[1].split("\n\n", 2)[1]
    assert "DiffusionNFT's reward" in claims.split("\n")[2] and "**disagrees**" in claims
    assert "MixGRPO's reward" in claims.split("\n")[3] and "**inconclusive**" in claims
