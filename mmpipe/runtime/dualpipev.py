"""`--schedule dualpipev`: DeepSpeed's own DualPipeV (DeepSeek-V3's schedule) over mmpipe's layer list.

DeepSpeed 0.19.8 ships it (deepspeed.runtime.pipe.dualpipev): `DualPipeVModule` cuts the layer list into
2p stages for p pipeline ranks, rank r building stage r (phase 0, on the way out) and stage 2p - 1 - r
(phase 1, on the way back: rank 0 ends with the head and computes the loss); `deepspeed.initialize`
returns a `DualPipeVEngine` for such a module, which runs `schedule.DualPipeVSchedule` (micro-batches
>= 2p; sends and receives queued and launched as one batch by `CommitP2P`; W kept inside B). mmpipe
adds only what its own layer list needs, on top of DeepSpeed's classes:

* `VLMDualPipeV(VLMPipeline, DualPipeVModule)`: mmpipe's stage boundaries (RunConfig.parts, 2p + 1 of
  them: the record's stages_per_rank) instead of DeepSpeed's partition methods, and the module's "part"
  hooks per phase: the layers of each phase are frozen, bound to their stage fields and given adapters
  (`each_part`), and the active phase says whether it is the pipeline's first (the loader's whole tuple)
  or its last part (the head) - rank 0 is both, in turn.
* `install_wire(engine)`: the float-only wire (mmpipe.runtime.wire) for the V. DualPipeV's buffers are
  `phase x m + micro-batch`; only rank 0 loads (its LoadMicroBatch: inputs and labels, the labels moved
  to the phase-1 slot by DeepSpeed). Every other rank reads each micro-batch's integer tensors from its
  own loader at that micro-batch's phase-0 ForwardPass (it always runs before the same micro-batch's
  phase-1 one on the same rank: the micro-batch turns around on the last rank) and keeps them for its
  phase-1 ForwardPass; rank 0 keeps its loaded integers the same way. A part that is not the first joins
  them to the floats it received (VLMPipeline.forward); a part that is not the last sends its floats only.
  Validation (mmpipe.runtime.validation) is DeepSpeed's DualPipeVEngine.eval_batch, its forward-only
  DualPipeVSchedule through the same handlers: the phase-0 pass still comes first on every rank, and each rank's
  iterator is the validation one for the call (wire.patch_engine's set_dataiterator).

The layer files a checkpoint writes are DeepSpeed's per layer (DualPipeVModule.save_state_dict saves both
phases), named by the layer's index, so the single-device reference reads them as it reads 1F1B's.
"""
from __future__ import annotations

from pathlib import Path

import torch
from deepspeed import comm as dist
from deepspeed.pipe import TiedLayerSpec
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from .pipeline import VLMPipeline
from .wire import INTS, _log_sends, integer_tensors, patch_engine

__all__ = ["VLMDualPipeV", "install_wire"]


class VLMDualPipeV(VLMPipeline, DualPipeVModule):
    """mmpipe's pipeline module as a DualPipeVModule: 2p stages at RunConfig.parts' boundaries, two per rank."""

    def _partition_layers(self, method="mmpipe"):
        # as DualPipeVModule._partition_layers, at mmpipe's boundaries: num_stages becomes the 2p stages
        self.num_stages *= 2
        self.parts = self._mmpipe_parts
        if len(self.parts) != self.num_stages + 1:
            raise ValueError(f"DualPipeV on {self.num_stages // 2} ranks needs {self.num_stages + 1} stage "
                             f"boundaries, got {self.parts}")
        out, back = self.stage_id, self.num_stages - 1 - self.stage_id
        self._set_bounds(start=self.parts[out], stop=self.parts[out + 1])
        self.phase_bounds = [(self.parts[out], self.parts[out + 1]), (self.parts[back], self.parts[back + 1])]

    install_wire = staticmethod(lambda engine: install_wire(engine))

    def _synchronize_tied_weights(self):
        """Each tied weight from the rank holding its FIRST layer, as PipelineModule does on a line of stages.
        DeepSpeed broadcasts from the lowest rank of the tie (module.py, `src=min(comm['ranks'])`), and
        DualPipeVModule folds the stages onto ranks (stage_owner: min(s, 2p - 1 - s)), so a tie between stage 1
        and stage 2p - 1 (llava-tiny at PP=2: the text embedding on rank 1, the LM head on rank 0) took rank 0's
        copy, which rank 0 built under the head's layer seed: every rank started from another init than the
        single-device reference (step-1 loss 4.1576 against 4.1615). A value copy under no_grad, as
        VLMPipeline's."""
        with torch.no_grad():
            for key, comm in self.tied_comms.items():
                first = next(i for i, spec in enumerate(self._layer_specs)
                             if isinstance(spec, TiedLayerSpec) and spec.key == key)
                src = self._grid.stage_to_global(stage_id=self.stage_owner(first))
                for attr in comm["weight_attr"]:
                    dist.broadcast(self._recursive_getattr(comm["module"], attr), src=src, group=comm["group"])

    def each_part(self):
        for phase in (0, 1):
            self.activate_phase(phase)
            yield phase
        self.activate_phase(0)

    def part_stage(self) -> int:
        """The active phase's stage of the 2p: r on the way out, 2p - 1 - r on the way back."""
        return self.stage_id if self.active_phase == 0 else self.num_stages - 1 - self.stage_id

    def first_part(self) -> bool:
        return self.part_stage() == 0

    def last_part(self) -> bool:
        return self.part_stage() == self.num_stages - 1


def _exec_load(self, buffer_id):
    """Rank 0's LoadMicroBatch (phase-0 buffer = the micro-batch): DeepSpeed's, then its integers filed."""
    wire = self._mmpipe_wire
    wire.loaded = ()
    wire.load(self, buffer_id)  # calls self._next_batch() once, which files the integers in wire.loaded
    self.pipe_buffers[INTS][buffer_id % self.micro_batches] = wire.loaded


def _exec_forward(self, buffer_id, phase):
    slot = buffer_id % self.micro_batches  # the micro-batch, whichever phase's buffer
    if phase == 0 and self.stage_id > 0:  # its first use on this rank: read it from this rank's loader
        batch = self._next_batch()
        self.pipe_buffers[INTS][slot] = integer_tensors(None if batch is None else batch[0])
    self.module.wire_ints = self.pipe_buffers[INTS][slot]
    try:
        self._mmpipe_wire.forward(self, buffer_id, phase)
    finally:
        self.module.wire_ints = None


def install_wire(engine) -> None:
    """Make `engine` (a DualPipeVEngine over a VLMDualPipeV, after deepspeed.initialize) send floats only."""
    log = patch_engine(engine, _exec_load, _exec_forward)
    if log:
        _log_queued(engine, log)


def _log_queued(engine, path: Path) -> None:
    """The MMPIPE_WIRE_LOG test hook (mmpipe.runtime.wire): DualPipeV queues its messages for CommitP2P's batch
    instead of p2p.send, so each queued send is logged as data; the shape announcements go through p2p.send."""
    _log_sends(engine, path)
    queue = engine._queue_p2p

    def logged(op, tensors, stage):
        if op is dist.isend:
            with open(path, "a") as f:
                f.writelines(f"data,{t.dtype},{'x'.join(map(str, t.shape))}\n" for t in tensors)
        return queue(op, tensors, stage)

    engine.__dict__["_queue_p2p"] = logged
