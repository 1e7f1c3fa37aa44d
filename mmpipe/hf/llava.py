"""LLaVA in and out of Hugging Face: LlavaForConditionalGeneration directories <-> mmpipe's layer list.

Names. mmpipe's single-device model names a weight "<layer index>.<HF sub-name>" (its layers use
HF's module names), so the map is a prefix per layer, e.g. for a 2-block tower:

    2.self_attn.q_proj.weight  <->  model.vision_tower.encoder.layers.1.self_attn.q_proj.weight
    5.mlp.gate_proj.weight     <->  model.language_model.layers.0.mlp.gate_proj.weight

The HF side is the installed transformers' own layout (read off the model built on the meta device);
checkpoints in the older layout (language_model.model.*, vision_tower.vision_model.*, ...) are
renamed to it first. On import every source tensor is mapped, or reported as unused by the model
(the tower's blocks after the feature layer, its post-LayerNorm and SigLIP's pooling head, which
LLaVA never runs); a name that fits nothing or a wrong shape is an error naming the tensor.

Export writes a tower cut at the feature layer (num_hidden_layers = blocks used, feature layer -1,
an identity post-LayerNorm, no pooling head): the same function as the imported model, so
`LlavaForConditionalGeneration.from_pretrained` reproduces mmpipe's logits.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..data.tokenizer import load_tokenizer
from ..model.builder import ReferenceModel, build_layer, layer_specs
from ..model.llava import (
    ClipVision,
    FinalNorm,
    LlamaBlock,
    LlamaText,
    LlavaEmbed,
    LlavaProjector,
    LMHeadLinear,
    TowerBlock,
    VisionEmbed,
)
from .export import hf_meta_state, hf_model_class, write_hf
from .safetensors_io import Joined, Renamed, as_weights, open_weights, same_tensor
from .stream import Imported, fill, meta_model
from .tokens import add_image_token, grown, image_token

HF_ACTS = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
LEGACY = [(r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head."),
          (r"^vision_tower\.", "model.vision_tower."), (r"^multi_modal_projector\.", "model.multi_modal_projector."),
          (r"^image_newline$", "model.image_newline")]  # LLaVA-NeXT / OneVision (mmpipe.hf.llava_next)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
TEXT_TYPES = ("llama", "qwen2", "mistral")
HF_CLASSES = {"llava": "LlavaForConditionalGeneration"}  # the model_type this importer reads


def _fail(where: str, msg: str):
    raise ConfigError(f"{where}: {msg}")


def _rope_theta(tc) -> float:
    params = getattr(tc, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        _fail("text_config", f"rope_type '{kind}' (RoPE scaling) is not supported; only plain RoPE")
    return float(params.get("rope_theta", getattr(tc, "rope_theta", 10000.0)))


def config_from_hf(hf, name: str = "hf", mean=None, std=None, check: bool = True) -> ModelConfig:
    """A LlavaConfig -> the mmpipe LLaVA-family config. Refuses what the layers do not implement. check False:
    not validated yet (mmpipe.hf.llava_next completes it as its own family first)."""
    vc, tc = hf.vision_config, hf.text_config
    if vc.model_type not in ("clip_vision_model", "siglip_vision_model"):
        _fail("vision_config", f"model_type '{vc.model_type}' (supported: clip_vision_model, siglip_vision_model)")
    if tc.model_type not in TEXT_TYPES:
        _fail("text_config", f"model_type '{tc.model_type}' (supported: {', '.join(TEXT_TYPES)})")
    if vc.hidden_act not in HF_ACTS:
        _fail("vision_config.hidden_act", f"'{vc.hidden_act}' is not supported")
    layer = hf.vision_feature_layer
    if not isinstance(layer, int):
        _fail("vision_feature_layer", f"{layer!r}: only one layer is supported")
    if getattr(hf, "projector_hidden_act", "gelu") != "gelu" or not getattr(hf, "multimodal_projector_bias", True):
        _fail("projector", "only the 2-layer GELU projector with biases is supported")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if head_dim * tc.num_attention_heads != tc.hidden_size:
        _fail("text_config.head_dim", f"{head_dim} x {tc.num_attention_heads} heads != hidden_size {tc.hidden_size}")
    if tc.model_type == "mistral" and getattr(tc, "sliding_window", None):
        _fail("text_config.sliding_window", f"{tc.sliding_window}: sliding-window attention is not implemented")
    clip = vc.model_type == "clip_vision_model"
    vision = ClipVision(
        image_size=vc.image_size, patch_size=vc.patch_size, dim=vc.hidden_size, n_layers=vc.num_hidden_layers,
        n_heads=vc.num_attention_heads, ff_dim=vc.intermediate_size, channels=vc.num_channels,
        mean=tuple(mean or (CLIP_MEAN if clip else (0.5,) * 3)), std=tuple(std or (CLIP_STD if clip else (0.5,) * 3)),
        ln_eps=vc.layer_norm_eps, kind="clip" if clip else "siglip", act=HF_ACTS[vc.hidden_act], feature_layer=layer,
        feature_select=hf.vision_feature_select_strategy)
    tie = tie_flag(hf)
    text = LlamaText(
        dim=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads, ff_dim=tc.intermediate_size,
        vocab_size=tc.vocab_size, max_context=tc.max_position_embeddings, partial_rotary_factor=1.0,
        rope_theta=_rope_theta(tc), ln_eps=tc.rms_norm_eps, n_kv_heads=tc.num_key_value_heads,
        qkv_bias=tc.model_type == "qwen2" or bool(getattr(tc, "attention_bias", False)), tie_embeddings=tie)
    image_token = getattr(hf, "image_token_id", None)
    if image_token is None:
        image_token = getattr(hf, "image_token_index")
    cfg = ModelConfig(name=name, family="llava", vision=vision, text=text, proj_inner_dim=tc.hidden_size,
                      image_token_id=int(image_token))
    if check:
        cfg.validate()
    return cfg


def token_ids(tok, vocab_size: int) -> dict[str, int | None]:
    """The bos / eos / pad ids an export declares (its text config's, and so its generation_config.json's, which
    transformers' generate stops at): the tokenizer's own, as `mmpipe generate` uses them. An id the tokenizer
    lacks, one outside the vocabulary, and every id when no tokenizer is known are None: never an HF class's
    default (Qwen2-VL's 151643 / 151645, Llama's 1 / 2), which names another model's tokens."""
    ids = {}
    for name in ("bos", "eos", "pad"):
        i = getattr(tok, f"{name}_token_id", None)
        ids[f"{name}_token_id"] = i if isinstance(i, int) and 0 <= i < vocab_size else None
    return ids


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe LLaVA config -> LlavaConfig of the exported model (tower cut at the feature layer), with tok's
    special token ids (token_ids)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config, SiglipVisionConfig
    v, t = cfg.vision, cfg.text
    act = {"quick_gelu": "quick_gelu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[v.act]
    common = dict(hidden_size=v.dim, intermediate_size=v.ff_dim, num_hidden_layers=v.n_blocks_used,
                  num_attention_heads=v.n_heads, image_size=v.image_size, patch_size=v.patch_size,
                  num_channels=v.channels, hidden_act=act, layer_norm_eps=v.ln_eps)
    vision = CLIPVisionConfig(**common) if v.kind == "clip" else SiglipVisionConfig(**common, vision_use_head=False)
    text_cls = Qwen2Config if t.qkv_bias else LlamaConfig
    extra = {} if t.qkv_bias else {"attention_bias": False, "mlp_bias": False}
    text = text_cls(hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
                    num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, vocab_size=t.vocab_size,
                    max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps, tie_word_embeddings=t.tie_embeddings,
                    rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta},
                    **token_ids(tok, t.vocab_size), **extra)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
                       vision_feature_layer=-1, vision_feature_select_strategy=v.feature_select,
                       tie_word_embeddings=t.tie_embeddings)


