"""`mmpipe eval`: answer every record of a data file with a checkpoint, score the answers.

    mmpipe eval --checkpoint runs/my-run --data held_out.jsonl --out eval/answers.jsonl

The file goes through the training data pipeline (mmpipe.data.dataset.prepare_eval: every --data
format, the same checks, --bad-records policy and index, kept under the --out folder's eval_data/).
For every good record, in file order:

    prompt     the record's tokens up to its first answer token: exactly what training conditions
               the answer on (chat template, BOS; the LLaVA family's <image> placeholders at the
               record's <image> marker, after BOS without one: a dynamic family's block of the image's
               grid, Qwen2-VL's bracketed patches or LLaVA-NeXT / OneVision's processor count for its
               tiles; a text-only record gets no image, as in training, nor does a prompt whose marker
               only comes after the first answer)
    reference  the first answer's tokens (the first assistant turn), EOS dropped, decoded
    answer     generated with the KV cache (mmpipe.inference.generate.generate_batch: greedy, or
               sampled with every record's generator seeded by --seed), decoded

scored by --metric (exact: normalised string equality; contains: the reference occurs in the answer).
Written: answers.jsonl (one line per record: row, prompt, reference, answer, score, has_image,
type when the record names its question type, and `empty` saying why when the answer is empty) and
answers.summary.json beside it (the metric overall and per type, n, bad records skipped, samples/s,
and the teacher-forced validation loss: cross-entropy summed over every answer token of the same
samples, over their count, as training's validation computes it). Rows hold one image (--max-images 1, as the
eval data is indexed): a record of several images is a bad record, too_many_images (training's validation, with
the run's --max-images, takes them). An image its family cuts into slots (Gemma 3's pan-and-scan: the whole image
and up to max_crops crops, each a block of the prompt) is read whole: the index takes up to that many slots a
record, and the prompt and the loss's row hold them all.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..config import ConfigError, fail
from ..data.args import DataArgs
from ..data.batches import collate
from ..data.dataset import prepare_eval, resolve_data
from ..data.image_kinds import image_kind
from ..data.packing import RowSet, sample_rowset
from ..data.records import BadRecord
from ..flags import print_plan
from ..model.builder import IGNORE_INDEX, lm_loss_sum
from .generate import (
    check_attention,
    empty_reason,
    generate_batch,
    length_buckets,
    load_checkpoint,
    resolve_checkpoint,
    with_images,
)
from .preference_eval import main_eval_dpo
from .sampling import Sampling

METRICS = ("exact", "contains")
TYPE_KEYS = ("type", "qtype", "question_type")  # a record's question type, if it names one
HELP = {"data": "the records to answer, in any format --data takes for training: a LLaVA .json/.jsonl, a pairs "
                ".csv/.jsonl, a .parquet, a saved HF dataset or image folder, or a data config JSON",
        "bad_records": "skip: count, list and leave out bad records (default); strict: stop before answering any",
        "tokenizer": "tokenizer directory (default: the one the run trained with: the HF directory's own, else the "
                     "run's tokenizer/, else the built-in one)"}
DATA_FLAGS = ("data", "image_root", "tokenizer", "prompt_format", "bad_records", "text_len", "overlong", "resize",
              "max_image_pixels")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="an mmpipe run directory (model.json + checkpoints/), a checkpoints/ directory, "
                        "or a Hugging Face directory `mmpipe import --hf` takes (LLaVA, LLaVA-NeXT, LLaVA-OneVision, "
                        "Qwen2-VL, Qwen2.5-VL)")
    fields = {f.name: f for f in dataclasses.fields(DataArgs)}
    for name in DATA_FLAGS:  # the training data flags, declared once in DataArgs
        md = fields[name].metadata
        kw = {"dest": name, "default": fields[name].default, "help": md["help"]}
        if md["choices"]:
            kw["choices"] = md["choices"]
        if name in ("text_len", "max_image_pixels"):
            kw["type"] = int
        if name in HELP:
            kw["help"] = HELP[name]
        kw["required"] = name == "data"
        p.add_argument("--" + name.replace("_", "-"), **kw)
    p.add_argument("--metric", default="exact", choices=METRICS,
                   help="exact: normalised equality (stripped, lower-case, trailing punctuation dropped; default); "
                        "contains: the normalised reference occurs in the answer")
    p.add_argument("--out", default="answers.jsonl",
                   help="answers file (default: answers.jsonl); the summary goes beside it (NAME.summary.json), "
                        "the data index under its folder's eval_data/")
    p.add_argument("--batch-size", type=int, default=16, help="records per generation batch (default: 16)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (every record's generator starts from it)")
    p.add_argument("--objective", default="sft", choices=("sft", "dpo"),
                   help="sft: answer and score every record (default); dpo: preference accuracy on a pair file, the "
                        "share of pairs whose chosen answer is the more likely (docs/dpo.md)")
    p.add_argument("--reference", default=None, metavar="RUN",
                   help="--objective dpo: a reference model (as --checkpoint) for TRL's rewards on the pairs")
    p.add_argument("--beta", type=float, default=0.1, help="--objective dpo with --reference: the rewards' beta")


def normalise(text: str) -> str:
    return text.strip().lower().rstrip(".,;:!?").strip()


def score(metric: str, answer: str, reference: str) -> int:
    a, r = normalise(answer), normalise(reference)
    return int(a == r) if metric == "exact" else int(r in a)


def summary_path(out: Path) -> Path:
    return out.with_name(out.stem + ".summary.json")


@dataclasses.dataclass
class Item:
    pos: int
    prompt: list[int]      # what generation continues from (placeholders included)
    text: list[int]        # the prompt's text tokens (no placeholders), for answers.jsonl
    reference: list[int]   # the first answer's tokens, EOS dropped
    has_image: bool        # the record has an image (its pixels feed the teacher-forced loss)
    sees_image: bool       # the prompt holds it: its marker comes before the first answer
    grid: tuple = ()       # a dynamic family's image grid: Qwen2-VL's (t, h, w), tiles' (h, w, rows, cols, n)
    slots: int = 1         # its blocks in the prompt (an image cut into slots: the whole image and its crops)
    images: int = 1        # its image slots (the loss's row holds them all)


def split_record(ids: np.ndarray, target: np.ndarray, eos_id: int | None) -> tuple[list[int], list[int]]:
    """(prompt ids, reference ids): the tokens before the first answer token, and that answer's run of
    answer tokens up to (not including) EOS. BOS is never an answer token."""
    answer = np.flatnonzero(target[1:]) + 1
    first = int(answer[0]) if len(answer) else len(ids)
    end = first
    while end < len(ids) and target[end] and ids[end] != eos_id:
        end += 1
    return ids[:first].tolist(), ids[first:end].tolist()


def _question_type(samples, row: int) -> str | None:
    raw = samples.source and samples.source.raw
    if raw is None:
        return None
    try:
        rec = raw(row)[1]
    except (BadRecord, OSError, ValueError):
        return None
    value = next((rec[k] for k in TYPE_KEYS if isinstance(rec, dict) and isinstance(rec.get(k), str)), None)
    return value


EVAL_IMAGES = ("mmpipe eval scores records of one image; training's validation takes more: mmpipe train --eval-data "
               "FILE --max-images N")


def _checked(args: argparse.Namespace):
    """(model config, where its weights are, DataOptions), resolved without reading a weight, or ConfigError."""
    for name, low in (("batch_size", 1), ("max_new_tokens", 1), ("top_k", 0)):
        if getattr(args, name) < low:
            raise ConfigError(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= {low}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature: {args.temperature} must be >= 0")
    if args.data == "shapes":
        raise ConfigError("--data: give a data file (`mmpipe export-shapes --out DIR` writes the built-in set "
                          "to one)")
    check_attention()
    cfg, weights, own_tokenizer = resolve_checkpoint(Path(args.checkpoint))
    # one image a record, every slot of it where its kind cuts it into several (image_slots)
    data_args = DataArgs(**{name: getattr(args, name) for name in DATA_FLAGS}, max_images=image_slots(cfg))
    # too_many_images names what sets the limit: eval has no --max-images (a record's images are its own to change)
    opts = dataclasses.replace(resolve_data(data_args, cfg, run_tokenizer=own_tokenizer), limit_by=EVAL_IMAGES)
    if len(opts.tokenizer) > cfg.text.vocab_size:
        raise ConfigError(f"--tokenizer: {len(opts.tokenizer)} tokens but the model's vocabulary has "
                          f"{cfg.text.vocab_size}; give the tokenizer the run was trained with")
    return cfg, weights, opts


def _loaded(args: argparse.Namespace):
    """(model, tokenizer, EvalSet, text_len) or ConfigError; --dry-run: its plan printed, None."""
    cfg, weights, opts = _checked(args)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as scratch:  # a dry run checks the records where nothing is kept
        if not args.dry_run:
            out.parent.mkdir(parents=True, exist_ok=True)
        evalset = prepare_eval(opts, cfg, scratch if args.dry_run else out.parent, seed=0, shapes=0, verbose="always",
                               run_dir=out.parent if args.dry_run else None)
        if args.dry_run:
            print_plan(f"eval: {evalset.size} records", model=f"{cfg.name} ({cfg.family})", weights=weights,
                       data=Path(opts.name).resolve(), decoding=Sampling.from_args(args, opts.tokenizer).plan(),
                       metric=args.metric,
                       answers=out.resolve(), summary=summary_path(out).resolve())
            return None
    model, _ = load_checkpoint(Path(args.checkpoint))
    return model, opts.tokenizer, evalset, opts.text_len


def image_slots(cfg) -> int:
    """The slots one image may take: its kind's slots_per_image (Gemma 3's pan-and-scan: 1 + max_crops), else 1."""
    return getattr(image_kind(cfg), "slots_per_image", 1)


@torch.no_grad()
def _loss(model, rows: RowSet, positions: list[int], pixels: torch.Tensor, tiling: torch.Tensor | None = None,
          slots: int = 0) -> tuple[float, int]:
    """Teacher-forced cross-entropy summed over the answer tokens of these samples, and their count;
    input ids and labels as training builds them (rows: one sample per row without images, `pixels` given).
    slots > 0: pixels [B, slots, C, S, S], a sample's slots first in its row's (the rest unused, not encoded)."""
    b = collate([rows[p] for p in positions])
    has_image = b["has_image"]
    if slots:
        assert not has_image[:, slots:].any(), "a row uses more slots than its pixels hold"
        has_image = has_image[:, :slots]
    logits = model(pixels, b["input_ids"], has_image, b["segments"], tiling)
    return float(lm_loss_sum(logits, b["labels"])), int((b["labels"] != IGNORE_INDEX).sum())


def main_eval(args: argparse.Namespace) -> int:
    if args.objective == "dpo":  # preference accuracy on a pair file (mmpipe.inference.preference_eval)
        return main_eval_dpo(args, _checked)
    if args.reference is not None:
        return fail(ConfigError("--reference: only eval --objective dpo reads a reference model"))
    try:
        loaded = _loaded(args)
    except ConfigError as e:
        return fail(e)
    if loaded is None:  # --dry-run
        return 0
    model, tok, evalset, text_len = loaded
    model.eval()
    sampling = Sampling.from_args(args, tok)
    started = time.perf_counter()
    items, answers, loss_sum, loss_tokens, bad = _generate_all(args, model, sampling, evalset, text_len)
    seconds = time.perf_counter() - started
    lines = _scored_lines(args, tok, evalset, items, answers)
    out = Path(args.out)
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = _summary(args, sampling, lines, evalset, loss_sum, loss_tokens, seconds, out)
    summary = dict(summary, **_with_bad(summary, bad))
    summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")
    types = "".join(f", {q} {v[args.metric]:.3f}" for q, v in summary["per_type"].items())
    print(f"mmpipe: eval: {args.metric} {summary[args.metric]:.3f} ({summary['correct']}/{summary['n']}{types}); "
          f"val loss {summary['val_loss']:.4f} over {loss_tokens} answer tokens; {summary['bad_records']} bad records "
          f"skipped; {summary['samples_per_s']:.1f} samples/s; answers in {out}, summary in {summary_path(out)}",
          flush=True)
    return 0


def _generate_all(args, model, sampling: Sampling, evalset, text_len: int):
    """Every record's prompt and reference, the generated answers (batches of equal-length prompts, decoded as
    `sampling` says) and the teacher-forced loss sum and answer-token count over the same batches."""
    cfg, eos = model.cfg, sampling.eos_id
    dtype, kind = next(model.parameters()).dtype, image_kind(cfg)
    items, bad = [], []
    for pos in range(evalset.size):
        enc, n_images = evalset.tokens(pos)
        text, reference = split_record(enc.ids, enc.target, eos)
        # a block at image_at == len(text) closes the prompt: the first answer token is predicted from it
        at = enc.image_at if len(enc.image_at) else np.ones(n_images, dtype=np.int64)
        seen = int((at[:n_images] <= len(text)).sum())  # an image's slots: all its blocks (one image a record)
        sees = seen > 0
        why = empty_tokens(text, reference, sees)
        if why:  # nothing to score, or nothing to answer from: a bad record, not a score over what is left
            bad.append({"row": evalset.row(pos), **why})
            continue
        grids = [tuple(int(x) for x in g) for g in enc.grids[:1]]
        prompt = with_images(text, cfg, enc.image_at[:seen] if len(enc.image_at) else None, grids) if sees else text
        items.append(Item(pos, prompt, text, reference, bool(n_images), sees, grids[0] if grids else (),
                          slots=seen, images=n_images))
    if bad:
        print(f"mmpipe: eval: {len(bad)} bad records skipped after tokenizing ({bad[0]['kind']}, row {bad[0]['row']}: "
              f"{bad[0]['reason']}{'; ...' if len(bad) > 1 else ''}); answers.summary.json lists them",
              file=sys.stderr, flush=True)
    answers: list[list[int]] = [[] for _ in items]
    slotted = image_slots(cfg) > 1
    rows = sample_rowset(evalset, cfg, text_len, need_images=False, slots=image_slots(cfg))
    loss_sum, loss_tokens = 0.0, 0
    with tqdm(total=len(items), desc="mmpipe eval", unit="record", dynamic_ncols=True) as bar:
        for batch in length_buckets([len(it.prompt) for it in items], args.batch_size):
            if slotted:  # each record's image slots, [B, M] of them (M: the batch's most)
                pixels, has_image, tiling = *_slot_pixels(evalset, kind, cfg, [items[i] for i in batch]), None
            else:  # each record's image (a kind of grids: its patches or crops and grid), one slot per row
                pixels, tiling, _ = kind.stack(cfg, [kind.input(evalset.pixels(items[i].pos), items[i].grid)
                                                     if items[i].has_image else None for i in batch])
                has_image = [items[i].sees_image for i in batch]
            pixels = pixels.to(dtype)
            new = generate_batch(model, pixels, [items[i].prompt for i in batch], sampling, has_image=has_image,
                                 batch_size=len(batch), tiling=tiling)
            for i, a in zip(batch, new):
                answers[i] = a
            s, n = _loss(model, rows, [items[i].pos for i in batch], pixels, tiling, pixels.shape[1] * slotted)
            loss_sum, loss_tokens = loss_sum + s, loss_tokens + n
            bar.update(len(batch))
    return items, answers, loss_sum, loss_tokens, bad


def _slot_pixels(evalset, kind, cfg, items: list[Item]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels [B, M, C, S, S], has_image [B, M]): each record's image slots, all of them (the loss's row holds them,
    as training's does), blank ones after them; has_image marks those its prompt holds (generation's)."""
    slots = [[evalset.pixels(it.pos, k) for k in range(it.images)] for it in items]
    m, blank = max(1, *map(len, slots)), kind.blank(cfg)
    pixels = torch.stack([torch.stack(row + [blank] * (m - len(row))) for row in slots])
    return pixels, torch.tensor([[1] * it.slots + [0] * (m - it.slots) for it in items])


