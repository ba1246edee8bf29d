"""examples/models/flux2.py against its oracle, diffusers' Flux2KleinPipeline (and Flux2Pipeline),
on the random tiny pipeline the plug-in builds offline. CPU, fp32.

Tolerances: the plug-in and the pipeline run the same transformer on the same tensors; they differ
only in float rounding (σ passed as σ rather than (1000·σ)/1000, the Euler step size taken from the
float32 grid in float64, the token packing done by a permute instead of a scatter). That is ~1e-7
per step, so 1e-5 on [0, 1] images and on velocities of size ~1 leaves a wide margin, while each
negative control below (a wrong grid, a wrong guidance) moves the result by more than 1e-3.
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import vgrpo as V  # noqa: E402

TOL = 1e-5
PROMPTS = ["a red cat", "a blue dog on green grass"]
RES, L = 64, 64                   # 64 px → a (128, 4, 4) latent; 64 text tokens (TINY_PRESET's)


def _plugin():
    spec = importlib.util.spec_from_file_location("vgrpo_plugin_flux2",
                                                  Path(__file__).with_name("flux2.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


F2 = _plugin()


def _tiny(seed=0):
    return V.freeze_and_cast(F2.build_tiny_pipeline(seed), torch.float32)


def _adapter(pipe, **kw):
    args = V.Args(resolution=RES, max_sequence_length=L, **kw)
    return F2.Adapter(pipe, torch.device("cpu"), args)


def _noise(ad, n, seed=0):
    return torch.randn((n, *ad.latent_shape(RES)), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pipe():
    return _tiny()


@pytest.fixture(scope="module")
def ad(pipe):
    return _adapter(pipe)


@pytest.mark.examples
def test_rollout_equals_the_pipelines_call(pipe, ad):
    """Euler on adapter.velocity over adapter.sigmas(K), decoded, is the pipeline's own __call__
    for the same initial latents (its `latents=` layout, (B, 128, H/16, W/16)), K and no guidance;
    the grid is the one its scheduler used (dynamic shift for this resolution and K)."""
    x1, cond = _noise(ad, 2), ad.encode(PROMPTS)
    for K in (4, 8):
        grid = ad.sigmas(K)
        assert grid.dtype == torch.float64 and grid[0] == 1 and grid[-1] == 0 and len(grid) == K + 1
        ours = ad.decode(V.euler_sample(ad.velocity, x1, grid, cond))
        ref = pipe(prompt=PROMPTS, latents=x1, num_inference_steps=K, guidance_scale=1.0,
                   height=RES, width=RES, output_type="pt", max_sequence_length=L).images
        assert torch.equal(grid.float(), pipe.scheduler.sigmas)        # the grid it stepped on
        assert ours.shape == ref.shape == (2, 3, RES, RES) and ref.std() > 0.05
        assert (ours - ref).abs().max() <= TOL
        assert (grid - V.sigma_grid(K)).abs().max() > 0.05              # mu did shift it
    # negative control: the unshifted grid (what a missing mu would give) is visibly off
    plain = ad.decode(V.euler_sample(ad.velocity, x1, V.sigma_grid(K), cond))
    assert (plain - ref).abs().max() > 100 * TOL


@pytest.mark.examples
def test_velocity_and_x0_equal_the_transformer_called_the_pipelines_way(pipe, ad):
    """adapter.velocity = the transformer on the pipeline's packed latents, ids and embeddings
    (prepare_latents, encode_prompt, timestep/1000, _unpack_latents_with_ids); x̂0 = x_t − σ·v is
    the scheduler's x0 (its stochastic branch); fp32 and autocast, with and without grad."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    t = torch.tensor([1.0, 0.6999, 0.3])                              # (3,) σ, 1 = noise
    x0, eps = _noise(ad, 3, seed=1), _noise(ad, 3, seed=2)
    z = V.interpolate(x0, eps, t)                                     # (3, 128, 4, 4)
    cond = ad.encode(prompts)
    with torch.no_grad():
        pe, text_ids = pipe.encode_prompt(prompt=prompts, device="cpu", max_sequence_length=L)
        packed, latent_ids = pipe.prepare_latents(3, 32, RES, RES, torch.float32, "cpu", None,
                                                  latents=z)        # (3, 16, 128), (3, 16, 4)
        out = pipe.transformer(hidden_states=packed, timestep=(t * 1000) / 1000, guidance=None,
                               encoder_hidden_states=pe, txt_ids=text_ids, img_ids=latent_ids,
                               return_dict=False)[0]                  # (3, 16, 128)
        v_ref = pipe._unpack_latents_with_ids(out, latent_ids, 4, 4)  # (3, 128, 4, 4)
        v = ad.velocity(z, t, cond)
    assert torch.equal(cond["prompt_embeds"], pe) and pe.shape == (3, L, 48)
    assert v.shape == z.shape and v_ref.abs().mean() > 0.1
    assert (v - v_ref).abs().max() <= TOL
    x0_ref = z - V.bcast(t, z) * v_ref                                # scheduler: sample − σ·out
    assert (V.x0_from_v(z, v, t) - x0_ref).abs().max() <= TOL
    with torch.autocast("cpu", dtype=torch.bfloat16):                 # the trainer's bf16 path
        zg = z.clone().requires_grad_(True)
        v_bf = ad.velocity(zg, t, cond)
    v_bf.float().square().mean().backward()
    assert torch.isfinite(zg.grad).all() and zg.grad.abs().max() > 0
    assert (v_bf.float() - v_ref).abs().max() <= 0.05 * v_ref.abs().max()  # bf16 rounding


