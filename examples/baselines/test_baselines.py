"""Tests of the baselines in examples/baselines/: MixGRPO, Flow-GRPO and DiffusionNFT, each loss by
hand, its schedule, two iterations on the tiny SD3 pipeline and its command line; DiffusionNFT's
gradient at θ = old. CPU only, offline: `python -m pytest -q examples/baselines`.

Every test carries one tier marker (pytest.ini); shared helpers (ROOT, TM, _load_example) are in
the repository's conftest.py.
"""
import json
import math

import pytest
import torch

import vgrpo as V
from conftest import ROOT, TM, _load_example


# ------------------------------------------------------------------------------------------------
# The baselines: MixGRPO, Flow-GRPO and DiffusionNFT in examples/baselines/
# ------------------------------------------------------------------------------------------------
# examples/baselines/mix_grpo_sd3.py: MixGRPO (mixed ODE–SDE window) on the tiny SD3 pipeline
@pytest.mark.examples
def test_random_stream_values_are_distinct_in_every_stream():
    """Every named stream, aliases included (an IntEnum member given another's value is only an
    alias, which iterating the enum skips), has a value of its own: within vgrpo.Stream, within
    the baselines' Stream, and across the two modulo 16 (vgrpo.generator's seed is
    (seed·1000003 + it)·16 + stream), the baselines' in the values vgrpo.Stream leaves to the
    examples (4–8, 11–15). So Flow-GRPO's SDE window and its SDE noise never draw the same
    numbers."""
    BC = _load_example("baselines/baseline_cli")
    for S in (V.Stream, BC.Stream):
        values = [int(v) for v in S.__members__.values()]
        assert len(values) == len(set(values)), S.__members__
    ours = {int(v) % 16 for v in BC.Stream.__members__.values()}
    assert len(ours) == len(BC.Stream.__members__)
    assert ours.isdisjoint({int(v) % 16 for v in V.Stream.__members__.values()})
    assert ours <= set(range(4, 9)) | set(range(11, 16))


@pytest.mark.examples
def test_mix_grpo_steps_and_loss_by_hand():
    """MixGRPO's two SDE steps (sampling_utils.py flow_grpo_step, dance_grpo_step) and its clipped
    per-step loss against hand computations in float64: x = (1, −2), v = (0.5, 1), σ = 0.75 → 0.5,
    η = 0.7, ξ = (1, −0.5)."""
    mix = _load_example("baselines/mix_grpo_sd3")
    f64 = dict(dtype=torch.float64)
    x, v, xi = (torch.tensor([[1.0, -2.0]], **f64), torch.tensor([[0.5, 1.0]], **f64),
                torch.tensor([[1.0, -0.5]], **f64))
    # flow: s_t² = 0.49·0.75/0.25 = 1.47; μ = x·(1 − 1.47/1.5·0.25) + v·(1 + 1.47·0.25/1.5)·(−0.25)
    #       = 0.755·x − 0.31125·v; std² = 1.47·0.25 = 0.3675
    xn, lp, mean, std = mix.flow_grpo_step(x, v, 0.75, 0.5, 0.7, 0.9, noise=xi)
    torch.testing.assert_close(mean, torch.tensor([[0.599375, -1.82125]], **f64))
    assert std == pytest.approx(math.sqrt(0.3675), rel=1e-12)
    torch.testing.assert_close(xn, mean + math.sqrt(0.3675) * xi)
    # log p = mean_elements(−ξ²/2) − log std − ½ log 2π = −(0.5 + 0.125)/2 − … = −0.7309225530
    expect = -0.3125 - 0.5 * math.log(0.3675) - 0.5 * math.log(2 * math.pi)
    assert expect == pytest.approx(-0.7309225530, abs=1e-9)
    torch.testing.assert_close(lp, torch.tensor([expect], **f64))
    assert lp.dtype == torch.float64
    _, lp2, _, _ = mix.flow_grpo_step(x, v, 0.75, 0.5, 0.7, 0.9, x_next=xn)   # the stored step
    torch.testing.assert_close(lp2, lp)
    # σ = 1: the noise scale uses σ_max = sigmas[1] = 0.9: s_t² = 0.49/0.1 = 4.9, μ = 0.51·x − 0.2·v
    _, _, mean1, std1 = mix.flow_grpo_step(x, v, 1.0, 0.8, 0.7, 0.9, noise=xi)
    torch.testing.assert_close(mean1, torch.tensor([[0.41, -1.22]], **f64))
    assert std1 == pytest.approx(math.sqrt(4.9 * 0.2), rel=1e-12)
    # dance: x̂0 = (0.625, −2.75); score = −(x − 0.25·x̂0)/0.5625 = (−1.5, 7/3);
    #        μ = x − 0.25·v + 0.245·score·0.25 = (0.783125, −2.1070833…); std = 0.7·0.5 = 0.35
    xn, lp, mean, std = mix.dance_grpo_step(x, v, 0.75, 0.5, 0.7, 0.9, noise=xi)
    torch.testing.assert_close(mean, torch.tensor([[0.783125, -2.25 + 0.245 * 0.25 * 7 / 3]], **f64))
    assert std == pytest.approx(0.35, rel=1e-12)
    torch.testing.assert_close(xn, mean + 0.35 * xi)
    torch.testing.assert_close(lp, torch.tensor([-0.3125], **f64))           # no constants
    # loss: A = (2, −1, 7 → clamped 5), log ρ = (0, 2e-4, 3e-4), ε = 1e-4
    #   (−2·1,  max(1.0002000200, 1.0001) = 1.0002000200,  max(−5·1.0003000450, −5·1.0001) = −5.0005)
    logp = torch.tensor([0.0, 2e-4, 3e-4], **f64, requires_grad=True)
    loss, st = mix.mix_loss(logp, torch.zeros(3, **f64), torch.tensor([2.0, -1.0, 7.0], **f64),
                            clip_range=1e-4, adv_clip_max=5.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([-2.0, 1.0002000200013335, -5.0005], **f64))
    assert float(st["clip_frac"]) == pytest.approx(2 / 3)
    assert float(st["abs_log_ratio"]) == pytest.approx(5e-4 / 3)
    loss.sum().backward()                   # d/d log p = −A·ρ where unclipped, 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, 1.0002000200013335, 0.0], **f64))
    # the k2 term to θ_old, ½ (log ρ)², only with kl_coeff
    kl, _ = mix.mix_loss(logp.detach(), torch.zeros(3, **f64), torch.zeros(3, **f64),
                         clip_range=1e-4, adv_clip_max=5.0, kl_coeff=2.0)
    torch.testing.assert_close(kl, torch.tensor([0.0, 4e-8, 9e-8], **f64))
    # optimizer-step shares: the k-th contiguous quarter of every group
    assert [r.tolist() for r in mix.step_rows(2, 12, 4)] == [[0, 1, 2, 12, 13, 14], [3, 4, 5, 15, 16, 17],
                                                             [6, 7, 8, 18, 19, 20], [9, 10, 11, 21, 22, 23]]
    assert [r.tolist() for r in mix.step_rows(1, 6, 4)] == [[0, 1], [2, 3], [4], [5]]


