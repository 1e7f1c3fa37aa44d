"""The cost model, the min-max split and `mmpipe plan`: optimal splits, frozen layers that cost no
backward, memory arithmetic that matches what autograd really keeps, plans in seconds with nothing
allocated, and a written config that trains as is."""
from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, train_run
from mmpipe.config import ConfigError, load_preset
from mmpipe.model.builder import IGNORE_INDEX, TiedCall, layer_specs, lm_loss
from mmpipe.model.rows import sample_rows
from mmpipe.planning.costmodel import (
    KNOWN_DEVICES,
    Device,
    Shape,
    layer_costs,
    pipeline_step_seconds,
    replayed_step_seconds,
    stage_memory,
    stage_seconds,
    stage_split_seconds,
    state_bytes,
)
from mmpipe.planning.layout import Training, plan_layout
from mmpipe.planning.partition import compute_parts, min_max_split
from mmpipe.planning.schedule_registry import ZB_H1
from mmpipe.planning.schedules import predict, simulate
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve


def _brute(weights, parts, fits=None):
    n, best = len(weights), None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = [0, *cuts, n]
        if fits and not all(fits(s, x, y) for s, (x, y) in enumerate(zip(b, b[1:]))):
            continue
        v = max(sum(weights[x:y]) for x, y in zip(b, b[1:]))
        best = v if best is None else min(best, v)
    return best


def test_min_max_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        w = [rng.choice([0.5, 1, 2, 3, 5, 8, 13]) for _ in range(n)]
        got = min_max_split(w, p)
        assert len(got) == p + 1 and got[0] == 0 and got[-1] == n and all(a < b for a, b in zip(got, got[1:]))
        assert max(sum(w[a:b]) for a, b in zip(got, got[1:])) == pytest.approx(_brute(w, p))


def test_min_max_split_respects_a_limit_and_says_when_none_fits():
    rng = random.Random(1)
    for _ in range(200):
        n, p = rng.randint(2, 8), rng.randint(1, 4)
        p = min(p, n)
        w = [rng.randint(1, 9) for _ in range(n)]
        cap = rng.randint(5, 25)

        def fits(s, a, b):
            return sum(w[a:b]) + s <= cap  # a later stage has less room, as memory with 1F1B is the other way round
        got = min_max_split(w, p, fits)
        want = _brute(w, p, fits)
        if want is None:
            assert got is None
        else:
            assert all(fits(s, a, b) for s, (a, b) in enumerate(zip(got, got[1:])))
            assert max(sum(w[a:b]) for a, b in zip(got, got[1:])) == want


def test_a_frozen_prefix_costs_no_backward_and_frozen_layers_behind_trainable_ones_cost_one_pass():
    cfg = load_preset("small")
    frozen_vit = layer_costs(cfg, ("vision",), 12)
    by = {r.name: r for r in frozen_vit}
    assert all(r.bwd_flops == 0 for r in frozen_vit if r.group == "vision")
    assert by["Projector"].bwd_flops == 2 * by["Projector"].fwd_flops
    assert all(r.act_bytes("fp32") == 0 for r in frozen_vit if r.group == "vision")  # nothing kept for a backward
    frozen_text = layer_costs(cfg, ("text",), 12)
    dec = [r for r in frozen_text if r.name == "DecoderBlock"]
    assert all(r.bwd_flops == r.fwd_flops for r in dec)  # input gradients only, to reach the projector
    # balanced stages put the cheap frozen ViT together with more layers than a uniform split
    parts = compute_parts(frozen_vit, 2, "balanced")
    trainable_costs = compute_parts(layer_costs(cfg, (), 12), 2, "balanced")
    assert parts[1] > trainable_costs[1]


def _saved_floats_per_sample(layer, make_args, loss_labels=None) -> float:
    """Float elements autograd keeps for one sample: saved tensors at batch 4 minus batch 2, over 2
    (constants shared by the batch cancel out), parameters excluded."""
    counts = []
    for batch in (2, 4):
        params = {p.data_ptr() for p in layer.parameters()}
        seen = {}

        def pack(t):
            if t.is_floating_point() and t.data_ptr() not in params:
                seen[(t.data_ptr(), tuple(t.shape), t.stride())] = t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(make_args(batch))
            if loss_labels is not None:
                lm_loss(out, loss_labels(batch, out))
        counts.append(sum(seen.values()))
    return (counts[1] - counts[0]) / 2


