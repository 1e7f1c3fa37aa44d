"""Moondream's own weight names <-> mmpipe's moondream-family layer list, both ways.

Two layouts of moondream checkpoints, both read (and written):

    current  model.vision.patch_emb / pos_emb / blocks.{i}.{ln1,attn.qkv,attn.proj,ln2,mlp.fc1,mlp.fc2} / post_ln,
             model.vision.proj_mlp.{fc1,fc2}, model.text.wte, model.text.blocks.{i}.{ln,attn.qkv,attn.proj,mlp.fc1,
             mlp.fc2}, model.text.post_ln, model.text.lm_head, model.region.* (REGION_NAMES)
    legacy   vision_encoder.encoder.model.visual.{patch_embed.linear, pos_embed, blocks.{i}.{norm1,...,norm2}, norm},
             vision_encoder.projection.mlp.*, text_model.transformer.embd.wte, text_model.transformer.h.{i}.{ln,
             mixer.Wqkv, mixer.out_proj, mlp.*}, text_model.lm_head.{ln, linear}, region_model.*

mmpipe's names are "<layer index>.<sub-name>" of the single-device model. Every source tensor is
mapped; anything else, a missing tensor or a wrong shape is an error naming it.

The region (detection / pointing) head, 14 tensors, is no pipeline layer: nothing in training reads
it. It travels beside the weights, unchanged, as RUN/region.safetensors (REGION_FILE) in moondream's
current names and dtype: `mmpipe import --moondream` writes it, `mmpipe export --format safetensors`
writes it back in either layout. Between the layouts only names change, and the two Fourier feature
matrices are transposed (moondream's legacy loader copies `coordinate_features.weight.T` into
`coord_features`): bit-exact both ways.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import REGION_FILE, ConfigError, ModelConfig
from ..model.builder import ReferenceModel
from ..model.layers import DecoderBlock, LMHead, PatchEmbed, Projector, TextEmbed, VisionBlock, VisionNorm
from .safetensors_io import as_weights, open_file
from .stream import Imported, fill, meta_model

LAYOUTS = ("current", "legacy")
REGION_PREFIXES = {"current": "model.region.", "legacy": "region_model."}

# moondream's region head: current name -> (legacy name, stored transposed in legacy). Shapes of moondream2:
# coord_encoder (2048, 256), coord_decoder fc1 (8192, 2048) fc2 (1024, 8192), size_encoder (2048, 512),
# size_decoder fc1 (8192, 2048) fc2 (2048, 8192), coord_features (1, 128), size_features (2, 256).
REGION_NAMES = {
    **{f"model.region.{mine}.{p}": (f"region_model.{legacy}.{p}", False)
       for mine, legacy in (("coord_encoder", "coordinate_encoder"), ("coord_decoder.fc1", "coordinate_decoder.fc1"),
                            ("coord_decoder.fc2", "coordinate_decoder.fc2"), ("size_encoder", "size_encoder"),
                            ("size_decoder.fc1", "size_decoder.fc1"), ("size_decoder.fc2", "size_decoder.fc2"))
       for p in ("weight", "bias")},
    "model.region.coord_features": ("region_model.coordinate_features.weight", True),
    "model.region.size_features": ("region_model.size_features.weight", True),
}

# per layer class: mmpipe sub-name -> moondream name (with {i} for the block number), per layout
_NAMES = {
    "current": {
        PatchEmbed: {"linear": "model.vision.patch_emb", "pos_emb": "model.vision.pos_emb"},
        VisionBlock: {"ln1": "model.vision.blocks.{i}.ln1", "attn.qkv": "model.vision.blocks.{i}.attn.qkv",
                      "attn.proj": "model.vision.blocks.{i}.attn.proj", "ln2": "model.vision.blocks.{i}.ln2",
                      "mlp.fc1": "model.vision.blocks.{i}.mlp.fc1", "mlp.fc2": "model.vision.blocks.{i}.mlp.fc2"},
        VisionNorm: {"ln": "model.vision.post_ln"},
        Projector: {"mlp.fc1": "model.vision.proj_mlp.fc1", "mlp.fc2": "model.vision.proj_mlp.fc2"},
        TextEmbed: {"wte.weight": "model.text.wte"},  # a bare parameter in moondream, no ".weight"
        DecoderBlock: {"ln": "model.text.blocks.{i}.ln", "attn.qkv": "model.text.blocks.{i}.attn.qkv",
                       "attn.proj": "model.text.blocks.{i}.attn.proj", "mlp.fc1": "model.text.blocks.{i}.mlp.fc1",
                       "mlp.fc2": "model.text.blocks.{i}.mlp.fc2"},
        LMHead: {"ln": "model.text.post_ln", "linear": "model.text.lm_head"},
    },
    "legacy": {
        PatchEmbed: {"linear": "vision_encoder.encoder.model.visual.patch_embed.linear",
                     "pos_emb": "vision_encoder.encoder.model.visual.pos_embed"},
        VisionBlock: {k: "vision_encoder.encoder.model.visual.blocks.{i}." + v for k, v in
                      {"ln1": "norm1", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "ln2": "norm2",
                       "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}.items()},
        VisionNorm: {"ln": "vision_encoder.encoder.model.visual.norm"},
        Projector: {"mlp.fc1": "vision_encoder.projection.mlp.fc1", "mlp.fc2": "vision_encoder.projection.mlp.fc2"},
        TextEmbed: {"wte": "text_model.transformer.embd.wte"},
        DecoderBlock: {k: "text_model.transformer.h.{i}." + v for k, v in
                       {"ln": "ln", "attn.qkv": "mixer.Wqkv", "attn.proj": "mixer.out_proj", "mlp.fc1": "mlp.fc1",
                        "mlp.fc2": "mlp.fc2"}.items()},
        LMHead: {"ln": "text_model.lm_head.ln", "linear": "text_model.lm_head.linear"},
    },
}


def key_map(cfg: ModelConfig, layout: str = "current") -> dict[str, str]:
    """mmpipe name -> moondream name for every tensor of the moondream-family model."""
    if layout not in LAYOUTS:
        raise ConfigError(f"moondream layout '{layout}' (valid: {', '.join(LAYOUTS)})")
    model = meta_model(cfg)
    out, count = {}, {VisionBlock: 0, DecoderBlock: 0}
    for idx, layer in enumerate(model):
        table = _NAMES[layout][type(layer)]
        for sub in layer.state_dict():
            # the longest table entry that is the sub-name or a module prefix of it
            key = max((k for k in table if sub == k or sub.startswith(k + ".")), key=len)
            out[f"{idx}.{sub}"] = table[key].format(i=count.get(type(layer), 0)) + sub[len(key):]
        if type(layer) in count:
            count[type(layer)] += 1
    return out


def detect_layout(names) -> str:
    names = list(names)
    if any(n.startswith("model.vision.") or n.startswith("model.text.") for n in names):
        return "current"
    if any(n.startswith("vision_encoder.") or n.startswith("text_model.") for n in names):
        return "legacy"
    raise ConfigError("not a moondream state dict: no model.vision.* / model.text.* or vision_encoder.* / "
                      "text_model.* tensors")


def split_region(source: dict[str, torch.Tensor], layout: str, text_dim: int,
                 where: str = "moondream") -> dict[str, torch.Tensor]:
    """The region head's tensors of a moondream state dict, in current names (legacy ones renamed, the
    feature matrices transposed back); {} when it has none. A partial head, or a region-named tensor
    moondream does not have, is refused naming it."""
    names = {mine if layout == "current" else legacy: (mine, layout == "legacy" and t)
             for mine, (legacy, t) in REGION_NAMES.items()}
    source = as_weights(source)
    found = {n for n in source if n.startswith(REGION_PREFIXES[layout])}
    if not found:
        return {}
    for n in sorted(found):
        if n not in names:
            raise ConfigError(f"{where}: tensor '{n}' {source.shape(n)} is not part of moondream's region head")
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigError(f"{where}: region head incomplete: no tensor for '{missing[0]}'"
                          + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    out = {mine: (source[n].t() if t else source[n]).contiguous() for n, (mine, t) in names.items()}
    # the coordinate / size encoders write into the decoder's hidden state: they must be text.dim wide
    width = out["model.region.coord_encoder.weight"].shape[0]
    if width != text_dim:
        raise ConfigError(f"{where}: region head is {width} wide, the text model {text_dim}")
    return out


def region_in_layout(region: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Current-named region tensors (split_region, REGION_FILE) under `layout`'s names, bit-exact."""
    if layout == "current":
        return dict(region)
    return {REGION_NAMES[n][0]: (v.t().contiguous() if REGION_NAMES[n][1] else v) for n, v in region.items()}


