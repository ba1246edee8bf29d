"""Training prompts for the GenEval and OCR stages of the SD3.5-M curriculum, written from templates
here and deterministic from a seed (examples/sd35_curriculum.py uses them).

    python examples/prompts/make_prompts.py --out examples/prompts --seed 0 \\
        --exclude /path/to/geneval/prompts/evaluation_metadata.jsonl

writes, in --out:
  geneval_train.jsonl, geneval_eval.jsonl: GenEval-style prompts, one JSON object a line in the
      format of GenEval's prompts/evaluation_metadata.jsonl [peer X10] (djghosh13/geneval,
      prompts/create_prompts.py): {"tag", "include": [{"class", "count", "color"?,
      "position"?: [relation, index]}], "exclude"?, "prompt"}. Six tags: single_object,
      two_object, counting, colors, position, color_attr. GenEval's conventions: the 80 COCO
      classes as its detector names them, its 10 colours and 4 relations, counts 2–4 with
      "exclude" = count + 1, no colour on "person", and position = [relation, 0]: the second
      object lies <relation> the first. The wording is ours (several templates per tag);
  ocr_train.jsonl, ocr_eval.jsonl: text-rendering prompts {"text", "prompt"}, the text between
      the prompt's only pair of double quotes (what the OCR reward reads);
  README.md: the command and seed that made them, and the counts.

The eval files are small held-out splits for vgrpo's --eval_prompts. vgrpo evaluates their first
--n_eval lines, so the GenEval one alternates tags line by line; the training files are shuffled.
No prompt is in both splits; the GenEval splits share no objects either (same tag, classes,
counts, colours and positions), except single_object, whose 80 classes all appear in training, and
the OCR splits share no text.

--exclude FILE (GenEval's evaluation_metadata.jsonl, or a text file of prompts) drops every
generated prompt whose text is in FILE (case, spaces and a final period ignored) and, for every tag
but single_object (GenEval's benchmark lists all 80 single objects), every prompt asking for the
same objects as an entry of FILE. Prompts are generated first and dropped afterwards, so the files
made with --exclude are those made without it minus the dropped lines (README.md counts them).
GenEval's file is not redistributed here.
"""
import argparse
import hashlib
import json
import random
import re
import shlex
import sys
from pathlib import Path

# The 80 COCO classes, spelled as GenEval's prompts/object_names.txt spells them (its detector's
# label names, which a GenEval reward matches against "class").
CLASSES = ["person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
           "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat",
           "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack",
           "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
           "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
           "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl",
           "banana", "apple", "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza",
           "donut", "cake", "chair", "couch", "potted plant", "bed", "dining table", "toilet",
           "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone",
           "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase",
           "scissors", "teddy bear", "hair drier", "toothbrush"]
COLORS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"]
RELATIONS = ["left of", "right of", "above", "below"]          # GenEval's "position" relations
NUMBERS = {2: "two", 3: "three", 4: "four"}
TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]

PLURAL = {"person": "people", "sheep": "sheep", "knife": "knives", "skis": "pairs of skis",
          "scissors": "pairs of scissors", "computer mouse": "computer mice"}
# Each template names every object of its tag; {a}, {b}: an object with its article ("an apple",
# "a red car"); {n}: a number word; {p}: a plural; {r}: a relation phrase. GenEval's own phrasing is
# "a photo of ..."; single_object avoids it, since GenEval's benchmark holds "a photo of" all 80.
TEMPLATES = {
    "single_object": ["a picture of {a}", "an image of {a}", "a photograph of {a}",
                      "a close-up photo of {a}", "a realistic photo of {a}", "a snapshot of {a}",
                      "a high-quality photo of {a}", "a photo showing {a}"],
    "two_object": ["a photo of {a} and {b}", "a picture of {a} and {b}", "an image of {a} and {b}",
                   "a photograph showing {a} and {b}"],
    "counting": ["a photo of {n} {p}", "a picture of {n} {p}", "an image of exactly {n} {p}",
                 "a photograph of {n} {p}", "a realistic photo of {n} {p}",
                 "a photo showing {n} {p}"],
    "colors": ["a photo of {a}", "a picture of {a}", "an image of {a}", "a photograph of {a}"],
    "position": ["a photo of {a} {r} {b}", "a picture of {a} {r} {b}", "an image of {a} {r} {b}",
                 "a photograph of {a} {r} {b}"],
    "color_attr": ["a photo of {a} and {b}", "a picture of {a} and {b}", "an image of {a} and {b}",
                   "a photograph of {a} and {b}"],
}
RELATION_PHRASES = {"left of": ["left of", "to the left of"],
                    "right of": ["right of", "to the right of"],
                    "above": ["above"], "below": ["below"]}

