"""Qwen3.5 in and out of Hugging Face: Qwen3_5ForConditionalGeneration directories (model_type qwen3_5) and
Qwen3_5MoeForConditionalGeneration ones (qwen3_5_moe: text.moe, every decoder layer sparse, the experts' fields by
mmpipe.hf.moe) <-> mmpipe's layer list (mmpipe.model.qwen3_5).

Names: "<layer index>.<sub-name>" <-> transformers', a prefix per layer class, the decoder layers numbered across
both kinds (a linear layer's sub-names are under linear_attn, a full one's under self_attn), e.g. for a 1-block tower
and decoder layers linear, full:

    0.proj.weight                        <->  model.visual.patch_embed.proj.weight
    0.pos_embed.weight                   <->  model.visual.pos_embed.weight
    2.linear_fc1.weight                  <->  model.visual.merger.linear_fc1.weight
    4.linear_attn.A_log                  <->  model.language_model.layers.0.linear_attn.A_log
    5.self_attn.q_proj.weight            <->  model.language_model.layers.1.self_attn.q_proj.weight

A sparse layer's MLP keeps transformers' names under the same prefix (mlp.gate.weight, mlp.experts.gate_up_proj,
mlp.experts.down_proj, mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight), the experts
fused in transformers' in-memory layout, which its save_pretrained writes (transformers has no conversion for
qwen3_5_moe's experts, so no other layout is read).

Every source tensor is mapped (a tied lm_head must equal the input embedding) or the import fails naming it, except
the multi-token-prediction head (mtp.*), which transformers does not load either; a missing or misshapen tensor fails.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.builder import ReferenceModel
from ..model.llava import LMHeadLinear
from ..model.qwen3_5 import DeltaNetBlock, GatedAttentionBlock, HybridText, Qwen35FinalNorm, layer_types
from ..model.qwen3_vl import Qwen3Embed, Qwen3Merger, Qwen3PatchEmbed, Qwen3VisionBlock
from .llava import ImportReport, _fail, processor_defaults, processor_settings, read_hf_config
from .moe import PerExpert, hf_moe_fields, moe_from_hf
from .qwen2_vl import pixel_defaults_taken, plan_named, write_with_processor
from .qwen3_vl import DEFAULT_PIXELS, hf_tower, text_section, tower_config
from .safetensors_io import LazyWeights, as_weights, open_weights
from .stream import Imported, fill, meta_model

HF_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
              "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}  # text.moe (docs/qwen3_5.md)
DECODER = (DeltaNetBlock, GatedAttentionBlock)  # their sparse kinds (text.moe) are subclasses: the same prefixes


def hf_class(cfg: ModelConfig) -> str:
    """The transformers class a config's weights load into: Qwen3.5-MoE's with text.moe."""
    return HF_CLASSES["qwen3_5_moe" if cfg.text.moe else "qwen3_5"]


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (a tied head has none)."""
    model = meta_model(cfg)
    out, seen = {}, {}
    for i, layer in enumerate(model):
        if not layer.state_dict():
            continue
        kind = DECODER if isinstance(layer, DECODER) else type(layer)  # both kinds count as decoder layers
        k = seen.get(kind, 0)
        seen[kind] = k + 1
        prefix = ("model.visual.patch_embed." if isinstance(layer, Qwen3PatchEmbed) else
                  f"model.visual.blocks.{k}." if isinstance(layer, Qwen3VisionBlock) else
                  "model.visual.merger." if isinstance(layer, Qwen3Merger) else
                  f"model.language_model.layers.{k}." if isinstance(layer, DECODER) else
                  "model.language_model." if isinstance(layer, (Qwen3Embed, Qwen35FinalNorm)) else
                  "" if isinstance(layer, LMHeadLinear) else None)
        if prefix is None:
            raise ValueError(f"layer {i} ({type(layer).__name__}) has no Qwen3.5 name")
        for sub in layer.state_dict():
            out[f"{i}.{sub}"] = ("model.visual." + sub if isinstance(layer, Qwen3PatchEmbed)
                                 and sub.startswith("pos_embed.") else prefix + sub)
    return out


