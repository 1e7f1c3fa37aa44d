"""The planner counts the tower as train runs it (issues 58 and 56), in process, nothing launched.

Under --sp (mmpipe.model.sp_tower) the tower is split over a stage's SP ranks by whole images only where one stage holds
its first and last layer; a cut inside it leaves it whole on every SP rank; after the merger one all-gather hands each
rank the whole [B, P / merge^2, D] (and Qwen3-VL's DeepStack sets), so the send after the merger is whole.
Under --objective dpo (at any SP) a sharing family's tower encodes each pair's images once (mmpipe.data.preference
.SHARED_IMAGE_FAMILIES): the planner and the partition price its tower and projector at half a row's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmpipe.config import load_preset
from mmpipe.planning.costmodel import BYTES, KNOWN_DEVICES, Shape, layer_costs, pair_image_rows
from mmpipe.planning.images import patch_row
from mmpipe.planning.layout import Training, plan_layout, predict_layout
from mmpipe.planning.partition import compute_parts, layer_table, trainable_units
from mmpipe.planning.sequence_parallel import sp_layer_costs, sp_seconds, sp_stage_rows, tower_span

H100 = KNOWN_DEVICES["h100-80gb"]
RATE = H100.peak_flops * H100.efficiency
M = 3  # images a row: the busiest of 2 SP ranks encodes 2 of them (the greedy on 3 equal images: 2 | 1)


@pytest.fixture(scope="module")
def qwen3():
    """qwen3-vl-tiny (DeepStack sets made inside the tower), a row of 3 images and 64 text positions: (cfg, the tower's
    [a, b), rows at SP 1, rows at SP 2)."""
    cfg = load_preset("qwen3-vl-tiny")
    one = layer_costs(cfg, (), 64, images=M, patches=patch_row(cfg, M))
    return cfg, tower_span(cfg), one, sp_layer_costs(cfg, one, 2, images=M)


def test_the_tower_is_split_where_one_stage_holds_it(qwen3):
    """Cut right after the merger: stage 0 is the whole tower, its FLOPs at SP 2 within the greedy's bound (total / 2
    + the largest image; here 2 of 3 images), plus the all-gather of (2 - 1) x N_max x D_all elements forward and the
    reduce-scatter backward; the merger's send whole (the gathered features)."""
    cfg, (a, b), one, two = qwen3
    assert [r.name for r in one[a:b]][0] == "QwenPatchEmbed" and one[b - 1].name == "QwenMerger"
    total = sum(r.flops for r in one[a:b])
    rows = sp_stage_rows(two, [0, b, len(two)])
    split = sum(r.flops for r in rows[a:b])
    assert split <= total / 2 + total / M and split == pytest.approx(total * 2 / 3, rel=1e-12)
    merger = one[b - 1]
    assert merger.carried_elems == 3 * merger.out_elems  # the 3 DeepStack sets, [P / 4, D] each, beside the hidden
    assert rows[b - 1].boundary_elems == merger.boundary_elems  # the send after the merger: whole on every SP rank
    micro = 2
    gather = (2 - 1) * 2 / 3 * 4 * merger.out_elems * micro * BYTES["fp32"] / H100.link  # N_max x D_all, 2 of 3
    lay = plan_layout(two, Shape(2, 1, micro, 4, 1, 1, 2), Training("fp32", 0, H100, partition=str(b)))
    s0 = lay.stage_rows[0]
    fwd = sum(r.fwd_flops for r in one[a:b]) * 2 / 3 * micro / RATE
    assert s0["forward_ms"] == pytest.approx((fwd + gather) * 1e3, rel=1e-9)
    assert sp_seconds(rows, [0, b, len(two)], micro, "fp32", 2, H100)[0] == pytest.approx((gather, gather))
    # its kept activations: 2 of 3 images' (the decoder's: / 2, as before)
    whole = plan_layout(one, Shape(2, 1, micro, 4), Training("fp32", 0, H100, partition=str(b)))
    assert s0["activations_gib"] < whole.stage_rows[0]["activations_gib"]


def test_a_cut_inside_the_tower_leaves_it_whole_on_every_sp_rank(qwen3):
    """Cut after the tower's second layer: both stages run their tower layers whole (SP 1's FLOPs), no all-gather."""
    cfg, (a, b), one, two = qwen3
    cut, micro = a + 2, 2
    lay = plan_layout(two, Shape(2, 1, micro, 4, 1, 1, 2), Training("fp32", 0, H100, partition=str(cut)))
    s0 = lay.stage_rows[0]
    assert s0["forward_ms"] == pytest.approx(sum(r.fwd_flops for r in one[:cut]) * micro / RATE * 1e3, rel=1e-9)
    rows = sp_stage_rows(two, lay.parts)
    assert [r.flops for r in rows[a:b]] == [r.flops for r in one[a:b]]
    assert rows[cut - 1].boundary_elems == one[cut - 1].boundary_elems  # the tower's hidden, whole
    assert all(r.sp_gather == 0 for r in rows)


