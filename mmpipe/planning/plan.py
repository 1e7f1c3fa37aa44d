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
import json
import shlex
import time
from pathlib import Path

from ..config import ConfigError, ModelConfig, fail, load_preset
from ..data.args import VIDEO_FLAGS, DataArgs
from ..data.dataset import ROW_FLAGS, row_text_len
from ..data.image_kinds import image_kind, row_budget
from ..flags import add_flags, from_namespace, to_argv
from ..model.args import ModelArgs
from ..model.builder import check_lora_rank, layer_specs
from ..model.costs import CropRow, PatchRow
from ..model.families import FAMILIES, family_of
from ..model.lora import Lora
from .calibrate import calibrate, load_profile, profile_device, profile_of, profile_precision, read_results, report
from .costmodel import KNOWN_DEVICES, Device, layer_costs, profile_layers, row_positions
from .images import (
    clip_refusal,
    clip_row,
    crop_line,
    crop_words,
    families_words,
    parse_image_size,
    parse_image_sizes,
    patch_row,
    sized_families,
)
from .layout import CPU_EFFICIENCY, CPU_LINK, GiB, Layout, plan_layout
from .schedule_registry import BASELINE, BOTH, SCHEDULE_NAMES, SCHEDULES, Schedule, asked

PLAN_SCHEDULES = (*SCHEDULE_NAMES, BOTH)

__all__ = ["GiB", "Layout", "plan_layout", "add_plan_args", "device_from_args", "plan", "main_plan"]


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
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks")
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
    # the flags plan shares with mmpipe train, declared and checked once (a --text-len train refuses, plan refuses)
    add_flags(p, ModelArgs)
    add_flags(p, DataArgs, only=ROW_FLAGS + VIDEO_FLAGS)  # --video-*: a clip's sampling (--video-frames' grid)


def device_from_args(args) -> Device:
    """The Device to plan on; sets args.precision when it was not given (bf16, or the device profile's)."""
    if getattr(args, "device_profile", None):
        prof = load_profile(args.device_profile)
        args.precision = args.precision or profile_precision(prof)
        base = profile_device(prof, args.precision)
    elif args.device == "cpu":
        base = cpu_device()
    elif args.device in KNOWN_DEVICES:
        base = KNOWN_DEVICES[args.device]
    elif args.device == "custom":
        base = Device("custom", 0.0, 0.0, 0.0)
    else:
        raise ConfigError(f"--device: '{args.device}' is not known (valid: {', '.join(KNOWN_DEVICES)}, cpu, custom)")
    dev = Device(base.name,
                 args.peak_tflops * 1e12 if args.peak_tflops else base.peak_flops,
                 args.gpu_mem * GiB if args.gpu_mem else base.memory,
                 args.link_gbps * 1e9 if args.link_gbps else base.link,
                 args.efficiency if args.efficiency else base.efficiency,
                 base.microbatch_overhead, base.step_overhead, base.allreduce_link, base.split_overhead)
    args.precision = args.precision or "bf16"
    missing = [n for n, v in (("--peak-tflops", dev.peak_flops), ("--gpu-mem", dev.memory), ("--link-gbps", dev.link))
               if v <= 0]
    if missing:
        raise ConfigError(f"--device custom: give {', '.join(missing)}")
    return dev


