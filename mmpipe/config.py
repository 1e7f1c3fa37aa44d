"""Model configs: frozen dataclasses, named presets loaded from JSON (mmpipe/presets/*.json)."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .registry import ImageLayout, known_families, known_pairs, lookup

PRESET_DIR = Path(__file__).parent / "presets"
REGION_FILE = "region.safetensors"  # in a run directory: moondream's region head, carried unchanged (hf.moondream)


VISION_ACTS = ("gelu_tanh", "gelu", "quick_gelu")


def fail(e: ConfigError) -> int:
    """Print each problem as one `mmpipe: error:` line; exit status 2, no traceback."""
    for line in str(e).splitlines():
        print(f"mmpipe: error: {line}", file=sys.stderr)
    return 2


def read_json(path: str | Path, where: str, missing: str):
    """A JSON file's contents, or ConfigError in one line: '<where>: <missing>' when there is no such
    file, '<where>: not valid JSON (...)' when it does not parse."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{where}: {missing}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None


# The model JSON's "vision" and "text" sections, one class per family (ImageLayout.vision / .text names it): a
# section holds the fields its family's layers read and nothing else, so a field another family reads is refused as
# unknown instead of ignored. The base classes hold what every tower / decoder has; a family's class adds its own.
@dataclass(frozen=True)
class VisionConfig:
    """What every tower has: square crops (or the largest square image) cut into patches, a ViT of n_layers."""
    multi_crop: typing.ClassVar[bool] = False  # moondream's local crops (CropVision), which --max-crops limits
    image_size: int  # square crop, pixels
    patch_size: int
    dim: int
    n_layers: int
    n_heads: int
    ff_dim: int
    channels: int = 3
    # SigLIP normalisation: (x - 0.5) / 0.5 maps [0, 1] to [-1, 1]
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    ln_eps: float = 1e-6

    @property
    def n_positions(self) -> int:  # tower tokens (CLIP adds its class token: ClipVision)
        return self.n_tokens

    @property
    def n_features(self) -> int:  # image features the projector reads per crop
        return self.n_positions

    @property
    def crop_slots(self) -> int:  # images the tower encodes per sample (moondream2's 1 + 12: CropVision)
        return 1

    @property
    def proj_in_dim(self) -> int:  # the projector's input width (moondream2's 2 x 1152: CropVision)
        return self.dim

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_tokens(self) -> int:  # e.g. (378 / 14)^2 = 27^2 = 729
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:  # e.g. 14 * 14 * 3 = 588 (Qwen's 2 frames: PatchVision)
        return self.patch_size * self.patch_size * self.channels

    @property
    def any_resolution(self) -> bool:  # any-resolution tiles: image_size may leave a remainder (AnyresVision)
        return False


@dataclass(frozen=True)
class CropVision(VisionConfig):
    """The moondream family's tower (both fusions): SigLIP-shaped, GELU-tanh, with moondream2's multi-crop."""
    multi_crop: typing.ClassVar[bool] = True  # --max-crops limits its crops
    # How many crop features each image token concatenates before the projector. moondream2 feeds [global crop,
    # pooled local crops] side by side, so its proj_mlp.fc1 reads 2 x dim (2 x 1152 = 2304; 0.5B: 2 x 720 = 1440).
    # 1: the projector reads the tower's output as is.
    crop_features: int = 1
    # Multi-crop (moondream2: 12): each image is encoded as a global crop plus up to max_crops overlapping local
    # crops of image_size px (mmpipe.data.crops), in 1 + max_crops fixed slots per sample; the projector reads
    # [global, stitched-and-pooled locals]. 0: one crop per image. overlap_margin: patches each local crop shares
    # with a neighbour on each side (moondream: 4).
    max_crops: int = 0
    overlap_margin: int = 4

    @property
    def crop_slots(self) -> int:  # 1 + 12 = 13 for moondream2
        return 1 + self.max_crops if self.max_crops else 1

    @property
    def proj_in_dim(self) -> int:  # e.g. 2 x 1152 = 2304 (moondream2)
        return self.crop_features * self.dim


@dataclass(frozen=True)
class ClipVision(VisionConfig):
    """The LLaVA family's tower: "siglip" (no class token) or "clip" (class token + pre-LayerNorm), its MLP
    activation, which hidden state feeds the projector (HF's vision_feature_layer: -2 is the second to last layer's
    output, LLaVA-1.5) and whether the first token is dropped ("default", CLIP's class token) or kept ("full")."""
    kind: str = "siglip"
    act: str = "gelu_tanh"
    feature_layer: int = -1
    feature_select: str = "full"

    @property
    def n_positions(self) -> int:  # CLIP adds the class token, e.g. 24^2 + 1 = 577
        return self.n_tokens + (self.kind == "clip")

    @property
    def n_features(self) -> int:  # LLaVA image features (= <image> placeholders), e.g. 577 - 1 = 576
        return self.n_positions - (self.feature_select == "default")

    @property
    def n_blocks_used(self) -> int:  # blocks up to the feature layer, e.g. 24 layers at -2: 23
        return self.feature_layer % (self.n_layers + 1)


