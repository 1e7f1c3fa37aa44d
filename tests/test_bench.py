"""mmpipe bench: a tiny sweep end to end on CPU (a 2-stage pipeline, a variant mmpipe refuses, both
peers, DP=2 through both engines), every output written, the refusal recorded and not fatal;
torch pipelining's losses equal mmpipe's and ZeRO-2's equal ZeRO-1's; the CSV columns are the
ones docs/benchmarks.md documents; bad sweep files exit 2 before anything runs."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(args: list[str], timeout: int = 400, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "mmpipe.cli", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def documented_columns() -> list[str]:
    """The `results.csv` column table of docs/benchmarks.md, in order."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("## results.csv columns", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_0-9]+)` \|", section, flags=re.M)


def test_tiny_sweep_end_to_end(tmp_path):
    sweep = tmp_path / "tiny.json"
    sweep.write_text(json.dumps({
        "name": "tiny", "steps": 4, "warmup_steps": 1, "base": {"preset": "tiny", "micro": 4, "gas": 2},
        "variants": [{"name": "pp2", "stages": 2},
                     {"name": "fp16_no_zero", "precision": "fp16"},  # refused: fp16 needs ZeRO-1
                     {"name": "fp16_z1", "stages": 2, "precision": "fp16", "zero": 1},  # the device lacks fp16
                     {"name": "dp2_z1", "dp": 2, "zero": 1},
                     {"name": "dp2_z2", "engine": "dp", "dp": 2, "zero": 2},
                     {"name": "pack", "pack": True, "max_images": 2, "text_len": 32}],  # 2 samples a row
        "peers": ["hf", "torch_pipe", "torch_pipe_zb"], "targets": {"pp2": "pp2"}}))
    out = tmp_path / "out"
    # this CPU's fp16 answer faked off (as on an AMD EPYC): the sweep still passes, the row says why
    proc = bench([str(sweep), "--output-dir", str(out)], MMPIPE_FAKE_ACCELERATOR="fp16=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("results.csv", "results.json", "results.md", "throughput.png", "memory.png", "bubble.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert "[bench 9/9" in proc.stdout  # the progress display
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = {r["name"]: r for r in reader}
        assert reader.fieldnames == documented_columns()
    assert set(rows) == {"pp2", "fp16_no_zero", "fp16_z1", "dp2_z1", "dp2_z2", "pack", "peer_hf", "peer_torch_pipe",
                         "peer_torch_pipe_zb"}
    ok = rows["pp2"]
    assert ok["status"] == "ok"
    assert int(ok["measured_steps"]) == 3  # 4 steps, the first excluded as warm-up
    assert float(ok["samples_per_s"]) > 0 and float(ok["step_time_s"]) > 0
    assert len(ok["peak_mem_mb_per_rank"].split(";")) == 2 and float(ok["peak_mem_mb_max"]) > 50
    assert 0 < float(ok["bubble_measured"]) < 1 and float(ok["bubble_theory"]) == pytest.approx(1 / 3, abs=1e-4)
    assert 0 < float(ok["mfu"]) < 1 and float(ok["achieved_flops"]) > 0
    assert 3 < float(ok["final_loss"]) < 6  # a tiny model's vocab-64 loss near ln(64) = 4.16
    # one sample per row: 16 image + 12 text = 28 positions computed per sample, fewer of them its own
    assert float(ok["positions_per_s"]) / float(ok["samples_per_s"]) == pytest.approx(28, rel=0.01)
    assert 0 < float(ok["padding_share"]) < 1 and float(ok["useful_tokens_per_s"]) < float(ok["positions_per_s"])
    packed = rows["pack"]  # rows of 2 x 16 + 32 = 64 positions (tiny's context) holding several samples each
    assert packed["status"] == "ok" and (packed["pack"], packed["max_images"], packed["text_len"]) == (
        "True", "2", "32")
    rows_per_step, step_s = float(packed["train_batch"]), float(packed["step_time_s"])  # 4 micro x 2 GAS = 8 rows
    assert float(packed["samples_per_s"]) * step_s > 1.5 * rows_per_step  # more samples than rows
    assert float(packed["positions_per_s"]) * step_s == pytest.approx(rows_per_step * 64, rel=0.01)
    assert (rows["peer_hf"]["pack"], rows["peer_hf"]["max_images"]) == ("False", "1")  # peers never pack
    bad = rows["fp16_no_zero"]
    assert bad["status"] == "refused" and "fp16" in bad["reason"] and "ZeRO" in bad["reason"].replace("zero", "ZeRO")
    lacking = rows["fp16_z1"]
    assert lacking["status"] == "unsupported" and lacking["reason"].startswith("fp16.enabled: ")
    assert "use bf16 (ds_configs/zero1_bf16.json)" in lacking["reason"]
    assert not (out / "variants" / "fp16_z1_r0" / "run.log").exists()  # never launched
    assert "| fp16_z1 | 0 | unsupported: fp16.enabled:" in (out / "results.md").read_text()
    assert rows["peer_hf"]["status"] == "ok" and float(rows["peer_hf"]["samples_per_s"]) > 0
    # torch pipelining runs the same layers, seeds, batches, AdamW, clipping and LR schedule at the same
    # boundary: every step's loss equals mmpipe's, so the throughput ratio compares the same work
    def losses(d):
        with open(out / d / "train_log.csv") as f:
            return [float(r["loss"]) for r in csv.DictReader(f)]
    assert losses("peers/torch_pipe_r0") == pytest.approx(losses("variants/pp2_r0"), abs=1e-5)
    # torch's zero-bubble ZBV (4 stages in a V on 2 ranks, B and W split by torch) trains the same model:
    # a real split backward, with mmpipe's integer tensors kept off its wire
    assert rows["peer_torch_pipe_zb"]["status"] == "ok", rows["peer_torch_pipe_zb"]["reason"]
    assert losses("peers/torch_pipe_zb_r0") == pytest.approx(losses("peers/torch_pipe_r0"), abs=1e-5)
    # ZeRO-2 through DeepSpeed's ordinary engine trains what the pipeline engine's DP=2 ZeRO-1 does
    # (each loss the mean over both replicas)
    assert losses("variants/dp2_z2_r0") == pytest.approx(losses("variants/dp2_z1_r0"), abs=1e-5)
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["peaks"]["fp32"] > 1e8  # measured one-thread matmul peak
    assert "| pp2 |" in (out / "results.md").read_text()


@pytest.mark.parametrize("body, expect", [
    ({"variants": [{"name": "a", "stagez": 2}]}, "variants[0]: unknown key 'stagez'"),
    ({"variants": [{"name": "a", "precision": "fp8"}]}, "variants[0].precision: 'fp8'"),
    ({"variants": [{"name": "a", "schedule": "zbv"}]},
     "variants[0].schedule: 'zbv' must be 1f1b or zb-h1 or dualpipev"),
    ({"variants": [{"name": "a", "freeze": "vison"}]}, "variants[0].freeze: 'vison' must be '' (nothing frozen) or "
                                                       "comma-separated groups of vision, projector, text"),
    ({"base": {"freeze": ["vision"]}, "variants": [{"name": "a"}]}, "base.freeze: ['vision'] must be ''"),
    ({"grid": {"freeze": ["", "vision,"]}}, "grid.freeze: 'vision,' must be ''"),
    ({"grid": {"stages": []}}, "grid.stages: must be a non-empty list"),
    ({"grid": {"stages": [1]}, "stepz": 3}, "stepz: unknown key"),
    ({"variants": [{"name": "a"}], "steps": 3, "warmup_steps": 3}, "warmup_steps: 3 leaves no measured step"),
    ({"variants": [{"name": "a", "engine": "dp", "stages": 2}]}, "engine 'dp' runs without a pipeline"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, "name 'a' is used twice"),
    ({"variants": [{"name": "a"}], "targets": {"pp2": "b"}}, "targets.pp2: no variant named 'b'"),
    ({"variants": [{"name": "a"}], "device": "tpu9"}, "device: 'tpu9' is not known"),
    ({}, "grid / variants: give one"),
    ({"variants": [{"name": "a", "pack": "yes"}]}, "variants[0].pack: 'yes' must be true or false"),
    ({"variants": [{"name": "a", "max_images": 0}]}, "variants[0].max_images: 0 must be an integer >= 1"),
    ({"base": {"text_len": 1}, "variants": [{"name": "a"}]}, "base.text_len: 1 must be an integer >= 2, or null"),
    ({"grid": {"max_images": [1, True]}}, "grid.max_images: True must be an integer >= 1"),
    ({"variants": [{"name": "a", "engine": "dp", "pack": True}]}, "engine 'dp' trains one-sample rows"),
    ({"variants": [{"name": "a"}], "data": 7}, "data: 7 must be 'shapes' or a path"),
    ({"variants": [{"name": "a"}], "data": "nosuch.jsonl"}, "data: 'nosuch.jsonl' not found (relative paths start"),
])
def test_bad_sweep_refused_before_running(tmp_path, capsys, body, expect):
    from mmpipe.cli import main
    sweep = tmp_path / "bad.json"
    sweep.write_text(json.dumps(body))
    assert main(["bench", str(sweep), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.startswith("mmpipe: error:"), err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_bad_sweep_exit_status_from_the_command(tmp_path):
    sweep = tmp_path / "bad.json"
    sweep.write_text("{not json")
    proc = bench([str(sweep)], timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("mmpipe: error:") and "not valid JSON" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_grid_is_the_cross_product():
    from mmpipe.bench.sweep import parse
    sw = parse({"base": {"micro": 8}, "grid": {"stages": [1, 2], "precision": ["fp32", "bf16"]}})
    assert [v.name for v in sw.variants] == ["pp1_fp32", "pp1_bf16", "pp2_fp32", "pp2_bf16"]
    assert all(v.micro == 8 for v in sw.variants)


def test_row_fields_and_data_reach_the_runs(tmp_path):
    """pack / max_images / text_len become each variant's mmpipe train flags, the sweep's data (relative to
    the sweep file) every run's --data; the peers run it unpacked, one sample per row."""
    from mmpipe.bench.peers import peer_command
    from mmpipe.bench.rows import peer_base
    from mmpipe.bench.run_variant import train_args
    from mmpipe.bench.sweep import load
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "conv.jsonl").write_text("")
    sweep = tmp_path / "s.json"
    sweep.write_text(json.dumps({"data": "d/conv.jsonl", "base": {"preset": "llava-tiny", "text_len": 40},
                                 "grid": {"pack": [False, True], "max_images": [1, 2]}, "peers": ["hf"]}))
    sw = load(str(sweep))
    assert sw.data == str(tmp_path / "d" / "conv.jsonl")
    assert [v.name for v in sw.variants] == ["nopack_img1", "nopack_img2", "pack_img1", "pack_img2"]
    argv = train_args(sw.variants[3], sw, tmp_path / "o", tmp_path / "o" / "ds.json").to_argv()
    assert argv[argv.index("--data") + 1] == sw.data and argv[argv.index("--max-images") + 1] == "2"
    assert "--pack" in argv and argv[argv.index("--text-len") + 1] == "40"
    assert "--pack" not in train_args(sw.variants[0], sw, tmp_path, tmp_path).to_argv()
    row, like = peer_base("hf", 0, sw)
    assert (row["pack"], row["max_images"], like.pack, like.max_images, like.text_len) == (False, 1, False, 1, 40)
    cmd, _ = peer_command("hf", sw.peer_shape(), sw, tmp_path / "p")
    assert cmd[cmd.index("--data") + 1] == sw.data and cmd[cmd.index("--text-len") + 1] == "40"
    assert not {"--pack", "--max-images"} & set(cmd)


def test_default_sweep_parses():
    from mmpipe.bench.sweep import load
    sw = load(str(ROOT / "ds_configs" / "sweeps" / "default.json"))
    assert sw.targets == {"pp1": "pp1", "pp2": "pp2", "hf_base": "pp1"} and max(v.world for v in sw.variants) == 2


def test_freeze_reaches_the_runs_names_the_grid_and_is_measured_per_stage(tmp_path):
    """A variant's freeze is its runs' --freeze (checked by mmpipe train's own rules: a stage left without a
    trainable parameter is refused, recorded, not fatal), a grid names it, and the row carries the per-stage
    timing a schedule or partition comparison reads (parts, idle, forward / backward per micro-batch)."""
    from mmpipe.bench.run_variant import check, measure, train_args
    from mmpipe.bench.sweep import parse
    sw = parse({"base": {"preset": "small", "stages": 4, "partition": "uniform"},
                "grid": {"freeze": ["", "vision"], "schedule": ["1f1b", "zb-h1"]}})
    assert [v.name for v in sw.variants] == ["trainable_1f1b", "trainable_zb-h1", "frozen-vision_1f1b",
                                             "frozen-vision_zb-h1"]
    argv = train_args(sw.variants[2], sw, tmp_path, tmp_path / "ds.json").to_argv()
    assert argv[argv.index("--freeze") + 1] == "vision"
    assert "--freeze" not in train_args(sw.variants[0], sw, tmp_path, tmp_path / "ds.json").to_argv()
    assert check(sw.variants[0], sw, tmp_path / "a") is None
    status, reason = check(sw.variants[2], sw, tmp_path / "b")
    assert status == "refused" and "would hold no trainable parameter" in reason
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.csv").write_text("step,samples_per_s,useful_tokens_per_s,positions_per_s\n" +
                                       "".join(f"{i},100,2800,2800\n" for i in range(1, 5)))
    stages = [{"idle_fraction": 0.2, "forward_ms_per_micro": 6.0, "backward_ms_per_micro": 10.0, "step_ms": 3.0},
              {"idle_fraction": 0.3, "forward_ms_per_micro": 8.0, "backward_ms_per_micro": 12.0, "step_ms": 4.0}]
    (run / "summary.json").write_text(json.dumps({"train_batch": 64, "decoder_length": 28, "parts": [0, 7, 11],
                                                  "stage_timing": {"per_stage": stages, "max_over_mean": 1.1}}))
    v = parse({"variants": [{"name": "z", "stages": 2, "freeze": "vision", "schedule": "zb-h1"}]}).variants[0]
    row = measure(v, sw, run, None)
    assert row["parts"] == [0, 7, 11] and row["stage_idle"] == [0.2, 0.3] and row["optimizer_ms"] == 4.0
    assert row["stage_forward_ms_per_micro"] == [6.0, 8.0] and row["stage_backward_ms_per_micro"] == [10.0, 12.0]


@pytest.mark.parametrize("name", ["zb_cells", "zb_cells_pp4", "partition", "schedules"])
def test_shipped_sweeps_parse_and_freeze_what_the_docs_say(name):
    """The sweep files that replaced scripts/bench_schedules.py and scripts/bench_partition.py (docs/schedules.md,
    docs/partition_benchmark.md): each cell a variant, vision trainable and frozen."""
    from mmpipe.bench.sweep import load
    sw = load(str(ROOT / "ds_configs" / "sweeps" / f"{name}.json"))
    if name != "schedules":
        assert {v.freeze for v in sw.variants} == {"", "vision"} and all(v.data_workers == 0 for v in sw.variants)
    if name.startswith("zb_cells"):
        assert len(sw.variants) == 8 and {(v.gas, v.schedule) for v in sw.variants} == {
            (g, s) for g in (4, 8) for s in ("1f1b", "zb-h1")}
    if name == "partition":
        assert {(v.stages, v.partition) for v in sw.variants if v.preset == "small"} == {
            (s, m) for s in (2, 4) for m in ("balanced", "uniform", "parameters")}


def test_ep_axis_is_parsed_checked_named_and_passed_to_train(tmp_path):
    """`ep` (mmpipe train --ep: an MoE model's experts over groups of ep of the dp ranks) is a variant axis: a grid
    names it `ep<N>`, it defaults to 1 (no --ep on the command line), a value that is not an integer >= 1 or does
    not divide dp, or ep > 1 on engine 'dp', is one line before anything runs; each variant's rank command carries
    --ep N, mmpipe train's own checks refuse what they refuse (a dense preset: recorded, not fatal), and the
    prediction beside the row plans that EP (the all-to-all in its step)."""
    from mmpipe.bench.run_variant import check, rank_module, train_args
    from mmpipe.bench.sweep import parse
    from mmpipe.config import ConfigError
    from mmpipe.planning.calibrate import predict_row
    from mmpipe.planning.costmodel import Device
    from test_plan_moe import tiny_moe
    model = tmp_path / "moe.json"
    model.write_text(json.dumps(tiny_moe().to_dict()))
    sw = parse({"base": {"preset": str(model), "micro": 2, "gas": 2}, "grid": {"dp": [2, 4], "ep": [1, 2]}})
    assert [(v.name, v.dp, v.ep) for v in sw.variants] == [("dp2_ep1", 2, 1), ("dp2_ep2", 2, 2), ("dp4_ep1", 4, 1),
                                                           ("dp4_ep2", 4, 2)]
    assert parse({"variants": [{"name": "a"}]}).variants[0].ep == 1
    argv = rank_module(sw.variants[3], sw, tmp_path / "o")
    assert argv[0] == "mmpipe.bench.rank" and argv[argv.index("--ep") + 1] == "2"
    assert argv[argv.index("--preset") + 1] == str(model)
    assert "--ep" not in train_args(sw.variants[2], sw, tmp_path, tmp_path / "ds.json").to_argv()
    for body, line in [
        ({"variants": [{"name": "a", "ep": 0}]}, "variants[0].ep: 0 must be an integer >= 1 dividing dp"),
        ({"variants": [{"name": "a", "dp": 2, "ep": True}]}, "variants[0].ep: True must be an integer >= 1"),
        ({"base": {"ep": "2"}, "variants": [{"name": "a"}]}, "base.ep: '2' must be an integer >= 1"),
        ({"grid": {"ep": [2, 1.5]}}, "grid.ep: 1.5 must be an integer >= 1"),
        ({"base": {"dp": 2}, "grid": {"ep": [1, 4]}},
         "variant 'ep4': ep 4 does not divide dp 2 (each expert-parallel group is ep of a stage's dp ranks)"),
        ({"variants": [{"name": "a", "engine": "dp", "dp": 2, "ep": 2}]},
         "variant 'a': engine 'dp' has no expert parallelism; ep > 1 needs engine 'pipe'"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse(body)
        assert any(ln.startswith(line) for ln in str(e.value).splitlines()), (line, str(e.value))
    dense = parse({"variants": [{"name": "d", "preset": "small", "dp": 2, "ep": 2}]})
    status, reason = check(dense.variants[0], dense, tmp_path / "d")
    assert status == "refused" and "--ep: 2 on small, a dense model" in reason
    device = Device("test", 1e12, 1e12, 1e9, efficiency=1.0)
    row = {**sw.variants[1].to_dict(), "stages": 1, "text_len": 48, "precision": "fp32"}
    two, one = predict_row(row, device), predict_row({**row, "ep": 1}, device)
    assert (two.ep, one.ep) == (2, 1) and two.step["a2a_s"] > 0 == one.step["a2a_s"]
    assert predict_row({k: v for k, v in row.items() if k != "ep"}, device).ep == 1  # rows from before the axis
