"""One model definition, two ways to run it.

`layer_specs(cfg)` is the model: a flat list of DeepSpeed LayerSpecs

    PatchEmbed, VisionBlock x n_vision, VisionNorm, Projector, TextEmbed, DecoderBlock x n_text, LMHead

(moondream2: 1 + 27 + 1 + 1 + 1 + 24 + 1 = 56 layers), or with `fusion: cross_attention` a
CrossAttnBlock before every k-th decoder block (mmpipe.model.cross_attention), or LLaVA's
(mmpipe.model.llava): each family builds its own (mmpipe.families). The same list feeds
deepspeed.pipe.PipelineModule (mmpipe.runtime.pipeline) and, built in one process, the single-device
reference (`build_reference`). Layer i is always initialised under torch.manual_seed(seed + i),
so both get identical weights whatever the stage count.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import ConfigError, ModelConfig
from ..registry import family_of
from .lora import Lora, adapted_linears, adapter_param_count, add_adapters
from .moe import split_aux
from .rows import sample_rows
from .stage import bind_fields

IGNORE_INDEX = -100
FREEZE_GROUPS = ("vision", "projector", "text")


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    return family_of(cfg).layers(cfg)


def bind_layer_fields(layers, cfg: ModelConfig, start: int = 0) -> None:
    """Each built layer (global index start + k) learns the stage tuple fields it takes and returns, from
    its family's schema (mmpipe.model.stage): the reference, the pipeline's stages and generation alike."""
    bind_fields(layers, family_of(cfg).fields(cfg), [s.typename for s in layer_specs(cfg)], start)


def bound(layer, cfg: ModelConfig, i: int):
    """Layer i of cfg's list, built alone (a measurement, a test), told the stage tuple fields of its place."""
    bind_layer_fields([layer], cfg, i)
    return layer


def layer_group(spec: LayerSpec) -> str:
    return spec.typename.group


def build_layer(spec: LayerSpec, idx: int, seed: int) -> nn.Module:
    torch.manual_seed(seed + idx)  # the same seed_fn(base_seed + idx) PipelineModule(seed_layers=True) uses
    return spec.build()


def apply_freeze(layers, freeze: tuple[str, ...]) -> None:
    for layer in layers:
        if getattr(layer, "group", None) in freeze:
            layer.requires_grad_(False)


