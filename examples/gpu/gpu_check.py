"""GPU check: V-GRPO's throughput on the real SD3.5-Medium and FLUX.1-dev architectures, in ONE run.

No downloads: every network is built from its published configuration with RANDOM weights
(SD3.5-M transformer 2.24B params, the SD3 VAE, CLIP-L/CLIP-G/T5-XXL text encoders at full width,
FLUX.1-dev's 11.9B transformer, and a PickScore-shaped CLIP ViT-H/14 reward), so timings and memory
are those of the real models while the images and rewards are meaningless. Tokenizers are the tiny
offline ones (token ids differ, sequence lengths are the real ones).

    python examples/gpu/gpu_check.py                  # every stage below, ~10 min on one H100/H200
    python examples/gpu/gpu_check.py --stages levers  # some stages: levers,memory,flow,flux,configs
    python examples/gpu/gpu_check.py --cpu_smoke      # the whole script on the tiny models, CPU
    python examples/gpu/gpu_check.py --stages configs --configs default,rb48_mb8   # single named rows
    python examples/gpu/gpu_check.py --stages configs --family flux --configs flux_default

Stages, in this order, each skipped when the time guard (--budget_s, default 570 s after the model
build) says it would not finish; every row is written to --out (JSON, and a markdown twin) as soon
as it is measured, so a run cut short keeps what it measured:
  levers  SD3.5-M single-GPU defaults (40 Euler steps, N_MC 4, μ 1, micro-batch 4, rollout
          batch 16, checkpointing) at P×G = 1×16 — the default's per-forward shapes (rollout 16
          rows, training micro-batch 4 × N_MC 4 = 16 rows), a ninth of its samples — once per
          lever on/off (merged-LoRA rollouts, the flash / efficient / cuDNN attention kernel, a
          bf16 VAE decode, regional torch.compile: experiments applied here from outside the
          trainer, see LEVERS), then every lever that paid at once. Per row: rollout-phase
          MFU, whole-iteration MFU, peak memory, |log ρ| (0 at μ = 1 must hold with every lever);
          the first iteration (compile, autotuning) is reported apart from the steady-state one.
  memory  which settings train SD3.5-M LoRA on a 24, 48 and 80 GB card, emulated with
          torch.cuda.set_per_process_memory_fraction (card size − 0.75 GiB for the CUDA context):
          candidates from fastest to leanest, stopping at the first that fits.
  flow    Flow-GRPO at its published SD3.5-M settings (examples/baselines/flow_grpo_sd3.py
          --recipe cfg4.5: 10 SDE steps, CFG 4.5, 9 trained steps, 2 optimizer steps, fp16)
          against V-GRPO at the paper's (40 ODE steps, CFG-free, N_MC 4, μ 1, bf16), same P×G and
          initial noise: seconds and GPU-seconds per iteration and per 1,000 images.
  flux    FLUX.1-dev defaults (720 px, 16-step DPM-Solver++(2M), μ 4) at MixGRPO's per-GPU batch
          1×12: whole-iteration MFU, with and without the levers that paid on SD3.5-M.

FLOP counting: `fwd` = model FLOPs of ONE transformer forward on ONE sample, counted by
torch.utils.flop_counter (matmuls 2·m·n·k, attention's two matmuls; elementwise ops not counted).
V-GRPO useful FLOPs per iteration = N · fwd · (K + J + 3·J): K rollout forwards, J θ_old
surrogate forwards, J θ forwards with backward (backward = 2 forwards); gradient-checkpointing
recompute and LoRA's own (rank-32) matmuls are not counted as useful. Rollout MFU =
N·K·fwd / rollout seconds / peak; iteration MFU = useful FLOPs / iteration seconds / peak
(peak: --peak, 989 TFLOP/s dense bf16, H100/H200 SXM). Flow-GRPO: fwd · (N · rollout NFE +
trained samples · (3 · trained NFE + reference NFE)), NFE counting a CFG step (2 rows) as 2.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch

import vgrpo as V

TM = V.tiny_models()                      # examples/tools/tiny_models.py: offline tiny pipelines

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
# levers stage: the SD3.5-M defaults at 1 × 16 images (the default's per-forward shapes)
LEVER_BASE = ["--prompts_per_iter", "1", "--group_size", "16"]
# The throughput levers are experiments, not trainer flags: each is applied to a live Run from
# outside vgrpo.py (a patched function, a wrapped adapter method, torch's process-wide switches)
# and undone before the next row. One comes back into vgrpo.py only with a measured speed-up.
LEVERS = ("merge_lora_rollout", "attn_flash", "attn_efficient", "attn_cudnn", "vae_autocast",
          "compile")


@contextlib.contextmanager
def lora_merged(transformer):
    """Run the body (no-grad rollouts) with every LoRA merged into its base weight,
    W ← W + (α/r)·B·A: one matmul per layer instead of three. On exit W is restored bit for bit
    from a CPU copy taken before the merge (peft's unmerge subtracts B·A, inexact in floating
    point); the LoRA factors are never touched. In bf16 the merged W is rounded to bf16, so the
    rollout policy differs from θ by that rounding; surrogates and ratios run unmerged, so ρ = 1
    at μ = 1 stays exact. Cost per call: the targeted base weights copied to the host and back."""
    from peft.tuners.lora import LoraLayer
    layers = [m for m in transformer.modules() if isinstance(m, LoraLayer)]
    saved = []                                          # (layer, base parameter, its CPU copy)
    try:
        with torch.no_grad():
            for m in layers:
                base = m.get_base_layer()
                saved += [(m, p, p.detach().to("cpu", copy=True))
                          for p in (base.weight, base.bias) if p is not None]
                m.merge()                                 # in place: W.data += ΔW
        yield
    finally:
        with torch.no_grad():
            for m, p, cpu in saved:
                p.copy_(cpu)
                m.merged_adapters.clear()         # peft's "merged" state; forward adds B·A again


def compile_blocks(transformer, backend: str = "inductor", enabled: bool = True) -> None:
    """Regional torch.compile: each block compiled in place (nn.Module.compile, state-dict keys
    unchanged), so blocks of one class share one graph and compile time stays in seconds; works
    under LoRA, gradient checkpointing and no-grad rollouts. enabled=False undoes it."""
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for blk in V.transformer_blocks(transformer):
        if enabled:
            blk.compile(backend=backend)
        else:
            blk._compiled_call_impl = None        # nn.Module.compile's slot


@contextlib.contextmanager
def levers(run, names, compile_backend="inductor"):
    """Apply the named levers to `run` for the body, then undo them."""
    sw = torch.backends.cuda
    switches = (sw.enable_flash_sdp, sw.enable_mem_efficient_sdp, sw.enable_math_sdp,
                sw.enable_cudnn_sdp)
    saved = (sw.flash_sdp_enabled(), sw.mem_efficient_sdp_enabled(), sw.math_sdp_enabled(),
             sw.cudnn_sdp_enabled())
    ad, real_rollout, real_decode = run.adapter, V.rollout, run.adapter.decode
    try:
        if "merge_lora_rollout" in names:             # rollouts and evaluation, not surrogates
            def merged_rollout(adapter, *a, **k):
                with lora_merged(adapter.transformer):
                    return real_rollout(adapter, *a, **k)
            V.rollout = merged_rollout
        for kernel in ("flash", "efficient", "cudnn"):
            if f"attn_{kernel}" in names:
                # that fused kernel, with math (tried last) as the fallback: with math off too,
                # the VAE's fp32 attention raised "Invalid backend" on an H200 (torch 2.11)
                for enable, k in zip(switches, ("flash", "efficient", "math", "cudnn")):
                    enable(k in (kernel, "math"))
        if "vae_autocast" in names:                   # decode in the compute dtype, not fp32
            def decode(latents):
                with run.ctx:
                    return real_decode(latents)
            ad.decode = decode
        if "compile" in names:
            compile_blocks(ad.transformer, compile_backend)
        yield
    finally:
        V.rollout = real_rollout
        ad.__dict__.pop("decode", None)
        for enable, on in zip(switches, saved):
            enable(on)
        if "compile" in names:
            compile_blocks(ad.transformer, enabled=False)


# memory stage: SD3.5-M LoRA settings from fastest to leanest; peak memory does not depend on the
# number of steps or of prompts (activations are per forward), so each trial is a short iteration
MEMORY_CANDIDATES = {
    "default": [],
    "offload_te": ["--offload_text_encoders"],
    "offload_te_mb2_rb8": ["--offload_text_encoders", "--micro_batch", "2", "--rollout_batch", "8",
                           "--reward_batch", "8"],
    "offload_te_mb1_rb4": ["--offload_text_encoders", "--micro_batch", "1", "--rollout_batch", "4",
                           "--reward_batch", "4"],
}
MEMORY_TRIAL = ["--prompts_per_iter", "1", "--group_size", "16", "--num_steps", "4"]
CARDS_GIB = (80, 48, 24)
CONTEXT_GIB = 0.75           # CUDA context + cuBLAS/cuDNN handles, outside the caching allocator


def build_sd35m_random(device, dtype, t5_layers=24):
    """StableDiffusion3Pipeline with SD3.5-Medium's architecture and random weights."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok1, tok2 = TM.tiny_clip_tokenizer(d), TM.tiny_clip_tokenizer(d)
    tok3 = TM.tiny_t5_tokenizer()
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
        tok1 = TM.tiny_clip_tokenizer(d)
    tok2 = TM.tiny_t5_tokenizer()
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
        tok = TM.tiny_clip_tokenizer(d)
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
    return V.Rewards({"pickscore": V.clip_reward(model, proc, device, dtype, logit_scale=True)},
                     [("pickscore", 1.0)])