def empty_tokens(text: list[int], reference: list[int], sees_image: bool) -> dict | None:
    """Why a record's tokens leave nothing to evaluate ({kind, reason}: the data report's bad-record kinds), else
    None: its first answer tokenizes to no token (EOS dropped: the reference is empty, and any answer would be
    scored against nothing), or its prompt has no token and no image to answer from."""
    if not reference:
        return {"kind": "empty_answer", "reason": "the first answer tokenizes to no token (the tokenizer maps its "
                                                  "text to nothing)"}
    if not text and not sees_image:
        return {"kind": "empty_prompt", "reason": "the prompt tokenizes to no token and has no image"}
    return None


def _scored_lines(args, tok, evalset, items, answers) -> list[dict]:
    lines = []
    for it, a in zip(items, answers):
        row = evalset.row(it.pos)
        answer = tok.decode(a, skip_special_tokens=True).strip()
        reference = tok.decode(it.reference, skip_special_tokens=True).strip()
        line = {"row": row, "prompt": tok.decode(it.text, skip_special_tokens=True).strip(), "reference": reference,
                "answer": answer, "score": score(args.metric, answer, reference), "has_image": it.has_image}
        if not answer:
            line["empty"] = empty_reason(a)
        qtype = _question_type(evalset.samples, row)
        if qtype is not None:
            line["type"] = qtype
        lines.append(line)
    return lines


