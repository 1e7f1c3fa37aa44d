"""Single-device reference training: the pipeline's layers, its batches and its optimizer recipe,
in one process with plain PyTorch. "Pipeline == single device" is tested against this.

It follows the DeepSpeed JSON: AdamW (torch_adam) with the same params, the same LR scheduler
class from deepspeed.runtime.lr_schedules, gradient clipping on the global norm, and DeepSpeed's
gradient accumulation (each micro-batch loss scaled by 1 / GAS). The bench peers (mmpipe.bench)
train with the same step (train_step, or clip_and_step after a torch pipelining schedule).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from deepspeed.runtime import lr_schedules

from ..data.batches import StepBatches, rank_batches
from ..data.dataset import prepare
from ..model.builder import ReferenceModel
from ..run_config import RunConfig
from .feed import run_dataset, step_order
from .precomputed import PrecomputedReference
from .preference import reference_model, reference_rows, starting_model


def make_optimizer(ds_config: dict, params) -> torch.optim.Optimizer:
    """The DeepSpeed JSON's Adam/AdamW as the torch optimizer DeepSpeed builds for `torch_adam`
    (params: tensors, or param groups whose own settings override the JSON's)."""
    opt_cfg = ds_config["optimizer"]
    if opt_cfg["type"].lower() not in ("adamw", "adam"):
        raise ValueError(f"reference loop supports Adam/AdamW, not {opt_cfg['type']}")
    kw = {k: v for k, v in opt_cfg.get("params", {}).items() if k not in ("torch_adam", "adam_w_mode")}
    kw["betas"] = tuple(kw.get("betas", (0.9, 0.999)))
    adamw = opt_cfg["type"].lower() == "adamw" or opt_cfg.get("params", {}).get("adam_w_mode", True)
    return (torch.optim.AdamW if adamw else torch.optim.Adam)(params, **kw)


def make_scheduler(ds_config: dict, opt: torch.optim.Optimizer):
    """The DeepSpeed JSON's LR scheduler class from deepspeed.runtime.lr_schedules on a torch
    optimizer (None without one); step it once per optimizer step, as the engine does."""
    s = ds_config.get("scheduler")
    return getattr(lr_schedules, s["type"])(opt, **s.get("params", {})) if s else None


def gradient_clipping(ds_config: dict) -> float:
    """The DeepSpeed JSON's global-norm clip (0: off); DeepSpeed's default is 1.0."""
    return ds_config.get("gradient_clipping", 1.0)


def accumulate(micro_loss: Callable[[], torch.Tensor], gas: int) -> float:
    """DeepSpeed's gradient accumulation: backward of each of `gas` micro-batch losses scaled by
    1 / GAS. micro_loss() draws the next micro-batch and returns its loss. Returns the mean over the
    micro-batches, the loss DeepSpeed reports for the step."""
    total = 0.0
    for _ in range(gas):
        loss = micro_loss()
        (loss / gas).backward()
        total += loss.item() / gas
    return total


def clip_and_step(params: list, opt: torch.optim.Optimizer, sched, clip: float,
                  norm_allreduce: Callable[[torch.Tensor], object] | None = None) -> None:
    """The optimizer step once the gradients are in, as the DeepSpeed engine takes it: clip on the
    global norm (clip 0: off), step the optimizer and the LR schedule, clear the gradients.

    norm_allreduce: where other ranks hold the rest of the model (pipeline stages), sums the local
    squared gradient norm with theirs in place (e.g. torch.distributed.all_reduce), so every rank
    clips by the norm of the whole model."""
    if clip > 0:
        if norm_allreduce is None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            _clip_across_ranks(params, clip, norm_allreduce)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)


def _clip_across_ranks(params: list, clip: float, norm_allreduce) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.stack([g.detach().pow(2).sum() for g in grads]).sum()
    norm_allreduce(sq)
    scale = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s coefficient
    for g in grads:
        g.mul_(scale)


def train_step(micro_loss: Callable[[], torch.Tensor], gas: int, params: list, opt: torch.optim.Optimizer, sched,
               clip: float, norm_allreduce: Callable[[torch.Tensor], object] | None = None) -> float:
    """One optimizer step over `gas` micro-batches (accumulate, then clip_and_step); returns the
    step's loss."""
    loss = accumulate(micro_loss, gas)
    clip_and_step(params, opt, sched, clip, norm_allreduce)
    return loss


def train_reference(run: RunConfig, *, seed: int, steps: int, out_dir: str = "", start: int = 0
                    ) -> tuple[ReferenceModel, list[float]]:
    """out_dir: where user data's index is read or written (mmpipe.data.dataset.prepare). start: the steps taken
    before, as a resume under another layout continues them (the weights --init-from's checkpoint, the AdamW
    moments fresh): the LR schedule stepped `start` times, the data from the position after step `start` on."""
    if run.dp != 1 or run.precision != "fp32":
        raise ValueError("the reference loop covers dp = 1, fp32")
    model = starting_model(run, seed)  # --init-from: weights only, as trainer.load_run_weights
    # --objective dpo: a frozen copy of the starting model, or --reference's run (mmpipe.runtime.preference), or
    # --reference-logps' file read (mmpipe.runtime.precomputed)
    ref_model = reference_model(run, model) if run.objective.reference and not run.reference_logps else None
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(run.ds_config, params)
    sched = make_scheduler(run.ds_config, opt)
    for _ in range(start if sched is not None else 0):
        sched.step()
    clip = gradient_clipping(run.ds_config)
    samples = prepare(run.data, run.model, out_dir, seed, verbose=False)
    data = run_dataset(run, samples, augment_seed=seed if run.data.augment else None)
    # the pipeline's row layout (--pack: by cost, mmpipe.data.balance), so its micro-batches hold the same rows
    position = start * run.train_batch
    batches = rank_batches(data, StepBatches(position, run.micro, run.gas, 0, 1, step_order(run, samples, data.plan)))
    pre = PrecomputedReference.for_stream(run, samples, seed, position, 0, data.plan, True) if run.reference_logps \
        else None
    model.train()

    def micro_loss():
        inputs, labels = next(batches)  # (pixels, input_ids, has_image, segments[, tiling]), (labels, weights)
        if ref_model is not None:  # (labels, ref_logps), as the pipeline's reference pass hands its last stage
            labels = reference_rows(ref_model, inputs, labels, run.objective, run.pack)
        elif pre is not None:
            labels = pre.rows(inputs, labels)
        return run.objective.loss(model(*inputs), labels)

    # one intra-op thread, as every rank runs (OMP_NUM_THREADS=1): the kernels' reduction order, so the float noise
    # Adam scales to a full step where a gradient is ~0 (key biases, Gated DeltaNet's decay gate), is the pipeline's
    # and not the host's core count (qwen3.5-tiny PP=2, 4 updates: in_proj_a 1.3e-5 apart with 2 threads, < 1e-5 with 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return model, [train_step(micro_loss, run.gas, params, opt, sched, clip) for _ in range(steps)]
    finally:
        torch.set_num_threads(threads)

