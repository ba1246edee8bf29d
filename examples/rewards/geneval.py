"""GenEval as a vgrpo plug-in reward: GenEval's rules (djghosh13/geneval,
`evaluation/evaluate_images.py`) applied to the detections of an in-process COCO instance
segmenter (Mask2Former through transformers) and an open_clip ViT-L/14 colour classifier, with the
partial-credit training reward of flow_grpo / DiffusionNFT [peer X10]. No mmdet, no mmcv.

    python vgrpo.py --model sd3.5-medium --preset geneval-stage \\
        --prompts examples/prompts/geneval_train.jsonl \\
        --eval_prompts examples/prompts/geneval_eval.jsonl \\
        --reward geneval --eval_rewards geneval,examples.rewards.geneval:accuracy

Prompts must come from a .jsonl file whose lines are GenEval metadata (GenEval's
`prompts/evaluation_metadata.jsonl` format: {"tag", "include": [{"class", "count", "color"?,
"position"?}], "exclude"?, "prompt"}); `check_prompts` rejects any other prompt in one line.

Three scorers, each `(images, prompts) -> (N,)` CPU fp32, each a reward name of its own:
    score     `geneval` (= examples.rewards.geneval:score): the partial-credit training reward of
              flow_grpo / DiffusionNFT, below
    accuracy  `examples.rewards.geneval:accuracy`: GenEval's own verdict, 1 or 0, what the benchmark
              averages (`evaluate` in evaluate_images.py)
    strict    `examples.rewards.geneval:strict`: the peers' "strict_correct", 1 or 0: every count met
              exactly, every colour and position right (from `evaluate_reward` in their
              gen_eval.py)
`evaluate` returns all three with GenEval's reason per image; `tag_accuracy` averages them per
tag and over tags as GenEval's `summary_scores.py` does.

Where the models come from, set in the environment (offline: point both at local copies):
    GENEVAL_DETECTOR         Mask2Former COCO instance segmentation, a hub id or a local folder
                             with the model and its image processor
                             (default facebook/mask2former-swin-small-coco-instance)
    GENEVAL_CLIP_ARCH        open_clip architecture: a model name or a JSON config
                             (default ViT-L-14-quickgelu, below)
    GENEVAL_CLIP_CHECKPOINT  an open_clip pretrained tag of that architecture, a file, or
                             owner/repo/path/in/repo on the hub (default "openai")
Both load on the first call, on the images' device, and stay: bf16 on a GPU, fp32 on the CPU.
GenEval loads `ViT-L-14` with pretrained="openai" under open_clip 2.20, whose OpenAI loader builds
the model with QuickGELU; open_clip 3.x builds plain `ViT-L-14` with GELU (and warns), so the
same weights need the name `ViT-L-14-quickgelu` here.

Per image (constants as in evaluate_images.py's defaults [peer X10]):
  1. uint8 by round-and-clamp of the [0, 1] image (flow_grpo `rewards.py`, `geneval_score`).
  2. Detections: Mask2Former, then its instance post-processing (transformers'
     `post_process_instance_segmentation`, redone on the CPU by `instances`) → per instance a
     class, a float32 score (class probability × mean mask probability, as mmdet), a binary mask;
     its box is the mask's tight box [x0, y0, x1 + 1, y1 + 1] (mmdet's mask2bbox). The scores are
     kept as computed: transformers rounds them to 6 decimals, which moves a score within
     5e-7 of 0.3 across the cut below.
  3. Kept per class: score > 0.3 (> 0.9 if the tag is "counting"), compared in float32 as GenEval
     compares mmdet's float32 scores with its threshold (numpy casts the threshold to float32,
     so the cut is float32(0.3) = 0.300000012: a score of exactly float32(0.3) is dropped, and
     0.9's cut is float32(0.9) = 0.899999976); best first, at most 16; the IoU suppression is
     off (max_overlap 1.0).
  4. Colour of an object: its box cropped from the image with everything outside its mask set to
     #999, open_clip's eval transform, argmax over GenEval's 10 colours of the zero-shot
     classifier built from "a photo of a {c} {class}", "a photo of a {c}-colored {class}",
     "a photo of a {c} object" (each text embedding normalised, averaged, normalised).
  5. Position of A relative to B: offset of the box centres, each axis shrunk by 0.1 × (sum of
     the two boxes' sizes on that axis) and kept with its sign; none if both are ~0, else with
     (dx, dy) = shrunk offset / |offset|: "left of" dx < −0.5, "right of" dx > 0.5, "above"
     dy < −0.5, "below" dy > 0.5 (image y points down).
  6. accuracy (GenEval): for each "include" in order, its class's first `count` kept objects
     must exist, all be of the colour if one is asked, and each stand in the relation to every
     object of the include it points at (which must itself have matched); no "exclude" class may
     have `count` or more kept objects.
     score (peers): the mean of one term per include for the number found n (all kept objects of
     the class): 1 − |count − n| / count; then, if a colour or position is asked and n ≠ count,
     a 0; else a colour term 1 − |count − n_colour| / count, and if the colour held and a
     position is asked, 0 when the target include failed, else 0 for a failed pair followed by
     1 (the peers append the 1 after a failure too; kept). "exclude" is not used. n can exceed
     count, so the count term and the score go below 0 (down to 1 − 15/1 = −14 for one asked
     object and 16 found); the peers do not clip, nor does this.
     strict (peers): every n == count, every colour count == count, every position held.

How far this is from the official scorer (mmdet 2.x, the Mask2Former Swin-S COCO checkpoint
mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco_20220504_001756-743b7d99.pth):
  * Different weights. The default detector is transformers' conversion of the Mask2Former
    authors' Swin-S COCO instance model, not mmdet's own training of the same architecture; the
    two detect differently, so counts near a threshold differ.
  * Score calibration. Both compute class probability × mean mask probability over 100 queries
    (top 100 of queries × classes), but from different weights and input sizes, so the same
    0.3 / 0.9 cuts fall at different points. mmdet tests at 1333 × 800 (keep ratio, its base
    config's test pipeline); the transformers processor uses the size in its checkpoint's
    preprocessor_config.json (edit `size` in a local copy to change it). transformers bins mask
    logits on a 384 × 384 grid and upsamples them nearest-neighbour; mmdet upsamples the logits
    bilinearly to the image size, so masks, boxes and mask scores differ by up to a few pixels.
  * NMS. GenEval's default turns its class-wise IoU suppression off (max_overlap 1.0), and so
    does this; mmdet's Mask2Former applies none either. Instances with an empty mask are dropped
    by transformers (mmdet scores them 0, below every threshold, so the same).
  * Precision and crops. bf16 on a GPU (GenEval: CLIP in fp16, detector fp32). The colour crops
    go through PIL and open_clip's own transform as GenEval's do, from the same uint8 image.
  * The peers pass RGB arrays to mmdet's inference_detector, which takes an array as BGR (its
    config's Normalize has to_rgb=True), so their training-time detector sees red and blue
    swapped; GenEval's evaluation reads PNG files (correct channels). This plug-in gives the
    detector RGB, as GenEval's evaluation does.
  Nothing here has been compared with the official scorer on real images (no weights were
  available where it was written); for GenEval numbers to report, use the official scorer.

The official scorer as a reward: run yifan123/reward-server (mmdet, the real checkpoint) in its
own environment, `gunicorn "app_geneval:create_app()"` (port 18085 in its gunicorn.conf.py), and
name it by URL: `--reward http://127.0.0.1:18085/geneval` (partial credit),
`.../geneval_strict`, `.../geneval_accuracy`; examples/rewards/remote_reward.py speaks its protocol.
"""
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.rewards.hub_file import hub_file  # noqa: E402

