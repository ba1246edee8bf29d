"""
Qwen-Image as a vgrpo.py model plug-in: diffusers' QwenImagePipeline (hub id Qwen/Qwen-Image).

Qwen-Image is a 20B MMDiT (60 double-stream blocks, 24 heads × 128) that reads the last hidden
layer of Qwen2.5-VL-7B as its text, and generates in the 16-channel latent space of a causal 3-D
(video-style) VAE whose images are one-frame videos. It is trained by rectified flow and sampled
with FlowMatchEulerDiscreteScheduler under a resolution-dependent ("dynamic") exponential time
shift; it is not guidance-distilled (the pipeline's CFG is "true CFG", a second branch).

How its conventions map to vgrpo.py's (next to the SD3 / FLUX table above vgrpo.SD3Adapter):
               QwenImagePipeline                          this plug-in (vgrpo.py's convention)
  text         Qwen2.5-VL last layer, chat template's     prompt_embeds (B, L, 3584) and its
               first 34 tokens dropped, padded to the     mask prompt_mask (B, L): both travel
               batch's longest + mask (None if all 1)     with cond, always (never None)
  VAE latent   (B, 16, 1, H/8, W/8), normalised by the    decode() undoes it: z·std + mean
               per-channel latents_mean / latents_std
  ODE latent   packed 2×2 into tokens: (B, (H/16)(W/16),  the same packed layout, D = (seq, 64);
               64) and img_shapes [(1, H/16, W/16)]       img_shapes rebuilt from seq
  t            timestep = σ (= 1000·σ / 1000, rounded     t = σ ∈ [0, 1], t = 1 noise → 0 data,
               to the latents' dtype); the transformer    rounded the pipeline's way
               scales by 1000 inside
  velocity     the transformer's output is ε − x0         v = ε − x0, unchanged (no sign flip)
  guidance     true CFG (true_cfg_scale with a            none: the conditional branch only,
               negative prompt); off without one          as vgrpo.py is CFG-free [paper P11]
  rollout grid linspace(1, 1/K, K), shifted by            the same, from the pipeline's own
               exp(μ), μ = calculate_shift(seq) (base     calculate_shift / retrieve_timesteps
               0.5 @ 256 → max 0.9 @ 8192 tokens), then   on a copy of its scheduler, at the
               stretched so the last σ is shift_terminal  run's resolution; then 0 appended
               0.02; then 0

Verified (examples/models/test_qwen_image.py, on the tiny pipeline below, CPU, fp32): the Euler
rollout of Adapter.velocity on Adapter.sigmas(K), decoded, equals QwenImagePipeline.__call__ for
the same initial latents, steps and no CFG; velocity and x̂0 equal the transformer called the
pipeline's way; the first update step's |log ρ| is 0; V-GRPO steps raise S of the positively
advantaged samples and lower the negatives'; a LoRA written by save_lora loads with the stock
pipeline's load_lora_weights and reproduces the trained velocity; the tiny pipeline survives
save_pretrained / from_pretrained; build_real_size_pipeline (the real architecture, random
weights, for examples/gpu/gpu_check.py) has the published sizes on the meta device. Not verified
here: the real 20B weights (nothing is downloaded
offline), bf16 on a GPU, the peers' defaults as a training recipe for V-GRPO, non-square images
(vgrpo.py trains squares), and Qwen-Image-Edit / Layered variants (other pipelines).
"""
from __future__ import annotations

import math

import numpy as np
import torch

PIPELINES = ("QwenImagePipeline",)
ALIASES = {"qwen-image": "Qwen/Qwen-Image"}
TINY = {"tiny-qwen-image": "build_tiny_pipeline"}
# Another hub id that says "qwen-image" (Qwen/Qwen-Image-2512, a mirror) is this family: its
# defaults, not SD3's. (An edit model's id matches too; its pipeline class is refused in one line.)
HUB_HINTS = ("qwen-image",)

# Both streams' attention projections and both streams' MLPs, inside the numbered blocks.
LORA_TARGETS = ("to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,"
                "img_mlp.net.0.proj,img_mlp.net.2,txt_mlp.net.0.proj,txt_mlp.net.2")

