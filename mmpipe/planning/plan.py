"""`mmpipe plan`: predicted step time, memory and throughput of every PP x DP x micro-batch layout
of a model on a cluster, before anything is launched or allocated (the model is built on the
meta device only to count its parameters).

For each layout: pipeline stages P dividing the GPUs, DP = GPUs / P, micro-batch b with
GAS m = global batch / (b x DP); the balanced (min-max time) split that fits memory; then

    step time  = (m + P - 1) x (slowest stage's forward + backward per micro-batch + its p2p)
                 + the data-parallel gradient all-reduce
    bubble     = (P - 1) / (m + P - 1)
    throughput = global batch / step time

Layouts whose every split overflows a device's memory are listed with the reason. The best
layout's DeepSpeed JSON can be written out (--write-config) and run as is.

Rows (`--max-images M`, `--pack`, as mmpipe train's): a micro-batch row carries M image slots
through the tower and L = M x N_dec + text_len decoder positions (costmodel.layer_costs), and the
global batch and micro-batch count rows. With --max-images alone a row is one sample, so samples/s
stays samples/s; with --pack a row holds as many samples as fit, which the data decides, so
throughput is reported as positions/s = rows/s x L (padding included), and

    useful tokens/s = positions/s x (1 - the data's padding share)

where the padding share is what `mmpipe train --pack` measures (summary.json data.padding_share).

`--schedule zb-h1` predicts the zero-bubble ZB-H1 schedule instead (step = 1F1B's minus the idle
time its order saves when both orders are replayed with each stage's forward, input-backward B and
weight-backward W seconds: costmodel.replayed_step_seconds); `--schedule both` prints both per
layout and recommends the faster; the chosen schedule goes into --json and --write-config.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from pathlib import Path

from ..config import ConfigError, fail
from ..data.args import VIDEO_FLAGS, DataArgs
from ..data.dataset import ROW_FLAGS
from ..flags import add_flags, to_argv
from ..model.args import ModelArgs
from ..model.builder import layer_specs
from ..registry import family_of
from .calibrate import calibrate, profile_of, read_results, report
from .costmodel import KNOWN_DEVICES, Shape, layer_costs, pair_image_rows, profile_layers
from .data_rows import DATA_FLAGS
from .images import sized_families
from .layout import GiB, Layout, plan_layout
from .partition import compute_parts
from .report import budget_words, print_json, print_plan
from .request import PLAN_SCHEDULES, PlanRun, PlanSpec, cpu_device, device_from_args, resolve
from .schedule_registry import BASELINE, DUALPIPEV, asked
from .sequence_parallel import sp_divides, sp_layer_costs
from .tensor_parallel import tp_layer_costs
from .vpairs import describe_pairs

__all__ = ["GiB", "Layout", "PlanRun", "PlanSpec", "plan_layout", "add_plan_args", "cpu_device", "device_from_args",
           "plan", "main_plan", "resolve"]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="moondream-2b", help="model preset or JSON (default: moondream-2b)")
    p.add_argument("--device", default="h100-80gb",
                   help=f"known device ({', '.join(KNOWN_DEVICES)}, cpu) or 'custom' with the flags below")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense TFLOP/s per device at the precision")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per device")
    p.add_argument("--link-gbps", type=float, default=None, help="GB/s between stages / for the all-reduce")
    p.add_argument("--efficiency", type=float, default=None, help="achieved share of peak (default: 0.45)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=256, help="samples per optimizer step (rows with --pack)")
    p.add_argument("--micro", default="1,2,4,8,16", help="micro-batch sizes to consider (rows with --pack)")
    p.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16"),
                   help="default: bf16; with --device-profile, the profile's precision when it holds one only (a "
                        "profile `mmpipe check` wrote holds its run's)")
    p.add_argument("--zero", type=int, default=1, choices=(0, 1), help="ZeRO stage (0 or 1 with a pipeline)")
    p.add_argument("--ep", default="1", metavar="N[,N...]",
                   help="an MoE model (text.moe): expert-parallel ranks to consider, as `mmpipe train --ep N` splits "
                        "the experts over groups of N data-parallel ranks; a layout whose DP N does not divide is "
                        "skipped (default: 1; docs/moe.md)")
    p.add_argument("--tp", default="1", metavar="N[,N...]",
                   help="tensor-parallel ranks per stage to consider, as `mmpipe train --tp N` splits each stage's "
                        "layers by the family's plan (world = PP x DP x TP; inside a node: a degree not dividing "
                        "--gpus-per-node is left out; default: 1; docs/tensor_parallel.md)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: plan Megatron's sequence parallelism, as `mmpipe train --sequence-parallel` (the "
                        "decoder's activations / TP; docs/tensor_parallel.md)")
    p.add_argument("--sp", default="1", metavar="N[,N...]",
                   help="sequence-parallel (Ulysses) ranks per stage to consider, as `mmpipe train --sp N` splits each "
                        "row's positions (world = PP x DP x TP x SP; TP x SP inside a node; default: 1; "
                        "docs/sequence_parallel.md)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks")
    p.add_argument("--dpo-reference", default=None, choices=("live", "precomputed"),
                   help="plan `mmpipe train --objective dpo`: live, its reference pass (one forward-only pipeline pass "
                        "a step) and each stage's copy of its trained weights counted; precomputed "
                        "(--reference-logps): nothing more (docs/dpo.md)")
    p.add_argument("--schedule", default=BASELINE.name, metavar="|".join(PLAN_SCHEDULES),
                   help="pipeline schedule to predict: 1f1b (default), zb-h1 (zero-bubble, docs/schedules.md), or "
                        "both, side by side, recommending the faster per layout")
    p.add_argument("--top", type=int, default=10, help="layouts to list")
    p.add_argument("--write-config", default=None, help="write the best layout's DeepSpeed JSON here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--profile", action="store_true",
                   help="time each layer kind here (one process, this device) instead of peak FLOP/s x efficiency")
    p.add_argument("--device-profile", default=None, metavar="FILE",
                   help="a device profile written by --calibrate: its peak, fitted efficiency and overheads "
                        "replace --device's (flags above still override)")
    p.add_argument("--calibrate", default=None, metavar="RESULTS.json",
                   help="fit efficiency and overheads to a `mmpipe bench` results.json, report the fit and the "
                        "held-back variants, write a device profile (docs/planning.md)")
    p.add_argument("--hold-out", default=None, metavar="NAMES",
                   help="with --calibrate: comma-separated variants to check, not fit (default: the last two)")
    p.add_argument("--write-profile", default=None, metavar="FILE",
                   help="with --calibrate: where the profile goes (default: device_profile.json beside RESULTS.json)")
    p.add_argument("--image-size", default=None, metavar="WxH[,WxH...]",
                   help=f"presets whose images take any size ({', '.join(sized_families())}): cost rows of "
                        "--max-images images of this size in pixels, e.g. 1024x768, each resized or tiled as "
                        "training does it; "
                        "several sizes: one image of each in turn, --max-images defaulting to their number "
                        "(default: the preset's vision.image_size square)")
    p.add_argument("--video-frames", type=int, default=None, metavar="N",
                   help="presets that read clips (the Qwen2-VL and Qwen3-VL families, LLaVA-OneVision): cost rows "
                        "holding one clip of N frames sampled, beside --max-images images of --image-size "
                        "(docs/video.md)")
    p.add_argument("--video-size", default=None, metavar="WxH",
                   help="with --video-frames: the clip's frame size in pixels, resized as training resizes it "
                        "(OneVision: to the tower's crop) "
                        "(default: the preset's vision.image_size square)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="with --pack: price the rows this data packs into (mmpipe train's --data, read from its token "
                        "index), spread over the DP ranks as train balances them; without it every row is assumed "
                        "one sample filling its positions (docs/balance.md)")
    p.add_argument("--data-index", default=None, metavar="RUN_DIR",
                   help="with --data: read the data index in RUN_DIR/data/ that `mmpipe train --output-dir RUN_DIR` "
                        "wrote, or build it there (default, and under --dry-run: a temporary folder)")
    # the flags plan shares with mmpipe train, declared and checked once (a --text-len train refuses, plan refuses)
    add_flags(p, ModelArgs)
    # --video-*: a clip's sampling (--video-frames' grid); DATA_FLAGS: what tokenises --data
    add_flags(p, DataArgs, only=ROW_FLAGS + VIDEO_FLAGS + DATA_FLAGS)


def plan(spec: PlanSpec) -> list[Layout]:
    """Every layout of spec.cfg on spec.gpus devices, best (highest throughput) first: each TP degree (spec.tps), each
    pipeline depth P dividing the GPUs / TP and at most the layer count, DP = GPUs / (P x TP), each micro-batch b
    dividing the global batch by DP (GAS = global / (b x DP)), each EP dividing DP; its balanced split that fits
    memory, or why none does. At TP t the rows are one TP rank's (planning.tensor_parallel.tp_layer_costs)."""
    s = spec
    whole = layer_table(s)
    profiles = ({m: profile_layers(s.cfg, s.text_len, m, s.precision, images=s.images) for m in s.micros}
                if s.profile else {})
    layouts = []
    # (a TP x SP pair train refuses, SP not dividing the heads a TP rank holds, is not planned: sp_divides)
    for tp, sp in [(tp, sp) for tp in s.tps for sp in s.sps if s.gpus % (tp * sp) == 0 and sp_divides(s.cfg, tp, sp)
                   and not (sp > 1 and s.sequence_parallel)]:  # (--sequence-parallel with --sp: refused too)
        rows = sp_layer_costs(s.cfg, tp_layer_costs(s.cfg, pair_rows(s, whole), tp, s.sequence_parallel), sp, tp,
                              s.images)
        gpus = s.gpus // (tp * sp)
        for stages in [p for p in range(1, gpus + 1) if gpus % p == 0 and p <= len(rows)]:
            dp = gpus // stages
            for micro in s.micros:
                if s.global_batch % (micro * dp):
                    continue
                for ep in [e for e in s.eps if dp % e == 0]:
                    shape = Shape(stages, dp, micro, s.global_batch // (micro * dp), ep, tp, sp)
                    layouts.append(plan_layout(rows, shape, s.training, profiles.get(micro)))
    return sorted(layouts, key=lambda lay: -lay.throughput)


def layer_table(spec: PlanSpec) -> list:
    """The layers' costs a row (costmodel.layer_costs): with --data the data's mean row's FLOPs (RowLoad.mean_rows,
    planning.data_rows), else one sample filling the row."""
    s = spec
    whole = layer_costs(s.cfg, s.freeze, s.text_len, s.checkpointing, s.lora, s.images, s.row)
    return s.load.mean_rows(whole) if s.load is not None else whole


def pair_rows(spec: PlanSpec, rows: list) -> list:
    """--dpo-reference (a dpo run): a sharing family's tower once a pair (costmodel.pair_image_rows), as
    runtime.feed.share_pair_images trains it, under --sp too (the split tower deals out the pairs' images:
    model.sp_tower); rows unchanged for any run without --dpo-reference."""
    return pair_image_rows(spec.cfg, rows) if spec.reference else rows


def ds_config(layout: Layout, precision: str, zero: int, checkpointing: bool, lr: float = 1e-4) -> dict:
    cfg = {  # all three batch sizes: DeepSpeed's train_batch = micro x GAS x DP fixes the DP it was planned for
        "train_batch_size": layout.micro * layout.gas * layout.dp,
        "train_micro_batch_size_per_gpu": layout.micro, "gradient_accumulation_steps": layout.gas,
        "steps_per_print": 1000000, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 100,
                                                           "warmup_type": "linear", "cos_min_ratio": 0.05}},
        "zero_optimization": {"stage": zero},
        "pipeline": {"stages": layout.stages, "partition": ",".join(str(b) for b in layout.parts[1:-1]) or "balanced",
                     "activation_checkpoint_interval": 1 if checkpointing else 0, "schedule": layout.schedule},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    return cfg