# ---- OCR: scenes that carry text, and the texts ------------------------------------------------
OCR_TEMPLATES = [
    'a wooden sign by a hiking trail that says "{t}"',
    'a neon sign reading "{t}" on a brick wall at night',
    'a coffee mug printed with the words "{t}" on a kitchen table',
    'a chalkboard menu outside a cafe with "{t}" written in white chalk',
    'a t-shirt with "{t}" printed across the chest, product photo',
    'a billboard above a highway showing the slogan "{t}"',
    'a birthday cake with "{t}" written in blue icing',
    'a vintage book cover with the title "{t}" in gold letters',
    'a storefront window with "{t}" painted on the glass',
    'a road sign that reads "{t}" under a clear sky',
    'a handwritten note on yellow paper that says "{t}"',
    'a movie poster with the title "{t}" in large bold letters',
    'a laptop sticker that says "{t}", close-up',
    'a street mural with the word "{t}" in bright colours',
    'a license plate reading "{t}" on the back of a car',
    'a shop awning with "{t}" in white letters',
    'a banner at a football stadium that reads "{t}"',
    'a glowing computer screen displaying the message "{t}"',
    'a wedding invitation card with "{t}" in elegant script',
    'a cereal box on a supermarket shelf labelled "{t}"',
    'a door with a brass plaque engraved "{t}"',
    'a smartphone screen showing a notification that says "{t}"',
    'a cardboard protest sign with "{t}" written in marker',
    'a bakery box tied with string and stamped "{t}"',
    'a sand castle on a beach with "{t}" written in the sand',
    'a vintage train station board displaying "{t}"',
    'a wine bottle with a label that reads "{t}"',
    'a classroom whiteboard with "{t}" written on it',
    'a hot air balloon with "{t}" painted on its side',
    'a baseball cap embroidered with "{t}"',
    'a greeting card that says "{t}" surrounded by flowers',
    'a food truck with "{t}" painted on the side',
    'a street sign on a pole reading "{t}"',
    'a candle jar with a label saying "{t}"',
    'a magazine cover with the headline "{t}"',
    'a tote bag with "{t}" printed on it, studio photo',
    'a doormat in front of a house that says "{t}"',
    'an old typewriter with a sheet of paper that reads "{t}"',
    'a rocket on a launch pad with "{t}" written on its body',
    'a pizza box with "{t}" printed on the lid',
]
OCR_PHRASES = [
    "Open Late", "Fresh Bread", "Welcome Home", "Good Morning", "Stay Curious", "Hello World",
    "No Parking", "Free Wifi", "Hot Coffee", "Summer Sale", "Thank You", "Happy Birthday",
    "Keep Calm", "Be Kind", "Dream Big", "Exit Only", "Lost Cat", "Grand Opening", "Sold Out",
    "Pay Here", "Now Hiring", "Closed Sunday", "Road Work Ahead", "Slow Down", "Quiet Please",
    "Best Pizza", "Fish Market", "City Library", "Night Owl", "Sweet Dreams", "Game Over",
    "Try Again", "Merry Christmas", "Happy New Year", "Good Luck", "Well Done", "Take Care",
    "Stop Here", "One Way", "Dead End", "Push", "Pull", "Danger", "Caution", "Private", "Enter",
    "Snack Bar", "Book Club", "Art Show", "Jazz Night", "Farm Stand", "Ice Cream", "Tea Time",
    "Garden Party", "Blue Moon", "Red Rocks", "Silver Lake", "Golden Hour", "Big Sky", "Wild West",
    "Ocean View", "Mountain Pass", "River Walk", "Sunset Blvd", "Main Street", "Park Avenue",
    "Gate 12", "Room 404", "Route 66", "Level 3", "Platform 9", "Aisle 7", "Since 1985",
    "Open 24 Hours",
]
OCR_WORDS = (
    "apple amber anchor arrow autumn bakery balloon banana beach bicycle bird blossom bloom bold "
    "book breeze bridge bright brook cabin cactus candle canyon castle cedar cherry cider cinema "
    "citrus cloud clover coast cobalt comet coral cosmic cotton cozy crystal daisy dawn desert "
    "dragon dream drift eagle echo ember falcon fern fiesta forest fox galaxy garden ginger "
    "glacier glow golden granite harbor harvest hazel honey horizon island ivory jasmine jungle "
    "kettle kite lagoon lantern lemon lighthouse lily lotus lucky lunar maple marble meadow "
    "melody mint misty moon mosaic nectar noble north oasis ocean olive orbit orchid owl paper "
    "peach pebble pepper pine pixel planet plum polar poppy prairie pumpkin quartz rain raven "
    "ripple river robin rocket rose ruby saffron sage salt sapphire scarlet shadow silver sky "
    "snow solar spark spice spring star stone storm sugar summit sun swift thunder tide tiger "
    "timber toast tulip twilight valley velvet violet voyage walnut wave willow winter wolf "
    "yellow zephyr"
).split()


