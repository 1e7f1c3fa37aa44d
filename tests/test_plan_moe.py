"""The planner and cost model for mixture-of-experts models (issue 43; docs/moe.md, docs/planning.md): active vs total
parameters, the experts' weights, gradients and optimizer states per expert-parallel rank (1 / EP of the experts,
the rest replicated), the all-to-all bytes per micro-batch and their time from the link, and `mmpipe plan --ep`'s
PP x DP x EP layouts. The model: qwen3-vl-tiny's shape with 8 experts of width 40, top 2 (tests/test_moe.py's),
D = 64, 4 decoder blocks; its row as tests/test_plan_qwen3.py's: P = 128 patches, 4 image slots, text 48, so
L = 2 x 4 + 128 / 4 + 48 = 88 decoder positions. In-process, meta device, no launches."""
from __future__ import annotations

import json

import pytest
import torch

from mmpipe.config import config_from_dict, load_preset
from mmpipe.model.builder import layer_param_counts, layer_specs, shapes_only
from mmpipe.planning.costmodel import (
    Device,
    Shape,
    all_to_all,
    layer_costs,
    moe_param_counts,
    rank_state_bytes,
    stage_memory,
    stage_seconds,
    state_bytes,
)
from mmpipe.planning.images import patch_row
from mmpipe.planning.layout import Training, _transfers, plan_layout

EXPERTS, TOP_K, EXPERT_FF, D, BLOCKS = 8, 2, 40, 64, 4
P, IMAGES, TEXT = 128, 4, 48
L = 2 * IMAGES + P // 4 + TEXT  # 88
EXPERT = 3 * D * EXPERT_FF  # 7,680 weights an expert: gate and up [2F, D], down [D, F]
# a device with round numbers: 1 TFLOP/s at 100%, 1 GB/s links, memory enough for everything
DEVICE = Device("test", 1e12, 1e12, 1e9, efficiency=1.0)


def tiny_moe():
    d = load_preset("qwen3-vl-tiny").to_dict()
    d["text"].update(tie_embeddings=False, moe=dict(experts=EXPERTS, top_k=TOP_K, ff_dim=EXPERT_FF))
    return config_from_dict(d, "qwen3-vl-moe-tiny")


def _rows(cfg, **kw):
    return layer_costs(cfg, (), TEXT, images=IMAGES, patches=patch_row(cfg, IMAGES, P), **kw)


def test_active_and_total_parameters():
    """total: the model's parameters; experts: every block's 8 x 7,680 = 61,440, x 4 blocks = 245,760; active: the
    total less the 8 - 2 = 6 experts each token skips in each block, 4 x 6 x 7,680 = 184,320. Both checked against
    the model built on the meta device: its 3-D expert tensors, and the same model built with top_k experts (what
    a token runs through) plus the router's rows of the other 6 experts (4 blocks x 6 x 64 = 1,536)."""
    cfg = tiny_moe()
    n = moe_param_counts(cfg)
    with shapes_only():
        model = [spec.build() for spec in layer_specs(cfg)]
    total = sum(p.numel() for layer in model for p in layer.parameters())
    experts = sum(p.numel() for layer in model for name, p in layer.named_parameters() if ".experts." in name)
    assert n == {"total": total, "active": total - 184_320, "experts": 245_760, "blocks": BLOCKS}
    assert experts == 245_760 == BLOCKS * EXPERTS * EXPERT
    d = cfg.to_dict()
    d["text"]["moe"]["experts"] = TOP_K
    only_k = sum(layer_param_counts(config_from_dict(d, "only-k")))
    assert n["active"] == only_k + BLOCKS * (EXPERTS - TOP_K) * D


def test_layer_rows_carry_experts_and_all_to_all():
    """Each MoE block's row: its experts (61,440 of its parameters) and one all-to-all's elements per row, L x top_k x
    D = 88 x 2 x 64 = 11,264; no other layer has either, and a dense model's rows have neither (defaults)."""
    rows = _rows(tiny_moe())
    moe = [r for r in rows if r.name == "Qwen3MoeBlock"]
    assert len(moe) == BLOCKS
    assert all(r.expert_params == 61_440 and r.a2a_elems == 11_264 and r.expert_trainable == 61_440 for r in moe)
    assert sum(r.expert_params + r.a2a_elems for r in rows if r.name != "Qwen3MoeBlock") == 0
    dense = layer_costs(load_preset("qwen3-vl-tiny"), (), TEXT, images=IMAGES,
                        patches=patch_row(load_preset("qwen3-vl-tiny"), IMAGES, P))
    assert all(r.expert_params == 0 and r.a2a_elems == 0.0 for r in dense)


