"""The model families: one registered `Family` entry each, under one key (the model JSON's family, fusion), holding
everything the project asks of a family. Every other module asks the entry (`family_of(cfg)`), never compares a
family's name, probes its config sections or tests its classes.

The registry sits at the bottom (the config layer) because the config itself asks it which sections a model JSON
has; it knows no family. Every family arrives the same way, by a module that builds its entry and calls `register`:
the built-in ones in mmpipe.families (imported on the first question, as a plugin is), then the modules named in
MMPIPE_FAMILIES and the "mmpipe.families" entry points of installed packages. A module that registers is the whole
family (docs/architecture.md, "Adding a family").

Parts of an entry that live above this layer (the layers, the image kind, the HF reader) are held as objects by
the module that registers it; the HF side's functions may also be "module:attribute" strings, resolved on first use,
because mmpipe.hf sits above every layer that builds or trains the model.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

PLUGINS_ENV = "MMPIPE_FAMILIES"  # comma-separated family modules, importable on every rank (the launcher passes env)
BUILTIN = "mmpipe.families"  # the built-in families' module


@dataclass(frozen=True)
class ImageLayout:
    """Where a family's decoder finds the image, and the classes of its model JSON's "vision" and "text" sections
    (the fields its layers read)."""
    spliced: bool = False          # its N_img tokens are decoder positions right after BOS (moondream)
    placeholders: bool = False     # it overwrites <image> placeholder ids inside input_ids (LLaVA)
    cross_attention: bool = False  # the sequence is text only; cross-attention layers read it beside
    vision: type | None = None     # its "vision" section's class (VisionConfig or a subclass; None: VisionConfig)
    text: type | None = None       # its "text" section's class (TextConfig or a subclass)


@dataclass(frozen=True)
class HfSide:
    """A family's weights outside mmpipe. `names` says whose names they take: "hf" (an HF directory in hf_class's
    names, read by the model_types listed) or "moondream" (moondream's one safetensors file, its region head beside
    the weights). Each function is a callable or a "module:attribute" string:
        importer(path) -> (model, report)   config(path) -> (its HF config, ModelConfig)   reader(path) -> Imported
        key_map(cfg) -> {mmpipe name: its name}   export(layers, out, tokenizer, shard_size=...)"""
    names: str
    hf_class: str | None = None  # the transformers class its weights load into unchanged (by config: the export's)
    model_types: tuple[str, ...] = ()  # config.json model_types its reader takes
    label: str = ""
    importer: Any = None
    config: Any = None
    reader: Any = None
    key_map: Any = None
    export: Any = None

    def fn(self, role: str) -> Callable:
        """The function of `role` (a field above), resolved from its "module:attribute" the first time."""
        f = getattr(self, role)
        if isinstance(f, str):
            module, _, attr = f.partition(":")
            f = getattr(importlib.import_module(module), attr)
        return f


def _none(cfg) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """One model family: its layer list and what the config, the data side, the pipeline, the planner and the HF
    side ask of it."""
    family: str  # the model JSON's `family` and `fusion` that select it
    fusion: str
    layers: Callable[[Any], list]  # ModelConfig -> the pipeline's LayerSpecs (mmpipe.model.builder.layer_specs)
    # blocks that activation checkpointing may recompute (DeepSpeed's checkpointable_layers, the cost model)
    checkpointable: tuple[type, ...]
    # the cost rule of each layer class; a tied layer's later use (TiedLayerSpec) by its forward_fn
    cost_rules: dict = field(repr=False, compare=False)
    layout: ImageLayout  # where the image enters the decoder, its config sections
    # the image kind: the data side's rule for its images (an object of mmpipe.data.image_kinds' protocol)
    kind: Any = field(repr=False, compare=False)
    # its sections' checks: ModelConfig -> [(ok, field, message)], one line each when not ok (exit 2)
    checks: Callable[[Any], list] = field(default=lambda cfg: [], repr=False, compare=False)
    # what its records may carry besides text (mmpipe.data.records.MEDIA_FIELDS' kinds); a record with anything
    # else is a bad record, unsupported_media, counted with its reason, never trained as the text around it
    media: tuple[str, ...] = ("image",)
    hf: HfSide | None = None  # None: no model outside mmpipe has its layers (cross-attention fusion): no import/export
    tower_tokens: Callable[[Any], int] = field(default=lambda cfg: cfg.vision.n_tokens, repr=False, compare=False)
    # the stage tuple's fields (mmpipe.model.stage.StageField): the row's four, then what the family carries
    fields: Callable[[Any], tuple] = field(default=lambda cfg: (), repr=False, compare=False)
    # where other trainers must cut: the layers they keep on stage 0 (a layer list -> how many), which `mmpipe plan`
    # costs beside its own split (None: no such rule)
    fixed_first_stage: Callable[[list], int] | None = field(default=None, repr=False, compare=False)
    # its mixture-of-experts section for a config (None: a dense decoder): the one answer the runtime, the planner
    # and the HF side read for the auxiliary loss, the expert groups and the expert path
    experts: Callable[[Any], Any] = field(default=_none, repr=False, compare=False)
    # how its layers split across tensor-parallel ranks: layer class -> its plan (filled by the tensor-parallel
    # work; empty: the family runs at --tp 1 only)
    tp_plan: dict = field(default_factory=dict, repr=False, compare=False)
    # how its layers take a row's positions split across sequence-parallel ranks (`--sp`, Ulysses): layer class -> the
    # function that makes one so (mmpipe.model.sequence_parallel); empty: --sp refused, with sp_why_not as its reason
    sp_plan: dict = field(default_factory=dict, repr=False, compare=False)
    sp_why_not: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.family, self.fusion

    @property
    def label(self) -> str:
        """The family as a user names it: its `family`, with the fusion where it is not the prefix one (tiny-xattn's
        "llava cross_attention")."""
        return self.family if self.fusion == "prefix" else f"{self.family} {self.fusion}"

    def cost_rule(self, spec):
        """The cost rule of a LayerSpec: a tied layer's later use by its forward_fn (a function, or a callable
        object's class: moe.TiedMoeHead), else (its first use too) its class."""
        fn = spec.forward_fn if isinstance(spec, _tied_spec()) else None
        if fn is not None and fn not in self.cost_rules:
            fn = type(fn)
        return self.cost_rules[fn or spec.typename]


