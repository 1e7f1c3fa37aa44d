"""The mixture-of-experts fields of a transformers text config <-> mmpipe's MoeConfig (mmpipe.config; the model side
is mmpipe.model.moe, docs/moe.md). Qwen3-VL-MoE's (Qwen3VLMoeTextConfig) and Qwen3.5-MoE's (Qwen3_5MoeTextConfig):
the names are Qwen's MoE names, read the same way for both.

    num_experts (num_local_experts in config.json)  -> experts
    num_experts_per_tok                             -> top_k
    moe_intermediate_size                           -> ff_dim
    router_aux_loss_coef                            -> aux_coef
    shared_expert_intermediate_size                 -> shared_ff_dim (Qwen3.5-MoE; absent: 0, no shared expert)
    (transformers' Qwen3VLMoe and Qwen3_5Moe routers always renormalise their top k: norm_topk True)

What mmpipe's blocks do not implement is refused in one line: dense layers among the sparse ones
(decoder_sparse_step > 1, mlp_only_layers; Qwen3_5MoeTextConfig has neither field: every layer is sparse), and on
export a router that does not renormalise, a shared expert on Qwen3VLMoe (its class has none) and none on Qwen3_5Moe
(its class always has one).

The experts' tensors come in two layouts: transformers' in-memory one, which its save_pretrained writes and mmpipe
holds (gate_up_proj [E, 2F, D], down_proj [E, D, F]), and the transposed one of checkpoints written for the
earlier modeling code ([E, D, 2F], [E, F, D]), which transformers 5 transposes as it loads (its conversion mapping
for qwen3_vl_moe: transpose where the shape is not the model's). `ExpertLayout` reads the second as the first, lazily,
tensor by tensor, by the same rule: a square case (D = 2F, D = F) is taken as it is, as transformers takes it.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..config import ModelConfig
from ..model.qwen3_vl import MoeConfig
from .llava import _fail
from .safetensors_io import as_weights, read_rows


def moe_from_hf(tc) -> MoeConfig | None:
    """A transformers text config's experts, or None for a dense one (no num_experts)."""
    experts = getattr(tc, "num_experts", 0) or 0
    if not experts:
        return None
    if getattr(tc, "decoder_sparse_step", 1) != 1 or list(getattr(tc, "mlp_only_layers", None) or []):
        _fail("text_config", f"decoder_sparse_step {tc.decoder_sparse_step} / mlp_only_layers "
                             f"{list(tc.mlp_only_layers or [])}: dense layers between the sparse ones are not "
                             f"supported (valid: 1 / [])")
    return MoeConfig(experts=experts, top_k=tc.num_experts_per_tok, ff_dim=tc.moe_intermediate_size,
                     aux_coef=float(tc.router_aux_loss_coef), norm_topk=True,
                     shared_ff_dim=int(getattr(tc, "shared_expert_intermediate_size", 0) or 0))


def hf_moe_fields(moe: MoeConfig, model_type: str = "qwen3_vl_moe") -> dict:
    """moe_from_hf's inverse: the text config fields of transformers' Qwen3VLMoeTextConfig, or with model_type
    "qwen3_5_moe" of its Qwen3_5MoeTextConfig (which has the shared expert's width and no dense-layer fields)."""
    name = {"qwen3_vl_moe": "Qwen3VLMoe", "qwen3_5_moe": "Qwen3_5Moe"}[model_type]
    if not moe.norm_topk:
        _fail("text.moe.norm_topk", f"false: transformers' {name} router always renormalises its top k")
    common = dict(num_experts=moe.experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ff_dim,
                  router_aux_loss_coef=moe.aux_coef)
    if model_type == "qwen3_5_moe":
        if moe.shared_ff_dim < 1:
            _fail("text.moe.shared_ff_dim", f"{moe.shared_ff_dim}: transformers' {name} sparse block always has a "
                                            f"shared expert (shared_expert_intermediate_size >= 1)")
        return dict(common, shared_expert_intermediate_size=moe.shared_ff_dim)
    if moe.shared_ff_dim:
        _fail("text.moe.shared_ff_dim", f"{moe.shared_ff_dim}: transformers' {name} has no shared expert (valid: 0)")
    return dict(common, decoder_sparse_step=1, mlp_only_layers=[])