def cpu_device() -> Device:
    """This machine: peak = a measured fp32 matmul rate on one thread per rank, memory = RAM."""
    import os

    import torch
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    peak = 2 * 512 ** 3 * n / (time.perf_counter() - t0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cpu", peak, float(ram), CPU_LINK, efficiency=CPU_EFFICIENCY)


def plan(cfg: ModelConfig, *, device: Device, gpus: int, global_batch: int, micros: list[int], text_len: int,
         precision: str, zero: int, freeze: tuple[str, ...], checkpointing: bool, profile: bool = False,
         lora: Lora | None = None, schedule: tuple[Schedule, ...] = (BASELINE,), images: int = 1,
         patches: PatchRow | None = None, eps: tuple[int, ...] = (1,)) -> list[Layout]:
    """images: a row's image slots (--max-images); global_batch and micros then count rows. patches: a
    dynamic-resolution row's patch budget and image grids (mmpipe.planning.images.patch_row). eps: an MoE model's
    expert-parallel degrees (--ep), each planned for every layout whose DP it divides."""
    rows = layer_costs(cfg, freeze, text_len, checkpointing, lora, images, patches)
    profiles = {m: profile_layers(cfg, text_len, m, precision, images=images) for m in micros} if profile else {}
    layouts = []
    for stages in [p for p in range(1, gpus + 1) if gpus % p == 0 and p <= len(rows)]:
        dp = gpus // stages
        for micro in micros:
            if global_batch % (micro * dp):
                continue
            for ep in [e for e in eps if dp % e == 0]:
                layouts.append(plan_layout(rows, stages=stages, dp=dp, micro=micro, gas=global_batch // (micro * dp),
                                           precision=precision, zero=zero, device=device,
                                           measured=profiles.get(micro), schedule=schedule, ep=ep))
    return sorted(layouts, key=lambda lay: -lay.throughput)


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


def _check_rows(args, cfg: ModelConfig) -> PatchRow | None:
    """--text-len, --max-images, --pack, --max-patches: mmpipe train's check (row_text_len, row_budget);
    --text-len defaults to what the model's context leaves, as it does for `mmpipe train --data` on your own
    data. A dynamic-resolution family's row (--image-size): its PatchRow; None for the others."""
    problems: list[str] = []
    sizes = None if args.image_size is None else parse_image_sizes(args.image_size)
    if sizes and image_kind(cfg).flag is None:  # fixed-size images: no size to cost
        problems.append(f"--image-size: the {cfg.family} family resizes every image to {cfg.vision.image_size} px "
                        f"square; only {families_words(sized_families())} (images of any size in a row budget) "
                        f"cost an image size")
    elif sizes and args.max_images is not None and args.max_images < len(sizes):
        problems.append(f"--image-size: {len(sizes)} sizes for --max-images {args.max_images}: a row holds one image "
                        f"of each (give --max-images {len(sizes)} or more)")
    elif sizes and args.max_images is None:
        args.max_images = len(sizes)  # a row holds one image of each size
    video = _check_video(args, cfg, problems)
    images = (args.max_images or 0) if sizes else 0  # images beside the clip: only those given a size
    if video:  # the clip is one more medium of the row: the default P and the shares count it
        args.max_images = images + 1
    data = from_namespace(DataArgs, args, only=ROW_FLAGS)
    args.text_len = row_text_len(data, cfg, None, problems)
    budget = row_budget(data, cfg, problems)
    if problems:
        raise ConfigError("\n".join(problems))
    if args.pack and args.max_images is None:  # train derives them from the data (data.dataset.packed_image_slots)
        print("note: --pack without --max-images: `mmpipe train` sizes a row's image slots from the data (it prints "
              "them: 'mmpipe: --pack: M image slots per row'); plan has no data and costs M = 1 - give that "
              "--max-images M here")
    args.max_images = args.max_images or 1
    if video:
        row = clip_row(cfg, budget, *video, images, sizes)
        slots = len(row.tilings) if isinstance(row, CropRow) else len(row.grids)
        args.video_slots = slots - images  # a Qwen3-VL clip takes a slot per temporal patch (OneVision's: one)
        args.max_images = slots
        return row
    return patch_row(cfg, args.max_images, budget, sizes)  # the row's P, or tiles' T


def _check_video(args, cfg: ModelConfig, problems: list[str]) -> tuple[int, tuple[int, int]] | None:
    """--video-frames N and --video-size WxH -> (N, (W, H)), None without them; a line per problem."""
    frames, size = getattr(args, "video_frames", None), getattr(args, "video_size", None)
    if frames is None and size is None:
        return None
    if "video" not in family_of(cfg).media:
        readers = [f.family for f in FAMILIES if "video" in f.media]
        problems.append(f"--video-frames: the {cfg.family} family reads no clips; only {families_words(readers)} do")
        return None
    if clip_refusal(cfg):
        problems.append(clip_refusal(cfg))
        return None
    if frames is None or frames < 2:
        problems.append(f"--video-frames: {frames} must be given and at least 2 (a temporal patch of 2 frames)")
        return None
    return frames, parse_image_size(size) if size else (cfg.vision.image_size, cfg.vision.image_size)


def fit_hints(args, micros: list[int], freeze: tuple[str, ...], lora, patches: PatchRow | None = None) -> str:
    """What a plan with no fitting layout can try: only the levers not already pulled (a dynamic-resolution
    row: a smaller patch budget and text first, the P x P masks and L x L of every block scale with them)."""
    hints = [f"a smaller {_budget(patches)} or --text-len than {args.text_len}"] if patches else []
    hints += [] if args.checkpointing else ["--checkpointing"]
    hints += [] if args.zero >= 1 else ["--zero 1"]
    hints += ["smaller --micro"] if min(micros, default=1) > 1 else []
    hints += [] if "vision" in freeze else ["--freeze vision"]
    hints += [] if lora else ["--lora 16 (adapters: no gradients or optimizer state for the base)"]
    return ", ".join(hints + ["more --nodes"])


def main_plan(args) -> int:
    if args.calibrate:
        return main_calibrate(args)
    try:
        model_args = from_namespace(ModelArgs, args)
        cfg = model_args.with_crops(load_preset(args.preset))
        cfg = from_namespace(DataArgs, args, only=VIDEO_FLAGS).with_video(cfg)
        device = device_from_args(args)
        micros = [int(x) for x in args.micro.split(",") if x]
        freeze, lora = model_args.frozen_groups(), model_args.adapters()
        check_lora_rank(cfg, lora)  # as train's resolve: no rank above the narrowest adapted linear's
        patches = _check_rows(args, cfg)
        if args.profile and patches:
            raise ConfigError(f"--profile: not for a dynamic-resolution preset ({cfg.family}) yet; plan it from "
                              f"--device's peak x --efficiency")
        if args.schedule not in PLAN_SCHEDULES:
            raise ConfigError(f"--schedule: {args.schedule!r} is not a schedule (valid: {', '.join(PLAN_SCHEDULES)})")
        if args.precision == "fp16" and args.zero != 1:
            raise ConfigError("--precision fp16 needs --zero 1 (DeepSpeed 0.19.8, see docs/configs.md)")
        eps = _check_ep(args.ep, cfg)
    except (ConfigError, ValueError) as e:
        return fail(e if isinstance(e, ConfigError) else ConfigError(f"--micro: {e}"))
    gpus = args.gpus_per_node * args.nodes
    t0 = time.perf_counter()
    layouts = plan(cfg, device=device, gpus=gpus, global_batch=args.global_batch, micros=micros,
                   text_len=args.text_len, precision=args.precision, zero=args.zero, freeze=freeze,
                   checkpointing=args.checkpointing, profile=args.profile, lora=lora, schedule=asked(args.schedule),
                   images=args.max_images, patches=patches, eps=eps)
    feasible = [lay for lay in layouts if lay.step]
    length = row_positions(cfg, args.text_len, args.max_images, patches)
    if args.json:  # throughput: rows/s (samples/s unless packed); positions_per_s = rows/s x L, padding included
        row = image_kind(cfg).row_json(patches)  # the row's budget flag and its images' grids or tilings
        moe = getattr(cfg.text, "moe", None) is not None  # a dense model's layouts keep their keys (no ep)
        keys = [{k: v for k, v in lay.__dict__.items() if moe or k != "ep"} for lay in layouts]
        print(json.dumps([{**d, "throughput": lay.throughput, "decoder_length": length,
                           "positions_per_s": lay.throughput * length, **row} for d, lay in zip(keys, layouts)],
                         indent=1))
    else:
        beside = fixed_first_stage(cfg, args, feasible[0] if feasible else None, device, freeze, lora, patches)
        _print(cfg, device, gpus, args, layouts, time.perf_counter() - t0, patches, beside)
    if not feasible:
        return fail(ConfigError(f"plan: no layout of {cfg.name} fits {gpus} x {device.memory / GiB:.0f} GiB at global "
                                f"batch {args.global_batch} (try {fit_hints(args, micros, freeze, lora, patches)})"))
    if args.write_config and args.dry_run:
        print(f"mmpipe: dry run: would write {Path(args.write_config).resolve()} (the best layout's DeepSpeed JSON)")
    elif args.write_config:
        out = Path(args.write_config)
        try:  # a folder the config goes in is made, as --output-dir's are; one that cannot be is one line
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(ds_config(feasible[0], args.precision, args.zero, args.checkpointing),
                                      indent=2) + "\n")
        except OSError as e:
            return fail(ConfigError(f"--write-config: cannot write {out}: {e.strerror or e}"))
        best = feasible[0]
        sched = "" if best.schedule == BASELINE.name else f", schedule {best.schedule}"
        print(f"mmpipe: wrote {args.write_config} ({best.stages} stages x dp {best.dp}, micro {best.micro} x GAS "
              f"{best.gas} = global batch {best.micro * best.gas * best.dp}{sched}); run it with mmpipe train "
              f"{shlex.join(train_flags(args, model_args, best, patches))}")
    return 0