def config_from_hf(hf, name: str = "hf", proc: dict | None = None) -> ModelConfig:
    """A Qwen3_5Config (+ its image processor's settings) -> the mmpipe config; refuses what the layers do not
    implement, and a layer pattern that does not match the layer count (one line, from the config's checks)."""
    tc, vc, proc = hf.text_config, hf.vision_config, proc or {}
    kinds = list(getattr(tc, "layer_types", None) or [])
    if len(kinds) != tc.num_hidden_layers or not set(kinds) <= {"linear_attention", "full_attention"}:
        _fail("text_config.layer_types", f"{len(kinds)} kinds {sorted(set(kinds))} for {tc.num_hidden_layers} layers "
                                         f"(one per layer: linear_attention or full_attention)")
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    moe = moe_from_hf(tc)
    text = text_section(
        HybridText, _dense_width(hf, moe), "Qwen3.5", theta=10000000.0, sections=(11, 11, 10), moe=moe,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", 0.25))),
        full_attention_indexes=tuple(i for i, kind in enumerate(kinds) if kind == "full_attention"),
        linear_key_heads=tc.linear_num_key_heads,
        linear_value_heads=tc.linear_num_value_heads, linear_key_dim=tc.linear_key_head_dim,
        linear_value_dim=tc.linear_value_head_dim, linear_conv_kernel=tc.linear_conv_kernel_dim)
    vision = tower_config(vc, tc, proc)  # Qwen3-VL's tower, without DeepStack
    cfg = ModelConfig(name=name, family="qwen3_5", vision=vision, text=text,
                      proj_inner_dim=vision.dim * vision.merge_size ** 2, image_token_id=hf.image_token_id,
                      vision_start_id=hf.vision_start_token_id, vision_end_id=hf.vision_end_token_id)
    cfg.validate()
    return cfg


class _Overlay:
    """obj with some attributes given (a read-only view for text_section)."""

    def __init__(self, obj, **given):
        self._obj, self._given = obj, given

    def __getattr__(self, name):
        return self._given[name] if name in self._given else getattr(self._obj, name)


def _dense_width(hf, moe):
    """hf, or for Qwen3.5-MoE a view whose text config's intermediate_size (the dense MLP's width, which
    Qwen3_5MoeTextConfig does not have: every layer is sparse) is the shared expert's: text.ff_dim, read by no
    sparse layer, holds it (the width of the one MLP every token runs)."""
    if moe is None:
        return hf
    return _Overlay(hf, text_config=_Overlay(hf.text_config, intermediate_size=moe.shared_ff_dim or moe.ff_dim))


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe Qwen3.5 config -> transformers' Qwen3_5Config (Qwen3_5MoeConfig with text.moe), with tok's special ids
    in its text config."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from .llava import token_ids
    t = cfg.text
    vision = hf_tower(cfg)
    mlp = hf_moe_fields(t.moe, "qwen3_5_moe") if t.moe else dict(intermediate_size=t.ff_dim)
    text = dict(hidden_size=t.dim, **mlp, num_hidden_layers=t.n_layers,
                num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, head_dim=t.head_dim,
                vocab_size=t.vocab_size, max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps,
                tie_word_embeddings=t.tie_embeddings, layer_types=list(layer_types(t)),
                linear_conv_kernel_dim=t.linear_conv_kernel, linear_key_head_dim=t.linear_key_dim,
                linear_value_head_dim=t.linear_value_dim, linear_num_key_heads=t.linear_key_heads,
                linear_num_value_heads=t.linear_value_heads,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                                 "mrope_section": list(t.mrope_section), "mrope_interleaved": True,
                                 "partial_rotary_factor": t.partial_rotary_factor},
                **token_ids(tok, t.vocab_size))
    return (Qwen3_5MoeConfig if t.moe else Qwen3_5Config)(
        vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
        vision_start_token_id=cfg.vision_start_id, vision_end_token_id=cfg.vision_end_id,
        tie_word_embeddings=t.tie_embeddings)


def _without_mtp(source):
    """The source less its multi-token-prediction head (mtp.*: the released checkpoints carry one, transformers'
    Qwen3_5ForConditionalGeneration ignores it on load, and so does the import)."""
    if isinstance(source, LazyWeights):
        return LazyWeights({k: f for k, f in source.files.items() if not k.startswith("mtp.")})
    return {k: v for k, v in as_weights(source).items() if not k.startswith("mtp.")}


def import_weights(model: ReferenceModel, source, where: str) -> ImportReport:
    """Load HF-named tensors into the mmpipe model: every source tensor mapped, every weight filled."""
    source = PerExpert(_without_mtp(source))
    assign, report = plan_named(model.cfg, source, where, key_map(model.cfg), hf_class(model.cfg))
    fill(model, source, assign)
    return report


