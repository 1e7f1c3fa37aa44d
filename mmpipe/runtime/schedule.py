"""The zero-bubble ZB-H1 schedule inside DeepSpeed's PipelineEngine (`--schedule zb-h1`).

DeepSpeed 0.19.8 runs one training schedule, 1F1B (`TrainSchedule`), whose backward pass computes
the gradients for the stage's input AND its weights before the input gradient goes upstream. ZB-H1
(Qi et al., ICLR 2024, arXiv 2401.10241) splits it: B, the input gradient, sent upstream at once,
and W, the weight gradients, deferred into time the stage would otherwise spend waiting. Here:

* `ZeroBubbleH1Schedule`, a `PipeSchedule` yielding DeepSpeed instruction lists, with two new
  instructions: `BackwardInput` (B) and `BackwardWeight` (W). Everything else is DeepSpeed's own
  instruction set and handlers: LoadMicroBatch, ForwardPass, the four blocking p2p instructions,
  ReduceTiedGrads, ReduceGrads, OptimizerStep (so ZeRO-1, bf16/fp16 and clipping are untouched).
* The B/W split: every trainable `nn.Linear` of this stage runs through `_DeferredLinear`, whose
  backward computes only the input gradient and stashes (input, grad_output); W computes
  grad_W = g^T x and grad_b = sum(g) from the stash and hands them to autograd on the parameter
  leaves (so DeepSpeed's gradient hooks fire as in a normal backward). Every other parameter
  (norms, embeddings, positions) takes its gradient in B. A frozen linear is left alone (autograd
  computes its input gradient only), and a stage with no trainable linear gets no W at all: the
  schedule is then 1F1B's order with B as the whole backward.
* `install(engine, "zb-h1")`: the engine instance's `_train_schedule` and `_INSTRUCTION_MAP`
  gain the schedule and the two handlers (the class, and every other engine, are untouched).

The order (`stage_orders`, a unit-time list-scheduling simulation: the ready B first, else the next F
while fewer than p micro-batches are in flight, else a pending W) and the per-stage streams with
each message placed at one global time (`stage_streams`, deadlock-free with DeepSpeed's blocking
p2p) are pure timing and live in mmpipe.planning.schedules, where `mmpipe plan --schedule` also
replays them with predicted per-stage times; this module turns them into DeepSpeed instructions.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..planning.schedule_registry import ONE_F_ONE_B, ZB_H1, Schedule, schedule_named
from ..planning.schedules import Op, simulate, stage_orders, stage_streams

__all__ = ["BackwardInput", "BackwardWeight", "Op", "ZeroBubbleH1Schedule", "install", "simulate", "stage_orders",
           "stage_streams"]


class BackwardInput(ds.BackwardPass):
    """B: DeepSpeed's backward pass with the trainable linears' weight gradients held back; the
    input gradient is ready for SendGrad right after. kwargs: buffer_id, micro_batch_id."""


class BackwardWeight(ds.BackwardPass):
    """W: the weight gradients B held back for micro-batch `micro_batch_id` (buffer_id: the buffer
    the micro-batch used, unused here: the stash is keyed by micro-batch, buffers are recycled)."""


# ----------------------------------------------------------------------------------- instructions

def _live_buffers(stream: list[tuple]) -> int:
    """Most micro-batches holding a pipe buffer at once: from its receive / load to its last use."""
    first, last = {}, {}
    for n, (_, kind, mb) in enumerate(stream):
        if kind == "W":
            continue
        first.setdefault(mb, n)
        last[mb] = n
    return max(sum(1 for mb in first if first[mb] <= n <= last[mb]) for n in range(len(stream)))


class ZeroBubbleH1Schedule(ds.PipeSchedule):
    """ZB-H1 for one stage. weight_stages[i]: whether stage i has deferred weight gradients (W)."""

    def __init__(self, micro_batches, stages, stage_id, weight_stages=None):
        super().__init__(micro_batches, stages, stage_id)
        self.weight_stages = tuple(weight_stages) if weight_stages is not None else (True,) * stages
        orders = stage_orders(stages, micro_batches, self.weight_stages)
        self.stream = stage_streams(orders)[stage_id]
        self.buffers = max(2, _live_buffers(self.stream))  # DeepSpeed's TrainSchedule also keeps >= 2

    def num_pipe_buffers(self):
        return self.buffers

    def steps(self):
        cmds: list = []
        for _, kind, mb in self.stream:
            buf = mb % self.buffers
            if kind == "recv_act":
                cmds.append(ds.RecvActivation(buf))
            elif kind == "send_act":
                cmds.append(ds.SendActivation(buf))
            elif kind == "recv_grad":
                cmds.append(ds.RecvGrad(buf))
            elif kind == "send_grad":
                cmds.append(ds.SendGrad(buf))
            else:
                if kind == "F":
                    if self.is_first_stage or self.is_last_stage:
                        cmds.append(ds.LoadMicroBatch(buf))
                    cmds.append(ds.ForwardPass(buf))
                elif kind == "B":
                    cmds.append(BackwardInput(buf, micro_batch_id=mb))
                else:
                    cmds.append(BackwardWeight(buf, micro_batch_id=mb))
                yield cmds
                cmds = []
        yield cmds + [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]


# --------------------------------------------------------------------------------- the B/W split

@dataclass
class WeightStash:
    """(linear, input, grad_output) triples: `current` collects one B's, `by_mb` holds them until W."""
    current: list | None = None
    by_mb: dict = field(default_factory=dict)
    anchor: torch.Tensor = field(default_factory=lambda: torch.empty(0, requires_grad=True))


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns dL/dx only and stashes (x, dL/dy) for W.

    The weight and bias are not inputs of the graph (no AccumulateGrad in B); `anchor`, a 0-element
    leaf, keeps y on the graph when x itself needs no gradient (the first linear of stage 0)."""

    @staticmethod
    def forward(ctx, x, anchor, module, stash):
        ctx.module, ctx.stash = module, stash
        ctx.save_for_backward(x)
        return F.linear(x, module.weight, module.bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        if ctx.stash.current is None:
            raise RuntimeError("mmpipe: a deferred linear ran backward outside a BackwardInput instruction")
        ctx.stash.current.append((ctx.module, x.detach(), grad_out.detach()))
        grad_x = grad_out.matmul(ctx.module.weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def _deferred_forward(module: torch.nn.Linear, stash: WeightStash, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # eval_batch, or the no-grad first pass of reentrant checkpointing
        return F.linear(x, module.weight, module.bias)
    return _DeferredLinear.apply(x, stash.anchor, module, stash)


def defer_weight_grads(module: torch.nn.Module, stash: WeightStash) -> int:
    """Route every trainable nn.Linear (exactly that type: peft's LoRA A/B included, its frozen base
    not) under `module` through _DeferredLinear; returns how many."""
    n = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear and m.weight.requires_grad:
            m.forward = lambda x, _m=m: _deferred_forward(_m, stash, x)
            n += 1
    return n


def _exec_backward_input(self, buffer_id, micro_batch_id):
    stash = self._mmpipe_stash
    stash.current = []
    received = self.grad_layer
    if received is not None and not self.is_last_stage():
        # RecvGrad writes every micro-batch's gradient into this one buffer, and autograd hands it on
        # uncopied: a linear at the end of the stage (a block's output projection, added to the
        # residual) would stash a view of it that the next RecvGrad overwrites before W runs
        self.grad_layer = received.clone() if torch.is_tensor(received) else [g.clone() for g in received]
    try:
        PipelineEngine._exec_backward_pass(self, buffer_id)
    finally:
        entries, stash.current = stash.current, None
        self.grad_layer = received
    if entries:
        stash.by_mb[micro_batch_id] = entries


@torch.no_grad()
def _weight_grads(entries) -> tuple[list, list]:
    params, grads = [], []
    for module, x, g in entries:
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        params.append(module.weight)
        grads.append(g2.t().matmul(x2).to(module.weight.dtype))  # [out, N] @ [N, in]
        if module.bias is not None and module.bias.requires_grad:
            params.append(module.bias)
            grads.append(g2.sum(0).to(module.bias.dtype))
    return params, grads


def _exec_backward_weight(self, buffer_id, micro_batch_id):
    entries = self._mmpipe_stash.by_mb.pop(micro_batch_id, None)
    if not entries:
        return
    params, grads = _weight_grads(entries)
    del entries
    bf16 = self.using_bf16_optimizer
    if bf16:  # as DeepSpeed brackets a non-last stage's backward: lp grads in, then added to the fp32 ones
        self.optimizer.clear_lp_grads()
    # autograd on the parameter leaves: AccumulateGrad adds into .grad and fires DeepSpeed's gradient
    # hooks (ZeRO-1's grad_accum upcast) exactly as the weight's edge in a full backward would
    torch.autograd.backward(params, grads)
    if bf16 and not self._config.bfloat16_config.immediate_grad_update:
        self.optimizer.update_hp_grads(clear_lp_grads=False)


def _weight_stages(engine, has_w: bool) -> list[bool]:
    """Collective over this pipeline: which stages have W work."""
    if not (dist.is_available() and dist.is_initialized()) or engine.num_stages == 1:
        return [has_w]
    out: list = [None] * engine.num_stages
    dist.all_gather_object(out, has_w, group=engine.grid.get_pipe_parallel_group())
    return [bool(x) for x in out]


def install(engine, schedule: str) -> dict | None:
    """Make `engine` (a PipelineEngine, after deepspeed.initialize) run `schedule`, a registered name
    (mmpipe.planning.schedule_registry). Collective for zb-h1 (every stage of the pipeline calls it).
    Returns what was installed, None for DeepSpeed's 1F1B."""
    installer = INSTALLERS[schedule_named(schedule)]
    return None if installer is None else installer(engine)


