"""Single-process generation with a KV cache, for every model family: `mmpipe generate`.

The model is the pipeline's own layer list (ReferenceModel). Generation splits it in two:

    encoder layers   everything before the first cache-aware layer (patch embedding, vision
                     blocks, projector): run once, on the image, as in training.
    decoder layers   the first cache-aware layer to the head (text embedding, decoder blocks,
                     LM head): run on the prompt (prefill), then on one new token at a time.

The per-layer cached-decoding interface
---------------------------------------
A layer is cache-aware when it has a method

    decode(t: StageTuple, cache: dict, start: int) -> StageTuple | Tensor

    t.hidden     prefill (start == 0): what the layer's forward would receive (the image
                 embeddings for a text embedding; the sequence for a block). Decode steps
                 (start > 0): the new positions only, [B, T_new, D] (T_new = 1); the text
                 embedding receives t.hidden = None and embeds t.input_ids, the new tokens.
    t.input_ids  prefill: the whole prompt [B, T_text]; decode steps: the new tokens [B, T_new].
    t.vision     the projected image, as in forward (cross-attention fusion), on every call.
    cache        a dict owned by this layer for this generation (empty at prefill): store K/V
                 there, [B, H_kv, T_seen, Dh]; a cross-attention layer caches the image's K/V once.
    start        absolute decoder position of t.hidden's first row: rotary positions are
                 start..start+T_new-1, and queries may see keys 0..start+T_new-1 (prefill: the
                 layer's usual mask, e.g. moondream's bidirectional BOS + image prefix).

It must return what forward would return for those positions (the head: logits [B, T_new, V]),
so cached and uncached decoding agree (tests/test_generate.py). It does so by sharing forward's
math rather than restating it: forward and decode call one function, which takes the positions
and an optional cache (forward: start 0, no cache; e.g. DecoderBlock.run, CrossAttnBlock.fuse);
a layer that works position by position (a norm, the head) decodes with forward itself. Layers of
a new family add the method; nothing here changes.

Batches (`generate_batch`, `mmpipe generate` with several --image/--prompt pairs or --records,
`mmpipe eval`): prompts are grouped by length (`length_buckets`), so a batch's rows share their
positions and no padding enters any row's cache or attention; each row stops at its own EOS and
samples from its own generator seeded with --seed (Sampling.seed). A row's answer is therefore the one generate()
gives it alone (tests/test_generate.py, every family).

How tokens are picked is one value, mmpipe.inference.sampling.Sampling (EOS, the length bound, greedy or
temperature / top-k / seed, the answer-id mask, the tokenizer's size), which generate, generate_batch and the
commands (Sampling.from_args) pass along whole.

Sampling.answer_id (moondream's prompt format, mmpipe.data.text.answer_id_of): as moondream's
`_generate_answer` does, the first new token is picked from the prompt's logits as they are, and
every later step sets answer_id's logit to -inf before picking (tests/test_moondream_prompt.py).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch import nn

from ..config import ConfigError, ModelConfig, config_from_dict, fail
from ..data.args import VIDEO_FLAGS, DataArgs
from ..data.image_kinds import image_kind
from ..data.records import BadRecord
from ..data.text import ConversationEncoder
from ..data.tokenizer import load_tokenizer
from ..flags import add_flags, from_namespace, print_plan
from ..hf.commands import hf_importer
from ..model.attention import attention_backend
from ..model.builder import ReferenceModel, TiedCall, layer_specs
from ..model.lora import read_lora
from ..model.moe import split_aux
from ..model.rows import sample_rows
from ..model.stage import unpack_in
from ..model.tensor_parallel import Shard, parallelize
from ..registry import family_of
from ..runtime.checkpoint import latest_tag, load_reference
from ..runtime.reshard import layer_files, layer_state, meta_layer, tp_problems
from .sampling import Sampling


def _split(model) -> int:
    """Index of the first cache-aware layer: the encoder layers before it run once, on the image."""
    for i, layer in enumerate(model):
        if hasattr(layer, "decode"):
            return i
    raise ValueError(f"{type(model[0]).__name__}...: no layer of this model supports cached decoding")


def placeholder_of(model) -> int | None:
    """The image placeholder id of a model whose prompts carry one (the LLaVA family), else None."""
    return image_kind(model.cfg).placeholder_id(model.cfg)


@torch.no_grad()
def _decode_rows(model, pixels: torch.Tensor, ids: torch.Tensor, has_image: torch.Tensor, sampling: Sampling,
                 tiling: torch.Tensor | None = None) -> list[list[int]]:
    """The KV-cached loop for B prompts whose rows have one length L (sample_rows): pixels [B, C, H, W],
    ids [B, T], has_image [B] (or an image kind's slots: pixels [B, M, C, H, W], has_image [B, M], slot_rows).
    Every row is its own sequence at the same positions, so no padding enters any row's attention; a row that
    has produced EOS keeps being fed EOS (its output ignored) until every row is done."""
    B, eos_id = ids.shape[0], sampling.eos_id
    gens = sampling.generators(B)
    first = _split(model)
    enc = (pixels, *slot_rows(model.cfg, ids, has_image)) + (() if tiling is None else (tiling,))  # tiling last
    for layer in list(model)[:first]:
        enc = layer(enc)  # the image side, once
    t = unpack_in(model[first], enc)  # the fields the decoder's first layer takes
    decoder = list(model)[first:]
    caches: list[dict] = [{} for _ in decoder]
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    start = 0
    for step in range(sampling.max_new_tokens):
        x = t
        for layer, cache in zip(decoder, caches):
            x = layer.decode(x, cache, start)
        logits = x  # [B, T_new, V]
        start += logits.shape[1]
        nxt = sampling.pick(sampling.masked(logits[:, -1], step, placeholder_of(model)), gens)
        for b, tok in enumerate(nxt.tolist()):
            if done[b]:
                continue
            if eos_id is not None and tok == eos_id:
                done[b] = True
            else:
                out[b].append(tok)
        if all(done):
            break
        if eos_id is not None:
            nxt = torch.where(torch.tensor(done), torch.full_like(nxt, eos_id), nxt)
        t = t._replace(hidden=None, input_ids=nxt[:, None], segments=torch.ones_like(nxt[:, None]))  # the same sample
    return out


def slot_rows(cfg, ids: torch.Tensor, has_image: torch.Tensor):
    """sample_rows' (input_ids, has_image, segments) of B prompts; has_image [B, M]: each row's image slots in use
    (an image its kind cuts into several, e.g. Gemma 3's pan-and-scan crops, whose blocks are all in the prompt),
    kept as the stage tuple's [B, M]."""
    if has_image.dim() < 2:
        return sample_rows(cfg, ids, has_image)
    rows, flags, segments = sample_rows(cfg, ids, has_image.amax(-1))
    return rows, has_image.long(), segments


@torch.no_grad()
def generate(model, pixel_values: torch.Tensor, prompt_ids: list[int], sampling: Sampling, *,
             use_cache: bool = True, has_image: bool | torch.Tensor = True, tiling: torch.Tensor | None = None
             ) -> list[int]:
    """New token ids for one image + prompt, decoded as `sampling` says (mmpipe.inference.sampling: EOS, which
    stops it and is not returned, the length bound, greedy or sampled, moondream's answer-id mask, the
    tokenizer's size).
    use_cache=False reruns the whole model on the growing sequence each step (the reference).
    has_image=False: a text-only prompt, as training sees one (pixel_values a blank image no position
    reads: moondream's text follows BOS at position 1, as moondream's own; LLaVA: no placeholders).
    Multi-crop models: pixel_values [1, vision.crop_slots, C, H, W] and tiling [1, 2]
    (mmpipe.data.crops.stack_images). A kind of image slots: pixel_values [1, M, C, H, W], has_image [M] (each
    slot in use)."""
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T_prompt]
    flag = has_image.long()[None] if torch.is_tensor(has_image) else torch.full((1,), int(has_image), dtype=torch.long)
    pixels = pixel_values.to(next(model.parameters()).dtype)
    if use_cache:
        return _decode_rows(model, pixels, ids, flag, sampling, tiling=tiling)[0]
    gens = sampling.generators(1)
    out: list[int] = []
    for step in range(sampling.max_new_tokens):
        logits = model(pixels, *slot_rows(model.cfg, ids, flag), tiling)
        logits = sampling.masked(split_aux(logits)[0][:, -1], step, placeholder_of(model))
        nxt = sampling.pick(logits, gens)
        if sampling.eos_id is not None and nxt.item() == sampling.eos_id:
            break
        out.append(nxt.item())
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return out


def with_images(ids: list[int], cfg: ModelConfig, image_at, grids=()) -> list[int]:
    """A prompt with its images' placeholders where training puts them (the image kind's with_images): LLaVA's N
    a block; a kind of grids' block of each image's grid (Qwen2-VL's bracketed one, any-resolution tiles' n
    placeholders, the processor's count) before ids[a] (a in image_at; None: after BOS)."""
    return image_kind(cfg).with_images(ids, cfg, image_at, grids)


def length_buckets(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of equal prompt length (at most batch_size each), in order of first
    appearance: a KV cache of equal-length rows needs no padding, so each row decodes as it would alone."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return [g[k:k + batch_size] for g in groups.values() for k in range(0, len(g), batch_size)]


@torch.no_grad()
def generate_batch(model, pixel_values: torch.Tensor, prompts: list[list[int]], sampling: Sampling, *,
                   has_image=None, batch_size: int = 16, progress=None, tiling: torch.Tensor | None = None
                   ) -> list[list[int]]:
    """generate() for many prompts at once: pixel_values [N, C, H, W], prompts N token-id lists,
    has_image N bools (default: all True; a kind of image slots: [N, M], pixel_values [N, M, C, H, W]) -> N
    answers in the prompts' order, each the tokens generate(model, pixel_values[i:i+1], prompts[i], sampling,
    has_image=has_image[i]) gives (greedy; a sampled row draws from its own generator seeded with sampling.seed,
    as generate does). Prompts are batched by length (length_buckets; the row's length: moondream's image
    positions count); each row stops at its own EOS. progress(n): called after each batch of n."""
    model.eval()
    flags = has_image.long() if torch.is_tensor(has_image) else \
        torch.tensor([1] * len(prompts) if has_image is None else [int(bool(h)) for h in has_image])
    pixels = pixel_values.to(next(model.parameters()).dtype)
    out: list[list[int]] = [[] for _ in prompts]
    n_img = model.cfg.n_image_positions
    seen = flags.reshape(len(prompts), -1).amax(-1)  # a row with an image (any of its slots)
    for idx in length_buckets([len(p) + n_img * int(f) for p, f in zip(prompts, seen)], batch_size):
        answers = _decode_rows(model, pixels[idx], torch.tensor([prompts[i] for i in idx], dtype=torch.long),
                               flags[idx], sampling, tiling=None if tiling is None else tiling[idx])
        for i, a in zip(idx, answers):
            out[i] = a
        if progress is not None:
            progress(len(idx))
    return out


# ---- the command -------------------------------------------------------------------------------

def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="an mmpipe run directory (model.json + checkpoints/), a checkpoints/ directory, "
                        "or a Hugging Face directory `mmpipe import --hf` takes (LLaVA, LLaVA-NeXT, LLaVA-OneVision, "
                        "Qwen2-VL, Qwen2.5-VL)")
    p.add_argument("--image", action="append", default=[],
                   help="an image file; repeat --image/--prompt for several (answered in batches, one JSON line each)")
    p.add_argument("--prompt", action="append", default=[], help="the user's question, one per --image")
    p.add_argument("--video", default=None, metavar="PATH",
                   help="a clip (the Qwen2-VL, Qwen3-VL and LLaVA-OneVision families), with one --prompt and no "
                        "--image: its frames sampled and its prompt built as training builds a clip's (docs/video.md)")
    add_flags(p, DataArgs, only=VIDEO_FLAGS)  # with --video: its sampling, as `mmpipe train` takes it
    p.add_argument("--records", default=None,
                   help="a JSONL file of {\"image\": path, \"prompt\": text} (image paths relative to the file; "
                        "no image: a text-only prompt), answered in batches, one JSON line each")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per batch (default: 16)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the HF directory's own, else the run's tokenizer/ (written by "
                        "mmpipe import), else the built-in one)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--tp", type=int, default=1,
                   help="split the model over N tensor-parallel ranks (N processes forked on this machine, gloo) by "
                        "its family's plan, each rank reading only its slices of an mmpipe run's layer files; the "
                        "logits are gathered over the vocabulary, so the answers are --tp 1's "
                        "(docs/tensor_parallel.md)")


def resolve_checkpoint(path: Path) -> tuple[ModelConfig, str, str | None]:
    """What load_checkpoint loads, resolved without reading a weight (also --dry-run's): (the model config,
    where its weights are, the checkpoint's own tokenizer directory or None). An HF directory is read by
    `mmpipe import`'s dispatch (mmpipe.hf.commands.hf_importer: LLaVA, LLaVA-NeXT / OneVision, Qwen2-VL).
    Raises ConfigError."""
    if (path / "config.json").is_file():
        _, read, label = hf_importer(path)
        return read(path)[1], f"{path.resolve()} (HF {label})", str(path)
    run_dir = path if (path / "model.json").is_file() else path.parent
    ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not (run_dir / "model.json").is_file():
        raise ConfigError(f"--checkpoint: {path} holds neither model.json (an mmpipe run) nor config.json "
                          f"(an HF model)")
    cfg = config_from_dict(json.loads((run_dir / "model.json").read_text()), run_dir.name)
    tag = latest_tag(ckpt)
    if tag is None:
        raise ConfigError(f"--checkpoint: no checkpoint in {ckpt} (no 'latest' file)")
    return cfg, str((ckpt / tag).resolve()), str(run_dir / "tokenizer") if (run_dir / "tokenizer").is_dir() else None


def load_checkpoint(path: Path):
    """(model, tokenizer directory or None) from an mmpipe run / checkpoints dir (the latest checkpoint,
    whatever its stage count; the run's tokenizer/ if `mmpipe import` wrote one) or an HF directory of a family
    `mmpipe import --hf` takes (its own tokenizer). Raises ConfigError."""
    cfg, _, own = resolve_checkpoint(path)
    if (path / "config.json").is_file():
        return hf_importer(path)[0](path)[0], own
    ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    try:
        return load_reference(ckpt, cfg, merged=True), own
    except FileNotFoundError as e:
        raise ConfigError(f"--checkpoint: {e}") from None


def _load(path: Path, tokenizer: str | None):
    """(model, tokenizer) from an mmpipe run / checkpoints dir or an HF directory."""
    model, own = load_checkpoint(path)
    # no --tokenizer: the checkpoint's own, and a problem with it is the checkpoint's
    return model, load_tokenizer(tokenizer or own, flag="--tokenizer" if tokenizer else "--checkpoint")


# where generate and eval run the model: load_reference and the HF importers load it to this process's CPU
DEVICE = torch.device("cpu")


def check_attention() -> None:
    """MMPIPE_ATTENTION by the attention module's own rule on DEVICE (flex needs CUDA): ConfigError in one line
    before any weight is read, rather than at the model's first attention as a traceback."""
    attention_backend(DEVICE)


def _requests(args: argparse.Namespace) -> list[tuple[str | None, str, str]]:
    """(image path or None, prompt, where) for every --image/--prompt pair and --records line (--video: its one
    prompt, the clip read by _video)."""
    given = [f"--{k.replace('_', '-')}" for k in VIDEO_FLAGS if getattr(args, k, None) is not None]
    if given and not getattr(args, "video", None):
        raise ConfigError(f"{', '.join(given)}: a clip's sampling, for --video PATH only")
    if getattr(args, "video", None):
        if args.image or args.records or len(args.prompt) != 1:
            raise ConfigError("--video: give one --prompt and no --image or --records beside it")
        if not Path(args.video).is_file():
            raise ConfigError(f"--video: {args.video} is not a file")
        return [(None, args.prompt[0], "--video")]
    if len(args.image) != len(args.prompt):
        raise ConfigError(f"--image / --prompt: {len(args.image)} images but {len(args.prompt)} prompts; give them "
                          f"in pairs")
    if not args.image and not args.records:
        raise ConfigError("--image / --prompt: give an image and a prompt (or --records FILE)")
    out = [(im, pr, "--image") for im, pr in zip(args.image, args.prompt)]
    if args.records:
        path = Path(args.records)
        if not path.is_file():
            raise ConfigError(f"--records: {path} is not a file")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise ConfigError(f"--records: {path}:{n}: not valid JSON") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or \
                    not isinstance(rec.get("image"), (str, type(None))):
                raise ConfigError(f"--records: {path}:{n}: need {{\"image\": path, \"prompt\": text}}")
            image = rec.get("image")
            out.append((str(path.parent / image) if image else None, rec["prompt"], f"{path}:{n}"))
    for image, _, where in out:
        if image is not None and not Path(image).is_file():
            raise ConfigError(f"{where}: {image} is not a file")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size: {args.batch_size} must be >= 1")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} must be >= 1")
    return out