def hf_qwen3_5_config(path: str | Path, notes: list[str] | None = None):
    """An HF Qwen3.5 directory's (HF config, mmpipe config); no weight is read (but llava.settle_tie's two)."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    return hf, config_from_hf(hf, path.name, processor_settings(path)[0])


def read_qwen3_5(path: str | Path) -> Imported:
    """An HF Qwen3_5ForConditionalGeneration or Qwen3_5MoeForConditionalGeneration directory, decided from its config
    and tensor headers (no weight read yet): save it layer by layer (Imported.save) or as a model (Imported.model)."""
    path, notes = Path(path), []
    _, cfg = hf_qwen3_5_config(path, notes)
    source = PerExpert(_without_mtp(open_weights(path)))  # experts stored one module each read fused
    assign, report = plan_named(cfg, source, str(path), key_map(cfg), hf_class(cfg))
    report.notes += notes + processor_defaults(path,
                                               lambda proc: pixel_defaults_taken(proc, DEFAULT_PIXELS, clip=False))
    return Imported(cfg, assign, source, report)


def import_qwen3_5(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """An HF Qwen3_5ForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_qwen3_5(path)
    return got.model(dtype), got.report


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, generation_config.json, the weights sharded, its image processor) that
    from_pretrained loads, one layer in memory at a time; source: a model or a run's layers (mmpipe.hf.stream).
    Qwen3.5-MoE: its experts one module each, as transformers' save_pretrained writes them (write_per_expert)."""
    if source.cfg.text.moe:
        return write_per_expert(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size)
    return write_with_processor(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size)


def _per_expert(name: str, shape: tuple) -> list[tuple[str, tuple, tuple]]:
    """A fused expert tensor's per-expert pieces: (name, shape, the slice of the fused tensor), PerExpert's inverse;
    any other tensor whole. E.g. P.mlp.experts.gate_up_proj [8, 80, 64] -> P.mlp.experts.e.gate_proj.weight [40, 64]
    (rows 0..39 of expert e) and P.mlp.experts.e.up_proj.weight [40, 64] (rows 40..79), e = 0..7."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base, (E, F2, D) = name[:-len("gate_up_proj")], shape
        f = F2 // 2
        return [piece for e in range(E) for piece in ((f"{base}{e}.gate_proj.weight", (f, D), (e, slice(0, f))),
                                                      (f"{base}{e}.up_proj.weight", (f, D), (e, slice(f, F2))))]
    if name.endswith("mlp.experts.down_proj"):
        base, (E, D, F) = name[:-len("down_proj")], shape
        return [(f"{base}{e}.down_proj.weight", (D, F), (e,)) for e in range(E)]
    return [(name, tuple(shape), None)]


def write_per_expert(source, out: str | Path, hf, names: dict[str, str], shard_size=None) -> Path:
    """mmpipe.hf.export.write_hf for a Qwen3_5MoeConfig, whose save_pretrained splits each fused expert tensor into
    one module per expert (transformers' conversion mapping for qwen3_5_moe_text, the qwen2_moe one, reverted on
    save; write_hf writes only renamings). The names and shapes written are checked against that save format of
    transformers' model built on the meta device; one layer in memory at a time, as write_hf."""
    from transformers.core_model_loading import revert_weight_conversion

    from .export import _generation_config, dominant, hf_meta_model, hf_model_class, planned
    from .qwen2_vl import image_processor
    from .safetensors_io import DEFAULT_SHARD_SIZE, parse_size, write_sharded
    from .stream import as_layers, renamed_tensors
    layers, out = as_layers(source), Path(out)
    entries = [(piece, dt, shape) for n, dt, whole in planned(layers, names)
               for piece, shape, _ in _per_expert(n, whole)]
    meta = hf_meta_model(hf)
    theirs = {k: tuple(t.shape) for k, t in revert_weight_conversion(meta, meta.state_dict()).items()}
    if hf.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    mine = {n: tuple(shape) for n, _, shape in entries}
    if mine != theirs:
        wrong = sorted(set(mine) ^ set(theirs)) or sorted(n for n in mine if mine[n] != theirs[n])
        raise RuntimeError(f"export: the weights written are not what a {hf_model_class(hf).__name__} saves: "
                           f"{wrong[:4]}")
    out.mkdir(parents=True, exist_ok=True)
    hf.dtype = str(dominant(entries)).removeprefix("torch.")
    hf.architectures = [hf_model_class(hf).__name__]
    hf.save_pretrained(out)
    _generation_config(hf).save_pretrained(out)

    def pieces(named):
        for n, t in named:  # clones: a safetensors file takes no two tensors that share memory
            yield from ((piece, t if at is None else t[at].clone()) for piece, _, at in _per_expert(n, t.shape))
    write_sharded(out, entries, pieces(renamed_tensors(layers, names)),
                  parse_size(shard_size or DEFAULT_SHARD_SIZE))
    if source.cfg.vision.max_pixels:
        image_processor(source.cfg.vision).save_pretrained(out)
    return out
