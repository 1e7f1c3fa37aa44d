"""A model family with an HF reader, defined outside the package in this one module: ViP-LLaVA (transformers'
VipLlavaForConditionalGeneration, config.json model_type "vipllava"), which mmpipe itself does not read.

ViP-LLaVA is LLaVA-1.5 with one change of architecture: its projector reads the CLIP tower's hidden states of
several layers (HF's vision_feature_layer, a list: (-2, -5, -8, -11, 6) of CLIP-L's 24 + 1 states), each without
its class token, concatenated on the channels in the list's order, through LayerNorm -> Linear -> GELU -> Linear
(VipLlavaMultiModalProjector). The layer list, with a 4-layer tower read at (-2, 1, -3), i.e. states (3, 1, 2):

    VisionEmbed, TowerBlock, FeatureTap, TowerBlock, FeatureTap, TowerBlock, FeatureTap, VipProjector,
    LlavaEmbed, LlamaBlock x n, FinalNorm, head                                    (LLaVA's layers but two)

A FeatureTap after each read state appends its patches to the carried float field `taps` [B x M, N, k x D]
(block order); VipProjector, its last reader, puts them in the config's order, projects them and drops the
field. So a pipeline cut inside the tower sends `taps` beside `hidden`, as the toy family's `summary` goes.

Its model JSON's "vision" section is its own (VipVision: the list of states, the projector's LayerNorm epsilon;
CLIP's class token always, so no `kind`), its images are LLaVA's placeholders with one rule of its own
(VisualPrompts), and its HF side reads and writes a VipLlava directory with mmpipe.hf.llava's machinery: LLaVA's
weight names (mmpipe.hf.llava.key_map, its projector's LayerNorm under the projector's prefix). Imported by name
(MMPIPE_FAMILIES=vipllava_family, this folder on PYTHONPATH), it registers itself: mmpipe's own code names no part
of it.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from mmpipe.config import VISION_ACTS, ConfigError, ModelConfig, VisionConfig
from mmpipe.data.image_kinds import Placeholders
from mmpipe.families import LLAVA
from mmpipe.model import costs
from mmpipe.model.llava import LlamaBlock, LlavaProjector, TowerBlock, VisionEmbed, decoder_specs
from mmpipe.model.stage import ROW, StageField, unpack_in
from mmpipe.registry import Family, HfSide, register

MODEL_TYPE = "vipllava"


@dataclass(frozen=True)
class VipVision(VisionConfig):
    """Its tower section: CLIP (class token, pre-LayerNorm), the hidden states its projector reads (HF's
    vision_feature_layer: -1 the last block's output, 0 the embeddings'), its projector's LayerNorm epsilon."""
    kind: typing.ClassVar[str] = "clip"  # VipLlavaModel drops every read state's first token: CLIP's class token
    # so its <image> placeholders are the patches alone, as LLaVA's "default" (transformers' LlavaProcessor, which
    # VipLlava's processor is, counts them so: 577 - 1 = 576; mmpipe.hf.bundle writes it)
    feature_select: typing.ClassVar[str] = "default"
    act: str = "quick_gelu"
    feature_layers: tuple[int, ...] = (-2, -5, -8, -11, 6)
    projector_ln_eps: float = 1e-5

    @property
    def n_positions(self) -> int:  # the class token and the patches, e.g. 24^2 + 1 = 577
        return self.n_tokens + 1

    @property
    def n_features(self) -> int:  # <image> placeholders: the patches, e.g. 576
        return self.n_tokens

    @property
    def states(self) -> tuple[int, ...]:
        """The read hidden states by index 0..n_layers, in the config's order: 24 layers, -2 -> 23, 6 -> 6."""
        return tuple(i % (self.n_layers + 1) for i in self.feature_layers)

    @property
    def n_blocks_used(self) -> int:  # blocks up to the last read state, e.g. 23 of CLIP-L's 24
        return max(self.states)

    @property
    def proj_in_dim(self) -> int:  # the projector's input: k states side by side, e.g. 5 x 1024 = 5120
        return len(self.feature_layers) * self.dim


def _states_ok(v: VipVision) -> bool:
    layers = v.feature_layers
    return (isinstance(layers, tuple) and len(layers) >= 1 and isinstance(v.n_layers, int)
            and all(isinstance(i, int) and not isinstance(i, bool) and -v.n_layers - 1 <= i <= v.n_layers
                    for i in layers))


