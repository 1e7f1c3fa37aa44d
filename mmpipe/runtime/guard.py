"""Non-finite losses in fp32 / bf16. (fp16 has DeepSpeed's loss scaler, which skips overflowing
steps itself; mmpipe counts those.)

--nonfinite stop (default): after a step whose loss is NaN or inf, every rank stops with one
  message and exit status 3, before any further checkpoint: the last good one stays `latest`.
--nonfinite skip: the step is dropped before the optimizer sees it — its gradients are zeroed,
  no AdamW update, no LR-scheduler step — the batch is counted, and training goes on. The check
  runs at DeepSpeed's optimizer step, where every rank of every pipeline meets once per batch:
  the last stage's loss and each stage's gradients vote through one all-reduce (MIN), so all
  ranks skip together. fp32 with ZeRO-0 only: bf16's and ZeRO-1's optimizers keep their own
  gradient buffers, which zeroing the parameters' gradients would not clear.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NONFINITE = ("stop", "skip")


def install_skip(engine) -> dict:
    """Wrap engine._take_model_step; returns a counter dict {"nonfinite_steps": n} it updates."""
    counter = {"nonfinite_steps": 0}
    take_step = engine._take_model_step

    def guarded(*args, **kwargs):
        ok = torch.ones(1)
        loss = engine.total_loss if engine.is_last_stage() else None
        if loss is not None and not torch.isfinite(loss).all():
            ok.zero_()
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        if grads and not torch.isfinite(torch.stack([g.float().norm() for g in grads]).sum()):
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 1:
            return take_step(*args, **kwargs)
        # as DeepSpeed does for an fp16 overflow: no update, no scheduler step, counters advance
        engine.zero_grad()
        counter["nonfinite_steps"] += 1
        engine._step_applied = False
        engine.losses = None
        engine.global_steps += 1
        engine.global_samples += engine.train_batch_size()

    engine._take_model_step = guarded
    return counter
