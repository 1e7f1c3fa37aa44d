"""Validation loss through the pipeline itself: DeepSpeed's `eval_batch` on every stage and every
data-parallel rank, averaged over answer tokens, written to eval_log.csv and the monitors.

The validation set (mmpipe.data.samples.EvalSet, E samples) is laid out like a training step's
stream: one `eval_batch` takes micro x GAS x DP positions (e.g. 4 x 2 x 1 = 8), so it takes
ceil(E / 8) calls; positions past E are label-free repeats (the pipeline's shapes are fixed).
While it runs, the module's loss function returns the SUM of cross-entropy over answer tokens
(the run's Objective.eval_sum, mmpipe.model.objectives). eval_batch averages its outputs over the GAS micro-batches and
the DP replicas, so one call returns sum / (GAS x DP); the loss is
    sum over calls of (returned x GAS x DP) / answer tokens of the set,
the mean over every answer token of the set, whatever the batch shapes, which is what the
single-device reference computes (tests/test_validation.py). --objective dpo (a pair objective): positions 2k /
2k + 1 are a pair's chosen / rejected answer (an even micro-batch holds whole pairs), the live reference's pass
(mmpipe.runtime.preference.LiveReference.step) runs over each call's micro-batches first, eval_sum is the sum of
the pairs' preference losses, and the loss is that sum over the set's pairs; the rewards' sums of the last stages
(Objective.eval_metrics) are summed over every rank and divided by the same count. Nothing of training is touched: the
training stream, RNG states and the step timer are not used, so training losses are the same
with validation on or off.
"""
from __future__ import annotations

import csv
import math
import time
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.batches import StepBatches, rank_batches
from ..data.samples import EvalSet
from ..run_config import RunConfig
from .feed import run_dataset
from .pipeline import rank_objective

EVAL_FIELDS = ["step", "eval_loss", "eval_samples", "eval_tokens", "elapsed_s"]


class Validator:
    def __init__(self, engine, run: RunConfig, evalset: EvalSet, out: Path, dtype, *, enabled: bool, append: bool,
                 t_start: float, reference=None):
        """t_start: the training clock's zero, so eval_log.csv's elapsed_s lines up with train_log.csv's. reference:
        dpo's LiveReference, run over each call's micro-batches before it."""
        self.engine, self.run, self.evalset, self.dtype, self.reference = engine, run, evalset, dtype, reference
        # the loss's denominator: the set's answer tokens, or its pairs (every good pair has both answers' tokens)
        self.tokens = evalset.size // 2 if run.objective.pairs else evalset.answer_tokens()
        self.metrics: dict[int, dict[str, float]] = {}  # step -> the objective's logged values on the set (dpo)
        self.calls = math.ceil(evalset.size / run.train_batch)  # micro x GAS x DP samples per eval_batch
        # one sample per row, the training rows' shape; every stage reads it (runtime.wire)
        self.dataset = run_dataset(run, evalset, first=engine.module.reads_images, last=engine.is_last_stage(),
                                   train=False)
        self.losses: dict[int, float] = {}
        self.t0 = t_start
        self.file = open(out / "eval_log.csv", "a" if append else "w", newline="") if enabled else None
        self.log = csv.DictWriter(self.file, EVAL_FIELDS + list(run.objective.logged if run.objective.eval_metrics
                                                               else ())) if enabled else None
        if self.file is not None and self.file.tell() == 0:
            self.log.writeheader()

    def __call__(self, step: int) -> float:
        """Collective: the validation loss after optimizer step `step` (every rank returns it)."""
        engine, run = self.engine, self.run
        sampler = StepBatches(0, run.micro, run.gas, engine.grid.data_parallel_id, run.dp)
        batches = rank_batches(self.dataset, islice(sampler, self.calls * run.gas), dtype=self.dtype)
        train_loss_fn, monitor_on = engine.module.loss_fn, engine.monitor.enabled
        engine.module.loss_fn = _eval_sum(engine, run)
        engine.monitor.enabled = False  # DeepSpeed would log the sum as 'eval_loss'; mmpipe logs the mean
        try:
            # dpo: each call's micro-batches through the reference first, labelled (labels, ref_logps)
            calls = (self.reference.step(batches) if self.reference else batches for _ in range(self.calls))
            total = sum(float(engine.eval_batch(it)) for it in calls)
        finally:
            engine.module.loss_fn, engine.monitor.enabled = train_loss_fn, monitor_on
            batches.close()
        loss = total * run.gas * run.dp / max(1, self.tokens)
        self.losses[step] = loss
        logged = self._pair_metrics() if run.objective.eval_metrics else {}
        self.metrics[step] = logged
        if self.log:
            self.log.writerow({"step": step, "eval_loss": repr(loss), "eval_samples": self.evalset.size,
                               "eval_tokens": self.tokens, "elapsed_s": f"{time.perf_counter() - self.t0:.2f}",
                               **{k: repr(v) for k, v in logged.items()}})
            self.file.flush()
        return loss

    def _pair_metrics(self) -> dict[str, float]:
        """Collective: the objective's logged values over the set, its last stages' sums added over every rank (the
        other stages add zeros) and divided by the pairs counted."""
        sums = self.run.objective.eval_metrics().to(self.engine.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        return {k: float(v / torch.clamp(sums[-1], min=1)) for k, v in zip(self.run.objective.logged, sums)}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _eval_sum(engine, run: RunConfig):
    """The objective's validation sum in the form the pipeline's training loss takes (pipeline.rank_objective): under
    --tp over the last stage's 1/TP of the logits, every TP rank returning the same sum; under --sp (with or without
    --tp) each SP rank's sum over its slice's positions (dpo: each sample's log-prob share), summed over the SP group,
    so every SP rank returns the whole row's sum and eval_batch's DP average (per (pipe, seq, model)) is as at SP 1."""
    return rank_objective(engine, run).eval_sum