def _plan(args: argparse.Namespace, requests: list) -> int:
    """--dry-run: the checkpoint and tokenizer resolved (no weight read), the requests checked."""
    cfg, weights, own = resolve_checkpoint(Path(args.checkpoint))
    tok = load_tokenizer(args.tokenizer or own)
    images = sum(image is not None for image, _, _ in requests)
    return print_plan(f"generate: {len(requests)} prompt(s), {images} with an image", model=f"{cfg.name} "
                      f"({cfg.family})", weights=weights, tokenizer=f"{args.tokenizer or own or 'built-in'} "
                      f"({len(tok)} tokens)", decoding=Sampling.from_args(args, tok).plan())


def _images(requests: list, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor | None, list]:
    """Every request's image as the model takes it: (pixels, tiling, each prompt's image grids: a dynamic
    family's, else none). An image that cannot be read, or that the family's image rule refuses (e.g. an aspect
    ratio too extreme for its tiles, mmpipe.data.records.BAD_KINDS): ConfigError naming it."""
    kind = image_kind(cfg)
    transform, images = kind.one_image(cfg), []  # moondream multi-crop: Crops; a kind of grids: (patches, grid)
    for image, _, where in requests:
        try:
            images.append(transform(Image.open(image).convert("RGB")) if image else None)
        except OSError as e:
            raise ConfigError(f"{where}: {image}: {e}") from None
        except BadRecord as e:
            raise ConfigError(f"{where}: {image}: {e.reason}; {e.kind}: give an image the model's image processor "
                              f"takes (crop or pad it)") from None
    return kind.stack(cfg, images)


