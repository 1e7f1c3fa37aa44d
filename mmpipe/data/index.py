"""The data index: every record read, checked and tokenised once, before training starts.

Why up front: within a pipeline the first stage decodes images and the last stage only reads
labels, so a record whose image turned out corrupt mid-run could not be dropped by both ends
alike. Checking everything first (images fully decoded, in worker processes) means the training
stream holds good records only, bad ones are counted and listed before step 1, and `strict`
can stop the run before any process group exists.

Stored in OUTPUT_DIR/data/: index.npz (token ids, answer-token masks, source rows, each record's
image count and where its images go) and index.json (fingerprint, counts); bad_records.jsonl lists
every refused record with its reason. The fingerprint covers the data files (size, mtime),
tokenizer, text length, policies, --max-images and whether `<image>` markers place the images; a
matching index is reused (ranks reuse the front door's, a resume reuses the first run's).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .images import check_image
from .records import BAD_KINDS, BadRecord, ImageSlot, VideoRef
from .sources import DataSpec, Source
from .text import IMAGE_MARKER, ConversationEncoder
from .tokenizer import BUILTIN_TEMPLATE
from .video import CLIP_COUNTS

INDEX_VERSION = 3  # 3: clips bounded by the video processor's pixels (2: by one image's); 2: n_images, image_at
SHOW_BAD = 10  # bad records printed one per line; all of them go to bad_records.jsonl


@dataclass
class DataIndex:
    rows: np.ndarray       # int64 [N]: source row of good record n
    offsets: np.ndarray    # int64 [N + 1]: its tokens are tokens[offsets[n]:offsets[n + 1]]
    tokens: np.ndarray     # int64 [sum of lengths]
    target: np.ndarray     # bool, like tokens: answer tokens
    n_images: np.ndarray   # int64 [N]: images of good record n (0 for a text-only one)
    image_offsets: np.ndarray  # int64 [N + 1]: cumsum of n_images; record n's are image_at[image_offsets[n]:[n + 1]]
    image_at: np.ndarray   # int64 [sum of n_images]: Encoded.image_at, the token each image's block goes before
    stats: dict
    # int64 [sum of n_images, 3]: each image's patch grid (t, h, w) from its size alone (a dynamic-resolution
    # family, mmpipe.data.patches); [sum of n_images, 5] (orig_h, orig_w, rows, cols, positions) for any-resolution
    # tiles (mmpipe.data.anyres); [0, 3] for the others
    grids: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def has_image(self) -> np.ndarray:  # bool [N]
        return self.n_images > 0

    def images_of(self, n: int) -> np.ndarray:
        return self.image_at[self.image_offsets[n]:self.image_offsets[n + 1]]

    def grids_of(self, n: int) -> np.ndarray:
        """[n_images, 3] grids of good record n ([0, 3] when the family has none)."""
        return self.grids[self.image_offsets[n]:self.image_offsets[n + 1]] if len(self.grids) else self.grids

    def subset(self, entries: np.ndarray, name: str) -> "DataIndex":
        """Good records `entries` (ascending) only; the fingerprint names the cut, so a resume checks it."""
        take, offsets = _ragged_take(self.offsets, entries)
        take_images, image_offsets = _ragged_take(self.image_offsets, entries)
        stats = {**self.stats, "fingerprint": f"{self.stats['fingerprint']}/{name}", "subset": name,
                 "good_in_subset": int(len(entries))}
        return DataIndex(self.rows[entries], offsets, self.tokens[take], self.target[take], self.n_images[entries],
                         image_offsets, self.image_at[take_images], stats,
                         self.grids[take_images] if len(self.grids) else self.grids)


def _ragged_take(offsets: np.ndarray, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(flat positions, new offsets) of rows `entries` of a ragged array, e.g. offsets [0, 2, 5, 6] and
    entries [0, 2] -> positions [0, 1, 5], offsets [0, 2, 3]."""
    pieces = [np.arange(offsets[n], offsets[n + 1]) for n in entries]
    take = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    return take, np.concatenate([[0], np.cumsum(np.diff(offsets)[entries])]).astype(np.int64)


