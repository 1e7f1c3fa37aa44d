"""Model configs: `ModelConfig`, the base classes of its sections (VisionConfig, TextConfig: what every tower and
decoder has), JSON input and output with the generic checks of every field (types, bounds: one line, exit 2), and the
named presets (mmpipe/presets/*.json). A family's own sections (the fields only its layers read) and their checks live
in its module beside its layers (e.g. mmpipe.model.qwen2_vl.PatchVision, qwen2_vl_checks), named by its registry
entry's layout and checks (mmpipe.registry): the config asks the entry which section classes a model JSON has."""
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