@dataclass(frozen=True)
class AnyresVision(ClipVision):
    """The LLaVA-NeXT / OneVision family (mmpipe.model.llava_next): LLaVA's tower with any-resolution tiling.
    grid_pinpoints are HF's image_grid_pinpoints ([h, w] px, multiples of image_size): an image is encoded as its
    base crop plus the tiles of the pinpoint its aspect fits best; anyres_max is OneVision's "anyres_max_9" -> 9 (its
    features are bilinear-pooled past 9 x N; also: an image of a several-image sample is its base crop only), 0 for
    LLaVA-NeXT. `image_size` is the tower's crop (336 CLIP-L, 384 SigLIP)."""
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    anyres_max: int = 0
    # OneVision's clips (mmpipe.data.video; --video-fps, --video-min-frames, --video-max-frames): the video
    # processor's sampling; its frames are the tower's crop size
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768

    @property
    def any_resolution(self) -> bool:  # as transformers' conv: OneVision's SigLIP cuts 384 px / 14 into 27 x 27
        return bool(self.grid_pinpoints)


@dataclass(frozen=True)
class PatchVision(VisionConfig):
    """The towers of patches (Qwen2-VL's, Qwen3-VL's; mmpipe.model.qwen2_vl): a patch spans temporal_patch_size frames
    (Qwen: 2, an image is 2 identical frames; patch_dim 3 x 2 x 14 x 14 = 1176), merge_size^2 neighbouring patches
    become one decoder token (Qwen: 2), window attention over window_size px (Qwen2.5: 112; 0: every block full)
    except in the fullatt_blocks (Qwen2.5: 7, 15, 23, 31), norm "layernorm" / "rmsnorm" (Qwen2.5), mlp "gelu"
    (fc1 / fc2 with `act`, Qwen2: quick_gelu) or "swiglu" (gate / up / down with bias, act silu: Qwen2.5), and the
    image processor's resize bounds in pixels (0: none). `dim` is the tower's width (embed_dim, 1280) and image_size
    the largest square image the bounds allow (what plan costs by default)."""
    act: str = "gelu_tanh"
    temporal_patch_size: int = 1
    merge_size: int = 1
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()
    norm: str = "layernorm"
    mlp: str = "gelu"
    min_pixels: int = 0
    max_pixels: int = 0
    # Clips (mmpipe.data.video; train / plan / generate's --video-* flags set them): the video processor's fps,
    # min_frames and max_frames, and its pixel bounds, 0: the images' (Qwen2-VL's min_pixels / max_pixels of a frame;
    # Qwen3-VL's size shortest_edge / longest_edge, over the whole clip's frames)
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 0
    video_max_pixels: int = 0

    @property
    def patch_dim(self) -> int:  # e.g. 14 * 14 * 3 x 2 frames = 1176
        return self.patch_size * self.patch_size * self.channels * self.temporal_patch_size

    @property
    def timestamps(self) -> bool:  # a clip's time as text before each temporal patch (Qwen3-VL), not in the rotary
        return False


@dataclass(frozen=True)
class Qwen2Vision(PatchVision):
    """The Qwen2-VL / Qwen2.5-VL family's tower, with Qwen2.5-VL's absolute-time temporal rotary for clips
    (vision_config.tokens_per_second, its releases: 2): a clip's temporal patch f sits at f x tokens_per_second x
    temporal_patch_size / sampled fps (mmpipe.data.video); 0: Qwen2-VL's temporal index f (the rows' tiling keeps 3
    columns)."""
    tokens_per_second: int = 0


@dataclass(frozen=True)
class Qwen3Vision(PatchVision):
    """The Qwen3.5 family's tower (Qwen3-VL's without DeepStack): Qwen2-VL's, no windows, plus a learned position
    table of num_position_embeddings = side^2 bilinearly resampled to each image's grid (2304 = 48^2)."""
    num_position_embeddings: int = 0

    @property
    def tokens_per_second(self) -> int:  # clips keep the temporal index in the rotary: their time is in the text
        return 0

    @property
    def timestamps(self) -> bool:
        return True


