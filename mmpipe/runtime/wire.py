"""Only floats cross a pipeline stage boundary: each stage reads the micro-batch's integer tensors itself.

The stage tuple (mmpipe.model.stage) holds floats (hidden; the cross-attention family's vision) and the
micro-batch's integer tensors (input_ids, has_image, segments, tiling), which no layer changes (the
Projector only drops tiling). DeepSpeed 0.19.8 sends every tuple tensor as its own blocking p2p
message, so instead each stage takes the integers from its own copy of the micro-batch (its own loader,
mmpipe.runtime.feed; a stage without the vision tower decodes no image) and the wire carries the floats
alone. `install(engine)` does it on the engine INSTANCE (the class and other engines are untouched), in
DeepSpeed's instruction style:

* every stage keeps the data iterator it is given (DeepSpeed's `set_dataiterator` keeps only the first
  and last stage's), and a ForwardPass that no LoadMicroBatch precedes in its step (a middle stage:
  DeepSpeed's TrainSchedule and InferenceSchedule and mmpipe's zb-h1 load on the first and last stage
  only) gets one, for the same buffer: so whichever schedule runs, train_batch or eval_batch;
* LoadMicroBatch runs the handler it replaces (DeepSpeed's: the first stage's inputs, the last stage's
  labels) and files the batch's integer tensors in the buffer's slot, pipe_buffers["mmpipe_ints"];
* ForwardPass hands the module (VLMPipeline, its `wire_ints`) the integers of the buffer it runs: a
  non-first stage joins them to the floats it received before its layers run, and a non-last stage
  returns its floats only (VLMPipeline.forward). So SendActivation sends floats, and SendGrad their
  gradients, one message per float tensor (moondream and LLaVA: 1 per micro-batch, cross-attention: 2).

It composes with `--schedule zb-h1` in either order (both copy the instance's current instruction map
and replace different entries; zb-h1 replaces `_train_schedule`, this wraps `_exec_schedule`), and with
mmpipe.runtime.timing installed after it (a middle stage's loads are timed as load).

Test hook: MMPIPE_WIRE_LOG=DIR appends every message this rank sends to DIR/wire_rank{R}.csv
(kind: meta, DeepSpeed's int32 shape announcement, or data; dtype; shape).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Callable

import torch
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe import schedule as ds

INTS = "mmpipe_ints"  # pipe_buffers key: per buffer, the integer tensors of the micro-batch loaded into it
WIRE_LOG = "MMPIPE_WIRE_LOG"


@dataclass
class _Wire:
    load: Callable  # the LoadMicroBatch / ForwardPass handlers this replaces
    forward: Callable
    loaded: tuple = ()  # the integer tensors of the batch _next_batch returned last


def integer_tensors(inputs) -> tuple:
    """The integer tensors of a batch's inputs ((pixels, input_ids, ...), the ints alone, or None), in order."""
    if inputs is None:
        return ()
    items = (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
    return tuple(t for t in items if not t.is_floating_point())


class _LoadBeforeForward:
    """A schedule whose every ForwardPass has a LoadMicroBatch of its buffer in the same step."""

    def __init__(self, schedule):
        self.schedule = schedule

    def num_pipe_buffers(self) -> int:
        return self.schedule.num_pipe_buffers()

    def __iter__(self):
        for cmds in self.schedule:
            if any(isinstance(c, ds.LoadMicroBatch) for c in cmds):
                yield cmds
            else:
                yield [x for c in cmds for x in ((ds.LoadMicroBatch(c.buffer_id), c)
                                                 if isinstance(c, ds.ForwardPass) else (c,))]


def _exec_load(self, buffer_id):
    wire = self._mmpipe_wire
    wire.loaded = ()
    wire.load(self, buffer_id)  # calls self._next_batch() once, which files the integers in wire.loaded
    self.pipe_buffers[INTS][buffer_id] = wire.loaded


def _exec_forward(self, buffer_id):
    self.module.wire_ints = self.pipe_buffers[INTS][buffer_id]
    try:
        self._mmpipe_wire.forward(self, buffer_id)
    finally:
        self.module.wire_ints = None


def to_device(batch, device):
    """A batch's tensors (nested in tuples, as (inputs, labels)) on the rank's device. non_blocking: from the
    loader's pinned memory (mmpipe.data.batches.rank_batches, pin_memory on CUDA) the host-to-device copy
    is queued on the stream and overlaps the work queued before it, where DeepSpeed's own load
    (`.clone().to(device)`) would wait for it; the caching host allocator keeps the pinned buffer until the
    copy is done. On the CPU it is the tensors themselves."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(t, device) for t in batch)
    return batch


def _next_batch(self, next_batch):
    batch = to_device(next_batch(), self.device)
    self._mmpipe_wire.loaded = integer_tensors(None if batch is None else batch[0])
    return batch


def _set_dataiterator(self, iterator):
    self.training_dataloader = None
    self.data_iterator = iterator


def patch_engine(engine, exec_load, exec_forward) -> Path | None | bool:
    """What every engine mmpipe runs gets (a PipelineEngine here, mmpipe.runtime.dualpipev's DualPipeVEngine): its
    LoadMicroBatch / ForwardPass handlers replaced by exec_load / exec_forward (the replaced ones kept in
    `_mmpipe_wire`), an integer-tensor pipe buffer, every rank's own data iterator, and _next_batch keeping the ints
    of the batch it returns. False when already installed; else the MMPIPE_WIRE_LOG file to log to (None: no log)."""
    d = engine.__dict__
    if "_mmpipe_wire" in d:
        return False
    d["_mmpipe_wire"] = _Wire(engine._INSTRUCTION_MAP[ds.LoadMicroBatch], engine._INSTRUCTION_MAP[ds.ForwardPass])
    engine.pipe_buffers[INTS] = [None] * engine.num_pipe_buffers  # _reserve_pipe_buffers extends every key
    d["_INSTRUCTION_MAP"] = {**engine._INSTRUCTION_MAP, ds.LoadMicroBatch: exec_load, ds.ForwardPass: exec_forward}
    d["set_dataiterator"] = MethodType(_set_dataiterator, engine)  # every rank keeps its iterator
    next_batch = engine._next_batch
    d["_next_batch"] = MethodType(lambda self: _next_batch(self, next_batch), engine)
    log = os.environ.get(WIRE_LOG)
    return Path(log) / f"wire_rank{engine.global_rank}.csv" if log else None


def install(engine) -> None:
    """Make `engine` (a PipelineEngine over a VLMPipeline, after deepspeed.initialize) send floats only."""
    exec_schedule = engine._exec_schedule
    log = patch_engine(engine, _exec_load, _exec_forward)
    if log is False:
        return
    engine.__dict__["_exec_schedule"] = lambda schedule: exec_schedule(_LoadBeforeForward(schedule))
    if log:
        _log_sends(engine, log)


def _log_sends(engine, path: Path) -> None:
    """The MMPIPE_WIRE_LOG test hook: this process's p2p sends, one line each."""
    send, send_meta, in_meta = p2p.send, engine._send_tensor_meta, []

    def logged_send(tensor, dest_stage, async_op=False):
        with open(path, "a") as f:
            f.write(f"{'meta' if in_meta else 'data'},{tensor.dtype},{'x'.join(map(str, tensor.shape))}\n")
        return send(tensor, dest_stage, async_op=async_op)

    def logged_meta(buffer, recv_stage):
        in_meta.append(1)
        try:
            return send_meta(buffer, recv_stage)
        finally:
            in_meta.pop()

    p2p.send = logged_send
    engine.__dict__["_send_tensor_meta"] = logged_meta