@pytest.mark.examples
def test_mix_grpo_window_schedule_published_and_scaled():
    """The progressive window (grpo_states.py): published K = 25, window 4, moved by 1 every 25 of
    300 iterations (starts 0 … 11, never wrapping); the scaled rule and its roll-back, against
    hand-computed positions and the state machine it is written from."""
    mix = _load_example("baselines/mix_grpo_sd3")
    R = mix.RECIPE
    assert (R["num_steps"], R["window"], R["shift_interval"], R["iterations"], R["stride"]) == (25, 4, 25, 300, 1)
    assert mix.scaled_recipe(25, 300) == R
    w = lambda it, rec: mix.window_at(it, rec)
    assert w(0, R) == [0, 1, 2, 3] and w(24, R) == [0, 1, 2, 3] and w(25, R) == [1, 2, 3, 4]
    assert w(299, R) == [11, 12, 13, 14]
    assert {w(it, R)[0] for it in range(300)} == set(range(12))            # 12 positions
    # past the published budget: truncated at K − 2 = 23, the start rolls back after 22
    assert w(21 * 25, R) == [21, 22] and w(22 * 25, R) == [22] and w(23 * 25, R) == [0, 1, 2, 3]
    assert w(22 * 25, dict(R, roll_back=False)) == w(40 * 25, dict(R, roll_back=False)) == [22]
    # scaled: window round½(4K/25), interval round½(25·I/300), halves up
    s = mix.scaled_recipe(10, 24)
    assert (s["window"], s["shift_interval"]) == (2, 2)                     # 1.6 → 2, 2.0 → 2
    assert [w(it, s)[0] for it in range(0, 24, 2)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert w(0, s) == w(1, s) == [0, 1] and w(14, s) == [7] and w(16, s) == [0, 1]
    s30 = mix.scaled_recipe(10, 30)
    assert (s30["window"], s30["shift_interval"]) == (2, 3)                 # 2.5 → 3
    assert [w(it, s30)[0] for it in range(0, 30, 3)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert (mix.scaled_recipe(4, 2)["window"], mix.scaled_recipe(4, 2)["shift_interval"]) == (1, 1)
    assert mix.scaled_recipe(40, 150)["window"] == 6 and mix.scaled_recipe(40, 150)["shift_interval"] == 13
    with pytest.raises(ValueError, match="num_steps"):
        mix.scaled_recipe(2, 10)
    # the closed form equals the reference loop (read, then count the iteration)
    for rec in (R, s, s30, dict(s, stride=3), dict(s, stride=2, roll_back=False)):
        K, start, n = rec["num_steps"], 0, 0
        for it in range(200):
            assert w(it, rec) == list(range(start, min(start + rec["window"], K - 2))), (rec, it)
            n += 1
            if n >= rec["shift_interval"]:
                n, start = 0, start + rec["stride"]
            if start > K - 3:
                start = 0 if rec["roll_back"] else K - 3


@pytest.mark.examples
def test_mix_grpo_two_iterations_on_the_tiny_model():
    """Two MixGRPO iterations on a vgrpo.Run (tiny SD3, P×G = 2×4, K = 4, scaled recipe: window 1,
    moved every iteration): the LoRA moves, the base weights do not, metrics are finite, the ratio
    is exactly 1 before the first of the 4 optimizer steps, NFE = rollout K + trained window T."""
    mix = _load_example("baselines/mix_grpo_sd3")
    args = V.parse_args(["--model", "tiny", "--reward", "jpeg", "--prompts_per_iter", "2",
                         "--group_size", "4", "--num_steps", "4", "--lora_rank", "4",
                         "--lora_alpha", "8", "--no-gradient_checkpointing"])
    run = V.setup(args)
    named = dict(run.adapter.transformer.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    state = mix.init_state(run, mix.scaled_recipe(4, 2))
    ms = [mix.mix_iteration(run, it, state) for it in range(2)]
    lora = [n for n in named if "lora_" in n]
    assert lora and all(not p.requires_grad for n, p in named.items() if "lora_" not in n)
    assert all(torch.equal(named[n].detach(), before[n]) for n in named if "lora_" not in n)
    assert any(not torch.equal(named[n].detach(), before[n]) for n in lora)
    assert [m["window"] for m in ms] == [[0], [1]]
    for m in ms:
        assert m["method"] == "mix_grpo" and m["opt_steps"] == 4 and m["n_trained_samples"] == 8
        assert (m["nfe_rollout"], m["nfe_theta"], m["nfe_ref"], m["nfe_total"]) == (4, 1, 0, 8 * 4 + 8 * 1)
        assert m["abs_log_ratio_first"] == 0.0                # θ = θ_old: same rows, shapes, code
        for k in ("reward_mean", "reward_std", "grad_norm", "clip_frac", "abs_log_ratio",
                  "time_rollout", "time_reward", "time_update", "time_iter"):
            assert math.isfinite(m[k]), k
    assert ms[0]["abs_log_ratio"] > 0                     # steps 2–4 are off-policy
    assert state["step"] == 8 and state["ema"] is None
    with mix.eval_weights(run, state):                    # the trained weights, no EMA
        assert all(torch.equal(named[n], p) for n, p in run.adapter.transformer.named_parameters())


@pytest.mark.examples
def test_mix_grpo_cli_writes_metrics_and_the_lora(tmp_path):
    """main(argv): tiny model + jpeg by default, vgrpo flags passed through, metrics.jsonl with an
    evaluation before and after, and the LoRA in diffusers' format."""
    mix = _load_example("baselines/mix_grpo_sd3")
    out = tmp_path / "mix"
    lines = mix.main(["--prompts_per_iter", "2", "--group_size", "2", "--mix_steps", "3",
                      "--iterations", "1", "--n_eval", "1", "--eval_steps", "2", "--out", str(out),
                      "--lora_rank", "4", "--lora_alpha", "8", "--no-gradient_checkpointing"])
    assert [("reward_mean" in m, "eval_reward_mean" in m) for m in lines] == \
        [(False, True), (True, False), (False, True)]
    assert [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()] == lines
    assert lines[1]["window"] == [0] and lines[1]["opt_steps"] == 2 and lines[1]["nfe_rollout"] == 3
    assert (out / "lora_mix_grpo" / V.LORA_FILE).is_file()
    assert json.loads((out / "recipe.json").read_text())["sde"] == "flow"
    mine, args = mix.parse(["--num_steps", "10", "--iterations", "30", "--sde", "dance"])
    assert args.num_steps == 10 and mine.rec["window"] == 2 and mine.rec["shift_interval"] == 3
    assert mine.rec["sde"] == "dance" and mine.rec["init_same_noise"]


# examples/baselines/flow_grpo_sd3.py: Flow-GRPO on the tiny SD3 pipeline, its cost table
FLOW_SMALL = ["--prompts_per_iter", "2", "--group_size", "4", "--iterations", "1", "--seed", "0",
              "--num_steps", "4", "--flow_steps", "4", "--n_eval", "2"]


@pytest.mark.examples
def test_flow_grpo_baseline_and_cost_table(tmp_path):
    """examples/baselines/flow_grpo_sd3.py, both methods at the default cfg4.5 recipe on the tiny SD3 pipeline
    (P×G = 2×4, V-GRPO K = 4, Flow-GRPO K = 4, 1 iteration each), with prompt files: the NFE
    accounting with CFG (2 forwards per step) and the KL's reference forwards, the ratio exactly 1
    before the first of Flow-GRPO's 2 optimizer steps, metrics.jsonl, and both LoRAs loadable.

    Measured (seed 0): V-GRPO NFE 4 / +4 / 4 / ref 0; Flow-GRPO 8 / +0 / 6 / ref 6 (3 of 4 steps
    trained, × 2 for CFG); |log ρ| at θ = θ_old exactly 0.0 and clip fraction before the first
    optimizer step 0.0 (fp32, rollout and training batches of the same size, same code path);
    the Flow-GRPO clip fraction over both steps 0.50 (its 2nd optimizer step sees ratios past
    1 ± 1e-4). Rewards are not asserted: one iteration on a random tiny model moves them by less
    than their noise.
    """
    flow = _load_example("baselines/flow_grpo_sd3")
    train = tmp_path / "train.txt"
    train.write_text("a red square\na blue circle\na green triangle\n")
    held = tmp_path / "held.txt"
    held.write_text("a yellow star\na purple moon\n")
    out = tmp_path / "run"
    lines = flow.main(FLOW_SMALL + ["--prompts", str(train), "--eval_prompts", str(held),
                                    "--out", str(out)])
    mine, args = flow.parse(FLOW_SMALL + ["--prompts", str(train)])
    assert args.prompts == str(train) and args.prompts_per_iter == 2    # not --prompts_per_iter
    rec = mine.rec
    assert rec["guidance"] == 4.5 and rec["beta"] == 0.04 and rec["clip_range"] == 1e-4
    its = [m for m in lines if "reward_mean" in m]
    evs = [m for m in lines if "eval_reward_mean" in m]
    assert [m["method"] for m in its] == ["vgrpo", "flow_grpo"]
    assert [(m["method"], m["iter"]) for m in evs] == [("vgrpo", 0), ("vgrpo", 1),
                                                        ("flow_grpo", 0), ("flow_grpo", 1)]
    on_disk = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == lines and len(lines) == 6
    for m in its:                                     # each phase timed, inside the iteration
        phases = [m[k] for k in ("time_rollout", "time_reward", "time_old", "time_update")]
        assert all(t >= 0 for t in phases) and m["time_update"] > 0, m
        assert sum(phases) <= m["time_iter"], m
    v, f = json.loads((out / "summary.json").read_text())["rows"]
    assert v["method"] == "V-GRPO" and f["method"] == "Flow-GRPO"
    K, J, T = 4, 4, int(0.99 * 4)
    assert (v["nfe_rollout"], v["nfe_old_extra"], v["nfe_theta"], v["nfe_ref"]) == (K, 0, J, 0)  # μ = 1
    assert (f["nfe_rollout"], f["nfe_old_extra"], f["nfe_theta"], f["nfe_ref"]) == \
        (2 * K, 0, 2 * T, 2 * T)                      # CFG: 2 forwards per step
    assert f["opt_steps"] == 2 and v["opt_steps"] == 1
    for row in (v, f):
        assert row["abs_log_ratio_first"] == 0.0      # fp32, same batch shapes and code path
        assert row["clip_frac_first_step"] == 0.0     # θ = θ_old before the first optimizer step
        assert row["lora_change"] > 0
    assert f["clip_frac"] > 0                         # the 2nd optimizer step is off-policy
    assert f["time_old"] == 0                         # old log-probs come with the rollout
    assert "| Flow-GRPO |" in (out / "table.md").read_text()
    # the saved LoRAs load into a stock pipeline and change its output
    from diffusers import StableDiffusion3Pipeline
    TM.build_tiny_sd3_pipeline().save_pretrained(tmp_path / "base")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "base"))
    x, t = torch.randn(1, pipe.transformer.config.in_channels, 8, 8), torch.tensor([500.0])
    c = {"encoder_hidden_states": torch.randn(1, 5, pipe.transformer.config.joint_attention_dim),
         "pooled_projections": torch.randn(1, pipe.transformer.config.pooled_projection_dim)}
    with torch.no_grad():
        base = pipe.transformer(hidden_states=x, timestep=t, **c).sample
        for method in ("vgrpo", "flow_grpo"):
            pipe.load_lora_weights(str(out / f"lora_{method}"), adapter_name=method)
            pipe.set_adapters(method)
            moved = pipe.transformer(hidden_states=x, timestep=t, **c).sample - base
            # V-GRPO's trained LoRA moves the output; Flow-GRPO saves its EMA, which first moves
            # at optimizer step 8 (flow_grpo/ema.py), so after 2 steps it is still the init (B = 0)
            assert (moved.abs().max() > 0) == (method == "vgrpo")
    ema_line = evs[-1]                                # Flow-GRPO's final evaluation: its EMA,
    assert ema_line["ema"] and ema_line["eval_reward_mean"] == evs[2]["eval_reward_mean"]  # = init
    assert math.isfinite(ema_line["eval_reward_mean_raw"])


@pytest.mark.examples
def test_flow_grpo_nocfg_recipe_filters_zero_advantages(tmp_path, monkeypatch):
    """--methods flow_grpo --recipe nocfg with a plug-in reward that is constant for one prompt:
    that group's 4 advantages are exactly 0 and are dropped before training (train_sd3.py's mask);
    no CFG (1 forward per step), a 3-step CPS window inside the first K/2 steps is all that is
    trained, β = 0 (no reference forwards), ε = 1e-5, and the ratio is exactly 1 before the first
    optimizer step. Also: without --out, the output goes to ./runs/…, never into the repository."""
    (tmp_path / "flat_reward.py").write_text(
        "import torch\n"
        "def score(images, prompts):\n"
        "    m = images.float().mean(dim=(1, 2, 3))\n"
        "    return torch.stack([torch.tensor(0.5) if 'flat' in p else v\n"
        "                        for p, v in zip(prompts, m)])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.txt").write_text("a flat grey wall\na busy street market\n")
    (tmp_path / "held.txt").write_text("a quiet lake\n")
    before = (ROOT / "examples" / "baselines" / "flow_grpo_sd3.md").read_text()
    flow = _load_example("baselines/flow_grpo_sd3")
    lines = flow.main(["--methods", "flow_grpo", "--recipe", "nocfg",
                       "--reward", "flat_reward:score", "--prompts", "train.txt",
                       "--eval_prompts", "held.txt", "--eval_holdout", "0",
                       "--prompts_per_iter", "2", "--group_size", "4",
                       "--iterations", "1", "--flow_steps", "6", "--num_steps", "4",
                       "--n_eval", "1"])
    its = [m for m in lines if "reward_mean" in m]
    assert len(its) == 1 and all(m["method"] == "flow_grpo" for m in its)
    for m in its:
        assert m["n_zero_adv"] == 4 and m["n_trained_samples"] == 4   # the flat group is dropped
        assert len(m["trained_steps"]) == 3 and max(m["trained_steps"]) < 3  # in the first K/2
        trained = m["trained_steps"]
        assert trained == list(range(trained[0], trained[0] + 3))
        assert (m["nfe_rollout"], m["nfe_theta"], m["nfe_ref"]) == (6, 3, 0)
    assert its[0]["abs_log_ratio_first"] == 0.0 and its[0]["clip_frac_first_step"] == 0.0
    runs = list((tmp_path / "runs").glob("flow_grpo_sd3-tiny-score-*"))
    assert len(runs) == 1 and (runs[0] / "lora_flow_grpo" / V.LORA_FILE).is_file()
    assert (ROOT / "examples" / "baselines" / "flow_grpo_sd3.md").read_text() == before


@pytest.mark.examples
def test_flow_grpo_pure_parts():
    """The pieces of examples/baselines/flow_grpo_sd3.py against hand computations: the per-prompt stat
    tracker (group mean, global population std + 1e-4, duplicates of a prompt pooled), the
    zero-advantage mask and its padding, the two SDE steps' log-probs, the KL term, CFG with the
    unconditional half detached, and the CLI (no abbreviation of --prompts, clear errors)."""
    flow = _load_example("baselines/flow_grpo_sd3")
    r = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 7.0])
    prompts = ["a", "a", "b", "b", "a", "c"]
    adv = flow.stat_tracker_advantages(prompts, r)
    glob = r.double().std(unbiased=False) + 1e-4
    expect = torch.tensor([1 - 3, 3 - 3, 0, 0, 5 - 3, 0], dtype=torch.float64) / glob
    torch.testing.assert_close(adv, expect)
    assert (adv != 0).tolist() == [True, False, False, False, True, False]
    keep = flow.keep_mask(adv, 3, torch.Generator().manual_seed(0))
    assert keep.sum() == 3 and keep[[0, 4]].all()        # 2 non-zero + 1 re-admitted → 3 batches
    assert flow.keep_mask(adv, 1, torch.Generator()).tolist() == (adv != 0).tolist()
    # "sde": the log-prob of a sampled step is the Gaussian density there (mean over elements)
    g = torch.Generator().manual_seed(1)
    x, v, xi = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    s, s2, a = 0.8, 0.6, 0.7
    xn, lp, mean, std_t = flow.sde_step(x, v, s, s2, a, 0.9, noise=xi)
    step_std = a * math.sqrt(s / (1 - s)) * math.sqrt(s - s2)
    ref = torch.distributions.Normal(mean, step_std).log_prob(xn).flatten(1).mean(1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    _, lp2, _, _ = flow.sde_step(x, v, s, s2, a, 0.9, x_next=xn)
    torch.testing.assert_close(lp2, lp)                   # evaluating the stored step: the same
    # "cps": mean (1−σ')x̂0 + sqrt(σ'² − s_t²)x̂1, noise s_t = σ'·sin(aπ/2), log p = −mean (x' − μ)²
    xn, lp, mean, std_t = flow.sde_step(x, v, s, s2, 0.8, 0.9, noise=xi, sde_type="cps")
    assert std_t == pytest.approx(s2 * math.sin(0.4 * math.pi))
    torch.testing.assert_close(xn - mean, std_t * xi)
    torch.testing.assert_close(lp, -(std_t * xi).square().flatten(1).mean(1))
    # KL: mean over samples of mean_elements (μ − μ_ref)² / (2 s_t²)
    kl = flow.kl_to_reference(mean, mean + 0.1, 0.5)
    assert float(kl) == pytest.approx(0.01 / (2 * 0.25), rel=1e-5)

    # CFG: v_u + w (v_c − v_u), gradient only through the conditional half
    class Lin:
        w = torch.tensor(2.0, requires_grad=True)

        def velocity(self, x, t, c):
            return self.w * c["e"] * x

    ad = Lin()
    gd = flow.Guided(ad, {"e": torch.tensor([[1.0]])}, 4.5)
    xx = torch.ones(2, 1)
    out = gd.velocity(xx, torch.zeros(2), {"e": torch.tensor([[3.0], [3.0]])})
    torch.testing.assert_close(out.detach(), torch.full((2, 1), 2.0 + 4.5 * (6.0 - 2.0)))
    out.sum().backward()
    assert float(ad.w.grad) == pytest.approx(2 * 4.5 * 3.0)          # d/dw of w·(4.5·3) per row
    ad.w.grad = None                                                  # --cfg_grad both:
    both = flow.Guided(ad, {"e": torch.tensor([[1.0]])}, 4.5, detach_uncond=False)
    both.velocity(xx, torch.zeros(2), {"e": torch.tensor([[3.0], [3.0]])}).sum().backward()
    assert float(ad.w.grad) == pytest.approx(2 * (4.5 * 3.0 - 3.5 * 1.0))  # (1 − w)·v_u counts too
    assert gd.forwards == 2 and flow.Guided(ad, {}, 1.0).forwards == 1
    # EMA (flow_grpo/ema.py, decay 0.9, every 8 steps): first moves at n = 7, by 1 − 8/17
    q = torch.nn.Parameter(torch.zeros(3))
    ema = flow.LoraEMA([q])
    with torch.no_grad():
        q.fill_(1.0)
    for n in range(7):
        ema.step(n)
        assert float(ema.ema[0][0]) == 0.0
    ema.step(7)
    torch.testing.assert_close(ema.ema[0], torch.full((3,), 9 / 17))
    ema.swap()
    torch.testing.assert_close(q.detach(), torch.full((3,), 9 / 17))
    ema.swap()
    assert float(q[0]) == 1.0
    # window plan
    g0 = torch.Generator().manual_seed(0)
    sde, trained = flow.step_plan(10, dict(window=3, timestep_fraction=1.0), g0)
    assert sum(sde) == 3 and trained[-1] < 5 and trained == [i for i in range(10) if sde[i]]
    full = flow.step_plan(10, dict(window=0, timestep_fraction=0.99), torch.Generator())
    assert full == ([True] * 10, list(range(9)))
    # CLI
    mine, args = flow.parse(["--prompts", "p.txt"])
    assert args.prompts == "p.txt" and mine.rec["beta"] == 0.04
    assert flow.parse(["--reward", "pickscore"])[0].rec["beta"] == 0.01    # grpo.py pickscore_sd3
    with pytest.raises(ValueError, match="--flow_mu"):
        flow.parse(["--prompts_per_iter", "1", "--group_size", "3", "--flow_mu", "2"])
    with pytest.raises(ValueError, match="--methods"):
        flow.parse(["--methods", "ppo"])


# examples/baselines/diffusion_nft_sd3.py: the loss by hand, the old adapter's schedule, dpm2, two iterations
@pytest.mark.examples
def test_diffusion_nft_loss_by_hand():
    """DiffusionNFT's loss (scripts/train_nft_sd3.py) on two 2-element samples, float64, β = 0.5,
    A_max = 5, β_KL = 0.1, every number worked out below; and its gradient at θ = old.
    Sample 1: t = 0.5, x_t = [0.5, 0.5], x0 = [1, −1], v_θ = [1, 2], v_old = [0, 1], A = 2.5:
      r = 2.5/5/2 + 1/2 = 0.75;  v⁺ = [0.5, 1.5], x̂⁺ = [0.25, −0.25], x̂⁺ − x0 = [−0.75, 0.75],
      MAE 0.75, e⁺ = 0.5625/0.75 = 0.75;  v⁻ = 1.5·v_old − 0.5·v_θ = [−0.5, 0.5], x̂⁻ = [0.75, 0.25],
      x̂⁻ − x0 = [−0.25, 1.25], MAE 0.75, e⁻ = (0.0625 + 1.5625)/2/0.75 = 13/12;
      A_max·(r e⁺ + (1 − r) e⁻)/β = 5·(0.5625 + 13/48)/0.5 = 25/3;  KL mean([0, 1]) = 0.5.
    Sample 2: t = 1, x_t = [1, 1], x0 = [0, 0], v_θ = v_old = [1, 1], v_ref = [0, 2], A = −10:
      clamp → −5, r = 0; x̂± = x0 exactly: MAE 0 is floored at 1e-5, e± = 0 (not 0/0); KL 1.
    Loss = (25/3 + 0)/2 + 0.1·(0.5 + 1)/2 = 25/6 + 0.075 = 509/120."""
    nft = _load_example("baselines/diffusion_nft_sd3")
    d = dict(dtype=torch.float64)
    x_t = torch.tensor([[0.5, 0.5], [1.0, 1.0]], **d)
    x0 = torch.tensor([[1.0, -1.0], [0.0, 0.0]], **d)
    t = torch.tensor([0.5, 1.0], **d)
    v = torch.tensor([[1.0, 2.0], [1.0, 1.0]], **d).requires_grad_(True)
    v_old = torch.tensor([[0.0, 1.0], [1.0, 1.0]], **d)
    v_ref = torch.tensor([[1.0, 1.0], [0.0, 2.0]], **d)
    adv = torch.tensor([2.5, -10.0], **d)
    loss, st = nft.nft_loss(v, v_old, v_ref, x0, x_t, t, adv, beta=0.5, adv_clip_max=5.0,
                            kl_coef=0.1)
    assert loss.dtype == torch.float64
    assert float(loss.detach()) == pytest.approx(509 / 120, rel=1e-6)
    assert float(st["policy_loss"]) == pytest.approx(25 / 6, rel=1e-6)
    assert float(st["kl_div"]) == pytest.approx(0.75, rel=1e-6)
    assert float(st["r_mean"]) == pytest.approx(0.375)
    assert float(st["positive_loss"]) == pytest.approx(0.375, rel=1e-6)       # (0.75 + 0)/2
    assert float(st["negative_loss"]) == pytest.approx(13 / 24, rel=1e-6)     # (13/12 + 0)/2
    torch.testing.assert_close(nft.optimality_weight(
        torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0], **d), 5.0),
        torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0], **d))
    # gradient at θ = old (sample 1 alone, no KL): x̂ − x0 = [−0.5, 1], MAE 0.75, r = 0.75:
    # dL/dv = A_max·(2/d)·t·(x̂ − x0)/MAE·(1 − 2r) = 5·1·0.5·[−0.5, 1]/0.75·(−0.5) = [5/6, −5/3],
    # whatever β; a descent step moves x̂ = x_t − t·v towards x0 (A > 0)
    for beta in (0.5, 1.0):
        v1 = v_old[:1].clone().requires_grad_(True)
        l1, _ = nft.nft_loss(v1, v_old[:1], None, x0[:1], x_t[:1], t[:1], adv[:1], beta=beta,
                             adv_clip_max=5.0, kl_coef=0.0)
        l1.backward()
        torch.testing.assert_close(v1.grad, torch.tensor([[5 / 6, -5 / 3]], **d))


