"""Evaluate a base model and its trained checkpoints on prompts they never saw, with every reward.

    python examples/evaluate.py --model sd3.5-medium --checkpoints runs/<run> \\
        --prompts test_prompts.txt \\
        --rewards pickscore,hpsv2,clipscore,examples.rewards.aesthetic:score --out runs/eval

The eight metrics of the V-GRPO paper's SD3.5-Medium table (Table 3), each on its own prompts:

    python examples/evaluate.py --model sd3.5-medium --checkpoints runs/<run> --metrics paper \\
        --prompts test_prompts.txt --geneval_prompts geneval.jsonl --ocr_prompts ocr.txt \\
        --out runs/eval

It answers what a run leaves open: did the checkpoint raise the reward on held-out prompts, by how
much, how sure is that, and what happened to the other rewards (reward hacking shows as a gain on
the trained reward next to a loss on the others). Every model draws image i of prompt p from the
same initial noise, seeded by (seed, p, i), so the comparison is paired: the base and each
checkpoint are scored on the same prompts AND the same noises.

Prompt sets: --prompts is scored with every --rewards; --geneval_prompts (a .jsonl file whose
lines carry GenEval's metadata) with GenEval alone, and --ocr_prompts (the text to render in
double quotes) with OCR alone. Each set is sampled once per model and scored once.

Statistics: each prompt's score is the mean over its images; a model's score is the mean over
prompts, with a 95 % percentile bootstrap interval over prompts (prompts resampled with
replacement, 10,000 resamples from a fixed seed, the same resamples for every model and reward of
a prompt set). The difference to the baseline (default: the base model) is computed prompt by
prompt and bootstrapped over the same resamples, so its interval is that of a paired difference.
GenEval's score is the mean over its tags of each tag's mean (GenEval's own overall score), its
prompts resampled within each tag.

Outputs (--out): settings.json, scores.jsonl (one line per image: model, prompt, every reward),
images/<model>/p<prompt>_i<image>.png, results.json, results.md and grid.png (rows: the first
prompts, columns: the models, the same noise in every column); the GenEval and OCR sets the same
in geneval/ and ocr/. A killed evaluation continues where it stopped when run again with the same
flags; models and prompt sets may be added to a finished one.

Everything model-related is vgrpo.py's own: load_pipeline, make_adapter, add_lora, load_trainable,
read_checkpoint, rollout, decode_and_reward, build_reward, probe_reward, and the trainer's flag
names. examples/evaluate.md documents every flag and a real output.
"""
import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

import vgrpo as V

ConfigError = V.ConfigError

# Flags shared with vgrpo.py: the same names, types, choices and meaning (Args is their source).
TRAINER_FLAGS = ("model", "prompts", "num_steps", "solver", "resolution", "max_sequence_length",
                 "guidance", "flux_shift", "seed", "rollout_batch", "reward_batch", "device",
                 "dtype", "offload_text_encoders", "pickscore_model", "pickscore_processor",
                 "clip_model")
# What a checkpoint's saved config supplies when the flag is not given: how its run sampled
# (resolution, text length, steps, solver) and where its reward models were. Not the machine's
# knobs (device, batches), nor the seed.
FROM_CHECKPOINT = ("model", "num_steps", "eval_steps", "solver", "resolution",
                   "max_sequence_length", "guidance", "flux_shift", "dtype", "pickscore_model",
                   "pickscore_processor", "clip_model")
HELP = {"model": "the base model: alias, hub id or local diffusers folder (default: the first "
                 "checkpoint's)",
        "prompts": "prompts scored with every --rewards: a text file, one per line, every line "
                   "used, or a .jsonl file (one JSON object with a \"prompt\" per line); optional "
                   "with --geneval_prompts or --ocr_prompts",
        "num_steps": "ODE steps per image (default: the checkpoint's evaluation steps, else the "
                     "model's preset)",
        "seed": "seed of the initial noises: image i of prompt p uses the seed (seed, p, i)",
        "rollout_batch": "images per batched ODE solve (memory knob; also the unit a resumed "
                         "evaluation redoes)"}
BOOT_DRAWS, BOOT_SEED, LEVEL = 10_000, 0, 0.95
KINDS = ("base", "lora", "full")          # sampled in this order: a full fine-tune overwrites
# The metrics of the V-GRPO paper's SD3.5-Medium table (Table 3), in its column order, which
# results.md keeps. GenEval and OCR are scored on prompt sets of their own (SETS: what each set's
# prompts must carry, and the reward that scores its column by default: for GenEval its own
# verdict per image, 1 or 0, which the benchmark reports, not the partial-credit training reward
# `geneval`); --metrics paper scores the other six on --prompts.
TABLE3 = ("geneval", "ocr", "pickscore", "clipscore", "hpsv2", "aesthetic", "imagereward",
          "unifiedreward")
PAPER_REWARDS = TABLE3[2:]
SETS = {"geneval": ("GenEval's metadata on every line: a .jsonl file",
                    "examples.rewards.geneval:accuracy"),
        "ocr": ("the text to render between double quotes", "ocr")}