def _video(args: argparse.Namespace, model, tok, encoder: ConversationEncoder) -> list[int]:
    """--video: the clip's answer. The clip as training reads it (mmpipe.data.video at one medium's default budget:
    its sampled frames' patches and grid; Qwen3-VL: its timestamps in the prompt and a slot per temporal patch),
    the prompt with its block(s) where training puts them; ConfigError for a clip the family does not read or its
    rule refuses."""
    from ..data.image_kinds import image_rule, one_image_budget
    from ..data.records import Record, VideoRef
    from ..data.text import IMAGE_MARKER
    from ..data.video import media_count
    from ..registry import family_of
    cfg, path = model.cfg, Path(args.video)
    if "video" not in family_of(cfg).media:
        raise ConfigError(f"--video: the {cfg.family} family reads no clips")
    cfg = from_namespace(DataArgs, args, only=VIDEO_FLAGS).with_video(cfg)  # --video-*: the clip's sampling
    rule, kind = image_rule(cfg, one_image_budget(cfg)), image_kind(cfg)
    if kind.frames_as_images:  # Gemma 4, InternVL: the clip's frames, each an image slot
        return _frames_video(args, model, tok, encoder, cfg, kind)
    if kind.clip_crops:  # OneVision's tiles: the clip a slot of its frames' crops
        return _onevision_video(args, model, tok, encoder, cfg, rule)
    try:
        rule = clip_budget(rule, path, cfg)
        rec = kind.with_timestamps(Record("--video", [("user", f"{IMAGE_MARKER}\n{args.prompt[0]}")],
                                          [VideoRef(path.name)]), rule, path.parent, IMAGE_MARKER)
        grids, _ = kind.media_grids(rec.images, rule, path.parent, 0)
        n = media_count(rec.images)
        patches = torch.cat([kind.clip_pixels(m, rule, path.parent, n, g) for m, g in zip(rec.images, grids)])
        ids, image_at = encoder.prompt(rec.messages, n_images=len(rec.images))
    except BadRecord as e:
        raise ConfigError(f"--video: {path}: {e.kind}: {e.reason}") from None
    pixels = torch.cat([patches, torch.zeros(rule.merge ** 2, patches.shape[1])])[None]  # a padding merge unit
    prompt = with_images(ids, cfg, image_at, [tuple(int(x) for x in g) for g in grids])
    return generate(model, pixels, prompt, Sampling.from_args(args, tok), use_cache=not args.no_cache,
                    tiling=torch.as_tensor(grids)[None])


