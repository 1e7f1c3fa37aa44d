"""`mmpipe plan --tp N[,N...]` (issue 54, item 7): the TP axis in the planner's memory and time, and its search over
PP x TP x DP (mmpipe.planning.tensor_parallel). In-process, nothing launched: qwen2.5-vl-72b built on the meta device.

By hand below: Qwen2.5-VL-72B's decoder block (D 8192, 64 heads of 128, 8 kv heads, FFN 29568, qkv bias), tower block
(d 1280, FFN 3456, SwiGLU with biases, RMSNorm), merger (4 x 1280 -> 8192) and vocabulary (152064 x 8192)."""
from __future__ import annotations

import json

import pytest

from mmpipe.config import load_preset
from mmpipe.planning.costmodel import BYTES, KNOWN_DEVICES, Shape, layer_costs, stage_memory, state_bytes
from mmpipe.planning.images import patch_row
from mmpipe.planning.layout import Training, plan_layout
from mmpipe.planning.tensor_parallel import tp_layer_costs, tp_seconds

PRESET, TEXT, PATCHES = "qwen2.5-vl-72b", 1024, 16384
H100 = KNOWN_DEVICES["h100-80gb"]


@pytest.fixture(scope="module")
def costed():
    """(cfg, rows at TP 1, rows at TP 2) of one row: 4 images in 16k patches + 1024 text, no checkpointing."""
    cfg = load_preset(PRESET)
    rows = layer_costs(cfg, (), TEXT, images=4, patches=patch_row(cfg, 4, PATCHES))
    return cfg, rows, tp_layer_costs(cfg, rows, 2)


def _split_and_whole(cfg) -> dict[str, tuple[int, int]]:
    """Layer name -> (its weights split by the family's plan, its weights whole on every rank), by hand: column and
    vocab weights with their biases split, a row linear's weight split and its bias whole (added once after the
    sum), norms whole."""
    t, v = cfg.text, cfg.vision
    d_m, kv = t.dim, t.kv_heads * t.head_dim
    block = (d_m * d_m + d_m) + 2 * (kv * d_m + kv) + d_m * d_m + 3 * t.ff_dim * d_m  # q, k, v (bias), o, gate/up/down
    d, f, wide = v.dim, v.ff_dim, v.dim * v.merge_size ** 2
    tower = (3 * d * d + 3 * d) + d * d + 2 * (f * d + f) + d * f  # qkv (bias), proj, gate / up (bias), down
    return {"QwenBlock": (block, 2 * d_m), "QwenVisionBlock": (tower, 2 * d + 2 * d),  # norms; proj, down biases
            "QwenMerger": ((wide * wide + wide) + d_m * wide, d + d_m),  # mlp.0 column, mlp.2 row; ln_q, mlp.2 bias
            "QwenEmbed": (t.vocab_size * d_m, 0)}


