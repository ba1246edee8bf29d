"""Tests of the Z-Image plug-in (examples/models/z_image.py) against diffusers' ZImagePipeline, the
oracle: its __call__, its transformer call, its scheduler, its LoRA loader and its save/load, all on
the tiny offline pipeline. CPU only, offline: `python -m pytest -q examples/models/test_z_image.py`.

Every test carries the `examples` tier marker (pytest.ini). The pipeline's encode_prompt rewrites
the prompt list it is given (each prompt → its chat template), so every call here gets a copy.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: vgrpo
sys.path.insert(0, str(Path(__file__).resolve().parent))       # this folder: the plug-in
import vgrpo as V   # noqa: E402
import z_image as Z  # noqa: E402

CPU = torch.device("cpu")
RES, L = 64, 64                                   # tiny preset: 64 px, 64 caption tokens
# caption lengths 28, 31 and 69 (chat template included): the last one is cut to L = 64 and
# pads to two 32-token chunks inside the transformer, the others to one
PROMPTS = ["a red cat", "a dog, sunny", "a lighthouse on a cliff above a stormy sea at dusk"]


class _Args:  # the two vgrpo.Args fields the adapter reads
    def __init__(self, resolution=RES, max_sequence_length=L):
        self.resolution, self.max_sequence_length = resolution, max_sequence_length


def _pipe(seed: int = 0):
    """The tiny pipeline the way vgrpo.load_pipeline hands it over: frozen, eval, fp32."""
    return V.freeze_and_cast(Z.build_tiny_pipeline(seed), torch.float32)


def _noise(n: int, seed: int, res: int = RES) -> torch.Tensor:
    return torch.randn(n, 16, res // 8, res // 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def zi():
    """(pipeline, adapter) shared by the tests that leave the weights alone."""
    pipe = _pipe()
    return pipe, Z.Adapter(pipe, CPU, _Args())


def _call(pipe, prompts, latents, steps, output_type, res=RES):
    """ZImagePipeline.__call__ with no guidance from the given initial latents."""
    return pipe(prompt=list(prompts), height=res, width=res, num_inference_steps=steps,
                guidance_scale=0.0, latents=latents.clone(), output_type=output_type,
                max_sequence_length=L).images


@pytest.mark.examples
def test_rollout_equals_the_pipelines_own_call(zi):
    """vgrpo.euler_sample with adapter.velocity on adapter.sigmas(K), decoded, equals __call__
    (its final latents, taken by its own step callback, and its [0, 1] images) for the same
    initial latents, K steps and guidance_scale 0. Both run the same fp32 ops except the step
    size: vgrpo subtracts the grid's values in float64, the scheduler in fp32, at most an ulp
    per step (|Δ| < 1e-6 after 8 steps of |v| < 10), hence atol 1e-5; measured: 0."""
    pipe, ad = zi
    x1, K, seen = _noise(3, 1), 8, {}

    def keep(pipeline, i, t, kw):                            # after each scheduler step
        seen["latents"] = kw["latents"].clone()
        return kw
    img = pipe(prompt=list(PROMPTS), height=RES, width=RES, num_inference_steps=K,
               guidance_scale=0.0, latents=x1.clone(), output_type="pt", max_sequence_length=L,
               callback_on_step_end=keep).images                # (3, 3, 64, 64)
    with torch.no_grad():
        x0 = V.euler_sample(ad.velocity, x1, ad.sigmas(K), ad.encode(PROMPTS))   # (3, 16, 8, 8)
        ours = ad.decode(x0)                                                     # (3, 3, 64, 64)
    assert ours.shape == img.shape == (3, 3, RES, RES) and ours.dtype == torch.float32
    assert 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(x0, seen["latents"], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, img, atol=1e-5, rtol=0)
    assert (x0 - x1).abs().max() > 1 and img.std() > 0.05      # latents moved, images not flat


@pytest.mark.examples
def test_velocity_and_x0_match_the_transformer_called_the_pipelines_way(zi):
    """adapter.velocity equals −(the transformer on the pipeline's list inputs: frames
    (C, 1, H, W), caption features from encode_prompt, t = (1000 − 1000σ)/1000), to fp32
    rounding (measured 0; atol 1e-6); x̂0 = x − σ·v equals the pipeline's own Euler step from σ to
    0 (x + σ·u). Each row alone gives the batch's row (ragged captions padded and cut back, the
    transformer's attention mask; measured < 1e-6, atol 1e-5). Under bf16 autocast it runs and
    stays near fp32; with grad it back-propagates to the input."""
    pipe, ad = zi
    x = _noise(3, 2)                                            # (3, 16, 8, 8)
    sigma = ad.sigmas(8)[[1, 4, 6]].float()                     # (3,) grid points 0.95, 0.75, 0.5
    c = ad.encode(PROMPTS)
    assert c["cap_feats"].shape == (3, L, 32) and c["cap_len"].tolist() == [28, 31, 64]
    with torch.no_grad():
        feats, _ = pipe.encode_prompt(list(PROMPTS), device=CPU, do_classifier_free_guidance=False,
                                      max_sequence_length=L)
        timestep = (1000 - sigma * 1000) / 1000                 # the pipeline's time, per row
        u = pipe.transformer(list(x.unsqueeze(2).unbind(0)), timestep, feats,
                             return_dict=False)[0]              # 3 × (16, 1, 8, 8)
        u = torch.stack([o.float() for o in u]).squeeze(2)      # (3, 16, 8, 8)
        v = ad.velocity(x, sigma, c)
        rows = torch.cat([ad.velocity(x[i:i + 1], sigma[i:i + 1], V.select(c, torch.tensor([i])))
                          for i in range(3)])
    torch.testing.assert_close(v, -u, atol=1e-6, rtol=0)
    torch.testing.assert_close(V.x0_from_v(x, v, sigma), x + V.bcast(sigma, x) * u, atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(rows, v, atol=1e-5, rtol=0)
    assert (v[0] - v[1]).abs().max() > 1e-3                     # rows do differ
    # and the two conventions matter: the output un-negated, or the time not reversed, is far off
    with torch.no_grad():
        u_fwd = pipe.transformer(list(x.unsqueeze(2).unbind(0)), sigma, feats, return_dict=False)[0]
    assert (v - u).abs().max() > 1e-1
    assert (v + torch.stack(u_fwd).squeeze(2)).abs().max() > 1e-2
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        v_bf16 = ad.velocity(x.bfloat16(), sigma, c)
    assert v_bf16.shape == v.shape
    assert (v_bf16.float() - v).norm() / v.norm() < 5e-2         # bf16: ~3 significant digits
    xg = x.clone().requires_grad_(True)
    ad.velocity(xg, sigma, c).square().mean().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0


@pytest.mark.examples
def test_sigmas_are_the_schedulers_at_the_resolution(zi):
    """adapter.sigmas(K) is the grid __call__ leaves in its scheduler, exactly: with Z-Image-Turbo's
    static shift 3, and with a dynamic-shifting scheduler at two resolutions, whose grids differ
    (μ follows the image sequence length, which the adapter takes from args.resolution)."""
    pipe, _ = zi
    for K in (4, 8):
        _call(pipe, PROMPTS[:1], _noise(1, 0), K, "latent")
        grid = Z.Adapter(pipe, CPU, _Args()).sigmas(K)
        assert grid.dtype == torch.float64 and len(grid) == K + 1
        assert grid[0] == 1 and grid[-1] == 0 and (grid.diff() < 0).all()
        assert torch.equal(grid.float(), pipe.scheduler.sigmas)
    from diffusers import FlowMatchEulerDiscreteScheduler
    dyn = _pipe()
    dyn.scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=16,
                                                    max_image_seq_len=256)
    grids = []
    for res in (64, 128):
        _call(dyn, PROMPTS[:1], _noise(1, 0, res), 4, "latent", res=res)
        grids.append(Z.Adapter(dyn, CPU, _Args(resolution=res)).sigmas(4))
        assert torch.equal(grids[-1].float(), dyn.scheduler.sigmas)
    assert (grids[0] - grids[1]).abs().max() > 1e-2


def _rollouts(ad, seed: int = 3):
    """4 samples (2 prompts × 2) of 4 Euler steps, their conditioning and 4 shared pairs."""
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[2]] * 2
    c, grid = ad.encode(prompts), ad.sigmas(4)
    with torch.no_grad():
        x0 = V.euler_sample(ad.velocity, _noise(4, seed), grid, c)          # (4, 16, 8, 8)
    pairs = V.draw_pairs(grid[:-1], 4, ad.latent_shape(RES), torch.zeros(4, dtype=torch.long),
                         generator=torch.Generator().manual_seed(seed))
    t, eps = pairs.take(torch.arange(4))                                     # (4, 4), (4, 4, *D)
    return x0, c, t, eps


@pytest.fixture(scope="module")
def trained():
    """A LoRA (DEFAULTS' targets) trained by 3 V-GRPO steps with fixed advantages ±1 on rollouts
    of the tiny model; the surrogates S (4,) before and after, the state and LoRA config."""
    ad = Z.Adapter(_pipe(), CPU, _Args())
    cfg = V.add_lora(ad.transformer, 8, 16, Z.DEFAULTS["lora_targets"][0].split(","))
    x0, c, t, eps = _rollouts(ad)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    with torch.no_grad():
        s_old, _ = V.pair_surrogates(ad.velocity, x0, c, t, eps)               # (4, J)
    params = [p for p in ad.transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(3):
        s_new, _ = V.pair_surrogates(ad.velocity, x0, c, t, eps)
        loss, stats = V.vgrpo_loss(s_new, s_old, adv)
        first = stats if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        s_after, _ = V.pair_surrogates(ad.velocity, x0, c, t, eps)
    return dict(ad=ad, cfg=cfg, adv=adv, S_old=s_old.mean(1), S_new=s_after.mean(1), first=first)


@pytest.mark.examples
def test_first_step_log_ratio_is_zero(zi):
    """pair_surrogates twice at the same weights (θ = θ_old, the first update step) → vgrpo_loss
    reports |log ρ| = 0 and ρ = 1: the adapter is deterministic (fp32, CPU; measured exactly 0)."""
    _, ad = zi
    x0, c, t, eps = _rollouts(ad)
    with torch.no_grad():
        s_old, _ = V.pair_surrogates(ad.velocity, x0, c, t, eps)
    s_new, x0_hat = V.pair_surrogates(ad.velocity, x0, c, t, eps)          # with grad, as θ's
    _, stats = V.vgrpo_loss(s_new, s_old, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert x0_hat.shape == (4, 4, 16, 8, 8) and torch.isfinite(s_new).all()
    assert stats["abs_log_ratio"] <= 1e-7 and abs(stats["ratio"] - 1) <= 1e-7


@pytest.mark.examples
def test_vgrpo_update_raises_the_positive_surrogates_and_lowers_the_negatives(trained):
    """3 AdamW steps of vgrpo_loss with advantages (+1, −1, +1, −1): S rises for every positive
    sample and falls for every negative one; the first step's |log ρ| is 0 (LoRA B starts at 0);
    the LoRA sits in every ZImageTransformerBlock (blocks()) and nowhere else."""
    ad, adv, dS = trained["ad"], trained["adv"], trained["S_new"] - trained["S_old"]
    assert trained["first"]["abs_log_ratio"] <= 1e-7
    assert (dS[adv > 0] > 0).all() and (dS[adv < 0] < 0).all(), dS
    lora = {id(p) for n, p in ad.transformer.named_parameters() if "lora_" in n}
    in_blocks = {id(p) for b in ad.blocks() for n, p in b.named_parameters() if "lora_" in n}
    assert in_blocks == lora and len(lora) == 2 * 7 * len(ad.blocks())  # A, B × 7 targets × 4


@pytest.mark.examples
def test_saved_lora_loads_in_the_stock_pipeline(trained, tmp_path):
    """adapter.save_lora(folder) of the trained LoRA → a fresh stock ZImagePipeline's
    load_lora_weights(folder) reproduces the trained velocity (the same LoRA math, atol 1e-5;
    measured < 1e-6), which differs from the base model's."""
    from peft.utils import get_peft_model_state_dict
    ad = trained["ad"]
    ad.save_lora(str(tmp_path), get_peft_model_state_dict(ad.transformer), trained["cfg"])
    stock = _pipe()
    base = Z.Adapter(stock, CPU, _Args())
    x, sigma = _noise(2, 5), torch.tensor([0.9, 0.4])
    c = base.encode(PROMPTS[:2])
    with torch.no_grad():
        v_base = base.velocity(x, sigma, c)
        stock.load_lora_weights(str(tmp_path))
        v_loaded, v_trained = base.velocity(x, sigma, c), ad.velocity(x, sigma, c)
    torch.testing.assert_close(v_loaded, v_trained, atol=1e-5, rtol=0)
    assert (v_loaded - v_base).abs().max() > 1e-3


@pytest.mark.examples
def test_tiny_pipeline_round_trips_through_save_and_from_pretrained(zi, tmp_path):
    """build_tiny_pipeline → save_pretrained → ZImagePipeline.from_pretrained offline: the same
    classes (a Qwen3Model, a Qwen2Tokenizer with its chat template), the same token ids and
    bit-identical images from __call__ for the same latents."""
    import json
    from diffusers import ZImagePipeline
    pipe, _ = zi
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen3Model"]
    assert index["tokenizer"][1] == "Qwen2Tokenizer"
    loaded = V.freeze_and_cast(ZImagePipeline.from_pretrained(tmp_path), torch.float32)
    chat = [{"role": "user", "content": PROMPTS[2]}]
    ids = [p.tokenizer.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=True,
                                           return_dict=False) for p in (pipe, loaded)]
    assert ids[0] == ids[1] and len(ids[0]) == 69
    x1 = _noise(2, 7)
    assert torch.equal(_call(loaded, PROMPTS[:2], x1, 4, "pt"),
                       _call(pipe, PROMPTS[:2], x1, 4, "pt"))