def main_calibrate(args) -> int:
    """--calibrate: fit, print, write the profile."""
    try:
        hold = None if args.hold_out is None else [n for n in args.hold_out.split(",") if n]
        result = calibrate(read_results(args.calibrate), hold, args.calibrate)
    except ConfigError as e:
        return fail(e)
    out = Path(args.write_profile or Path(args.calibrate).with_name("device_profile.json"))
    if args.dry_run:
        print(report(result))
        print(f"mmpipe: dry run: would write {out.resolve()}")
        return 0
    out.write_text(json.dumps(profile_of(result), indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(report(result))
    print(f"mmpipe: wrote {out}; use it with mmpipe plan --device-profile {out}")
    return 0


def fit_hints(spec: PlanSpec) -> str:
    """What a plan with no fitting layout can try: only the levers not already pulled (a dynamic-resolution
    row: a smaller budget and text first, the P x P masks and L x L of every block scale with them)."""
    s = spec
    hints = [f"a smaller {budget_words(s.row)} or --text-len than {s.text_len}"] if s.row else []
    hints += [] if s.checkpointing else ["--checkpointing"]
    hints += [] if s.zero >= 1 else ["--zero 1"]
    hints += ["smaller --micro"] if min(s.micros, default=1) > 1 else []
    hints += [] if "vision" in s.freeze else ["--freeze vision"]
    hints += [] if s.lora else ["--lora 16 (adapters: no gradients or optimizer state for the base)"]
    return ", ".join(hints + ["more --nodes"])


def main_plan(args) -> int:
    if args.calibrate:
        return main_calibrate(args)
    try:
        run = resolve(args)
    except (ConfigError, ValueError) as e:
        return fail(e if isinstance(e, ConfigError) else ConfigError(f"--micro: {e}"))
    s, t0 = run.spec, time.perf_counter()
    layouts = plan(s)
    feasible = [lay for lay in layouts if lay.step]
    if run.json:
        print_json(run, layouts)
    else:
        beside = (fixed_first_stage(s, feasible[0] if feasible else None), v_pairs_line(s, run.schedule, layouts))
        print_plan(run, layouts, time.perf_counter() - t0, "\n".join(line for line in beside if line))
    if not feasible:
        return fail(ConfigError(f"plan: no layout of {s.cfg.name} fits {s.gpus} x {s.device.memory / GiB:.0f} GiB at "
                                f"global batch {s.global_batch} (try {fit_hints(s)})"))
    return write_config(run, feasible[0]) if run.write_config else 0


def write_config(run: PlanRun, best: Layout) -> int:
    """--write-config FILE: the best layout's DeepSpeed JSON, and the train command that runs it as planned."""
    s = run.spec
    if run.dry_run:
        print(f"mmpipe: dry run: would write {Path(run.write_config).resolve()} (the best layout's DeepSpeed JSON)")
        return 0
    out = Path(run.write_config)
    try:  # a folder the config goes in is made, as --output-dir's are; one that cannot be is one line
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(ds_config(best, s.precision, s.zero, s.checkpointing), indent=2) + "\n")
    except OSError as e:
        return fail(ConfigError(f"--write-config: cannot write {out}: {e.strerror or e}"))
    sched = "" if best.schedule == BASELINE.name else f", schedule {best.schedule}"
    print(f"mmpipe: wrote {run.write_config} ({best.stages} stages x dp {best.dp}, micro {best.micro} x GAS "
          f"{best.gas} = global batch {best.micro * best.gas * best.dp}{sched}); run it with mmpipe train "
          f"{shlex.join(train_flags(run, best))}")
    return 0


def train_flags(run: PlanRun, best: Layout) -> list[str]:
    """The `mmpipe train` flags that run the plan as planned: the preset (train's default is another model), the
    written config (precision, ZeRO, checkpointing, schedule, batch sizes, partition) and its DP, the model
    flags the plan was given (--freeze, --lora..., --max-crops) and the row's shape (--pack, --max-images, the
    vision budget, --text-len), each as train spells it."""
    s = run.spec
    rows = ([*(["--pack"] if run.pack else []), "--max-images", str(s.images)] if run.pack or s.images > 1 else [])
    rows += budget_words(s.row, " ").split() if s.row else []
    ep = ["--ep", str(best.ep)] if best.ep > 1 else []
    ep += ["--tp", str(best.tp), *(["--sequence-parallel"] if s.sequence_parallel else [])] if best.tp > 1 else []
    ep += ["--sp", str(best.sp)] if best.sp > 1 else []
    return ["--preset", run.preset, "--ds-config", run.write_config, "--dp", str(best.dp), *ep,
            *to_argv(run.model_args), *rows, "--text-len", str(s.text_len), *run.data_argv]


def fixed_first_stage(spec: PlanSpec, best: Layout | None) -> str:
    """The best layout with stage 0 fixed where other trainers must cut (Family.fixed_first_stage: Qwen3-VL's
    tower and decoder layers 0..2), the other stages balanced as plan balances them, predicted by the same model:
    the line `mmpipe plan` prints beside its own split; '' for a family without such a rule or a one-stage best."""
    s = spec
    rule = family_of(s.cfg).fixed_first_stage
    if rule is None or best is None or best.stages < 2:
        return ""
    rows = sp_layer_costs(s.cfg, tp_layer_costs(s.cfg, pair_rows(s, layer_table(s)), best.tp,
                                                 s.sequence_parallel), best.sp, best.tp, s.images)
    first = rule(layer_specs(s.cfg))
    shape = Shape(best.stages - 1, best.dp, best.micro, best.gas, best.ep, best.tp, best.sp)
    # its own memory per stage: stage index + 1; the cut on the mean row (--data's load prices whole splits)
    rest = plan_layout(rows[first:], shape, dataclasses.replace(s.training, load=None))
    head = (f"stage 0 fixed at layers 0..{first - 1} (where other trainers cut {s.cfg.family}: "
            f"Family.fixed_first_stage)")
    if not rest.parts:
        return f"{head}: the other {best.stages - 1} stages cannot hold layers {first}..{len(rows) - 1} ({rest.reason})"
    cut = dataclasses.replace(s.training, partition=",".join(str(first + p) for p in rest.parts[:-1]))
    fixed = plan_layout(rows, dataclasses.replace(shape, stages=best.stages), cut)
    s0, fits = fixed.stage_rows[0], fixed.stage_rows[0]["memory_gib"] * GiB <= s.device.memory
    return (f"{head}, the other {best.stages - 1} balanced: step {fixed.step['step_s']:.3f} s against "
            f"{best.step['step_s']:.3f} s; its stage 0 {s0['memory_gib']:.2f} GiB"
            f"{'' if fits else f' (over {s.device.memory / GiB:.0f} GiB: it does not fit)'}, fwd "
            f"{s0['forward_ms']:.2f} + bwd {s0['backward_ms']:.2f} ms against the best's slowest stage "
            f"{max(r['forward_ms'] + r['backward_ms'] for r in best.stage_rows):.2f} ms")


def v_pairs_line(spec: PlanSpec, schedule, layouts: list[Layout]) -> str:
    """With dualpipev asked for (--schedule dualpipev or all): the V-pair split of the best layout DualPipeV runs
    (PP >= 2), cut as `mmpipe train --schedule dualpipev` cuts it (compute_parts with v_ranks: each rank's pair of
    stages balanced by FLOPs, a frozen layer's forward only; mmpipe.planning.vpairs); '' otherwise."""
    s = spec
    lay = next((x for x in layouts if x.step and DUALPIPEV.name in x.predictions and x.stages >= 2), None)
    if DUALPIPEV not in asked(schedule) or lay is None:
        return ""
    rows, p = tp_layer_costs(s.cfg, pair_rows(s, layer_table(s)), lay.tp, s.sequence_parallel), lay.stages
    head = f"dualpipev's V at PP={p} ({2 * p} stages, rank r holding stage r and {2 * p - 1} - r)"
    try:
        return f"{head}: {describe_pairs(rows, compute_parts(rows, 2 * p, 'balanced', v_ranks=p))}"
    except ConfigError as e:
        return f"{head}: {e}"