def test_memory_per_rank_at_tp2_is_split_weights_halved_replicated_whole(costed):
    cfg, one, two = costed
    by_hand = _split_and_whole(cfg)
    for name, (split, whole) in by_hand.items():
        r1, r2 = next(r for r in one if r.name == name), next(r for r in two if r.name == name)
        assert r1.params == split + whole, name  # the hand count is the layer's
        assert r2.params == split // 2 + whole, name
    head1, head2 = one[-1], two[-1]
    assert head1.params - head2.params == cfg.text.vocab_size * cfg.text.dim // 2  # its vocabulary split
    for same in ("QwenPatchEmbed", "FinalNorm"):  # replicated: whole on every rank
        assert [r.params for r in one if r.name == same] == [r.params for r in two if r.name == same]
    # a whole model on one stage, bf16, ZeRO-1 over DP 16: the states of the rank's parameters
    n = {name: sum(1 for r in one if r.name == name) for name in by_hand}
    total1 = sum(r.params for r in one)
    total2 = total1 - sum(n[k] * split // 2 for k, (split, _) in by_hand.items()) - (head1.params - head2.params)
    mem = stage_memory(two, [0, len(two)], 0, Shape(1, 16, 1, 8, 1, 2), "bf16", 1)
    want = state_bytes(total2, total2, "bf16", 1, 16)
    assert {k: mem[k] for k in want} == pytest.approx(want, rel=1e-12)
    assert want["weights"] == 2 * total2 and want["optimizer"] == 12 * total2 / 16


def test_activations_of_the_split_regions_and_the_logits_are_halved(costed):
    cfg, one, two = costed
    t = cfg.text
    block1, block2 = (next(r for r in rows if r.name == "QwenBlock") for rows in (one, two))
    seq = block1.tokens  # the row's decoder positions
    # kept whole: x, the two RMSNorms' inputs and outputs, x + attn (6 D) and the fp32 statistics; split: q, the
    # attention output, o_proj's input (3 D), k and v (2 kv), gate, silu, up, their product (4 F)
    split = (3 * t.dim + 2 * t.kv_heads * t.head_dim + 4 * t.ff_dim) * seq
    assert block1.act_elems - block2.act_elems == split / 2
    assert block2.act_fp32_elems == block1.act_fp32_elems
    head1, head2 = one[-1], two[-1]
    assert head1.act_elems - head2.act_elems == seq * t.vocab_size / 2  # the fp32 logits, 1/TP per rank
    assert head1.act_fp32_elems - head2.act_fp32_elems == seq * t.vocab_size / 2


def test_the_tp_all_reduces_and_split_flops_set_the_stage_time(costed):
    """Stage 1 = 20 decoder blocks: per micro-batch forward = 20 x (the replicated norms' 2 x 2 D x L FLOPs + the rest
    / 2) / (peak x efficiency) + 20 x 2 all-reduces of [micro, L, D] bf16, each 2 (t - 1) / t x bytes / link; the
    backward the blocks' backward FLOPs likewise + 2 all-reduces each."""
    cfg, one, two = costed
    block1 = next(r for r in one if r.name == "QwenBlock")
    first = next(i for i, r in enumerate(two) if r.name == "QwenBlock")
    parts, micro, tp = [0, first + 10, first + 30, first + 50, len(two)], 2, 2
    assert all(r.name == "QwenBlock" for r in two[parts[1]:parts[2]])
    seq, width = block1.tokens, cfg.text.dim
    allreduce = 2 * seq * width * micro * BYTES["bf16"] * 2 * (tp - 1) / tp / H100.link  # two a block, one direction
    assert tp_seconds(two, parts, micro, "bf16", tp, H100)[1] == pytest.approx((20 * allreduce, 20 * allreduce))
    whole_flops = 2.0 * 2 * width * seq  # the two RMSNorms' weights: not split
    fwd = whole_flops + (block1.fwd_flops - whole_flops) / tp
    rate = H100.peak_flops * H100.efficiency
    lay = plan_layout(two, Shape(4, 4, micro, 16, 1, tp),
                      Training("bf16", 1, H100, partition=",".join(map(str, parts[1:-1]))))
    stage = lay.stage_rows[1]
    assert stage["forward_ms"] == pytest.approx((20 * fwd * micro / rate + 20 * allreduce) * 1e3, rel=1e-9)
    bwd = block1.bwd_flops * fwd / block1.fwd_flops
    assert stage["backward_ms"] == pytest.approx((20 * bwd * micro / rate + 20 * allreduce) * 1e3, rel=1e-9)
    assert stage["tp_ms"] == pytest.approx(40 * allreduce * 1e3)
    # at TP 1 the same stage has no all-reduce and all the FLOPs
    lay1 = plan_layout(one, Shape(4, 8, micro, 8), Training("bf16", 1, H100, partition=",".join(map(str, parts[1:-1]))))
    assert lay1.stage_rows[1]["forward_ms"] == pytest.approx(20 * block1.fwd_flops * micro / rate * 1e3, rel=1e-9)
    assert "tp_ms" not in lay1.stage_rows[1]


def _plan(capsys, *flags) -> tuple[int, str, str]:
    from mmpipe.cli import main
    rc = main(["plan", "--preset", PRESET, "--gpus-per-node", "8", "--nodes", "4", "--global-batch", "128",
               "--micro", "1", "--image-size", "1024x768", "--max-images", "4", "--max-patches", str(PATCHES),
               "--checkpointing", *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_search_picks_tp_where_tp1_does_not_fit(capsys):
    """16k patches + 16k text a row (L = 20,488): no PP x DP layout fits 80 GB at TP 1; with --tp 1,2,4,8 the best
    splits each stage over TP ranks, and the train command it writes names its --tp."""
    rc, out, err = _plan(capsys, "--text-len", "16384", "--tp", "1")
    assert rc == 2 and "no layout of qwen2.5-vl-72b fits" in err
    rc, out, err = _plan(capsys, "--text-len", "16384", "--tp", "1,2,4,8", "--json")
    layouts = json.loads(out)
    fitting = [lay for lay in layouts if lay["step"]]
    assert rc == 0 and fitting and all(lay["tp"] > 1 for lay in fitting)
    assert {lay["tp"] for lay in layouts} == {1, 2, 4, 8}
    best = fitting[0]
    assert best["stages"] * best["dp"] * best["tp"] == 32
    assert max(r["memory_gib"] for r in best["stage_rows"]) <= H100.memory / 2 ** 30


def test_tp_left_out_and_families_without_a_plan_say_so_in_one_line(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    rc, out, _ = _plan(capsys, "--text-len", "1024", "--tp", "1,4,16", "--top", "1", "--write-config", str(ds))
    assert rc == 0 and "tp: 16 left out: it does not divide 8 GPUs per node (TP stays inside a node)" in out
    # the best (4 stages x dp 2 x tp 4 at 1024 text) is written, and the train command that runs it names its TP
    assert "best: 4 stages x dp 2 x tp 4," in out
    command = out.split("run it with mmpipe train ")[1].split()
    assert command[command.index("--tp") + 1] == "4" and command[command.index("--dp") + 1] == "2"
    written = json.loads(ds.read_text())
    assert written["pipeline"]["stages"] == 4 and written["train_batch_size"] == 128
    from mmpipe.cli import main
    rc = main(["plan", "--preset", "gemma-3-4b", "--global-batch", "64", "--text-len", "24", "--tp", "1,2"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("planned at TP 1 only") == 1
    assert "gemma-3-4b (gemma3) has no tensor-parallel plan yet: planned at TP 1 only" in out
    rc = main(["plan", "--preset", PRESET, "--tp", "0"])
    assert rc == 2 and capsys.readouterr().err.strip().endswith("--tp: 0 must be >= 1")