def test_rank_state_bytes_split_experts_over_ep():
    """1000 weights, 800 of them experts, all trained, 4 data-parallel ranks:
    fp32 ZeRO 0, EP 4: a rank holds 200 + 800 / 4 = 400 weights: 4 x 400 = 1,600 B weights, 1,600 B gradients,
    8 x 400 = 3,200 B moments.
    bf16 ZeRO 1, EP 2: 200 + 800 / 2 = 600 weights, 2 x 600 = 1,200 B; gradients 2 x 600 + fp32 4 x (200 / 4 +
    400 / 2) = 1,200 + 1,000; master weights and moments 12 x (200 / 4 + 400 / 2) = 3,000 B: the replicated
    weights' fp32 state sharded over the 4 DP ranks, the experts' over the 4 / 2 = 2 ranks holding the same ones.
    EP 1: state_bytes, unchanged."""
    assert rank_state_bytes(1000, 1000, 800, 800, "fp32", 0, 4, 4) == {"weights": 1600, "grads": 1600,
                                                                       "optimizer": 3200}
    assert rank_state_bytes(1000, 1000, 800, 800, "bf16", 1, 4, 2) == {"weights": 1200, "grads": 2200,
                                                                       "optimizer": 3000}
    assert rank_state_bytes(1000, 1000, 800, 800, "bf16", 1, 4, 1) == state_bytes(1000, 1000, "bf16", 1, 4)


def test_stage_memory_holds_one_ep_share_of_the_experts():
    """One stage of the whole model, fp32 ZeRO 0, DP 2: at EP 2 a rank keeps half the 245,760 expert weights, so
    its weights, gradients and moments shrink by 4 x, 4 x and 8 x 122,880 B; activations do not change (every
    rank runs its own tokens' rows). Under LoRA the experts are frozen (not linears): their weights split, no
    gradients or moments either way."""
    cfg = tiny_moe()
    rows = _rows(cfg)
    one, two = (stage_memory(rows, [0, len(rows)], 0, Shape(1, 2, 1, 2, ep), "fp32", 0) for ep in (1, 2))
    assert one["weights"] - two["weights"] == 4 * 122_880
    assert one["grads"] - two["grads"] == 4 * 122_880
    assert one["optimizer"] - two["optimizer"] == 8 * 122_880
    assert one["activations"] == two["activations"]
    from mmpipe.model.lora import Lora
    lora = _rows(cfg, lora=Lora(4, 8.0, ("text",)))
    one, two = (stage_memory(lora, [0, len(lora)], 0, Shape(1, 2, 1, 2, ep), "fp32", 0) for ep in (1, 2))
    assert one["weights"] - two["weights"] == 4 * 122_880
    assert (one["grads"], one["optimizer"]) == (two["grads"], two["optimizer"])


def test_all_to_all_bytes_and_seconds():
    """Per stage and micro-batch (micro 2, bf16): each MoE block's two all-to-alls forward move L x top_k x D x 2 B x
    micro = 88 x 2 x 64 x 2 x 2 = 45,056 B each, 90,112 B a block, and the same backward. Cut after the tower and
    decoder block 1: stage 1 holds blocks 2 and 3, 180,224 B each way. At EP 4, 3 / 4 of the rows leave the rank:
    180,224 x 3 / 4 / 1e9 B/s = 135.168 us each way; at EP 1 nothing moves: 0 s."""
    cfg = tiny_moe()
    rows = _rows(cfg)
    cut = [i for i, r in enumerate(rows) if r.name == "Qwen3MoeBlock"][2]
    parts = [0, cut, len(rows)]
    assert sum(r.name == "Qwen3MoeBlock" for r in rows[:cut]) == 2
    four = all_to_all(rows, parts, 2, "bf16", 4, DEVICE)
    assert [x["bytes"] for x in four] == [180_224, 180_224]
    assert four[1]["seconds"] == pytest.approx(135.168e-6, rel=1e-12)
    assert [x["seconds"] for x in all_to_all(rows, parts, 2, "bf16", 1, DEVICE)] == [0.0, 0.0]


