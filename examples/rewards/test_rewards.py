"""Tests of the curriculum's reward plug-ins in examples/rewards/: OCR with the real PP-OCRv4
models, GenEval's rules and its loading path, the reward-server client against a loopback server,
UnifiedReward on a tiny Qwen2.5-VL. CPU only, offline: `python -m pytest -q examples/rewards`.

The other plug-ins here (hpsv2, aesthetic, imagereward, jpeg) run through the trainer in
test_vgrpo.py, "Rewards: every code path on tiny models built offline". Every test carries one
tier marker (pytest.ini); shared helpers are in the repository's conftest.py.
"""
import contextlib
import http.server
import io
import json
import math
import pickle
import re
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import vgrpo as V


# ------------------------------------------------------------------------------------------------
# The curriculum's rewards: OCR, GenEval, a reward server, UnifiedReward
# ------------------------------------------------------------------------------------------------
# examples/rewards/ocr.py: the OCR reward (PP-OCRv4 through rapidocr-onnxruntime, Flow-GRPO's scoring)
from examples.rewards import ocr as OCR  # noqa: E402


@pytest.mark.examples
def test_ocr_scoring_matches_hand_computed_values():
    """Target extraction, normalisation, edit distance, the substring rule and the cap at
    len(target) give Flow-GRPO's reward 1 − dist/len(target) on hand-worked cases."""
    p = 'a neon sign that says "Hello World" next to "Other"'
    assert OCR.target_text(p) == "helloworld"                     # first pair only, normalised
    assert OCR.target_text('"A B"') == "ab"
    assert OCR.normalise(" Open  Late\tX ") == "openlate\tx"        # only ' ' goes, like the peers
    # Levenshtein: textbook values, symmetric, empty strings
    for a, b, d in [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "", 3),
                    ("", "", 0), ("same", "same", 0), ("ab", "ba", 2), ("hello", "jello", 1)]:
        assert OCR.levenshtein(a, b) == d and OCR.levenshtein(b, a) == d, (a, b)
    # substring rule: the target inside more text is dist 0, whatever surrounds it
    assert OCR.ocr_reward("SALE! Hello World 50% off", p) == 1.0
    assert OCR.ocr_reward("HELLOWORLD", p) == 1.0
    # one substitution: "hellowurld" vs "helloworld" → 1 − 1/10
    assert OCR.ocr_reward("Hello Wurld", p) == pytest.approx(0.9)
    # two deletions: "helowrld" → 1 − 2/10
    assert OCR.ocr_reward("helo wrld", p) == pytest.approx(0.8)
    # nothing read: dist = len(target) → 0
    assert OCR.ocr_reward("", p) == 0.0
    # lots of unrelated text: Levenshtein 25 > len("open") = 4, capped at 4 → 0, not negative
    assert OCR.levenshtein("zzzzzzzzzzzzzzzzzzzzzzzzz", "open") == 25
    assert OCR.ocr_reward("zzzzzzzzzzzzzzzzzzzzzzzzz", 'a door sign "open"') == 0.0
    # a near miss with extra text: "opxnhours" vs "open": substitute e→x, delete "hours" → 6,
    # capped at 4 → 0; "opxn" alone → 1 − 1/4
    assert OCR.ocr_reward("opxn hours", 'a door sign "open"') == 0.0
    assert OCR.ocr_reward("opxn", 'a door sign "open"') == pytest.approx(0.75)


@pytest.mark.examples
def test_ocr_images_reach_the_engine_as_the_peers_uint8_rgb():
    """Float (N, 3, H, W) images become (N, H, W, 3) uint8 RGB by ×255, round, clamp, as
    flow_grpo/rewards.py does, so the engine sees the channel order the peers' PaddleOCR saw."""
    x = torch.zeros(2, 3, 2, 3)
    x[0, 0] = 1.0                                    # image 0 pure red
    x[1, :, 0, 0] = torch.tensor([0.5, 1.2, -0.1])   # 127.5 rounds half to even → 128; clamped
    x[1, :, 1, 2] = torch.tensor([0.2, 0.4, 0.6])    # 51, 102, 153
    out = OCR.to_uint8_hwc(x.to(torch.bfloat16).float())
    assert out.dtype == np.uint8 and out.shape == (2, 2, 3, 3)
    assert (out[0, ..., 0] == 255).all() and (out[0, ..., 1:] == 0).all()   # R first: RGB
    assert out[1, 0, 0].tolist() == [128, 255, 0]
    assert out[1, 1, 2].tolist() == [51, 102, 153]


@pytest.mark.examples
def test_ocr_check_prompts_names_the_first_prompt_without_text_in_quotes(capsys):
    """A prompt with no quoted text (none, an unclosed quote, or only spaces in quotes) is a
    one-line ValueError naming it by number; vgrpo.py turns it into a ConfigError before loading."""
    OCR.check_prompts(['a sign that says "open"', 'a mug with "A" on it'])    # fine
    cases = [(['a sign "open"', "a blank sign"], r"^OCR prompt 2 has no text in double quotes "
                                                 r"to render: 'a blank sign'; .*\"open\"$"),
             (['a sign "open'], r"^OCR prompt 1 has one double quote and no closing one"),
             (['a sign "   " here'], r"^OCR prompt 1 has nothing but spaces between")]
    for prompts, pattern in cases:
        with pytest.raises(ValueError) as e:
            OCR.check_prompts(prompts)
        assert re.search(pattern, str(e.value)) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="OCR prompt 1 has no text"):
        OCR.score(torch.ones(1, 3, 8, 8), ["a blank sign"])
    fn = V.plugin_reward(V.REWARD_PLUGINS["ocr"])
    assert fn.check_prompts is OCR.check_prompts
    with pytest.raises(V.ConfigError, match=r"^reward 'ocr': OCR prompt 1 has no text in double"):
        V.probe_reward("ocr", fn, 32, torch.device("cpu"), ["a blank sign", 'a "b"'])


@pytest.mark.examples
def test_ocr_scores_an_image_the_engine_fails_on_as_zero_and_raises_if_all_fail(monkeypatch,
                                                                                 capsys):
    """As in the peers, an image the OCR engine raises on scores 0 (with a warning on stderr);
    when every image of a call fails (a broken install), score raises instead of returning 0s."""
    def engine(image):
        if image[0, 0, 0] == 0:
            raise RuntimeError("Traceback ...\nONNXRuntimeError: bad input")
        return [[None, "Hello", 0.9], [None, " World", 0.8]], None
    monkeypatch.setattr(OCR, "_load", lambda device: engine)
    imgs = torch.ones(2, 3, 4, 4)
    imgs[1] = 0
    got = OCR.score(imgs, ['"hello world"', '"hello world"'])
    assert got.dtype == torch.float32 and got.tolist() == [1.0, 0.0]
    assert "OCR failed on 1 of 2 images (scored 0), first: RuntimeError: ONNXRuntimeError: bad " \
           "input" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="OCR failed on all 1 images"):
        OCR.score(imgs[1:], ['"hello world"'])


def _ocr_render(text: str, size=(512, 128), font_size=64) -> torch.Tensor:
    """`text` in black, centred on a white size[0]×size[1] image, as (3, H, W) float in [0, 1].
    Pillow's own scalable font (Pillow ≥ 10.1), so no system font is needed."""
    from PIL import Image, ImageDraw, ImageFont
    try:
        font = ImageFont.load_default(size=font_size)
    except TypeError:                                # Pillow < 10.1: a fixed 11-px bitmap font
        pytest.skip("needs Pillow >= 10.1 for a scalable default font")
    im = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(im)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - (right - left)) / 2 - left, (size[1] - (bottom - top)) / 2 - top),
              text, fill="black", font=font)
    return torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255


@pytest.mark.examples
def test_ocr_reward_with_the_real_pp_ocr_models_ranks_exact_misspelt_blank():
    """The shipped PP-OCRv4 ONNX models read "hello world" rendered at 64 px (Pillow's font) on a
    512×128 white image: reward ≥ 0.9, above a misspelling, above a blank image (exactly 0).
    0.9 allows one misread character of the 10 (another onnxruntime build, another font version);
    a wrong channel order, resize or threshold costs far more. The misspelling "helo wrld" is two
    deletions, 0.8 if read exactly; extra text around the target still scores 1."""
    pytest.importorskip("rapidocr_onnxruntime")
    prompt = 'a shop sign that says "hello world"'
    imgs = torch.stack([_ocr_render("hello world"), _ocr_render("helo wrld"),
                        torch.ones(3, 128, 512), _ocr_render("say hello world", font_size=48)])
    assert imgs.shape == (4, 3, 128, 512)
    got = V.plugin_reward(V.REWARD_PLUGINS["ocr"])(imgs, [prompt] * 4)
    assert got.shape == (4,) and got.dtype == torch.float32
    exact, misspelt, blank, extra = got.tolist()
    assert exact >= 0.9 and exact > misspelt > blank == 0.0, got
    assert misspelt == pytest.approx(0.8, abs=0.1) and extra == 1.0, got
    engine = OCR._load(torch.device("cpu"))
    assert OCR._load(torch.device("cpu")) is engine                # loaded once per process
    assert engine.use_cls is False and engine.text_score == 0.5    # as the peers' PaddleOCR