def article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def one(name: str, color: str = "") -> str:
    """One object with its article and colour: "an apple", "a red car", "a pair of blue skis"."""
    noun = f"{color} {name}".strip()
    return article(f"pair of {noun}" if name in ("skis", "scissors") else noun)


def plural(name: str) -> str:
    if name in PLURAL:
        return PLURAL[name]
    return name + ("es" if re.search(r"(s|x|ch|sh)$", name) else "s")


def norm(text: str) -> str:
    """What --exclude and the splits compare: lower case, single spaces, no final period."""
    return " ".join(text.lower().split()).rstrip(".")


def content_key(meta: dict) -> str:
    """The objects a GenEval entry asks for (tag, include, exclude; not the wording). The two
    unordered tags sort their objects; position keeps GenEval's order (reference object first)."""
    inc = [json.dumps(o, sort_keys=True) for o in meta["include"]]
    if meta["tag"] in ("two_object", "color_attr"):
        inc = sorted(inc)
    exc = [json.dumps(o, sort_keys=True) for o in meta.get("exclude", [])]
    return json.dumps([meta["tag"], inc, exc])


def split_key(meta: dict) -> str:
    """What the held-out split never shares with training: the prompt text for single_object (80
    classes only), the objects for every other tag."""
    return norm(meta["prompt"]) if meta["tag"] == "single_object" else content_key(meta)


def geneval_entry(tag: str, rng: random.Random) -> dict:
    """One random GenEval-style entry of `tag`, its fields in GenEval's order (prompt last)."""
    not_person = [c for c in CLASSES if c != "person"]           # no "[colour] person" (GenEval)
    t = rng.choice(TEMPLATES[tag])
    if tag == "single_object":
        c = rng.choice(CLASSES)
        return dict(tag=tag, include=[{"class": c, "count": 1}], prompt=t.format(a=one(c)))
    if tag == "two_object":
        a, b = rng.sample(CLASSES, 2)
        return dict(tag=tag, include=[{"class": a, "count": 1}, {"class": b, "count": 1}],
                    prompt=t.format(a=one(a), b=one(b)))
    if tag == "counting":
        c, n = rng.choice(CLASSES), rng.randint(2, 4)
        return dict(tag=tag, include=[{"class": c, "count": n}],
                    exclude=[{"class": c, "count": n + 1}],
                    prompt=t.format(n=NUMBERS[n], p=plural(c)))
    if tag == "colors":
        c, col = rng.choice(not_person), rng.choice(COLORS)
        return dict(tag=tag, include=[{"class": c, "count": 1, "color": col}],
                    prompt=t.format(a=one(c, col)))
    if tag == "position":
        a, b = rng.sample(CLASSES, 2)                            # "a {r} b": b is the reference
        rel = rng.choice(RELATIONS)
        return dict(tag=tag, include=[{"class": b, "count": 1},
                                      {"class": a, "count": 1, "position": [rel, 0]}],
                    prompt=t.format(a=one(a), r=rng.choice(RELATION_PHRASES[rel]), b=one(b)))
    if tag == "color_attr":
        (a, b), (ca, cb) = rng.sample(not_person, 2), rng.sample(COLORS, 2)
        return dict(tag=tag, include=[{"class": a, "count": 1, "color": ca},
                                      {"class": b, "count": 1, "color": cb}],
                    prompt=t.format(a=one(a, ca), b=one(b, cb)))
    raise ValueError(tag)


