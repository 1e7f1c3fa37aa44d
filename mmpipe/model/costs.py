"""What one layer costs per sample, by kind: the rules mmpipe.planning.costmodel applies to every
layer of a model's list. A family names the rule of each of its layer classes
(mmpipe.families); how the numbers are counted is in costmodel's docstring.

A rule sees the model config, the layer's parameter count and the tokens per sample: `n` on the
vision side (the tower's tokens), `seq` in the decoder (its positions: image + text). LLaVA's
layers use the rules of the moondream layers of the same shape, under the same names.

A dynamic-resolution family's vision layers (Qwen2-VL, `per_row` rules) run on the row's patch budget
instead: `n` is the row's P patches (--max-patches) whatever its images, and the rule also sees the
row's PatchRow (the grids of the images it holds), so attention counts each image's own patches (and,
in Qwen2.5's windowed blocks, each window's), and the layer's LayerSpec kwargs (a block's `full`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import ModelConfig


@dataclass(frozen=True)
class Cost:
    tokens: int   # sequence positions per sample the layer runs on
    fwd: float    # forward FLOPs per sample
    act: float    # activation elements kept for the backward, per sample
    fp32: float   # of which always fp32 (LN and softmax statistics, the loss's logits)
    out: float    # output elements per sample: what a boundary after the layer sends


@dataclass(frozen=True)
class LayerRule:
    name: str  # the layer kind it is reported as (mmpipe plan, the partition summary)
    cost: Callable[[ModelConfig, int, int, int], Cost]  # (cfg, params, n, seq) -> Cost
    takes: str  # its input, for profiling: pixels, vision, image, sequence or sequence+image
    embedding: bool = False   # pixels / token ids in: no input gradient, only weight gradients
    uses_image: bool = False  # reads the image beside the sequence (the stage tuple's `vision`)
    per_crop: bool = False    # runs once per crop slot: moondream multi-crop multiplies it by vision.crop_slots
    # runs on the row's patch budget (dynamic resolution): n = P per row, never x image slots; its cost
    # function takes the row's PatchRow and the layer's spec kwargs after (cfg, params, n, seq)
    per_row: bool = False
    # an MoE block: holds experts (`--ep` splits them over ranks) and runs their all-to-alls (planning.costmodel)
    experts: bool = False

    def cost_of(self, cfg: ModelConfig, params: int, n: int, seq: int, row: "PatchRow | None" = None,
                kwargs: dict | None = None) -> Cost:
        """The layer's cost per sample; a per-crop layer of a multi-crop model (vision.crop_slots > 1)
        encodes crop_slots crops of n tokens each (moondream2: 13 x 729 = 9477 tokens per sample),
        so every term scales by the slots (attention too: each crop attends only within itself).
        A per_row rule gets the row's images (row) and the layer's own kwargs (e.g. full=False)."""
        if self.per_row:
            return self.cost(cfg, params, n, seq, row, **(kwargs or {}))
        c, k = self.cost(cfg, params, n, seq), cfg.vision.crop_slots
        if not self.per_crop or k == 1:
            return c
        return Cost(c.tokens * k, c.fwd * k, c.act * k, c.fp32 * k, c.out * k)


def _patch_embed(cfg, params, n, seq):  # the patch matrix the linear saw
    return Cost(n, 2.0 * params * n, n * cfg.vision.patch_dim, 0.0, n * cfg.vision.dim)


def _vision_block(cfg, params, n, seq):
    v = cfg.vision
    return Cost(n, 2.0 * params * n + 4.0 * n * n * v.dim, (9 * v.dim + 2 * v.ff_dim) * n + (4 + v.n_heads) * n,
                (4 + v.n_heads) * n, n * v.dim)


def _vision_norm(cfg, params, n, seq):
    return Cost(n, 2.0 * params * n, cfg.vision.dim * n + 2 * n, 2 * n, n * cfg.vision.dim)


def _projector(cfg, params, n, seq):
    # keeps fc1's input (moondream2: global + pooled local crop features, 2 x 1152), fc1 out, gelu out
    return Cost(n, 2.0 * params * n, cfg.vision.proj_in_dim * n + 2 * cfg.proj_inner_dim * n, 0.0, n * cfg.text.dim)


def _text_embed(cfg, params, n, seq):  # a lookup, not a matmul; token ids are all it keeps
    return Cost(seq, float(cfg.text.dim * seq), 0.0, 0.0, seq * cfg.text.dim)


def _cross_attn_block(cfg, params, n, seq):
    """Text queries (seq = T) over N image keys, gated: q and proj over T, k v over N, q k^T and attn v
    (4 T N D), the gated MLP over T. Kept: besides the projections, each position's own-sample mask
    over the image keys (T x N, as SDPA's float mask) and its per-position gate (3 T)."""
    t, h = cfg.text, cfg.cross_attn_heads or cfg.text.n_heads
    fwd = 2.0 * 2 * t.dim * t.dim * (seq + n) + 4.0 * seq * n * t.dim + 2.0 * 2 * t.dim * t.ff_dim * seq
    act = (9 * t.dim + 2 * t.ff_dim + 7 + h) * seq + 3 * t.dim * n + seq * n
    return Cost(seq, fwd, act, (4 + h) * seq, seq * t.dim)


def _row_geometry(seq: int, rot_dim: int, mask: bool = True) -> tuple[float, float]:
    """(act, fp32) a decoder block keeps for its row's own geometry (mmpipe.model.attention.row_geometry):
    the fp32 rotary cos and sin at each sample's own positions, 2 x L x rot_dim, and with `mask` SDPA's
    per-row L x L mask, as the query's dtype (e.g. tiny at L = 28, rot_dim 8: 784 + 448 per row)."""
    return (seq * seq if mask else 0) + 2.0 * rot_dim * seq, 2.0 * rot_dim * seq


def _phi_block(cfg, params, n, seq):
    """The moondream-shaped DecoderBlock. Its row keeps an L x L mask on CPU: the image prefix (bidirectional
    past BOS) attends under the dense row_mask there; on CUDA (a BlockMask) and in the cross-attention family's
    text rows (causal, or the split by sample) it is an upper bound by L x L (docs/attention.md)."""
    t = cfg.text
    act, fp32 = _row_geometry(seq, t.rotary_dim)
    return Cost(seq, 2.0 * params * seq + 4.0 * seq * seq * t.dim,
                (7 * t.dim + 2 * t.ff_dim) * seq + (2 + t.n_heads) * seq + act, (2 + t.n_heads) * seq + fp32,
                seq * t.dim)


def _llama_block(cfg, params, n, seq):
    """LLaVA's LlamaBlock (mmpipe.model.llava; GQA, qkv bias or not), as autograd keeps it per position
    (tests/test_plan.py): 9 D (x, each RMSNorm's normalised input and output, q after RoPE, attention out,
    o_proj's input, x + attn) + 2 kv (k after RoPE, v: kv_heads x head_dim each) + 4 F (gate, silu, up,
    product) + fp32 the two RMSNorms' statistics and the log-sum-exp (2 + H); the row's rotary (_row_geometry).
    No L x L mask: one-sample rows attend causally, packed rows by sample (CPU: the split, whose gathered q, k, v
    and outputs replace those above one for one; CUDA: a BlockMask, a few KiB), docs/attention.md; only the
    MMPIPE_ATTENTION=dense reference keeps L^2 more, and CUDA heads under 16 wide (llava-tiny). E.g.
    llava-1.5-7b: 9 x 4096 + 2 x 4096 + 4 x 11008 = 89088 values."""
    t = cfg.text
    act, fp32 = _row_geometry(seq, t.head_dim, mask=False)
    kv = t.kv_heads * t.head_dim
    return Cost(seq, 2.0 * params * seq + 4.0 * seq * seq * t.dim,
                (9 * t.dim + 2 * kv + 4 * t.ff_dim) * seq + (2 + t.n_heads) * seq + act, (2 + t.n_heads) * seq + fp32,
                seq * t.dim)


def _final_norm(cfg, params, n, seq):  # nn.RMSNorm: its input, the statistic, the normalised input (the weight's)
    return Cost(seq, 2.0 * params * seq, 2 * cfg.text.dim * seq + seq, seq, seq * cfg.text.dim)


def _lm_head(cfg, params, n, seq):  # + the fp32 logits of the loss's log-softmax
    t = cfg.text
    return Cost(seq, 2.0 * params * seq, 2 * t.dim * seq + 2 * seq + t.vocab_size * seq,
                2 * seq + t.vocab_size * seq, seq * t.vocab_size)


def _linear_head(cfg, params, n, seq):  # LLaVA's head (its norm is FinalNorm): its input + the loss's fp32 logits
    t = cfg.text
    return Cost(seq, 2.0 * params * seq, (t.dim + t.vocab_size) * seq, t.vocab_size * seq, seq * t.vocab_size)


PATCH_EMBED = LayerRule("PatchEmbed", _patch_embed, "pixels", embedding=True, per_crop=True)
VISION_BLOCK = LayerRule("VisionBlock", _vision_block, "vision", per_crop=True)
VISION_NORM = LayerRule("VisionNorm", _vision_norm, "vision", per_crop=True)
PROJECTOR = LayerRule("Projector", _projector, "vision")
TEXT_EMBED = LayerRule("TextEmbed", _text_embed, "image", embedding=True)
# moves the image into the stage tuple: from here to the last CrossAttnBlock every boundary carries it
CROSS_ATTN_TEXT_EMBED = LayerRule("CrossAttnTextEmbed", _text_embed, "image", embedding=True, uses_image=True)
CROSS_ATTN_BLOCK = LayerRule("CrossAttnBlock", _cross_attn_block, "sequence+image", uses_image=True)
DECODER_BLOCK = LayerRule("DecoderBlock", _phi_block, "sequence")
LLAMA_BLOCK = LayerRule("LlamaBlock", _llama_block, "sequence")
FINAL_NORM = LayerRule("FinalNorm", _final_norm, "sequence")
LM_HEAD = LayerRule("LMHead", _lm_head, "sequence")
LINEAR_HEAD = LayerRule("LMHead", _linear_head, "sequence")  # LLaVA's LMHeadLinear and tied head


# ---- Qwen2-VL / Qwen2.5-VL (mmpipe.model.qwen2_vl): a row of P patches, images of any size ----------------

@dataclass(frozen=True)
class PatchRow:
    """A dynamic-resolution row's vision side: its patch budget P (--max-patches) and the grids (t, h, w), in
    patches, of the images it holds (together at most P; the rest is padding, each pad patch attending to
    itself only). E.g. P = 16384 with four 1024x768 images (smart_resize: 1036 x 756 px, 54 x 74 patches):
    4 x 3996 = 15984 used, 400 padding."""
    patches: int
    grids: tuple[tuple[int, int, int], ...] = ()
    kind = "patches"  # the row kind (mmpipe plan's words and lines for it: planning.report)
    flag = "--max-patches"  # its budget's flag

    @property
    def used(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    @property
    def budget(self) -> int:
        """P: the vision positions the row's tower runs on, whatever its images hold."""
        return self.patches

    @property
    def slots(self) -> int:
        """The image slots it holds: one grid each (a Qwen3-VL clip: one per temporal patch)."""
        return len(self.grids)

    def set_tokens(self, cfg: ModelConfig, images: int, n: int) -> int:
        """One carried image feature set's tokens: P / merge^2 merged tokens whatever its images (Qwen3-VL's
        DeepStack sets, [B, P / 4, D])."""
        return self.patches // cfg.vision.merge_size ** 2


def _windows(side: int, unit: int) -> list[int]:
    """A grid side of `side` patches cut into windows of `unit` patches (the last one shorter), e.g. 74, 8 ->
    9 x 8 + 2."""
    return [unit] * (side // unit) + ([side % unit] if side % unit else [])


def attention_pairs(v, row: PatchRow, full: bool) -> int:
    """Query-key pairs a Qwen vision block computes in a row: each image's frame attends within itself
    (t x (h w)^2), or in a windowed block (Qwen2.5, full False) within each window of window_size / patch
    patches a side (transformers' 4 x 4 merge units of 2 x 2 patches: 8 x 8 patches, edge windows smaller);
    every padding patch to itself. E.g. one 54 x 74-patch image: full 3996^2 = 15968016 pairs; windowed, its
    7 x 10 windows (54 = 6 x 8 + 6 rows, 74 = 9 x 8 + 2 columns): (6 x 64 + 36) x (9 x 64 + 4) = 243600."""
    unit = v.merge_size * (v.window_size // (v.patch_size * v.merge_size)) if v.window_size and not full else 0
    pairs = row.patches - row.used
    for t, h, w in row.grids:
        if unit:
            pairs += t * sum((a * b) ** 2 for a in _windows(h, unit) for b in _windows(w, unit))
        else:
            pairs += t * (h * w) ** 2
    return pairs


def _qwen_vision_block(cfg, params, n, seq, row, full=True):
    """n = P patches per row. Forward: the linears over P, attention 4 d x the pairs it computes (attention_pairs:
    per image, per window; the layers' Split batches each segment size through SDPA, so these pairs and no
    others, tests/test_vision_attention.py). Kept, as autograd keeps them (qwen-tiny, measured by
    tests/test_plan_qwen.py): per patch x, norm1's output (RMSNorm: and its normalised input), the proj input,
    x2, norm2's, the MLP input (7 d with RMSNorm, 5 d with LayerNorm), the MLP's (SwiGLU: gate, silu, up,
    product: 4 f; QuickGELU: fc1, sigmoid, product: 3 f), fp32 the norms' statistics (1 or 2 each) and the 2D
    rotary cos and sin (2 x head_dim); per patch in an image (row.used) the gathered q, k, v and SDPA's output
    (4 d) and fp32 log-sum-exp (h): a padding patch's output is its v, kept by nothing. No P x P mask (the
    MMPIPE_ATTENTION=dense reference keeps one more, P^2 as the query's dtype, and computes all P^2 pairs).
    E.g. Qwen2.5-VL-7B's tower (d 1280, f 3420, h 16) at P = 16384 holding 15984 patches: (7 x 1280 + 4 x 3420 +
    2 + 2 x 80) x 16384 + (4 x 1280 + 16) x 15984 = 456 M values per row and block."""
    v = cfg.vision
    rms = v.norm == "rmsnorm"
    mlp = 4 if v.mlp == "swiglu" else (3 if v.act == "quick_gelu" else 2)
    fp32 = (2 if rms else 4) + 2 * (v.dim // v.n_heads)
    used = min(row.used, n)
    fwd = 2.0 * params * n + 4.0 * v.dim * attention_pairs(v, row, full)
    act = ((7 if rms else 5) * v.dim + mlp * v.ff_dim + fp32) * n + (4 * v.dim + v.n_heads) * used
    return Cost(n, fwd, act, fp32 * n + v.n_heads * used, n * v.dim)


def _qwen_patch_embed(cfg, params, n, seq, row):  # the patch matrix [P, C T p p] the matmul saw
    return _patch_embed(cfg, params, n, seq)


def _qwen_merger(cfg, params, n, seq, row):
    """P patches in, P / merge^2 tokens out: ln_q's input and statistics (RMSNorm: and its output), its output
    regrouped as mlp.0's input, mlp.0's output (GELU's input), GELU's output: 5 P d + P (4 P d + 2 P with
    LayerNorm); the linears run on P / merge^2 tokens of merge^2 d."""
    v = cfg.vision
    rms, tokens = v.norm == "rmsnorm", n // (v.merge_size ** 2)
    stats = (1 if rms else 2) * n
    return Cost(tokens, 2.0 * params * tokens, (5 if rms else 4) * v.dim * n + stats, stats, tokens * cfg.text.dim)


def _qwen_embed(cfg, params, n, seq, row):
    """The lookup, and the row's P / merge^2 merged image tokens, which the gather onto the placeholders keeps."""
    tokens = n // (cfg.vision.merge_size ** 2)
    return Cost(seq, float(cfg.text.dim * seq), float(tokens * cfg.text.dim), 0.0, seq * cfg.text.dim)


QWEN_PATCH_EMBED = LayerRule("QwenPatchEmbed", _qwen_patch_embed, "pixels", embedding=True, per_row=True)
QWEN_VISION_BLOCK = LayerRule("QwenVisionBlock", _qwen_vision_block, "vision", per_row=True)
QWEN_MERGER = LayerRule("QwenMerger", _qwen_merger, "vision", per_row=True)
QWEN_EMBED = LayerRule("QwenEmbed", _qwen_embed, "image", embedding=True, per_row=True)
# QwenBlock is LlamaBlock under multimodal rotary (3 x [L] positions, the same fp32 cos / sin [L, head_dim]):
# autograd keeps the same tensors (measured on qwen-tiny, tests/test_plan_qwen.py)
QWEN_BLOCK = LayerRule("QwenBlock", _llama_block, "sequence")


# ---- LLaVA-NeXT / OneVision (mmpipe.model.llava_next): a row of T crops, each image as base + tiles ----------

@dataclass(frozen=True)
class CropRow:
    """An any-resolution row's vision side: its crop budget T (--max-tiles) and the tiling (orig_h, orig_w, rows,
    cols) of each image it holds (1 + rows x cols crops each, rows = cols = 0: the base crop only; together at
    most T, the rest zero crops the tower encodes all the same). E.g. llava-v1.6 (CLIP-L 336, pinpoints up to
    2 x 2): T = 5 for one 672 x 672 image."""
    crops: int
    tilings: tuple[tuple[int, int, int, int], ...] = ()
    kind = "crops"  # the row kind (mmpipe plan's words and lines for it: planning.report)
    flag = "--max-tiles"  # its budget's flag

    @property
    def budget(self) -> int:
        """T: the crops the row's tower encodes, zero crops included."""
        return self.crops

    @property
    def slots(self) -> int:
        """The image slots it holds: one tiling each (a OneVision clip: one)."""
        return len(self.tilings)

    def set_tokens(self, cfg: ModelConfig, images: int, n: int) -> int:
        """One carried image feature set's tokens: M image slots of n tokens each."""
        return images * n


def _crops(cfg: ModelConfig, row: CropRow | None) -> int:
    """The row's T crops; without a row, one image of the largest pinpoint's tiles (the base crop + them)."""
    if row is not None:
        return row.crops
    S = cfg.vision.image_size
    return 1 + max((h // S) * (w // S) for h, w in cfg.vision.grid_pinpoints)


def _on_crops(rule):
    """A per-crop rule of llava.py's tower run on the row's T crops: every term x T (attention within a crop)."""
    def cost(cfg, params, n, seq, row):
        k, n = _crops(cfg, row), cfg.vision.n_positions
        c = rule(cfg, params, n, seq)
        return Cost(c.tokens * k, c.fwd * k, c.act * k, c.fp32 * k, c.out * k)
    return cost


def _anyres_projector(cfg, params, n, seq, row):
    """The projector on T x N features (the moondream projector's rule), then the row's [L, D] it scatters them
    onto (the newline-joined features are views and one concatenation: one [L, D] more kept)."""
    k, n = _crops(cfg, row), cfg.vision.n_features
    c = _projector(cfg, params, n, seq)
    return Cost(c.tokens * k, c.fwd * k, c.act * k + seq * cfg.text.dim, 0.0, seq * cfg.text.dim)


def _anyres_embed(cfg, params, n, seq, row):  # the lookup; torch.where keeps only its bool mask
    return _text_embed(cfg, params, n, seq)


ANYRES_PATCH_EMBED = LayerRule("PatchEmbed", _on_crops(_patch_embed), "pixels", embedding=True, per_row=True)
ANYRES_VISION_BLOCK = LayerRule("VisionBlock", _on_crops(_vision_block), "vision", per_row=True)
ANYRES_PROJECTOR = LayerRule("AnyresProjector", _anyres_projector, "vision", per_row=True)
ANYRES_EMBED = LayerRule("TextEmbed", _anyres_embed, "image", embedding=True, per_row=True)


# ---- Qwen3-VL (mmpipe.model.qwen3_vl): Qwen2-VL's rules, plus DeepStack's mergers and adds ------------------

def _deepstack_merger(cfg, params, n, seq, row):
    """The merger's rule on the row's P patches (its norm runs on the merged 4 d vectors: the same elements);
    what a boundary after it sends is the tower's hidden state, P x d, passed on unchanged. The set it makes,
    P / merge^2 x D_text, rides in the stage tuple to its add (not yet counted at boundaries: docs/qwen3_vl.md)."""
    c = _qwen_merger(cfg, params, n, seq, row)
    return Cost(n, c.fwd, c.act, c.fp32, n * cfg.vision.dim)


def _deepstack_add(cfg, params, n, seq):
    """One add of D per image position (at most seq), no weights; keeps nothing (the gather's indices only)."""
    return Cost(seq, float(cfg.text.dim * seq), 0.0, 0.0, seq * cfg.text.dim)


DEEPSTACK_MERGER = LayerRule("DeepstackMerger", _deepstack_merger, "vision", per_row=True)
DEEPSTACK_ADD = LayerRule("DeepstackAdd", _deepstack_add, "sequence")