def clip_budget(rule, path: Path, cfg: ModelConfig):
    """The image rule whose row's P holds the clip at its video processor's own size (VideoRule.own: a prompt's one
    clip shares no row), at most the decoder's context (max_context positions of merge^2 patches each); where that
    makes its frames smaller than the processor would, one line on stderr says so."""
    import dataclasses

    import numpy as np

    from ..data.video import probe, video_rule
    info = probe(path)
    own = video_rule(rule).own(info)
    need, most = int(np.prod(own.grid)), cfg.text.max_context * rule.merge ** 2
    if need > most:
        print(f"mmpipe: generate: --video: {path}: the clip's {'x'.join(map(str, own.grid))} patch grid at its video "
              f"processor's size is over the model's context ({cfg.text.max_context} positions): its frames are made "
              f"smaller to fit", file=sys.stderr, flush=True)
    return dataclasses.replace(rule, row_patches=max(rule.row_patches, min(need, most)))


def _frames_video(args: argparse.Namespace, model, tok, encoder: ConversationEncoder, cfg, kind) -> list[int]:
    """--video on a family whose clips are frames as images (Gemma 4, InternVL; mmpipe.data.video): the clip's
    sampled frames, each an image slot after the text its processor writes (Gemma 4's mm:ss times, InternVL's FrameN
    lines), at the start of the user turn, in a row whose budget holds every frame at one image's default."""
    from ..data.records import Record, VideoRef
    from ..data.text import IMAGE_MARKER
    path = Path(args.video)
    try:
        rec = Record("--video", [("user", f"{IMAGE_MARKER}\n{args.prompt[0]}")], [VideoRef(path.name)])
        rec = kind.with_timestamps(rec, kind.rule(cfg, kind.budget(cfg, None, 1, [])), path.parent, IMAGE_MARKER)
        n = len(rec.images)
        rule = kind.rule(cfg, kind.budget(cfg, None, n, []), n)
        grids, _ = kind.media_grids(rec.images, rule, path.parent, 0)
        pixels = torch.cat([kind.clip_pixels(m, rule, path.parent, n, g) for m, g in zip(rec.images, grids)])
        ids, image_at = encoder.prompt(rec.messages, n_images=n)
    except BadRecord as e:
        raise ConfigError(f"--video: {path}: {e.kind}: {e.reason}") from None
    width = kind.blocks(cfg, n, 0).tiling_width
    prompt = with_images(ids, cfg, image_at, [tuple(int(x) for x in g) for g in grids])
    return generate(model, pixels[None], prompt, Sampling.from_args(args, tok), use_cache=not args.no_cache,
                    tiling=torch.as_tensor(grids[:, :width])[None])


