"""Per-rank training entry: `python -m mmpipe.train ...` under the deepspeed launcher or torchrun.

Each rank resolves and checks the whole run (mmpipe.run_config) before creating a process group,
builds its stage of the VLMPipeline, and pulls micro-batches from a deterministic stream: the first
and last stage of each pipeline draw the same micro-batches (the last one without images), data-
parallel replicas draw disjoint ones. After the last step, rank 0 reloads the final checkpoint into
the single-device reference model and scores held-out accuracy (greedy answers, exact match).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from .config import ConfigError
from .runtime.precision import check_all_ranks
from .cluster.preempt import EXIT_REQUEUE, MARKER, Preemption
from .run_config import RunConfig, add_train_args, fail, resolve
from .cluster.slurm_env import ranks_from_slurm

CSV_FIELDS = ["step", "loss", "lr", "samples_per_s", "tokens_per_s", "elapsed_s", "skipped", "loss_scale"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mmpipe.train", description=__doc__.splitlines()[0])
    add_train_args(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _setup_torch():
    import torch
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)  # 1 per rank on CPU: 2 ranks on 2 cores ran 3x slower without it
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu":
        # the shared-memory all-reduce op only serves inference; skip its ~25 s JIT build
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return torch, deepspeed


def train(args: argparse.Namespace, run: RunConfig, preempt=None) -> int:
    torch, deepspeed = _setup_torch()
    import torch.distributed as dist
    from tqdm import tqdm

    from .data.batches import StepBatches, TrainSet, rank_batches
    from .data.dataset import prepare
    from .data.text import decoder_positions, placeholders
    from .runtime.pipeline import VLMPipeline

    deepspeed.init_distributed()
    rank = dist.get_rank()
    unsupported = check_all_ranks(run.precision)  # collective: every rank stops here together
    if unsupported:
        if rank == 0:
            fail(ConfigError(unsupported))
        dist.destroy_process_group()
        return 2
    out = Path(args.output_dir)
    ckpt_dir = out / "checkpoints"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps(run.model.to_dict(), indent=2) + "\n")
        (out / MARKER).unlink(missing_ok=True)  # an earlier preemption's, handled: not this run's
    dist.barrier()
    # the front door built the data index; ranks started without it build it themselves
    samples = prepare(run.data, run.model, out, args.seed, verbose=rank == 0)
    fingerprint = getattr(samples, "index", None) and samples.index.stats["fingerprint"]

    pipe = VLMPipeline(run, seed=args.seed)
    if run.init_from and not args.resume:
        n = load_run_weights(pipe, Path(run.init_from) / "checkpoints")
        if rank == 0:
            print(f"mmpipe: weights from {run.init_from} (stage 0: {n} layers); fresh optimizer", flush=True)
    engine, _, _, _ = deepspeed.initialize(
        model=pipe, config=run.ds_config, model_parameters=[p for p in pipe.parameters() if p.requires_grad])

    from .runtime import checkpoint, rng
    from .runtime.guard import install_skip
    from .runtime.timing import gather_stage_report, instrument, pipeline_summary
    checkpoint.make_loads_safe(engine)
    if rank == 0:
        for name in checkpoint.remove_partial(ckpt_dir) if ckpt_dir.is_dir() else []:
            print(f"mmpipe: removed {ckpt_dir / name}, a checkpoint whose save did not finish", flush=True)
    start_step, start_pos, counters = 0, 0, {"skipped_steps": 0, "nonfinite_steps": 0}
    if args.resume:
        state, notes = checkpoint.resume(engine, ckpt_dir, run, fingerprint=fingerprint, rank=rank)
        start_step, start_pos = state["step"], state["samples"]
        counters = {k: state.get(k, 0) for k in counters}
        if rank == 0:
            for note in notes:
                print(f"mmpipe: {note}", flush=True)
            if run.auto_schedule and state["total_steps"] != args.steps:
                print(f"mmpipe: warning: the LR schedule was laid out for {state['total_steps']} steps and now runs "
                      f"to {args.steps}; from step {start_step + 1} it follows the {args.steps}-step curve "
                      f"(fix scheduler.params.total_num_steps in the config to keep one schedule)", flush=True)
            _truncate_logs(out, start_step, start_pos)
        dist.barrier()  # logs trimmed before anyone appends

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(run.precision, torch.float32)
    dp_rank = engine.grid.data_parallel_id
    first, last = engine.is_first_stage(), engine.is_last_stage()
    v = run.model.vision
    dataset = TrainSet(samples, text_len=run.text_len, n_img=run.model.n_image_positions, image_size=v.image_size,
                       need_images=first, need_labels=last, augment_seed=args.seed if run.data.augment else None,
                       image_token=placeholders(run.model))
    seen_log = None
    if run.data.log_samples and first:
        seen_log = open(out / f"samples_dp{dp_rank}.csv", "a" if args.resume else "w")
        if seen_log.tell() == 0:
            seen_log.write("position,row\n")

    def log_seen(positions):
        seen_log.write("".join(f"{p},{samples.row(p)}\n" for p in positions.tolist()))

    batches = rank_batches(dataset, StepBatches(start_pos, run.micro, run.gas, dp_rank, run.dp),
                           workers=run.data.workers if first else 0, dtype=dtype,
                           on_batch=log_seen if seen_log else None)
    batches = _nan_fault(batches, start_step, run.gas)
    guard = install_skip(engine) if args.nonfinite == "skip" else None
    timer = instrument(engine, skip_steps=1)  # the first step allocates buffers and exchanges shapes

    seq = decoder_positions(run.model, run.text_len)  # per sample, pads included: e.g. 16 image + 12 text = 28
    if rank == 0:
        # micro x GAS x DP samples per optimizer step
        print(f"mmpipe: {run.model.name} in {run.stages} stages x dp {run.dp}; {run.micro} micro x {run.gas} GAS x "
              f"{run.dp} DP = {run.train_batch} samples/step; {run.precision}, ZeRO-{run.zero_stage}; "
              f"parts {run.parts}", flush=True)
    log_file = open(out / "train_log.csv", "a" if args.resume else "w", newline="") if rank == 0 else None
    log = csv.DictWriter(log_file, CSV_FIELDS) if log_file else None
    if log and log_file.tell() == 0:
        log.writeheader()

    step_times, losses = [], []
    t_start = time.perf_counter()
    bar = tqdm(total=args.steps, initial=start_step, disable=rank != 0, desc="train", dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30)  # a log file: occasional lines, not one per step
    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        overflows, dropped = engine.skipped_steps, guard["nonfinite_steps"] if guard else 0
        loss = engine.train_batch(data_iter=batches).item()
        dt = time.perf_counter() - t0
        overflows = engine.skipped_steps - overflows  # fp16: the loss scaler skipped this step
        dropped = (guard["nonfinite_steps"] if guard else 0) - dropped  # --nonfinite skip dropped it
        counters["skipped_steps"] += overflows
        counters["nonfinite_steps"] += dropped
        step_times.append(dt)
        losses.append(loss)
        if log:
            log.writerow({"step": step, "loss": repr(loss), "lr": f"{engine.get_lr()[0]:.6g}",
                          "samples_per_s": f"{run.train_batch / dt:.1f}", "tokens_per_s": f"{run.train_batch * seq / dt:.0f}",
                          "elapsed_s": f"{time.perf_counter() - t_start:.2f}",
                          "skipped": "fp16_overflow" if overflows else "nonfinite" if dropped else "",
                          # fp16: the scale the next step multiplies the loss by (halved after an overflow)
                          "loss_scale": f"{engine.optimizer.loss_scale:g}" if run.precision == "fp16" else ""})
            log_file.flush()
        if not math.isfinite(loss) and not dropped and run.precision != "fp16":
            # --nonfinite stop; fp16 overflows are the loss scaler's business (it skipped the step)
            if rank == 0:
                print(f"mmpipe: error: step {step}: the loss is {loss} ({run.precision}); stopping before any further "
                      f"checkpoint, so `latest` ({checkpoint.latest_tag(ckpt_dir) or 'none'}) is the last good state. "
                      f"Lower the LR, check the data at positions {start_pos + (step - start_step - 1) * run.train_batch}.."
                      f"{start_pos + (step - start_step) * run.train_batch - 1} (--log-samples), or use --nonfinite skip",
                      file=sys.stderr, flush=True)
            return 3
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(1)
        stop = preempt.agreed() if preempt else 0  # collective: every rank stops at the same step
        if step == args.steps or (args.save_every and step % args.save_every == 0) or stop:
            if seen_log:
                seen_log.flush()
            pos = start_pos + (step - start_step) * run.train_batch
            state = checkpoint.run_state(engine, run, args, step, pos, fingerprint, counters)
            checkpoint.save(engine, ckpt_dir, step, state, keep=args.keep_checkpoints, rank_state={"rng": rng.get_state()})
        if stop and step < args.steps:
            bar.close()
            if rank == 0:
                print(f"mmpipe: {preempt.name(stop)}: stopped after step {step} of {args.steps}, checkpoint "
                      f"{ckpt_dir / checkpoint.latest_tag(ckpt_dir)}; exit status {EXIT_REQUEUE} (requeue me; "
                      f"run again with --resume)", flush=True)
                (out / MARKER).write_text(f"{preempt.name(stop)} step {step}\n")
            del batches
            dist.destroy_process_group()
            return EXIT_REQUEUE
    bar.close()
    if seen_log:
        seen_log.close()
    stage_rows = gather_stage_report(engine, timer)  # collective; also every stage's layer files are on disk now
    train_time = time.perf_counter() - t_start
    del batches  # stop the loader workers before the process group goes
    dist.destroy_process_group()  # tear gloo down in order, not in the interpreter's exit (seen to abort a rank)
    if rank != 0:
        return 0

    # the first step includes warm-up (buffer allocation, shape exchange): leave it out of the rates
    timed = step_times[1:] or step_times
    step_s = statistics.median(timed) if timed else float("nan")
    summary = {
        "steps": args.steps, "start_step": start_step, "final_loss": losses[-1] if losses else None,
        "samples_per_s": run.train_batch / step_s, "tokens_per_s": run.train_batch * seq / step_s,
        "step_time_s": step_s, "train_time_s": train_time,
        "stages": run.stages, "dp": run.dp, "micro_batch": run.micro, "gradient_accumulation": run.gas,
        "train_batch": run.train_batch, "precision": run.precision, "zero_stage": run.zero_stage,
        "preset": run.model.name, "freeze": list(run.freeze), "parts": run.parts, "seed": args.seed,
        "ds_config": run.ds_config_path, **counters,
    }
    from .planning.partition import describe
    summary["partition"] = describe(run.layers, run.parts)
    if stage_rows and stage_rows[0].get("steps"):
        timing = pipeline_summary(stage_rows, run.gas, run.stages)
        summary["stage_timing"] = timing
        print(f"mmpipe: per stage (ms per micro-batch) forward "
              f"{[round(r['forward_ms_per_micro'], 2) for r in stage_rows]}, backward "
              f"{[round(r['backward_ms_per_micro'], 2) for r in stage_rows]}; slowest/mean compute "
              f"{timing['max_over_mean']:.2f}; idle (bubble) {timing['measured_bubble']:.1%} measured, "
              f"{timing['theory_bubble']:.1%} in 1F1B theory", flush=True)
    summary["data"] = {"name": run.data.name, "text_len": run.text_len, "samples_seen": args.steps * run.train_batch}
    if not run.data.builtin:
        from .data.index import describe as describe_data
        stats = samples.index.stats
        summary["data"].update({k: stats[k] for k in ("records", "good", "bad", "bad_by_kind", "truncated",
                                                      "with_image", "first_bad")},
                               epochs=args.steps * run.train_batch / len(samples.index),
                               bad_records_file=str(out / "data" / "bad_records.jsonl"))
        for line in describe_data(stats)[:1]:
            print(f"mmpipe: {line}", flush=True)
    if args.eval_samples > 0 and run.data.builtin:
        from .runtime.checkpoint import load_reference
        from .inference.evaluate import blind_baseline, evaluate
        torch.set_num_threads(os.cpu_count() or 1)  # the other ranks are done
        model = load_reference(ckpt_dir, run.model)
        res = evaluate(model, run.model, seed=args.seed, n_samples=args.eval_samples)
        blank = evaluate(model, run.model, seed=args.seed, n_samples=args.eval_samples, blank_images=True)
        summary.update(eval_accuracy=res["accuracy"], eval_per_type=res["per_type"], eval_samples=res["n"],
                       blank_image_accuracy=blank["accuracy"], blank_image_per_type=blank["per_type"],
                       chance_accuracy=blind_baseline(run.model, seed=args.seed)["accuracy"])
        print(f"mmpipe: held-out accuracy {res['accuracy']:.3f} "
              f"({', '.join(f'{k} {v:.2f}' for k, v in res['per_type'].items())}); "
              f"blank images {blank['accuracy']:.3f}; blind chance {summary['chance_accuracy']:.3f}", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"mmpipe: done, summary in {out / 'summary.json'}", flush=True)
    return 0


def load_run_weights(pipe, ckpt_dir: Path) -> int:
    """--init-from: this stage's layers (and its copy of a tied module) from the latest checkpoint of
    another run, read per layer file (any stage count wrote them). Weights only: the optimizer and
    schedule start fresh. Returns the layers loaded."""
    import torch
    from deepspeed.pipe import TiedLayerSpec
    from .runtime.checkpoint import latest_tag
    d = ckpt_dir / latest_tag(ckpt_dir)

    def load(module, idx: int):
        module.load_state_dict(torch.load(d / f"layer_{idx:02d}-model_states.pt", map_location="cpu", weights_only=True))

    n = 0
    for offset, layer in enumerate(pipe.forward_funcs):
        idx = pipe._local_start + offset
        if isinstance(layer, torch.nn.Module) and layer.state_dict():
            load(layer, idx)
            n += 1
    for key, module in pipe.tied_modules.items():  # the head's copy on a stage without the embedding
        load(module, next(i for i, s in enumerate(pipe._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == key))
    return n


def _nan_fault(batches, start_step: int, gas: int):
    """Test hook: MMPIPE_FAULT=nan-batch:STEP turns the pixels of step STEP's micro-batches into
    NaN on the first stage, the way a corrupt batch would poison the loss. Unset in normal runs."""
    spec = os.environ.get("MMPIPE_FAULT", "")
    bad_step = int(spec.split(":")[1]) if spec.startswith("nan-batch:") else None
    for k, (inputs, labels) in enumerate(batches):
        if inputs is not None and bad_step is not None and start_step + k // gas + 1 == bad_step:
            inputs = (inputs[0] * float("nan"), *inputs[1:])
        yield inputs, labels


def _truncate_logs(out: Path, step: int, position: int) -> None:
    """A run that died after its last checkpoint logged steps (and samples) that the resumed run
    does again: drop them, so each step and position appears once."""
    for path, keep in [(out / "train_log.csv", lambda r: int(r["step"]) <= step)] + [
            (p, lambda r: int(r["position"]) < position) for p in sorted(out.glob("samples_dp*.csv"))]:
        if not path.is_file():
            continue
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows, fields = [r for r in reader if keep(r)], reader.fieldnames
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fields)
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    preempt = Preemption()  # before anything slow: a signal during start-up stops at the first step
    ranks_from_slurm(os.environ)
    try:
        run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return fail(e)
    return train(args, run, preempt)


if __name__ == "__main__":
    sys.exit(main())
