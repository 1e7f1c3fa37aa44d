"""Preference pairs (--objective dpo): each record is a prompt with a chosen and a rejected answer, read as two
samples side by side.

Two record shapes, from any file --data reads (.json / .jsonl, .parquet, a saved HF dataset):

    TRL's     {"prompt": ..., "chosen": ..., "rejected": ..., "images": [...]}: each of the three a string, or a list
              of chat messages {"role", "content"}, content a string or parts [{"type": "image"}, {"type": "text",
              "text": ...}] (an image part becomes an <image> marker); a string prompt without markers gets one per
              image in front (TRL's VLM datasets put the image before the text)
    LLaVA's   {"image": ..., "conversations": [... up to the last user turn], "chosen": ..., "rejected": ...}; an
              answer a string or a turn {"from": "gpt", "value": ...}

`PairSource` makes record i two conversation records, 2i (prompt + chosen) and 2i + 1 (prompt + rejected), each
checked as any conversation is (mmpipe.data.sources: images, markers, roles, length), so the index holds sides. A
pair whose side is missing, empty, or equal to the other is refused on both sides with its reason (a side's kind:
missing_field, empty_answer, equal_answers), and a side refused alone (too long, a bad image) takes its partner out
of training (`pair_cut`). `PairedSamples` then shuffles pairs, never sides: stream position 2k is the chosen and
2k + 1 the rejected answer of one pair, so an even micro-batch (micro-batches start at multiples of it,
mmpipe.data.batches) holds whole pairs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from ..config import ConfigError
from .index import DataIndex
from .records import BadRecord
from .samples import EvalSet, IndexedSamples
from .sources import DataSpec, Source, open_source

SIDES = ("chosen", "rejected")
PEEK = 16  # records read to tell whether the data holds pairs


def _bad(where: str, kind: str, reason: str) -> BadRecord:
    e = BadRecord(kind, reason)
    e.where = where
    return e


def _content(value, where: str, what: str) -> str:
    """A message's content -> text: a string, or TRL's parts (an image part is an <image> marker)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        return "".join("<image>\n" if p.get("type") == "image" else str(p.get("text", "")) for p in value)
    raise _bad(where, "missing_field", f"{what}'s content is a {type(value).__name__}, not text or a list of parts")


def _messages(value, where: str, what: str, role: str) -> list[dict]:
    """A TRL field (a string, or chat messages) -> LLaVA turns {"from", "value"}."""
    if isinstance(value, str):
        return [{"from": role, "value": value}]
    if isinstance(value, dict):  # one LLaVA turn {"from", "value"}
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise _bad(where, "missing_field", f"'{what}' is {'missing' if value is None else type(value).__name__}, "
                                           f"not text or a list of messages")
    return [{"from": m.get("role", m.get("from")), "value": _content(m.get("content", m.get("value")), where, what)}
            for m in value]


def _answer(raw: dict, side: str, where: str) -> str:
    turns = _messages(raw.get(side), where, side, "assistant")
    text = "\n".join(t["value"] for t in turns)
    if not text.strip():
        raise _bad(where, "empty_answer", f"'{side}' (the {side} answer) is empty")
    return text


def pair_conversation(raw: dict, side: str, where: str, columns: dict) -> dict:
    """Record `raw`'s prompt and its `side` answer as a LLaVA conversation record; BadRecord for the whole pair."""
    if not isinstance(raw, dict):
        raise _bad(where, "missing_field", f"record is a {type(raw).__name__}, not an object")
    for s in SIDES:
        if raw.get(s) is None:
            raise _bad(where, "missing_field", f"'{s}' is missing: a preference pair needs both answers")
    chosen, rejected = _answer(raw, "chosen", where), _answer(raw, "rejected", where)
    if chosen.strip() == rejected.strip():
        raise _bad(where, "equal_answers", "'chosen' and 'rejected' are the same answer")
    images = raw.get("images", raw.get(columns["image"]))
    if columns["conversations"] in raw:
        turns = raw[columns["conversations"]]
        if not isinstance(turns, list):
            raise _bad(where, "missing_field", f"'{columns['conversations']}' is not a list")
    else:
        turns = _messages(raw.get("prompt"), where, "prompt", "user")
        n_images = len(images) if isinstance(images, list) else int(images not in (None, ""))
        if turns and "<image>" not in "".join(str(t["value"]) for t in turns) and n_images:
            turns[0] = {**turns[0], "value": "<image>\n" * n_images + str(turns[0]["value"])}
    answer = chosen if side == "chosen" else rejected
    return {columns["image"]: images, columns["conversations"]: [*turns, {"from": "assistant", "value": answer}]}


