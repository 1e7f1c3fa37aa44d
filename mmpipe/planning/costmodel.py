"""What each layer costs, in FLOPs, seconds and bytes, from the shapes it really sees.

Per layer and per sample (tokens: image tokens N for the ViT side, N + text for the decoder), or,
in the row layout (`--max-images M`, `--pack`: mmpipe.data.packing), per row: a row carries M image
slots through every per-image layer (the layers fed pixels or vision tokens: patch embedding, vision
blocks, projector), so each costs M x one image's, like a multi-crop tower's per-crop layers x crop
slots, and the decoder sees the row's L = M x N_dec + text_len positions (N_dec: an image's decoder
positions), e.g. llava-tiny at M = 4, text 96: the tower on 4 images, the decoder on 4 x 16 + 96 =
160 positions. M = 1 is the classic one-sample row (N_dec + text_len, e.g. 16 + 12 = 28). Every
"per sample" below is then "per row"; how many real samples (and useful, non-padding positions) a
row holds the data decides, not the cost model.

    forward FLOPs   2 per weight per token for matmuls, + 4 * tokens^2 * width for attention
                    (q k^T and attn v), a lookup for the embedding
    backward FLOPs  2x forward for a trainable layer (input and weight gradients); 1x for a frozen
                    layer behind a trainable one (input gradients only: they must reach the
                    trainable layers before it); 0 for a frozen prefix, e.g. a frozen ViT in front
                    of the first trainable layer, which runs no backward at all. The embeddings
                    (pixels, token ids in) have no input gradient: 1x if trainable, else 0; nor has a
                    trained DeepStack merger on a frozen tower (a branch: the tower's blocks after it
                    stay a frozen prefix)
    recompute       + forward again for a checkpointed block (activation checkpointing)
    W FLOPs         the part of the backward ZB-H1 defers (`--schedule zb-h1`, docs/schedules.md):
                    the weight gradients of the layer's trainable nn.Linear modules, g^T x, which
                    cost what their forward matmuls cost: 2 per trainable linear weight per token,
                    capped at the backward. So a trainable block's backward 2 x forward splits into
                    B = forward + attention (input gradients: 2 per weight per token, and q k^T, attn v
                    backward) and W = 2 x linear weights x tokens, W ~ half the backward when linears
                    dominate; under LoRA W is the adapters' 2 x adapter weights x tokens (half of
                    their 4 x); a frozen layer: W = 0 (B is its input gradient, 1 x forward); a frozen
                    prefix: B = W = 0; a trainable token embedding (nn.Embedding, not a linear): W = 0,
                    its weight gradient runs in B, as in the runtime. The remainder B = backward - W.

Activation bytes per sample: what autograd keeps for the backward, counted tensor by tensor
for mmpipe's own layers (tests compare it with torch's saved-tensor hooks on the CPU):

    PatchEmbed    N * patch_dim                        (the patch matrix the linear saw)
    VisionBlock   (9 d + 2 f) N + (4 + h) N floats      x, ln1 out, q k v, attn out, proj in,
                                                       ln2 in/out, fc1 out, gelu out; LN stats
                                                       (fp32) and the attention log-sum-exp
    VisionNorm    d N + 2 N                            input, LN stats
    Projector     d_v N + 2 f_p N                      fc1 in, fc1 out, gelu out
    TextEmbed     0 floats (token ids only)
    DecoderBlock  (7 D + 2 F) T + (2 + H) T            x, ln out, q k v, attn out, proj in,
                                                       fc1 out, gelu out (parallel block: one LN)
    LMHead        2 D T + 2 T, + V T fp32 logits for the loss's log-softmax
    CrossAttnBlock (9 D + 2 F + 4 + H) T + 3 D N + 3   x, ln1 out, q, attn out, proj in/out, x2, ln2
                                                       out, mlp out, fc1 out, gelu out; the image
                                                       and its k v; LN stats and log-sum-exp; the
                                                       per-sample gate products (cross_attention
                                                       fusion, whose decoder T is the text alone)

A family that carries features beside `hidden` in its stage tuple (mmpipe.model.stage: a float field made
by one layer, dropped after its last reader) sends each across every stage boundary between its maker and
that reader: `carried_elems`, counted in `boundary_elems` with the layer's own output (`_carry`, from the
family's fields, the schema the runtime binds). Each such field is costed by its own shape (_field_elems): a field
sized by the row (Gemma 4's per-layer inputs, shared K/V) its width x the row's positions; an MoE model's router
statistics (moe_stats) 2 x E fp32 a row; any other one projected image set of the row, its image tokens x D_text:
cross-attention fusion's image (M x N x D, from the text embedding to the last CrossAttnBlock), Qwen3-VL's DeepStack
sets (P / merge^2 x D each, deepstack_k from its merger to the add after decoder layer k), e.g. qwen3-vl-8b at
P = 16384: 4096 x 4096 per set, 3 of them (x 2 bytes in bf16 = 96 MiB per row) at a boundary inside the tower after
the last merger or before decoder layer 0's add, 1 after decoder layer 1's add, none after decoder layer 2's.

A layer that is frozen and sees no gradient (a frozen prefix) keeps nothing. With activation
checkpointing, a checkpointed block keeps only its input (T x width) between forward and
backward, plus, once per stage, one block's full set while it is recomputed (for the one
micro-batch in its backward, not for every micro-batch in flight).

A dynamic-resolution family (Qwen2-VL, image kind patches) has no fixed image: a row carries P
patches (--max-patches) through the tower whatever its M image slots, and the decoder sees the
data's L = 2 M + P / merge^2 + text_len positions; its vision rules (per_row) see the row's images
(PatchRow: mmpipe.planning.images), so attention counts each image's own patches and windows.

The rule of each layer kind is in mmpipe.model.costs; each family names its layers' rules
(mmpipe.families), and LLaVA's layers are costed as the moondream layers of the same shape.

Time: FLOPs / (peak FLOP/s x efficiency), or, calibrated (`mmpipe plan --profile`, and what the
CPU validation uses), the measured forward and backward seconds of each layer kind at the
run's micro-batch on this device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig
from ..data.image_kinds import image_kind
from ..data.packing import row_shape
from ..model.builder import adapter_param_counts, bound, layer_param_counts, layer_specs, shapes_only
from ..model.costs import DEEPSTACK_MERGER, Cost, CropRow, PatchRow
from ..model.lora import Lora
from ..model.stage import HIDDEN, live_fields
from ..registry import family_of
from .images import patch_row
from .schedule_registry import BASELINE, Schedule

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# what a layer takes in that is per image: pixels (patch embedding), vision tokens (blocks, norm, projector)
PER_IMAGE_INPUTS = ("pixels", "vision")


@dataclass(frozen=True)
class LayerCost:
    name: str
    group: str
    params: int
    trainable: bool
    tokens: int            # sequence positions per sample
    fwd_flops: float       # per sample
    bwd_flops: float       # per sample (0 for a frozen prefix)
    recompute: bool        # forward runs twice (activation checkpointing)
    act_elems: float       # activation elements kept for the backward, per sample, full (no checkpointing)
    act_fp32_elems: float  # of which always fp32 (LN statistics, softmax statistics, loss logits)
    out_elems: float       # the layer's output per sample: what a checkpointed block keeps, what crosses a boundary
    carried_elems: float = 0.0  # carried feature sets riding along in the stage tuple after it, per sample (_carry)
    carried_fp32_elems: float = 0.0  # of which always fp32, whole on every SP rank: an MoE model's moe_stats [2, E]
    embedding: bool = False  # pixels / token ids in: its full backward is 1x forward (weight gradients only)
    adapter_params: int = 0  # LoRA: the adapters' parameters, the layer's only trainable ones (in `params` too)
    w_flops: float = 0.0  # per sample, of bwd_flops: the trainable linears' weight gradients (ZB-H1's W)
    expert_params: int = 0  # an MoE block's experts (E x 3 D F, in `params` too): split over the EP ranks
    a2a_elems: float = 0.0  # an MoE block: one all-to-all's rows per sample, positions x top_k x D (moe_ep_costs)
    tied: str = ""  # a TiedLayerSpec's key (a tied embedding and head): one module, and one count, in a stage
    tp_ar_fwd: float = 0.0  # at TP > 1 (planning.tensor_parallel): all-reduced elements per sample, forward
    tp_ar_bwd: float = 0.0  # and backward
    sp_a2a: float = 0.0  # at SP > 1 (planning.sequence_parallel): a block's all-to-all elements a sample, each way
    # at SP > 1, the tower's last layer split over SP (planning.sequence_parallel.sp_layer_costs): its all-gather's
    # elements a sample, N_max x D_all (each rank receives SP - 1 of them), as many back in the reduce-scatter
    sp_gather: float = 0.0
    # at SP > 1, a tower layer split over SP: the row as each SP rank runs it where a cut inside the tower leaves the
    # tower replicated (whole on every rank: planning.sequence_parallel.sp_stage_rows picks it); None elsewhere
    replicated: LayerCost | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def expert_trainable(self) -> int:
        """The experts' share of trainable_params: all of them in a trainable layer, none under LoRA (the 3-D expert
        tensors are not linears, so they stay frozen)."""
        return self.expert_params if self.trainable and not self.adapter_params else 0

    @property
    def trainable_params(self) -> int:
        """What gets gradients and optimizer state: all of a trainable layer, only the adapters under LoRA."""
        return self.adapter_params or (self.params if self.trainable else 0)

    @property
    def boundary_elems(self) -> float:
        """What a stage boundary after this layer sends forward (and its gradient back), per sample."""
        return self.out_elems + self.carried_elems

    def boundary_bytes(self, precision: str) -> float:
        """boundary_elems in bytes, per sample: the router statistics at 4 B in every precision (route_stats' fp32),
        the rest at the precision's, e.g. gemma-4-26b-a4b in bf16 after a decoder layer: its hidden 2306 x 2816 x 2 B +
        moe_stats 2 x 128 x 4 B = 12,988,416 B."""
        fp32 = self.carried_fp32_elems
        return (self.boundary_elems - fp32) * BYTES[precision] + fp32 * 4

    @property
    def flops(self) -> float:
        return self.fwd_flops * (2 if self.recompute else 1) + self.bwd_flops

    def act_bytes(self, precision: str) -> float:
        """Per sample, kept from this layer's forward until its backward."""
        if self.bwd_flops == 0:
            return 0.0  # nothing will run backward through it
        if self.recompute:
            return self.out_elems * BYTES[precision]  # its input, which is the previous layer's output
        return (self.act_elems - self.act_fp32_elems) * BYTES[precision] + self.act_fp32_elems * 4


def layer_costs(cfg: ModelConfig, freeze: tuple[str, ...], text_len: int, checkpointing: bool = False,
                lora: Lora | None = None, images: int = 1, patches: PatchRow | None = None) -> list[LayerCost]:
    """With LoRA, an adapted layer's base runs as a frozen layer (input gradients only) and its
    adapters add 2 FLOPs per adapter weight per token forward, twice that backward; a layer of a
    LoRA group without adapters is frozen. images: image slots per row (the row layout's M; 1: one
    sample per row, the classic layout): per-image layers cost M x, the decoder sees M x N_dec + text_len.
    patches: a dynamic-resolution family's row (Qwen2-VL: P patches and its images' grids, from
    mmpipe.planning.images.patch_row; default: train's P with M images of the preset's image_size): its
    vision layers run on the row's P patches (per_row rules), the decoder on mmpipe.data.packing's L."""
    family = family_of(cfg)
    patches = patches or patch_row(cfg, images)
    n, seq = _tokens(cfg, text_len, images, patches)
    rows, seen_trainable = [], False
    frozen = set(freeze) | set(lora.groups if lora else ())
    counts = zip(layer_param_counts(cfg), adapter_param_counts(cfg, lora), linear_param_counts(cfg))
    for spec, (params, adapters, linear) in zip(layer_specs(cfg), counts):
        rule, group = family.cost_rule(spec), spec.typename.group
        trainable = (group not in frozen and params > 0) or adapters > 0
        c = rule.cost_of(cfg, params, n, seq, patches, spec.module_kwargs)
        if rule.takes in PER_IMAGE_INPUTS and not rule.per_row:
            c = _per_image(c, images)
        # a DeepStack merger branches off the tower's hidden state and passes it on unchanged: trained, it puts
        # its own set on the graph but not the tower's stream, so behind a frozen prefix (--freeze vision) it has
        # only weight gradients, and the frozen blocks after it stay a prefix that runs no backward
        branch = rule is DEEPSTACK_MERGER
        if rule.embedding or (branch and not seen_trainable):  # no input gradient: weight gradients only
            bwd = c.fwd if trainable else 0.0
        else:
            bwd = 2.0 * c.fwd if trainable and not adapters else (c.fwd if seen_trainable or adapters else 0.0)
        seen_trainable |= trainable and not branch
        fwd = c.fwd + 2.0 * adapters * c.tokens  # the adapters' two thin matmuls per adapted linear
        bwd += 4.0 * adapters * c.tokens if adapters else 0.0
        recompute = checkpointing and spec.typename in family.checkpointable and bwd > 0
        # ZB-H1's W: 2 per trainable linear weight per token (g^T x), e.g. a trainable block of 4d^2 + 2df
        # linear weights over N tokens: W = 2 (4d^2 + 2df) N of its backward 2 (2 (4d^2 + 2df) N + 4 N^2 d)
        w_params = adapters if adapters else (linear if trainable else 0)
        w = min(2.0 * w_params * c.tokens, bwd)
        rows.append(LayerCost(rule.name, group, params + adapters, trainable, c.tokens, fwd, bwd, recompute,
                              float(c.act), float(c.fp32), float(c.out), embedding=rule.embedding,
                              adapter_params=adapters, w_flops=w, tied=getattr(spec, "key", "") or "",
                              **_moe_fields(cfg, rule, c.tokens)))
    return _carry(cfg, rows, _image_set_elems(cfg, n, images, patches), seq)


def pair_image_rows(cfg: ModelConfig, rows: list[LayerCost]) -> list[LayerCost]:
    """rows (a row's costs, either side of a preference pair) as --objective dpo runs them: in a family whose tower
    encodes each pair's images once (mmpipe.data.preference.shares_images: the rejected row's images are neither
    loaded nor encoded, the tower's output placed on both rows) every tower and projector layer costs half a row's
    (FLOPs, kept activations, its output and the image sets it carries: [B / 2, ..] micro-batch tensors), and so
    does every image set a decoder layer carries (Qwen3-VL's DeepStack sets cross a cut at [B / 2, ..]); an MoE
    model's router statistics (carried_fp32_elems) stay a row's. Other families: rows unchanged (an image a side).
    E.g. qwen-tiny at 128 patches, 2 rows a pair: the tower's 128 patches a pair, 64 a row."""
    from ..data.preference import shares_images
    if not shares_images(cfg):
        return rows

    def half(r: LayerCost) -> LayerCost:
        sets = (r.carried_elems - r.carried_fp32_elems) / 2 + r.carried_fp32_elems
        if r.group not in ("vision", "projector") or r.name == "CrossAttnBlock":  # its queries: every row's text
            return dataclasses.replace(r, carried_elems=sets)
        return dataclasses.replace(r, fwd_flops=r.fwd_flops / 2, bwd_flops=r.bwd_flops / 2, w_flops=r.w_flops / 2,
                                   act_elems=r.act_elems / 2, act_fp32_elems=r.act_fp32_elems / 2,
                                   out_elems=r.out_elems / 2, carried_elems=sets)
    return [half(r) for r in rows]


def _moe_fields(cfg: ModelConfig, rule, tokens: int) -> dict:
    """An MoE block's expert weights and all-to-all rows (LayerCost.expert_params, a2a_elems); {} for any other
    layer (its rule says: LayerRule.experts), so a dense model's rows are unchanged. E.g. qwen3-vl-30b-a3b: 128 x 3 x
    2048 x 768 = 603,979,776 expert weights a block, and at 1024 positions 1024 x 8 x 2048 = 16,777,216 elements an
    all-to-all."""
    from ..model.moe import expert_params
    if not rule.experts:  # Qwen3-VL-MoE's block, Qwen3.5-MoE's two kinds
        return {}
    m = family_of(cfg).experts(cfg)
    return {"expert_params": m.experts * expert_params(cfg), "a2a_elems": float(tokens * m.top_k * cfg.text.dim)}


def moe_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """An MoE model's parameters (built on the meta device): total; active = what one token runs through, the total
    less the E - top_k experts it skips in each MoE block; experts = all blocks' expert weights (what `--ep` splits).
    E.g. 48 blocks of 128 experts of 3 x 2048 x 768 = 4,718,592 weights, top 8: experts 48 x 128 x 4,718,592 =
    28,991,029,248, active = total - 48 x 120 x 4,718,592 = total - 27,179,089,920. A tied embedding and head count
    once (unique_param_count), as the per-stage table counts them."""
    from ..model.moe import expert_params
    family = family_of(cfg)
    m = family.experts(cfg)
    blocks = sum(family.cost_rule(s).experts for s in layer_specs(cfg))
    total = unique_param_count(cfg)
    return {"total": total, "active": total - blocks * (m.experts - m.top_k) * expert_params(cfg),
            "experts": blocks * m.experts * expert_params(cfg), "blocks": blocks}


def unique_param_count(cfg: ModelConfig) -> int:
    """The model's parameters, each tensor once: a TiedLayerSpec's later uses (a tied head) are its first use's
    module (mmpipe.model.builder.ReferenceModel, DeepSpeed's tied_modules in one stage), so they add nothing, as
    stage_params counts a stage. E.g. gemma-4-26b-a4b: its 62 layers sum to 26,544,131,376, its head the embedding's
    262,144 x 2816 = 738,197,504 again: 25,805,933,872."""
    seen, total = set(), 0
    for spec, params in zip(layer_specs(cfg), layer_param_counts(cfg)):
        key = getattr(spec, "key", None)  # only a TiedLayerSpec has one
        if key is None or key not in seen:
            total += params
        seen.add(key)
    return total


def linear_param_counts(cfg: ModelConfig) -> list[int]:
    """Per layer, the parameters of its nn.Linear modules (exactly that type, as the runtime's B/W
    split defers them), built on the meta device."""
    import torch
    with shapes_only():
        return [sum(p.numel() for m in spec.build().modules() if type(m) is torch.nn.Linear for p in m.parameters())
                for spec in layer_specs(cfg)]


def _tokens(cfg: ModelConfig, text_len: int, images: int = 1, patches: PatchRow | None = None) -> tuple[int, int]:
    """(n, seq) per row: the tower's tokens per image (LLaVA: CLIP's class token too) and the decoder's
    positions M x N_dec + text_len, e.g. 16 image + 12 text = 28, 16 <image> placeholders + 12 text for
    LLaVA, 12 when the image is attended to; M = 4 slots of 16 + 96 text = 160 (rows). A dynamic family's
    row (patches): its P patches, and the data's L = M x 2 brackets + P / merge^2 + text_len; an any-resolution
    row (a CropRow): its T crops, and the data's L = the largest sample's image positions + text_len."""
    if patches is not None:  # either row kind: its budget (P patches, T crops) is what the tower runs on
        return patches.budget, row_shape(cfg, images, text_len, patches.budget).length
    per_image = image_kind(cfg).sample_positions(cfg, 1, 0)  # N_dec: spliced positions or <image>s (0: attended)
    return family_of(cfg).tower_tokens(cfg), images * per_image + text_len


def row_positions(cfg: ModelConfig, text_len: int, images: int = 1, patches: PatchRow | None = None) -> int:
    """Decoder positions per row, pads included (M x N_dec + text_len), as the cost model sees them."""
    return _tokens(cfg, text_len, images, patches or patch_row(cfg, images))[1]


def _per_image(c: Cost, images: int) -> Cost:
    """A per-image layer over a row's M image slots: M x every term (each image attends only within itself)."""
    if images == 1:
        return c
    return Cost(c.tokens * images, c.fwd * images, c.act * images, c.fp32 * images, c.out * images)


def _image_set_elems(cfg: ModelConfig, n: int, images: int, patches: PatchRow | CropRow | None) -> int:
    """One carried feature set of a row: its image tokens x D_text. A dynamic-resolution row: P / merge^2 merged
    tokens whatever its images (Qwen3-VL's DeepStack sets, [B, P / 4, D]; qwen3-vl-tiny at P = 128: 32 x 64);
    else M image slots of n tokens each (cross-attention's image, [B x M, N, D])."""
    return (patches.set_tokens(cfg, images, n) if patches is not None else images * n) * cfg.text.dim


def _carry(cfg: ModelConfig, rows: list[LayerCost], set_elems: int, seq: int) -> list[LayerCost]:
    """Each layer's carried_elems: the float fields besides hidden live in the tuple leaving it (the family's schema
    through mmpipe.model.stage.live_fields, as the runtime binds them), each by its own shape (_field_elems). E.g.
    qwen3-vl-tiny's list (DeepStack after tower blocks 0, 1, 3): after DeepstackMerger0 1 set, after DeepstackMerger1
    2, from DeepstackMerger2 through decoder layer 0 3, after DeepstackAdd0 2, after DeepstackAdd1 1, from
    DeepstackAdd2 on none; the cross-attention family's 1 from its text embedding up to its last CrossAttnBlock;
    gemma-4-e2b's per_layer from its embedding to its last decoder layer, and each shared K/V from its producer to
    its last consumer; an MoE model's moe_stats from its first MoE block to the head (carried_fp32_elems too)."""
    live = live_fields(family_of(cfg).fields(cfg), [s.typename for s in layer_specs(cfg)])
    sizes = [[_field_elems(cfg, f, set_elems, seq) for f in out if f.floating and f.name != HIDDEN.name]
             for out in live[1:]]
    return [dataclasses.replace(r, carried_elems=float(sum(n for n, _ in k)), carried_fp32_elems=float(
        sum(n for n, fp32 in k if fp32))) if k else r for r, k in zip(rows, sizes)]


def _field_elems(cfg: ModelConfig, field, set_elems: int, seq: int) -> tuple[int, bool]:
    """(elements a row, always fp32) of one carried float field, by its real shape: a field sized by the row
    (StageField.per_position) its elements a position x the row's seq decoder positions, e.g. gemma-4-e2b's
    per_layer 35 x 256 = 8960 a position, each shared K/V 2 x 1 x 256 sliding, 2 x 1 x 512 full; an MoE model's
    router statistics (mmpipe.model.moe's moe_stats [B, 2, E], fp32: route_stats) 2 x E a row whatever the row, e.g.
    2 x 128 = 256 for gemma-4-26b-a4b (not an image set: 256 x 2816 = 720,896 there, 11% on top of its hidden
    2306 x 2816); any other one image set."""
    from ..model.moe import MOE_STATS
    if field.per_position:
        return field.per_position(cfg) * seq, False
    if field.name == MOE_STATS.name:  # every MoE family's field is named so (the heads read t.moe_stats)
        return 2 * family_of(cfg).experts(cfg).experts, True
    return set_elems, False


# ---- memory per stage ---------------------------------------------------------------------------

def state_bytes(params: int, trainable: int, precision: str, zero_stage: int, dp: int) -> dict:
    """Model and optimizer state of one stage's rank, in bytes (AdamW: two fp32 moments).

        fp32        weights 4 N, gradients 4 N_t, moments 8 N_t
        bf16/fp16   weights 2 N, gradients 2 N_t, fp32 master weights 4 N_t, fp32 gradients 4 N_t
                    (DeepSpeed's mixed-precision optimizers accumulate in fp32), moments 8 N_t
    ZeRO-1 shards the fp32 master weights, fp32 gradients and moments over the DP replicas."""
    shard = dp if zero_stage >= 1 else 1
    if precision == "fp32":
        return {"weights": 4 * params, "grads": 4 * trainable, "optimizer": 8 * trainable / shard}
    return {"weights": 2 * params, "grads": 2 * trainable + 4 * trainable / shard,
            "optimizer": (8 + 4) * trainable / shard}


def rank_state_bytes(params: float, trainable: float, experts: float, expert_trainable: float, precision: str,
                     zero_stage: int, dp: int, ep: int = 1) -> dict:
    """state_bytes of one rank under expert parallelism (`--ep N`, docs/moe.md): the experts (of `params`, of
    `trainable`) split over the N ranks of an EP group, so a rank holds E / N of them, their ZeRO-1 shards over the
    DP / N ranks holding the same experts (the expert-data-parallel group, as DeepSpeed's MoE parameter groups
    shard them); everything else is a replica on all DP ranks, as without EP. ep = 1: state_bytes unchanged.
    E.g. fp32, ZeRO 0, 1000 weights of which 800 experts, all trained, N = 4: weights 4 x (200 + 800 / 4) = 1600 B,
    gradients the same, moments 8 x 400 = 3200 B."""
    if ep == 1 or not experts:
        return state_bytes(params, trainable, precision, zero_stage, dp)
    rest = state_bytes(params - experts, trainable - expert_trainable, precision, zero_stage, dp)
    mine = state_bytes(experts / ep, expert_trainable / ep, precision, zero_stage, dp // ep)
    return {k: rest[k] + mine[k] for k in rest}


def tied_repeats(rows: list[LayerCost]) -> tuple[int, int]:
    """(parameters, trainable parameters) that rows count more than once: a TiedLayerSpec's later uses in the same
    stage. DeepSpeed builds a tied module once per stage (PipelineModule.tied_modules) and a stage holding both the
    embedding and the head (e.g. PP 1) holds one copy, one gradient and one optimizer state; stages apart each hold
    their own copy. E.g. qwen3-vl-2b's tied 151,936 x 2048 = 311,164,928 embedding and head in one stage: its rows sum
    to 2,438,696,960, the model 2,127,532,032. Adapters (LoRA) are each use's own and not repeated."""
    seen, params, trainable = set(), 0, 0
    for r in rows:
        if not r.tied:
            continue
        if r.tied in seen:
            base = r.params - r.adapter_params
            params += base
            trainable += base if r.trainable and not r.adapter_params else 0
        seen.add(r.tied)
    return params, trainable


def stage_params(rows: list[LayerCost]) -> int:
    """The parameters a stage of these layers holds: each tied module once (tied_repeats)."""
    return sum(r.params for r in rows) - tied_repeats(rows)[0]


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """1F1B: stage s holds the activations of up to min(P - s, m) micro-batches at once."""
    return min(stages - stage, micro_batches)


@dataclass(frozen=True)
class Shape:
    """A layout's shape: P pipeline stages x DP data-parallel replicas (x TP ranks each), micro-batches of `micro` rows
    x GAS `gas` of them a step, and EP expert-parallel ranks (an MoE model's experts split over groups of ep of the dp
    ranks)."""
    stages: int
    dp: int
    micro: int
    gas: int
    ep: int = 1
    tp: int = 1  # tensor-parallel ranks of a stage (`--tp`; planning.tensor_parallel): world = stages x dp x tp x sp
    sp: int = 1  # sequence-parallel ranks of a stage (`--sp`; planning.sequence_parallel), each L / sp of the row


def reference_copy_bytes(rows: list[LayerCost], precision: str) -> float:
    """--objective dpo's live reference on a stage (mmpipe.runtime.preference.LiveReference): a copy of the stage's
    trained tensors other than LoRA adapters (a frozen group is shared), in the weights' own precision; no gradient,
    no optimizer state. E.g. 1000 trained fp32 weights: 4000 B more; a tied module in the stage twice counts once
    (tied_repeats). A precomputed reference holds none."""
    trained = sum(r.trainable_params - r.adapter_params for r in rows if r.trainable_params)
    return (trained - tied_repeats(rows)[1]) * BYTES[precision]


def stage_memory(rows: list[LayerCost], parts: list[int], stage: int, shape: Shape, precision: str, zero_stage: int,
                 micro_batches_in_flight: int | None = None, reference: bool = False) -> dict:
    """Bytes on one rank of `stage`: states + activations of the micro-batches in flight (1F1B's
    in_flight, or micro_batches_in_flight: another schedule's, e.g. ZB-H1's from its simulated order). shape.ep: the
    expert-parallel ranks the MoE blocks' experts are split over (rank_state_bytes); shape.gas: the micro-batches a
    step (1F1B holds min(P - s, m) of them). reference: dpo's live reference copy too (reference_copy_bytes)."""
    micro, micro_batches, dp, ep = shape.micro, shape.gas, shape.dp, shape.ep
    layers = rows[parts[stage]:parts[stage + 1]]
    repeated, repeated_trainable = tied_repeats(layers)
    params = sum(r.params for r in layers) - repeated
    trainable = sum(r.trainable_params for r in layers) - repeated_trainable
    mem = rank_state_bytes(params, trainable, sum(r.expert_params for r in layers),
                           sum(r.expert_trainable for r in layers), precision, zero_stage, dp, ep)
    per_sample = sum(r.act_bytes(precision) for r in layers)
    # one block's full activations while it is recomputed: once, for the one micro-batch in its backward
    # (not per micro-batch in flight, which keep only their checkpointed inputs)
    recompute = max((((r.act_elems - r.act_fp32_elems) * BYTES[precision] + r.act_fp32_elems * 4)
                     for r in layers if r.recompute), default=0.0)
    k = in_flight(stage, len(parts) - 1, micro_batches) if micro_batches_in_flight is None else micro_batches_in_flight
    mem["activations"] = (per_sample * k + recompute) * micro
    if reference:
        mem["reference"] = reference_copy_bytes(layers, precision)
    mem["total"] = sum(mem.values())
    return mem


class RangeMemory:
    """stage_memory's total for any contiguous range of layers in O(1): prefix sums of the parameters and the
    kept activations, and each range's largest recomputed block, built once (O(n^2) for the maxima). The
    balanced split asks it for every (stage, first, end): ~P n^2 times, e.g. 1M times for qwen2.5-vl-72b's
    117 layers at 32 stages, where summing each range anew took minutes."""

    def __init__(self, rows: list[LayerCost], precision: str, *, micro: int, micro_batches: int, zero_stage: int,
                 dp: int, ep: int = 1, reference: bool = False):
        """reference: --objective dpo's live reference copy counted on every stage (reference_copy_bytes)."""
        self.precision, n = precision, len(rows)
        self.copy, self.reference = [0.0], reference  # prefix sums of the reference copy's bytes (zero without)
        for r in rows:
            self.copy.append(self.copy[-1] + (reference_copy_bytes([r], precision) if reference else 0.0))
        self.micro, self.micro_batches, self.zero_stage, self.dp, self.ep = micro, micro_batches, zero_stage, dp, ep
        self.params, self.trainable, self.act, self.experts, self.expert_trainable = ([0.0] for _ in range(5))
        for r in rows:
            self.params.append(self.params[-1] + r.params)
            self.trainable.append(self.trainable[-1] + r.trainable_params)
            self.experts.append(self.experts[-1] + r.expert_params)
            self.expert_trainable.append(self.expert_trainable[-1] + r.expert_trainable)
            self.act.append(self.act[-1] + r.act_bytes(precision))
        full = [((r.act_elems - r.act_fp32_elems) * BYTES[precision] + r.act_fp32_elems * 4) if r.recompute else 0.0
                for r in rows]
        # a tied module's uses after its first, each with the use before it: a range holding both counts the later
        # one's weights once too many (tied_repeats)
        self.ties: list[tuple[int, int, float, float]] = []  # (previous use, use, params, trainable)
        last: dict[str, int] = {}
        for i, r in enumerate(rows):
            if r.tied and r.tied in last:
                base = r.params - r.adapter_params
                self.ties.append((last[r.tied], i, base, base if r.trainable and not r.adapter_params else 0))
            if r.tied:
                last[r.tied] = i
        self.recompute = [[0.0] * (n + 1) for _ in range(n + 1)]  # [a][b]: the largest in layers a..b-1
        for a in range(n):
            for b in range(a + 1, n + 1):
                self.recompute[a][b] = max(self.recompute[a][b - 1], full[b - 1])

    def total(self, a: int, b: int, stage: int, stages: int) -> float:
        """Bytes on a rank of `stage` (of `stages`) holding layers a..b-1, as stage_memory counts them (1F1B)."""
        inside = [(p, t) for i, j, p, t in self.ties if a <= i and j < b]
        state = rank_state_bytes(self.params[b] - self.params[a] - sum(p for p, _ in inside),
                                 self.trainable[b] - self.trainable[a] - sum(t for _, t in inside),
                                 self.experts[b] - self.experts[a], self.expert_trainable[b] - self.expert_trainable[a],
                                 self.precision, self.zero_stage, self.dp, self.ep)
        k = in_flight(stage, stages, self.micro_batches)
        return (sum(state.values()) + ((self.act[b] - self.act[a]) * k + self.recompute[a][b]) * self.micro
                + self.copy[b] - self.copy[a] - (sum(t for _, t in inside) * BYTES[self.precision] if self.reference
                                                 else 0.0))


# ---- time ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float      # dense FLOP/s at the training precision
    memory: float          # bytes per device
    link: float            # bytes/s between stages and for the data-parallel all-reduce
    efficiency: float = 0.45  # achieved share of peak on transformer layers (typical large-model MFU)
    # fixed costs FLOPs do not explain, fitted from a sweep by `mmpipe plan --calibrate` (0 = not modelled):
    # per pipeline slot (each of the m + P - 1 micro-batch slots: loading, the engine's per-instruction
    # work, launch latency) and per optimizer step (the optimizer, the gradient-norm and loss reductions)
    microbatch_overhead: float = 0.0  # seconds per slot
    step_overhead: float = 0.0        # seconds per step
    allreduce_link: float = 0.0       # bytes/s of the data-parallel gradient all-reduce (0: the same as link)
    # what splitting the backward costs ZB-H1 beyond its FLOPs, per W instruction (one per micro-batch on a
    # stage with W work): B's copy of the received gradient, W's own autograd call and separate matmuls.
    # Fitted by --calibrate from a sweep's zb-h1 variants; 0 = free, the uncalibrated planner's view
    split_overhead: float = 0.0       # seconds per W


# dense bf16 peaks from the vendors' data sheets; links: NVLink within a node
KNOWN_DEVICES = {
    "a100-40gb": Device("a100-40gb", 312e12, 40e9, 300e9),
    "a100-80gb": Device("a100-80gb", 312e12, 80e9, 300e9),
    "h100-80gb": Device("h100-80gb", 989e12, 80e9, 450e9),
    "h200": Device("h200", 989e12, 141e9, 450e9),
    "l40s": Device("l40s", 362e12, 48e9, 32e9),
}


def all_to_all(rows: list[LayerCost], parts: list[int], micro: int, precision: str, ep: int, device: Device
               ) -> list[dict]:
    """Per stage, the expert-parallel exchange of one micro-batch (mmpipe.model.moe.Experts.exchange): each MoE
    block sends its (position, choice) rows to the experts' owners and takes the results back, two all-to-alls of
    positions x top_k x D elements forward, and their gradients the same way backward (two more):

        bytes per direction (forward or backward) = 2 x sum over the stage's MoE blocks of positions x top_k x D
                                                    x micro x dtype bytes
        seconds per direction                     = bytes x (ep - 1) / ep / device.link

    (ep - 1) / ep: the share of the rows whose expert lives on another rank of the EP group when the router spreads
    them evenly (at ep = 1 nothing leaves the rank: 0 s). The exchange is on the critical path (the experts wait
    for their rows), so it adds to the stage's forward and backward. E.g. qwen3-vl-30b-a3b, 1024 positions, micro
    1, bf16: 2 x 1024 x 8 x 2048 x 2 = 64 MiB per block per direction; at ep 8 over 450 GB/s 7 / 8 of it takes
    0.131 ms."""
    out = []
    for a, b in zip(parts, parts[1:]):
        per_dir = 2 * sum(r.a2a_elems for r in rows[a:b]) * micro * BYTES[precision]
        out.append({"bytes": per_dir, "seconds": per_dir * (ep - 1) / ep / device.link})
    return out


def stage_seconds(rows: list[LayerCost], parts: list[int], micro: int, device: Device,
                  measured: dict | None = None) -> list[tuple[float, float]]:
    """(forward, backward) seconds per micro-batch for each stage. `measured` maps a layer name
    to its measured (forward, backward) seconds per sample (from profile_layers)."""
    out = []
    for a, b in zip(parts, parts[1:]):
        f = bw = 0.0
        for r in rows[a:b]:
            if measured and r.name in measured:
                mf, mb = measured[r.name]
                # the profile timed the trainable backward: 2x forward FLOPs, 1x for the embeddings
                full = r.fwd_flops * (1 if r.embedding else 2)
                bwd_share = r.bwd_flops / full if full else 0.0  # 1 trainable, 1/2 frozen behind one, 0 prefix
                f += mf * micro
                bw += (mb * bwd_share + (mf if r.recompute else 0.0)) * micro
            else:
                rate = device.peak_flops * device.efficiency
                f += r.fwd_flops * micro / rate
                bw += (r.bwd_flops + (r.fwd_flops if r.recompute else 0.0)) * micro / rate
        out.append((f, bw))
    return out


def stage_split_seconds(rows: list[LayerCost], parts: list[int], micro: int, device: Device,
                        measured: dict | None = None) -> list[tuple[float, float, float]]:
    """(forward, B, W) seconds per micro-batch for each stage: stage_seconds' backward split into B
    (input gradients, the rest of the backward, recompute included) and W (the trainable linears'
    weight gradients, LayerCost.w_flops), B + W = stage_seconds' backward. Measured, a layer's W is
    its timed trainable backward x w_flops / that backward's FLOPs (2 x forward; 1 x for an embedding)."""
    out = []
    for (f, bw), a, b in zip(stage_seconds(rows, parts, micro, device, measured), parts, parts[1:]):
        w = 0.0
        for r in rows[a:b]:
            if not r.w_flops:
                continue
            if measured and r.name in measured:
                full = r.fwd_flops * (1 if r.embedding else 2)
                w += measured[r.name][1] * (r.w_flops / full) * micro
            else:
                w += r.w_flops * micro / (device.peak_flops * device.efficiency)
        w = min(w, bw)
        out.append((f, bw - w, w))
    return out


def pipeline_step_seconds(stage_times: list[tuple[float, float]], micro_batches: int, boundary_bytes: list[float],
                          grad_bytes: float, dp: int, device: Device) -> dict:
    """1F1B with P stages and m micro-batches: every stage is busy m times and idle P - 1 slots,
    so the step takes (m + P - 1) x the slowest stage's forward + backward; each boundary moves a
    micro-batch's activations forward and their gradient back; data-parallel replicas then
    all-reduce gradients (ring: 2 (d - 1) / d of the largest stage's gradient bytes). A calibrated
    device adds its fixed costs: device.microbatch_overhead per slot, device.step_overhead per step."""
    p, m = len(stage_times), micro_batches
    slot = max(f + b for f, b in stage_times)
    comm = max(boundary_bytes, default=0.0) * 2 / device.link  # activation forward + gradient back
    allreduce = 2 * (dp - 1) / dp * grad_bytes / (device.allreduce_link or device.link) if dp > 1 else 0.0
    step = (m + p - 1) * (slot + comm + device.microbatch_overhead) + allreduce + device.step_overhead
    return {"step_s": step, "slot_s": slot, "bubble": (p - 1) / (m + p - 1), "p2p_s": comm, "allreduce_s": allreduce,
            "slots": m + p - 1}


def replayed_step_seconds(schedule: Schedule, stage_times: list[tuple[float, float, float]],
                          weight_stages: list[bool], micro_batches: int, boundary_bytes: list[float],
                          grad_bytes: float, dp: int, device: Device) -> dict:
    """A schedule other than the baseline (ZB-H1, `--schedule zb-h1`) as a change to
    pipeline_step_seconds' 1F1B step: both schedules' orders (mmpipe.planning.schedules: the unit-time
    orders the runtime runs) are replayed with these per-stage (F, B, W) seconds, each slot's p2p and
    per-slot overhead split half onto F, half onto B, and the schedule's step is 1F1B's minus what the
    replay says it saves:

        step_zb  = step_1f1b - (replay_1f1b - replay_zb)
        bubble   = 1 - m x slot / ((m + P - 1) x slot - (replay_1f1b - replay_zb)),
                   slot = the slowest stage's F + B + W + p2p + per-slot overhead

    (1F1B's own bubble (P - 1)/(m + P - 1) is the same formula with no saving). E.g. P = 2, m = 4,
    F = B = W = 1 s on both stages, free p2p: 1F1B 5 x 3 = 15 s, the replays 15 and 13, ZB-H1
    15 - 2 = 13 s, bubble 1 - 12/13 = 7.7% against 1 - 12/15 = 20%. A stage with weight_stages[i]
    False has no W: its B is the whole backward, its order 1F1B's. in_flight: the schedule's peak
    micro-batches per stage (ZB-H1: up to P on every stage with W, against 1F1B's P - s).
    device.split_overhead is added to every W of a schedule that splits the backward, in its replay
    only (1F1B does not split), so a split that costs more than the bubble it fills makes `saved`
    negative: ZB-H1 predicted slower."""
    from .schedules import predict
    m = micro_batches
    base = pipeline_step_seconds([(f, b + w) for f, b, w in stage_times], m, boundary_bytes, grad_bytes, dp, device)
    extra = (base["p2p_s"] + device.microbatch_overhead) / 2  # per micro-batch: half with F, half with B
    times = [(f + extra, b + extra, w) for f, b, w in stage_times]
    one = predict(BASELINE, m, times, weight_stages)
    split = [device.split_overhead if has_w and schedule.split_backward else 0.0 for has_w in weight_stages]
    own = predict(schedule, m, [(f, b, w + o) for (f, b, w), o in zip(times, split)], weight_stages)
    saved = one["makespan"] - own["makespan"]
    saved = 0.0 if abs(saved) <= 1e-9 * one["makespan"] else saved  # the same sums added in another order (P = 1)
    span = base["slots"] * (base["slot_s"] + base["p2p_s"] + device.microbatch_overhead)  # 1F1B's compute span
    no_bubble = m * (base["slot_s"] + base["p2p_s"] + device.microbatch_overhead)
    return {**base, "schedule": schedule.name, "step_s": base["step_s"] - saved,
            "bubble": 1 - no_bubble / (span - saved), "saved_s": saved, "replay_1f1b_s": one["makespan"],
            "replay_s": own["makespan"], "weight_stages": [bool(x) for x in weight_stages],
            "in_flight": own["in_flight"], "w_s": [w for _, _, w in stage_times]}


def profile_layers(cfg: ModelConfig, text_len: int, micro: int, precision: str = "fp32", repeats: int = 5,
                   threads: int = 1, images: int = 1, device: str | None = None) -> dict[str, tuple[float, float]]:
    """Measured (forward, backward) seconds per sample of each layer kind, trainable, at the run's
    micro-batch on this process's device, with `threads` threads (a rank's share: mmpipe train runs
    one per rank on CPU): the calibration `mmpipe plan --profile` uses instead of peak FLOP/s. images:
    a row's image slots (per-image layers timed on one image x M, the decoder on the row's positions).
    Backward is timed whole (input + weight gradients); stage_seconds scales it by each layer's
    backward share (1 trainable, 1/2 frozen behind a trainable one, 0 frozen prefix). device: where the
    layers and inputs live (default the CPU; `mmpipe check` times each rank's own, e.g. cuda:1), the
    accelerator synchronised around each timing (its kernels run asynchronously)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.device(device or "cpu"):  # the default device of every tensor and layer built inside
            return _profile(cfg, text_len, micro, precision, repeats, images)
    finally:
        torch.set_num_threads(before)


def _profile_rows(cfg: ModelConfig, text_len: int, micro: int, images: int) -> tuple:
    """Random rows of one sample each for the profile (mmpipe.model.stage): its `images` image blocks
    after BOS, then text; has_image [micro, images], segments 1 throughout."""
    import torch
    shape = row_shape(cfg, images, text_len)
    ids = torch.randint(0, cfg.text.vocab_size, (micro, shape.length))
    ids = torch.where(ids == shape.image_id, 0, ids)
    ids[:, 1:1 + images * shape.image_len] = shape.image_id
    return ids, torch.ones(micro, images, dtype=torch.long), torch.ones(micro, shape.length, dtype=torch.long)


def _with_row_fields(layer, args: tuple, floats, seq: int, cfg: ModelConfig) -> tuple:
    """args (hidden, *ints) with the carried floats the layer takes that no image makes, after hidden in its stage_in
    order: a field sized by the row (StageField.per_position: Gemma 4's per_layer, its shared K/V) as floats(seq,
    width), an MoE model's router statistics (mmpipe.model.moe's moe_stats, entering every sparse block but the
    first) as floats(2, E)."""
    def make(f):
        return floats(seq, f.per_position(cfg)) if f.per_position else floats(2, family_of(cfg).experts(cfg).experts)
    extra = tuple(make(f) for f in layer.__dict__.get("stage_in", ())
                  if f.floating and (f.per_position or f.name == "moe_stats"))
    return args[:1] + extra + args[1:] if extra else args


def _profile(cfg: ModelConfig, text_len: int, micro: int, precision: str, repeats: int, images: int = 1) -> dict:
    import time

    import torch
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    v, t = cfg.vision, cfg.text
    n, seq = _tokens(cfg, text_len, images)
    ints = _profile_rows(cfg, text_len, micro, images)  # the row's input_ids, has_image, segments
    n_feat = row_shape(cfg, images, text_len).image_len or n  # what fills an image (cross-attention: its tokens)

    def floats(*shape, rows=micro):
        return torch.randn(rows, *shape, dtype=dtype, requires_grad=True)
    inputs = {"pixels": lambda: (torch.randn(micro, 3, v.image_size, v.image_size, dtype=dtype), *ints),
              "vision": lambda: (floats(n, v.dim), *ints),  # vision tokens (per-image layers read no ints)
              "image": lambda: (floats(n_feat, t.dim, rows=micro * images), *ints),  # the projected images
              "sequence": lambda: (floats(seq, t.dim), *ints),
              "sequence+image": lambda: (floats(seq, t.dim), floats(n_feat, t.dim, rows=micro * images), *ints)}
    family, out = family_of(cfg), {}
    here = torch.empty(0).device
    sync = torch.cuda.synchronize if here.type == "cuda" else (lambda: None)
    for i, spec in enumerate(layer_specs(cfg)):
        rule = family.cost_rule(spec)
        if rule.name in out:
            continue
        layer = bound(spec.build().to(dtype), cfg, i)
        fwd, bwd = [], []
        for k in range(repeats + 1):
            args = _with_row_fields(layer, inputs[rule.takes](), floats, seq, cfg)
            sync()
            t0 = time.perf_counter()
            y = spec.forward_fn(layer, args) if getattr(spec, "forward_fn", None) else layer(args)  # a tied head
            y = y[0] if isinstance(y, tuple) else y
            sync()
            t1 = time.perf_counter()
            y.float().sum().backward()
            sync()
            t2 = time.perf_counter()
            if k:  # the first call warms up allocator and kernels
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        fwd.sort()
        bwd.sort()
        crops = cfg.vision.crop_slots if rule.per_crop else 1  # timed on one crop; multi-crop runs crop_slots
        crops *= images if rule.takes in PER_IMAGE_INPUTS else 1  # timed on one image; a row carries M
        out[rule.name] = (fwd[len(fwd) // 2] / micro * crops, bwd[len(bwd) // 2] / micro * crops)
    return out