# The family's Args overrides: field -> (value, source). Peers' Qwen-Image configs: Flow-GRPO
# [peer X1] config/grpo.py pickscore_qwenimage; Flow-Factory (X-GenGroup/Flow-Factory)
# examples/grpo/lora/qwen_image/default.yaml. Both sample with an SDE and true CFG 4; vgrpo.py
# keeps its deterministic CFG-free rollouts, so `guidance` (FLUX's distilled guidance) has no
# entry: Qwen-Image has no guidance embedding.
DEFAULTS = {
    "resolution": (512, "[peer X1] pickscore_qwenimage resolution 512; Flow-Factory 512"),
    "num_steps": (10, "[peer X1] pickscore_qwenimage sample.num_steps 10; Flow-Factory 10"),
    "eval_steps": (50, "[peer X1] eval_num_steps 50; QwenImagePipeline.__call__'s default"),
    "max_sequence_length": (512, "QwenImagePipeline.__call__'s default max_sequence_length"),
    "group_size": (16, "[peer X1] num_image_per_prompt 16; Flow-Factory group_size 16"),
    "lora_rank": (64, "Flow-Factory examples/grpo/lora/qwen_image/default.yaml lora_rank"),
    "lora_alpha": (128, "Flow-Factory examples/grpo/lora/qwen_image/default.yaml lora_alpha"),
    "lr": (3e-4, "Flow-Factory examples/grpo/lora/qwen_image/default.yaml learning_rate"),
    "lora_targets": (LORA_TARGETS, "Flow-Factory QwenImageAdapter.default_target_modules (its "
                                   "img_mlp.net.2.proj names no module; net.2 is the Linear)"),
    "gradient_checkpointing": (True, "[peer X1] pickscore_qwenimage activation_checkpointing"),
}

# --model tiny-qwen-image (our choice, CPU-sized like examples/tools/tiny_models.py's _TINY):
# 64 px = 4 × 4 tokens; the JPEG reward needs no reward model.
TINY_PRESET = dict(resolution=64, num_steps=8, eval_steps=16, max_sequence_length=64,
                   prompts_per_iter=4, group_size=8, gradient_checkpointing=False, lora_rank=8,
                   lora_alpha=16, lr=1e-2, iterations=30, micro_batch=32, rollout_batch=32,
                   eval_every=10, save_every=10, n_eval=8, reward="jpeg")