def _paddle_det_size(h: int, w: int, limit: int = 960) -> tuple:
    """PaddleOCR's detector input size (DetResizeForTest, limit_type "max"): the longest side
    shrunk to `limit` if longer (never enlarged), then each side rounded to a multiple of 32."""
    ratio = min(1.0, limit / max(h, w))
    return tuple(max(int(round(int(n * ratio) / 32) * 32), 32) for n in (h, w))


@pytest.mark.examples
def test_ocr_a_1024_px_image_reaches_the_detector_at_most_960_px_and_is_read(monkeypatch):
    """SD3.5's 1024 × 1024 and 1344 × 768 images (larger than the other tests' 512 × 128) reach
    the real PP-OCRv4 detector as PaddleOCR's rule makes them (longest side 960, sides multiples
    of 32: 960 × 960 and 544 × 960), normalised with PaddleOCR's mean and std; the text is read
    (reward 1) and the boxes come back in the image's own pixels, centred on the drawn text. A
    512 × 128 image goes in unresized."""
    pytest.importorskip("rapidocr_onnxruntime")
    engine = OCR._load(torch.device("cpu"))
    seen, infer = [], engine.text_det.infer
    monkeypatch.setattr(engine.text_det, "infer", lambda x: seen.append(x) or infer(x))
    prompt = 'a shop sign that says "hello world"'
    white = (1 - np.array(OCR.PADDLE_DET["det_mean"])) / np.array(OCR.PADDLE_DET["det_std"])
    for (w, h), font_size in (((1024, 1024), 96), ((1344, 768), 80), ((512, 128), 64)):
        img = _ocr_render("hello world", size=(w, h), font_size=font_size)
        seen.clear()
        assert OCR.score(img[None], [prompt]).tolist() == [1.0], (w, h)
        assert [x.shape for x in seen] == [(1, 3, *_paddle_det_size(h, w))], (w, h)
        np.testing.assert_allclose(seen[0][0, :, 0, 0], white, rtol=1e-5)
        result, _ = engine(OCR.to_uint8_hwc(img[None])[0])
        boxes = np.array([box for box, _text, _conf in result])          # (k, 4, 2) x, y
        ys, xs = np.where(img[0].numpy() < 0.5)                          # the drawn text
        centre = (boxes[..., 0].min() + boxes[..., 0].max()) / 2, \
            (boxes[..., 1].min() + boxes[..., 1].max()) / 2
        assert abs(centre[0] - (xs.min() + xs.max()) / 2) < 8, (w, h, centre)
        assert abs(centre[1] - (ys.min() + ys.max()) / 2) < 8, (w, h, centre)


@pytest.mark.examples
def test_ocr_model_files_come_from_the_environment(monkeypatch, tmp_path):
    """OCR_DET_MODEL / OCR_REC_MODEL / OCR_REC_KEYS name the ONNX files (and character list)
    the engine loads, one engine per set of files; copies of the wheel's own files read the same."""
    rapid = pytest.importorskip("rapidocr_onnxruntime")
    models = Path(rapid.__file__).parent / "models"
    det, rec = tmp_path / "det.onnx", tmp_path / "rec.onnx"
    det.write_bytes((models / "ch_PP-OCRv4_det_infer.onnx").read_bytes())
    rec.write_bytes((models / "ch_PP-OCRv4_rec_infer.onnx").read_bytes())
    default = OCR._load(torch.device("cpu"))
    (tmp_path / "junk.onnx").write_text("not a model")
    for var, good in (("OCR_DET_MODEL", det), ("OCR_REC_MODEL", rec)):
        monkeypatch.setenv(var, str(tmp_path / "junk.onnx"))
        with pytest.raises(Exception):                         # the file named is the one read
            OCR._load(torch.device("cpu"))
        monkeypatch.setenv(var, str(good))
    engine = OCR._load(torch.device("cpu"))
    assert engine is not default and OCR._load(torch.device("cpu")) is engine
    img = _ocr_render("open late")[None]
    assert OCR.score(img, ['a sign "Open Late"']).tolist() == [1.0]
    monkeypatch.setenv("OCR_REC_KEYS", str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match=r"^OCR_REC_KEYS='.*missing.txt' is not a file"):
        OCR._load(torch.device("cpu"))


# examples/rewards/geneval.py: GenEval's rules on synthetic detections, each tag passes and fails
from examples.rewards import geneval as GE  # noqa: E402


def _ge_box(x, y, side=10.0):
    return (x, y, x + side, y + side)


def _ge_verdicts(dets, meta):
    """(accuracy, strict, score) of both rules on the same detections."""
    acc, _ = GE.geneval_accuracy(dets, meta)
    strict, score, _ = GE.geneval_reward(dets, meta)
    return acc, strict, score


_SINGLE = {"tag": "single_object", "include": [{"class": "cat", "count": 1}],
           "prompt": "a photo of a cat"}


@pytest.mark.examples
def test_geneval_single_object_passes_and_fails():
    """single_object: one cat above 0.3 passes both rules (score 1); a cat at exactly 0.3 is not
    kept (GenEval keeps score > 0.3), and a dog instead of a cat fails (score 0)."""
    cat = GE.Det(_ge_box(0, 0), 0.95)
    kept = GE.keep_detections({"cat": [cat]}, "single_object")
    assert _ge_verdicts(kept, _SINGLE) == (True, True, 1.0)
    kept = GE.keep_detections({"cat": [GE.Det(_ge_box(0, 0), 0.3)], "dog": [cat]}, "single_object")
    assert list(kept) == ["dog"]
    assert _ge_verdicts(kept, _SINGLE) == (False, False, 0.0)


_TWO = {"tag": "two_object",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
        "prompt": "a photo of a cat and a dog"}


@pytest.mark.examples
def test_geneval_two_object_passes_and_fails_with_half_credit():
    """two_object: a cat and a dog pass; a cat alone fails, partial credit (1 + 0) / 2 = 0.5. Plain
    (box, score, mask, colour) tuples are accepted as detections."""
    both = {"cat": [(_ge_box(0, 0), 0.9, None, None)], "dog": [(_ge_box(50, 0), 0.8, None, None)]}
    assert _ge_verdicts(both, _TWO) == (True, True, 1.0)
    assert _ge_verdicts({"cat": both["cat"]}, _TWO) == (False, False, 0.5)


_COUNT = {"tag": "counting", "include": [{"class": "cat", "count": 3}],
          "exclude": [{"class": "cat", "count": 4}], "prompt": "a photo of three cats"}


@pytest.mark.examples
def test_geneval_counting_uses_its_own_threshold_and_the_exclude():
    """counting: scores must exceed 0.9 (not 0.3), so three cats at 0.95 plus one at 0.5 pass; a
    fourth cat at 0.95 trips the exclude (GenEval: wrong; peers: 1 − |3 − 4|/3 = 2/3, not strict);
    two cats fail both (1 − 1/3)."""
    three = [GE.Det(_ge_box(20 * k, 0), 0.95) for k in range(3)]
    weak = GE.Det(_ge_box(100, 0), 0.5)
    kept = GE.keep_detections({"cat": three + [weak]}, "counting")
    assert len(kept["cat"]) == 3 and _ge_verdicts(kept, _COUNT) == (True, True, 1.0)
    assert len(GE.keep_detections({"cat": three + [weak]}, "single_object")["cat"]) == 4   # 0.3 there
    four = GE.keep_detections({"cat": three + [GE.Det(_ge_box(100, 0), 0.95)]}, "counting")
    acc, strict, score = _ge_verdicts(four, _COUNT)
    assert (acc, strict) == (False, False) and score == pytest.approx(2 / 3)
    acc, strict, score = _ge_verdicts({"cat": three[:2]}, _COUNT)
    assert (acc, strict) == (False, False) and score == pytest.approx(2 / 3)


_COLOR = {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}],
          "prompt": "a photo of a red cat"}


