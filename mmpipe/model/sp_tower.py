"""The vision tower under --sp, split across a stage's SP ranks by whole images (issue 58 deliver 3;
docs/sequence_parallel.md, "The vision tower").

Without this every SP rank ran the tower on every image of the micro-batch. Here each SP rank encodes its share of
the images and the features are gathered after the tower's last layer, so every rank holds every image's features
again (the decoder embedding places them on the whole row and keeps its slice: mmpipe.model.sequence_parallel).

What a unit of work is. The tower attends within one image only, and within one temporal patch of a clip (Qwen2-VL /
Qwen2.5-VL's full and window blocks, Qwen3-VL's and Qwen3.5's blocks: qwen2_vl.vision_segments keys every patch on
its slot and frame; the 2D rotary and Qwen3's learned positions read a patch's (row, col) in its frame's grid), so
a clip of t temporal patches of h x w is, to the tower, t images of (1, h, w) one after the other: the unit is an
image, or one temporal patch of a clip (a whole frame pair, never part of one), and a 1280-frame clip's 640 units
split over SP as a single image cannot. LLaVA's unit is an image (B x M crops of one size, unused slots skipped).

Who runs which unit: the longest-processing-time greedy on patch counts, the same on every rank (it reads only the
micro-batch's integer tensors, which every SP rank loads whole): units largest first (ties: the first), each to the
least loaded rank (ties: the lowest). A rank's load is then at most total / SP + the largest unit (and within 4/3 of
the best split): 64, 32 and 16 patches at SP 2 give 64 | 32 + 16 = 48 (the best), 8 equal frames 4 | 4. Padding
patches (the row's patch budget beyond its images) and unused slots are no one's: the unsplit tower computed them
for nothing (no placeholder reads them).

How the tower runs on a rank's units (PatchTower: the Qwen families): the stage tuple keeps its fields, the tower's
layers run unchanged on a pseudo-row [1, P_r, ..] of the rank's units' patches back to back, and the row's integer
tensors are rewritten so that the tower reads the units as the slots of that row, yet nothing is lost: tiling becomes
[1, 1 + B x M + U_r, c] (a header (P, B, M), the B x M original slots, then the U_r units' grids (1, h, w)) and
has_image the matching [1, ..] (header -1, the original slots -(has_image) - 1, the units 1): the tower reads a slot
with has_image <= 0 as unused (qwen2_vl.used_grids), so it sees the units alone, and after its last layer the
original tiling and has_image come back exact (decode). No side channel: activation checkpointing recomputes a chunk
of layers from the tuple alone. LLaVA's tower (ImageTower) runs on the rank's images [n_r, C, H, W] directly.

The gather (gather_tokens, after the tower's last layer: the merger / projector): every float field there is per
merged image token (hidden and Qwen3-VL's DeepStack sets deepstack_k, made by the mergers inside the tower, so split
the same way), concatenated on the feature dim into one block [N_r, D_all] a rank. Forward: all-gather of the blocks
padded to the largest, N_max (gloo's all-gather takes equal sizes), into the whole [B, P / merge^2, D] (LLaVA: [B x M,
N, D]) at each token's place, zeros at padding tokens, as the stage's fixed shapes need (a cut after the tower sends
them). Cost: each rank receives (SP - 1) x N_max x D_all, N_max <= N_total / SP + the largest unit's tokens: no
more than the image positions of the row the embedding already holds whole on every rank. Backward (exact): each
rank's gradient of the whole features is its own positions' share (the embedding and DeepstackAdd keep their slice),
so the reduce-scatter of the [SP x N_max, D_all] gradients (the all-gather's adjoint) hands each rank the sum over SP
of its own tokens' gradients, the single device's; its units' tower backward then gives its images' share of the
tower's parameter gradients, and the step's SP sum (sum_gradients_at_step) adds the shares: the whole.

dpo's pairs (--objective dpo, a family sharing a pair's images: mmpipe.model.rows): the tower's input holds B / 2
rows' images, the even rows', and so the units are theirs alone (rows.tower_rows / pair_rows), each pair's images
dealt and encoded once; the gathered features are [B / 2, ..], which the embedding reads for both rows of a pair
(rows.slot_images), as on one device. The encoded header keeps the tower's row count (PatchTower: its has_image flag
-rows; ImageTower: the odd rows' has_image as -h - 1), so leave needs no side channel here either.

Where it applies: only a stage holding the tower's first and last layer (the patch embedding and the merger /
projector): there the split and the gather are one stage's business and the wire (mmpipe.runtime.wire: floats of
fixed shapes a micro-batch) carries only whole [B, P / merge^2, D] features, as without SP. A cut inside the tower
leaves it replicated (each SP rank runs it whole, as before): each rank's part would have a shape that changes with
every micro-batch. The planner's default cuts keep the tower whole on stage 0 (Qwen3-VL's fixed_first_stage does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .llava import LlavaProjector, VisionEmbed
from .qwen2_vl import QwenMerger, QwenPatchEmbed, used_grids
from .qwen3_vl import Qwen3Merger, Qwen3PatchEmbed
from .rows import pair_rows, tower_rows
from .stage import unpack_in, unpack_out
from .tensor_parallel import Shard

TOWER = "sp_tower"  # the key of a family's sp_plan entry naming its tower (PatchTower / ImageTower)


def greedy(sizes: list[int], ranks: int) -> list[list[int]]:
    """Units (their sizes) -> each rank's units, ascending: largest first to the least loaded (module docstring)."""
    loads, owned = [0] * ranks, [[] for _ in range(ranks)]
    for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        loads[r] += sizes[u]
        owned[r].append(u)
    return [sorted(o) for o in owned]