def test_layout_adds_the_all_to_all_to_the_step():
    """plan_layout at EP 2 (one stage, DP 2, micro 1, GAS 4, fp32): the stage's forward and backward each grow by
    its all-to-all seconds, 2 x 4 blocks x 11,264 x 4 B = 360,448 B x 1 / 2 / 1e9 B/s = 180.224 us; the step
    reports them: a2a_s = 2 x 180.224 us a micro-batch, a2a_share = 4 slots x a2a_s / step_s; the rank holds
    the total less half the experts (245,760 / 2) and moves 2 x 360,448 B = 0.6875 MiB a micro-batch."""
    cfg = tiny_moe()
    rows = _rows(cfg)
    one, two = (plan_layout(rows, Shape(1, 2, 1, 4, ep), Training("fp32", 0, DEVICE)) for ep in (1, 2))
    (f, b), = stage_seconds(rows, [0, len(rows)], 1, DEVICE)
    a2a = 360_448 / 2 / 1e9
    assert two.stage_rows[0]["forward_ms"] == pytest.approx((f + a2a) * 1e3, rel=1e-12)
    assert two.stage_rows[0]["backward_ms"] == pytest.approx((b + a2a) * 1e3, rel=1e-12)
    assert two.step["a2a_s"] == pytest.approx(2 * a2a, rel=1e-12)
    assert two.step["a2a_share"] == pytest.approx(4 * 2 * a2a / two.step["step_s"], rel=1e-12)
    assert two.stage_rows[0]["a2a_mib"] == 2 * 360_448 / 2 ** 20 == 0.6875
    total = moe_param_counts(cfg)["total"]
    assert (two.stage_rows[0]["rank_params"], one.stage_rows[0]["rank_params"]) == (total - 122_880, total)
    assert one.step["a2a_s"] == 0.0 and two.ep == 2
    # the experts' gradient all-reduce: at EP 2 of DP 2 each shard is alone in its expert-data-parallel group
    # (2 / 2 = 1 rank): only the replicated gradients go round, (total - 245,760) x 4 B over the ring's 2 x 1 / 2
    assert two.step["allreduce_s"] == pytest.approx((total - 245_760) * 4 / 1e9, rel=1e-12)
    assert one.step["allreduce_s"] == pytest.approx(total * 4 / 1e9, rel=1e-12)


