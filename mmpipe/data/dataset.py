"""The data side of a run: flags -> DataOptions (checked), then the sample source each rank reads.

    resolve_data(args, cfg)  checks the flags and the data's shape (format, columns, tokenizer);
                             no record is read. Called with the rest of the run's checks.
    prepare(opts, cfg, out_dir, seed)  reads and checks every record once (mmpipe.data.index),
                             prints the report, applies --bad-records; returns the samples.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError, ModelConfig
from ..registry import family_of
from .args import DataArgs
from .image_kinds import BUDGET_FLAGS, budget_given, image_kind, image_rule, row_budget
from .index import DataIndex, RecordChecks, bad_list, build_index, check_policy, describe, fingerprint, load_index
from .preference import PairedSamples, describe_pairs, pair_cut, pair_source
from .samples import SHAPES_TEXT_LEN, EvalSet, IndexedSamples, ShapesSamples, image_reader
from .sources import DataSpec, data_spec, open_source
from .text import ConversationEncoder
from .tokenizer import builtin_tokenizer, load_tokenizer


@dataclass
class DataOptions:
    name: str                   # "shapes" or the --data argument
    spec: DataSpec | None       # None for the built-in set
    tokenizer: object
    text_len: int
    bad_records: str
    overlong: str
    max_pixels: int
    resize: str
    augment: bool
    workers: int
    log_samples: bool
    # --eval-split: the fraction of good records held out, and which part this is ("train": the rest)
    holdout: float = 0.0
    part: str = "train"
    max_images: int = 1         # --max-images: image slots per row (record_images: a record's limit)
    markers: bool = False       # <image> markers place the images (the LLaVA family), else after BOS
    auto_slots: bool = False    # --pack without --max-images: max_images follows from the data (packed_image_slots)
    # the row's vision budget in its image kind's unit (mmpipe.data.image_kinds): a family of patches' P, of tiles'
    # T crops (its flag, or its default for max_images); 0 for fixed-size images
    vision_budget: int = 0
    auto_budget: bool = False   # the budget is the default for max_images: it follows them (packed_image_slots)
    image_text: str | None = None  # what an image marker becomes in the text (mmpipe.data.text.image_text)
    pairs: bool = False  # --objective dpo: records are preference pairs, two samples each (mmpipe.data.preference)
    balance: bool = True        # --balance on: a packed step's rows spread by predicted cost (mmpipe.data.balance)
    limit_by: str = ""          # what fixes record_images where no flag of the command does (mmpipe eval), image_limit

    @property
    def record_images(self) -> int:
        """Images one record may have: --max-images with <image> markers (LLaVA), else 1 (the image goes
        after BOS; --max-images > 1 then only gives a packed row slots for its samples' images). Slots
        chosen by packed_image_slots never raise it: the index it reads must not change with them."""
        return self.max_images if self.markers and not self.auto_slots else 1

    @property
    def image_limit(self) -> str:
        """record_images and what sets it, as too_many_images' reason and the front door's --pack line both say it:
        --max-images N only where that flag is the limit; under --pack alone the rows' M image slots are not (the
        index they are read from keeps one image a record), nor for a family without <image> markers; limit_by: a
        command without the flag (mmpipe eval) says what does."""
        if self.limit_by:
            return f"{self.record_images} ({self.limit_by})"
        if self.markers and not self.auto_slots:
            return f"--max-images {self.max_images}"
        return "1 (" + ("--pack alone packs one-image samples; --max-images N takes records of up to N" if self.markers
                        else "a family without <image> markers takes one image a record") + ")"

    @property
    def builtin(self) -> bool:
        return self.spec is None


def resolve_data(args: DataArgs, cfg: ModelConfig | None, run_tokenizer: str | None = None) -> DataOptions:
    """Raises ConfigError with every problem, one line each. run_tokenizer: the tokenizer directory
    of the run --init-from starts from (--tokenizer overrides it). The LLaVA family's built-in
    tokenizer carries <image>."""
    problems = []
    spec = None
    if args.data != "shapes":
        try:
            spec = data_spec(args.data, args.image_root)
        except ConfigError as e:
            problems.append(str(e))
    tok = None
    path = args.tokenizer or run_tokenizer
    if args.data == "shapes" and args.tokenizer:
        problems.append("--tokenizer: the built-in shapes set uses the built-in tokenizer; drop --tokenizer")
    elif args.data == "shapes" and args.prompt_format == "moondream":
        problems.append("--prompt-format moondream: the built-in shapes set is written in the built-in tokenizer's "
                        "words; give your own --data and moondream's --tokenizer")
    elif args.data == "shapes" and run_tokenizer:
        problems.append(f"--init-from: the run's tokenizer ({run_tokenizer}) is not the built-in one the shapes set "
                        f"is written in; train it on your own data (--data)")
    else:
        try:
            image_token = image_kind(cfg).markers  # the built-in tokenizer's <image>, to write markers
            tok = (load_tokenizer(path, args.prompt_format) if path or args.prompt_format == "moondream"
                   else builtin_tokenizer(image_token=image_token))
        except ConfigError as e:
            problems.append(str(e))
    markers = image_kind(cfg).markers
    text_len = row_text_len(args, cfg, SHAPES_TEXT_LEN if args.data == "shapes" else None, problems)
    image_text = _image_checks(args, cfg, tok, problems)
    if args.max_image_pixels < 1:
        problems.append(f"--max-image-pixels: {args.max_image_pixels} must be >= 1")
    if args.data_workers < 0:
        problems.append(f"--data-workers: {args.data_workers} must be >= 0")
    budget = row_budget(args, cfg, problems)
    if problems:
        raise ConfigError("\n".join(problems))
    return DataOptions(args.data, spec, tok, text_len or SHAPES_TEXT_LEN, args.bad_records, args.overlong,
                       args.max_image_pixels, args.resize, args.augment, args.data_workers, args.log_samples,
                       max_images=args.max_images or 1, markers=markers,
                       auto_slots=args.pack and args.max_images is None, vision_budget=budget,
                       auto_budget=bool(budget) and not budget_given(args, cfg), image_text=image_text,
                       balance=args.balance == "on")


def _image_checks(args: DataArgs, cfg: ModelConfig | None, tok, problems: list[str]) -> str | None:
    """--augment against the family's image rule; the text an image marker becomes (text.image_text)."""
    kind = image_kind(cfg)
    refusal = kind.augment_refusal(cfg) if args.augment and cfg is not None else None
    if refusal:
        problems.append(refusal)
    try:  # the bracketed image text of a family of patches (Qwen2-VL); tiles keep LLaVA's <image>
        return kind.marker_text(tok, cfg) if tok is not None else None
    except ConfigError as e:
        problems.append(str(e))
        return None


