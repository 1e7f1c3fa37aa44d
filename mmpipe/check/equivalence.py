"""Pipeline == single device, on the user's run: the model shrunk to at most 2 blocks per layer group
(`shrunk`), everything else the run's (micro-batch, GAS, DP, stages, schedule, precision, ZeRO,
freezing, LoRA, packing, data), trained STEPS steps through the trainer's own engine, stream and
hooks (`pipeline_side`) and through the single-device reference loop's pieces (`reference_side`).
Each step's loss and each stage's gradient norm are compared, relatively, against TOLERANCE[precision].

The gradient norm is what catches a gradient that is wrong by a constant factor on one stage (e.g.
1/GAS, DeepSpeed #8152): Adam nearly cancels such a factor, so the loss barely moves.

--objective dpo: both sides run the live reference, a frozen copy of the shrunk model's start (the pipeline's reference
pass through every stage before each step, mmpipe.runtime.preference; the loop's reference_rows), so a reference
that moved with the policy, or log-probs that reached the loss in the wrong rows, show in the losses from step 2 on
(step 1 is ln 2 on both sides whatever the reference). The run's --reference RUN and --reference-logps FILE are the
full model's, which the shrunk one cannot read: the check's reference is its own start instead."""
from __future__ import annotations

import dataclasses
import math
import time
from bisect import bisect_right

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule

from ..config import ConfigError, ModelConfig
from ..data.batches import micro_batch_indices, rank_batches
from ..data.dataset import prepare
from ..model.builder import ReferenceModel
from ..planning.partition import check_trainable, compute_parts, layer_table
from ..run_args import TrainArgs
from ..run_config import RunConfig
from ..runtime.feed import run_dataset, step_order
from ..runtime.preference import LiveReference, reference_model, reference_rows
from ..runtime.reference import accumulate, clip_and_step, gradient_clipping, make_optimizer, make_scheduler
from ..runtime.trainer import DataStream, Progress, build_engine

STEPS = 3
MAX_BLOCKS = 2
# largest relative difference allowed (loss, gradient norm): fp32 is summation order only; bf16 / fp16
# pipelines are compared with the fp32 reference, so their rounding counts too
TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 3e-2), "fp16": (1e-2, 3e-2)}


def shrunk(cfg: ModelConfig, blocks: int) -> ModelConfig:
    """Every layer group with n_layers (the vision tower, the decoder) cut to at most `blocks` blocks;
    block index lists of the group (Qwen2.5-VL's full-attention blocks among windowed ones, Qwen3-VL's DeepStack
    taps) keep the indices that remain, or the last block when none does, so each kind of block still runs (a
    DeepStack set still crosses the cut). Validated."""
    changes = {}
    for f in dataclasses.fields(cfg):
        sub = getattr(cfg, f.name)
        if dataclasses.is_dataclass(sub) and hasattr(sub, "n_layers") and sub.n_layers > blocks:
            kept = {g.name: tuple(i for i in getattr(sub, g.name) if i < blocks) or (blocks - 1,)
                    for g in dataclasses.fields(sub)
                    if g.name.endswith(("_blocks", "_indexes")) and isinstance(getattr(sub, g.name), tuple)
                    and getattr(sub, g.name)}
            changes[f.name] = dataclasses.replace(sub, n_layers=blocks, **kept)
    small = dataclasses.replace(cfg, **changes)
    small.validate()
    return small


def shrunk_run(run: RunConfig, args: TrainArgs) -> RunConfig:
    """The run with its model shrunk: at most MAX_BLOCKS blocks per group, more only where the run has
    more stages than the shrunk model could fill. Random weights (no --init-from: its layer files are
    the full model's). Raises ConfigError when no shrunk model splits into the run's stages."""
    checkpointing = int(run.ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0) or 0) > 0
    method = str(args.partition or run.ds_config.get("pipeline", {}).get("partition", "best"))
    method = "balanced" if method[:1].isdigit() else method  # explicit boundaries name the full model's layers
    blocks, problem = MAX_BLOCKS, None
    while True:
        try:  # a shrunk config its family's checks refuse tries more blocks too (Gemma 4's last kv_shared_layers
            # layers need an earlier producer of each attention type: gemma4-tiny's 2 shared of 5 need all 5)
            model = shrunk(run.model, blocks)
            table = layer_table(model, run.freeze, run.text_len, checkpointing, run.lora, run.max_images)
            parts = compute_parts(table, run.stages, method)
            check_trainable(table, parts)
            # dpo: the reference is the shrunk start's (RUN's files and FILE's log-probs are the full model's)
            return dataclasses.replace(run, model=model, layers=table, parts=parts, init_from=None, reference=None,
                                       reference_logps=None)
        except ConfigError as e:
            problem = e
        if shrunk_all(run.model, blocks):
            raise problem
        blocks += 1


def shrunk_all(cfg: ModelConfig, blocks: int) -> bool:
    """Whether `blocks` blocks a group already keeps every block of every group (shrinking cuts nothing)."""
    return all(getattr(cfg, f.name).n_layers <= blocks for f in dataclasses.fields(cfg)
               if dataclasses.is_dataclass(getattr(cfg, f.name)) and hasattr(getattr(cfg, f.name), "n_layers"))


