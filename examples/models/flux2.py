"""
FLUX.2 [klein] behind vgrpo.py's model seam: a plug-in for diffusers' Flux2KleinPipeline (and the
Flux2Pipeline of FLUX.2 [dev], which shares its latents, transformer and scheduler).

The model. FLUX.2 [klein] (Black Forest Labs, January 2026) is a rectified-flow transformer with
5 double-stream and 20 single-stream blocks (klein-4B; 8 + 24 for 9B), a Qwen3 text encoder
(Qwen3-4B / Qwen3-8B: three of its hidden layers, stacked, are the text tokens) and the FLUX.2
VAE: 32 latent channels at 1/8 of the image side, 2×2-patchified to 128 channels and normalised by
the VAE's own BatchNorm running statistics. The released klein checkpoints are step-distilled:
4 steps, no classifier-free guidance, no guidance embedding, so the CFG-free rollouts of V-GRPO
are the model's ordinary samples. FLUX.2 [dev] (Flux2Pipeline) differs only in its text stack
(Mistral3) and an embedded guidance scale, both of which this file passes through the pipeline.

How its conventions map to vgrpo.py's (§2: t = 1 noise → 0 data, x_t = (1 − t)·x0 + t·ε,
v = ε − x0); what Adapter converts:
                 vgrpo.py                       Flux2KleinPipeline (diffusers 0.42)
  time           t = σ ∈ [0, 1], 1 = noise      the same σ; the scheduler's timesteps are 1000·σ,
                                                the pipeline passes timestep/1000 and the
                                                transformer multiplies by 1000 inside: we pass σ
  velocity       v = ε − x0                     the transformer's output as is: the scheduler's
                                                Euler step is x ← x + (σ' − σ)·v
  ODE latent     D = (128, H/16, W/16)          the same normalised, patchified latent: the layout
                                                of the pipeline's `latents=` argument; it packs
                                                it to (H/16·W/16, 128) tokens, so do we, but
                                                only inside velocity()
  position ids   -                              image (T, H, W, L) = (0, i, j, 0) per token, text
                                                (0, 0, 0, l): the pipeline's own helpers
  text           cond["prompt_embeds"]          Qwen3 on the chat-templated prompt, padded to L
                 (B, L, 3·hidden)               tokens; hidden states of layers 9, 18, 27 stacked
                                                (3·2560 = 7680 wide for klein-4B)
  guidance       CFG-free                       klein: none; [dev]: the embedded scale (--guidance)
  rollout grid   sigmas(K)                      linspace(1, 1/K, K), the scheduler's exponential
                                                time shift with mu = compute_empirical_mu(H/16 ·
                                                W/16, K) (it depends on K too), then 0
  decode         images in [0, 1]               un-normalise (BatchNorm stats), unpatchify,
                                                VAE decode, x/2 + 1/2

What is verified (examples/models/test_flux2.py, on build_tiny_pipeline's random tiny model, CPU):
the Euler rollout of Adapter.velocity on Adapter.sigmas(K) decodes to the pipeline's own __call__
images for the same initial latents, steps and no guidance, and the grid is the one its scheduler
used; the velocity and x̂0 equal the transformer called the pipeline's way; the first step's
|log ρ| is 0; a V-GRPO update with fixed advantages ±1 raises the positives' surrogate and lowers
the negatives'; a LoRA saved with save_lora loads in the stock pipeline (load_lora_weights) and
reproduces the trained velocity; the tiny pipeline saves and loads back through from_pretrained;
Flux2Pipeline's rollout with embedded guidance equals its __call__ (given prompt embeddings); a
folder missing a part or naming another FLUX.2 pipeline is one line before anything loads;
build_real_size_pipeline (klein-4B's published architecture, random weights, on the meta device)
has the transformer, text encoder and VAE sizes of the Hub's weights to within 1%.
What is not verified: anything with real weights (no weights offline), the real size on a GPU
(examples/gpu/gpu_check.py's row), bf16 numerics on a GPU, the real Qwen3 tokenizer and chat
template (the tiny one is built here to the same shape), FLUX.2 [dev]'s Mistral3 text stack, the
undistilled klein-base checkpoints (made for CFG and ~50 steps; V-GRPO's rollouts are CFG-free),
and the DEFAULTS' training outcome.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import vgrpo as V  # the running trainer (vgrpo.model_plugins maps the name to it)

PIPELINES = ("Flux2KleinPipeline", "Flux2Pipeline")
ALIASES = {"flux.2-klein-4b": "black-forest-labs/FLUX.2-klein-4B",   # Apache-2.0
           "flux.2-klein-9b": "black-forest-labs/FLUX.2-klein-9B"}   # non-commercial licence
TINY = {"tiny-flux2-klein": "build_tiny_pipeline"}
# Other klein hub ids (the undistilled -base ones, quantised mirrors) are this family, not
# FLUX.1 (flux.py's hint "flux" is shorter, and the longest hint wins). FLUX.2 [dev]'s id
# is left to FLUX.1's defaults: klein's 4 steps are its distillation, not [dev]'s.
HUB_HINTS = ("flux.2-klein", "flux2-klein", "flux-2-klein")

# LoRA on the attention and feed-forward linears of both block kinds. The single-stream blocks'
# output projection `attn.to_out` is left out, as in the peer's list: its name also matches the
# double-stream blocks' `attn.to_out` ModuleList, which is not a Linear.
FLUX2_LORA_TARGETS = ("to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,"
                      "ff.linear_in,ff.linear_out,ff_context.linear_in,ff_context.linear_out,"
                      "to_qkv_mlp_proj")

_FF = "Flow-Factory examples/grpo/lora/flux2_klein/default.yaml"  # the peer's klein GRPO config
DEFAULTS = {
    "resolution": (384, f"{_FF}: train.resolution 384"),
    "num_steps": (4, f"{_FF}: num_inference_steps 4 (klein is step-distilled to 4)"),
    "eval_steps": (4, "diffusers test_flux2_klein_inference_512: 4 steps, guidance 1.0"),
    "max_sequence_length": (512, "diffusers Flux2KleinPipeline.__call__: max_sequence_length 512"),
    "lora_rank": (64, f"{_FF}: lora_rank 64"),
    "lora_alpha": (128, f"{_FF}: lora_alpha 128"),
    "lora_targets": (FLUX2_LORA_TARGETS,
                     "Flow-Factory src/flow_factory/models/flux/flux2_klein.py default targets"),
    "group_size": (16, f"{_FF}: group_size 16"),
    "global_std": (False, f"{_FF}: global_std false"),
    "lr": (3e-4, f"{_FF}: learning_rate 3.0e-4"),
    "gradient_checkpointing": (False, f"{_FF}: enable_gradient_checkpointing false"),
}
# --model tiny-flux2-klein on a CPU: the sizes of examples/tools/tiny_models.py's _TINY (our
# choice), with 64 text tokens because the tiny tokenizer spends one token per byte and the chat
# template alone takes 25.
TINY_PRESET = dict(resolution=64, num_steps=8, eval_steps=16, max_sequence_length=64,
                   prompts_per_iter=4, group_size=8, gradient_checkpointing=False, lora_rank=8,
                   lora_alpha=16, lr=1e-2, iterations=30, micro_batch=32, rollout_batch=32,
                   eval_every=10, save_every=10, n_eval=8, reward="jpeg")


class Adapter:
    """A diffusers Flux2KleinPipeline (or Flux2Pipeline) behind vgrpo.py's seam (the table above).

    The ODE runs on the pipeline's normalised, patchified latent (M, 128, H/16, W/16); velocity()
    packs it to tokens for the transformer and back, a pure permutation (so Gaussian noise and
    per-element means are the same in both layouts)."""

    def __init__(self, pipe, device: torch.device, args) -> None:
        self.pipe, self.device = pipe, device
        self.transformer, self.vae = pipe.transformer, pipe.vae
        self.L, self.resolution = args.max_sequence_length, args.resolution
        self.patch = 2 * pipe.vae_scale_factor      # 16 image pixels per side of one latent token
        # [dev] embeds its guidance scale like FLUX.1-dev; klein has no guidance embedder
        self.guidance = args.guidance if self.transformer.config.guidance_embeds else None
        self._cache: Optional[dict] = None          # prompt → embeddings (cache_prompts)
        self._ids: dict = {}                        # (L, h, w) → (txt_ids, img_ids)

    def latent_shape(self, resolution: int) -> tuple:
        r = resolution // self.patch                # the pipeline floors H to a multiple of 16
        return (self.transformer.config.in_channels, r, r)  # (128, H/16, W/16)

    # the prompt cache of --offload_text_encoders: SD3's, which reads _encode (below)
    encode, cache_prompts = V.SD3Adapter.encode, V.SD3Adapter.cache_prompts

    @torch.no_grad()  # encode_prompt is not under no_grad itself
    def _encode(self, prompts: list[str]) -> dict:
        """The pipeline's conditional branch only (CFG-free): prompt_embeds (B, L, 3·hidden)."""
        pe, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                        max_sequence_length=self.L)  # its default text layers
        return {"prompt_embeds": pe}

    def _position_ids(self, L: int, h: int, w: int) -> tuple:
        """(L, 4) text and (h·w, 4) image ids from the pipeline's own helpers; every row of a
        batch shares them (the transformer reads only the first row of 3-D ids)."""
        if (L, h, w) not in self._ids:
            cls = type(self.pipe)
            txt = cls._prepare_text_ids(torch.zeros(1, L, 1))[0]          # (L, 4): (0, 0, 0, l)
            img = cls._prepare_latent_ids(torch.zeros(1, 1, h, w))[0]    # (h·w, 4): (0, i, j, 0)
            self._ids[(L, h, w)] = (txt.to(self.device), img.to(self.device))
        return self._ids[(L, h, w)]

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v_θ(x, t, c) = ε̂ − x̂0 on the latent x (M, 128, h, w), t (M,) = σ (1 = noise)."""
        M, C, h, w = x.shape
        pe = cond["prompt_embeds"]                                              # (M, L, D)
        dt = x.dtype if torch.is_autocast_enabled(x.device.type) else self.transformer.dtype
        txt_ids, img_ids = self._position_ids(pe.shape[1], h, w)
        tokens = x.reshape(M, C, h * w).permute(0, 2, 1)   # (M, h·w, 128): _pack_latents' order
        g = (None if self.guidance is None  # the transformer scales σ and guidance by 1000
             else torch.full((M,), self.guidance, device=x.device, dtype=torch.float32))
        v = self.transformer(hidden_states=tokens.to(dt), timestep=t.to(dt), guidance=g,
                             encoder_hidden_states=pe, txt_ids=txt_ids, img_ids=img_ids,
                             return_dict=False)[0]                              # (M, h·w, 128)
        return v.permute(0, 2, 1).reshape(M, C, h, w)                           # (M, 128, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (M, 128, h, w) → images (M, 3, 16h, 16w) in [0, 1], fp32: the pipeline's
        un-normalisation by the VAE's BatchNorm running stats, unpatchify, VAE decode."""
        z = latents.to(self.vae.dtype)
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(z)                          # (1, 128, 1, 1)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(z)         # (1, 128, 1, 1)
        z = self.pipe._unpatchify_latents(z * std + mean)                       # (M, 32, 2h, 2w)
        return (self.vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)

    def sigmas(self, num_steps: int, resolution: Optional[int] = None) -> torch.Tensor:
        """The rollout grid (K + 1,) float64 on the CPU, 1 → exactly 0, computed as the pipeline's
        __call__ does for this resolution (default: args.resolution) and K: linspace(1, 1/K, K)
        shifted by the scheduler with mu = compute_empirical_mu(image tokens, K)."""
        seq = (resolution or self.resolution) // self.patch
        mu = importlib.import_module(type(self.pipe).__module__).compute_empirical_mu(
            image_seq_len=seq * seq, num_steps=num_steps)
        sched = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)  # a fresh one
        if getattr(sched.config, "use_flow_sigmas", False):  # the pipeline's own exception
            sched.set_timesteps(num_steps, mu=mu)
        else:
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return sched.sigmas.detach().double().cpu()

    def blocks(self) -> list:
        """The repeated blocks: double-stream, then single-stream."""
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    def save_lora(self, folder: str, state: dict, lora_config) -> None:
        """Write the LoRA in diffusers' format (Flux2LoraLoaderMixin.load_lora_weights)."""
        type(self.pipe).save_lora_weights(folder, transformer_lora_layers=state,
                                          transformer_lora_adapter_metadata=lora_config.to_dict())


