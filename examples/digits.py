"""V-GRPO on a genuinely pretrained image model on a CPU: real handwritten digits, a learned reward.

No hub weights are needed: scikit-learn ships the UCI handwritten digits (1,797 real 8×8 scans)
inside its wheel. This script builds, from the real diffusers/transformers classes,

  1. a tiny StableDiffusion3Pipeline PRETRAINED on those digits (upsampled to 32×32): an
     AutoencoderKL trained on them (×4 down → 8×8×4 latents), two tiny CLIP text encoders and a
     tiny T5 (frozen, random: they only have to tell prompts apart), and an SD3Transformer2DModel
     (4 layers × 4 heads × 32, ~2.3M parameters) trained with the rectified-flow loss on phrasings
     such as "a handwritten digit 7". Saved as a diffusers folder: `vgrpo.py --model DIR` and a
     stock `StableDiffusion3Pipeline.from_pretrained(DIR)` both load it; cached, later runs reuse
     it.
  2. a learned prompt-alignment reward (the analogue of the paper's GenEval): a small conv
     classifier trained on real digits; `reward(images, prompts)` is the probability it gives the
     prompted digit, plugged into vgrpo.py as `--reward examples.digits:reward`.

Commands (from the repository root):

    python examples/digits.py quickstart     # build (or reuse), 30 V-GRPO iterations through
                                             # vgrpo.py, before/after grid + prompt accuracy
    python examples/digits.py build          # only the pretrained folder + classifier (cached)
    python examples/digits.py benchmark      # V-GRPO vs Flow-GRPO, DiffusionNFT and MixGRPO,
                                             # each at its own lr (chosen on a validation set),
                                             # the paper's two speed-up claims, the frontier,
                                             # ablations, long runs, timing; resumable
    python examples/digits.py benchmark --quick   # the same in miniature, 1 seed
    python examples/digits.py report         # summary.json, digits.md, figures, README section

    # the folder is an ordinary diffusers pipeline; train on it with vgrpo.py itself:
    python vgrpo.py --model examples/digits_cache/pipeline --reward examples.digits:reward \\
        --prompts examples/digits_cache/train_prompts.txt \\
        --eval_prompts examples/digits_cache/eval_prompts.txt \\
        --resolution 32 --max_sequence_length 32 --num_steps 10 ...   (see README)

`--max_sequence_length` must be the T5 length the model was pretrained with (32): SD3 pads T5 to
that length and the transformer attends over the padding, so another length moves every prompt
embedding and prompt accuracy collapses to chance.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # everything here is built offline
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
import torch.nn as nn
import torch.nn.functional as F

import vgrpo as V
TM = V.tiny_models()                                  # the offline tokenizer builders

CACHE = Path(os.environ.get("VGRPO_DIGITS_CACHE", Path(__file__).with_name("digits_cache")))
RESULTS = Path(__file__).with_name("digits_results")
SEQ_LEN = 32              # T5 tokens: pretraining and every V-GRPO run must use the same length
CLIP_LEN = 32             # CLIP tokens (stored in the saved tokenizers, so loaders pick it up)
RES = 32                  # pixels; the VAE downsamples ×4 to 8×8×4 latents

# Phrasings: V-GRPO trains on TRAIN_TEMPLATES (as does pretraining); evaluation uses the held-out
# EVAL_TEMPLATES, which the model never saw. Every phrasing names the digit as a numeral.
TRAIN_TEMPLATES = ["a handwritten digit {d}", "the digit {d}", "handwritten {d}",
                   "a {d}, handwritten", "digit {d}", "the number {d}", "a drawing of a {d}",
                   "write the digit {d}"]
EVAL_TEMPLATES = ["a written digit {d}", "number {d}", "the numeral {d}", "a scan of a {d}"]


def prompts_of(templates: list[str]) -> list[str]:
    return [t.format(d=d) for d in range(10) for t in templates]


def digit_of(prompt: str) -> int:
    """The digit a prompt asks for: its (only) numeral character."""
    ds = [c for c in prompt if c.isdigit()]
    if len(ds) != 1:
        raise ValueError(f"prompt {prompt!r} must name exactly one digit 0-9 as a numeral")
    return int(ds[0])


# ------------------------------------------------------------------------------------------------
# Data: the UCI digits, 8×8 in 0…16 → 32×32 in [0, 1]; a fixed 80/20 split.
# ------------------------------------------------------------------------------------------------
def real_digits(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """(images (n, 1, 32, 32) in [0, 1], labels (n,)) of the 'train' (80 %) or 'test' (20 %)
    split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(RES, RES), mode="bicubic", align_corners=False).clamp(0, 1)
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = len(y) // 5
    idx = order[n_test:] if split == "train" else order[:n_test]
    return x[idx], y[idx]


# ------------------------------------------------------------------------------------------------
# The reward model: a small conv classifier on real digits.
# ------------------------------------------------------------------------------------------------
class DigitClassifier(nn.Module):
    """3 conv layers + linear; input (n, 1, 32, 32) in [0, 1]. `features` (n, 64) is the embedding
    used for the diversity and nearest-real-digit metrics."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),        # 16×16
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),       # 8×8
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
            nn.Flatten(), nn.Linear(256, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random shifts of up to ±2 px and contrast 0.8–1.2 (real scans vary in both)."""
    n = len(x)
    theta = torch.zeros(n, 2, 3)
    scale = 1 + (torch.rand(n, generator=g) - 0.5) * 0.2
    theta[:, 0, 0] = theta[:, 1, 1] = scale
    theta[:, :, 2] = (torch.rand(n, 2, generator=g) - 0.5) * (4 / RES) * 2
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    x = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
    return (x * (0.8 + 0.4 * torch.rand(n, 1, 1, 1, generator=g))).clamp(0, 1)


def train_classifier(steps: int = 600, seed: int = 0, log=print) -> tuple[DigitClassifier, float]:
    """Train on the train split; return (model in eval mode, accuracy on the test split)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = real_digits("train")
    xt, yt = real_digits("test")
    clf = DigitClassifier()
    opt = torch.optim.AdamW(clf.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    for step in range(steps):
        i = torch.randint(len(y), (128,), generator=g)
        loss = F.cross_entropy(clf(_augment(x[i], g)), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    clf.eval()
    with torch.no_grad():
        acc = (clf(xt).argmax(1) == yt).float().mean().item()
    log(f"classifier: held-out accuracy {acc:.4f} on {len(yt)} real test digits ({steps} steps)")
    return clf, acc


# ------------------------------------------------------------------------------------------------
# The pipeline: VAE trained on the digits, frozen random text encoders, a pretrained transformer.
# ------------------------------------------------------------------------------------------------
def to_rgb(x: torch.Tensor) -> torch.Tensor:
    """(n, 1, H, W) in [0, 1] → (n, 3, H, W) in [-1, 1], the VAE's input convention."""
    return x.repeat(1, 3, 1, 1) * 2 - 1


def train_vae(steps: int = 300, seed: int = 0, log=print):
    """A diffusers AutoencoderKL, 32×32×3 → 8×8×4, trained on the train-split digits (MSE + a
    small KL)."""
    from diffusers import AutoencoderKL
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=RES,
                        use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=False)
    x, _ = real_digits("train")
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
    vae.train()
    for step in range(steps):
        xb = to_rgb(x[torch.randint(len(x), (32,), generator=g)])
        post = vae.encode(xb).latent_dist
        rec = vae.decode(post.sample()).sample
        loss = F.mse_loss(rec, xb) + 1e-5 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    vae.eval().requires_grad_(False)
    with torch.no_grad():                           # SD3 convention: z = (μ − shift) · scale
        mu = vae.encode(to_rgb(x)).latent_dist.mean
    vae.register_to_config(shift_factor=float(mu.mean()), scaling_factor=float(1 / mu.std()))
    log(f"vae: {steps} steps, final recon MSE {loss.item():.4f}, latent mean {mu.mean():.3f} "
        f"std {mu.std():.3f}")
    return vae


def new_pipeline(vae, seed: int = 0, layers: int = 4, heads: int = 4):
    """An SD3 pipeline around `vae`: tiny text encoders (vgrpo's offline tokenizers) and a fresh
    SD3Transformer2DModel (`layers` × `heads` × 32). Scheduler shift 1: 8×8 latents need no
    high-noise emphasis."""
    import tempfile
    from diffusers import (FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        tok1, tok2 = TM.tiny_clip_tokenizer(d), TM.tiny_clip_tokenizer(d)
    for tok in (tok1, tok2):      # 32 CLIP tokens instead of 77: the pipeline reads this length
        tok.model_max_length = CLIP_LEN          # from the tokenizer; text tokens dominate the cost
    tok3 = TM.tiny_t5_tokenizer()
    n = len(tok1)
    clip_cfg = CLIPTextConfig(vocab_size=n, hidden_size=32, intermediate_size=64, projection_dim=32,
                              num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=CLIP_LEN,
                              bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1,
                              hidden_act="quick_gelu")
    te1, te2 = CLIPTextModelWithProjection(clip_cfg), CLIPTextModelWithProjection(clip_cfg)
    joint = 64                       # ≥ 32 + 32: the CLIP features are zero-padded up to it
    te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=joint, d_kv=8, d_ff=64,
                                  num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                                  dropout_rate=0.0,
                                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    transformer = SD3Transformer2DModel(
        sample_size=RES // 4, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
        attention_head_dim=32, num_attention_heads=heads, joint_attention_dim=joint,
        caption_projection_dim=32 * heads, pooled_projection_dim=64, pos_embed_max_size=8)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=vae,
        text_encoder=te1, tokenizer=tok1, text_encoder_2=te2, tokenizer_2=tok2,
        text_encoder_3=te3, tokenizer_3=tok3)
    for m in (te1, te2, te3, vae):
        m.eval().requires_grad_(False)
    return pipe


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str]) -> dict:
    """Text conditioning exactly as vgrpo's SD3Adapter computes it (CFG-free, T5 length SEQ_LEN)."""
    pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                          device="cpu", do_classifier_free_guidance=False,
                                          max_sequence_length=SEQ_LEN)
    return {"prompt_embeds": pe, "pooled": pooled}


