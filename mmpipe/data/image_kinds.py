"""A family's images on the data side, one object each behind one protocol: the single place that knows which
rule a model's images follow. Every other module asks `image_kind(cfg)`, never the family's name or a layout flag.

A family's entry holds its kind (mmpipe.registry.Family.kind); the kinds live here, above model/, because
they call the data side's rules (transformers' image processors, the crop and placeholder counts):

    spliced       a fixed-size image of N tokens spliced after BOS (moondream; the cross-attention family, N = 0)
    placeholders  a fixed-size image on N <image> placeholder ids at its marker (LLaVA)
    patches       an image of any size as its grid of patches in the row's budget of P (--max-patches), a
                  bracketed block of placeholders (Qwen2-VL / Qwen2.5-VL; mmpipe.data.patches)
    tiles         an image of any size as its base crop and tiles in the row's budget of T crops (--max-tiles),
                  a block of placeholders (LLaVA-NeXT / OneVision; mmpipe.data.anyres)

What a kind answers: its row budget's flag (None: fixed-size images have none) and the budget a run gets, the
grid rule of its images (None: fixed size), the positions a sample's images take (the text's room in the
context), a row's image blocks (mmpipe.data.packing.RowShape), what an image marker becomes in the text, why
--augment does not apply (None: it does), a row's blank image slot, and the generation inputs: one image as the
model reads it (`one_image`), a batch of them with one slot per prompt (`stack`), and a prompt with its images'
placeholders (`with_images`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from ..model.rows import IMAGE_SLOT
from ..registry import families, family_of
from . import video
from .anyres import default_tile_budget, tile_rule
from .blocks import FixedBlocks, PatchBlocks, TileBlocks
from .crops import blank_image, make_transform, stack_images
from .patches import default_patch_budget, patch_rule, per_image_patches
from .text import image_text, with_placeholders

VIDEO_DEFAULTS = (2.0, 4, 768, 0, 0)  # PatchVision's video_* defaults: an index made before them keeps its key
BUDGET_FLAGS = ("max_patches", "max_tiles")  # DataArgs' row budgets: the kind takes at most one


@dataclass(frozen=True)
class Spliced:
    name = "spliced"
    flag = None
    # a sample's text carries its images' markers, a block of the family's placeholders at each (so several images a
    # sample; the built-in tokenizer then holds an <image> token to write them): not for spliced images, which go
    # after BOS whatever the text says
    markers = False
    describe = "images are a fixed size"
    # its placeholder is the tokenizer's <image> (LLaVA's), added to the tokenizer of fresh weights and expanded by
    # transformers' LlavaProcessor in an export; a family of grids has its tokenizer's own (Qwen2-VL's <|image_pad|>)
    image_token = False
    # a clip is its frames, each an image slot after its processor's text (Gemma 4, InternVL: mmpipe.data.video's
    # frames as images; `mmpipe plan` does not cost them yet)
    frames_as_images = False

    # what a record's slots depend on beyond the text, for the index's fingerprint where the kind has no grid rule
    # (Gemma 3's pan-and-scan settings, mmpipe.data.gemma3); None: nothing
    slot_key = None

    def placeholder_id(self, cfg: ModelConfig) -> int | None:
        """The id of the image placeholders its prompts carry (decoding never picks it), None without them."""
        return None

    def with_timestamps(self, rec, rule, image_root, marker: str):
        """The record as its clips' slots are laid out (Qwen3-VL: a slot per temporal patch after its timestamp
        text; mmpipe.data.video); unchanged for a kind without such a layout (its family reads no clips)."""
        return rec

    def augment_refusal(self, cfg: ModelConfig) -> str | None:
        """Why --augment cannot apply (None: it can): moondream multi-crop's crops are cut by its fixed rule."""
        return (None if cfg.vision.crop_slots == 1 else
                "--augment: multi-crop images (vision.max_crops) are cut by moondream's fixed rule, which the "
                "Projector's stitching assumes; drop --augment or use --max-crops 0")

    def blank(self, cfg: ModelConfig):
        """An unused image slot's pixels (zeros no placeholder reads; multi-crop: Crops of zeros, tiled 1 x 1)."""
        return blank_image(cfg.vision.image_size, cfg.vision.crop_slots - 1)

    def one_image(self, cfg: ModelConfig):
        """PIL image -> the model's pixels for one image: [3, S, S], or moondream multi-crop's Crops."""
        return make_transform(cfg.vision)

    def input(self, pixels, grid):
        """What `stack` takes for one image read by a sample source (pixels, and its grid for a kind of grids)."""
        return pixels

    def stack(self, cfg: ModelConfig, images: list) -> tuple[torch.Tensor, torch.Tensor | None, list]:
        """one_image's outputs, None for a prompt without an image -> (pixels [B, 3, S, S] (multi-crop
        [B, 1 + K, 3, S, S]), tiling (multi-crop's [B, 2], else None), each prompt's grids: none)."""
        blank = self.blank(cfg)
        return (*stack_images([blank if im is None else im for im in images]), [()] * len(images))

    def with_images(self, ids: list[int], cfg: ModelConfig, image_at, grids=()) -> list[int]:
        """A prompt with the image placeholders training puts there: none (the model splices the image)."""
        return list(ids)

    def budget(self, cfg: ModelConfig, given: int | None, max_images: int, problems: list[str]) -> int:
        return 0

    def follow(self, cfg: ModelConfig, slots: int, sizes: list) -> int:
        """The budget when it follows --pack's image slots (mmpipe.data.dataset.packed_image_slots): none."""
        return 0

    def rule(self, cfg: ModelConfig, budget: int, max_images: int = 1):
        return None

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        """One image a sample, after BOS (several only fill a packed row's slots)."""
        return cfg.n_image_positions

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        return FixedBlocks(cfg.n_image_positions, IMAGE_SLOT)

    def marker_text(self, tok, cfg: ModelConfig) -> str | None:
        return None

    def row_json(self, row) -> dict:
        """`mmpipe plan --json`'s row fields: the budget flag and the images' grids (none for fixed-size images)."""
        return {}


