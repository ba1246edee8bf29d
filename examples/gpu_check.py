"""GPU check: one full V-GRPO iteration of vgrpo.py on the real SD3.5-Medium architecture.

No downloads: every network is built from its published configuration with RANDOM weights
(transformer 2.24B params, the SD3 VAE, CLIP-L/CLIP-G/T5-XXL text encoders at full width, and a
PickScore-shaped CLIP ViT-H/14 reward), so timings and memory are those of the real model while
the images and rewards are meaningless. Tokenizers are the tiny offline ones (token ids differ,
sequence lengths are the real 77 + 128).

    python examples/gpu_check.py                      # default single-GPU settings + a variant
    python examples/gpu_check.py --configs default    # one configuration
    python examples/gpu_check.py --cpu_smoke          # the script itself, on the tiny model, CPU
    python examples/gpu_check.py --family flux        # FLUX.1-dev's architecture (11.9B), random weights

For each configuration it runs vgrpo.iteration() once after a small warm-up iteration and prints
the wall time of each phase, peak GPU memory, NFE per sample and achieved model TFLOP/s (model
FLOPs counted with torch.utils.flop_counter on one forward, times the forwards and backwards an
iteration performs; gradient-checkpointing recompute is not counted as useful work).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import vgrpo as V

RESULTS = Path(__file__).resolve().parent.parent / "results" / "gpu"   # raw rows land here
BF16_PEAK_TFLOPS = 989.0     # H100/H200 SXM dense bf16 spec; pass --peak for another GPU

CONFIGS = {
    # the defaults of `python vgrpo.py --model sd3.5-medium --reward pickscore`
    "default": [],
    # a smaller batch with bigger micro-batches and no gradient checkpointing (memory vs speed)
    "mb8_nockpt": ["--prompts_per_iter", "2", "--micro_batch", "8", "--no-gradient_checkpointing"],
    # the default batch with bigger rollout and training micro-batches (throughput)
    "rb48_mb8": ["--rollout_batch", "48", "--micro_batch", "8"],
    # FLUX defaults (720 px, 16-step DPM-Solver++(2M), μ = 4, clip 1e-2) at MixGRPO's per-GPU batch:
    # one prompt × 12 images [ours C1]
    "flux_default": ["--prompts_per_iter", "1"],
    "flux_g4": ["--prompts_per_iter", "1", "--group_size", "4"],
    "flux_nockpt_mb1": ["--prompts_per_iter", "1", "--no-gradient_checkpointing", "--micro_batch", "1"],
}
WARMUP = {"sd3": ["--prompts_per_iter", "1", "--group_size", "4", "--num_steps", "4"],
          "flux": ["--prompts_per_iter", "1", "--group_size", "2", "--num_steps", "4", "--resolution", "256",
                   "--mu", "1", "--no-gradient_checkpointing", "--micro_batch", "1"]}


def build_sd35m_random(device, dtype, t5_layers=24):
    """StableDiffusion3Pipeline with SD3.5-Medium's architecture and random weights."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok1, tok2 = V.tiny_clip_tokenizer(d), V.tiny_clip_tokenizer(d)
    tok3 = V.tiny_t5_tokenizer()
    n = len(tok1)
    with torch.device(device):
        transformer = SD3Transformer2DModel(   # [ours C19] SD3.5-Medium config
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
            attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
            caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm").to(dtype)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                            layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                            scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                            use_post_quant_conv=False)
        clip = lambda h, layers, heads, inter: CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=49408, hidden_size=h, intermediate_size=inter, projection_dim=h,
            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
            bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1)).to(dtype)
        te1 = clip(768, 12, 12, 3072)                     # CLIP-L
        te2 = clip(1280, 32, 20, 5120)                    # OpenCLIP bigG
        te3 = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240,
                                      num_layers=t5_layers, num_heads=64, feed_forward_proj="gated-gelu",
                                      dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                      decoder_start_token_id=0)).to(dtype)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=vae, text_encoder=te1, tokenizer=tok1, text_encoder_2=te2,
                                    tokenizer_2=tok2, text_encoder_3=te3, tokenizer_3=tok3)
    for m in (transformer, vae, te1, te2, te3):
        m.requires_grad_(False).eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_flux_dev_random(device, dtype):
    """FluxPipeline with FLUX.1-dev's architecture (diffusers' default FluxTransformer2DModel config:
    19 double + 38 single blocks, width 3072, guidance embedding) and random weights."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok1 = V.tiny_clip_tokenizer(d)
    tok2 = V.tiny_t5_tokenizer()
    n = len(tok1)
    with torch.device(device):
        transformer = FluxTransformer2DModel(guidance_embeds=True).to(dtype)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                            layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                            use_post_quant_conv=False)
        te1 = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                           num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                           bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1)).to(dtype)
        te2 = T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                      num_heads=64, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).to(dtype)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), vae=vae,
                        text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2, transformer=transformer)
    for m in (transformer, vae, te1, te2):
        m.requires_grad_(False).eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_pickscore_random(device, dtype):
    """A CLIP ViT-H/14 (PickScore's architecture, ~0.99B params) with random weights."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok = V.tiny_clip_tokenizer(d)
    n = len(tok)
    cfg = CLIPConfig(text_config=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096,
                                      num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=77,
                                      bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1),
                     vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                        num_attention_heads=16, image_size=224, patch_size=14),
                     projection_dim=1024, logit_scale_init_value=4.6052)
    with torch.device(device):
        model = CLIPModel(cfg)
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 224},
                                                            crop_size={"height": 224, "width": 224}),
                         tokenizer=tok)
    return V.Rewards.of({"pickscore": V.PickScoreReward(model, proc, device, dtype)}, [("pickscore", 1.0)])