def pretrain(pipe, steps: int, seed: int = 0, batch: int = 32, lr: float = 1e-3, log=print,
             eval_every: int = 0, on_eval=None, t_density: str = "logit_normal",
             train_text: bool = False):
    """Rectified-flow pretraining of the transformer: x_t = (1 − t)·x0 + t·ε, target ε − x0,
    t logit-normal (SD3's training density), 10 % of prompts replaced by "" (keeps an unconditional
    model for classifier-free guidance). Latents are the VAE posterior means, scaled as SD3 does.
    train_text: also train the three text encoders (faster to pick up the prompt; the test's fast
    recipe)."""
    from tqdm.auto import tqdm
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = real_digits("train")
    vae, tr = pipe.vae, pipe.transformer
    with torch.no_grad():
        mu = vae.encode(to_rgb(x)).latent_dist.mean
        z = (mu - vae.config.shift_factor) * vae.config.scaling_factor
    phr = [[t.format(d=d) for t in TRAIN_TEMPLATES] for d in range(10)]
    texts = [p for ps in phr for p in ps] + [""]                          # (10·T + 1) rows
    table = encode_prompts(pipe, texts)
    T = len(TRAIN_TEMPLATES)
    tr.train().requires_grad_(True)
    params = list(tr.parameters())
    encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
    if train_text:
        for m in encoders:
            m.train().requires_grad_(True)
            params += list(m.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    warm = 50
    # linear warm-up, then constant: a shorter budget is exactly a prefix of a longer one
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    bar = tqdm(range(steps), desc="pretraining", unit="step")
    for step in bar:
        i = torch.randint(len(y), (batch,), generator=g)
        row = y[i] * T + torch.randint(T, (batch,), generator=g)
        row[torch.rand(batch, generator=g) < 0.1] = 10 * T                 # the empty prompt
        x0 = z[i]
        eps = torch.randn(x0.shape, generator=g)
        t = (torch.sigmoid(torch.randn(batch, generator=g)) if t_density == "logit_normal"
             else torch.rand(batch, generator=g))
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        if train_text:
            pe, _, pooled, _ = pipe.encode_prompt(
                prompt=texts, prompt_2=None, prompt_3=None, device="cpu",
                do_classifier_free_guidance=False, max_sequence_length=SEQ_LEN)
            table = {"prompt_embeds": pe, "pooled": pooled}
        v = tr(hidden_states=xt, timestep=t * 1000,
               encoder_hidden_states=table["prompt_embeds"][row],
               pooled_projections=table["pooled"][row], return_dict=False)[0]
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if eval_every and (step + 1) % eval_every == 0:
            tr.eval()
            with torch.no_grad():
                m = heldout_metrics(pipe, n_per=5)
            tr.train()
            log(f"pretraining step {step + 1}: held-out prompt accuracy {m['acc']:.3f}, "
                f"diversity {m['diversity']:.2f}")
            if on_eval is not None:
                on_eval(step + 1, m)
    bar.close()
    for m in [tr, *encoders]:
        m.eval().requires_grad_(False)
    return pipe


# ------------------------------------------------------------------------------------------------
# Building / caching.
# ------------------------------------------------------------------------------------------------
def build(cache: Path = CACHE, pretrain_steps: int = 1500, vae_steps: int = 300,
          clf_steps: int = 400, seed: int = 0, force: bool = False, log=print,
          eval_every: int = 0, on_eval=None, pretrain_lr: float = 1e-3, layers: int = 4,
          heads: int = 4, t_density: str = "logit_normal", train_text: bool = False) -> Path:
    """Make (or reuse) cache/pipeline (diffusers folder), cache/classifier.pt and the prompt files.
    Returns the pipeline folder. Reused only if it was built with the same budgets and seed."""
    cache = Path(cache)
    recipe = dict(pretrain_steps=pretrain_steps, pretrain_lr=pretrain_lr, vae_steps=vae_steps,
                  clf_steps=clf_steps, seed=seed, layers=layers, heads=heads, t_density=t_density,
                  train_text=train_text,
                  seq_len=SEQ_LEN, templates=TRAIN_TEMPLATES, version=1)
    info_path = cache / "build.json"
    if not force and info_path.is_file() \
            and json.loads(info_path.read_text()).get("recipe") == recipe:
        log(f"reusing the pretrained digits model in {cache} (delete it, or pass --force, "
            "to rebuild)")
        return cache / "pipeline"
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    global _CLF
    stage = cache / "classifier.json"           # each stage is cached on its own recipe
    if not force and stage.is_file() and json.loads(stage.read_text())["steps"] == clf_steps \
            and json.loads(stage.read_text())["seed"] == seed:
        clf = DigitClassifier()
        clf.load_state_dict(torch.load(cache / "classifier.pt", map_location="cpu"))
        clf.eval().requires_grad_(False)
        clf_acc = json.loads(stage.read_text())["heldout_acc"]
        log(f"reusing the classifier in {cache} (held-out accuracy {clf_acc:.4f})")
    else:
        clf, clf_acc = train_classifier(clf_steps, seed, log)
        torch.save(clf.state_dict(), cache / "classifier.pt")
        stage.write_text(json.dumps(dict(steps=clf_steps, seed=seed, heldout_acc=clf_acc)))
    _CLF = clf
    t1 = time.perf_counter()
    stage = cache / "vae.json"
    if not force and stage.is_file() \
            and json.loads(stage.read_text()) == dict(steps=vae_steps, seed=seed):
        from diffusers import AutoencoderKL
        vae = AutoencoderKL.from_pretrained(cache / "vae").eval().requires_grad_(False)
        log(f"reusing the VAE in {cache}")
    else:
        vae = train_vae(vae_steps, seed, log)
        vae.save_pretrained(cache / "vae")
        stage.write_text(json.dumps(dict(steps=vae_steps, seed=seed)))
    xt, yt = real_digits("test")
    with torch.no_grad():
        rec = vae.decode(vae.encode(to_rgb(xt)).latent_dist.mean).sample
        rec = (rec.mean(1, keepdim=True) + 1) / 2
        rec_acc = (clf(rec.clamp(0, 1)).argmax(1) == yt).float().mean().item()
    log(f"vae: reconstructions of the held-out digits classified {rec_acc:.4f} correct")
    t2 = time.perf_counter()
    pipe = new_pipeline(vae, seed, layers, heads)
    n_par = sum(p.numel() for p in pipe.transformer.parameters())
    log(f"transformer: {n_par / 1e6:.2f}M parameters; rectified-flow pretraining, "
        f"{pretrain_steps} steps")
    pretrain(pipe, pretrain_steps, seed, lr=pretrain_lr, log=log, eval_every=eval_every,
             on_eval=on_eval, t_density=t_density, train_text=train_text)
    t3 = time.perf_counter()
    tmp = cache / "pipeline.tmp"
    pipe.save_pretrained(tmp)
    if (cache / "pipeline").exists():
        import shutil
        shutil.rmtree(cache / "pipeline")
    tmp.rename(cache / "pipeline")
    (cache / "train_prompts.txt").write_text("\n".join(prompts_of(TRAIN_TEMPLATES)) + "\n")
    (cache / "eval_prompts.txt").write_text("\n".join(prompts_of(EVAL_TEMPLATES)) + "\n")
    base = heldout_metrics(load_pipe(cache / "pipeline"), n_per=10)
    info = dict(recipe=recipe, classifier_heldout_acc=clf_acc, vae_recon_acc=rec_acc,
                transformer_params=n_par, base=base,
                seconds=dict(classifier=t1 - t0, vae=t2 - t1, pretrain=t3 - t2))
    info_path.write_text(json.dumps(info, indent=2))
    log(f"base model: held-out prompt accuracy {base['acc']:.3f}, reward {base['reward']:.3f} "
        f"(10 digits × 10 samples: unseen phrasings and noise); built in "
        f"{time.perf_counter() - t0:.0f} s")
    return cache / "pipeline"


# The test suite's fast version (test_vgrpo.py): small budgets, a few iterations.
# A 2-layer × 2-head transformer (0.29M parameters) with trainable text encoders learns the
# prompt in a few hundred steps. Measured with this recipe: base 26–32 %, 54–61 % after these 20
# V-GRPO iterations (1 and 2 threads), 84 % after 30; chance is 10 %. The test takes 60 s with 2
# threads and 90 s with 1 on an otherwise idle 2-core machine.
FAST_BUILD = dict(clf_steps=100, vae_steps=80, pretrain_steps=500, pretrain_lr=3e-3, layers=2,
                  heads=2, train_text=True)
FAST_RL = dict(iterations=20, flags=["--lr", "2e-3", "--prompts_per_iter", "8"])


def load_pipe(folder):
    """The saved folder through vgrpo's own loader (the path `vgrpo.py --model DIR` takes)."""
    return V.load_pipeline(str(folder), torch.float32)


# ------------------------------------------------------------------------------------------------
# The reward (vgrpo plug-in contract) and the held-out metrics.
# ------------------------------------------------------------------------------------------------
_CLF: DigitClassifier | None = None


def classifier() -> DigitClassifier:
    global _CLF
    if _CLF is None:
        path = CACHE / "classifier.pt"
        if not path.is_file():
            raise RuntimeError(f"{path} not found: run `python examples/digits.py build` first "
                               "(or set VGRPO_DIGITS_CACHE to the folder that holds it)")
        clf = DigitClassifier()
        clf.load_state_dict(torch.load(path, map_location="cpu"))
        _CLF = clf.eval().requires_grad_(False)
    return _CLF


def gray(images: torch.Tensor) -> torch.Tensor:
    """(n, 3, H, W) in [0, 1] → (n, 1, 32, 32) in [0, 1], what the classifier sees."""
    x = images.detach().float().cpu().mean(1, keepdim=True)
    return x if x.shape[-1] == RES else F.interpolate(x, size=(RES, RES), mode="area")


@torch.no_grad()
def reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """vgrpo plug-in reward: p_classifier(prompted digit | image), (N,) in [0, 1]."""
    p = classifier()(gray(images)).softmax(1)
    return p[torch.arange(len(prompts)), torch.tensor([digit_of(q) for q in prompts])]


# Held-out set: the unseen EVAL_TEMPLATES with noise seeded HELDOUT_SEED (every reported number).
# Validation set: four further unseen phrasings with their own noise (only to choose each method's
# learning rate). Training draws its noise from vgrpo's own per-iteration generators.
VAL_TEMPLATES = ["an image of a {d}", "digit {d}, written by hand", "a sketch of the digit {d}",
                 "the figure {d}"]
HELDOUT_SEED, VAL_SEED = 12345, 4242


def eval_set(n_per: int = 10, seed: int = HELDOUT_SEED, templates: list[str] | None = None):
    """n_per prompts per digit, cycling through `templates` (default EVAL_TEMPLATES), each image
    with its own initial noise from a generator seeded `seed`. n_per = 40 gives the benchmark's
    held-out set: 10 digits × 4 phrasings × 10 noises = 400 images.
    Returns (prompts, digits (n,), x1 (n, 4, 8, 8))."""
    templates = templates or EVAL_TEMPLATES
    g = torch.Generator().manual_seed(seed)
    prompts, digits = [], []
    for d in range(10):
        for k in range(n_per):
            prompts.append(templates[k % len(templates)].format(d=d))
            digits.append(d)
    x1 = torch.randn((len(prompts), 4, RES // 4, RES // 4), generator=g)
    return prompts, torch.tensor(digits), x1


_REAL_FEAT = None


@torch.no_grad()
def image_metrics(images: torch.Tensor, digits: torch.Tensor) -> dict:
    """Per-image measures, each (n,) float64 numpy, images (n, 3, H, W) in [0, 1]:
    reward  p_classifier(prompted digit);  correct  1 if the classifier's top class is the digit;
    div     mean L2 distance of its classifier features to the other samples of the same digit,
            relative to the same number for real (train-split) digits (1 = as varied as real
            handwriting; mode collapse → 0); the set's diversity is the mean over digits;
    nn      L2 distance of its features to the nearest real digit's, relative to the same for
            real test digits (drifting off the data, e.g. reward hacking → up)."""
    global _REAL_FEAT
    clf = classifier()
    if _REAL_FEAT is None:
        xr, yr = real_digits("train")
        xt, _ = real_digits("test")
        fr, ft = clf.features(xr), clf.features(xt)
        nn_test = torch.cdist(ft, fr).min(1).values.mean().item()
        _REAL_FEAT = (fr, yr, _pairwise_div(fr, yr), nn_test)
    fr, yr, div_real, nn_real = _REAL_FEAT
    f = clf.features(gray(images))
    p = clf.head(f).softmax(1)
    idx = torch.arange(len(digits))
    div = torch.zeros(len(digits))
    for d in range(10):
        rows = torch.nonzero(digits == d).flatten()
        if len(rows) > 1:
            div[rows] = torch.cdist(f[rows], f[rows]).sum(1) / (len(rows) - 1) / div_real
    return {"reward": p[idx, digits].double().numpy(),
            "correct": (p.argmax(1) == digits).double().numpy(),
            "div": div.double().numpy(),
            "nn": (torch.cdist(f, fr).min(1).values / nn_real).double().numpy()}


def sample_metrics(images: torch.Tensor, digits: torch.Tensor) -> dict:
    """The set's prompt accuracy, reward, diversity (mean over digits) and nn-real (see
    image_metrics)."""
    m = image_metrics(images, digits)
    per_digit = [m["div"][(digits == d).numpy()].mean() for d in range(10) if (digits == d).any()]
    return {"acc": float(m["correct"].mean()), "reward": float(m["reward"].mean()),
            "diversity": float(sum(per_digit) / len(per_digit)), "nn_real": float(m["nn"].mean())}


def _pairwise_div(f: torch.Tensor, y: torch.Tensor) -> float:
    vals = []
    for d in range(10):
        fd = f[y == d]
        if len(fd) > 1:
            dist = torch.cdist(fd, fd)
            vals.append(dist.sum() / (len(fd) * (len(fd) - 1)))
    return torch.stack(vals).mean().item()


@torch.no_grad()
def generate(adapter, prompts: list[str], x1: torch.Tensor, num_steps: int = 10, batch: int = 100):
    """Deterministic Euler ODE samples of `prompts` from noise x1, through vgrpo's own rollout and
    decoder. Returns images (n, 3, 32, 32) in [0, 1]."""
    lat = V.rollout(adapter, x1, adapter.encode(prompts), torch.arange(len(prompts)),
                    adapter.sigmas(num_steps), "euler", batch, torch.no_grad())
    return torch.cat([adapter.decode(lat[r]) for r in torch.arange(len(lat)).split(batch)])


def heldout_metrics(pipe_or_adapter, n_per: int = 10, num_steps: int = 10,
                    return_images: bool = False):
    adapter = pipe_or_adapter
    if not hasattr(adapter, "velocity"):
        adapter = V.SD3Adapter(pipe_or_adapter, torch.device("cpu"), SEQ_LEN)
    prompts, digits, x1 = eval_set(n_per)
    imgs = generate(adapter, prompts, x1, num_steps)
    m = sample_metrics(imgs, digits)
    return (m, imgs) if return_images else m


# ------------------------------------------------------------------------------------------------
# The methods, each through its own trainer: vgrpo.setup + vgrpo.iteration; examples/
# flow_grpo_sd3.py's Flow-GRPO iteration with Flow-GRPO's EMA of the LoRA; examples/
# diffusion_nft_sd3.py's DiffusionNFT iteration with its EMA; examples/mix_grpo_sd3.py's MixGRPO
# iteration (no EMA).
# ------------------------------------------------------------------------------------------------
# Everything every method shares: the same P × G rollouts per iteration, steps and LoRA (vgrpo's
# SD3 defaults for rank/alpha). --lr here is the quickstart's; benchmark runs append their own.
COMMON = ["--reward", "examples.digits:reward", "--resolution", str(RES),
          "--max_sequence_length", str(SEQ_LEN), "--num_steps", "10", "--prompts_per_iter", "4",
          "--group_size", "8", "--lr", "2e-3", "--no-gradient_checkpointing", "--micro_batch", "32",
          "--rollout_batch", "64", "--device", "cpu", "--eval_every", "0"]

# The learning-rate sweep: V-GRPO, Flow-GRPO's two published SD3 recipes, DiffusionNFT's SD3
# recipe (config/nft.py sd3_pickscore: K = 10 dpm2 rollout steps, the benchmark's 10) and MixGRPO's
# recipe with its window schedule scaled to the benchmark's 10-step grid and iteration budget
# (mix_grpo_sd3.scaled_recipe). V-GRPO, Flow-GRPO and DiffusionNFT publish lr 3e-4 for LoRA on
# SD3.5-M; MixGRPO publishes 1e-5 for a full fine-tune of FLUX.1-dev, but here it trains the same
# LoRA as every other method, so it gets the same grid. All at a far larger batch than this
# benchmark's 4 × 8; every method gets the same grid around 3e-4.
SWEEP = {
    "V-GRPO": [],
    "Flow-GRPO (CFG 4.5)": {"mdp": "cfg4.5"},
    "Flow-GRPO (no CFG)": {"mdp": "nocfg"},
    "DiffusionNFT": {"nft": "sd3_pickscore"},
    "MixGRPO": {"mix": "scaled"},
}
FLOWS = ["Flow-GRPO (CFG 4.5)", "Flow-GRPO (no CFG)"]
BASELINES = [m for m in SWEEP if m != "V-GRPO"]
EMA_METHODS = [*FLOWS, "DiffusionNFT"]        # evaluated (and chosen) through their EMA
PUBLISHED_LR = {"V-GRPO": 3e-4, "Flow-GRPO (CFG 4.5)": 3e-4, "Flow-GRPO (no CFG)": 3e-4,
                "DiffusionNFT": 3e-4, "MixGRPO": 3e-4}
PUBLISHED_LR_NOTE = {"MixGRPO": "MixGRPO publishes 1e-5 for a full fine-tune; here it trains the "
                                "same LoRA as every method (LoRA lrs are larger)"}
# The paper's two speed-up claims (its abstract), measured here as it states them: the baseline
# trains B iterations at its own lr; V-GRPO's iterations to the baseline's final held-out reward;
# the claim is the ratio B / those iterations ("unit": the count the paper's ratio is in).
CLAIMS = {
    "MixGRPO": dict(factor=2.0, unit="iters", label="2× fewer iterations than MixGRPO",
                    paper="FLUX.1-dev: MixGRPO's reward after 300 iterations in 150"),
    "DiffusionNFT": dict(factor=1700 / 580, unit="steps",
                         label="3× fewer gradient steps than DiffusionNFT",
                         paper="SD3.5-M: 580 gradient steps instead of about 1.7K, at 53.8 "
                               "instead of 120 NFE per step"),
}
# V-GRPO one switch away from the shipped recipe, run at V-GRPO's chosen learning rate
ABLATIONS = {
    "pair sharing: group": ["--pair_sharing", "group"],
    "pair sharing: none": ["--pair_sharing", "none"],
    "no stratification": ["--no-stratified"],
    "no adaptive weighting": ["--no-adaptive_weighting"],
    "v-parameterisation": ["--parameterization", "v"],
    "soft-clip off": ["--soft_clip_eta", "0"],
    "per-group std": ["--no-global_std"],
    "naive FPO-style": ["--parameterization", "v", "--pair_sharing", "none", "--no-stratified",
                        "--no-adaptive_weighting", "--soft_clip_eta", "0"],
}
# The long runs: V-GRPO, V-GRPO with the paper's KL term (x-space, to θ_old, β = 0.3; it only acts
# from the second optimizer step of an iteration, hence μ = 2, as in its OCR stage), and the
# Flow-GRPO recipe with the better validation reward at its chosen lr.
KL_FLAGS = ["--kl_coef", "0.3", "--mu", "2"]
LONG = {"V-GRPO": [], "V-GRPO + KL (β = 0.3, μ = 2)": KL_FLAGS, "Flow-GRPO": "better"}
DIVERSITY_KEEP = 0.9      # an lr is eligible if its validation diversity ≥ 0.9 × the base model's


def vgrpo_flags(folder: Path, seed: int, extra: list[str]) -> list[str]:
    return ["--model", str(folder), "--prompts", str(CACHE / "train_prompts.txt"),
            "--eval_prompts", str(CACHE / "eval_prompts.txt"), "--seed", str(seed), *COMMON, *extra]


def _example(name: str):
    sys.path.insert(0, str(Path(__file__).parent))
    import importlib
    return importlib.import_module(name)


def _flow_grpo():
    return _example("flow_grpo_sd3")


class Trainer:
    """One method at one lr and seed, on the same model, LoRA, AdamW, prompts and P × G (every
    run is built by vgrpo.setup). V-GRPO: vgrpo.iteration. Flow-GRPO: examples/flow_grpo_sd3.py's
    iteration at a published recipe, carrying its optimizer-step count and the EMA of the LoRA
    that Flow-GRPO evaluates and saves (flow_grpo_sd3.LoraEMA). DiffusionNFT: examples/
    diffusion_nft_sd3.py's init_state / nft_iteration, evaluated through its eval_weights (its
    EMA). MixGRPO: examples/mix_grpo_sd3.py's scaled_recipe(K, budget) / init_state /
    mix_iteration (no EMA: it evaluates the trained weights). `evaluated()` puts in the weights
    the method evaluates; `adapter` samples the CFG-free policy; `cfg` (the CFG-4.5 recipe only)
    the guided policy as Flow-GRPO does. `budget`: the run's iterations (MixGRPO's window
    schedule is scaled to it)."""

    def __init__(self, folder: Path, spec, seed: int, lr: float, budget: int = 16):
        self.kind = ("vgrpo" if not isinstance(spec, dict) else "flow" if "mdp" in spec
                     else "nft" if "nft" in spec else "mix")
        extra = ["--lr", repr(float(lr))]
        self.ema = self.cfg = None
        self.recipe = None
        if self.kind in ("vgrpo", "nft", "mix"):
            self.args = V.parse_args(vgrpo_flags(folder, seed, [*(spec if self.kind == "vgrpo"
                                                                  else []), *extra]))
            self.run = run = V.setup(self.args)
            self.N = self.args.prompts_per_iter * self.args.group_size
            if self.kind == "nft":
                self.M = _example("diffusion_nft_sd3")
                self.state = self.M.init_state(run)                 # its published recipe
                K = self.state["recipe"]["num_steps"]
                if K != self.args.num_steps:
                    raise ValueError(f"DiffusionNFT's rollout has {K} steps, the benchmark's "
                                     f"{self.args.num_steps}")
                self.ema = self.state["ema"]
                self.recipe = {k: v for k, v in self.state["recipe"].items()}
            elif self.kind == "mix":
                self.M = _example("mix_grpo_sd3")
                self.recipe = self.M.scaled_recipe(self.args.num_steps, budget)
                self.state = self.M.init_state(run, self.recipe)
            return
        FG = _flow_grpo()
        self.FG = FG
        self.mine, self.args = FG.parse(vgrpo_flags(
            folder, seed, ["--recipe", spec["mdp"], "--methods", "flow_grpo", *extra]))
        self.run = run = V.setup(self.args)                # LoRA + optimizer exactly as V-GRPO's
        self.N = self.args.prompts_per_iter * self.args.group_size
        self.guided = FG.Guided(run.adapter, run.adapter.encode([""]), self.mine.rec["guidance"])
        self.f_sigmas = run.adapter.sigmas(self.mine.flow_steps)
        self.state = {"step": 0, "ema": FG.LoraEMA(run.params)}
        self.ema = self.state["ema"]
        guided = self.guided

        class WithCFG:                                      # the adapter's seam, guided velocity
            encode, sigmas, decode = run.adapter.encode, run.adapter.sigmas, run.adapter.decode
            velocity = staticmethod(guided.velocity)
        self.cfg = WithCFG() if guided.forwards == 2 else None

    @property
    def adapter(self):
        return self.run.adapter

    def step(self, it: int) -> dict:
        """One training iteration; returns its numeric metrics plus nfe_total, the transformer
        forwards of the whole iteration (CFG counts 2 per step; backward passes not counted), and
        opt_steps, its optimizer (gradient) steps."""
        r = self.run
        if self.kind == "vgrpo":
            m = V.iteration(r, it)
            nfe = self.N * (m["nfe_rollout"] + _old_extra(m, self.args.mu) + m["nfe_theta"])   # rollout, θ_old, θ
            m["opt_steps"] = 0 if m.get("skipped") else self.args.mu
        elif self.kind == "flow":
            m = self.FG.flow_grpo_iteration(self.mine, self.args, r.adapter, self.guided, r.rewards,
                                            r.opt, r.params, r.train_prompts, it, r.D,
                                            self.f_sigmas, r.dev, r.ctx, self.state)
            nfe = (self.N * m["nfe_rollout"]                   # the SDE rollout (θ_old terms free)
                   + m["n_trained_samples"] * (m["nfe_theta"] + m["nfe_ref"]))
        else:                       # DiffusionNFT / MixGRPO count their own forwards and steps
            m = (self.M.nft_iteration(r, it, self.state) if self.kind == "nft"
                 else self.M.mix_iteration(r, it, self.state))
            nfe = m["nfe_total"]
            if self.kind == "mix":
                m["window_start"] = m["window"][0] if m["window"] else -1
                m["window_len"] = len(m["window"])
        out = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out["nfe_total"] = int(nfe)
        out["opt_steps"] = int(m["opt_steps"])
        return out

    @contextlib.contextmanager
    def evaluated(self):
        """Inside, the model holds the weights the method evaluates: Flow-GRPO's and
        DiffusionNFT's EMA (DiffusionNFT through its own eval_weights), MixGRPO's and V-GRPO's
        trained weights; the trained weights are back on exit."""
        if self.kind == "flow":
            self.ema.swap()
            try:
                yield
            finally:
                self.ema.swap()
        elif self.kind in ("nft", "mix"):
            with self.M.eval_weights(self.run, self.state):
                yield
        else:
            yield

    def swap_ema(self) -> None:
        """Exchange the trained LoRA weights and the EMA in place (call again to swap back)."""
        self.ema.swap()


# ------------------------------------------------------------------------------------------------
# The benchmark: a plan written before any training run, jobs run by one or more worker
# processes (each takes the next unclaimed job whose inputs exist; resumable), one JSON per run.
# ------------------------------------------------------------------------------------------------
# `benchmark --quick` timed once, end to end (build cached), on the 2-core machine of this report
QUICK_TIMED = ("464 s (7.7 min) end to end with the training code of commit e0d737d (build "
               "cached, 2 workers × 1 thread) on an otherwise idle 2-core machine (AMD EPYC; one "
               "regeneration of another report ran meanwhile), against the plan's estimate of "
               "10 min wall-clock")
THRESHOLD_RULE = ("half of the base model's remaining held-out error removed: "
                  "accuracy ≥ base + (1 − base)/2")
CLAIM_BUDGET_RULE = (
    "B = the sweep's iterations, for every method: each baseline trains B iterations at its own "
    "lr (chosen on validation for that budget); the threshold is its final mean held-out "
    "reward; V-GRPO (at its chosen lr, same B) is timed to the first crossing of that reward by "
    "its seed-mean held-out curve, linearly interpolated between its evaluations")
# The sweep's methods: the CFG-4.5 Flow-GRPO recipe costs 4× the no-CFG recipe per iteration
# (CFG doubles every forward and its rollout runs 10 SDE steps); in the 16-iteration benchmark it
# was never the better Flow-GRPO recipe on validation and its EMA stayed at the base model's
# reward at every lr, so the full and quick plans leave it out to fit their time (it runs with
# `--plan` variants that list it, and the report handles it).
PLAN_METHODS = ["V-GRPO", "Flow-GRPO (no CFG)", "DiffusionNFT", "MixGRPO"]
PLANS = {
    # seeds, lrs, sweep iterations (the claims' budget B) and held-out evaluation interval
    # (V-GRPO's curve is what the claims interpolate: every 4; the baselines' final evaluation is
    # what they use: every 8), the long runs, the timing rounds; held-out 40 per digit (400
    # images), validation 20 per digit (200). The full grid spans 30× around the published 3e-4:
    # 1e-2, in the 16-iteration benchmark, diverged for every method (held-out reward 0.1–0.26
    # against the base model's 0.75); 1e-4 is there for the methods that take several optimizer
    # steps per iteration (MixGRPO: 4)
    "full": dict(seeds=[0, 1, 2], lrs=[1e-4, 3e-4, 1e-3, 3e-3], iterations=32, eval_every=4,
                 baseline_eval_every=8, methods=PLAN_METHODS,
                 ablation_evals=[], long_iterations=100, long_eval_every=20,
                 timing_rounds=8, n_heldout=40, n_val=20,
                 ablations=["naive FPO-style", "no adaptive weighting", "no stratification",
                            "pair sharing: none", "v-parameterisation"]),
    "quick": dict(seeds=[0], lrs=[3e-4, 1e-3, 3e-3], iterations=8, eval_every=4,
                  baseline_eval_every=8, methods=PLAN_METHODS,
                  ablation_evals=[], long_iterations=24, long_eval_every=8,
                  timing_rounds=2, n_heldout=40, n_val=20, ablations=[]),
    # the machinery end to end in a minute or two (development only)
    "smoke": dict(seeds=[0, 1], lrs=[1e-3, 3e-3], iterations=2, eval_every=1,
                  baseline_eval_every=2, methods=PLAN_METHODS,
                  ablation_evals=[1], long_iterations=3, long_eval_every=3,
                  timing_rounds=1, n_heldout=4, n_val=2, ablations=["naive FPO-style"]),
}
# Measured before sizing the plans (one process, 1 thread, on the 2-core machine while another
# job used about one core): seconds per training iteration, per 400-image held-out evaluation
# (the 200-image validation set: half), per run's setup. CFG doubles an evaluation's cost.
MEASURED = dict(sec_per_iter={"V-GRPO": 2.4, "V-GRPO + KL (β = 0.3, μ = 2)": 3.1,
                              "Flow-GRPO (CFG 4.5)": 8.0, "Flow-GRPO (no CFG)": 2.0,
                              "DiffusionNFT": 4.8, "MixGRPO": 1.6},
                sec_per_eval_400=13.0, sec_setup=5.0, sec_base_eval=50.0)


def recipes_of(plan: dict) -> dict:
    """The recipes the new baselines run with, as recorded in the plan: DiffusionNFT's published
    sd3_pickscore (its K = 10 dpm2 rollout steps are the benchmark's 10) and MixGRPO's schedule
    scaled to the 10-step grid and to the sweep's budget (the long runs: their own)."""
    K = int(COMMON[COMMON.index("--num_steps") + 1])
    out = {}
    if "DiffusionNFT" in plan["methods"]:
        NFT = _example("diffusion_nft_sd3")
        rec = {k: v for k, v in NFT.RECIPE.items() if k not in NFT.RUN_LEVEL}
        if rec["num_steps"] != K:
            raise ValueError(f"DiffusionNFT's recipe has K = {rec['num_steps']}, not {K}")
        out["DiffusionNFT"] = dict(rec, note="config/nft.py sd3_pickscore; run-level settings "
                                   "(lr, P, G, LoRA) are the benchmark's")
    if "MixGRPO" in plan["methods"]:
        MIX = _example("mix_grpo_sd3")
        out["MixGRPO"] = MIX.scaled_recipe(K, plan["iterations"])
    return out


def methods_of(plan: dict) -> list[str]:
    """The sweep's methods of a plan (plans written before `methods` existed: their sweep's)."""
    return [m for m in (plan.get("methods") or list(plan.get("sweep", SWEEP))) if m in SWEEP]


def eval_every_of(plan: dict, method: str) -> int:
    return plan["eval_every"] if method.startswith("V-GRPO") or method in ABLATIONS \
        else plan.get("baseline_eval_every", plan["eval_every"])


def estimate(plan: dict, workers: int = 2) -> dict:
    """Seconds the plan takes, from MEASURED: every run's iterations and evaluations (the EMA
    methods evaluate their trained weights too, CFG-4.5 its CFG sampler), the timing job, the base
    evaluation; wall-clock = worker-seconds / workers (the job order keeps both busy)."""
    M = MEASURED
    e400 = M["sec_per_eval_400"] * plan["n_heldout"] / 40       # the held-out set
    ev_val = M["sec_per_eval_400"] * plan["n_val"] / 40           # the validation set
    ema = {"Flow-GRPO (CFG 4.5)", "Flow-GRPO (no CFG)", "DiffusionNFT"}
    total, per = 0.0, {}

    def run_cost(m, iters, every, kind):
        n_ev = len(set(range(every, iters + 1, every)) | {iters}) if kind != "ablation" else \
            len(set(plan["ablation_evals"]) - {0} | {iters})
        c = M["sec_setup"] + iters * M["sec_per_iter"][m] + n_ev * e400 + ev_val
        if m in ema:
            c += e400 + ev_val
        if m == "Flow-GRPO (CFG 4.5)":
            c += 2 * e400
        return c
    for j in jobs_of(plan):
        m = j["method"]
        if j["kind"] == "sweep":
            c = run_cost(m, plan["iterations"], eval_every_of(plan, m), "sweep")
        elif j["kind"] == "ablation":
            c = run_cost("V-GRPO", plan["iterations"], plan["iterations"], "ablation")
        elif j["kind"] == "long":
            mm = "Flow-GRPO (no CFG)" if m == "Flow-GRPO" else m
            c = run_cost(mm, plan["long_iterations"], plan["long_eval_every"], "long")
        else:
            c = plan["timing_rounds"] * sum(M["sec_per_iter"][x] for x in methods_of(plan)) \
                + M["sec_setup"] * len(methods_of(plan))
        per[j["kind"]] = per.get(j["kind"], 0.0) + c
        total += c
    total += M["sec_base_eval"]
    return {"worker_seconds": round(total), "wall_seconds": round(total / max(workers, 1)),
            "by_kind": {k: round(v) for k, v in per.items()}, "from": M}


def slug(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower()).strip("_")


def jobs_of(plan: dict) -> list[dict]:
    """Every run of the plan, in the order workers take them. lr None: the method's chosen lr
    (known once its sweep is done); method "Flow-GRPO" of the long runs: the better recipe. The
    long Flow-GRPO run is chosen from the first two seeds' sweep runs (it is among the longest
    jobs and must start early); the remaining seeds' Flow-GRPO sweep runs come after it. The
    timing job comes after every sweep run (it times each method at its chosen lr)."""
    jobs = []
    sweep = lambda m, seeds: [dict(kind="sweep", method=m, lr=lr, seed=s)
                              for s in seeds for lr in plan["lrs"]]
    first, rest = plan["seeds"][:2], plan["seeds"][2:]
    methods = methods_of(plan)
    flows = [m for m in methods if m in FLOWS]
    others = [m for m in methods if m != "V-GRPO" and m not in FLOWS]
    if "V-GRPO" in methods:
        jobs += sweep("V-GRPO", plan["seeds"])
        jobs += [dict(kind="long", method=m, lr=None, seed=0) for m in LONG if m != "Flow-GRPO"]
    for s in first:
        for m in flows:
            jobs += sweep(m, [s])
    if flows:
        jobs.append(dict(kind="long", method="Flow-GRPO", lr=None, seed=0))
    for m in others:
        jobs += sweep(m, plan["seeds"])
    for m in flows:
        jobs += sweep(m, rest)
    jobs.append(dict(kind="timing", method="all", lr=None, seed=0))
    jobs += [dict(kind="ablation", method=m, lr=None, seed=s)
             for s in plan["seeds"] for m in plan["ablations"]]
    for j in jobs:
        lr = f"__lr{j['lr']:g}" if j["lr"] is not None else ""
        j["id"] = f"{j['kind']}__{slug(j['method'])}{lr}__s{j['seed']}"
    return jobs


def _needs(job: dict, jobs: list[dict]) -> list[str]:
    """Ids of the jobs whose results this one needs (its lr is chosen from them)."""
    sweep = lambda f: [j["id"] for j in jobs if j["kind"] == "sweep" and f(j)]
    if job["kind"] == "sweep":
        return []
    if job["kind"] == "ablation" or (job["kind"] == "long" and job["method"] != "Flow-GRPO"):
        return sweep(lambda j: j["method"] == "V-GRPO")
    if job["kind"] == "long":
        return sweep(lambda j: j["method"] in FLOWS and j["seed"] in jobs_seeds(jobs)[:2])
    return sweep(lambda j: True)                           # timing: every sweep run


def jobs_seeds(jobs: list[dict]) -> list[int]:
    return sorted({j["seed"] for j in jobs if j["kind"] == "sweep"})


def load_results(out: Path) -> dict:
    """{job id: result dict} of every finished run in `out`."""
    res = {}
    for p in sorted(out.glob("*.json")):
        if p.name not in ("plan.json", "base.json", "summary.json"):
            res[p.stem] = json.loads(p.read_text())
    return res


def _claim(path: Path) -> bool:
    """Take a job for this process (several worker processes share one results folder). A claim
    whose process is gone is taken over, so an interrupted benchmark resumes."""
    claim = path.with_suffix(".claim")
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(claim.read_text() or 0), 0)
            return False                                   # another live process runs it
        except (ProcessLookupError, ValueError):
            claim.write_text(str(os.getpid()))
            return True
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _pack(m: dict, full: bool) -> dict:
    """An evaluation for the JSON: means, the image count and the per-image reward and
    correctness (for the bootstrap); the per-image div and nn too if `full` (final evaluations)."""
    out = {"n": int(len(m["reward"])), "acc": float(m["correct"].mean()),
           "reward": float(m["reward"].mean()), "diversity": float(m["div"].mean()),
           "nn_real": float(m["nn"].mean()),
           "img_reward": [round(float(x), 4) for x in m["reward"]],
           "img_correct": "".join("1" if c else "0" for c in m["correct"])}
    if full:
        out["img_div"] = [round(float(x), 4) for x in m["div"]]
        out["img_nn"] = [round(float(x), 4) for x in m["nn"]]
    return out


def evaluate(adapter, data, full: bool = True) -> tuple[dict, torch.Tensor]:
    prompts, digits, x1 = data
    imgs = generate(adapter, prompts, x1)
    return _pack(image_metrics(imgs, digits), full), imgs


def eval_sets(plan: dict) -> dict:
    return {"heldout": eval_set(plan["n_heldout"], HELDOUT_SEED, EVAL_TEMPLATES),
            "val": eval_set(plan["n_val"], VAL_SEED, VAL_TEMPLATES)}


def evaluate_base(folder: Path, plan: dict, log=print) -> dict:
    """The base model (LoRA B = 0, so iteration 0 of every run) on both sets, CFG-free and with
    the CFG-4.5 sampler of Flow-GRPO's recipe; also the held-out grids' images."""
    sets = eval_sets(plan)
    tr = Trainer(folder, SWEEP["Flow-GRPO (CFG 4.5)"], 0, 1e-3)
    base = {}
    for name, data in sets.items():
        base[name], imgs = evaluate(tr.adapter, data)
        base[name + "_cfg"], imgs_cfg = evaluate(tr.cfg, data)
        if name == "heldout":
            save_grid(imgs, data[1], plan["grids"] / "base.png")
            save_grid(imgs_cfg, data[1], plan["grids"] / "base__cfg.png")
    log(f"base model: held-out acc {base['heldout']['acc']:.3f} reward "
        f"{base['heldout']['reward']:.3f} diversity {base['heldout']['diversity']:.3f}; "
        f"with CFG 4.5 acc {base['heldout_cfg']['acc']:.3f} diversity "
        f"{base['heldout_cfg']['diversity']:.3f}; validation reward {base['val']['reward']:.3f} "
        f"diversity {base['val']['diversity']:.3f}")
    return base


def spec_of(job: dict, chosen: dict):
    """(method name as run, its flags or Flow-GRPO recipe, lr) of a job, given the chosen lrs."""
    m = job["method"]
    if job["kind"] == "sweep":
        return m, SWEEP[m], job["lr"]
    if job["kind"] == "ablation":
        return m, ABLATIONS[m], chosen["V-GRPO"]["lr"]
    if m == "Flow-GRPO":
        best = chosen["better_flow"]
        return best, SWEEP[best], chosen[best]["lr"]
    return m, LONG[m], chosen["V-GRPO"]["lr"]


def run_job(job: dict, folder: Path, plan: dict, base: dict, chosen: dict, log=print) -> dict:
    """One training run with held-out evaluations (the EMA's too for Flow-GRPO, and at the end
    the trained weights', the validation set's and the CFG sampler's)."""
    method, spec, lr = spec_of(job, chosen)
    iters = {"sweep": plan["iterations"], "ablation": plan["iterations"],
             "long": plan["long_iterations"]}[job["kind"]]
    if job["kind"] == "ablation":
        at = set(plan["ablation_evals"]) | {0, iters}
    else:
        every = (plan["long_eval_every"] if job["kind"] == "long"
                 else eval_every_of(plan, method))
        at = set(range(0, iters + 1, every)) | {iters}
    sets = eval_sets(plan)
    t0 = time.perf_counter()
    tr = Trainer(folder, spec, job["seed"], lr, budget=iters)
    key = "ema" if tr.ema is not None else "raw"    # what Flow-GRPO / DiffusionNFT evaluate: EMA
    evals, log_iters, final = [], [], {}
    for it in range(iters + 1):
        if it in at:
            ev = {"iter": it}
            if it == 0:                                     # LoRA B = 0: the base model
                ev[key] = {k: v for k, v in base["heldout"].items()
                           if k not in ("img_div", "img_nn")}
            else:
                with tr.evaluated():                        # the weights the method evaluates
                    ev[key], imgs = evaluate(tr.adapter, sets["heldout"], full=it == iters)
                    if it == iters:
                        save_grid(imgs, sets["heldout"][1],
                                  plan["grids"] / f"{job['id']}__{key}.png")
                        final["val_" + key], _ = evaluate(tr.adapter, sets["val"])
                        if tr.cfg is not None:
                            final["heldout_cfg_" + key], imgs_c = evaluate(tr.cfg,
                                                                           sets["heldout"])
                            save_grid(imgs_c, sets["heldout"][1],
                                      plan["grids"] / f"{job['id']}__cfg_{key}.png")
                if tr.ema is not None and it == iters:      # and the trained weights themselves
                    final["heldout_raw"], _ = evaluate(tr.adapter, sets["heldout"])
                    final["val_raw"], _ = evaluate(tr.adapter, sets["val"])
            evals.append(ev)
            e = ev[key]
            log(f"{job['id']:44s} iter {it:3d}  held-out acc {e['acc']:.3f}  reward "
                f"{e['reward']:.3f}  diversity {e['diversity']:.3f}  nn-real {e['nn_real']:.3f}")
        if it == iters:
            break
        log_iters.append(tr.step(it))
    return dict(job, method=method, lr=lr, iterations=iters, evals=evals, final=final,
                iters=log_iters, ema=tr.ema is not None, eval_key=key, nfe_n=tr.N,
                n_heldout=len(sets["heldout"][0]), n_val=len(sets["val"][0]),
                flags=spec, recipe=tr.recipe, seconds=time.perf_counter() - t0,
                threads=torch.get_num_threads(), finished=time.strftime("%Y-%m-%d %H:%M:%S"))


def timing_job(folder: Path, chosen: dict, rounds: int, log=print, budget: int = 16,
               methods: list | None = None) -> dict:
    """Wall-clock as a ratio within one process: every method of the sweep at its chosen lr, one
    iteration of each in turn, `rounds` times (all see the same machine load). `budget`: the
    sweep's iterations (MixGRPO's window schedule is scaled to it)."""
    methods = [m for m in (methods or SWEEP) if m in chosen]
    trainers = {m: Trainer(folder, SWEEP[m], 0, chosen[m]["lr"], budget=budget)
                for m in methods}
    secs = {m: [] for m in methods}
    for r in range(rounds):
        for m, tr in trainers.items():
            t0 = time.perf_counter()
            tr.step(r)
            secs[m].append(time.perf_counter() - t0)
        log(f"timing round {r}: " + ", ".join(f"{m} {s[-1]:.2f} s" for m, s in secs.items()))
    return dict(kind="timing", method="all", seed=0, rounds=rounds, seconds_per_iter=secs,
                lrs={m: chosen[m]["lr"] for m in methods}, threads=torch.get_num_threads(),
                finished=time.strftime("%Y-%m-%d %H:%M:%S"))


def worker(out: Path, log=print) -> None:
    """Run jobs until none is left: each time the first unclaimed job whose inputs are done."""
    plan = json.loads((out / "plan.json").read_text())
    plan["grids"] = out / "grids"
    base = json.loads((out / "base.json").read_text())
    folder = CACHE / "pipeline"
    jobs = jobs_of(plan)
    while True:
        done = {p.stem for p in out.glob("*.json")} | {p.stem for p in out.glob("*.failed")}
        todo = [j for j in jobs if j["id"] not in done]
        if not todo:
            return
        ready = [j for j in todo if all(n in done for n in _needs(j, jobs))]
        job = next((j for j in ready if _claim(out / f"{j['id']}.json")), None)
        if job is None:
            time.sleep(5)                                   # waiting for another worker's run
            continue
        path = out / f"{job['id']}.json"
        try:
            res_in = load_results(out)
            if job["kind"] == "long" and job["method"] == "Flow-GRPO":
                res_in = {k: r for k, r in res_in.items() if r.get("kind") != "sweep"
                          or r["method"] not in FLOWS or r["seed"] in plan["seeds"][:2]}
            chosen = choose(res_in, plan, base) if _needs(job, jobs) else {}
            if job["kind"] == "timing":
                res = timing_job(folder, chosen, plan["timing_rounds"], log,
                                 budget=plan["iterations"], methods=methods_of(plan))
            else:
                res = run_job(job, folder, plan, base, chosen, log)
        except Exception as e:                              # recorded; the others go on
            import traceback
            traceback.print_exc()
            path.with_suffix(".failed").write_text(f"{type(e).__name__}: {e}\n")
        else:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(res))
            tmp.rename(path)
            log(f"-> {path.name} ({res.get('seconds', 0):.0f} s)")
        path.with_suffix(".claim").unlink(missing_ok=True)


def benchmark(out: Path, mode: str = "full", workers: int = 2, threads: int = 1,
              log=print) -> None:
    """Build (or reuse) the model, write the plan and the base model's evaluation (before any
    training run: the threshold is fixed here), run every job with `workers` processes of
    `threads` threads each, then the report."""
    folder = build(log=log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grids").mkdir(exist_ok=True)
    plan_path = out / "plan.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        if plan["mode"] != mode:
            raise ValueError(f"{out} holds a {plan['mode']!r} benchmark; pass another --out")
    else:
        plan = dict(PLANS[mode], mode=mode, common_flags=COMMON,
                    sweep={m: SWEEP[m] for m in PLANS[mode]["methods"]},
                    published_lr={m: PUBLISHED_LR[m] for m in PLANS[mode]["methods"]},
                    published_lr_notes=PUBLISHED_LR_NOTE, claims=CLAIMS,
                    claim_budget=PLANS[mode]["iterations"], claim_budget_rule=CLAIM_BUDGET_RULE,
                    recipes=recipes_of(PLANS[mode]), estimate=estimate(PLANS[mode], workers),
                    ablation_flags={m: ABLATIONS[m] for m in PLANS[mode]["ablations"]},
                    long=LONG, diversity_keep=DIVERSITY_KEEP, threshold_rule=THRESHOLD_RULE,
                    heldout_templates=EVAL_TEMPLATES, val_templates=VAL_TEMPLATES,
                    heldout_seed=HELDOUT_SEED, val_seed=VAL_SEED, workers=workers,
                    threads=threads, started=time.strftime("%Y-%m-%d %H:%M:%S"),
                    commit=_commit())
    if not (out / "base.json").is_file():
        torch.set_num_threads(max(threads, 1) * max(workers, 1))
        base = evaluate_base(folder, dict(plan, grids=out / "grids"), log)
        plan["base_acc"] = base["heldout"]["acc"]
        plan["threshold"] = base["heldout"]["acc"] + (1 - base["heldout"]["acc"]) / 2
        (out / "base.json").write_text(json.dumps(base))
    now = lambda: time.strftime("%Y-%m-%d %H:%M:%S")
    plan.setdefault("sessions", []).append(dict(started=now(), commit=_commit()))
    plan_path.write_text(json.dumps(plan, indent=1))
    log(f"threshold (fixed before the runs): {THRESHOLD_RULE} = {plan['threshold']:.4f}")
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VGRPO_DIGITS_CACHE=str(CACHE))
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker", "--out",
                               str(out), "--threads", str(threads)], env=env)
             for _ in range(workers - 1)]
    torch.set_num_threads(threads)
    worker(out, log)
    for p in procs:
        p.wait()
    plan = json.loads(plan_path.read_text())             # re-read: amended by hand meanwhile?
    plan["sessions"][-1]["ended"] = now()
    plan_path.write_text(json.dumps(plan, indent=1))
    report(out, log=log)


