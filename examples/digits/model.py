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

The committed build is `examples/digits/model/` (the default cache; VGRPO_DIGITS_CACHE names
another). Commands (from the repository root; `python -m examples.digits --help` lists them):

    python -m examples.digits quickstart     # 30 V-GRPO iterations through vgrpo.py on the
                                             # committed model, before/after grid + accuracy
    python -m examples.digits build          # the pretrained folder + classifier (reused if built)
    python -m examples.digits benchmark      # V-GRPO against DiffusionNFT and MixGRPO (resumable)
    python -m examples.digits report         # examples/digits/report.md from the committed runs

    # the folder is an ordinary diffusers pipeline; train on it with vgrpo.py itself:
    python vgrpo.py --model examples/digits/model/pipeline --reward examples.digits:reward \\
        --prompts examples/digits/model/train_prompts.txt \\
        --eval_prompts examples/digits/model/eval_prompts.txt \\
        --resolution 32 --max_sequence_length 32 --num_steps 10 ...   (see docs/benchmarks.md)

`--max_sequence_length` must be the T5 length the model was pretrained with (32): SD3 pads T5 to
that length and the transformer attends over the padding, so another length moves every prompt
embedding and prompt accuracy collapses to chance.

This module is what the reward plug-in `examples.digits:reward` runs; the benchmark (bench.py),
its statistics (stats.py) and its report (report.py) are imported only by their commands.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # everything here is built offline
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch
import torch.nn as nn
import torch.nn.functional as F

import vgrpo as V
TM = V.tiny_models()                                  # the offline tokenizer builders

MODEL = Path(__file__).with_name("model")            # the committed build every run shares
CACHE = Path(os.environ.get("VGRPO_DIGITS_CACHE", MODEL))
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


def encode_prompts(pipe, prompts: list[str], grad: bool = False) -> dict:
    """Text conditioning exactly as vgrpo's SD3Adapter computes it (CFG-free, T5 length SEQ_LEN);
    grad: keep the graph (pretraining with trainable text encoders)."""
    with contextlib.nullcontext() if grad else torch.no_grad():
        pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                              device="cpu", do_classifier_free_guidance=False,
                                              max_sequence_length=SEQ_LEN)
    return {"prompt_embeds": pe, "pooled": pooled}


def _pretrain_batch(z, y, g, batch: int, n_templates: int, t_density: str):
    """One rectified-flow batch: (x_t, t, target ε − x0, text-table rows). 10 % of the rows get
    the empty prompt (the last row of the table), which keeps an unconditional model for CFG."""
    i = torch.randint(len(y), (batch,), generator=g)
    row = y[i] * n_templates + torch.randint(n_templates, (batch,), generator=g)
    row[torch.rand(batch, generator=g) < 0.1] = 10 * n_templates            # the empty prompt
    x0 = z[i]
    eps = torch.randn(x0.shape, generator=g)
    if t_density == "logit_normal":
        t = torch.sigmoid(torch.randn(batch, generator=g))
    else:
        t = torch.rand(batch, generator=g)
    xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
    return xt, t, eps - x0, row


