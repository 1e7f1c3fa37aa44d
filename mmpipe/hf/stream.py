"""Weights between source files and mmpipe's layers one layer at a time, never the whole model.

Import: an importer decides, from the source's names and shapes alone (mmpipe.hf.safetensors_io.LazyWeights
reads only headers), which source tensor fills each mmpipe weight (`Imported.assign`). `Imported.save` then
reads one layer's tensors, saves them as that layer's file in the source's dtype (bf16 in, bf16 layer files
out: DeepSpeed's engine and load_state_dict cast on load, as for any checkpoint) and drops them before the
next layer: the peak is the largest layer (Qwen2.5-VL-72B: the embedding, 152064 x 8192 x 2 B = 2.49 GB of
bf16, against 144 GB for the whole checkpoint) however large the model. `Imported.model` fills a single-device
model instead (tests, small models).

At `--tp N` (`Imported.save(tp=N)`) a layer the family's plan splits is written as N files, one per TP rank, as a
TP run's checkpoint holds it (layer_XX-model_RR-model_states.pt, mmpipe.runtime.reshard.layer_files), each read from
the source as that rank's rows alone (mmpipe.hf.safetensors_io.read_rows: plain reads of them): one TP rank's
file in memory at a time, 1 / N of the layer's split tensors and its whole replicated ones (norms); a layer the plan
does not split (LLaVA's tower) stays one whole file, which every rank reads.

Export: `RunLayers` reads a run's layer files one at a time (a plan pass reads only their shapes and dtypes,
mmap'ed; a TP run's layer gathered from its TP ranks' files through mmpipe.runtime.reshard.layer_state, the path
--resume and --init-from read), `MergedRunLayers` a LoRA run's with each layer's adapters merged as it is read,
`ModelLayers` serves a model already in memory; mmpipe.hf.export renames and writes them.
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
from ..model.tensor_parallel import split_dims
from ..registry import family_of
from ..runtime.reshard import layer_files, layer_state, meta_layer
from .safetensors_io import read_rows


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

    def layer_part(self, idx: int, subs: dict[str, str], dims: dict, part: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Layer idx's state as TP rank part[0] of part[1] holds it (dims: the plan's split dims, split_dims): each
        split tensor's rows read alone (read_rows), the others whole. A layer `made` from its read tensors (LLaVA's
        grown embedding) is made whole, then sliced."""
        if idx in self.made:
            whole = self.layer(idx, subs)
            return {k: _rows(t, *tp_rows(dims[k], t.shape, part)) if k in dims else t for k, t in whole.items()}
        return {sub: read_rows(self.source, src, *tp_rows(dims[sub], self.source.shape(src), part)) if sub in dims
                else self.source[src] for sub, src in subs.items()}

    def save(self, out: Path, tag: str = "imported", tp: int = 1) -> Path:
        """model.json + checkpoints/<tag>/layer_XX-model_states.pt, one layer in memory at a time; at tp > 1 a
        layer the plan splits as one file per TP rank (module docstring), one rank's slice in memory at a time."""
        d = out / "checkpoints" / tag
        d.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        meta, plan = (meta_model(self.cfg), family_of(self.cfg).tp_plan) if tp > 1 else (None, {})
        for idx, subs in sorted(self.by_layer().items()):
            dims = split_dims(meta[idx], plan, tp) if tp > 1 else {}
            for r in range(tp if dims else 1):
                state = self.layer_part(idx, subs, dims, (r, tp)) if dims else self.layer(idx, subs)
                torch.save(state, tp_layer_file(d, idx, r) if dims else layer_file(d, idx))
                del state  # the next rank's (layer's) tensors are read only now
                if dims:
                    _give_back()
        (out / "checkpoints" / "latest").write_text(tag)
        return out


def _give_back() -> None:
    """Hand the freed slices' heap pages back to the system (glibc's malloc_trim; elsewhere nothing): glibc keeps
    freed chunks under its mmap threshold, which rises to the size of the last freed one (up to 32 MiB), so a TP
    import's slices, read and freed one rank at a time, piled up in the heap: measured on scripts/bench_tp_import.py's
    model, the import's peak RSS at TP 2 / 4 was 94.9 / 73.0 MiB with slices of 62.5 / 31.2 MiB; trimmed after each
    rank's file, 68.6 / 35.4 MiB."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def tp_layer_file(d: Path, idx: int, rank: int) -> Path:
    """TP rank `rank`'s file of layer idx, DeepSpeed's name (PipelineModule.ckpt_layer_path at a model axis)."""
    return d / f"layer_{idx:02d}-model_{rank:02d}-model_states.pt"


def tp_rows(dim, shape: tuple, part: tuple[int, int]) -> tuple[int, list[tuple[int, int]]]:
    """(dim, the row ranges) of TP rank r's slice (part = (r, of)) of a whole tensor of `shape` split along dim (an
    int, or (dim, whole part widths) for a fused weight: the rank's 1 / of of each part, in order). E.g. a fused qkv
    of 3 x 64 rows at (1, 2): rows 32..63, 96..127, 160..191."""
    r, of = part
    d, widths = (dim, None) if isinstance(dim, int) else dim
    ranges, at = [], 0
    for n in widths or (shape[d],):
        ranges.append((at + r * n // of, at + (r + 1) * n // of))
        at += n
    return d, ranges


def _rows(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim).clone()


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
    use) has no file, as DeepSpeed writes it. A layer written by TP ranks (a --tp run's, `mmpipe import --tp`'s)
    is gathered from their files as it is loaded (mmpipe.runtime.reshard.layer_state at TP 1: its slices
    concatenated along the plan's split dims, one layer in memory)."""

    def __init__(self, ckpt: Path, cfg: ModelConfig, lora=None):
        self.dir, self.cfg, self.lora = ckpt, cfg, lora
        self.layers = [i for i, layer in enumerate(meta_model(cfg)) if layer.state_dict()]
        self.plan, self.specs = family_of(cfg).tp_plan, layer_specs(cfg)
        for i in self.layers:
            if not layer_files(ckpt, i):
                raise FileNotFoundError(f"checkpoint {ckpt.name} lacks layer {i}: {layer_file(ckpt, i)}")

    def metas(self) -> dict[int, dict[str, tuple[torch.dtype, tuple]]]:
        """Each layer's names, dtypes and whole shapes: a whole file's own; a TP layer's from its rank 0 file (the
        dtypes) and the layer built whole on the meta device (the shapes it gathers to)."""
        out = {}
        for i in self.layers:
            files = layer_files(self.dir, i)
            state = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
            shapes = ({k: tuple(t.shape) for k, t in meta_layer(self.specs[i], i, self.lora)().state_dict().items()}
                      if len(files) > 1 else {k: tuple(t.shape) for k, t in state.items()})
            out[i] = {k: (t.dtype, shapes[k]) for k, t in state.items()}
        return out

    def load(self, idx: int) -> dict[str, torch.Tensor]:
        files = layer_files(self.dir, idx)
        if len(files) == 1:  # mmap'ed: the writer pages each tensor in as it copies it
            return torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
        return layer_state(self.dir, idx, meta_layer(self.specs[idx], idx, self.lora), 0, 1, self.plan)


class MergedRunLayers(RunLayers):
    """A LoRA run's layers with their adapters folded into the base weights (W += (alpha / r) B A, as
    load_reference(merged=True)), one layer at a time: a layer file with adapters is loaded into that layer built
    alone with them, merged, and handed over under the base model's names."""

    def __init__(self, ckpt: Path, cfg: ModelConfig, lora):
        super().__init__(ckpt, cfg, lora)
        self.plain = meta_model(cfg)

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