def _commit() -> str:
    import subprocess
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return "?"


# ------------------------------------------------------------------------------------------------
# Statistics: each method's lr chosen on the validation set; 95 % intervals by a bootstrap over
# seeds and images (seeds drawn with replacement, then the held-out images within each drawn seed;
# the same draws for every method, so differences are paired; percentile intervals).
# ------------------------------------------------------------------------------------------------
N_BOOT = 1000


def final_eval(r: dict, split: str = "heldout", variant: str | None = None):
    """A run's last evaluation on `split` ("heldout" / "val" / "heldout_cfg") of `variant`
    ("raw" trained weights, "ema" Flow-GRPO's EMA; default the run's own eval_key) or None."""
    v = variant or r["eval_key"]
    if split == "heldout" and v == r["eval_key"]:
        return r["evals"][-1].get(v)
    return r["final"].get(f"{split}_{v}")


def runs_of(results: dict, kind: str, method: str, lr=None) -> list[dict]:
    rs = [r for r in results.values() if r.get("kind") == kind and r["method"] == method
          and (lr is None or abs(r["lr"] - lr) < 1e-12)]
    return sorted(rs, key=lambda r: r["seed"])


def choose(results: dict, plan: dict, base: dict) -> dict:
    """Each sweep method's lr: the best mean final validation reward among the lrs whose mean
    validation diversity is ≥ DIVERSITY_KEEP × the base model's (if none is, the most diverse lr,
    flagged). Flow-GRPO is judged by its EMA (what it evaluates); "lr_raw": the choice by its
    trained weights. "better_flow": the recipe with the higher validation reward at its lr."""
    keep = plan["diversity_keep"] * base["val"]["diversity"]
    chosen = {}
    for m in SWEEP:
        rows = []
        for lr in plan["lrs"]:
            rs = runs_of(results, "sweep", m, lr)
            if not rs:
                continue
            row = {"lr": lr, "seeds": len(rs)}
            for v in ("raw", "ema"):
                vals = [final_eval(r, "val", v) for r in rs]
                if all(x is not None for x in vals):
                    row[f"val_reward_{v}"] = sum(x["reward"] for x in vals) / len(vals)
                    row[f"val_diversity_{v}"] = sum(x["diversity"] for x in vals) / len(vals)
                    row[f"eligible_{v}"] = row[f"val_diversity_{v}"] >= keep
            rows.append(row)
        if not rows:
            continue
        entry = {"rows": rows, "diversity_floor": keep}
        for v in ("raw", "ema"):
            cand = [r for r in rows if f"val_reward_{v}" in r]
            if not cand:
                continue
            ok = [r for r in cand if r[f"eligible_{v}"]]
            pick = (max(ok, key=lambda r: r[f"val_reward_{v}"]) if ok
                    else max(cand, key=lambda r: r[f"val_diversity_{v}"]))
            entry["lr_" + v], entry["fallback_" + v] = pick["lr"], not ok
        entry["variant"] = "ema" if "lr_ema" in entry else "raw"
        entry["lr"] = entry["lr_" + entry["variant"]]
        chosen[m] = entry
    flows = [m for m in FLOWS if m in chosen]
    if flows:
        def val_at(m):
            e = chosen[m]
            return next(r[f"val_reward_{e['variant']}"] for r in e["rows"] if r["lr"] == e["lr"])
        chosen["better_flow"] = max(flows, key=val_at)
    return chosen