# ------------------------------------------------------------------------------------------------
# Measuring one configuration
# ------------------------------------------------------------------------------------------------
def forward_flops(adapter, D, cond, ctx):
    """Model FLOPs of one transformer forward on one sample (matmuls + attention)."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn((1,) + D, device=adapter.device)
    t = torch.full((1,), 0.5, device=adapter.device)
    c = V.select(cond, torch.zeros(1, dtype=torch.long, device=adapter.device))
    with torch.no_grad(), ctx, FlopCounterMode(display=False) as fc:
        adapter.velocity(x, t, c)
    return fc.get_total_flops()


class Env:
    """What every stage shares: the pipeline, reward, device, clock and report."""

    def __init__(self, a, dev, dtype, ctx, report):
        self.a, self.dev, self.dtype, self.ctx, self.report = a, dev, dtype, ctx, report
        self.cuda = dev.type == "cuda"
        self.t0 = time.perf_counter()
        self.pipe = self.reward = None
        self.model = "sd3.5-medium"
        self.small = []               # CPU smoke: tiny sizes appended to every configuration
        self.fwd = {}                 # (model, resolution) → FLOPs of one forward on one sample

    def left(self) -> float:
        """Seconds of the time budget left."""
        return self.a.budget_s - (time.perf_counter() - self.t0)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def fresh_transformer(pipe) -> None:
    """No LoRA, no compiled blocks, before the next configuration attaches its own."""
    tr = pipe.transformer
    if getattr(tr, "peft_config", None):
        tr.delete_adapters(list(tr.peft_config))
    compile_blocks(tr, enabled=False)


def measure(env, stage, name, extra, iters=1, lever_names=()):
    """setup() + `iters` iterations of one configuration, with the named levers applied. Returns a
    row (also on failure: with 'error'). Time and phases are those of the LAST iteration (steady
    state when iters ≥ 2)."""
    argv = ["--model", env.model, "--reward", "pickscore", "--eval_rewards", "pickscore"] + extra
    argv += env.small + env.a.extra.split()
    row = {"stage": stage, "config": name, "flags": " ".join(extra), "levers": ",".join(lever_names)}
    try:
        args = V.parse_args(argv)
        fresh_transformer(env.pipe)
        if not args.gradient_checkpointing:
            env.pipe.transformer.disable_gradient_checkpointing()
        env.free()
        if env.cuda:
            torch.cuda.reset_peak_memory_stats()
        run = V.setup(args, pipe=env.pipe, rewards=env.reward)
        key = (args.model, args.resolution)
        if key not in env.fwd:                         # counted on the eager model
            c1 = run.adapter.encode(run.train_prompts[:1])
            env.fwd[key] = forward_flops(run.adapter, run.D, c1, run.ctx)
        fwd = env.fwd[key]
        walls, ms = [], []
        with levers(run, lever_names, env.a.compile_backend or "inductor"):
            for it in range(iters):
                t0 = time.perf_counter()
                ms.append(V.iteration(run, it))
                walls.append(time.perf_counter() - t0)
        P, G, J, K = args.prompts_per_iter, args.group_size, args.n_mc, args.num_steps
        N, m, wall = P * G, ms[-1], walls[-1]
        flops_iter = N * fwd * (K + J + 3 * J)
        flops_roll = N * fwd * K
        peak = env.a.peak * 1e12
        row.update({
            "P×G": f"{P}×{G}", "K": K, "micro_batch": args.micro_batch,
            "rollout_batch": args.rollout_batch, "grad_ckpt": args.gradient_checkpointing,
            "iterations": iters,
            "time_first_iter": walls[0], "time_iter": wall,
            **{k: m[k] for k in ("time_rollout", "time_reward", "time_old", "time_update")},
            "peak_mem_GiB": (torch.cuda.max_memory_allocated() / 2 ** 30 if env.cuda
                             else float("nan")),
            "fwd_TFLOP_per_sample": fwd / 1e12, "TFLOP/s": flops_iter / wall / 1e12,
            "MFU_%": 100 * flops_iter / wall / peak,
            "rollout_MFU_%": 100 * flops_roll / m["time_rollout"] / peak,
            "abs_log_ratio": max(x["abs_log_ratio"] for x in ms),
            "reward_finite": all(x["n_nonfinite_reward"] == 0 for x in ms),
            "grad_norm": m["grad_norm"]})
        if iters >= 2:
            row["first_minus_steady_s"] = walls[0] - wall  # compile, autotuning, allocator
        del run
    except torch.OutOfMemoryError as e:
        row["error"] = "out of memory: " + str(e).splitlines()[0][:200]
    except Exception as e:  # noqa: BLE001 — a lever that fails (a kernel) is a result
        row["error"] = err(e)
    env.free()
    env.report.add(stage, row)
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    print(json.dumps(brief, ensure_ascii=False), flush=True)
    return row


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def ok(row) -> bool:
    return "error" not in row and "skipped" not in row


def skip(env, stage, name, why):
    row = {"stage": stage, "config": name, "skipped": why}
    env.report.add(stage, row)
    print(f"{stage}/{name}: skipped ({why})", flush=True)
    return row


# ------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------
COMPILE_EST_S = 240          # first-iteration compile allowance (inductor, every graph variant)


def stage_levers(env) -> list[str]:
    """Each lever on/off at the SD3.5-M defaults (1 × 16). Returns the names of those that paid."""
    base = measure(env, "levers", "baseline", LEVER_BASE, iters=2)
    if not ok(base):
        return []
    step = base["time_iter"]
    paid = {}
    for name in LEVERS:
        if env.a.levers and name not in env.a.levers.split(","):
            continue
        if env.a.cpu_smoke and name in ("attn_efficient", "attn_cudnn"):
            skip(env, "levers", name, "CUDA-only SDPA kernel")
            continue
        iters = 2 if name == "compile" else 1
        need = iters * step * 1.5 + (COMPILE_EST_S if name == "compile" and env.cuda else 0)
        if env.left() < need + env.a.reserve_s:
            skip(env, "levers", name, f"time guard: {env.left():.0f} s left, ~{need:.0f} s needed")
            continue
        r = measure(env, "levers", name, LEVER_BASE, iters=iters, lever_names=[name])
        if ok(r):
            r["speedup_iter"] = step / r["time_iter"]
            r["speedup_rollout"] = base["time_rollout"] / r["time_rollout"]
            r["peak_mem_vs_baseline"] = (r["peak_mem_GiB"] / base["peak_mem_GiB"] if env.cuda
                                         else float("nan"))
            env.report.write()
            # kept only where it pays: ≥ 2% faster per iteration (timing noise is ~1% on a GPU)
            if r["speedup_iter"] >= 1.02 and r["abs_log_ratio"] == 0.0:
                paid[name] = r["speedup_iter"]
    attn = sorted((v, k) for k, v in paid.items() if k.startswith("attn_"))
    kept = [k for k in paid if not k.startswith("attn_")] + ([attn[-1][1]] if attn else [])
    env.report.info["levers_kept"] = kept
    if len(kept) >= 2:
        iters = 2 if "compile" in kept else 1
        need = iters * step * 1.5 + (COMPILE_EST_S if "compile" in kept and env.cuda else 0)
        if env.left() < need + env.a.reserve_s:
            skip(env, "levers", "combined", "time guard")
        else:
            r = measure(env, "levers", "combined: " + ",".join(kept), LEVER_BASE, iters=iters,
                        lever_names=kept)
            if ok(r):
                r["speedup_iter"] = step / r["time_iter"]
                r["speedup_rollout"] = base["time_rollout"] / r["time_rollout"]
                env.report.write()
    return kept


def stage_memory(env) -> None:
    """Which settings fit a 24 / 48 / 80 GB card (largest card first; a setting that does not fit a
    larger card is not tried on a smaller one)."""
    total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if env.cuda else float("nan")
    too_big = set()
    for card in (CARDS_GIB if env.cuda else CARDS_GIB[:1]):      # CPU smoke: every candidate once
        if env.cuda and card - CONTEXT_GIB > total:
            skip(env, "memory", f"{card} GB", f"larger than this GPU ({total:.0f} GiB)")
            continue
        for name, flags in MEMORY_CANDIDATES.items():
            label = f"{card} GB: {name}"
            if name in too_big:
                skip(env, "memory", label, "did not fit a larger card")
                continue
            if env.left() < 30 + env.a.reserve_s:
                skip(env, "memory", label, "time guard")
                return
            if env.cuda:
                env.free()
                torch.cuda.set_per_process_memory_fraction((card - CONTEXT_GIB) / total)
            try:
                r = measure(env, "memory", label, MEMORY_TRIAL + flags)
            finally:
                if env.cuda:
                    torch.cuda.set_per_process_memory_fraction(1.0)
            r["card_GiB"], r["limit_GiB"] = card, card - CONTEXT_GIB
            r["fits"] = ok(r) if env.cuda else None            # no limit on the CPU
            env.report.write()
            if r["fits"]:
                break
            if "out of memory" in r.get("error", ""):
                too_big.add(name)


def load_flow_example():
    import importlib.util
    path = ROOT / "examples" / "baselines" / "flow_grpo_sd3.py"
    spec = importlib.util.spec_from_file_location("flow_grpo_sd3", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stage_flow(env) -> None:
    """Flow-GRPO (published SD3.5-M recipe) vs V-GRPO (paper settings), same P×G, one table."""
    flow = load_flow_example()
    if not hasattr(flow, "RECIPES"):
        skip(env, "flow", "Flow-GRPO vs V-GRPO",
             "examples/baselines/flow_grpo_sd3.py has no --recipe (older version)")
        return
    P, G = (1, 4) if env.a.cpu_smoke else (1, 24)
    argv = ["--model", env.model, "--reward", "pickscore", "--recipe", "cfg4.5",
            "--prompts_per_iter", str(P), "--group_size", str(G),
            "--iterations", str(env.a.flow_iterations), "--device", str(env.dev.type),
            "--n_eval", "1", "--eval_steps", "4"] + env.small
    argv += ["--flow_steps", "4"] if env.a.cpu_smoke else []        # Flow-GRPO's 10 on the GPU
    try:
        fresh_transformer(env.pipe)
        env.free()
        mine, args = flow.parse(argv)
        rows, info, lines = flow.run(mine, args, log=lambda s: print(s, flush=True), pipe=env.pipe,
                                     rewards=env.reward)[:3]
    except Exception as e:  # noqa: BLE001
        env.report.add("flow", {"stage": "flow", "config": "Flow-GRPO vs V-GRPO", "error": err(e)})
        print(f"flow: {type(e).__name__}: {e}", flush=True)
        return
    finally:
        fresh_transformer(env.pipe)
        env.free()
    key = (args.model, args.resolution)
    if key not in env.fwd:
        ad = V.make_adapter(env.pipe, args, env.dev)
        ctx = torch.autocast(env.dev.type, dtype=env.dtype, enabled=env.cuda)
        D = ad.latent_shape(args.resolution)
        env.fwd[key] = forward_flops(ad, D, ad.encode(["a red fox"]), ctx)
    fwd = env.fwd[key]
    env.report.info["flow"] = info
    for method, label in (("vgrpo", "V-GRPO"), ("flow_grpo", "Flow-GRPO")):
        its = [m for m in lines if m.get("method") == method and "time_iter" in m]
        if not its:
            continue
        m, N = its[-1], P * G
        n_tr = m.get("n_trained_samples", N)
        flops = fwd * (N * m["nfe_old"] + n_tr * (3 * m["nfe_theta"] + m.get("nfe_ref", 0)))
        desc = next((r["rollout"] for r in rows if r["method"] == label), "")
        row = {"stage": "flow", "config": label, "settings": desc, "images_per_iter": N,
               "nfe_rollout": m["nfe_rollout"], "nfe_pi_old": m["nfe_old"],
               "nfe_theta": m["nfe_theta"],
               "nfe_ref": m.get("nfe_ref", 0), "opt_steps": m.get("opt_steps"),
               "time_first_iter": its[0]["time_iter"], "time_iter": m["time_iter"],
               "gpu_s_iter": m["time_iter"] * 1, "s_per_1000_images": 1000 * m["time_iter"] / N,
               "gpu_s_per_1000_images": 1000 * m["time_iter"] / N * 1,
               **{k: m[k] for k in ("time_rollout", "time_reward", "time_old", "time_update")},
               "TFLOP/s": flops / m["time_iter"] / 1e12,
               "MFU_%": 100 * flops / m["time_iter"] / (env.a.peak * 1e12),
               "abs_log_ratio_first": its[0].get("abs_log_ratio_first",
                                                 its[0].get("abs_log_ratio"))}
        env.report.add("flow", row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                         ensure_ascii=False), flush=True)


def stage_flux(env, kept) -> None:
    """FLUX.1-dev defaults at 1 × 12: whole-iteration MFU, with and without the levers that paid
    on SD3.5-M."""
    env.pipe = None
    import torch._dynamo
    torch._dynamo.reset()                                # compiled SD3 blocks
    env.free()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    stage_flux_build(env)
    env.report.info["flux_build_s"] = time.perf_counter() - t0
    print(f"built FLUX.1-dev-shaped pipeline in {time.perf_counter() - t0:.0f}s", flush=True)
    measure(env, "flux", "warmup", WARMUP["flux"])
    base = measure(env, "flux", "flux_default", CONFIGS["flux_default"])
    if kept and ok(base):
        compile_extra = COMPILE_EST_S if "compile" in kept and env.cuda else 0
        iters = 2 if "compile" in kept else 1
        if env.left() < iters * base["time_iter"] * 1.3 + compile_extra:
            skip(env, "flux", "flux_default + levers", "time guard")
        else:
            r = measure(env, "flux", "flux_default + levers", CONFIGS["flux_default"], iters=iters,
                        lever_names=kept)
            if ok(r):
                r["speedup_iter"] = base["time_iter"] / r["time_iter"]
                env.report.write()


def stage_configs(env) -> None:
    """The named CONFIGS, one iteration each after a warm-up (the README's earlier rows)."""
    fam = "flux" if env.model.startswith("flux") else "sd3"
    measure(env, "configs", "warmup", WARMUP[fam])
    default = "flux_default" if fam == "flux" else "default,mb8_nockpt"
    for n in (env.a.configs or default).split(","):
        if n in CONFIGS:
            measure(env, "configs", n, CONFIGS[n])


# ------------------------------------------------------------------------------------------------
# Output: one JSON and its markdown twin, rewritten after every row
# ------------------------------------------------------------------------------------------------
class Report:
    COLS = {
        "levers": ["config", "P×G", "time_first_iter", "time_iter", "time_rollout", "time_reward",
                   "time_old", "time_update", "rollout_MFU_%", "MFU_%", "peak_mem_GiB",
                   "speedup_iter", "speedup_rollout", "abs_log_ratio"],
        "memory": ["config", "limit_GiB", "fits", "peak_mem_GiB", "micro_batch", "rollout_batch",
                   "time_iter"],
        "flow": ["config", "settings", "images_per_iter", "nfe_pi_old", "nfe_theta", "nfe_ref",
                 "time_first_iter", "time_iter", "gpu_s_iter", "s_per_1000_images",
                 "gpu_s_per_1000_images", "time_rollout", "time_update", "MFU_%",
                 "abs_log_ratio_first"],
        "flux": ["config", "P×G", "time_first_iter", "time_iter", "time_rollout", "time_update",
                 "rollout_MFU_%", "MFU_%", "peak_mem_GiB", "speedup_iter", "abs_log_ratio"],
        "configs": ["config", "P×G", "micro_batch", "grad_ckpt", "time_rollout", "time_reward",
                    "time_old", "time_update", "time_iter", "peak_mem_GiB", "TFLOP/s", "MFU_%"],
    }

    def __init__(self, path, info):
        self.path, self.info, self.sections = (Path(path) if path else None), info, {}

    def add(self, section, row):
        self.sections.setdefault(section, []).append(row)
        self.write()

    def write(self):
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"info": self.info, **self.sections}
        self.path.write_text(json.dumps(data, indent=2, ensure_ascii=False))
        self.path.with_suffix(".md").write_text(self.markdown())

    def markdown(self) -> str:
        def cell(v):
            if isinstance(v, float):
                return "—" if math.isnan(v) else (f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}")
            return "—" if v is None else str(v)
        i = self.info
        out = [f"# examples/gpu/gpu_check.py: {i.get('device', '')}, torch {i.get('torch', '')}", "",
               f"Command: `{i.get('command', '')}`. Times in seconds; MFU against "
               f"{i.get('peak_TFLOPs')} TFLOP/s; FLOP counting in the script's docstring.", ""]
        for sec, rows in self.sections.items():
            if sec == "warmup":
                continue
            cols = self.COLS.get(sec, ["config"])
            out += [f"## {sec}", "", "| " + " | ".join(cols) + " | note |",
                    "|" + "---|" * (len(cols) + 1)]
            for r in rows:
                note = r.get("error") or r.get("skipped") or ""
                out.append("| " + " | ".join(cell(r.get(c)) for c in cols) + f" | {note} |")
            out.append("")
        return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="levers,memory,flow,flux",
                    help="comma-separated, run in this order: levers, memory, flow, flux, configs")
    ap.add_argument("--configs", default=None, help="configs stage: names from CONFIGS (default: "
                    "default,mb8_nockpt for sd3, flux_default for flux)")
    ap.add_argument("--family", default="sd3", choices=("sd3", "flux"),
                    help="configs stage: which model")
    ap.add_argument("--extra", default="", help="vgrpo flags appended to every configuration")
    ap.add_argument("--peak", type=float, default=BF16_PEAK_TFLOPS, help="GPU dense bf16 TFLOP/s")
    ap.add_argument("--budget_s", type=float, default=570.0,
                    help="time guard: stages and rows that would end past this many seconds "
                         "after the start (model build included) are skipped")
    ap.add_argument("--reserve_s", type=float, default=20.0, help="seconds kept free at the end")
    ap.add_argument("--compile_backend", default=None,
                    help="backend for the compile lever (default inductor; the CPU smoke uses "
                    "eager)")
    ap.add_argument("--levers", default=None, help=f"levers stage: a subset of {','.join(LEVERS)}")
    ap.add_argument("--flow_iterations", type=int, default=2,
                    help="flow stage: iterations of each method")
    ap.add_argument("--out", default=None, help="JSON output (a .md twin beside it); default "
                    "results/gpu/gpu_check.json on a GPU, none in --cpu_smoke")
    ap.add_argument("--cpu_smoke", action="store_true",
                    help="every stage on the tiny models on the CPU")
    a = ap.parse_args(argv)
    V._quiet_hf()
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = set(stages) - {"levers", "memory", "flow", "flux", "configs"}
    if bad:
        ap.error(f"unknown stage(s) {sorted(bad)}")
    if a.cpu_smoke:
        dev, dtype, ctx = torch.device("cpu"), torch.float32, torch.autocast("cpu", enabled=False)
        a.compile_backend = a.compile_backend or "eager"
    else:
        if not torch.cuda.is_available():
            sys.exit("error: this check needs a CUDA GPU (or pass --cpu_smoke)")
        dev, dtype = torch.device("cuda"), torch.bfloat16
        ctx = torch.autocast("cuda", dtype=dtype)
        torch.backends.cuda.matmul.allow_tf32 = True
        a.out = a.out or str(ROOT / "results" / "gpu" / "gpu_check.json")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (smoke: tiny models)"
    cmd = "python examples/gpu/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = {"device": name, "torch": torch.__version__, "command": cmd, "peak_TFLOPs": a.peak,
            "budget_s": a.budget_s, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    env = Env(a, dev, dtype, ctx, Report(a.out, info))
    print(f"{info['device']}  torch {torch.__version__}  stages {stages}", flush=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if a.cpu_smoke:
        env.small = ["--num_steps", "4", "--resolution", "64", "--max_sequence_length", "32",
                     "--lora_rank", "4", "--lora_alpha", "8", "--device", "cpu",
                     "--group_size", "4"]
        flux_only = stages == ["flux"] or (stages == ["configs"] and a.family == "flux")
        env.pipe = TM.build_tiny_flux_pipeline() if flux_only else TM.build_tiny_sd3_pipeline()
        from examples.rewards.jpeg import score as jpeg
        env.reward = V.Rewards({"jpeg": jpeg}, [("jpeg", 1.0)])
        global LEVER_BASE, MEMORY_TRIAL
        LEVER_BASE = ["--prompts_per_iter", "1", "--group_size", "4"]
        MEMORY_TRIAL = ["--prompts_per_iter", "1", "--group_size", "4"]
    else:
        flux_only = stages == ["flux"] or (stages == ["configs"] and a.family == "flux")
        if not flux_only:
            env.pipe = build_sd35m_random(dev, dtype)
        env.reward = build_pickscore_random(dev, dtype)
        if env.pipe is not None:
            env.pipe.vae.to(torch.float32)
            with torch.no_grad():
                ad = V.make_adapter(env.pipe, V.parse_args(["--model", env.model]), dev)
                c = ad.encode(["a red fox"])
            info["text_embeddings_finite"] = all(bool(torch.isfinite(v).all()) for v in c.values())
    info["build_s"] = time.perf_counter() - t0
    if flux_only and not a.cpu_smoke:
        env.pipe = None
    if a.cpu_smoke and flux_only:
        env.model = "flux.1-dev"
    print(f"built in {info['build_s']:.0f}s", flush=True)
    kept_levers = []
    if "configs" in stages:
        if a.family == "flux" and not env.model.startswith("flux"):
            stage_flux_build(env)
        stage_configs(env)
    if env.pipe is not None and not env.model.startswith("flux"):
        if "levers" in stages or "memory" in stages or "flow" in stages:
            measure(env, "warmup", "warmup", WARMUP["sd3"])    # kernels, allocator (not reported)
        if "levers" in stages:
            kept_levers = stage_levers(env)
        if "memory" in stages:
            if env.left() > 60:
                stage_memory(env)
            else:
                skip(env, "memory", "all", "time guard")
        if "flow" in stages:
            if env.left() > 90:
                stage_flow(env)
            else:
                skip(env, "flow", "all", "time guard")
    if "flux" in stages:
        need = 20 if a.cpu_smoke else 150                  # build + warm-up + one 1×12 iteration
        if env.left() > need:
            stage_flux(env, kept_levers)
        else:
            skip(env, "flux", "all", "time guard")
    info["total_s"] = time.perf_counter() - env.t0
    env.report.write()
    print("\n" + env.report.markdown(), flush=True)
    if a.out:
        print(f"wrote {a.out} and {Path(a.out).with_suffix('.md')}", flush=True)
    return env.report


def stage_flux_build(env):
    env.pipe = None
    env.free()
    env.pipe = (TM.build_tiny_flux_pipeline() if env.a.cpu_smoke
                else build_flux_dev_random(env.dev, env.dtype))
    env.pipe.vae.to(torch.float32)
    env.model = "flux.1-dev"


if __name__ == "__main__":
    main()
