"""Deliberate breaks for the tests that must show they would catch them (docs/testing.md, "Choosing a tolerance").

A launched run imports this at start-up when tests/breaks is on its PYTHONPATH (conftest.broken_env), and applies
the break MMPIPE_TEST_BREAK names, in every rank; nothing else ever imports it. Each broken call prints a line
(BROKE), so a control run can show that its break ran. Breaks:

- expert_reduction: the expert shards' gradient reduction patched out, on both of mmpipe.runtime.experts' paths
  (DeepSpeed's `_reduce_expert_gradients` under BF16_Optimizer; the all-reduce over the expert-data-parallel group
  and the division by DP otherwise): each expert shard then steps on its own rank's summed gradient, not the mean
  over the global batch. At DP = EP the group is one rank and only the division by DP is lost, which AdamW hardly
  sees; at DP = 2 EP each copy of a shard trains on half the batch.
"""
import os

BROKE = "mmpipe-test-break: skipped"

if os.environ.get("MMPIPE_TEST_BREAK") == "expert_reduction":
    import torch.distributed
    from deepspeed.runtime.engine import DeepSpeedEngine

    from mmpipe.runtime import experts

    def _skipped(self, *args, **kwargs):  # BF16_Optimizer's path
        print(f"{BROKE} _reduce_expert_gradients", flush=True)

    DeepSpeedEngine._reduce_expert_gradients = _skipped

    class _Dist:  # the other path (experts._install_fp32): no all-reduce of an expert gradient ([E, ...])
        def __getattr__(self, name):
            return getattr(torch.distributed, name)

        def all_reduce(self, tensor, *args, **kwargs):
            if tensor.dim() < 3:  # the clip's squared norms
                return torch.distributed.all_reduce(tensor, *args, **kwargs)
            print(f"{BROKE} the shards' all_reduce", flush=True)

    install_fp32 = experts._install_fp32
    experts.dist = _Dist()
    experts._install_fp32 = lambda engine, shards, dp, ep_group: install_fp32(engine, shards, 1, ep_group)  # no / DP

if os.environ.get("MMPIPE_TEST_BREAK") == "no_update":
    import torch

    def _no_step(self, closure=None):
        print(f"{BROKE} AdamW.step", flush=True)

    torch.optim.AdamW.step = _no_step