def _np():
    import numpy as np
    return np


_IDX = {}


def boot_index(S: int, n: int):
    """(seed draws (B, S), image draws (B, S, n)); fixed per (S, n) so that all statistics of a
    report share them (paired)."""
    np = _np()
    if (S, n) not in _IDX:
        rng = np.random.default_rng(0)
        _IDX[(S, n)] = (rng.integers(0, S, (N_BOOT, S)), rng.integers(0, n, (N_BOOT, S, n)))
    return _IDX[(S, n)]


def boot_mean(X):
    """X (S, n) per seed and image → (point estimate, (B,) bootstrap replicates)."""
    np = _np()
    X = np.asarray(X, dtype=np.float64)
    si, ii = boot_index(*X.shape)
    return float(X.mean()), X[si[:, :, None], ii].mean(axis=(1, 2))


def interval(reps) -> tuple[float, float]:
    np = _np()
    reps = np.sort(np.asarray(reps, dtype=np.float64))
    lo, hi = reps[int(0.025 * (len(reps) - 1))], reps[int(round(0.975 * (len(reps) - 1)))]
    return float(lo), float(hi)


def _arrays(evs: list[dict], key: str):
    np = _np()
    if key == "correct":
        return np.array([[c == "1" for c in e["img_correct"]] for e in evs], dtype=np.float64)
    return np.array([e[{"reward": "img_reward", "div": "img_div", "nn": "img_nn"}[key]]
                     for e in evs], dtype=np.float64)


def final_stats(rs: list[dict], split: str = "heldout", variant: str | None = None) -> dict:
    """{acc, reward, diversity, nn_real: (point, lo, hi)} of the runs' final evaluations, plus the
    bootstrap replicates under "_reps" and the image count "n"."""
    evs = [final_eval(r, split, variant) for r in rs]
    if not evs or any(e is None for e in evs):
        return {}
    out, reps = {"n": evs[0]["n"], "seeds": len(evs)}, {}
    for name, key in (("acc", "correct"), ("reward", "reward"), ("diversity", "div"),
                      ("nn_real", "nn")):
        if key in ("div", "nn") and "img_div" not in evs[0]:
            continue
        p, b = boot_mean(_arrays(evs, key))
        out[name], reps[name] = (p, *interval(b)), b
    out["_reps"] = reps
    return out


def crossing(curve, its, thr):
    """The first iteration at which `curve` (..., E), evaluated at iterations `its` (E,), reaches
    `thr` (scalar or (...,)), linearly interpolated between the evaluation before and the first
    one at or above it; its[0] if the first evaluation already does; inf if none does."""
    np = _np()
    curve = np.asarray(curve, dtype=np.float64)
    thr = np.broadcast_to(np.asarray(thr, dtype=np.float64), curve.shape[:-1])
    ok = curve >= thr[..., None]
    e = ok.argmax(-1)
    a1 = np.take_along_axis(curve, e[..., None], -1)[..., 0]
    a0 = np.take_along_axis(curve, np.maximum(e - 1, 0)[..., None], -1)[..., 0]
    frac = np.where(e > 0, (thr - a0) / np.maximum(a1 - a0, 1e-12), 0.0)
    h = its[np.maximum(e - 1, 0)] + frac * (its[e] - its[np.maximum(e - 1, 0)])
    return np.where(ok.any(-1), h, np.inf)


def hit_times(rs: list[dict], thr: float):
    """Iterations to reach held-out accuracy ≥ thr (linear interpolation between evaluations; inf
    if never). Returns (per-seed point estimates (S,), replicates (B, S))."""
    np = _np()
    key = rs[0]["eval_key"]
    its = np.array([e["iter"] for e in rs[0]["evals"]], dtype=np.float64)
    X = np.stack([_arrays([e[key] for e in r["evals"]], "correct") for r in rs])   # (S, E, n)
    S, E, n = X.shape
    si, ii = boot_index(S, n)
    acc_b = X[si[:, :, None, None], np.arange(E)[None, None, :, None],
              ii[:, :, None, :]].mean(-1)                                        # (B, S, E)
    return crossing(X.mean(-1), its, thr), crossing(acc_b, its, thr)


def curves(rs: list[dict], key: str = "reward"):
    """(evaluation iterations (E,), per-image values (S, E, n)) of runs with the same schedule."""
    np = _np()
    k = rs[0]["eval_key"]
    its = np.array([e["iter"] for e in rs[0]["evals"]], dtype=np.float64)
    return its, np.stack([_arrays([e[k] for e in r["evals"]], key) for r in rs])


def opt_steps_per_iter(r: dict) -> float:
    """Mean optimizer (gradient) steps per training iteration, as logged (runs logged before the
    count was: V-GRPO's μ from its flags, 1 by default)."""
    its = r["iters"]
    if its and all("opt_steps" in x for x in its):
        return sum(x["opt_steps"] for x in its) / len(its)
    fl = r.get("flags") or []
    return float(fl[fl.index("--mu") + 1]) if isinstance(fl, list) and "--mu" in fl else 1.0


UNITS = {"iters": "iterations", "steps": "gradient steps", "nfe": "NFE", "seconds": "seconds"}


def claim(v_rs: list[dict], b_rs: list[dict], timing: dict | None, method: str) -> dict:
    """V-GRPO's speed-up to a baseline's final held-out reward, as the paper states its claims:
    the baseline ran B iterations; the threshold is its final mean held-out reward; h = the
    iterations V-GRPO's seed-mean held-out reward curve needs to reach it (crossing). Ratios
    B·u_b / (h·u_v) per unit u: iterations (u = 1), gradient steps (optimizer steps per
    iteration), NFE (training forwards per iteration), seconds (seconds per iteration in the
    timing job). Paired bootstrap: the same seed and image draws for both methods (boot_index),
    the threshold recomputed in each draw; the timing rounds resampled jointly. If V-GRPO never
    reaches the threshold within its Bv iterations the ratio is below the bound B·u_b/(Bv·u_v):
    "reached" False, the point is that bound; in the interval a draw that never reaches counts as
    0 for the lower end and as the bound for the upper end (both conservative). Only seeds both
    methods finished are used."""
    np = _np()
    seeds = sorted({r["seed"] for r in v_rs} & {r["seed"] for r in b_rs})
    v_rs = [r for r in v_rs if r["seed"] in seeds]
    b_rs = [r for r in b_rs if r["seed"] in seeds]
    its, Xv = curves(v_rs)
    _, Xb = curves(b_rs)
    S, E, n = Xv.shape
    si, ii = boot_index(S, n)
    draw = lambda X: X[si[:, :, None], ii].mean(axis=(1, 2))                    # (S, n) → (B,)
    B, Bv = b_rs[0]["iterations"], v_rs[0]["iterations"]
    thr, thr_b = float(Xb[:, -1].mean()), draw(Xb[:, -1])
    gain, gain_b = thr - float(Xb[:, 0].mean()), thr_b - draw(Xb[:, 0])     # vs its iteration 0
    vfin, vfin_b = float(Xv[:, -1].mean()), draw(Xv[:, -1])
    v_b = Xv[si[:, :, None, None], np.arange(E)[None, None, :, None],
             ii[:, :, None, :]].mean(axis=(1, 3))                                 # (B, E)
    h, h_b = float(crossing(Xv.mean(axis=(0, 2)), its, thr)), crossing(v_b, its, thr_b)
    h, h_b = (0.0 if h < 1e-9 else h), np.where(h_b < 1e-9, 0.0, h_b)   # at the base model
    rate = {"iters": (1.0, 1.0),
            "steps": (_mean([opt_steps_per_iter(r) for r in b_rs]),
                      _mean([opt_steps_per_iter(r) for r in v_rs])),
            "nfe": (_mean([nfe_per_iter(r) for r in b_rs]), _mean([nfe_per_iter(r) for r in v_rs]))}
    sec = (timing or {}).get("seconds_per_iter", {})
    sec_b = None
    if method in sec and "V-GRPO" in sec:
        sb, sv = np.array(sec[method], dtype=np.float64), np.array(sec["V-GRPO"], dtype=np.float64)
        k = np.random.default_rng(1).integers(0, len(sb), (N_BOOT, len(sb)))
        rate["seconds"] = (float(sb.mean()), float(sv.mean()))
        sec_b = (sb[k].mean(1), sv[k].mean(1))
    out = {"method": method, "B": B, "Bv": Bv, "seeds": S, "n": n, "reached": bool(np.isfinite(h)),
           "reached_draws": float(np.isfinite(h_b).mean()), "threshold": thr,
           "baseline_final": (thr, *interval(thr_b)), "gain_over_base": (gain, *interval(gain_b)),
           "vgrpo_final": (vfin, *interval(vfin_b)),
           "vgrpo_iters": (h, *interval(np.where(np.isfinite(h_b), h_b, np.inf))),
           "per_iter": {u: {"baseline": r[0], "vgrpo": r[1]} for u, r in rate.items()},
           "ratio": {}, "bound": {}}
    for u, (rb, rv) in rate.items():
        if u == "seconds":
            num_b, den_b = B * sec_b[0], sec_b[1]
        else:
            num_b, den_b = np.full(N_BOOT, B * rb), np.full(N_BOOT, rv)
        bound = B * rb / (Bv * rv)
        with np.errstate(divide="ignore", invalid="ignore"):
            pt = (bound if not np.isfinite(h) else math.inf if h == 0
                  else (B * rb) / (h * rv))
            r_b = num_b / (h_b * den_b)
            bound_b = num_b / (Bv * den_b)
        lo_src = np.where(np.isfinite(h_b), r_b, 0.0)          # never reached: below the bound
        hi_src = np.where(np.isfinite(h_b), r_b, bound_b)
        out["ratio"][u] = (float(pt), interval(lo_src)[0], interval(hi_src)[1])
        out["bound"][u] = float(bound)
    return out


def claim_verdict(c: dict, factor: float, unit: str) -> tuple[str, str]:
    """(verdict, reason) of a claimed speed-up `factor` in `unit`: not resolved if the baseline's
    final reward is not measurably above the base model's (the threshold is then where every
    method starts); agrees if the ratio's interval lies above 1 and reaches the factor; disagrees
    if it lies wholly below the factor; else not resolved."""
    g = c["gain_over_base"]
    p, lo, hi = c["ratio"][unit]
    if not g[1] > 0:
        return ("not resolved", f"{c['method']}'s final held-out reward is not measurably above "
                                f"the base model's in {c['B']} iterations (gain {_ci(g, '{:+.3f}')})")
    if lo > 1 and hi >= factor:
        return "agrees", f"the interval lies above 1 and reaches {factor:.2g}×"
    if hi < factor:
        return ("disagrees", (f"not reached within V-GRPO's {c['Bv']} iterations, the speed-up "
                              f"is below the bound {c['bound'][unit]:.2f}×, short of "
                              f"{factor:.2g}×" if not c["reached"]
                              else f"the whole interval lies below {factor:.2g}×"))
    return "not resolved", f"the interval spans 1 and {factor:.2g}×"


