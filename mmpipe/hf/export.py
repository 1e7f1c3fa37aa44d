"""Writing an HF model directory from mmpipe layers, one layer at a time, without transformers' model.

What a directory needs is config.json, generation_config.json and the weights under transformers' names: the
HF config (each family's hf_config) and the family's key map give all three. transformers' class is built only
on the meta device (no memory), to check that the names and shapes written are exactly the ones its
from_pretrained expects. The weights go out shard by shard in the layers' own dtype (bf16 layer files: a bf16
export; config.json's dtype says which), the index in transformers' format (mmpipe.hf.safetensors_io).
"""
from __future__ import annotations

from collections import Counter
from itertools import chain
from pathlib import Path

import torch

from .safetensors_io import DEFAULT_SHARD_SIZE, parse_size, write_sharded
from .stream import as_layers, renamed_tensors


def hf_model_class(hf):
    """The transformers class of an HF config: Qwen2_5_VLConfig -> Qwen2_5_VLForConditionalGeneration."""
    import transformers
    return getattr(transformers, type(hf).__name__.replace("Config", "ForConditionalGeneration"))


def hf_meta_model(hf):
    """transformers' model of hf built on the meta device: its weight names and shapes, no memory."""
    with torch.device("meta"):
        return hf_model_class(hf)(hf)


def hf_meta_state(hf) -> dict[str, torch.Tensor]:
    return hf_meta_model(hf).state_dict()


def saved_names(model) -> dict[str, str]:
    """transformers' name of each weight in the module -> the name its save_pretrained writes: transformers 5
    saves in a checkpoint's original layout (e.g. Qwen2-VL's model.language_model.layers.0.* as model.layers.0.*,
    revert_weight_conversion), and an export writes what transformers would. A conversion that is more than a
    renaming (tensors merged or split) is refused naming the weight."""
    from transformers.core_model_loading import revert_weight_conversion
    out = {}
    for k, t in model.state_dict().items():
        got = list(revert_weight_conversion(model, {k: t}))
        if len(got) != 1:
            raise RuntimeError(f"export: transformers saves '{k}' of a {type(model).__name__} as {got}, not one "
                               f"renamed tensor; mmpipe writes only renamings")
        out[k] = got[0]
    return out


def planned(layers, names: dict[str, str]) -> list[tuple[str, torch.dtype, tuple]]:
    """(HF name, dtype, shape) of every layer weight, in the order renamed_tensors hands them over."""
    metas = layers.metas()
    return [(names[f"{i}.{sub}"], dt, shape) for i in layers.layers for sub, (dt, shape) in metas[i].items()]


def dominant(entries) -> torch.dtype:
    """The dtype holding most of the bytes: config.json's dtype, and that of tensors export makes up."""
    count = Counter()
    for _, dt, shape in entries:
        count[dt] += torch.Size(shape).numel() * dt.itemsize
    return count.most_common(1)[0][0] if count else torch.float32


def write_hf(source, out: str | Path, hf, names: dict[str, str], made=None, shard_size=None) -> Path:
    """source: a model or a layer source (mmpipe.hf.stream); hf: the HF config to write; names: mmpipe name ->
    HF name (the key map); made(name, shape, dtype): a tensor for an HF weight no mmpipe weight gives (LLaVA's
    cut tower: an identity post-LayerNorm), None if it cannot. A tied head's lm_head is not written (as
    save_pretrained drops it). shard_size: e.g. '5GB' (default transformers' own)."""
    layers, out = as_layers(source), Path(out)
    max_bytes = parse_size(shard_size or DEFAULT_SHARD_SIZE)
    entries = planned(layers, names)
    dtype = dominant(entries)
    meta = hf_meta_model(hf)
    theirs, saved = meta.state_dict(), saved_names(meta)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    given = {n: shape for n, _, shape in entries}
    for n, shape in given.items():
        if n not in theirs:
            raise RuntimeError(f"export: mmpipe weight for '{n}', which a {hf_model_class(hf).__name__} lacks")
        if tuple(theirs[n].shape) != tuple(shape):
            raise RuntimeError(f"export: '{n}' is {tuple(shape)}, a {hf_model_class(hf).__name__} expects "
                               f"{tuple(theirs[n].shape)}")
    extra = {}
    for n, t in theirs.items():
        if n in given or (tied and n == "lm_head.weight"):
            continue
        extra[n] = made(n, tuple(t.shape), dtype) if made else None
        if extra[n] is None:
            raise RuntimeError(f"export: no mmpipe weight for HF tensor '{n}'")
    entries += [(n, t.dtype, tuple(t.shape)) for n, t in extra.items()]
    out.mkdir(parents=True, exist_ok=True)
    hf.dtype = str(dtype).removeprefix("torch.")  # what save_pretrained writes: the weights' dtype
    hf.architectures = [hf_model_class(hf).__name__]
    hf.save_pretrained(out)
    _generation_config(hf).save_pretrained(out)
    entries = [(saved[n], dt, shape) for n, dt, shape in entries]
    # map, not a generator expression: its loop variable would keep the last tensor alive into the next layer
    tensors = map(lambda item: (saved[item[0]], item[1]), chain(renamed_tensors(layers, names), extra.items()))
    write_sharded(out, entries, tensors, max_bytes)
    return out


def _generation_config(hf):
    """The generation_config.json save_pretrained writes: transformers' own reading of the model config."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_model_config(hf)
    except NotImplementedError:
        return GenerationConfig()
