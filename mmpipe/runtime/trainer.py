"""One rank's training run: build the engine, restore, loop, save, report (`train`, one screen).

Each rank builds its stage of the VLMPipeline and pulls micro-batches from a deterministic stream:
every stage of a pipeline draws the same micro-batches (only the first decodes images, only the last
builds labels; the others take the integer tensors, mmpipe.runtime.wire), data-parallel replicas draw
disjoint ones. The pieces around the loop are named here:
`build_engine`, `restore`, `DataStream`, `run_step`, `save`, `requeue`, `report`.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import TiedLayerSpec
from tqdm import tqdm

from ..cluster.hostfile import rank_threads
from ..cluster.preempt import EXIT_REQUEUE, MARKER, Preemption
from ..config import REGION_FILE, ConfigError, fail
from ..data.balance import describe_balance
from ..data.batches import StepBatches, rank_batches
from ..data.dataset import prepare, prepare_eval
from ..data.index import describe as describe_data
from ..data.tokenizer import BUILTIN_TEMPLATE
from ..model.lora import LORA_FILE, load_base
from ..planning.partition import describe as describe_parts
from ..run_args import TrainArgs
from ..run_config import RunConfig
from . import checkpoint, reshard, rng
from .curves import plot_runs
from .experts import deepspeed_moe
from .experts import install as install_experts
from .feed import StepCounts, decoder_length, run_dataset, step_order
from .guard import install_skip
from .pipeline import pipeline_class
from .precision import check_all_ranks
from .precomputed import PrecomputedReference
from .preference import LiveReference
from .schedule import install as install_schedule
from .steplog import StepLog, data_counts
from .teardown import end_of_run, error_fault, on_exit
from .timing import gather_stage_report, instrument, pipeline_summary
from .validation import Validator

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Progress:
    """Where the run stands: restored from a checkpoint's run state, advanced per step."""
    step: int = 0  # optimizer steps done
    position: int = 0  # samples consumed from the data stream
    counters: dict = field(default_factory=lambda: {"skipped_steps": 0, "nonfinite_steps": 0})


