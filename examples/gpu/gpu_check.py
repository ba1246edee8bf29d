"""GPU check: V-GRPO's throughput on the real SD3.5-Medium and FLUX.1-dev architectures, in ONE run.

No downloads: every network is built from its published configuration with RANDOM weights
(SD3.5-M transformer 2.24B params, the SD3 VAE, CLIP-L/CLIP-G/T5-XXL text encoders at full width,
FLUX.1-dev's 11.9B transformer, and a PickScore-shaped CLIP ViT-H/14 reward), so timings and memory
are those of the real models while the images and rewards are meaningless. Tokenizers are the tiny
offline ones (token ids differ, sequence lengths are the real ones).

    python examples/gpu/gpu_check.py                  # the default stages, ~10 min on one H100/H200
    python examples/gpu/gpu_check.py --stages levers,flux --levers compile,cudagraphs \
        --budget_s 520 --out results/gpu/gpu_check_compile.json    # --compile against eager
    python examples/gpu/gpu_check.py --stages levers  # some stages: levers,memory,flow,flux,configs
    python examples/gpu/gpu_check.py --cpu_smoke      # the whole script on the tiny models, CPU
    python examples/gpu/gpu_check.py --stages configs --configs default,rb48_mb8   # single named rows
    python examples/gpu/gpu_check.py --stages configs --family flux --configs flux_default
    python examples/gpu/gpu_check.py --stages plugins  # Qwen-Image, FLUX.2 klein, Z-Image
    python examples/gpu/gpu_check.py --stages plugins --plugins z_image,flux2 --card_GiB 48

Stages, in this order, each skipped when the time guard (--budget_s, default 570 s from the start,
model build included; on a GPU the stages before flux leave it 150 s, and the stages before
plugins its first plug-in's allowance) says it would not finish;
every row is written to --out (JSON, and a markdown twin) as soon as it is measured, so a run cut
short keeps what it measured:
  levers  SD3.5-M single-GPU defaults (40 Euler steps, N_MC 4, μ 1, micro-batch 4, rollout
          batch 16, checkpointing) at P×G = 1×16 — the default's per-forward shapes (rollout 16
          rows, training micro-batch 4 × N_MC 4 = 16 rows), a ninth of its samples. The baseline
          runs the trainer with --no-compile (eager), then one row per lever:
            compile     the trainer's own --compile: vgrpo.setup calls vgrpo.compile_blocks, which
                        compiles each transformer block in place and warms it up at the run's
                        shapes; those seconds (run.time_compile) are reported apart from the
                        iterations (time_compile), and the first iteration apart from the steady one.
            cudagraphs  (only when named in --levers) --compile, and the no-grad rollout's velocity
                        calls replayed from CUDA graphs: one graph per input shape, captured at its
                        first call after two warm-up calls, with static input buffers, autocast's
                        weight-cast cache off during capture (so every replay reads the LoRA's
                        current weights) and the output cloned (DPM-Solver++(2M) keeps the previous
                        prediction). Surrogate passes never replay a graph. At each capture the
                        replay is compared with a plain call (cudagraph_rel_diff); the lever pays
                        only if that is within bf16 rounding (CUDAGRAPH_TOL), |log ρ| stays 0, and
                        the iteration is ≥ 2 % faster than the compile row's. Off by default: it
                        holds one graph memory pool per shape, and a graph replays the kernels and
                        addresses of its capture, so a later change of code path (a merged LoRA:
                        never combined with it) or a replaced weight tensor would replay stale.
                        CUDA only; --cpu_smoke runs its bookkeeping with a stand-in that replays
                        through the same buffers without a graph.
            merge_lora_rollout, attn_flash / attn_efficient / attn_cudnn, vae_autocast:
                        experiments applied here from outside the trainer (see LEVERS), eager.
          Then every lever that paid, at once. Per row: MFU per phase (rollout; update = θ_old
          pass + θ forward/backward) and per iteration, peak memory, |log ρ| (0 at μ = 1 must hold
          with every lever) and |log ρ| of the first optimizer step.
  memory  which settings train SD3.5-M LoRA on a 24, 48 and 80 GB card, emulated with
          torch.cuda.set_per_process_memory_fraction (card size − 0.75 GiB for the CUDA context):
          candidates from fastest to leanest, stopping at the first that fits (eager).
  flow    Flow-GRPO at its published SD3.5-M settings (examples/baselines/flow_grpo_sd3.py
          --recipe cfg4.5: 10 SDE steps, CFG 4.5, 9 trained steps, 2 optimizer steps, fp16)
          against V-GRPO at the paper's (40 ODE steps, CFG-free, N_MC 4, μ 1, bf16), same P×G and
          initial noise: seconds and GPU-seconds per iteration and per 1,000 images (eager).
  flux    FLUX.1-dev defaults (720 px, 16-step DPM-Solver++(2M), μ 4, clip 1e-2) at MixGRPO's
          per-GPU batch 1×12: eager, then with --compile (the trainer's default on one GPU) and the
          other levers that paid on SD3.5-M, then with cudagraphs if it paid. At μ 4 the first
          optimizer step has ρ ≡ 1 by construction (abs_log_ratio_first 0) and the later three
          are off-policy (abs_log_ratio > 0).
  plugins (only when named) one row per model plug-in of examples/models/ that has a
          build_real_size_pipeline, found through vgrpo.model_plugins (--plugins picks some):
          Qwen-Image (20.4B transformer, Qwen2.5-VL-7B text), FLUX.2 [klein] 4B and
          Z-Image-Turbo (6.15B), each built on the GPU at its published architecture with random
          weights, then the plug-in's own defaults (its DEFAULTS: resolution, steps, group size,
          LoRA, checkpointing) at 1 prompt × its group size, eager, one iteration (two when the
          time guard allows) after a warm-up at tiny shapes. --offload_text_encoders when the
          pipeline's weights exceed half the card (--card_GiB, default this GPU; a smaller value
          also caps the allocator there, as the memory stage does). Per row: seconds and peak
          memory of setup and of each phase (rollout; reward = decode + reward model; θ_old's
          surrogates, empty at μ 1; update), the iteration's seconds, MFU, |log ρ| of the first
          step (0 at μ 1), and fits (no out-of-memory on this card). After an out-of-memory the
          next of PLUGIN_FALLBACKS (gradient checkpointing, then micro-batch 1) gets its own row.
          The time guard allows each plug-in PLUGIN_EST_S, estimates not yet measured. Their
          tokenizers are the plug-ins' byte-level ones: a prompt is a few times its real number
          of text tokens (FLUX.2 pads to max_sequence_length 512 either way).
Every row runs the trainer with an explicit --compile or --no-compile (--extra or a CONFIGS entry
may name one). On the CPU (--cpu_smoke) compilation uses the cheap "eager" dynamo backend
(--compile_backend; inductor takes minutes there): the code path is the trainer's, the speed is not.

FLOP counting: `fwd` = model FLOPs of ONE transformer forward on ONE sample, counted by
torch.utils.flop_counter (matmuls 2·m·n·k, attention's two matmuls; elementwise ops not counted).
Only the passes that ran are counted, per sample, from the measured iteration's own metrics:
    rollout  K = nfe_rollout forwards (no grad)
    update   nfe_old θ_old forwards (no grad; N_MC·(μ−1)/μ, 0 at μ = 1, where S_old comes from the
             first step's own forward) + 3·J, J = nfe_theta = N_MC θ forwards with their backward
             (backward = 2 forwards; 0 when the iteration skipped its update)
    FLOPs_rollout = N·fwd·K      FLOPs_update = N·fwd·(nfe_old + 3·J)      FLOPs_iter = the sum
    rollout MFU = FLOPs_rollout / time_rollout / peak
    update MFU  = FLOPs_update / (time_old + time_update) / peak
    MFU         = FLOPs_iter / iteration seconds / peak   (reward seconds included, its FLOPs not)
Not counted as useful: gradient-checkpointing recompute, LoRA's own (rank-32) matmuls, the text
encoders, VAE and reward. peak: --peak, 989 TFLOP/s dense bf16 (H100/H200 SXM). Flow stage:
fwd · (N · (nfe_rollout + nfe_old) + trained samples · (3 · nfe_theta + nfe_ref)), NFE counting a
CFG step (2 rows) as 2. Rows measured before this count (results/gpu/gpu_check_h200*.json) counted
N_MC θ_old forwards per sample whether they ran or not, and the flow stage left out the rollout;
examples/gpu/mfu_restate.py recomputes their MFU from their stored times.
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
# The levers. `compile` is the trainer's own flag (--compile, vgrpo.compile_blocks in setup); the
# others are experiments, not trainer flags: each is applied to a live Run from outside vgrpo.py
# (a patched function, a wrapped adapter method, torch's process-wide switches) and undone before
# the next row. One comes back into vgrpo.py only with a measured speed-up. `cudagraphs` runs only
# when --levers names it (see the docstring).
LEVERS = ("compile", "merge_lora_rollout", "attn_flash", "attn_efficient", "attn_cudnn",
          "vae_autocast", "cudagraphs")
DEFAULT_LEVERS = tuple(n for n in LEVERS if n != "cudagraphs")
COMPILED_LEVERS = ("compile", "cudagraphs")       # rows that run the trainer with --compile
CUDAGRAPH_TOL = 1e-2    # max |replay − plain| / max |plain| at a capture: bf16 rounding is ~4e-3


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


def compiled_modules(transformer) -> list:
    """(module, its compiled call) of every module nn.Module.compile compiled in place: the
    trainer's regional compile (vgrpo.compile_blocks on adapter.blocks(), whatever the family
    names its blocks: SD3's transformer_blocks, Z-Image's layers and refiners)."""
    return [(m, m._compiled_call_impl) for m in transformer.modules()
            if getattr(m, "_compiled_call_impl", None) is not None]


def uncompile_blocks(transformer) -> None:
    """Undo the trainer's regional compile (vgrpo.compile_blocks: nn.Module.compile on each block)."""
    for blk, _ in compiled_modules(transformer):
        blk._compiled_call_impl = None            # nn.Module.compile's slot