def _check_ep(text: str, cfg: ModelConfig) -> tuple[int, ...]:
    """--ep N[,N...] -> the degrees, checked as `mmpipe train --ep` checks one (run_config._check_ep): each >= 1,
    above 1 only on an MoE model and dividing its experts; whether it divides a layout's DP, plan decides per
    layout."""
    try:
        eps = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise ConfigError(f"--ep: {text!r} is not a list of integers, e.g. 1,2,4,8") from None
    moe = getattr(cfg.text, "moe", None)
    for ep in eps:
        if ep < 1:
            raise ConfigError(f"--ep: {ep} must be >= 1")
        if ep > 1 and moe is None:
            raise ConfigError(f"--ep: {ep} on {cfg.name}, a dense model (no text.moe): expert parallelism splits "
                              f"experts")
        if ep > 1 and moe.experts % ep:
            raise ConfigError(f"--ep: {ep} does not divide {cfg.name}'s {moe.experts} experts")
    return eps or (1,)


def train_flags(args, model_args: ModelArgs, best: Layout, patches: PatchRow | None) -> list[str]:
    """The `mmpipe train` flags that run the plan as planned: the preset (train's default is another model), the
    written config (precision, ZeRO, checkpointing, schedule, batch sizes, partition) and its DP, the model
    flags the plan was given (--freeze, --lora..., --max-crops) and the row's shape (--pack, --max-images, the
    vision budget, --text-len), each as train spells it."""
    rows = ([*(["--pack"] if args.pack else []), "--max-images", str(args.max_images)]
            if args.pack or args.max_images > 1 else [])
    rows += _budget(patches, " ").split() if patches else []
    ep = ["--ep", str(best.ep)] if best.ep > 1 else []
    return ["--preset", args.preset, "--ds-config", args.write_config, "--dp", str(best.dp), *ep, *to_argv(model_args),
            *rows, "--text-len", str(args.text_len)]