# ------------------------------------------------------------------------------------------------
# GenEval's constants [peer X10]: evaluate_images.py's option defaults, its COLORS, and its
# object_names.txt (COCO's 80 classes in COCO's contiguous label order, GenEval's spelling).
# ------------------------------------------------------------------------------------------------
THRESHOLD = 0.3             # options "threshold": keep a detection if its score is above this
COUNTING_THRESHOLD = 0.9    # options "counting_threshold": the same, for the tag "counting"
MAX_OBJECTS = 16            # options "max_objects": per class, the best this many
NMS_THRESHOLD = 1.0         # options "max_overlap": 1.0 = no IoU suppression
POSITION_THRESHOLD = 0.1    # options "position_threshold": dead zone, × sum of the box sizes
BACKGROUND = "#999"         # options "bgcolor": fill outside an object's mask in its colour crop
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
CLASSNAMES = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange",
    "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant",
    "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator",
    "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush"]
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}",
                   "a photo of a {c} object")

DETECTOR = "facebook/mask2former-swin-small-coco-instance"
CLIP_ARCH, CLIP_CHECKPOINT = "ViT-L-14-quickgelu", "openai"
BATCH = 16                  # images per detector forward (memory only; results are per image)
_LOADED = {}                # (device, detector, arch, checkpoint) → the models, see _load