@dataclass(frozen=True)
class Placeholders(Spliced):
    name = "placeholders"
    image_token = True
    markers = True

    def placeholder_id(self, cfg: ModelConfig) -> int | None:
        return cfg.image_token_id

    def with_images(self, ids: list[int], cfg: ModelConfig, image_at, grids=()) -> list[int]:
        """A prompt with N placeholders a block at each image marker (after BOS without one): LLaVA's 576."""
        return with_placeholders(ids, cfg.image_token_id, cfg.vision.n_features, image_at)

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        """A block of N placeholders for each of up to M images: e.g. 576 x 2 = 1152 for two CLIP-336 images."""
        return cfg.vision.n_features * max(1, max_images)

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        return FixedBlocks(cfg.vision.n_features, cfg.image_token_id)


class Budgeted:
    """A kind whose images of any size fill a row budget by a grid rule: generation reads one image a prompt at one
    image's default budget, stacked one slot a row, its grid's block in the prompt."""
    image_token = False
    markers = True
    frames_as_images = False
    slot_key = None
    with_timestamps = Spliced.with_timestamps  # the record unchanged: only Qwen3-VL's patches lay clips out so

    def placeholder_id(self, cfg: ModelConfig) -> int | None:
        return cfg.image_token_id

    def augment_refusal(self, cfg: ModelConfig) -> str | None:
        return (f"--augment: the {cfg.family} family's images are resized by its image processor's own rule "
                f"({self.name}: mmpipe.data.image_kinds), which has no augmentation; drop --augment")

    def blank(self, cfg: ModelConfig):
        return None  # unused slots hold no patches: the row's budget is zero padded

    def one_image(self, cfg: ModelConfig):
        """PIL image -> (patches [n, patch_dim] or crops [1 + rows x cols, C, S, S], grid), by the rule at one
        image's default budget (any one image fits); BadRecord for an image the rule refuses."""
        return self.rule(cfg, self.budget(cfg, None, 1, [])).patches

    def input(self, pixels, grid):
        return pixels, grid

    def stack(self, cfg: ModelConfig, images: list) -> tuple[torch.Tensor, torch.Tensor, list]:
        """one_image's (patches, grid) per prompt, None for a text-only one -> (pixels, tiling [B, 1, k], grids):
        one slot a row, its patches (crops) then zeros up to the batch's largest image (at least one merge unit,
        one crop), its slot tiling (zeros without an image), as the model reads them: Qwen2-VL's pixels
        [B, P, patch_dim] and (t, h, w); any-resolution tiles' [B, T, C, S, S] and (orig_h, orig_w, rows, cols)."""
        blocks = self.blocks(cfg, 1, 0)
        pixels = torch.zeros(len(images), max([blocks.least] + [len(im[0]) for im in images if im is not None]),
                             *blocks.unit)
        tiling = torch.zeros(len(images), 1, blocks.tiling_width, dtype=torch.long)
        for b, im in enumerate(images):
            if im is not None:
                pixels[b, :len(im[0])] = im[0]
                vals = [int(g) for g in im[1][:blocks.tiling_width]]  # an image's grid: no clip step column
                tiling[b, 0, :len(vals)] = torch.tensor(vals)
        return pixels, tiling, [[im[1]] if im is not None else [] for im in images]

    # Clips (mmpipe.data.video): a family whose records may carry them (Family.media) reads them by its kind: Patches
    # and Tiles are its two implementations; a fixed-size kind takes none (its family refuses the record).
    def with_images(self, ids: list[int], cfg: ModelConfig, image_at, grids=()) -> list[int]:
        """The block of each image's grid (Qwen2-VL's bracketed one, tiles' n placeholders) before ids[a] (a in
        image_at; None or empty: after BOS)."""
        blocks, out = self.blocks(cfg, 1, 0), list(ids)
        at = [1] * len(grids) if image_at is None or not len(image_at) else [int(a) for a in image_at]
        for a, grid in sorted(zip(at, grids), reverse=True):  # last first: the earlier positions stay put
            out[a:a] = blocks.block(grid).tolist()
        return out