def vip_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Its sections' fields: the states name the tower's (one line each, exit 2, as every family's)."""
    v, t = cfg.vision, cfg.text
    return [
        (v.act in VISION_ACTS, "vision.act", f"'{v.act}' is not supported (valid: {', '.join(VISION_ACTS)})"),
        (_states_ok(v), "vision.feature_layers",
         f"{v.feature_layers!r}: a list of the tower's hidden states, each in -{v.n_layers + 1} .. {v.n_layers}"),
        (isinstance(v.projector_ln_eps, float) and v.projector_ln_eps > 0, "vision.projector_ln_eps",
         f"{v.projector_ln_eps!r} must be a number > 0"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (0 <= cfg.image_token_id < t.vocab_size, "image_token_id",
         f"{cfg.image_token_id} is not a token id of the {t.vocab_size}-token vocabulary"),
    ]


class FeatureTap(nn.Module):
    """Keeps the tower's state here for the projector: `taps` gains its patches [B x M, N, D] (the class token
    dropped, as VipLlavaModel.get_image_features does) on the channels; the first tap makes the field."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def forward(self, args):
        t = unpack_in(self, args)
        patches = t.hidden[:, 1:]
        return t._replace(taps=patches if t.taps is None else torch.cat([t.taps, patches], -1)).pack()


class VipProjector(LlavaProjector):
    """The read states in the config's order, then LayerNorm, linear_1, GELU, linear_2: [B x M, N, k x D_vision]
    -> [B x M, N, D_text]; the last reader of `taps`. A LlavaProjector to mmpipe.hf.llava.key_map, which names its
    weights model.multi_modal_projector.<name>, as VipLlava's are."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        v = cfg.vision
        block_order = sorted(set(v.states))  # the taps' order: each state once, as the tower reaches it
        self.order, self.dim = [block_order.index(s) for s in v.states], v.dim
        self.projector_layernorm = nn.LayerNorm(v.proj_in_dim, eps=v.projector_ln_eps)
        self.linear_1 = nn.Linear(v.proj_in_dim, cfg.proj_inner_dim)
        self.linear_2 = nn.Linear(cfg.proj_inner_dim, cfg.text.dim)

    def forward(self, args):
        t = unpack_in(self, args)
        kept = t.taps.split(self.dim, -1)
        x = self.projector_layernorm(torch.cat([kept[k] for k in self.order], -1))
        return t._replace(hidden=self.linear_2(F.gelu(self.linear_1(x))), taps=None).pack()


def vip_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """VisionEmbed (state 0), a TowerBlock per state up to the last read one, a FeatureTap after each read state,
    VipProjector, LLaVA's decoder."""
    read = set(cfg.vision.states)
    specs = [LayerSpec(VisionEmbed, cfg)] + ([LayerSpec(FeatureTap, cfg)] if 0 in read else [])
    for state in range(1, cfg.vision.n_blocks_used + 1):
        specs += [LayerSpec(TowerBlock, cfg)] + ([LayerSpec(FeatureTap, cfg)] if state in read else [])
    return specs + [LayerSpec(VipProjector, cfg)] + decoder_specs(cfg)


TAPS = StageField("taps", True, made_by=FeatureTap, dropped_by=VipProjector)


def _tap_cost(cfg: ModelConfig, params: int, n: int, seq: int) -> costs.Cost:
    # a copy, no FLOPs; what a boundary after it sends: hidden and at most every state's patches, n x (1 + k) x D
    return costs.Cost(n, 0.0, 0.0, 0.0, n * (cfg.vision.dim + cfg.vision.proj_in_dim))


TAP_RULE = costs.LayerRule("FeatureTap", _tap_cost, "vision")


@dataclass(frozen=True)
class VisualPrompts(Placeholders):
    """LLaVA's placeholders, for images that carry ViP-LLaVA's visual prompts: marks drawn on the image (boxes,
    ellipses, arrows, scribbles) that the text names by colour, shape and place ("the red box on the left"). Its
    training drew them and never augmented; --augment's random crop (85-100% of the area) can cut a mark at the
    edge off, leaving text about a mark the model cannot see, so the kind refuses it."""
    name = "visual_prompts"

    def augment_refusal(self, cfg: ModelConfig) -> str | None:
        return ("--augment: the vipllava family's images carry visual prompts (marks the text names by colour and "
                "place); a random crop can cut one off and the colour jitter shifts its colour; drop --augment")


# ---- the HF side: a VipLlava directory read with mmpipe.hf.llava's machinery ----------------------------------

class _AsLlava:
    """A VipLlavaConfig as mmpipe.hf.llava.config_from_hf reads a LlavaConfig: one feature layer (-1, which
    VipVision replaces) and the class token dropped, every other attribute the VipLlavaConfig's own."""
    vision_feature_layer = -1
    vision_feature_select_strategy = "default"

    def __init__(self, hf):
        self._hf = hf

    def __getattr__(self, name):
        return getattr(self._hf, name)


def config_from_hf(hf, name: str = "hf", mean=None, std=None) -> ModelConfig:
    """A VipLlavaConfig -> this family's config: LLaVA's text section and tower fields, its own states."""
    from mmpipe.hf.llava import config_from_hf as llava_config
    if hf.vision_config.model_type != "clip_vision_model":
        raise ConfigError(f"vision_config: model_type '{hf.vision_config.model_type}' (ViP-LLaVA drops each state's "
                          f"first token, CLIP's class token: only clip_vision_model)")
    layers = hf.vision_feature_layer
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    base = llava_config(_AsLlava(hf), name, mean, std, check=False)
    shared = {f.name: getattr(base.vision, f.name) for f in dataclasses.fields(VisionConfig)}
    vision = VipVision(**shared, act=base.vision.act, feature_layers=layers,
                       projector_ln_eps=float(hf.projector_layernorm_eps))
    cfg = dataclasses.replace(base, family=MODEL_TYPE, vision=vision)
    cfg.validate()
    return cfg


def hf_vip_config(path: str | Path, notes: list[str] | None = None):
    """A VipLlava directory's (HF config, mmpipe config); no weight is read."""
    from mmpipe.hf.llava import _preprocessor, read_hf_config
    path = Path(path)
    hf = read_hf_config(path, (MODEL_TYPE,), notes)
    return hf, config_from_hf(hf, path.name, *_preprocessor(path))


def read_vipllava(path: str | Path):
    """A VipLlava directory decided from its config and tensor headers (mmpipe.hf.stream.Imported): every tensor
    mapped by LLaVA's names, or reported unused (the tower's blocks after the last read state, its
    post-LayerNorm)."""
    from mmpipe.hf.llava import plan_weights, processor_defaults, stats_defaults
    from mmpipe.hf.safetensors_io import open_weights
    from mmpipe.hf.stream import Imported
    path, notes = Path(path), []
    hf, cfg = hf_vip_config(path, notes)
    source = open_weights(path)
    assign, report = plan_weights(cfg, source, hf, str(path))
    report.notes += notes + processor_defaults(path, stats_defaults)
    return Imported(cfg, assign, source, report)


def import_vipllava(path: str | Path, dtype=torch.float32):
    """A VipLlava directory -> (single-device model, report): `mmpipe generate --checkpoint HF_DIR`'s reader."""
    got = read_vipllava(path)
    return got.model(dtype), got.report


def hf_config(cfg: ModelConfig, tok=None):
    """This family's config -> the VipLlavaConfig of its export: LLaVA's (mmpipe.hf.llava.hf_config: the tower cut
    after the last read state, tok's special ids), the states by their index from 0 (a negative one would name
    another state of the cut tower)."""
    from transformers import VipLlavaConfig

    from mmpipe.hf.llava import hf_config as llava_hf_config
    from mmpipe.model.llava import ClipVision
    v = cfg.vision
    shared = {f.name: getattr(v, f.name) for f in dataclasses.fields(VisionConfig)}
    clip = ClipVision(**shared, kind="clip", act=v.act, feature_layer=v.n_blocks_used, feature_select="default")
    llava = llava_hf_config(dataclasses.replace(cfg, vision=clip), tok)
    return VipLlavaConfig(vision_config=llava.vision_config, text_config=llava.text_config,
                          image_token_index=cfg.image_token_id, vision_feature_layer=list(v.states),
                          projector_layernorm_eps=v.projector_ln_eps, tie_word_embeddings=cfg.text.tie_embeddings)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """Every mmpipe weight name -> VipLlavaForConditionalGeneration's (LLaVA's names: mmpipe.hf.llava.key_map)."""
    from mmpipe.hf.llava import _hf_names
    from mmpipe.hf.llava import key_map as llava_key_map
    return llava_key_map(cfg, _hf_names(hf_config(cfg)))


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """A VipLlava directory that from_pretrained loads (mmpipe.hf.llava.export_hf with this family's config)."""
    from mmpipe.hf.llava import export_hf as llava_export
    return llava_export(source, out, tok, hf=hf_config(source.cfg, tok), shard_size=shard_size)


VIPLLAVA = register(Family(
    MODEL_TYPE, "prefix", vip_specs, (TowerBlock, LlamaBlock),
    {**LLAVA.cost_rules, FeatureTap: TAP_RULE, VipProjector: costs.PROJECTOR},
    dataclasses.replace(LLAVA.layout, vision=VipVision), VisualPrompts(), checks=vip_checks,
    fields=lambda cfg: ROW + (TAPS,), tower_tokens=lambda cfg: cfg.vision.n_positions,  # CLIP's class token too
    hf=HfSide("hf", "VipLlavaForConditionalGeneration", (MODEL_TYPE,), "ViP-LLaVA", importer=import_vipllava,
              config=hf_vip_config, reader=read_vipllava, key_map=key_map, export=export_hf)))