class Det(NamedTuple):
    """One detected object. box (x0, y0, x1, y1) in pixels, x1/y1 exclusive; score in [0, 1];
    mask (H, W) bool numpy array or None (then the colour crop is the plain box); colour one of
    COLORS or None (needed only where a rule asks for the colour)."""
    box: tuple
    score: float
    mask: Optional[np.ndarray] = None
    colour: Optional[str] = None


# ------------------------------------------------------------------------------------------------
# The rules: detections + metadata → verdicts. Pure Python/numpy, no model.
# Detections are {class name: [Det, ...]}.
# ------------------------------------------------------------------------------------------------
def check_prompts(prompts: list) -> None:
    """Raise ValueError (one line, naming the first bad prompt) unless every prompt carries usable
    GenEval metadata in `.metadata` (a prompt read from a .jsonl file)."""
    for i, p in enumerate(prompts, 1):
        meta = getattr(p, "metadata", None)
        problem = _metadata_problem(meta)
        if problem and meta is None:
            problem += ("; use a .jsonl prompt file whose lines are GenEval metadata, e.g. "
                        '{"tag": "single_object", "include": [{"class": "cat", "count": 1}], '
                        '"prompt": "a photo of a cat"}')
        if problem:
            raise ValueError(f"prompt {i} ({str(p)[:60]!r}) {problem}")


def _metadata_problem(meta) -> str:
    """What makes `meta` unusable as GenEval metadata, or '' if nothing does."""
    if meta is None:
        return "has no GenEval metadata (a .txt prompt file has none)"
    if not isinstance(meta, dict):
        return f"has metadata of type {type(meta).__name__}, not a JSON object"
    if meta.get("tag") not in TAGS:
        return f"has GenEval tag {meta.get('tag')!r}; expected one of {', '.join(TAGS)}"
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        return 'has no "include" list of objects in its GenEval metadata'
    for key in ("include", "exclude"):
        reqs = meta.get(key, [])
        if not isinstance(reqs, list):
            return f'has a GenEval "{key}" that is not a list'
        for j, req in enumerate(reqs):
            where = f'GenEval "{key}"[{j}]'
            if not isinstance(req, dict) or req.get("class") not in CLASSNAMES:
                cls = req.get("class") if isinstance(req, dict) else req
                return f"has {where} class {cls!r}, not one of GenEval's 80 COCO class names"
            count = req.get("count")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                return f'has {where} "count" {count!r}; expected an integer ≥ 1'
            if key == "include" and "color" in req and req["color"] not in COLORS:
                return f'has {where} "color" {req["color"]!r}; expected one of {", ".join(COLORS)}'
            if key == "include" and "position" in req:
                pos = req["position"]
                if not (isinstance(pos, list) and len(pos) == 2 and pos[0] in RELATIONS
                        and isinstance(pos[1], int) and 0 <= pos[1] < j):
                    return (f'has {where} "position" {pos!r}; expected [relation, index of an '
                            f"earlier include], relation one of {', '.join(RELATIONS)}")
    return ""