def _install_zb_h1(engine) -> dict:
    """ZeroBubbleH1Schedule and the B / W handlers on this engine instance; the trainable linears deferred."""
    stash = WeightStash()
    n = sum(defer_weight_grads(layer, stash) for layer in engine.module.forward_funcs
            if isinstance(layer, torch.nn.Module))
    weight_stages = _weight_stages(engine, n > 0)
    d = engine.__dict__
    d["_mmpipe_stash"] = stash
    d["_INSTRUCTION_MAP"] = {**engine._INSTRUCTION_MAP, BackwardInput: _exec_backward_input,
                             BackwardWeight: _exec_backward_weight}
    d["_train_schedule"] = lambda: ZeroBubbleH1Schedule(engine.micro_batches, engine.num_stages, engine.stage_id,
                                                        weight_stages)
    return {"schedule": ZB_H1.name, "deferred_linears": n, "weight_stages": weight_stages}


# The runtime half of each schedule record: what makes an engine run it (None: DeepSpeed's own
# TrainSchedule, the engine's default). A table here, not a field of the record, because the records
# sit in planning/, below run_args and this layer: a field holding these would import DeepSpeed's engine
# into the planner and the flag parser (mmpipe.planning.schedule_registry's docstring).
INSTALLERS: dict[Schedule, Callable[..., dict] | None] = {ONE_F_ONE_B: None, ZB_H1: _install_zb_h1}