def distinct(draw, n: int, key, avoid=lambda e: False, what: str = "") -> list:
    """n entries of draw() with distinct key(entry), none for which avoid(entry) holds. Gives up
    after 20,000 draws in a row brought nothing new."""
    out, seen, idle = [], set(), 0
    while idle < 20_000:
        e, idle = draw(), idle + 1
        if key(e) not in seen and not avoid(e):
            seen.add(key(e))
            out.append(e)
            idle = 0
        if len(out) == n:
            return out
    raise ValueError(f"could not draw {n} distinct {what} prompts (got {len(out)}); ask for fewer")


def interleave(groups: list) -> list:
    """[[a1, a2], [b1], [c1, c2]] → [a1, b1, c1, a2, c2]: the first lines cover every group."""
    out = []
    for i in range(max(map(len, groups))):
        out += [g[i] for g in groups if i < len(g)]
    return out


def make_geneval(seed: int, per_tag: int, eval_per_tag: int) -> tuple[list, list]:
    """(train, eval) entries: per tag, eval_per_tag held-out entries, then per_tag training
    entries with distinct prompts that share no split_key with the held-out ones."""
    train, held = [], []
    for tag in TAGS:
        rng = random.Random(f"{seed}-geneval-{tag}")       # one stream per tag: sizes independent
        draw = lambda: geneval_entry(tag, rng)              # noqa: E731
        h = distinct(draw, eval_per_tag, split_key, what=tag)
        held_keys = {split_key(e) for e in h}
        train += distinct(draw, per_tag, lambda e: norm(e["prompt"]),
                          lambda e: split_key(e) in held_keys, tag)
        held.append(h)
    random.Random(f"{seed}-geneval-shuffle").shuffle(train)
    return train, interleave(held)


def ocr_text(rng: random.Random) -> str:
    """A text to render: a short phrase, or one or two words of the list in some letter case."""
    kind = rng.random()
    if kind < 0.3:
        return rng.choice(OCR_PHRASES)
    words = rng.sample(OCR_WORDS, rng.choice((1, 2, 2)))
    style = rng.choice(("title", "title", "upper", "lower"))
    text = " ".join(words)
    return {"title": text.title(), "upper": text.upper(), "lower": text}[style]


def make_ocr(seed: int, n_train: int, n_eval: int) -> tuple[list, list]:
    """(train, eval) entries; the held-out texts never appear in training, in any letter case."""
    rng = random.Random(f"{seed}-ocr")
    held = distinct(lambda: _ocr_entry(rng), n_eval, lambda e: norm(e["text"]), what="OCR")
    held_texts = {norm(e["text"]) for e in held}
    train = distinct(lambda: _ocr_entry(rng), n_train, lambda e: norm(e["prompt"]),
                     lambda e: norm(e["text"]) in held_texts, "OCR")
    return train, held


def _ocr_entry(rng: random.Random) -> dict:
    text = ocr_text(rng)
    return {"text": text, "prompt": rng.choice(OCR_TEMPLATES).format(t=text)}


