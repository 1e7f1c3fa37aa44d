"""LoRA adapters inside mmpipe's pipeline layers, through peft's own LoRA layers.

peft's `inject_adapter_in_model` works on any nn.Module, so each pipeline layer (one LayerSpec's
module) gets its adapters where it is built - in the single-device reference and on whichever
stage holds it - and DeepSpeed's PipelineModule, optimizer, checkpoints and ZeRO see ordinary
parameters. No PeftModel wrapper: it assumes one whole model in one process.

What `Lora` selects: every nn.Linear of the layers in `groups` (vision, projector, text) whose name
within its layer matches `targets` (a regular expression, searched; empty: every linear), except
the LM head (`adapters = False` on its class; adapting the vocabulary projection is rarely wanted
and would be the largest adapter). The base weights of every layer in `groups` are frozen -
embeddings, norms and head included; layers outside `groups` train or stay frozen as --freeze says.

Adapter count per adapted linear (in -> out): A [r, in] + B [out, r] = r (in + out). For moondream's
decoder block at rank r: qkv r(D + 3D) + proj 2rD + fc1 r(D + F) + fc2 r(F + D) = r(8D + 2F).

Initialisation: layer i's adapters are drawn under seed + ADAPTER_SEED + i (peft: A Kaiming-uniform,
B zero, so training starts from exactly the base model), whatever stage builds the layer, so the
pipeline and the reference start identical, as for the base weights (mmpipe.model.builder).

Dropout (--lora-dropout p): peft's lora_dropout[name] (nn.Dropout) is replaced by `SplitDropout`, which draws the
mask at the shape the single device's input has and keeps this rank's slice of it: the linear's `input_split`
((dim, rank, parts), ..), set by the one function that applies a parallel plan (tensor_parallel.parallelize: a row
linear's input is the feature slice [.., r D / TP : (r + 1) D / TP]; under --sequence-parallel a linear of a
POSITIONS layer outside the TP region reads positions r L / TP ..; sequence_parallel.parallelize_sequence: under --sp
a decoder block's linears read positions r L / SP .. of the padded row). Every rank of the model axis holds the same
RNG state (DeepSpeed reseeds each layer with base_seed x micro-batch + layer before its forward, on every rank), so
rank r's mask is exactly its slice of the single device's; without a split (one device, a column linear's replicated
input) the slice is the whole mask, F.dropout's own draw (bernoulli_(1 - p), / (1 - p)) bit for bit on the CPU.

State names: peft moves a wrapped linear's weights to `<name>.base_layer.weight` and adds
`<name>.lora_A.default.weight` / `.lora_B.` ; `base_state` / `load_base` translate between those
and the plain names imports, exports and --init-from use.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError

ADAPTER_SEED = 1_000_003  # far from the base layers' seed + i
LORA_MARK = ".lora_"
BASE_MARK = ".base_layer"
LORA_FILE = "lora.json"  # in a run directory: the adapters its checkpoints hold


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    dropout: float = 0.0
    groups: tuple[str, ...] = ("text",)
    targets: str = ""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank  # peft's scaling: delta W = (alpha / r) B A

    @classmethod
    def parse(cls, rank: int, alpha: float | None, dropout: float, groups: str, targets: str,
              valid_groups: tuple[str, ...]) -> "Lora":
        """From the flags (--lora, --lora-alpha, ...), checked: ConfigError names every bad one, one per line."""
        if rank < 1:
            raise ConfigError(f"--lora: rank {rank} must be >= 1 (0: no adapters)")
        names = tuple(g for g in groups.split(",") if g)
        alpha = 2.0 * rank if alpha is None else alpha
        bad = [g for g in names if g not in valid_groups]
        problems = [msg for wrong, msg in (
            (alpha <= 0, f"--lora-alpha: {alpha} must be > 0"),
            (not 0 <= dropout < 1, f"--lora-dropout: {dropout} must be in [0, 1)"),
            (bool(bad) or not names, f"--lora-groups: unknown or no group(s) {bad or groups!r} "
                                     f"(valid: {', '.join(valid_groups)})")) if wrong]
        try:
            re.compile(targets)
        except re.error as e:
            problems.append(f"--lora-targets: '{targets}' is not a regular expression ({e})")
        if problems:
            raise ConfigError("\n".join(problems))
        return cls(rank, alpha, dropout, names, targets)

    def to_dict(self) -> dict:
        return {**asdict(self), "groups": list(self.groups)}

    @classmethod
    def from_dict(cls, d: dict) -> "Lora":
        return cls(int(d["rank"]), float(d["alpha"]), float(d.get("dropout", 0.0)), tuple(d.get("groups", ("text",))),
                   str(d.get("targets", "")))


class SplitDropout(nn.Module):
    """peft's adapter dropout (nn.Dropout(p) on the adapter's input x) drawn whole and sliced (module docstring).
    split: ((dim, rank, parts), ..), x being part `rank` of `parts` equal parts along dim of the single device's input.
    Costs one bernoulli of the whole input's shape per adapted linear per rank, what the single device pays (e.g. a
    row-split down_proj's [B, T, F] at TP 2: each rank draws all B T F, keeps B T F / 2); only the slice is kept for
    backward."""

    def __init__(self, p: float, split: tuple = ()):
        super().__init__()
        self.p, self.split = p, tuple(split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        whole = list(x.shape)
        for dim, _, parts in self.split:
            whole[dim] *= parts
        keep = torch.empty(whole, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)  # F.dropout's CPU draw
        for dim, rank, _ in self.split:
            keep = keep.narrow(dim, rank * x.shape[dim], x.shape[dim])
        keep = keep.clone() if self.split else keep  # not a view: the whole mask is freed
        return x * keep.div_(1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.split}"


def read_lora(run_dir: str | Path) -> Lora | None:
    f = Path(run_dir) / LORA_FILE
    return Lora.from_dict(json.loads(f.read_text())) if f.is_file() else None


def target_names(layer: nn.Module, lora: Lora | None) -> list[str]:
    """The linears of `layer` that get an adapter, by their names within the layer."""
    if lora is None or getattr(layer, "group", None) not in lora.groups or not getattr(layer, "adapters", True):
        return []
    pattern = re.compile(lora.targets)
    return [n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and pattern.search(n)]


def add_adapters(layer: nn.Module, idx: int, lora: Lora | None, seed: int) -> int:
    """Freeze the base of a layer in lora.groups and give its target linears adapters. Returns the
    number of adapter parameters added."""
    if lora is None or getattr(layer, "group", None) not in lora.groups:
        return 0
    layer.requires_grad_(False)
    names = target_names(layer, lora)
    if not names:
        return 0
    from peft import LoraConfig, inject_adapter_in_model  # peft's import costs seconds; only LoRA runs pay it

    from .tensor_parallel import adapters_split
    torch.manual_seed(seed + ADAPTER_SEED + idx)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=names)
    with adapters_split(layer):  # --tp: drawn at the whole linear's sizes, then this rank's slices kept
        inject_adapter_in_model(config, layer)  # leaves only the adapters trainable within `layer`
    if lora.dropout > 0:  # each rank's slice of the single device's mask (SplitDropout)
        for _, _, adapted in lora_layers(layer):
            for name in adapted.lora_dropout:
                split = getattr(adapted.base_layer, "input_split", ())
                adapted.lora_dropout[name] = SplitDropout(lora.dropout, split)
    return sum(p.numel() for n, p in layer.named_parameters() if LORA_MARK in n)


def adapted_linears(layer: nn.Module, lora: Lora | None) -> list[tuple[str, nn.Linear]]:
    """(name, linear) of each linear of `layer` that gets an adapter (works on the meta device)."""
    if lora is None:
        return []
    linears = dict(layer.named_modules())
    return [(n, linears[n]) for n in target_names(layer, lora)]


def adapter_param_count(layer: nn.Module, lora: Lora | None) -> int:
    """r (in + out) per adapted linear, without building the adapters (works on the meta device)."""
    return sum(lora.rank * (m.in_features + m.out_features) for _, m in adapted_linears(layer, lora))


def is_adapter(name: str) -> bool:
    return LORA_MARK in name


def base_name(name: str) -> str:
    return name.replace(BASE_MARK, "")


def base_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state under plain names, adapters left out (the unmerged base)."""
    return {base_name(k): v for k, v in module.state_dict().items() if not is_adapter(k)}