@dataclass(frozen=True)
class DeepstackVision(Qwen3Vision):
    """The Qwen3-VL family's tower (mmpipe.model.qwen3_vl): the blocks whose outputs DeepStack merges and adds to
    the outputs of decoder layers 0, 1, ... (Qwen3-VL-8B: (8, 16, 24) of 27 blocks)."""
    deepstack_indexes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TextConfig:
    """What every decoder has (moondream's Phi blocks read no more)."""
    dim: int
    n_layers: int
    n_heads: int
    ff_dim: int
    vocab_size: int
    max_context: int
    partial_rotary_factor: float = 0.5  # Phi: rotary on the first half of each head
    rope_theta: float = 10000.0
    ln_eps: float = 1e-5
    # Grouped-query attention: key/value heads (0: n_heads), and a head width of its own (attn_head_dim, HF's
    # head_dim; Qwen3-VL-4B: 2560 / 32 heads = 80, but 128; 0: dim / n_heads)
    n_kv_heads: int = 0
    attn_head_dim: int = 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:  # e.g. 64 * 0.5 = 32 of each 64-wide head
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class LlamaText(TextConfig):
    """The LLaVA families' decoders (Llama / Qwen2 / Mistral): Qwen2's bias on q/k/v, input embedding and LM head
    sharing one matrix (TiedLayerSpec)."""
    qkv_bias: bool = False
    tie_embeddings: bool = False


@dataclass(frozen=True)
class MropeText(LlamaText):
    """The Qwen2-VL family's decoder: multimodal rotary, the head's rotary frequencies in 3 sections rotated by the
    temporal, height and width position (Qwen: (16, 24, 24), summing to head_dim / 2)."""
    mrope_section: tuple[int, ...] = ()


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts decoder's MLP (issue 43; mmpipe.model.moe, docs/moe.md): the model JSON's "text": {...,
    "moe": {...}}. Every decoder layer's MLP is `experts` SwiGLU experts of width ff_dim (transformers'
    moe_intermediate_size), each token sent to its top_k by a softmax router, their weights renormalised to sum 1
    (norm_topk; Qwen3-VL-MoE always does), with the load-balancing loss x aux_coef (router_aux_loss_coef; 0.001)
    added to the LM loss. shared_ff_dim > 0: a shared expert every token runs beside the routed ones, a SwiGLU of that
    width (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate x) (Qwen3.5-MoE; 0: none, as
    Qwen3-VL-MoE; written to model.json only when set). Qwen3-VL-30B-A3B: 128 experts, top 8, ff_dim 768;
    Qwen3.5-35B-A3B: 256 experts, top 8, ff_dim 512, shared_ff_dim 512."""
    experts: int
    top_k: int
    ff_dim: int
    aux_coef: float = 0.001
    norm_topk: bool = True
    shared_ff_dim: int = 0

    def checks(self, text: "Qwen3Text") -> list[tuple[bool, str, str]]:
        """The section's own ranges and the decoder it sits in (the qwen3_vl and qwen3_5 families' checks ask them)."""
        return [(not text.tie_embeddings, "text.moe",
                 "with tie_embeddings: an MoE model's head is untied here (as Qwen3-VL-MoE's releases are)"),
                (self.experts >= 1 and self.ff_dim >= 1, "text.moe.experts",
                 f"{self.experts} experts of ff_dim {self.ff_dim}: both must be >= 1"),
                (1 <= self.top_k <= self.experts, "text.moe.top_k",
                 f"{self.top_k} must be between 1 and the {self.experts} experts"),
                (self.aux_coef >= 0, "text.moe.aux_coef", f"{self.aux_coef} must be >= 0"),
                (self.shared_ff_dim >= 0, "text.moe.shared_ff_dim",
                 f"{self.shared_ff_dim} must be >= 0 (0: no shared expert)")]


@dataclass(frozen=True)
class Qwen3Text(MropeText):
    """The Qwen3-VL family's decoder: the sections interleaved over the frequencies (t h w t h w ..., transformers'
    mrope_interleaved) instead of in 3 blocks, and RMSNorms on each head's q and k."""
    mrope_interleaved: bool = False
    qk_norm: bool = False
    moe: MoeConfig | None = None  # a mixture-of-experts decoder (MoeConfig; None: dense)


@dataclass(frozen=True)
class HybridText(Qwen3Text):
    """The Qwen3.5 family's decoder (mmpipe.model.qwen3_5): the layers that are full attention, the others Gated
    DeltaNet (transformers' layer_types as indices; Qwen3.5: every 4th, 3, 7, 11, ...: a shrunk model keeps one of
    each kind, mmpipe.check.equivalence.shrunk), and the linear layers' geometry: key / value heads and their widths,
    the short convolution's kernel (Qwen3.5-9B: 16 / 32 heads of 128 / 128, kernel 4)."""
    full_attention_indexes: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0



