"""
Z-Image as a vgrpo.py model plug-in: diffusers' ZImagePipeline (Tongyi-MAI/Z-Image-Turbo) behind
the adapter seam of vgrpo.py §9, and a tiny random Z-Image pipeline that runs offline on a CPU.

What the model is. Z-Image is a 6B single-stream DiT (S3-DiT): the image tokens and the caption
tokens are concatenated into ONE sequence that every block attends over (no joint/dual streams as
in SD3 or FLUX). The caption features are the second-to-last hidden states of a Qwen3-4B language
model (2560 wide) run on the prompt wrapped in Qwen's chat template; the latents are those of
FLUX.1's 16-channel autoencoder. Z-Image-Turbo is the few-step distilled variant: no
classifier-free guidance (`guidance_scale=0`), which is what V-GRPO's CFG-free rollouts want.

How its conventions map to vgrpo.py's (t = σ ∈ [0, 1], 1 noise → 0 data, v = ε − x0):
                 vgrpo.py                              ZImagePipeline / ZImageTransformer2DModel
  time           t = σ, 1 = noise                      the transformer's t = (1000 − 1000σ)/1000
                                                       = 1 − σ: 0 = noise, 1 = data (reversed)
  velocity       v = ε − x0                            output u = x0 − ε; the pipeline steps the
                                                       scheduler with −u, so v = −u (negated)
  ODE latent     (M, 16, H/8, W/8), one batch tensor   a LIST of M tensors (16, 1, H/8, W/8): one
                                                       frame each; patchified 2×2 inside
  text           cap_feats (B, L, 2560) zero-padded,   a LIST of B tensors (L_b, 2560): Qwen3's
                 cap_len (B,) the true lengths         hidden_states[-2] with the padding removed
  rollout grid   sigmas(K) from the scheduler           linspace(1, 1/K, K), shifted (Turbo: static
                                                       shift 3; dynamic μ(seq) if configured), + 0
  guidance       none (the conditional branch)         Turbo: guidance_scale 0 (distilled)
  VAE            decode to [0, 1]                      FLUX's AE: z / 0.3611 + 0.1159, then decode
  LoRA           vgrpo.add_lora on DEFAULTS targets    attention.to_q/k/v/to_out.0, feed_forward.
                                                       w1/w2/w3 of every ZImageTransformerBlock

Beyond the contract (kept in this file): the rollout grid depends on the resolution (a dynamic
shift uses the image sequence length) but sigmas(num_steps) gets none, so the adapter keeps
args.resolution; the caption features are ragged, so encode returns them zero-padded to
max_sequence_length with their lengths (cap_len) and velocity cuts each row back before the call.
build_real_size_pipeline() is the real architecture (the Hub's configs, below) with random
weights: on the meta device for counting, on a GPU for the real model's memory and time.

Verified (examples/models/test_z_image.py, on the tiny pipeline, CPU, fp32): the Euler rollout on
sigmas(K) decoded equals ZImagePipeline.__call__ for the same latents and steps with no guidance;
velocity and x̂0 equal the transformer called the pipeline's way; sigmas equal the scheduler's at
two resolutions with static and dynamic shift; |log ρ| = 0 at the first step; a V-GRPO update
raises S of the positive samples and lowers the negatives'; save_lora loads in the stock pipeline
(load_lora_weights) with the trained velocity; the tiny pipeline survives save_pretrained /
from_pretrained; the real-size pipeline, built on meta, has the published parameter counts
(transformer 6.15B, text encoder 4.0B, within 1%). Not verified: the real 6B weights (no
download here), bf16/GPU numerics beyond a CPU autocast smoke check, FSDP and torch.compile over
blocks(), and the Z-Image (base) variant (the same pipeline class, but made for CFG).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import vgrpo as V  # the running trainer (vgrpo.model_plugins maps the name to it)

PIPELINES = ("ZImagePipeline",)
ALIASES = {"z-image-turbo": "Tongyi-MAI/Z-Image-Turbo"}
TINY = {"tiny-z-image": "build_tiny_pipeline"}
# Another hub id that says "z-image" (a mirror, Z-Image base) is this family, with Turbo's defaults:
# set --num_steps for the undistilled base (made for CFG, not verified here).
HUB_HINTS = ("z-image",)

# CPU-sized overrides of DEFAULTS for --model tiny-z-image, as examples/tools/tiny_models.py's
# _TINY: 64 px, 8 steps, a big learning rate so that `--reward jpeg` learns in about a minute.
# 64 caption tokens, not 32: the tiny tokenizer spends one token per byte and the chat template
# alone takes 20 of them.
TINY_PRESET = dict(resolution=64, num_steps=8, eval_steps=16, max_sequence_length=64,
                   prompts_per_iter=4, group_size=8, gradient_checkpointing=False, lora_rank=8,
                   lora_alpha=16, lr=1e-2, iterations=30, micro_batch=32, rollout_batch=32,
                   eval_every=10, save_every=10, n_eval=8, reward="jpeg")

# The family's Args overrides, field -> (value, source): the peer's LoRA GRPO recipe for this
# very model, Flow-Factory (X-GenGroup/Flow-Factory) examples/grpo/lora/z_image_turbo/default.yaml
# (its full fine-tuning recipe beside it has the same sampling, at lr 1e-5). It samples with an
# SDE; vgrpo.py keeps its deterministic rollouts and its own V-GRPO settings.
_FF = "Flow-Factory examples/grpo/lora/z_image_turbo/default.yaml"
DEFAULTS = {
    "resolution": (512, f"{_FF}: train.resolution"),
    "num_steps": (6, f"{_FF}: train.num_inference_steps"),
    "eval_steps": (10, f"{_FF}: eval.num_inference_steps"),
    "group_size": (16, f"{_FF}: train.group_size"),
    "max_sequence_length": (512, "diffusers ZImagePipeline.__call__ max_sequence_length"),
    "lora_rank": (64, f"{_FF}: model.lora_rank"),
    "lora_alpha": (128, f"{_FF}: model.lora_alpha"),
    "lr": (3e-4, f"{_FF}: optimizers learning_rate"),
    "lora_targets": ("attention.to_q,attention.to_k,attention.to_v,attention.to_out.0,"
                     "feed_forward.w1,feed_forward.w2,feed_forward.w3",
                     "Flow-Factory src/flow_factory/models/z_image/z_image.py "
                     "default_target_modules"),
    "gradient_checkpointing": (True, "our choice: memory (a 6B transformer), as SD3's family"),
}


class Adapter:
    """A diffusers ZImagePipeline behind vgrpo.py's seam (the table above); shapes per method."""

    def __init__(self, pipe, device: torch.device, args) -> None:
        self.pipe, self.device = pipe, device
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.L = args.max_sequence_length                    # caption tokens, template included
        self.resolution = args.resolution                    # the grid's dynamic shift needs it
        self.vae_scale = pipe.vae_scale_factor               # 8: AE downsampling
        self._cache: dict | None = None                      # prompt → row (cache_prompts)

    def latent_shape(self, resolution: int) -> tuple:
        """(C, H, W) of one ODE latent: (16, 2·⌊res/16⌋, 2·⌊res/16⌋), as prepare_latents."""
        unit = 2 * self.vae_scale                            # the AE's 8 × the transformer's 2×2
        if resolution % unit:
            raise ValueError(f"Z-Image needs a resolution divisible by {unit}, got {resolution}")
        side = 2 * (resolution // unit)
        return (self.transformer.config.in_channels, side, side)

    # the prompt cache of --offload_text_encoders: SD3's, which reads _encode (below)
    encode, cache_prompts = V.SD3Adapter.encode, V.SD3Adapter.cache_prompts

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> dict:
        """The pipeline's own text stack, CFG-free: a list of (L_b, D) → padded to L rows."""
        # encode_prompt rewrites its list in place (each prompt → its chat template): pass a copy
        feats, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                           do_classifier_free_guidance=False,
                                           max_sequence_length=self.L)
        B, D = len(feats), feats[0].shape[-1]
        cap = feats[0].new_zeros(B, self.L, D)               # (B, L, D): fixed L, so cached rows
        for i, f in enumerate(feats):                        # of different batches stack
            cap[i, :len(f)] = f
        lens = torch.tensor([len(f) for f in feats], device=cap.device)  # (B,)
        return {"cap_feats": cap, "cap_len": lens}

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v_θ(x, t, c) = ε − x0: x (M, C, H, W), t (M,) = σ (1 = noise) → (M, C, H, W)."""
        dt = x.dtype if torch.is_autocast_enabled(x.device.type) else self.transformer.dtype
        lens = cond["cap_len"].tolist()                      # ragged captions: one host sync
        caps = [c[:n].to(dt) for c, n in zip(cond["cap_feats"], lens)]   # M × (L_m, D)
        frames = list(x.to(dt).unsqueeze(2).unbind(0))       # M × (C, 1, H, W): one frame each
        # the pipeline's time, op for op: timestep = 1000σ (fp32), then (1000 − timestep)/1000
        t_z = (1000 - t.float() * 1000) / 1000               # (M,), 1 − σ: 0 noise → 1 data
        out = self.transformer(frames, t_z, caps, return_dict=False)[0]  # M × (C, 1, H, W)
        return -torch.stack(out).squeeze(2)                  # (M, C, H, W): u = x0 − ε, v = −u

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (M, C, H, W) → images (M, 3, 8H, 8W) in [0, 1], fp32, as __call__ decodes."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + cfg.shift_factor
        return (self.vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The rollout grid (K + 1,) float64, 1 → 0, of ZImagePipeline.__call__ at this
        resolution: its default sigmas and its μ (calculate_shift of the image sequence length)
        through a fresh copy of the pipeline's scheduler, which shifts them and appends the 0."""
        from diffusers.pipelines.z_image.pipeline_z_image import (calculate_shift,
                                                                  get_default_z_image_sigmas)
        sched = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        _, H, W = self.latent_shape(self.resolution)
        c = sched.config
        mu = calculate_shift((H // 2) * (W // 2), c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                             c.get("max_shift", 1.15))       # ignored by a static-shift scheduler
        sched.set_timesteps(num_steps, sigmas=get_default_z_image_sigmas(num_steps), mu=mu)
        return sched.sigmas.detach().double().cpu()

    def blocks(self) -> list:
        """Every ZImageTransformerBlock: the noise and context refiners, then the main layers."""
        tr = self.transformer
        return [*tr.noise_refiner, *tr.context_refiner, *tr.layers]

    def save_lora(self, folder: str, state: dict, lora_config) -> None:
        """Write the LoRA in diffusers' format (ZImagePipeline.load_lora_weights reads it)."""
        type(self.pipe).save_lora_weights(folder, transformer_lora_layers=state,
                                          transformer_lora_adapter_metadata=lora_config.to_dict())


# ------------------------------------------------------------------------------------------------
# Random pipelines, built offline: the real architecture (a GPU's memory and time at real size)
# and the tiny one (--model tiny-z-image). Real classes, real loaders, random weights.
# ------------------------------------------------------------------------------------------------
# Tongyi-MAI/Z-Image-Turbo's published configs, the Hub's {transformer,vae,text_encoder,scheduler}/
# config.json (text_encoder/ is Qwen3-4B's; model_index.json loads it as a Qwen3Model, no LM head).
REAL_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840,
                        n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5,
                        qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
                        axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])