def _onevision_video(args: argparse.Namespace, model, tok, encoder: ConversationEncoder, cfg, rule) -> list[int]:
    """--video on LLaVA-OneVision: its fps-sampled frames (up to vision.video_max_frames crops, the clip alone in its
    row) as crops, one slot of tiling (0, 0, -1, 1 - F), the processor's count of placeholders at the prompt's
    start, as training places a clip at its marker."""
    import dataclasses

    from ..data.records import VideoRef
    from ..data.text import IMAGE_MARKER
    path, kind = Path(args.video), image_kind(cfg)
    rule = dataclasses.replace(rule, row_tiles=max(rule.row_tiles, cfg.vision.video_max_frames))
    try:
        grids, _ = kind.media_grids([VideoRef(path.name)], rule, path.parent, 0)
        pixels = kind.clip_pixels(VideoRef(path.name), rule, path.parent, 1, grids[0])[None]  # [1, F, C, S, S]
        ids, image_at = encoder.prompt([("user", f"{IMAGE_MARKER}\n{args.prompt[0]}")], n_images=1)
    except BadRecord as e:
        raise ConfigError(f"--video: {path}: {e.kind}: {e.reason}") from None
    prompt = with_images(ids, cfg, image_at, [tuple(int(x) for x in grids[0])])
    return generate(model, pixels, prompt, Sampling.from_args(args, tok), use_cache=not args.no_cache,
                    tiling=torch.as_tensor(grids[:, :4])[None])


