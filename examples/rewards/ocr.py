"""OCR as a vgrpo plug-in reward: PP-OCR reads each image, and the reward says how close what it
reads is to the text the prompt asks for between double quotes. Scoring is Flow-GRPO's OCR reward
[peer X10]. vgrpo.py's reward name `ocr` is this plug-in (the SD3.5 OCR stage):

    python vgrpo.py --model sd3.5-medium --reward ocr --preset ocr-stage \\
        --prompts examples/prompts/ocr_train.jsonl --eval_prompts examples/prompts/ocr_eval.jsonl
    python examples/evaluate.py ... --ocr_prompts examples/prompts/ocr_eval.jsonl

It needs `pip install rapidocr-onnxruntime==1.4.4`. Its wheel ships the PP-OCRv4 detection and
recognition models as ONNX files, so nothing is downloaded. The models run on onnxruntime's CPU
provider. On a GPU (images on CUDA), they run on onnxruntime-gpu's CUDAExecutionProvider when
`onnxruntime.get_available_providers()` lists it (`pip uninstall onnxruntime`, then
`pip install onnxruntime-gpu` built for your CUDA); without it they run on the CPU, with no error.
On the CPU, onnxruntime takes as many threads as torch (torch.get_num_threads()).

Where the models come from, set in the environment (default: the ONNX files in the wheel,
ch_PP-OCRv4_det_infer.onnx and ch_PP-OCRv4_rec_infer.onnx):
    OCR_DET_MODEL   a text-detection ONNX file (the peers run en_PP-OCRv3_det)
    OCR_REC_MODEL   a text-recognition ONNX file (the peers run en_PP-OCRv4_rec)
    OCR_REC_KEYS    its character list, one per line (e.g. PaddleOCR's en_dict.txt), when the
                    ONNX file does not embed one

Scoring [peer X10] (yifan123/flow_grpo flow_grpo/ocr.py and flow_grpo/rewards.py `ocr_score`;
NVlabs/DiffusionNFT's copies of both score the same way):
    target = the prompt's text between its first two double quotes, spaces removed, lower-cased
    read   = the recognised pieces with confidence ≥ 0.5, in reading order, joined with "",
             spaces removed, lower-cased
    dist   = 0 if target is a substring of read, else min(Levenshtein(read, target), len(target))
    reward = 1 − dist / len(target)                         in [0, 1]; 1 = the text is all there
A blank image scores 0. Extra text next to the target costs nothing. A prompt without quoted text
is a one-line error (check_prompts).

What differs from the peers, who run PaddleOCR 2.9.1 as PaddleOCR(use_angle_cls=False, lang="en"):
the models (the wheel's Chinese-and-English PP-OCRv4 pair instead of en_PP-OCRv3_det +
en_PP-OCRv4_rec; set OCR_DET_MODEL / OCR_REC_MODEL / OCR_REC_KEYS to ONNX conversions of those to
close the gap) and the runtime (onnxruntime instead of Paddle Inference). Detection and
recognition are set up as PaddleOCR's (PADDLE_DET below, drop_score 0.5, no angle classifier).
"""
import logging
import os
import sys

import numpy as np
import torch

_LOADED = {}               # (use_cuda, threads, det, rec, keys) → a RapidOCR engine
ENV_FILES = {"OCR_DET_MODEL": "det_model_path", "OCR_REC_MODEL": "rec_model_path",
             "OCR_REC_KEYS": "rec_keys_path"}            # variable → RapidOCR's argument
_LOGGERS = ("RapidOCR", "OrtInferSession")        # rapidocr's loggers: info on every load

# [peer X10] PaddleOCR 2.9.1's text system, which the peers run as PaddleOCR(use_angle_cls=False,
# lang="en") (its paddleocr.py, tools/infer/utility.py, tools/infer/predict_det.py). RapidOCR's
# own defaults differ in each of these detection settings, so they are set here.
PADDLE_DET = dict(det_limit_side_len=960, det_limit_type="max",    # longest side ≤ 960
                  det_mean=[0.485, 0.456, 0.406], det_std=[0.229, 0.224, 0.225],
                  det_thresh=0.3, det_box_thresh=0.6, det_unclip_ratio=1.5,
                  det_donot_use_dilation=True, det_score_mode="fast")
DROP_SCORE = 0.5           # PaddleOCR's drop_score: pieces read with less confidence are dropped
                           # (the peers' own filter after it, confidence > 0, drops nothing more)


# ---- scoring (pure) ----------------------------------------------------------------------------
def normalise(text: str) -> str:
    """Spaces removed, then lower-cased, as the peers do to both the target and the read text. Only
    ' ' is removed (not tabs or newlines)."""
    return text.replace(" ", "").lower()


def target_text(prompt: str) -> str:
    """The text to render: the part of the prompt between its first two double quotes, normalised.
    The peers take prompt.split('"')[1]."""
    return normalise(prompt.split('"')[1])


