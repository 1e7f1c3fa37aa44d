"""Per-rank entry of an engine-'dp' variant: the same model, data and DeepSpeed JSON, data-parallel
through DeepSpeed's ordinary engine (no pipeline), so ZeRO-2/3 can run.

DeepSpeed 0.19.8 rejects ZeRO-2/3 for any PipelineModule (../shared/DEEPSPEED_NOTES.md). As the
notes found, a 1-stage VLMPipeline wrapped in a plain nn.Module whose forward returns the loss gets
the ordinary DeepSpeedEngine, and its losses matched the 2-stage pipeline. The run is resolved by
mmpipe.run_config with ZeRO-0/1 (its pipeline rule) and the requested stage is put back after.
Writes train_log.csv and summary.json with train's fields (no stage timing: there are no stages).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from .memory import write_peak


class LossModule(torch.nn.Module):
    def __init__(self, pipe):
        super().__init__()
        self.pipe = pipe

    def forward(self, pixels, input_ids, has_image, labels):
        from ..model.builder import lm_loss
        return lm_loss(self.pipe((pixels, input_ids, has_image)), labels)


def main(argv=None) -> int:
    from .. import train
    from ..config import ConfigError
    from ..run_config import fail, resolve
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, required=True)
    ns, rest = p.parse_known_args(argv)
    args = train.parse_args(rest)
    import os
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        run = resolve(args, world_size=world)
    except ConfigError as e:
        return fail(e)
    torch_, deepspeed = train._setup_torch()
    import torch.distributed as dist
    from ..data.batches import StepBatches, TrainSet, rank_batches
    from ..data.dataset import prepare
    from ..runtime.pipeline import VLMPipeline

    deepspeed.init_distributed()
    rank = dist.get_rank()
    from ..runtime.precision import check_all_ranks
    unsupported = check_all_ranks(run.precision)
    if unsupported:
        if rank == 0:
            fail(ConfigError(unsupported))
        dist.destroy_process_group()
        return 2
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds = dict(run.ds_config)
    ds.pop("pipeline", None)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": ns.zero}
    pipe = VLMPipeline(run, seed=args.seed)  # 1 stage: every layer here, built under the same seeds
    model = LossModule(pipe)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds,
                                           model_parameters=[q for q in model.parameters() if q.requires_grad])
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(run.precision, torch.float32)
    samples = prepare(run.data, run.model, out, args.seed, verbose=False)
    v = run.model.vision
    dataset = TrainSet(samples, text_len=run.text_len, n_img=run.model.n_image_positions, image_size=v.image_size,
                       augment_seed=args.seed if run.data.augment else None)
    batches = rank_batches(dataset, StepBatches(0, run.micro, run.gas, rank, run.dp), dtype=dtype,
                           workers=run.data.workers)
    seq = run.model.n_image_positions + run.text_len
    log_file = open(out / "train_log.csv", "w", newline="") if rank == 0 else None
    log = csv.DictWriter(log_file, train.CSV_FIELDS) if log_file else None
    if log:
        log.writeheader()
    step_times, losses, t_start = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(run.gas):
            (pixels, ids, has_image), labels = next(batches)
            loss = engine(pixels, ids, has_image, labels)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the GAS boundary only
            total += loss.item() / run.gas
        # the mean over the DP replicas, as the PipelineEngine reports its loss (rank 0's alone is
        # the loss of half the batch at DP=2)
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        total = float(mean) / run.dp
        dt = time.perf_counter() - t0
        step_times.append(dt)
        losses.append(total)
        if log:
            log.writerow({"step": step, "loss": repr(total), "lr": f"{engine.get_lr()[0]:.6g}",
                          "samples_per_s": f"{run.train_batch / dt:.1f}", "tokens_per_s": f"{run.train_batch * seq / dt:.0f}",
                          "elapsed_s": f"{time.perf_counter() - t_start:.2f}", "skipped": ""})
            log_file.flush()
    del batches
    dist.barrier()
    dist.destroy_process_group()
    write_peak(out)
    if rank == 0:
        step_s = statistics.median(step_times[1:] or step_times)
        (out / "summary.json").write_text(json.dumps({
            "steps": args.steps, "final_loss": losses[-1], "samples_per_s": run.train_batch / step_s,
            "tokens_per_s": run.train_batch * seq / step_s, "step_time_s": step_s, "stages": 1, "dp": run.dp,
            "micro_batch": run.micro, "gradient_accumulation": run.gas, "train_batch": run.train_batch,
            "precision": run.precision, "zero_stage": ns.zero, "preset": run.model.name, "engine": "dp"}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