@pytest.mark.examples
def test_diffusion_nft_old_adapter_schedule():
    """train_nft_sd3.py return_decay (types 1 and 2 of config/nft.py) and the soft update
    old ← d·old + (1 − d)·θ against hand values; the recipes' schedules and the CLI's mapping."""
    nft = _load_example("baselines/diffusion_nft_sd3")
    one, two = nft.DECAY_TYPES[1], nft.DECAY_TYPES[2]
    assert one == (0, 0.001, 0.5) and two == (75, 0.0075, 0.999) and nft.DECAY_TYPES[0][2] == 0
    for step, want in ((0, 0.0), (1, 0.001), (250, 0.25), (500, 0.5), (10_000, 0.5)):
        assert nft.return_decay(step, *one) == pytest.approx(want)
    for step, want in ((0, 0.0), (74, 0.0), (75, 0.0), (76, 0.0075), (175, 0.75), (208, 0.9975),
                       (209, 0.999), (10_000, 0.999)):
        assert nft.return_decay(step, *two) == pytest.approx(want)
    assert all(nft.return_decay(s, *nft.DECAY_TYPES[0]) == 0.0 for s in (0, 10, 1000))
    old = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([[-4.0]], dtype=torch.float64)]
    new = [torch.tensor([3.0, 6.0], dtype=torch.float64), torch.tensor([[4.0]], dtype=torch.float64)]
    nft.soft_update_(old, new, 0.25)                      # 0.25·old + 0.75·new
    assert old[0].tolist() == [2.5, 5.0] and old[1].tolist() == [[2.0]]
    nft.soft_update_(old, new, 1.0)
    assert old[0].tolist() == [2.5, 5.0]                  # d = 1: the old policy stays
    nft.soft_update_(old, new, 0.0)
    assert old[0].tolist() == [3.0, 6.0] and old[1].tolist() == [[4.0]]   # d = 0: a copy
    rec = nft.RECIPE
    assert (rec["decay_flat"], rec["decay_uprate"], rec["decay_uphold"]) == one
    ocr = nft.RECIPES["sd3_ocr"]
    assert (ocr["decay_flat"], ocr["decay_uprate"], ocr["decay_uphold"]) == two
    assert ocr["opt_steps"] == 2 and ocr["beta"] == 0.1
    assert (rec["beta"], rec["kl_coef"], rec["adv_clip_max"], rec["num_steps"]) == (1.0, 1e-4, 5.0, 10)
    mine, _ = nft.parse(["--decay_type", "2", "--no_ema", "--nft_steps", "4"])
    over = mine.rec                                   # the parse() of every baseline: (options, Args)
    assert (over["decay_flat"], over["decay_uprate"], over["decay_uphold"]) == two
    assert over["ema"] is False and over["num_steps"] == 4 and "lr" not in over


