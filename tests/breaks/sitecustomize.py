"""Deliberate breaks for the tests that must show they would catch them (docs/testing.md, "Choosing a tolerance").

A launched run imports this at start-up when tests/breaks is on its PYTHONPATH (conftest.broken_env), and applies
the break MMPIPE_TEST_BREAK names, in every rank; nothing else ever imports it. Each broken call prints a line
(BROKE), so a control run can show that its break ran. Breaks:

- expert_reduction: bf16's expert-gradient reduction patched out (DeepSpeed's `_reduce_expert_gradients`, which
  mmpipe.runtime.experts calls after the replicated weights' reduction): each expert shard then steps on its own
  rank's gradient, not the mean over the global batch.
"""
import os

BROKE = "mmpipe-test-break: skipped"

if os.environ.get("MMPIPE_TEST_BREAK") == "expert_reduction":
    from deepspeed.runtime.engine import DeepSpeedEngine

    def _skipped(self, *args, **kwargs):
        print(f"{BROKE} _reduce_expert_gradients", flush=True)

    DeepSpeedEngine._reduce_expert_gradients = _skipped

if os.environ.get("MMPIPE_TEST_BREAK") == "no_update":
    import torch

    def _no_step(self, closure=None):
        print(f"{BROKE} AdamW.step", flush=True)

    torch.optim.AdamW.step = _no_step
