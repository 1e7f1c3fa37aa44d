"""The vision towers' attention within each image (and window) as a split (mmpipe.model.attention.Split: each
segment's own SDPA, equal sizes batched) equals the dense reference mask it replaces (MMPIPE_ATTENTION=dense:
one [B, 1, P, P] bool mask), fp32 within 1e-5, outputs and gradients; and it computes the pairs the planner
counts (mmpipe.model.costs.attention_pairs). docs/vision_attention.md."""
from __future__ import annotations

import pytest
import torch

from mmpipe.config import load_preset
from mmpipe.model import attention, qwen2_vl
from mmpipe.model.attention import Split, segment_split, split_mask
from mmpipe.model.builder import bound, layer_specs
from mmpipe.model.costs import PatchRow, attention_pairs
from mmpipe.model.qwen2_vl import patch_coords, vision_geometry, vision_segments
from mmpipe.model.stage import StageTuple

TOL = 1e-5


def _out_and_grads(mask, q, k, v, up):
    q, k, v = (a.detach().requires_grad_() for a in (q, k, v))
    out = attention.attend(q, k, v, mask)
    (out * up).sum().backward()
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_split_equals_its_dense_mask(kv_heads):
    """Two rows: segments of 5, 3, 2 and 3, 5, 3 positions in an order that interleaves them (a window's patches are
    not contiguous in the processor's order), positions on their own (-1), ids unique across the batch; 4 query
    heads over 4 or 2 kv heads."""
    torch.manual_seed(0)
    seg = torch.tensor([[0, 0, 1, 0, 1, 1, 0, 0, -1, -1, 2, 2],
                        [3, 3, 3, -1, 4, 5, 5, 5, 4, 4, 4, 4]])
    split = segment_split(seg)
    assert sorted(g.shape for g in split.groups) == [(1, 2), (2, 5), (3, 3)]  # segment 2; 0 and 4; 1, 3 and 5
    assert split.groups[-1].tolist() == [[0, 1, 3, 6, 7], [16, 20, 21, 22, 23]]  # row order within, b * P + p
    assert split.alone.tolist() == [8, 9, 15]
    B, P, H = 2, seg.shape[1], 4
    q = torch.randn(B, H, P, 8)
    k, v = torch.randn(B, kv_heads, P, 8), torch.randn(B, kv_heads, P, 8)
    up = torch.randn(B, H, P, 8)
    for a, b in zip(_out_and_grads(split, q, k, v, up), _out_and_grads(split_mask(seg), q, k, v, up)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


# rows of qwen-tiny (window 56 px / 14 = 4 patches a side): images of several sizes, a video's two frames,
# padding; 8 x 6 cuts into 2 x 2 windows of 16, 8, 16, 8 patches, 6 x 10 into 2 x 3 of 16, 16, 8, 8, 8, 4
GRIDS = [[[1, 4, 4], [1, 8, 6], [0, 0, 0]],   # 16 + 48 used, 16 padding, an unused slot
         [[2, 4, 4], [1, 6, 10], [1, 2, 2]]]  # 32 (two frames) + 60 + 4 = 96 used, none padding
P = 96


def _tower_row(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    grids = torch.tensor(GRIDS)
    has_image = (grids.prod(-1) > 0).long()
    L = 8
    ints = (torch.randint(0, 100, (2, L), generator=g), has_image, torch.ones(2, L, dtype=torch.long), grids)
    return torch.randn(2, P, cfg.vision.dim, generator=g), ints


def _run(layers, hidden, ints, dense: bool, monkeypatch):
    """The blocks' output and every input / parameter gradient, on one backend."""
    monkeypatch.setenv("MMPIPE_ATTENTION", "dense" if dense else "auto")
    for m in layers:
        m.zero_grad()
    h = hidden.clone().requires_grad_()
    args = (h, *(t.clone() for t in ints))  # fresh integer tensors: no cache entry of the other backend
    for m in layers:
        args = m(args)
    args[0].pow(2).sum().backward()
    return [args[0], h.grad] + [p.grad for m in layers for p in m.parameters()]


@pytest.mark.parametrize("preset", ["qwen-tiny", "qwen3-vl-tiny"])
def test_tower_blocks_split_equal_dense(preset, monkeypatch):
    """qwen-tiny's windowed block 0 and full block 1 (Qwen2.5), and qwen3-vl-tiny's first two (full) blocks, on
    rows of images of different sizes, a two-frame video and padding: the split gives the dense mask's outputs
    and gradients (input and every parameter's), within 1e-5 in fp32; under the default backend no block
    builds a [B, 1, P, P] mask."""
    cfg = load_preset(preset)
    specs = layer_specs(cfg)
    torch.manual_seed(0)
    layers = [bound(specs[i].build(), cfg, i) for i in (1, 2)]
    assert [getattr(m, "full", True) for m in layers] == ([False, True] if preset == "qwen-tiny" else [True, True])
    hidden, ints = _tower_row(cfg)
    built = []
    real = qwen2_vl.dense_vision_mask
    monkeypatch.setattr(qwen2_vl, "dense_vision_mask", lambda *a: built.append(1) or real(*a))
    split = _run(layers, hidden, ints, dense=False, monkeypatch=monkeypatch)
    assert not built
    dense = _run(layers, hidden, ints, dense=True, monkeypatch=monkeypatch)
    assert built
    for a, b in zip(split, dense, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("full", [False, True])
def test_split_computes_the_pairs_the_planner_counts(full):
    """qwen-tiny's segments for GRIDS' rows: each group's n x s^2 scores plus one per patch alone is exactly
    costs.attention_pairs of the row's images, so the planner's attention FLOPs are what runs; a window never
    spans two images or frames and holds at most 4 x 4 patches."""
    v = load_preset("qwen-tiny").vision
    grids = torch.tensor(GRIDS)
    seg = vision_segments(patch_coords(grids, P, v.merge_size), grids.shape[1], v, full)
    split = segment_split(seg)
    computed = sum(g.shape[0] * g.shape[1] ** 2 for g in split.groups) + len(split.alone)
    planned = sum(attention_pairs(v, PatchRow(P, tuple(tuple(g) for g in row if g[0])), full)
                  for row in GRIDS)
    assert computed == planned
    biggest = max(g.shape[1] for g in split.groups)
    assert biggest == (60 if full else 16)
    if not full:  # the 8 x 6 image: windows of 16, 8, 16, 8 patches; 6 x 10: 16, 16, 8, 8, 8, 4
        sizes = sorted(s for g in split.groups for s in [g.shape[1]] * g.shape[0])
        assert sizes == sorted([16, 16, 16, 4] + [16, 8, 16, 8] + [16, 16, 8, 8, 8, 4])


def test_dense_backend_is_the_reference_mask(monkeypatch):
    """MMPIPE_ATTENTION=dense gives the tower the pairwise bool mask (the reference, built apart from the
    segment ids), anything else the Split; the two agree pair by pair (split_mask of the segments)."""
    cfg = load_preset("qwen-tiny")
    hidden, ints = _tower_row(cfg)
    t = StageTuple(hidden, ints[0], ints[1], ints[2], tiling=ints[3])
    for full in (False, True):
        monkeypatch.setenv("MMPIPE_ATTENTION", "dense")
        mask, _ = vision_geometry(t, cfg.vision, full)
        monkeypatch.delenv("MMPIPE_ATTENTION")
        split, _ = vision_geometry(t, cfg.vision, full)
        assert isinstance(mask, torch.Tensor) and isinstance(split, Split)
        seg = vision_segments(patch_coords(torch.tensor(GRIDS), P, 2), 3, cfg.vision, full)
        assert torch.equal(mask, split_mask(seg))
        assert mask.sum() == P * 2 + sum(g.shape[0] * (g.shape[1] ** 2 - g.shape[1]) for g in split.groups)