@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str
    vision: VisionConfig
    text: TextConfig
    proj_inner_dim: int
    # How the image reaches the decoder. "prefix": the projected image tokens are spliced into the
    # sequence after BOS (moondream). "cross_attention": the sequence is text only and a gated
    # cross-attention layer before every `cross_attn_every`-th decoder block attends to the
    # projected image (Flamingo, Llama 3.2 Vision; mmpipe.model.cross_attention).
    fusion: str = "prefix"
    cross_attn_every: int = 1
    cross_attn_heads: int = 0  # 0: the decoder's n_heads
    # The gates are tanh(scale * a), a starting at 0: under Adam a scale s moves tanh's argument
    # about s times faster, like a gate learning rate x s (not exactly: the gates' gradients are
    # s times larger in the clipping norm). A model field, not a parameter group, because
    # DeepSpeed's WarmupLR / WarmupDecayLR set every group to one warmup_max_lr.
    cross_attn_gate_scale: float = 1.0
    # LLaVA family: the token id of <image>; the image features overwrite its positions.
    image_token_id: int = -1
    # Qwen2-VL family: <|vision_start|> and <|vision_end|>, around each image's image_token_id block
    vision_start_id: int = -1
    vision_end_id: int = -1

    @property
    def layout(self) -> ImageLayout | None:
        """Where this family puts the image (its registered entry's); None for an unknown family / fusion (validate
        refuses it)."""
        entry = lookup(self.family, self.fusion)
        return entry.layout if entry is not None else None

    @property
    def n_image_positions(self) -> int:
        """Decoder positions the image takes besides the text tokens: N_img when spliced, 0 when it sits
        on <image> placeholders inside the text or the decoder only attends to it (labels and logits
        then cover the text alone)."""
        return self.vision.n_tokens if self.layout is not None and self.layout.spliced else 0

    @property
    def cross_attn_layers(self) -> list[int]:
        """Decoder block indices a cross-attention layer precedes, e.g. 12 blocks every 4: [0, 4, 8]."""
        if self.layout is None or not self.layout.cross_attention:
            return []
        return list(range(0, self.text.n_layers, self.cross_attn_every))

    @property
    def prefix_len(self) -> int:
        """BOS + image tokens: the bidirectional prefix (moondream2: 1 + 729 = 730); BOS alone, so a
        plain causal mask, when the image is attended to instead of spliced in."""
        return 1 + self.n_image_positions

    def with_vocab(self, vocab_size: int) -> "ModelConfig":
        return dataclasses.replace(self, text=dataclasses.replace(self.text, vocab_size=vocab_size))

    def to_dict(self) -> dict:
        """The JSON shape load_preset reads back."""
        d = dataclasses.asdict(self)
        d.pop("name")
        if (d["text"].get("moe") or {}).get("shared_ff_dim") == 0:  # written only when set (MoeConfig)
            del d["text"]["moe"]["shared_ff_dim"]
        return d

    def validate(self) -> None:
        v, t = self.vision, self.text
        families, fusions = known_families()
        checks = [
            _known(self.family, families, "family"),
            _known(self.fusion, fusions, "fusion"),
            (self.cross_attn_every >= 1, "cross_attn_every", f"{self.cross_attn_every} must be >= 1"),
            (self.proj_inner_dim >= 1, "proj_inner_dim", f"{self.proj_inner_dim} must be >= 1"),
            (self.cross_attn_gate_scale > 0, "cross_attn_gate_scale", f"{self.cross_attn_gate_scale} must be > 0"),
            (self.cross_attn_heads >= 0 and (self.cross_attn_every < 1 or not self.cross_attn_layers  # range(.., 0)
                                             or t.dim % (self.cross_attn_heads or t.n_heads) == 0), "cross_attn_heads",
             f"{self.cross_attn_heads}: text.dim {t.dim} must be divisible by it"),
            # any-resolution towers may leave a remainder, as transformers' conv does (OneVision's SigLIP: 384 px
            # / 14 -> 27 x 27 patches)
            (v.image_size % v.patch_size == 0 or v.any_resolution, "vision.image_size",
             f"{v.image_size} is not a multiple of patch_size {v.patch_size}"),
            (v.dim % v.n_heads == 0, "vision.dim", f"{v.dim} is not divisible by n_heads {v.n_heads}"),
            # a head width of its own (attn_head_dim: Qwen3-VL, Qwen3.5) frees the width from the heads
            (bool(t.attn_head_dim) or t.dim % t.n_heads == 0, "text.dim",
             f"{t.dim} is not divisible by n_heads {t.n_heads} (or set text.attn_head_dim)"),
            (t.rotary_dim % 2 == 0 and t.rotary_dim > 0, "text.partial_rotary_factor",
             f"gives rotary dim {t.rotary_dim}; it must be even and > 0"),
            (self.prefix_len < t.max_context, "text.max_context",
             f"{t.max_context} leaves no room for text after the {self.prefix_len}-token image prefix"),
        ]
        entry = lookup(self.family, self.fusion)
        checks += entry.checks(self) if entry is not None else []
        for ok, field, msg in checks:
            if not ok:
                raise ConfigError(f"model config '{self.name}': {field}: {msg}")


def _known(value: str, valid: tuple[str, ...], field: str) -> tuple[bool, str, str]:
    return value in valid, field, f"'{value}' is not a known {field} (valid: {', '.join(valid)})"


