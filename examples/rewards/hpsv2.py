"""HPSv2.1 as a vgrpo plug-in reward: cos(image, text) of an open_clip ViT-H-14 that holds the HPS
weights, preprocessed as the HPSv2 repository preprocesses (ResizeMaxSize) [peer X10]. vgrpo.py's
reward name `hpsv2` is this plug-in (FLUX's default reward is `hpsv2:1,pickscore:1`):

    python vgrpo.py --model flux.1-dev --reward hpsv2:1,pickscore:1
    python vgrpo.py --model sd3.5-medium --reward pickscore --eval_rewards pickscore,hpsv2
    python examples/evaluate.py ... --rewards pickscore,hpsv2

Where its parts come from, set in the environment (offline: point HPSV2_CHECKPOINT at a local copy):
    HPSV2_CHECKPOINT  the HPS weights: a file, or owner/repo/path/in/repo on the hub
                      (default xswu/HPSv2/HPS_v2.1_compressed.pt; v2.0: HPS_v2_compressed.pt)
    HPSV2_ARCH        the open_clip architecture: a model name or a JSON config (default ViT-H-14)

The model is loaded on the first call, on the device of the images it is given, and kept: in bf16
on a GPU and fp32 on the CPU. Scores are about 0.25–0.37 (unit "cos" under the name `hpsv2`).
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.rewards.hub_file import hub_file  # noqa: E402

ARCH, CHECKPOINT = "ViT-H-14", "xswu/HPSv2/HPS_v2.1_compressed.pt"
_LOADED = {}                     # (device, arch, checkpoint) → (model, tokenizer, image side)


def hps_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """HPSv2's preprocessing in torch: longest side → size (bicubic, antialiased), zero-pad to a
    square, OpenAI CLIP mean/std. (N, 3, H, W) in [0, 1] → (N, 3, size, size) fp32."""
    import open_clip
    x, (h, w) = images.float(), images.shape[-2:]
    scale = size / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
    top, left = (size - nh) // 2, (size - nw) // 2
    x = F.pad(x, (left, size - nw - left, top, size - nh - top), value=0.0)  # black bars
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    return (x - x.new_tensor(mean).view(1, 3, 1, 1)) / x.new_tensor(std).view(1, 3, 1, 1)


def _load(device: torch.device):
    arch = os.environ.get("HPSV2_ARCH", ARCH)
    checkpoint = os.environ.get("HPSV2_CHECKPOINT", CHECKPOINT)
    key = (device, arch, checkpoint)
    if key not in _LOADED:
        import open_clip
        name = arch
        if arch.endswith(".json"):                    # a config file: registered under its stem
            open_clip.add_model_config(arch)
            name = Path(arch).stem
        ckpt = torch.load(hub_file(checkpoint, "HPSV2_CHECKPOINT"), map_location="cpu",
                          weights_only=False)
        model = open_clip.create_model(name, pretrained=None)
        model.load_state_dict(ckpt.get("state_dict", ckpt))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        size = model.visual.image_size
        if not isinstance(size, int):
            size = size[0]
        _LOADED[key] = (model.eval().requires_grad_(False).to(device, dtype),
                        open_clip.get_tokenizer(name), size)
    return _LOADED[key]


@torch.no_grad()
def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """images (N, 3, H, W) in [0, 1], N prompts → (N,) cos(image, text), CPU fp32."""
    model, tokenizer, size = _load(images.device)
    dtype = next(model.parameters()).dtype
    img = model.encode_image(hps_pixels(images, size).to(dtype), normalize=True)
    txt = model.encode_text(tokenizer(prompts).to(images.device), normalize=True)
    return (img.float() * txt.float()).sum(-1).cpu()
