"""`mmpipe export --format peft`: a LoRA run's adapters as a peft adapter of the family's HF model
(a family with an HF class: its registry entry's HfSide gives the names and the base export).

OUT/adapter_config.json + OUT/adapter_model.safetensors load with
`peft.PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(OUT/base), OUT)` (or
Qwen2VLForConditionalGeneration's, ...);
OUT/base is the run's base model, unmerged, as `mmpipe export --format hf` writes a model (for a
run whose only trainable weights were the adapters, that is exactly its --init-from import).

Names: an adapter of mmpipe's layer i, `<i>.self_attn.q_proj.lora_A.default.weight`, sits on the
linear whose weight mmpipe.hf.llava.key_map names `model.language_model.layers.<k>.self_attn.q_proj
.weight`, so peft's key is `base_model.model.model.language_model.layers.<k>.self_attn.q_proj
.lora_A.weight`. peft itself writes the files (get_peft_model + set_peft_model_state_dict +
save_pretrained): its format, not a copy of it.
"""
from __future__ import annotations

import copy
from pathlib import Path

from ..model.builder import ReferenceModel
from ..model.lora import LORA_MARK, is_adapter, strip_adapters


def adapter_state(model: ReferenceModel, kmap: dict[str, str]) -> tuple[dict, list[str]]:
    """(peft state dict, HF module names that carry adapters) of a LoRA ReferenceModel; kmap: mmpipe base
    name -> HF name."""
    state, modules = {}, set()
    for name, tensor in model.state_dict().items():
        if not is_adapter(name):
            continue
        module, rest = name.split(LORA_MARK, 1)  # "12.self_attn.q_proj", "A.default.weight"
        hf_module = kmap[module + ".weight"][:-len(".weight")]
        modules.add(hf_module)
        state[f"base_model.model.{hf_module}.lora_{rest.split('.')[0]}.weight"] = tensor.detach().contiguous()
    return state, sorted(modules)


def export_adapter(model: ReferenceModel, out: str | Path, names, export_hf) -> Path:
    """names(cfg): mmpipe name -> HF name of every weight; export_hf(model, dir): the base as an HF directory."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForImageTextToText
    out = Path(out)
    base_dir = export_hf(strip_adapters(copy.deepcopy(model)), out / "base")
    hf_model = AutoModelForImageTextToText.from_pretrained(base_dir)  # the exported config's class
    state, modules = adapter_state(model, names(model.cfg))
    lora = model.lora
    peft_model = get_peft_model(hf_model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=modules))
    result = set_peft_model_state_dict(peft_model, state)
    if result.unexpected_keys:
        raise RuntimeError(f"export: peft did not take adapter tensor '{result.unexpected_keys[0]}'")
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
    peft_model.save_pretrained(out)
    return out
