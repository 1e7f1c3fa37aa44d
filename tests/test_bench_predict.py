"""Predicted beside measured, calibration and the plots (issue 22, items 3-5): every variant row of a
bench result carries what `mmpipe plan` computes for its layout; `mmpipe plan --calibrate` recovers
the terms measurements were generated from, writes a device profile that round-trips and changes
plan's step time; bad inputs are one `mmpipe: error:` line and exit 2; throughput.png has one bar
per variant. No training runs here: rows are built from sweep variants with measured fields set."""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from mmpipe.bench.plots import plot_throughput, prediction_points, throughput_bars
from mmpipe.bench.predict import COLUMNS as PREDICTED
from mmpipe.bench.predict import add_predictions
from mmpipe.bench.report import COLUMNS, write_all
from mmpipe.bench.sweep import parse
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.planning.calibrate import calibrate, load_profile, predict_row, results_device
from mmpipe.planning.costmodel import Device
from mmpipe.planning.plan import PlanSpec, plan

ROOT = Path(__file__).resolve().parent.parent
META = {"sweep": "test", "device": "cpu", "peaks": {"fp32": 1.0e11, "bf16": 4.0e11}, "steps": 6, "warmup_steps": 1,
        "machine": {"cpu": "test", "cores": 2}}
SWEEP = {"base": {"preset": "small", "micro": 16, "gas": 4},
         "variants": [{"name": "pp1"}, {"name": "pp2", "stages": 2}, {"name": "pp2_bf16", "stages": 2,
                                                                      "precision": "bf16"},
                      {"name": "pp2_mb8_gas8", "stages": 2, "micro": 8, "gas": 8},
                      {"name": "pp2_ckpt", "stages": 2, "checkpointing": True},
                      {"name": "pp2_bf16_mb8", "stages": 2, "precision": "bf16", "micro": 8, "gas": 8},
                      {"name": "pp1_dp2_z1", "dp": 2, "zero": 1},
                      {"name": "pp2_dp2_z1", "stages": 2, "dp": 2, "zero": 1, "micro": 8},
                      {"name": "pp2_uniform", "stages": 2, "partition": "uniform"},
                      {"name": "pp1_gas8", "gas": 8}]}
# what the synthetic "measurements" are generated from: the planner with these terms
TRUE = {"efficiency": {"fp32": 0.37, "bf16": 0.12}, "microbatch_overhead_s": 0.012, "step_overhead_s": 0.025,
        "allreduce_link": 3e7}


def truth_device(precision: str, split: float = 0.0) -> Device:
    base = results_device(META, precision)
    return replace(base, efficiency=TRUE["efficiency"][precision], microbatch_overhead=TRUE["microbatch_overhead_s"],
                   step_overhead=TRUE["step_overhead_s"], allreduce_link=TRUE["allreduce_link"], split_overhead=split)


def measured_rows(repeats: int = 2, noise=lambda name, rep: 1.0, sweep=SWEEP, split: float = 0.0) -> list[dict]:
    """One row per variant x repeat as `mmpipe bench` writes it, the step time from TRUE's planner
    (zb-h1 variants: its replay with `split` seconds per W)."""
    rows = []
    for rep in range(repeats):
        for v in parse(sweep).variants:
            row = {"kind": "variant", "repeat": rep, **v.to_dict(), "world": v.world, "status": "ok", "reason": ""}
            step = predict_row(row, truth_device(v.precision, split)).step["step_s"] * noise(v.name, rep)
            batch = v.micro * v.gas * v.dp
            rows.append({**row, "train_batch": batch, "measured_steps": 5, "step_time_s": step,
                         "samples_per_s": batch / step, "samples_per_s_iqr": 1.0,
                         "useful_tokens_per_s": 25 * batch / step, "useful_tokens_per_s_iqr": 1.0,
                         "positions_per_s": 28 * batch / step, "positions_per_s_iqr": 1.0,
                         "peak_mem_mb_per_rank": [800.0 + r for r in range(v.world)],
                         "peak_mem_mb_max": 800.0 + v.world - 1,
                         "bubble_measured": 0.3 if v.stages > 1 else 0.0,
                         "bubble_theory": (v.stages - 1) / (v.gas + v.stages - 1), "final_loss": 3.0, "wall_s": 10.0})
    return rows