def compute_iou(box_a, box_b) -> float:
    """IoU of two boxes in GenEval's inclusive-pixel convention (+1 on each side length)."""
    area = lambda b: max(b[2] - b[0] + 1, 0) * max(b[3] - b[1] + 1, 0)
    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]),
                  min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0


def keep_detections(raw: dict, tag: str) -> dict:
    """GenEval's selection (evaluate_image): per class, score > THRESHOLD (COUNTING_THRESHOLD for
    the tag "counting"), best first, at most MAX_OBJECTS, then greedy IoU suppression at
    NMS_THRESHOLD (off at 1.0). Classes left empty are dropped. {class: [Det]} → same."""
    threshold = COUNTING_THRESHOLD if tag == "counting" else THRESHOLD
    kept = {}
    for cls, dets in _as_dets(raw).items():
        scores = np.array([d.score for d in dets], dtype=np.float32)     # mmdet's scores: float32
        order = np.argsort(scores)[::-1]              # GenEval's own sort: the same order on ties
        keep = above(scores, threshold)
        order = [dets[k] for k in order if keep[k]][:MAX_OBJECTS]
        out = []
        while order:
            best = order.pop(0)
            out.append(best)
            order = [d for d in order
                     if NMS_THRESHOLD == 1 or compute_iou(best.box, d.box) < NMS_THRESHOLD]
        if out:
            kept[cls] = out
    return kept


def above(scores, threshold: float) -> np.ndarray:
    """GenEval's cut, score > threshold, compared in float32: evaluate_images.py compares mmdet's
    float32 score array with a Python float, and numpy casts that float to float32 (NumPy 1's
    value-based casting and NumPy 2's weak scalars alike). scores: floats → bool array."""
    return np.asarray(scores, dtype=np.float32) > np.float32(threshold)


