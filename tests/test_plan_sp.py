"""`mmpipe plan --sp N[,N...]` (issue 58, item 5): the Ulysses SP axis in the planner's memory and time, and its search
over PP x DP x TP x SP (mmpipe.planning.sequence_parallel). In-process, nothing launched: qwen3-vl-8b built on the meta
device, a 128k-position video row (640 temporal patches of 448 x 448 px, 125,440 image tokens, 1024 text tokens).

By hand below: qwen3-vl-8b's decoder (D 4096, 32 heads of 128, 8 kv heads) and vocabulary (151,936)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from mmpipe.config import load_preset
from mmpipe.model.sequence_parallel import TILE_ENV, tile_positions
from mmpipe.planning.costmodel import BYTES, KNOWN_DEVICES, Shape, layer_costs, stage_memory
from mmpipe.planning.images import patch_row
from mmpipe.planning.layout import Training, plan_layout
from mmpipe.planning.sequence_parallel import sp_layer_costs, sp_seconds, tower_span

PRESET = "qwen3-vl-8b"
H100 = KNOWN_DEVICES["h100-80gb"]
VIDEO = ["--video-frames", "1280", "--video-size", "448x448", "--video-max-frames", "1280", "--video-max-pixels",
         "300000000", "--text-len", "1024", "--max-patches", "524288", "--global-batch", "8", "--micro", "1",
         "--checkpointing", "--freeze", "vision"]


@pytest.fixture(scope="module")
def costed():
    """(cfg, rows at SP 1, rows at SP 4) of one row: an image of 8 k patches + 16k text, no checkpointing."""
    cfg = load_preset(PRESET)
    rows = layer_costs(cfg, (), 16384, images=1, patches=patch_row(cfg, 1, 8192))
    return cfg, rows, sp_layer_costs(cfg, rows, 4)


def test_an_sp_rank_holds_its_share_of_the_row_and_every_weight(costed):
    cfg, one, four = costed
    a, b = tower_span(cfg)  # the tower: split by whole images (tests/test_plan_split_tower.py), 1 image here
    for i, (r1, r4) in enumerate(zip(one, four)):
        assert r4.params == r1.params and r4.trainable_params == r1.trainable_params  # weights replicated
        if a <= i < b:
            continue
        kept = ("act_elems", "act_fp32_elems") if r1.name != "LMHead" else ()  # the head's: the tiled loss's (below)
        for field in (*kept, "out_elems", "fwd_flops", "bwd_flops", "w_flops"):
            assert getattr(r4, field) == pytest.approx(getattr(r1, field) / 4), (r1.name, field)
    # a decoder block's all-to-alls: q and the output [L / 4, D], k and v [L / 4, kv] each way; none elsewhere
    t = cfg.text
    block = next(r for r in four if r.name == "QwenBlock")
    assert block.sp_a2a == (2 * t.dim + 2 * t.kv_heads * 128) * block.tokens / 4
    assert all(r.sp_a2a == 0 for r in four if not r.name.endswith("Block") or r.group != "text")
    # the same stage's memory (the decoder up to the head): its states whole, its activations a quarter
    shape = Shape(1, 8, 1, 8)
    m1, m4 = (stage_memory(rows[b:-1], [0, len(rows) - 1 - b], 0, shape, "bf16", 1) for rows in (one, four))
    assert m4["weights"] == m1["weights"] and m4["optimizer"] == m1["optimizer"]
    assert m4["activations"] == pytest.approx(m1["activations"] / 4)


def test_the_head_keeps_one_tile_of_logits_and_its_input(costed, monkeypatch):
    """Under --sp the loss is tiled (mmpipe.model.sequence_parallel.TiledCrossEntropy: it saves the head's input
    hidden and no logits, and makes one tile of tile_positions(V) positions' fp32 logits at a time): the head's kept
    bytes at SP 2 are its input [L / 2, D] in bf16 and one tile of fp32 logits, not the slice's L / 2 x V."""
    cfg, one, _ = costed
    head = one[-1]
    assert head.name == "LMHead"
    t, half = cfg.text, head.tokens / 2
    for tile_bytes in (None, 64 << 20):  # the default 1 GiB tile, and $MMPIPE_SP_TILE_BYTES' smaller one
        if tile_bytes:
            monkeypatch.setenv(TILE_ENV, str(tile_bytes))
        tile = tile_positions(t.vocab_size)
        assert 1 < tile < half / 4  # the slice (9,217 positions) needs several tiles: 6 of 1,767, 84 of 110
        two = sp_layer_costs(cfg, one, 2)[-1]
        assert two.act_bytes("bf16") == pytest.approx(half * t.dim * 2 + tile * t.vocab_size * 4, rel=1e-12)
        assert two.act_bytes("bf16") < half * t.dim * 2 + half * t.vocab_size * 4  # the whole slice's logits
    # a slice shorter than a tile keeps its own logits only
    short = sp_layer_costs(cfg, [dataclasses.replace(head, tokens=200, act_elems=(t.dim + t.vocab_size) * 200,
                                                      act_fp32_elems=t.vocab_size * 200,
                                                      out_elems=t.vocab_size * 200)], 2)[0]
    assert short.act_bytes("bf16") == 100 * t.dim * 2 + 100 * t.vocab_size * 4


def test_the_all_to_alls_and_split_flops_set_the_stage_time(costed):
    """A stage of 10 decoder blocks: forward = 10 x the block's FLOPs / 4 / (peak x efficiency) + 10 all-to-all sets,
    each (4 - 1) / 4 x (2 D + 2 kv) x L / 4 x micro x 2 B / link; the step's gradient all-reduce over DP x SP."""
    cfg, one, four = costed
    first = next(i for i, r in enumerate(four) if r.name == "QwenBlock")
    parts, micro, sp = [0, first + 10, first + 20, len(four)], 2, 4
    block = four[first]
    a2a = 3 / 4 * block.sp_a2a * micro * BYTES["bf16"] / H100.link
    assert sp_seconds(four, parts, micro, "bf16", sp, H100)[1] == pytest.approx((10 * a2a, 10 * a2a))
    # the docstring's example: L = 131,072, SP 4, bf16: 671 MB a block forward, 3 / 4 of it over 450 GB/s = 1.12 ms
    b = sp_layer_costs(cfg, [dataclasses.replace(one[first], tokens=131072)], 4)
    assert b[0].sp_a2a * BYTES["bf16"] == (8192 + 2048) * 32768 * 2 == 671_088_640
    assert sp_seconds(b, [0, 1], 1, "bf16", 4, H100)[0][0] == pytest.approx(1.118e-3, rel=1e-3)
    lay = plan_layout(four, Shape(3, 2, micro, 8, 1, 1, sp),
                      Training("bf16", 1, H100, partition=",".join(map(str, parts[1:-1]))))
    rate = H100.peak_flops * H100.efficiency
    stage = lay.stage_rows[1]
    assert stage["forward_ms"] == pytest.approx((10 * block.fwd_flops * micro / rate + 10 * a2a) * 1e3, rel=1e-9)
    assert stage["sp_ms"] == pytest.approx(20 * a2a * 1e3)
    assert lay.sp == sp and lay.step["allreduce_s"] > 0  # DP 2 x SP 4 = 8 ranks hold each weight


def _plan(capsys, *flags) -> tuple[int, str, str]:
    from mmpipe.cli import main
    rc = main(["plan", "--preset", PRESET, "--gpus-per-node", "8", *VIDEO, *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_128k_video_row_fits_only_with_sp(capsys, tmp_path):
    """8 H100s, LoRA 16 (no full fine-tune of 8.8 B fits one node's 8 x 80 GB at 128k without ZeRO over SP: the
    docs' table): no layout fits at SP 1 (the head's fp32 logits alone are 133,376 x 151,936 x 4 B = 75.5 GiB);
    --sp 1,2,4,8 finds layouts (the tiled loss's head: one tile of logits a rank), the best one's world is 8 and the
    train command it writes names its --sp."""
    rc, out, err = _plan(capsys, "--lora", "16", "--sp", "1")
    assert rc == 2 and "no layout of qwen3-vl-8b fits" in err
    ds = tmp_path / "ds.json"
    rc, out, err = _plan(capsys, "--lora", "16", "--sp", "1,2,4,8", "--top", "3", "--write-config", str(ds))
    assert rc == 0, err
    assert " SP " in out.splitlines()[3] and "best: 1 stages x dp 4 x sp 2," in out
    command = out.split("run it with mmpipe train ")[1].split()
    assert command[command.index("--sp") + 1] == "2" and command[command.index("--dp") + 1] == "4"
    rc, out, _ = _plan(capsys, "--lora", "16", "--sp", "1,2,4,8", "--json")
    layouts = json.loads(out)
    fitting = [lay for lay in layouts if lay["step"]]
    assert fitting and all(lay["sp"] > 1 for lay in fitting)
    assert all(lay["stages"] * lay["dp"] * lay["sp"] == 8 for lay in layouts)


def test_sp_left_out_in_one_line(capsys):
    """SP must divide the heads and KV heads (each rank attends with H / SP of them) and, with TP, the node."""
    rc, out, _ = _plan(capsys, "--lora", "16", "--sp", "1,3,4,16", "--top", "1")
    assert rc == 0
    assert "sp: 3 left out: it does not divide qwen3-vl-8b's 32 attention heads" in out
    assert "sp: 16 left out: it does not divide qwen3-vl-8b's 8 KV heads" in out
    _, out, _ = _plan(capsys, "--tp", "2", "--sp", "8", "--top", "1")
    assert "sp: 8 left out: 2 TP x 8 SP does not divide 8 GPUs per node (both stay inside a node)" in out
    rc, _, err = _plan(capsys, "--sp", "0")
    assert rc == 2 and err.strip().endswith("--sp: 0 must be >= 1")