class Adapter:
    """A diffusers QwenImagePipeline behind vgrpo.py's model seam (examples/models/README.md)."""

    def __init__(self, pipe, device: torch.device, args) -> None:
        cfg = pipe.transformer.config
        if cfg.guidance_embeds or cfg.use_additional_t_cond or cfg.zero_cond_t:
            # the text-to-image pipeline's call: none of these (Edit / Layered variants set them)
            raise ValueError(f"{type(pipe.transformer).__name__} with guidance_embeds, "
                             "use_additional_t_cond or zero_cond_t is not Qwen-Image text-to-image")
        self.pipe, self.device = pipe, device
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.L, self.resolution = args.max_sequence_length, args.resolution
        self.vae_scale = pipe.vae_scale_factor      # 8 = 2 ** len(vae.temperal_downsample)
        self._cache: dict | None = None             # prompt → (L_p, 3584) rows (cache_prompts)

    def latent_shape(self, resolution: int) -> tuple:
        """D = (seq, 64): (resolution/16)² tokens of 2×2 patches × 16 latent channels."""
        if resolution % (2 * self.vae_scale):
            raise ValueError(f"Qwen-Image needs a resolution divisible by {2 * self.vae_scale}: "
                             f"{resolution}")
        side = resolution // (2 * self.vae_scale)   # tokens per side
        return (side * side, self.transformer.config.in_channels)

    # --- text ---------------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> dict:
        """CFG-free conditioning of B prompts: prompt_embeds (B, L, D_txt) and prompt_mask (B, L)
        long, L the longest prompt's tokens (≤ max_sequence_length), from the cache or the text
        encoder. The mask must travel with the embeddings: rows are zero-padded."""
        if self._cache is None:
            return self._encode(prompts)
        if missing := [p for p in prompts if p not in self._cache]:
            raise ValueError("prompt not among the cached embeddings (--offload_text_encoders): "
                             f"{missing[0]!r}")
        return self._pad([self._cache[p] for p in prompts])

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> dict:
        pe, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                           max_sequence_length=self.L)  # (B, L, D), (B, L) | None
        if mask is None:  # the pipeline drops an all-ones mask; vgrpo selects rows of tensors
            mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
        return {"prompt_embeds": pe, "prompt_mask": mask}

    def _pad(self, rows: list) -> dict:
        """Cached rows (L_p, D) → the encoder's batch layout: zero-padded to the longest + mask."""
        L = max(len(r) for r in rows)
        pe = torch.stack([torch.cat([r, r.new_zeros(L - len(r), r.shape[1])]) for r in rows])
        mask = torch.stack([torch.arange(L) < len(r) for r in rows]).long()  # (B, L)
        return {"prompt_embeds": pe.to(self.device), "prompt_mask": mask.to(self.device)}

    @torch.no_grad()
    def cache_prompts(self, prompts: list[str], batch: int = 16) -> None:
        """Embed every prompt once (its valid tokens, on the CPU), then the text encoder to CPU."""
        uniq, cache = list(dict.fromkeys(prompts)), {}
        for i in range(0, len(uniq), batch):
            c = self._encode(uniq[i:i + batch])
            for p, row, m in zip(uniq[i:i + batch], c["prompt_embeds"], c["prompt_mask"]):
                cache[p] = row[m.bool()].cpu()  # (L_p, D): padding is re-made per batch
        self._cache = cache
        self.pipe.text_encoder.to("cpu")
        torch.cuda.empty_cache()  # a no-op when CUDA is unused

    # --- the ODE ------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v_θ(x, t, c) = ε − x0 on packed latents x (M, seq, 64), t (M,) in [0, 1] (1 = noise).
        The pipeline hands the transformer σ as (1000·σ in the latents' dtype) / 1000, so do we:
        in bf16 that rounding is visible, and rollouts then match the pipeline's step for step."""
        dt = x.dtype if torch.is_autocast_enabled(x.device.type) else self.transformer.dtype
        side = math.isqrt(x.shape[1])                      # square images: seq = side²
        return self.transformer(
            hidden_states=x.to(dt), timestep=(t * 1000).to(dt) / 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=cond["prompt_mask"],
            img_shapes=[[(1, side, side)]] * x.shape[0], return_dict=False)[0]  # (M, seq, 64)

    def sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The pipeline's rollout grid (K + 1,) float64, 1 → σ_K = shift_terminal → 0, for the
        run's resolution (or `resolution`): its own calculate_shift(seq) → μ and
        retrieve_timesteps(sigmas=linspace(1, 1/K, K), mu=μ), on a copy of its scheduler."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import (calculate_shift,
                                                                     retrieve_timesteps)
        seq = self.latent_shape(resolution or self.resolution)[0]
        cfg = self.pipe.scheduler.config
        mu = calculate_shift(seq, cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        sched = type(self.pipe.scheduler).from_config(cfg)  # the pipeline's stays untouched
        retrieve_timesteps(sched, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps,
                                                                      num_steps), mu=mu)
        return sched.sigmas.detach().double().cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents (M, seq, 64) → images (M, 3, 16·√seq, 16·√seq) fp32 in [0, 1]."""
        M, seq, C4 = latents.shape
        s, C = math.isqrt(seq), C4 // 4
        z = latents.float().view(M, s, s, C, 2, 2).permute(0, 3, 1, 4, 2, 5)  # M,C,s,2,s,2
        z = z.reshape(M, C, 1, 2 * s, 2 * s)                 # (M, C, 1 frame, H/8, W/8)
        cfg, dev = self.vae.config, latents.device
        mean = torch.tensor(cfg.latents_mean, device=dev).view(1, C, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std, device=dev).view(1, C, 1, 1, 1)
        z = (z / inv_std + mean).to(self.vae.dtype)          # the pipeline's arithmetic, exactly
        img = self.vae.decode(z).sample[:, :, 0]             # (M, 3, H, W) in [-1, 1]
        return (img.float() / 2 + 0.5).clamp(0, 1)

    # --- training -----------------------------------------------------------------------------
    def blocks(self) -> list:
        """The 60 (tiny: 2) QwenImageTransformerBlocks: compile / FSDP units."""
        return list(self.transformer.transformer_blocks)

    def save_lora(self, folder: str, state: dict, lora_config) -> None:
        """The LoRA in diffusers' format: QwenImagePipeline.load_lora_weights(folder) reads it."""
        type(self.pipe).save_lora_weights(folder, transformer_lora_layers=state,
                                          transformer_lora_adapter_metadata=lora_config.to_dict())