def main_generate(args: argparse.Namespace) -> int:
    try:
        requests = _requests(args)
        check_attention()
        if args.dry_run:
            return _plan(args, requests)
        if getattr(args, "tp", 1) != 1:
            cfg = resolve_checkpoint(Path(args.checkpoint))[0]
            for problem in tp_problems(cfg, args.tp):
                raise ConfigError(problem)
            return _tp_generate(args, requests)
        model, tok = _load(Path(args.checkpoint), args.tokenizer)
    except ConfigError as e:
        return fail(e)
    return _answer(args, requests, model, tok)


def _inputs(requests: list, cfg: ModelConfig, tok) -> tuple[torch.Tensor, torch.Tensor | None, list, list]:
    """(pixels, tiling, has_image, each request's prompt ids) as training reads them: a kind of markers reads the
    image from placeholders at the prompt's <image> marker (after BOS without one); other families take the prompt
    as it is. ConfigError in one line for an image or a prompt they refuse."""
    kind = image_kind(cfg)
    encoder = ConversationEncoder(tok, cfg.text.max_context, markers=kind.markers,
                                  image_text=kind.marker_text(tok, cfg))
    if hasattr(kind, "slot_pixels"):  # an image cut into slots with text between them (Gemma 3's pan-and-scan)
        return _slotted(requests, cfg, kind, encoder)
    pixels, tiling, grids = _images(requests, cfg)
    has_image = [image is not None for image, _, _ in requests]
    prompts = []
    for (_, prompt, where), h, g in zip(requests, has_image, grids):
        try:
            ids, image_at = encoder.prompt([("user", prompt)], n_images=int(h))
        except BadRecord as e:
            raise ConfigError(f"{where}: {e.reason}") from None
        prompts.append(with_images(ids, cfg, image_at, g) if h else ids)
    return pixels, tiling, has_image, prompts