def results_file(tmp_path, rows=None) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": META, "rows": rows or measured_rows(), "targets": [], "medians": {}}))
    return path


def plan_json(capsys, *args) -> list[dict]:
    assert main(["plan", "--preset", "small", "--text-len", "12", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


# ---- item 3: predictions --------------------------------------------------------------------------------

def test_each_rows_prediction_is_what_mmpipe_plan_prints_for_its_layout(capsys):
    rows = {r["name"]: r for r in add_predictions(measured_rows(1), META)}
    for name, gpus, batch, micro, prec, zero in (("pp2", 2, 64, 16, "fp32", 0), ("pp1_dp2_z1", 2, 128, 16, "fp32", 1),
                                                 ("pp2_bf16", 2, 64, 16, "bf16", 0),
                                                 ("pp2_dp2_z1", 4, 64, 8, "fp32", 1)):
        r = rows[name]
        # the CLI, as a user reproduces it: the sweep's peak, the CPU's default efficiency 0.5
        got = plan_json(capsys, "--device", "cpu", "--peak-tflops", str(META["peaks"][prec] / 1e12),
                        "--efficiency", "0.5", "--gpus-per-node", str(gpus), "--global-batch", str(batch),
                        "--micro", str(micro), "--precision", prec, "--zero", str(zero))
        lay = next(g for g in got if g["stages"] == r["stages"] and g["dp"] == r["dp"])
        assert r["predicted_step_time_s"] == pytest.approx(lay["step"]["step_s"], rel=1e-12)
        assert r["predicted_bubble"] == pytest.approx(lay["step"]["bubble"])
        per_stage = [s["memory_gib"] * 1024 for s in lay["stage_rows"]]
        # ranks are stage-major (DeepSpeed's pipe x data grid): rank = stage x DP + replica
        assert r["predicted_peak_mem_mb_per_rank"] == pytest.approx(
            [per_stage[k // r["dp"]] for k in range(r["world"])], abs=1e-3)
        assert r["step_time_ratio"] == pytest.approx(r["step_time_s"] / r["predicted_step_time_s"])
        assert r["peak_mem_ratio"] == pytest.approx(r["peak_mem_mb_max"] / r["predicted_peak_mem_mb_max"])
    assert rows["pp1"]["bubble_ratio"] is None and rows["pp1"]["predicted_bubble"] == 0.0
    assert rows["pp2"]["bubble_ratio"] == pytest.approx(0.3 / 0.2)
    # a uniform split is predicted as mmpipe train cuts it (layers 0-5 | 6-10), slower than balanced's
    assert rows["pp2_uniform"]["predicted_step_time_s"] > rows["pp2"]["predicted_step_time_s"] * 1.1


def test_predictions_in_csv_json_and_markdown(tmp_path):
    rows = measured_rows(2)
    rows.append({"kind": "peer", "repeat": 0, "name": "peer_hf", "engine": "hf", "preset": "small", "stages": 1,
                 "dp": 1, "zero": None, "precision": "fp32", "micro": 16, "gas": 4, "status": "ok", "reason": "",
                 "samples_per_s": 300.0, "samples_per_s_iqr": 2.0, "step_time_s": 64 / 300.0})
    rows.append({**rows[1], "repeat": 2, "status": "crashed", "reason": "boom"})  # pp2, a failed repeat
    write_all(rows, tmp_path, META, {"pp1": "pp1", "pp2": "pp2"})
    with open(tmp_path / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        got = list(reader)
    assert reader.fieldnames == COLUMNS and set(PREDICTED) <= set(COLUMNS)
    section = (ROOT / "docs" / "benchmarks.md").read_text().split("## results.csv columns", 1)[1].split("\n## ")[0]
    assert re.findall(r"^\| `([a-z_0-9]+)` \|", section, flags=re.M) == COLUMNS  # documented, in order
    pp2 = next(r for r in got if r["name"] == "pp2" and r["repeat"] == "0")
    want = predict_row(pp2 | {"stages": 2, "dp": 1, "micro": 16, "gas": 4, "checkpointing": False},
                       results_device(META, "fp32")).step["step_s"]
    assert float(pp2["predicted_step_time_s"]) == pytest.approx(want, rel=1e-5)
    assert len(pp2["predicted_peak_mem_mb_per_rank"].split(";")) == 2
    failed = next(r for r in got if r["name"] == "pp2" and r["repeat"] == "2")
    assert failed["predicted_step_time_s"] and failed["step_time_ratio"] == ""  # predicted, nothing to compare
    peer = next(r for r in got if r["name"] == "peer_hf")
    assert all(peer[c] == "" for c in PREDICTED)
    res = json.loads((tmp_path / "results.json").read_text())
    assert all(r["predicted_step_time_s"] for r in res["rows"] if r["kind"] == "variant")
    md = (tmp_path / "results.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("| pp2 | 2 x 1 |"))
    measured = [r["step_time_s"] for r in rows if r["name"] == "pp2" and r["status"] == "ok"]
    assert f"{sum(measured) / 2 * 1e3:.1f} / {want * 1e3:.1f}" in line
    assert f"**{sum(measured) / 2 / want:.2f}**" in line
    assert "Predicted: `mmpipe plan`" in md


def test_collected_results_without_predictions_get_them(tmp_path):
    """write_all computes them from the rows' variant fields, whatever wrote the rows."""
    rows = [{k: v for k, v in r.items() if k not in PREDICTED} for r in measured_rows(1)]
    out = write_all(rows, tmp_path, META, None)
    assert all(r["predicted_step_time_s"] > 0 for r in out["rows"])


# ---- item 4: calibration --------------------------------------------------------------------------------

def test_calibration_recovers_the_terms_measurements_were_made_with(tmp_path):
    data = json.loads(results_file(tmp_path).read_text())
    res = calibrate(data, ["pp2_ckpt", "pp2_uniform"], "x")
    p = res["params"]
    assert p["efficiency"] == pytest.approx(TRUE["efficiency"], rel=1e-6)
    assert p["microbatch_overhead_s"] == pytest.approx(TRUE["microbatch_overhead_s"], rel=1e-6)
    assert p["step_overhead_s"] == pytest.approx(TRUE["step_overhead_s"], rel=1e-6)
    assert p["allreduce_link"] == pytest.approx(TRUE["allreduce_link"], rel=1e-6)
    assert res["fit_error"]["max_abs"] < 1e-6  # float round-off of the least squares (columns span 1e-3..1e6)
    held = {s["name"]: s for s in res["variants"] if s["held_out"]}
    assert set(held) == {"pp2_ckpt", "pp2_uniform"}
    for s in held.values():  # never fitted, predicted exactly once the terms are right
        assert s["after"] == pytest.approx(s["measured"], rel=1e-6)
        assert abs(s["before"] / s["measured"] - 1) > 0.2  # the uncalibrated planner was far off


def test_calibration_with_noise_and_default_hold_out(tmp_path, capsys):
    # +-4% noise, alternating by variant: the fit is least squares, not exact
    names = [v.name for v in parse(SWEEP).variants]
    rows = measured_rows(1, noise=lambda n, rep: 1.04 if names.index(n) % 2 else 0.96)
    path = results_file(tmp_path, rows)
    prof = tmp_path / "prof.json"
    assert main(["plan", "--calibrate", str(path), "--write-profile", str(prof)]) == 0
    out = capsys.readouterr().out
    # default: the last two the fit can speak for (pp1_gas8 and pp2_uniform: fp32, DP = 1)
    assert re.search(r"^pp2_uniform .*HELD OUT$", out, flags=re.M) and re.search(r"^pp1_gas8 .*HELD OUT$", out,
                                                                                   flags=re.M)
    assert "fit error (relative, fitted variants)" in out and "held-out error: before" in out
    p = load_profile(str(prof))
    assert p["fit"]["held_out"] == ["pp2_uniform", "pp1_gas8"]
    assert 0.01 < p["fit"]["rms_rel_error"] < 0.06  # the noise is 4%
    # efficiency and the per-slot overhead trade off under noise (both scale with the slots), so the
    # terms move more than 4%; what the fit is for, predicting variants it did not see, stays near the noise
    assert p["fit"]["held_out_rms_rel_error"] < 0.08


def test_calibration_fits_the_zb_h1_split_overhead_and_plan_then_ranks_the_schedules_as_measured(tmp_path, capsys):
    """zb-h1 variants "measured" with splitting costing 8 ms per W (on this CPU the split cost more than
    the bubble it fills, docs/schedules.md): --calibrate recovers the overhead from one of them and
    predicts the held-out one; `plan --schedule both` with the profile then ranks 1F1B first for PP=2,
    as the measurements do, where the uncalibrated planner (a free split) ranks zb-h1 first."""
    split = 0.008
    zb = [{"name": "pp2_zb", "stages": 2, "schedule": "zb-h1"},
          {"name": "pp2_zb_mb8_gas8", "stages": 2, "micro": 8, "gas": 8, "schedule": "zb-h1"}]
    sweep = {**SWEEP, "variants": SWEEP["variants"][:4] + zb}
    rows = measured_rows(1, sweep=sweep, split=split)
    step = {r["name"]: r["step_time_s"] for r in rows}
    assert step["pp2_zb"] > step["pp2"] and step["pp2_zb_mb8_gas8"] > step["pp2_mb8_gas8"]  # measured: 1f1b faster
    path, prof = results_file(tmp_path, rows), tmp_path / "prof.json"
    assert main(["plan", "--calibrate", str(path), "--hold-out", "pp2_zb_mb8_gas8", "--write-profile", str(prof)]) == 0
    out = capsys.readouterr().out
    assert "zb-h1 split overhead 8.00 ms per W" in out
    p = load_profile(str(prof))
    assert p["split_overhead_s"] == pytest.approx(split, rel=1e-6)
    assert p["efficiency"]["fp32"] == pytest.approx(TRUE["efficiency"]["fp32"], rel=1e-6)  # zb rows kept out
    assert p["fit"]["held_out_rms_rel_error"] < 1e-6  # the held-out zb-h1 variant predicted exactly
    args = ["--schedule", "both", "--precision", "fp32", "--gpus-per-node", "2", "--global-batch", "64",
            "--micro", "16", "--zero", "0"]
    calibrated = next(g for g in plan_json(capsys, "--device-profile", str(prof), *args) if g["stages"] == 2)
    assert calibrated["predictions"]["zb-h1"]["step_s"] == pytest.approx(step["pp2_zb"], rel=1e-6)
    assert calibrated["schedule"] == "1f1b"
    free = {**json.loads(prof.read_text()), "split_overhead_s": 0.0}  # the same profile, the split free
    (tmp_path / "free.json").write_text(json.dumps(free))
    uncal = next(g for g in plan_json(capsys, "--device-profile", str(tmp_path / "free.json"), *args)
                 if g["stages"] == 2)
    assert uncal["schedule"] == "zb-h1"  # a free split: the bubble it fills is all gain


def test_device_profile_round_trips_and_changes_plans_step(tmp_path, capsys):
    path = results_file(tmp_path)
    prof = tmp_path / "prof.json"
    assert main(["plan", "--calibrate", str(path), "--hold-out", "pp2_ckpt", "--write-profile", str(prof)]) == 0
    capsys.readouterr()
    p = load_profile(str(prof))
    assert p["microbatch_overhead_s"] == pytest.approx(0.012, rel=1e-6) and p["peak_flops"]["fp32"] == 1e11
    args = ["--gpus-per-node", "2", "--global-batch", "64", "--micro", "16", "--zero", "0"]
    for prec in ("fp32", "bf16"):
        calibrated = plan_json(capsys, "--device-profile", str(prof), "--precision", prec, *args)
        plain = plan_json(capsys, "--device", "cpu", "--peak-tflops", str(META["peaks"][prec] / 1e12),
                          "--efficiency", "0.5", "--precision", prec, *args)
        for stages in (1, 2):
            want = predict_row({"preset": "small", "stages": stages, "dp": 2 // stages, "micro": 16,
                                "gas": 4 // (2 // stages), "precision": prec, "zero": 0}, truth_device(prec))
            cal = next(g for g in calibrated if g["stages"] == stages)
            assert cal["step"]["step_s"] == pytest.approx(want.step["step_s"], rel=1e-6)
            assert cal["step"]["step_s"] > 1.3 * next(g for g in plain if g["stages"] == stages)["step"]["step_s"]
    # flags still override the profile
    eff = plan_json(capsys, "--device-profile", str(prof), "--precision", "fp32", "--efficiency", "0.74", *args)
    cal = next(g for g in calibrated if g["stages"] == 2)
    assert next(g for g in eff if g["stages"] == 2)["step"]["step_s"] < cal["step"]["step_s"]


def _one_error(capsys, argv: list[str], expect: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmpipe: error:") and expect in err[0], err


def test_bad_results_file_is_one_line_and_exit_2(tmp_path, capsys):
    sweep = ROOT / "ds_configs" / "sweeps" / "default.json"
    _one_error(capsys, ["plan", "--calibrate", str(sweep)], "not a `mmpipe bench` result")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    _one_error(capsys, ["plan", "--calibrate", str(bad)], "not valid JSON")
    _one_error(capsys, ["plan", "--calibrate", str(tmp_path / "missing.json")], "not found")
    good = results_file(tmp_path)
    _one_error(capsys, ["plan", "--calibrate", str(good), "--hold-out", "nosuch"], "--hold-out: nosuch is not")
    _one_error(capsys, ["plan", "--calibrate", str(good), "--hold-out", "pp2_bf16,pp2_bf16_mb8"],
               "would leave no bf16 variant")
    few = results_file(tmp_path, [r for r in measured_rows(1) if r["name"] in ("pp1", "pp2", "pp2_ckpt")])
    _one_error(capsys, ["plan", "--calibrate", str(few), "--hold-out", "pp2_ckpt"], "2 variant(s) to fit 3")
    assert not (tmp_path / "device_profile.json").exists()


@pytest.mark.parametrize("edit, expect", [
    (lambda p: {"hello": 1}, "not a device profile"),
    (lambda p: {**p, "efficiency": {"fp32": -1}}, "efficiency must map precisions"),
    (lambda p: {**p, "efficiency": {"fp8": 0.5}}, "efficiency must map precisions"),
    (lambda p: {**p, "microbatch_overhead_s": "fast"}, "microbatch_overhead_s must be a non-negative number"),
    (lambda p: {k: v for k, v in p.items() if k != "allreduce_bytes_per_s"}, "allreduce_bytes_per_s must be"),
    (lambda p: {**p, "peak_flops": {"bf16": 1e11}}, "efficiency for fp32 has no peak_flops entry"),
])
def test_malformed_profile_is_one_line_and_exit_2(tmp_path, capsys, edit, expect):
    assert main(["plan", "--calibrate", str(results_file(tmp_path)), "--write-profile", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    good = json.loads((tmp_path / "p.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps(edit(good)))
    _one_error(capsys, ["plan", "--preset", "small", "--device-profile", str(tmp_path / "bad.json"), "--precision",
                        "fp32"], expect)


def test_profile_without_the_precision_is_refused(tmp_path, capsys):
    rows = [r for r in measured_rows(1) if r["precision"] == "fp32"]
    assert main(["plan", "--calibrate", str(results_file(tmp_path, rows)), "--write-profile",
                 str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    _one_error(capsys, ["plan", "--preset", "small", "--device-profile", str(tmp_path / "p.json"), "--precision",
                        "bf16"], "calibrated for fp32 only, not --precision bf16 (plan with --precision fp32, or "
                                 "calibrate on a sweep with bf16 variants)")
    # without --precision it plans at the one precision the profile holds, not plan's default bf16
    assert main(["plan", "--preset", "small", "--device-profile", str(tmp_path / "p.json")]) == 0
    assert ", fp32, ZeRO-1" in capsys.readouterr().out.splitlines()[0]
    (tmp_path / "text").write_text("not json")
    _one_error(capsys, ["plan", "--device-profile", str(tmp_path / "text")], "not valid JSON")


# ---- item 5: plots --------------------------------------------------------------------------------------

def test_throughput_plot_has_one_bar_per_variant_and_the_ideal():
    rows = measured_rows(3) + [
        {"kind": "variant", "repeat": 0, "name": "fp16_z1", "stages": 2, "dp": 1, "status": "unsupported",
         "reason": "no fp16", "preset": "small", "precision": "fp16", "checkpointing": False, "gas": 4},
        {"kind": "peer", "repeat": 0, "name": "peer_torch_pipe", "stages": 2, "dp": 1, "status": "ok",
         "samples_per_s": 500.0, "samples_per_s_iqr": 5.0, "preset": "small", "precision": "fp32"}]
    rows[0] = {**rows[0], "samples_per_s": rows[0]["samples_per_s"] * 1.5}  # pp1 repeat 0 faster: median moves
    bars = throughput_bars(rows, {"pp1": "pp1"})
    names = list(dict.fromkeys(r["name"] for r in rows))
    assert sorted(b["name"] for b in bars) == sorted(names)  # one bar per variant, not per repeat
    by = {b["name"]: b for b in bars}
    pp1 = sorted(r["samples_per_s"] for r in rows if r["name"] == "pp1")
    assert by["pp1"]["median"] == pytest.approx(pp1[1]) and len(by["pp1"]["repeats"]) == 3
    assert by["pp1"]["q1"] == pytest.approx((pp1[0] + pp1[1]) / 2) and by["pp1"]["q3"] == pytest.approx(
        (pp1[1] + pp1[2]) / 2)
    # PP=2's 1F1B bound from PP=1: pp1 x 2 x m/(m+1), m = 4 -> 1.6 x pp1; DP=2: 2 x pp1; PP=2 x DP=2, m=4: 3.2 x
    assert by["pp2"]["ideal"] == pytest.approx(pp1[1] * 1.6)
    assert by["pp2_mb8_gas8"]["ideal"] == pytest.approx(pp1[1] * 2 * 8 / 9)
    assert by["pp1_dp2_z1"]["ideal"] == pytest.approx(pp1[1] * 2)
    assert by["pp2_dp2_z1"]["ideal"] == pytest.approx(pp1[1] * 3.2)
    assert by["pp2_bf16"]["ideal"] is None and by["pp2_ckpt"]["ideal"] is None and by["pp1"]["ideal"] is None
    assert by["fp16_z1"]["status"] == "unsupported" and by["peer_torch_pipe"]["group"] == "peer"
    assert bars[-1]["name"] == "peer_torch_pipe"  # peers last
    groups = [b["group"] for b in bars]
    assert groups == sorted(groups, key=groups.index)  # each PP x DP layout together
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plot_throughput(plt, bars)
    ax = fig.axes[0]
    drawn = [p for p in ax.patches if p.get_width() > 0]
    ok = [b for b in bars if b["status"] == "ok"]
    assert len(drawn) == len(ok)  # one bar per variant that ran
    assert sorted(round(p.get_width(), 6) for p in drawn) == sorted(round(b["median"], 6) for b in ok)
    peer_bar = next(p for p in drawn if math.isclose(p.get_width(), 500.0))
    variant_colours = {p.get_facecolor() for p in drawn if p is not peer_bar}
    assert peer_bar.get_facecolor() not in variant_colours  # the peer in its own colour
    assert [t.get_text() for t in ax.get_yticklabels()] == [b["name"] for b in bars]
    plt.close(fig)


def test_predicted_points_and_all_plots_written(tmp_path):
    rows = add_predictions(measured_rows(2), META)
    pts = prediction_points(rows)
    assert len(pts) == len(parse(SWEEP).variants)
    pp2 = next(p for p in pts if p["name"] == "pp2")
    assert pp2["step_pred"] == next(r for r in rows if r["name"] == "pp2")["predicted_step_time_s"]
    write_all(rows, tmp_path, META, None)
    for name in ("throughput.png", "predicted.png", "memory.png", "bubble.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name


def test_small_preset_is_what_the_tests_assume():
    cfg = load_preset("small")
    layouts = plan(PlanSpec(cfg, device=results_device(META, "fp32"), gpus=2, global_batch=64, micros=(16,),
                            text_len=12, precision="fp32", zero=0))
    assert {(lay.stages, lay.dp) for lay in layouts} == {(1, 2), (2, 1)}


def test_a_tp_variant_is_planned_as_plan_tp_prints_its_layout(tmp_path, capsys):
    """The sweep's tp axis (mmpipe train --tp, issue 54): a variant's world is stages x dp x tp and its name says its
    tp; `check` resolves it as mmpipe train does (llava-tiny has a tensor-parallel plan); engine 'dp' with tp > 1 is
    one line. Its prediction is `mmpipe plan --tp 2`'s for its layout, one TP rank's memory on each rank (DeepSpeed's
    pipe x data x model grid: rank = (stage x DP + replica) x TP + t), below the TP 1 variant's."""
    from mmpipe.bench.run_variant import check
    from mmpipe.config import ConfigError
    from mmpipe.planning.calibrate import text_len_of
    sweep = parse({"base": {"preset": "llava-tiny", "stages": 2, "micro": 4, "gas": 2}, "grid": {"tp": [1, 2]}})
    one, two = sweep.variants
    assert (one.world, two.world) == (2, 4) and "tp2" in two.name and "tp1" in one.name
    assert check(two, sweep, tmp_path / "tp2") is None
    rows = add_predictions([{"kind": "variant", "repeat": 0, **v.to_dict(), "world": v.world, "status": "ok",
                             "reason": ""} for v in sweep.variants], META)
    text_len = str(text_len_of(load_preset("llava-tiny")))
    assert main(["plan", "--preset", "llava-tiny", "--text-len", text_len, "--json", "--tp", "2", "--device", "cpu",
                 "--peak-tflops", str(META["peaks"]["fp32"] / 1e12), "--efficiency", "0.5", "--gpus-per-node", "4",
                 "--global-batch", "8", "--micro", "4", "--precision", "fp32", "--zero", "0"]) == 0
    lay = next(g for g in json.loads(capsys.readouterr().out) if (g["stages"], g["dp"], g.get("tp")) == (2, 1, 2))
    assert rows[1]["predicted_step_time_s"] == pytest.approx(lay["step"]["step_s"], rel=1e-12)
    per_stage = [s["memory_gib"] * 1024 for s in lay["stage_rows"]]
    assert rows[1]["predicted_peak_mem_mb_per_rank"] == pytest.approx([per_stage[k // 2] for k in range(4)], abs=1e-3)
    assert rows[1]["predicted_peak_mem_mb_max"] < rows[0]["predicted_peak_mem_mb_max"]
    with pytest.raises(ConfigError, match="engine 'dp' has no tensor parallelism; tp > 1 needs engine 'pipe'"):
        parse({"variants": [{"name": "dp_tp", "engine": "dp", "dp": 2, "tp": 2}]})