@pytest.mark.examples
def test_geneval_colors_passes_and_fails():
    """colors: a red cat passes; a blue cat fails (peers: count term 1, colour term 0 → 0.5). A
    colour the rule needs but the detection lacks is an error, not a silent miss."""
    red, blue = (GE.Det(_ge_box(0, 0), 0.9, None, c) for c in ("red", "blue"))
    assert _ge_verdicts({"cat": [red]}, _COLOR) == (True, True, 1.0)
    assert _ge_verdicts({"cat": [blue]}, _COLOR) == (False, False, 0.5)
    with pytest.raises(ValueError, match="no colour"):
        GE.geneval_accuracy({"cat": [GE.Det(_ge_box(0, 0), 0.9)]}, _COLOR)


_POS = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                       {"class": "dog", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a dog left of a cat"}


@pytest.mark.examples
def test_geneval_tied_scores_are_read_in_genevals_sort_order():
    """Detections of one class with equal scores are ordered as GenEval's evaluate_images.py
    orders them, np.argsort(scores)[::-1] on mmdet's float32 (n, 5) array (reproduced here on
    such an array): of two tied cats the later one comes first. So with count 1 and a colour
    asked, the later cat's colour decides GenEval's verdict: a red cat after a blue one at the
    same score passes "a red cat", and the same two in the other order fail it."""
    blue, red = (GE.Det(_ge_box(20 * k, 0), 0.8, None, c) for k, c in enumerate(("blue", "red")))
    weak = GE.Det(_ge_box(60, 0), 0.5, None, "green")
    dets = [blue, red, weak]
    bbox = np.zeros((len(dets), 5), np.float32)                   # mmdet: x0, y0, x1, y1, score
    bbox[:, :4], bbox[:, 4] = [d.box for d in dets], [d.score for d in dets]
    genevals = np.argsort(bbox[:, 4])[::-1].tolist()
    assert genevals[0] == 1                                        # the tie: the later one first
    kept = GE.keep_detections({"cat": dets}, "colors")
    assert [d.colour for d in kept["cat"]] == [dets[k].colour for k in genevals]
    assert GE.geneval_accuracy(kept, _COLOR)[0]
    swapped = GE.keep_detections({"cat": [red, blue, weak]}, "colors")
    assert [d.colour for d in swapped["cat"]] == ["blue", "red", "green"]
    assert not GE.geneval_accuracy(swapped, _COLOR)[0]


@pytest.mark.examples
def test_geneval_position_passes_and_fails_with_the_peers_extra_term():
    """position "dog left of cat": the dog's box well left of the cat's passes; to its right fails.
    The peers append 0 for the failed pair and then 1 anyway: (1 + 1 + 0 + 1) / 4 = 0.75. With a
    second, weaker dog on the wrong side GenEval (best dog only) passes; the peers do not."""
    cat = GE.Det((100.0, 40.0, 140.0, 80.0), 0.9)
    left, right = GE.Det((10.0, 40.0, 50.0, 80.0), 0.9), GE.Det((200.0, 40.0, 240.0, 80.0), 0.9)
    assert _ge_verdicts({"cat": [cat], "dog": [left]}, _POS) == (True, True, 1.0)
    assert _ge_verdicts({"cat": [cat], "dog": [right]}, _POS) == (False, False, 0.75)
    assert _ge_verdicts({"dog": [left]}, _POS) == (False, False, 1 / 3)      # no target: 0 + 1 + 0
    # GenEval places only the best `count` dogs; the peers count both (1 + (1 − 1) + 0) / 3
    weaker_right = GE.Det(right.box, 0.5)
    assert _ge_verdicts({"cat": [cat], "dog": [left, weaker_right]}, _POS) == (True, False, 1 / 3)


@pytest.mark.examples
def test_geneval_relative_position_dead_zone_and_diagonals():
    """relative_position: the centre offset shrunk by 0.1 × (sum of sizes) per axis must still be
    over half the offset's length, so 100-pixel boxes 15 or 30 apart have no relation and 50 apart
    do; a far diagonal gives two; image y points down ("above" = smaller y)."""
    a = (0.0, 0.0, 100.0, 100.0)
    assert GE.relative_position((15.0, 0.0, 115.0, 100.0), a) == set()          # 15 − 20 < 0
    assert GE.relative_position((30.0, 0.0, 130.0, 100.0), a) == set()          # 10/30 ≤ 0.5
    assert GE.relative_position((50.0, 0.0, 150.0, 100.0), a) == {"right of"}   # 30/50 > 0.5
    assert GE.relative_position((300.0, -300.0, 400.0, -200.0), a) == {"right of", "above"}
    assert GE.relative_position((0.0, 300.0, 100.0, 400.0), a) == {"below"}


_ATTR = {"tag": "color_attr", "include": [{"class": "cat", "count": 1, "color": "red"},
                                          {"class": "dog", "count": 1, "color": "blue"}],
         "prompt": "a photo of a red cat and a blue dog"}


@pytest.mark.examples
def test_geneval_color_attr_passes_fails_and_partial_credit_by_hand():
    """color_attr: a red cat and a blue dog pass; a white dog fails ((1 + 1 + 1 + 0) / 4 = 0.75).
    Two cats (the best one red) and a blue dog: GenEval reads only the best cat and passes, the
    peers score cat-count 1 − |1 − 2|/1 = 0, a 0 for its colour, then 1, 1 → 0.5, not strict."""
    red_cat = GE.Det(_ge_box(0, 0), 0.9, None, "red")
    blue_dog, white_dog = (GE.Det(_ge_box(50, 0), 0.8, None, c) for c in ("blue", "white"))
    assert _ge_verdicts({"cat": [red_cat], "dog": [blue_dog]}, _ATTR) == (True, True, 1.0)
    assert _ge_verdicts({"cat": [red_cat], "dog": [white_dog]}, _ATTR) == (False, False, 0.75)
    two_cats = GE.keep_detections(
        {"cat": [GE.Det(_ge_box(90, 90), 0.5, None, "green"), red_cat], "dog": [blue_dog]}, "color_attr")
    assert [d.colour for d in two_cats["cat"]] == ["red", "green"]                 # best first
    assert _ge_verdicts(two_cats, _ATTR) == (True, False, 0.5)


@pytest.mark.examples
def test_geneval_partial_credit_goes_below_zero_as_the_peers_do():
    """More objects than asked: the peers' count term 1 − |c − n|/c is not clipped (3 cats for one
    → −1); GenEval's own verdict only needs the best `count` and passes. At most 16 per class."""
    cats = [GE.Det(_ge_box(12 * k, 0), 0.9) for k in range(3)]
    assert _ge_verdicts({"cat": cats}, _SINGLE) == (True, False, -1.0)
    many = GE.keep_detections({"cat": [GE.Det(_ge_box(k, 0), 0.5 + k / 100) for k in range(20)]},
                              "single_object")
    assert len(many["cat"]) == GE.MAX_OBJECTS and many["cat"][0].score == pytest.approx(0.69)
    assert GE.geneval_reward(many, _SINGLE)[1] == 1 - 15


@pytest.mark.examples
def test_geneval_tag_accuracy_is_the_mean_over_tags():
    """tag_accuracy: per-tag means, and "overall" = the mean of those (summary_scores.py)."""
    res = [dict(tag="counting", accuracy=1.0), dict(tag="counting", accuracy=0.0),
           dict(tag="colors", accuracy=1.0)]
    assert GE.tag_accuracy(res) == {"counting": 0.5, "colors": 1.0, "overall": 0.75}


@pytest.mark.examples
def test_geneval_colour_crop_masks_the_background_and_boxes_follow_mmdet():
    """colour_crop: outside the mask is GenEval's #999 grey, the crop is the box; mask_boxes is
    mmdet's mask2bbox [x0, y0, x_last + 1, y_last + 1]."""
    from PIL import Image
    img = np.zeros((20, 30, 3), np.uint8)
    img[...] = (0, 255, 0)
    mask = np.zeros((20, 30), bool)
    mask[5:10, 4:12] = True
    mask[9, 4] = False                                                  # a corner left unmasked
    box = tuple(GE.mask_boxes(torch.from_numpy(mask)[None])[0].tolist())
    assert box == (4.0, 5.0, 12.0, 10.0)
    crop = np.asarray(GE.colour_crop(Image.fromarray(img), GE.Det(box, 0.9, mask)))
    assert crop.shape == (5, 8, 3)
    assert (crop[0, 0] == (0, 255, 0)).all() and (crop[4, 0] == (153, 153, 153)).all()
    assert (np.asarray(GE.colour_crop(Image.fromarray(img), GE.Det(box, 0.9)))[4, 0] == (0, 255, 0)).all()


def _ge_prompt(meta: dict) -> str:
    """A prompt as vgrpo.py reads it from a .jsonl line: a str with .metadata."""
    p = V.Prompt(meta["prompt"])
    p.metadata = meta
    return p


@pytest.mark.examples
def test_geneval_check_prompts_names_the_first_prompt_without_usable_metadata():
    """check_prompts: GenEval metadata passes; a .txt prompt, a class outside COCO's 80, or a
    position pointing forward is one line naming the prompt."""
    GE.check_prompts([_ge_prompt(m) for m in (_SINGLE, _TWO, _COUNT, _COLOR, _POS, _ATTR)])
    with pytest.raises(ValueError, match=r"^prompt 2 \('a photo of a cat'\) has no GenEval metadata") as e:
        GE.check_prompts([_ge_prompt(_SINGLE), "a photo of a cat"])
    assert "\n" not in str(e.value) and ".jsonl" in str(e.value)
    bad = dict(_SINGLE, include=[{"class": "kitten", "count": 1}])
    with pytest.raises(ValueError, match="'kitten', not one of GenEval's 80"):
        GE.check_prompts([_ge_prompt(bad)])
    forward = dict(_POS, include=[{"class": "dog", "count": 1, "position": ["left of", 1]},
                                  {"class": "cat", "count": 1}])
    with pytest.raises(ValueError, match="position"):
        GE.check_prompts([_ge_prompt(forward)])


# examples/rewards/geneval.py: the loading path on tiny random models, through the environment variables
def _ge_tiny_models(folder: Path, monkeypatch):
    """A tiny random Mask2Former (Swin backbone, 2 queries, 80 classes) whose class head favours
    "cat", saved with its image processor; a tiny random open_clip model (JSON config + state
    dict). The environment variables point at them."""
    import open_clip
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation,
                              Mask2FormerImageProcessor, SwinConfig)
    from transformers.utils import logging
    logging.disable_progress_bar()
    torch.manual_seed(0)
    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
                      num_heads=[1, 1, 2, 2], window_size=4,
                      out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=swin, feature_size=32, mask_feature_size=32,
                            hidden_dim=32, encoder_feedforward_dim=32, encoder_layers=1,
                            decoder_layers=2, num_attention_heads=2, dim_feedforward=32,
                            num_queries=2, id2label=dict(enumerate(GE.CLASSNAMES)))
    model = Mask2FormerForUniversalSegmentation(cfg).eval()
    with torch.no_grad():
        model.class_predictor.bias[GE.CLASSNAMES.index("cat")] = 5.5    # P(cat) ≈ 0.75 per query
    model.save_pretrained(folder / "detector")
    Mask2FormerImageProcessor(size={"height": 64, "width": 64}, size_divisor=32).save_pretrained(
        folder / "detector")
    arch = folder / "tiny-geneval-clip.json"
    arch.write_text(json.dumps({"embed_dim": 16, "quick_gelu": True,
                                "vision_cfg": {"image_size": 32, "layers": 2, "width": 32,
                                               "patch_size": 8, "head_width": 16},
                                "text_cfg": {"context_length": 77, "vocab_size": 49408,
                                             "width": 32, "heads": 2, "layers": 2}}))
    open_clip.add_model_config(str(arch))
    torch.save(open_clip.create_model(arch.stem, pretrained=None).state_dict(), folder / "clip.pt")
    monkeypatch.setenv("GENEVAL_DETECTOR", str(folder / "detector"))
    monkeypatch.setenv("GENEVAL_CLIP_ARCH", str(arch))
    monkeypatch.setenv("GENEVAL_CLIP_CHECKPOINT", str(folder / "clip.pt"))