def _slotted(requests: list, cfg: ModelConfig, kind, encoder: ConversationEncoder):
    """_inputs for a kind that cuts an image into slots: each request laid out as training lays out a record
    (kind.with_timestamps: the processor's text, a marker and a slot per block), each slot's pixels the kind's
    (slot_pixels), a row's unused slots blank: (pixels [N, M, C, S, S], None, has_image [N, M], prompts)."""
    from ..data.images import DEFAULT_MAX_PIXELS
    from ..data.records import Record
    from ..data.text import IMAGE_MARKER
    slots, prompts = [], []
    for image, prompt, where in requests:
        try:
            rec = kind.with_timestamps(Record(where, [("user", prompt)], [image] if image else []), None, None,
                                       IMAGE_MARKER)
            ids, image_at = encoder.prompt(rec.messages, n_images=len(rec.images))
            slots.append([kind.slot_pixels(m, None, DEFAULT_MAX_PIXELS) for m in rec.images])
        except BadRecord as e:
            raise ConfigError(f"{where}: {e.kind}: {e.reason}") from None  # the reason names the image
        prompts.append(with_images(ids, cfg, image_at) if rec.images else ids)
    m, blank = max(1, *map(len, slots)), kind.blank(cfg)
    pixels = torch.stack([torch.stack(row + [blank] * (m - len(row))) for row in slots])
    return pixels, None, torch.tensor([[1] * len(row) + [0] * (m - len(row)) for row in slots]), prompts


def _answer(args: argparse.Namespace, requests: list, model, tok) -> int:
    """Every request's answer printed (stdout: the answer alone for one --image / --video, else a JSON line each)."""
    try:
        cfg = model.cfg
        if getattr(args, "video", None):
            kind = image_kind(cfg)
            encoder = ConversationEncoder(tok, cfg.text.max_context, markers=kind.markers,
                                          image_text=kind.marker_text(tok, cfg))
            new = _video(args, model, tok, encoder)
            answer = tok.decode(new, skip_special_tokens=True).strip()
            if not answer:
                print(f"mmpipe: generate: --video: empty answer: {empty_reason(new)}", file=sys.stderr, flush=True)
            print(answer)
            return 0
        pixels, tiling, has_image, prompts = _inputs(requests, cfg, tok)
    except ConfigError as e:
        return fail(e)
    sampling = Sampling.from_args(args, tok)
    if args.no_cache:
        new = [generate(model, pixels[i:i + 1], p, sampling, use_cache=False, has_image=h,
                        tiling=None if tiling is None else tiling[i:i + 1])
               for i, (p, h) in enumerate(zip(prompts, has_image))]
    else:
        new = generate_batch(model, pixels, prompts, sampling, has_image=has_image, batch_size=args.batch_size,
                             tiling=tiling)
    answers = [tok.decode(a, skip_special_tokens=True).strip() for a in new]
    for (_, _, where), a, answer in zip(requests, new, answers):
        if not answer:  # say why on stderr: stdout stays the answers alone
            print(f"mmpipe: generate: {where}: empty answer: {empty_reason(a)}", file=sys.stderr, flush=True)
    if len(requests) == 1 and not args.records:  # the single-image form: the answer alone
        print(answers[0])
        return 0
    for (image, prompt, _), answer in zip(requests, answers):
        print(json.dumps({"image": image, "prompt": prompt, "answer": answer}), flush=True)
    return 0


# ---- --tp: the model split over TP ranks forked on this machine ----------------------------------------------