def test_plan_command_lists_pp_dp_ep_layouts(tmp_path, capsys):
    """`mmpipe plan --ep 1,2,4` on 4 GPUs: every layout whose DP the EP divides (PP 1 x DP 4: EP 1, 2, 4; PP 2 x DP 2:
    EP 1, 2; PP 4 x DP 1: EP 1), 6 of them; the MoE line (total, active, experts), the EP column, the
    all-to-all share; --json carries each layout's ep; --write-config's command line passes --ep to train."""
    from mmpipe.cli import main
    cfg = tiny_moe()
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg.to_dict()))
    argv = ["plan", "--preset", str(path), "--device", "custom", "--peak-tflops", "1", "--gpu-mem", "8",
            "--link-gbps", "1", "--gpus-per-node", "4", "--global-batch", "8", "--micro", "1", "--max-patches",
            str(P), "--max-images", str(IMAGES), "--text-len", str(TEXT), "--ep", "1,2,4"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert sorted((x["stages"], x["dp"], x["ep"]) for x in got) == [(1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 2, 1),
                                                                    (2, 2, 2), (4, 1, 1)]
    assert all(x["step"]["a2a_share"] == 0.0 for x in got if x["ep"] == 1)
    assert all(x["step"]["a2a_share"] > 0.0 for x in got if x["ep"] > 1)
    assert main([*argv, "--write-config", str(tmp_path / "ds.json")]) == 0
    out = capsys.readouterr().out
    n = moe_param_counts(cfg)
    assert f"{n['total']:,} parameters, {n['active']:,} active per token, 245,760 in experts" in out
    assert " PP  DP EP micro  GAS  bubble   step s    a2a" in out
    best = next(x for x in sorted(got, key=lambda x: -x["throughput"]))
    assert (f"--dp {best['dp']} --ep {best['ep']}" in out) == (best["ep"] > 1)


@pytest.mark.parametrize("ep", [1, 2])
def test_per_rank_line_names_an_all_to_all_only_where_one_runs(ep, tmp_path, capsys):
    """Issue 53: at EP 1 every expert is on its rank and no all-to-all runs, so the best layout's per-rank line names
    each stage's parameters alone (it printed 'all-to-all 1442.2 MiB / 0.00 ms a micro-batch' for qwen3-vl-30b-a3b);
    at EP 2 it names each stage's all-to-all too, the MiB and ms --json's stage rows hold."""
    from mmpipe.cli import main
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(tiny_moe().to_dict()))
    argv = ["plan", "--preset", str(path), "--device", "custom", "--peak-tflops", "1", "--gpu-mem", "8",
            "--link-gbps", "1", "--gpus-per-node", "4", "--global-batch", "8", "--micro", "1", "--max-patches",
            str(P), "--max-images", str(IMAGES), "--text-len", str(TEXT), "--ep", str(ep)]
    assert main([*argv, "--json"]) == 0
    best = max(json.loads(capsys.readouterr().out), key=lambda x: x["throughput"])
    assert best["ep"] == ep and any(r["a2a_mib"] > 0 for r in best["stage_rows"])  # the bytes its blocks would move
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"\nbest: {best['stages']} stages x dp {best['dp']} (ep {ep})," in out
    a2a = (lambda r: f", all-to-all {r['a2a_mib']:.1f} MiB / {r['a2a_ms']:.2f} ms a micro-batch") if ep > 1 else (
        lambda r: "")
    line = "per rank: " + "; ".join(f"stage {r['stage']} {r['rank_params']:,.0f} params{a2a(r)}"
                                    for r in best["stage_rows"])
    assert [x for x in out.splitlines() if x.startswith("per rank: ")] == [line]
    assert ("all-to-all" in line) == (ep > 1) and out.count(" MiB / ") == (len(best["stage_rows"]) if ep > 1 else 0)


