"""Tests of the GPU measurement scripts in examples/gpu/, on the CPU with the tiny models: the SD3
variance diagnostics (sd3_diagnostics.py); gpu_check.py's throughput levers (the trainer's
--compile, with the cheap dynamo backends the CPU allows; the CUDA-graph lever's bookkeeping with
its CPU stand-in), its FLOP count of the passes that ran, its CPU smoke run of every stage; and
mfu_restate.py's recomputed MFU of the stored GPU rows. CPU only, offline:
`python -m pytest -q examples/gpu`.

Every test carries one tier marker (pytest.ini); shared helpers (TM, _load_example) and the
autouse fixture that restores torch's SDPA switches after each test are in the repository's
conftest.py.
"""
import json
import math

import pytest
import torch

import vgrpo as V
from conftest import TM, _load_example


# ------------------------------------------------------------------------------------------------
# examples/gpu/sd3_diagnostics.py: the SD3 variance diagnostics
# ------------------------------------------------------------------------------------------------
@pytest.mark.examples
def test_sd3_diagnostics_variance_reduction(tmp_path):
    """Each variance-reduction technique lowers the statistic it targets (paper P4–P8), on one fixed
    rollout batch of the tiny SD3 pipeline (P×G = 2×4, K = 8, N_MC = 4, 4 pair draws, per-sample
    gradients on 2 of them).

    Measured (2-core CPU, 1 thread), seeds 0 / 1 / 2 / 3 (this test runs seed 0):
        within-group CV   V-GRPO 0.016 0.014 0.012 0.016   − pair sharing 0.068 0.064 0.061 0.064
        batch CV          V-GRPO 0.017 0.015 0.014 0.017   naive          0.043 0.038 0.036 0.037
        within-group CV   x-MSE without adaptive weighting 0.031 0.030 0.026 0.027
        CV across draws   V-GRPO 0.079 0.034 0.064 0.035   − stratification 0.362 0.326 0.148 0.083
        cos(g, g')        V-GRPO 0.913 0.869 0.884 0.924   − pair sharing 0.536 0.679 0.557 0.512
    Worst ratios over those seeds: 0.25 (sharing), 0.46 (naive), 0.60 (adaptive), 0.43
    (stratification); worst cosine gap 0.19. The thresholds below leave margin to all of them.
    Not asserted: the gradient-norm/|S| correlation (R²), which on this random model is at noise
    level (|r| ≲ 0.3 over 8 samples) and flips order between seeds; and anything about the v-space
    variants, whose loss scale does not depend on t for a random network (see the script's notes).
    """
    diag = _load_example("gpu/sd3_diagnostics")
    out = tmp_path / "diag.md"
    rows = diag.main(["--prompts_per_iter", "2", "--group_size", "4", "--draws", "4", "--grad_draws", "2",
                      "--seed", "0", "--out", str(out)])
    r = {row["variant"]: row for row in rows}
    assert [row["variant"] for row in rows] == [v[0] for v in diag.VARIANTS]
    for row in rows:
        for k in ("cv_batch", "cv_group", "cv_draws", "mean_abs_S", "mean_grad_norm", "r2_quad_batch",
                  "r2_quad_pooled", "grad_cos"):
            assert math.isfinite(row[k]), (row["variant"], k)
        assert row["mean_grad_norm"] > 0
    on = r["V-GRPO (all on)"]
    assert on["cv_group"] < 0.5 * r["− pair sharing"]["cv_group"]                # (1) shared pairs
    assert on["cv_batch"] < 0.7 * r["naive (all off)"]["cv_batch"]                 # all three together
    assert on["cv_group"] < 0.8 * r["− adaptive weighting (x-MSE)"]["cv_group"]    # (3b) self-normalisation
    assert on["cv_draws"] < 0.75 * r["− stratification"]["cv_draws"]               # (2) stratified t
    assert on["grad_cos"] > r["− pair sharing"]["grad_cos"] + 0.1                  # steadier update direction
    text = out.read_text()
    assert "| V-GRPO (all on) |" in text and "CV group" in text