def test_activation_memory_matches_what_autograd_keeps():
    cfg = load_preset("tiny")
    text_len, n = 12, cfg.vision.n_tokens
    rows = layer_costs(cfg, (), text_len)
    specs = layer_specs(cfg)
    widths = {"vision": cfg.vision.dim, "projector": cfg.vision.dim, "text": cfg.text.dim}

    def args_for(i):
        def make(batch):  # one-sample rows (mmpipe.model.stage): n image positions after BOS, then the text
            ints = sample_rows(cfg, torch.ones(batch, text_len, dtype=torch.long))  # input_ids, has_image, segments
            if i == 0:
                return torch.randn(batch, 3, cfg.vision.image_size, cfg.vision.image_size), *ints
            name = rows[i].name
            tokens = n + text_len if name in ("DecoderBlock", "LMHead") else n
            text_side = name in ("DecoderBlock", "LMHead")
            width = cfg.text.dim if text_side else widths[rows[i].group]
            if name == "TextEmbed":
                width = cfg.text.dim
            return torch.randn(batch, tokens, width, requires_grad=True), *ints
        return make

    for i, (spec, row) in enumerate(zip(specs, rows)):
        labels = _one_label if row.name == "LMHead" else None
        measured = _saved_floats_per_sample(spec.build(), args_for(i), labels)
        assert measured == row.act_elems, (i, row.name, measured, row.act_elems)


def _one_label(batch, out):  # the loss's labels: one answer token per row
    return torch.full(out.shape[:2], IGNORE_INDEX).index_fill_(1, torch.tensor([3]), 1)


@pytest.mark.parametrize("text", [{}, {"n_kv_heads": 1, "qkv_bias": False, "tie_embeddings": False, "ff_dim": 48}],
                         ids=["llava-tiny", "one-kv-head-no-bias-untied"])
def test_llava_activation_memory_matches_what_autograd_keeps(text):
    """Every LLaVA layer's act_elems (LlamaBlock: 9 D + 2 kv + 4 F per position + the row's geometry) equals
    the floats autograd keeps: llava-tiny (GQA 4/2, qkv bias, tied head, F = 2 D), and 1 kv head, no bias,
    an untied head and F = 1.5 D, so that the D, kv and F terms are told apart."""
    cfg = load_preset("llava-tiny")
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, **text))
    text_len, v, d = 12, cfg.vision, cfg.text.dim
    rows = layer_costs(cfg, (), text_len)
    length = rows[-1].tokens  # 16 <image> placeholders + 12 text
    shapes = {"VisionBlock": (v.n_positions, v.dim), "Projector": (v.n_positions, v.dim),
              "TextEmbed": (v.n_features, d), "PatchEmbed": (3, v.image_size, v.image_size)}

    def ints(batch):
        ids = torch.ones(batch, length, dtype=torch.long)
        ids[:, 1:1 + v.n_features] = cfg.image_token_id
        return sample_rows(cfg, ids)
    for spec, row in zip(layer_specs(cfg), rows):
        layer = TiedCall(spec.build(), spec.forward_fn) if getattr(spec, "forward_fn", None) else spec.build()
        shape = shapes.get(row.name, (length, d))

        def make(batch, shape=shape, grad=row.name != "PatchEmbed"):
            return torch.randn(batch, *shape, requires_grad=grad), *ints(batch)
        labels = _one_label if row.name == "LMHead" else None
        measured = _saved_floats_per_sample(layer, make, labels)
        # one-sample rows attend on SDPA's causal path and keep no L x L mask, nor does the rule (packed rows,
        # by sample: test_plan_qwen)
        assert measured == row.act_elems, (row.name, measured, row.act_elems)