# ------------------------------------------------------------------------------------------------
# The tiny offline pipeline: --model tiny-flux2-klein and the tests. Random weights from small
# configs, a tokenizer built here; the architecture and the loading code are the real ones.
# ------------------------------------------------------------------------------------------------
# Qwen3's chat template, reduced to what encode_prompt uses: one user message, the generation
# prompt and, with enable_thinking=False, the empty think block.
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX)
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _tiny_models():
    """examples/tools/tiny_models.py, by path (the module vgrpo.tiny_models() loads)."""
    if "vgrpo_tiny_models" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "tools" / "tiny_models.py"
        spec = importlib.util.spec_from_file_location("vgrpo_tiny_models", path)
        sys.modules["vgrpo_tiny_models"] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["vgrpo_tiny_models"]


def tiny_qwen_tokenizer():
    """A real Qwen2TokenizerFast (Qwen3's class) over a 261-token byte-level BPE vocabulary with no
    merges (each byte one token), Qwen's special tokens and chat template; offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    vocab = {c: i for i, c in enumerate(_tiny_models()._bytes_to_unicode().values())}  # 256
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tok = Qwen2TokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", unk_token=None,
                             pad_token="<|endoftext|>", chat_template=_CHAT_TEMPLATE,
                             model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>"])  # whole tokens, not special (as in Qwen3)
    return tok


def _scheduler():
    """FLUX's resolution-dependent shift. Flux2 pipelines pass mu themselves (compute_empirical_mu),
    so only use_dynamic_shifting and the exponential shift matter: the other fields are unused."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                           max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)