class PairSource(Source):
    """Record i of `inner` as two conversation records: 2i its prompt + chosen, 2i + 1 its prompt + rejected."""

    def __init__(self, inner: Source):
        self.inner = inner
        self.spec = dataclasses.replace(inner.spec, format="llava")  # each side is read as a conversation

    def __len__(self) -> int:
        return 2 * len(self.inner)

    def raw(self, i: int) -> tuple[str, dict]:
        where, raw = self.inner.raw(i // 2)
        side = SIDES[i % 2]
        return f"{where} {side}", pair_conversation(raw, side, f"{where} {side}", self.spec.columns)


def pair_source(spec: DataSpec) -> PairSource:
    """--data's records as pairs; ConfigError (one line) if none of its first records has a chosen / rejected."""
    inner = open_source(spec)
    for i in range(min(PEEK, len(inner))):
        try:
            _, raw = inner.raw(i)
        except BadRecord:
            continue
        if isinstance(raw, dict) and any(s in raw for s in SIDES):
            return PairSource(inner)
    name = spec.path or ", ".join(spec.data_files)
    raise ConfigError(f"--objective dpo: {name} holds no preference pairs (none of its first {min(PEEK, len(inner))} "
                      f"records has a 'chosen' or 'rejected' answer; docs/dpo.md)")


def pair_cut(index: DataIndex) -> DataIndex:
    """The index's pairs whose two sides are both good (rows 2j and 2j + 1 of the PairSource), in file order."""
    rows = index.rows
    both = set((rows[rows % 2 == 0] // 2).tolist()) & set((rows[rows % 2 == 1] // 2).tolist())
    keep = np.array([k for k, r in enumerate(rows.tolist()) if r // 2 in both], dtype=np.int64)
    cut = index.subset(keep, "pairs")
    cut.stats["pairs"] = len(both)
    cut.stats["pair_records"] = index.stats["records"] // 2
    return cut


def describe_pairs(stats: dict) -> str:
    return (f"data: {stats['pairs']} of {stats['pair_records']} preference pairs usable (each side a sample above; a "
            f"pair with a side refused is left out whole)")


class PairedSamples(IndexedSamples):
    """IndexedSamples of a pair_cut index, shuffled by pair: position 2k / 2k + 1 are one pair's chosen / rejected."""

    @functools.lru_cache(maxsize=2)
    def _pair_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.index) // 2)

    def entry(self, pos: int) -> int:
        if self.ordered:
            return pos % len(self.index)
        epoch, k = divmod(pos, len(self.index))
        return 2 * int(self._pair_order(epoch)[k // 2]) + k % 2


# The families whose tower encodes a pair's images once (docs/dpo.md, "The image once per pair"): their tower works on
# each image (or each row's patches) alone and one layer places its output on the image positions, which reads
# slot (2i + s, m)'s features from image (i, m) (mmpipe.model.rows.slot_images). The cross-attention fusion carries
# the projected images [B / 2 x M, ..] to every cross-attention layer as a stage field, each computing their keys /
# values once and row b reading its pair's (cross_attention.CrossAttnBlock). LLaVA-NeXT / OneVision and InternVL lay
# out a row's crops by its own tiling in the projector, which reads row b's crops from its pair's chosen row (the
# tower's entry marks the case: rows.mark_pair_rows).
# Gemma 4's patch lists (max_soft_tokens) read the tower's rows' grids (rows.tower_rows in gemma4.image_patches and
# its pooling), its fixed squares are LLaVA's case.
SHARED_IMAGE_FAMILIES = {("llava", "prefix"), ("moondream", "prefix"), ("qwen2_vl", "prefix"),
                         ("qwen3_vl", "prefix"), ("qwen3_5", "prefix"), ("gemma3", "prefix"), ("gemma4", "prefix"),
                         ("llava_next", "prefix"), ("internvl", "prefix"), ("moondream", "cross_attention")}


def shares_images(cfg) -> bool:
    """Whether a dpo run's micro-batches carry each pair's images once (SHARED_IMAGE_FAMILIES)."""
    return (cfg.family, cfg.fusion) in SHARED_IMAGE_FAMILIES


def _record(samples, pos: int) -> int:
    """The preference record of stream position pos: index entries 2j / 2j + 1 of a pair_cut index are PairSource
    records 2i / 2i + 1, both record i. A validation set (EvalSet) repeats its sample 0 past its end."""
    if isinstance(samples, EvalSet):
        samples, pos = samples.samples, (pos if pos < samples.size else 0)
    return int(samples.index.rows[samples.entry(pos)]) // 2


def same_pairs(samples, chosen: list[int], rejected: list[int]) -> bool:
    """Whether two rows' samples (stream positions) come from the same preference records in the same order (the
    chosen and rejected sides of the same pairs, or a validation set's padding), so their images are the same."""
    return len(chosen) == len(rejected) and all(_record(samples, c) == _record(samples, r)
                                                for c, r in zip(chosen, rejected))


def write_jsonl(path, records: list[dict]) -> None:
    """Preference records to a .jsonl file (tests, docs' examples)."""
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def preference_problems(args, data, micro: int) -> list[str]:
    """--objective dpo's own checks against the run's flags and data (DataOptions, or None where it failed), one line
    each: beta > 0, rpo_alpha >= 0, pairs in the data, whole pairs in a micro-batch, what is not built yet. Every
    schedule runs it: the live reference pass is the engine's own eval_batch, DeepSpeed's inference schedule under
    1F1B and zb-h1 (tests/test_dpo_packed.py), DualPipeVEngine's forward-only DualPipeVSchedule under dualpipev
    (docs/dpo.md)."""
    problems = []
    if args.beta <= 0:
        problems.append(f"--beta: {args.beta} must be > 0 (DPO's KL weight; TRL's default 0.1)")
    if args.rpo_alpha < 0:
        problems.append(f"--rpo-alpha: {args.rpo_alpha} must be >= 0")
    if micro % 2:
        problems.append(f"--objective dpo: the micro-batch is {micro} rows; it must be even, so each pair's chosen "
                        f"and rejected rows share one micro-batch (train_micro_batch_size_per_gpu)")
    if args.eval_data and args.reference_logps:
        problems.append("--objective dpo: --eval-data with --reference-logps is not supported yet (the validation "
                        "pairs' reference log-probs are not scored; the live reference validates; docs/dpo.md)")
    for on, what in ((bool(args.eval_split), "--eval-split (it would split pairs)"),):  # --tp: run_config._check_tp
        if on:
            problems.append(f"--objective dpo with {what} is not supported yet (docs/dpo.md)")
    if data is not None and data.builtin:
        problems.append("--objective dpo: the built-in shapes set has no preference pairs; give --data with "
                        "'chosen' / 'rejected' answers (docs/dpo.md)")
    elif data is not None:
        try:
            pair_source(data.spec)
        except ConfigError as e:
            problems.append(str(e))
    return problems


def reference_problems(args, model, read_run) -> list[str]:
    """--reference RUN: only with --objective dpo, an mmpipe run directory (model.json, a checkpoint, no TP shards,
    no LoRA adapters: read_run(RUN, None), run_config.init_model, checks them as --init-from's) holding the very model
    the run trains (model: the run's ModelConfig as fitted, or None where it failed). --reference-logps FILE: only
    with dpo, a file (its fingerprints are checked against the data index once it is built, runtime.precomputed)."""
    problems = []
    if args.reference_logps is not None and args.objective != "dpo":
        problems.append(f"--reference-logps: only --objective dpo reads reference log-probs (this run's objective "
                        f"is {args.objective})")
    elif args.reference_logps is not None and not os.path.isfile(args.reference_logps):
        problems.append(f"--reference-logps: {args.reference_logps} is not a file (`mmpipe score-reference` writes "
                        f"one; docs/dpo.md)")
    return problems + _reference_run_problems(args, model, read_run)


def _reference_run_problems(args, model, read_run) -> list[str]:
    if args.reference is None:
        return []
    if not args.objective == "dpo":
        return [f"--reference: only --objective dpo reads a reference model (this run's objective is {args.objective})"]
    try:
        ref = read_run(args.reference, None)
    except ConfigError as e:
        return [str(e).replace("--init-from:", "--reference:", 1)]
    if model is None or ref.to_dict() == model.to_dict():
        return []
    a, b = ref.to_dict(), model.to_dict()
    diff = next(f"{k}.{j}" if isinstance(a[k], dict) else k for k in a
                for j in (a[k] if isinstance(a[k], dict) else [None])
                if (a[k].get(j) != b.get(k, {}).get(j) if isinstance(a[k], dict) else a[k] != b.get(k)))
    return [f"--reference: {args.reference} holds another model than this run trains ({diff} differs)"]
