"""mmpipe.runtime.timing: per-stage instruction timers and the measured pipeline bubble.

A fake engine (same dispatch as PipelineEngine._exec_schedule) checks the accounting exactly
and fast; one real 2-rank DeepSpeed pipeline (gloo, CPU, ~15 s) with a deliberately slow
first stage checks that the measurement sees who waits for whom.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from types import MethodType

import pytest
from deepspeed.runtime.pipe import schedule as S

from mmpipe.runtime.timing import format_summary, gather_stage_report, instrument, pipeline_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FWD_S, BWD_S, RECV_S = 0.004, 0.006, 0.003


def _sleeper(seconds):
    def fn(self, **kwargs):
        self.calls.append(seconds)
        time.sleep(seconds)
    return fn


class FakeEngine:
    """Dispatches like PipelineEngine._exec_schedule: class dict of plain functions, MethodType."""
    _INSTRUCTION_MAP = {
        S.LoadMicroBatch: _sleeper(0.0), S.ForwardPass: _sleeper(FWD_S), S.BackwardPass: _sleeper(BWD_S),
        S.SendActivation: _sleeper(0.0), S.RecvActivation: _sleeper(RECV_S), S.SendGrad: _sleeper(0.0),
        S.RecvGrad: _sleeper(0.0), S.ReduceTiedGrads: _sleeper(0.0), S.ReduceGrads: _sleeper(0.0),
        S.OptimizerStep: _sleeper(0.001),
    }

    def __init__(self, micro_batches=4, stage_id=1, fail=False):
        self.micro_batches, self.stage_id, self.num_stages, self.global_rank = micro_batches, stage_id, 2, 0
        self.calls, self.fail = [], fail

    def _exec(self, cmds):
        for cmd in cmds:
            MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)

    def _aggregate_total_loss(self):
        return 0.0

    def train_batch(self, data_iter=None):
        cmds = []
        for b in range(self.micro_batches):
            cmds += [S.RecvActivation(0), S.LoadMicroBatch(0), S.ForwardPass(0), S.BackwardPass(0), S.SendGrad(0)]
        cmds += [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]
        self._exec(cmds)
        if self.fail:
            raise RuntimeError("boom")
        return self._aggregate_total_loss()

    def eval_batch(self, data_iter=None):
        self._exec([S.ForwardPass(0)] * self.micro_batches)


def test_accounting_on_fake_engine():
    class_map = dict(FakeEngine._INSTRUCTION_MAP)
    eng, other = FakeEngine(), FakeEngine()
    timer = instrument(eng, skip_steps=1)
    assert FakeEngine._INSTRUCTION_MAP == class_map            # class dict untouched
    assert "_INSTRUCTION_MAP" not in other.__dict__ and other.train_batch.__func__ is FakeEngine.train_batch
    assert instrument(eng, skip_steps=1) is timer              # idempotent

    assert timer.report()["steps"] == 0 and timer.report()["forward_ms"] is None
    for _ in range(3):
        eng.train_batch()
        eng.eval_batch()                                       # not a train step: not counted
    other.train_batch()                                        # other engine: not counted
    r = timer.report()
    assert r["steps"] == 2 and r["stage"] == 1 and r["micro_batches"] == 4
    assert r["calls_per_step"]["forward"] == 4 and r["calls_per_step"]["step"] == 1
    assert r["calls_per_step"]["reduce"] == 2 and r["calls_per_step"]["loss_sync"] == 1
    assert r["forward_ms"] >= 4 * FWD_S * 1000 and r["backward_ms"] >= 4 * BWD_S * 1000
    assert r["recv_ms"] >= 4 * RECV_S * 1000
    assert r["forward_ms_per_micro"] == pytest.approx(r["forward_ms"] / 4)
    assert r["backward_ms_per_micro"] == pytest.approx(r["backward_ms"] / 4)
    parts = sum(r[f"{c}_ms"] for c in ("forward", "backward", "recv", "send", "load", "reduce", "step", "loss_sync"))
    assert parts <= r["total_ms"] + 1e-6 and r["other_ms"] == pytest.approx(r["total_ms"] - parts, abs=1e-6)
    assert 0 <= r["busy_fraction"] <= 1 and 0 <= r["idle_fraction"] <= 1
    assert r["busy_fraction"] + r["idle_fraction"] <= 1 + 1e-9
    assert r["idle_fraction"] == pytest.approx((r["recv_ms"] + r["send_ms"] + r["loss_sync_ms"]) / r["total_ms"])
    assert r["busy_fraction"] > 0.6                            # the fake's time is mostly fwd/bwd

    # without torch.distributed: one row, this rank's
    rows = gather_stage_report(eng, timer)
    assert len(rows) == 1 and rows[0]["forward_ms"] == pytest.approx(r["forward_ms"]) and rows[0]["replicas"] == 1

    timer.start_measuring()                                    # restart: forget the above
    assert timer.report()["steps"] == 0
    eng.train_batch()
    assert timer.report()["steps"] == 1
    timer.stop_measuring()
    eng.train_batch()
    assert timer.report()["steps"] == 1

    timer.detach()
    assert "_INSTRUCTION_MAP" not in eng.__dict__ and "train_batch" not in eng.__dict__
    assert eng._INSTRUCTION_MAP is FakeEngine._INSTRUCTION_MAP


def test_failed_step_is_not_counted():
    eng = FakeEngine(fail=True)
    timer = instrument(eng)
    with pytest.raises(RuntimeError):
        eng.train_batch()
    assert timer.report()["steps"] == 0
    eng.fail = False
    eng.train_batch()
    assert timer.report()["steps"] == 1 and timer.report()["calls_per_step"]["forward"] == 4


def test_pipeline_summary_math():
    rows = [{"stage": 0, "forward_ms": 30.0, "backward_ms": 60.0, "idle_fraction": 0.1, "total_ms": 100.0, "steps": 3},
            {"stage": 1, "forward_ms": 10.0, "backward_ms": 20.0, "idle_fraction": 0.5, "total_ms": 101.0, "steps": 3}]
    s = pipeline_summary(rows, micro_batches=4, stages=2)
    assert s["theory_bubble"] == pytest.approx(1 / 5)
    assert pipeline_summary(rows, micro_batches=8, stages=4)["theory_bubble"] == pytest.approx(3 / 11)
    assert s["compute_ms"] == [90.0, 30.0] and s["max_over_mean"] == pytest.approx(1.5)
    assert s["slowest_stage"] == 0 and s["measured_bubble"] == pytest.approx(0.3) and s["step_ms"] == 101.0
    assert "bubble measured 0.300 vs 1F1B theory 0.200" in format_summary(s)


SCRIPT = r'''
import json, os, sys, time
import torch, torch.nn as nn
import deepspeed
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.engine import PipelineEngine
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # skip a 25 s JIT build
deepspeed.init_distributed(dist_backend="gloo")
from mmpipe.runtime.timing import instrument, gather_stage_report, pipeline_summary, format_summary

class Sleep(nn.Module):          # makes stage 0 slow: 20 ms per micro-batch forward
    def forward(self, x):
        time.sleep(0.02)
        return x

torch.manual_seed(0)
layers = [nn.Linear(8, 32), Sleep(), nn.Linear(32, 32), nn.Linear(32, 1)]   # uniform: 2 layers per stage
net = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 1000000}
engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()], config=cfg)
class_map = dict(PipelineEngine._INSTRUCTION_MAP)
timer = instrument(engine, skip_steps=1)

def data():
    g = torch.Generator().manual_seed(1)
    while True:
        x = torch.randn(2, 8, generator=g)
        yield x, x.sum(1, keepdim=True)
it = data()
losses = [engine.train_batch(data_iter=it).item() for _ in range(6)]
rows = gather_stage_report(engine, timer)
if rows is not None:
    s = pipeline_summary(rows, micro_batches=engine.micro_batches, stages=engine.num_stages)
    print(format_summary(s), flush=True)
    out = sys.argv[1]
    with open(out + ".tmp", "w") as f:
        json.dump({"summary": s, "losses": losses, "own_map": "_INSTRUCTION_MAP" in engine.__dict__,
                   "class_map_untouched": PipelineEngine._INSTRUCTION_MAP == class_map}, f)
    os.replace(out + ".tmp", out)
'''


def test_two_stage_pipeline_sees_who_waits(tmp_path):
    script = tmp_path / "pipe_timing.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "timing.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    # the success marker, not only the exit code (DeepSpeed can abort at exit after a good run)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["class_map_untouched"] and res["own_map"]
    s = res["summary"]
    rows = {r["stage"]: r for r in s["per_stage"]}
    assert sorted(rows) == [0, 1] and s["stages"] == 2 and s["micro_batches"] == 4
    assert s["theory_bubble"] == pytest.approx(1 / 5)
    for r in rows.values():
        assert r["steps"] == 5 and r["replicas"] == 1             # 6 steps, first one skipped
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0
        assert r["forward_ms_per_micro"] == pytest.approx(r["forward_ms"] / 4)
        assert r["backward_ms_per_micro"] == pytest.approx(r["backward_ms"] / 4)
        assert 0 <= r["busy_fraction"] <= 1 and 0 <= r["idle_fraction"] <= 1
        assert r["busy_fraction"] + r["idle_fraction"] <= 1 + 1e-6
        assert r["calls_per_step"]["forward"] == 4 and r["calls_per_step"]["backward"] == 4
    slow, fast = rows[0], rows[1]
    assert slow["forward_ms_per_micro"] >= 20.0                   # the sleep is seen on stage 0 ...
    assert fast["forward_ms_per_micro"] < 10.0                    # ... and only there
    assert fast["idle_fraction"] > 0.3                            # stage 1 waits for stage 0 ...
    assert fast["idle_fraction"] > slow["idle_fraction"] + 0.2    # ... not the other way round
    assert slow["busy_fraction"] > 0.6
    assert s["slowest_stage"] == 0 and s["max_over_mean"] > 1.5
    assert s["measured_bubble"] > s["theory_bubble"]              # imbalance adds to the 1F1B bubble