ROW_FLAGS = ("text_len", "max_images", "pack", *BUDGET_FLAGS)  # the row's shape: what `mmpipe plan` takes


def dynamic(cfg: ModelConfig | None) -> bool:
    """Images of any size, each taking the positions its size gives (a kind with a row budget: patches, tiles)."""
    return cfg is not None and image_kind(cfg).flag is not None


def row_text_len(args: DataArgs, cfg: ModelConfig | None, default_len: int | None, problems: list[str]) -> int | None:
    """--max-images, --pack and --text-len against the model, the one check `mmpipe train` (resolve_data)
    and `mmpipe plan` make; appends a line per problem. Returns the row's text length: --text-len, else
    default_len, else what the model's context leaves after BOS + the images."""
    markers = image_kind(cfg).markers
    if args.max_images is not None and args.max_images < 1:
        problems.append(f"--max-images: {args.max_images} must be >= 1")
    elif (args.max_images or 1) > 1 and cfg is not None and not markers and not args.pack:
        # without markers one image per sample; --max-images then only sizes a packed row's image slots
        how = f"({cfg.fusion}) attends to one image" if cfg.cross_attn_layers else "splices one image after BOS"
        problems.append(f"--max-images: {args.max_images}: the {cfg.family} family {how}; several images per "
                        f"sample need the LLaVA family (with --pack it sizes a row's image slots)")
    text_len = args.text_len
    if cfg is not None:
        # spliced image, or LLaVA's <image> placeholders, a block for each of up to --max-images images:
        # e.g. 576 x 2 = 1152 of a 4096 context for two CLIP-336 images
        kind, m, budget = image_kind(cfg), args.max_images or 1, row_budget(args, cfg, [])
        n_image = kind.sample_positions(cfg, m, budget)
        if args.pack:  # a packed row's M slots, whoever's images: moondream's 4 x 16 = 64, not one sample's 16
            n_image = max(n_image, kind.blocks(cfg, m, budget).positions(m))
        room = cfg.text.max_context - n_image  # decoder positions: images + text_len (BOS included) <= max_context
        if text_len is None:
            text_len = default_len or room
        if room < 2:  # the images alone fill the context: no --text-len helps
            given = [f"--{f.replace('_', '-')}" for f in ("max_images", kind.flag) if f and getattr(args, f, None)]
            problems.append(f"{given[0] if given else '--max-images'}: the image positions ({n_image} for {m} "
                            f"slot{'s' * (m > 1)}) leave no room for text in text.max_context "
                            f"{cfg.text.max_context}: give a smaller {' or '.join(given) or '--max-images'}")
        elif text_len < 2 or text_len > room:
            problems.append(f"--text-len: {text_len} must be between 2 and {room} (text.max_context "
                            f"{cfg.text.max_context} - {n_image} image positions)")
    return text_len


