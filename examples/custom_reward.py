"""A plug-in reward in a few lines: a *verifiable* colour reward.

    python vgrpo.py --model tiny --reward examples.custom_reward:colour_match
    python vgrpo.py --model sd3.5-medium --reward pickscore:1,examples.custom_reward:colour_match:0.5

vgrpo calls `fn(images, prompts)` with images (N, 3, H, W) float in [0, 1] on the training device
and one prompt per image, and expects a tensor (N,) back: higher is better.
"""
import torch

COLOURS = {"red": 0, "green": 1, "blue": 2}


def colour_match(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Mean of the colour channel the prompt names minus the mean of the other two (in [−1, 1]).

    Prompts that name none of red / green / blue score the image's mean saturation instead, so
    every prompt gets a defined reward."""
    rgb = images.float().mean(dim=(2, 3))                       # (N, 3) mean colour per image
    out = rgb.max(dim=1).values - rgb.min(dim=1).values         # saturation fallback
    for i, p in enumerate(prompts):
        named = [c for w, c in COLOURS.items() if w in p.lower()]
        if named:
            c = named[0]
            out[i] = rgb[i, c] - (rgb[i].sum() - rgb[i, c]) / 2
    return out
