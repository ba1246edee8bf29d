"""JPEG size as a vgrpo plug-in reward: −(kB of the image saved as a quality-95 JPEG) [peer X10].
It needs no weights, so it is the offline smoke reward; vgrpo.py's reward name `jpeg` is this
plug-in (unit "-kB"):

    python vgrpo.py --model tiny --reward jpeg
"""
import io

import torch


def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """images (N, 3, H, W) in [0, 1] → (N,) CPU fp32, −kB each; the prompts are not used."""
    from PIL import Image
    u8 = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    sizes = []
    for im in u8.permute(0, 2, 3, 1):                                           # (H, W, 3) each
        buf = io.BytesIO()
        Image.fromarray(im.numpy()).save(buf, format="JPEG", quality=95)
        sizes.append(-buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)