def _tied_spec() -> type:
    from deepspeed.pipe import TiedLayerSpec
    return TiedLayerSpec


_FAMILIES: dict[tuple[str, str], Family] = {}
_loaded = False
_builtin: set[tuple[str, str]] = set()
_plugin_error: ConfigError | None = None  # a family module that did not import (load)


def register(entry: Family) -> Family:
    """Add a family. Registering a (family, fusion) that exists is an error: a plugin cannot replace a family."""
    if entry.key in _FAMILIES:
        raise ValueError(f"model family {entry.family}/{entry.fusion} is registered already")
    _FAMILIES[entry.key] = entry
    return entry


def unregister(entry: Family) -> None:
    """Forget a family registered from outside (a test's, when the families that follow in the same process must
    not see it); a built-in one stays."""
    if _FAMILIES.get(entry.key) is entry and entry.key not in _builtin:
        del _FAMILIES[entry.key]


def load() -> None:
    """Import the built-in families and every family module from outside the package, once; each registers itself
    on import. A module named in MMPIPE_FAMILIES that does not import is kept as a ConfigError naming it, raised where
    a model config asks which families exist (`known_families`, `family_of`): one line there, not a traceback from
    whatever first asked (a command's help text lists families too)."""
    global _loaded, _plugin_error
    if _loaded:
        return
    _loaded = True  # before importing: a family module's own questions must not recurse here
    from importlib.metadata import entry_points
    importlib.import_module(BUILTIN)
    _builtin.update(_FAMILIES)  # the keys the built-in module registered: never unregistered
    for name in [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]:
        try:
            importlib.import_module(name)
        except ImportError as e:
            _plugin_error = ConfigError(f"{PLUGINS_ENV}: family module '{name}' does not import ({e})")
    for ep in entry_points(group="mmpipe.families"):
        ep.load()


def _checked() -> None:
    load()
    if _plugin_error is not None:
        raise _plugin_error


def families() -> tuple[Family, ...]:
    """Every registered family, the built-in ones first."""
    load()
    return tuple(_FAMILIES.values())


def lookup(family: str, fusion: str) -> Family | None:
    """The entry of a (family, fusion), None where none is registered."""
    load()
    return _FAMILIES.get((family, fusion))


def family_of(cfg) -> Family:
    """The entry of a model config; an unknown (family, fusion) is one line naming the registered ones."""
    f = lookup(cfg.family, cfg.fusion)
    if f is None:
        _checked()
        raise ConfigError(f"model config '{cfg.name}': no model family '{cfg.family}' with fusion '{cfg.fusion}' "
                          f"(valid: {', '.join(f'{f.family}/{f.fusion}' for f in families())})")
    return f


def known_families() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(families, fusions) a model JSON may name: the built-in ones and those registered from outside."""
    _checked()
    keys = [f.key for f in families()]
    return tuple(dict.fromkeys(f for f, _ in keys)), tuple(dict.fromkeys(u for _, u in keys))


def hf_families() -> dict[str, Family]:
    """The families whose HF reader takes a config.json model_type, by that model_type."""
    return {mt: f for f in families() if f.hf is not None for mt in f.hf.model_types}


def known_pairs() -> tuple[tuple[str, str], ...]:
    """Every registered (family, fusion)."""
    return tuple(f.key for f in families())
