"""ImageReward (THUDM) as a vgrpo plug-in reward: the score of `ImageReward.load(...)` per
(prompt, image) pair, as Flow-GRPO's `flow_grpo/imagereward_scorer.py` scores it [peer X10].

    pip install image-reward          # not in requirements.txt: its pins (timm 0.6.13,
                                      # fairscale 0.4.13) clash with open_clip's
    python vgrpo.py --model flux.1-dev --reward hpsv2:1,pickscore:1,examples.rewards.imagereward:score:1
    IMAGEREWARD_MODEL=/path/to/ImageReward.pt python vgrpo.py ...      # offline: a local file

The model is loaded on the first call, on the device of the images it is given, and kept. Its
output is unbounded (about −2 … 2); vgrpo logs it raw, with weight 1 unless the spec says other.
"""
import os

import torch

_MODEL = {}                                   # device → the loaded ImageReward model


def _model(device: torch.device):
    if device not in _MODEL:
        try:
            import ImageReward as RM  # noqa: N813 — the package's own name
        except ImportError:
            raise ImportError("ImageReward needs the optional package `image-reward` (pip install "
                              "image-reward), not in requirements.txt: its pins (timm 0.6.13, "
                              "fairscale 0.4.13) clash with open_clip") from None
        _MODEL[device] = RM.load(os.environ.get("IMAGEREWARD_MODEL", "ImageReward-v1.0"),
                                 device=str(device))
    return _MODEL[device]


@torch.no_grad()
def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """images (N, 3, H, W) in [0, 1], N prompts → (N,) ImageReward scores, one pair at a time."""
    from PIL import Image
    model = _model(images.device)
    u8 = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    pil = [Image.fromarray(im.numpy()) for im in u8.permute(0, 2, 3, 1)]       # (H, W, 3) each
    return torch.tensor([float(model.score(p, im)) for p, im in zip(prompts, pil)])