@dataclass(frozen=True)
class Patches(Budgeted):
    name = "patches"
    flag = "max_patches"
    describe = "images take a patch budget (--max-patches)"

    def budget(self, cfg: ModelConfig, given: int | None, max_images: int, problems: list[str]) -> int:
        """P: --max-patches, else room for M images at vision.max_pixels; a line per problem."""
        v, unit = cfg.vision, cfg.vision.merge_size ** 2
        p = given if given is not None else default_patch_budget(v, max_images)
        least = patch_rule(cfg, p).min_pixels // v.patch_size ** 2
        if given is not None and (given < least or given % unit):
            problems.append(f"--max-patches: {given} must be a multiple of merge_size^2 = {unit} and at least {least} "
                            f"(vision.min_pixels {v.min_pixels} / patch_size^2: the smallest image's patches)")
        elif p < least:
            problems.append(f"--max-patches: the model's vision.max_pixels ({v.max_pixels}) leaves no patch budget; "
                            f"give --max-patches P (a multiple of {unit}, at least {least})")
        return p

    def follow(self, cfg: ModelConfig, slots: int, sizes: list) -> int:
        """P for M = slots images at the data's rate, P = M x g (g the mean image's patches, from the sizes' index
        grids: [(Encoded, images)]), at least one image at vision.max_pixels, e.g. M = 4 images of 300 patches:
        P = 1200."""
        unit, images = cfg.vision.merge_size ** 2, sum(int(n) for _, n in sizes)
        mean = sum(int(np.prod(enc.grids[:n, :3], axis=1).sum()) for enc, n in sizes) / max(1, images)
        return max(per_image_patches(cfg.vision), math.ceil(slots * mean / unit) * unit)

    def rule(self, cfg: ModelConfig, budget: int, max_images: int = 1):
        return patch_rule(cfg, budget) if budget else None

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        """Each image's two brackets and the placeholders of P patches: 2 M + P / merge^2."""
        return 2 * max(1, max_images) + budget // cfg.vision.merge_size ** 2

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        v = cfg.vision
        patch_dim = v.channels * v.temporal_patch_size * v.patch_size ** 2  # floats per patch, C x T x p x p
        return PatchBlocks(budget or default_patch_budget(v, max_images), v.merge_size, cfg.image_token_id,
                           cfg.vision_start_id, cfg.vision_end_id, patch_dim, bool(v.tokens_per_second))

    def marker_text(self, tok, cfg: ModelConfig) -> str | None:
        return image_text(tok, cfg)

    def row_json(self, row) -> dict:
        return {self.flag: row.patches, "image_grids": [list(g) for g in row.grids]}

    def grid_key(self, rule, record_images: int, budget: int) -> list:
        """What an index's grids depend on, for its fingerprint: the rule's resize bounds for each image count a
        record may have (not P itself, which --pack's slots may raise without changing any grid)."""
        key = [rule.factor, rule.min_pixels, [rule.cap(n) for n in range(1, record_images + 1)]]
        # clips' steps (a 4th grid column) follow tokens_per_second; an index without them keeps its old key
        key += [rule.tokens_per_second] if rule.tokens_per_second else []
        # clips' sampling (--video-*): a key of its own only where it is not the processors' defaults
        return key + ([list(rule.video)] if rule.video and rule.video != VIDEO_DEFAULTS else [])

    # its clips: frames sampled by the video processor, as patches in the row's P (mmpipe.data.video)
    clip_crops = False  # a clip's slot holds patches, its grid (t, h, w); generation sizes the row to the clip

    def with_timestamps(self, rec, rule, image_root, marker: str):
        return video.with_timestamps(rec, rule, image_root, marker)

    def media_grids(self, media: list, rule, image_root, max_pixels: int, spare: int = 0):
        return video.media_grids(media, rule, image_root, max_pixels)

    def clip_pixels(self, ref, rule, image_root, n_media: int, grid):
        return video.clip_patches(ref, rule, image_root, n_media, grid)

    def images_count(self, media: list) -> int:
        """What its rule counts a sample's images by: its media, each clip once (video.media_count)."""
        return video.media_count(media)