def _with_bad(summary: dict, bad: list[dict]) -> dict:
    """The summary's bad-record counts with the records found bad after tokenizing (empty_tokens) added, and their
    list (row, kind, reason)."""
    kinds = dict(summary["bad_by_kind"])
    for b in bad:
        kinds[b["kind"]] = kinds.get(b["kind"], 0) + 1
    return {"bad_records": summary["bad_records"] + len(bad), "bad_by_kind": kinds, "bad_after_tokenizing": bad}


def _summary(args, sampling: Sampling, lines: list[dict], evalset, loss_sum: float, loss_tokens: int,
             seconds: float, out: Path) -> dict:
    hits: dict[str, list[int]] = defaultdict(list)
    for line in lines:
        if "type" in line:
            hits[line["type"]].append(line["score"])
    stats, n = evalset.samples.index.stats, len(lines)
    correct = sum(line["score"] for line in lines)
    return {"metric": args.metric, args.metric: correct / max(1, n), "correct": correct, "n": n,
            "per_type": {q: {args.metric: sum(v) / len(v), "n": len(v)} for q, v in sorted(hits.items())},
            "records": stats["records"], "bad_records": stats["bad"], "bad_by_kind": stats["bad_by_kind"],
            "val_loss": loss_sum / max(1, loss_tokens), "answer_tokens": loss_tokens,
            "samples_per_s": n / max(seconds, 1e-9), "seconds": round(seconds, 3),
            "checkpoint": str(args.checkpoint), "data": str(args.data), "answers": str(out),
            "decoding": sampling.to_json(), "max_new_tokens": sampling.max_new_tokens}
