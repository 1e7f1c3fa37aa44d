"""Any schedule's order, run inside DeepSpeed's PipelineEngine (`--schedule`).

DeepSpeed 0.19.8 runs one training schedule, 1F1B (`TrainSchedule`), whose backward pass computes
the gradients for the stage's input AND its weights before the input gradient goes upstream. A
`Schedule` record (mmpipe.planning.schedule_registry) carries its own order instead: per stage, its
forward (F), backward or input-backward (B) and weight-backward (W) ops, with the messages between
the stages placed at one global time each (mmpipe.planning.schedules.stage_streams, deadlock-free with
DeepSpeed's blocking p2p). This module is the one translator from such an order to DeepSpeed
instructions, whichever schedule made it:

* `OrderSchedule`, a `PipeSchedule` yielding DeepSpeed instruction lists for one stage's stream.
  F is LoadMicroBatch (first and last stage) + ForwardPass; messages are the four blocking p2p
  instructions; the step ends with ReduceTiedGrads, ReduceGrads, OptimizerStep (so ZeRO-1,
  bf16/fp16 and clipping are untouched). B is DeepSpeed's BackwardPass, or, for a schedule that
  splits the backward (`split_backward`: ZB-H1, Qi et al., ICLR 2024, arXiv 2401.10241), the two new
  instructions `BackwardInput` (B) and `BackwardWeight` (W).
* The B/W split: every trainable `nn.Linear` of this stage runs through `_DeferredLinear`, whose
  backward computes only the input gradient and stashes (input, grad_output); W computes
  grad_W = g^T x and grad_b = sum(g) from the stash and hands them to autograd on the parameter
  leaves (so DeepSpeed's gradient hooks fire as in a normal backward). Every other parameter
  (norms, embeddings, positions) takes its gradient in B. A frozen linear is left alone (autograd
  computes its input gradient only), and a stage with no trainable linear gets no W at all: its
  order is then the schedule's with B as the whole backward.
* `install(engine, schedule)`: the engine instance's `_train_schedule` (and, for a split, its
  `_INSTRUCTION_MAP`, with the two handlers) run the record's order; the class, and every other
  engine, are untouched. A `deepspeed_native` record (1F1B) installs nothing: DeepSpeed's own
  TrainSchedule runs.

The orders themselves (`stage_orders`: a unit-time list-scheduling simulation; ZB-H1's: the ready B
first, else the next F while fewer than p micro-batches are in flight, else a pending W) are pure
timing and live in mmpipe.planning.schedules, where `mmpipe plan --schedule` also replays them with
predicted per-stage times.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..model.tensor_parallel import gathered_rows
from ..planning.schedule_registry import ZB_H1, Schedule
from ..planning.schedules import Op, simulate, stage_orders, stage_streams

__all__ = ["BackwardInput", "BackwardWeight", "Op", "OrderSchedule", "install", "simulate", "stage_orders",
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


class OrderSchedule(ds.PipeSchedule):
    """`schedule`'s order for one stage, as DeepSpeed instructions. weight_stages[i]: whether stage i
    has weight-gradient work (W, for a schedule that splits the backward; else a longer B)."""

    def __init__(self, micro_batches, stages, stage_id, weight_stages=None, schedule: Schedule = ZB_H1):
        super().__init__(micro_batches, stages, stage_id)
        self.schedule = schedule
        self.weight_stages = tuple(weight_stages) if weight_stages is not None else (True,) * stages
        orders = schedule.orders(stages, micro_batches, self.weight_stages)
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
                elif kind == "B" and not self.schedule.split_backward:
                    cmds.append(ds.BackwardPass(buf))
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
    """y = x W^T (+ b) whose backward returns dL/dx only and stashes (x, dL/dy) for W.

    The weight and bias are not inputs of the graph (no AccumulateGrad in B); `anchor`, a 0-element
    leaf, keeps y on the graph when x itself needs no gradient (the first linear of stage 0). bias:
    whether b is in this product (a row-parallel linear adds its bias after the TP all-reduce: autograd
    takes its gradient in B). token: a row an entry gathered under Megatron's sequence parallelism
    (tensor_parallel._Row): x is kept as this rank's positions, and W gathers the row again, as the
    split linear's own backward would (tensor_parallel._GatheredLinear)."""

    @staticmethod
    def forward(ctx, x, anchor, module, stash, bias, token):
        ctx.module, ctx.stash, ctx.bias, ctx.token = module, stash, bias, token
        ctx.save_for_backward(x if token is None else token.local)
        return F.linear(x, module.weight, module.bias if bias else None)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        if ctx.stash.current is None:
            raise RuntimeError("mmpipe: a deferred linear ran backward outside a BackwardInput instruction")
        ctx.stash.current.append((ctx.module, x.detach(), grad_out.detach(), ctx.bias, ctx.token))
        grad_x = grad_out.matmul(ctx.module.weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None


def _deferred_forward(module: torch.nn.Linear, stash: WeightStash, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    if not torch.is_grad_enabled():  # eval_batch, or the no-grad first pass of reentrant checkpointing
        return F.linear(x, module.weight, module.bias if bias else None)
    return _DeferredLinear.apply(x, stash.anchor, module, stash, bias, getattr(x, "tp_row", None))


def defer_weight_grads(module: torch.nn.Module, stash: WeightStash) -> int:
    """Route every trainable nn.Linear (exactly that type: peft's LoRA A/B included, its frozen base
    not) under `module` through _DeferredLinear; returns how many. A tensor-parallel linear
    (mmpipe.model.tensor_parallel: tp_shard) keeps its forward, whose collectives (the column's
    copy in, its gradient all-reduced backward; the row's all-reduce; under --sequence-parallel the
    gather and reduce-scatter) stay around its own matmul: only that matmul is deferred (tp_local),
    so W's g^T x reads the x and g this rank holds, its slice's gradient. A linear whose forward something else
    replaced on the instance keeps it and takes its weight gradient in B: under --sp an untied head's projection
    returns its hidden and weight for the tiled loss (sequence_parallel.tiled_head), whose backward makes the weight
    gradient a tile of logits at a time (deferring it would keep the logits' gradient, or recompute them, in W)."""
    n = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear and m.weight.requires_grad:
            if hasattr(m, "tp_shard"):
                m.tp_local = functools.partial(_deferred_forward, m, stash)
            elif "forward" in vars(m):
                continue
            else:
                m.forward = functools.partial(_deferred_forward, m, stash)
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
    params, grads, rows = [], [], {}
    for module, x, g, bias, token in entries:
        if token is not None:  # the row gathered again once for every linear of its entry (in the same order on
            if id(token) not in rows:  # every TP rank, so the all-gathers pair up)
                rows[id(token)] = gathered_rows(token)
            x = rows[id(token)]
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        params.append(module.weight)
        grads.append(g2.t().matmul(x2).to(module.weight.dtype))  # [out, N] @ [N, in]
        if bias and module.bias is not None and module.bias.requires_grad:
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


def install(engine, schedule: Schedule) -> dict | None:
    """Make `engine` (a PipelineEngine, after deepspeed.initialize) run `schedule`'s order. Collective
    for a translated schedule (every stage of the pipeline calls it: which stages have W work).
    Returns what was installed, None for a `deepspeed_native` one (DeepSpeed's own 1F1B)."""
    if schedule.deepspeed_native:
        return None
    d = engine.__dict__
    layers = [layer for layer in engine.module.forward_funcs if isinstance(layer, torch.nn.Module)]
    if schedule.split_backward:  # the trainable linears' weight gradients deferred from B to W
        stash = WeightStash()
        n = sum(defer_weight_grads(layer, stash) for layer in layers)
        d["_mmpipe_stash"] = stash
        d["_INSTRUCTION_MAP"] = {**engine._INSTRUCTION_MAP, BackwardInput: _exec_backward_input,
                                 BackwardWeight: _exec_backward_weight}
    else:  # one backward per micro-batch, DeepSpeed's own; the weight stages only time the order
        n = sum(type(m) is torch.nn.Linear and m.weight.requires_grad for layer in layers for m in layer.modules())
    weight_stages = _weight_stages(engine, n > 0)
    d["_train_schedule"] = lambda: OrderSchedule(engine.micro_batches, engine.num_stages, engine.stage_id,
                                                 weight_stages, schedule)
    return {"schedule": schedule.name, "deferred_linears": n if schedule.split_backward else 0,
            "weight_stages": weight_stages}
