"""Everything one run needs, resolved and checked before any process group exists.

`resolve(args, world_size, ds_config)` reads the DeepSpeed JSON (or takes it as a dict), the preset
and the TrainArgs, and either returns a RunConfig or raises ConfigError listing every problem, one
line each, naming the field and what would be valid. It changes none of its inputs. The front door
(`mmpipe train`), every rank (`python -m mmpipe.train`), `mmpipe slurm` and `mmpipe bench` call it,
so a bad run is refused with exit status 2 before anything is launched.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, ModelConfig, config_from_dict, load_preset, read_json
from .data.dataset import DataOptions, packed_image_slots, resolve_data
from .data.image_kinds import image_kind
from .data.preference import preference_problems, reference_problems
from .data.sources import data_spec
from .data.tokenizer import IMAGE_TOKEN, add_image_token
from .model.attention import attention_choice
from .model.builder import check_lora_rank
from .model.lora import Lora, read_lora
from .model.objectives import TOKENS, Objective, objective_named, run_objective
from .model.tensor_parallel import tp_sizes
from .planning.costmodel import LayerCost
from .planning.partition import check_trainable, compute_parts, layer_table
from .planning.schedule_registry import BASELINE, SCHEDULE_NAMES, Schedule, schedule_named
from .planning.tensor_parallel import sequence_parallel_problems
from .registry import families, family_of
from .run_args import TrainArgs

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "ds_configs"
DEFAULT_DS_CONFIG = "cpu_fp32.json"


def _shipped(name: str | Path) -> Path | None:
    """ds_configs/NAME of a source checkout, else the copy `pip install .` put under
    <prefix>/share/mmpipe/ds_configs; None if neither has it."""
    for base in (REPO_CONFIGS, Path(sys.prefix) / "share" / "mmpipe" / "ds_configs"):
        if (base / name).is_file():
            return base / name
    return None


def default_ds_config() -> str:
    return str(_shipped(DEFAULT_DS_CONFIG) or REPO_CONFIGS / DEFAULT_DS_CONFIG)


def ds_config_path(args: TrainArgs) -> str:
    """--ds-config as given, else the default. A relative ds_configs/NAME that does not exist from the
    working directory is the shipped NAME, as the default is: the docs' `--ds-config
    ds_configs/zero1_bf16.json` works from any directory (a file of yours by that path comes first)."""
    if not args.ds_config:
        return default_ds_config()
    p = Path(args.ds_config)
    if p.exists() or p.is_absolute() or len(p.parts) < 2 or p.parts[0] != "ds_configs":
        return args.ds_config
    return str(_shipped(Path(*p.parts[1:])) or args.ds_config)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    ds_config: dict  # as handed to deepspeed.initialize, batch sizes filled in
    ds_config_path: str
    stages: int
    dp: int
    micro: int
    gas: int
    parts: list[int]
    layers: list[LayerCost]
    freeze: tuple[str, ...]
    precision: str
    zero_stage: int
    data: DataOptions
    auto_schedule: bool = False  # the scheduler's total_num_steps was "auto", i.e. --steps
    init_from: str | None = None  # a run directory whose latest checkpoint's weights start this run
    eval_data: DataOptions | None = None  # --eval-data: the validation set, read like the training data
    lora: Lora | None = None  # --lora: adapters on these groups' linears, their base frozen (mmpipe.model.lora)
    schedule: Schedule = BASELINE  # --schedule / pipeline.schedule: its record (planning.schedule_registry)
    pack: bool = False  # --pack: several samples per row (mmpipe.data.packing)
    loss_norm: str = "token"  # --loss-norm: one of mmpipe.data.packing.LOSS_NORMS
    ep: int = 1  # --ep: expert-parallel ranks (mmpipe.runtime.experts)
    objective: Objective = TOKENS  # --objective: what the last stage trains on (mmpipe.model.objectives)
    tp: int = 1  # --tp: tensor-parallel ranks per stage (mmpipe.model.tensor_parallel); world = stages x dp x tp
    sp: int = 1  # --sp: sequence-parallel ranks per stage, on the grid's model axis (mmpipe.model.sequence_parallel)
    sequence_parallel: bool = False  # --sequence-parallel: TP's, Megatron's (mmpipe.model.tensor_parallel)
    reference: str | None = None  # --reference: the run directory whose weights are dpo's reference (else the start)
    reference_logps: str | None = None  # --reference-logps: dpo's reference log-probs read from this file

    @property
    def experts(self):
        """The model's mixture-of-experts section (None: dense), as its family answers it: the one signal for the
        auxiliary loss, the expert groups and the expert path."""
        return family_of(self.model).experts(self.model)

    @property
    def text_len(self) -> int:
        return self.data.text_len

    @property
    def max_images(self) -> int:
        return self.data.max_images

    @property
    def train_batch(self) -> int:
        return self.micro * self.gas * self.dp


def _load_json(path: str) -> dict:
    data = read_json(path, f"--ds-config: {path}", "file not found")
    if not isinstance(data, dict):
        raise ConfigError(f"--ds-config: {path} must hold a JSON object")
    return data


def _batch_sizes(ds: dict, dp: int) -> tuple[int, int]:
    """DeepSpeed's rule: train_batch_size = micro x GAS x DP; any two of the three fix the third."""
    tb, micro, gas = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu"), ds.get(
        "gradient_accumulation_steps")
    for key, val in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", micro),
                     ("gradient_accumulation_steps", gas)):
        if val is not None and (not isinstance(val, int) or val < 1):
            raise ConfigError(f"{key}: {val!r} must be a positive integer")
    if micro is None and tb is None:
        raise ConfigError("train_micro_batch_size_per_gpu: missing (set it, or train_batch_size)")
    if micro is None:
        gas = gas or 1
        if tb % (gas * dp):
            raise ConfigError(f"train_batch_size: {tb} is not divisible by gradient_accumulation_steps {gas} x dp {dp}")
        micro = tb // (gas * dp)
    if gas is None:
        if tb is None:
            gas = 1
        elif tb % (micro * dp):
            raise ConfigError(f"train_batch_size: {tb} is not divisible by micro {micro} x dp {dp}")
        else:
            gas = tb // (micro * dp)
    if tb is not None and tb != micro * gas * dp:
        raise ConfigError(f"train_batch_size: {tb} != train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {gas} x dp {dp} = {micro * gas * dp}")
    return micro, gas


def _stages(args: TrainArgs, ds: dict) -> int:
    """--stages, else the config's pipeline.stages, where "auto" (DeepSpeed's default) means 2."""
    stages = args.stages if args.stages is not None else ds.get("pipeline", {}).get("stages", "auto")
    stages = 2 if stages == "auto" else stages
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"--stages: {stages!r} must be a positive integer")
    return stages


def requested_stages(args: TrainArgs) -> int:
    """The stage count a launch needs processes for (stages x dp), before the full check."""
    return _stages(args, _load_json(ds_config_path(args)))


def config_dp(args: TrainArgs) -> int:
    """The data-parallel degree the DeepSpeed config fixes when it gives all three batch sizes
    (train_batch_size / (micro x GAS), as `mmpipe plan --write-config` writes them), else 1: what a
    local launch without --dp runs. A config whose sizes do not divide is left to resolve's check."""
    ds = _load_json(ds_config_path(args))
    tb, micro, gas = (ds.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    if all(isinstance(v, int) and v > 0 for v in (tb, micro, gas)) and tb % (micro * gas) == 0:
        return tb // (micro * gas)
    return 1


class Problems(list):
    """Every problem of a run, collected so the user sees them all at once, one line each."""

    def attempt(self, fn, *a):
        try:
            return fn(*a)
        except ConfigError as e:
            self.append(str(e))
            return None

    def raise_any(self) -> None:
        if self:
            raise ConfigError("\n".join(self))


def _schedule(args: TrainArgs, pipe_cfg: dict, problems: Problems) -> Schedule:
    """--schedule, else the DeepSpeed JSON's pipeline.schedule, else 1F1B, as its record; a name not
    registered is a problem."""
    name = args.schedule or pipe_cfg.get("schedule", BASELINE.name)
    try:
        return schedule_named(name)
    except ValueError:
        where = "--schedule" if args.schedule else "pipeline.schedule"
        problems.append(f"{where}: {name!r} is not a schedule (valid: {', '.join(SCHEDULE_NAMES)})")
        return BASELINE


def resolve(args: TrainArgs, world_size: int, ds_config: dict | None = None) -> RunConfig:
    """ds_config: the DeepSpeed JSON as a dict (copied, never changed); None reads args.ds_config."""
    problems = Problems()
    ds_path = ds_config_path(args)
    ds = copy.deepcopy(ds_config) if ds_config is not None else problems.attempt(_load_json, ds_path)
    model, run_tok = _model(args, problems)
    data = problems.attempt(resolve_data, args, model, run_tok)
    eval_data = _eval_data(args, data, problems)
    if data is not None and args.eval_split and eval_data is not None:
        data = dataclasses.replace(data, holdout=args.eval_split, part="train")
    _check_flags(args, problems)
    problems.attempt(attention_choice)  # the ranks' MMPIPE_ATTENTION (mmpipe.model.attention)
    freeze = problems.attempt(args.frozen_groups) or ()
    lora = problems.attempt(args.adapters)
    if ds is None:
        problems.raise_any()

    pipe_cfg = ds.get("pipeline", {})
    stages = problems.attempt(_stages, args, ds) or 1
    schedule = _schedule(args, pipe_cfg, problems)
    tp = max(1, args.tp) * max(1, args.sp)  # the grid's model-axis ranks: TP's, or SP's (--sp with --tp: refused)
    if world_size % (stages * tp):
        per = f"{stages} stages x tp {tp}" if tp > 1 else f"{stages} stages"
        problems.append(f"--stages: world size {world_size} is not a multiple of {per} "
                        f"(data-parallel degree = world size / {'(stages x tp)' if tp > 1 else 'stages'})")
    dp = max(1, world_size // (stages * tp))
    zero_stage, precision = _check_ds(ds, args, problems)
    _check_ep(args, model, dp, ds, zero_stage, precision, problems)
    micro, gas = problems.attempt(_batch_sizes, ds, dp) or (1, 1)
    if objective_named(args.objective).pairs:  # --objective dpo: preference pairs, two rows each
        problems.extend(preference_problems(args, data, micro))
        data = data and dataclasses.replace(data, pairs=True)
        eval_data = eval_data and dataclasses.replace(eval_data, pairs=True)  # --eval-data: validation pairs
    parts, table = [], []
    if model is not None and data is not None:
        model = _fit_to_tokenizer(model, data, args.init_from, run_tok, problems)
        data = problems.attempt(packed_image_slots, data, model, args.output_dir, args.seed) or data  # --pack alone
        # the layer list's parts: a stage per rank, DualPipeV's V two (stage r and 2p - 1 - r on rank r)
        per_rank = Problems()
        parts, table = _partition(args, model, data, (freeze, lora, stages, pipe_cfg, schedule.stages_per_rank),
                                  per_rank)
        problems.extend(line if schedule.stages_per_rank == 1 else f"{line} (--schedule {schedule} cuts "
                        f"{schedule.stages_per_rank} x {stages} ranks = {stages * schedule.stages_per_rank} stages)"
                        for line in per_rank)
    problems.extend(schedule.problems(stages, gas, {
        "experts": model is not None and family_of(model).experts(model) is not None,
        "eval": bool(args.eval_data or args.eval_split)}))
    _check_tp(args, model, (zero_stage, precision, schedule, pipe_cfg), problems)  # the model as fitted (vocabulary)
    if args.sequence_parallel:
        problems.extend(sequence_parallel_problems(args.tp, model, data, args.lora))
    _check_sp(args, model, (zero_stage, precision, schedule, ds), problems)
    problems.extend(reference_problems(args, model, init_model))  # --reference RUN: the model as fitted, too
    problems.raise_any()

    auto_schedule = _fill(ds, args.steps, (micro, gas, dp), tp)
    if eval_data is not None:
        eval_data = dataclasses.replace(eval_data, tokenizer=data.tokenizer)  # as fitted above (LLaVA's <image>)
    return RunConfig(model=model, ds_config=ds, ds_config_path=ds_path, stages=stages, dp=dp, micro=micro, gas=gas,
                     parts=parts or [], layers=table, freeze=freeze, precision=precision, zero_stage=zero_stage,
                     data=data, auto_schedule=auto_schedule, init_from=args.init_from, eval_data=eval_data, lora=lora,
                     schedule=schedule, pack=args.pack, loss_norm=args.loss_norm, ep=args.ep,
                     objective=run_objective(args), tp=max(1, args.tp), sp=max(1, args.sp), reference=args.reference,
                     sequence_parallel=args.sequence_parallel,
                     reference_logps=args.reference_logps)


def _model(args: TrainArgs, problems: Problems) -> tuple[ModelConfig | None, str | None]:
    """(the model the run trains, the tokenizer directory of the run it starts from, if it has one): --init-from's
    model.json, else the preset, with --max-crops and --video-* applied."""
    run_tok = None
    if args.init_from:
        model = problems.attempt(init_model, args.init_from, args.preset)
        if model is not None and (Path(args.init_from) / "tokenizer").is_dir():
            run_tok = str(Path(args.init_from) / "tokenizer")  # written by `mmpipe import`
    else:
        model = problems.attempt(load_preset, args.preset or "small")
    if model is not None:
        model = problems.attempt(args.with_crops, model)
        model = problems.attempt(args.with_video, model) or model  # --video-*: the clip sampling (vision.video_*)
    return model, run_tok


def _partition(args: TrainArgs, model: ModelConfig, data: DataOptions, training: tuple, problems: Problems):
    """(stage boundaries, the layer cost table) of the run's rows; training: (freeze, lora, stages, the DeepSpeed
    JSON's pipeline section, the schedule's stages per rank: 2, DualPipeV's V, balances each rank's pair)."""
    freeze, lora, ranks, pipe_cfg, per_rank = training
    stages, v_ranks = ranks * per_rank, ranks if per_rank > 1 else 0
    checkpointing = int(pipe_cfg.get("activation_checkpoint_interval", 0) or 0) > 0
    # per row: --max-images image slots through the tower, M x N_dec + text_len decoder positions
    # (a dynamic-resolution family: its --max-patches P through the tower, 2 M + P / merge^2 + text_len)
    table = layer_table(model, freeze, data.text_len, checkpointing, lora, data.max_images,
                        data.vision_budget,  # the row's vision budget: P patches or T crops
                        # dpo: a sharing family's tower once a pair (runtime.feed.share_pair_images)
                        objective_named(args.objective).pairs)
    if lora is not None and not any(r.adapter_params for r in table):
        problems.append(f"--lora-targets: '{lora.targets}' matches no linear layer of the {','.join(lora.groups)} "
                        f"group(s) of {model.name}")
    problems.attempt(check_lora_rank, model, lora)
    parts = problems.attempt(compute_parts, table, stages, str(args.partition or pipe_cfg.get("partition", "best")),
                             None, v_ranks)
    if parts:
        problems.attempt(check_trainable, table, parts)
    return parts or [], table


def _fill(ds: dict, steps: int, batch: tuple[int, int, int], tp: int) -> bool:
    """The DeepSpeed JSON as the run uses it (a copy, changed in place): the batch sizes (micro, GAS, DP), an "auto"
    schedule's length (--steps: returns True) and, under TP, whole-output sends."""
    micro, gas, dp = batch
    sched = ds.get("scheduler", {}).get("params", {})
    auto_schedule = sched.get("total_num_steps") == "auto"
    if auto_schedule:  # as in DeepSpeed's HF integration: the run's length
        sched["total_num_steps"] = steps
    ds.update(train_batch_size=micro * gas * dp, train_micro_batch_size_per_gpu=micro,
              gradient_accumulation_steps=gas)
    if tp > 1:  # each TP rank sends its whole stage output to the same TP rank of the next stage (mmpipe's wire:
        # floats only), not DeepSpeed's 1/TP slice all-gathered by the receiver (pipe_partitioned, default True)
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    return auto_schedule


def _eval_data(args: TrainArgs, data: DataOptions | None, problems: Problems) -> DataOptions | None:
    """--eval-data: the training data's options (tokenizer, text length, image handling, bad-record
    policy) over another source; no augmentation, no sample log."""
    if args.eval_every < 0:
        problems.append(f"--eval-every: {args.eval_every} must be >= 0 (0: validate only at the end)")
    if args.eval_split:
        return _eval_split(args, data, problems)
    if args.eval_data is None:
        if args.eval_every:
            problems.append("--eval-every: there is nothing to validate on; give --eval-data or --eval-split")
        return None
    if data is None:
        return None
    if (args.eval_data == "shapes") != data.builtin:
        problems.append(f"--eval-data: {args.eval_data!r} and --data {data.name!r}: the built-in shapes set "
                        f"validates only a run on the shapes set (they share its tokenizer); give a file of your own")
        return None
    if args.eval_data == "shapes":
        if args.eval_samples < 1:
            problems.append("--eval-samples: the validation set of --eval-data shapes needs at least 1 sample")
        return dataclasses.replace(data, augment=False, log_samples=False)
    try:
        spec = data_spec(args.eval_data, args.image_root)
    except ConfigError as e:  # the same checks as --data's, under this flag's name
        problems.append(str(e).replace("--data:", "--eval-data:", 1))
        return None
    return dataclasses.replace(data, name=args.eval_data, spec=spec, augment=False, log_samples=False)


def _eval_split(args: TrainArgs, data: DataOptions | None, problems: Problems) -> DataOptions | None:
    if not 0 < args.eval_split < 1:
        problems.append(f"--eval-split: {args.eval_split} must be a fraction between 0 and 1")
    elif args.eval_data is not None:
        problems.append("--eval-split / --eval-data: give one (a held-out part of --data, or another file)")
    elif data is not None and data.builtin:
        problems.append("--eval-split: the built-in shapes set has a held-out split of its own: --eval-data shapes")
    elif data is not None:
        return dataclasses.replace(data, holdout=args.eval_split, part="heldout", augment=False, log_samples=False)
    return None


def _check_ep(args: TrainArgs, model, dp: int, ds: dict, zero_stage: int, precision: str, problems: Problems) -> None:
    """--ep N (docs/moe.md): N >= 1; above 1 only for an MoE model whose experts and DP it divides, and only where the
    expert shards' gradients and optimizer states are handled (mmpipe.runtime.experts): fp32 at ZeRO 0 (mmpipe's
    reduction and clip) and bf16 at ZeRO 0, or 1 with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer with its
    MoE parameter groups). fp16, fp32 at ZeRO 1 and bf16 at ZeRO 1 accumulating in bf16 go through DeepSpeed's ZeRO
    optimizer, whose MoE groups mmpipe's shards do not join yet."""
    ep, moe = args.ep, family_of(model).experts(model) if model is not None else None
    if ep < 1:
        problems.append(f"--ep: {ep} must be >= 1")
    if ep <= 1 or model is None:
        return
    if moe is None:
        problems.append(f"--ep: {ep} on {model.name}, a dense model (no text.moe): expert parallelism splits experts")
        return
    if dp % ep:
        problems.append(f"--ep: {ep} does not divide the {dp} data-parallel replicas (world size / stages)")
    if moe.experts % ep:
        problems.append(f"--ep: {ep} does not divide {model.name}'s {moe.experts} experts")
    if not (precision == "bf16" or (precision == "fp32" and zero_stage == 0)):
        problems.append(f"--ep: {ep} runs in bf16 (ZeRO 0 or 1) or in fp32 at zero_optimization.stage 0 for now "
                        f"(here: {precision}, ZeRO {zero_stage}; docs/moe.md)")
    elif precision == "bf16" and zero_stage == 1 and _grad_accum_dtype(ds) not in ("fp32", "float32", "float"):
        # DeepSpeed 0.19.8 (engine._do_optimizer_sanity_check) takes BF16_Optimizer at ZeRO 1 only with fp32
        # gradient accumulation; otherwise its ZeRO optimizer, the path fp32 ZeRO 1 is refused on above
        problems.append(f"--ep: {ep} in bf16 at ZeRO 1 needs \"data_types\": {{\"grad_accum_dtype\": \"fp32\"}} in "
                        "the DeepSpeed config (DeepSpeed then takes its BF16_Optimizer, whose MoE groups the expert "
                        "shards join; its ZeRO optimizer's are not checked yet; docs/moe.md)")


def _grad_accum_dtype(ds: dict) -> str:
    return str((ds.get("data_types") or {}).get("grad_accum_dtype", "")).lower()


def _check_tp(args: TrainArgs, model, setup: tuple, problems: Problems) -> None:
    """--tp N (docs/tensor_parallel.md): N >= 1; above 1 only for a family with a tensor-parallel plan whose text
    sizes N divides (heads and KV heads whole on a rank, or kv heads a divisor of N; equal vocabulary and FFN
    slices; an MoE model's expert FFN widths, the plan's SIZES), and only where it was checked: fp32 at ZeRO 0 or 1
    (so --ep takes its fp32 path), bf16 at ZeRO 0 or 1 (DeepSpeed's BF16_Optimizer: the TP sum acts on its buffers,
    tests/test_tensor_parallel.py; an MoE model's expert groups under --ep clip by the norm of every TP slice,
    tests/test_tp_moe_bf16.py), 1F1B, zb-h1 in fp32 on a dense model with the SFT objective (its deferred weight
    gradients around the split linears' collectives: tests/test_tp_zero_bubble.py), with activation checkpointing, LoRA
    (its dropout masks each rank's slice of the single device's: lora.SplitDropout, tests/test_lora_dropout_split.py)
    and validation (tests/test_tp_combos.py), --init-from (each rank reads its slices: tests/test_tp_import.py); each
    combination not checked refused with its reason in one line."""
    tp, (_, precision, schedule, _) = args.tp, setup  # ZeRO 0 or 1 and checkpointing: all checked
    if tp < 1:
        problems.append(f"--tp: {tp} must be >= 1")
    if tp <= 1 or model is None:
        return
    if not family_of(model).tp_plan:
        have = ", ".join(sorted(f.family for f in families() if f.tp_plan))
        problems.append(f"--tp: {tp} on {model.name}: the {family_of(model).label} family has no tensor-parallel "
                        f"plan yet (mmpipe.registry.Family.tp_plan; {have} have one)")
        return
    t = model.text
    for what, n in (("attention heads (text.n_heads)", t.n_heads), ("vocabulary (text.vocab_size)", t.vocab_size),
                    ("FFN width (text.ff_dim)", t.ff_dim), *tp_sizes(model, family_of(model).tp_plan)):
        if n % tp:
            problems.append(f"--tp: {tp} does not divide {model.name}'s {n} {what}")
    if t.kv_heads % tp and tp % t.kv_heads:  # fewer kv heads than ranks: each rank keeps the one its queries read
        problems.append(f"--tp: {tp} does not divide {model.name}'s {t.kv_heads} KV heads (text.n_kv_heads) and is "
                        f"not a multiple of them")
    for why, on in (
            ("precision fp16 is not supported yet: DeepSpeed's fp16 ZeRO-1 optimizer under TP (its loss scaler's "
             "overflow vote, its norm) is not checked against a reference: this CPU has no fp16 kernels",
             precision == "fp16"),
            (f"schedule {schedule} and precision {precision} is not supported yet: its deferred weight gradients "
             f"under TP are checked in fp32 only", schedule.split_backward and precision != "fp32"),
            (f"schedule {schedule} on an MoE model is not supported yet: its deferred weight gradients under TP are "
             f"checked on dense models only", schedule.split_backward and family_of(model).experts(model) is not None),
            (f"schedule {schedule} and --objective {args.objective} is not supported yet: its deferred weight "
             f"gradients under TP are checked with sft only",
             schedule.split_backward and objective_named(args.objective).name != TOKENS.name),
            (f"schedule {schedule} is not supported yet: only 1F1B and zb-h1 are checked under TP",
             not schedule.split_backward and schedule.name != BASELINE.name)):
        if on:
            problems.append(f"--tp: {tp} with {why} (docs/tensor_parallel.md)")
    if objective_named(args.objective).vocab_parallel is None:
        problems.append(f"--tp: objective {args.objective} has no vocab-parallel loss yet")


def _check_sp(args: TrainArgs, model, setup: tuple, problems: Problems) -> None:
    """--sp N (docs/sequence_parallel.md): N >= 1; above 1 only for a family whose decoder this slice splits (LLaVA,
    Qwen2-VL / Qwen2.5-VL, Qwen3-VL, Qwen3.5), N dividing the attention heads and KV heads (and Gated DeltaNet's key
    and value heads: each rank runs H/N of them after the all-to-all; a row's positions are padded to a multiple of N),
    and only where it was checked: fp32 at ZeRO 0 or 1, bf16 at ZeRO 0 or 1 with fp32 gradient accumulation
    (DeepSpeed's BF16_Optimizer either way: the SP sum acts on its buffers), 1F1B, zb-h1 in fp32 on a dense model with
    SFT (tests/test_sp_zero_bubble.py; with --tp by hand), SFT and dpo (an objective with an SP
    form: Objective.split_sequence), validation, --init-from (tests/test_sp_objectives.py; --resume, at this or
    another SP, MoE with --ep, --tp, LoRA (its dropout on the text: each rank's slice of the mask) and activation
    checkpointing are checked). With --tp T the
    all-to-all trades the heads each TP rank holds, so N divides H / T (and the plan's counts / T); the KV heads a TP
    rank holds (Hkv / T, or the 1 it uses where T exceeds Hkv) are divided by N or, under --tp, divide it (each then
    repeated N / Hkv times before the exchange: sequence_parallel.kv_for_sp)."""
    sp, (zero_stage, precision, schedule, ds) = args.sp, setup
    if sp < 1:
        problems.append(f"--sp: {sp} must be >= 1")
    if sp <= 1 or model is None:
        return
    family = family_of(model)
    if not family.sp_plan:  # mmpipe.registry.Family.sp_plan: the families whose decoder this slice splits
        have = ", ".join(sorted(f.family for f in families() if f.sp_plan))
        problems.append(f"--sp: {sp} on {model.name}: the {model.family} family's decoder is not split by position "
                        f"yet: {family.sp_why_not or 'its layers have no sequence-parallel form'} (--sp trains {have})")
        return
    t, tp = model.text, max(1, args.tp)  # a row SP does not divide is padded to a multiple (padded_row)
    for what, n in (("attention heads (text.n_heads)", t.n_heads), ("KV heads (text.n_kv_heads)", t.kv_heads),
                    *tp_sizes(model, family.sp_plan)):  # the plan's own (Gated DeltaNet's key and value heads)
        kv = what.startswith("KV")
        if not n or (n % tp and not kv):  # (TP not dividing them: --tp's own line)
            continue
        mine = n // tp if n % tp == 0 else 1  # a TP rank's share (KV heads fewer than TP ranks: the one it uses)
        if mine % sp and not (kv and tp > 1 and sp % mine == 0):
            problems.append(f"--sp: {sp} does not divide {model.name}'s {n} {what}"
                            + (f" ({mine} a TP rank at --tp {tp}{', nor do they divide it' if kv else ''})"
                               if tp > 1 else ""))
    if args.sequence_parallel:
        problems.append(f"--sp: {sp} with --sequence-parallel: both split the row's positions (Megatron's over the "
                        f"TP ranks, Ulysses' over the SP ranks) and their exchanges are not composed; use one")
    unchecked = [name for name, on in (
        # the tower splits by whole images (sp_tower): an adapter there reads this rank's images, not a slice of the
        # single device's input that a mask could be cut from (the decoder's: lora.SplitDropout)
        (f"--lora-dropout {args.lora_dropout} on --lora-groups {args.lora_groups}", args.lora > 0
         and args.lora_dropout > 0 and bool({"vision", "projector"} & set(args.lora_groups.split(",")))),
        (f"--objective {args.objective}", objective_named(args.objective).sequence_parallel is None),
        (f"precision {precision}", precision == "fp16"), (f"ZeRO stage {zero_stage}", zero_stage > 1),
        # BF16_Optimizer is checked (ZeRO 0, and ZeRO 1 with fp32 accumulation: DeepSpeed 0.19.8 takes it there only,
        # engine._do_optimizer_sanity_check); else at ZeRO 1 DeepSpeed's ZeRO optimizer accumulates bf16 in p.grad
        ("bf16 at ZeRO 1", precision == "bf16" and zero_stage == 1
         and _grad_accum_dtype(ds) not in ("fp32", "float32", "float")),
        # the experts' norm under BF16_Optimizer goes over each SP coordinate's EP group: not checked
        (f"--ep {args.ep} in bf16", args.ep > 1 and precision == "bf16"),
        # zb-h1's deferred weight gradients under SP: checked in fp32 on dense models with SFT (and --tp by hand)
        (f"schedule {schedule}", not schedule.split_backward and schedule.name != BASELINE.name),
        (f"schedule {schedule} in {precision}", schedule.split_backward and precision != "fp32"),
        (f"schedule {schedule} on an MoE model", schedule.split_backward and family.experts(model) is not None),
        (f"schedule {schedule} and --objective {args.objective}",
         schedule.split_backward and objective_named(args.objective).name != TOKENS.name)) if on]
    if unchecked:
        problems.append(f"--sp: {sp} with {', '.join(unchecked)} is not supported yet (--sp trains fp32 at ZeRO 0 / "
                        f"1, bf16 at ZeRO 0, or 1 with \"data_types\": {{\"grad_accum_dtype\": \"fp32\"}}, 1F1B, "
                        f"zb-h1 in fp32 with SFT, SFT and dpo; docs/sequence_parallel.md)")


def _check_flags(args: TrainArgs, problems: Problems) -> None:
    """The run flags' own ranges (the model's and the data's are checked with them: ModelArgs, resolve_data)."""
    if args.resume and not (Path(args.output_dir) / "checkpoints" / "latest").is_file():
        problems.append(f"--resume: no checkpoint in {Path(args.output_dir) / 'checkpoints'}")
    if args.steps < 1:
        problems.append(f"--steps: {args.steps} must be >= 1")
    if args.save_every < 0:
        problems.append(f"--save-every: {args.save_every} must be >= 0")
    if args.keep_checkpoints < 0:
        problems.append(f"--keep-checkpoints: {args.keep_checkpoints} must be >= 0 (0 keeps all)")


def _check_ds(ds: dict, args: TrainArgs, problems: Problems) -> tuple[int, str]:
    """ZeRO stage and precision, and what DeepSpeed 0.19.8 would get wrong with them: (zero, precision)."""
    zero_stage = ds.get("zero_optimization", {}).get("stage", 0)
    if zero_stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage: {zero_stage!r} is not a ZeRO stage (valid: 0 or 1 with a pipeline)")
        zero_stage = 0
    fp16 = bool(ds.get("fp16", {}).get("enabled", False))
    bf16 = bool(ds.get("bf16", {}).get("enabled", False))
    if zero_stage >= 2:
        problems.append(f"zero_optimization.stage: {zero_stage} cannot run with a pipeline in DeepSpeed 0.19.8, "
                        f"which rejects ZeRO-2/3 for any PipelineModule (valid: 0 or 1)")
    if fp16 and bf16:
        problems.append("fp16.enabled / bf16.enabled: both are on; choose one")
    if fp16 and zero_stage != 1:
        problems.append("fp16.enabled: fp16 needs zero_optimization.stage 1: without ZeRO, DeepSpeed 0.19.8 never "
                        "multiplies the loss by the loss scale (wrong updates, no overflow detection); "
                        "use stage 1, bf16, or fp32")
    if "optimizer" not in ds:
        problems.append("optimizer: missing; set e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3, "
                        "\"torch_adam\": true}}")
    _check_monitors(ds, problems)
    if args.nonfinite == "skip" and (fp16 or bf16 or zero_stage != 0):
        problems.append("--nonfinite: skip works with fp32 and ZeRO stage 0 (bf16 and ZeRO-1 optimizers hold their "
                        "own gradient buffers); fp16 skips overflowing steps by itself; use --nonfinite stop")
    return zero_stage, "fp16" if fp16 else "bf16" if bf16 else "fp32"


# DeepSpeed's monitor sections and the package each imports in every rank (csv_monitor: none)
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _check_monitors(ds: dict, problems: Problems) -> None:
    """Each enabled monitor's package importable here, before launch: DeepSpeed imports it only in the
    ranks' deepspeed.initialize, and a missing one is a traceback per rank."""
    for section, package in MONITOR_PACKAGES.items():
        if (ds.get(section) or {}).get("enabled") and importlib.util.find_spec(package) is None:
            problems.append(f"{section}.enabled: the {package} package is not installed; pip install {package}, or "
                            f"drop the {section} section (csv_monitor logs without one)")


def _fit_to_tokenizer(model: ModelConfig, data: DataOptions, init_from: str | None, run_tok: str | None,
                      problems: Problems) -> ModelConfig:
    """Imported weights must hold the tokenizer; fresh ones are sized to it (and get its <image>)."""
    if init_from:
        problems.attempt(check_init_tokenizer, model, data.tokenizer, run_tok)
        return model
    # fresh weights: LLaVA's placeholder is the tokenizer's <image>, added if missing; a family of grids' is its
    # tokenizer's own (Qwen2-VL's <|image_pad|> at image_token_id, checked by mmpipe.data.text.image_text)
    if image_kind(model).image_token:
        model = dataclasses.replace(model, image_token_id=add_image_token(data.tokenizer))
    n_vocab = len(data.tokenizer)
    if model.text.vocab_size >= n_vocab:
        return model
    if data.builtin:
        problems.append(f"text.vocab_size: {model.text.vocab_size} is smaller than the tokenizer's {n_vocab} tokens")
        return model
    return model.with_vocab(-(-n_vocab // 64) * 64)  # fresh weights: embedding and head sized, a multiple of 64


RESIZED = ("vocab_size", "image_token_id")  # what a fresh run fits to its tokenizer (model.json records it)


def merged_route(d: Path, cfg: ModelConfig) -> str:
    """How a LoRA run's merged weights become a run to start from: export merges the adapters, import
    writes the run (tests/test_lora.py parses these commands)."""
    hf = family_of(cfg).hf
    names = hf and hf.names
    if names == "hf":
        return (f"start from its merged weights: `mmpipe export --checkpoint {d} --format hf --out MERGED` then "
                f"`mmpipe import --hf MERGED --out RUN`, and --init-from RUN")
    if names is None:  # no file format outside mmpipe holds its layers
        return f"start from the run it started from ({cfg.fusion} weights have no export to re-import)"
    return (f"start from its merged weights: `mmpipe export --checkpoint {d} --format safetensors --out "
            f"merged.safetensors` then `mmpipe import --moondream merged.safetensors --preset {d / 'model.json'} "
            f"--out RUN`, and --init-from RUN")