@pytest.mark.examples
def test_real_size_pipeline_on_meta_has_the_published_sizes():
    """build_real_size_pipeline() on the meta device (nothing allocated, nothing downloaded):
    the transformer's parameter count is the published 6.15B to within 1% (the configs give
    6,154,908,736), the text encoder Qwen3-4B's 4.0B to within 1% (4,022,468,096); every weight
    is bf16 on meta, the default dtype is restored, and the adapter sees the real model's
    34 blocks (2 noise + 2 context refiners + 30 layers) and its 1024 px latent (16, 128, 128)."""
    pipe = Z.build_real_size_pipeline()
    assert torch.get_default_dtype() == torch.float32
    for part, published in Z.PUBLISHED_PARAMS.items():
        params = list(getattr(pipe, part).parameters())
        assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params), part
        n = sum(p.numel() for p in params)
        assert abs(n / published - 1) < 0.01, (part, n)
    assert pipe.transformer.config.dim == 3840 and pipe.vae_scale_factor == 8
    ad = Z.Adapter(pipe, torch.device("meta"), _Args(resolution=1024, max_sequence_length=512))
    assert len(ad.blocks()) == 34 and ad.latent_shape(1024) == (16, 128, 128)


@pytest.mark.examples
def test_other_z_image_hub_ids_are_this_family():
    """A Z-Image hub id that is no alias gets this family's defaults, not SD3's."""
    for hub_id in ("Tongyi-MAI/Z-Image", "someone/z-image-turbo-bf16"):
        assert V.model_family(hub_id) == "z_image", hub_id
        args = V.parse_args(["--model", hub_id])
        value, src = Z.DEFAULTS["num_steps"]
        assert args.num_steps == value and src in args.origin["num_steps"], args.origin