def train(args: TrainArgs, run: RunConfig, preempt: Preemption | None = None,
          evaluate: Callable[[Path], dict] | None = None) -> int:
    """evaluate(ckpt_dir) -> summary fields, run by rank 0 after training (the shapes set's held-out accuracy)."""
    rank = join_process_group(run.precision)
    if rank is None:
        return 2
    out, ckpt_dir = Path(args.output_dir), Path(args.output_dir) / "checkpoints"
    prepare_output(out, run, rank)
    # the front door built the data index; ranks started without it build it themselves
    samples = prepare(run.data, run.model, out, args.seed, verbose=rank == 0)
    fingerprint = samples.index and samples.index.stats["fingerprint"]
    engine = build_engine(run, args, rank)
    # dpo: the reference's weights, the start's or --reference's, kept on each stage (mmpipe.runtime.preference)
    live = run.objective.reference and not run.reference_logps
    reference = LiveReference(engine, run, lambda m, d: load_run_weights(m, d, run.tp)) if live else None
    progress = restore(engine, run, args, ckpt_dir, fingerprint, rank)
    stream = DataStream(engine, run, args, samples, progress)
    if run.reference_logps:  # dpo's reference read from a file (mmpipe.runtime.precomputed): no reference pass
        reference = PrecomputedReference.for_stream(run, samples, args.seed, progress.position,
                                                    engine.grid.data_parallel_id, stream.plan, engine.is_last_stage())
    on_exit(stream.close)  # an error's exit path stops the loader's workers too (mmpipe.train's release)
    guard = install_skip(engine) if args.nonfinite == "skip" else None
    error_fault(engine)  # a test hook, inert unless MMPIPE_FAULT names it
    timer = instrument(engine, skip_steps=1)  # the first step allocates buffers and exchanges shapes
    positions = decoder_length(run)  # per row, pads included: e.g. 16 image + 12 text = 28
    log = StepLog(out, run.train_batch, positions, enabled=rank == 0, append=args.resume,
                  aux=run.experts is not None, logged=run.objective.logged)  # MoE: lm_loss and aux_loss
    counts = StepCounts(run, samples, stream.plan) if rank == 0 else None  # each step's samples, useful positions
    validate = make_validator(engine, run, args, out, rank, log.t_start,  # None without --eval-data
                              reference if live else None)  # dpo: the validation pairs' reference pass
    announce(run, rank)
    bar = tqdm(total=args.steps, initial=progress.step, disable=rank != 0, desc="train", dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30)  # a log file: occasional lines, not one per step
    start = Progress(progress.step, progress.position)
    for step in range(progress.step + 1, args.steps + 1):
        first_row = progress.position  # the step trains rows [first_row, first_row + micro x GAS x DP)
        lr = engine.get_lr()[0]  # the rate this step's update uses: DeepSpeed moves its schedule after the update
        batches = reference.step(stream.batches) if reference else stream.batches  # dpo: the reference pass first
        loss, dt, skipped = run_step(engine, batches, guard, progress, run.train_batch)
        dt += reference.seconds if reference else 0.0
        extra = {k: float(v) for k, v in (engine.agg_additional_losses or {}).items()}
        log.step(step, loss, dt, counts(first_row, run.train_batch) if counts else None, lr=lr, skipped=skipped,
                 loss_scale=engine.optimizer.loss_scale if run.precision == "fp16" else None,
                 aux_loss=extra.get("aux_loss") if run.experts is not None else None,
                 logged={k: extra[k] for k in run.objective.logged})
        if not math.isfinite(loss) and not skipped and run.precision != "fp16":  # fp16: the loss scaler's business
            report_nonfinite(step, loss, run, ckpt_dir, start, rank)
            return 3
        monitor_step(engine, log, rank)
        if validate and (step == args.steps or (args.eval_every and step % args.eval_every == 0)):
            monitor(engine, rank, [("Eval/Samples/eval_loss", validate(step))])
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.update(1)
        stop = preempt.agreed() if preempt else 0  # collective: every rank stops at the same step
        if step == args.steps or (args.save_every and step % args.save_every == 0) or stop:
            stream.flush()
            save(engine, run, args, ckpt_dir, step, fingerprint, progress)
        if stop and step < args.steps:
            bar.close()
            return requeue(preempt.name(stop), step, args, out, stream, rank)
    bar.close()
    stream.flush()
    stage_rows = gather_stage_report(engine, timer)  # collective; also every stage's layer files are on disk now
    train_time = log.elapsed()
    timing = pipeline_summary(stage_rows, run.gas, run.stages) if stage_rows and stage_rows[0].get("steps") else None
    monitor_timing(engine, stage_rows, timing, rank)  # before the process group goes: the monitors ask for ranks
    end_of_run(stream)  # loader workers stopped, barrier, groups destroyed (mmpipe.train's release joins gloo)
    if rank == 0:
        report(log, run, args, samples, Finished(start, progress, stage_rows, timing, train_time),
               (evaluate, validate, counts))
    return 0


def make_validator(engine, run: RunConfig, args: TrainArgs, out: Path, rank: int, t_start: float,
                   reference=None) -> Validator | None:
    if run.eval_data is None:
        return None
    evalset = prepare_eval(run.eval_data, run.model, out, args.seed, args.eval_samples, verbose=rank == 0)
    return Validator(engine, run, evalset, out, DTYPES[run.precision], enabled=rank == 0, append=args.resume,
                     t_start=t_start, reference=reference)


def monitor(engine, rank: int, events: list[tuple[str, float]]) -> None:
    """To DeepSpeed's own monitors (the config's tensorboard / csv_monitor / wandb sections), keyed by
    samples trained, as DeepSpeed keys its train_loss and lr."""
    if rank == 0 and engine.monitor.enabled:
        engine.monitor.write_events([(tag, value, engine.global_samples) for tag, value in events])