def _hf_names(hf) -> list[str]:
    return list(hf_meta_state(hf))


def key_map(cfg: ModelConfig, hf_names: list[str]) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (tied head: none of its own)."""
    patch = "embeddings.patch_embedding.weight"
    tower = next(k for k in hf_names if k.endswith(patch))[:-len(patch)]
    lm, out = "model.language_model.", {}
    model = meta_model(cfg)
    block = {TowerBlock: 0, LlamaBlock: 0}
    for i, layer in enumerate(model):
        for sub in layer.state_dict():
            if isinstance(layer, VisionEmbed):
                hf = tower + (sub if sub.startswith("pre_layrnorm") else "embeddings." + sub)
            elif isinstance(layer, TowerBlock):
                hf = f"{tower}encoder.layers.{block[TowerBlock]}.{sub}"
            elif isinstance(layer, LlavaProjector):  # LLaVA-NeXT's projector holds the model's image_newline
                hf = ("model." if sub == "image_newline" else "model.multi_modal_projector.") + sub
            elif isinstance(layer, LlavaEmbed):
                hf = lm + sub
            elif isinstance(layer, LlamaBlock):
                hf = f"{lm}layers.{block[LlamaBlock]}.{sub}"
            elif isinstance(layer, FinalNorm):
                hf = lm + sub
            elif isinstance(layer, LMHeadLinear):
                hf = sub
            else:
                raise TypeError(f"no HF name for layer {i} ({type(layer).__name__})")
            out[f"{i}.{sub}"] = hf
        if type(layer) in block:
            block[type(layer)] += 1
    return out


def canonical(name: str, known: set[str]) -> str | None:
    """A source tensor name in the installed transformers' layout, or None when it fits nothing."""
    candidates = [name]
    for pat, new in LEGACY:
        if re.match(pat, name):
            candidates.append(re.sub(pat, new, name))
    candidates += [c.replace("vision_tower.vision_model.", "vision_tower.") for c in list(candidates)]
    return next((c for c in candidates if c in known), None)