def _stage_sq(module: torch.nn.Module, readable: bool) -> float | None:
    """This rank's share of its stage's squared gradient norm: each parameter once (not a tied weight's
    pipe-replicated copy; on the model axis its TP slices, and a replicated weight on model rank 0 only; under --sp
    all of these on SP rank 0 only: mark_norm_counting's marks, which VLMPipeline clears on SP ranks > 0).
    readable: the reduced gradients are in p.grad (fp32 without ZeRO); a bf16 optimizer keeps them in its own fp32
    buffers and ZeRO-1 in its partitions, where p.grad may hold this replica's unreduced ones: None."""
    if not readable:
        return None
    grads = [p.grad for p in module.parameters() if p.requires_grad and getattr(p, "model_parallel", True)]
    if any(g is None for g in grads):
        return None
    return float(sum(g.detach().float().pow(2).sum() for g in grads))  # 0 where none counts here (--sp rank 1)


def pipeline_side(run: RunConfig, args: TrainArgs, rank: int) -> list[dict]:
    """Collective: STEPS steps of the shrunk run through the trainer's engine (its fault hooks too).
    Per step: the loss, this stage's squared gradient norm before the optimizer step and the global norm
    DeepSpeed reports (where its optimizer computes one)."""
    engine = build_engine(run, args, rank)
    reference = LiveReference(engine, run) if run.objective.reference else None  # dpo: the start, frozen
    samples = prepare(run.data, run.model, args.output_dir, args.seed, verbose=False)
    stream = DataStream(engine, run, args, samples, Progress())
    seen, imap = [], dict(engine._INSTRUCTION_MAP)
    step_fn = imap[ds_schedule.OptimizerStep]

    def optimizer_step(self, *a, **kw):
        sq = _stage_sq(self.module, run.precision == "fp32" and run.zero_stage == 0)
        out = step_fn(self, *a, **kw)
        norm = self.get_global_grad_norm()  # a tensor or a float, where the optimizer computes one
        seen.append({"stage_sq": sq, "global_norm": None if norm is None else float(norm)})
        return out
    imap[ds_schedule.OptimizerStep] = optimizer_step
    engine.__dict__["_INSTRUCTION_MAP"] = imap
    for _ in range(STEPS):  # one OptimizerStep per train_batch
        t0 = time.perf_counter()
        batches = reference.step(stream.batches) if reference else stream.batches  # dpo: the reference pass first
        loss = engine.train_batch(data_iter=batches).item()
        seen[-1].update(loss=loss, seconds=time.perf_counter() - t0)
    stream.close()
    at = engine.grid._topo.get_coord(engine.global_rank)  # the grid's coordinate: --sp's 'seq', --tp's 'model'
    seq, model = getattr(at, "seq", 0), getattr(at, "model", 0)
    return [dict(s, stage=engine.stage_id, dp=engine.grid.data_parallel_id, seq=seq, model=model) for s in seen]


class AllReplicas:
    """The batch sampler of every DP replica's micro-batches of a step, one after another: what one
    device sees when it trains the whole step (GAS x DP micro-batches)."""

    def __init__(self, run: RunConfig, order=None):
        """order: the pipeline's row layout (runtime.feed.step_order), so each replica's micro-batches are its."""
        self.run, self.order = run, order

    def __iter__(self):
        step = 0
        while True:
            for d in range(self.run.dp):
                yield from micro_batch_indices(step, self.run.micro, self.run.gas, d, self.run.dp, order=self.order)
            step += 1


def _to(x, dev: torch.device):
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, dev) for v in x)
    return x.to(dev) if isinstance(x, torch.Tensor) else x


def reference_side(run: RunConfig, seed: int, out_dir: str, dev: torch.device) -> list[dict]:
    """STEPS steps of the shrunk run on one device in fp32 (mmpipe.runtime.reference's step, GAS x DP
    micro-batches per step): per step the loss and each stage's squared gradient norm before clipping."""
    model = ReferenceModel(run.model, seed=seed, freeze=run.freeze, lora=run.lora).to(dev)
    ref_model = reference_model(run, model) if run.objective.reference else None  # dpo: a frozen copy of the start
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(run.ds_config, params)
    sched, clip = make_scheduler(run.ds_config, opt), gradient_clipping(run.ds_config)
    stage_of = {}
    for i, layer in enumerate(model):  # a tied weight counts on the first stage that holds it, as in the pipeline
        for p in layer.parameters():
            stage_of.setdefault(id(p), bisect_right(run.parts, i) - 1)
    samples = prepare(run.data, run.model, out_dir, seed, verbose=False)
    data = run_dataset(run, samples, augment_seed=seed if run.data.augment else None)
    batches = rank_batches(data, AllReplicas(run, step_order(run, samples, data.plan)))
    model.train()

    def micro_loss():
        inputs, labels = _to(next(batches), dev)
        if ref_model is not None:  # (labels, ref_logps[, segments]), as the reference pass hands the last stage
            labels = reference_rows(ref_model, inputs, labels, run.objective, run.pack)
        return run.objective.loss(model(*inputs), labels)
    steps = []
    for _ in range(STEPS):
        loss = accumulate(micro_loss, run.gas * run.dp)
        sq = [0.0] * run.stages
        for p in params:
            if p.grad is not None:
                sq[stage_of[id(p)]] += float(p.grad.detach().float().pow(2).sum())
        clip_and_step(params, opt, sched, clip)
        steps.append({"loss": loss, "stage_sq": sq})
    return steps


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a) else math.inf


