"""Model configs: frozen dataclasses, named presets loaded from JSON (mmpipe/presets/*.json)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A user-facing configuration problem: one line naming the field and what would be valid."""


@dataclass(frozen=True)
class VisionConfig:
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
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_tokens(self) -> int:  # e.g. (378 / 14)^2 = 27^2 = 729
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:  # e.g. 14 * 14 * 3 = 588
        return self.patch_size * self.patch_size * self.channels


@dataclass(frozen=True)
class TextConfig:
    dim: int
    n_layers: int
    n_heads: int
    ff_dim: int
    vocab_size: int
    max_context: int
    partial_rotary_factor: float = 0.5  # Phi: rotary on the first half of each head
    rope_theta: float = 10000.0
    ln_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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

    @property
    def prefix_len(self) -> int:
        """BOS + image tokens: the bidirectional prefix (moondream2: 1 + 729 = 730)."""
        return 1 + self.vision.n_tokens

    def with_vocab(self, vocab_size: int) -> "ModelConfig":
        return dataclasses.replace(self, text=dataclasses.replace(self.text, vocab_size=vocab_size))

    def to_dict(self) -> dict:
        """The JSON shape load_preset reads back."""
        d = dataclasses.asdict(self)
        d.pop("name")
        return d

    def validate(self) -> None:
        v, t = self.vision, self.text
        checks = [
            (self.family == "moondream", "family", f"'{self.family}' is not a known family (valid: moondream)"),
            (v.image_size % v.patch_size == 0, "vision.image_size",
             f"{v.image_size} is not a multiple of patch_size {v.patch_size}"),
            (v.dim % v.n_heads == 0, "vision.dim", f"{v.dim} is not divisible by n_heads {v.n_heads}"),
            (t.dim % t.n_heads == 0, "text.dim", f"{t.dim} is not divisible by n_heads {t.n_heads}"),
            (t.rotary_dim % 2 == 0 and t.rotary_dim > 0, "text.partial_rotary_factor",
             f"gives rotary dim {t.rotary_dim}; it must be even and > 0"),
            (self.prefix_len < t.max_context, "text.max_context",
             f"{t.max_context} leaves no room for text after the {self.prefix_len}-token image prefix"),
        ]
        for ok, field, msg in checks:
            if not ok:
                raise ConfigError(f"model config '{self.name}': {field}: {msg}")


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _build(cls, data: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown} (valid: {sorted(names)})")
    try:
        obj = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except TypeError as e:  # a missing required field
        raise ConfigError(f"{where}: {e}") from None
    return obj


def config_from_dict(data: dict, name: str) -> ModelConfig:
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    for key in ("vision", "text"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"model config '{name}': '{key}' section missing")
    cfg = ModelConfig(
        name=name,
        family=data.get("family", "moondream"),
        vision=_build(VisionConfig, data["vision"], f"model config '{name}': vision"),
        text=_build(TextConfig, data["text"], f"model config '{name}': text"),
        proj_inner_dim=int(data.get("proj_inner_dim", 4 * data["text"].get("dim", 0))),
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
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--preset: {path} is not valid JSON ({e})") from None
    return config_from_dict(data, name)