def fixed_first_stage(cfg: ModelConfig, args, best: Layout | None, device: Device, freeze: tuple[str, ...], lora,
                      patches: PatchRow | None) -> str:
    """The best layout with stage 0 fixed where other trainers must cut (Family.fixed_first_stage: Qwen3-VL's
    tower and decoder layers 0..2), the other stages balanced as plan balances them, predicted by the same model:
    the line `mmpipe plan` prints beside its own split; '' for a family without such a rule or a one-stage best."""
    rule = family_of(cfg).fixed_first_stage
    if rule is None or best is None or best.stages < 2:
        return ""
    rows = layer_costs(cfg, freeze, args.text_len, args.checkpointing, lora, args.max_images, patches)
    first = rule(layer_specs(cfg))
    kw = dict(dp=best.dp, micro=best.micro, gas=best.gas, precision=args.precision, zero=args.zero, device=device,
              ep=best.ep)
    rest = plan_layout(rows[first:], stages=best.stages - 1, **kw)  # its own memory per stage: stage index + 1
    head = f"stage 0 fixed at layers 0..{first - 1} (where other trainers cut {cfg.family}: Family.fixed_first_stage)"
    if not rest.parts:
        return f"{head}: the other {best.stages - 1} stages cannot hold layers {first}..{len(rows) - 1} ({rest.reason})"
    fixed = plan_layout(rows, stages=best.stages, partition=",".join(str(first + p) for p in rest.parts[:-1]), **kw)
    s0, fits = fixed.stage_rows[0], fixed.stage_rows[0]["memory_gib"] * GiB <= device.memory
    return (f"{head}, the other {best.stages - 1} balanced: step {fixed.step['step_s']:.3f} s against "
            f"{best.step['step_s']:.3f} s; its stage 0 {s0['memory_gib']:.2f} GiB"
            f"{'' if fits else f' (over {device.memory / GiB:.0f} GiB: it does not fit)'}, fwd {s0['forward_ms']:.2f} "
            f"+ bwd {s0['backward_ms']:.2f} ms against the best's slowest stage "
            f"{max(r['forward_ms'] + r['backward_ms'] for r in best.stage_rows):.2f} ms")