@pytest.mark.examples
def test_cached_prompts_equal_the_encoded_ones(pipe):
    """cache_prompts (--offload_text_encoders) hands back exactly what encode computes."""
    fresh, cached = _adapter(pipe), _adapter(pipe)
    cached.cache_prompts(PROMPTS)
    want = fresh.encode(PROMPTS[::-1])["prompt_embeds"]
    assert torch.equal(cached.encode(PROMPTS[::-1])["prompt_embeds"], want)
    with pytest.raises(ValueError, match="not among the cached"):
        cached.encode(["another prompt"])


@pytest.fixture(scope="module")
def lora_run():
    """A V-GRPO update on the tiny model: LoRA (vgrpo.add_lora, DEFAULTS' targets), 4 rollouts
    of K = 4 (two prompts × 2), fixed advantages ±1 within each prompt, 2 shared (t, ε) pairs
    from the rollout grid, 4 AdamW steps of vgrpo_loss; θ_old's surrogates taken once."""
    pipe = _tiny()
    tr = pipe.transformer
    cfg = V.add_lora(tr, 4, 8, F2.DEFAULTS["lora_targets"][0].split(","))
    ad = _adapter(pipe)
    cond = V.select(ad.encode(PROMPTS), torch.tensor([0, 0, 1, 1]))
    grid = ad.sigmas(4)
    with torch.no_grad():
        x0 = V.euler_sample(ad.velocity, _noise(ad, 4, seed=3), grid, cond)   # (4, 128, 4, 4)
    pairs = V.draw_pairs(grid[:-1], 2, ad.latent_shape(RES), torch.zeros(4, dtype=torch.long),
                         generator=torch.Generator().manual_seed(4))
    t, eps = pairs.take(torch.arange(4))                              # (4, 2), (4, 2, 128, 4, 4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])

    def S():
        with torch.no_grad():
            return V.pair_surrogates(ad.velocity, x0, cond, t, eps)[0]          # (4, 2)

    s_old = S()
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    stats = []
    for _ in range(4):
        s_new, _ = V.pair_surrogates(ad.velocity, x0, cond, t, eps)
        loss, st = V.vgrpo_loss(s_new, s_old, adv)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats.append(st)
    return dict(pipe=pipe, ad=ad, cfg=cfg, cond=cond, x0=x0, t=t, eps=eps, adv=adv,
                S_old=s_old.mean(1), S_new=S().mean(1), stats=stats, params=params)


@pytest.mark.examples
def test_first_step_abs_log_ratio_is_zero(lora_run):
    """At θ = θ_old (the first step, LoRA at its zero-B init) ρ ≡ 1: pair_surrogates twice at the
    same weights, once without and once with grad, agree exactly."""
    first = lora_run["stats"][0]
    assert float(first["abs_log_ratio"]) == 0.0 and float(first["ratio"]) == 1.0
    assert all(len(p.shape) == 2 for p in lora_run["params"])         # only LoRA A/B trained
    blocks = {id(m) for b in lora_run["ad"].blocks() for m in b.modules()}
    lora_mods = [m for m in lora_run["pipe"].transformer.modules() if hasattr(m, "lora_A")]
    assert lora_mods and all(id(m) in blocks for m in lora_mods)  # LoRA only inside blocks()