@pytest.mark.parametrize("argv,line", [
    (["--preset", "qwen3-vl-tiny", "--ep", "2"],
     "--ep: 2 on qwen3-vl-tiny, a dense model (no text.moe): expert parallelism splits experts"),
    (["--ep", "3"], "--ep: 3 does not divide qwen3-vl-moe-tiny's 8 experts"),
    (["--ep", "0"], "--ep: 0 must be >= 1"),
    (["--ep", "two"], "--ep: 'two' is not a list of integers, e.g. 1,2,4,8"),
])
def test_plan_refuses_bad_ep_in_one_line(argv, line, tmp_path, capsys):
    from mmpipe.cli import main
    path = tmp_path / "qwen3-vl-moe-tiny.json"
    path.write_text(json.dumps(tiny_moe().to_dict()))
    assert main(["plan", "--preset", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mmpipe: error: {line}"]


def test_dense_plan_keys_unchanged(capsys):
    """A dense model's plan is what it was: no ep key in --json, no a2a entries in its steps or stage rows (what its
    users' scripts read), no EP column."""
    from mmpipe.cli import main
    argv = ["plan", "--preset", "qwen3-vl-tiny", "--gpus-per-node", "2", "--global-batch", "4", "--micro", "1",
            "--max-patches", str(P), "--max-images", str(IMAGES), "--text-len", str(TEXT)]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got and all("ep" not in x and "a2a_s" not in x["step"] and "a2a_ms" not in x["stage_rows"][0]
                       for x in got)
    assert main(argv) == 0
    assert " PP  DP micro  GAS  bubble   step s" in capsys.readouterr().out


def _text_params(cfg) -> int:
    """The decoder's parameters (embedding, blocks, norm, head), built on the meta device."""
    return sum(c for s, c in zip(layer_specs(cfg), layer_param_counts(cfg)) if s.typename.group == "text")


def test_qwen3_vl_30b_a3b_preset_gives_the_published_counts():
    """The qwen3-vl-30b-a3b preset (Qwen3-VL-30B-A3B-Instruct's config.json, its _source), on the meta device.
    A text block: attention q 2048 x 4096 + k, v 2 x 2048 x 512 + o 4096 x 2048 = 18,874,368, q / k norms 2 x 128,
    two RMSNorms 2 x 2048, router 128 x 2048 = 262,144, experts 128 x 3 x 2048 x 768 = 603,979,776: 623,120,640;
    48 of them 29,909,790,720 (Qwen3-30B-A3B's card: "29.9B" non-embedding), + embedding and head 2 x 151,936 x
    2048 + the final norm 2048 = 30,532,122,624 (the card's "30.5B" total); the whole model with the tower and
    merger 31,070,754,032: the released checkpoint's safetensors count, exactly.
    Active: a block with 8 experts, 56,889,600, x 48 + 622,331,904 = 3,353,032,704 for the text model, which the
    card gives as "3.3B activated", two significant digits: 1.6% above 3.3 B, so 1% cannot be decided from it.
    Pinned here: the count exactly (the shapes are the config's, the total the checkpoint's) and the figure's own
    digits, [3.3 B, 3.4 B); read as rounded to nearest, "3.3B" would mean [3.25 B, 3.35 B), which this count misses
    by 3.0 M (0.09%; docs/moe.md, Planning). 3,891,664,112 active with the tower."""
    cfg = load_preset("qwen3-vl-30b-a3b")
    n = moe_param_counts(cfg)
    assert n == {"total": 31_070_754_032, "active": 3_891_664_112, "experts": 48 * 603_979_776, "blocks": 48}
    text = _text_params(cfg)
    assert text == 48 * 623_120_640 + 2 * 151_936 * 2048 + 2048 == 30_532_122_624
    assert abs(text / 30.5e9 - 1) < 0.01 and abs((text - 2 * 151_936 * 2048) / 29.9e9 - 1) < 0.01
    active = text - (n["total"] - n["active"])
    assert active == 48 * 56_889_600 + 622_331_904 == 3_353_032_704
    assert 3.3e9 <= active < 3.4e9
    assert sum(p.numel() for p in _built(cfg)) == n["total"]


def test_qwen3_vl_235b_a22b_preset_gives_the_published_counts():
    """The qwen3-vl-235b-a22b preset (Qwen3-VL-235B-A22B-Instruct's config.json, its _source), on the meta device.
    A text block: attention q 4096 x 8192 + k, v 2 x 4096 x 512 + o 8192 x 4096 = 71,303,168, q / k norms 2 x 128,
    two RMSNorms 2 x 4096, router 128 x 4096 = 524,288, experts 128 x 3 x 4096 x 1536 = 2,415,919,104:
    2,487,755,008; 94 of them 233,848,970,752, + the final norm 4096 = 233,848,974,848 (Qwen3-235B-A22B's card:
    "234B" non-embedding), + embedding and head 2 x 151,936 x 4096 = 235,093,634,560 (the card's "235B"); the
    whole model with the tower and merger 235,670,022,896: the released checkpoint's safetensors count, exactly
    (0.29% above the name's 235 B). Active: a block with 8 experts, 2,487,755,008 - 120 x 18,874,368 =
    222,830,848, x 94 + 1,244,663,808 = 22,190,763,520 for the text model, 0.87% above the card's "22B activated"
    (within 1%, and inside the [21.5 B, 22.5 B) its two digits allow); 22,767,151,856 with the tower."""
    cfg = load_preset("qwen3-vl-235b-a22b")
    n = moe_param_counts(cfg)
    expert = 3 * 4096 * 1536
    assert n["blocks"] == 94 and n["experts"] == 94 * 128 * expert
    assert n["total"] == 235_670_022_896 and abs(n["total"] / 235e9 - 1) < 0.01
    text = _text_params(cfg)
    block = 71_303_168 + 2 * 128 + 2 * 4096 + 128 * 4096 + 128 * expert
    assert block == 2_487_755_008
    assert text == 94 * block + 4096 + 2 * 151_936 * 4096 == 235_093_634_560
    assert abs((text - 2 * 151_936 * 4096) / 234e9 - 1) < 0.01
    active = text - (n["total"] - n["active"])
    assert active == 94 * (block - 120 * expert) + 4096 + 2 * 151_936 * 4096 == 22_190_763_520
    assert abs(active / 22e9 - 1) < 0.01 and 21.5e9 <= active < 22.5e9
    assert n["active"] == 22_767_151_856


def _built(cfg):
    with shapes_only():
        return [p for spec in layer_specs(cfg) for p in spec.build().parameters()]


# ---- a tied embedding and head (not MoE: the planner's parameter column, fixed beside the MoE counts) ----------

@pytest.mark.parametrize("preset,embedding", [("qwen3-vl-2b", 151_936 * 2048), ("qwen3.5-0.8b", 248_320 * 1024)])
def test_plan_counts_a_tied_embedding_once_per_stage(preset, embedding, capsys):
    """A TiedLayerSpec's embedding and head are one module in a stage that holds both (DeepSpeed's tied_modules), so
    `mmpipe plan`'s parameter column at PP 1 is the model built on the meta device (each tied key once): e.g.
    qwen3-vl-2b 2,127,532,032, not the rows' 2,438,696,960 (151,936 x 2048 = 311,164,928 twice). Its weights,
    gradients and optimizer states count it once too (stage_memory and the partitioner's RangeMemory agree), and so
    does the gradient all-reduce. Cut between the embedding and the head, each stage holds its own copy: the stages
    sum to the model plus one embedding."""
    from mmpipe.cli import main
    from mmpipe.planning.costmodel import RangeMemory, stage_params
    cfg = load_preset(preset)
    seen, model = set(), 0
    with shapes_only():
        for spec in layer_specs(cfg):
            key = getattr(spec, "key", None)  # a TiedLayerSpec's later use shares its first one's weights
            if key is None or key not in seen:
                model += sum(p.numel() for p in spec.build().parameters())
            seen.add(key)
    rows = layer_costs(cfg, (), 16, images=1, patches=patch_row(cfg, 1, 256))
    assert [r.tied for r in rows].count("embed") == 2
    assert sum(r.params for r in rows) - embedding == model == stage_params(rows)
    whole = stage_memory(rows, [0, len(rows)], 0, Shape(1, 1, 1, 2), "fp32", 0)
    assert (whole["weights"], whole["grads"], whole["optimizer"]) == (4 * model, 4 * model, 8 * model)
    ranges = RangeMemory(rows, "fp32", micro=1, micro_batches=2, zero_stage=0, dp=1)
    assert ranges.total(0, len(rows), 0, 1) == pytest.approx(whole["total"], rel=1e-12)
    cut = max(i for i, r in enumerate(rows) if r.tied) - 1  # the head alone in stage 1, the embedding in stage 0
    two = [stage_memory(rows, [0, cut, len(rows)], s, Shape(2, 1, 1, 2), "fp32", 0) for s in (0, 1)]
    assert sum(m["weights"] for m in two) == 4 * (model + embedding)
    assert [ranges.total(0, cut, 0, 2), ranges.total(cut, len(rows), 1, 2)] == \
        [pytest.approx(m["total"], rel=1e-12) for m in two]
    argv = ["plan", "--preset", preset, "--gpus-per-node", "2", "--global-batch", "4", "--micro", "1",
            "--max-patches", "256", "--text-len", "16", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    one = next(x for x in got if x["stages"] == 1)
    assert one["stage_rows"][0]["params"] == model
    pipe = next(x for x in got if x["stages"] == 2)
    assert sum(r["params"] for r in pipe["stage_rows"]) == model + embedding


# ---- the MoE line's total and the boundary bytes of moe_stats, against the built model ----------------------------

def _tied_moe():
    d = tiny_moe().to_dict()
    d["text"]["tie_embeddings"] = True
    return config_from_dict(d, "qwen3-vl-moe-tied")


@pytest.mark.parametrize("make,argv", [
    (lambda: load_preset("gemma4-moe-tiny"), ["--text-len", "24"]),
    (_tied_moe, ["--max-patches", str(P), "--max-images", str(IMAGES), "--text-len", str(TEXT)])])
def test_moe_line_counts_a_tied_head_once(make, argv, tmp_path, capsys):
    """The MoE line's total is the single-device model's unique parameters (ReferenceModel: the tied head is the
    embedding's module, counted once), as the per-stage table's PP 1 row counts them; it printed the embedding's
    matrix twice (gemma-4-26b-a4b: 26,544,131,376 for 25,805,933,872). Active = total less the skipped experts."""
    from mmpipe.cli import main
    from mmpipe.model.builder import ReferenceModel
    cfg = make()
    with shapes_only():
        model = ReferenceModel(cfg)
    unique = sum(p.numel() for p in model.parameters())  # nn.Module.parameters(): each tensor once
    assert unique < sum(layer_param_counts(cfg))  # the preset is tied: the layers' sum has the head again
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(cfg.to_dict()))
    base = ["plan", "--preset", str(path), "--gpus-per-node", "1", "--global-batch", "2", "--micro", "1", *argv]
    assert main(base) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("MoE: "))
    n = moe_param_counts(cfg)
    skipped = n["blocks"] * (cfg.text.moe.experts - cfg.text.moe.top_k) * n["experts"] // (
        n["blocks"] * cfg.text.moe.experts)
    assert f" {unique:,} parameters, {unique - skipped:,} active per token, " in line
    assert main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["stage_rows"][0]["params"] == unique