def relative_position(box_a, box_b) -> set:
    """Where box A lies relative to box B: a subset of RELATIONS (GenEval's relative_position)."""
    a = np.asarray(box_a[:4], dtype=np.float64).reshape(2, 2)          # rows (x0, y0), (x1, y1)
    b = np.asarray(box_b[:4], dtype=np.float64).reshape(2, 2)
    offset = a.mean(0) - b.mean(0)                                      # centre A − centre B
    size_sum = np.abs(a[1] - a[0]) + np.abs(b[1] - b[0])                # (w_a + w_b, h_a + h_b)
    shrunk = np.maximum(np.abs(offset) - POSITION_THRESHOLD * size_sum, 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    rel = set()
    if dx < -0.5:
        rel.add("left of")
    if dx > 0.5:
        rel.add("right of")
    if dy < -0.5:
        rel.add("above")
    if dy > 0.5:
        rel.add("below")
    return rel


def _colours(dets: list, cls: str) -> list:
    if any(d.colour is None for d in dets):
        raise ValueError(f"a {cls!r} detection has no colour; give Det.colour where a rule asks "
                         "for the colour (colour_requests says which)")
    return [d.colour for d in dets]


def _colour_reason(req: dict, colours: list, op: str) -> str:
    seen = ", ".join(f"{colours.count(c)} {c}" for c in COLORS if c in colours)
    return (f"expected {req['color']} {req['class']}{op}{req['count']}, found "
            f"{colours.count(req['color'])} {req['color']}; and {seen}")


def _as_dets(dets: dict) -> dict:
    """{class: [Det or (box, score, mask, colour) tuple]} → {class: [Det]}."""
    return {cls: [Det(*d) for d in objs] for cls, objs in dets.items()}


def _position_holds(found: list, targets: list, relation: str) -> tuple[bool, str]:
    """Every (object, target) pair has `relation` (GenEval stops at the first pair that fails)."""
    for obj in found:
        for target in targets:
            rel = relative_position(obj.box, target.box)
            if relation not in rel:
                return False, " and ".join(sorted(rel))
    return True, ""


def geneval_accuracy(dets: dict, meta: dict) -> tuple[bool, str]:
    """GenEval's verdict (`evaluate` in evaluate_images.py): includes are ANDed, evaluated in
    order on each class's first `count` objects; excludes are ORed. Returns (correct, reason)."""
    dets, correct, reason = _as_dets(dets), True, []
    groups = []                                # groups[k]: include k's objects, None if it failed
    for req in meta.get("include", []):
        cls, count = req["class"], req["count"]
        found = dets.get(cls, [])[:count]
        matched = len(found) >= count
        if not matched:
            reason.append(f"expected {cls}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colours = _colours(found, cls)
                if colours.count(req["color"]) < count:
                    matched = False
                    reason.append(_colour_reason(req, colours, ">="))
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    matched = False
                    reason.append(f"no target for {cls} to be {relation}")
                else:
                    matched, seen = _position_holds(found, groups[target], relation)
                    if not matched:
                        reason.append(f"expected {cls} {relation} target, found {seen} target")
        correct &= matched
        groups.append(found if matched else None)
    for req in meta.get("exclude", []):
        n = len(dets.get(req["class"], []))
        if n >= req["count"]:
            correct = False
            reason.append(f"expected {req['class']}<{req['count']}, found {n}")
    return correct, "\n".join(reason)


def geneval_reward(dets: dict, meta: dict) -> tuple[bool, float, str]:
    """The peers' partial credit and strict verdict [peer X10] (`evaluate_reward` in
    NVlabs/DiffusionNFT flow_grpo/gen_eval.py = yifan123/reward-server reward_server/gen_eval.py;
    flow_grpo trains on its score). Returns (strict, score, reason); formula in the module doc."""
    dets, strict, reason, terms = _as_dets(dets), True, [], []
    groups = []                                # as in geneval_accuracy
    for req in meta.get("include", []):
        cls, count = req["class"], req["count"]
        found = dets.get(cls, [])                       # all kept objects, not the first `count`
        matched = True
        terms.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            matched = False
            reason.append(f"expected {cls}=={count}, found {len(found)}")
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                colours = _colours(found, cls)
                terms.append(1 - abs(count - colours.count(req["color"])) / count)
                if colours.count(req["color"]) != count:
                    matched = False
                    reason.append(_colour_reason(req, colours, "=="))
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    matched = False
                    reason.append(f"no target for {cls} to be {relation}")
                    terms.append(0.0)
                else:
                    matched, seen = _position_holds(found, groups[target], relation)
                    if not matched:
                        reason.append(f"expected {cls} {relation} target, found {seen} target")
                        terms.append(0.0)
                    terms.append(1.0)                   # the peers append it after a failure too
        strict &= matched
        groups.append(found if matched else None)
    score = sum(terms) / len(terms) if terms else 0.0
    return strict, score, "\n".join(reason)


def colour_requests(meta: dict) -> dict:
    """{class: n}: both rules read the colour of at most a class's first n kept objects."""
    need = {}
    for req in meta.get("include", []):
        if "color" in req:
            need[req["class"]] = max(need.get(req["class"], 0), req["count"])
    return need


def tag_accuracy(results: list, key: str = "accuracy") -> dict:
    """GenEval's summary (summary_scores.py): the mean of `key` per tag, and "overall" = the mean
    of the per-tag means. results: evaluate()'s dicts."""
    per_tag = {}
    for r in results:
        per_tag.setdefault(r["tag"], []).append(float(r[key]))
    out = {tag: sum(v) / len(v) for tag, v in per_tag.items()}
    if out:
        out["overall"] = sum(out.values()) / len(out)
    return out


# ------------------------------------------------------------------------------------------------
# The models: Mask2Former detections, open_clip colours.
# ------------------------------------------------------------------------------------------------
def _load(device: torch.device) -> dict:
    detector_id = os.environ.get("GENEVAL_DETECTOR", DETECTOR)
    arch = os.environ.get("GENEVAL_CLIP_ARCH", CLIP_ARCH)
    checkpoint = os.environ.get("GENEVAL_CLIP_CHECKPOINT", CLIP_CHECKPOINT)
    key = (device, detector_id, arch, checkpoint)
    if key in _LOADED:
        return _LOADED[key]
    import open_clip
    from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        processor = AutoImageProcessor.from_pretrained(detector_id)
        detector = Mask2FormerForUniversalSegmentation.from_pretrained(detector_id)
    except OSError:
        raise RuntimeError(f"could not load GENEVAL_DETECTOR {detector_id!r} (no network, or not "
                           f"in the local cache); download it (`hf download "
                           f"{detector_id} --local-dir DIR`) and set GENEVAL_DETECTOR=DIR"
                           ) from None
    if detector.config.num_labels != len(CLASSNAMES):
        raise RuntimeError(f"GENEVAL_DETECTOR {detector_id!r} has {detector.config.num_labels} "
                           "classes; GenEval needs a COCO instance-segmentation model (80 classes, "
                           f"COCO's order), e.g. {DETECTOR}")
    name = arch
    if arch.endswith(".json"):                          # a config file: registered under its stem
        open_clip.add_model_config(arch)
        name = Path(arch).stem
    if open_clip.get_pretrained_cfg(name, checkpoint):  # a tag: open_clip fetches it (cached)
        pretrained = checkpoint
    else:
        pretrained = hub_file(checkpoint, "GENEVAL_CLIP_CHECKPOINT")
    try:
        clip, _, transform = open_clip.create_model_and_transforms(name, pretrained=pretrained)
    except RuntimeError as e:
        raise RuntimeError(f"could not load GENEVAL_CLIP_CHECKPOINT {checkpoint!r} for {name} "
                           f"({str(e).splitlines()[0][:120]}); download its weights (for "
                           "'openai': timm/vit_large_patch14_clip_224.openai, "
                           "open_clip_pytorch_model.bin) and set GENEVAL_CLIP_CHECKPOINT="
                           "/path/to/file") from None
    _LOADED[key] = dict(
        processor=processor, detector=detector.eval().requires_grad_(False).to(device, dtype),
        clip=clip.eval().requires_grad_(False).to(device, dtype), transform=transform,
        tokenizer=open_clip.get_tokenizer(name), classifiers={}, device=device, dtype=dtype)
    return _LOADED[key]


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Tight boxes of binary masks as mmdet's mask2bbox: (n, H, W) → (n, 4) float
    [x0, y0, x_last + 1, y_last + 1]; an empty mask gives zeros."""
    n, h, w = masks.shape
    cols, rows = masks.any(dim=1), masks.any(dim=2)                     # (n, W), (n, H)
    boxes = torch.zeros(n, 4)
    for i in range(n):
        xs, ys = torch.where(cols[i])[0], torch.where(rows[i])[0]
        if len(xs) and len(ys):
            boxes[i] = torch.tensor([xs[0], ys[0], xs[-1] + 1, ys[-1] + 1], dtype=torch.float32)
    return boxes


MASK_GRID = 384             # transformers' post-processing bins every mask's logits on this grid


def instances(class_logits: torch.Tensor, mask_logits: torch.Tensor) -> list:
    """Mask2Former's instance post-processing, the steps of transformers'
    post_process_instance_segmentation (itself mmdet's Mask2Former test-time steps) without its
    rounding of the scores to 6 decimals. class_logits (B, Q, C + 1), the last class "no object";
    mask_logits (B, Q, h, w); fp32 on the CPU. Per image: the class probabilities without
    "no object", their top Q over queries × classes; each its query's mask logits bilinearly
    resized to MASK_GRID², the mask where they are > 0, its mean sigmoid over the mask; score =
    class probability × that mean. → per image (labels (k,), scores (k,) float32, masks
    (k, MASK_GRID, MASK_GRID) bool) of the non-empty masks with score above THRESHOLD (`above`),
    in top-k order."""
    n_queries, n_classes = class_logits.shape[1], class_logits.shape[2] - 1
    grids = F.interpolate(mask_logits, size=(MASK_GRID, MASK_GRID), mode="bilinear",
                          align_corners=False)
    out = []
    for logits, grid in zip(class_logits, grids):
        probs = F.softmax(logits, dim=-1)[:, :-1]                       # (Q, C)
        top, index = probs.flatten(0, 1).topk(n_queries, sorted=False)
        labels, query = index % n_classes, torch.div(index, n_classes, rounding_mode="floor")
        m = grid[query]                                                 # (Q, grid, grid)
        binary = (m > 0).float()
        mean_prob = (m.sigmoid().flatten(1) * binary.flatten(1)).sum(1) / (
            binary.flatten(1).sum(1) + 1e-6)
        scores = top * mean_prob
        keep = binary.flatten(1).any(1) & torch.from_numpy(above(scores.numpy(), THRESHOLD))
        out.append((labels[keep], scores[keep], binary[keep].bool()))
    return out


@torch.no_grad()
def detect(models: dict, u8: torch.Tensor) -> list:
    """(N, 3, H, W) uint8 → per image {class: [Det]} of every instance `instances` keeps (score
    above THRESHOLD; unsorted, no colours; keep_detections applies GenEval's selection).

    The post-processing runs on CPU fp32 logits; the kept masks are then resized from the
    MASK_GRID² grid to (H, W) nearest-neighbour and empty ones dropped, which is what
    transformers' target_sizes path does to every query's mask."""
    processor, detector = models["processor"], models["detector"]
    n, _, h, w = u8.shape
    out = []
    for start in range(0, n, BATCH):
        chunk = list(u8[start:start + BATCH].cpu())                     # (3, H, W) uint8 each
        inputs = processor(images=chunk, return_tensors="pt")
        pred = detector(pixel_values=inputs["pixel_values"].to(models["device"], models["dtype"]),
                        pixel_mask=inputs["pixel_mask"].to(models["device"]))
        for labels, scores, masks in instances(pred.class_queries_logits.float().cpu(),
                                               pred.masks_queries_logits.float().cpu()):
            dets = {}
            if len(labels):
                masks = F.interpolate(masks[None].float(), size=(h, w), mode="nearest")[0]
                masks = masks.bool()                                    # (n_inst, H, W)
                for label, score, box, mask in zip(labels.tolist(), scores.tolist(),
                                                   mask_boxes(masks).tolist(), masks):
                    if mask.any():
                        dets.setdefault(CLASSNAMES[label], []).append(
                            Det(tuple(box), score, mask.numpy()))
            out.append(dets)
    return out


def _colour_classifier(models: dict, cls: str) -> torch.Tensor:
    """GenEval's zero-shot colour classifier for one class (clip_benchmark's
    zero_shot_classifier): per colour, the mean of the normalised embeddings of the three
    templates, normalised. → (D, 10) fp32, cached per class."""
    if cls not in models["classifiers"]:
        texts = [t.format(c=c, cls=cls) for c in COLORS for t in COLOR_TEMPLATES]
        emb = models["clip"].encode_text(models["tokenizer"](texts).to(models["device"])).float()
        emb = F.normalize(emb, dim=-1).view(len(COLORS), len(COLOR_TEMPLATES), -1).mean(1)
        models["classifiers"][cls] = F.normalize(emb, dim=-1).T                     # (D, 10)
    return models["classifiers"][cls]


def colour_crop(image, det: Det):
    """GenEval's ImageCrops item: outside the mask filled with BACKGROUND, then the box cropped
    (PIL rounds the box to whole pixels). image: a PIL RGB image. → PIL image."""
    from PIL import Image
    if det.mask is not None:
        image = Image.composite(image, Image.new("RGB", image.size, BACKGROUND),
                                Image.fromarray(det.mask))
    return image.crop(tuple(float(v) for v in det.box[:4]))


@torch.no_grad()
def add_colours(models: dict, u8: torch.Tensor, kept: list, metas: list) -> list:
    """Give each object that a rule will ask the colour of (colour_requests) its CLIP colour."""
    from PIL import Image
    jobs, crops = [], []                                       # (image, class, index), pixels
    for i, (dets, meta) in enumerate(zip(kept, metas)):
        need = {cls: n for cls, n in colour_requests(meta).items() if cls in dets}
        if not need:
            continue
        image = Image.fromarray(u8[i].permute(1, 2, 0).cpu().numpy())  # (H, W, 3) RGB
        for cls, n in need.items():
            for j, det in enumerate(dets[cls][:n]):
                jobs.append((i, cls, j))
                crops.append(models["transform"](colour_crop(image, det)))
    if not jobs:
        return kept
    feats = []
    for start in range(0, len(crops), 64):
        x = torch.stack(crops[start:start + 64]).to(models["device"], models["dtype"])
        feats.append(F.normalize(models["clip"].encode_image(x).float(), dim=-1))
    feats = torch.cat(feats)                                                        # (n, D)
    kept = [dict(d) for d in kept]
    for (i, cls, j), f in zip(jobs, feats):
        colour = COLORS[int((f @ _colour_classifier(models, cls)).argmax())]
        objs = list(kept[i][cls])
        objs[j] = objs[j]._replace(colour=colour)
        kept[i][cls] = objs
    return kept


@torch.no_grad()
def evaluate(images: torch.Tensor, prompts: list) -> list:
    """images (N, 3, H, W) in [0, 1], N prompts with GenEval metadata → N dicts: tag, prompt,
    accuracy (GenEval's verdict), strict, score (the peers' partial credit), reason (GenEval's),
    counts (kept objects per class)."""
    check_prompts(prompts)
    metas = [p.metadata for p in prompts]
    models = _load(images.device)
    u8 = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)  # [peer X10]
    kept = [keep_detections(d, m["tag"]) for d, m in zip(detect(models, u8), metas)]
    kept = add_colours(models, u8, kept, metas)
    results = []
    for dets, meta in zip(kept, metas):
        correct, reason = geneval_accuracy(dets, meta)
        exact, partial, _ = geneval_reward(dets, meta)
        results.append(dict(tag=meta["tag"], prompt=meta["prompt"], accuracy=float(correct),
                            strict=float(exact), score=partial, reason=reason,
                            counts={cls: len(v) for cls, v in dets.items()}))
    return results


def score(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """The training reward `geneval`: the peers' partial credit, ≤ 1 (below 0 when more objects
    are found than asked). (N,) CPU fp32."""
    return torch.tensor([r["score"] for r in evaluate(images, prompts)], dtype=torch.float32)


def accuracy(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """GenEval's own verdict, 1 or 0 per image (what the benchmark averages). (N,) CPU fp32."""
    return torch.tensor([r["accuracy"] for r in evaluate(images, prompts)], dtype=torch.float32)


def strict(images: torch.Tensor, prompts: list) -> torch.Tensor:
    """The peers' strict verdict, 1 or 0 per image (exact counts). (N,) CPU fp32."""
    return torch.tensor([r["strict"] for r in evaluate(images, prompts)], dtype=torch.float32)