SLOT_SAMPLES = 1024  # stream positions packed_image_slots reads: enough for a stable mean, ~10 ms


def packed_image_slots(opts: DataOptions, cfg: ModelConfig, out_dir: str | Path, seed: int) -> DataOptions:
    """--pack without --max-images: a row's image slots follow from its text budget and the data. A row
    of M slots and L = M x N + text_len positions (N per image) fills its slots and its positions at the
    same rate when M = k x text_len / t, with k the images and t the text positions of the mean sample:
    s samples fill the slots at s x k = M and the positions at s x (t + k x N) = L, both at s = text_len / t.
    E.g. one-image samples of 22 text positions, text_len 96: M = round(96 / 22) = 4, L = 4 N + 96, about
    4 samples a row; with one slot (the unpacked default) a row could never hold a second image sample.
    Read from the token index of the first SLOT_SAMPLES stream positions (no image is opened), so every
    rank derives the same M. Text-only data keeps M = 1. A row budget the user did not set follows M by its
    kind's rule (ImageKind.follow: a family of patches' P = M mean images' patches, tiles' T room for M)."""
    if not opts.auto_slots:
        return opts
    samples = prepare(opts, cfg, out_dir, seed, verbose=False)
    sizes = [samples.tokens(pos) for pos in range(SLOT_SAMPLES)]
    text = sum(len(enc.ids) for enc, _ in sizes)
    images = sum(int(n) for _, n in sizes)
    slots, budget = context_slots(opts, cfg, max(1, round(images * opts.text_len / text)), sizes)
    return dataclasses.replace(opts, max_images=slots, vision_budget=budget)


def context_slots(opts: DataOptions, cfg: ModelConfig, slots: int, sizes: list) -> tuple[int, int]:
    """(M, the row budget) of --pack alone: the most slots, up to the data's, whose row fits the model's context, as
    --max-images M's row must (row_text_len): L = the M slots' image positions (the budget following M, fitted to the
    context where the kind fits it: InternVL's T) + --text-len <= text.max_context. E.g. qwen-tiny (context 256, 64
    patches = 16 + 2 positions an image at its cap) on the built-in set at --text-len 100: the data's M = 11 took
    P = 704, a row of 22 + 176 + 100 = 298; fitted, M = 8, P = 512: 16 + 128 + 100 = 244. Where not even one slot
    fits (a --max-patches / --max-tiles given beside --text-len), one line."""
    kind, context = image_kind(cfg), cfg.text.max_context
    for m in range(slots, 0, -1):
        budget = kind.follow(cfg, m, sizes) if opts.auto_budget else opts.vision_budget
        if opts.auto_budget and hasattr(kind, "context_budget"):  # InternVL: T the context holds at --text-len
            budget = kind.context_budget(cfg, budget, m, opts.text_len)
        fits = kind.blocks(cfg, m, budget).positions(m) + opts.text_len <= context
        if fits and (not kind.flag or budget >= m):  # a budget of one crop (patch) an image at least
            return m, budget
    least = kind.blocks(cfg, 1, max(budget, 1) if kind.flag else 0).positions(1)  # one image at the least budget
    flag = f" or --{kind.flag.replace('_', '-')}" if kind.flag and not opts.auto_budget else ""
    raise ConfigError(f"--pack: --text-len {opts.text_len} leaves {context - opts.text_len} of text.max_context "
                      f"{context} positions, fewer than one image slot takes ({least}): give a smaller "
                      f"--text-len{flag}")


def index_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "data"


def prepare(opts: DataOptions, cfg: ModelConfig, out_dir: str | Path, seed: int, *, verbose: bool | str = True,
            run_dir: str | Path | None = None):
    """The samples of this run. verbose: print the data report (when the index is built, or always
    if verbose == "always"). For user data, reads the index OUTPUT_DIR/data/ written by an
    earlier call with the same fingerprint (the front door's, or the run being resumed), or
    builds it. Raises ConfigError for --bad-records strict with bad records, or no good record.
    run_dir: a dry run's out_dir is scratch; the report names the bad-record list a run writes under run_dir."""
    if opts.builtin:
        return ShapesSamples(cfg, seed, budget=opts.vision_budget)
    index, source = _checked_index(opts, cfg, index_dir(out_dir), verbose,
                                   None if run_dir is None else index_dir(run_dir))
    if opts.holdout:
        index = held_out_cut(index, opts.holdout, "train")
    reader = image_reader(cfg, opts.spec.image_root, opts.max_pixels, resize=opts.resize, augment=opts.augment,
                          budget=opts.vision_budget)
    if opts.pairs:  # both sides of a pair good, shuffled by pair
        return PairedSamples(index, source, reader, seed=seed, pad_id=opts.tokenizer.pad_token_id)
    return IndexedSamples(index, source, reader, seed=seed, pad_id=opts.tokenizer.pad_token_id)