# ------------------------------------------------------------------------------------------------
# examples/gpu/gpu_check.py: the throughput levers, the FLOP count and the CPU smoke run
#    Each lever changes how the same numbers are computed, not what is computed. `compile` is the
#    trainer's own --compile (here with a cheap dynamo backend: inductor takes minutes on a CPU);
#    the others are experiments applied to a live Run from outside.
# ------------------------------------------------------------------------------------------------
LEVER = ["--model", "tiny", "--reward", "jpeg", "--prompts_per_iter", "2", "--group_size", "3",
         "--num_steps", "4", "--eval_every", "0", "--device", "cpu"]


def _lever_run(names=(), its=2, extra=(), backend="aot_eager", stats=None):
    """setup() on a fresh tiny pipeline with LoRA B ≠ 0 (the default init B = 0 would make a merge
    a no-op), then `its` iterations with gpu_check's levers `names`; `compile` becomes the
    trainer's --compile (compiled in setup, with `backend`). Returns (run, metrics)."""
    gc = _load_example("gpu/gpu_check")
    flags = LEVER + list(extra) + (["--compile"] if "compile" in names else ["--no-compile"])
    with gc.compile_backend(backend):
        run = V.setup(V.parse_args(flags), pipe=TM.build_tiny_sd3_pipeline())
    g = torch.Generator().manual_seed(1)
    for n, p in run.adapter.transformer.named_parameters():
        if "lora_B" in n:
            p.data = 0.05 * torch.randn(p.shape, generator=g)
    with gc.levers(run, [n for n in names if n != "compile"], stats):
        return run, [V.iteration(run, it) for it in range(its)]


@pytest.mark.examples
def test_lora_merge_restores_every_weight_bit_for_bit():
    """gpu_check.lora_merged: inside, the base weights hold W + (α/r)·B·A and a forward equals the
    unmerged one up to rounding; after, every parameter (base and LoRA) is bit-identical."""
    gc = _load_example("gpu/gpu_check")
    run, _ = _lever_run(its=0)
    ad, tr = run.adapter, run.adapter.transformer
    before = {n: p.detach().clone() for n, p in tr.named_parameters()}
    x = torch.randn((3,) + run.D, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.2, 0.5, 0.9])
    c = ad.encode(["a cat", "a dog", "a bird"])
    with torch.no_grad():
        v_ref = ad.velocity(x, t, c)
        with gc.lora_merged(tr):
            v_merged = ad.velocity(x, t, c)
            changed = [n for n, p in tr.named_parameters() if not torch.equal(p, before[n])]
            assert changed and all("base_layer.weight" in n for n in changed)
    # fp32: merged W x vs W x + B(A x) differ by summation order only; |v| ~ 1 on the tiny model
    assert torch.allclose(v_merged, v_ref, atol=1e-5, rtol=1e-5)
    for n, p in tr.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed"
    with pytest.raises(RuntimeError, match="inside"):       # restored even when the body raises
        with gc.lora_merged(tr):
            raise RuntimeError("inside")
    for n, p in tr.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed after an exception"


@pytest.mark.examples
def test_levers_keep_ratio_one_and_the_same_run():
    """Every CPU lever (merged-LoRA rollouts, the math / flash SDPA kernel, a bf16 VAE decode, the
    CUDA-graph lever's CPU stand-in, and the trainer's own --compile with the aot_eager backend)
    keeps ρ ≡ 1 at μ = 1, leaves the frozen weights and torch's switches as they were, and gives
    the same gradient norm as the plain run up to fp32 summation order (1e-4 relative is ~1000×
    the rounding seen); the JPEG reward is a step function of the pixels, so it is compared
    loosely. --compile compiles every block in setup (run.time_compile), the others none."""
    import torch._dynamo
    sw = torch.backends.cuda
    switches = (sw.flash_sdp_enabled(), sw.math_sdp_enabled())
    ref, m_ref = _lever_run(its=1)
    frozen = {n: p for n, p in ref.adapter.transformer.named_parameters() if "lora_" not in n}
    for names in (["merge_lora_rollout"], ["attn_flash"], ["vae_autocast"], ["cudagraphs"],
                  ["compile"]):
        torch._dynamo.reset()
        stats = {}
        run, m = _lever_run(names, its=1, stats=stats)
        assert m[0]["abs_log_ratio"] == 0.0 and m[0]["ratio"] == 1.0, names
        assert m[0]["abs_log_ratio_first"] == 0.0, names
        assert m[0]["grad_norm"] == pytest.approx(m_ref[0]["grad_norm"], rel=1e-4), names
        assert m[0]["reward_mean"] == pytest.approx(m_ref[0]["reward_mean"], abs=0.05), names
        for n, p in run.adapter.transformer.named_parameters():
            assert "lora_" in n or torch.equal(p, frozen[n]), f"{names}: {n} changed"
        assert (sw.flash_sdp_enabled(), sw.math_sdp_enabled()) == switches
        blocks = V.transformer_blocks(run.adapter.transformer)
        compiled = names == ["compile"]
        assert run.compiled is compiled and (run.time_compile > 0) is compiled, names
        assert all((b._compiled_call_impl is not None) is compiled for b in blocks), names
        assert "decode" not in run.adapter.__dict__ and "velocity" not in run.adapter.__dict__
        assert V.rollout.__name__ == "rollout"
        if names == ["cudagraphs"]:          # 6 samples in one rollout chunk: one shape, 4 steps
            assert stats == {"cudagraph_graphs": 1, "cudagraph_replays": 4,
                             "cudagraph_rel_diff": 0.0}
    torch._dynamo.reset()