def forward_flops(adapter, D, cond, ctx):
    """Model FLOPs of one transformer forward on one sample (matmuls + attention)."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn((1,) + D, device=adapter.device)
    t = torch.full((1,), 0.5, device=adapter.device)
    c = V.select(cond, torch.zeros(1, dtype=torch.long, device=adapter.device))
    with torch.no_grad(), ctx, FlopCounterMode(display=False) as fc:
        adapter.velocity(x, t, c)
    return fc.get_total_flops()


def run_config(name, extra, pipe, reward, dev, dtype, ctx, peak, model="sd3.5-medium"):
    args = V.parse_args(["--model", model, "--reward", "pickscore", "--eval_rewards", "pickscore"] + extra)
    tr = pipe.transformer
    if hasattr(tr, "peft_config"):                      # fresh LoRA per configuration
        tr.delete_adapters(list(tr.peft_config))
    if not args.gradient_checkpointing:
        tr.disable_gradient_checkpointing()
    run = V.setup(args, pipe=pipe, rewards=reward)      # the trainer's own setup (LoRA, optimizer, grid)
    adapter, D = run.adapter, run.D
    P, G, J = args.prompts_per_iter, args.group_size, args.n_mc
    N = P * G
    fwd = forward_flops(adapter, D, adapter.encode(run.train_prompts[:1]), ctx)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = V.iteration(run, 0)
    wall = time.perf_counter() - t0
    # useful model FLOPs: rollout K fwd + old J fwd + θ J × (fwd + 2·fwd backward)
    flops = N * fwd * (args.num_steps + J + 3 * J)
    row = {"config": name, "P×G": f"{P}×{G}", "micro_batch": args.micro_batch,
           "grad_ckpt": args.gradient_checkpointing, "time_rollout": m["time_rollout"],
           "time_reward": m["time_reward"], "time_old": m["time_old"], "time_update": m["time_update"],
           "time_iter": wall,
           "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else float("nan"),
           "fwd_TFLOP_per_sample": fwd / 1e12, "TFLOP/s": flops / wall / 1e12,
           "MFU_%": 100 * flops / wall / 1e12 / peak, "abs_log_ratio": m["abs_log_ratio"],
           "reward_finite": m["n_nonfinite_reward"] == 0, "grad_norm": m["grad_norm"]}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=None, help="default: default,mb8_nockpt (sd3) or flux_default (flux)")
    ap.add_argument("--family", default="sd3", choices=("sd3", "flux"))
    ap.add_argument("--extra", default="", help="flags appended to every configuration, warm-up included")
    ap.add_argument("--peak", type=float, default=BF16_PEAK_TFLOPS, help="GPU dense bf16 TFLOP/s")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (default "
                    "results/gpu/gpu_check_<gpu>_<family>.json; '' = do not write)")
    ap.add_argument("--cpu_smoke", action="store_true", help="run the script on the tiny model on the CPU")
    a = ap.parse_args()
    V._quiet_hf()
    a.configs = a.configs or ("flux_default" if a.family == "flux" else "default,mb8_nockpt")
    extra = a.extra.split()
    for k in CONFIGS:
        CONFIGS[k] = CONFIGS[k] + extra
    WARMUP[a.family] = WARMUP[a.family] + extra
    model = "flux.1-dev" if a.family == "flux" else "sd3.5-medium"
    if a.cpu_smoke:
        dev = torch.device("cpu")
        pipe = V.build_tiny_flux_pipeline() if a.family == "flux" else V.build_tiny_sd3_pipeline()
        reward = V.Rewards.of({"jpeg": V.JpegReward()}, [("jpeg", 1.0)])
        small = ["--prompts_per_iter", "2", "--group_size", "3", "--num_steps", "4", "--resolution", "64",
                 "--max_sequence_length", "32", "--lora_rank", "4", "--lora_alpha", "8"]
        rows = [run_config(n, small + CONFIGS[n] + ["--prompts_per_iter", "2", "--resolution", "64"], pipe, reward,
                           dev, torch.float32, torch.autocast("cpu", enabled=False), a.peak, model=model)
                for n in a.configs.split(",") if n in CONFIGS]
        print_table(rows)
        return
    assert torch.cuda.is_available(), "this check needs a CUDA GPU (or pass --cpu_smoke)"
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ctx = torch.autocast("cuda", dtype=dtype)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(False)          # as vgrpo.setup_device: cuDNN SDPA backward fails on FLUX
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    pipe = build_flux_dev_random(dev, dtype) if a.family == "flux" else build_sd35m_random(dev, dtype)
    pipe.vae.to(torch.float32)
    reward = build_pickscore_random(dev, dtype)
    with torch.no_grad():
        c = V.make_adapter(pipe, V.parse_args(["--model", model]), dev).encode(["a red fox in the snow"])
    print("text embeddings finite:", all(bool(torch.isfinite(v).all()) for v in c.values()), flush=True)
    n_tr = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"built random {model} pipeline (transformer {n_tr / 1e9:.3f}B params) and PickScore-shaped "
          f"reward in {time.perf_counter() - t0:.0f}s; memory {torch.cuda.memory_allocated() / 2 ** 30:.1f} GiB",
          flush=True)
    # warm-up: kernels, allocator, autotuning (not reported)
    run_config("warmup", WARMUP[a.family], pipe, reward, dev, dtype, ctx, a.peak, model=model)
    rows = []
    for n in [c for c in a.configs.split(",") if c in CONFIGS]:
        try:
            rows.append(run_config(n, CONFIGS[n], pipe, reward, dev, dtype, ctx, a.peak, model=model))
        except torch.OutOfMemoryError as e:
            print(f"{n}: out of memory ({str(e).splitlines()[0]})", flush=True)
            torch.cuda.empty_cache()
    print_table(rows)
    if a.out is None:
        gpu = "".join(ch if ch.isalnum() else "_" for ch in torch.cuda.get_device_name().lower())
        a.out = str(RESULTS / f"gpu_check_{gpu}_{a.family}.json")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rows, indent=2))
        print(f"rows written to {a.out}", flush=True)


def print_table(rows):
    print("\n| config | P×G | micro-batch | grad ckpt | rollout s | reward s | old s | update s | "
          "iteration s | peak GiB | TFLOP/s | MFU % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['P×G']} | {r['micro_batch']} | {r['grad_ckpt']} | {r['time_rollout']:.1f} | "
              f"{r['time_reward']:.1f} | {r['time_old']:.1f} | {r['time_update']:.1f} | {r['time_iter']:.1f} | "
              f"{r['peak_mem_GiB']:.1f} | {r['TFLOP/s']:.0f} | {r['MFU_%']:.0f} |")


if __name__ == "__main__":
    main()
