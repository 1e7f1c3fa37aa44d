"""`mmpipe check` on the run's own ranks: the table and check.json, exit 0 when every check passes
(small PP=2, llava-tiny PP=2 packed, PP=1 x DP=2), exit 1 naming a planted 1/GAS gradient on one stage
(equivalence) and an artificially slowed rank (links), exit 2 with one line for bad input before any
rank starts. Four launches in all: each costs ~30 s of CPU here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmpipe.check.links import SLOW_ENV
from mmpipe.cli import main
from mmpipe.runtime import precision

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["env", "links", "equivalence", "loader"]


def _check(out: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "check", "--output-dir", str(out), *args], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env),
                          capture_output=True, text=True, timeout=300)
    path = out / "check.json"
    assert path.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


def _passed(proc, doc: dict, stages: int, dp: int) -> None:
    assert proc.returncode == 0 and doc["ok"] and doc["failed"] == [], proc.stdout[-3000:] + proc.stderr[-2000:]
    assert list(doc["checks"]) == CHECKS and (doc["stages"], doc["dp"]) == (stages, dp)
    assert [r["rank"] for r in doc["ranks"]] == list(range(stages * dp))
    assert all(r["backend"] == "gloo" and r["deepspeed"] and r["precision_problem"] is None for r in doc["ranks"])
    eq = doc["checks"]["equivalence"]
    assert eq["steps"] == 3 and max(eq["blocks"].values()) <= 2
    assert eq["max_loss_rel_diff"] <= eq["tolerance"]["loss"] and eq["max_grad_norm_rel_diff"] <= 1e-4
    assert eq["losses"]["pipeline"] != eq["losses"]["reference"][:1] * 3  # it trained: the loss moved
    feed = doc["checks"]["loader"]
    assert feed["rows_per_s"] > 0 and feed["pipeline_rows_per_s"] > 0
    assert "check: " in proc.stdout and "the loader feeds" in proc.stdout  # the table


def test_small_pp2_passes(tmp_path):
    proc, doc = _check(tmp_path, "--preset", "small", "--stages", "2")
    _passed(proc, doc, 2, 1)
    (link,) = doc["checks"]["links"]["rows"]  # stage 0 -> 1 at micro x positions x dim fp32
    assert link["kind"] == "p2p" and link["ranks"] == [0, 1] and link["bytes"] == 16 * 28 * 128 * 4


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
