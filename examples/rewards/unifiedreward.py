"""UnifiedReward (CodeGoat24/UnifiedReward), a VLM judge, as a vgrpo plug-in reward: the model reads
the image and the authors' pointwise image-generation prompt and answers with a
"Final Score:" from 1 to 5, which is the reward [peer X10]. vgrpo.py's reward name
`unifiedreward` is this plug-in (unit "of 5"); the MixGRPO protocol uses it for evaluation only:

    python vgrpo.py --model flux.1-dev --reward hpsv2:1,pickscore:1 \
        --eval_rewards hpsv2,pickscore,unifiedreward
    UNIFIEDREWARD_MODEL=/path/to/UnifiedReward-qwen-7b python vgrpo.py ...     # offline

The model is a Qwen2.5-VL checkpoint loaded with transformers (AutoModelForImageTextToText +
AutoProcessor), as the authors' own transformers script loads it
(CodeGoat24/UnifiedReward `inference_qwen/image_generation/qwen_point_score_image_generation.py`).
Flow-GRPO and DiffusionNFT instead serve `CodeGoat24/UnifiedReward-7b-v1.5` with sglang
(Flow-GRPO `flow_grpo/rewards.py` `unifiedreward_score_sglang`, DiffusionNFT
`flow_grpo/unifiedreward_scorer.py`).
That checkpoint is built on LLaVA-OneVision-7b (its model card), in the LLaVA-NeXT repository's
format rather than transformers' (not tried here); to score with it, serve it as they do.

Environment:
    UNIFIEDREWARD_MODEL           hub id or local folder (default CodeGoat24/UnifiedReward-qwen-7b)
    UNIFIEDREWARD_PROMPT          which of the authors' two pointwise prompts: "elements" (default;
                                  their transformers script's, the model lists each caption element
                                  as 0/1 before its score) or "criteria" (their sglang script's, the
                                  one Flow-GRPO and DiffusionNFT send)
    UNIFIEDREWARD_MAX_NEW_TOKENS  generation cap (default 512, the authors' script's value: the
                                  element list comes before the score, and a cap that cuts it
                                  off leaves no score)
    UNIFIEDREWARD_BATCH           images per generate() call (default 8)

Scoring: greedy decoding (Flow-GRPO and the authors' sglang client send temperature 0). The score
is the first match of the authors' regex `Final Score:\\s*([1-5](?:\\.\\d+)?)`
(`sglang_llava/sglang_inference.py`), in 1…5, not divided by 5. An answer without a match is NaN
for that image, where the peers write 0.0; vgrpo masks non-finite rewards and leaves them out of
the means. The model is loaded on the first call, on the images' device, and kept: bf16 on a GPU,
fp32 on the CPU.
"""
import math
import os
import re
import sys

import torch

MODEL = "CodeGoat24/UnifiedReward-qwen-7b"

# The authors' pointwise image-generation prompts, word for word [peer X10]; {} is the caption.
PROMPTS = {
    # CodeGoat24/UnifiedReward inference_qwen/image_generation/qwen_point_score_image_generation.py
    # (also inference_llava/image_generation/point_score_image_generation.py, after "<image>\n")
    "elements": (
        "You are given a text caption and a generated image based on that caption. Your task is to "
        "evaluate this image based on two key criteria:\n1. Alignment with the Caption: Assess how "
        "well this image aligns with the provided caption. Consider the accuracy of depicted "
        "objects, their relationships, and attributes as described in the caption.\n2. Overall "
        "Image Quality: Examine the visual quality of this image, including clarity, detail "
        "preservation, color accuracy, and overall aesthetic appeal.\nExtract key elements from "
        "the provided text caption, evaluate their presence in the generated image using the "
        "format: 'element (type): value' (where value=0 means not generated, and value=1 means "
        "generated), and assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided "
        "as follows:\nText Caption: [{}]"),
    # CodeGoat24/UnifiedReward sglang_llava/sglang_inference.py (= flow_grpo/rewards.py), without
    # its leading "<image>\n": here the image goes in as the message's image part, before the text
    "criteria": (
        "You are given a text caption and a generated image based on that caption. Your task is to "
        "evaluate this image based on two key criteria:\n1. Alignment with the Caption: Assess how "
        "well this image aligns with the provided caption. Consider the accuracy of depicted "
        "objects, their relationships, and attributes as described in the caption.\n2. Overall "
        "Image Quality: Examine the visual quality of this image, including clarity, detail "
        "preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
        "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\n"
        "Text Caption: [{}]"),
}
# The authors' parser (sglang_llava/sglang_inference.py `_extract_scores`) [peer X10]. Unanchored,
# like theirs: "Final Score: 10" reads as 1, "Final Score: 0" as no score.
FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")
_LOADED = {}                     # (device, location) → (model, processor)