@pytest.mark.examples
def test_cudagraph_lever_replays_the_plain_rollout():
    """gpu_check.GraphedVelocity, with the CPU stand-in for a CUDA graph (static input buffers, one
    static output): a DPM-Solver++(2M) rollout of the tiny FLUX model (it keeps the previous
    prediction, so an uncloned static output would corrupt it) is bit-identical to the plain one,
    one graph serves every step of one shape, a second shape gets its own, and calls with grad
    enabled never replay."""
    gc = _load_example("gpu/gpu_check")
    args = V.parse_args(["--model", "tiny-flux", "--reward", "jpeg", "--device", "cpu",
                         "--num_steps", "4"])
    ad = V.make_adapter(TM.build_tiny_flux_pipeline(), args, torch.device("cpu"))
    assert args.solver == "dpmpp2m"
    cond, sig = ad.encode(["a cat", "a dog"]), ad.sigmas(4)
    x1 = torch.randn((5,) + ad.latent_shape(64), generator=torch.Generator().manual_seed(3))
    idx = torch.tensor([0, 1, 0, 1, 1])
    ctx = torch.autocast("cpu", enabled=False)
    with torch.no_grad():
        plain = V.rollout(ad, x1, cond, idx, sig, "dpmpp2m", 3, ctx)   # chunks of 3 and 2 rows
        gv = gc.GraphedVelocity(ad.velocity, gc.standin_capture)
        ad.velocity = gv
        try:
            graphed = V.rollout(ad, x1, cond, idx, sig, "dpmpp2m", 3, ctx)
            again = V.rollout(ad, x1, cond, idx, sig, "dpmpp2m", 3, ctx)
        finally:
            del ad.velocity
    assert torch.equal(graphed, plain) and torch.equal(again, plain)
    assert len(gv.graphs) == 2 and gv.replays == 2 * 2 * 4 and gv.max_rel_diff == 0.0
    x, t, c = x1[:3], torch.full((3,), 0.5), V.select(cond, idx[:3])
    with torch.no_grad():
        a = gv(x, t, c)
        b = gv(x + 1, t, c)                    # a second replay must not overwrite the first
    assert not torch.equal(a, b) and torch.equal(a, ad.velocity(x, t, c).detach())
    with torch.enable_grad():
        gv(x, t, c)
    assert gv.replays == 2 * 2 * 4 + 2