@dataclass
class ImportReport:
    mapped: int = 0
    unused: list[str] = field(default_factory=list)  # in the source, not needed by the model
    tokenizer: object = None  # stage-1 import: the LM's tokenizer with <image> added (save it with the model)
    notes: list[str] = field(default_factory=list)  # what the import took by default (processor_defaults)

    def summary(self) -> str:
        return (f"{self.mapped} tensors mapped, {len(self.unused)} unused by the model"
                + (f" ({', '.join(self.unused[:4])}{', ...' if len(self.unused) > 4 else ''})" if self.unused else "")
                + "".join(f"; {n}" for n in self.notes))


def plan_weights(cfg: ModelConfig, source, hf, where: str,
                 fresh: tuple[str, ...] = ()) -> tuple[dict[str, str], ImportReport]:
    """(mmpipe name -> source name, report), from the source's names and shapes alone (a lazy source reads no
    weight here but a tied head's and its embedding, compared): every source tensor mapped or reported unused.
    Weights whose HF name starts with one of `fresh` are left out (a new projector keeps its initialisation)."""
    source = as_weights(source)
    names = _hf_names(hf)
    kmap = key_map(cfg, names)
    by_hf = {h: m for m, h in kmap.items()}
    known = set(names)
    shapes = {k: tuple(t.shape) for k, t in meta_model(cfg).state_dict().items()}
    report, assign = ImportReport(), {}
    for src in source:
        hf_name = canonical(src, known)
        if hf_name is None:
            _fail(where, f"tensor '{src}' {source.shape(src)} matches no weight of a {hf_model_class(hf).__name__}")
        mine = by_hf.get(hf_name)
        if mine is None:
            if hf_name == "lm_head.weight" and cfg.text.tie_embeddings:
                emb = next((k for k in source if canonical(k, known) == "model.language_model.embed_tokens.weight"),
                           None)
                if emb is not None and not same_tensor(source, emb, src):
                    _fail(where, f"tensor '{src}': the config ties embeddings but it differs from the input embedding")
                report.mapped += 1
                continue
            report.unused.append(src)
            continue
        if source.shape(src) != shapes[mine]:
            _fail(where, f"tensor '{src}' has shape {source.shape(src)}, the model expects {shapes[mine]}")
        assign[mine] = src
        report.mapped += 1
    missing = sorted(m for m in set(kmap) - set(assign) if not kmap[m].startswith(fresh))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        _fail(where, f"no tensor for '{kmap[missing[0]]}'{more}")
    return assign, report