@pytest.mark.examples
def test_diffusion_nft_dpm2_solver():
    """The "dpm2" rollout (flow_grpo/diffusers_patch/solver.py) on an analytic linear field,
    float64: a first step that is DDIM from σ = 1 (x' = (1 − σ')x̂0 + σ'x1), a last step that
    lands on x̂0, the same result as vgrpo's DPM-Solver++(2M) on SD3's shifted grid and on a grid
    that does not start at 1; Euler ("flow", η = 0) is vgrpo's euler_sample."""
    nft = _load_example("baselines/diffusion_nft_sd3")
    g = torch.Generator().manual_seed(0)
    A = 0.5 * torch.randn(4, 4, generator=g, dtype=torch.float64)
    fn = lambda x, t, c: x @ A + t[:, None]                                   # noqa: E731
    x1 = torch.randn(3, 4, generator=g, dtype=torch.float64)
    one = nft.dpm2_sample(fn, x1, torch.tensor([1.0, 0.4], dtype=torch.float64))
    x0_hat = x1 - fn(x1, torch.ones(3), None)
    torch.testing.assert_close(one, 0.6 * x0_hat + 0.4 * x1)
    last = nft.dpm2_sample(fn, x1, torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(last, x0_hat)
    late = torch.tensor([0.9, 0.5, 0.2, 0.0], dtype=torch.float64)             # σ_0 < 1
    for sig in (V.sigma_grid(10, 3.0), V.sigma_grid(3), late):
        torch.testing.assert_close(nft.dpm2_sample(fn, x1, sig), V.dpmpp2m_sample(fn, x1, sig))
    assert nft.SAMPLERS["flow"] is V.euler_sample


@pytest.mark.examples
def test_diffusion_nft_two_iterations_tiny_sd3(monkeypatch):
    """Two DiffusionNFT iterations on the tiny SD3 pipeline (P×G = 2×2, K = 3 dpm2 steps, T = 2
    training times per sample, one optimizer step each): the LoRA moves, the base weights do not,
    the metrics are finite and count 3 + 3·2 forwards per sample; the rollout samples with the
    old adapter; the old adapter starts as θ and then follows old ← d·old + (1 − d)·θ with the
    schedule's d (here uprate 0.25, uphold 0.4: d = 0.25, then 0.4); the EMA moves by 9/11 at
    step 1 (ema.py: 1 − min(2/11, 0.9)); eval_weights swaps the EMA in and back."""
    nft = _load_example("baselines/diffusion_nft_sd3")
    run = V.setup(V.parse_args(["--model", "tiny", "--reward", "jpeg", "--prompts_per_iter", "2",
                                "--group_size", "2", "--resolution", "32", "--seed", "0"]))
    tr = run.adapter.transformer
    base = {n: p.detach().clone() for n, p in tr.named_parameters() if "lora_" not in n}
    init = [p.detach().clone() for p in run.params]
    state = nft.init_state(run, num_steps=3, decay_uprate=0.25, decay_uphold=0.4)
    assert state["T"] == 2 and len(state["old"]) == len(run.params) > 0
    assert all(torch.equal(o, q) for o, q in zip(state["old"], state["theta"]))
    assert all(p.requires_grad for p in run.params) and not any(o.requires_grad for o in state["old"])
    used = []
    solve = nft._solve

    def spy(*a, **kw):
        used.append(tr.active_adapters())
        return solve(*a, **kw)
    monkeypatch.setattr(nft, "_solve", spy)
    for it, d in enumerate((0.25, 0.4)):
        old_before = [o.detach().clone() for o in state["old"]]
        m = nft.nft_iteration(run, it, state)
        assert m["method"] == "diffusion_nft" and m["iter"] == it and state["step"] == it + 1
        assert m["old_decay"] == pytest.approx(d) and m["opt_steps"] == 1
        for o, ob, q in zip(state["old"], old_before, state["theta"]):
            torch.testing.assert_close(o, d * ob + (1 - d) * q.detach())
        assert (m["nfe_rollout"], m["nfe_theta"], m["nfe_old"], m["nfe_ref"]) == (3, 2, 2, 2)
        assert m["nfe_total"] == 4 * (3 + 3 * 2) and m["n_trained_samples"] == 4
        for k in ("reward_mean", "reward_std", "time_rollout", "time_reward", "time_update",
                  "time_iter", "grad_norm", "loss", "policy_loss", "kl_div", "r_mean"):
            assert math.isfinite(m[k]), k
        if it == 0:
            assert m["old_deviate"] == 0.0 and m["positive_loss"] == m["negative_loss"]  # θ = old
            theta1 = [q.detach().clone() for q in state["theta"]]
            for e, q0, q1 in zip(state["ema"].ema, init, theta1):
                torch.testing.assert_close(e, q0 + 9 / 11 * (q1 - q0))
    assert used and all(a == [nft.OLD] for a in used)             # rollouts: the old adapter
    assert tr.active_adapters() == ["default"]
    assert any(not torch.equal(p, q) for p, q in zip(run.params, init))              # LoRA moved
    assert not all(torch.equal(o, q) for o, q in zip(state["old"], state["theta"]))
    assert all(torch.equal(p, base[n]) for n, p in tr.named_parameters() if "lora_" not in n)
    trained = [p.detach().clone() for p in run.params]
    ema = [e.clone() for e in state["ema"].ema]
    with nft.eval_weights(run, state):
        assert all(torch.equal(p, e) for p, e in zip(run.params, ema))
    assert all(torch.equal(p, q) for p, q in zip(run.params, trained))


@pytest.mark.examples
def test_nft_gradient_identity_at_theta_old():
    """At θ = old, DiffusionNFT's loss (examples/baselines/diffusion_nft_sd3.py nft_loss) has the gradient of
    V-GRPO's μ = 1 loss on the same (t, ε) pairs with advantages clamped at ±A_max, whatever its
    mixing β: both are mean_n clip(A_n)·mean_j ∇e_nj with e the self-normalised x-error (the
    reason the digits report swaps knobs, not methods, to explain a gap between the two)."""
    nft = _load_example("baselines/diffusion_nft_sd3")
    torch.manual_seed(0)
    N, J, D = 6, 3, 8
    net = torch.nn.Linear(D, D).double()
    x0 = torch.randn(N, D, dtype=torch.float64)
    t = torch.rand(N, J, dtype=torch.float64) * 0.9 + 0.05                 # (N, J) pair times
    eps = torch.randn(N, J, D, dtype=torch.float64)                        # (N, J, D) pair noises
    adv = torch.tensor([-7.0, -2.0, -0.5, 0.3, 1.5, 6.0], dtype=torch.float64)   # beyond ±5 too

    def nft_grad(beta):
        net.zero_grad()
        total = 0.0
        for j in range(J):                               # DiffusionNFT: one time per forward
            x_t = V.interpolate(x0, eps[:, j], t[:, j])
            v = net(x_t)
            loss, _ = nft.nft_loss(v, v.detach(), None, x0, x_t, t[:, j], adv, beta=beta,
                                   adv_clip_max=5.0, kl_coef=0.0)
            total = total + loss / J
        total.backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()]).clone()

    net.zero_grad()
    s_new, _ = V.pair_surrogates(lambda z, tt, c: net(z), x0, None, t, eps)   # (N, J)
    loss, _ = V.vgrpo_loss(s_new, s_new.detach(), adv.clamp(-5, 5))
    loss.backward()
    g_v = torch.cat([p.grad.flatten() for p in net.parameters()]).clone()
    for beta in (1.0, 0.1):
        torch.testing.assert_close(nft_grad(beta).float(), g_v.float(), rtol=1e-5, atol=1e-7)
    assert g_v.abs().max() > 1e-3                         # a gradient that could differ
