"""`mmpipe plan --tp N[,N...]` (issue 54, item 7): the TP axis in the planner's memory and time, and its search over
PP x TP x DP (mmpipe.planning.tensor_parallel). In-process, nothing launched: qwen2.5-vl-72b built on the meta device.

By hand below: Qwen2.5-VL-72B's decoder block (D 8192, 64 heads of 128, 8 kv heads, FFN 29568, qkv bias), tower block
(d 1280, FFN 3456, SwiGLU with biases, RMSNorm), merger (4 x 1280 -> 8192) and vocabulary (152064 x 8192)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from mmpipe import registry
from mmpipe.config import load_preset
from mmpipe.families import CROSS_ATTENTION
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


def test_tp_left_out_and_families_without_a_plan_say_so_in_one_line(capsys, tmp_path, monkeypatch):
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
    # every built-in family has a plan (the cross-attention family's last: tests/test_tp_cross_attention.py); one
    # registered without one, here the cross-attention family's entry less its plan, is planned at TP 1
    monkeypatch.setitem(registry._FAMILIES, CROSS_ATTENTION.key, dataclasses.replace(CROSS_ATTENTION, tp_plan={}))
    rc = main(["plan", "--preset", "xattn-base", "--global-batch", "64", "--text-len", "24", "--tp", "1,2"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("planned at TP 1 only") == 1
    assert "xattn-base (moondream cross_attention) has no tensor-parallel plan yet: planned at TP 1 only" in out
    rc = main(["plan", "--preset", PRESET, "--tp", "0"])
    assert rc == 2 and capsys.readouterr().err.strip().endswith("--tp: 0 must be >= 1")



def _tiny_moe(tmp_path=None):
    """qwen3-vl-tiny made MoE (tests/test_plan_moe.py's: D 64, 4 heads of 16 / 2 kv, 8 experts of F 40, top 2,
    untied), with its preset file where a command needs one."""
    from mmpipe.config import config_from_dict
    d = load_preset("qwen3-vl-tiny").to_dict()
    d["text"].update(tie_embeddings=False, moe=dict(experts=8, top_k=2, ff_dim=40))
    if tmp_path is not None:
        (tmp_path / "moe.json").write_text(json.dumps(d))
    return config_from_dict(d, "qwen3-vl-moe-tiny")


def test_moe_block_at_tp2_splits_its_experts_and_keeps_the_router_whole():
    """Qwen3MoeBlock at TP 2 (Megatron's expert TP: each expert's gate / up column and down row over F, the router
    replicated), one row of 88 positions (4 image slots in 128 patches + 48 text), by hand: split q 64 x 64,
    k / v 2 x 32 x 64, o 64 x 64 and the experts 8 x 3 x 64 x 40 = 61,440; whole the router 8 x 64, two RMSNorms
    (2 x 64) and the per-head q / k norms (2 x 16). The FLOPs all but the whole weights' 2 x 672 a position / 2; the
    activations of the split regions / 2: the dense block's (q, attention out, o's input, k, v, the MLP's 4 F) less
    its 4 F, plus each choice's 4 F_e (gate, up, silu, product), so the dispatched copies of x and the router's
    logits stay whole; two all-reduces of [L, D] forward (o_proj, the experts' partial outputs) and two backward
    (their regions' inputs) plus the top-k weights [L, 2]; the EP all-to-all's rows as at TP 1."""
    cfg = _tiny_moe()
    rows = layer_costs(cfg, (), 48, images=4, patches=patch_row(cfg, 4, 128))
    one, two = (next(r for r in rs if r.name == "Qwen3MoeBlock") for rs in (rows, tp_layer_costs(cfg, rows, 2)))
    seq, d = one.tokens, 64
    assert seq == 88
    experts, attention, whole = 8 * 3 * d * 40, 2 * d * d + 2 * 32 * d, 8 * d + 2 * d + 2 * 16
    assert one.params == attention + experts + whole and one.expert_params == experts
    assert two.params == (attention + experts) // 2 + whole and two.expert_params == experts // 2
    assert two.fwd_flops == pytest.approx(2 * whole * seq + (one.fwd_flops - 2 * whole * seq) / 2, rel=1e-12)
    assert two.bwd_flops / one.bwd_flops == pytest.approx(two.fwd_flops / one.fwd_flops, rel=1e-12)
    assert one.act_elems - two.act_elems == (3 * d + 2 * 32 + 2 * 4 * 40) * seq / 2
    assert (two.tp_ar_fwd, two.tp_ar_bwd) == (2 * seq * d, 2 * seq * d + 2 * seq)
    assert two.a2a_elems == one.a2a_elems == seq * 2 * d


def test_moe_memory_at_tp2_ep2_holds_half_the_experts_of_half_of_each(capsys, tmp_path):
    """A rank of TP 2 x EP 2 holds E / 2 experts x 1/2 of each: the model on one stage, fp32, ZeRO 0: weights 4 B x
    (the rank's non-expert parameters + all experts / 4); and `mmpipe plan --tp 1,2 --ep 1,2` plans the MoE model
    at TP 2 (no 'planned at TP 1 only') with an EP column."""
    cfg = _tiny_moe(tmp_path)
    rows = layer_costs(cfg, (), 48, images=4, patches=patch_row(cfg, 4, 128))
    two = tp_layer_costs(cfg, rows, 2)
    experts = sum(r.expert_params for r in rows)
    assert experts == 4 * 8 * 3 * 64 * 40
    rest = sum(r.params for r in two) - experts // 2  # the rank's non-expert parameters at TP 2
    mem = stage_memory(two, [0, len(two)], 0, Shape(1, 2, 1, 4, 2, 2), "fp32", 0)
    assert mem["weights"] == 4 * (rest + experts / 4)
    from mmpipe.cli import main
    rc = main(["plan", "--preset", str(tmp_path / "moe.json"), "--gpus-per-node", "4", "--global-batch", "8",
               "--text-len", "48", "--max-images", "4", "--max-patches", "128", "--tp", "1,2", "--ep", "1,2", "--json"])
    out = capsys.readouterr().out
    layouts = json.loads(out)
    assert rc == 0 and "planned at TP 1 only" not in out
    assert {(lay["tp"], lay["ep"]) for lay in layouts if lay["step"]} >= {(1, 1), (2, 1), (2, 2)}