def import_weights(model: ReferenceModel, source, hf, where: str, fresh: tuple[str, ...] = ()) -> ImportReport:
    """Load HF-named tensors into the mmpipe model (plan_weights, then each weight copied in, cast to the
    model's dtype)."""
    source = as_weights(source)
    assign, report = plan_weights(model.cfg, source, hf, where, fresh)
    fill(model, source, assign)
    return report


def processor_settings(path: Path) -> tuple[dict, str | None]:
    """(the directory's image processor settings, the file they came from): preprocessor_config.json, or the
    image_processor section of a processor's processor_config.json (what `mmpipe export` writes); ({}, None)
    when neither is there. A file that is not a JSON object is one line naming it."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        f = path / name
        if f.is_file():
            d = settings_file(f)
            d = d.get("image_processor", {}) if name == "processor_config.json" else d
            if not isinstance(d, dict):
                _fail(str(f), "not a JSON object of image processor settings")
            return d, name
    return {}, None


def settings_file(f: Path) -> dict:
    """A processor's settings file: its JSON object; a file that is not one is one line naming it."""
    try:
        d = json.loads(f.read_text())
    except ValueError as e:
        _fail(str(f), f"not JSON ({e})")
    if not isinstance(d, dict):
        _fail(str(f), "not a JSON object of processor settings")
    return d


def _preprocessor(path: Path):
    """(image_mean, image_std) of the directory's image processor (processor_settings); None where it has none."""
    d = processor_settings(path)[0]
    return d.get("image_mean"), d.get("image_std")


def stats_defaults(settings: dict, clip: bool = True) -> tuple[list[str], list[str]]:
    """(image_mean / image_std keys the settings lack, the defaults config_from_hf takes for them, in words)."""
    keys = [k for k in ("image_mean", "image_std") if not settings.get(k)]
    what = " / ".join(keys)
    return keys, [f"CLIP's {what}" if clip else f"{what} 0.5 (SigLIP's)"] if keys else []


def processor_defaults(path: Path, taken) -> list[str]:
    """The import summary's note on the image processor settings taken by default for want of the directory's
    own (a model fed other resize bounds or statistics than it was trained with answers worse, and nothing else
    would say so), as a list for ImportReport.notes: taken(settings) -> (the keys missing, the defaults taken in
    words); [] when none is."""
    settings, source = processor_settings(path)
    keys, words = taken(settings)
    if not keys:
        return []
    where = "no preprocessor_config.json" if source is None else f"{source} has no {', '.join(keys)}"
    return [f"{where}: took {', '.join(words)} by default"]


def load_hf_llava(path: str | Path, dtype=torch.float32) -> ReferenceModel:
    return import_llava(path, dtype)[0]


def tie_flag(hf) -> bool:
    """Whether transformers ties a composite model's head to its input embedding: the top-level config's
    tie_word_embeddings alone (PreTrainedModel.get_expanded_tied_weights_keys reads self.config's; no class reads
    text_config's). The Qwen2-VL, Qwen2.5-VL, LLaVA and LLaVA-OneVision configs copy a text_config True onto a False
    top level when built (their __post_init__, for pre-v5 saves), so an AutoConfig of theirs carries it there; the
    Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 (-MoE) and LLaVA-NeXT configs do not, and a text_config True ties nothing."""
    return bool(getattr(hf, "tie_word_embeddings", False))


HEADS = ("lm_head.weight", "language_model.lm_head.weight")  # the head's name, current and older layouts
EMBEDS = ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
          "model.embed_tokens.weight")


def settle_tie(hf, path: Path) -> str | None:
    """Untie hf where transformers' from_pretrained loads the directory untied although the config ties: its
    tie_weights finds the head and the embedding both in the file with different values and leaves them apart
    (a logged warning). Returns a note saying so, else None. Reads those two tensors only when the config ties and
    the file holds both; a directory without weights (a config alone) is left as it is."""
    if not tie_flag(hf):
        return None
    try:
        source = open_weights(path)
    except ConfigError:
        return None
    head, embed = (next((k for k in names if k in source), None) for names in (HEADS, EMBEDS))
    if head is None or embed is None or same_tensor(source, head, embed):
        return None
    hf.tie_word_embeddings = False
    return (f"config.json ties the head to the input embedding, but the file's {head} differs from it: read untied, "
            f"as transformers loads it")


