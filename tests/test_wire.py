"""mmpipe.runtime.wire without a process group: every schedule's ForwardPass is preceded by a LoadMicroBatch
of its buffer on every stage (so a middle stage reads its micro-batch's integer tensors), and the install
composes with zb-h1's in either order. The real PP=2 / PP=4 / zb-h1 / cross-attention / rows / multi-crop
runs check the messages themselves (conftest.Run.assert_only_floats_crossed)."""
from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from mmpipe.planning.schedule_registry import ZB_H1
from mmpipe.runtime import schedule as zb
from mmpipe.runtime import wire


def _steps(schedule) -> list[list]:
    return [list(cmds) for cmds in schedule]


@pytest.mark.parametrize("make", [
    lambda s: ds.TrainSchedule(micro_batches=5, stages=4, stage_id=s),
    lambda s: ds.InferenceSchedule(micro_batches=5, stages=4, stage_id=s),
    lambda s: zb.OrderSchedule(5, 4, s),  # zb-h1's order (OrderSchedule's default record)
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
    installs = [wire.install, lambda e: zb.install(e, ZB_H1)]
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


def test_every_tensor_of_a_loaded_batch_reaches_the_ranks_device():
    """The load hook moves the whole (inputs, labels) batch, labels' (labels, weights) pair included, to the
    engine's device (asynchronously from pinned memory on CUDA), and files the integer tensors it moved:
    the meta device stands in for a GPU here."""
    class Engine:
        device = torch.device("meta")
        _mmpipe_wire = wire._Wire(None, None)
    pixels, ids = torch.zeros(2, 3, 4, 4), torch.ones(2, 5, dtype=torch.long)
    has_image, segments = torch.ones(2, 1, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    batch = ((pixels, ids, has_image, segments), (torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5)))
    engine = Engine()
    got = wire._next_batch(engine, lambda: batch)
    flat = [*got[0], *got[1]]
    assert len(flat) == 6 and all(t.device.type == "meta" for t in flat)
    assert [t.shape for t in flat] == [t.shape for t in (*batch[0], *batch[1])]
    assert [t.dtype for t in engine._mmpipe_wire.loaded] == [torch.long] * 3
    assert all(t.device.type == "meta" for t in engine._mmpipe_wire.loaded)
    assert wire._next_batch(engine, lambda: None) is None and engine._mmpipe_wire.loaded == ()


def test_the_loader_pins_its_batches_when_asked(monkeypatch):
    """A CUDA rank's loader (runtime.trainer.DataStream: pin_memory when the engine's device is cuda) hands
    the DataLoader pin_memory, and a bf16 cast of the pixels is pinned again."""
    from mmpipe.data import batches
    seen, pinned = {}, []

    class Loader:
        def __init__(self, *a, **kw):
            seen.update(kw)

        def __iter__(self):
            yield {"pos": torch.arange(2), "input_ids": torch.ones(2, 3, dtype=torch.long),
                   "has_image": torch.ones(2, 1, dtype=torch.long), "segments": torch.ones(2, 3, dtype=torch.long),
                   "pixels": torch.zeros(2, 3, 4, 4), "labels": torch.zeros(2, 3, dtype=torch.long)}
    monkeypatch.setattr(batches, "DataLoader", Loader)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.dtype) or t)
    (inputs, _), = list(batches.rank_batches(None, None, dtype=torch.bfloat16, pin_memory=True))
    assert seen["pin_memory"] is True and pinned == [torch.bfloat16] and inputs[0].dtype == torch.bfloat16