def init_model(run_dir: str, preset: str | None) -> ModelConfig:
    """--init-from RUN: the model config RUN trained or imported; --preset, if given, must describe
    the same model (up to the vocabulary size and <image> id a run fits to its tokenizer)."""
    d = Path(run_dir)
    if not (d / "model.json").is_file():
        raise ConfigError(f"--init-from: {d} has no model.json (give an mmpipe run directory, "
                          f"e.g. `mmpipe import --out`)")
    if not (d / "checkpoints" / "latest").is_file():
        raise ConfigError(f"--init-from: {d} has no checkpoint (checkpoints/latest is missing)")
    cfg = config_from_dict(json.loads((d / "model.json").read_text()), d.name)
    if read_lora(d):
        raise ConfigError(f"--init-from: {d} trained LoRA adapters; {merged_route(d, cfg)}")
    if preset is not None:
        want = load_preset(preset)

        def shape(c: ModelConfig) -> dict:
            out = c.to_dict()
            out.pop("image_token_id")
            out["text"].pop("vocab_size")
            return out
        a, b = shape(cfg), shape(want)
        diff = [f"{k}.{j}" for k in a if isinstance(a[k], dict) for j in a[k] if a[k][j] != b[k].get(j)]
        diff += [k for k in a if not isinstance(a[k], dict) and a[k] != b.get(k)]
        if diff:
            diff = diff[0]
            raise ConfigError(f"--preset: {preset} is not the model {d} holds ({diff} differs); leave --preset out "
                              f"with --init-from (the run's model.json is used)")
    return cfg


def check_init_tokenizer(cfg: ModelConfig, tok, source: str | None) -> None:
    """The weights' vocabulary must hold the tokenizer, and a tokenizer's <image> must be the model's."""
    where = source or "the built-in tokenizer"
    if len(tok) > cfg.text.vocab_size:
        raise ConfigError(f"--init-from: {where} has {len(tok)} tokens, more than the model's vocabulary "
                          f"({cfg.text.vocab_size}); give the tokenizer the weights were trained with (--tokenizer)")
    if image_kind(cfg).markers:
        tid = tok.get_vocab().get(IMAGE_TOKEN)
        if tid is not None and tid != cfg.image_token_id:
            raise ConfigError(f"--init-from: {where} has {IMAGE_TOKEN} at id {tid}, the model's placeholder is "
                              f"image_token_id {cfg.image_token_id}")