def monitor_step(engine, log: StepLog, rank: int) -> None:
    """Real samples/s, useful (non-padding) decoder positions/s and computed positions/s (mmpipe.runtime.steplog)."""
    if rank == 0 and engine.monitor.enabled:
        monitor(engine, rank, [(f"Train/Samples/{k}", v) for k, v in log.rates().items()])


def monitor_timing(engine, stage_rows, timing: dict | None, rank: int) -> None:
    """Per-stage forward / backward ms per micro-batch and the measured bubble, as gathered on rank 0."""
    if rank != 0 or timing is None:
        return
    events = [("Timing/measured_bubble", timing["measured_bubble"])]
    for i, r in enumerate(stage_rows):
        events += [(f"Timing/stage{i}/forward_ms_per_micro", r["forward_ms_per_micro"]),
                   (f"Timing/stage{i}/backward_ms_per_micro", r["backward_ms_per_micro"])]
    monitor(engine, rank, events)


def setup_torch() -> None:
    torch.set_num_threads(rank_threads(os.environ))  # 1 per rank on CPU: 2 ranks on 2 cores
    if get_accelerator().device_name() == "cpu":                         # ran 3x slower without it
        # the shared-memory all-reduce op only serves inference; skip its ~25 s JIT build
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def join_process_group(precision: str) -> int | None:
    """Every rank entry's start (training, `mmpipe check`, a bench DP variant): torch set up, the process
    group joined, each rank on its own device before any collective (NCCL needs it: else every rank of
    a node would use device 0), and every rank's precision support gathered. The rank, or None when a
    device cannot run `precision` (rank 0 printed why; exit 2)."""
    setup_torch()
    deepspeed.init_distributed()
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()
    return None if refuse_unsupported(precision, rank) else rank


def refuse_unsupported(precision: str, rank: int) -> bool:
    """Collective: True (rank 0 printed why) when any rank's device cannot run `precision`."""
    unsupported = check_all_ranks(precision)
    if unsupported:
        if rank == 0:
            fail(ConfigError(unsupported))
        dist.destroy_process_group()
    return bool(unsupported)


def prepare_output(out: Path, run: RunConfig, rank: int) -> None:
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "model.json").write_text(json.dumps(run.model.to_dict(), indent=2) + "\n")
        if run.init_from and (Path(run.init_from) / REGION_FILE).is_file():  # moondream's region head rides along
            shutil.copyfile(Path(run.init_from) / REGION_FILE, out / REGION_FILE)  # for `mmpipe export`
        tok = run.data.tokenizer
        if tok is not None and getattr(tok, "chat_template", None) != BUILTIN_TEMPLATE:  # a user's / an import's
            tok.save_pretrained(out / "tokenizer")  # RUN/tokenizer: what generate, eval and --init-from RUN read
        (out / LORA_FILE).unlink(missing_ok=True)
        if run.lora:  # how to rebuild the adapters for generate, eval and export
            (out / LORA_FILE).write_text(json.dumps(run.lora.to_dict(), indent=2) + "\n")
        (out / MARKER).unlink(missing_ok=True)  # an earlier preemption's, handled: not this run's
    dist.barrier()