def llava_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """The fields only the LLaVA family's layers read: its tower, grouped-query attention, <image>."""
    v, t = cfg.vision, cfg.text
    return [
        (v.kind in ("siglip", "clip"), "vision.kind", f"'{v.kind}' is not a known tower (valid: siglip, clip)"),
        (v.act in VISION_ACTS, "vision.act", f"'{v.act}' is not supported (valid: {', '.join(VISION_ACTS)})"),
        (v.feature_select in ("default", "full"), "vision.feature_select",
         f"'{v.feature_select}' (valid: default, full)"),
        (-v.n_layers - 1 <= v.feature_layer <= v.n_layers and v.n_blocks_used >= 1, "vision.feature_layer",
         f"{v.feature_layer} does not name a block's output of a {v.n_layers}-layer tower"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (0 <= cfg.image_token_id < t.vocab_size, "image_token_id",
         f"{cfg.image_token_id} is not a token id of the {t.vocab_size}-token vocabulary"),
        (cfg.layout is not None, "fusion", f"'{cfg.fusion}': the LLaVA family places the image on placeholders"),
    ]


def moondream_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Grouped-query attention in the Phi block (k/v heads shared by n_heads / kv_heads query heads each)
    and the projector's crop features (1, or moondream2's global + pooled local: 2)."""
    v, t = cfg.vision, cfg.text
    return [
        (t.n_kv_heads >= 0 and t.n_heads % t.kv_heads == 0, "text.n_kv_heads",
         f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (v.crop_features in (1, 2), "vision.crop_features",
         f"{v.crop_features} (valid: 1, or 2 for moondream2's global + local crop features)"),
        (v.max_crops >= 0 and (v.max_crops == 0 or v.crop_features == 2), "vision.max_crops",
         f"{v.max_crops}: multi-crop needs crop_features 2 (the projector reads global + local features)"),
        (v.max_crops == 0 or not (cfg.layout and cfg.layout.cross_attention), "vision.max_crops",
         f"{v.max_crops}: multi-crop is for the prefix decoder (cross-attention reads one crop)"),
        (v.max_crops == 0 or 0 <= 2 * v.overlap_margin < v.grid, "vision.overlap_margin",
         f"{v.overlap_margin} patches on each side leave no window in a {v.grid}-patch crop"),
    ]


def qwen2_vl_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """The Qwen2-VL family's tower (merge units, windows, norm, MLP), multimodal rotary and special ids."""
    v, t = cfg.vision, cfg.text
    unit = v.patch_size * v.merge_size  # px per merged token side
    ids = [(0 <= getattr(cfg, k) < t.vocab_size, k, f"{getattr(cfg, k)} is not a token id of the "
            f"{t.vocab_size}-token vocabulary") for k in ("image_token_id", "vision_start_id", "vision_end_id")]
    return ids + [
        (v.merge_size >= 1 and v.temporal_patch_size >= 1, "vision.merge_size",
         f"{v.merge_size} / temporal_patch_size {v.temporal_patch_size} must be >= 1"),
        (v.norm in ("layernorm", "rmsnorm"), "vision.norm", f"'{v.norm}' (valid: layernorm, rmsnorm)"),
        (v.mlp in ("gelu", "swiglu"), "vision.mlp", f"'{v.mlp}' (valid: gelu, swiglu)"),
        (v.act == "silu" if v.mlp == "swiglu" else v.act in VISION_ACTS, "vision.act",
         f"'{v.act}' with mlp '{v.mlp}' (valid: silu with swiglu; {', '.join(VISION_ACTS)} with gelu)"),
        ((v.dim // v.n_heads) % 4 == 0, "vision.dim", f"{v.dim} / {v.n_heads} heads: the 2D rotary needs a head "
         f"width divisible by 4"),
        (v.window_size >= 0 and v.window_size % unit == 0, "vision.window_size",
         f"{v.window_size} must be a multiple of patch_size x merge_size = {unit} (0: no windows)"),
        (all(0 <= i < v.n_layers for i in v.fullatt_blocks), "vision.fullatt_blocks",
         f"{list(v.fullatt_blocks)}: block indices of a {v.n_layers}-block tower"),
        (v.image_size % unit == 0, "vision.image_size", f"{v.image_size} is not a multiple of {unit}"),
        (0 <= v.min_pixels and (not v.max_pixels or v.min_pixels <= v.max_pixels), "vision.min_pixels",
         f"{v.min_pixels} must be between 0 and max_pixels {v.max_pixels}"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (t.rotary_dim == t.head_dim, "text.partial_rotary_factor",
         f"{t.partial_rotary_factor}: multimodal rotary turns the whole head (valid: 1.0)"),
        (len(t.mrope_section) == 3 and sum(t.mrope_section) == t.head_dim // 2, "text.mrope_section",
         f"{list(t.mrope_section)}: 3 sections summing to head_dim / 2 = {t.head_dim // 2}"),
    ]


def llava_next_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """LLaVA's checks (tower, decoder, <image>) plus the pinpoints: [h, w] pairs, multiples of the crop."""
    v, S = cfg.vision, cfg.vision.image_size
    ok = bool(v.grid_pinpoints) and all(len(p) == 2 and all(isinstance(x, int) and x > 0 and x % S == 0 for x in p)
                                        for p in v.grid_pinpoints)
    return llava_checks(cfg) + [
        (ok, "vision.grid_pinpoints", f"{[list(p) for p in v.grid_pinpoints]}: one or more [h, w] pairs in "
         f"pixels, each a positive multiple of image_size {S}"),
        (v.anyres_max >= 0, "vision.anyres_max", f"{v.anyres_max} must be >= 0 (0: LLaVA-NeXT, no pooling)"),
        (v.n_features == v.n_tokens, "vision.feature_select", f"'{v.feature_select}' with a {v.kind} tower: tiles "
         f"need one feature per patch (valid: default for clip, full for siglip)"),
    ]


def _qwen3_tower_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Qwen2-VL's checks (no windows in Qwen3-VL's tower) plus the square position table."""
    v = cfg.vision
    side = math.isqrt(v.num_position_embeddings)
    return qwen2_vl_checks(cfg) + [
        (side >= 2 and side * side == v.num_position_embeddings, "vision.num_position_embeddings",
         f"{v.num_position_embeddings} is not a square table of side >= 2 (Qwen3-VL: 2304 = 48^2)"),
        (v.window_size == 0, "vision.window_size", f"{v.window_size}: Qwen3-VL's tower has no windows (valid: 0)"),
        (v.norm == "layernorm" and v.mlp == "gelu", "vision.mlp",
         f"'{v.mlp}' / norm '{v.norm}': Qwen3-VL's tower is LayerNorm + fc1 / fc2 (valid: gelu / layernorm)"),
    ]


def qwen3_vl_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Qwen3's tower checks, DeepStack's indexes (one per decoder layer it adds to), and an MoE decoder's section."""
    v, t = cfg.vision, cfg.text
    return _qwen3_tower_checks(cfg) + (t.moe.checks(t) if t.moe else []) + [
        (all(0 <= i < v.n_layers for i in v.deepstack_indexes) and list(v.deepstack_indexes)
         == sorted(set(v.deepstack_indexes)), "vision.deepstack_indexes",
         f"{list(v.deepstack_indexes)}: increasing block indices of a {v.n_layers}-block tower"),
        (len(v.deepstack_indexes) <= min(t.n_layers, MAX_DEEPSTACK), "vision.deepstack_indexes",
         f"{len(v.deepstack_indexes)} sets for decoder layers 0..{len(v.deepstack_indexes) - 1}: at most "
         f"{min(t.n_layers, MAX_DEEPSTACK)} (the decoder's {t.n_layers} layers, mmpipe's {MAX_DEEPSTACK})"),
    ]


def qwen3_5_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Qwen3's tower checks, the partial interleaved rotary (sections summing to rotary_dim / 2,
    Qwen3.5: 256 x 0.25 = 64 -> 11 + 11 + 10 = 32), the layer pattern with the linear layers' geometry, and a
    Qwen3.5-MoE decoder's section (every layer of either kind sparse: mmpipe.model.qwen3_5)."""
    t = cfg.text
    full = list(t.full_attention_indexes)
    checks = [c for c in _qwen3_tower_checks(cfg) if c[1] not in ("text.partial_rotary_factor", "text.mrope_section")]
    linear = len(full) < t.n_layers
    return checks + (t.moe.checks(t) if t.moe else []) + [
        (len(t.mrope_section) == 3 and sum(t.mrope_section) == t.rotary_dim // 2, "text.mrope_section",
         f"{list(t.mrope_section)}: 3 sections summing to rotary_dim / 2 = {t.rotary_dim // 2}"),
        (all(0 <= i < t.n_layers for i in full) and full == sorted(set(full)), "text.full_attention_indexes",
         f"{full}: increasing layer indices of a {t.n_layers}-layer decoder"),
    ] + [(not linear or n > 0, f"text.{k}", f"{n}: the linear layers' geometry (heads, widths, kernel) must be > 0")
         for k, n in (("linear_key_heads", t.linear_key_heads), ("linear_value_heads", t.linear_value_heads),
                      ("linear_key_dim", t.linear_key_dim), ("linear_value_dim", t.linear_value_dim),
                      ("linear_conv_kernel", t.linear_conv_kernel))] + [
        (not linear or t.linear_value_heads % max(t.linear_key_heads, 1) == 0, "text.linear_value_heads",
         f"{t.linear_value_heads} value heads: a multiple of the {t.linear_key_heads} key heads")]


