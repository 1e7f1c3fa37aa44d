"""`mmpipe check` on the run's own ranks: the table and check.json, exit 0 when every check passes
(small PP=2 with --full-step, llava-tiny PP=2 packed, PP=1 x DP=2), exit 1 naming a planted 1/GAS
gradient on one stage (equivalence) and an artificially slowed rank (links), exit 2 with one line for bad
input before any rank starts; the device profile it writes is what `mmpipe plan --device-profile` plans
with; `mmpipe slurm --command check` writes a script whose ranks are check's. Four launches in all: each
costs ~30 s of CPU here."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmpipe.check import memory, rank
from mmpipe.check.links import SLOW_ENV
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.planning.calibrate import load_profile
from mmpipe.planning.costmodel import layer_costs
from mmpipe.runtime import precision

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["env", "links", "equivalence", "loader", "profile"]


def _check(out: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "check", "--output-dir", str(out), *args], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env),
                          capture_output=True, text=True, timeout=300)
    path = out / "check.json"
    assert path.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


def _passed(proc, doc: dict, stages: int, dp: int, checks: list[str] = CHECKS) -> None:
    assert proc.returncode == 0 and doc["ok"] and doc["failed"] == [], proc.stdout[-3000:] + proc.stderr[-2000:]
    assert list(doc["checks"]) == checks and (doc["stages"], doc["dp"]) == (stages, dp)
    assert [r["rank"] for r in doc["ranks"]] == list(range(stages * dp))
    assert all(r["backend"] == "gloo" and r["deepspeed"] and r["precision_problem"] is None for r in doc["ranks"])
    eq = doc["checks"]["equivalence"]
    assert eq["steps"] == 3 and max(eq["blocks"].values()) <= 2
    assert eq["max_loss_rel_diff"] <= eq["tolerance"]["loss"] and eq["max_grad_norm_rel_diff"] <= 1e-4
    assert eq["losses"]["pipeline"] != eq["losses"]["reference"][:1] * 3  # it trained: the loss moved
    feed = doc["checks"]["loader"]
    assert feed["rows_per_s"] > 0 and feed["pipeline_rows_per_s"] > 0
    assert "check: " in proc.stdout and "the loader feeds" in proc.stdout  # the table


def test_small_pp2_passes(tmp_path, capsys):
    proc, doc = _check(tmp_path, "--preset", "small", "--stages", "2", "--full-step")
    _passed(proc, doc, 2, 1, ["env", "links", "memory", *CHECKS[2:]])
    (link,) = doc["checks"]["links"]["rows"]  # stage 0 -> 1 at micro x positions x dim fp32
    assert link["kind"] == "p2p" and link["ranks"] == [0, 1] and link["bytes"] == 16 * 28 * 128 * 4
    _full_step_measured(doc, proc.stdout)
    _profile_plans(tmp_path, doc, capsys)


def _full_step_measured(doc: dict, table: str) -> None:
    """--full-step: one step of the full model on both stages, each rank's peak beside the planner's stage."""
    mem = doc["checks"]["memory"]
    assert mem["ran"] and [(r["rank"], r["stage"]) for r in mem["ranks"]] == [(0, 0), (1, 1)]
    assert all(r["measured"] > 0 and r["how"] == "VmHWM - VmRSS before" and r["ok"] for r in mem["ranks"])
    assert [r["predicted"] for r in mem["ranks"]] == mem["predicted_bytes"] and mem["tolerance"] == 3.0
    assert "one step of the full model" in doc["summary"]["memory"] and "predicted  measured" in table


def _profile_plans(out: Path, doc: dict, capsys) -> None:
    """The device profile check wrote is calibrate's format, and `mmpipe plan --device-profile` plans with it:
    a PP=1 layout's forward + backward is the measured layer-kind table's seconds for the whole model."""
    prof = doc["checks"]["profile"]
    path = out / "device_profile.json"
    assert prof["ok"] and prof["path"] == str(path) and str(path) in doc["summary"]["profile"]
    p = load_profile(str(path))
    rows = layer_costs(load_preset("small"), (), 12)  # the built-in data's 12 text positions, micro 16
    kinds = p["layer_kinds"]
    table_s = sum((kinds[r.name]["forward_s"] + kinds[r.name]["backward_s"]) * 16 for r in rows)
    assert table_s == pytest.approx(p["fit"]["model_seconds_per_micro"], rel=1e-9)
    assert sum(r.flops for r in rows) * 16 / (p["peak_flops"]["fp32"] * p["efficiency"]["fp32"]) == \
        pytest.approx(table_s, rel=1e-9)
    args = ["plan", "--preset", "small", "--text-len", "12", "--gpus-per-node", "2", "--global-batch", "64", "--micro",
            "16", "--precision", "fp32", "--json"]
    assert main([*args, "--device-profile", str(path)]) == 0
    calibrated = {g["stages"]: g for g in json.loads(capsys.readouterr().out)}
    assert main([*args, "--device", "cpu"]) == 0
    plain = {g["stages"]: g for g in json.loads(capsys.readouterr().out)}
    (stage,) = calibrated[1]["stage_rows"]
    assert (stage["forward_ms"] + stage["backward_ms"]) / 1e3 == pytest.approx(table_s, rel=1e-6)
    assert calibrated[2]["step"]["p2p_s"] == pytest.approx(16 * 28 * 128 * 4 * 2 / p["link_bytes_per_s"], rel=1e-6)
    assert calibrated[1]["step"]["step_s"] != pytest.approx(plain[1]["step"]["step_s"], rel=1e-3)
    # docs/check.md's command as written, no --precision: the profile's fp32, not plan's default bf16
    assert main(["plan", "--device-profile", str(path), "--preset", "small", "--text-len", "12", "--micro", "16"]) == 0
    assert ", fp32, ZeRO-1" in capsys.readouterr().out.splitlines()[0]


def test_the_families_without_a_profile_are_named_in_the_row_and_in_check_md():
    """The profile check skips a family whose images take any size in a row budget (one fixed-size image is what
    it times): the row names the family and why, and docs/check.md's profile row names every family skipped, from
    the registry (issue 46 item 10: the page named the Qwen presets only, while LLaVA-NeXT's were skipped too)."""
    from mmpipe.check.profile import skip_reason
    from mmpipe.config import list_presets
    from mmpipe.registry import families
    skipped = {f.family for f in families() if f.kind.flag is not None}
    assert skipped == {"qwen2_vl", "llava_next", "qwen3_vl", "qwen3_5", "internvl"}
    row = next(ln for ln in (ROOT / "docs" / "check.md").read_text().splitlines() if ln.startswith("| `profile` |"))
    for name in list_presets():
        cfg = load_preset(name)
        why = skip_reason(cfg)
        assert (why is not None) == (cfg.family in skipped), name
        if why:
            assert why.startswith(f"no profile for the {cfg.family} family yet: its images take any size") \
                and "the qwen2_vl, llava_next, qwen3_vl, qwen3_5 and internvl families write none" in why, why
            assert f"the {cfg.family} family (" in row, cfg.family


def test_llava_tiny_packed_passes(tmp_path):
    proc, doc = _check(tmp_path, "--preset", "llava-tiny", "--stages", "2", "--pack", "--max-images", "2")
    _passed(proc, doc, 2, 1)
    assert doc["checks"]["loader"]["pipeline_rate"] == "measured"  # llava-tiny has no block to cut


def test_pp1_dp2_passes(tmp_path):
    proc, doc = _check(tmp_path, "--preset", "small", "--stages", "1", "--dp", "2")
    _passed(proc, doc, 1, 2)
    (link,) = doc["checks"]["links"]["rows"]  # no stage boundary: the DP group's all-reduce alone
    assert link["kind"] == "all-reduce" and link["ranks"] == [0, 1] and link["bandwidth"] > 0


def test_planted_defects_are_named(tmp_path):
    """Stage 0's gradients scaled by 1/GAS (DeepSpeed #8152's bug) fail equivalence on stage 0's gradient
    norm; rank 2's sends slowed make the link 1 <-> 2 fail while 0 <-> 1 passes."""
    proc, doc = _check(tmp_path, "--preset", "small", "--stages", "3", MMPIPE_FAULT="grad-over-gas:0",
                       **{SLOW_ENV: "2:0.2"})
    # (the loader may fail too: 3 stages are predicted to take more rows/s than a loaded machine's loader gives)
    assert proc.returncode == 1 and doc["failed"][:2] == ["links", "equivalence"], proc.stderr[-2000:]
    assert "mmpipe: check failed: links, equivalence" in proc.stderr
    eq = doc["checks"]["equivalence"]
    assert eq["worst_grad_norm"]["where"] == "stage 0" and eq["max_grad_norm_rel_diff"] > 0.5  # GAS 4: off by 3/4
    ok = {tuple(r["ranks"]): r["ok"] for r in doc["checks"]["links"]["rows"]}
    assert ok == {(0, 1): True, (1, 2): False}
    assert "slow: stage 1 -> 2 (ranks 1 <-> 2, dp 0)" in doc["summary"]["links"]


def _refused(capsys, argv: list[str]) -> list[str]:
    rc = main(["check", *argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("mmpipe: error:")]
    assert rc == 2 and lines, err
    return lines


def test_bad_input_one_line_each(tmp_path, capsys, monkeypatch):
    out = ["--output-dir", str(tmp_path / "o"), "--preset", "small"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "nowhere.png"}\n{"conversations": []}\n')
    (line,) = _refused(capsys, [*out, "--data", str(bad)])
    assert "every one of the 2 records" in line and "is bad" in line
    monkeypatch.setattr(precision, "this_device", lambda: precision.Device("cpu", "test CPU", False, False))
    (line,) = _refused(capsys, [*out, "--ds-config", "ds_configs/cpu_bf16.json"])
    assert "bf16.enabled: test CPU (cpu) does not run bf16" in line
    assert not (tmp_path / "o" / "check.json").exists()


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client (.ci/run installs openssh)")
def test_unreachable_host_is_refused(tmp_path, capsys):
    hf = tmp_path / "hostfile"
    hf.write_text("mmpipe-no-such-host-a slots=1\nmmpipe-no-such-host-b slots=1\n")
    lines = _refused(capsys, ["--hostfile", str(hf), "--output-dir", str(tmp_path / "o"), "--stages", "2"])
    assert len(lines) == 2 and "host mmpipe-no-such-host-a is not reachable" in lines[0]  # one line per host
    assert "mmpipe-no-such-host-b" in lines[1]


def test_full_step_fails_over_the_prediction_and_does_not_run_what_cannot_fit():
    """The memory verdict: a rank over predicted x tolerance + slack fails (named); a stage predicted over its
    device fails without a step (nothing measured)."""
    mib, gib, slack = 2 ** 20, 2 ** 30, memory.SLACK["cuda"]
    rows = [{"rank": 0, "stage": 0, "measured": 400 * mib * 1.25 + slack + 1, "how": "max_memory_allocated"},
            {"rank": 1, "stage": 1, "measured": 100 * mib * 1.25 + slack, "how": "max_memory_allocated"}]
    got = memory.judge(rows, [400 * mib, 100 * mib], 80 * gib, "cuda")
    assert [r["ok"] for r in got["ranks"]] == [False, True] and not got["ok"] and got["tolerance"] == 1.25
    assert memory.judge(rows, [400 * mib, 100 * mib], 80 * gib, "cpu")["ok"]  # x3 on CPU
    got = memory.judge([None, None], [90 * gib, 10 * gib], 80 * gib, "cuda")
    assert not got["ok"] and not got["ran"]
    assert got["error"] == "stage 0 predicted 90.0 GiB > the device's 80.0 GiB: not run"


def test_slurm_writes_a_check_job(tmp_path, capsys):
    """`mmpipe slurm --command check`: the script's srun starts check's rank entry with the run's flags and
    check's own (no --resume, no requeue); --full-step without it is one line, exit 2."""
    out = tmp_path / "o"
    assert main(["slurm", "--command", "check", "--full-step", "--preset", "small", "--stages", "2", "--output-dir",
                 str(out)]) == 0
    script = (out / "slurm_job.sh").read_text()
    (line,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    words = shlex.split(line)
    assert words[2:5] == ["-u", "-m", "mmpipe.check.rank"] and "scontrol requeue" not in script
    args, opts = rank.parse([w for w in words[5:] if w != "${RESUME[@]}"])
    assert (args.preset, args.stages, args.output_dir, opts.full_step) == ("small", 2, str(out), True)
    assert "RESUME=(--resume)" not in script
    capsys.readouterr()
    assert main(["slurm", "--full-step", "--preset", "small", "--output-dir", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err.strip() == "mmpipe: error: --full-step: a check flag; give --command check"


def _links_rank(rank: int, store: str, run, out: str) -> None:
    import torch
    import torch.distributed as dist

    from mmpipe.check import links
    torch.set_num_threads(1)  # before any op: a forked child must not enter the parent's OpenMP pool (it hangs)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    rows = links.measure(run)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def test_links_time_the_all_to_all_of_each_ep_group(tmp_path):
    """An MoE model under --ep 2 (PP 1 x DP 2; the planner's tiny MoE model of tests/test_plan_moe.py: 4 blocks of 8
    experts, top 2, D 64, 88 decoder positions a row, micro 2, fp32): the links check, on two in-process gloo ranks,
    times one all-to-all across the EP group (ranks 0, 1) at what one MoE block exchanges per micro-batch,
    2 x 88 x 2 x 64 x 4 = 90,112 B, half of it leaving each rank, beside the DP group's all-reduce; the planner's
    time for it (CPU link 5 GB/s): 45,056 / 5e9 = 9.0 us, a quarter of costmodel.all_to_all's stage bytes (two
    all-to-alls of 4 blocks) one way. The table shows each link's time and planned time; the links line names the
    slowest all-to-all against its planned time."""
    from types import SimpleNamespace

    import torch.multiprocessing as mp

    from mmpipe.check import links, report
    from mmpipe.planning.costmodel import all_to_all
    from mmpipe.planning.layout import CPU_LINK
    from test_plan_moe import DEVICE, _rows, tiny_moe
    cfg = tiny_moe()
    rows = _rows(cfg)
    run = SimpleNamespace(model=cfg, stages=1, dp=2, ep=2, tp=1, sp=1, micro=2, gas=1, precision="fp32", zero_stage=0,
                          schedule="1f1b", layers=rows, parts=[0, len(rows)])
    assert links.all_to_all_bytes(run, 0) == 2 * 88 * 2 * 64 * 4 == 90_112
    # a bf16 cut after the last DeepStack add: the hidden [88, 64] at 2 B and moe_stats [2, 8] at 4 B (route_stats'
    # fp32 in every precision, as the planner counts it), micro 2: 22,656 B, not 22,592 at 2 B for all
    cut = SimpleNamespace(**{**vars(run), "stages": 2, "precision": "bf16", "parts": [0, 16, len(rows)]})
    assert links.boundary_bytes(cut, 0) == 2 * (88 * 64 * 2 + 2 * 8 * 4) == 2 * rows[15].boundary_bytes("bf16")
    assert all_to_all(rows, run.parts, 2, "fp32", 2, DEVICE)[0]["bytes"] == 2 * 4 * 90_112
    out = tmp_path / "rows.json"
    mp.start_processes(_links_rank, args=(str(tmp_path / "store"), run, str(out)), nprocs=2, start_method="fork")
    got = json.loads(out.read_text())
    assert [r["kind"] for r in got] == ["all-reduce", "all-to-all"]
    a2a = got[1]
    assert a2a["name"] == "stage 0 ep group (ranks 0, 1)" and a2a["ranks"] == [0, 1] and a2a["bytes"] == 90_112
    assert a2a["seconds"] > 0 and a2a["ok"] and a2a["bandwidth"] == pytest.approx(45_056 / a2a["seconds"])
    assert a2a["planned_s"] == pytest.approx(45_056 / CPU_LINK) == pytest.approx(9.0112e-6)
    assert got[0]["planned_s"] == pytest.approx(got[0]["bytes"] * 1.0 / CPU_LINK)  # ring: 2 (2 - 1) / 2
    run.model = SimpleNamespace(name="qwen3-vl-moe-tiny")
    checks = {"env": {"ok": True, "ranks": 2, "backend": "gloo", "problems": []}, "links": {"ok": True, "rows": got},
              "equivalence": {"ok": True, "error": "not run here"},
              "loader": {"ok": True, "rows_per_s": 1.0, "pipeline_rows_per_s": None, "pipeline_rate": "-",
                         "samples_per_s": 1.0, "workers": 0}}
    table = report.render(run, [], checks).splitlines()
    header = next(ln for ln in table if ln.startswith("link "))
    assert header.split() == ["link", "kind", "size", "time", "planned", "bandwidth", "latency", "result"]
    (row,) = [ln for ln in table if ln.startswith("stage 0 ep group")]
    assert "all-to-all  90.1 KB" in row and "0.009 ms" in row and row.endswith("pass")
    line = report.summaries(checks)["links"]
    assert line.startswith("2 links; all-to-all (one MoE block, one micro-batch): slowest ") and \
        "for 90.1 KB (stage 0 ep group (ranks 0, 1)), planned 0.009 ms" in line