def fingerprint(spec: DataSpec, tokenizer, text_len: int, overlong: str, max_pixels: int, max_images: int = 1,
                markers: bool = False, grids=None) -> str:
    """grids: what a dynamic family's grids depend on (DataOptions.grid_key), None for the others."""
    files = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in spec.files() if os.path.isfile(f)]
    tok = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), tokenizer.chat_template)
    parts = [INDEX_VERSION, asdict(spec), files, tok, text_len, overlong, max_pixels, max_images, markers]
    blob = json.dumps(parts + ([grids] if grids is not None else []), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---- the scan, in worker processes --------------------------------------------------------------

_W: dict = {}


def _init_worker(source, encoder, checks):
    _W.update(source=source, encoder=encoder, checks=checks)


def _check(i: int):
    """-> (i, ids, target, truncated, image_at, grids, clip counts or None) for a good record (len(image_at): its
    images; grids [n, 3], a dynamic family's, from each image's size; clip counts: video.media_grids'), (i, where,
    kind, reason) for a bad one."""
    where, c = f"record {i}", _W["checks"]
    try:
        rec = _W["source"].record(i, c.media, c.family)
        where = rec.where
        rec = c.kind.with_timestamps(rec, c.rule, c.image_root, IMAGE_MARKER)  # Qwen3-VL: a slot per temporal patch
        if len(rec.images) > c.max_images and any(isinstance(m, VideoRef) and m.frame >= 0 for m in rec.images):
            raise BadRecord("too_many_images", f"{len(rec.images)} image slots (a clip takes one per temporal patch "
                                               f"(Qwen3-VL) or frame (Gemma 4, InternVL)) > "
                                               f"{c.image_limit or f'--max-images {c.max_images}'}")
        if len(rec.images) > c.max_images:
            limit = c.image_limit or f"--max-images {c.max_images}"
            crops = any(isinstance(m, ImageSlot) and m.crop for m in rec.images)  # Gemma 3's pan-and-scan
            raise BadRecord("too_many_images", f"{len(rec.images)} images{' (a crop takes a slot)' * crops} > {limit}")
        enc = _W["encoder"].encode(rec.messages, len(rec.images))
        if any(isinstance(m, VideoRef) for m in rec.images):  # clips among the images (a family that reads them)
            spare = _W["encoder"].text_len - len(enc.ids)  # text positions OneVision's clips may take
            grids, clips = c.kind.media_grids(rec.images, c.rule, c.image_root, c.max_pixels, spare)
            return i, enc.ids, enc.target, enc.truncated, enc.image_at, grids, clips
        sizes = [check_image(m.ref if isinstance(m, ImageSlot) else m, c.image_root, c.max_pixels) for m in rec.images
                 if not (isinstance(m, ImageSlot) and m.crop)]  # an image cut into slots: checked once
        # PatchRule [n, 3] (t, h, w) (or 4: a clip's step column, PatchRule.grid_width); TileRule [n, 5] (orig_h,
        # orig_w, rows, cols, positions)
        grids = c.rule.sample_grids(sizes) if c.rule is not None else np.zeros((0, 3), dtype=np.int64)
        return i, enc.ids, enc.target, enc.truncated, enc.image_at, grids, None
    except BadRecord as e:
        return i, getattr(e, "where", where), e.kind, e.reason


@dataclass(frozen=True)
class RecordChecks:
    """What every record is checked against, once, when the index is built. media / family: what the model family
    reads of a record besides text (mmpipe.registry.Family.media) and its name for the refusal; not in the
    index fingerprint, so an index built before a family read more keeps its decisions and a run resumed on it
    reads the same records (nothing it took is refused mid-run). rule: a dynamic family's PatchRule
    (mmpipe.data.patches) or TileRule (mmpipe.data.anyres), which gives each image's grid. image_limit: max_images
    as too_many_images names it, what sets it (default: --max-images N)."""
    image_root: str
    max_pixels: int
    max_images: int = 1
    rule: object = None
    media: tuple[str, ...] = ("image",)
    family: str = "model's"
    image_limit: str | None = None
    kind: object = None  # the family's image kind (mmpipe.data.image_kinds): how its clips are read


def scan(source: Source, encoder: ConversationEncoder, checks: RecordChecks, workers: int) -> tuple[list, list]:
    args = (source, encoder, checks)
    if workers <= 1 or len(source) < 256:  # a pool costs more than it saves on a small file
        _init_worker(*args)
        results = [_check(i) for i in range(len(source))]
    else:
        with mp.get_context("fork").Pool(workers, _init_worker, args) as pool:
            results = list(pool.imap(_check, range(len(source)), chunksize=64))
    good = [r for r in results if len(r) == 7]
    bad = [r for r in results if len(r) == 4]
    return good, bad


def build_index(source: Source, encoder: ConversationEncoder, checks: RecordChecks, *, policy: str, out_dir: Path,
                workers: int, fp: str, listed: str = "") -> DataIndex:
    """listed: where the user finds every bad record (bad_list), for --bad-records strict's refusal."""
    spec = source.spec
    good, bad = scan(source, encoder, checks, workers)
    counts = Counter(kind for _, _, kind, _ in bad)
    n_images = np.array([len(g[4]) for g in good], dtype=np.int64)
    stats = {"fingerprint": fp, "records": len(source), "good": len(good), "bad": len(bad),
             "bad_by_kind": {k: counts[k] for k in BAD_KINDS if counts[k]},
             "truncated": sum(1 for g in good if g[3]), "with_image": int((n_images > 0).sum()),
             "images": int(n_images.sum()),
             "unknown_token_share": _unknown_share(good, encoder.tok),
             "builtin_tokenizer": getattr(encoder.tok, "chat_template", None) == BUILTIN_TEMPLATE,
             "first_bad": [{"where": w, "kind": k, "reason": r} for _, w, k, r in bad[:SHOW_BAD]]}
    if any(g[6] for g in good):  # clips: what the report says of them (video.CLIP_COUNTS)
        stats.update({k: sum(g[6][k] for g in good if g[6]) for k in CLIP_COUNTS})
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"bad_records.jsonl.{os.getpid()}"
    with open(tmp, "w") as f:
        for _, w, k, r in bad:
            f.write(json.dumps({"where": w, "kind": k, "reason": r}) + "\n")
    os.replace(tmp, out_dir / "bad_records.jsonl")
    lengths = np.array([len(g[1]) for g in good], dtype=np.int64)
    index = DataIndex(
        rows=np.array([g[0] for g in good], dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        tokens=np.concatenate([g[1] for g in good]) if good else np.zeros(0, np.int64),
        target=np.concatenate([g[2] for g in good]) if good else np.zeros(0, bool),
        n_images=n_images, image_offsets=np.concatenate([[0], np.cumsum(n_images)]).astype(np.int64),
        image_at=np.concatenate([np.zeros(0, np.int64), *(g[4] for g in good)]).astype(np.int64), stats=stats,
        grids=np.concatenate([g[5] for g in good]).astype(np.int64) if good else np.zeros((0, 3), np.int64))
    check_policy(index, spec, policy, listed)
    _save(index, out_dir)
    return index


def _unknown_share(good: list, tok) -> float:
    """Share of text tokens the tokenizer does not know: high when user text meets the built-in
    word-level tokenizer, which only knows the shapes vocabulary."""
    if tok.unk_token_id is None or not good:
        return 0.0
    n = sum(len(g[1]) for g in good)
    return float(sum(int((g[1] == tok.unk_token_id).sum()) for g in good) / n)


def bad_list(index_dir: Path, kept: bool = True) -> str:
    """Where every bad record is listed, as the user can open it: index_dir's bad_records.jsonl by its absolute path
    (the printed lines show the first SHOW_BAD only). kept False: a dry run, whose index directory is scratch,
    deleted after; index_dir is the one a run without --dry-run writes."""
    path = (Path(index_dir) / "bad_records.jsonl").resolve()
    return f"in {path}" if kept else f"in {path} once run without --dry-run (a dry run keeps no list)"


def check_policy(index: DataIndex, spec: DataSpec, policy: str, listed: str = "") -> None:
    """listed: bad_list's words, named by strict's refusal."""
    s = index.stats
    name = spec.path or ", ".join(spec.data_files)
    if s["good"] == 0:
        raise ConfigError(f"--data: every one of the {s['records']} records of {name} is bad "
                          f"({_kinds(s)}); first: {_first(s)}" if s["records"] else f"--data: {name} holds no records")
    if policy == "strict" and s["bad"]:
        lines = [f"--bad-records strict: {b['where']}: {b['kind']}: {b['reason']}" for b in s["first_bad"]]
        more = s["bad"] - len(lines)
        total = f"{s['bad']} bad records in all: {_kinds(s)}"
        last = "--bad-records strict: " + (f"... and {more} more; " if more else "") + total + \
            (f"; all listed {listed}" if listed else "")
        raise ConfigError("\n".join(lines + [last]))


def _kinds(s: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in s["bad_by_kind"].items())


def _first(s: dict) -> str:
    b = s["first_bad"][0]
    return f"{b['where']}: {b['kind']}: {b['reason']}"


def describe(stats: dict, listed: str = "in bad_records.jsonl") -> list[str]:
    """The data report printed before training: counts, then the first bad records one per line, and where the
    rest are (listed: bad_list's words)."""
    images = stats.get("images", stats["with_image"])  # an index of several images per record says how many
    lines = [f"data: {stats['good']} of {stats['records']} records usable ({stats['with_image']} with an image"
             + (f", {images} images" if images != stats["with_image"] else "") + ")"
             + (f", {stats['truncated']} truncated" if stats["truncated"] else "")
             + (f"; {stats['bad']} skipped: {_kinds(stats)}" if stats["bad"] else "")]
    if stats.get("clips"):
        resized = (f"; {stats['clips_resized']} clips' frames made smaller than their video processor makes them "
                   f"(their share of the row's --max-patches)" if stats["clips_resized"] else "")
        lines.append(f"data: {stats['clips']} clips: {stats['clip_frames_sampled']} of their {stats['clip_frames']} "
                     f"frames sampled (the family's video processor's fps rule){resized}"
                     + (f"; {stats['clips_fewer_frames']} clips sampled to {stats['clip_frames_dropped']} fewer frames "
                        f"than the fps rule gives, to fit their share of the row (the processor's max_frames lowered, "
                        f"not below min_frames)" if stats.get("clips_fewer_frames") else ""))
    if stats.get("unknown_token_share", 0) > 0.05:
        why = ("the built-in one knows only the shapes words; give --tokenizer DIR"
               if stats.get("builtin_tokenizer", True)  # an index written before the key: the old wording
               else "it has no piece for them: is --tokenizer the one the model was trained with?")
        lines.append(f"data: warning: {stats['unknown_token_share']:.0%} of text tokens are unknown to the tokenizer "
                     f"({why})")
    lines += [f"data: skipped {b['where']}: {b['kind']}: {b['reason']}" for b in stats["first_bad"]]
    if stats["bad"] > len(stats["first_bad"]):
        lines.append(f"data: ... {stats['bad'] - len(stats['first_bad'])} more; all {stats['bad']} listed {listed}")
    return lines


def _save(index: DataIndex, out_dir: Path) -> None:
    # written under temporary names and renamed: ranks that build the same index at once never
    # read a half-written file
    tmp = out_dir / f"index.{os.getpid()}.npz"
    np.savez(tmp, rows=index.rows, offsets=index.offsets, tokens=index.tokens, target=index.target,
             n_images=index.n_images, image_offsets=index.image_offsets, image_at=index.image_at, grids=index.grids)
    os.replace(tmp, out_dir / "index.npz")
    tmp = out_dir / f"index.json.{os.getpid()}"
    tmp.write_text(json.dumps(index.stats, indent=2) + "\n")
    os.replace(tmp, out_dir / "index.json")


def load_index(out_dir: Path, fp: str) -> DataIndex | None:
    try:
        stats = json.loads((out_dir / "index.json").read_text())
        if stats.get("fingerprint") != fp:
            return None
        with np.load(out_dir / "index.npz", allow_pickle=False) as z:
            grids = z["grids"] if "grids" in z.files else np.zeros((0, 3), dtype=np.int64)  # written before grids
            return DataIndex(z["rows"], z["offsets"], z["tokens"], z["target"], z["n_images"], z["image_offsets"],
                             z["image_at"], stats, grids)
    except (OSError, ValueError, KeyError):
        return None