def plan_moondream(cfg: ModelConfig, source, where: str = "moondream") -> tuple[dict[str, str], dict]:
    """(mmpipe name -> source name, the region head's tensors in current names and their own dtype, {} when the
    source has none), from the source's names and shapes: a lazy source reads only the region head here."""
    source = as_weights(source)
    layout = detect_layout(source)
    region = split_region(source, layout, cfg.text.dim, where)
    kmap = key_map(cfg, layout)
    by_src = {s: m for m, s in kmap.items()}
    shapes = {k: tuple(t.shape) for k, t in meta_model(cfg).state_dict().items()}
    assign = {}
    for name in source:
        mine = by_src.get(name)
        if mine is None:
            if name.startswith(REGION_PREFIXES[layout]):
                continue
            raise ConfigError(f"{where}: tensor '{name}' {source.shape(name)} matches no weight of the model")
        if source.shape(name) != shapes[mine]:
            raise ConfigError(f"{where}: tensor '{name}' has shape {source.shape(name)}, the model expects "
                              f"{shapes[mine]}")
        assign[mine] = name
    missing = sorted(set(by_src) - set(source))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"{where}: no tensor for '{missing[0]}'{more}")
    return assign, region


def read_moondream(cfg: ModelConfig, path: str | Path) -> Imported:
    """A moondream .safetensors file for the model shape cfg, decided from its header (Imported.save writes the
    layers one at a time); the region head rides in Imported.extra as REGION_FILE."""
    source = open_file(path)
    assign, region = plan_moondream(cfg, source, str(path))
    return Imported(cfg, assign, source, None, {REGION_FILE: region} if region else {})


def import_moondream(model: ReferenceModel, source, where: str = "moondream") -> dict[str, torch.Tensor]:
    """Load moondream-named tensors into the model; returns the region head's tensors (current names,
    their own dtype; {} when the source has none), which no layer holds."""
    source = as_weights(source)
    assign, region = plan_moondream(model.cfg, source, where)
    fill(model, source, assign)
    return region


def export_moondream(model: ReferenceModel, layout: str = "current",
                     region: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under moondream's names (contiguous, ready for safetensors), with the region
    head (current names, as split_region returns) under `layout`'s names when given."""
    state = model.state_dict()
    out = {md: state[m].detach().contiguous() for m, md in key_map(model.cfg, layout).items()}
    return {**out, **region_in_layout(region or {}, layout)}


def load_region(path: Path, text_dim: int) -> dict[str, torch.Tensor]:
    """The region head from a REGION_FILE, or from a run directory holding one (checked as on import)."""
    from safetensors.torch import load_file
    path = path / REGION_FILE if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--region: {path} does not exist (mmpipe import --moondream writes RUN/{REGION_FILE})")
    return split_region(load_file(str(path)), "current", text_dim, str(path))
