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
    python examples/digits.py benchmark      # methods × seeds through vgrpo's trainer (resumable)
    python examples/digits.py report         # table, curves and grids from the benchmark's JSON

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
import json
import math
import os
import statistics
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
FAST_RL = dict(iterations=20, flags=["--lr", "5e-3", "--prompts_per_iter", "8"])


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


def eval_set(n_per: int = 10, seed: int = 12345):
    """Held-out prompts (unseen phrasings, every digit) × n_per noises (a stream that training
    never draws).
    Returns (prompts, digits, x1 (10·n_per, 4, 8, 8))."""
    g = torch.Generator().manual_seed(seed)
    prompts, digits = [], []
    for d in range(10):
        for k in range(n_per):
            prompts.append(EVAL_TEMPLATES[k % len(EVAL_TEMPLATES)].format(d=d))
            digits.append(d)
    x1 = torch.randn((len(prompts), 4, RES // 4, RES // 4), generator=g)
    return prompts, torch.tensor(digits), x1


_REAL_FEAT = None


@torch.no_grad()
def sample_metrics(images: torch.Tensor, digits: torch.Tensor) -> dict:
    """Prompt accuracy, reward, within-digit diversity and distance to the nearest real digit.
    images (n, 3, H, W) in [0, 1]. Diversity: mean pairwise L2 distance of classifier features among
    samples of the same digit, relative to the same number for real (train-split) digits (1 = as
    varied as real handwriting; mode collapse → 0). Nearest-real: mean L2 distance from each
    sample's features to the nearest real digit's, relative to the same for real test digits
    (drifting off the data, e.g. reward hacking → up)."""
    global _REAL_FEAT
    clf = classifier()
    if _REAL_FEAT is None:
        xr, yr = real_digits("train")
        xt, _ = real_digits("test")
        fr, ft = clf.features(xr), clf.features(xt)
        nn_test = torch.cdist(ft, fr).min(1).values.mean().item()
        _REAL_FEAT = (fr, yr, _pairwise_div(fr, yr), nn_test)
    fr, yr, div_real, nn_real = _REAL_FEAT
    x = gray(images)
    logits = clf.head(f := clf.features(x))
    p = logits.softmax(1)
    return {"acc": (logits.argmax(1) == digits).float().mean().item(),
            "reward": p[torch.arange(len(digits)), digits].mean().item(),
            "diversity": _pairwise_div(f, digits) / div_real,
            "nn_real": torch.cdist(f, fr).min(1).values.mean().item() / nn_real}


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
# Runs through vgrpo's own trainer: vgrpo.setup + vgrpo.iteration (the loop of vgrpo.train), with a
# held-out evaluation every few iterations instead of the built-in 10-image one.
# ------------------------------------------------------------------------------------------------
# Everything every method shares: the same P × G rollouts per iteration, steps, LoRA and lr
# (vgrpo's SD3 defaults for LoRA rank/alpha and lr). Speed flags are memory knobs only.
COMMON = ["--reward", "examples.digits:reward", "--resolution", str(RES),
          "--max_sequence_length", str(SEQ_LEN), "--num_steps", "10", "--prompts_per_iter", "4",
          "--group_size", "8", "--lr", "2e-3", "--no-gradient_checkpointing", "--micro_batch", "32",
          "--rollout_batch", "64", "--device", "cpu", "--eval_every", "0"]

# name → vgrpo flags (the method as one flag away from the shipped defaults)
METHODS = {
    "V-GRPO (shipped)": [],
    "pair sharing: group": ["--pair_sharing", "group"],
    "pair sharing: none": ["--pair_sharing", "none"],
    "no stratification": ["--no-stratified"],
    "no adaptive weighting": ["--no-adaptive_weighting"],
    "v-parameterisation": ["--parameterization", "v"],
    "soft-clip off": ["--soft_clip_eta", "0"],
    "per-group std": ["--no-global_std"],
    "naive FPO-style": ["--parameterization", "v", "--pair_sharing", "none", "--no-stratified",
                        "--no-adaptive_weighting", "--soft_clip_eta", "0"],
    # examples/flow_grpo_sd3.py's update at Flow-GRPO's published recipes
    "MDP: Flow-GRPO (CFG 4.5)": {"mdp": "cfg4.5"},
}
# Runnable with --methods, not part of the default benchmark (time): Flow-GRPO's no-CFG recipe.
EXTRA_METHODS = {"MDP: Flow-GRPO no-CFG": {"mdp": "nocfg"}}
# The reward-hacking regime: long runs at a high learning rate, with and without the paper's
# controls. The ratio clip and the x-space KL (to θ_old) only act from the second optimizer step
# of an iteration on, so their rows use μ = 2.
HACKING = {
    "unconstrained (soft-clip off)": ["--soft_clip_eta", "0"],
    "soft-clip η = 3 (shipped)": [],
    "ratio clip ε = 0.01, μ = 2": ["--soft_clip_eta", "0", "--mu", "2", "--clip_eps", "0.01"],
    "x-space KL β = 1, μ = 2": ["--soft_clip_eta", "0", "--mu", "2", "--kl_coef", "1"],
}


def vgrpo_flags(folder: Path, seed: int, extra: list[str]) -> list[str]:
    return ["--model", str(folder), "--prompts", str(CACHE / "train_prompts.txt"),
            "--eval_prompts", str(CACHE / "eval_prompts.txt"), "--seed", str(seed), *COMMON, *extra]


def run_method(folder: Path, method: str, flags, seed: int, iterations: int, eval_at: list[int],
               n_per: int = 10, log=print, keep_images: bool = False, base=None) -> dict:
    """One run; returns {"iters": per-iteration vgrpo metrics, "evals": held-out metrics}."""
    if isinstance(flags, dict):
        return run_mdp(folder, flags["mdp"], seed, iterations, eval_at, n_per, log, keep_images,
                       base)
    args = V.parse_args(vgrpo_flags(folder, seed, flags))
    run = V.setup(args)
    return _loop(run.adapter, lambda it: V.iteration(run, it), iterations, eval_at, n_per, method,
                 log, keep_images, base)


def _loop(adapter, step, iterations, eval_at, n_per, method, log, keep_images, base=None,
          cfg=None):
    """Train `iterations` steps, evaluating at eval_at and at the end. `base`: the iteration-0
    evaluation if already computed (LoRA starts at B = 0, so iteration 0 IS the base model)."""
    prompts, digits, x1 = eval_set(n_per)
    out = {"iters": [], "evals": [], "images": {}}
    for it in range(iterations + 1):
        if it in eval_at or it == iterations:
            if it == 0 and base is not None:
                ev, imgs = {"iter": 0, **base[0]}, base[1]
            else:
                imgs = generate(adapter, prompts, x1)
                ev = {"iter": it, **sample_metrics(imgs, digits)}
            if cfg is not None:
                m_cfg = sample_metrics(generate(cfg, prompts, x1), digits)
                ev.update({f"{k}_cfg": v for k, v in m_cfg.items()})
            out["evals"].append(ev)
            if keep_images:
                out["images"][it] = imgs
            log(f"{method:32s} iter {it:3d}  held-out acc {ev['acc']:.3f}  "
                f"reward {ev['reward']:.3f}  diversity {ev['diversity']:.2f}  "
                f"nn-real {ev['nn_real']:.2f}")
        if it == iterations:
            break
        m = step(it)
        out["iters"].append({k: v for k, v in m.items() if isinstance(v, (int, float))})
    return out


def run_mdp(folder, recipe, seed, iterations, eval_at, n_per, log, keep_images, base=None):
    """The Flow-GRPO MDP baseline: examples/flow_grpo_sd3.py's iteration at its published recipe
    (`recipe`: cfg4.5 or nocfg), on the same model, LoRA, optimizer, lr, prompts and P × G.
    Held-out metrics use the same CFG-free ODE sampler as every other row; with CFG, the metrics
    of its own guided ODE sampler are added as *_cfg."""
    sys.path.insert(0, str(Path(__file__).parent))
    import flow_grpo_sd3 as FG
    mine, args = FG.parse(vgrpo_flags(folder, seed, ["--recipe", recipe, "--methods", "flow_grpo"]))
    run = V.setup(args)                                    # LoRA + optimizer exactly as V-GRPO's
    guided = FG.Guided(run.adapter, run.adapter.encode([""]), mine.rec["guidance"])
    f_sigmas = run.adapter.sigmas(mine.flow_steps)

    def step(it):
        return FG.flow_grpo_iteration(mine, args, run.adapter, guided, run.rewards, run.opt,
                                      run.params, run.train_prompts, it, run.D, f_sigmas, run.dev,
                                      run.ctx)

    class WithCFG:                                         # the adapter's seam, guided velocity
        encode, sigmas, decode = run.adapter.encode, run.adapter.sigmas, run.adapter.decode
        velocity = staticmethod(guided.velocity)
    cfg = WithCFG() if guided.forwards == 2 else None
    return _loop(run.adapter, step, iterations, eval_at, n_per, f"MDP ({recipe})", log,
                 keep_images, base, cfg)


def slug(name: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in name.lower()).strip("_")


def _claim(path: Path) -> bool:
    """Take a job for this process (several benchmark processes may share one results folder).
    A claim whose process is gone is taken over, so an interrupted benchmark resumes."""
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


def benchmark(seeds=(0, 1, 2), iterations: int = 20, eval_every: int = 5, hack_iterations: int = 60,
              hack_lr: float = 1e-3, methods=None, hacking: bool = True, out: Path = RESULTS,
              n_per: int = 6, log=print):
    """Every method × seed (seed-major, so machine load hits all methods alike), then the hacking
    runs. One JSON per finished run in `out`; finished runs are skipped (resumable), and several
    processes may run it at once on the same folder (each takes the next unclaimed run)."""
    folder = build(log=log)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grids").mkdir(exist_ok=True)
    eval_at = list(range(0, iterations + 1, eval_every))
    every = {**METHODS, **EXTRA_METHODS}
    jobs = [("main", m, every[m], s, iterations, eval_at)
            for s in seeds for m in (methods or METHODS)]
    if hacking:
        h_at = list(range(0, hack_iterations + 1, 10))
        jobs += [("hacking", m, [*f, "--lr", str(hack_lr)], 0, hack_iterations, h_at)
                 for m, f in HACKING.items()]
    _, digits, _ = eval_set(n_per)
    base = None
    for kind, method, flags, seed, iters, at in jobs:
        path = out / f"{kind}__{slug(method)}__s{seed}.json"
        if path.is_file() or not _claim(path):
            continue
        if base is None:                                   # the base model, evaluated once
            base = heldout_metrics(load_pipe(folder), n_per=n_per, return_images=True)
        t0 = time.perf_counter()
        res = run_method(folder, method, flags, seed, iters, at, n_per=n_per, log=log,
                         keep_images=seed == 0 or kind == "hacking", base=base)
        for it, imgs in res.pop("images").items():
            if it in (0, iters):                           # first and last evaluation only
                grid_image(imgs, digits, n_per, scale=1).save(
                    out / "grids" / f"{kind}__{slug(method)}__s{seed}__it{it}.png", optimize=True)
        res.update(kind=kind, method=method, flags=flags, seed=seed, iterations=iters, n_per=n_per,
                   seconds=time.perf_counter() - t0, threads=torch.get_num_threads(),
                   finished=time.strftime("%Y-%m-%d %H:%M:%S"))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.rename(path)
        path.with_suffix(".claim").unlink(missing_ok=True)
        log(f"-> {path.name} ({res['seconds']:.0f} s)")


# ------------------------------------------------------------------------------------------------
# Pictures with PIL only (no plotting library needed): sample grids and line charts.
# ------------------------------------------------------------------------------------------------
def grid_image(images: torch.Tensor, digits: torch.Tensor, per_digit: int, scale: int = 2):
    """Rows = digits 0-9, `per_digit` samples each; images (n, 3, 32, 32) in [0, 1] → PIL."""
    from PIL import Image
    x = gray(images)[:, 0]
    rows = []
    for d in range(10):
        sel = x[digits == d][:per_digit]
        rows.append(torch.cat(list(sel), dim=1))
    canvas = (torch.cat(rows, dim=0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    im = Image.fromarray(canvas, mode="L")
    return im.resize((im.width * scale, im.height * scale), Image.NEAREST)


def titled(images: list, titles: list[str], gap: int = 12):
    """Side-by-side PIL images with a one-line title above each."""
    from PIL import Image, ImageDraw
    h = max(i.height for i in images) + 18
    w = sum(i.width for i in images) + gap * (len(images) - 1)
    out = Image.new("L", (w, h), 255)
    draw = ImageDraw.Draw(out)
    x = 0
    for im, t in zip(images, titles):
        out.paste(im, (x, 18))
        draw.text((x + 2, 3), t, fill=0)
        x += im.width + gap
    return out


COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
          (0, 0, 0)]


_ASCII_GREEK = {ord("ε"): "eps", ord("β"): "beta", ord("η"): "eta", ord("μ"): "mu"}  # PIL's font


def line_chart(series: dict, title: str, xlabel: str, ylabel: str, size=(520, 360), ylim=None):
    """series: name → (xs, ys[, y_err]). A plain PIL line chart with a legend."""
    from PIL import Image, ImageDraw
    W, H = size
    L, R, T, B = 50, 10, 24, 36
    im = Image.new("RGB", (W, H + 14 * ((len(series) + 1) // 2)), "white")
    d = ImageDraw.Draw(im)
    xs_all = [x for s in series.values() for x in s[0]]
    ys_all = [y for s in series.values() for y in s[1]]
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = ylim or (min(ys_all), max(ys_all))
    if y1 - y0 < 1e-9:
        y1 = y0 + 1
    px = lambda x: L + (x - x0) / max(x1 - x0, 1e-9) * (W - L - R)
    py = lambda y: T + (1 - (y - y0) / (y1 - y0)) * (H - T - B)
    d.rectangle([L, T, W - R, H - B], outline="black")
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        d.line([L - 3, py(yv), L, py(yv)], fill="black")
        d.text((2, py(yv) - 6), f"{yv:.2f}", fill="black")
        xv = x0 + (x1 - x0) * k / 4
        d.line([px(xv), H - B, px(xv), H - B + 3], fill="black")
        d.text((px(xv) - 8, H - B + 5), f"{xv:.0f}", fill="black")
    d.text((L, 5), title, fill="black")
    d.text((W // 2 - 30, H - 16), xlabel, fill="black")
    d.text((L + 4, T + 2), ylabel, fill=(90, 90, 90))
    for i, (name, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        pts = [(px(x), py(min(max(y, y0), y1))) for x, y in zip(s[0], s[1])]
        d.line(pts, fill=c, width=2)
        for p in pts:
            d.ellipse([p[0] - 2, p[1] - 2, p[0] + 2, p[1] + 2], fill=c)
        lx, ly = 8 + (i % 2) * (W // 2), H + 2 + 14 * (i // 2)
        d.line([lx, ly + 6, lx + 14, ly + 6], fill=c, width=3)
        d.text((lx + 18, ly), name.translate(_ASCII_GREEK), fill="black")
    return im


def stack(images: list, horizontal: bool = False):
    from PIL import Image
    if horizontal:
        size = (sum(i.width for i in images), max(i.height for i in images))
        out = Image.new("RGB", size, "white")
        x = 0
        for i in images:
            out.paste(i.convert("RGB"), (x, 0))
            x += i.width
        return out
    out = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    y = 0
    for i in images:
        out.paste(i.convert("RGB"), (0, y))
        y += i.height
    return out


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
    pic = titled([grid_image(imgs0, digits, 8), grid_image(imgs1, digits, 8)],
                 [f"base model: {before['acc']:.0%} correct",
                  f"after {iterations} V-GRPO iterations: {after['acc']:.0%}"])
    Path(grid).parent.mkdir(parents=True, exist_ok=True)
    pic.save(grid)
    log(f"held-out prompt accuracy (10 digits × 10 samples, unseen phrasings and noise): "
        f"{before['acc']:.1%} → {after['acc']:.1%}; reward {before['reward']:.3f} → "
        f"{after['reward']:.3f}; diversity {before['diversity']:.2f} → {after['diversity']:.2f}")
    log(f"before/after grid (rows: digits 0-9, same noise): {grid}")
    return {"before": before, "after": after}


# ------------------------------------------------------------------------------------------------
# Report: the benchmark's JSON → examples/digits.md (tables), examples/digits.png (curves, grids).
# ------------------------------------------------------------------------------------------------
THRESHOLD_RULE = ("half of the base model's remaining held-out error removed: "
                  "acc ≥ base + (1 − base)/2")


def _ms(vals, fmt="{:.3f}"):
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    if not vals:
        return "—"
    m = sum(vals) / len(vals)
    if len(vals) == 1:
        return fmt.format(m)
    sd = (sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    return f"{fmt.format(m)} ± {fmt.format(sd)}"


def _at(res, it, key):
    for e in res["evals"]:
        if e["iter"] == it:
            return e[key]
    return None


def _setup_notes(plan: dict, main: list, hack: list) -> str:
    """The header of digits.md: what was run, from the benchmark's own records."""
    bj = CACHE / "build.json"
    info = json.loads(bj.read_text()) if bj.is_file() else {}
    nan = float("nan")
    flags = " ".join(plan.get("common_flags", COMMON))
    secs = sum(r["seconds"] for r in main + hack)
    start, end = plan.get("started", "?"), max((r["finished"] for r in main + hack), default="?")
    return (
        "# V-GRPO on handwritten digits: results of `python examples/digits.py benchmark`\n\n"
        f"Model: the tiny SD3 pipeline pretrained by `examples/digits.py build` "
        f"({info.get('transformer_params', 0) / 1e6:.2f}M-parameter SD3Transformer2DModel, "
        f"{info.get('recipe', {}).get('pretrain_steps', '?')} rectified-flow steps; VAE "
        f"reconstructions classified {info.get('vae_recon_acc', nan):.1%} correct). Reward: "
        "p(prompted digit) from a conv classifier with "
        f"{info.get('classifier_heldout_acc', nan):.1%} held-out accuracy on real digits. "
        "Every method: vgrpo's own `setup` + `iteration` (the "
        f"MDP rows: examples/flow_grpo_sd3.py's iteration), flags `{flags}` plus the method's own; "
        "LoRA rank 32 / alpha 64 (vgrpo's SD3 default); lr 2e-3 for every method (at 3e-4 V-GRPO "
        "moved an earlier checkpoint of this model by 2 points in 10 iterations, at 2e-3 by "
        "13). Held-out evaluation: the 4 unseen phrasings × "
        f"{plan.get('n_per', 6)} fixed noises per digit ({10 * plan.get('n_per', 6)} images), "
        "deterministic 10-step Euler ODE without CFG for every row (for the CFG recipe, its own "
        "CFG-4.5 sampler is reported too), every "
        f"{plan.get('eval_every', 4)} iterations; iteration 0 is the base model for every method "
        "(LoRA starts at B = 0) and is evaluated once. Diversity: mean pairwise distance of "
        "classifier features within a digit, real digits = 1. nn-real: distance to the nearest "
        "real digit in that feature space, real test digits = 1. Surrogate CV: vgrpo's logged "
        "`surrogate_cv` and `surrogate_cv_group` (CV of S_old over the batch and within groups), "
        "mean over iterations. "
        f"Wall clock: {secs / 60:.0f} min of run time in two processes, {start} → {end}, "
        "on a 2-core machine shared with other jobs (times are only roughly comparable; "
        "iterations are the primary measure).\n\n")


def report(out: Path = RESULTS, md: Path = Path(__file__).with_name("digits.md"),
           png: Path = Path(__file__).with_name("digits.png"), log=print) -> str:
    from PIL import Image
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "plan.json"]
    main = [r for r in runs if r["kind"] == "main"]
    hack = [r for r in runs if r["kind"] == "hacking"]
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {}
    by = {}
    for r in main:
        by.setdefault(r["method"], []).append(r)
    order = [m for m in {**METHODS, **EXTRA_METHODS} if m in by]
    lines = []
    if main:
        base = sum(r["evals"][0]["acc"] for r in main) / len(main)
        thr = base + (1 - base) / 2
        its = sorted({e["iter"] for r in main for e in r["evals"]})
        last = max(its)
        shown = its
        lines.append(f"Threshold (fixed before the runs): {THRESHOLD_RULE}; base {base:.3f} → "
                     f"threshold {thr:.3f}.\n")
        head = (["method", "seeds"] + [f"acc @{i}" for i in shown] +
                [f"reward @{last}", "iters to thr.", "train s to thr.", f"diversity @{last}",
                 f"nn-real @{last}", "surrogate CV", "CV within group", "s / iter (median)"])
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for m in order:
            rs = by[m]
            reach_it, reach_s = [], []
            for r in rs:
                hit = next((e["iter"] for e in r["evals"] if e["acc"] >= thr), None)
                if hit is not None:
                    reach_it.append(hit)
                    reach_s.append(sum(x["time_iter"] for x in r["iters"][:hit]))
            cv = [sum(x["surrogate_cv"] for x in r["iters"]) / len(r["iters"]) for r in rs
                  if r["iters"] and "surrogate_cv" in r["iters"][0]]
            cvg = [sum(x["surrogate_cv_group"] for x in r["iters"]) / len(r["iters"]) for r in rs
                   if r["iters"] and "surrogate_cv_group" in r["iters"][0]]
            spi = [statistics.median(x["time_iter"] for x in r["iters"]) for r in rs if r["iters"]]
            reached = f"{len(reach_it)}/{len(rs)}"
            row = ([m, str(len(rs))] + [_ms([_at(r, i, "acc") for r in rs]) for i in shown] +
                   [_ms([_at(r, last, "reward") for r in rs]),
                    (_ms(reach_it, "{:.1f}") + f" ({reached})") if reach_it
                    else f"not reached (0/{len(rs)})",
                    _ms(reach_s, "{:.0f}") if reach_s else "—",
                    _ms([_at(r, last, "diversity") for r in rs], "{:.2f}"),
                    _ms([_at(r, last, "nn_real") for r in rs], "{:.2f}"),
                    _ms(cv, "{:.3f}"), _ms(cvg, "{:.3f}"), _ms(spi, "{:.2f}")])
            lines.append("| " + " | ".join(row) + " |")
    cfg_rows = [m for m in order if "acc_cfg" in by[m][0]["evals"][0]]
    if cfg_rows:
        lines.append("\nThe CFG recipe's policy sampled as Flow-GRPO samples it (10-step Euler ODE "
                     "with CFG 4.5, same held-out prompts and noise):\n")
        head = ["method", "seeds"] + [f"acc @{i}" for i in shown] + [
            f"reward @{last}", f"diversity @{last}", f"nn-real @{last}"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for m in cfg_rows:
            rs = by[m]
            lines.append("| " + " | ".join(
                [m + ", CFG 4.5 sampler", str(len(rs))] +
                [_ms([_at(r, i, "acc_cfg") for r in rs]) for i in shown] +
                [_ms([_at(r, last, "reward_cfg") for r in rs]),
                 _ms([_at(r, last, "diversity_cfg") for r in rs], "{:.2f}"),
                 _ms([_at(r, last, "nn_real_cfg") for r in rs], "{:.2f}")]) + " |")
    if hack:
        hits = sorted({e["iter"] for r in hack for e in r["evals"]})
        shown = hits
        hack.sort(key=lambda r: list(HACKING).index(r["method"]) if r["method"] in HACKING else 99)
        lines.append(f"\nPast the stable learning rate (seed 0, lr {plan.get('hack_lr', '?')}, "
                     f"{hits[-1]} iterations; held-out acc / diversity at each iteration):\n")
        head = ["run"] + [f"@{i}" for i in shown] + ["peak acc", "final nn-real", "s / iter"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in hack:
            cells = [f"{_at(r, i, 'acc'):.3f} / {_at(r, i, 'diversity'):.2f}" for i in shown]
            peak = max(e["acc"] for e in r["evals"])
            spi = sum(x["time_iter"] for x in r["iters"]) / len(r["iters"])
            lines.append("| " + " | ".join([r["method"], *cells, f"{peak:.3f}",
                                            f"{r['evals'][-1]['nn_real']:.2f}", f"{spi:.2f}"])
                         + " |")
    text = _setup_notes(plan, main, hack) + "\n".join(lines) + "\n"
    charts = []
    if main:
        series = {}
        for m in order:
            rs = by[m]
            xs = [e["iter"] for e in rs[0]["evals"]]
            ys = [sum(_at(r, x, "acc") for r in rs) / len(rs) for x in xs]
            series[m] = (xs, ys)
        charts.append(line_chart(series, "held-out prompt accuracy (mean of "
                                 f"{len(by[order[0]])} seeds)", "iteration", "accuracy"))
    if hack:
        for key, title in (("acc", "4x learning rate: held-out accuracy"),
                           ("diversity", "4x learning rate: within-digit diversity (real = 1)")):
            charts.append(line_chart({r["method"]: ([e["iter"] for e in r["evals"]],
                                                    [e[key] for e in r["evals"]]) for r in hack},
                                     title, "iteration", key))
    pics = []
    gdir = out / "grids"
    want = [("main", "V-GRPO (shipped)", 0, 0, "base model"),
            ("main", "V-GRPO (shipped)", 0, None, "V-GRPO (shipped)"),
            ("main", "MDP: Flow-GRPO (CFG 4.5)", 0, None, "MDP (Flow-GRPO, CFG 4.5)"),
            ("hacking", list(HACKING)[0], 0, None, "unconstrained, long"),
            ("hacking", list(HACKING)[1], 0, None, "soft-clip, long")]
    for kind, m, s, it, title in want:
        found = sorted(gdir.glob(f"{kind}__{slug(m)}__s{s}__it*.png"),
                       key=lambda p: int(p.stem.split("__it")[-1]))
        if found:
            p = found[0] if it == 0 else found[-1]
            pics.append((Image.open(p), f"{title} @{p.stem.split('__it')[-1]}"))
    if charts or pics:
        rows = [stack(charts, horizontal=True)] if charts else []
        if pics:
            big = [p.resize((p.width * 2, p.height * 2), Image.NEAREST) for p, _ in pics]
            rows.append(titled(big, [t for _, t in pics]))
        stack(rows).save(png, optimize=True)
    md.write_text(text)
    log(text)
    return text


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
    k = sub.add_parser("benchmark", help="methods × seeds, then the reward-hacking runs "
                       "(resumable)")
    k.add_argument("--seeds", default="0,1,2")
    k.add_argument("--iterations", type=int, default=16)
    k.add_argument("--hack_iterations", type=int, default=30)
    k.add_argument("--n_per", type=int, default=6, help="held-out samples per digit")
    k.add_argument("--eval_every", type=int, default=4)
    k.add_argument("--hack_lr", type=float, default=8e-3)
    k.add_argument("--no_hacking", action="store_true")
    k.add_argument("--methods", default=None,
                   help="comma-separated method names (default: all of METHODS)")
    k.add_argument("--out", default=str(RESULTS))
    r = sub.add_parser("report", help="tables and figure from the benchmark's JSON")
    r.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    try:
        if a.cmd == "build":
            build(pretrain_steps=a.pretrain_steps, force=a.force)
        elif a.cmd == "quickstart":
            quickstart(a.iterations, a.run_dir, a.seed, a.grid)
        elif a.cmd == "benchmark":
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            if not (out / "plan.json").is_file():         # written once, before the first run
                (out / "plan.json").write_text(json.dumps(dict(
                    threshold=THRESHOLD_RULE, seeds=a.seeds, iterations=a.iterations,
                    hack_iterations=a.hack_iterations, hack_lr=a.hack_lr, common_flags=COMMON,
                    n_per=a.n_per, eval_every=a.eval_every,
                    methods=METHODS, hacking=HACKING, started=time.strftime("%Y-%m-%d %H:%M:%S")),
                    indent=1))
            methods = [m.strip() for m in a.methods.split(",")] if a.methods else None
            every = {**METHODS, **EXTRA_METHODS}
            if methods and set(methods) - set(every):
                raise ValueError(f"--methods: unknown {sorted(set(methods) - set(every))}; "
                                 f"choose from {list(every)}")
            benchmark(tuple(int(s) for s in a.seeds.split(",")), a.iterations, methods=methods,
                      hack_iterations=a.hack_iterations, hack_lr=a.hack_lr,
                      hacking=not a.no_hacking,
                      out=out, n_per=a.n_per, eval_every=a.eval_every)
            report(out)
        else:
            report(Path(a.out))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