@dataclass(frozen=True)
class Tiles(Budgeted):
    name = "tiles"
    flag = "max_tiles"
    describe = "images take a crop budget (--max-tiles)"

    def budget(self, cfg: ModelConfig, given: int | None, max_images: int, problems: list[str]) -> int:
        """T: --max-tiles, else room for any one sample of M images (mmpipe.data.anyres)."""
        if given is not None and given < 1:
            problems.append(f"--max-tiles: {given} must be >= 1 (crops per row: each image's base crop and its tiles)")
            return 1
        return given if given is not None else default_tile_budget(cfg, max_images)

    def follow(self, cfg: ModelConfig, slots: int, sizes: list) -> int:
        """T for M = slots images: room for any one sample of them."""
        return default_tile_budget(cfg, slots)

    def rule(self, cfg: ModelConfig, budget: int, max_images: int = 1):
        return tile_rule(cfg, budget, max_images)

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        """Room for the largest sample's images (TileRule.row_budget)."""
        return tile_rule(cfg, 0).row_budget(max(1, max_images))[1]

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        rule, v = tile_rule(cfg, budget, max_images), cfg.vision
        return TileBlocks(rule.row_tiles, rule.row_budget(max_images)[1], cfg.image_token_id,
                          (v.channels, v.image_size, v.image_size))

    def marker_text(self, tok, cfg: ModelConfig) -> str | None:
        return None  # LLaVA's <image> marks the place; its block is the grid's placeholders

    def row_json(self, row) -> dict:
        return {self.flag: row.crops, "image_tilings": [list(g) for g in row.tilings]}

    def grid_key(self, rule, record_images: int, budget: int) -> list:
        """What an index's grids and its too_many_tiles refusals depend on: the rule and T (budget: 0 where T
        follows the slots)."""
        *key, video = dataclasses.astuple(dataclasses.replace(rule, row_tiles=0))  # video: TileRule's last field
        # OneVision's clip sampling (--video-*) only where not the defaults: an index made before it keeps its key
        return key + ([list(video)] if video and video != VIDEO_DEFAULTS[:3] else []) + [budget]

    # its clips: OneVision's frames, each a base crop through the tower and pooled, in the row's T (mmpipe.data.video)
    clip_crops = True  # a clip's slot holds its frames' crops, tiling (0, 0, -1, 1 - F)

    def media_grids(self, media: list, rule, image_root, max_pixels: int, spare: int = 0):
        return video.onevision_grids(media, rule, image_root, max_pixels, spare)

    def clip_pixels(self, ref, rule, image_root, n_media: int, grid):
        """The index's frame count (its grid) says which frames."""
        return video.onevision_frames(video.clip_path(ref, image_root), rule, int(grid[2]), int(grid[3]))

    def images_count(self, media: list) -> int:
        """Its images alone, as transformers' batch_num_images (a clip does not make an image base-only)."""
        from .records import VideoRef
        return sum(1 for m in media if not isinstance(m, VideoRef))