def test_state_memory_hand_arithmetic():
    # fp32: 4 + 4 + 8 = 16 bytes per trainable parameter, 4 per frozen one
    assert state_bytes(1000, 600, "fp32", 0, 1) == {"weights": 4000, "grads": 2400, "optimizer": 4800}
    # bf16 + ZeRO-1 over 4 replicas: weights 2 B, grads 2 B + fp32 grads 4/4 B, master + moments 12/4 B
    assert state_bytes(1000, 600, "bf16", 1, 4) == {"weights": 2000, "grads": 1200 + 600, "optimizer": 1800}
    cfg = load_preset("tiny")
    rows = layer_costs(cfg, (), 12)
    parts = [0, 5, len(rows)]
    # stage 0 of 2 with 4 micro-batches holds min(2 - 0, 4) = 2 micro-batches of 3 samples in flight
    mem = stage_memory(rows, parts, 0, Shape(len(parts) - 1, 1, 3, 4), "fp32", 0)
    params = sum(r.params for r in rows[:5])
    acts = sum((r.act_elems - r.act_fp32_elems) * 4 + r.act_fp32_elems * 4 for r in rows[:5] if r.bwd_flops)
    assert mem["weights"] == 4 * params and mem["optimizer"] == 8 * params
    assert mem["activations"] == acts * 3 * 2
    last = stage_memory(rows, parts, 1, Shape(len(parts) - 1, 1, 3, 4), "fp32", 0)
    assert last["activations"] == sum(r.act_bytes("fp32") for r in rows[5:]) * 3 * 1  # min(2 - 1, 4) = 1