class GatheredLogits(nn.Module):
    """The last layer of a split model (a vocab-parallel head: each rank's V / TP logits) with its logits gathered
    over the TP group, so every rank holds the whole row's logits and picks the same token (greedy: equal logits,
    bit for bit; sampled: the same generator draws). [B, T, V / TP] x TP -> [B, T, V], in rank order: rank r's slice
    is vocabulary rows r V / TP .. (r + 1) V / TP (the plan's vocab mark)."""

    def __init__(self, head: nn.Module, shard: Shard):
        super().__init__()
        self.head, self.shard = head, shard

    def _gather(self, out):
        logits, *aux = out if isinstance(out, tuple) else (out,)  # an MoE head's aux loss rides along
        parts = [torch.empty_like(logits) for _ in range(self.shard.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.shard.group)
        whole = torch.cat(parts, dim=-1)
        return (whole, *aux) if aux else whole

    def forward(self, args):
        return self._gather(self.head(args))

    def decode(self, t, cache: dict, start: int):
        return self._gather(self.head.decode(t, cache, start))


def split_model(model, shard: Shard):
    """A whole single-device model (ReferenceModel) split in place by its family's plan (what `mmpipe train --tp`
    splits: each layer as DeepSpeed builds it, a tied head's forward_fn wrapped), its head's logits gathered."""
    plan = family_of(model.cfg).tp_plan
    for layer in model:
        if isinstance(layer, TiedCall):  # the tied head's later use: its forward_fn, as DeepSpeed's partial of it
            layer.forward_fn = parallelize(functools.partial(layer.forward_fn), plan, shard).func
        else:
            parallelize(layer, plan, shard)
    model[len(model) - 1] = GatheredLogits(model[len(model) - 1], shard)
    return model


def tp_reference(ckpt_dir: Path, cfg: ModelConfig, shard: Shard):
    """TP rank shard.rank's split model with its slices of a run's latest checkpoint, read layer by layer through
    mmpipe.runtime.reshard.layer_state (what --resume and --init-from read: this rank's rows of each split tensor,
    from the files of whatever TP wrote them, memory-mapped; a file written at this TP as it is)."""
    tag_dir = Path(ckpt_dir) / latest_tag(ckpt_dir)
    model, plan, specs = split_model(ReferenceModel(cfg), shard), family_of(cfg).tp_plan, layer_specs(cfg)
    for idx in range(len(model)):
        layer = model[idx].head if isinstance(model[idx], GatheredLogits) else model[idx]
        if not layer_files(tag_dir, idx) and not layer.state_dict():
            continue  # a tied head's later use: no file
        layer.load_state_dict(layer_state(tag_dir, idx, meta_layer(specs[idx], idx), shard.rank, shard.size, plan))
    return model


def _tp_generate(args: argparse.Namespace, requests: list) -> int:
    """--tp N: N ranks forked here (fork: no rank imports torch again), one gloo group; each loads its split model
    and answers every request; rank 0 prints, its exit status is the command's."""
    with tempfile.TemporaryDirectory(prefix="mmpipe-tp-") as tmp:
        mp.start_processes(_tp_rank, args=(args, requests, tmp), nprocs=args.tp, start_method="fork")
        return int((Path(tmp) / "rc").read_text())


def _tp_rank(rank: int, args: argparse.Namespace, requests: list, tmp: str) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads() // args.tp))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=args.tp)
    shard = Shard(dist.group.WORLD, rank, args.tp)
    path = Path(args.checkpoint)
    try:
        cfg, _, own = resolve_checkpoint(path)
        ckpt = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        if (path / "config.json").is_file() or read_lora(ckpt.parent):  # whole weights (an HF dir; LoRA merged)
            model = split_model(load_checkpoint(path)[0], shard)
        else:
            model = tp_reference(ckpt, cfg, shard)
        tok = load_tokenizer(args.tokenizer or own, flag="--tokenizer" if args.tokenizer else "--checkpoint")
    except ConfigError as e:
        rc = fail(e) if rank == 0 else 2
    else:
        with contextlib.redirect_stdout(sys.stdout if rank == 0 else io.StringIO()):
            rc = _answer(args, requests, model, tok)
    if rank == 0:
        (Path(tmp) / "rc").write_text(str(rc))
    dist.barrier()
    dist.destroy_process_group()


def empty_reason(new: list[int]) -> str:
    """Why new token ids decoded to an empty answer: EOS came first, or every token was a special one
    (decoding skips those). Ids past the tokenizer are never generated (`_masked`)."""
    if not new:
        return "the model's first new token was EOS"
    shown = ", ".join(map(str, new[:8])) + (", ..." if len(new) > 8 else "")
    return f"its {len(new)} new tokens (ids {shown}) are all special tokens, which decoding skips"