@pytest.mark.examples
def test_geneval_scores_jsonl_prompts_on_tiny_random_models(tmp_path, monkeypatch):
    """Through GENEVAL_DETECTOR / GENEVAL_CLIP_ARCH / GENEVAL_CLIP_CHECKPOINT: the tiny detector
    finds two cats per image (score ≈ 0.37: kept at 0.3, dropped at counting's 0.9); score,
    accuracy and strict give N finite values in [0, 1] that follow the rules; the colour path runs
    for the colour prompt only."""
    _ge_tiny_models(tmp_path, monkeypatch)
    metas = [dict(_COLOR, include=[{"class": "cat", "count": 2, "color": "red"}]),
             dict(_SINGLE, include=[{"class": "dog", "count": 1}]),
             dict(_COUNT, include=[{"class": "cat", "count": 2}]),
             _SINGLE]
    prompts = [_ge_prompt(m) for m in metas]
    images = torch.rand(4, 3, 40, 48, generator=torch.Generator().manual_seed(0))
    seen = []
    detect = GE.detect
    monkeypatch.setattr(GE, "detect", lambda models, u8: seen.append(u8) or detect(models, u8))
    res = GE.evaluate(images, prompts)
    assert torch.equal(seen[0], (images * 255).round().to(torch.uint8))     # RGB uint8, as flow_grpo
    assert [r["counts"] for r in res] == [{"cat": 2}, {"cat": 2}, {}, {"cat": 2}]
    assert res[0]["score"] in (0.5, 0.75, 1.0)          # count term 1, colour term n_red/2
    assert [(r["accuracy"], r["strict"], r["score"]) for r in res[1:]] == \
        [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.0, 0.0, 0.0)]
    models = next(m for k, m in GE._LOADED.items() if k[1] == str(tmp_path / "detector"))
    assert list(models["classifiers"]) == ["cat"] and models["detector"].dtype == torch.float32
    for fn in (GE.score, GE.accuracy, GE.strict):
        out = fn(images, prompts)
        assert out.shape == (4,) and out.dtype == torch.float32 and torch.isfinite(out).all()
        assert ((out >= 0) & (out <= 1)).all()
    assert GE.score(images, prompts).tolist() == [r["score"] for r in res]
    with pytest.raises(ValueError, match="prompt 1 .* has no GenEval metadata"):
        GE.score(images[:1], ["a photo of a cat"])


@pytest.mark.examples
def test_geneval_detections_equal_the_processors_own_post_processing(tmp_path, monkeypatch):
    """detect() (its own post-processing on the MASK_GRID grid, then the kept masks resized) gives
    the labels, scores and masks of post_process_instance_segmentation with target_sizes, on
    non-square images; its scores are float32 values, transformers' the same rounded to 6
    decimals; boxes are the masks' tight boxes."""
    from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation
    _ge_tiny_models(tmp_path, monkeypatch)
    u8 = (torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(1)) * 255).to(torch.uint8)
    mine = GE.detect(GE._load(torch.device("cpu")), u8)
    proc = AutoImageProcessor.from_pretrained(tmp_path / "detector")
    model = Mask2FormerForUniversalSegmentation.from_pretrained(tmp_path / "detector").eval()
    with torch.no_grad():
        out = model(**proc(images=list(u8), return_tensors="pt"))
    ref = proc.post_process_instance_segmentation(out, threshold=GE.THRESHOLD, return_binary_maps=True,
                                                  target_sizes=[(40, 56)] * 3)
    assert len(mine) == len(ref) == 3                      # zip below: every image compared
    for dets, r in zip(mine, ref):
        assert [round(d.score, 6) for d in dets["cat"]] == [
            s["score"] for s in r["segments_info"]]
        assert all(float(np.float32(d.score)) == d.score for d in dets["cat"])
        assert {s["label_id"] for s in r["segments_info"]} == {GE.CLASSNAMES.index("cat")}
        for d, m in zip(dets["cat"], r["segmentation"].bool()):
            assert (torch.from_numpy(d.mask) == m).all()
            ys, xs = torch.where(m)
            assert d.box == (xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1)


@pytest.mark.examples
def test_geneval_thresholds_compare_in_float32_as_geneval():
    """GenEval keeps a detection if its float32 score (mmdet's) is above the threshold as numpy
    compares them, in float32: float32(0.3) = 0.300000012 is dropped, the next float32 up is
    kept; so is float32(0.3000002) (transformers would have rounded it to 0.3). The counting cut
    is float32(0.9). The kept classes equal numpy's own `scores > 0.3`, GenEval's expression."""
    f32 = np.float32

    def geneval(scores: dict, threshold: float) -> set:
        """The classes GenEval keeps: its float32 score array compared with a Python float."""
        return {cls for cls, v in scores.items() if (np.array([v], np.float32) > threshold)[0]}

    def kept(scores: dict, tag: str) -> set:
        return set(GE.keep_detections({cls: [GE.Det(_ge_box(0, 0), float(v))]
                                       for cls, v in scores.items()}, tag))

    near = {"cat": f32(0.3), "dog": np.nextafter(f32(0.3), f32(1)),
            "cow": np.nextafter(f32(0.3), f32(0)), "bird": 0.3, "sheep": f32(0.3000002),
            "horse": 0.30000001}                       # a float between 0.3 and float32(0.3)
    assert kept(near, "single_object") == geneval(near, 0.3) == {"dog", "sheep"}
    at = GE.keep_detections({"cat": [GE.Det(_ge_box(0, 0), float(f32(0.3)))]}, "single_object")
    assert _ge_verdicts(at, _SINGLE) == (False, False, 0.0)
    near9 = {"cat": f32(0.9), "dog": np.nextafter(f32(0.9), f32(1)), "cow": 0.9,
             "bird": 0.900000003}                      # above 0.9, float32 rounds it to f32(0.9)
    assert kept(near9, "counting") == geneval(near9, 0.9) == {"dog"}