def _old_extra(m: dict, mu: int) -> float:
    """V-GRPO's θ_old no-grad forwards per sample beyond the rollout, as vgrpo counts them now:
    N_MC·(μ − 1)/μ (the first minibatch takes S_old from its own pass at θ = θ_old; none at
    μ = 1). Runs logged before that change (nfe_old an int: N_MC, or rollout + N_MC) are
    recounted the same way, from N_MC = nfe_theta and the run's μ; a skipped update is logged
    with the N_MC forwards it did run."""
    if isinstance(m["nfe_old"], float):                    # logged as it runs
        return m["nfe_old"]
    return m["nfe_theta"] * (mu - 1) / mu


def _mu(r: dict) -> int:
    """The μ a V-GRPO run trained with (its flags; vgrpo's default 1)."""
    f = r.get("flags") or []
    return int(f[f.index("--mu") + 1]) if isinstance(f, list) and "--mu" in f else 1


def nfe_per_iter(r: dict) -> float:
    """Mean training forwards per iteration; V-GRPO's recomputed from the logged counts, so runs
    logged before and after θ_old's pass was folded into the first step count alike."""
    its = r["iters"]
    if its and "n_trained_samples" not in its[0] and "nfe_rollout" in its[0]:
        N = r["nfe_n"] if "nfe_n" in r else 32
        tot = [N * (x["nfe_rollout"] + _old_extra(x, _mu(r)) + x["nfe_theta"]) for x in its]
    else:
        tot = [x["nfe_total"] for x in its]
    return sum(tot) / max(len(tot), 1)


def efficiency(rs: list[dict], thr: float, timing: dict | None, method: str) -> dict:
    """Iterations, network evaluations and wall-clock seconds to the threshold, each with its
    interval (wall-clock: iterations × the method's seconds per iteration in the timing run,
    whose rounds are resampled too)."""
    np = _np()
    pt, reps = hit_times(rs, thr)
    si, _ = boot_index(len(rs), rs[0]["evals"][-1][rs[0]["eval_key"]]["n"])
    nfe = np.array([nfe_per_iter(r) for r in rs])
    out = {"reached": int(np.isfinite(pt).sum()), "seeds": len(rs),
           "iters": (float(pt.mean()), *interval(reps.mean(1))),
           "nfe": (float((pt * nfe).mean()), *interval((reps * nfe[si]).mean(1))),
           "nfe_per_iter": float(nfe.mean()), "_iters_reps": reps.mean(1),
           "_nfe_reps": (reps * nfe[si]).mean(1)}
    if timing and method in timing["seconds_per_iter"]:
        s = np.array(timing["seconds_per_iter"][method])
        rng = np.random.default_rng(1)
        s_b = s[rng.integers(0, len(s), (N_BOOT, len(s)))].mean(1)
        out["sec_per_iter"] = (float(s.mean()), *interval(s_b))
        out["seconds"] = (float(pt.mean() * s.mean()), *interval(reps.mean(1) * s_b))
        out["_sec_reps"] = reps.mean(1) * s_b
    return out