def build_engine(run: RunConfig, args: TrainArgs, rank: int):
    pipe = pipeline_class(run.schedule)(run, seed=args.seed)  # the schedule's module: DualPipeV's is its own
    if run.init_from and (not args.resume or run.objective.reference):  # dpo: its reference is the start
        n = load_run_weights(pipe, Path(run.init_from) / "checkpoints", run.tp)
        if rank == 0:
            print(f"mmpipe: weights from {run.init_from} (stage 0: {n} layers); fresh optimizer", flush=True)
    moe = (deepspeed_moe(pipe.expert_shards, run.ep, pipe.expert_shards_group)  # bf16 --ep: DeepSpeed's MoE groups
           if pipe.expert_shards and run.precision == "bf16" else contextlib.nullcontext())
    with moe:
        engine, _, _, _ = deepspeed.initialize(
            model=pipe, config=run.ds_config, model_parameters=[p for p in pipe.parameters() if p.requires_grad])
    if type(engine).__name__ != run.schedule.engine:  # deepspeed.initialize picks the engine from the module's class
        raise RuntimeError(f"mmpipe: schedule {run.schedule} runs on DeepSpeed's {run.schedule.engine}, "
                           f"deepspeed.initialize returned a {type(engine).__name__}")
    checkpoint.make_loads_safe(engine)
    if pipe.expert_shards:  # --ep: shards reduced and clipped over their own groups, whole in checkpoints
        install_experts(engine, pipe.expert_shards, run.dp, pipe.expert_shards_group)
        per = pipe.expert_shards[0][0].shape[0]
        first = per * dist.get_rank(pipe.expert_shards_group)
        print(f"mmpipe: rank {rank}: experts {first}..{first + per - 1} of {run.model.text.moe.experts} in each MoE "
              f"block (--ep {run.ep})", flush=True)
    grad_fault(engine, run.gas)  # a test hook, inert unless MMPIPE_FAULT names it
    pipe.install_wire(engine)  # only floats cross a stage boundary; before `instrument` copies the instruction map
    zb = install_schedule(engine, run.schedule)  # collective unless native; before `instrument` copies the instr. map
    if zb and rank == 0:
        print(f"mmpipe: schedule {zb['schedule']}: stage 0 defers {zb['deferred_linears']} linears' weight gradients; "
              f"stages with W work {[i for i, w in enumerate(zb['weight_stages']) if w]}", flush=True)
    return engine


def restore(engine, run: RunConfig, args: TrainArgs, ckpt_dir: Path, fingerprint, rank: int) -> Progress:
    """Remove a half-written checkpoint; with --resume load the latest (weights, optimizer, schedule,
    data position, RNG) and trim logs written after it."""
    if rank == 0:
        for name in checkpoint.remove_partial(ckpt_dir) if ckpt_dir.is_dir() else []:
            print(f"mmpipe: removed {ckpt_dir / name}, a checkpoint whose save did not finish", flush=True)
    if not args.resume:
        return Progress()
    state, notes = checkpoint.resume(engine, ckpt_dir, run, fingerprint=fingerprint, rank=rank)
    progress = Progress(state["step"], state["samples"], {k: state.get(k, 0) for k in Progress().counters})
    if rank == 0:
        for note in notes:
            print(f"mmpipe: {note}", flush=True)
        if run.auto_schedule and state["total_steps"] != args.steps:
            print(f"mmpipe: warning: the LR schedule was laid out for {state['total_steps']} steps and now runs "
                  f"to {args.steps}; from step {progress.step + 1} it follows the {args.steps}-step curve "
                  f"(fix scheduler.params.total_num_steps in the config to keep one schedule)", flush=True)
        truncate_logs(Path(args.output_dir), progress.step, progress.position)
    dist.barrier()  # logs trimmed before anyone appends
    return progress