def _print(cfg, device, gpus, args, layouts, seconds, patches: PatchRow | None = None, beside: str = "") -> None:
    peak = (f"{device.peak_flops / 1e12:.0f} TFLOP/s" if device.peak_flops >= 1e12 else
            f"{device.peak_flops / 1e9:.1f} GFLOP/s")
    fixed = (f", + {device.microbatch_overhead * 1e3:.2f} ms per slot, + {device.step_overhead * 1e3:.2f} ms per step"
             if device.microbatch_overhead or device.step_overhead else "")
    fixed += f", + {device.split_overhead * 1e3:.2f} ms per zb-h1 W" if device.split_overhead else ""
    image = (f"{cfg.vision.n_tokens} image tokens"
             f"{f' (ViT on 1 + {cfg.vision.crop_slots - 1} crops)' if cfg.vision.crop_slots > 1 else ''}")
    print(f"{cfg.name} on {gpus} x {device.name} ({peak} at {device.efficiency:.0%}{fixed}, "
          f"{device.memory / GiB:.0f} GiB, link {device.link / 1e9:.0f} GB/s); global batch {args.global_batch}, "
          f"text {args.text_len} {'attending to' if cfg.cross_attn_layers else '+'} "
          f"{_patch_words(cfg, args, patches) if patches else image}, {args.precision}, ZeRO-{args.zero}"
          f"{', checkpointing' if args.checkpointing else ''}{', frozen: ' + args.freeze if args.freeze else ''}"
          f"{f', LoRA rank {args.lora} on {args.lora_groups} (base frozen)' if args.lora else ''}")
    images = args.max_images  # image slots M
    per_image = row_positions(cfg, 0) if not patches else 0  # an image's decoder positions N_dec
    length = row_positions(cfg, args.text_len, images, patches)
    rows = (f"{'; rows hold several samples (--pack)' if args.pack else '; one sample per row'}; global batch "
            f"and micro-batch count rows")
    if isinstance(patches, CropRow):
        print(crop_line(cfg, patches, args.text_len, length) + rows)
    elif patches:
        print(_patch_line(cfg, args, patches, length) + rows)
    elif images > 1 or args.pack:
        print(f"decoder positions per row: {images} image slots x {per_image} + {args.text_len} text = {length}" + rows)
    else:
        print(f"decoder positions per row: {per_image} image + {args.text_len} text = {length}, one sample per row")
    moe = getattr(cfg.text, "moe", None)
    if moe:
        print(_moe_line(cfg, args.text_len, length, args.precision))
    rate = (lambda lay: lay.throughput * length) if args.pack else (lambda lay: lay.throughput)
    label = "positions/s" if args.pack else "samples/s"
    replayed = [s for s in asked(args.schedule) if s is not BASELINE]  # their B / W seconds and memory in the rows
    if args.schedule == BOTH:
        _print_both(layouts, args.top, rate, label, bool(moe))
    else:
        if replayed:
            print(f"schedule {args.schedule}: step and bubble from replaying its order with each stage's forward, "
                  f"input-backward (B) and weight-backward (W) seconds; memory at its micro-batches in flight")
        _print_one(layouts, args.top, rate, label, bool(moe))
    if args.pack:
        print(f"positions/s = rows/s x {length}, padding included; useful tokens/s = positions/s x (1 - padding "
              f"share), which the data decides and plan cannot know: `mmpipe train --pack` reports it "
              f"(summary.json data.padding_share)")
    best = next((lay for lay in layouts if lay.step), None)
    if best:
        print(f"\nbest: {best.stages} stages x dp {best.dp}{f' (ep {best.ep})' if moe else ''}, micro {best.micro} "
              f"x GAS {best.gas}{', schedule ' + best.schedule if replayed else ''}")
        print(f"{'stage':>5} {'layers':>9} {'first..last':<28} {'params':>12} {'GiB':>7} {'act GiB':>8} "
              f"{'fwd ms':>8} {'bwd ms':>8}" + (f" {'B ms':>8} {'W ms':>8}" if replayed else "")
              + "".join(f" {s.short + ' GiB':>7}" for s in replayed))
        for r in best.stage_rows:
            print(f"{r['stage']:>5} {r['layers'][0]:>4}..{r['layers'][1]:<3} {r['first'] + '..' + r['last']:<28} "
                  f"{r['params']:>12,} {r['memory_gib']:>7.2f} {r['activations_gib']:>8.2f} {r['forward_ms']:>8.2f} "
                  f"{r['backward_ms']:>8.2f}" + (f" {r['input_backward_ms']:>8.2f} {r['weight_backward_ms']:>8.2f}"
                                                  if replayed else "")
                  + "".join(f" {r[s.short + '_memory_gib']:>7.2f}" for s in replayed))
        if moe:
            print("per rank: " + "; ".join(f"stage {r['stage']} {r['rank_params']:,.0f} params, all-to-all "
                                           f"{r['a2a_mib']:.1f} MiB / {r['a2a_ms']:.2f} ms a micro-batch"
                                           for r in best.stage_rows))
    if beside:
        print(beside)
    print(f"(planned in {seconds:.2f} s, nothing allocated)")


