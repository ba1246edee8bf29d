"""The LAION improved aesthetic predictor as a vgrpo plug-in reward: an MLP on the L2-normalised
CLIP ViT-L/14 image features, as ddpo-pytorch's `aesthetic_scorer.py` scores it [peer X10]. The
prompts are not used; the score is about 1–10, logged raw.

    python vgrpo.py --model sd3.5-medium --reward examples.rewards.aesthetic:score
    python vgrpo.py --model sd3.5-medium --reward pickscore --eval_rewards pickscore,examples.rewards.aesthetic:score
    python examples/evaluate.py ... --rewards pickscore,hpsv2,clipscore,examples.rewards.aesthetic:score

Where its two parts come from, set in the environment (offline: point both at local copies):
    AESTHETIC_CLIP     the CLIP model and processor: a hub id or a local folder
                       (default openai/clip-vit-large-patch14)
    AESTHETIC_WEIGHTS  the MLP's state dict: a file, or owner/repo/path/in/repo on the hub
                       (default trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth)

Both are loaded on the first call, on the device of the images it is given, and kept: the CLIP in
bf16 on a GPU and fp32 on the CPU, the MLP in fp32. The images are preprocessed in torch as
vgrpo's CLIP rewards preprocess them (vgrpo.clip_pixels: the processor's shortest-edge resize,
centre crop and normalisation).
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.rewards.hub_file import hub_file  # noqa: E402
from vgrpo import clip_pixels  # noqa: E402

CLIP = "openai/clip-vit-large-patch14"
WEIGHTS = "trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth"
_LOADED = {}                                  # device → (CLIP model, its processor, the MLP)


def head(weights=None) -> torch.nn.Module:
    """The predictor's MLP, its modules named as in the original so that its state dict loads as
    is. weights: a local file (None leaves the MLP randomly initialised)."""
    nn = torch.nn
    mlp = nn.Sequential()
    mlp.layers = nn.Sequential(                                 # 768 → 1024 → 128 → 64 → 16 → 1
        nn.Linear(768, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
        nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))
    if weights is not None:
        mlp.load_state_dict(torch.load(weights, map_location="cpu"))
    return mlp


def _load(device: torch.device):
    if device not in _LOADED:
        from transformers import AutoModel, AutoProcessor
        clip = os.environ.get("AESTHETIC_CLIP", CLIP)
        try:
            processor, model = AutoProcessor.from_pretrained(clip), AutoModel.from_pretrained(clip)
        except OSError:
            raise RuntimeError(f"could not load AESTHETIC_CLIP {clip!r} (no network, or not in the "
                               f"local cache); download it (`hf download {clip} "
                               "--local-dir DIR`) and set AESTHETIC_CLIP=DIR") from None
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        mlp = head(hub_file(os.environ.get("AESTHETIC_WEIGHTS", WEIGHTS), "AESTHETIC_WEIGHTS"))
        _LOADED[device] = (model.eval().requires_grad_(False).to(device, dtype), processor,
                           mlp.eval().requires_grad_(False).to(device, torch.float32))
    return _LOADED[device]


@torch.no_grad()
def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """images (N, 3, H, W) in [0, 1] → (N,) aesthetic scores, CPU fp32; prompts unused."""
    model, processor, mlp = _load(images.device)
    px = clip_pixels(images, processor.image_processor).to(model.dtype)
    f = model.get_image_features(pixel_values=px)
    f = f if torch.is_tensor(f) else f.pooler_output            # transformers ≥ 5 wraps it
    return mlp(F.normalize(f.float(), dim=-1)).squeeze(-1).cpu()
