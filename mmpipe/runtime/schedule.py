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

How the order is made (`stage_orders`): a list-scheduling simulation of all stages with unit
times F = B = W = 1 (a linear layer's three matmuls cost the same: 2 FLOPs per weight per token
each), where a free stage does, in priority, the ready B (it unblocks the stage upstream), else
the next F if its input is there and fewer than p micro-batches are in flight on the stage
(forward done, W not done: 1F1B's peak, reached on its stage 0, so memory stays at 1F1B's bound),
else a pending W. With W deferred this way the B's run up the pipeline at the pace of B alone, and
each stage fills its drain with the W's it held back. In units: p = 2, m = 4: 1F1B takes
(m + p - 1) x 3 = 15, ZB-H1 13 = 3m + (p - 1) (the paper's (p - 1)(F + B - W) bubble), the
no-bubble bound 3m = 12; p = 4, m = 8: 33, 29 (the paper's hand-made order: 27), 24 (`simulate`).

How it is turned into instructions (`_stage_streams`): DeepSpeed's p2p is blocking (a send waits
for the matching receive), so each message gets one time T - the simulated start of the op that
consumes it - and both ends place it at T in their stream: every stage's stream is sorted by the
global key (time, messages before compute, stage pair, direction). The unfinished event with the
smallest key is then always runnable (a compute op: everything before it on its stage is done; a
message: both ends are at it), so the schedule cannot deadlock, for any p and m.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..run_args import SCHEDULES


class BackwardInput(ds.BackwardPass):
    """B: DeepSpeed's backward pass with the trainable linears' weight gradients held back; the
    input gradient is ready for SendGrad right after. kwargs: buffer_id, micro_batch_id."""


class BackwardWeight(ds.BackwardPass):
    """W: the weight gradients B held back for micro-batch `micro_batch_id` (buffer_id: the buffer
    the micro-batch used, unused here: the stash is keyed by micro-batch, buffers are recycled)."""


# ------------------------------------------------------------------------------------------ order

@dataclass
class Op:
    kind: str  # "F", "B" or "W"
    mb: int
    start: float = 0.0
    end: float = 0.0


def stage_orders(stages: int, micro_batches: int, weight_stages: list[bool] | tuple[bool, ...],
                 times: list[tuple[float, float, float]] | None = None, split: bool = True) -> list[list[Op]]:
    """Each stage's compute ops in order, with simulated start/end times.

    times[i] = (F, B, W) of stage i (default 1, 1, 1; a stage without W work: W's time joins B).
    split=False is 1F1B: B and W as one op (DeepSpeed's BackwardPass), same priorities and bound."""
    p, m = stages, micro_batches
    times = times or [(1.0, 1.0, 1.0)] * p
    dur = []
    for i in range(p):
        f, b, w = times[i]
        has_w = split and weight_stages[i]
        dur.append({"F": f, "B": b if has_w else b + (w if weight_stages[i] else 0.0), "W": w})
    has_w = [split and weight_stages[i] for i in range(p)]
    # micro-batches in flight (forward done, W - or, without W, B - not done): 1F1B holds p - i on
    # stage i; ZB-H1 lets every stage hold up to p, 1F1B's peak (stage 0's), so memory stays at
    # 1F1B's bound while the later stages can hold W's back into their drain
    limit = [p if split else p - i for i in range(p)]
    f_end = [[None] * m for _ in range(p)]  # when F(k) on stage i ended
    b_end = [[None] * m for _ in range(p)]
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    free = [0.0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    t = 0.0
    while any(nw[i] < m if has_w[i] else nb[i] < m for i in range(p)):
        for i in range(p):
            if free[i] > t:
                continue
            op = None
            k = nb[i]
            if k < nf[i]:  # B(k) needs F(k) here and B(k) downstream
                ready = f_end[i][k] if i == p - 1 else b_end[i + 1][k]
                if ready is not None and ready <= t:
                    op = Op("B", k)
            in_flight = nf[i] - (nw[i] if has_w[i] else nb[i])
            if op is None and nf[i] < m and in_flight < limit[i]:
                ready = 0.0 if i == 0 else f_end[i - 1][nf[i]]
                if ready is not None and ready <= t:
                    op = Op("F", nf[i])
            if op is None and has_w[i] and nw[i] < nb[i]:
                op = Op("W", nw[i])
            if op is None:
                continue
            op.start, op.end = t, t + dur[i][op.kind]
            free[i] = op.end
            if op.kind == "F":
                f_end[i][op.mb] = op.end
                nf[i] += 1
            elif op.kind == "B":
                b_end[i][op.mb] = op.end
                nb[i] += 1
            else:
                nw[i] += 1
            orders[i].append(op)
        later = [free[i] for i in range(p) if free[i] > t]
        if not later:
            raise RuntimeError(f"pipeline order stalled at t={t} (p={p}, m={m})")  # cannot happen: a bug
        t = min(later)
    return orders


def simulate(stages: int, micro_batches: int, weight_stages, times=None, split: bool = True) -> dict:
    """Makespan and each stage's idle share of it, for the docs and the planner: the order's
    timeline with free communication and the optimizer step left out."""
    orders = stage_orders(stages, micro_batches, weight_stages, times, split)
    span = max(o[-1].end for o in orders)
    busy = [sum(op.end - op.start for op in o) for o in orders]
    return {"makespan": span, "idle": [1 - b / span for b in busy], "orders": orders}


# ----------------------------------------------------------------------------------- instructions

def _stage_streams(orders: list[list[Op]]) -> list[list[tuple]]:
    """Per stage, the sorted (key, kind, micro-batch) events: compute ops and the messages around them."""
    p = len(orders)
    events: list[list[tuple]] = [[] for _ in range(p)]
    for i, o in enumerate(orders):
        for op in o:
            events[i].append(((op.start, 1, 0, 0), op.kind, op.mb))
            if op.kind == "F" and i > 0:  # activation i-1 -> i, needed when F starts here
                key = (op.start, 0, i - 1, 0)
                events[i].append((key, "recv_act", op.mb))
                events[i - 1].append((key, "send_act", op.mb))
            if op.kind == "B" and i < p - 1:  # gradient i+1 -> i, needed when B starts here
                key = (op.start, 0, i, 1)
                events[i].append((key, "recv_grad", op.mb))
                events[i + 1].append((key, "send_grad", op.mb))
    for i in range(p):
        events[i].sort(key=lambda e: e[0])
        # the sender's message must come after the op that produced it
        pos = {(e[1], e[2]): n for n, e in enumerate(events[i])}
        for (kind, mb), n in pos.items():
            if kind == "send_act":
                assert pos[("F", mb)] < n
            elif kind == "send_grad":
                assert pos[("B", mb)] < n
    return events


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
        self.stream = _stage_streams(orders)[stage_id]
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
    """Make `engine` (a PipelineEngine, after deepspeed.initialize) run `schedule`. Collective for zb-h1
    (every stage of the pipeline calls it). Returns what was installed, None for DeepSpeed's 1F1B."""
    if schedule == "1f1b":
        return None
    if schedule != "zb-h1":
        raise ValueError(f"unknown schedule {schedule!r} (valid: {', '.join(SCHEDULES)})")
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
    return {"schedule": schedule, "deferred_linears": n, "weight_stages": weight_stages}