@pytest.mark.examples
def test_vgrpo_update_raises_the_positives_surrogate(lora_run):
    """After the update S = mean_j s rises for A = +1 and falls for A = −1, each sample."""
    dS = lora_run["S_new"] - lora_run["S_old"]                        # (4,)
    pos, neg = lora_run["adv"] > 0, lora_run["adv"] < 0
    assert (dS[pos] > 0).all() and (dS[neg] < 0).all(), dS
    assert float(lora_run["stats"][-1]["abs_log_ratio"]) > 0          # the weights did move


@pytest.mark.examples
def test_saved_lora_loads_in_the_stock_pipeline(lora_run, pipe, tmp_path):
    """adapter.save_lora → the stock Flux2KleinPipeline.load_lora_weights on a fresh tiny build
    reproduces the trained velocity and the trained rollout (through the pipeline's __call__)."""
    from peft.utils import get_peft_model_state_dict
    ad, x0, t, eps = lora_run["ad"], lora_run["x0"], lora_run["t"][:, 0], lora_run["eps"][:, 0]
    z, cond = V.interpolate(x0, eps, t), lora_run["cond"]
    ad.save_lora(str(tmp_path), get_peft_model_state_dict(ad.transformer), lora_run["cfg"])
    stock = _tiny()
    with torch.no_grad():
        v_base = _adapter(stock).velocity(z, t, cond)
        assert torch.equal(v_base, _adapter(pipe).velocity(z, t, cond))  # same seed, same base
        stock.load_lora_weights(str(tmp_path))
        v_trained, v_loaded = ad.velocity(z, t, cond), _adapter(stock).velocity(z, t, cond)
    assert (v_trained - v_base).abs().max() > 1e-3                    # the LoRA changed v
    assert (v_loaded - v_trained).abs().max() <= TOL
    x1 = _noise(ad, 2, seed=5)
    with torch.no_grad():
        ours = ad.decode(V.euler_sample(ad.velocity, x1, ad.sigmas(4), ad.encode(PROMPTS)))
    ref = stock(prompt=PROMPTS, latents=x1, num_inference_steps=4, guidance_scale=1.0,
                height=RES, width=RES, output_type="pt", max_sequence_length=L).images
    assert (ours - ref).abs().max() <= TOL


@pytest.mark.examples
def test_tiny_pipeline_saves_and_loads_back(pipe, tmp_path):
    """build_tiny_pipeline: every module in eval mode with no active dropout; save_pretrained →
    Flux2KleinPipeline.from_pretrained (offline) gives the same tokens and the same images."""
    from diffusers import Flux2KleinPipeline
    mods = [m for part in (pipe.transformer, pipe.vae, pipe.text_encoder) for m in part.modules()]
    assert not any(m.training for m in mods)
    assert all(m.p == 0 for m in mods if isinstance(m, torch.nn.Dropout))
    assert pipe.text_encoder.config.attention_dropout == 0
    pipe.save_pretrained(tmp_path)
    back = Flux2KleinPipeline.from_pretrained(tmp_path).to(torch.float32)
    back.set_progress_bar_config(disable=True)
    assert type(back.tokenizer) is type(pipe.tokenizer) and back.config.is_distilled
    chat = [{"role": "user", "content": PROMPTS[1]}]
    ids = [tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False))["input_ids"]
           for tok in (pipe.tokenizer, back.tokenizer)]
    assert ids[0] == ids[1] and len(ids[0]) == len(PROMPTS[1]) + 25  # a token per byte + template
    x1 = _noise(_adapter(pipe), 2, seed=6)
    kw = dict(prompt=PROMPTS, latents=x1, num_inference_steps=4, guidance_scale=1.0,
              height=RES, width=RES, output_type="pt", max_sequence_length=L)
    assert torch.equal(pipe(**kw).images, back(**kw).images)