def _floats_leaving(model, inputs) -> list[int]:
    """Each layer's output tuple's float tensors in bytes (what crosses a cut after it: the stage tuple's floats, the
    ints rebuilt on each stage from the batch), the single-device model run layer by layer."""
    out, x = [], inputs
    with torch.no_grad():
        for layer in model:
            x = layer(x)
            out.append(sum(t.numel() * t.element_size() for t in x if torch.is_tensor(t) and t.is_floating_point()))
    return out


def test_boundary_bytes_are_what_each_cut_sends_gemma4_moe():
    """gemma4-moe-tiny in bf16, micro 2, one image and 12 text positions a row: at every cut the planner's boundary
    bytes (layout._transfers, what the step's p2p time is from) equal the floats of the stage tuple leaving that
    layer: hidden, per_layer and shared K/V in bf16, moe_stats [2, 2, 4] in fp32 (route_stats). It counted moe_stats as
    one image set (36 x 32 = 1,152 bf16 elements a row for the 2 x 4 = 8 fp32 it is)."""
    from mmpipe.data.packing import row_shape
    from mmpipe.model.builder import ReferenceModel
    cfg, micro, text = load_preset("gemma4-moe-tiny"), 2, 12
    shape = row_shape(cfg, 1, text)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.image_token_id, (micro, shape.length), generator=g)
    ids[:, 1:1 + shape.image_len] = torch.as_tensor(shape.block(None))
    px = torch.rand(micro, 1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g, dtype=torch.bfloat16)
    model = ReferenceModel(cfg).to(torch.bfloat16)
    sent = _floats_leaving(model, (px, ids, torch.ones(micro, 1, dtype=torch.long), torch.ones_like(ids)))
    rows = layer_costs(cfg, (), text)
    every = list(range(len(rows) + 1))  # a cut after every layer but the head, whose logits are never sent
    assert _transfers(rows, every, Shape(len(rows), 1, micro, 1), "bf16")[0] == sent[:-1]