def read_hf_config(path: Path, model_types: tuple[str, ...], notes: list[str] | None = None):
    """An HF directory's config.json (transformers' AutoConfig, local files only), or one line naming the
    directory when it cannot be read or is not one of model_types; its tie as transformers loads the directory
    (settle_tie, whose note goes to notes)."""
    from transformers import AutoConfig
    try:
        hf = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        _fail(str(path), f"cannot read config.json ({' '.join(str(e).split())})")
    if hf.model_type not in model_types:
        want = model_types[0] if len(model_types) == 1 else f"one of {', '.join(model_types)}"
        _fail(f"{path}/config.json", f"model_type '{hf.model_type}' is not {want}")
    note = settle_tie(hf, Path(path))
    if note and notes is not None:
        notes.append(note)
    return hf


def hf_llava_config(path: str | Path, notes: list[str] | None = None):
    """An HF LlavaForConditionalGeneration directory's (HF config, mmpipe config); no weight is read (but
    settle_tie's two)."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    return hf, config_from_hf(hf, path.name, *_preprocessor(path))


def read_llava(path: str | Path) -> Imported:
    """An HF LlavaForConditionalGeneration directory, decided from its config and tensor headers (no weight read
    yet): save it layer by layer (Imported.save) or as a model (Imported.model)."""
    path, notes = Path(path), []
    hf, cfg = hf_llava_config(path, notes)
    source = open_weights(path)
    assign, report = plan_weights(cfg, source, hf, str(path))
    report.notes += notes + processor_defaults(path, lambda d: stats_defaults(d, cfg.vision.kind == "clip"))
    return Imported(cfg, assign, source, report)


def import_llava(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """An HF LlavaForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_llava(path)
    return got.model(dtype), got.report


PROJECTOR = ("model.multi_modal_projector.",)  # the stage-1 start's fresh weights (HF names)


def _parts(vision_dir: Path, lm_dir: Path, feature_layer: int, feature_select: str, image_token_id: int | None):
    """The stage-1 start's (HF config, mmpipe config, lazy source in LLaVA's names, the LM's tokenizer or None
    when image_token_id is given, where)."""
    from transformers import AutoConfig, LlavaConfig
    vc, tc = (AutoConfig.from_pretrained(d, local_files_only=True) for d in (vision_dir, lm_dir))
    vc = getattr(vc, "vision_config", vc)  # a full CLIP / SigLIP directory: its vision half
    tok = None
    if image_token_id is None:
        tok = load_tokenizer(str(lm_dir))
        image_token_id = tc.vocab_size - 1  # placeholder until the token is added
    hf = LlavaConfig(vision_config=vc.to_dict(), text_config=tc.to_dict(), image_token_id=image_token_id,
                     vision_feature_layer=feature_layer, vision_feature_select_strategy=feature_select,
                     tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)))
    cfg = config_from_hf(hf, lm_dir.name, *_preprocessor(vision_dir))
    vision = Renamed(open_weights(vision_dir), lambda k: "model.vision_tower." + re.sub(r"^vision_model\.", "", k))
    lm = Renamed(open_weights(lm_dir), lambda k: re.sub(r"^model\.", "model.language_model.", k))  # and lm_head
    return hf, cfg, Joined(vision, lm), tok, f"{vision_dir} + {lm_dir}"