def test_the_balanced_split_prices_each_cut_as_train_runs_it(qwen3):
    """plan's balanced split at SP 2, PP 2 (no memory limit binds): its largest stage is the least over every cut,
    each priced by sp_stage_rows (tower split or replicated), found by trying them all."""
    cfg, (a, b), one, two = qwen3
    lay = plan_layout(two, Shape(2, 1, 1, 4, 1, 1, 2), Training("fp32", 0, H100))

    def worst(p):
        rows = sp_stage_rows(two, p)
        return max(sum(r.flops for r in rows[x:y]) for x, y in zip(p, p[1:]))
    cuts = [[0, u[0], len(two)] for u in trainable_units(two)[1:]]
    assert worst(lay.parts) == pytest.approx(min(worst(p) for p in cuts), rel=1e-12)


def _tower_heavy(tmp_path: Path) -> object:
    """qwen-tiny with a 4-block, 128-wide tower (scripts/bench_dpo.py --tower-layers 4 --tower-dim 128)."""
    cfg = json.loads((Path(__file__).resolve().parents[1] / "mmpipe" / "presets" / "qwen-tiny.json").read_text())
    cfg["vision"].update(n_layers=4, dim=128, n_heads=8, ff_dim=256)
    path = tmp_path / "qwen-tiny-tower4x128.json"
    path.write_text(json.dumps(cfg))
    return load_preset(str(path))


def test_dpo_prices_a_sharing_familys_tower_once_a_pair(tmp_path):
    """qwen-tiny (a sharing family): the tower and projector at half a row's, the decoder unchanged; tiny-xattn
    (cross-attention): its tower halved, its cross-attention blocks not; under --sp halved too. `mmpipe plan
    --dpo-reference` and train's partition then move a decoder layer onto the tower's stage (PP 2)."""
    cfg = _tower_heavy(tmp_path)
    side = layer_table(cfg, (), 238)
    pair = pair_image_rows(cfg, side)
    for s, p in zip(side, pair):
        tower = s.group in ("vision", "projector")
        assert p.flops == (s.flops / 2 if tower else s.flops) and p.out_elems == (s.out_elems / 2 if tower else
                                                                                 s.out_elems)
    other = load_preset("tiny-xattn")  # cross-attention: its blocks' queries are every row's text, not halved
    xattn = layer_table(other, (), 64)
    assert [p.flops for p in pair_image_rows(other, xattn)] == [
        s.flops / 2 if s.group in ("vision", "projector") and s.name != "CrossAttnBlock" else s.flops for s in xattn]
    assert any(s.name == "CrossAttnBlock" for s in xattn)
    # predicted: the tower's stage (cut after the merger) half its forward with a reference, either kind
    merger = next(i for i, r in enumerate(side) if r.name == "QwenMerger")
    at = [predict_layout(cfg, Shape(2, 1, 8, 2, 1, 1, sp), Training("fp32", 0, H100, partition=str(merger + 1),
                                                                     reference=ref), 238)
          for ref, sp in (("", 1), ("precomputed", 1), ("live", 1), ("", 2), ("live", 2))]
    sft, pre, live, sft2, sp2 = (x.stage_rows[0]["forward_ms"] for x in at)
    assert pre == pytest.approx(sft / 2, rel=1e-9) and live == pytest.approx(sft / 2, rel=1e-9)
    # under --sp too (the split tower deals out the pairs' images, its all-gather of half the tokens)
    assert sp2 == pytest.approx(sft2 / 2, rel=1e-9) and sft2 != sft
    # the cut: per side the tower's stage ends inside the tower (before its merger); once a pair it holds the merger
    # and the decoder's first layer, its embedding (train's partition: layer_table(pairs=True), what
    # run_config._partition builds for a dpo run at SP 1; the blocks stay on stage 1: one more would make stage 0
    # the slower)
    first_text = next(i for i, r in enumerate(side) if r.group == "text")
    pairs = compute_parts(layer_table(cfg, (), 238, pairs=True), 2, "balanced")
    assert compute_parts(side, 2, "balanced")[1] <= merger < first_text < pairs[1]


def test_plan_front_door_cuts_dpo_with_the_cheaper_tower(tmp_path, capsys):
    """`mmpipe plan --dpo-reference live` on the tower-heavy qwen-tiny, 2 CPUs: its PP 2 layout's stage 0 ends inside
    the tower without the flag (an image per side) and holds the decoder's embedding with it (once a pair)."""
    from mmpipe.cli import main
    _tower_heavy(tmp_path)
    argv = ["plan", "--preset", str(tmp_path / "qwen-tiny-tower4x128.json"), "--gpus-per-node", "2",
            "--global-batch", "16", "--micro", "8", "--device", "cpu", "--text-len", "238", "--json"]
    embed = 6  # QwenPatchEmbed, 4 QwenVisionBlock, QwenMerger, then the decoder's QwenEmbed
    for ref, holds in (([], False), (["--dpo-reference", "live"], True)):
        assert main(argv + ref) == 0
        pp2 = next(x for x in json.loads(capsys.readouterr().out) if x["stages"] == 2)
        assert (pp2["parts"][1] > embed) is holds, pp2["parts"]