def plan_in_a_fresh_process(presets: list[str], argv: list[str]) -> dict[str, tuple[list[dict], float]]:
    """`mmpipe plan --preset P ARGV --json` for each preset in turn, in one new interpreter: per preset (the
    layouts, the interpreter's peak resident memory in GB once it is planned), the memory a model's weights
    would blow through if plan allocated them (the peak so far: each preset's bound holds for all before it).
    No timing is asserted (a shared machine's load decides it; `mmpipe plan` prints its own time)."""
    code = ("import contextlib, io, resource, sys; from mmpipe.cli import main\n"
            f"for p in {presets!r}:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            f"        rc = main(['plan', '--preset', p, *{argv!r}, '--json'])\n"
            "    out = buf.getvalue()\n"
            "    print('PLAN', p, rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, out[out.index('['):]"
            ".replace(chr(10), ' '))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {}
    for line in proc.stdout.splitlines():
        if line.startswith("PLAN "):
            _, preset, rc, rss_kb, layouts = line.split(" ", 4)
            assert rc == "0", (preset, proc.stderr[-2000:])
            got[preset] = json.loads(layouts), int(rss_kb) / 1e6
    assert list(got) == presets, proc.stdout[-2000:]
    return got


def test_plan_does_not_allocate_the_model():
    planned = plan_in_a_fresh_process(["moondream-2b", "vlm-7b"], ["--device", "a100-80gb"])
    for preset, (layouts, rss_gb) in planned.items():
        fits = [lay for lay in layouts if lay["step"]]
        assert fits and fits[0]["throughput"] >= max(lay["throughput"] for lay in layouts)
        weights_gb = {"moondream-2b": 1.86e9, "vlm-7b": 7.0e9}[preset] * 4 / 1e9
        assert rss_gb < min(2.0, weights_gb / 3), preset  # the fp32 weights alone would be 7.4 / 28 GB


def test_nothing_fits_is_a_clear_error(capsys):
    from mmpipe.cli import main
    rc = main(["plan", "--preset", "vlm-7b", "--device", "a100-40gb", "--gpus-per-node", "1", "--precision", "fp32",
               "--zero", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["mmpipe: error: plan: no layout of vlm-7b fits 1 x 37 GiB at global batch 256 (try "
                               "--checkpointing, --zero 1, --freeze vision, --lora 16 (adapters: no gradients or "
                               "optimizer state for the base), more --nodes)"]


def plan_here(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`mmpipe plan ARGV` in this process (a new interpreter costs ~4 s of imports): its exit status and output."""
    from mmpipe.cli import main
    capsys.readouterr()
    try:
        rc = main(["plan", *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["mmpipe", "plan", *argv], rc, out, err)


def test_the_planned_config_trains_as_written(tmp_path, capsys):
    out = tmp_path / "ds.json"
    proc = plan_here(capsys, "--preset", "tiny", "--device", "cpu", "--gpus-per-node", "2", "--global-batch", "32",
                     "--text-len", "12", "--precision", "fp32", "--zero", "0", "--write-config", str(out))
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(out.read_text())
    stages = cfg["pipeline"]["stages"]
    # the whole layout, in the file and the hint: run as written (no --dp), the global batch is the planned one
    best = next(ln for ln in proc.stdout.splitlines() if ln.startswith("best:"))
    dp = int(best.split(" x dp ")[1].split(",")[0])
    assert cfg["train_batch_size"] == 32 == dp * cfg["train_micro_batch_size_per_gpu"] * cfg[
        "gradient_accumulation_steps"]
    assert f"run it with mmpipe train --preset tiny --ds-config {out} --dp {dp} --text-len 12" in proc.stdout
    run = train_run(tmp_path / "run", "--preset", "tiny", "--ds-config", str(out), "--steps", "2",
                    "--eval-samples", "0").check()
    s = run.summary
    assert s["stages"] == stages and s["micro_batch"] == cfg["train_micro_batch_size_per_gpu"]
    assert (s["dp"], s["train_batch"]) == (dp, 32)
    if stages > 1:
        assert s["parts"][1:-1] == [int(b) for b in cfg["pipeline"]["partition"].split(",")]


def test_a_calibrated_devices_fixed_costs_add_to_the_step_as_the_formula_says():
    """(m + P - 1) x (slot + p2p + per-slot overhead) + all-reduce over its own bandwidth + per-step overhead."""
    plain = Device("d", 1e12, 1e10, 1e9)
    cal = Device("d", 1e12, 1e10, 1e9, microbatch_overhead=0.002, step_overhead=0.030, allreduce_link=1e8)
    times, grad = [(0.010, 0.020), (0.012, 0.025)], 4e6
    a = pipeline_step_seconds(times, 4, [1e6], grad, 2, plain)
    b = pipeline_step_seconds(times, 4, [1e6], grad, 2, cal)
    # slots 4 + 2 - 1 = 5; p2p 2 x 1e6 / 1e9 = 2 ms; all-reduce 2 (2-1)/2 x 4e6 B = 4e6 B
    assert a["step_s"] == pytest.approx(5 * (0.037 + 0.002) + 4e6 / 1e9)
    assert b["step_s"] == pytest.approx(5 * (0.037 + 0.002 + 0.002) + 4e6 / 1e8 + 0.030)
    assert a["bubble"] == b["bubble"] == pytest.approx(1 / 5) and b["slots"] == 5


def test_plan_layout_cuts_a_named_partition_as_training_does():
    rows = layer_costs(load_preset("small"), (), 12)
    dev = KNOWN_DEVICES["a100-80gb"]
    uni = plan_layout(rows, Shape(2, 1, 4, 4), Training("bf16", 0, dev, partition="uniform"))
    bal = plan_layout(rows, Shape(2, 1, 4, 4), Training("bf16", 0, dev))
    assert uni.parts == compute_parts(rows, 2, "uniform") and bal.parts == compute_parts(rows, 2, "balanced")
    assert uni.parts != bal.parts and uni.step["slot_s"] > bal.step["slot_s"]
    explicit = plan_layout(rows, Shape(2, 1, 4, 4), Training("bf16", 0, dev, partition="3"))
    assert explicit.parts == [0, 3, len(rows)]


# ---- --schedule: 1F1B and ZB-H1 predicted ---------------------------------------------------------

def test_zb_h1_unit_step_is_shorter_by_the_schedule_modules_count():
    """P = 2, m = 4, F = B = W = 1 s, free links: 1F1B (4 + 2 - 1) x 3 = 15 s, ZB-H1 13 s: the counts
    mmpipe.planning.schedules.simulate computes (the order mmpipe.runtime.schedule runs)."""
    dev = Device("unit", 1e12, 1e10, float("inf"))
    one = pipeline_step_seconds([(1.0, 2.0)] * 2, 4, [0.0], 0.0, 1, dev)
    zb = replayed_step_seconds(ZB_H1, [(1.0, 1.0, 1.0)] * 2, [True, True], 4, [0.0], 0.0, 1, dev)
    units_1f1b = simulate(2, 4, [True, True], split=False)["makespan"]
    units_zb = simulate(2, 4, [True, True])["makespan"]
    assert (units_1f1b, units_zb) == (15, 13)
    assert one["step_s"] == pytest.approx(units_1f1b) and zb["step_s"] == pytest.approx(units_zb)
    assert zb["saved_s"] == pytest.approx(2.0)
    assert one["bubble"] == pytest.approx(1 - 12 / 15) and zb["bubble"] == pytest.approx(1 - 12 / 13)
    # P = 4, m = 8: 33 -> 29 units; ZB-H1 holds up to P = 4 micro-batches on every stage (1F1B: 4, 3, 2, 1)
    zb4 = replayed_step_seconds(ZB_H1, [(1.0, 1.0, 1.0)] * 4, [True] * 4, 8, [0.0] * 3, 0.0, 1, dev)
    assert zb4["step_s"] == pytest.approx(29) and zb4["in_flight"] == [4, 4, 4, 4]
    assert predict("1f1b", 8, [(1.0, 1.0, 1.0)] * 4, [True] * 4)["in_flight"] == [4, 3, 2, 1]
    # one stage: nothing to save
    zb1 = replayed_step_seconds(ZB_H1, [(1.0, 1.0, 1.0)], [True], 4, [], 0.0, 1, dev)
    assert zb1["saved_s"] == 0.0 and zb1["step_s"] == pytest.approx(12) and zb1["bubble"] == pytest.approx(0)


def test_backward_splits_into_b_and_w_and_a_stage_without_trainable_linears_has_no_w():
    cfg, dev = load_preset("small"), KNOWN_DEVICES["a100-80gb"]
    rows = layer_costs(cfg, (), 12)
    for r in rows:  # a trainable block: W = 2 x linear weights x tokens, about half its backward
        if r.name in ("VisionBlock", "DecoderBlock"):
            assert r.w_flops <= 2 * r.params * r.tokens and 0.4 < r.w_flops / r.bwd_flops <= 0.5
    text = next(i for i, r in enumerate(rows) if r.name == "TextEmbed")
    assert rows[text].trainable and rows[text].w_flops == 0  # nn.Embedding: its gradient runs in B
    frozen = layer_costs(cfg, ("vision", "projector"), 12)
    assert all(r.bwd_flops == 0 and r.w_flops == 0 for r in frozen[:text])  # frozen prefix: no B, no W
    # stage 0 = frozen ViT + projector + the token embedding: trainable, but no nn.Linear of its own
    lay = plan_layout(frozen, Shape(2, 1, 4, 4), Training("bf16", 0, dev, "zb-h1", partition=str(text + 1)))
    zb = lay.predictions["zb-h1"]
    assert lay.parts == [0, text + 1, len(frozen)] and lay.schedule == "zb-h1" and lay.step is zb
    assert zb["weight_stages"] == [False, True] and zb["w_s"][0] == 0.0 and zb["w_s"][1] > 0
    assert lay.stage_rows[0]["weight_backward_ms"] == 0.0
    for (f, bw), (f2, b, w) in zip(stage_seconds(frozen, lay.parts, 4, dev),
                                   stage_split_seconds(frozen, lay.parts, 4, dev)):
        assert f2 == f and b + w == pytest.approx(bw)  # B + W is the backward 1F1B is predicted with
    # stage 0's B is only the embedding's weight gradient (dim x tokens FLOPs): the ViT runs no backward
    assert lay.stage_rows[0]["input_backward_ms"] == pytest.approx(
        frozen[text].bwd_flops * 4 / (dev.peak_flops * dev.efficiency) * 1e3)


def test_plan_layout_default_is_1f1b_and_both_recommends_the_faster():
    rows = layer_costs(load_preset("small"), (), 12)
    dev = KNOWN_DEVICES["a100-80gb"]
    plain, both = (plan_layout(rows, Shape(4, 1, 4, 4), Training("bf16", 0, dev, sched)) for sched in ("1f1b", "both"))
    assert plain.schedule == "1f1b" and set(plain.predictions) == {"1f1b"} and "input_backward_ms" not in \
        plain.stage_rows[0]
    assert both.predictions["1f1b"] == plain.step and set(both.predictions) == {"1f1b", "zb-h1"}
    faster = min(both.predictions, key=lambda k: both.predictions[k]["step_s"])
    assert both.schedule == faster and both.step is both.predictions[faster]


def _plan(capsys, *argv):
    return plan_here(capsys, "--preset", "small", "--device", "a100-80gb", "--gpus-per-node", "4", "--global-batch",
                     "64", "--micro", "4,8", *argv)


def test_plan_schedule_both_names_both_and_writes_the_choice(tmp_path, capsys):
    out = tmp_path / "ds.json"
    proc = _plan(capsys, "--schedule", "both", "--write-config", str(out))
    assert proc.returncode == 0, proc.stderr
    header = next(ln for ln in proc.stdout.splitlines() if ln.lstrip().startswith("PP"))
    assert "1f1b s" in header and "zb-h1 s" in header and "faster" in header
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.strip() and ln.split()[0] in ("1", "2", "4")
            and len(ln.split()) > 9]
    assert rows and {r[8] for r in rows} <= {"1f1b", "zb-h1"} and any(r[0] != "1" for r in rows)
    best = next(ln for ln in proc.stdout.splitlines() if ln.startswith("best:"))
    written = json.loads(out.read_text())
    assert best.endswith(f"schedule {written['pipeline']['schedule']}")
    js = json.loads(_plan(capsys, "--schedule", "both", "--json").stdout)
    assert all(set(lay["predictions"]) == {"1f1b", "zb-h1"} and lay["schedule"] in ("1f1b", "zb-h1") for lay in js)
    default = json.loads(_plan(capsys, "--json").stdout)
    assert all(lay["schedule"] == "1f1b" and set(lay["predictions"]) == {"1f1b"} for lay in default)


def test_plan_refuses_a_bad_schedule(capsys):
    proc = _plan(capsys, "--schedule", "gpipe")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "mmpipe: error: --schedule: 'gpipe' is not a schedule (valid: 1f1b, zb-h1, dualpipev, both, all)"], proc.stderr


def test_a_row_carries_its_images_through_the_tower_and_its_positions_through_the_decoder():
    """Rows (--max-images M, --pack): per-image layers cost M x one image's, the decoder M x N + text_len
    positions; M = 1 is the classic layout, unchanged. llava-tiny: N = 16, M = 4, text 96 -> 160."""
    cfg = load_preset("llava-tiny")
    one, row = layer_costs(cfg, (), 96), layer_costs(cfg, (), 96, images=4)
    assert layer_costs(cfg, (), 96, images=1) == one
    tower = {"PatchEmbed", "VisionBlock", "Projector"}  # LLaVA's tower: no final vision norm layer
    assert tower <= {r.name for r in one}
    for a, b in zip(one, row):
        if a.name in tower:  # 4 images: every term x 4
            assert (b.tokens, b.fwd_flops, b.bwd_flops, b.act_elems, b.out_elems) == pytest.approx(
                (4 * a.tokens, 4 * a.fwd_flops, 4 * a.bwd_flops, 4 * a.act_elems, 4 * a.out_elems))
        else:
            assert (a.tokens, b.tokens) == (16 + 96, 4 * 16 + 96)


def test_plan_prices_rows_and_reports_positions_when_packed(capsys):
    from mmpipe.cli import main
    base = ["plan", "--preset", "llava-tiny", "--device", "a100-80gb", "--gpus-per-node", "2", "--global-batch", "32",
            "--micro", "4", "--text-len", "32"]  # llava-tiny's 64 positions: 2 x 16 image + 32 text, as train allows
    assert main(base + ["--max-images", "2", "--pack"]) == 0
    out = capsys.readouterr().out
    assert "decoder positions per row: 2 image slots x 16 + 32 text = 64; rows hold several samples" in out
    assert "positions/s" in next(ln for ln in out.splitlines() if ln.lstrip().startswith("PP"))
    assert "useful tokens/s = positions/s x (1 - padding share)" in out
    assert main(base + ["--max-images", "2", "--pack", "--json"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert all(lay["decoder_length"] == 64 and lay["positions_per_s"] == pytest.approx(lay["throughput"] * 64)
               for lay in packed)
    assert main(base + ["--json"]) == 0
    classic = json.loads(capsys.readouterr().out)
    assert classic[0]["decoder_length"] == 48 and packed[0]["throughput"] < classic[0]["throughput"]
    assert main(base) == 0
    assert "decoder positions per row: 16 image + 32 text = 48, one sample per row" in capsys.readouterr().out
    assert main(base + ["--max-images", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmpipe: error: --max-images: 0 must be >= 1"), err
    assert main(base + ["--preset", "tiny-xattn", "--pack", "--max-images", "2"]) == 0  # cross-attention packs too
    assert "2 image slots" in capsys.readouterr().out


def test_plan_checks_the_shared_flags_as_train_does(capsys):
    """plan takes --text-len, --max-images, --pack, --freeze, --lora from train's declarations and refuses
    what train refuses, in train's words; its default --text-len is what the preset's context leaves."""
    from mmpipe.cli import main
    base = ["plan", "--preset", "small", "--device", "a100-80gb", "--gpus-per-node", "2", "--global-batch", "32"]
    for bad in (["--text-len", "2000"], ["--max-images", "2"], ["--freeze", "vison"], ["--lora", "4", "--lora-groups",
                                                                                      "txt"]):
        train = TrainArgs.from_argv(["--preset", "small", *bad])
        with pytest.raises(ConfigError) as e:
            resolve(train, 2)
        assert main(base + bad) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"mmpipe: error: {e.value}"], bad
    assert main(base + ["--json"]) == 0  # small: 64 positions, 16 image tokens -> text 48
    assert {lay["decoder_length"] for lay in json.loads(capsys.readouterr().out)} == {16 + 48}


# the printed run command of --write-config (issue 46 item 2): models whose preset is not train's default, with the
# row and model flags a user plans with; each must run as printed
WRITTEN_PLANS = {
    "qwen2.5-vl-72b": ["--device", "h100-80gb", "--gpus-per-node", "8", "--nodes", "4", "--global-batch", "128",
                       "--micro", "1", "--image-size", "1024x768", "--max-images", "4", "--max-patches", "16384",
                       "--text-len", "1024", "--checkpointing"],
    "llava-v1.6-mistral-7b": ["--image-size", "1024x768,300x1200", "--max-tiles", "10", "--text-len", "512"],
    "llava-1.5-7b": ["--device", "h100-80gb", "--gpus-per-node", "8", "--global-batch", "64", "--text-len", "1024",
                     "--max-images", "2", "--pack", "--freeze", "vision", "--lora", "16"],
    "moondream-2b": ["--device", "a100-80gb", "--gpus-per-node", "2", "--global-batch", "64", "--max-crops", "6",
                     "--text-len", "128"],
}


@pytest.mark.parametrize("preset", list(WRITTEN_PLANS))
def test_the_printed_train_command_runs_the_plan_as_planned(preset, tmp_path, capsys):
    """`mmpipe plan --write-config` prints the `mmpipe train` command that runs the plan: run as printed (a dry
    run: these models do not fit here) it takes the planned model, layout and rows, not train's default preset."""
    from mmpipe.cli import main
    out = tmp_path / "ds.json"
    proc = plan_here(capsys, "--preset", preset, *WRITTEN_PLANS[preset], "--write-config", str(out))
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.strip().splitlines()[-1].split("; run it with mmpipe train ", 1)[1]
    argv = shlex.split(printed)
    assert argv[:2] == ["--preset", preset], printed
    planned = json.loads(out.read_text())["pipeline"]
    capsys.readouterr()
    assert main(["train", *argv, "--dry-run"]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert f"mmpipe: dry run: train {preset} " in said
    best = next(ln for ln in proc.stdout.splitlines() if ln.startswith("best:"))
    assert f"layout: {best.split(': ')[1].split(',')[0]} = " in said, (best, said)  # '16 stages x dp 2'
    bounds = [int(b) for b in planned["partition"].split(",")] if planned["partition"] != "balanced" else []
    assert f"layer boundaries [0, {''.join(f'{b}, ' for b in bounds)}" in said
    for flag in ("--image-size", "--checkpointing", "--device", "--nodes", "--global-batch", "--micro"):
        assert flag not in argv  # plan's own flags: train takes them from the config it wrote, or has none
    given = WRITTEN_PLANS[preset]
    for flag in ("--text-len", "--max-images", "--max-patches", "--max-tiles", "--freeze", "--lora", "--max-crops"):
        if flag in given:  # each row and model flag the plan was given, with its value
            assert argv[argv.index(flag) + 1] == given[given.index(flag) + 1], flag
    assert ("--pack" in argv) == ("--pack" in given)


def _check_profile(path, precision: str = "fp32") -> None:
    """A device profile as `mmpipe check --preset small --stages 2` writes it on fp32 ranks (mmpipe.check.profile's
    own profile_doc of the run, its layer-kind table a made-up one: plan reads the fitted terms, not the table)."""
    from mmpipe.check.profile import profile_doc
    run = resolve(TrainArgs(preset="small", stages=2, eval_samples=0), world_size=2)
    kinds = {r.name: (1e-4, 2e-4) for r in run.layers}
    slowest = {"rank": 1, "kinds": kinds, "seconds": 0.05}
    doc = profile_doc(run, slowest, Device("cpu", 9e10, 16 * 2 ** 30, 5e9), [])
    assert doc["fit"]["source"] == "mmpipe check" and list(doc["efficiency"]) == [precision]
    path.write_text(json.dumps(doc))


def test_a_profile_check_wrote_plans_at_its_own_precision(tmp_path, capsys):
    """docs/check.md's `mmpipe plan --device-profile runs/check/device_profile.json ...` without --precision plans
    at the precision the check ran (fp32 here, where plan's own default is bf16); another precision is refused
    in one line whose advice fits a profile check wrote (plan at fp32, or rerun the check at bf16)."""
    path = tmp_path / "device_profile.json"
    _check_profile(path)
    doc = ["--device-profile", str(path), "--preset", "small", "--text-len", "12", "--micro", "16"]
    proc = plan_here(capsys, *doc)
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert header.startswith("small on 8 x cpu (calibrated) ") and ", fp32, ZeRO-1" in header, header
    proc = plan_here(capsys, *doc, "--precision", "bf16")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"mmpipe: error: --device-profile: {path}: calibrated for fp32 only, not --precision bf16 (plan with "
        f"--precision fp32, or rerun mmpipe check with a bf16 --ds-config)"]
    proc = plan_here(capsys, "--preset", "small", "--text-len", "12", "--micro", "16")  # no profile: plan's bf16
    assert proc.returncode == 0 and ", bf16, ZeRO-1" in proc.stdout.splitlines()[0], proc.stdout[:300]


def test_write_config_makes_its_folder_and_a_path_it_cannot_write_is_one_line(tmp_path, capsys):
    argv = ["--preset", "small", "--device", "a100-80gb", "--gpus-per-node", "2", "--global-batch", "32"]
    assert plan_here(capsys, *argv, "--write-config", str(tmp_path / "new" / "ds.json")).returncode == 0
    assert json.loads((tmp_path / "new" / "ds.json").read_text())["train_batch_size"] == 32
    (tmp_path / "file").write_text("")
    proc = plan_here(capsys, *argv, "--write-config", str(tmp_path / "file" / "ds.json"))  # under a file: no folder
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"mmpipe: error: --write-config: cannot write {tmp_path / 'file' / 'ds.json'}: ")