class DataStream:
    """This rank's micro-batches from `position` on, and with --log-samples the record of each."""

    def __init__(self, engine, run: RunConfig, args: TrainArgs, samples, progress: Progress):
        dp_rank, first, images = engine.grid.data_parallel_id, engine.is_first_stage(), engine.module.reads_images
        # every stage reads its micro-batches (a stage after the first: their integer tensors, runtime.wire)
        dataset = run_dataset(run, samples, first=images, last=engine.is_last_stage(),
                              augment_seed=args.seed if run.data.augment else None)
        self.samples, self.seen, self.plan = samples, None, dataset.plan
        if run.data.log_samples and first:
            self.seen = open(Path(args.output_dir) / f"samples_dp{dp_rank}.csv", "a" if args.resume else "w")
            if self.seen.tell() == 0:  # rows: the row's stream position, then each sample's and its record
                self.seen.write("position,sample,row\n" if self.plan else "position,row\n")
        order = step_order(run, samples, dataset.plan)  # --pack: the step's rows spread by cost (data.balance)
        batches = rank_batches(dataset, StepBatches(progress.position, run.micro, run.gas, dp_rank, run.dp, order),
                               workers=run.data.workers if images else 0, dtype=DTYPES[run.precision],
                               on_batch=self._log_seen if self.seen else None,
                               pin_memory=torch.device(engine.device).type == "cuda")
        self.batches = nan_fault(batches, progress.step, run.gas)

    def _log_seen(self, positions) -> None:
        if self.plan is None:
            self.seen.write("".join(f"{p},{self.samples.row(p)}\n" for p in positions.tolist()))
        else:
            self.seen.write("".join(f"{r},{p},{self.samples.row(p)}\n" for r in positions.tolist()
                                    for p in self.plan.row(r)))

    def flush(self) -> None:
        if self.seen:
            self.seen.flush()

    def close(self) -> None:
        """Closing the generator chain ends the DataLoader iterator and its worker processes now."""
        self.batches.close()
        if self.seen:
            self.seen.close()


def run_step(engine, batches, guard, progress: Progress, train_batch: int) -> tuple[float, float, str]:
    """One optimizer step: (loss, seconds, why its update was dropped: fp16_overflow, nonfinite or '')."""
    overflows, dropped = engine.skipped_steps, guard["nonfinite_steps"] if guard else 0
    t0 = time.perf_counter()
    loss = engine.train_batch(data_iter=batches).item()
    dt = time.perf_counter() - t0
    overflows = engine.skipped_steps - overflows  # fp16: the loss scaler skipped this step
    dropped = (guard["nonfinite_steps"] if guard else 0) - dropped  # --nonfinite skip dropped it
    progress.step += 1
    progress.position += train_batch  # micro x GAS x DP samples
    progress.counters["skipped_steps"] += overflows
    progress.counters["nonfinite_steps"] += dropped
    return loss, dt, "fp16_overflow" if overflows else "nonfinite" if dropped else ""


def save(engine, run: RunConfig, args: TrainArgs, ckpt_dir: Path, step: int, fingerprint, progress: Progress) -> None:
    state = checkpoint.run_state(engine, run, args, step, progress.position, fingerprint, progress.counters)
    checkpoint.save(engine, ckpt_dir, step, state, keep=args.keep_checkpoints, rank_state={"rng": rng.get_state()})


def report_nonfinite(step: int, loss: float, run: RunConfig, ckpt_dir: Path, start: Progress, rank: int) -> None:
    if rank != 0:
        return
    first = start.position + (step - start.step - 1) * run.train_batch  # this step's samples in the stream
    print(f"mmpipe: error: step {step}: the loss is {loss} ({run.precision}); stopping before any further "
          f"checkpoint, so `latest` ({checkpoint.latest_tag(ckpt_dir) or 'none'}) is the last good state. "
          f"Lower the LR, check the data at positions {first}..{first + run.train_batch - 1} (--log-samples), "
          f"or use --nonfinite skip", file=sys.stderr, flush=True)


def requeue(signal_name: str, step: int, args: TrainArgs, out: Path, stream: DataStream, rank: int) -> int:
    """A preemption signal: the checkpoint of `step` is saved; stop so the job can be requeued."""
    if rank == 0:
        print(f"mmpipe: {signal_name}: stopped after step {step} of {args.steps}, checkpoint "
              f"{out / 'checkpoints' / checkpoint.latest_tag(out / 'checkpoints')}; exit status {EXIT_REQUEUE} "
              f"(requeue me; run again with --resume)", flush=True)
        (out / MARKER).write_text(f"{signal_name} step {step}\n")
    end_of_run(stream)
    return EXIT_REQUEUE


