"""
Offline tiny models for vgrpo.py: randomly initialised StableDiffusion3Pipeline and FluxPipeline
in miniature, with real tokenizers and configs built here (no network, no weights) [ours C19].

`python vgrpo.py --model tiny` / `--model tiny-flux` loads this file by path (vgrpo.tiny_models());
the tests, examples/gpu/gpu_check.py and the CPU smoke runs of the examples build their pipelines
here.
They exist so that everything runs on a laptop CPU in minutes; they are not part of the method.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


# vgrpo.py's per-model defaults for --model tiny / tiny-flux (our choice): `--model tiny --reward
# jpeg` learns visibly in well under a minute of CPU. Flags given on the command line override them.
_TINY = dict(resolution=64, num_steps=8, eval_steps=16, max_sequence_length=32, prompts_per_iter=4,
             group_size=8, gradient_checkpointing=False, lora_rank=8, lora_alpha=16, lr=1e-2,
             iterations=30, micro_batch=32, rollout_batch=32, eval_every=10, save_every=10,
             n_eval=8)
PRESETS = {"tiny": _TINY, "tiny-flux": dict(_TINY, reward="jpeg")}   # FLUX's family preset: HPS


def _bytes_to_unicode() -> dict:
    """GPT-2/CLIP byte → printable-unicode table (used to write a byte-level tiny vocabulary)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_clip_tokenizer(folder: str):
    """A real CLIPTokenizer over a 514-token byte vocabulary (each character one token), offline."""
    from transformers import CLIPTokenizer
    ch = list(_bytes_to_unicode().values())
    vocab = ch + [c + "</w>" for c in ch] + ["<|startoftext|>", "<|endoftext|>"]       # 514 tokens
    Path(folder, "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    Path(folder, "merges.txt").write_text("#version: 0.2\n")
    # model_max_length=77: the SD3 pipeline takes its CLIP length from it [peer X11]
    return CLIPTokenizer(str(Path(folder, "vocab.json")), str(Path(folder, "merges.txt")), model_max_length=77)


def tiny_t5_tokenizer():
    """A real T5TokenizerFast over a small unigram vocabulary of letters and digits, offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import T5TokenizerFast
    letters = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    pieces = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
              + [("▁" + c, -3.0) for c in letters] + [(c, -4.0) for c in letters])
    tk = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tk.post_processor = TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=0, model_max_length=512)


def save_tiny_clip(folder) -> None:
    """A randomly initialised CLIPModel and its CLIPProcessor (32-pixel images, the tiny byte
    tokenizer), saved into `folder`: a stand-in for PickScore's and CLIP's weights, offline."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    Path(folder).mkdir(parents=True, exist_ok=True)
    tok = tiny_clip_tokenizer(str(folder))
    n = len(tok)
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=77, bos_token_id=n - 2,
                                      eos_token_id=n - 1, pad_token_id=n - 1),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=32, patch_size=8),
                     projection_dim=16, logit_scale_init_value=4.6052)
    CLIPModel(cfg).eval().save_pretrained(folder)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=ip, tokenizer=tok).save_pretrained(folder)


def build_tiny_sd3_pipeline(seed: int = 0):
    """A randomly initialised StableDiffusion3Pipeline with SD3.5-Medium's architecture in
    miniature (MMDiT-X dual attention in block 0, qk RMSNorm, three text encoders), ~0.3M params,
    its VAE decoder made latent-sensitive (_smooth_decoder). No network: tokenizers and configs
    are built here [ours C19]."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        tok1 = tiny_clip_tokenizer(d)
        tok2 = tiny_clip_tokenizer(d)
    tok3 = tiny_t5_tokenizer()
    V = len(tok1)
    clip_cfg = CLIPTextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, projection_dim=32,
                              num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                              bos_token_id=V - 2, eos_token_id=V - 1, pad_token_id=V - 1, hidden_act="quick_gelu")
    te1, te2 = CLIPTextModelWithProjection(clip_cfg), CLIPTextModelWithProjection(clip_cfg)
    joint = 64                                  # ≥ 32 + 32: the CLIP features are zero-padded up to it
    te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=joint, d_kv=8, d_ff=64, num_layers=1,
                                  num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0,
                                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=joint, caption_projection_dim=32,
        pooled_projection_dim=64, pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
                        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                        use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2,
        text_encoder_3=te3, tokenizer_3=tok3)
    _smooth_decoder(vae)
    for m in (transformer, vae, te1, te2, te3):
        m.eval()                                # built from configs, modules start in train mode
    return pipe


@torch.no_grad()
def _smooth_decoder(vae) -> None:
    """Make the tiny VAE's decoder a smooth upsampler of latent channels 0–2 instead of random.

    A randomly initialised decoder's output is dominated by its biases and GroupNorms: the image
    barely depends on the latent, so no reward could be learned from it (measured: JPEG size
    varied by < 0.1 kB across latents scaled ×0 … ×4). Here every residual branch (resnet conv2,
    attention output) and every conv bias is zeroed, conv_in/conv_out pick channels, and each
    upsampler applies a 3×3 binomial blur; the architecture and the loading code are untouched.
    """
    dec = vae.decoder
    for name, mod in dec.named_modules():
        if name.endswith("conv2") or name.endswith("to_out.0"):
            mod.weight.zero_()
            mod.bias.zero_()
    for name, p in dec.named_parameters():
        if name.endswith("bias") and "norm" not in name:
            p.zero_()
    blur = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    for block in dec.up_blocks:
        for up in block.upsamplers or []:
            up.conv.weight.zero_()
            for i in range(up.conv.weight.shape[0]):
                up.conv.weight[i, i] = blur
    for conv, n, gain in ((dec.conv_in, dec.conv_in.weight.shape[0], 1.0), (dec.conv_out, 3, 0.5)):
        conv.weight.zero_()
        for i in range(n):
            conv.weight[i, i, 1, 1] = gain


def build_tiny_flux_pipeline(seed: int = 0):
    """A randomly initialised FluxPipeline in miniature (one double- and one single-stream block,
    guidance embedding like FLUX.1-dev, CLIP-L pooled + T5 text), ~0.1M params, offline
    [ours C19]. Same latent-sensitive VAE decoder as the tiny SD3 pipeline."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        tok1 = tiny_clip_tokenizer(d)
    tok2 = tiny_t5_tokenizer()
    V = len(tok1)
    te1 = CLIPTextModel(CLIPTextConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=77, bos_token_id=V - 2,
                                       eos_token_id=V - 1, pad_token_id=V - 1, hidden_act="quick_gelu"))
    te2 = T5EncoderModel(T5Config(vocab_size=len(tok2), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                                  relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
                                  eos_token_id=1, decoder_start_token_id=0))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
                        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                            base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=sched, vae=vae, text_encoder=te1, tokenizer=tok1, text_encoder_2=te2,
                        tokenizer_2=tok2, transformer=transformer)
    _smooth_decoder(vae)
    for m in (transformer, vae, te1, te2):
        m.eval()
    return pipe