@pytest.mark.examples
def test_geneval_detect_keeps_scores_unrounded_so_the_cut_falls_where_genevals_does():
    """A stub detector whose cat query scores float32 0.30000016 (class probability × a mask
    probability of exactly 1) and whose dog query scores 0.29999977: detect() carries the cat's
    score as computed, not rounded to 6 decimals (0.3, which the cut would drop), so the cat is
    kept and single_object passes, as GenEval does on the same float32 score; the dog is not."""
    import math
    import types
    from transformers import Mask2FormerImageProcessor
    cat, dog = GE.CLASSNAMES.index("cat"), GE.CLASSNAMES.index("dog")
    logits = torch.zeros(1, 2, 81)                  # 2 queries × (80 classes + "no object")
    for q, (cls, target) in enumerate(((cat, 0.3000002), (dog, 0.2999998))):
        logits[0, q, cls] = math.log(80 * target / (1 - target))    # p = e^a / (e^a + 80)
    probs = logits.softmax(-1)[0, [0, 1], [cat, dog]].tolist()
    assert np.float32(probs[0]) > np.float32(0.3) and round(probs[0], 6) == 0.3   # the case
    assert probs[1] < 0.3
    masks = torch.full((1, 2, 24, 24), 20.0)        # every pixel in, sigmoid 1.0 in float32
    pred = types.SimpleNamespace(class_queries_logits=logits, masks_queries_logits=masks)
    models = dict(processor=Mask2FormerImageProcessor(size={"height": 32, "width": 32}),
                  detector=lambda **inputs: pred, device=torch.device("cpu"), dtype=torch.float32)
    (dets,) = GE.detect(models, torch.zeros(1, 3, 40, 48, dtype=torch.uint8))
    assert list(dets) == ["cat"] and dets["cat"][0].score == probs[0]
    assert dets["cat"][0].box == (0.0, 0.0, 48.0, 40.0)
    kept = GE.keep_detections(dets, "single_object")
    assert list(kept) == ["cat"] and _ge_verdicts(kept, _SINGLE) == (True, True, 1.0)


_RGB = {"red": (1, 0, 0), "orange": (1, 0.5, 0), "yellow": (1, 1, 0), "green": (0, 1, 0),
        "blue": (0, 0, 1), "purple": (0.5, 0, 0.5), "pink": (1, 0.75, 0.8),
        "brown": (0.6, 0.3, 0.1), "black": (0, 0, 0), "white": (1, 1, 1)}


@pytest.mark.examples
def test_geneval_colour_of_each_object_is_read_from_its_own_crop(monkeypatch):
    """Two images on a green ground, each with a red and a blue square, a cat on one and a dog on
    the other (swapped in the second image). A stub colour classifier names the colour nearest the
    crop's mean RGB. Read on each object's own masked crop, every colour prompt passes; read on
    the whole image every object would be green, and on another object's crop the colours would
    be swapped: each fails."""
    import types
    from PIL import Image
    protos = torch.nn.functional.normalize(torch.tensor([_RGB[c] for c in GE.COLORS]), dim=1)

    def mean_rgb(im):                                   # the stub transform: PIL → (3,)
        return torch.from_numpy(np.asarray(im, np.float32).mean((0, 1)) / 255)

    models = dict(transform=mean_rgb, clip=types.SimpleNamespace(encode_image=lambda x: x),
                  classifiers={"cat": protos.T, "dog": protos.T},
                  device=torch.device("cpu"), dtype=torch.float32)
    assert GE.COLORS[int((torch.tensor([0.17, 0.67, 0.17]) @ protos.T).argmax())] == "green"
    images = torch.zeros(2, 3, 64, 96)
    images[:, 1] = 1.0                                               # green ground
    left, right = (8, 8, 40, 40), (56, 8, 88, 40)                    # x0, y0, x1, y1
    colours = [("red", "blue"), ("blue", "red")]                     # (left, right) per image
    dets = []
    for i, pair in enumerate(colours):
        objs = {}
        for (x0, y0, x1, y1), colour, cls in zip((left, right), pair, ("cat", "dog")):
            images[i, :, y0:y1, x0:x1] = torch.tensor(_RGB[colour]).view(3, 1, 1)
            mask = np.zeros((64, 96), bool)
            mask[y0:y1, x0:x1] = True
            objs[cls] = [GE.Det((float(x0), float(y0), float(x1), float(y1)), 0.9, mask)]
        dets.append(objs)
    metas = [dict(_ATTR, include=[{"class": "cat", "count": 1, "color": cat},
                                  {"class": "dog", "count": 1, "color": dog}],
                  prompt=f"a photo of a {cat} cat and a {dog} dog") for cat, dog in colours]
    monkeypatch.setattr(GE, "_load", lambda device: models)
    monkeypatch.setattr(GE, "detect", lambda m, u8: dets)
    res = GE.evaluate(images, [_ge_prompt(m) for m in metas])
    assert [(r["accuracy"], r["strict"], r["score"]) for r in res] == [(1.0, 1.0, 1.0)] * 2, res
    u8 = (images * 255).round().to(torch.uint8)
    got = GE.add_colours(models, u8, dets, metas)
    assert [(d["cat"][0].colour, d["dog"][0].colour) for d in got] == colours
    whole = [Image.fromarray(u8[i].permute(1, 2, 0).numpy()) for i in range(2)]
    assert {GE.COLORS[int((mean_rgb(im) @ protos.T).argmax())] for im in whole} == {"green"}


@pytest.mark.examples
def test_geneval_is_the_reward_name_and_its_errors_are_one_line(tmp_path, monkeypatch):
    """`--reward geneval` is this plug-in: vgrpo's probe rejects .txt prompts through its
    check_prompts before anything loads; a detector that is not there is one line naming
    GENEVAL_DETECTOR."""
    fn = V.build_reward("geneval", V.Args(), torch.device("cpu"), torch.float32)
    with pytest.raises(V.ConfigError, match=r"reward 'geneval': prompt 1 \('a cat'\) has no GenEval"):
        V.probe_reward("geneval", fn, 32, torch.device("cpu"), ["a cat", "a dog"])
    monkeypatch.setenv("GENEVAL_DETECTOR", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=r"GENEVAL_DETECTOR=DIR") as e:
        GE.score(torch.rand(1, 3, 32, 32), [_ge_prompt(_SINGLE)])
    assert "\n" not in str(e.value)


# examples/rewards/remote_reward.py: a reward server on loopback
from examples.rewards import remote_reward as RR  # noqa: E402


class _RuEvil:
    def __reduce__(self):
        return exec, ("import sys; sys._ru_pwned = True",)


class _RuBomb:                                    # 46 bytes that would allocate 1 GB
    def __reduce__(self):
        return bytearray, (10 ** 9,)


def _ru_array_bomb(state=None):
    """numpy's own array pickle, (0,)-shaped at first, made (10**9,): 89 bytes, 1 GB; with an
    object array's `state` instead, a pickle whose state numpy does not check (it crashes)."""
    import numpy as np
    rebuild = np.arange(1).__reduce__()[0]

    class Bomb:
        def __reduce__(self):
            return ((rebuild, (np.ndarray, (10 ** 9,), b"b")) if state is None else
                    (rebuild, (np.ndarray, (0,), b"b"), state))
    return pickle.dumps(Bomb(), protocol=4)


