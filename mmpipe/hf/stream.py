"""Weights between source files and mmpipe's layers one layer at a time, never the whole model.

Import: an importer decides, from the source's names and shapes alone (mmpipe.hf.safetensors_io.LazyWeights
reads only headers), which source tensor fills each mmpipe weight (`Imported.assign`). `Imported.save` then
reads one layer's tensors, saves them as that layer's file in the source's dtype (bf16 in, bf16 layer files
out: DeepSpeed's engine and load_state_dict cast on load, as for any checkpoint) and drops them before the
next layer: the peak is the largest layer (Qwen2.5-VL-72B: the embedding, 152064 x 8192 x 2 B = 2.49 GB of
bf16, against 144 GB for the whole checkpoint) however large the model. `Imported.model` fills a single-device
model instead (tests, small models).

Export: `RunLayers` reads a run's layer files one at a time (a plan pass reads only their shapes and dtypes,
mmap'ed), `MergedRunLayers` a LoRA run's with each layer's adapters merged as it is read, `ModelLayers` serves a
model already in memory; mmpipe.hf.export renames and writes them.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.builder import ReferenceModel, build_layer, layer_specs, shapes_only
from ..model.lora import add_adapters, base_name, is_adapter, merge_adapters


def meta_model(cfg: ModelConfig) -> ReferenceModel:
    """The model's layers with meta weights: their names and shapes, no memory."""
    with shapes_only():
        return ReferenceModel(cfg)


def layer_file(d: Path, idx: int) -> Path:
    return d / f"layer_{idx:02d}-model_states.pt"


@dataclass
class Imported:
    """An import, decided but not yet read: cfg, assign (mmpipe name "<layer>.<sub>" -> source name), the
    source (lazy), the report (mmpipe.hf.llava.ImportReport), `extra` files to write beside the layers
    (moondream's region head: name -> tensors) and `made`: layer index -> a function of the layer's read
    tensors giving its state (LLaVA's stage-1 start: a fresh projector, an embedding grown by <image>'s row)."""
    cfg: ModelConfig
    assign: dict[str, str]
    source: object
    report: object
    extra: dict = field(default_factory=dict)
    made: dict[int, Callable[[dict], dict]] = field(default_factory=dict)

    def by_layer(self) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {i: {} for i in self.made}
        for mine, src in self.assign.items():
            idx, sub = mine.split(".", 1)
            out.setdefault(int(idx), {})[sub] = src
        return out

    def layer(self, idx: int, subs: dict[str, str]) -> dict[str, torch.Tensor]:
        state = {sub: self.source[src] for sub, src in subs.items()}
        return self.made[idx](state) if idx in self.made else state

    def model(self, dtype=torch.float32) -> ReferenceModel:
        """A single-device model with the weights, in dtype (every tensor cast as it is copied in)."""
        model = ReferenceModel(self.cfg).to(dtype)
        for idx, subs in self.by_layer().items():
            model[idx].load_state_dict(self.layer(idx, subs))
        return model

    def save(self, out: Path, tag: str = "imported") -> Path:
        """model.json + checkpoints/<tag>/layer_XX-model_states.pt, one layer in memory at a time."""
        d = out / "checkpoints" / tag
        d.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        for idx, subs in sorted(self.by_layer().items()):
            state = self.layer(idx, subs)
            torch.save(state, layer_file(d, idx))
            del state  # the next layer's tensors are read only now
        (out / "checkpoints" / "latest").write_text(tag)
        return out


def fill(model: ReferenceModel, source, assign: dict[str, str]) -> None:
    """Copy each assigned source tensor (mmpipe name -> source name) into the model, cast to its dtype, one
    tensor read at a time."""
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for mine, src in assign.items():
            params[mine].copy_(source[src])


class RunLayers:
    """A run checkpoint's layers, one file at a time: metas() -> per layer {sub: (dtype, shape)} (read mmap'ed:
    no weight enters memory), load(idx) -> the layer's state dict. A layer without weights (a tied head's later
    use) has no file, as DeepSpeed writes it."""

    def __init__(self, ckpt: Path, cfg: ModelConfig):
        self.dir, self.cfg = ckpt, cfg
        self.layers = [i for i, layer in enumerate(meta_model(cfg)) if layer.state_dict()]
        for i in self.layers:
            if not layer_file(ckpt, i).is_file():
                raise FileNotFoundError(f"checkpoint {ckpt.name} lacks layer {i}: {layer_file(ckpt, i)}")

    def metas(self) -> dict[int, dict[str, tuple[torch.dtype, tuple]]]:
        out = {}
        for i in self.layers:
            state = torch.load(layer_file(self.dir, i), map_location="cpu", weights_only=True, mmap=True)
            out[i] = {k: (t.dtype, tuple(t.shape)) for k, t in state.items()}
        return out

    def load(self, idx: int) -> dict[str, torch.Tensor]:
        return torch.load(layer_file(self.dir, idx), map_location="cpu", weights_only=True, mmap=True)


class MergedRunLayers(RunLayers):
    """A LoRA run's layers with their adapters folded into the base weights (W += (alpha / r) B A, as
    load_reference(merged=True)), one layer at a time: a layer file with adapters is loaded into that layer built
    alone with them, merged, and handed over under the base model's names."""

    def __init__(self, ckpt: Path, cfg: ModelConfig, lora):
        super().__init__(ckpt, cfg)
        self.lora, self.specs, self.plain = lora, layer_specs(cfg), meta_model(cfg)

    def metas(self):
        """The merged names and shapes (the plain layer's), each in its base weight's dtype."""
        out = {}
        for i, files in super().metas().items():
            dtypes = {base_name(k): dt for k, (dt, _) in files.items() if not is_adapter(k)}
            out[i] = {k: (dtypes[k], tuple(t.shape)) for k, t in self.plain[i].state_dict().items()}
        return out

    def load(self, idx: int) -> dict[str, torch.Tensor]:
        state = super().load(idx)
        if not any(is_adapter(k) for k in state):
            return state
        dtypes = {base_name(k): t.dtype for k, t in state.items() if not is_adapter(k)}
        layer = build_layer(self.specs[idx], idx, 0)  # fp32; every value is then the file's
        add_adapters(layer, idx, self.lora, 0)
        layer.load_state_dict(state)
        del state
        # merged in fp32, handed over in the base weights' own dtype (what metas planned)
        return {k: t.detach().to(dtypes[k]) for k, t in merge_adapters(layer).state_dict().items()}


class ModelLayers:
    """A single-device model's layers with RunLayers' interface (an export of a model in memory)."""

    def __init__(self, model: ReferenceModel):
        self.model, self.cfg = model, model.cfg
        self.layers = [i for i, layer in enumerate(model) if layer.state_dict()]

    def metas(self):
        return {i: {k: (t.dtype, tuple(t.shape)) for k, t in self.model[i].state_dict().items()} for i in self.layers}

    def load(self, idx: int) -> dict[str, torch.Tensor]:
        return {k: t.detach() for k, t in self.model[idx].state_dict().items()}


def as_layers(source):
    """A model in memory or a layer source as it is."""
    return ModelLayers(source) if isinstance(source, ReferenceModel) else source


def renamed_tensors(layers, names: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(new name, tensor) of every layer's weights in layer order, one layer loaded at a time; names:
    "<layer>.<sub>" -> the name to write."""
    for i in layers.layers:
        state = layers.load(i)
        for sub in list(state):
            yield names[f"{i}.{sub}"], state.pop(sub)  # the writer's reference is the last one
        del state