def import_parts(vision_dir: str | Path, lm_dir: str | Path, *, feature_layer: int = -2,
                 feature_select: str = "default", image_token_id: int | None = None, seed: int = 1234,
                 dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """LLaVA's stage-1 start: a vision tower directory (CLIPVisionModel / SiglipVisionModel) and a
    causal-LM directory (Llama / Qwen2 / Mistral ForCausalLM), with a freshly initialised projector
    (layer seed + index, as every mmpipe layer). Without image_token_id, <image> is added to the
    LM directory's tokenizer and the vocabulary grown (mmpipe.hf.tokens.add_image_token)."""
    vision_dir, lm_dir = Path(vision_dir), Path(lm_dir)
    hf, cfg, source, tok, where = _parts(vision_dir, lm_dir, feature_layer, feature_select, image_token_id)
    model = ReferenceModel(cfg, seed=seed).to(dtype)
    report = import_weights(model, source, hf, where, fresh=PROJECTOR)
    report.notes += processor_defaults(vision_dir, lambda d: stats_defaults(d, cfg.vision.kind == "clip"))
    if tok is not None:
        add_image_token(tok, model)
        report.tokenizer = tok
    return model, report


def read_parts(vision_dir: str | Path, lm_dir: str | Path, *, feature_layer: int = -2,
               feature_select: str = "default", seed: int = 1234) -> Imported:
    """import_parts decided from the headers, for Imported.save (one layer at a time, the sources' dtype): the
    projector built alone as ReferenceModel(cfg, seed) builds it (fp32), <image> added to the LM's tokenizer and,
    when that grows the vocabulary, the embedding and an untied head grown by rows at the mean of theirs."""
    vision_dir, lm_dir = Path(vision_dir), Path(lm_dir)
    hf, cfg0, source, tok, where = _parts(vision_dir, lm_dir, feature_layer, feature_select, None)
    assign, report = plan_weights(cfg0, source, hf, where, fresh=PROJECTOR)
    report.notes += processor_defaults(vision_dir, lambda d: stats_defaults(d, cfg0.vision.kind == "clip"))
    token_id, vocab = image_token(tok, cfg0.text.vocab_size)
    report.tokenizer, extra = tok, vocab - cfg0.text.vocab_size
    cfg = dataclasses.replace(cfg0.with_vocab(vocab), image_token_id=token_id)
    specs, made = layer_specs(cfg), {}
    for i, layer in enumerate(meta_model(cfg0)):
        if isinstance(layer, LlavaProjector):
            made[i] = lambda state, i=i: build_layer(specs[i], i, seed).state_dict()
        elif extra and isinstance(layer, (LlavaEmbed, LMHeadLinear)) and layer.state_dict():
            made[i] = lambda state: {k: grown(t, extra) for k, t in state.items()}
    return Imported(cfg, assign, source, report, made=made)


def export_hf(source, out: str | Path, tok=None, hf=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, generation_config.json, the weights sharded) that from_pretrained
    loads, one layer in memory at a time (mmpipe.hf.export.write_hf); source: a model or a run's layers
    (mmpipe.hf.stream). tok: the run's tokenizer, whose special ids the config declares (token_ids); hf: the HF
    config to write (default: hf_config's LlavaConfig; mmpipe.hf.llava_next gives its LlavaNext / OneVision one).
    The tower is cut at the feature layer; its unused post-LayerNorm is written as the identity."""
    cfg = source.cfg
    hf = hf or hf_config(cfg, tok)

    def identity(name: str, shape: tuple, dtype):
        if "post_layernorm" not in name:
            return None
        return (torch.ones if name.endswith("weight") else torch.zeros)(shape, dtype=dtype)

    return write_hf(source, out, hf, key_map(cfg, _hf_names(hf)), identity, shard_size)


def load_into_pipeline(pipe, model: ReferenceModel) -> int:
    """Copy imported weights into a PipelineModule's local layers (and its local copy of a tied
    module, kept identical on every stage that holds one). Returns the number of layers loaded."""
    n = 0
    for offset, layer in enumerate(pipe.forward_funcs):
        if isinstance(layer, torch.nn.Module):
            layer.load_state_dict(model[pipe._local_start + offset].state_dict())
            n += 1
    for key, module in pipe.tied_modules.items():
        first = next(i for i, s in enumerate(pipe._layer_specs) if getattr(s, "key", None) == key)
        module.load_state_dict(model[first].state_dict())
    return n


def hf_key_map(cfg: ModelConfig) -> dict[str, str]:
    """Every mmpipe weight name -> LlavaForConditionalGeneration's, for the names its config of cfg declares."""
    return key_map(cfg, _hf_names(hf_config(cfg)))