def announce(run: RunConfig, rank: int) -> None:
    if rank == 0:  # micro x GAS x DP rows of decoder_length positions per optimizer step
        unit = (f"rows of {decoder_length(run)} positions{', packed' if run.pack else ''}, {run.max_images} image "
                f"slot(s) each")
        tp = (f" x tp {run.tp}" if run.tp > 1 else "") + (f" x sp {run.sp}" if run.sp > 1 else "")
        print(f"mmpipe: {run.model.name} in {run.stages} stages x dp {run.dp}{tp}; {run.micro} micro x {run.gas} GAS x "
              f"{run.dp} DP = {run.train_batch} {unit}/step; {run.precision}, ZeRO-{run.zero_stage}; "
              f"parts {run.parts}", flush=True)


class Finished(NamedTuple):
    """What a finished run has to report: where it started and where it ended, its stages' rows (gathered) and
    their timing, and its training wall time."""
    start: Progress
    progress: Progress
    stage_rows: list
    timing: dict | None
    train_time: float


def report(log: StepLog, run: RunConfig, args: TrainArgs, samples, done: Finished, hooks: tuple) -> None:
    """Rank 0, after training: summary.json (rates, layout, stage timing, data, evaluation). hooks: (the held-out
    evaluation or None, the validator or None, the step counts)."""
    evaluate, validate, counts = hooks
    start, progress, stage_rows, timing, train_time = done
    out = Path(args.output_dir)
    summary = {
        "start_step": start.step, "train_time_s": train_time, "stages": run.stages, "dp": run.dp, "tp": run.tp,
        "sp": run.sp, "micro_batch": run.micro, "gradient_accumulation": run.gas,
        "precision": run.precision, "zero_stage": run.zero_stage, "preset": run.model.name,
        "freeze": list(run.freeze), "parts": run.parts, "seed": args.seed, "ds_config": run.ds_config_path,
        **progress.counters, "partition": describe_parts(run.layers, run.parts),
        "lora": run.lora.to_dict() if run.lora else None,
    }
    if stage_rows:  # per stage, averaged over its replicas: what the optimizer really holds
        summary["optimizer_params"] = [int(r["optimizer_params"]) for r in stage_rows]
    if timing is not None:
        summary["stage_timing"] = timing
        print(f"mmpipe: per stage (ms per micro-batch) forward "
              f"{[round(r['forward_ms_per_micro'], 2) for r in stage_rows]}, backward "
              f"{[round(r['backward_ms_per_micro'], 2) for r in stage_rows]}; slowest/mean compute "
              f"{timing['max_over_mean']:.2f}; idle (bubble) {timing['measured_bubble']:.1%} measured, "
              f"{timing['theory_bubble']:.1%} in 1F1B theory", flush=True)
    # real samples and useful positions of every row trained: this process's steps (counted as they ran)
    # and, resumed, the rows before them; rows_seen = steps x micro x GAS x DP
    seen = log.seen(counts(0, start.position) if start.position else (0, 0), start.position)
    summary["data"] = {"name": run.data.name, "text_len": run.text_len, "max_images": run.max_images,
                       "pack": run.pack, **seen}
    balance = counts.unevenness(start.position, progress.position - start.position)  # None: unpacked rows
    if balance is not None:
        summary["data"]["balance"] = balance
        print(f"mmpipe: {describe_balance(balance, run.data.balance)}", flush=True)
    if not run.data.builtin:
        stats = samples.index.stats
        summary["data"].update(data_counts(stats),  # images and clips apart (clips: their own counts)
                               epochs=seen["samples_seen"] / len(samples.index),
                               bad_records_file=str(out / "data" / "bad_records.jsonl"))
        for line in describe_data(stats)[:1]:
            print(f"mmpipe: {line}", flush=True)
    if validate:
        validate.close()
        last = max(validate.losses)
        summary.update(eval_loss=validate.losses[last], eval_step=last, eval_samples_validated=validate.evalset.size,
                       eval_tokens=validate.tokens, eval_data=run.eval_data.name,
                       **{f"eval_{k}": v for k, v in validate.metrics[last].items()})  # dpo: the set's rewards
    if evaluate:
        torch.set_num_threads(os.cpu_count() or 1)  # the other ranks are done
        summary.update(evaluate(out / "checkpoints"))
    log.finish(steps=args.steps, **summary)
    plot_runs([out], out / "curves.png")
    print(f"mmpipe: done, summary in {out / 'summary.json'}, curves in {out / 'curves.png'}", flush=True)


