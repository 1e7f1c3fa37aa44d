"""mmpipe.runtime.wire without a process group: every schedule's ForwardPass is preceded by a LoadMicroBatch
of its buffer on every stage (so a middle stage reads its micro-batch's integer tensors), and the install
composes with zb-h1's in either order. The real PP=2 / PP=4 / zb-h1 / cross-attention / rows / multi-crop
runs check the messages themselves (conftest.Run.assert_only_floats_crossed)."""
from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from mmpipe.runtime import schedule as zb
from mmpipe.runtime import wire


def _steps(schedule) -> list[list]:
    return [list(cmds) for cmds in schedule]


@pytest.mark.parametrize("make", [
    lambda s: ds.TrainSchedule(micro_batches=5, stages=4, stage_id=s),
    lambda s: ds.InferenceSchedule(micro_batches=5, stages=4, stage_id=s),
    lambda s: zb.ZeroBubbleH1Schedule(5, 4, s),
], ids=["1f1b", "inference", "zb-h1"])
def test_every_stage_loads_each_micro_batch_before_its_forward(make):
    for stage in range(4):
        plain, loaded = _steps(make(stage)), _steps(wire._LoadBeforeForward(make(stage)))
        flat = [c for cmds in loaded for c in cmds]
        forwards = [c for c in flat if isinstance(c, ds.ForwardPass)]
        loads = [c for c in flat if isinstance(c, ds.LoadMicroBatch)]
        assert len(forwards) == len(loads) == 5, stage  # one load per micro-batch, middle stages included
        for cmds in loaded:  # a step's load is of the buffer its forward runs
            for c in cmds:
                if isinstance(c, ds.ForwardPass):
                    assert [x.buffer_id for x in cmds if isinstance(x, ds.LoadMicroBatch)] == [c.buffer_id]
        if stage in (0, 3):  # the ends already load: their schedule is unchanged
            assert [[repr(c) for c in s] for s in plain] == [[repr(c) for c in s] for s in loaded]


class _Engine:
    """What the two installs touch on a PipelineEngine (1 stage: zb-h1 gathers nothing)."""

    _INSTRUCTION_MAP = {ds.LoadMicroBatch: lambda self, buffer_id: None, ds.ForwardPass: lambda self, buffer_id: None}

    def __init__(self):
        self.module = torch.nn.Module()
        self.module.forward_funcs = [torch.nn.Linear(2, 2)]
        self.num_stages, self.stage_id, self.micro_batches, self.num_pipe_buffers = 1, 0, 2, 0
        self.pipe_buffers, self.global_rank = {"inputs": []}, 0

    def _next_batch(self):
        return None

    def _exec_schedule(self, schedule):
        return None


@pytest.mark.parametrize("wire_first", [True, False])
def test_composes_with_zb_h1_in_either_order(wire_first):
    engine = _Engine()
    installs = [wire.install, lambda e: zb.install(e, "zb-h1")]
    for install in installs if wire_first else installs[::-1]:
        install(engine)
    m = engine._INSTRUCTION_MAP
    assert m[ds.LoadMicroBatch] is wire._exec_load and m[ds.ForwardPass] is wire._exec_forward
    assert m[zb.BackwardInput] is zb._exec_backward_input and m[zb.BackwardWeight] is zb._exec_backward_weight
    assert wire.INTS in engine.pipe_buffers and type(_Engine._INSTRUCTION_MAP) is dict  # the class map untouched
    assert set(_Engine._INSTRUCTION_MAP) == {ds.LoadMicroBatch, ds.ForwardPass}


def test_integer_tensors_of_a_batch():
    px, ids, flag = torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.long), torch.ones(2, dtype=torch.long)
    assert wire.integer_tensors((px, ids, flag)) == (ids, flag)
    assert wire.integer_tensors((ids, flag)) == (ids, flag)
    assert wire.integer_tensors(None) == () and wire.integer_tensors(px) == ()
