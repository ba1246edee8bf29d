"""The Qwen-Image plug-in (examples/models/qwen_image.py) against diffusers' QwenImagePipeline,
on the tiny offline pipeline: the pipeline's own __call__, transformer call, scheduler and LoRA
loader are the oracles. CPU, fp32."""
import re
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: vgrpo.py
sys.path.insert(0, str(HERE))
import qwen_image as Q  # noqa: E402
import vgrpo as V  # noqa: E402

CPU = torch.device("cpu")
RES, K, L = 64, 4, 64              # 64 px = 4 × 4 tokens, 4 Euler steps, text cap
PROMPTS = ["a cat", "a red dog on the grass"]  # unequal lengths: the first row is padded


def _args(**kw):
    return V.Args(resolution=RES, max_sequence_length=L, **kw)


def _noise(n: int, seed: int) -> torch.Tensor:
    return torch.randn((n, 16, 64), generator=torch.Generator().manual_seed(seed))  # (n, seq, 64)


@pytest.fixture(scope="module")
def pipe():
    return V.freeze_and_cast(Q.build_tiny_pipeline(), torch.float32)


@pytest.mark.examples
def test_rollout_equals_the_pipeline_call(pipe):
    """Adapter.sigmas + vgrpo.euler_sample + Adapter.velocity + decode = QwenImagePipeline(...)
    with the same packed initial latents (its own `latents` layout), steps and no CFG."""
    ad = Q.Adapter(pipe, CPU, _args())
    assert ad.latent_shape(RES) == (16, 64)
    x1 = _noise(2, 1)
    call = dict(height=RES, width=RES, num_inference_steps=K, true_cfg_scale=1.0,
                max_sequence_length=L)
    seen = {}

    def last_latents(pipeline, i, t, kw):                   # the latents after each step
        seen["x0"] = kw["latents"].clone()
        return kw
    ref_img = pipe(PROMPTS, latents=x1.clone(), output_type="pt", callback_on_step_end=last_latents,
                   **call).images
    ref_lat, grid_used = seen["x0"], pipe.scheduler.sigmas.double()  # the grid it stepped on
    sig = ad.sigmas(K)
    assert sig[0] == 1.0 and sig[-1] == 0.0 and sig[-2] == pytest.approx(0.02)  # shift_terminal
    assert torch.equal(sig, grid_used)
    x0 = V.euler_sample(ad.velocity, x1, sig, ad.encode(PROMPTS))
    img = ad.decode(x0)
    # the same float32 operations in the same order: equal to rounding; 1e-6 is ~10 ulps of
    # latents of size ~3 (measured: 0 on this CPU)
    torch.testing.assert_close(x0, ref_lat, atol=1e-6, rtol=0)
    torch.testing.assert_close(img, ref_img, atol=1e-6, rtol=0)
    assert img.shape == (2, 3, RES, RES) and 0 <= img.min() and img.max() <= 1
    # the tolerance can tell grids apart: the unshifted grid lands far away
    other = V.euler_sample(ad.velocity, x1, V.sigma_grid(K), ad.encode(PROMPTS))
    assert (other - ref_lat).abs().max() > 1e-2
    # the dynamic shift depends on the resolution (μ from the token count), like the pipeline's
    assert not torch.equal(ad.sigmas(K, resolution=256), sig)