def levenshtein(a: str, b: str) -> int:
    """Edit distance with unit-cost insertions, deletions and substitutions, over code points:
    what the peers' `Levenshtein.distance` (python-Levenshtein) returns, as the two-row dynamic
    programme, so that package is not needed."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))                   # distances from a[:0] to each b[:j]
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1,              # delete ca
                           cur[j - 1] + 1,           # insert cb
                           prev[j - 1] + (ca != cb)))  # substitute (free if equal)
        prev = cur
    return prev[-1]


def ocr_reward(read: str, prompt: str) -> float:
    """One image's reward [peer X10]: 1 − dist / len(target), as `OcrScorer.__call__` in
    yifan123/flow_grpo flow_grpo/ocr.py. `read` is the recognised pieces joined with "" (not yet
    normalised), `prompt` the whole prompt."""
    target, read = target_text(prompt), normalise(read)
    dist = 0 if target in read else levenshtein(read, target)
    dist = min(dist, len(target))                    # a lot of unrelated text costs no more
    return 1 - dist / len(target)


def check_prompts(prompts: list) -> None:
    """Raise ValueError (one line, naming the first bad prompt) unless every prompt has text to
    render: a non-empty span between its first two double quotes."""
    for i, p in enumerate(prompts, 1):
        quotes = p.count('"')
        if quotes >= 2 and target_text(p):
            continue
        problem = {0: "has no text in double quotes to render",
                   1: "has one double quote and no closing one"}.get(
            quotes, "has nothing but spaces between its first two double quotes")
        raise ValueError(f'OCR prompt {i} {problem}: {str(p)[:80]!r}; the reward scores the text '
                         f'between the first pair of double quotes, e.g. a sign that says "open"')


# ---- the engine --------------------------------------------------------------------------------
def to_uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) float in [0, 1], any device → (N, H, W, 3) uint8 RGB numpy [peer X10]: the
    peers' conversion (yifan123/flow_grpo flow_grpo/rewards.py `ocr_score`), done in fp32. The
    peers hand these RGB arrays to PaddleOCR, which takes an array as BGR; RapidOCR also uses an
    array as it is, so the channels reach the models in the same order as the peers'."""
    x = (images.float() * 255).round().clamp(0, 255).to(torch.uint8)   # (N, 3, H, W)
    return x.cpu().numpy().transpose(0, 2, 3, 1)                       # (N, H, W, 3)


def _load(device: torch.device):
    """The RapidOCR engine for this device and these models, built once per process."""
    try:
        import onnxruntime
        from rapidocr_onnxruntime import RapidOCR
        from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess
    except ImportError as e:
        raise ImportError(f"the OCR reward needs rapidocr-onnxruntime ({e}); "
                          "pip install rapidocr-onnxruntime==1.4.4") from None
    use_cuda = (device.type == "cuda"
                and "CUDAExecutionProvider" in onnxruntime.get_available_providers())
    threads = -1 if use_cuda else torch.get_num_threads()
    files = {var: os.environ.get(var) or None for var in ENV_FILES}
    key = (use_cuda, threads, *files.values())
    if key not in _LOADED:
        for var, path in files.items():
            if path and not os.path.isfile(path):
                raise FileNotFoundError(f"{var}={path!r} is not a file; point it at one, or unset "
                                        "it to use the file shipped in rapidocr-onnxruntime")
        for name in _LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        paths = {ENV_FILES[var]: path for var, path in files.items() if path}
        engine = RapidOCR(
            use_cls=False,                       # the peers: use_angle_cls=False, ocr(cls=False)
            text_score=DROP_SCORE,
            # RapidOCR's own resizing and letterboxing before detection: off, PaddleOCR has none
            max_side_len=10**9, min_side_len=0, min_height=0, width_height_ratio=-1,
            intra_op_num_threads=threads,
            det_use_cuda=use_cuda, rec_use_cuda=use_cuda, **PADDLE_DET, **paths)
        # RapidOCR ignores det_limit_side_len under limit_type "max" (it picks 960, 1500 or 2000
        # from the image size); PaddleOCR shrinks the longest side to 960 whatever the size.
        engine.text_det.get_preprocess = lambda max_side: DetPreProcess(
            960, "max", PADDLE_DET["det_mean"], PADDLE_DET["det_std"])
        _LOADED[key] = engine
    return _LOADED[key]


def read_text(engine, image: np.ndarray) -> str:
    """The recognised pieces of one (H, W, 3) uint8 image, in reading order (top to bottom, then
    left to right), those with confidence ≥ 0.5 only, joined with "" [peer X10]."""
    result, _ = engine(np.ascontiguousarray(image))
    return "".join(text for _box, text, _conf in result) if result else ""


@torch.no_grad()
def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """images (N, 3, H, W) in [0, 1], N prompts → (N,) OCR reward in [0, 1], CPU fp32.

    An image the engine fails on scores 0 with a warning, as in the peers (one odd sample must not
    stop a run that would replay it on resume); if every image of the call fails, it raises."""
    check_prompts(prompts)
    engine = _load(images.device)
    rewards, errors = [], []
    for image, prompt in zip(to_uint8_hwc(images), prompts):
        try:
            read = read_text(engine, image)
        except Exception as e:                       # noqa: BLE001 (the peers catch all too)
            last = (str(e).strip().splitlines() or [""])[-1]       # its traceback's last line
            errors.append(f"{type(e).__name__}: {last}")
            rewards.append(0.0)
            continue
        rewards.append(ocr_reward(read, prompt))
    if errors and len(errors) == len(prompts):
        raise RuntimeError(f"OCR failed on all {len(prompts)} images, first: {errors[0]}")
    if errors:
        print(f"ocr reward: OCR failed on {len(errors)} of {len(prompts)} images (scored 0), "
              f"first: {errors[0]}", file=sys.stderr)
    return torch.tensor(rewards, dtype=torch.float32)
