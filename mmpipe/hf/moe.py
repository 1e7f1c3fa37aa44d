"""The mixture-of-experts fields of a transformers text config <-> mmpipe's MoeConfig (mmpipe.config; the model side
is mmpipe.model.moe, docs/moe.md). Qwen3-VL-MoE's (Qwen3VLMoeTextConfig) first; the names are Qwen's MoE names, so
a later Qwen MoE family can read them the same way.

    num_experts (num_local_experts in config.json)  -> experts
    num_experts_per_tok                             -> top_k
    moe_intermediate_size                           -> ff_dim
    router_aux_loss_coef                            -> aux_coef
    (transformers' Qwen3VLMoe router always renormalises its top k: norm_topk True)

What mmpipe's blocks do not implement is refused in one line: dense layers among the sparse ones
(decoder_sparse_step > 1, mlp_only_layers), and on export a router that does not renormalise.

The experts' tensors come in two layouts: transformers' in-memory one, which its save_pretrained writes and mmpipe
holds (gate_up_proj [E, 2F, D], down_proj [E, D, F]), and the transposed one of checkpoints written for the
earlier modeling code ([E, D, 2F], [E, F, D]), which transformers 5 transposes as it loads (its conversion mapping
for qwen3_vl_moe: transpose where the shape is not the model's). `ExpertLayout` reads the second as the first, lazily,
tensor by tensor, by the same rule: a square case (D = 2F, D = F) is taken as it is, as transformers takes it.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..config import ModelConfig, MoeConfig
from .llava import _fail
from .safetensors_io import as_weights


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
                     aux_coef=float(tc.router_aux_loss_coef), norm_topk=True)


def hf_moe_fields(moe: MoeConfig) -> dict:
    """moe_from_hf's inverse: the text config fields of transformers' Qwen3VLMoeTextConfig."""
    if not moe.norm_topk:
        _fail("text.moe.norm_topk", "false: transformers' Qwen3VLMoe router always renormalises its top k")
    return dict(num_experts=moe.experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ff_dim,
                router_aux_loss_coef=moe.aux_coef, decoder_sparse_step=1, mlp_only_layers=[])


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
    return ExpertLayout(source, cfg) if getattr(cfg.text, "moe", None) else source