def parse_score(text: str) -> float:
    """The judge's answer → its Final Score (1…5), or NaN when the answer holds none."""
    match = FINAL_SCORE.search(text)
    return float(match.group(1)) if match else math.nan


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if value and not value.isdigit():
        raise ValueError(f"{name}={value!r}: expected a positive whole number")
    return max(1, int(value)) if value else default


def _load(device: torch.device):
    location = os.environ.get("UNIFIEDREWARD_MODEL", MODEL)
    key = (device, location)
    if key not in _LOADED:
        from transformers import AutoModelForImageTextToText, AutoProcessor
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            processor = AutoProcessor.from_pretrained(location)
            model = AutoModelForImageTextToText.from_pretrained(location, dtype=dtype)
        except OSError as e:
            raise RuntimeError(
                f"could not load UNIFIEDREWARD_MODEL {location!r} ({type(e).__name__}); download "
                f"it (`hf download {MODEL}`) and set UNIFIEDREWARD_MODEL=/path/to/"
                "folder") from None
        processor.tokenizer.padding_side = "left"       # batched generation: answers start
        _LOADED[key] = (model.eval().requires_grad_(False).to(device), processor)   # together
    return _LOADED[key]


@torch.no_grad()
def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """images (N, 3, H, W) in [0, 1], N prompts → (N,) Final Scores in 1…5 (NaN where the answer
    holds none), CPU fp32."""
    from PIL import Image
    choice = os.environ.get("UNIFIEDREWARD_PROMPT", "elements")
    if choice not in PROMPTS:
        raise ValueError(f"UNIFIEDREWARD_PROMPT={choice!r}: use one of {', '.join(PROMPTS)}")
    max_new_tokens = _env_int("UNIFIEDREWARD_MAX_NEW_TOKENS", 512)
    batch = _env_int("UNIFIEDREWARD_BATCH", 8)
    model, processor = _load(images.device)
    u8 = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    pil = [Image.fromarray(im.numpy()) for im in u8.permute(0, 2, 3, 1)]       # (H, W, 3) each
    answers = []
    for i in range(0, len(pil), batch):
        texts = [processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"},     # image first, as the authors'
                                          {"type": "text", "text": PROMPTS[choice].format(p)}]}],
            tokenize=False, add_generation_prompt=True) for p in prompts[i:i + batch]]
        inputs = processor(text=texts, images=pil[i:i + batch], padding=True,
                           return_tensors="pt").to(model.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]             # (B, new tokens): left-padded,
        answers += processor.batch_decode(new, skip_special_tokens=True,   # so one offset
                                          clean_up_tokenization_spaces=False)
    scores = [parse_score(a) for a in answers]
    missing = [i for i, s in enumerate(scores) if math.isnan(s)]
    if missing:
        print(f"unifiedreward: {len(missing)} of {len(scores)} answers hold no 'Final Score: 1-5' "
              f"(scored NaN); e.g. image {missing[0]}: {answers[missing[0]][-120:]!r}",
              file=sys.stderr)
    return torch.tensor(scores, dtype=torch.float32)