def load_run_weights(pipe, ckpt_dir: Path, tp: int = 1) -> int:
    """--init-from: this stage's layers (and its copy of a tied module) from the latest checkpoint of
    another run, read per layer file (any stage count wrote them) as this rank's TP slice of it at the run's `tp`
    (mmpipe.runtime.reshard.layer_state: from files of any TP, memory-mapped, only this rank's rows copied; at TP 1 a
    --tp run's gathered): a rank opens only its own layers' files (tests/test_streaming_io.py counts them). A file's
    dtype need not be the run's: an import keeps its source's (bf16), and load_state_dict's copy casts (bf16 -> fp32
    exactly). Weights only: the optimizer and schedule start fresh. Returns the layers loaded."""
    d = ckpt_dir / checkpoint.latest_tag(ckpt_dir)
    rank = pipe._grid.get_slice_parallel_rank() if tp > 1 else 0

    def load(module, idx: int):
        whole = reshard.meta_layer(pipe._layer_specs[idx], idx)
        load_base(module, reshard.layer_state(d, idx, whole, rank, tp))  # adapters (LoRA) keep theirs

    n, loaded = 0, set()
    for _ in pipe.each_part():  # DualPipeV's rank holds two parts of the list (stage r and 2p - 1 - r), 1F1B one
        for offset, layer in enumerate(pipe.forward_funcs):
            if isinstance(layer, torch.nn.Module) and layer.state_dict() and id(layer) not in loaded:
                load(layer, pipe._local_start + offset)
                loaded.add(id(layer))
                n += 1
    for key, module in pipe.tied_modules.items():  # the head's copy on a stage without the embedding
        if id(module) in loaded:  # DeepSpeed lists the tied module on the stage that holds it too: read once
            continue
        load(module, next(i for i, s in enumerate(pipe._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == key))
    return n


def nan_fault(batches, start_step: int, gas: int):
    """Test hook: MMPIPE_FAULT=nan-batch:STEP turns the pixels of step STEP's micro-batches into
    NaN where they are loaded, the way a corrupt batch would poison the loss. Unset in normal runs."""
    spec = os.environ.get("MMPIPE_FAULT", "")
    bad_step = int(spec.split(":")[1]) if spec.startswith("nan-batch:") else None
    for k, (inputs, labels) in enumerate(batches):
        if inputs[0].is_floating_point() and bad_step is not None and start_step + k // gas + 1 == bad_step:
            inputs = (inputs[0] * float("nan"), *inputs[1:])
        yield inputs, labels


def grad_fault(engine, gas: int) -> None:
    """Test hook: MMPIPE_FAULT=grad-over-gas:STAGE scales stage STAGE's gradients by 1/GAS, the
    silent DeepSpeed pipeline + accumulation bug (#8152) `mmpipe check` must catch. Unset in normal runs."""
    spec = os.environ.get("MMPIPE_FAULT", "")
    if spec.startswith("grad-over-gas:") and engine.stage_id == int(spec.split(":")[1]):
        for p in engine.module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g / gas)


def truncate_logs(out: Path, step: int, position: int) -> None:
    """A run that died after its last checkpoint logged steps (and samples) that the resumed run
    does again: drop them, so each step and position appears once."""
    for path, keep in [(out / name, lambda r: int(r["step"]) <= step) for name in ("train_log.csv", "eval_log.csv")] + [
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