REAL_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                layers_per_block=2, latent_channels=16, norm_num_groups=32, act_fn="silu",
                sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                mid_block_add_attention=True, force_upcast=True, use_quant_conv=False,
                use_post_quant_conv=False)                    # FLUX.1's autoencoder
REAL_TEXT_ENCODER = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         rope_theta=1e6, attention_bias=False, hidden_act="silu",
                         tie_word_embeddings=True)
REAL_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# The published sizes (parameters): the transformer 6B (arXiv 2511.22699, the model card), 6.15B
# to three digits as quoted for the released weights; the text encoder Qwen3-4B, 4.0B (its card).
PUBLISHED_PARAMS = {"transformer": 6.15e9, "text_encoder": 4.0e9}


# Qwen3's chat template, reduced to what encode_prompt uses: one user turn, then the assistant
# header; with enable_thinking false Qwen3 adds an empty think block (encode_prompt passes true).
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


def _tiny_models():
    """examples/tools/tiny_models.py by path (the module vgrpo.tiny_models() loads, shared)."""
    if "vgrpo_tiny_models" in sys.modules:
        return sys.modules["vgrpo_tiny_models"]
    path = Path(__file__).resolve().parents[1] / "tools" / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("vgrpo_tiny_models", path)
    mod = sys.modules["vgrpo_tiny_models"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_qwen_tokenizer():
    """A real Qwen2Tokenizer (byte-level BPE, Qwen's pre-tokenizer) over a 256-byte vocabulary
    and Qwen's special tokens, no merges (each byte one token), with a chat template; offline."""
    from transformers import Qwen2Tokenizer
    byte_chars = list(_tiny_models()._bytes_to_unicode().values())       # GPT-2's byte table
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab = {tok: i for i, tok in enumerate(byte_chars + special)}       # 261 tokens
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=4096,
                         additional_special_tokens=special[1:])
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def build_tiny_pipeline(seed: int = 0):
    """A randomly initialised ZImagePipeline in miniature: a 2-layer Qwen3 text encoder (32 wide),
    a Z-Image transformer with one noise and one context refiner and two main layers (dim 32,
    2 heads), FLUX's AE shape in miniature with the latent-sensitive decoder of the tiny SD3
    pipeline, Z-Image-Turbo's scheduler (static shift 3). Every module eval, dropout 0."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline,
                           ZImageTransformer2DModel)
    from transformers import Qwen3Config, Qwen3Model
    torch.manual_seed(seed)
    tok = tiny_qwen_tokenizer()
    text = Qwen3Model(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        attention_dropout=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    # head_dim 16 = sum(axes_dims); the real model's RoPE lengths (REAL_TRANSFORMER): up to 1536
    # caption positions on the first axis, 512 latent patches per side
    transformer = ZImageTransformer2DModel(**{
        **REAL_TRANSFORMER, "dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2,
        "n_kv_heads": 2, "cap_feat_dim": 32, "axes_dims": [4, 6, 6]})
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
                        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False)                      # FLUX's AE constants
    _tiny_models()._smooth_decoder(vae)     # else the image barely depends on the latent
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**REAL_SCHEDULER), vae=vae,
                          text_encoder=text, tokenizer=tok, transformer=transformer)
    for m in (transformer, vae, text):
        m.eval()                            # built from configs, modules start in train mode
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_real_size_pipeline(dtype: torch.dtype = torch.bfloat16, device="meta"):
    """ZImagePipeline with Z-Image-Turbo's architecture (the REAL_* configs above) and random
    weights, without a download: on the meta device (the default) nothing is allocated, so a
    CPU can count its parameters; on a GPU its memory and time are the real model's. The
    tokenizer is the tiny one (the real vocabulary is not offline); its ids are valid rows of
    the real 151936-token embedding, so prompts encode, though not as the real text would."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline,
                           ZImageTransformer2DModel)
    from transformers import Qwen3Config, Qwen3Model
    tok = tiny_qwen_tokenizer()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # initialised in dtype: 10B fp32 weights never exist
    try:
        with torch.device(device):
            transformer = ZImageTransformer2DModel(**REAL_TRANSFORMER)
            vae = AutoencoderKL(**REAL_VAE)
            text = Qwen3Model(Qwen3Config(**REAL_TEXT_ENCODER, pad_token_id=tok.pad_token_id,
                                          eos_token_id=tok.eos_token_id))
    finally:
        torch.set_default_dtype(default)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**REAL_SCHEDULER), vae=vae,
                          text_encoder=text, tokenizer=tok, transformer=transformer)
    for m in (transformer, vae, text):
        m.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