def test_boundary_bytes_are_what_the_moe_launches_count():
    """The planner's bytes at the cuts where the MoE launches count each message by shape (fp32, micro 2, their rows
    of L = 88): tests/test_moe_pipeline.py's Qwen3-VL-MoE at 13, hidden 2x88x64, DeepStack's sets 1 and 2 (2x32x64
    each) and moe_stats 2x2x8; tests/test_qwen3_5_moe.py's Qwen3.5-MoE (the launch's model) at 7, hidden 2x88x64
    and moe_stats 2x2x8. moe_stats was counted as one more set: 2 x 32 x 64 x 4 B where it is 2 x 2 x 8 x 4 B."""
    d = load_preset("qwen3.5-tiny").to_dict()
    d["text"].update(tie_embeddings=False, moe=dict(experts=8, top_k=2, ff_dim=16, aux_coef=0.01, shared_ff_dim=24))
    for cfg, cut, shapes in ((tiny_moe(), 13, [(2, L, 64), (2, 32, 64), (2, 32, 64), (2, 2, EXPERTS)]),
                             (config_from_dict(d, "qwen3.5-moe-tiny"), 7, [(2, L, 64), (2, 2, 8)])):
        rows = _rows(cfg)
        sent = 4 * sum(a * b * c for a, b, c in shapes)
        assert _transfers(rows, [0, cut, len(rows)], Shape(2, 1, 2, 1), "fp32")[0] == [sent], cfg.name