def pretrain(pipe, steps: int, seed: int = 0, batch: int = 32, lr: float = 1e-3,
             t_density: str = "logit_normal", train_text: bool = False):
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
    texts = [t.format(d=d) for d in range(10) for t in TRAIN_TEMPLATES] + [""]   # (10·T + 1)
    table = encode_prompts(pipe, texts)
    tr.train().requires_grad_(True)
    params = list(tr.parameters())
    encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
    if train_text:
        for m in encoders:
            m.train().requires_grad_(True)
            params += list(m.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    # linear warm-up over 50 steps, then constant: a shorter budget is a prefix of a longer one
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    bar = tqdm(range(steps), desc="pretraining", unit="step")
    for step in bar:
        xt, t, target, row = _pretrain_batch(z, y, g, batch, len(TRAIN_TEMPLATES), t_density)
        if train_text:                       # the encoders move: encode the table again
            table = encode_prompts(pipe, texts, grad=True)
        v = tr(hidden_states=xt, timestep=t * 1000,
               encoder_hidden_states=table["prompt_embeds"][row],
               pooled_projections=table["pooled"][row], return_dict=False)[0]
        loss = F.mse_loss(v, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    for m in [tr, *encoders]:
        m.eval().requires_grad_(False)
    return pipe


# ------------------------------------------------------------------------------------------------
# Building / caching.
# ------------------------------------------------------------------------------------------------
def build(cache: Path | None = None, pretrain_steps: int = 1500, vae_steps: int = 300,
          clf_steps: int = 400, seed: int = 0, force: bool = False, log=print,
          pretrain_lr: float = 1e-3, layers: int = 4, heads: int = 4,
          t_density: str = "logit_normal", train_text: bool = False) -> Path:
    """Make (or reuse) cache/pipeline (diffusers folder), cache/classifier.pt and the prompt files.
    Returns the pipeline folder. Reused only if it was built with the same budgets and seed; each
    stage (classifier, VAE) is also cached on its own recipe. cache: default CACHE, read at the
    call (VGRPO_DIGITS_CACHE, or the one a test set). The committed build (MODEL) is never
    overwritten: another recipe needs another cache."""
    global _CLF
    cache = Path(cache) if cache is not None else CACHE
    recipe = dict(pretrain_steps=pretrain_steps, pretrain_lr=pretrain_lr, vae_steps=vae_steps,
                  clf_steps=clf_steps, seed=seed, layers=layers, heads=heads, t_density=t_density,
                  train_text=train_text, seq_len=SEQ_LEN, templates=TRAIN_TEMPLATES, version=1)
    info_path = cache / "build.json"
    if not force and info_path.is_file() \
            and json.loads(info_path.read_text()).get("recipe") == recipe:
        log(f"reusing the pretrained digits model in {cache}")
        return cache / "pipeline"
    if cache.resolve() == MODEL.resolve():
        raise ValueError(f"{MODEL} is the committed build every benchmark run shares; set "
                         "VGRPO_DIGITS_CACHE to another folder to build another model")
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    clf, clf_acc = _cached_classifier(cache, clf_steps, seed, force, log)
    _CLF = clf
    t1 = time.perf_counter()
    vae, rec_acc = _cached_vae(cache, vae_steps, seed, force, clf, log)
    t2 = time.perf_counter()
    pipe = new_pipeline(vae, seed, layers, heads)
    n_par = sum(p.numel() for p in pipe.transformer.parameters())
    log(f"transformer: {n_par / 1e6:.2f}M parameters; rectified-flow pretraining, "
        f"{pretrain_steps} steps")
    pretrain(pipe, pretrain_steps, seed, lr=pretrain_lr, t_density=t_density,
             train_text=train_text)
    t3 = time.perf_counter()
    _save_pipeline(pipe, cache)
    base = heldout_metrics(load_pipe(cache / "pipeline"), n_per=10)
    info = dict(recipe=recipe, classifier_heldout_acc=clf_acc, vae_recon_acc=rec_acc,
                transformer_params=n_par, base=base,
                seconds=dict(classifier=t1 - t0, vae=t2 - t1, pretrain=t3 - t2))
    info_path.write_text(json.dumps(info, indent=2))
    log(f"base model: held-out prompt accuracy {base['acc']:.3f}, reward {base['reward']:.3f} "
        f"(10 digits × 10 samples: unseen phrasings and noise); built in "
        f"{time.perf_counter() - t0:.0f} s")
    return cache / "pipeline"


def _cached_classifier(cache: Path, steps: int, seed: int, force: bool, log):
    """(classifier, its held-out accuracy): cache/classifier.pt if built with the same recipe."""
    stage = cache / "classifier.json"
    if not force and stage.is_file():
        info = json.loads(stage.read_text())
        if info["steps"] == steps and info["seed"] == seed:
            clf = DigitClassifier()
            clf.load_state_dict(torch.load(cache / "classifier.pt", map_location="cpu"))
            log(f"reusing the classifier in {cache} (held-out accuracy "
                f"{info['heldout_acc']:.4f})")
            return clf.eval().requires_grad_(False), info["heldout_acc"]
    clf, acc = train_classifier(steps, seed, log)
    torch.save(clf.state_dict(), cache / "classifier.pt")
    stage.write_text(json.dumps(dict(steps=steps, seed=seed, heldout_acc=acc)))
    return clf, acc


def _cached_vae(cache: Path, steps: int, seed: int, force: bool, clf, log):
    """(VAE, the share of its held-out reconstructions the classifier gets right): cache/vae if
    built with the same recipe, else trained."""
    from diffusers import AutoencoderKL
    stage = cache / "vae.json"
    if not force and stage.is_file() \
            and json.loads(stage.read_text()) == dict(steps=steps, seed=seed):
        vae = AutoencoderKL.from_pretrained(cache / "vae").eval().requires_grad_(False)
        log(f"reusing the VAE in {cache}")
    else:
        vae = train_vae(steps, seed, log)
        vae.save_pretrained(cache / "vae")
        stage.write_text(json.dumps(dict(steps=steps, seed=seed)))
    xt, yt = real_digits("test")
    with torch.no_grad():
        rec = vae.decode(vae.encode(to_rgb(xt)).latent_dist.mean).sample
        rec = (rec.mean(1, keepdim=True) + 1) / 2
        acc = (clf(rec.clamp(0, 1)).argmax(1) == yt).float().mean().item()
    log(f"vae: reconstructions of the held-out digits classified {acc:.4f} correct")
    return vae, acc


def _save_pipeline(pipe, cache: Path) -> None:
    """cache/pipeline (written beside, then renamed into place) and the two prompt files."""
    import shutil
    tmp = cache / "pipeline.tmp"
    pipe.save_pretrained(tmp)
    if (cache / "pipeline").exists():
        shutil.rmtree(cache / "pipeline")
    tmp.rename(cache / "pipeline")
    (cache / "train_prompts.txt").write_text("\n".join(prompts_of(TRAIN_TEMPLATES)) + "\n")
    (cache / "eval_prompts.txt").write_text("\n".join(prompts_of(EVAL_TEMPLATES)) + "\n")


# The tests' V-GRPO run on the committed model (test_digits.py): the shipped recipe at lr 3e-3
# for 12 iterations. Held-out prompt accuracy on 200 images (n_per=20), 1 thread: 0.715 before;
# 0.86 (seed 0) and 0.84 (seed 2) after 12 iterations, 0.81 (seed 1) after 10; chance is 0.10.
FAST_RL = dict(iterations=12, flags=["--lr", "3e-3"])
# A build in seconds, for the tests of the build path only: it learns next to nothing.
TINY_BUILD = dict(clf_steps=4, vae_steps=2, pretrain_steps=4, layers=1, heads=2)


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
            raise RuntimeError(f"{path} not found: run `python -m examples.digits build` first "
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
# The flags every digits run shares (the quickstart's and every method's of the benchmark).
# ------------------------------------------------------------------------------------------------
# The same P × G rollouts per iteration, steps and LoRA (vgrpo's SD3 defaults for rank/alpha).
# --lr here is the quickstart's; benchmark runs append their own.
COMMON = ["--reward", "examples.digits:reward", "--resolution", str(RES),
          "--max_sequence_length", str(SEQ_LEN), "--num_steps", "10", "--prompts_per_iter", "4",
          "--group_size", "8", "--lr", "2e-3", "--no-gradient_checkpointing", "--micro_batch", "32",
          "--rollout_batch", "64", "--device", "cpu", "--eval_every", "0"]


def vgrpo_flags(folder: Path, seed: int, extra: list[str]) -> list[str]:
    """vgrpo.py's flags for a run on the pretrained folder: its prompt files, COMMON, `extra`."""
    return ["--model", str(folder), "--prompts", str(CACHE / "train_prompts.txt"),
            "--eval_prompts", str(CACHE / "eval_prompts.txt"), "--seed", str(seed), *COMMON, *extra]


# ------------------------------------------------------------------------------------------------
# Pictures of samples: a grid per digit (PNG) and the quickstart's before/after figure.
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


def before_after_figure(imgs0, imgs1, digits, titles: list[str], path: Path, per_digit: int = 8):
    """Two sample grids side by side (rows: digits 0-9, same noise), matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