@dataclass
class Model:
    """One column of the comparison: the base model, or a checkpoint of a run on top of it."""
    tag: str                              # "base", or <run folder>-it<iteration>
    kind: str                             # one of KINDS
    entry: str = "base"                   # as given to --checkpoints
    ckpt: Optional[Path] = None           # the checkpoint folder
    iteration: Optional[int] = None
    config: dict = field(default_factory=dict)      # the checkpoint's training config

    def describe(self) -> dict:
        return {"kind": self.kind, "checkpoint": None if self.ckpt is None else str(self.ckpt),
                "iteration": self.iteration}


@dataclass
class PromptSet:
    """A prompt file and the metrics scored on it: --prompts with every --rewards, or one of SETS
    with its own metric. Each model samples every set; its images and records are in folder()."""
    key: str                              # "prompts", or a key of SETS
    path: str
    prompts: list                         # str; a .jsonl file's carry .metadata
    rewards: dict                         # {metric: the reward that scores it, as build_reward's}

    def folder(self, out: Path) -> Path:
        return out if self.key == "prompts" else out / self.key

    def flag(self) -> str:
        return "--prompts" if self.key == "prompts" else f"--{self.key}_prompts"

    def tags(self) -> Optional[list]:
        """GenEval's tag of every prompt (its metadata's "tag"), if each has one; else None."""
        tags = [(getattr(p, "metadata", None) or {}).get("tag") for p in self.prompts]
        return tags if self.key == "geneval" and None not in tags else None