def _budget(row, between: str = " than ") -> str:
    """The row's vision budget flag and value, e.g. '--max-patches than 16384', '--max-tiles 37'."""
    return f"--max-tiles{between}{row.crops}" if isinstance(row, CropRow) else f"--max-patches{between}{row.patches}"


def _patch_words(cfg, args, patches: PatchRow) -> str:
    """The header's image part for a dynamic-resolution row: its images, each size's resized size and grid."""
    if isinstance(patches, CropRow):
        return crop_words(cfg, args, patches)
    p, m, merge = cfg.vision.patch_size, len(patches.grids), cfg.vision.merge_size ** 2
    if getattr(args, "video_frames", None):  # the row's last grids are its clip's (clip_row)
        slots = args.video_slots
        clip = patches.grids[-slots:]
        _, h, w = clip[0]
        temporal = sum(g[0] for g in clip)
        images = PatchRow(patches.patches, patches.grids[:m - slots])
        size = args.video_size or "vision.image_size"
        words = (f"a clip of {args.video_frames} frames of {size} px -> {temporal} temporal patches of {w * p}x{h * p} "
                 f"px ({temporal} x {h} x {w} patches, {temporal * h * w // merge} image tokens"
                 f"{f', {slots} slots' if slots > 1 else ''})")
        return words + (f" + {_patch_words(cfg, argparse.Namespace(**{**vars(args), 'video_frames': None}), images)}"
                        if images.grids else "")
    sizes = args.image_size.split(",") if args.image_size else [""]
    kinds = dict.fromkeys((sizes[k % len(sizes)], g) for k, g in enumerate(patches.grids))  # in order, once each
    words = [f"{f'{size} px -> ' if size else ''}{w * p}x{h * p} px ({h} x {w} patches, {t * h * w // merge} image "
             f"tokens{' each' if len(kinds) == 1 and m > 1 else ''})" for size, (t, h, w) in kinds]
    return f"{m} image{'s' if m > 1 else ''} " + ("of " + words[0] if len(kinds) == 1 else "(" + "; ".join(words) + ")")


def _patch_line(cfg, args, patches: PatchRow, length: int) -> str:
    """A dynamic-resolution row's budgets: patches used of P, decoder positions of L."""
    merge, m = cfg.vision.merge_size ** 2, len(patches.grids)
    return (f"vision patches per row: {patches.used} of --max-patches {patches.patches} "
            f"({1 - patches.used / patches.patches:.0%} padding); decoder positions per row: {m} x 2 brackets + "
            f"{patches.patches // merge} image ({patches.used // merge} used) + {args.text_len} text = {length}")


def _print_one(layouts, top, rate=lambda lay: lay.throughput, label: str = "samples/s", moe: bool = False) -> None:
    """moe: an EP column after DP and the all-to-all's share of the step (`a2a`) after the step."""
    w = max(10, len(label))
    ep = (lambda lay: f" {lay.ep:>3}") if moe else (lambda lay: "")
    a2a = (lambda lay: f" {lay.step['a2a_share']:>6.1%}" if lay.step else f" {'':>6}") if moe else (lambda lay: "")
    print(f"{'PP':>3} {'DP':>3}{' EP' if moe else ''} {'micro':>5} {'GAS':>4} {'bubble':>7} {'step s':>8}"
          f"{'    a2a' if moe else ''} {label:>{w}} {'max GiB':>8}  partition / why not")
    for lay in layouts[:top] + [lay for lay in layouts[top:] if not lay.step][:3]:
        if lay.step:
            peak = max(lay.step.get("memory_gib") or [r["memory_gib"] for r in lay.stage_rows])
            print(f"{lay.stages:>3} {lay.dp:>3}{ep(lay)} {lay.micro:>5} {lay.gas:>4} {lay.step['bubble']:>7.1%} "
                  f"{lay.step['step_s']:>8.3f}{a2a(lay)} {rate(lay):>{w}.1f} {peak:>8.1f}  {lay.parts}")
        else:
            print(f"{lay.stages:>3} {lay.dp:>3}{ep(lay)} {lay.micro:>5} {lay.gas:>4} {'':>7} {'':>8}{a2a(lay)} "
                  f"{'':>{w}} {'':>8}  does not fit: {lay.reason}")