# the kinds, one object each: a family's entry holds its own (mmpipe.registry.Family.kind)
SPLICED, PLACEHOLDERS, PATCHES, TILES = Spliced(), Placeholders(), Patches(), Tiles()
BUDGET_NOUNS = {"max_patches": "a patch budget", "max_tiles": "a crop budget"}


def image_kind(cfg: ModelConfig | None):
    """The kind of cfg's images (fixed-size spliced images for no model: the built-in shapes set's default)."""
    if cfg is None:
        return SPLICED
    kind = family_of(cfg).kind
    return kind.of(cfg) if hasattr(kind, "of") else kind  # a family whose config picks its kind (gemma4)


def row_budget(args, cfg: ModelConfig | None, problems: list[str]) -> int:
    """The one row budget of cfg's kind, in its unit (P patches, T crops; 0 for fixed-size images): its flag, else
    its default for --max-images. A budget flag the kind does not take is refused, naming the families that take
    it. Appends a line per problem."""
    kind, budget = image_kind(cfg), 0
    for flag in BUDGET_FLAGS:
        given = getattr(args, flag, None)
        if cfg is not None and flag == kind.flag:
            budget = kind.budget(cfg, given, args.max_images or 1, problems)
            if given is None and hasattr(kind, "context_budget"):  # InternVL: T the context holds at --text-len
                budget = kind.context_budget(cfg, budget, args.max_images or 1, getattr(args, "text_len", None))
        elif given is not None and cfg is not None:
            takers = list(dict.fromkeys(f.family for f in families() if f.kind.flag == flag))
            who = f"the {takers[0]} family takes" if len(takers) == 1 else f"the {', '.join(takers)} families take"
            problems.append(f"--{flag.replace('_', '-')}: the {cfg.family} family's {kind.describe}; only "
                            f"{who} {BUDGET_NOUNS[flag]}")
    return budget


def budget_given(args, cfg: ModelConfig | None) -> bool:
    """Whether the user set cfg's kind's budget flag (else it is the default and follows the image slots)."""
    kind = image_kind(cfg)
    return kind.flag is not None and getattr(args, kind.flag, None) is not None


def image_rule(cfg: ModelConfig, budget: int = 0):
    """The grid rule of cfg's images at the row budget of its kind (None for fixed-size images)."""
    return image_kind(cfg).rule(cfg, budget)


def one_image_budget(cfg: ModelConfig) -> int:
    """cfg's kind's budget at one image's default (0 for fixed-size images): one slot per row, as evaluation and
    generation read an image."""
    return image_kind(cfg).budget(cfg, None, 1, [])