# ------------------------------------------------------------------------------------------------
# Command line and configuration: everything checked before anything loads or is written.
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    a = p.add_argument
    a("--checkpoints", nargs="*", default=[], metavar="RUN_OR_CKPT",
      help="checkpoint folders, or run folders (their latest checkpoint); LoRA or full fine-tune, "
           "read from each checkpoint's trainer_state.pt. 'base' names the base model again")
    a("--rewards", help="comma-separated rewards to score on --prompts, each reported on its "
                        f"own: built-in ({', '.join(V.BUILTIN_REWARDS)}) or module.path:function "
                        "(default: the first checkpoint's --reward and --eval_rewards)")
    a("--metrics", choices=["paper"], help="'paper': the V-GRPO paper's eight SD3.5-Medium "
      f"metrics: {', '.join(PAPER_REWARDS)} on --prompts (in place of --rewards), GenEval on "
      "--geneval_prompts and OCR on --ocr_prompts (both then required)")
    for key, (what, default) in SETS.items():
        a(f"--{key}_prompts", metavar="FILE", help=f"prompts with {what}; every model samples "
          f"them, and {key} alone scores them (in its own folder, {key}/)")
        a(f"--{key}_reward", metavar="REWARD", help=f"what scores the {key} column: a reward "
          f"name, module.path:function or URL [default {default}]")
    a("--images_per_prompt", type=int, default=4, help="images per prompt and model [default 4]")
    a("--out", required=True, help="output folder; run again with the same flags to continue")
    a("--baseline", default="base", help="the model the differences are taken to: 'base', a "
                                         "model tag or a --checkpoints entry [default base]")
    a("--grid_prompts", type=int, default=8, help="prompts (rows) in grid.png [default 8]")
    a("--grid_images", type=int, default=1, help="images per prompt and model in grid.png "
                                                 "[default 1]")
    fields = {f.name: f for f in dataclasses.fields(V.Args)}
    types = {"int": int, "float": float, "str": str}
    for name in TRAINER_FLAGS:                       # as vgrpo.given_flags builds them
        f = fields[name]
        where = ("the first checkpoint's, else " if name in FROM_CHECKPOINT else "") + \
            "vgrpo.py's for the model"
        kw = dict(default=argparse.SUPPRESS, help=HELP.get(name, f.metadata["help"]) +
                  ("" if name in HELP else f" [vgrpo.py's flag; default: {where}]"))
        if f.type in ("bool", bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = types[str(f.type).replace("Optional[", "").rstrip("]")]
            kw["choices"] = f.metadata["choices"]
        a(f"--{name}", **kw)
    return p


def read_models(entries: list[str]) -> list[Model]:
    """The base, then one Model per --checkpoints entry, each validated by vgrpo's reader. A model
    named twice gets a numbered tag (tag-2): sampled twice, a determinism check."""
    models = [Model("base", "base")]
    for e in entries:
        if e == "base":
            m = Model("base", "base")
        else:
            try:
                ckpt, state = V.read_checkpoint(e)
            except ConfigError as err:                    # its message names the trainer's flag
                raise ConfigError(str(err).replace("--resume", "--checkpoints")) from None
            cfg = state["config"]
            run = ckpt.parent.parent.name if ckpt.parent.name == "checkpoints" else ckpt.name
            m = Model(f"{run}-it{state['iteration']}", "full" if cfg["full_finetune"] else "lora",
                      e, ckpt, state["iteration"], cfg)
        tag, k = m.tag, 2
        while m.tag in {x.tag for x in models}:
            m.tag, k = f"{tag}-{k}", k + 1
        models.append(m)
    return models


def reward_names(spec: Optional[str], first: dict) -> list[str]:
    """--rewards → names; without it the first checkpoint's training and evaluation rewards."""
    if spec is None:
        if not first:
            raise ConfigError("--rewards is required without --checkpoints, e.g. "
                              "--rewards pickscore,hpsv2,clipscore,examples.rewards.aesthetic:score")
        spec = ",".join([first["reward"]] + [first["eval_rewards"]] * bool(first["eval_rewards"]))
        terms = dict.fromkeys(n for n, _ in V.parse_reward_spec(spec))
        return list(terms)
    try:
        terms = V.parse_reward_spec(spec)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--reward ", "--rewards ")) from None
    if weighted := [n for n, w in terms if w != 1.0]:
        raise ConfigError(f"--rewards {spec!r}: each reward is reported on its own, so weights "
                          f"mean nothing here; drop the weight of {weighted[0]!r}")
    return [n for n, _ in terms]


def set_reward(key: str, spec: Optional[str]) -> str:
    """--<key>_reward → the one reward that scores a set's metric (default: SETS')."""
    spec = spec or SETS[key][1]
    try:
        (name, weight), *more = V.parse_reward_spec(spec)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--reward ", f"--{key}_reward ")) from None
    if more or weight != 1.0:
        raise ConfigError(f"--{key}_reward {spec!r}: name one reward, without a weight")
    return name


def configure(ns: argparse.Namespace):
    """Flags → (Args, models, prompt sets). vgrpo's own resolution of presets applies, with the
    first checkpoint's config between the presets and the flags given."""
    given = {k: v for k, v in vars(ns).items() if k in TRAINER_FLAGS}
    models = read_models(ns.checkpoints)
    first = next((m.config for m in models if m.config), {})
    if "model" not in given and not first:
        raise ConfigError("--model is required without --checkpoints (an alias, a hub id or a "
                          "local diffusers folder)")
    files = {k: getattr(ns, f"{k}_prompts") for k in SETS}
    if ns.metrics == "paper":
        lacking = ["--prompts"] * ("prompts" not in given) + [f"--{k}_prompts" for k, f in
                                                               files.items() if f is None]
        if lacking or ns.rewards:
            raise ConfigError("--metrics paper scores six rewards on --prompts (in place of "
                              "--rewards), GenEval on --geneval_prompts and OCR on --ocr_prompts; "
                              + ("drop --rewards" if ns.rewards else
                                 "pass " + " and ".join(lacking)))
    if "prompts" not in given and not any(files.values()):
        raise ConfigError("--prompts is required: a text file, one prompt per line (or "
                          f"--{'_prompts, --'.join(SETS)}_prompts alone)")
    if "prompts" not in given and ns.rewards:
        raise ConfigError("--rewards scores the prompts of --prompts; pass --prompts")
    for k, f in files.items():
        if getattr(ns, f"{k}_reward") and not f:
            raise ConfigError(f"--{k}_reward scores the prompts of --{k}_prompts; pass "
                              f"--{k}_prompts")
    inherited = {k: first[k] for k in FROM_CHECKPOINT if k in first}
    # n_mc is training-only, but check_args relates it to num_steps: one pair fits any grid
    args = V.resolve_args({**given, "n_mc": 1}, resumed=inherited)
    args = dataclasses.replace(args, num_steps=given.get("num_steps") or args.eval_steps
                               or args.num_steps, eval_holdout=0.0, eval_prompts=None)
    counts = {"images_per_prompt": (ns.images_per_prompt, 1), "grid_prompts": (ns.grid_prompts, 0),
              "grid_images": (ns.grid_images, 1), "seed": (args.seed, 0)}
    problems = [f"--{k} must be ≥ {lo} (got {v})" for k, (v, lo) in counts.items() if v < lo]
    if problems:
        raise ConfigError("; ".join(problems))
    sets = []
    if "prompts" in given:                   # every line, in file order
        spec = ",".join(PAPER_REWARDS) if ns.metrics == "paper" else ns.rewards
        names = reward_names(spec, first)
        sets.append(PromptSet("prompts", args.prompts,
                              V.read_prompt_file(args.prompts, "--prompts"), {n: n for n in names}))
    for k, f in files.items():
        if f is None:
            continue
        if any(k in s.rewards for s in sets):
            raise ConfigError(f"--rewards names {k!r}, which --{k}_prompts scores on its own "
                              "prompts; drop it from --rewards")
        sets.append(PromptSet(k, f, V.read_prompt_file(f, f"--{k}_prompts"),
                              {k: set_reward(k, getattr(ns, f"{k}_reward"))}))
    return args, models, sets


def baseline_tag(value: str, models: list[Model]) -> str:
    for m in models:
        if value == m.tag:
            return m.tag
    for m in models:
        if value == m.entry:
            return m.tag
    raise ConfigError(f"--baseline {value!r} is none of the models: "
                      f"{', '.join(m.tag for m in models)}")


def set_settings(s: PromptSet) -> dict:
    """What decides a prompt set's images and scores: its prompts (their text and metadata, by
    SHA-256) and rewards."""
    lines = [p if getattr(p, "metadata", None) is None else json.dumps(p.metadata, sort_keys=True)
             for p in s.prompts]
    return {"prompts": str(s.path), "n_prompts": len(s.prompts),
            "prompts_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
            "rewards": list(s.rewards) if s.key == "prompts" else s.rewards}


def settings_of(args, ns, models, sets, dtype) -> dict:
    """What decides every image and score; a folder continues only with the same settings. The
    --prompts set's keys are at the top, each other set's under its key."""
    model = str(Path(args.model).resolve()) if os.path.isdir(args.model) else args.model
    out = {"model": model}
    for s in sets:
        if s.key == "prompts":
            out.update(set_settings(s))
        else:
            out[s.key] = set_settings(s)
    return {**out, "images_per_prompt": ns.images_per_prompt, "num_steps": args.num_steps,
            "solver": args.solver, "seed": args.seed, "resolution": args.resolution,
            "max_sequence_length": args.max_sequence_length,
            **({"guidance": args.guidance, "flux_shift": args.flux_shift}
               if V.model_family(args.model) == "flux" else {}),
            "dtype": str(dtype).removeprefix("torch."),
            "models": {m.tag: m.describe() for m in models}}


def check_out(out: Path, settings: dict) -> dict:
    """--out must be writable; if it holds an evaluation, the settings must agree (models and
    prompt sets may be added, and a set's file may move). Returns the settings to save: the old
    ones with the new models and sets. Creates nothing."""
    top = next(q for q in (out.absolute(), *out.absolute().parents) if q.exists())
    if not top.is_dir():
        raise ConfigError(f"--out {str(out)!r}: {str(top)!r} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=top).close()
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot write in {str(top)!r} ({e.strerror})") \
            from None
    if not (out / "settings.json").is_file():
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"--out {str(out)!r} is not empty and holds no evaluation "
                              "(settings.json); pass a new or an empty folder")
        return settings
    old = json.loads((out / "settings.json").read_text())
    differ = []
    for k, v in settings.items():
        added = k in (*SETS, "n_prompts", "prompts_sha256", "rewards") and k not in old
        if added or k in ("models", "prompts"):     # a prompt set added; a file moved
            continue
        if k in SETS:
            differ += [f"{k} {x}" for x in v if x != "prompts" and old[k].get(x) != v[x]]
        elif old.get(k) != v:
            differ.append(k)
    differ += [f"model {t}" for t, m in settings["models"].items()
               if old["models"].get(t, m) != m]
    if differ:
        raise ConfigError(f"--out {str(out)!r} holds an evaluation with other settings "
                          f"({', '.join(differ)}); pass another --out, or the same flags to "
                          "continue it")
    return {**old, **settings, "models": {**old["models"], **settings["models"]}}


# ------------------------------------------------------------------------------------------------
# Models: the base pipeline once; each checkpoint checked against it, then swapped in and out.
# ------------------------------------------------------------------------------------------------
def saved_shapes(m: Model) -> dict:
    """{tensor name: shape} of a checkpoint's weights, read from the file's header only."""
    from safetensors import safe_open
    with safe_open(str(m.ckpt / (V.FULL_FILE if m.kind == "full" else V.LORA_FILE)), "pt") as f:
        return {k.removeprefix("transformer."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def expected_shapes(adapter, m: Model) -> dict:
    """{tensor name: shape} the checkpoint must hold to fit this transformer: its whole state
    dict (full fine-tune), or the LoRA that its rank, alpha and targets attach (then removed)."""
    tr = adapter.transformer
    if m.kind == "full":
        return {k: tuple(v.shape) for k, v in tr.state_dict().items()}
    attach(adapter, m, load=False)
    try:                                             # peft names them lora_A.<adapter>.weight
        return {n.replace(".default.", "."): tuple(p.shape) for n, p in tr.named_parameters()
                if "lora_" in n}
    finally:
        detach(adapter, m)


def check_match(adapter, m: Model, model: str) -> None:
    """A checkpoint of another model (other blocks, widths or architecture) fails here, in one
    line, before anything is sampled."""
    try:
        want, got = expected_shapes(adapter, m), saved_shapes(m)
    except Exception as e:  # noqa: BLE001 — e.g. peft finding none of the LoRA's target modules
        raise ConfigError(f"checkpoint {str(m.ckpt)!r} ({m.kind}) does not fit --model {model!r}: "
                          f"{type(e).__name__}: {e}") from None
    if want == got:
        return
    extra, missing = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
    shape = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    what = []
    if extra:
        what.append(f"{len(extra)} tensor(s) the model lacks (e.g. {extra[0]})")
    if missing:
        what.append(f"{len(missing)} the checkpoint lacks (e.g. {missing[0]})")
    if shape:
        what.append(f"{len(shape)} of another shape (e.g. {shape[0]}: {got[shape[0]]} in the "
                    f"checkpoint, {want[shape[0]]} in the model)")
    raise ConfigError(f"checkpoint {str(m.ckpt)!r} ({m.kind}) does not match --model {model!r}: "
                      + "; ".join(what))


def attach(adapter, m: Model, load: bool = True) -> None:
    """Model m's weights into the transformer: a LoRA attached as its run did (rank, alpha,
    targets) and loaded, or a full fine-tune's weights over the base's. The base: nothing."""
    cfg = m.config
    if m.kind == "lora":
        V.add_lora(adapter.transformer, cfg["lora_rank"], cfg["lora_alpha"],
                   cfg["lora_targets"].split(","))
    if load and m.kind != "base":
        V.load_trainable(adapter, m.ckpt, m.kind == "full")


def detach(adapter, m: Model) -> None:
    """Back to the base transformer after a LoRA (a full fine-tune is sampled last: no way back)."""
    if m.kind == "lora":
        adapter.transformer.unload_lora()


# ------------------------------------------------------------------------------------------------
# Sampling: fixed chunks of (prompt, image) pairs, the record of each image written as it is done.
# ------------------------------------------------------------------------------------------------
def initial_noise(seed: int, p: int, i: int, shape: tuple) -> torch.Tensor:
    """x1 of image i of prompt p, from its own generator seeded by (seed, p, i): the same for
    every model, whatever the batching, the order or the number of restarts. (C, H, W) fp32."""
    s = np.random.SeedSequence([seed, p, i]).generate_state(1, np.uint64)[0]
    return torch.randn(shape, generator=torch.Generator().manual_seed(int(s)))


def image_file(tag: str, p: int, i: int) -> str:
    return f"images/{tag}/p{p:04d}_i{i:02d}.png"


def save_image(img: torch.Tensor, path: Path) -> None:
    """(3, H, W) uint8 → PNG, written under a temporary name and renamed: never half a file."""
    from PIL import Image
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(tmp, format="PNG")
    os.replace(tmp, path)


def read_records(out: Path) -> dict:
    """{(model, prompt index, image index): record} of scores.jsonl's complete lines whose image
    exists. The file is rewritten without the line a kill cut short (an append would continue
    it)."""
    path, recs, keep = out / "scores.jsonl", {}, []
    if not path.is_file():
        return recs
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if (out / r["file"]).is_file():
            recs[(r["model"], r["prompt_index"], r["image_index"])] = r
            keep.append(line)
    path.with_suffix(".tmp").write_text("".join(l + "\n" for l in keep))
    os.replace(path.with_suffix(".tmp"), path)
    return recs


@torch.no_grad()
def sample_chunk(adapter, rewards, names, chunk, prompts, args, sigmas, D, dev, ctx):
    """Images and raw scores of one chunk [(p, i), ...] (M = len(chunk)): the noises, each prompt
    encoded once, one ODE solve of the M rows, then vgrpo's decode-and-score."""
    x1 = torch.stack([initial_noise(args.seed, p, i, D) for p, i in chunk]).to(dev)   # (M, *D)
    uniq = list(dict.fromkeys(p for p, _ in chunk))
    cond = adapter.encode([prompts[p] for p in uniq])
    rows = torch.tensor([uniq.index(p) for p, _ in chunk], device=dev)                 # (M,)
    lat = V.rollout(adapter, x1, cond, rows, sigmas, args.solver, len(chunk), ctx)    # (M, *D)
    return V.decode_and_reward(adapter, rewards, names, lat, [prompts[p] for p, _ in chunk],
                               args.reward_batch, keep_images=True)


def sample_all(adapter, rewards, models, sets, args, ns, out, dev, ctx) -> None:
    """Every (model, prompt set, prompt, image) not yet recorded. A set's pairs are cut into the
    same chunks of --rollout_batch every time, and a chunk with anything missing is sampled whole
    again, so each image comes from the same batch as in an uninterrupted run: the same numbers,
    exactly. Each model is attached once and samples every set."""
    from tqdm.auto import tqdm
    todo, left = {}, 0
    for s in sets:
        s.folder(out).mkdir(parents=True, exist_ok=True)
        done = read_records(s.folder(out))
        pairs = [(p, i) for p in range(len(s.prompts)) for i in range(ns.images_per_prompt)]
        chunks = [pairs[k:k + args.rollout_batch] for k in range(0, len(pairs), args.rollout_batch)]
        for m in models:
            todo[m.tag, s.key] = [[(p, i, (m.tag, p, i) in done) for p, i in c] for c in chunks
                                  if any((m.tag, p, i) not in done for p, i in c)]
            left += sum((m.tag, p, i) not in done for p, i in pairs)
    sigmas, D = adapter.sigmas(args.num_steps), adapter.latent_shape(args.resolution)
    bar = tqdm(total=left, unit="img", desc="evaluate", dynamic_ncols=True)
    for m in sorted(models, key=lambda m: KINDS.index(m.kind)):
        if not any(todo[m.tag, s.key] for s in sets):
            continue
        attach(adapter, m)
        for s in sets:
            if not todo[m.tag, s.key]:
                continue
            bar.set_postfix_str(m.tag + ("" if s.key == "prompts" else f" {s.key}"))
            names, folder = list(s.rewards), s.folder(out)
            with open(folder / "scores.jsonl", "a") as f:
                for chunk in todo[m.tag, s.key]:
                    raw, imgs = sample_chunk(adapter, rewards, names, [(p, i) for p, i, _ in chunk],
                                             s.prompts, args, sigmas, D, dev, ctx)
                    for row, (p, i, recorded) in enumerate(chunk):
                        if recorded:
                            continue
                        rec = {"model": m.tag, "prompt_index": p, "prompt": s.prompts[p],
                               "image_index": i, "file": image_file(m.tag, p, i),
                               **{n: float(raw[n][row]) for n in names}}
                        save_image(imgs[row], folder / rec["file"])   # the image, then its line
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
                        bar.update(1)
        detach(adapter, m)
    bar.close()


# ------------------------------------------------------------------------------------------------
# Statistics and reports.
# ------------------------------------------------------------------------------------------------
def summarize(scores: dict, baseline: str, draws: int = BOOT_DRAWS, seed: int = BOOT_SEED,
              level: float = LEVEL, groups: Optional[list] = None) -> dict:
    """Means over prompts with percentile bootstrap intervals, and paired differences.

    Args: scores {model: {reward: (P, I) array}}, image i of prompt p at [p, i] (the same noise
        in every model); baseline: the model the differences are taken to; groups: None, or a
        label per prompt (GenEval's tags).
    Returns {model: {reward: {mean, ci, n_nonfinite[, diff, diff_ci]}}}.
    Notes: x_p = mean over the images of prompt p (non-finite scores left out); mean = mean_p x_p.
        One set of `draws` resamples of P prompt indices (with replacement, from `seed`) serves
        every model and reward; an interval is the [(1 − level)/2, (1 + level)/2] percentiles of
        the resampled means. diff: the same for d_p = x_p − x_p(baseline), so it is paired, and
        exactly 0 with its interval for identical scores. With groups, mean = the mean over
        groups of each group's mean of x_p (GenEval's overall score, the mean over its tasks
        [peer X10]: djghosh13/geneval evaluation/summary_scores.py), and each resample draws
        every group's prompts from that group alone (a stratified bootstrap: the groups keep
        their sizes)."""
    P = next(iter(scores[baseline].values())).shape[0]
    rng = np.random.default_rng(seed)
    if groups is None:
        parts = [np.arange(P)]
        idx = [rng.integers(0, P, size=(draws, P))]                                  # (B, P)
    else:
        labels = np.array(groups, dtype=object)
        parts = [np.flatnonzero(labels == g) for g in dict.fromkeys(groups)]
        idx = [g[rng.integers(0, len(g), size=(draws, len(g)))] for g in parts]    # (B, P_g) each
    q = [50 * (1 - level), 50 * (1 + level)]

    def stat(x):                                     # x (P,) → mean, [lo, hi]
        mean = np.nanmean([np.nanmean(x[g]) for g in parts])
        reps = np.nanmean(np.stack([np.nanmean(x[i], axis=1) for i in idx]), axis=0)   # (B,)
        return float(mean), [float(v) for v in np.percentile(reps, q)]

    with warnings.catch_warnings():                  # all-NaN prompts: NaN, said by n_nonfinite
        warnings.simplefilter("ignore", RuntimeWarning)
        per_prompt = {m: {r: np.nanmean(s, axis=1) for r, s in rs.items()}
                      for m, rs in scores.items()}                                 # (P,) each
        out = {}
        for m, rs in per_prompt.items():
            out[m] = {}
            for r, x in rs.items():
                e = dict(zip(("mean", "ci"), stat(x)))
                e["n_nonfinite"] = int((~np.isfinite(scores[m][r])).sum())
                if m != baseline:
                    e["diff"], e["diff_ci"] = stat(x - per_prompt[baseline][r])
                out[m][r] = e
    return out


def by_tag(scores: dict, baseline: str, tags: list) -> dict:
    """{tag: summarize of that tag's prompts alone} (GenEval's per-task accuracy), tags in the
    order they first appear."""
    rows = {t: [p for p, x in enumerate(tags) if x == t] for t in dict.fromkeys(tags)}
    return {t: summarize({m: {n: s[r] for n, s in rs.items()} for m, rs in scores.items()},
                         baseline) for t, r in rows.items()}


def table3_order(names: list[str]) -> list[str]:
    """Metric names in the V-GRPO paper's Table 3 column order (TABLE3; a plug-in
    `<package>.<metric>:score` or a URL ending in /<metric> takes its metric's place), then the
    others in the order given."""
    def rank(name):
        m = (re.fullmatch(r"(?:[\w.]+\.)?(\w+):score", name)
             or re.fullmatch(r"https?://.*/(\w+)", name))
        short = m[1] if m else name
        return TABLE3.index(short) if short in TABLE3 else len(TABLE3)
    return sorted(names, key=rank)                   # stable: the rest keep their order


def _decimals(means: list[float]) -> int:
    """Decimals that show a reward to 4 significant digits at its size (2 to 5)."""
    top = max([abs(x) for x in means if math.isfinite(x) and x != 0] or [1.0])
    return min(5, max(2, 3 - math.floor(math.log10(top))))


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _num(x: float, d: int, sign: bool = False) -> str:
    return "nan" if not math.isfinite(x) else f"{x:+.{d}f}" if sign else f"{x:.{d}f}"


def markdown(results: dict) -> str:
    """results.md: the means, then the paired differences, one column per metric in Table 3's
    order; GenEval's tags in two more tables."""
    s, base, sets = results["settings"], results["baseline"], results["prompt_sets"]
    b, models = results["bootstrap"], results["models"]

    def tables(key, names, head):                   # means; paired differences (None: no other)
        d = {n: _decimals([m[key][n]["mean"] for m in models.values()]) for n in names}
        lines = ["| model | " + " | ".join(head) + " |", "|---" * (len(names) + 1) + "|"]
        means, diffs = list(lines), list(lines)
        for tag, m in models.items():
            rs = m[key]
            means.append(f"| {tag} | " + " | ".join(
                f"{_num(rs[n]['mean'], d[n])} [{_num(rs[n]['ci'][0], d[n])}, "
                f"{_num(rs[n]['ci'][1], d[n])}]" for n in names) + " |")
            if tag == base:
                continue
            cells = []
            for n in names:
                lo, hi = rs[n]["diff_ci"]
                c = (f"{_num(rs[n]['diff'], d[n], True)} [{_num(lo, d[n], True)}, "
                     f"{_num(hi, d[n], True)}]")
                cells.append(f"**{c}**" if lo > 0 or hi < 0 else c)
            diffs.append(f"| {tag} | " + " | ".join(cells) + " |")
        return "\n".join(means), ("\n".join(diffs) if len(models) > 1 else None)

    scorer = {n: r for ps in sets.values() for n, r in ps["rewards"].items()}

    def label(n):                                    # a metric scored by another reward names it
        if scorer[n] != n:
            return f"{n} ({scorer[n]})"
        return f"{n} ({V.REWARD_UNITS[n][0]})" if n in V.REWARD_UNITS else n

    names = table3_order(list(scorer))
    means, diffs = tables("rewards", names, [label(n) for n in names])
    how = (f"{s['num_steps']}-step {s['solver']} ODE, {s['resolution']} px, {s['dtype']}, noise "
           f"seed {s['seed']} (image i of prompt p from the same noise in every model)")
    cell = ("Each cell: the mean over prompts of each prompt's mean over its images, and its "
            f"{b['level']:.0%} percentile bootstrap interval over prompts ({b['draws']:,} "
            f"resamples, seed {b['seed']}, the same for every model and reward")
    images = _count(s["images_per_prompt"], "image")
    if list(sets) == ["prompts"]:
        text = [f"# Evaluation: {_count(s['n_prompts'], 'prompt')} × {images}", "",
                f"Model `{s['model']}`, prompts `{s['prompts']}`, {how}. {cell})."]
    else:
        used = "; ".join(f"`{ps['prompts']}` ({_count(ps['n_prompts'], 'prompt')}) for "
                         f"{', '.join(ps['rewards'])}" for ps in sets.values())
        text = [f"# Evaluation: {_count(len(sets), 'prompt set')} × {images} per prompt", "",
                f"Model `{s['model']}`, {how}. Prompts: {used}. {cell} of a prompt set)."]
    tags = sets.get("geneval", {}).get("tags")
    if tags:
        text[-1] += (f" GenEval: the mean over its {len(tags)} tags of each tag's mean, as "
                     "GenEval's own overall score, with each tag's prompts resampled within it.")
    text += ["", means]
    if diffs:
        text += ["", f"Paired difference to `{base}` (the same prompts, noises and resamples); "
                 "bold: the interval excludes 0.", "", diffs]
    if tags:
        t_means, t_diffs = tables("geneval_tags", list(tags), [f"{t} ({n})" for t, n in
                                                               tags.items()])
        text += ["", "GenEval by tag (prompts): each tag's mean over its prompts, its interval "
                 "from resampling that tag's prompts.", "", t_means]
        if t_diffs:
            text += ["", f"GenEval by tag, paired difference to `{base}`.", "", t_diffs]
    bad = [f"{tag}: {n} {e['n_nonfinite']}" for tag, m in models.items()
           for n, e in m["rewards"].items() if e["n_nonfinite"]]
    if bad:
        text += ["", "Non-finite scores, left out of the means: " + "; ".join(bad) + "."]
    return "\n".join(text) + "\n"


def write_grid(out: Path, tags: list[str], prompts: list[str], n_prompts: int, n_images: int,
               resolution: int) -> None:
    """grid.png: a row per prompt (its index and text on the left), a column of n_images images
    per model (its tag on top), the same noises in every column. Small images are enlarged
    (nearest neighbour) to at least 128 px, large ones shrunk to 256."""
    from PIL import Image, ImageDraw, ImageFont
    if n_prompts == 0:
        return
    side = resolution * max(1, 128 // resolution) if resolution < 128 else min(resolution, 256)
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    labels = [f"p{p}: {prompts[p]}" for p in range(n_prompts)]
    label_w = min(240, 8 + max(int(measure.textlength(t, font=font)) for t in labels))
    col_w, gap, head_h = n_images * side, 6, 18
    grid = Image.new("RGB", (label_w + len(tags) * (col_w + gap), head_h + n_prompts * side),
                     "white")
    draw = ImageDraw.Draw(grid)
    for c, tag in enumerate(tags):
        draw.text((label_w + c * (col_w + gap), 3), tag, fill="black", font=font)
        for p in range(n_prompts):
            for i in range(n_images):
                im = Image.open(out / image_file(tag, p, i)).convert("RGB")
                im = im.resize((side, side), Image.NEAREST if side >= resolution else
                               Image.LANCZOS)
                grid.paste(im, (label_w + c * (col_w + gap) + i * side, head_h + p * side))
    for p, text in enumerate(labels):
        while len(text) > 4 and measure.textlength(text, font=font) > label_w - 8:
            text = text[:-2] + "…"
        draw.text((2, head_h + p * side + side // 2 - 6), text, fill="black", font=font)
    grid.save(out / "grid.png")


# ------------------------------------------------------------------------------------------------
# The command.
# ------------------------------------------------------------------------------------------------
def evaluate(argv: Optional[list[str]] = None) -> dict:
    """Parse, validate everything (flags, prompts, checkpoints, --out, rewards on a probe batch
    of each prompt set, the model and each checkpoint against it), only then create --out, sample
    what is missing, and write the reports. Returns results.json's content."""
    ns = build_parser().parse_args(argv)
    args, models, sets = configure(ns)
    base = baseline_tag(ns.baseline, models)
    dev, dtype, ctx = V.setup_device(args)
    out = Path(ns.out)
    current = settings_of(args, ns, models, sets, dtype)
    settings = check_out(out, current)
    fns = {}
    for s in sets:          # a reward failing, or refusing its prompts, stops here in one line
        for name, spec in s.rewards.items():
            fns[name] = V.build_reward(spec, args, dev, dtype)
            try:
                V.probe_reward(name, fns[name], min(args.resolution, 256), dev, s.prompts)
            except ConfigError as e:
                if s.key == "prompts":
                    raise
                raise ConfigError(f"{e} (scoring {s.flag()} {s.path!r})") from None
    adapter = V.make_adapter(V.load_pipeline(args.model, dtype).to(dev), args, dev)
    for m in models:
        if m.kind != "base":
            check_match(adapter, m, args.model)
    if args.offload_text_encoders:
        adapter.cache_prompts([p for s in sets for p in s.prompts])

    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings, indent=2))
    rewards = V.Rewards(fns, [(n, 1.0) for n in fns])
    sample_all(adapter, rewards, models, sets, args, ns, out, dev, ctx)

    results = {"settings": current, "baseline": base,
               "bootstrap": {"draws": BOOT_DRAWS, "seed": BOOT_SEED, "level": LEVEL,
                             "over": "prompts"},
               "prompt_sets": {}, "models": {m.tag: {**m.describe(), "rewards": {}}
                                             for m in models}}
    I = ns.images_per_prompt
    for s in sets:
        recs, P, names = read_records(s.folder(out)), len(s.prompts), list(s.rewards)
        scores = {m.tag: {n: np.array([[recs[(m.tag, p, i)][n] for i in range(I)]
                                       for p in range(P)], dtype=np.float64) for n in names}
                  for m in models}
        tags = s.tags()
        stats = summarize(scores, base, groups=tags)
        results["prompt_sets"][s.key] = {"prompts": str(s.path), "n_prompts": P,
                                         "rewards": s.rewards}
        for m in models:
            results["models"][m.tag]["rewards"].update(stats[m.tag])
        if tags:
            results["bootstrap"]["geneval"] = "the mean over tags; prompts resampled in each tag"
            per = by_tag(scores, base, tags)
            results["prompt_sets"][s.key]["tags"] = {t: tags.count(t) for t in per}
            for m in models:
                results["models"][m.tag]["geneval_tags"] = {t: per[t][m.tag]["geneval"]
                                                            for t in per}
        write_grid(s.folder(out), [m.tag for m in models], s.prompts, min(P, ns.grid_prompts),
                   min(I, ns.grid_images), args.resolution)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(md := markdown(results))
    wrote = [f"{s.key}/" if s.key != "prompts" else "grid.png, scores.jsonl, images/"
             for s in sets]
    print(md + f"\nwrote {out}/results.md, results.json, {', '.join(wrote)}")
    return results


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: bad input prints one line (error: ...) and returns 2; a run that cannot
    go on, such as a plug-in reward failing mid-evaluation, one line and its status (69)."""
    try:
        evaluate(argv)
    except (ConfigError, V.RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
