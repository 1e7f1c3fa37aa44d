"""Single-device reference training: the pipeline's layers, its batches and its optimizer recipe,
in one process with plain PyTorch. "Pipeline == single device" is tested against this.

It follows the DeepSpeed JSON: AdamW (torch_adam) with the same params, the same LR scheduler
class from deepspeed.runtime.lr_schedules, gradient clipping on the global norm, and DeepSpeed's
gradient accumulation (each micro-batch loss scaled by 1 / GAS).
"""
from __future__ import annotations

from pathlib import Path

import torch
from deepspeed.runtime import lr_schedules

from ..data.batches import StepBatches, TrainSet, rank_batches
from ..data.dataset import prepare
from ..data.text import placeholders
from ..model.builder import ReferenceModel, lm_loss
from ..run_config import RunConfig


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


def train_reference(run: RunConfig, *, seed: int, steps: int, out_dir: str = "") -> tuple[ReferenceModel, list[float]]:
    """out_dir: where user data's index is read or written (mmpipe.data.dataset.prepare)."""
    if run.dp != 1 or run.precision != "fp32":
        raise ValueError("the reference loop covers dp = 1, fp32")
    model = ReferenceModel(run.model, seed=seed, freeze=run.freeze)
    if run.init_from:  # weights only, as mmpipe.train.load_run_weights
        from .checkpoint import load_reference
        model.load_state_dict(load_reference(Path(run.init_from) / "checkpoints", run.model).state_dict())
    opt = make_optimizer(run.ds_config, [p for p in model.parameters() if p.requires_grad])
    sched = make_scheduler(run.ds_config, opt)
    clip = run.ds_config.get("gradient_clipping", 1.0)  # DeepSpeed's default is 1.0
    v = run.model.vision
    data = TrainSet(prepare(run.data, run.model, out_dir, seed, verbose=False), text_len=run.text_len,
                    n_img=run.model.n_image_positions, image_size=v.image_size, augment_seed=seed if run.data.augment else None,
                    image_token=placeholders(run.model))
    batches = rank_batches(data, StepBatches(0, run.micro, run.gas, 0, 1))
    losses = []
    model.train()
    for _ in range(steps):
        total = 0.0
        for _ in range(run.gas):
            (pixels, input_ids, has_image), labels = next(batches)
            loss = lm_loss(model(pixels, input_ids, has_image), labels)
            (loss / run.gas).backward()
            total += loss.item() / run.gas  # DeepSpeed reports the mean over micro-batches
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        losses.append(total)
    return model, losses