# ------------------------------------------------------------------------------------------------
# The tiny offline pipeline (--model tiny-qwen-image): random weights, real classes and configs.
# ------------------------------------------------------------------------------------------------
# The chat template's system prefix as Qwen2's BPE splits it: 34 tokens, the pipeline's
# prompt_template_encode_start_idx. The tiny tokenizer gets merges for exactly these words so
# that the pipeline drops the whole prefix, as it does with the real tokenizer.
_TEMPLATE_WORDS = ("system", "user", "\n", "Describe", " the", " image", " by", " detailing",
                   " color", " shape", " size", " texture", " quantity", " text", " spatial",
                   " relationships", " of", " objects", " and", " background")
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen/Qwen-Image's scheduler/scheduler_config.json: the dynamic shift under test.
REAL_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192,
                      max_shift=0.9, num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
                      time_shift_type="exponential", use_dynamic_shifting=True)


def _bytes_to_unicode() -> dict:
    """GPT-2 / Qwen2 byte-level table: byte → printable character."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_qwen2_tokenizer():
    """A real Qwen2Tokenizer (byte-level BPE, Qwen2's pre-tokenizer) over the 256 byte symbols,
    the template words' merges and the chat special tokens: ~360 tokens, built offline."""
    from transformers import Qwen2Tokenizer
    b2u = _bytes_to_unicode()
    vocab, merges = {c: i for i, c in enumerate(b2u.values())}, []
    for word in _TEMPLATE_WORDS:  # left-to-right merges: "Ġ"+"t" → "Ġt", "Ġt"+"h" → "Ġth", ...
        u = "".join(b2u[b] for b in word.encode())
        for k in range(2, len(u) + 1):
            if u[:k] not in vocab:
                merges.append((u[:k - 1], u[k - 1]))
                vocab[u[:k]] = len(vocab)
    for s in _SPECIAL:
        vocab[s] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=list(_SPECIAL[1:]))