def load_base(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load plain-named weights (an import, an --init-from run) into a module that may carry
    adapters: every base weight must be there, adapters keep their values."""
    own = {base_name(k): k for k in module.state_dict() if not is_adapter(k)}
    extra = sorted(set(state) - set(own))
    if any(is_adapter(k) for k in extra):
        raise ValueError("the source holds LoRA adapters; export it merged (mmpipe export) and import that as the base")
    missing, unexpected = module.load_state_dict({own.get(k, k): v for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not is_adapter(k)]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the layer: missing {missing[:3]}, unexpected {unexpected[:3]}")


def lora_layers(model: nn.Module):
    """(parent, attribute, peft LoRA layer) for every adapted linear in `model`."""
    from peft.tuners.lora import LoraLayer
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, LoraLayer)]


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += (alpha / r) B A, peft's merge) and put the plain
    linear back: the model then has the base model's names and shapes, for generate, eval and export."""
    for parent, name, layer in lora_layers(model):
        layer.merge()
        setattr(parent, name, layer.get_base_layer())
    return model


def strip_adapters(model: nn.Module) -> nn.Module:
    """Put the plain base linears back without merging: the frozen base as it was trained on."""
    for parent, name, layer in lora_layers(model):
        setattr(parent, name, layer.get_base_layer())
    return model