@contextlib.contextmanager
def compile_backend(backend):
    """vgrpo.compile_blocks calls blk.compile() with torch's default backend (inductor); inside this
    block that call uses `backend` instead (the CPU smoke's cheap "eager"). None or "inductor":
    nothing changes."""
    if backend in (None, "inductor"):
        yield
        return
    real = torch.nn.Module.compile

    def compile(self, *a, **k):
        k.setdefault("backend", backend)
        return real(self, *a, **k)
    torch.nn.Module.compile = compile
    try:
        yield
    finally:
        torch.nn.Module.compile = real


def autocast_without_cache(device_type: str):
    """The current autocast (same dtype) with its weight-cast cache off, or nothing without one:
    a captured graph must cast the LoRA's fp32 weights itself, at every replay."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                          cache_enabled=False)


def cuda_graph_capture(fn, static):
    """Two warm-up calls on a side stream (compiled blocks settle their guards, cuBLAS its
    workspace), then one CUDA graph of fn(*static). Returns (replay, static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    return graph.replay, out                       # the bound method keeps the graph alive


def standin_capture(fn, static):
    """The CPU stand-in for cuda_graph_capture: a 'replay' that recomputes fn(*static) into the same
    output buffer, so the static-buffer bookkeeping is what runs (no graph)."""
    out = fn(*static)

    def replay():
        out.copy_(fn(*static))
    return replay, out


class GraphedVelocity:
    """adapter.velocity with its no-grad calls replayed from one graph per input signature (shapes,
    dtypes, autocast): inputs copied into the graph's static buffers, the static output cloned.
    Calls with grad enabled go to the plain velocity. At each capture the replay is compared with
    a plain call on the same inputs: max_rel_diff = max |replay − plain| / max |plain|."""

    def __init__(self, velocity, capture):
        self.velocity, self.capture = velocity, capture
        self.graphs = {}               # signature → (replay, (x, t, cond) static, static output)
        self.max_rel_diff, self.replays = 0.0, 0

    def __call__(self, x, t, cond):
        if torch.is_grad_enabled() or not isinstance(cond, dict):
            return self.velocity(x, t, cond)
        dev = x.device.type
        key = (tuple(x.shape), x.dtype, tuple(t.shape), t.dtype,
               tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(cond.items())),
               torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        if key not in self.graphs:
            static = (x.clone(), t.clone(), {k: v.clone() for k, v in cond.items()})
            with autocast_without_cache(dev):
                replay, out = self.capture(self.velocity, static)
                replay()
                ref = self.velocity(*static).float()
            diff = (out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
            self.max_rel_diff = max(self.max_rel_diff, float(diff))
            self.graphs[key] = (replay, static, out)
        replay, (sx, st, sc), out = self.graphs[key]
        sx.copy_(x)
        st.copy_(t)
        for k, v in sc.items():
            v.copy_(cond[k])
        replay()
        self.replays += 1
        return out.clone()


@contextlib.contextmanager
def levers(run, names, stats=None, capture=None):
    """Apply the named levers that act on a live Run (all but `compile`, which is the trainer's
    --compile, given at setup) for the body, then undo them. `stats` receives the cudagraphs
    lever's counts; `capture` overrides its graph capture (default: CUDA graphs on CUDA, the
    stand-in elsewhere)."""
    sw = torch.backends.cuda
    switches = (sw.enable_flash_sdp, sw.enable_mem_efficient_sdp, sw.enable_math_sdp,
                sw.enable_cudnn_sdp)
    saved = (sw.flash_sdp_enabled(), sw.mem_efficient_sdp_enabled(), sw.math_sdp_enabled(),
             sw.cudnn_sdp_enabled())
    ad, real_rollout, real_decode = run.adapter, V.rollout, run.adapter.decode
    gv = None
    try:
        if "merge_lora_rollout" in names:             # rollouts and evaluation, not surrogates
            if "cudagraphs" in names:                 # the merge replaces what a graph reads
                raise ValueError("cudagraphs and merge_lora_rollout do not combine")

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
        if "cudagraphs" in names:                     # the no-grad rollout only
            gv = GraphedVelocity(ad.velocity, capture or (
                cuda_graph_capture if run.dev.type == "cuda" else standin_capture))
            inner = V.rollout

            def graphed_rollout(adapter, *a, **k):
                adapter.velocity = gv                 # shadows the method for this call only
                try:
                    return inner(adapter, *a, **k)
                finally:
                    adapter.__dict__.pop("velocity", None)
            V.rollout = graphed_rollout
        yield
    finally:
        V.rollout = real_rollout
        ad.__dict__.pop("decode", None)
        ad.__dict__.pop("velocity", None)
        for enable, on in zip(switches, saved):
            enable(on)
        if gv is not None:
            if stats is not None:
                stats.update(cudagraph_graphs=len(gv.graphs), cudagraph_replays=gv.replays,
                             cudagraph_rel_diff=gv.max_rel_diff)
            gv.graphs.clear()                         # the graphs' memory pools


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


def build_pickscore_random(device, dtype, tiny=False):
    """A CLIP ViT-H/14 (PickScore's architecture, ~0.99B params) with random weights; `tiny`: the
    same code path at 2 layers of width 32 on 32-pixel images (a CPU smoke run's)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok = TM.tiny_clip_tokenizer(d)
    n = len(tok)
    if tiny:
        text = dict(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4)
        vision, proj, px = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, image_size=32, patch_size=8), 16, 32
    else:
        text = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096,
                    num_hidden_layers=24, num_attention_heads=16)
        vision, proj, px = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                num_attention_heads=16, image_size=224, patch_size=14), 1024, 224
    cfg = CLIPConfig(text_config=dict(text, max_position_embeddings=77, bos_token_id=n - 2,
                                      eos_token_id=n - 1, pad_token_id=n - 1),
                     vision_config=vision, projection_dim=proj, logit_scale_init_value=4.6052)
    with torch.device(device):
        model = CLIPModel(cfg)
    proc = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": px},
                                                            crop_size={"height": px, "width": px}),
                         tokenizer=tok)
    return V.Rewards({"pickscore": V.clip_reward(model, proc, device, dtype, logit_scale=True)},
                     [("pickscore", 1.0)])


# ------------------------------------------------------------------------------------------------
# Measuring one configuration
# ------------------------------------------------------------------------------------------------
def forward_flops(adapter, D, cond, ctx):
    """Model FLOPs of one transformer forward on one sample (matmuls + attention), counted on the
    eager blocks (compiled ones are set aside for the count and put back)."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn((1,) + D, device=adapter.device)
    t = torch.full((1,), 0.5, device=adapter.device)
    c = V.select(cond, torch.zeros(1, dtype=torch.long, device=adapter.device))
    compiled = compiled_modules(adapter.transformer)
    try:
        uncompile_blocks(adapter.transformer)
        with torch.no_grad(), ctx, FlopCounterMode(display=False) as fc:
            adapter.velocity(x, t, c)
    finally:
        for b, impl in compiled:
            b._compiled_call_impl = impl
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
        self.later_s = 0.0            # seconds kept for a later stage (flux) by the time guard

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
    uncompile_blocks(tr)


def flop_forwards(m: dict) -> tuple:
    """(rollout, update) forwards per sample that ran in the iteration whose metrics are `m`:
    K = nfe_rollout; nfe_old (θ_old's no-grad pass, 0 at μ = 1) + 3 · nfe_theta (θ's forward and
    backward; none when the update was skipped)."""
    theta = 0.0 if m.get("skipped") else 3.0 * m["nfe_theta"]
    return float(m["nfe_rollout"]), float(m["nfe_old"]) + theta


def mfu_fields(fwd: float, N: int, m: dict, wall: float, peak_tflops: float) -> dict:
    """The FLOP count and MFU per phase and per iteration of one measured iteration (docstring)."""
    f_roll, f_upd = flop_forwards(m)
    roll, upd, peak = N * fwd * f_roll, N * fwd * f_upd, peak_tflops * 1e12
    upd_s = m["time_old"] + m["time_update"]
    return {"nfe_rollout": m["nfe_rollout"], "nfe_old": m["nfe_old"], "nfe_theta": m["nfe_theta"],
            "forwards_per_sample": f_roll + f_upd, "TFLOP_iter": (roll + upd) / 1e12,
            "TFLOP/s": (roll + upd) / wall / 1e12, "MFU_%": 100 * (roll + upd) / wall / peak,
            "rollout_MFU_%": 100 * roll / m["time_rollout"] / peak,
            "update_MFU_%": 100 * upd / upd_s / peak if upd_s > 0 else float("nan")}


# the iteration's phases as vgrpo.timed names them → the report's peak-memory columns
PHASE_PEAKS = {"time_rollout": "peak_rollout_GiB", "time_reward": "peak_reward_GiB",
               "time_old": "peak_old_GiB", "time_update": "peak_update_GiB"}


@contextlib.contextmanager
def phase_peaks(read, reset):
    """Inside, every vgrpo.timed block (the iteration's phases: rollout, rewards, θ_old's
    surrogates, update) starts the peak-memory counter afresh (`reset`) and appends its peak
    (`read`, GiB) to peaks[key]; peaks["all"] collects the peaks between the blocks too, so its
    max is the whole body's. Yields `peaks` ({key: [GiB, ...]}, one entry per block run);
    vgrpo.timed is restored on exit, whatever happens."""
    real, peaks = V.timed, {"all": []}

    @contextlib.contextmanager
    def timed(times, key, *rest, **kw):
        peaks["all"].append(read())              # since the last reset: what ran before
        reset()
        try:
            with real(times, key, *rest, **kw):
                yield
        finally:
            peaks.setdefault(key, []).append(read())
            peaks["all"].append(peaks[key][-1])
            reset()
    V.timed = timed
    try:
        yield peaks
    finally:
        V.timed = real
        peaks["all"].append(read())


def measure(env, stage, name, extra, iters=1, lever_names=(), keep_going=None,
            per_phase_memory=False):
    """setup() + `iters` iterations of one configuration, with the named levers applied: `compile`
    and `cudagraphs` as the trainer's --compile (every other row --no-compile, unless the flags
    name one), the others around the iterations. Returns a row (also on failure: with 'error').
    Time and phases are those of the LAST iteration (steady state when iters ≥ 2).
    keep_going(seconds of the last iteration) → whether to run the next one (a time guard;
    the row's `iterations` says how many ran). per_phase_memory: the peak memory of setup and of
    each phase (PHASE_PEAKS, the max over the iterations; NaN on the CPU) in the row, and
    peak_mem_GiB the max over all of them."""
    argv = ["--model", env.model, "--reward", "pickscore", "--eval_rewards", "pickscore"] + extra
    argv += env.small + env.a.extra.split()
    if "--compile" not in argv and "--no-compile" not in argv:
        argv.append("--compile" if set(lever_names) & set(COMPILED_LEVERS) else "--no-compile")
    row = {"stage": stage, "config": name, "flags": " ".join(extra), "levers": ",".join(lever_names)}
    try:
        args = V.parse_args(argv)
        fresh_transformer(env.pipe)
        if not args.gradient_checkpointing:
            env.pipe.transformer.disable_gradient_checkpointing()
        env.free()
        if env.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with compile_backend(env.a.compile_backend):
            run = V.setup(args, pipe=env.pipe, rewards=env.reward)
        row.update(compiled=run.compiled, time_compile=run.time_compile,
                   time_setup=time.perf_counter() - t0)
        read = ((lambda: torch.cuda.max_memory_allocated() / 2 ** 30) if env.cuda
                else (lambda: float("nan")))
        reset = torch.cuda.reset_peak_memory_stats if env.cuda else (lambda: None)
        if per_phase_memory:
            row["peak_setup_GiB"] = read()        # text encoders still on the GPU, LoRA added
        key = (args.model, args.resolution)
        if key not in env.fwd:
            c1 = run.adapter.encode(run.train_prompts[:1])
            env.fwd[key] = forward_flops(run.adapter, run.D, c1, run.ctx)
        fwd = env.fwd[key]
        walls, ms, stats = [], [], {}
        probe = (phase_peaks(read, reset) if per_phase_memory
                 else contextlib.nullcontext({"all": []}))
        with levers(run, lever_names, stats), probe as peaks:
            for it in range(iters):
                t0 = time.perf_counter()
                ms.append(V.iteration(run, it))
                walls.append(time.perf_counter() - t0)
                if it < iters - 1 and keep_going is not None and not keep_going(walls[-1]):
                    break
        P, G, K = args.prompts_per_iter, args.group_size, args.num_steps
        N, m, wall = P * G, ms[-1], walls[-1]
        if per_phase_memory:
            row.update({col: max(peaks[key]) for key, col in PHASE_PEAKS.items()})
            row["peak_mem_GiB"] = max([row["peak_setup_GiB"], *peaks["all"]])
        row.update({
            "P×G": f"{P}×{G}", "K": K, "resolution": args.resolution, "n_mc": args.n_mc,
            "mu": args.mu, "micro_batch": args.micro_batch, "rollout_batch": args.rollout_batch,
            "grad_ckpt": args.gradient_checkpointing, "iterations": len(ms),
            "time_first_iter": walls[0], "time_iter": wall,
            **{k: m[k] for k in ("time_rollout", "time_reward", "time_old", "time_update")},
            "peak_mem_GiB": row.get("peak_mem_GiB", read() if env.cuda else float("nan")),
            "fwd_TFLOP_per_sample": fwd / 1e12, **mfu_fields(fwd, N, m, wall, env.a.peak),
            "abs_log_ratio": max(x["abs_log_ratio"] for x in ms),
            "abs_log_ratio_first": max(x["abs_log_ratio_first"] for x in ms),
            "reward_finite": all(x["n_nonfinite_reward"] == 0 for x in ms),
            "grad_norm": m["grad_norm"], **stats})
        if len(ms) >= 2:
            row["first_minus_steady_s"] = walls[0] - wall  # recompiles, autotuning, allocator
        del run
    except torch.OutOfMemoryError as e:
        phase = getattr(e, "vgrpo_phase", None)       # vgrpo.timed's phase, if inside one
        row["error"] = ("out of memory" + (f" in {phase}" if phase else "") + ": "
                        + str(e).splitlines()[0][:200])
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
# compile allowances for the time guard: setup's compilation, measured 65 s for SD3.5-M on an
# H200 (inductor, cold), ×2 for margin; FLUX.1-dev's (two block kinds) is not measured
COMPILE_EST_S = {"sd3": 130, "flux": 120}
FLUX_STAGE_S = 150           # FLUX build + warm-up + one eager 1×12 iteration (49 s on an H200)


def effective(names) -> frozenset:
    """The levers a row really runs: cudagraphs runs on the compiled blocks."""
    names = set(names)
    return frozenset(names | ({"compile"} if "cudagraphs" in names else set()))


def stage_levers(env) -> list[str]:
    """The eager baseline and each lever at the SD3.5-M defaults (1 × 16); cudagraphs against the
    compile row. Returns the names of the levers that paid."""
    base = measure(env, "levers", "baseline", LEVER_BASE, iters=2)
    if not ok(base):
        return []
    step = base["time_iter"]
    chosen = env.a.levers.split(",") if env.a.levers else DEFAULT_LEVERS
    if "cudagraphs" in chosen and "compile" not in chosen:
        chosen = ["compile", *chosen]                 # its reference row
    paid, rows = {}, {}
    for name in (n for n in LEVERS if n in chosen):
        if not env.cuda and name in ("attn_efficient", "attn_cudnn"):
            skip(env, "levers", name, "CUDA-only SDPA kernel")
            continue
        compiled = name in COMPILED_LEVERS
        iters = 2 if compiled else 1
        need = iters * step * 1.5 + (COMPILE_EST_S["sd3"] if compiled and env.cuda else 0)
        if env.left() < need + env.a.reserve_s + env.later_s:
            skip(env, "levers", name, f"time guard: {env.left():.0f} s left, ~{need:.0f} s needed"
                 + (f" and {env.later_s:.0f} s kept for the flux stage" if env.later_s else ""))
            continue
        r = rows[name] = measure(env, "levers", name, LEVER_BASE, iters=iters, lever_names=[name])
        if not ok(r):
            continue
        r["speedup_iter"] = step / r["time_iter"]
        r["speedup_rollout"] = base["time_rollout"] / r["time_rollout"]
        r["peak_mem_vs_baseline"] = (r["peak_mem_GiB"] / base["peak_mem_GiB"] if env.cuda
                                     else float("nan"))
        gain = r["speedup_iter"]
        if name == "cudagraphs":                      # what the graphs add to the compiled run
            ref = rows.get("compile", {})
            gain = ref["time_iter"] / r["time_iter"] if ok(ref) else float("nan")
            r["speedup_vs_compile"] = gain
            if ok(ref):
                r["rollout_speedup_vs_compile"] = ref["time_rollout"] / r["time_rollout"]
        correct = (r["abs_log_ratio"] == 0.0
                   and r.get("cudagraph_rel_diff", 0.0) <= CUDAGRAPH_TOL)
        # kept only where it pays: ≥ 2% faster per iteration (timing noise is ~1% on a GPU)
        r["pays"] = bool(gain >= 1.02 and correct)
        env.report.write()
        if r["pays"]:
            paid[name] = gain
    attn = sorted((v, k) for k, v in paid.items() if k.startswith("attn_"))
    kept = [k for k in paid if not k.startswith("attn_")] + ([attn[-1][1]] if attn else [])
    if "cudagraphs" in kept and "merge_lora_rollout" in kept:
        kept.remove("merge_lora_rollout")             # the merge rewrites what a graph reads
    env.report.info["levers_kept"] = kept
    if len(effective(kept)) >= 2 and effective(kept) not in {effective([k]) for k in rows}:
        compiled = bool(effective(kept) & set(COMPILED_LEVERS))
        iters = 2 if compiled else 1
        need = iters * step * 1.5 + (COMPILE_EST_S["sd3"] if compiled and env.cuda else 0)
        if env.left() < need + env.a.reserve_s + env.later_s:
            skip(env, "levers", "combined", "time guard")
        else:
            r = measure(env, "levers", "combined: " + ",".join(kept), LEVER_BASE, iters=iters,
                        lever_names=kept)
            if ok(r):
                r["speedup_iter"] = step / r["time_iter"]
                r["speedup_rollout"] = base["time_rollout"] / r["time_rollout"]
                env.report.write()
    env.report.info["compile_failed"] = "compile" in rows and not ok(rows["compile"])
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
            if env.left() < 30 + env.a.reserve_s + env.later_s:
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
        roll = fwd * N * m["nfe_rollout"]                 # the rollout, CFG rows counted
        upd = fwd * (N * m["nfe_old"] + n_tr * (3 * m["nfe_theta"] + m.get("nfe_ref", 0)))
        flops, upd_s, peak = roll + upd, m["time_old"] + m["time_update"], env.a.peak * 1e12
        desc = next((r["rollout"] for r in rows if r["method"] == label), "")
        row = {"stage": "flow", "config": label, "settings": desc, "images_per_iter": N,
               "nfe_rollout": m["nfe_rollout"], "nfe_pi_old": m["nfe_old"],
               "nfe_theta": m["nfe_theta"],
               "nfe_ref": m.get("nfe_ref", 0), "opt_steps": m.get("opt_steps"),
               "time_first_iter": its[0]["time_iter"], "time_iter": m["time_iter"],
               "gpu_s_iter": m["time_iter"] * 1, "s_per_1000_images": 1000 * m["time_iter"] / N,
               "gpu_s_per_1000_images": 1000 * m["time_iter"] / N * 1,
               **{k: m[k] for k in ("time_rollout", "time_reward", "time_old", "time_update")},
               "TFLOP_iter": flops / 1e12, "TFLOP/s": flops / m["time_iter"] / 1e12,
               "MFU_%": 100 * flops / m["time_iter"] / peak,
               "rollout_MFU_%": 100 * roll / m["time_rollout"] / peak,
               "update_MFU_%": 100 * upd / upd_s / peak if upd_s > 0 else float("nan"),
               "abs_log_ratio_first": its[0].get("abs_log_ratio_first",
                                                 its[0].get("abs_log_ratio"))}
        env.report.add("flow", row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                         ensure_ascii=False), flush=True)


def stage_flux(env, kept) -> None:
    """FLUX.1-dev defaults (μ 4) at 1 × 12: eager; with --compile (the trainer's default on one GPU)
    and the other levers that paid on SD3.5-M; then with cudagraphs too if it paid there."""
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
    if not ok(base):
        return
    lev = [k for k in kept if k != "cudagraphs"]
    if "compile" not in lev and not env.report.info.get("compile_failed"):
        lev = ["compile", *lev]
    todo = [lev] if lev else []
    if "cudagraphs" in kept:
        todo.append([*lev, "cudagraphs"])
    for names in todo:
        compiled = bool(effective(names) & set(COMPILED_LEVERS))
        extra_s = COMPILE_EST_S["flux"] if compiled and env.cuda else 0
        one = base["time_iter"] * 1.3 + extra_s
        if env.left() < one + env.a.reserve_s + env.later_s:
            skip(env, "flux", "flux_default + " + ",".join(names), "time guard")
            continue
        # a second iteration, when there is time, shows that nothing compiles after setup
        iters = 2 if env.left() > one + base["time_iter"] + env.a.reserve_s + env.later_s else 1
        r = measure(env, "flux", "flux_default + " + ",".join(names), CONFIGS["flux_default"],
                    iters=iters, lever_names=names)
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


# plugins stage: every model plug-in of examples/models/ with a build_real_size_pipeline (its
# published architecture, random weights), at one GPU's share of a batch: 1 prompt × the
# plug-in's group size, at its DEFAULTS' resolution, steps, LoRA and checkpointing, eager.
PLUGIN_BATCH = ["--prompts_per_iter", "1"]
PLUGIN_WARMUP = ["--prompts_per_iter", "1", "--group_size", "2", "--num_steps", "2", "--n_mc", "2",
                 "--resolution", "256", "--micro_batch", "1", "--rollout_batch", "2",
                 "--reward_batch", "2"]
# after an out-of-memory, the next setting (one that changes the run's configuration)
PLUGIN_FALLBACKS = {"default": [], "grad_ckpt": ["--gradient_checkpointing"],
                    "grad_ckpt_mb1": ["--gradient_checkpointing", "--micro_batch", "1",
                                      "--rollout_batch", "4", "--reward_batch", "4"]}
# Time-guard allowances per plug-in: build, warm-up, setup and one iteration. NOT measured (no GPU
# has run this stage): one forward's FLOPs at the defaults (Qwen-Image ~45 TFLOP per sample,
# Z-Image ~14, FLUX.2 klein-4B ~9), K + 4·N_MC forwards for each of 16 samples at ~400 TFLOP/s,
# plus ~60 s of building and setup, × 1.5. Replace them with measured seconds once measured.
PLUGIN_EST_S = {"flux2": 90, "qwen_image": 240, "z_image": 120}
PLUGIN_EST_OTHER_S = 240          # a plug-in not listed above
PLUGIN_EST_CPU_S = 10             # --cpu_smoke: the tiny pipelines


def real_size_plugins() -> dict:
    """{name: module} of the model plug-ins vgrpo finds (vgrpo.model_plugins: examples/models/)
    that have a build_real_size_pipeline, in vgrpo's order."""
    return {n: m for n, m in V.model_plugins().items() if hasattr(m, "build_real_size_pipeline")}


def plugin_estimate(env, name) -> float:
    """Seconds the time guard allows one plug-in (PLUGIN_EST_S)."""
    return PLUGIN_EST_CPU_S if not env.cuda else PLUGIN_EST_S.get(name, PLUGIN_EST_OTHER_S)


def pipeline_weights(pipe) -> tuple:
    """(GiB of the weights of every module of the pipeline, the transformer's parameters)."""
    mods = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    size = sum(t.numel() * t.element_size() for m in mods
               for t in [*m.parameters(), *m.buffers()])
    return size / 2 ** 30, sum(p.numel() for p in pipe.transformer.parameters())


def offload_rule(weights_gib, card_gib) -> bool:
    """--offload_text_encoders when the pipeline's weights exceed half the card (no card: no)."""
    return card_gib is not None and weights_gib > card_gib / 2


@contextlib.contextmanager
def card_limit(env, card_gib):
    """On a GPU larger than `card_gib`: torch's allocator capped at card − CONTEXT_GIB for the
    body, as the memory stage emulates a smaller card. Otherwise (the CPU too) nothing."""
    total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if env.cuda else None
    limited = env.cuda and card_gib < total
    if limited:
        env.free()
        torch.cuda.set_per_process_memory_fraction((card_gib - CONTEXT_GIB) / total)
    try:
        yield
    finally:
        if limited:
            torch.cuda.set_per_process_memory_fraction(1.0)


def stage_plugins(env) -> None:
    """One row per model plug-in (--plugins; default every one with a real-size builder): its
    real architecture with random weights built on this GPU (on the CPU: its tiny pipeline),
    a warm-up at tiny shapes (not reported), then the plug-in's defaults at 1 × its group size,
    eager, with per-phase peak memory. Text encoders are offloaded when the pipeline's weights
    exceed half the card. An out-of-memory row is followed by the next of PLUGIN_FALLBACKS."""
    import torch._dynamo
    found = real_size_plugins()
    names = env.a.plugins.split(",") if env.a.plugins else list(found)
    total = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if env.cuda else None
    card = env.a.card_GiB or total
    for i, name in enumerate(names):
        later = sum(plugin_estimate(env, n) for n in names[i + 1:])
        est = plugin_estimate(env, name)
        if env.left() < est + env.a.reserve_s:
            skip(env, "plugins", name, f"time guard: {env.left():.0f} s left, ~{est:.0f} s "
                 "needed")["plugin"] = name
            env.report.write()
            continue
        env.pipe = None
        torch._dynamo.reset()
        env.free()
        mod, t0 = found[name], time.perf_counter()
        alias = next(iter(mod.ALIASES))
        torch.manual_seed(0)
        try:
            pipe = (getattr(mod, next(iter(mod.TINY.values())))() if env.a.cpu_smoke
                    else mod.build_real_size_pipeline(env.dtype, device=env.dev))
            weights, n_tr = pipeline_weights(pipe)
            ad = V.make_adapter(pipe, V.parse_args(["--model", alias] + env.small), env.dev)
            with torch.no_grad(), env.ctx:
                c = ad.encode(["a red fox"])
            finite = all(bool(torch.isfinite(v).all()) for v in c.values()
                         if v.is_floating_point())
            del ad, c
        except Exception as e:  # noqa: BLE001 — an out-of-memory at build is a result
            env.pipe = pipe = None
            env.free()
            oom = isinstance(e, torch.OutOfMemoryError)
            env.report.add("plugins", {"stage": "plugins", "config": name, "plugin": name,
                                       "error": f"build: {err(e)}",
                                       "fits": False if oom and env.cuda else None})
            continue
        offload = offload_rule(weights, card)
        common = {"plugin": name, "model": alias, "pipeline": type(pipe).__name__,
                  "build_s": time.perf_counter() - t0, "transformer_params_B": n_tr / 1e9,
                  "weights_GiB": weights, "card_GiB": card, "offload_text_encoders": offload,
                  "text_embeddings_finite": finite}
        print(f"built {name} ({type(pipe).__name__}, {weights:.1f} GiB of weights) in "
              f"{common['build_s']:.0f}s; offload_text_encoders {offload}", flush=True)
        env.pipe, env.model = pipe, alias
        flags = PLUGIN_BATCH + (["--offload_text_encoders"] if offload else [])
        with card_limit(env, card):
            measure(env, "warmup", f"{name}: warmup",
                    PLUGIN_WARMUP + flags[len(PLUGIN_BATCH):])
            tried = []
            for rung, more in PLUGIN_FALLBACKS.items():
                argv = ["--model", alias] + flags + more + env.small + env.a.extra.split()
                cfg = V.parse_args(argv)
                if cfg in tried:                    # the defaults already have it
                    continue
                if tried and env.left() < spent * 1.2 + env.a.reserve_s:
                    skip(env, "plugins", f"{name}: {rung}", "time guard")["plugin"] = name
                    env.report.write()
                    break
                t1 = time.perf_counter()
                r = measure(env, "plugins", f"{name}: {rung}", flags + more, iters=2,
                            per_phase_memory=True,
                            keep_going=lambda s: env.left() > 1.3 * s + env.a.reserve_s + later)
                spent = time.perf_counter() - t1
                oom = "out of memory" in r.get("error", "")
                r.update(common, fits=None)       # unknown on the CPU, or after another error
                if env.cuda and (ok(r) or oom):
                    r["fits"] = ok(r)
                env.report.write()
                if not oom:
                    break
                tried.append(cfg)
        env.pipe = pipe = None
        env.free()


# ------------------------------------------------------------------------------------------------
# Output: one JSON and its markdown twin, rewritten after every row
# ------------------------------------------------------------------------------------------------
class Report:
    COLS = {
        "levers": ["config", "P×G", "time_compile", "time_first_iter", "time_iter", "time_rollout",
                   "time_reward", "time_old", "time_update", "rollout_MFU_%", "update_MFU_%",
                   "MFU_%", "peak_mem_GiB", "speedup_iter", "speedup_rollout",
                   "speedup_vs_compile", "pays", "abs_log_ratio", "abs_log_ratio_first",
                   "cudagraph_rel_diff"],
        "memory": ["config", "limit_GiB", "fits", "peak_mem_GiB", "micro_batch", "rollout_batch",
                   "time_iter"],
        "flow": ["config", "settings", "images_per_iter", "nfe_rollout", "nfe_pi_old", "nfe_theta",
                 "nfe_ref", "time_first_iter", "time_iter", "gpu_s_iter", "s_per_1000_images",
                 "gpu_s_per_1000_images", "time_rollout", "time_update", "rollout_MFU_%",
                 "update_MFU_%", "MFU_%", "abs_log_ratio_first"],
        "flux": ["config", "P×G", "mu", "time_compile", "time_first_iter", "time_iter",
                 "time_rollout", "time_old", "time_update", "rollout_MFU_%", "update_MFU_%",
                 "MFU_%", "peak_mem_GiB", "speedup_iter", "abs_log_ratio", "abs_log_ratio_first"],
        "configs": ["config", "P×G", "micro_batch", "grad_ckpt", "compiled", "time_compile",
                    "time_rollout", "time_reward", "time_old", "time_update", "time_iter",
                    "peak_mem_GiB", "TFLOP/s", "rollout_MFU_%", "update_MFU_%", "MFU_%"],
        "plugins": ["config", "model", "P×G", "resolution", "K", "micro_batch", "grad_ckpt",
                    "offload_text_encoders", "weights_GiB", "time_setup", "time_first_iter",
                    "time_iter", "time_rollout", "time_reward", "time_old", "time_update",
                    "peak_setup_GiB", "peak_rollout_GiB", "peak_reward_GiB", "peak_old_GiB",
                    "peak_update_GiB", "peak_mem_GiB", "fits", "abs_log_ratio_first",
                    "MFU_%"],
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
                    help="comma-separated, run in this order: configs, levers, memory, flow, "
                         "flux, plugins (plugins only when named)")
    ap.add_argument("--plugins", default=None,
                    help="plugins stage: model plug-ins of examples/models/ (default: every one "
                         "with a build_real_size_pipeline)")
    ap.add_argument("--card_GiB", type=float, default=None,
                    help="plugins stage: the card the offload rule and `fits` refer to (default: "
                         "this GPU's memory, none on the CPU); on a larger GPU its allocator is "
                         "capped to it, as the memory stage does")
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
                    help="torch.compile backend of the trainer's --compile rows (default: its "
                    "own, inductor; the CPU smoke uses eager, inductor takes minutes there)")
    ap.add_argument("--levers", default=None,
                    help=f"levers stage: a subset of {','.join(LEVERS)} (default: all but "
                    "cudagraphs, which runs only when named)")
    ap.add_argument("--flow_iterations", type=int, default=2,
                    help="flow stage: iterations of each method")
    ap.add_argument("--out", default=None, help="JSON output (a .md twin beside it); default "
                    "results/gpu/gpu_check.json on a GPU, none in --cpu_smoke")
    ap.add_argument("--cpu_smoke", action="store_true",
                    help="every stage on the tiny models on the CPU")
    a = ap.parse_args(argv)
    V._quiet_hf()
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = set(stages) - {"levers", "memory", "flow", "flux", "configs", "plugins"}
    if bad:
        ap.error(f"unknown stage(s) {sorted(bad)}")
    bad = set((a.plugins or "").split(",")) - set(real_size_plugins()) - {""}
    if bad:
        ap.error(f"unknown plug-in(s) {sorted(bad)}; choose from "
                 f"{','.join(real_size_plugins())}")
    bad = set((a.levers or "").split(",")) - set(LEVERS) - {""}
    if bad:
        ap.error(f"unknown lever(s) {sorted(bad)}; choose from {','.join(LEVERS)}")
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
        if stages != ["plugins"]:          # the plugins stage builds its own pipelines
            env.pipe = TM.build_tiny_flux_pipeline() if flux_only else TM.build_tiny_sd3_pipeline()
        from examples.rewards.jpeg import score as jpeg
        env.reward = V.Rewards({"jpeg": jpeg}, [("jpeg", 1.0)])
        global LEVER_BASE, MEMORY_TRIAL
        LEVER_BASE = ["--prompts_per_iter", "1", "--group_size", "4"]
        MEMORY_TRIAL = ["--prompts_per_iter", "1", "--group_size", "4"]
    else:
        flux_only = stages == ["flux"] or (stages == ["configs"] and a.family == "flux")
        if not flux_only and stages != ["plugins"]:
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
    # the stages before flux and plugins leave them their time (plugins: its first plug-in's)
    plugins_s = 0.0
    if "plugins" in stages and env.cuda:
        first = (a.plugins or ",".join(real_size_plugins())).split(",")[0]
        plugins_s = plugin_estimate(env, first)
    env.later_s = (FLUX_STAGE_S if "flux" in stages and env.cuda else 0.0) + plugins_s
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
            if env.left() > 60 + env.later_s:
                stage_memory(env)
            else:
                skip(env, "memory", "all", "time guard")
        if "flow" in stages:
            if env.left() > 90 + env.later_s:
                stage_flow(env)
            else:
                skip(env, "flow", "all", "time guard")
    if "flux" in stages:
        env.later_s = plugins_s
        if env.left() > (20 if a.cpu_smoke else FLUX_STAGE_S) + env.later_s:
            stage_flux(env, kept_levers)
        else:
            skip(env, "flux", "all", "time guard")
    if "plugins" in stages:
        env.later_s = 0.0
        stage_plugins(env)            # its own time guard, plug-in by plug-in
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