MAX_DEEPSTACK = 8  # DeepStack sets a model may carry (mmpipe.model.qwen3_vl makes a layer class per set)

def crop_budget(model: ModelConfig, max_crops: int) -> ModelConfig:
    """--max-crops N: the model with at most N local crops per image (a smaller budget, same weights)."""
    if not model.vision.multi_crop:
        raise ConfigError(f"--max-crops: the {model.family} family has no crops to limit (moondream's multi-crop)")
    if not 0 <= max_crops <= model.vision.max_crops:
        raise ConfigError(f"--max-crops: {max_crops} must be between 0 and the model's vision.max_crops "
                          f"{model.vision.max_crops}" + ("" if model.vision.max_crops else " (one crop per image)"))
    return dataclasses.replace(model, vision=dataclasses.replace(model.vision, max_crops=max_crops))


def widen(cls: type, section, **extra):
    """`section` (a VisionConfig / TextConfig) as the subclass `cls`, its fields kept and cls's own set from extra
    (LLaVA's tower read by the LLaVA-NeXT importer, then its pinpoints)."""
    return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(section)}, **extra)


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _declared(base: type) -> dict[str, object]:
    """Every field the sections derived from `base` declare (plugins' included), with its default: what a model.json
    written before the per-family sections holds for the fields of other families (it was one class of all of them)."""
    out, todo = {}, [base]
    while todo:
        cls = todo.pop()
        out.update({f.name: f.default for f in dataclasses.fields(cls)})
        todo += cls.__subclasses__()
    return out


