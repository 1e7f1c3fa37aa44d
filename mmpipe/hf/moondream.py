"""Moondream's own weight names <-> mmpipe's moondream-family layer list, both ways.

Two layouts of moondream checkpoints, both read (and written):

    current  model.vision.patch_emb / pos_emb / blocks.{i}.{ln1,attn.qkv,attn.proj,ln2,mlp.fc1,mlp.fc2} / post_ln,
             model.vision.proj_mlp.{fc1,fc2}, model.text.wte, model.text.blocks.{i}.{ln,attn.qkv,attn.proj,mlp.fc1,
             mlp.fc2}, model.text.post_ln, model.text.lm_head
    legacy   vision_encoder.encoder.model.visual.{patch_embed.linear, pos_embed, blocks.{i}.{norm1,...,norm2}, norm},
             vision_encoder.projection.mlp.*, text_model.transformer.embd.wte, text_model.transformer.h.{i}.{ln,
             mixer.Wqkv, mixer.out_proj, mlp.*}, text_model.lm_head.{ln, linear}

mmpipe's names are "<layer index>.<sub-name>" of the single-device model. Every source tensor is
mapped or, for moondream's region (detection / pointing) head, which mmpipe does not model,
reported as unused; anything else, a missing tensor or a wrong shape is an error naming it.
"""
from __future__ import annotations

import torch

from ..config import ConfigError, ModelConfig
from ..model.builder import ReferenceModel
from ..model.layers import DecoderBlock, LMHead, PatchEmbed, Projector, TextEmbed, VisionBlock, VisionNorm

LAYOUTS = ("current", "legacy")
UNUSED_PREFIXES = ("model.region.", "region_model.")

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
    with torch.device("meta"):
        model = ReferenceModel(cfg)
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


def import_moondream(model: ReferenceModel, source: dict[str, torch.Tensor], where: str = "moondream") -> list[str]:
    """Load moondream-named tensors into the model; returns the source names left unused (region head)."""
    kmap = key_map(model.cfg, detect_layout(source))
    by_src = {s: m for m, s in kmap.items()}
    state, unused = model.state_dict(), []
    for name, tensor in source.items():
        mine = by_src.get(name)
        if mine is None:
            if name.startswith(UNUSED_PREFIXES):
                unused.append(name)
                continue
            raise ConfigError(f"{where}: tensor '{name}' {tuple(tensor.shape)} matches no weight of the model")
        if tuple(tensor.shape) != tuple(state[mine].shape):
            raise ConfigError(f"{where}: tensor '{name}' has shape {tuple(tensor.shape)}, the model expects "
                              f"{tuple(state[mine].shape)}")
        state[mine] = tensor.to(state[mine].dtype)
    missing = sorted(set(by_src) - set(source))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(f"{where}: no tensor for '{missing[0]}'{more}")
    model.load_state_dict(state)
    return unused


def export_moondream(model: ReferenceModel, layout: str = "current") -> dict[str, torch.Tensor]:
    """The model's weights under moondream's names (contiguous, ready for safetensors)."""
    state = model.state_dict()
    return {md: state[m].detach().contiguous() for m, md in key_map(model.cfg, layout).items()}