def read_exclude(path: str) -> tuple[set, set]:
    """(normalised prompt texts, content keys) of a GenEval metadata .jsonl, or the lines of a
    text file of prompts (texts only)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--exclude {path!r} is not a file; pass GenEval's "
                         "prompts/evaluation_metadata.jsonl")
    texts, keys = set(), set()
    lines = [l for l in p.read_text(encoding="utf-8").splitlines() if l.strip()]
    for i, line in enumerate(lines, 1):
        if not path.endswith(".jsonl"):
            texts.add(norm(line))
            continue
        try:
            meta = json.loads(line)
            texts.add(norm(meta["prompt"]))
            if "tag" in meta and "include" in meta:
                keys.add(content_key(meta))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--exclude {path!r}, line {i}: not a JSON object with a "
                             '"prompt"') from None
    return texts, keys


def excluded(meta: dict, texts: set, keys: set) -> bool:
    if norm(meta["prompt"]) in texts:
        return True
    return meta.get("tag", "single_object") != "single_object" and content_key(meta) in keys


def write_jsonl(path: Path, entries: list) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")


def main(argv=None) -> int:
    """The command line: draw both prompt sets, drop the excluded prompts, write the files."""
    p = argparse.ArgumentParser(description="GenEval-style and OCR training prompts, "
                                "deterministic from --seed")
    p.add_argument("--out", default="examples/prompts", help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of every draw")
    p.add_argument("--exclude", help="GenEval's evaluation_metadata.jsonl (or a .txt of prompts): "
                   "drop its prompts and, but for single_object, their objects")
    p.add_argument("--geneval_per_tag", type=int, default=500, help="training prompts per tag")
    p.add_argument("--geneval_eval_per_tag", type=int, default=10, help="held-out prompts per tag")
    p.add_argument("--ocr_train", type=int, default=2000, help="OCR training prompts")
    p.add_argument("--ocr_eval", type=int, default=60, help="OCR held-out prompts")
    p.error = lambda message: p.exit(2, f"error: {message} (--help lists every flag)\n")
    args = p.parse_args(argv)
    for k in ("geneval_per_tag", "geneval_eval_per_tag", "ocr_train", "ocr_eval"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be ≥ 1 (got {getattr(args, k)})")
    try:
        texts, keys = read_exclude(args.exclude) if args.exclude else (set(), set())
        sets = dict(zip(("geneval_train", "geneval_eval"),
                        make_geneval(args.seed, args.geneval_per_tag, args.geneval_eval_per_tag)))
        sets.update(zip(("ocr_train", "ocr_eval"),
                        make_ocr(args.seed, args.ocr_train, args.ocr_eval)))
    except ValueError as e:
        p.error(str(e))
    dropped = {}
    for name, entries in sets.items():
        sets[name] = [e for e in entries if not excluded(e, texts, keys)]
        dropped[name] = len(entries) - len(sets[name])

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, entries in sets.items():
        write_jsonl(out / f"{name}.jsonl", entries)
    (out / "README.md").write_text(readme(args, sets, dropped), encoding="utf-8")
    for name, entries in sets.items():
        print(f"{out / name}.jsonl: {len(entries)} prompts ({dropped[name]} dropped by --exclude)")
    return 0


def readme(args, sets: dict, dropped: dict) -> str:
    """README.md of the output folder: how the files were made, and what they hold."""
    cmd = ["python", "examples/prompts/make_prompts.py", "--out", args.out, "--seed", str(args.seed)]
    for k, default in (("geneval_per_tag", 500), ("geneval_eval_per_tag", 10), ("ocr_train", 2000),
                       ("ocr_eval", 60)):
        if getattr(args, k) != default:
            cmd += [f"--{k}", str(getattr(args, k))]
    excl = "no --exclude"
    if args.exclude:
        cmd += ["--exclude", Path(args.exclude).name]
        data = Path(args.exclude).read_bytes()
        excl = (f"--exclude {Path(args.exclude).name} ({len(data.splitlines())} lines, sha256 "
                f"{hashlib.sha256(data).hexdigest()}): GenEval's prompts/evaluation_metadata.jsonl "
                "(github.com/djghosh13/geneval), not redistributed here")
    rows = []
    for name, entries in sets.items():
        tags = [e["tag"] for e in entries if "tag" in e]
        per = ", ".join(f"{t} {tags.count(t)}" for t in TAGS if t in tags) or "—"
        rows.append(f"| {name}.jsonl | {len(entries)} | {dropped[name]} | {per} |")
    return "\n".join([
        "# Prompt sets for the GenEval and OCR stages",
        "",
        "Written by `examples/prompts/make_prompts.py` (its docstring describes the templates and "
        "formats):",
        "",
        "```bash",
        shlex.join(cmd),
        "```",
        "",
        f"Seed {args.seed}; {excl}. The same command without `--exclude` writes these files plus "
        "the dropped lines, in the same order.",
        "",
        "| file | prompts | dropped by --exclude | per tag |",
        "|---|---|---|---|",
        *rows,
        "",
        "Use: `python vgrpo.py --reward geneval --prompts examples/prompts/geneval_train.jsonl "
        "--eval_prompts examples/prompts/geneval_eval.jsonl`, and the same with `ocr`; "
        "`examples/sd35_curriculum.py` passes them to its GenEval and OCR stages.",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