def lm_loss(logits: torch.Tensor, labels) -> torch.Tensor:
    """The training loss. logits [B, T, V]; labels [B, T], the token each position should predict next,
    IGNORE_INDEX everywhere but answer tokens: the mean cross-entropy over the micro-batch's labelled
    positions. labels (labels, weights [B, T] float): the sum of cross-entropy x weight, the weights
    of mmpipe.data.packing.LossNorm making the step's loss a mean over the global batch (--loss-norm).
    An MoE model's head gives (logits, aux_coef x its load-balancing loss): added (mmpipe.model.moe)."""
    logits, aux = split_aux(logits)
    if aux is not None:
        return lm_loss(logits, labels) + aux
    if isinstance(labels, (tuple, list)):
        labels, weights = labels
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="none")
        return (ce * weights.flatten()).sum()
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The SUM of cross-entropy over labelled positions: validation divides by the set's answer
    tokens, so micro-batches with more answer tokens weigh more (mmpipe.runtime.validation)."""
    logits = split_aux(logits)[0]  # an MoE head's auxiliary loss is a training term, not validation's
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class TiedCall(nn.Module):
    """A TiedLayerSpec's later use: DeepSpeed's forward_fn on the module built at its first use.
    The module is held outside the submodules, so its weights are saved and loaded once (DeepSpeed
    writes no layer file for this position either)."""

    def __init__(self, module: nn.Module, forward_fn):
        super().__init__()
        self._tied, self.forward_fn, self.group = [module], forward_fn, getattr(module, "group", None)

    @property
    def module(self) -> nn.Module:
        return self._tied[0]

    def forward(self, args):
        return self.forward_fn(self._tied[0], args)

    def decode(self, t, cache: dict, start: int):  # the logits (a tied MoE head returns its aux loss too)
        return split_aux(self.forward_fn(self._tied[0], t.pack()))[0]


def _build_all(specs: list[LayerSpec], seed: int) -> list[nn.Module]:
    layers, tied = [], {}
    for i, s in enumerate(specs):
        if isinstance(s, TiedLayerSpec) and s.key in tied:
            layers.append(TiedCall(tied[s.key], s.forward_fn) if s.forward_fn else tied[s.key])
            continue
        layers.append(build_layer(s, i, seed))
        if isinstance(s, TiedLayerSpec):
            tied[s.key] = layers[-1]
    return layers


class ReferenceModel(nn.Sequential):
    """The single-device model: the pipeline's layer list run in order in one process."""

    def __init__(self, cfg: ModelConfig, seed: int = 1234, freeze: tuple[str, ...] = (), lora: Lora | None = None):
        super().__init__(*_build_all(layer_specs(cfg), seed))
        self.cfg, self.lora = cfg, lora
        bind_layer_fields(self, cfg)
        apply_freeze(self, freeze)
        for i, layer in enumerate(self):
            add_adapters(layer, i, lora, seed)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, has_image: torch.Tensor,
                segments: torch.Tensor, tiling: torch.Tensor | None = None) -> torch.Tensor:
        """The stage contract's first input (mmpipe.model.stage; one prompt per row: mmpipe.model.rows.sample_rows);
        tiling for multi-crop (pixel_values [B, M, vision.crop_slots, C, H, W]). -> logits [B, L, V]."""
        inputs = (pixel_values, input_ids, has_image, segments) + (() if tiling is None else (tiling,))
        return super().forward(inputs)

    def one_per_row(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, has_image: torch.Tensor | None = None,
                    tiling: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] of one prompt per row: input_ids [B, T] (BOS first; LLaVA: placeholders in place),
        has_image [B] (default: all), turned into rows by mmpipe.model.rows.sample_rows (moondream: L = N_img + T,
        the image after BOS; LLaVA, cross-attention: L = T)."""
        return split_aux(self(pixel_values, *sample_rows(self.cfg, input_ids, has_image), tiling))[0]  # MoE: logits


class _ShapesOnly(TorchFunctionMode):
    """Under the meta device, initialisation returns its input unchanged: counting parameters reads
    their shapes, never their values. torch runs some init ops on meta tensors (normal_, a tensor times
    a scalar: nn.Embedding's init, a learned position table's randn x 0.02) through Python decompositions
    whose first use imports torch._dynamo, ~1.6 s of CPU in every process that resolves a run (the
    front door and each rank) for values nobody reads. A random draw on meta (torch.randn: PatchEmbed's
    position table) goes through torch._refs, whose pin_memory check imports sympy (~1 s): it becomes
    torch.empty, the same meta tensor."""
    INIT = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_, torch.Tensor.mul_,
            torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul, torch.nn.init.normal_,
            torch.nn.init.trunc_normal_, torch.nn.init.uniform_, torch.nn.init.zeros_, torch.nn.init.ones_,
            torch.nn.init.constant_}

    DRAWS = {torch.randn, torch.rand}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.DRAWS:
            return torch.empty(*args, **(kwargs or {}))
        if func in self.INIT:  # the tensor operand: an in-place op's target, or a product's shape
            return next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shapes_only():
    """Modules built inside have meta parameters of the right shapes and no values (counting only)."""
    with torch.device("meta"), _ShapesOnly():
        yield


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Parameters per layer, built on the meta device: no memory is allocated even for moondream-2b."""
    with shapes_only():
        return [sum(p.numel() for p in s.build().parameters()) for s in layer_specs(cfg)]


def check_lora_rank(cfg: ModelConfig, lora: Lora | None) -> None:
    """--lora's rank at most the smallest adapted linear's min(in, out), else ConfigError: B A of a linear
    has rank <= min(in, out), so a higher rank only adds parameters (llava-tiny at --lora 100000: 51 M
    adapter weights on a 49 K-parameter model). Counted on the meta device."""
    if lora is None:
        return
    kinds = {(s.typename, repr(s.module_kwargs)): s for s in layer_specs(cfg)}  # the repeated blocks: one each
    with shapes_only():
        widths = [(min(m.in_features, m.out_features), f"{type(layer).__name__}.{n}", m.in_features, m.out_features)
                  for layer in (s.build() for s in kinds.values()) for n, m in adapted_linears(layer, lora)]
    if widths and lora.rank > min(widths)[0]:
        width, name, n_in, n_out = min(widths)
        raise ConfigError(f"--lora: rank {lora.rank} is more than {cfg.name}'s adapted linears can use: the "
                          f"narrowest, {name} ({n_in} -> {n_out}), takes rank {width} at most (B A's rank <= "
                          f"min(in, out)); use --lora {width} or less")


def adapter_param_counts(cfg: ModelConfig, lora: Lora | None) -> list[int]:
    """LoRA adapter parameters per layer (0 without LoRA), counted on the meta device."""
    if lora is None:
        return [0] * len(layer_specs(cfg))
    with shapes_only():
        return [adapter_param_count(s.build(), lora) for s in layer_specs(cfg)]