@pytest.mark.examples
def test_flop_count_counts_only_the_passes_that_ran():
    """gpu_check's FLOP count takes θ_old's forwards from the iteration's nfe_old: none at μ = 1
    (S_old comes from the first step's own forward), N_MC·(μ−1)/μ at μ > 1. At μ = 1 the count per
    sample is K + 3·N_MC, below the K + 4·N_MC that counting the θ_old pass would give; the update
    phase's MFU divides by θ_old's and the update's seconds."""
    gc = _load_example("gpu/gpu_check")
    K, J, N = 4, 4, 6
    for mu, nfe_old in ((1, 0.0), (2, J * (2 - 1) / 2)):
        run = V.setup(V.parse_args(LEVER + ["--mu", str(mu), "--no-compile"]),
                      pipe=TM.build_tiny_sd3_pipeline())
        m = V.iteration(run, 0)
        assert m["nfe_old"] == nfe_old and m["nfe_theta"] == J and m["nfe_rollout"] == K
        assert gc.flop_forwards(m) == (K, nfe_old + 3 * J)
        f = gc.mfu_fields(1e9, N, m, wall=2.0, peak_tflops=1.0)
        assert f["forwards_per_sample"] == K + nfe_old + 3 * J
        assert f["TFLOP_iter"] * 1e12 == pytest.approx(1e9 * N * (K + nfe_old + 3 * J))
        assert f["update_MFU_%"] == pytest.approx(
            100 * 1e9 * N * (nfe_old + 3 * J) / (m["time_old"] + m["time_update"]) / 1e12)
        assert f["rollout_MFU_%"] == pytest.approx(100 * 1e9 * N * K / m["time_rollout"] / 1e12)
        if mu == 1:                                     # the θ_old pass did not run: not counted
            assert f["forwards_per_sample"] < K + J + 3 * J
    assert gc.flop_forwards({**m, "skipped": True}) == (K, nfe_old)    # no update, no θ passes


@pytest.mark.examples
def test_mfu_restate_recomputes_the_stored_rows():
    """examples/gpu/mfu_restate.py: the stored rows' MFU with only the passes that ran (the numbers
    docs/gpu.md quotes). Rows measured before θ_old's pass was folded into the first step keep
    their MFU (the pass ran then); the μ = 1 rows after it lose the N_MC θ_old forwards; the flow
    rows gain the rollout they had left out."""
    mr = _load_example("gpu/mfu_restate")
    rows = {(f, s, r["config"]): r for f, s, r in mr.main()}
    lf, old = "gpu_check_h200_levers_flow.json", "gpu_check_h200.json"
    base, comp = rows[(lf, "levers", "baseline")], rows[(lf, "levers", "compile")]
    assert base["MFU_%"] == pytest.approx(base["stored_MFU_%"] * 52 / 56)       # K + 3J of K + 4J
    assert (round(base["MFU_%"], 2), round(comp["MFU_%"], 2)) == (18.16, 35.53)
    assert (round(comp["rollout_MFU_%"], 2), round(comp["update_MFU_%"], 2)) == (39.56, 33.28)
    d = rows[(old, "configs", "default")]
    assert d["nfe_old"] == 4 and d["MFU_%"] == pytest.approx(d["stored_MFU_%"])
    fx = rows[("gpu_check_h200_flux.json", "configs", "flux_default")]
    assert fx["MFU_%"] == pytest.approx(fx["stored_MFU_%"])
    v = rows[(lf, "flow", "V-GRPO")]
    assert v["stored_MFU_%"] < 4 and round(v["MFU_%"], 2) == 16.73