@pytest.mark.examples
def test_flux2_dev_pipeline_with_embedded_guidance(pipe):
    """Flux2Pipeline (FLUX.2 [dev]: the same latents and scheduler, an embedded guidance scale)
    from the tiny parts and a guidance-embedding transformer; its text stack (Mistral3) is left
    out, so both sides get the same prompt embeddings. The rollout equals its __call__ at
    guidance 4, and a wrong guidance is visibly off."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel
    torch.manual_seed(7)
    tr = Flux2Transformer2DModel(in_channels=128, num_layers=1, num_single_layers=1,
                                 attention_head_dim=16, num_attention_heads=2,
                                 joint_attention_dim=48, axes_dims_rope=(4, 4, 4, 4),
                                 guidance_embeds=True).eval().requires_grad_(False)
    dev = Flux2Pipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None,
                        tokenizer=None, transformer=tr)
    dev.set_progress_bar_config(disable=True)
    ad4, ad1 = _adapter(dev, guidance=4.0), _adapter(dev, guidance=1.0)
    pe = torch.randn(2, L, 48, generator=torch.Generator().manual_seed(8))
    x1, cond = _noise(ad4, 2, seed=9), {"prompt_embeds": pe}
    ref = dev(prompt_embeds=pe, latents=x1, num_inference_steps=4, guidance_scale=4.0,
              height=RES, width=RES, output_type="pt").images
    with torch.no_grad():
        ours = ad4.decode(V.euler_sample(ad4.velocity, x1, ad4.sigmas(4), cond))
        off = ad1.decode(V.euler_sample(ad1.velocity, x1, ad1.sigmas(4), cond))
    assert (ours - ref).abs().max() <= TOL
    assert (off - ref).abs().max() > 100 * TOL


@pytest.mark.examples
def test_bad_folders_are_one_line_before_anything_loads(pipe, tmp_path, capsys, monkeypatch):
    """A saved FLUX.2 folder missing its text encoder, and one whose model_index.json names
    another FLUX.2 pipeline (the inpainting one, which no plug-in drives): each is one line on
    stderr, exit 2, before any weights load and before the run folder is made."""
    import json
    import shutil
    monkeypatch.setattr(V, "load_pipeline", lambda *a, **k: pytest.fail("the model was loaded"))
    pipe.save_pretrained(tmp_path / "inpaint")                      # complete, but relabelled
    shutil.copytree(tmp_path / "inpaint", tmp_path / "no_te")
    shutil.rmtree(tmp_path / "no_te" / "text_encoder")
    index = tmp_path / "inpaint" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()),
                                 "_class_name": "Flux2KleinInpaintPipeline"}))
    for folder, said in (("no_te", "lists 'text_encoder' but there is no text_encoder/ folder"),
                         ("inpaint", "holds a Flux2KleinInpaintPipeline")):
        V.check_local_pipeline.cache_clear()                # it caches per folder
        run = tmp_path / f"run_{folder}"
        capsys.readouterr()
        argv = ["--model", str(tmp_path / folder), "--reward", "jpeg", "--run_dir", str(run)]
        assert V.main(argv) == 2
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert len(err) == 1 and said in err[0] and not run.exists(), err


@pytest.mark.examples
def test_real_size_pipeline_has_the_published_parameter_counts():
    """build_real_size_pipeline on the meta device (nothing allocated): the transformer, the text
    encoder and the VAE each within 1% of the published size of FLUX.2-klein-4B's weights on the
    Hub (bf16 bytes / 2: transformer 7.75 GB, text encoder 8.05 GB, VAE 168 MB), and the plug-in
    reads it at 1024 px as the real model: a (128, 64, 64) latent, 7680-wide text."""
    real = F2.build_real_size_pipeline()
    parts = {"transformer": (real.transformer, 7.75e9 / 2), "text_encoder": (real.text_encoder,
             8.05e9 / 2), "vae": (real.vae, 168e6 / 2)}
    for name, (module, published) in parts.items():
        params = list(module.parameters())
        assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params), name
        count = sum(p.numel() for p in params)
        assert abs(count / published - 1) < 0.01, (name, count, published)
    ad = F2.Adapter(real, torch.device("meta"), V.Args(resolution=1024, max_sequence_length=512))
    assert ad.latent_shape(1024) == (128, 64, 64)
    te = real.text_encoder.config                                      # layers 9, 18, 27 stacked
    assert real.transformer.config.joint_attention_dim == 3 * te.hidden_size == 7680
    assert te.num_hidden_layers > 27 and len(ad.blocks()) == 25


@pytest.mark.examples
def test_other_klein_hub_ids_are_this_family():
    """A klein hub id that is no alias (the undistilled base, a quantised mirror) gets this
    family's defaults, not FLUX.1's, whose hint "flux" it also contains; FLUX.1 ids stay FLUX.1."""
    for hub_id in ("black-forest-labs/FLUX.2-klein-base-4B", "someone/flux2-klein-4b-int8"):
        assert V.model_family(hub_id) == "flux2", hub_id
        args = V.parse_args(["--model", hub_id])
        value, src = F2.DEFAULTS["num_steps"]
        assert args.num_steps == value and src in args.origin["num_steps"], args.origin
    assert V.model_family("black-forest-labs/FLUX.1-schnell") == "flux"