@pytest.mark.examples
def test_velocity_and_x0_match_the_pipelines_transformer_call(pipe):
    """The transformer called as QwenImagePipeline.__call__ calls it: encode_prompt's embeddings
    and mask, timestep = (1000·σ)/1000, img_shapes from the image size."""
    ad = Q.Adapter(pipe, CPU, _args())
    x, t = _noise(2, 2), torch.tensor([0.7, 0.25])
    pe, mask = pipe.encode_prompt(PROMPTS, device=CPU, max_sequence_length=L)
    assert mask is not None and not mask.all()              # the short prompt is padded
    side = RES // pipe.vae_scale_factor // 2
    with torch.no_grad():
        ref = pipe.transformer(hidden_states=x, timestep=(t * 1000) / 1000,
                               encoder_hidden_states=pe, encoder_hidden_states_mask=mask,
                               img_shapes=[[(1, side, side)]] * 2, return_dict=False)[0]
        cond = ad.encode(PROMPTS)
        v = ad.velocity(x, t, cond)
        torch.testing.assert_close(v, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(V.x0_from_v(x, v, t), x - t.view(2, 1, 1) * ref,
                                   atol=1e-6, rtol=0)
        # the mask matters: without it the padded row's velocity changes
        unmasked = dict(cond, prompt_mask=torch.ones_like(cond["prompt_mask"]))
        assert (ad.velocity(x, t, unmasked)[0] - ref[0]).abs().max() > 1e-4
        # cached embeddings (--offload_text_encoders) give the same conditioning, any order
        cached = Q.Adapter(pipe, CPU, _args())
        cached.cache_prompts(PROMPTS)
        torch.testing.assert_close(cached.velocity(x.flip(0), t.flip(0), cached.encode(
            PROMPTS[::-1])), ref.flip(0), atol=1e-5, rtol=1e-5)
        # under autocast (bf16) the same field, to bf16's precision
        with torch.autocast("cpu", dtype=torch.bfloat16):
            vb = ad.velocity(x, t, cond)
        assert torch.isfinite(vb).all()
        assert (vb.float() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few V-GRPO steps on the tiny model's own rollouts, fixed advantages ±1: what the three
    tests below check. A fresh pipeline (add_lora changes it) from the same seed."""
    p = V.freeze_and_cast(Q.build_tiny_pipeline(), torch.float32)
    base = tmp_path_factory.mktemp("qwen") / "base"
    p.save_pretrained(base)                                 # the stock pipeline to load into
    ad = Q.Adapter(p, CPU, _args())
    cfg = V.add_lora(p.transformer, 4, 8, Q.LORA_TARGETS.split(","))
    params = [q for q in p.transformer.parameters() if q.requires_grad]
    sig = ad.sigmas(K)
    prompt_idx = torch.tensor([0, 0, 1, 1])                 # 2 prompts × 2 samples
    cond = V.select(ad.encode(PROMPTS), prompt_idx)
    with torch.no_grad():
        x0 = V.euler_sample(ad.velocity, _noise(4, 3), sig, cond)
    pairs = V.draw_pairs(sig[:-1], 2, ad.latent_shape(RES), torch.zeros(4, dtype=torch.long),
                         generator=torch.Generator().manual_seed(4))
    t, eps = pairs.take(torch.arange(4))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])            # one of each sign per prompt
    with torch.no_grad():
        s_old, _ = V.pair_surrogates(ad.velocity, x0, cond, t, eps)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(4):
        s_new, _ = V.pair_surrogates(ad.velocity, x0, cond, t, eps)
        loss, st = V.vgrpo_loss(s_new, s_old, adv)
        first = first or st
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        s_after, _ = V.pair_surrogates(ad.velocity, x0, cond, t, eps)
    return dict(pipe=p, ad=ad, cfg=cfg, base=base, first=first, adv=adv,
                dS=(s_after.mean(1) - s_old.mean(1)))


@pytest.mark.examples
def test_first_step_ratio_is_one(trained):
    """θ = θ_old on the first step: the same surrogate twice, so |log ρ| = 0 exactly."""
    assert trained["first"]["abs_log_ratio"].item() == 0.0
    assert trained["first"]["ratio"].item() == 1.0
    # every LoRA weight gets a gradient except the last block's text-stream outputs
    # (to_add_out, txt_mlp): the transformer returns the image tokens only, so they feed nothing
    last = trained["pipe"].transformer.config.num_layers - 1
    none = {n.split(".lora_")[0] for n, q in trained["pipe"].transformer.named_parameters()
            if q.requires_grad and q.grad is None}
    assert none == {f"transformer_blocks.{last}.{m}" for m in
                    ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")}


@pytest.mark.examples
def test_update_raises_positive_surrogates_and_lowers_negative(trained):
    dS, adv = trained["dS"], trained["adv"]
    assert (dS[adv > 0] > 0).all() and (dS[adv < 0] < 0).all(), dS


@pytest.mark.examples
def test_saved_lora_loads_in_the_stock_pipeline(trained, tmp_path):
    """Adapter.save_lora → QwenImagePipeline.from_pretrained(base).load_lora_weights: the same
    velocity as the trained transformer's, and not the base model's."""
    from diffusers import QwenImagePipeline
    from peft.utils import get_peft_model_state_dict
    ad = trained["ad"]
    ad.save_lora(str(tmp_path), get_peft_model_state_dict(ad.transformer), trained["cfg"])
    fresh = V.freeze_and_cast(QwenImagePipeline.from_pretrained(trained["base"]), torch.float32)
    plain = Q.Adapter(fresh, CPU, _args())
    x, t = _noise(2, 5), torch.tensor([0.8, 0.3])
    with torch.no_grad():
        cond = plain.encode(PROMPTS)
        v_base = plain.velocity(x, t, cond)
        fresh.load_lora_weights(str(tmp_path))
        v_loaded, v_trained = plain.velocity(x, t, cond), ad.velocity(x, t, cond)
    torch.testing.assert_close(v_loaded, v_trained, atol=1e-5, rtol=1e-4)
    assert (v_loaded - v_base).abs().max() > 1e-3          # the LoRA does something


@pytest.mark.examples
def test_tiny_pipeline_round_trip_and_module_constants(pipe, tmp_path):
    from diffusers import QwenImagePipeline
    # every module in eval mode (built from configs they start in train mode), dropout 0
    for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
        assert not any(m.training for m in part.modules())
    pipe.save_pretrained(tmp_path)
    index = (tmp_path / "model_index.json").read_text()
    assert re.search(r'"_class_name": "(\w+)"', index)[1] in Q.PIPELINES
    loaded = QwenImagePipeline.from_pretrained(tmp_path)
    a, b = Q.Adapter(pipe, CPU, _args()), Q.Adapter(loaded, CPU, _args())
    x, t = _noise(2, 6), torch.tensor([0.5, 0.9])
    with torch.no_grad():
        ca, cb = a.encode(PROMPTS), b.encode(PROMPTS)
        assert torch.equal(ca["prompt_mask"], cb["prompt_mask"])
        torch.testing.assert_close(a.velocity(x, t, ca), b.velocity(x, t, cb), atol=0, rtol=0)
        torch.testing.assert_close(a.decode(x), b.decode(x), atol=0, rtol=0)
    # the tiny tokenizer splits the chat template's system prefix into the 34 tokens the
    # pipeline drops (prompt_template_encode_start_idx), as the real one does
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(loaded.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    # the plug-in's module constants: every LoRA target names modules inside numbered blocks,
    # every default an Args field with a source
    names = [n for n, _ in pipe.transformer.named_modules()]
    for target in Q.LORA_TARGETS.split(","):
        assert any(re.fullmatch(rf".*\.\d+\.(.*\.)?{re.escape(target)}", n) for n in names), target
    fields = V.Args.__dataclass_fields__
    assert all(k in fields and src for k, (_, src) in Q.DEFAULTS.items())
    assert all(k in fields for k in Q.TINY_PRESET)
    assert Q.ALIASES == {"qwen-image": "Qwen/Qwen-Image"}
    assert all(callable(getattr(Q, fn)) for fn in Q.TINY.values())
    assert len(a.blocks()) == pipe.transformer.config.num_layers


@pytest.mark.examples
def test_real_size_pipeline_has_qwen_images_sizes():
    """build_real_size_pipeline on the meta device (shapes only, nothing downloaded): the
    transformer has Qwen-Image's 20.4B parameters and the text encoder Qwen2.5-VL-7B's 8.29B,
    each within 1 %; every parameter is bf16 from the start (no fp32 copy first); and the
    transformer maps the Adapter's 512 px latent (1024 tokens × 64) and text rows of the text
    encoder's width to a velocity of the latent's shape."""
    before = torch.get_default_dtype()
    pipe = Q.build_real_size_pipeline()
    assert torch.get_default_dtype() == before
    count = {n: sum(p.numel() for p in getattr(pipe, n).parameters())
             for n in ("transformer", "text_encoder", "vae")}
    assert count["transformer"] == pytest.approx(20.4e9, rel=0.01)
    assert count["text_encoder"] == pytest.approx(8.29e9, rel=0.01)
    assert count["vae"] == pytest.approx(0.127e9, rel=0.01)
    for n in ("transformer", "text_encoder", "vae"):
        assert {(p.device.type, p.dtype) for p in getattr(pipe, n).parameters()} == {
            ("meta", torch.bfloat16)}, n
    ad = Q.Adapter(pipe, torch.device("meta"), V.Args(resolution=512))
    D = ad.latent_shape(512)
    width = pipe.text_encoder.config.text_config.hidden_size
    assert D == (1024, 64) and width == 3584
    meta = dict(device="meta", dtype=torch.bfloat16)
    v = pipe.transformer(hidden_states=torch.empty((2,) + D, **meta),
                         timestep=torch.empty(2, **meta),
                         encoder_hidden_states=torch.empty(2, 20, width, **meta),
                         encoder_hidden_states_mask=torch.ones(2, 20, dtype=torch.long,
                                                               device="meta"),
                         img_shapes=[[(1, 32, 32)]] * 2, return_dict=False)[0]
    assert v.shape == (2,) + D


@pytest.mark.examples
def test_other_qwen_image_hub_ids_are_this_family():
    """A Qwen-Image hub id that is no alias (a later release, a mirror) gets this family's
    defaults, not SD3's."""
    for hub_id in ("Qwen/Qwen-Image-2512", "someone/qwen-image-fp8"):
        assert V.model_family(hub_id) == "qwen_image", hub_id
        args = V.parse_args(["--model", hub_id])
        value, src = Q.DEFAULTS["num_steps"]
        assert args.num_steps == value and src in args.origin["num_steps"], args.origin
    assert V.model_family("stabilityai/stable-diffusion-3.5-large") == "sd3"