def _replica0(pipe: list[list[dict]]) -> dict[int, list[dict]]:
    """Data-parallel replica 0's rows per stage, its SP x TP ranks (--sp / --tp, either or both) in one: the loss
    (SP 0, TP 0)'s (every rank of a stage reports the same: the vocab-parallel loss and --sp's are all-reduced), the
    stage's squared gradient norm the sum of its SP x TP ranks' (on SP rank 0 each TP rank counts its TP slices and
    TP rank 0 a replicated weight, SP ranks > 0 nothing: mark_norm_counting's marks, which _stage_sq reads, DeepSpeed's
    'tensor rank' seq x TP + model; None where one rank's was not readable). E.g. PP 1 x SP 2 x TP 2: ranks 0 and 1
    (SP 0) count, 2 and 3 add 0."""
    ranks: dict[int, list[list[dict]]] = {}
    for rows in sorted((r for r in pipe if r and r[0]["dp"] == 0), key=lambda r: (r[0]["seq"], r[0]["model"])):
        ranks.setdefault(rows[0]["stage"], []).append(rows)
    out = {}
    for stage, models in ranks.items():
        steps = []
        for k, first in enumerate(models[0]):
            sq = [m[k]["stage_sq"] for m in models]
            steps.append(dict(first, stage_sq=None if None in sq else sum(sq)))
        out[stage] = steps
    return out


def judge(run: RunConfig, pipe: list[list[dict]], ref: list[dict]) -> dict:
    """pipe: every rank's pipeline_side rows. The largest relative loss and gradient-norm differences;
    per stage where every stage's gradients were readable, else on DeepSpeed's global norm."""
    tol_loss, tol_grad = TOLERANCE[run.precision]
    replica0 = _replica0(pipe)
    loss_diff, grads = 0.0, []
    for k, want in enumerate(ref):
        loss_diff = max(loss_diff, _rel(replica0[0][k]["loss"], want["loss"]))
        got_sq = [replica0[s][k]["stage_sq"] for s in range(run.stages)]
        if all(g is not None for g in got_sq):
            pairs = [(f"stage {s}", math.sqrt(g), math.sqrt(w))
                     for s, (g, w) in enumerate(zip(got_sq, want["stage_sq"]))]
        elif replica0[0][k]["global_norm"] is not None:
            pairs = [("global", replica0[0][k]["global_norm"], math.sqrt(sum(want["stage_sq"])))]
        else:  # an optimizer that reports no norm: the losses alone are compared
            pairs = []
        grads += [(_rel(g, w), k + 1, where, g, w) for where, g, w in pairs]
    grad_diff, step, where, g, w = max(grads, key=lambda t: t[0]) if grads else (0.0, None, "not compared", None, None)
    ok = loss_diff <= tol_loss and grad_diff <= tol_grad
    later = [s["seconds"] for s in replica0[0][1:]]  # the first step allocates and exchanges shapes
    return {"ok": ok, "steps": len(ref), "blocks": _blocks(run.model), "max_loss_rel_diff": loss_diff,
            "max_grad_norm_rel_diff": grad_diff, "tolerance": {"loss": tol_loss, "grad_norm": tol_grad},
            "worst_grad_norm": {"step": step, "where": where, "pipeline": g, "reference": w},
            "losses": {"pipeline": [s["loss"] for s in replica0[0]], "reference": [s["loss"] for s in ref]},
            "pipeline_rows_per_s": run.micro * run.gas * len(later) / sum(later)}


def _blocks(cfg: ModelConfig) -> dict:
    return {f.name: getattr(cfg, f.name).n_layers for f in dataclasses.fields(cfg)
            if hasattr(getattr(cfg, f.name), "n_layers")}


def check(run: RunConfig, args: TrainArgs, rank: int, dev: torch.device) -> dict | None:
    """Collective; the result on rank 0 (None elsewhere)."""
    try:
        small = shrunk_run(run, args)
    except ConfigError as e:
        return {"ok": False, "error": f"no shrunk model splits into {run.stages} stages: {e}"} if rank == 0 else None
    rows = pipeline_side(small, args, rank)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    result = judge(small, every, reference_side(small, args.seed, args.output_dir, dev)) if rank == 0 else None
    if result is not None:
        result["full_model"] = small.model == run.model  # the run's model had no more blocks to cut
    dist.barrier()
    return result