# _build's check of every number a section holds, before any family's checks compute with it: its type (an integer
# is not a float, a string or true / false) and its lower bound. An int counts something (>= 1) unless its default
# is 0, then its documented "none" (n_kv_heads 0: n_heads; window_size 0: no windows; max_crops 0: one crop), or
# below 0, then an index from the end (feature_layer -2; its family checks it); FLOORS names the exceptions. A float
# is a finite number, > 0 where POSITIVE names it (an eps, a rotary base or share, a rate, a std; a gate or a
# coefficient may be 0, a shift below 0). A list's integers are indices or rotary sections, checked by their family.
FLOORS = {"overlap_margin": 0}  # crops that share no patch (the moondream check's 0 <= 2 x margin < grid)
POSITIVE = {"ln_eps", "rope_theta", "partial_rotary_factor", "video_fps", "std"}
_NUMBER = {int: "an integer", float: "a number"}


def _is_number(value, kind: type) -> bool:
    return (isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
            and (isinstance(value, int) or math.isfinite(value)))  # JSON's NaN / Infinity are floats


def _below(name: str, kind: type, default, value) -> str | None:
    """'must be >= 1' / '> 0' when `value` (a number of field `name`) is under its bound, else None."""
    if kind is float:
        floor, strict = (0, True) if name in POSITIVE else (None, False)
    elif name in FLOORS:
        floor, strict = FLOORS[name], False
    elif default is dataclasses.MISSING or default >= 1:
        floor, strict = 1, False
    else:
        floor, strict = (0 if default == 0 else None), False
    if floor is None or (value > floor if strict else value >= floor):
        return None
    return f"must be {'>' if strict else '>='} {floor}"


def _list_words(args: tuple) -> str:
    """'a list of integers', 'a list of 3 numbers', 'a list of lists of 2 integers'."""
    count = "" if args[-1] is Ellipsis else f"{len(args)} "
    inner = args[0]
    each = (_list_words(typing.get_args(inner))[2:].replace("list", "lists", 1) if typing.get_origin(inner) is tuple
            else {int: "integers", float: "numbers"}[inner])
    return f"a list of {count}{each}"


def _list_problem(name: str, args: tuple, value) -> str | None:
    """What is wrong with `value` for a tuple field of element types `args` (tuple's), or None."""
    listed = isinstance(value, (list, tuple))  # a JSON list, or a tuple of to_dict's (config_from_dict(cfg.to_dict()))
    kinds = args[:1] * len(value) if args[-1] is Ellipsis and listed else args
    if not listed or len(value) != len(kinds):
        return f"{value!r} is not {_list_words(args)}"
    for x, kind in zip(value, kinds):
        nested = typing.get_origin(kind) is tuple
        if nested and _list_problem(name, typing.get_args(kind), x) or not nested and not _is_number(x, kind):
            return f"{value!r} is not {_list_words(args)}"
        bound = _below(name, kind, None, x) if kind is float else None
        if bound:
            return f"{value!r}: each {bound}"
    return None


def _numbers(args: tuple) -> bool:
    """Whether a tuple field's element types (tuple's args) are numbers or tuples of them: what _list_problem reads."""
    return all(a in _NUMBER or a is Ellipsis or typing.get_origin(a) is tuple and _numbers(typing.get_args(a))
               for a in args)


def _field_problem(f: dataclasses.Field, hint, value) -> str | None:
    """What is wrong with `value` for the section field f (declared `hint`), or None. Other types than numbers,
    flags, strings and lists of numbers (a plugin's own) are its family's to check."""
    if hint in _NUMBER:
        if not _is_number(value, hint):
            return f"{value!r} is not {_NUMBER[hint]}"
        bound = _below(f.name, hint, f.default, value)
        return f"{value} {bound}" if bound else None
    if hint in (bool, str):
        return None if isinstance(value, hint) else f"{value!r} is not {'true or false' if hint is bool else 'text'}"
    args = typing.get_args(hint)
    return _list_problem(f.name, args, value) if typing.get_origin(hint) is tuple and _numbers(args) else None