def prepare_eval(opts: DataOptions, cfg: ModelConfig, out_dir: str | Path, seed: int, shapes: int, *,
                 verbose: bool | str = True, run_dir: str | Path | None = None) -> EvalSet:
    """The validation set: every good record of --eval-data in file order (its index in
    OUTPUT_DIR/eval_data/, built and checked as the training data's), or `shapes` samples of the
    built-in held-out split. run_dir: as prepare's."""
    if opts.builtin:
        return EvalSet(ShapesSamples(cfg, seed, "eval", opts.vision_budget), shapes)
    if opts.holdout:  # --eval-split: the held-out part of the training data's own index
        index, source = _checked_index(opts, cfg, index_dir(out_dir), verbose=False)
        index = held_out_cut(index, opts.holdout, "heldout")
    else:
        index, source = _checked_index(opts, cfg, Path(out_dir) / "eval_data", verbose,
                                       None if run_dir is None else Path(run_dir) / "eval_data")
    reader = image_reader(cfg, opts.spec.image_root, opts.max_pixels, resize=opts.resize, budget=opts.vision_budget)
    ordered = IndexedSamples(index, source, reader, seed=seed, pad_id=opts.tokenizer.pad_token_id, ordered=True)
    return EvalSet(ordered, len(index))


def held_out_cut(index: DataIndex, fraction: float, part: str) -> DataIndex:
    """--eval-split: ceil(fraction x N) good records held out, the same ones for every seed and stage
    count (a fixed permutation of N, e.g. N = 200 at 0.1: 20 held out); "train" is the rest."""
    n = len(index)
    held = np.sort(np.random.default_rng([0x6D6D70, n]).permutation(n)[:math.ceil(fraction * n)])
    keep = held if part == "heldout" else np.setdiff1d(np.arange(n), held)
    return index.subset(keep, f"{part}{fraction}")


def _checked_index(opts: DataOptions, cfg: ModelConfig, d: Path, verbose: bool | str, shown: Path | None = None):
    """shown: the index directory a run without --dry-run uses, when d is a dry run's scratch."""
    listed = bad_list(shown or d, kept=shown is None)  # where the report and strict's refusal say the list is
    rule = image_rule(cfg, opts.vision_budget)
    # what the grids depend on: the rule's resize bounds for each image count a record may have (not P itself,
    # which --pack's slots may raise without changing any grid); tiles: the rule, T unless it follows the slots
    kind = image_kind(cfg)  # no rule: the kind's slot settings (pan-and-scan's), None for the others
    grids = kind.slot_key if rule is None else kind.grid_key(rule, opts.record_images,
                                                              0 if opts.auto_budget else opts.vision_budget)
    fp = fingerprint(opts.spec, opts.tokenizer, opts.text_len, opts.overlong, opts.max_pixels, opts.record_images,
                     opts.markers, grids) + ("/pairs" if opts.pairs else "")
    source = pair_source(opts.spec) if opts.pairs else open_source(opts.spec)
    index = load_index(d, fp)
    built = index is None
    if built:
        encoder = ConversationEncoder(opts.tokenizer, opts.text_len, opts.overlong, markers=opts.markers,
                                      image_text=opts.image_text)
        checks = RecordChecks(opts.spec.image_root, opts.max_pixels, opts.record_images, rule, family_of(cfg).media,
                              cfg.family, opts.image_limit, image_kind(cfg))
        index = build_index(source, encoder, checks, policy=opts.bad_records, out_dir=d, fp=fp, listed=listed,
                            workers=max(1, min(opts.workers, os.cpu_count() or 1)))
    else:
        check_policy(index, opts.spec, opts.bad_records, listed)
    if opts.pairs:
        index = pair_cut(index)
    if verbose == "always" or (verbose and built):
        for line in describe(index.stats, listed) + ([describe_pairs(index.stats)] if opts.pairs else []):
            print(f"mmpipe: {line}", flush=True)
    return index, source