class ExpertLayout(Mapping):
    """A weights view (mmpipe.hf.safetensors_io's interface) in which transposed expert tensors read in transformers'
    in-memory layout; everything else as it is."""

    def __init__(self, source, cfg: ModelConfig):
        self.source = as_weights(source)
        t = cfg.text
        want = {"mlp.experts.gate_up_proj": (t.moe.experts, 2 * t.moe.ff_dim, t.dim),
                "mlp.experts.down_proj": (t.moe.experts, t.dim, t.moe.ff_dim)}
        self.flipped = {name for name in self.source for end, (e, a, b) in want.items()
                        if name.endswith(end) and (a, b) != (b, a) and tuple(self.source.shape(name)) == (e, b, a)}

    def __getitem__(self, name):
        t = self.source[name]
        return t.transpose(1, 2).contiguous() if name in self.flipped else t

    def rows(self, name, dim, ranges):
        """A slice along dim of the tensor as it reads here: of a flipped one, along the stored tensor's other dim."""
        if name not in self.flipped:
            return read_rows(self.source, name, dim, ranges)
        return read_rows(self.source, name, {1: 2, 2: 1}.get(dim, dim), ranges).transpose(1, 2).contiguous()

    def __contains__(self, name):  # not Mapping's, which reads the tensor
        return name in self.source

    def __iter__(self):
        return iter(self.source)

    def __len__(self):
        return len(self.source)

    def shape(self, name):
        s = tuple(self.source.shape(name))
        return (s[0], s[2], s[1]) if name in self.flipped else s

    def dtype(self, name):
        return self.source.dtype(name)


def expert_layout(source, cfg: ModelConfig):
    """source as ExpertLayout for an MoE config, unchanged for a dense one."""
    return ExpertLayout(source, cfg) if cfg.text.moe else source


class PerExpert(Mapping):
    """A weights view in which experts stored one module each (transformers' save format for qwen3_5_moe: its
    conversion mapping, the qwen2_moe one, splits the fused tensors on save and merges them on load) read as the fused
    tensors mmpipe holds:

        P.mlp.experts.{e}.gate_proj.weight [F, D], .up_proj.weight [F, D]  ->  P.mlp.experts.gate_up_proj [E, 2F, D]
                                                                                (expert e: gate rows, then up rows)
        P.mlp.experts.{e}.down_proj.weight [D, F]                          ->  P.mlp.experts.down_proj [E, D, F]

    read lazily, one fused tensor at a time (the E experts of one layer stacked); everything else as it is."""

    PART = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")

    def __init__(self, source):
        self.source = as_weights(source)
        self.parts: dict[str, list] = {}  # fused name -> [(expert, part, source name)]
        self.plain = []
        for name in self.source:
            m = self.PART.match(name)
            if m is None:
                self.plain.append(name)
                continue
            fused = m[1] + ("down_proj" if m[3] == "down" else "gate_up_proj")
            self.parts.setdefault(fused, []).append((int(m[2]), m[3] != "up", name))  # gate before up

    def _sources(self, fused):
        return [name for _, _, name in sorted(self.parts[fused], key=lambda p: (p[0], not p[1]))]

    def __getitem__(self, name):
        if name not in self.parts:
            return self.source[name]
        names = self._sources(name)
        if name.endswith("down_proj"):
            return torch.stack([self.source[n] for n in names])
        pairs = zip(names[0::2], names[1::2])  # (gate, up) of each expert
        return torch.stack([torch.cat([self.source[g], self.source[u]]) for g, u in pairs])

    def rows(self, name, dim, ranges):
        """A slice of a fused tensor read from each expert's own tensors' slices (a TP rank's F / TP of each expert:
        mmpipe.model.tp_plans.EXPERTS); along the expert dim, or of a plain tensor, as read_rows reads it."""
        if name not in self.parts:
            return read_rows(self.source, name, dim, ranges)
        if dim == 0:  # whole experts (no plan splits them so)
            return torch.cat([self[name].narrow(0, lo, hi - lo) for lo, hi in ranges]).clone()
        names = self._sources(name)
        if name.endswith("down_proj"):
            return torch.stack([read_rows(self.source, n, dim - 1, ranges) for n in names])
        if dim == 2:
            return torch.stack([torch.cat([read_rows(self.source, n, 1, ranges) for n in pair])
                                for pair in zip(names[0::2], names[1::2])])
        width = self.source.shape(names[0])[0]  # F: rows [0, F) are the gate's, [F, 2F) the up projection's
        return torch.stack([torch.cat([read_rows(self.source, n, 0, [(max(lo, off) - off, min(hi, off + width) - off)])
                                       for lo, hi in ranges for off, n in ((0, g), (width, u))
                                       if max(lo, off) < min(hi, off + width)])
                            for g, u in zip(names[0::2], names[1::2])])

    def __contains__(self, name):  # not Mapping's, which reads the tensor
        return name in self.parts or (name in self.source and self.PART.match(name) is None)

    def __iter__(self):
        return iter(self.plain + list(self.parts))

    def __len__(self):
        return len(self.plain) + len(self.parts)

    def shape(self, name):
        if name not in self.parts:
            return tuple(self.source.shape(name))
        names = self._sources(name)
        rows, cols = self.source.shape(names[0])
        if name.endswith("down_proj"):
            return (len(names), rows, cols)
        return (len(names) // 2, 2 * rows, cols)

    def dtype(self, name):
        return self.source.dtype(self._sources(name)[0] if name in self.parts else name)
