"""
FLUX.1 as a vgrpo.py model plug-in: diffusers' FluxPipeline (hub id black-forest-labs/FLUX.1-dev),
the paper's second model and the first plug-in of the model seam (vgrpo.Model).

FLUX.1-dev is a 12B guidance-distilled MMDiT: 19 double-stream and 38 single-stream blocks that
read CLIP-L's pooled vector and T5-XXL's tokens, on SD3's 16-channel VAE latent packed into 2×2
patches. Its rows of the seam's table (above vgrpo.SD3Adapter, whose methods this one reuses):
               FluxPipeline                               this plug-in (vgrpo.py's convention)
  text         CLIP-L pooled + T5 → L tokens, txt_ids     prompt_embeds (B, L, 4096), pooled
                                                          (B, 768); txt_ids: zeros (L, 3)
  ODE latent   packed 2×2: ((H/16)(W/16), 64), img_ids    the same, D = (seq, 64)
  t            t ∈ [0, 1] (×1000 inside the transformer)  t = σ, 1 noise → 0 data; v = ε − x0
  guidance     distilled: a guidance embedding, 3.5       --guidance (3.5) into the embedding
  rollout grid linspace shifted by 3 (MixGRPO) [ours C8]  vgrpo.sigma_grid(K, --flux_shift)

Verified (test_vgrpo.py §15, on examples/tools/tiny_models.py's tiny FluxPipeline, CPU):
unpacking inverts diffusers' packing exactly, the image ids equal the pipeline's, the LoRA wraps
the blocks and not the top-level projection, two iterations train from a saved folder and their
LoRA loads in the stock FluxPipeline; the family's defaults are MixGRPO's protocol. Not verified
offline: the real 12B weights (docs/gpu.md measures them at real size with random weights).
"""
from __future__ import annotations

import math

import torch

import vgrpo as V  # the running trainer (vgrpo.model_plugins maps the name to it)

PIPELINES = ("FluxPipeline",)
ALIASES = {"flux.1-dev": "black-forest-labs/FLUX.1-dev"}
TINY = {"tiny-flux": "build_tiny_pipeline"}
HUB_HINTS = ("flux",)  # another hub id whose name says "flux" is this family (FLUX.1-schnell, …)

# Attention as SD3's, plus the feed-forward projections and the single blocks' MLP and output;
# the top-level `proj_out` is outside the numbered blocks, so add_lora leaves it alone.
LORA_TARGETS = (V.SD3_LORA_TARGETS + ",ff.net.0.proj,ff.net.2,ff_context.net.0.proj,"
                "ff_context.net.2,proj_mlp,proj_out")

# The family's Args overrides, field -> (value, source): MixGRPO's FLUX protocol, with LoRA
# (MixGRPO's own: --full_finetune --lr 1e-5) [ours C1–C3, C8, C17] (METHOD.md).
_MIXGRPO = "[ours C1–C3, C8, C17] MixGRPO protocol"
DEFAULTS = {k: (v, _MIXGRPO) for k, v in dict(
    gradient_checkpointing=True, resolution=720, num_steps=16, eval_steps=16, solver="dpmpp2m",
    group_size=12, prompts_per_iter=2, mu=4, clip_eps=1e-2, soft_clip_eta=3.0,
    reward="hpsv2:1,pickscore:1", reward_aggregation="per_reward", global_std=False,
    std_eps=1e-8, max_sequence_length=512, lora_targets=LORA_TARGETS, iterations=300).items()}
PRESETS = {"paper": dict(prompts_per_iter=32, group_size=12)}  # MixGRPO's 32 prompts × 12


def build_tiny_pipeline(seed: int = 0):
    """The offline random FluxPipeline of examples/tools/tiny_models.py (--model tiny-flux)."""
    return V.tiny_models().build_tiny_flux_pipeline(seed)


def __getattr__(name: str):  # TINY_PRESET read from tiny_models.py when first asked for
    if name == "TINY_PRESET":
        return V.tiny_models().PRESETS["tiny-flux"]
    raise AttributeError(name)


def unpack_latents(x: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """FLUX's 2×2 patch packing undone: (B, (H/2)·(W/2), 4C) → (B, C, H, W). A pure permutation,
    so Gaussian noise and per-element means are the same in both layouts."""
    B, _, C4 = x.shape
    patches = x.view(B, H // 2, W // 2, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # B,C,H/2,2,W/2,2
    return patches.reshape(B, C4 // 4, H, W)


class Adapter(V.SD3Adapter):
    """FLUX.1: packed latents + image ids, t in [0, 1], the guidance embedding, a shifted grid."""

    def __init__(self, pipe, device: torch.device, args) -> None:
        super().__init__(pipe, device, args.max_sequence_length)
        self.guidance, self.shift = args.guidance, args.flux_shift

    def latent_shape(self, resolution: int) -> tuple:
        r = resolution // self.vae_scale                             # latent side (even)
        return ((r // 2) ** 2, self.transformer.config.in_channels)  # (seq, 64)

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> dict:
        """prompt_embeds (B, L, 4096) from T5, pooled (B, 768) from CLIP-L (txt_ids are zeros)."""
        pe, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.L)
        return {"prompt_embeds": pe, "pooled": pooled}

    def _img_ids(self, seq: int) -> torch.Tensor:
        """(seq, 3) rows [0, row, col] of the square packed latent grid."""
        s = math.isqrt(seq)
        rows, cols = torch.meshgrid(*[torch.arange(s, device=self.device)] * 2, indexing="ij")
        return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(seq, 3)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """v_θ on packed latents x (M, seq, 64), t (M,) in [0, 1]."""
        dt = x.dtype if torch.is_autocast_enabled(x.device.type) else self.transformer.dtype
        g = (torch.full((x.shape[0],), self.guidance, device=x.device, dtype=dt)
             if self.transformer.config.guidance_embeds else None)
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=x.device)  # (L, 3)
        return self.transformer(hidden_states=x.to(dt), timestep=t.to(dt), guidance=g,
                                pooled_projections=cond["pooled"],
                                encoder_hidden_states=cond["prompt_embeds"], txt_ids=txt_ids,
                                img_ids=self._img_ids(x.shape[1]), return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        side = 2 * math.isqrt(latents.shape[1])
        return super().decode(unpack_latents(latents, side, side))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return V.sigma_grid(num_steps, self.shift)