def ratio(a_reps, b_reps, a_pt, b_pt) -> tuple:
    """b / a with its interval from paired replicates (inf where b never reached)."""
    np = _np()
    a, b = np.asarray(a_reps, dtype=np.float64), np.asarray(b_reps, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = b / a                                   # both never reached: nan (undefined)
    r = r[~np.isnan(r)]
    with np.errstate(divide="ignore", invalid="ignore"):
        pt = float(np.float64(b_pt) / np.float64(a_pt)) if a_pt > 0 else float("inf")
    return (pt, *interval(r)) if len(r) else (pt, float("nan"), float("nan"))


def frontier_margin(v_pts, d: float):
    """Height of V-GRPO's reward–diversity frontier at diversity d: the upper envelope of its
    (diversity, reward) points (Pareto points joined linearly; at lower diversity than all of
    them, the best reward). None beyond its most diverse point."""
    pareto = sorted([p for p in v_pts if not any(q[0] >= p[0] and q[1] >= p[1] and q != p
                                                 for q in v_pts)])
    if d > pareto[-1][0]:
        return None
    if d <= pareto[0][0]:
        return max(p[1] for p in pareto)
    for (d0, r0), (d1, r1) in zip(pareto, pareto[1:]):
        if d0 <= d <= d1:
            return r0 + (r1 - r0) * (d - d0) / max(d1 - d0, 1e-12)
    return None


# ------------------------------------------------------------------------------------------------
# Report: the runs' JSON → summary.json, digits.md, the README's digits section, the figures.
# ------------------------------------------------------------------------------------------------
def _ci(t, fmt="{:.3f}") -> str:
    if not t or any(isinstance(x, float) and math.isnan(x) for x in t):
        return "—"
    p, lo, hi = t
    if math.isinf(p) or math.isinf(hi):
        inner = f"[{fmt.format(lo)}, not reached]" if not math.isinf(lo) else "[not reached]"
        return (f"not reached {inner}" if math.isinf(p) else f"{fmt.format(p)} {inner}")
    return f"{fmt.format(p)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _lr(x) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _label(m: str, variant: str) -> str:
    if m == "V-GRPO" or m in ABLATIONS or m.startswith("V-GRPO") or m not in EMA_METHODS:
        return m
    return f"{m}, {'EMA' if variant == 'ema' else 'trained weights'}"


def analyse(out: Path) -> dict:
    """Everything the report shows, from the runs in `out` (machine-readable: summary.json)."""
    plan = json.loads((out / "plan.json").read_text())
    base = json.loads((out / "base.json").read_text())
    results = load_results(out)
    # within a sweep method, only the seeds finished at every lr (so lrs compare like with like)
    dropped = []
    for m in SWEEP:
        rs = [r for r in results.values() if r.get("kind") == "sweep" and r["method"] == m]
        full = {sd for sd in {r["seed"] for r in rs}
                if all(any(r["seed"] == sd and abs(r["lr"] - lr) < 1e-12 for r in rs)
                       for lr in plan["lrs"])}
        dropped += [r["id"] for r in rs if r["seed"] not in full]
    results = {k: r for k, r in results.items() if k not in dropped}
    planned = {j["id"] for j in jobs_of(plan)}
    marks = {p.stem: p.read_text() for p in out.glob("*.failed") if p.stem in planned}
    failed = sorted(k for k, t in marks.items() if not t.startswith("skipped"))
    skipped = sorted(k for k, t in marks.items() if t.startswith("skipped"))
    timing = next((r for r in results.values() if r.get("kind") == "timing"), None)
    chosen = choose(results, plan, base)
    thr = plan["threshold"]
    S = {"plan": {k: v for k, v in plan.items() if k != "grids"}, "threshold": thr,
         "failed": failed, "skipped": skipped, "chosen": chosen, "timing": timing,
         "finished": [r["finished"] for r in results.values()],
         "not_used": sorted(dropped),
         "not_finished": sorted(j["id"] for j in jobs_of(plan)
                                if j["id"] not in results and j["id"] not in marks
                                and j["id"] not in dropped)}
    S["base"] = {k: {m: v[m] for m in ("n", "acc", "reward", "diversity", "nn_real")}
                 for k, v in base.items()}
    bh = base["heldout"]
    S["base_ci"] = {}
    for name, key in (("acc", "correct"), ("reward", "reward"), ("diversity", "div"),
                      ("nn_real", "nn")):
        p, b = boot_mean(_arrays([bh], key))
        S["base_ci"][name] = (p, *interval(b))
        S.setdefault("_base_reps", {})[name] = b
    # the runs themselves: curves, image counts, EMA flag
    S["runs"] = []
    for rid, r in sorted(results.items()):
        if r.get("kind") == "timing":
            continue
        curves = {}
        for v in ("raw", "ema"):
            pts = [(e["iter"], e[v]["acc"], e[v]["reward"], e[v]["diversity"], e[v]["nn_real"])
                   for e in r["evals"] if v in e]
            if pts:
                curves[v] = [dict(zip(("iter", "acc", "reward", "diversity", "nn_real"), p))
                             for p in pts]
        fin = {}
        for split in ("heldout", "val", "heldout_cfg"):
            for v in ("raw", "ema"):
                e = final_eval(r, split, v)
                if e is not None:
                    fin[f"{split}_{v}"] = {k: e[k] for k in ("n", "acc", "reward", "diversity",
                                                             "nn_real")}
        S["runs"].append(dict(id=rid, kind=r["kind"], method=r["method"], lr=r["lr"],
                              seed=r["seed"], iterations=r["iterations"], ema=r["ema"],
                              evaluated=r["eval_key"], n_heldout=r["n_heldout"],
                              n_val=r["n_val"], heldout_curve=curves, final=fin,
                              train_reward=[x["reward_mean"] for x in r["iters"]],
                              nfe_per_iter=nfe_per_iter(r), seconds=r["seconds"],
                              surrogate_cv=_mean([x.get("surrogate_cv") for x in r["iters"]]),
                              final_ci_images={k: v for k, v in final_stats([r]).items()
                                               if k != "_reps"}))
    # the sweep: every (method, lr, weights) with intervals; the frontier
    S["sweep"] = []
    for m in SWEEP:
        for lr in plan["lrs"]:
            rs = runs_of(results, "sweep", m, lr)
            if not rs:
                continue
            for v in (["ema", "raw"] if rs[0]["ema"] else ["raw"]):
                fs = final_stats(rs, "heldout", v)
                vs = final_stats(rs, "val", v)
                row = dict(method=m, lr=lr, variant=v, seeds=len(rs), n=fs.get("n"),
                           heldout={k: fs[k] for k in fs if k not in ("_reps", "n", "seeds")},
                           val={k: vs[k] for k in vs if k not in ("_reps", "n", "seeds")},
                           chosen=m in chosen and chosen[m].get("lr_" + v) == lr,
                           _reps=fs.get("_reps"))
                if rs[0]["final"].get("heldout_cfg_" + v):
                    cs = final_stats(rs, "heldout_cfg", v)
                    row["heldout_cfg"] = {k: cs[k] for k in cs if k not in ("_reps", "n",
                                                                           "seeds")}
                S["sweep"].append(row)
    S["frontier"] = frontier(S["sweep"], S)
    # efficiency at the chosen lrs
    S["efficiency"] = {}
    for m in SWEEP:
        if m not in chosen:
            continue
        rs = runs_of(results, "sweep", m, chosen[m]["lr"])
        if rs and rs[0]["eval_key"] == chosen[m]["variant"]:
            e = efficiency(rs, thr, timing, m)
            e["final"] = {k: v for k, v in final_stats(rs).items() if k not in ("_reps",)}
            e.update(label=_label(m, chosen[m]["variant"]), lr=chosen[m]["lr"])
            S["efficiency"][m] = e
    # the paper's speed-up claims (and the same measurement against every other baseline)
    S["claims"] = {}
    v_rs = runs_of(results, "sweep", "V-GRPO", chosen["V-GRPO"]["lr"]) if "V-GRPO" in chosen \
        else []
    for m in BASELINES:
        if m not in chosen or not v_rs:
            continue
        b_rs = runs_of(results, "sweep", m, chosen[m]["lr"])
        if not b_rs or b_rs[0]["eval_key"] != chosen[m]["variant"]:
            continue
        c = claim(v_rs, b_rs, timing, m)
        c.update(label=_label(m, chosen[m]["variant"]), lr=chosen[m]["lr"],
                 vgrpo_lr=chosen["V-GRPO"]["lr"])
        if m in CLAIMS:
            c["claim"] = dict(CLAIMS[m])
            c["verdict"], c["reason"] = claim_verdict(c, CLAIMS[m]["factor"], CLAIMS[m]["unit"])
        S["claims"][m] = c
    # ablations at V-GRPO's lr, paired against the shipped recipe at that lr
    S["ablations"] = []
    if "V-GRPO" in chosen:
        ref = runs_of(results, "sweep", "V-GRPO", chosen["V-GRPO"]["lr"])
        ref_fs = final_stats(ref) if ref else {}
        for m in ["V-GRPO", *ABLATIONS]:
            rs = ref if m == "V-GRPO" else runs_of(results, "ablation", m)
            if not rs:
                continue
            fs = final_stats(rs)
            row = dict(method=m, lr=chosen["V-GRPO"]["lr"], seeds=len(rs),
                       heldout={k: fs[k] for k in fs if k not in ("_reps", "n", "seeds")},
                       n=fs["n"], surrogate_cv=_mean([x.get("surrogate_cv") for r in rs
                                                      for x in r["iters"]]),
                       surrogate_cv_group=_mean([x.get("surrogate_cv_group") for r in rs
                                                 for x in r["iters"]]))
            if m != "V-GRPO" and len(rs) == len(ref) and ref_fs:
                d = fs["_reps"]["reward"] - ref_fs["_reps"]["reward"]
                row["delta_reward"] = (fs["reward"][0] - ref_fs["reward"][0], *interval(d))
            pt, reps = hit_times(rs, thr)
            row["iters_to_threshold"] = (float(pt.mean()), *interval(reps.mean(1)))
            row["reached"] = int(sum(math.isfinite(x) for x in pt))
            row["n_evals"] = len(rs[0]["evals"])
            S["ablations"].append(row)
        if len(S["ablations"]) == 1:                        # the shipped row alone: none run
            S["ablations"] = []
    # long runs
    S["long"] = []
    for r in sorted((r for r in results.values() if r.get("kind") == "long"),
                    key=lambda r: list(LONG).index(_long_name(r))):
        key = r["eval_key"]
        fs = final_stats([r])
        S["long"].append(dict(method=r["method"], name=_long_name(r), lr=r["lr"],
                              iterations=r["iterations"], ema=r["ema"],
                              curve=[dict(iter=e["iter"], **{k: e[key][k] for k in
                                     ("acc", "reward", "diversity", "nn_real")})
                                     for e in r["evals"]],
                              train_reward=[x["reward_mean"] for x in r["iters"]],
                              final={k: fs[k] for k in fs if k not in ("_reps",)},
                              final_raw={k: v for k, v in final_stats([r], "heldout", "raw")
                                         .items() if k != "_reps"} if r["ema"] else None))
    # the efficiency measures over the long runs too (one seed each: intervals over images only)
    S["long_efficiency"] = {}
    for r in sorted((r for r in results.values() if r.get("kind") == "long"),
                    key=lambda r: list(LONG).index(_long_name(r))):
        e = efficiency([r], thr, timing, r["method"] if _long_name(r) != r["method"] or
                       r["method"] == "V-GRPO" else "-")
        e["final"] = {k: v for k, v in final_stats([r]).items() if k != "_reps"}
        e.update(label=r["method"] + (", EMA" if r["ema"] else ""), lr=r["lr"])
        S["long_efficiency"][_long_name(r)] = e
    for E in (S["efficiency"], S["long_efficiency"]):
        ev = E.get("V-GRPO")
        for m, e in E.items():
            if ev and m != "V-GRPO":
                e["vs_vgrpo"] = {k: ratio(ev[r], e[r], ev[k][0], e[k][0])
                                 for k, r in (("iters", "_iters_reps"), ("nfe", "_nfe_reps"),
                                              ("seconds", "_sec_reps")) if r in e and r in ev}
    return S


def _long_name(r: dict) -> str:
    return "Flow-GRPO" if r["method"] in FLOWS else r["method"]


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def frontier(sweep: list[dict], S: dict) -> dict:
    """Each baseline's point (every baseline of the sweep, at every lr, each weights variant it
    was evaluated with: Flow-GRPO's and DiffusionNFT's EMA and trained weights, MixGRPO's trained
    weights) and its distance below V-GRPO's reward–diversity frontier (held-out, final), with
    its interval from the bootstrap replicates; positive = the point lies below. V-GRPO's
    frontier: its points at every lr plus the base model (lr 0: where every method starts)."""
    np = _np()
    base = {"heldout": {k: S["base_ci"][k] for k in ("reward", "diversity")},
            "_reps": S["_base_reps"]}
    vpts = [base] + [r for r in sweep if r["method"] == "V-GRPO" and r["_reps"]]
    if len(vpts) < 2:
        return {}
    pts = lambda rows: [(r["heldout"]["diversity"][0], r["heldout"]["reward"][0]) for r in rows]
    out = {"vgrpo_points": pts(vpts), "points": []}
    for r in sweep:
        if r["method"] == "V-GRPO" or not r["_reps"]:
            continue
        d, rew = r["heldout"]["diversity"][0], r["heldout"]["reward"][0]
        f = frontier_margin(pts(vpts), d)
        item = dict(method=r["method"], lr=r["lr"], variant=r["variant"], diversity=d, reward=rew)
        if f is None:
            item["position"] = "more diverse than every V-GRPO point and the base model"
        else:
            reps = []
            for b in range(N_BOOT):
                vb = [(q["_reps"]["diversity"][b], q["_reps"]["reward"][b]) for q in vpts]
                fb = frontier_margin(vb, r["_reps"]["diversity"][b])
                reps.append(np.nan if fb is None else fb - r["_reps"]["reward"][b])
            reps = np.array(reps)
            reps = reps[~np.isnan(reps)]
            item["margin"] = (f - rew, *interval(reps)) if len(reps) else (f - rew, f - rew,
                                                                             f - rew)
            m = item["margin"]
            item["position"] = ("below V-GRPO's frontier" if m[1] > 0 else
                                "above V-GRPO's frontier" if m[2] < 0 else
                                "on V-GRPO's frontier within noise")
        out["points"].append(item)
    inside = [p for p in out["points"] if "margin" in p]
    out["all_below"] = bool(inside) and all(p["margin"][0] > 0 for p in inside)
    out["all_below_ci"] = bool(inside) and all(p["margin"][1] > 0 for p in inside)
    out["any_above_ci"] = any(p["margin"][2] < 0 for p in inside)
    return out


def _setup_text(S: dict, cmd: str) -> str:
    p, b = S["plan"], S["base"]
    info = json.loads((CACHE / "build.json").read_text()) if (CACHE / "build.json").is_file() \
        else {}
    nan = float("nan")
    return (
        f"Produced by `{cmd}` (plan `{p['mode']}`, commit {p.get('commit', '?')}, started "
        f"{p['started']}, {p['workers']} worker processes × {p['threads']} thread on "
        f"{p.get('machine', 'a 2-core machine')}; tables and figures by `python examples/digits.py "
        f"report` at commit {_commit()}). Model: the tiny SD3 pipeline of `examples/digits.py "
        f"build` ({info.get('transformer_params', 0) / 1e6:.2f}M-parameter "
        f"SD3Transformer2DModel); reward p(prompted digit) from a conv classifier "
        f"({info.get('classifier_heldout_acc', nan):.1%} on held-out real digits). Every run: "
        f"P × G = 4 × 8 rollouts per iteration, 10 steps, LoRA rank 32, built by vgrpo's "
        f"`setup` (LoRA, AdamW, rewards, prompt and noise streams); methods "
        f"{', '.join(methods_of(p))}. V-GRPO through vgrpo's `iteration`; Flow-GRPO through "
        f"examples/flow_grpo_sd3.py's iteration at its published recipes, with its EMA of the "
        f"LoRA (decay 0.9, updated every 8 optimizer steps); DiffusionNFT through "
        f"examples/diffusion_nft_sd3.py (`init_state` / `nft_iteration`, recipe sd3_pickscore: "
        f"K = 10 dpm2 rollout steps, the benchmark's 10; 1 optimizer step per iteration), "
        f"evaluated through its `eval_weights` (its EMA, decay 0.9 every step); MixGRPO through "
        f"examples/mix_grpo_sd3.py (`scaled_recipe(10, B)` / `init_state` / `mix_iteration`: "
        + (lambda r: f"window {r['window']} steps moved every {r['shift_interval']} iterations, "
           f"{r['opt_steps']} optimizer steps per iteration" if r else "the scaled window")(
            p.get("recipes", {}).get("MixGRPO"))
        + f"), no EMA (it evaluates its trained weights). The EMA methods' curves are the EMA's; "
        f"their trained weights were evaluated at the end of each run and are shown as a second "
        f"row. Every method trains the same LoRA: MixGRPO's published lr (1e-5) is for a full "
        f"fine-tune of FLUX.1-dev, so it gets the same LoRA grid as everyone.\n\n"
        f"* **Held-out set** (every reported number): {b['heldout']['n']} images, the 4 unseen "
        f"phrasings ({', '.join(repr(t.format(d='N')) for t in p['heldout_templates'])}) × 10 "
        f"digits × {p['n_heldout'] // 4} noises. **Validation set** (only to choose each "
        f"method's lr): {b['val']['n']} images from 4 other unseen phrasings and other noise. "
        f"Sampler: deterministic 10-step Euler ODE without CFG for every method"
        + (" (the CFG-4.5 recipe's policy also with its own CFG-4.5 sampler, marked \"CFG "
           "sampler\")" if "Flow-GRPO (CFG 4.5)" in methods_of(p) else "") + ".\n"
        f"* **lr choice**: the best final validation reward among the lrs whose validation "
        f"diversity is ≥ {p['diversity_keep']:.0%} of the base model's "
        f"({b['val']['diversity']:.3f} → floor {S['chosen'].get('V-GRPO', {}).get('diversity_floor', nan):.3f}); "
        f"grid {', '.join(_lr(x) for x in p['lrs'])} for every method (V-GRPO, Flow-GRPO and "
        f"DiffusionNFT publish 3e-4 for LoRA at batch 48 × 24; MixGRPO 1e-5 for a full "
        f"fine-tune), {len(p['seeds'])} seed(s), {p['iterations']} iterations (the claims' "
        f"budget B), held-out evaluations every {p['eval_every']} iterations for V-GRPO and "
        f"every {p.get('baseline_eval_every', p['eval_every'])} for the baselines (the claims "
        f"interpolate V-GRPO's curve and use the baselines' final evaluation).\n"
        f"* **Intervals**: 95 % percentile bootstrap, {N_BOOT} draws: seeds drawn with "
        f"replacement, then the held-out images within each drawn seed; the same draws for every "
        f"method (differences are paired). Diversity and nn-real are bootstrapped through their "
        f"per-image terms (each image's mean feature distance to the other samples of its "
        f"digit; its distance to the nearest real digit). One-seed rows (long runs) resample "
        f"images only.\n"
        f"* **Measures**: accuracy = the classifier's top class is the prompted digit; reward = "
        f"its probability; diversity = within-digit feature distance, real handwriting = 1; "
        f"nn-real = distance to the nearest real digit, real test digits = 1 (off the data → "
        f"up).\n"
        f"* **Threshold** (fixed before the runs, from the base evaluation): "
        f"{p['threshold_rule']}; base {p['base_acc']:.4f} → {p['threshold']:.4f}. Iterations to "
        f"it are interpolated linearly between evaluations; NFE = transformer forwards of "
        f"training (rollout, θ_old / old-adapter and θ passes, reference passes; CFG counts 2; "
        f"backward passes not counted); gradient steps = optimizer steps; wall-clock = "
        f"iterations × seconds per iteration measured in one process that ran one iteration of "
        f"each method in turn, {p['timing_rounds']} rounds.\n"
        + ("* **Changed by hand during this run** (from the plan's own record): "
           + "; ".join(p["amendments"]) + ".\n" if p.get("amendments") else ""))


def _sweep_rows(S: dict) -> list[list[str]]:
    rows = []
    for r in S["sweep"]:
        h, v = r["heldout"], r["val"]
        primary = r["variant"] == S["chosen"].get(r["method"], {}).get("variant")
        mark = (" **(chosen)**" if primary else " (chosen by its trained weights)") \
            if r["chosen"] else ""
        rows.append([_label(r["method"], r["variant"]) + mark,
                     _lr(r["lr"]), str(r["seeds"]),
                     f"{v['reward'][0]:.3f}" if v else "—",
                     f"{v['diversity'][0]:.3f}" if v else "—",
                     _ci(h.get("acc")), _ci(h.get("reward")), _ci(h.get("diversity")),
                     _ci(h.get("nn_real"))])
        if r.get("heldout_cfg"):
            c = r["heldout_cfg"]
            rows.append([_label(r["method"], r["variant"]) + ", CFG sampler", _lr(r["lr"]),
                         str(r["seeds"]), "", "", _ci(c.get("acc")), _ci(c.get("reward")),
                         _ci(c.get("diversity")), _ci(c.get("nn_real"))])
    return rows


SWEEP_HEAD = ["method", "lr", "seeds", "val reward", "val diversity", "held-out acc",
              "held-out reward", "held-out diversity", "nn-real"]


def _frontier_groups(S: dict) -> list[tuple]:
    """[(method, variant, its points, verdict of V-GRPO's frontier against them)] for every
    baseline's points of the frontier: first the weights each method evaluates, then the trained
    weights of the EMA methods."""
    F = S.get("frontier") or {}
    out = []
    for primary in (True, False):
        for m in BASELINES:
            for v in ("ema", "raw"):
                if (v == S["chosen"].get(m, {}).get("variant", "raw")) != primary:
                    continue
                pts = [p for p in F.get("points", []) if p["method"] == m and p["variant"] == v]
                if not pts:
                    continue
                inside = [p for p in pts if "margin" in p]
                below = [p for p in inside if p["margin"][1] > 0]
                above = [p for p in inside if p["margin"][2] < 0]
                noise = [p for p in inside if p not in below and p not in above]
                if above:
                    verdict = "does not lie above it"
                elif below and not noise:
                    verdict = "lies above it"
                elif below:
                    verdict = "lies above it or level with it"
                elif noise:
                    verdict = "is level with it within noise"
                else:
                    verdict = "cannot be compared (every point more diverse than V-GRPO's)"
                out.append((m, v, pts, dict(verdict=verdict, below=below, above=above,
                                            noise=noise, beyond=[p for p in pts
                                                                 if "margin" not in p])))
    return out


def _frontier_text(S: dict) -> str:
    F = S.get("frontier") or {}
    if not F.get("points"):
        return "Frontier: not enough runs.\n"
    lines = ["V-GRPO's frontier: the upper envelope of its (diversity, reward) points at every "
             "lr and the base model (lr 0, where every method starts), joined linearly. A "
             "baseline's point is below it if the gap's whole interval is above 0, above it if "
             "the whole interval is below 0, else within noise of it."]
    for m, v, pts, g in _frontier_groups(S):
        primary = v == S["chosen"].get(m, {}).get("variant", "raw")
        name = _label(m, v) + (" (what it evaluates)" if primary and m in EMA_METHODS else "")
        s = (f"* **{name}:** V-GRPO's frontier {g['verdict']}: of {len(pts)} points, "
             f"{len(g['below'])} lie below it, {len(g['noise'])} within noise of it, "
             f"{len(g['above'])} above it")
        if g["beyond"]:
            s += (f", {len(g['beyond'])} beyond its most diverse point (lr "
                  + ", ".join(_lr(p["lr"]) for p in g["beyond"]) + ")")
        lines.append(s + ".")
        for p in pts:
            if "margin" in p:
                lines.append(f"  * lr {_lr(p['lr'])}: reward {p['reward']:.3f} at diversity "
                             f"{p['diversity']:.3f}; V-GRPO's frontier there is "
                             f"{_ci(p['margin'], '{:+.3f}')} higher ({p['position']})")
    floor = DIVERSITY_KEEP * S["base_ci"]["diversity"][0]
    best = []
    for label, f in [("V-GRPO", lambda r: r["method"] == "V-GRPO")] + [
            (_label(m, S["chosen"].get(m, {}).get("variant", "raw")),
             (lambda r, m=m: r["method"] == m
              and r["variant"] == S["chosen"].get(m, {}).get("variant", "raw")))
            for m in BASELINES]:
        ok = [r for r in S["sweep"] if f(r) and r["heldout"].get("diversity")
              and r["heldout"]["diversity"][0] >= floor]
        if ok:
            r = max(ok, key=lambda r: r["heldout"]["reward"][0])
            best.append(f"{label} {_ci(r['heldout']['reward'])} (lr {_lr(r['lr'])}, diversity "
                        f"{r['heldout']['diversity'][0]:.3f})")
    if best:
        lines.append(f"* How far each method gets along the frontier: the best held-out reward "
                     f"of any of its points that keeps ≥ {DIVERSITY_KEEP:.0%} of the base "
                     f"model's held-out diversity (≥ {floor:.3f}): " + "; ".join(best) +
                     f" (base model {_ci(S['base_ci']['reward'])}).")
    return "\n".join(lines) + "\n"


def _eff_rows(E: dict) -> list[list[str]]:
    rows = []
    ev_iters = (E.get("V-GRPO") or {}).get("iters") or [0.0]
    unreached = isinstance(ev_iters[0], float) and math.isinf(ev_iters[0])
    for m, e in E.items():
        f = e["final"]
        vs = e.get("vs_vgrpo", {})     # over V-GRPO's infinite count (unreached): no ratio
        rows.append([e["label"], _lr(e["lr"]),
                     f"{e['reached']}/{e['seeds']}", _ci(e["iters"], "{:.1f}"),
                     _ci(e["nfe"], "{:,.0f}"), _ci(e.get("seconds"), "{:.0f}"),
                     _ci(e.get("sec_per_iter"), "{:.2f}"), f"{e['nfe_per_iter']:,.0f}",
                     *[("V-GRPO not reached" if unreached else _ci(vs.get(k), "{:.2f}"))
                       if vs else "1" for k in ("iters", "nfe", "seconds")],
                     _ci(f.get("reward")), _ci(f.get("acc"))])
    return rows


EFF_HEAD = ["method", "lr", "seeds reaching", "iterations to thr.", "NFE to thr.",
            "seconds to thr.", "s / iteration", "NFE / iteration", "iterations ÷ V-GRPO's", "NFE ÷ V-GRPO's",
            "seconds ÷ V-GRPO's", "final held-out reward", "final held-out acc"]


def _abl_rows(S: dict) -> list[list[str]]:
    rows = []
    for a in S["ablations"]:
        h = a["heldout"]
        rows.append([a["method"] + (" (shipped)" if a["method"] == "V-GRPO" else ""),
                     str(a["seeds"]), _ci(h.get("acc")), _ci(h.get("reward")),
                     _ci(a.get("delta_reward"), "{:+.3f}") if a.get("delta_reward") else "—",
                     _ci(h.get("diversity")), _ci(h.get("nn_real")),
                     (f"{_ci(a['iters_to_threshold'], '{:.1f}')} ({a['reached']}/{a['seeds']})"
                      if a["n_evals"] > 2 else "—"),
                     f"{a['surrogate_cv']:.3f}" if a["surrogate_cv"] is not None else "—",
                     f"{a['surrogate_cv_group']:.3f}" if a["surrogate_cv_group"] is not None
                     else "—"])
    return rows


ABL_HEAD = ["method", "seeds", "held-out acc", "held-out reward", "Δ reward vs shipped",
            "diversity", "nn-real", "iterations to thr. (seeds reaching)", "surrogate CV",
            "CV within group"]


def _long_text(S: dict) -> str:
    if not S["long"]:
        return "Long runs: not run.\n"
    b = S["base"]["heldout"]
    its = sorted({c["iter"] for L in S["long"] for c in L["curve"]})
    head = (["run", "lr"] + [f"@{i}: acc / div / nn" for i in its]
            + ["peak acc (iteration)", "final reward (CI)"])
    rows, notes = [], []
    for L in S["long"]:
        by = {c["iter"]: c for c in L["curve"]}
        rows.append([L["method"] + (", EMA" if L["ema"] else ""), _lr(L["lr"])]
                    + [f"{by[i]['acc']:.3f} / {by[i]['diversity']:.2f} / {by[i]['nn_real']:.2f}"
                       if i in by else "—" for i in its]
                    + ["{:.3f} (@{})".format(*max(((c["acc"], c["iter"]) for c in L["curve"])))]
                    + [_ci(L["final"].get("reward"))])
        peak = max(L["curve"], key=lambda c: c["acc"])
        last = L["curve"][-1]
        tr = L["train_reward"]
        k = max(1, len(tr) // 10)
        signs = []
        if last["diversity"] < DIVERSITY_KEEP * b["diversity"]:
            signs.append(f"diversity fell to {last['diversity']:.2f} "
                         f"({last['diversity'] / b['diversity']:.0%} of the base model's)")
        if last["nn_real"] > 1.1 * b["nn_real"]:
            signs.append(f"samples moved off the data (nn-real {b['nn_real']:.2f} → "
                         f"{last['nn_real']:.2f})")
        if peak["acc"] - last["acc"] >= 0.03:
            signs.append(f"held-out accuracy fell from its peak {peak['acc']:.3f} "
                         f"(@{peak['iter']}) to {last['acc']:.3f}")
        windows = [sum(tr[i:i + k]) / k for i in range(0, len(tr) - k + 1)]
        if signs and windows:
            peak_tr, last_tr = max(windows), windows[-1]
            signs.append(
                f"the training reward fell too (best {k}-iteration mean {peak_tr:.3f}, last "
                f"{last_tr:.3f}): the policy degraded on its own prompts as well, i.e. "
                "instability rather than reward hacking (the classifier was not fooled)"
                if last_tr < peak_tr - 0.05 else
                f"while the training reward held (best {k}-iteration mean {peak_tr:.3f}, last "
                f"{last_tr:.3f}): the policy over-fits its training prompts and the reward "
                "model, i.e. reward hacking in the wider sense")
        notes.append(f"* **{L['method']}**: training reward {sum(tr[:k]) / k:.3f} (first "
                     f"{k} iterations) → {sum(tr[-k:]) / k:.3f} (last {k}); held-out accuracy "
                     f"{L['curve'][0]['acc']:.3f} → {last['acc']:.3f}, diversity "
                     f"{L['curve'][0]['diversity']:.3f} → {last['diversity']:.3f}, nn-real "
                     f"{L['curve'][0]['nn_real']:.3f} → {last['nn_real']:.3f}. "
                     + (("Signs of trouble: " + "; ".join(signs) + ".") if signs else
                        "No sign of reward hacking by these measures (diversity ≥ "
                        f"{DIVERSITY_KEEP:.0%} of the base model's, nn-real within 10 %, "
                        "accuracy within 0.03 of its peak)."))
    by = {L["name"]: L for L in S["long"]}
    ch = S["chosen"]
    if "Flow-GRPO" in by and ch.get("better_flow"):
        f, bf = by["Flow-GRPO"], ch["better_flow"]
        same = f["method"] == bf and abs(f["lr"] - ch[bf]["lr"]) < 1e-12
        notes.append(f"* The long Flow-GRPO run's recipe and lr ({f['method']}, {_lr(f['lr'])}) "
                     f"were chosen from the first two seeds of the sweep so that it could start "
                     f"early; the choice from every seed is {bf}, {_lr(ch[bf]['lr'])}"
                     + (" (the same)." if same else " (different: read that row with care)."))
    kl = next((L for n, L in by.items() if n.startswith("V-GRPO + KL")), None)
    if kl and "V-GRPO" in by:
        v = by["V-GRPO"]
        pk = lambda L: max(c["acc"] for c in L["curve"])
        notes.append(f"* **What the KL term did** (same lr, seed and prompts; μ = 2 optimizer "
                     f"steps per iteration instead of 1): peak held-out accuracy {pk(kl):.3f} "
                     f"against {pk(v):.3f} without it; after {kl['iterations']} iterations "
                     f"{kl['curve'][-1]['acc']:.3f} against {v['curve'][-1]['acc']:.3f}, nn-real "
                     f"{kl['curve'][-1]['nn_real']:.2f} against {v['curve'][-1]['nn_real']:.2f}, "
                     f"diversity {kl['curve'][-1]['diversity']:.2f} against "
                     f"{v['curve'][-1]['diversity']:.2f}.")
    return _table(head, rows) + "\n" + "\n".join(notes) + "\n"


def _ratio_ci(c: dict, u: str) -> str:
    """A claim ratio with its interval; "< bound" where V-GRPO never reached the threshold."""
    if u not in c["ratio"]:
        return "—"
    if not c["gain_over_base"][0] > 0:
        return "— (no gain over the base model)"
    p, lo, hi = c["ratio"][u]
    f = lambda x: "∞" if math.isinf(x) else f"{x:.2f}"
    lo_s = f"< {c['bound'][u]:.2f}" if lo == 0 and c["reached_draws"] < 1 else f(lo)
    return (f"< {c['bound'][u]:.2f} (not reached) [{lo_s}, {f(hi)}]" if not c["reached"]
            else f"{f(p)}× [{lo_s}, {f(hi)}]")


def _claim_lines(S: dict, short: bool = False) -> list[str]:
    """One line per claim of the paper: its verdict, the ratio in the paper's unit and the
    others, both final rewards."""
    out = []
    for m, c in S.get("claims", {}).items():
        if "claim" not in c:
            continue
        cl, u = c["claim"], c["claim"]["unit"]
        others = ", ".join(f"{UNITS[k]} {_ratio_ci(c, k)}" for k in UNITS if k != u
                           and k in c["ratio"])
        reach = (f"V-GRPO reached {c['label']}'s final held-out reward {_ci(c['baseline_final'])} "
                 f"(after {c['B']} iterations) in {_ci(c['vgrpo_iters'], '{:.1f}')} iterations"
                 if c["reached"] else
                 f"V-GRPO did not reach {c['label']}'s final held-out reward "
                 f"{_ci(c['baseline_final'])} within its {c['Bv']} iterations")
        line = (f"* **{cl['label']} ({cl['paper']}): {c['verdict']}** — {reach}; speed-up in "
                f"{UNITS[u]} {_ratio_ci(c, u)} (claimed {cl['factor']:.2g}×)")
        if not short:
            line += (f"; in {others}; V-GRPO's own final reward {_ci(c['vgrpo_final'])}; "
                     f"{c['reason']}")
        else:
            line += f"; {c['reason']}"
        out.append(line + ".")
    return out


def _claims_text(S: dict) -> str:
    """The full table of the speed-up measurement against every baseline (the paper's two claims
    marked), with its rule."""
    C = S.get("claims", {})
    if not C:
        return "Not measured (the sweep is not finished).\n"
    head = ["baseline (its lr)", "B", "its final held-out reward", "gain over base",
            "V-GRPO's iterations to it", "iterations ratio", "gradient-steps ratio",
            "NFE ratio", "seconds ratio", "steps / iter. (baseline, V-GRPO)",
            "NFE / iter. (baseline, V-GRPO)", "s / iter. (baseline, V-GRPO)", "paper's claim"]
    rows = []
    for m, c in C.items():
        pi = c["per_iter"]
        sec = pi.get("seconds")
        rows.append([f"{c['label']} ({_lr(c['lr'])})", str(c["B"]), _ci(c["baseline_final"]),
                     _ci(c["gain_over_base"], "{:+.3f}"),
                     _ci(c["vgrpo_iters"], "{:.1f}") if c["reached"] else
                     f"not reached in {c['Bv']}",
                     _ratio_ci(c, "iters"), _ratio_ci(c, "steps"), _ratio_ci(c, "nfe"),
                     _ratio_ci(c, "seconds"),
                     f"{pi['steps']['baseline']:.2g}, {pi['steps']['vgrpo']:.2g}",
                     f"{pi['nfe']['baseline']:,.0f}, {pi['nfe']['vgrpo']:,.0f}",
                     f"{sec['baseline']:.2f}, {sec['vgrpo']:.2f}" if sec else "—",
                     f"{c['claim']['label']}: **{c['verdict']}**" if "claim" in c else "—"])
    p = S["plan"]
    v = next(iter(C.values()))
    return (f"Rule (fixed in the plan before the runs): {p.get('claim_budget_rule', CLAIM_BUDGET_RULE)}"
            f". B = {v['B']}; V-GRPO at its chosen lr {_lr(v['vgrpo_lr'])}; every ratio is "
            f"B·(baseline's count per iteration) ÷ (V-GRPO's iterations · its count per "
            f"iteration), > 1 = V-GRPO faster; intervals: the paired bootstrap over seeds and "
            f"images (the threshold recomputed in every draw; seconds also resample the timing "
            f"rounds); a draw in which V-GRPO never reaches the threshold bounds the ratio by "
            f"B/Bv · (counts) and widens the interval to that bound (\"<\"). Gain over base: the "
            f"baseline's final minus its iteration-0 (base model) reward, same draws. Verdict: "
            f"agrees if the interval in the paper's unit lies above 1 and reaches the claimed "
            f"factor, disagrees if it lies wholly below it, not resolved otherwise or if the "
            f"baseline did not improve measurably.\n\n" + _table(head, rows) + "\n"
            + "\n".join(_claim_lines(S)) + "\n")


def _paper_text(S: dict) -> str:
    """Where the measurements agree or disagree with the paper's claims, computed."""
    out = _claim_lines(S)
    for E, where, it in ((S["efficiency"], f"sweep, {S['plan']['iterations']} iterations",
                          S["plan"]["iterations"]),
                         (S.get("long_efficiency", {}), "long runs, one seed",
                          S["plan"]["long_iterations"])):
        ev = E.get("V-GRPO")
        for m, e in E.items():
            if m == "V-GRPO" or m not in FLOWS or not ev:
                continue
            r = e.get("vs_vgrpo", {}).get("iters")
            fin_v, fin_f = ev["final"].get("reward"), e["final"].get("reward")
            if r is None or fin_v is None or fin_f is None:
                continue
            reach = (f"V-GRPO reached it on {ev['reached']}/{ev['seeds']} seeds, {e['label']} on "
                     f"{e['reached']}/{e['seeds']} within {it} iterations")
            if ev["reached"] == 0:
                verdict = "not resolved (V-GRPO did not reach the threshold)"
            elif e["reached"] == 0 and ev["reached"] == ev["seeds"]:
                verdict = ("agrees" if math.isfinite(ev["iters"][2]) else
                           "points the paper's way, not resolved (V-GRPO's own interval "
                           "includes never reaching it)")
            elif not math.isnan(r[1]) and r[1] > 1:
                verdict = "agrees"
            elif not math.isnan(r[2]) and r[2] < 1:
                verdict = "disagrees"
            else:
                verdict = "not resolved (interval includes 1)"
            s = reach + (f"; {e['label']} needed {_ci(r, '{:.2f}')}× V-GRPO's iterations"
                         if math.isfinite(r[0]) and r[0] > 0 else "")
            out.append(f"* **Fewer iterations than the MDP baseline (the paper's efficiency "
                       f"claim), {where}: {verdict}** against {e['label']}: {s}; final "
                       f"held-out reward {_ci(fin_v)} (V-GRPO) vs {_ci(fin_f)}.")
    groups = [g for g in _frontier_groups(S)
              if g[1] == S["chosen"].get(g[0], {}).get("variant", "raw")]
    if groups:
        out.append("* **On the reward–diversity frontier** (not a claim of the paper, the "
                   "question a faster-moving method must answer), against the weights each "
                   "baseline evaluates: " + "; ".join(
                       f"against {_label(m, v)} V-GRPO's frontier {g['verdict']} ("
                       f"{len(g['below'])} below, {len(g['noise'])} within noise, "
                       f"{len(g['above'])} above, {len(g['beyond'])} beyond)"
                       for m, v, pts, g in groups) + ".")
        below = [p for m, v, pts, g in groups for p in g["below"]]
        if below:                            # which points, so a diverged run is seen as one
            out[-1] += (" Below it: " + "; ".join(
                f"{_label(p['method'], p['variant'])} lr {_lr(p['lr'])}, held-out reward "
                f"{p['reward']:.3f}" for p in below)
                + f" (base {S['base_ci']['reward'][0]:.3f}).")
    A = {a["method"]: a for a in S["ablations"]}
    claims = [("naive FPO-style", "the naive surrogate is worse"),
              ("no adaptive weighting", "adaptive weighting helps"),
              ("no stratification", "stratification helps"),
              ("pair sharing: none", "pair sharing helps"),
              ("v-parameterisation", "x-parameterisation beats v")]
    for m, claim in claims:
        a = A.get(m)
        if a and a.get("delta_reward"):
            d = a["delta_reward"]
            verdict = ("agrees" if d[2] < 0 else "disagrees" if d[1] > 0 else
                       "not resolved (interval includes 0)")
            out.append(f"* **Ablation, {claim}: {verdict}** — {m} minus shipped, final "
                       f"held-out reward {_ci(d, '{:+.3f}')}.")
    cvs = {a["method"]: a["surrogate_cv"] for a in S["ablations"]}
    if cvs.get("V-GRPO") and cvs.get("naive FPO-style"):
        agree = cvs["V-GRPO"] < cvs["naive FPO-style"]
        out.append(f"* **Lower surrogate CV with the three techniques: "
                   f"{'agrees' if agree else 'disagrees'}** — {cvs['naive FPO-style']:.3f} "
                   f"(naive) → {cvs['V-GRPO']:.3f} (shipped); the paper: 0.230 → 0.128.")
    return "\n".join(out) + "\n" if out else ""


def _cost_text(S: dict) -> str:
    runs = S["runs"]
    if not runs:
        return ""
    secs = sum(r["seconds"] for r in runs) + (S["timing"] or {}).get("seconds", 0)
    stamp = lambda s: time.mktime(time.strptime(s, "%Y-%m-%d %H:%M:%S"))
    plan, sessions = S["plan"], [s for s in S["plan"].get("sessions", []) if s.get("ended")]
    if sessions:            # each `benchmark` invocation's own span: idle time between them out
        wall = sum(stamp(s["ended"]) - stamp(s["started"]) for s in sessions)
        notes = ", ".join(s["note"] for s in sessions if s.get("note"))
        span = (f"{wall / 60:.0f} min of wall-clock time in {len(sessions)} invocation(s) of "
                f"`benchmark`" + (f" ({notes})" if notes else ""))
    else:
        wall = max(map(stamp, S["finished"])) - stamp(plan["started"])
        span = (f"{wall / 60:.0f} min from start to the last result (including any runs left "
                f"out or put back by hand)")
    est = plan.get("estimate")
    est_s = (f" The plan's estimate, written before the runs from seconds per iteration and per "
             f"evaluation measured for each method: {est['worker_seconds'] / 60:.0f} min of run "
             f"time, {est['wall_seconds'] / 60:.0f} min wall-clock with {plan['workers']} "
             f"workers." if est else "")
    left = [m for m in FLOWS if plan.get("methods") and m not in methods_of(plan)]
    left_abl = [a for a in ABLATIONS if a not in plan["ablations"]]
    cut = []
    if left:
        cut.append(f"the {', '.join(left)} recipe (4× the no-CFG recipe's cost per iteration; "
                   "in the 16-iteration benchmark its EMA stayed at the base model's reward at "
                   "every lr and it was never the better Flow-GRPO recipe on validation)")
    if left_abl and plan["ablations"]:
        unused = {"pair sharing: group", "soft-clip off", "per-group std"}   # no claim uses them
        cut.append(f"{len(left_abl)} of the {len(ABLATIONS)} ablations ({', '.join(left_abl)})"
                   + (", which no claim of the paper uses" if set(left_abl) <= unused else ""))
    if plan.get("methods"):
        cut.append("long runs for the new baselines (the long runs are V-GRPO, V-GRPO + KL and "
                   "the better Flow-GRPO recipe)")
    cut_s = (" Left out to fit the time: " + "; ".join(cut) + ".") if cut else ""
    return (f"Cost of the run reported here: {len(runs)} training runs, {secs / 60:.0f} min of "
            f"run time in {plan['workers']} worker processes, {span}, on "
            f"{plan.get('machine', 'a 2-core machine')}.{est_s}{cut_s} `--quick` (1 seed, 3 lrs, "
            f"an 8-iteration sweep of {', '.join(PLANS['quick']['methods'])}, 24-iteration long "
            f"runs, no ablations) took {QUICK_TIMED}.")


def write_report(S: dict, cmd: str, figs: dict) -> tuple[str, str]:
    """(digits.md text, README section body)."""
    ch = S["chosen"]
    chosen_line = "; ".join(f"{_label(m, ch[m]['variant'])} {_lr(ch[m]['lr'])}"
                            + (" (no lr kept the diversity floor: the most diverse one)"
                               if ch[m].get(f"fallback_{ch[m]['variant']}") else "")
                            for m in SWEEP if m in ch)
    raw_line = "; ".join(f"{m} {_lr(ch[m]['lr_raw'])}" for m in EMA_METHODS
                         if m in ch and "lr_raw" in ch[m])
    better = ch.get("better_flow", "—")
    edge = [m for m in SWEEP if m in ch and ch[m]["lr"] == max(S["plan"]["lrs"])]
    if edge:
        chosen_line += (f". The largest lr of the grid was chosen for {', '.join(edge)}: its best "
                        "lr may lie above the grid")
    parts = {
        "setup": _setup_text(S, cmd),
        "sweep": (f"Chosen on the validation set: {chosen_line}. (Chosen by the trained weights "
                  f"instead of the EMA: {raw_line or '—'}.) Better Flow-GRPO recipe on "
                  f"validation: {better}. Base model: held-out acc "
                  f"{_ci(S['base_ci']['acc'])}, reward {_ci(S['base_ci']['reward'])}, diversity "
                  f"{_ci(S['base_ci']['diversity'])}, nn-real {_ci(S['base_ci']['nn_real'])}; "
                  f"with the CFG-4.5 sampler acc {S['base']['heldout_cfg']['acc']:.3f}, "
                  f"diversity {S['base']['heldout_cfg']['diversity']:.3f}.\n\n"
                  + _table(SWEEP_HEAD, _sweep_rows(S))),
        "frontier": _frontier_text(S),
        "eff": ((_table(EFF_HEAD, _eff_rows(S["efficiency"])) if S["efficiency"] else
                 "Not run.\n")
                + (f"\nThe same over the long runs ({S['plan']['long_iterations']} iterations, "
                   f"one seed each, evaluated every {S['plan']['long_eval_every']} iterations; "
                   "intervals over images only):\n\n"
                   + _table(EFF_HEAD, _eff_rows(S["long_efficiency"]))
                   if S.get("long_efficiency") else "")),
        "abl": (_table(ABL_HEAD, _abl_rows(S)) if S["ablations"] else
                "Not run in this benchmark run.\n"),
        "long": _long_text(S),
        "paper": _paper_text(S),
    }
    fail = (f"\nFailed runs (see the benchmark's log): {', '.join(S['failed'])}.\n"
            if S["failed"] else "")
    if S.get("not_used"):
        fail += (f"\nFinished but not used (their seed is not finished at every lr of the "
                 f"sweep): {', '.join(S['not_used'])}.\n")
    if S.get("not_finished"):
        fail += (f"\n**Not finished when this report was made** (the benchmark was stopped for "
                 f"time): {', '.join(S['not_finished'])}.\n")
    if S.get("skipped"):
        fail += (f"\n**Not run in this benchmark run** (skipped by hand for time on a machine "
                 f"shared with other jobs; the plan includes them and `benchmark` runs them "
                 f"when their marker files are deleted): {', '.join(S['skipped'])}.\n")
    img = lambda k, alt: f"![{alt}]({figs[k]})\n" if k in figs else ""
    md = ("# V-GRPO, Flow-GRPO, DiffusionNFT and MixGRPO on handwritten digits: each at its own "
          "learning rate\n\n"
          + parts["setup"] + "\n" + _cost_text(S) + "\n" + fail
          + "\n## Learning-rate sweep (final held-out numbers, 95 % intervals)\n\n"
          + parts["sweep"]
          + "\n## The paper's speed-up claims, measured as it states them\n\n"
          + img("claims", "claims") + "\n" + _claims_text(S)
          + "\n## The reward–diversity frontier\n\n" + img("frontier", "frontier")
          + "\n" + parts["frontier"]
          + "\n## Efficiency at each method's chosen lr\n\n" + parts["eff"]
          + "\n## Ablations at V-GRPO's chosen lr\n\n" + parts["abl"]
          + "\n## Long runs\n\n" + img("long", "long runs") + "\n" + parts["long"]
          + "\n## Against the paper\n\n" + parts["paper"]
          + "\n" + img("main", "curves and samples"))
    readme = _readme_text(S, figs, img)
    return md, readme


def _readme_text(S: dict, figs: dict, img) -> str:
    """The README's digits section: one table, the frontier, one line per claim, the link."""
    p, ch, C = S["plan"], S["chosen"], S.get("claims", {})
    rows = []
    for m in methods_of(p):
        if m not in ch:
            continue
        rs = [r for r in S["sweep"] if r["method"] == m and r["variant"] == ch[m]["variant"]
              and r["chosen"]]
        fin = rs[0]["heldout"].get("reward") if rs else None
        c = C.get(m)
        rows.append([_label(m, ch[m]["variant"]) + (" (paper's claim)" if m in CLAIMS else ""),
                     _lr(ch[m]["lr"]), _ci(fin)]
                    + ([_ratio_ci(c, u) for u in UNITS] if c else ["—"] * len(UNITS)))
    head = ["method", "chosen lr", "final held-out reward"] + [
        f"speed-up in {UNITS[u]}" for u in UNITS]
    claims = _claim_lines(S, short=True)
    missing = [m for m in CLAIMS if m not in methods_of(p)]
    if missing:                            # a results folder from before the baseline existed
        claims.append(f"* **Not measured in this run:** the claims over {' and '.join(missing)} "
                      "(this run predates them); `python examples/digits.py benchmark` "
                      "measures them.")
    groups = [g for g in _frontier_groups(S) if g[1] == ch.get(g[0], {}).get("variant", "raw")]
    front = ("* **Reward–diversity frontier** (not a claim of the paper): V-GRPO's frontier "
             + "; ".join(f"{g['verdict']} against {_label(m, v)}" for m, v, _, g in groups)
             + ".") if groups else ""
    return ("\n`examples/digits.py benchmark` trains V-GRPO and the baselines on a genuinely "
            "pretrained tiny SD3 pipeline on a CPU with a learned reward (a digit classifier's "
            f"probability of the prompted digit): same model, P × G = 4 × 8, 10 steps, LoRA, "
            f"prompts and noise; each method at its own lr chosen on a validation set; "
            f"{len(p['seeds'])} seed(s) × {p['iterations']} iterations (B); 95 % paired "
            "bootstrap intervals over seeds and held-out images. Speed-up = B ÷ the iterations "
            "V-GRPO needs to reach the method's final held-out reward, also in gradient steps, "
            "training NFE and seconds (> 1: V-GRPO faster).\n\n"
            + _table(head, rows) + "\n" + img("frontier", "reward–diversity frontier")
            + "\n**Against the paper:**\n\n" + "\n".join(claims + ([front] if front else []))
            + "\n\nEvery table (sweep, frontier points, speed-ups, efficiency, ablations, long "
            "runs, setup, cost, machine, commit): [examples/digits.md](examples/digits.md).\n")


def _strip(x):
    """JSON-ready copy: numpy → float, private keys (leading _) and infinities dropped."""
    np = _np()
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_strip(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


README_SECTION = "## Results on real handwritten digits: a pretrained model, a learned reward"


README_END = "<!-- the digits summary above is written by `python examples/digits.py report` -->"


def replace_readme_section(readme: Path, body: str) -> None:
    """The README's digits summary: from its heading to README_END (what follows the marker, such
    as the toy's lines, is kept), or to the next heading where there is no marker."""
    text = readme.read_text()
    start = text.index(README_SECTION) + len(README_SECTION)
    end = text.find(README_END, start)
    end, gap = (end, "\n\n") if end >= 0 else (text.index("\n## ", start), "\n")
    readme.write_text(text[:start] + "\n" + body.rstrip("\n") + gap + text[end:])


def report(out: Path = RESULTS, md: Path | None = None, readme: Path | None = None,
           cmd: str | None = None, log=print) -> str:
    """summary.json, the markdown and the figures from the runs in `out`. Defaults: for the
    shipped results folder, examples/digits.md, examples/digits*.png and the README section; for
    any other folder, report.md and figures inside it."""
    out = Path(out)
    shipped = out.resolve() == RESULTS.resolve()
    readme = readme or (ROOT / "README.md" if shipped and md is None else None)
    md = Path(md) if md else (Path(__file__).with_name("digits.md") if shipped
                              else out / "report.md")
    fig_dir = md.parent
    S = analyse(out)
    if cmd is None:
        cmd = "python examples/digits.py benchmark" + (
            " --quick" if S["plan"]["mode"] == "quick" else "") + (
            "" if shipped else f" --out {out}")
    figs = figures(S, out, fig_dir, prefix="digits" if fig_dir == Path(__file__).parent
                   else "report")
    rel = {k: os.path.relpath(v, md.parent) for k, v in figs.items()}
    text, body = write_report(S, cmd, rel)
    md.write_text(text)
    (out / "summary.json").write_text(json.dumps(_strip(S), indent=1))
    if readme:
        rfig = {k: os.path.relpath(v, Path(readme).parent) for k, v in figs.items()}
        _, body = write_report(S, cmd, rfig)
        replace_readme_section(Path(readme), body)
    log(text)
    log(f"wrote {md}, {out / 'summary.json'}, " + ", ".join(str(v) for v in figs.values()))
    return text


# ------------------------------------------------------------------------------------------------
# Pictures: sample grids (PNG files) and the charts (matplotlib).
# ------------------------------------------------------------------------------------------------
def grid_array(images: torch.Tensor, digits: torch.Tensor, per_digit: int):
    """Rows = digits 0-9, the first `per_digit` samples of each; → (10·32, per_digit·32) uint8."""
    x = gray(images)[:, 0]
    rows = [torch.cat(list(x[digits == d][:per_digit]), dim=1) for d in range(10)]
    return (torch.cat(rows, dim=0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def save_grid(images: torch.Tensor, digits: torch.Tensor, path: Path, per_digit: int = 10):
    from PIL import Image
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid_array(images, digits, per_digit), mode="L").save(path, optimize=True)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


STYLE = {"V-GRPO": dict(color="tab:blue", marker="o"),
         "Flow-GRPO (CFG 4.5)": dict(color="tab:red", marker="s"),
         "Flow-GRPO (no CFG)": dict(color="tab:orange", marker="^"),
         "DiffusionNFT": dict(color="tab:green", marker="v"),
         "MixGRPO": dict(color="tab:purple", marker="P")}


def figures(S: dict, out: Path, fig_dir: Path, prefix: str) -> dict:
    """The frontier, the long runs and the main figure (curves at the chosen lrs + samples).
    Returns {name: path} of those written."""
    plt = _plt()
    np = _np()
    figs = {}
    b = S["base_ci"]
    # 1. reward–diversity frontier: every (method, lr) point, final held-out, with intervals
    if S["sweep"]:
        fig, ax = plt.subplots(figsize=(7.5, 5.2))
        for m in SWEEP:
            for v in ("ema", "raw"):
                rows = sorted([r for r in S["sweep"] if r["method"] == m and r["variant"] == v],
                              key=lambda r: r["lr"])
                if not rows:
                    continue
                fill = m not in EMA_METHODS or v == "ema"   # an EMA method's trained weights: hollow
                st = STYLE[m]
                xs = [r["heldout"]["diversity"][0] for r in rows]
                ys = [r["heldout"]["reward"][0] for r in rows]
                xe = np.array([[x - r["heldout"]["diversity"][1], r["heldout"]["diversity"][2] - x]
                               for x, r in zip(xs, rows)]).T
                ye = np.array([[y - r["heldout"]["reward"][1], r["heldout"]["reward"][2] - y]
                               for y, r in zip(ys, rows)]).T
                lab = _label(m, v)
                ax.errorbar(xs, ys, xerr=xe, yerr=ye, color=st["color"], marker=st["marker"],
                            ls="-" if fill else ":", mfc=st["color"] if fill else "white",
                            capsize=2, lw=1.2, ms=7, label=lab)
                for x, y, r in zip(xs, ys, rows):
                    ax.annotate(_lr(r["lr"]) + (" ★" if r["chosen"] else ""), (x, y),
                                textcoords="offset points", xytext=(5, 4), fontsize=7,
                                color=st["color"])
        cfg = [r for r in S["sweep"] if r.get("heldout_cfg") and r["variant"] == "ema"]
        if cfg:
            ax.scatter([r["heldout_cfg"]["diversity"][0] for r in cfg],
                       [r["heldout_cfg"]["reward"][0] for r in cfg], marker="x", color="tab:red",
                       label="Flow-GRPO (CFG 4.5), EMA, sampled with CFG 4.5")
            bc = S["base"]["heldout_cfg"]
            ax.scatter([bc["diversity"]], [bc["reward"]], marker="X", color="black", s=50,
                       label="base model, sampled with CFG 4.5")
        ax.errorbar([b["diversity"][0]], [b["reward"][0]],
                    xerr=[[b["diversity"][0] - b["diversity"][1]], [b["diversity"][2] -
                                                                     b["diversity"][0]]],
                    yerr=[[b["reward"][0] - b["reward"][1]], [b["reward"][2] - b["reward"][0]]],
                    color="black", marker="D", ms=7, capsize=2, label="base model")
        ax.axvline(1.0, color="gray", lw=0.8, ls="--")
        ax.text(1.0, ax.get_ylim()[0], " real handwriting", color="gray", fontsize=7,
                va="bottom")
        ax.axvline(DIVERSITY_KEEP * b["diversity"][0], color="gray", lw=0.8, ls=":")
        ax.text(DIVERSITY_KEEP * b["diversity"][0], ax.get_ylim()[0],
                f" {DIVERSITY_KEEP:.0%} of the base model's", color="gray", fontsize=7,
                va="bottom")
        ax.set_xlabel("held-out diversity (within-digit, real digits = 1)")
        ax.set_ylabel("held-out reward  p(prompted digit)")
        it = S["plan"]["iterations"]
        ax.set_title(f"Reward–diversity frontier after {it} iterations "
                     f"({S['sweep'][0]['seeds']} seeds × {S['sweep'][0]['n']} images; "
                     "★ chosen lr)", fontsize=9)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
        figs["frontier"] = fig_dir / f"{prefix}_frontier.png"
        fig.tight_layout()
        fig.savefig(figs["frontier"], dpi=110)
        plt.close(fig)
    # 1b. the claims: every method's held-out reward curve at its chosen lr (seed mean), each
    # baseline's final reward as a dashed line, where V-GRPO's curve crosses it marked
    if S.get("claims"):
        fig, ax = plt.subplots(figsize=(7.5, 4.6))
        for m in methods_of(S["plan"]):
            rs = [r for r in S["runs"] if r["kind"] == "sweep" and r["method"] == m
                  and m in S["chosen"] and abs(r["lr"] - S["chosen"][m]["lr"]) < 1e-12]
            if not rs:
                continue
            key = S["chosen"][m]["variant"]
            cv = [r["heldout_curve"].get(key) for r in rs]
            if any(c is None for c in cv):
                continue
            its = [q["iter"] for q in cv[0]]
            y = np.array([[q["reward"] for q in c] for c in cv]).mean(0)
            st = STYLE[m]
            ax.plot(its, y, color=st["color"], marker=st["marker"], ms=5,
                    label=f"{_label(m, key)}, lr {_lr(S['chosen'][m]['lr'])}")
            c = S["claims"].get(m)
            if c:
                ax.axhline(c["threshold"], color=st["color"], ls="--", lw=0.8)
                if c["reached"]:
                    ax.plot([c["vgrpo_iters"][0]], [c["threshold"]], marker="*", ms=12,
                            color=st["color"], mec="black")
        ax.axhline(b["reward"][0], color="black", ls=":", lw=0.8, label="base model")
        ax.set_xlabel("iteration")
        ax.set_ylabel("held-out reward (mean over seeds)")
        ax.set_title("Held-out reward at each method's chosen lr\ndashed: each baseline's final "
                     "reward; ★ where V-GRPO's curve reaches it", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        figs["claims"] = fig_dir / f"{prefix}_claims.png"
        fig.tight_layout()
        fig.savefig(figs["claims"], dpi=100)
        plt.close(fig)
    # 2. long runs: training reward, held-out accuracy, diversity, nn-real against iterations
    if S["long"]:
        fig, axs = plt.subplots(1, 4, figsize=(15, 3.6))
        colors = {"V-GRPO": "tab:blue", "Flow-GRPO": "tab:red"}
        for i, L in enumerate(S["long"]):
            c = colors.get(L["name"], "tab:green")
            lab = f"{L['method']}{', EMA' if L['ema'] else ''} (lr {_lr(L['lr'])})"
            tr = np.array(L["train_reward"])
            axs[0].plot(np.arange(len(tr)), tr, color=c, alpha=0.35, lw=0.8)
            k = 5
            if len(tr) >= k:
                axs[0].plot(np.arange(k - 1, len(tr)), np.convolve(tr, np.ones(k) / k, "valid"),
                            color=c, lw=1.6, label=lab)
            its = [p["iter"] for p in L["curve"]]
            for ax, key in zip(axs[1:], ("acc", "diversity", "nn_real")):
                ax.plot(its, [p[key] for p in L["curve"]], color=c, marker="o", ms=3, label=lab)
        bb = S["base"]["heldout"]
        for ax, key, title in zip(axs[1:], ("acc", "diversity", "nn_real"),
                                  ("held-out accuracy", "held-out diversity (real = 1)",
                                   "distance to nearest real digit (real = 1)")):
            ax.axhline(bb[key], color="black", lw=0.8, ls=":", label="base model")
            ax.set_title(title, fontsize=9)
        axs[2].axhline(1.0, color="gray", lw=0.8, ls="--", label="real digits")
        axs[3].axhline(1.0, color="gray", lw=0.8, ls="--")
        axs[0].set_title("training reward (rollouts; Flow-GRPO: SDE)", fontsize=9)
        for ax in axs:
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        axs[0].legend(fontsize=7)
        axs[2].legend(fontsize=7)
        figs["long"] = fig_dir / f"{prefix}_long.png"
        fig.tight_layout()
        fig.savefig(figs["long"], dpi=100)
        plt.close(fig)
    # 3. main: held-out accuracy against iterations and against NFE at the chosen lrs, samples
    runs = {m: [r for r in S["runs"] if r["kind"] == "sweep" and r["method"] == m
                and abs(r["lr"] - S["chosen"][m]["lr"]) < 1e-12]
            for m in SWEEP if m in S["chosen"]}
    runs = {m: rs for m, rs in runs.items() if rs}
    grids = [("base model", out / "grids" / "base.png")]
    for m, rs in runs.items():
        r0 = rs[0]
        grids.append((f"{m} @{r0['iterations']}, lr {_lr(r0['lr'])}",
                      out / "grids" / f"{r0['id']}__{r0['evaluated']}.png"))
    for L in S["long"]:
        rid = f"long__{slug(L['name'])}__s0"
        grids.append((f"long: {L['method']} @{L['iterations']}",
                      out / "grids" / f"{rid}__{'ema' if L['ema'] else 'raw'}.png"))
    grids = [(t, p) for t, p in grids if p.is_file()]
    if runs or grids:
        from PIL import Image
        fig = plt.figure(figsize=(15, 8.5))
        gs = fig.add_gridspec(2, max(len(grids), 2), height_ratios=[1, 1.25])
        ax1 = fig.add_subplot(gs[0, : max(len(grids), 2) // 2])
        ax2 = fig.add_subplot(gs[0, max(len(grids), 2) // 2:])
        for m, rs in runs.items():
            key = rs[0]["evaluated"]
            its = [p["iter"] for p in rs[0]["heldout_curve"][key]]
            acc = np.array([[p["acc"] for p in r["heldout_curve"][key]] for r in rs])
            nfe = np.array(its) * _mean([r["nfe_per_iter"] for r in rs])
            st = STYLE[m]
            lab = f"{_label(m, key)}, lr {_lr(rs[0]['lr'])} ({len(rs)} seeds)"
            for ax, x in ((ax1, its), (ax2, nfe)):
                ax.plot(x, acc.mean(0), color=st["color"], marker=st["marker"], label=lab)
                if len(rs) > 1:
                    ax.fill_between(x, acc.min(0), acc.max(0), color=st["color"], alpha=0.15)
        for ax, xl in ((ax1, "iteration"), (ax2, "training NFE (transformer forwards)")):
            ax.axhline(S["threshold"], color="gray", ls="--", lw=0.8, label="threshold")
            ax.set_xlabel(xl)
            ax.set_ylabel("held-out accuracy")
            ax.grid(alpha=0.3)
        ax1.set_title("held-out accuracy at each method's chosen lr (band: min–max over seeds)",
                      fontsize=9)
        ax2.set_title("the same against training network evaluations", fontsize=9)
        ax1.legend(fontsize=7)
        for i, (t, p) in enumerate(grids):
            ax = fig.add_subplot(gs[1, i])
            ax.imshow(np.asarray(Image.open(p)), cmap="gray", vmin=0, vmax=255)
            ax.set_title(t, fontsize=8)
            ax.axis("off")
        figs["main"] = fig_dir / f"{prefix}.png"
        fig.tight_layout()
        fig.savefig(figs["main"], dpi=90)
        plt.close(fig)
    return figs


def before_after_figure(imgs0, imgs1, digits, titles: list[str], path: Path, per_digit: int = 8):
    """Two sample grids side by side (rows: digits 0-9, same noise), matplotlib."""
    plt = _plt()
    fig, axs = plt.subplots(1, 2, figsize=(8, 5.2))
    for ax, imgs, t in zip(axs, (imgs0, imgs1), titles):
        ax.imshow(grid_array(imgs, digits, per_digit), cmap="gray", vmin=0, vmax=255,
                  interpolation="nearest")                 # the model's own pixels, unsmoothed
        ax.set_title(t, fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# The newcomer's first run: build (or reuse), train with `vgrpo.py` itself, show before/after.
# ------------------------------------------------------------------------------------------------
def quickstart(iterations: int = 30, run_dir: str = "runs/digits-quickstart", seed: int = 0,
               grid: str = "runs/digits-quickstart/before_after.png", log=print) -> dict:
    from diffusers import StableDiffusion3Pipeline
    folder = build(log=log)
    prompts, digits, x1 = eval_set(10)
    before, imgs0 = heldout_metrics(load_pipe(folder), n_per=10, return_images=True)
    flags = vgrpo_flags(folder, seed, ["--iterations", str(iterations), "--run_dir", run_dir,
                                       "--save_every", str(iterations)])
    log("python vgrpo.py " + " ".join(flags))
    if V.main(flags) != 0:
        raise RuntimeError("the V-GRPO run failed (see the error above)")
    # the trained LoRA through stock diffusers: from_pretrained + load_lora_weights
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    pipe.load_lora_weights(str(V.find_checkpoint(run_dir)))
    after, imgs1 = heldout_metrics(pipe, n_per=10, return_images=True)
    before_after_figure(imgs0, imgs1, digits,
                        [f"base model: {before['acc']:.0%} correct",
                         f"after {iterations} V-GRPO iterations: {after['acc']:.0%}"], grid)
    log(f"held-out prompt accuracy (10 digits × 10 samples, unseen phrasings and noise): "
        f"{before['acc']:.1%} → {after['acc']:.1%}; reward {before['reward']:.3f} → "
        f"{after['reward']:.3f}; diversity {before['diversity']:.2f} → {after['diversity']:.2f}")
    log(f"before/after grid (rows: digits 0-9, same noise): {grid}")
    return {"before": before, "after": after}


# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="pretrain (or reuse) the digits pipeline and classifier")
    b.add_argument("--pretrain_steps", type=int, default=1500)
    b.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    q = sub.add_parser("quickstart", help="build, train 30 V-GRPO iterations, before/after grid")
    q.add_argument("--iterations", type=int, default=30)
    q.add_argument("--run_dir", default="runs/digits-quickstart")
    q.add_argument("--grid", default="runs/digits-quickstart/before_after.png")
    q.add_argument("--seed", type=int, default=0)
    k = sub.add_parser("benchmark", help="lr sweep, claims, ablations, long runs, timing; then the "
                       "report "
                       "(resumable)")
    k.add_argument("--quick", action="store_true",
                   help="1 seed, 3 lrs, 8-iteration sweep, 24-iteration long runs, no ablations "
                   "(default out: runs/digits-quick)")
    k.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    k.add_argument("--workers", type=int, default=2, help="worker processes")
    k.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    k.add_argument("--plan", default=None, choices=tuple(PLANS), help=argparse.SUPPRESS)
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("--out", required=True)
    w.add_argument("--threads", type=int, default=1)
    r = sub.add_parser("report", help="summary.json, markdown and figures from a results folder")
    r.add_argument("--out", default=str(RESULTS))
    r.add_argument("--md", default=None, help="markdown path (default: see report())")
    r.add_argument("--readme", default=None, help="also rewrite this README's digits section")
    a = p.parse_args(argv)
    try:
        if a.cmd == "build":
            build(pretrain_steps=a.pretrain_steps, force=a.force)
        elif a.cmd == "quickstart":
            quickstart(a.iterations, a.run_dir, a.seed, a.grid)
        elif a.cmd == "benchmark":
            out = Path(a.out or ("runs/digits-quick" if a.quick else RESULTS))
            benchmark(out, a.plan or ("quick" if a.quick else "full"), a.workers, a.threads)
        elif a.cmd == "worker":
            torch.set_num_threads(a.threads)
            worker(Path(a.out))
        else:
            report(Path(a.out), md=a.md, readme=a.readme)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