@pytest.mark.examples
def test_gpu_check_smoke_runs_every_stage(tmp_path):
    """examples/gpu/gpu_check.py --cpu_smoke: the one-run GPU measurement, on the tiny models, writes
    its JSON and markdown with a row per lever, memory candidate, method and FLUX configuration.
    The baseline runs with --no-compile and the compile row with the trainer's --compile (its
    seconds in time_compile); every lever keeps ρ = 1 at μ = 1; the FLOP count per sample is
    K + 3·N_MC at μ = 1 and K + N_MC·3/4 + 3·N_MC at FLUX's μ = 4, where the first optimizer
    step's |log ρ| is 0. (merge_lora_rollout and attn_flash are covered above; left out for time.)"""
    gc = _load_example("gpu/gpu_check")
    out = tmp_path / "gc.json"
    gc.main(["--cpu_smoke", "--levers", "compile,attn_cudnn,vae_autocast,cudagraphs",
             "--flow_iterations", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    lev = {r["config"]: r for r in data["levers"]}
    assert {"baseline", "compile", "vae_autocast", "cudagraphs"} <= set(lev)
    for name in ("baseline", "compile", "vae_autocast", "cudagraphs"):
        r = lev[name]
        assert "error" not in r and r["abs_log_ratio"] == 0.0 and r["reward_finite"]
        assert r["fwd_TFLOP_per_sample"] > 0 and r["forwards_per_sample"] == 4 + 3 * 4
        assert r["MFU_%"] > 0 and r["rollout_MFU_%"] > 0 and r["update_MFU_%"] > 0
        assert r["compiled"] is (name in ("compile", "cudagraphs"))
    assert lev["compile"]["time_compile"] > 0 and lev["baseline"]["time_compile"] == 0
    assert lev["cudagraphs"]["cudagraph_graphs"] == 1 and "speedup_vs_compile" in lev["cudagraphs"]
    assert lev["baseline"]["iterations"] == 2 and "first_minus_steady_s" in lev["baseline"]
    assert "CUDA-only" in lev["attn_cudnn"]["skipped"]
    mem = data["memory"]
    assert [r["config"] for r in mem] == [f"80 GB: {n}" for n in gc.MEMORY_CANDIDATES]
    assert all("error" not in r and r["fits"] is None for r in mem)      # no limit on the CPU
    flow = {r["config"]: r for r in data["flow"]}
    if hasattr(gc.load_flow_example(), "RECIPES"):
        v, f = flow["V-GRPO"], flow["Flow-GRPO"]
        assert v["images_per_iter"] == f["images_per_iter"] == 4
        assert f["nfe_rollout"] == 2 * 4                  # CFG: 2 rows per SDE step (4 in the smoke)
        for r in (v, f):
            assert r["s_per_1000_images"] == pytest.approx(1000 * r["time_iter"] / 4)
            assert r["abs_log_ratio_first"] < 1e-5
            assert r["rollout_MFU_%"] > 0                 # the rollout is counted
    else:
        assert "older version" in flow["Flow-GRPO vs V-GRPO"]["skipped"]
    flux = {r["config"]: r for r in data["flux"]}
    fd = flux["flux_default"]
    assert "error" not in fd and fd["P×G"] == "1×4" and fd["mu"] == 4 and not fd["compiled"]
    assert fd["abs_log_ratio_first"] == 0.0 and fd["nfe_old"] == 3          # 4 · (4 − 1) / 4
    assert fd["forwards_per_sample"] == 4 + 3 + 3 * 4
    fc = next(r for n, r in flux.items() if n.startswith("flux_default + compile"))
    assert "error" not in fc and fc["compiled"] and fc["abs_log_ratio_first"] == 0.0
    md = out.with_suffix(".md").read_text()
    assert "## levers" in md and "## memory" in md and "## flux" in md


@pytest.mark.examples
def test_phase_peaks_attribute_memory_to_each_phase():
    """gpu_check.phase_peaks around one V-GRPO iteration, with a fake allocator whose every read
    returns the next integer: the counter is reset at the start and end of each of the four phases
    vgrpo.timed names (rollout, reward, θ_old, update), each phase gets the read at its end, "all"
    also the reads between them, and vgrpo.timed is restored afterwards, also after an error."""
    gc = _load_example("gpu/gpu_check")
    run = V.setup(V.parse_args(LEVER + ["--no-compile"]), pipe=TM.build_tiny_sd3_pipeline())
    reads, resets = iter(range(1, 100)), []
    real = V.timed
    with gc.phase_peaks(lambda: next(reads), lambda: resets.append(1)) as peaks:
        assert V.timed is not real
        m = V.iteration(run, 0)
    assert V.timed is real and m["abs_log_ratio_first"] == 0.0
    assert peaks == {"time_rollout": [2], "time_reward": [4], "time_old": [6],
                     "time_update": [8], "all": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    assert len(resets) == 8 and set(gc.PHASE_PEAKS) == set(peaks) - {"all"}
    with pytest.raises(RuntimeError, match="inside"):
        with gc.phase_peaks(lambda: 0.0, lambda: None):
            raise RuntimeError("inside")
    assert V.timed is real


@pytest.mark.examples
def test_gpu_check_plugins_stage_on_the_tiny_pipelines(tmp_path, monkeypatch):
    """examples/gpu/gpu_check.py --stages plugins --cpu_smoke: the plugins stage's code path on
    each plug-in's tiny pipeline (its TINY builder in place of build_real_size_pipeline). Every
    plug-in vgrpo finds with a real-size builder gets rows, named by its first alias; the text
    encoders are offloaded exactly when the weights exceed half of --card_GiB (chosen between
    the tiny pipelines' sizes, so both cases run); an out-of-memory (injected in the update of
    every micro-batch above 1) is a row, followed by the next fallback that changes the run
    (gradient checkpointing, skipped where the defaults already have it, then micro-batch 1),
    which fits. Its rows hold finite times and |log ρ| = 0 at the first step; peak memory is
    NaN on the CPU."""
    gc = _load_example("gpu/gpu_check")
    found = gc.real_size_plugins()
    assert {"qwen_image", "flux2", "z_image"} <= set(found)
    weights = {n: gc.pipeline_weights(getattr(m, next(iter(m.TINY.values())))())[0]
               for n, m in found.items()}
    lo, hi = min(weights.values()), max(weights.values())
    assert lo < hi
    card = lo + hi                                 # half of it lies between the two sizes
    real = V.update_steps

    def oom(run, *a, **k):
        if run.args.micro_batch > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(run, *a, **k)
    monkeypatch.setattr(V, "update_steps", oom)
    out = tmp_path / "gc.json"
    gc.main(["--cpu_smoke", "--stages", "plugins", "--card_GiB", str(card), "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"info", "warmup", "plugins"}             # no SD3 or FLUX.1 stage ran
    rows = data["plugins"]
    assert [r["plugin"] for r in rows if "error" not in r] == list(found)
    for name, mod in found.items():
        mine = [r for r in rows if r["plugin"] == name]
        ckpt = mod.DEFAULTS.get("gradient_checkpointing", (False,))[0]
        want = ["default"] + ([] if ckpt else ["grad_ckpt"]) + ["grad_ckpt_mb1"]
        assert [r["config"] for r in mine] == [f"{name}: {w}" for w in want]
        for r in mine[:-1]:
            assert r["error"].startswith("out of memory in time_update: CUDA out of memory")
        r = mine[-1]
        assert "error" not in r and r["model"] == next(iter(mod.ALIASES))
        assert r["offload_text_encoders"] is (weights[name] > card / 2)
        assert r["weights_GiB"] == pytest.approx(weights[name]) and r["card_GiB"] == card
        assert r["micro_batch"] == 1 and r["grad_ckpt"] is True and r["P×G"] == "1×4"
        assert r["fits"] is None and r["text_embeddings_finite"] and r["reward_finite"]
        assert r["abs_log_ratio_first"] == 0.0 and r["abs_log_ratio"] == 0.0
        assert r["iterations"] == 2 and r["transformer_params_B"] > 0
        for k in ("build_s", "time_setup", "time_first_iter", "time_iter", "time_rollout",
                  "time_reward", "time_update", "MFU_%", "fwd_TFLOP_per_sample"):
            assert math.isfinite(r[k]) and r[k] > 0, (name, k)
        assert r["time_iter"] >= r["time_rollout"] + r["time_reward"] + r["time_update"]
        for k in ("peak_setup_GiB", *gc.PHASE_PEAKS.values(), "peak_mem_GiB"):
            assert math.isnan(r[k]), (name, k)                  # no CUDA allocator to read
    assert {r["offload_text_encoders"] for r in rows if "error" not in r} == {True, False}
    md = out.with_suffix(".md").read_text()
    assert "## plugins" in md and "| qwen_image: grad_ckpt_mb1 | qwen-image |" in md


# ------------------------------------------------------------------------------------------------
# examples/gpu/first_run.py: the first-run acceptance run (the headline command, measured by phase)
# ------------------------------------------------------------------------------------------------
FIRST_RUN_PHASES = ("rollout", "reward decode", "θ_old pass", "update")


def _finite_numbers(row):
    return all(math.isfinite(v) for v in row.values() if isinstance(v, float))


@pytest.mark.examples
def test_first_run_smoke_records_every_phase(tmp_path):
    """examples/gpu/first_run.py --cpu_smoke: vgrpo.main runs the headline command (SD3.5-M's
    family preset, --reward pickscore, compiled) on the tiny pipeline and a tiny CLIP put in place of
    the hub's, and stops after 2 iterations and the evaluation at 0. Its JSON and markdown hold the
    setup's compile seconds, each iteration's times, a row per phase (setup, compile, the
    evaluation, then the four phases of each iteration in order), |log ρ| exactly 0 at μ = 1, and
    only finite numbers (peak memory is None on the CPU). The run folder is removed."""
    fr = _load_example("gpu/first_run")
    out = tmp_path / "fr.json"
    assert fr.main(["--cpu_smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    info, setup, stopped = data["info"], data["setup"], data["stopped"]
    assert stopped["reason"] == "completed" and info["iterations_asked"] == 2
    assert info["trainer_command"].startswith("python vgrpo.py --model sd3.5-medium --reward pickscore")
    cfg = info["config"]
    assert cfg["model"] == "sd3.5-medium" and cfg["reward"] == "pickscore" and cfg["mu"] == 1
    assert cfg["gradient_checkpointing"] is True and cfg["eval_steps"] == 4 and cfg["iterations"] == 150
    assert setup["compiled"] is True and setup["time_compile"] > 0 and setup["build_s"] > 0
    assert setup["setup_s"] >= setup["time_compile"] and setup["peak_GiB"] is None
    its = data["iterations"]
    assert [r["iter"] for r in its] == [0, 1]
    for r in its:
        assert r["abs_log_ratio"] == 0.0 and r["abs_log_ratio_first"] == 0.0 and r["ratio"] == 1.0
        assert r["time_iter"] > 0 and r["nfe_old"] == 0 and r["n_nonfinite_reward"] == 0
        assert r["time_iter"] >= r["time_rollout"] + r["time_reward"] + r["time_update"]
        assert _finite_numbers(r) and r["peak_GiB"] is None
    ev = data["evaluations"]
    assert len(ev) == 1 and ev[0]["iter"] == 0 and ev[0]["rows"] == 2 and ev[0]["seconds"] > 0
    assert math.isfinite(ev[0]["eval_reward_mean"])
    ph = data["phases"]
    assert [(r["iter"], r["phase"]) for r in ph] == (
        [(None, "compile"), (None, "setup"), (0, "evaluation")]
        + [(i, p) for i in (0, 1) for p in FIRST_RUN_PHASES])
    for r in ph:
        assert "error" not in r and r["seconds"] >= 0 and _finite_numbers(r)
        assert r["peak_GiB"] is None and r["reserved_GiB"] is None
        assert r["new_graphs"] == (0 if r["iter"] is not None else r["new_graphs"])
    assert next(r for r in ph if r["phase"] == "compile")["new_graphs"] > 0   # compiled in setup
    md = out.with_suffix(".md").read_text()
    assert "**Stopped:** completed" in md
    for section in ("## setup", "## iterations", "## evaluations", "## phases"):
        assert section in md
    assert "| 1 | θ_old pass |" in md


@pytest.mark.examples
def test_first_run_records_out_of_memory_and_time_guard(tmp_path, monkeypatch):
    """An out-of-memory in a phase is the report's last row, naming the phase and the iteration,
    with what ran before it recorded and exit status 3, not a traceback; and a time budget already
    spent stops before the evaluation at 0 and iteration 0, saying what it skipped."""
    fr = _load_example("gpu/first_run")

    def oom(run, ro):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")
    monkeypatch.setattr(V, "reward_and_advantages", oom)
    out = tmp_path / "oom.json"
    assert fr.main(["--cpu_smoke", "--extra=--no-compile", "--out", str(out)]) == 3
    data = json.loads(out.read_text())
    assert data["stopped"]["reason"] == "out of memory"
    assert (data["stopped"]["phase"], data["stopped"]["iter"]) == ("reward decode", 0)
    assert [(r["iter"], r["phase"]) for r in data["phases"]] == [
        (None, "setup"), (0, "evaluation"), (0, "rollout"), (0, "reward decode")]
    last = data["phases"][-1]
    assert last["error"].startswith("out of memory: OutOfMemoryError: CUDA out of memory")
    assert data["setup"]["compiled"] is False and data["iterations"] == []
    assert data["info"]["defaults"] is False and "--no-compile" in data["info"]["trainer_command"]
    assert data["stopped"]["lower_with"] == "--reward_batch 8"
    assert "out of memory at reward decode, iteration 0" in out.with_suffix(".md").read_text()
    monkeypatch.undo()

    out = tmp_path / "guard.json"
    assert fr.main(["--cpu_smoke", "--extra=--no-compile", "--budget_s", "0",
                    "--out", str(out)]) == 3
    data = json.loads(out.read_text())
    assert data["stopped"]["reason"] == "time guard"
    assert "iterations 0–1 and the evaluation at 0 skipped" in data["stopped"]["detail"]
    assert [r["phase"] for r in data["phases"]] == ["setup"] and data["iterations"] == []