def build_tiny_pipeline(seed: int = 0):
    """A randomly initialised QwenImagePipeline in miniature, offline: a 2-layer Qwen2.5-VL text
    model (hidden 32, mRoPE, a 1-block vision tower it never uses), a 2-block transformer
    (2 heads × 16, RoPE axes 4 + 6 + 6), the 3-D VAE at base width 8 with Qwen-Image's
    latents_mean / std and 8× downsampling, and the real scheduler config. Every module .eval(),
    dropout 0; the VAE decoder is made latent-sensitive (_smooth_decoder)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImagePipeline, QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    tok = tiny_qwen2_tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in _SPECIAL}
    V, hidden = len(tok), 32
    te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=V, hidden_size=hidden, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, attention_dropout=0.0,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # head 8
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
        # ids past the vocabulary: no text token can be taken for an image placeholder
        image_token_id=V + 1, video_token_id=V + 2, vision_start_token_id=V + 3,
        vision_end_token_id=V + 4))
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=hidden, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 attn_scales=[], temperal_downsample=[False, True, True],
                                 dropout=0.0)
    _smooth_decoder(vae)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**REAL_SCHEDULER),
                             vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer)
    for m in (transformer, vae, te):
        m.eval()  # built from configs, modules start in train mode
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def _smooth_decoder(vae) -> None:
    """Make the tiny VAE decoder a smooth upsampler of latent channels 0–2 instead of random.

    At random init the decoded image barely depends on the latent (its pixel std is the same,
    0.16, for latents scaled ×0, ×1 and ×4), so no image reward could be learned. Here every
    residual branch (resnet conv2, attention proj) and every conv bias is zeroed, conv_in,
    the channel-changing shortcuts and conv_out pass channels through, and each upsampler's conv
    is a 3×3 binomial blur; the architecture and the loading code are untouched."""
    dec = vae.decoder
    for name, mod in dec.named_modules():
        if name.endswith("conv2") or name.endswith("proj"):
            mod.weight.zero_()
    for name, p in dec.named_parameters():
        if name.endswith("bias") and "norm" not in name:
            p.zero_()
    blur = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    for name, mod in dec.named_modules():
        w = getattr(mod, "weight", None)
        if name.endswith("resample.1"):                      # Conv2d(dim, dim // 2, 3)
            w.zero_()
            for i in range(w.shape[0]):
                w[i, i] = blur
        elif w is not None and (name.endswith("conv_shortcut") or name in ("conv_in", "conv_out")):
            w.zero_()                                        # causal Conv3d (out, in, T, kh, kw)
            for i in range(min(w.shape[0], w.shape[1], 3)):
                w[i, i, -1, w.shape[3] // 2, w.shape[4] // 2] = 0.5 if name == "conv_out" else 1


# ------------------------------------------------------------------------------------------------
# The real architecture with random weights (examples/gpu/gpu_check.py: time and memory at size)
# ------------------------------------------------------------------------------------------------
# Qwen/Qwen-Image's transformer/config.json, vae/config.json and text_encoder/config.json (the
# last is Qwen/Qwen2.5-VL-7B-Instruct's): the values below, written out so that nothing is read
# from the Hub. The transformer's and the VAE's are also diffusers' defaults for these classes
# (docs/source/en/api/models/qwenimage_transformer2d.md lists them). Built here: 20.43B
# transformer parameters (the report says "a 20B MMDiT"; quoted elsewhere as 20.4B) and 8.29B
# in the text encoder (Qwen2.5-VL-7B's count, its 0.68B vision tower included).
REAL_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                        guidance_embeds=False, axes_dims_rope=(16, 56, 56))
REAL_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0,
                latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
                latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160])
REAL_TEXT_ENCODER = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     hidden_act="silu", attention_dropout=0.0, tie_word_embeddings=False,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                     bos_token_id=151643, eos_token_id=151645),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       in_chans=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, hidden_act="silu",
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653, tie_word_embeddings=False)


class _default_dtype:
    """Parameters created inside are `dtype` from the start: the 20B transformer in fp32 first
    would need 82 GB, more than an 80 GB card holds, before the cast to bf16."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc) -> None:
        torch.set_default_dtype(self.saved)


def build_real_size_pipeline(dtype: torch.dtype = torch.bfloat16, device="meta"):
    """QwenImagePipeline with Qwen-Image's real architecture and RANDOM weights, built from the
    configs above with nothing downloaded: the 60-block transformer (20.4B parameters), the
    3-D VAE at base width 96, and Qwen2.5-VL-7B (8.3B, its vision tower included, unused) as
    the text encoder, each created directly in `dtype` on `device` ("meta": shapes only, no
    memory). The tokenizer is the tiny offline one (tiny_qwen2_tokenizer): byte-level, so a
    prompt is a few times more text tokens than Qwen2's real vocabulary gives (next to the
    1024 image tokens of 512 px, a small share). The ids it makes are valid rows of the real
    embedding table; the pipeline's 34-token template prefix is dropped as with the real one."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImagePipeline, QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    tok = tiny_qwen2_tokenizer()
    with torch.device(device), _default_dtype(dtype):
        transformer = QwenImageTransformer2DModel(**REAL_TRANSFORMER)
        vae = AutoencoderKLQwenImage(**REAL_VAE)
        te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**REAL_TEXT_ENCODER))
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**REAL_SCHEDULER),
                             vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer)
    for m in (transformer, vae, te):
        m.requires_grad_(False).eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