@dataclass(frozen=True)
class Assignment:
    """Each rank's share: rows, its input rows in the whole input (patches of the flattened [B x P] row, or images of
    [B x M]); tokens, its output tokens' places in the whole flattened output (per rank, in its block's order)."""
    rows: list[torch.Tensor]
    tokens: list[torch.Tensor]


def _cat(parts: list[torch.Tensor], device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


class _GatherTokens(torch.autograd.Function):
    """[N_r, D] of each rank -> the whole [total, D], each rank's rows at its tokens' places (zeros elsewhere);
    backward: the reduce-scatter of the gradients, each rank's own tokens' summed over SP (module docstring)."""

    @staticmethod
    def forward(ctx, local, tokens, total, shard):
        counts = [len(t) for t in tokens]
        top = max(counts)
        src = _cat([r * top + torch.arange(n, device=local.device) for r, n in enumerate(counts)], local.device)
        dest = _cat(tokens, local.device)
        ctx.shard, ctx.src, ctx.dest, ctx.top, ctx.n = shard, src, dest, top, len(local)
        out = local.new_zeros(total, local.shape[1])
        if top:
            padded = torch.cat([local, local.new_zeros(top - len(local), local.shape[1])])
            gathered = local.new_empty(shard.size * top, local.shape[1])
            dist.all_gather_into_tensor(gathered, padded.contiguous(), group=shard.group)
            out[dest] = gathered[src]
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.top:
            return grad.new_zeros(0, grad.shape[1]), None, None, None
        send = grad.new_zeros(ctx.shard.size * ctx.top, grad.shape[1])
        send[ctx.src] = grad[ctx.dest]
        mine = grad.new_empty(ctx.top, grad.shape[1])
        dist.reduce_scatter_tensor(mine, send, group=ctx.shard.group)
        return mine[:ctx.n], None, None, None


def gather_tokens(fields: dict, assignment: Assignment, shape: tuple, shard: Shard) -> dict:
    """Each rank's per-token floats {name: [1 or n, .., D]} (its units' tokens in order) -> the whole ones of shape
    (..., D) (shape: the leading dims, e.g. (B, P / merge^2)), one collective for all of them (cat on the features)."""
    names = list(fields)
    n = len(assignment.tokens[shard.rank])  # the rank's tokens (a rank without images: its padding's dropped)
    flat = [fields[k].reshape(-1, fields[k].shape[-1])[:n] for k in names]
    widths = [f.shape[1] for f in flat]
    total = 1
    for s in shape:
        total *= s
    whole = _GatherTokens.apply(torch.cat(flat, 1), assignment.tokens, total, shard)
    return {k: w.reshape(*shape, w.shape[1]).to(fields[k].dtype) for k, w in zip(names, whole.split(widths, 1))}


def _run_entry(layer, shard: Shard, tower, unit: int):
    whole = layer.forward

    def forward(args):
        return whole(tower.enter(unpack_in(layer, args), shard, unit).pack())
    return forward


def _run_exit(layer, shard: Shard, tower):
    whole = layer.forward

    def forward(args):
        return tower.leave(unpack_out(layer, whole(args)), layer, shard).pack()
    return forward


class PatchTower:
    """The Qwen families' tower (Qwen2-VL / Qwen2.5-VL, Qwen3-VL with DeepStack, Qwen3.5): a row of patches, each
    slot's grid (t, h, w) in tiling; units are temporal patches (module docstring)."""

    def __init__(self, entry: type, exit: type):
        self.entry, self.exit = entry, exit

    @staticmethod
    def units(grids: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
        """Used grids [B, M, 3] -> (row b, first patch in the row, patches, h, w) per temporal patch, slot order."""
        out = []
        for b, row in enumerate(grids.tolist()):
            start = 0
            for t, h, w in row:
                out += [(b, start + f * h * w, h * w, h, w) for f in range(t)]
                start += t * h * w
        return out

    def assign(self, grids: torch.Tensor, P: int, unit: int, size: int) -> tuple[Assignment, list]:
        """(each rank's share, each rank's units (units' entries)); unit: patches a merged token (merge^2), P: the
        row's patch budget."""
        units, dev = self.units(grids), grids.device
        owned = [[units[u] for u in o] for o in greedy([u[2] for u in units], size)]
        rows = [_cat([b * P + s + torch.arange(n, device=dev) for b, s, n, _, _ in o], dev) for o in owned]
        tokens = [_cat([b * (P // unit) + s // unit + torch.arange(n // unit, device=dev) for b, s, n, _, _ in o], dev)
                  for o in owned]
        return Assignment(rows, tokens), owned

    def enter(self, t, shard: Shard, unit: int):
        """The patch embedding's input: the rank's units' patches as a pseudo-row, the integer tensors encoded. A
        rank without units (fewer images and frames than SP ranks) runs `unit` (merge^2) padding patches, as the
        tower cannot take none; leave drops their token."""
        (rows, P), B = t.hidden.shape[:2], t.has_image.shape[0]  # rows: B, or B / 2 (dpo's pairs: rows.tower_rows)
        assignment, owned = self.assign(used_grids(tower_rows(t)), P, 1, shard.size)
        mine = owned[shard.rank]
        (M, c), dev, long = t.tiling.shape[1:], t.tiling.device, t.tiling.dtype
        header = torch.tensor([[P, B, M] + [0] * (c - 3)], device=dev, dtype=long)
        grids = torch.tensor([[1, h, w] + [0] * (c - 3) for *_, h, w in mine], device=dev, dtype=long).view(-1, c)
        tiling = torch.cat([header, t.tiling.flatten(0, 1), grids])[None]
        # the header's flag -rows (<= -1: an unused slot to the tower) keeps the tower's row count for leave
        flags = t.has_image.new_tensor([-rows]), -t.has_image.flatten() - 1, t.has_image.new_ones(len(mine))
        pixels = t.hidden.flatten(0, 1)[assignment.rows[shard.rank]]
        pixels = pixels if len(pixels) else pixels.new_zeros(unit, pixels.shape[1])  # no slot holds them: padding
        return t._replace(hidden=pixels[None], tiling=tiling, has_image=torch.cat(flags)[None])

    @staticmethod
    def decode(t) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(P, the tower's rows, tiling [B, M, c], has_image [B, M]) of the row enter encoded."""
        P, B, M = t.tiling[0, 0, :3].tolist()
        c = t.tiling.shape[-1]
        rows = -int(t.has_image[0, 0])
        return P, rows, t.tiling[0, 1:1 + B * M].reshape(B, M, c), (-t.has_image[0, 1:1 + B * M] - 1).reshape(B, M)

    def leave(self, t, layer, shard: Shard):
        """The merger's output: every float field gathered to [rows, P / merge^2, D] (rows: B, or B / 2 where
        dpo's pairs share their images), the integer tensors decoded."""
        P, rows, tiling, has = self.decode(t)
        t = t._replace(tiling=tiling, has_image=has)
        grids = used_grids(t._replace(tiling=pair_rows(tiling, rows), has_image=pair_rows(has, rows)))
        assignment = self.assign(grids, P, layer.unit, shard.size)[0]
        floats = {k: getattr(t, k) for k in t.names if getattr(t, k).is_floating_point()}
        return t._replace(**gather_tokens(floats, assignment, (rows, P // layer.unit), shard))


class ImageTower:
    """LLaVA's tower: B x M images of one size (pixels [B, M, C, H, W]), unused slots (has_image 0) skipped; a
    unit is an image, so the greedy deals them round the ranks."""

    def __init__(self, entry: type, exit: type):
        self.entry, self.exit = entry, exit

    @staticmethod
    def assign(has_image: torch.Tensor, features: int, size: int) -> Assignment:
        used = (has_image.flatten() > 0).nonzero().squeeze(1).tolist()
        dev = has_image.device
        owned = [[used[u] for u in o] for o in greedy([1] * len(used), size)]
        return Assignment([torch.tensor(o, dtype=torch.long, device=dev) for o in owned],
                          [_cat([i * features + torch.arange(features, device=dev) for i in o], dev) for o in owned])

    def enter(self, t, shard: Shard, unit: int):  # noqa: ARG002 (PatchTower's signature)
        """The rank's images [n_r, C, H, W]; a rank without any runs one blank image (leave drops it). Where dpo's
        pairs share their images (pixels [B / 2, M, ..]) the units are the even rows' slots (rows.pair_rows), and
        the odd rows' has_image rides as -h - 1 (< 0, read by nothing in the tower) so leave knows the case."""
        has = pair_rows(t.has_image, t.hidden.shape[0])
        mine = self.assign(has, 1, shard.size).rows[shard.rank]
        images = t.hidden.flatten(0, t.hidden.dim() - 4)
        if has is not t.has_image:
            t = t._replace(has_image=torch.stack([has, -t.has_image[1::2] - 1], 1).flatten(0, 1))
        return t._replace(hidden=images[mine] if len(mine) else images.new_zeros(1, *images.shape[1:]))

    def leave(self, t, layer, shard: Shard):  # noqa: ARG002 (PatchTower's signature)
        features, has = t.hidden.shape[1], t.has_image
        if (has < 0).any():  # enter's pairs: the even rows' images, has_image decoded
            t = t._replace(has_image=torch.where(has < 0, -has - 1, has))
            has = has[::2]
        assignment = self.assign(has, features, shard.size)
        return t._replace(**gather_tokens({"hidden": t.hidden}, assignment, (has.numel(), features), shard))


def split_tower(layers, shard: Shard, tower) -> bool:
    """The stage's layers (parallelize_sequence's list) with the tower split over SP where the stage holds its first
    and last layer (module docstring: a cut inside the tower leaves it replicated). True when it did."""
    entry = [m for m in layers if isinstance(m, tower.entry)]
    exit_ = [m for m in layers if isinstance(m, tower.exit)]
    if not entry or not exit_:
        return False
    entry[0].forward = _run_entry(entry[0], shard, tower, getattr(exit_[-1], "unit", 1))  # merge^2 patches a token
    exit_[-1].forward = _run_exit(exit_[-1], shard, tower)
    return True


# the families' plan entries (mmpipe.model.sequence_parallel's *_SP_PLAN): the tower's first and last layer
LLAVA_TOWER = {TOWER: ImageTower(VisionEmbed, LlavaProjector)}
QWEN2_VL_TOWER = {TOWER: PatchTower(QwenPatchEmbed, QwenMerger)}
QWEN3_TOWER = {TOWER: PatchTower(Qwen3PatchEmbed, Qwen3Merger)}  # Qwen3-VL (its DeepStack mergers inside) and Qwen3.5