@torch.no_grad()
def build_tiny_pipeline(seed: int = 0):
    """A randomly initialised Flux2KleinPipeline in miniature, offline: 2 double- and 2 single-
    stream blocks over the real 128-channel token width, a 28-layer Qwen3 (so the pipeline's
    default text layers 9, 18, 27 exist) of width 16, the FLUX.2 VAE with 32 latent channels,
    random BatchNorm statistics (so the normalisation is exercised) and the latent-sensitive
    decoder of examples/tools/tiny_models.py; every module in eval mode, no dropout."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    tok = tiny_qwen_tokenizer()
    hidden = 16
    te = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=32, num_hidden_layers=28,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=True, attention_dropout=0.0, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * hidden,   # three stacked Qwen3 layers
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)      # sums to attention_head_dim
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, latent_channels=32, norm_num_groups=4, sample_size=64)
    vae.bn.running_mean.copy_(0.5 * torch.randn(128))       # (128,) patchified channels
    vae.bn.running_var.copy_(0.25 + torch.rand(128))        # (128,)
    vae.post_quant_conv.weight.copy_(torch.eye(32).view(32, 32, 1, 1))  # keep the decode path,
    vae.post_quant_conv.bias.zero_()                                    # but mix no channels
    _tiny_models()._smooth_decoder(vae)
    pipe = Flux2KleinPipeline(scheduler=_scheduler(), vae=vae, text_encoder=te, tokenizer=tok,
                              transformer=transformer, is_distilled=True)
    for m in (transformer, vae, te):
        m.eval()                                # built from configs, modules start in train mode
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ------------------------------------------------------------------------------------------------
# The real architecture with random weights: examples/gpu/gpu_check.py's rows (memory and time at
# the real size) and the parameter-count test, without downloading anything.
# ------------------------------------------------------------------------------------------------
# black-forest-labs/FLUX.2-klein-4B's published configs (the Hub repo's config.json files, as also
# listed by diffusers' docs and the MLX / C ports of klein): transformer/config.json: 5 double-
# and 20 single-stream blocks, 24 heads × 128, text width 7680 = 3 × Qwen3-4B's 2560, no guidance
# embedding; vae/config.json: AutoencoderKLFlux2's defaults (128-256-512-512 channels, 2 layers per
# block, 32 latent channels); text_encoder/config.json: Qwen/Qwen3-4B's (36 layers of width 2560,
# MLP 9728, 32 query / 8 key-value heads of 128, vocabulary 151936, tied embeddings, rope θ 1e6).
# Their sizes on the Hub, bf16: transformer 7.75 GB (3.88 B parameters), text encoder 8.05 GB
# (4.02 B), VAE 168 MB (84 M).
KLEIN_4B_TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20,
                            attention_head_dim=128, num_attention_heads=24,
                            joint_attention_dim=7680, timestep_guidance_channels=256,
                            mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000,
                            eps=1e-6, guidance_embeds=False)
KLEIN_4B_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                    latent_channels=32, norm_num_groups=32, patch_size=(2, 2))
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645)


@torch.no_grad()
def build_real_size_pipeline(dtype: torch.dtype = torch.bfloat16, device="meta", seed: int = 0):
    """Flux2KleinPipeline at FLUX.2 [klein] 4B's published architecture (above), random weights,
    built offline. On the meta device (the default) nothing is allocated: shapes and parameter
    counts only; on a GPU the weights are drawn there in `dtype` (no fp32 copy of 8 B parameters
    first). The tokenizer is the tiny byte-level one (its ids lie inside Qwen3's vocabulary); the
    scheduler is the tiny pipeline's, whose shift the pipeline sets itself (mu)."""
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)               # draw the weights in dtype directly
    try:
        with torch.device(device):
            transformer = Flux2Transformer2DModel(**KLEIN_4B_TRANSFORMER)
            vae = AutoencoderKLFlux2(**KLEIN_4B_VAE)
            te = Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B))
    finally:
        torch.set_default_dtype(default)
    pipe = Flux2KleinPipeline(scheduler=_scheduler(), vae=vae, text_encoder=te,
                              tokenizer=tiny_qwen_tokenizer(), transformer=transformer,
                              is_distilled=True)
    for m in (transformer, vae, te):
        m.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