def _moe_line(cfg: ModelConfig, text_len: int, length: int, precision: str) -> str:
    """An MoE model's parameters (total, active per token, the experts --ep splits) and what each block's
    all-to-all moves per row (costmodel.all_to_all)."""
    from .costmodel import BYTES, moe_param_counts
    m, n = cfg.text.moe, moe_param_counts(cfg)
    per_row = length * m.top_k * cfg.text.dim * BYTES[precision]
    return (f"MoE: {m.experts} experts, top {m.top_k}, in {n['blocks']} blocks: {n['total']:,} parameters, "
            f"{n['active']:,} active per token, {n['experts']:,} in experts (1 / EP of them per rank); each block's "
            f"all-to-all {length} positions x {m.top_k} x {cfg.text.dim} x {BYTES[precision]} B = "
            f"{per_row / 2 ** 20:.3g} MiB a row, 2 forward + 2 backward, (EP - 1) / EP of it off the rank")


def _print_both(layouts, top, rate=lambda lay: lay.throughput, label: str = "samples/s", moe: bool = False) -> None:
    """One row per layout: every schedule's bubble and step, which is faster and by how much (moe: an EP column)."""
    w = max(10, len(label))
    cols = [(s, len(s.name) + 4) for s in SCHEDULES]  # a bubble column as wide as '<name> bub'
    print(f"{'PP':>3} {'DP':>3}{' EP' if moe else ''} {'micro':>5} {'GAS':>4} "
          + " ".join(f"{s.name + ' bub':>{n}} {s.name + ' s':>8}" for s, n in cols)
          + f"  {'faster':<15} {label:>{w}} {'max GiB':>8}  partition / why not")
    for lay in layouts[:top] + [lay for lay in layouts[top:] if not lay.step][:3]:
        ep = f" {lay.ep:>3}" if moe else ""
        if not lay.step:
            print(f"{lay.stages:>3} {lay.dp:>3}{ep} {lay.micro:>5} {lay.gas:>4} "
                  + " ".join(f"{'':>{n}} {'':>8}" for _, n in cols)
                  + f"  {'':<15} {'':>{w}} {'':>8}  does not fit: {lay.reason}")
            continue
        steps = " ".join(f"{lay.predictions[s.name]['bubble']:>{n}.1%} {lay.predictions[s.name]['step_s']:>8.3f}"
                         for s, n in cols)
        peak = max(lay.step.get("memory_gib") or [r["memory_gib"] for r in lay.stage_rows])
        print(f"{lay.stages:>3} {lay.dp:>3}{ep} {lay.micro:>5} {lay.gas:>4} {steps}  {_faster(lay):<15} "
              f"{rate(lay):>{w}.1f} {peak:>8.1f}  {lay.parts}")


def _faster(lay: Layout) -> str:
    """The schedule the layout runs fastest (lay.schedule) and its gain over the baseline's step; when that is
    the baseline, why: another schedule does not fit ('zb: mem') or is no faster ('equal')."""
    base = lay.predictions[BASELINE.name]["step_s"]
    if lay.schedule != BASELINE.name:
        return f"{lay.schedule} {1 - lay.step['step_s'] / base:.1%}"
    crowded = [s.short for s in SCHEDULES if not lay.predictions[s.name].get("fits", True)]
    if crowded:
        return f"{BASELINE.name} ({', '.join(crowded)}: mem)"
    equal = any(lay.predictions[s.name]["step_s"] == base for s in SCHEDULES if s is not BASELINE)
    return BASELINE.name + (" (equal)" if equal else "")