class _RuHandler(http.server.BaseHTTPRequestHandler):
    """yifan123/reward-server's app_geneval.py in miniature: POST "/" only, a pickled dict in,
    JPEG images opened with formats=["jpeg"], a pickled dict of lists out (200), a traceback as
    text on failure (500). The score is the mean brightness in [0, 1]; `outputs` (DeQA's field) is
    1 − brightness, so a test sees which field a NAME reads. server.mode picks a broken answer."""

    def do_POST(self):  # noqa: N802 — http.server's name
        srv = self.server
        srv.paths.append(self.path)
        srv.types.append(self.headers.get("Content-Type"))
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if srv.mode == "500":
            return self._send(500, b"Traceback (most recent call last):\n  ...\n"
                                   b"KeyError: 'meta_datas'\n")
        if srv.mode == "escapes":                     # clear the screen, retitle, ring
            return self._send(500, b"KeyError: \x1b[2J\x1b]0;owned\x07'x'\r\n")
        if self.path != srv.route:
            return self._send(404, b"<!doctype html><title>404 Not Found</title>")
        import numpy as np
        from PIL import Image
        data = pickle.loads(body)                    # the test's own client: trusted here
        srv.received.append(data)
        images = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in data["images"]]
        bright = [float(np.asarray(im.convert("RGB"), dtype=np.float64).mean() / 255)
                  for im in images]
        answer = {"scores": bright, "rewards": [1.0] * len(bright),
                  "strict_rewards": [0.0] * len(bright), "group_rewards": {},
                  "group_strict_rewards": {}, "outputs": [1 - b for b in bright]}
        if srv.mode == "numpy":
            answer["scores"] = np.asarray(bright, dtype=np.float32)
        if srv.mode == "short":
            answer["scores"] = bright[:-1]
        if srv.mode == "nan":
            answer["scores"] = [math.nan] + bright[1:]
        if srv.mode == "text":
            answer["scores"] = [str(b) for b in bright]
        if srv.mode == "no_outputs":
            del answer["outputs"]
        payload = pickle.dumps(answer)
        if srv.mode == "garbage":
            payload = b"<html><body>502 Bad Gateway</body></html>"
        if srv.mode == "evil":                        # unpickling this would run code
            payload = pickle.dumps(_RuEvil())
        if srv.mode.startswith("bomb"):
            import numpy as np
            payload = {"bomb": pickle.dumps(_RuBomb()), "bomb_array": _ru_array_bomb(),
                       "bomb_object": _ru_array_bomb((1, (10 ** 8,), np.dtype("O"), False, [1.]))
                       }[srv.mode]
        if srv.mode == "huge":                        # a valid answer, padded past 1000 bytes
            answer["padding"] = "x" * 5000
            payload = pickle.dumps(answer)
        if srv.mode == "endless":                     # no length, no end: read whole, never
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                while True:
                    self.wfile.write(b"x" * 4096)
        self._send(200, payload)

    def _send(self, status, payload):
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):                     # keep pytest's output clean
        pass


@pytest.fixture
def _ru_server(monkeypatch):
    """A reward server on 127.0.0.1 (an ephemeral port) in a thread, and short client timeouts."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RuHandler)
    srv.mode, srv.route, srv.paths, srv.received, srv.types = "ok", "/", [], [], []
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    for name, value in (("CONNECT_TIMEOUT", "1"), ("READ_TIMEOUT", "2"), ("TRIES", "3"),
                        ("BACKOFF", "0.01"), ("BATCH", "64")):
        monkeypatch.setenv(f"REMOTE_REWARD_{name}", value)
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def _ru_url(srv, name, prefix=""):
    return f"http://127.0.0.1:{srv.server_address[1]}{prefix}/{name}"


def _ru_images(levels):
    """(N, 3, 24, 32) flat grey images, one brightness per image."""
    return torch.tensor(levels, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 24, 32).clone()


class _RuPrompt(str):
    """A prompt from a .jsonl file, as vgrpo.py makes them: a str with .metadata."""
    metadata: dict


def _ru_geneval_prompts(n):
    out = []
    for i in range(n):
        p = _RuPrompt(f"a photo of {i + 1} cats")
        p.metadata = {"tag": "counting", "include": [{"class": "cat", "count": i + 1}],
                      "prompt": str(p)}
        out.append(p)
    return out


@pytest.mark.examples
def test_remote_reward_round_trips_scores_and_metadata(_ru_server, monkeypatch):
    """examples/rewards/remote_reward.py speaks reward-server's protocol: POST "/" (the URL without NAME,
    a PREFIX kept) with a pickled dict of JPEG "images", "meta_datas" (each prompt's .metadata, None
    without), "only_strict" and plain-str "prompts"; the NAME's field of the pickled answer comes
    back as (N,) fp32 in the images' order, across batches; numpy answers are accepted. The
    content type sent is the one the module's docstring names."""
    monkeypatch.setenv("REMOTE_REWARD_BATCH", "2")
    levels = [0.1, 0.3, 0.5, 0.7, 0.9]
    prompts = _ru_geneval_prompts(5)
    got = RR.client(_ru_url(_ru_server, "geneval"))(_ru_images(levels), prompts)
    assert got.dtype == torch.float32 and got.shape == (5,)
    torch.testing.assert_close(got, torch.tensor(levels), atol=0.01, rtol=0)   # JPEG rounding
    assert _ru_server.paths == ["/", "/", "/"]                                  # 2 + 2 + 1 images
    sent = _ru_server.received
    assert [len(d["images"]) for d in sent] == [2, 2, 1]
    assert all(im[:3] == b"\xff\xd8\xff" for d in sent for im in d["images"])  # JPEG files
    assert [m for d in sent for m in d["meta_datas"]] == [p.metadata for p in prompts]
    assert [p for d in sent for p in d["prompts"]] == [str(p) for p in prompts]
    assert all(type(p) is str for d in sent for p in d["prompts"])              # not _RuPrompt
    assert all(d["only_strict"] is True for d in sent)
    assert set(_ru_server.types) == {"application/octet-stream"}
    assert '"Content-Type: application/octet-stream"' in RR.__doc__
    # geneval_accuracy reads "rewards" and asks for the non-strict rule; deqa reads "outputs",
    # needs no metadata (None is sent); a PREFIX before NAME stays in the path
    _ru_server.received.clear()
    assert RR.client(_ru_url(_ru_server, "geneval_accuracy"))(
        _ru_images([0.2]), _ru_geneval_prompts(1)).tolist() == [1.0]
    assert _ru_server.received[0]["only_strict"] is False
    _ru_server.route, _ru_server.received[:] = "/rw/", []
    got = RR.client(_ru_url(_ru_server, "deqa", prefix="/rw"))(_ru_images([0.2, 0.6]), ["a", "b"])
    torch.testing.assert_close(got, torch.tensor([0.8, 0.4]), atol=0.01, rtol=0)
    assert _ru_server.paths[-1] == "/rw/" and _ru_server.received[0]["meta_datas"] == [None, None]
    _ru_server.route, _ru_server.mode = "/", "numpy"
    got = RR.client(_ru_url(_ru_server, "geneval"))(_ru_images([0.4, 0.8]), _ru_geneval_prompts(2))
    torch.testing.assert_close(got, torch.tensor([0.4, 0.8]), atol=0.01, rtol=0)


