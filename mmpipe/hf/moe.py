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
"""
from __future__ import annotations

from ..config import MoeConfig
from .llava import _fail


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