def _build(cls, data: dict, where: str, family: str = ""):
    """A section from its JSON dict: lists become tuples, a dict for a dataclass field becomes that dataclass. A field
    another family's section declares is dropped when it holds that field's default (an older model.json wrote every
    family's fields), refused when it does not: the family's layers would not read it."""
    names = {f.name for f in dataclasses.fields(cls)}
    base = next(c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c))
    declared = _declared(base)
    foreign = sorted(k for k in set(data) - names if k in declared)
    set_foreign = [k for k in foreign if _tuples(data[k]) != declared[k]]
    if set_foreign:
        raise ConfigError(f"{where}: {set_foreign}: not a field of the {family} family's section, whose layers would "
                          f"not read it (valid: {sorted(names)})")
    unknown = sorted(set(data) - names - set(foreign))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown} (valid: {sorted(names)})")
    hints = typing.get_type_hints(cls)
    values, fields = {}, {f.name: f for f in dataclasses.fields(cls)}
    for k in sorted(names & set(data)):
        sub = [t for t in (hints[k], *typing.get_args(hints[k])) if dataclasses.is_dataclass(t)]
        problem = None if sub else _field_problem(fields[k], hints[k], data[k])
        if sub and not (isinstance(data[k], dict) or data[k] is None and fields[k].default is None):
            problem = f"{data[k]!r} is not a section {{...}}"
        if problem:
            raise ConfigError(f"{where}.{k}: {problem}")
        values[k] = (_build(sub[0], data[k], f"{where}.{k}", family) if sub and isinstance(data[k], dict)
                     else _tuples(data[k]))  # JSON lists -> tuples, nested too: the configs are frozen and hashable
    try:
        return cls(**values)
    except TypeError as e:  # a missing required field
        raise ConfigError(f"{where}: {e}") from None


def _layout(family: str, fusion: str, where: str) -> ImageLayout:
    """The (family, fusion)'s layout, or the line naming which of the two is not known."""
    families, fusions = known_families()
    for ok, field, msg in (_known(family, families, "family"), _known(fusion, fusions, "fusion")):
        if not ok:
            raise ConfigError(f"{where}: {field}: {msg}")
    entry = lookup(family, fusion)
    if entry is None:
        valid = ", ".join(f"{f}/{u}" for f, u in known_pairs())
        raise ConfigError(f"{where}: fusion: '{fusion}' is not a fusion of the {family} family (valid family/fusion: "
                          f"{valid})")
    return entry.layout


def config_from_dict(data: dict, name: str) -> ModelConfig:
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    for key in ("vision", "text"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"model config '{name}': '{key}' section missing")
    top = {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    unknown = sorted(set(data) - top)
    if unknown:
        raise ConfigError(f"model config '{name}': unknown field(s) {unknown} (valid: {sorted(top)})")
    for key in ("cross_attn_every", "cross_attn_heads", "proj_inner_dim", "image_token_id", "vision_start_id",
                "vision_end_id"):
        if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool)):
            raise ConfigError(f"model config '{name}': {key}: {data[key]!r} is not an integer")
    g = data.get("cross_attn_gate_scale", 1.0)
    if not isinstance(g, (int, float)) or isinstance(g, bool):
        raise ConfigError(f"model config '{name}': cross_attn_gate_scale: {g!r} is not a number")
    family, fusion = data.get("family", "moondream"), data.get("fusion", "prefix")
    layout = _layout(family, fusion, f"model config '{name}'")
    cfg = ModelConfig(
        name=name,
        family=family,
        vision=_build(layout.vision or VisionConfig, data["vision"], f"model config '{name}': vision", family),
        text=_build(layout.text or TextConfig, data["text"], f"model config '{name}': text", family),
        proj_inner_dim=int(data.get("proj_inner_dim", 4 * data["text"].get("dim", 0))),
        **{k: data[k] for k in ("fusion", "cross_attn_every", "cross_attn_heads", "cross_attn_gate_scale",
                                "image_token_id", "vision_start_id", "vision_end_id") if k in data},
    )
    cfg.validate()
    return cfg


def load_preset(name_or_path: str) -> ModelConfig:
    """A preset name (tiny, small, moondream-0.5b, moondream-2b) or a path to a JSON file of the same shape."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        name = path.stem
    else:
        path = PRESET_DIR / f"{name_or_path}.json"
        name = name_or_path
        if not path.exists():
            raise ConfigError(f"--preset: unknown preset '{name_or_path}' (valid: {', '.join(list_presets())}, "
                              f"or a path to a .json model config)")
    return config_from_dict(read_json(path, f"--preset: {path}", "not found"), name)