def _ru_one_line_error(fn, *args):
    with pytest.raises(RR.RemoteRewardError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.examples
def test_remote_reward_dead_or_silent_server_is_one_line_within_the_timeout(monkeypatch):
    """A closed port: one line naming the URL after REMOTE_REWARD_TRIES quick tries, through
    vgrpo.py's plug-in wrapper too. A server that accepts but never answers: one line naming the
    read timeout, after about REMOTE_REWARD_READ_TIMEOUT seconds (1, longer than the connect
    timeout's 0.3, so the two differ) and without a retry; with a whole-request deadline shorter
    than the read timeout, one line naming REMOTE_REWARD_DEADLINE after about that long."""
    for name, value in (("CONNECT_TIMEOUT", "0.3"), ("READ_TIMEOUT", "1"), ("DEADLINE", "10"),
                        ("TRIES", "3"), ("BACKOFF", "0.01")):
        monkeypatch.setenv(f"REMOTE_REWARD_{name}", value)
    with socket.socket() as s:                        # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/geneval"
    start = time.monotonic()
    msg = _ru_one_line_error(RR.client(url), _ru_images([0.5]), _ru_geneval_prompts(1))
    assert time.monotonic() - start < 3
    assert url in msg and "connection failed" in msg and "after 3 tries" in msg
    wrapped = V.plugin_reward(url)
    with pytest.raises(V.RewardError) as info:
        wrapped(_ru_images([0.5]), _ru_geneval_prompts(1))
    assert "\n" not in str(info.value) and url in str(info.value)
    with socket.socket() as silent:                   # the kernel accepts, nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/deqa"
        start = time.monotonic()
        msg = _ru_one_line_error(RR.client(url), _ru_images([0.5]), ["a"])
        took = time.monotonic() - start
        assert 0.9 < took < 1.6, took                 # one read timeout, no second try
        assert url in msg and "REMOTE_REWARD_READ_TIMEOUT=1 s" in msg
        monkeypatch.setenv("REMOTE_REWARD_DEADLINE", "0.6")
        monkeypatch.setenv("REMOTE_REWARD_READ_TIMEOUT", "5")
        start = time.monotonic()
        msg = _ru_one_line_error(RR.client(url), _ru_images([0.5]), ["a"])
        took = time.monotonic() - start
    assert 0.5 < took < 1.2, took                     # the deadline, before the read timeout
    assert url in msg and "REMOTE_REWARD_DEADLINE=0.6 s" in msg


@contextlib.contextmanager
def _ru_trickler(seconds: float, every: float = 0.2):
    """A server on 127.0.0.1 that reads each request, answers "200 OK" with a Content-Length of
    1000 and then sends one byte every `every` seconds; it serves for `seconds` in all, then
    closes. Yields (its URL without NAME, the times it accepted a connection)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.05)
    end, accepted, stop = time.monotonic() + seconds, [], threading.Event()

    def read_request(conn):
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536) or b"\r\n\r\n"
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head + b"\ncontent-length: 0")[1])
        while len(body) < length:
            body += conn.recv(65536) or b"\0" * length

    def serve():
        while not stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            accepted.append(time.monotonic())
            with conn:
                try:
                    conn.settimeout(1)
                    read_request(conn)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
                    while not stop.wait(every) and time.monotonic() < end:
                        conn.sendall(b"x")
                except OSError:                         # the client hung up
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


@pytest.mark.examples
def test_remote_reward_a_trickling_server_is_cut_off_by_the_deadline(monkeypatch):
    """A server that sends its answer one byte every 0.2 s never lets the 1-second read timeout
    fire; the whole-request deadline (1.5 s) cuts it off: one line naming the URL and
    REMOTE_REWARD_DEADLINE after about 1.5 s, from one request (not retried)."""
    for name, value in (("CONNECT_TIMEOUT", "1"), ("READ_TIMEOUT", "1"), ("DEADLINE", "1.5"),
                        ("TRIES", "3"), ("BACKOFF", "0.01")):
        monkeypatch.setenv(f"REMOTE_REWARD_{name}", value)
    with _ru_trickler(seconds=6) as (root, accepted):
        url = f"{root}/deqa"
        start = time.monotonic()
        msg = _ru_one_line_error(RR.client(url), _ru_images([0.5]), ["a"])
        took = time.monotonic() - start
    assert 1.4 < took < 2.5, (took, msg)
    assert url in msg and "REMOTE_REWARD_DEADLINE=1.5 s" in msg and len(accepted) == 1


@pytest.mark.examples
def test_remote_reward_default_deadline_is_connect_plus_twice_read(monkeypatch):
    """REMOTE_REWARD_DEADLINE not set: the whole-request deadline is CONNECT_TIMEOUT + 2 ×
    READ_TIMEOUT, as the docstring says. With nothing set at all that is 10 + 2·120 = 250 s (the
    timer each request arms, read off threading.Timer); with CONNECT 0.2 and READ 0.4 it is 1 s,
    and a server trickling a byte every 0.2 s (the read timeout never fires) is cut off after
    about 1 s (CONNECT + 1 × READ would be 0.6 s), in one line naming that deadline."""
    for name in ("CONNECT_TIMEOUT", "READ_TIMEOUT", "DEADLINE"):
        monkeypatch.delenv(f"REMOTE_REWARD_{name}", raising=False)
    monkeypatch.setenv("REMOTE_REWARD_TRIES", "1")
    armed, real_timer = [], threading.Timer

    def timer(interval, fn):
        armed.append(interval)
        return real_timer(interval, fn)
    monkeypatch.setattr(threading, "Timer", timer)
    with socket.socket() as s:                        # a port nothing listens on: fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _ru_one_line_error(RR.client(f"http://127.0.0.1:{port}/deqa"), _ru_images([0.5]), ["a"])
    assert armed == [250.0]
    assert "CONNECT_TIMEOUT + 2 × READ_TIMEOUT: 250 s" in RR.__doc__
    monkeypatch.setenv("REMOTE_REWARD_CONNECT_TIMEOUT", "0.2")
    monkeypatch.setenv("REMOTE_REWARD_READ_TIMEOUT", "0.4")
    with _ru_trickler(seconds=6) as (root, accepted):
        start = time.monotonic()
        msg = _ru_one_line_error(RR.client(f"{root}/deqa"), _ru_images([0.5]), ["a"])
        took = time.monotonic() - start
    assert "REMOTE_REWARD_DEADLINE=1 s" in msg and len(accepted) == 1, msg
    assert 0.9 < took < 2.0, took


@pytest.mark.examples
def test_remote_reward_garbage_answers_are_one_line_errors(_ru_server):
    """Not a pickle, a pickle that would run code (refused, and it does not run), too few values,
    a NaN, strings, a NAME whose field the answer lacks: each one line naming the URL and the
    fault. Numpy arrays and sets do unpickle, in every pickle protocol (0–5). A GenEval NAME
    refuses prompts without metadata before sending anything; a URL it cannot use is one line."""
    import numpy as np
    images, prompts = _ru_images([0.2, 0.4, 0.6]), _ru_geneval_prompts(3)
    url = _ru_url(_ru_server, "geneval")
    expect = {"garbage": "not a pickle", "evil": "forbidden global builtins.exec",
              "short": "holds 2 values for 3 images", "nan": "'scores'[0] is nan",
              "text": "'scores'[0] is '0."}
    for mode, fault in expect.items():
        _ru_server.mode = mode
        msg = _ru_one_line_error(RR.client(url), images, prompts)
        assert url in msg and fault in msg, (mode, msg)
    assert not hasattr(sys, "_ru_pwned")
    for protocol in range(6):                       # numpy arrays, sets: data in every protocol
        data = pickle.dumps({"s": {0.5}, "a": np.arange(3.0)}, protocol=protocol)
        got = RR._AnswerUnpickler(io.BytesIO(data)).load()
        assert got["s"] == {0.5} and got["a"].tolist() == [0.0, 1.0, 2.0]
    _ru_server.mode = "no_outputs"
    msg = _ru_one_line_error(RR.client(_ru_url(_ru_server, "unifiedreward")), images, prompts)
    assert "the answer has no 'outputs'" in msg and "'scores'" in msg        # the keys it got
    _ru_server.mode = "ok"
    _ru_server.received.clear()
    with pytest.raises(ValueError, match=r"prompt 'a plain prompt' has none; pass a \.jsonl"):
        RR.client(url)(images[:1], ["a plain prompt"])
    with pytest.raises(ValueError, match="prompt 'x' has none"):
        RR.client(url).check_prompts(prompts + [_RuPrompt("x")])
    assert _ru_server.received == []
    for bad in ("ftp://127.0.0.1:1/geneval", "http://127.0.0.1:1/", "http://127.0.0.1:x/geneval"):
        _ru_one_line_error(RR.client, bad)


@pytest.mark.examples
def test_remote_reward_a_hostile_server_is_bounded(_ru_server, monkeypatch, capsys):
    """Answers built to exhaust or crash the client: a 46-byte pickle of bytearray(10**9), numpy's
    array pickle resized to 10**9 elements (89 bytes), an object array whose state numpy does not
    check: each refused before it allocates (or crashes), one line. An answer longer than
    REMOTE_REWARD_MAX_BYTES: refused by its Content-Length, or, without one, after that many bytes
    of an endless answer (not at the deadline). An error text with terminal escapes reaches the
    retry line and the error with "?" in their place. A URL with a user
    name and password is refused without printing either, in the client and in vgrpo.py."""
    images, prompts = _ru_images([0.2, 0.4]), _ru_geneval_prompts(2)
    url = _ru_url(_ru_server, "geneval")
    monkeypatch.setenv("REMOTE_REWARD_MAX_BYTES", "1000")
    for mode, fault in {"bomb": "bytearray(1000000000,) is refused",
                        "bomb_array": "_reconstruct(<class 'numpy.ndarray'>, (1000000000,)",
                        "bomb_object": "dtype('O8', False, True) is refused",
                        "huge": "answered 5", "endless": "answered more"}.items():
        _ru_server.mode = mode
        msg = _ru_one_line_error(RR.client(url), images, prompts)
        assert fault in msg and url in msg, (mode, msg)
    assert "than REMOTE_REWARD_MAX_BYTES=1000" in msg
    _ru_server.mode = "escapes"
    monkeypatch.setenv("REMOTE_REWARD_TRIES", "2")
    capsys.readouterr()
    msg = _ru_one_line_error(RR.client(url), images, prompts)
    retry = capsys.readouterr().err
    assert "HTTP 500 (KeyError: ?[2J?]0;owned?'x')" in msg and "try 2 of 2" in retry, msg
    assert all(c.isprintable() for c in msg + retry.rstrip("\n")), retry
    secret = f"http://alice:s3cret@127.0.0.1:{_ru_server.server_address[1]}/geneval"
    msg = _ru_one_line_error(RR.client, secret)
    assert "s3cret" not in msg and "alice" not in msg and "user name or password" in msg
    capsys.readouterr()
    assert V.main(["--model", "tiny", "--reward", f"{secret}:1,jpeg:1"]) == 2
    out, err = capsys.readouterr()
    assert "s3cret" not in out + err and "alice" not in out + err and err.count("\n") == 1, err


@pytest.mark.examples
def test_remote_reward_retries_are_bounded(_ru_server):
    """A server that answers HTTP 500 gets exactly REMOTE_REWARD_TRIES requests (3), then one line
    with the status and the traceback's last line; a 404 (wrong path) is not retried."""
    _ru_server.mode = "500"
    msg = _ru_one_line_error(RR.client(_ru_url(_ru_server, "geneval")),
                             _ru_images([0.5]), _ru_geneval_prompts(1))
    assert len(_ru_server.paths) == 3
    assert "HTTP 500 (KeyError: 'meta_datas') after 3 tries" in msg
    _ru_server.mode, _ru_server.paths[:] = "ok", []
    msg = _ru_one_line_error(RR.client(_ru_url(_ru_server, "geneval", prefix="/wrong")),
                             _ru_images([0.5]), _ru_geneval_prompts(1))
    assert _ru_server.paths == ["/wrong/"] and "HTTP 404" in msg


@pytest.mark.examples
def test_remote_reward_trains_through_vgrpo_main(_ru_server, tmp_path, capsys):
    """`--reward http://HOST:PORT/deqa` trains the tiny model on the server's scores (the probe's
    2 images and the iteration's 4 reach it); `/geneval` with plain-text prompts stops before the
    model loads with one line naming the URL and the prompt."""
    url = _ru_url(_ru_server, "deqa")
    run = tmp_path / "run"
    assert V.main(["--model", "tiny", "--reward", url, "--iterations", "1", "--prompts_per_iter",
                   "2", "--group_size", "2", "--num_steps", "4", "--eval_every", "0",
                   "--run_dir", str(run)]) == 0
    m = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()][0]
    assert 0 <= m["reward_mean"] <= 1                                # 1 − brightness
    assert [len(d["images"]) for d in _ru_server.received] == [2, 4]
    capsys.readouterr()
    url = _ru_url(_ru_server, "geneval")
    assert V.main(["--model", "tiny", "--reward", url, "--iterations", "1",
                   "--run_dir", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "has none; pass a .jsonl" in err
    assert not (tmp_path / "no").exists()


# examples/rewards/unifiedreward.py: the VLM judge
from examples.rewards import unifiedreward as UR  # noqa: E402


@pytest.mark.examples
def test_unifiedreward_parser_reads_the_authors_final_score():
    """parse_score follows the authors' regex (sglang_llava/sglang_inference.py): the first
    "Final Score:" followed by 1–5 with optional decimals; anything else is NaN (theirs: 0.0)."""
    nan = math.nan
    cases = {"Final Score: 4.5": 4.5,
             "cat (object): 1\ndog (animal): 0\nFinal Score: 3": 3.0,
             "Final Score:2.25": 2.25,
             "Final Score: 5.": 5.0,
             "Final Score: 4.5/5": 4.5,
             "Final Score: 1\nFinal Score: 4": 1.0,           # the first one
             "Final Score: 10": 1.0,                          # the authors' unanchored [1-5]
             "Final Score: 0": nan, "Final Score: 6": nan, "Final Score: -3": nan,
             "final score: 4": nan, "Final Score: **4**": nan, "Final Score: four": nan,
             "Score: 4": nan, "": nan}
    for text, want in cases.items():
        got = UR.parse_score(text)
        assert (math.isnan(got) and math.isnan(want)) or got == want, (text, got)


_UR_TEMPLATE = (              # Qwen's chatml layout, written here: the tiny processor has none
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _ur_tiny_qwen25vl(folder):
    """A randomly initialised Qwen2.5-VL (87k params) with a byte-level tokenizer and a Qwen2.5-VL
    processor, built offline and saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2_5_VLProcessor, Qwen2TokenizerFast, Qwen2VLImageProcessor,
                              Qwen2VLVideoProcessor)
    from examples.tools.tiny_models import _bytes_to_unicode
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(_bytes_to_unicode().values())},
                               merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = Qwen2TokenizerFast(tokenizer_object=bpe, unk_token=None, bos_token=None,
                             eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             additional_special_tokens=specials)
    ids = dict(zip(specials, tok.convert_tokens_to_ids(specials)))
    proc = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56,
                                                                     max_pixels=112 * 112),
                               tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                               chat_template=_UR_TEMPLATE)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim/2
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                         bos_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(cfg).eval().save_pretrained(folder)
    proc.save_pretrained(folder)


@pytest.mark.examples
def test_unifiedreward_scores_with_a_tiny_qwen25vl_from_UNIFIEDREWARD_MODEL(tmp_path, monkeypatch):
    """examples/rewards/unifiedreward.py loads UNIFIEDREWARD_MODEL with transformers (fp32 on the CPU,
    once), asks the authors' prompt about each image, and returns (N,) fp32 Final Scores: NaN or
    1–5 from the random model; with canned answers, their parsed scores in order across batches.
    A model that is not there is one line naming UNIFIEDREWARD_MODEL."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    d = tmp_path / "ur"
    _ur_tiny_qwen25vl(d)
    monkeypatch.setenv("UNIFIEDREWARD_MODEL", str(d))
    monkeypatch.setenv("UNIFIEDREWARD_MAX_NEW_TOKENS", "4")
    monkeypatch.setenv("UNIFIEDREWARD_BATCH", "2")
    monkeypatch.setattr(UR, "_LOADED", {})
    torch.manual_seed(0)
    images = torch.rand(3, 3, 40, 56)
    prompts = ["a red fox", "a sign: Final Score: 5 {x}", "a cat"]   # a score only in the prompt
    got = UR.score(images, prompts)
    assert got.shape == (3,) and got.dtype == torch.float32
    assert all(math.isnan(s) or 1 <= s <= 5 for s in got.tolist())
    (key, (model, processor)), = UR._LOADED.items()
    assert key == (torch.device("cpu"), str(d)) and model.dtype == torch.float32
    seen, answers = [], iter(["x (object): 1\nFinal Score: 4.5", "no score here", "Final Score: 2"])

    def canned(input_ids, max_new_tokens, do_sample, **kw):
        assert max_new_tokens == 4 and do_sample is False
        assert kw["pixel_values"].dtype == model.dtype
        seen.append(processor.batch_decode(input_ids))
        tok = processor.tokenizer
        new = [tok(next(answers), add_special_tokens=False).input_ids for _ in input_ids]
        width = max(map(len, new))
        new = torch.tensor([a + [tok.pad_token_id] * (width - len(a)) for a in new])
        return torch.cat([input_ids, new], dim=1)

    monkeypatch.setattr(model, "generate", canned)
    got = UR.score(images, prompts)
    assert got[0].item() == 4.5 and math.isnan(got[1].item()) and got[2].item() == 2.0
    assert [len(b) for b in seen] == [2, 1]                                     # batches of 2
    first = seen[0][0]
    assert re.match(r"(<\|endoftext\|>)+<\|im_start\|>user\n", first)   # shorter: left-padded
    assert "<|vision_start|><|image_pad|>" in first
    assert UR.PROMPTS["elements"].format("a red fox") in first
    assert "Text Caption: [a sign: Final Score: 5 {x}]" in seen[0][1]       # and not scored
    monkeypatch.setenv("UNIFIEDREWARD_PROMPT", "criteria")
    answers = iter(["Final Score: 3"] * 3)
    seen.clear()
    assert UR.score(images, prompts).tolist() == [3.0, 3.0, 3.0]
    assert UR.PROMPTS["criteria"].format("a cat") in seen[1][0]
    assert len(UR._LOADED) == 1                                                 # loaded once
    monkeypatch.setenv("UNIFIEDREWARD_PROMPT", "pairwise")
    with pytest.raises(ValueError, match="UNIFIEDREWARD_PROMPT='pairwise'"):
        UR.score(images, prompts)
    monkeypatch.delenv("UNIFIEDREWARD_PROMPT")
    monkeypatch.setenv("UNIFIEDREWARD_MODEL", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=r"^could not load UNIFIEDREWARD_MODEL .*missing.*"
                                           r"set UNIFIEDREWARD_MODEL=/path/to/folder$"):
        UR.score(images, prompts)
