"""What `mmpipe plan` plans, resolved and checked once before anything is costed, the way mmpipe.run_config resolves
a `RunConfig`: `resolve(args)` reads the flags and the preset and returns a `PlanRun` or raises ConfigError (one line
per problem). It changes none of its inputs (the argparse namespace keeps what the user gave).

- `PlanSpec`: what the cost model needs to list the layouts (mmpipe.planning.plan.plan): the model, the device, the
  cluster, the batch, the row, the precision and the schedules;
- `PlanRun`: the spec and what the command does with the layouts: the preset and model flags it names again in the
  train command it prints, the --schedule / --pack / --top / --json / --write-config choices, and the row's sizes as
  given (--image-size, --video-frames / --video-size) for the printed header.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from ..config import ConfigError, ModelConfig, load_preset
from ..data.args import VIDEO_FLAGS, DataArgs
from ..data.dataset import ROW_FLAGS, row_text_len
from ..data.image_kinds import image_kind, row_budget
from ..flags import degrees, from_namespace
from ..model.args import ModelArgs
from ..model.builder import check_lora_rank
from ..model.costs import CropRow, PatchRow
from ..model.lora import Lora
from ..registry import families, family_of
from .calibrate import load_profile, profile_device, profile_precision
from .costmodel import KNOWN_DEVICES, Device, layer_costs
from .data_rows import read_data, row_load, scratch, train_argv
from .images import (
    clip_media,
    clip_refusal,
    clip_row,
    families_words,
    parse_image_size,
    parse_image_sizes,
    patch_row,
    sized_families,
)
from .layout import CPU_EFFICIENCY, CPU_LINK, GiB, Training
from .schedule_registry import ALL, BASELINE, BOTH, SCHEDULE_NAMES, Schedule, asked
from .sequence_parallel import check_sp
from .tensor_parallel import check_tp, sequence_parallel_problems

PLAN_SCHEDULES = (*SCHEDULE_NAMES, BOTH, ALL)


@dataclass(frozen=True)
class PlanSpec:
    """Every PP x DP x micro (x EP) layout of `cfg` on `gpus` devices is costed from these. images: a row's image
    slots (--max-images); global_batch and micros then count rows. row: a dynamic-resolution row's budget and its
    images' grids (PatchRow) or tilings (CropRow), mmpipe.planning.images; None for a fixed-size family. eps: an MoE
    model's expert-parallel degrees (--ep), each planned for every layout whose DP it divides."""
    cfg: ModelConfig
    device: Device
    gpus: int
    global_batch: int
    micros: tuple[int, ...]
    text_len: int
    precision: str
    zero: int
    freeze: tuple[str, ...] = ()
    checkpointing: bool = False
    profile: bool = False
    lora: Lora | None = None
    schedule: tuple[Schedule, ...] = (BASELINE,)
    images: int = 1
    row: PatchRow | CropRow | None = None
    eps: tuple[int, ...] = (1,)
    tps: tuple[int, ...] = (1,)  # tensor-parallel degrees (--tp), each planned for every PP x DP of GPUs / TP
    sps: tuple[int, ...] = (1,)  # sequence-parallel degrees (--sp), each with each TP: PP x DP of GPUs / (TP x SP)
    reference: str = ""  # --dpo-reference: dpo's reference, live (a forward pass and a copy) or precomputed (none)
    load: object = None  # --data: the data's packed rows, priced (planning.data_rows.RowLoad); None: uniform rows
    # --sequence-parallel: TP's (Megatron's), at every TP above 1 (last: PlanSpec(...) is built positionally; a field
    # before `load` took its place, and --data's rows were dropped)
    sequence_parallel: bool = False

    @property
    def training(self) -> Training:
        """How each layout trains: the balanced split that fits, at the spec's precision, ZeRO and schedules."""
        return Training(self.precision, self.zero, self.device, self.schedule, "balanced", self.checkpointing,
                        self.freeze, reference=self.reference, load=self.load)


@dataclass(frozen=True)
class PlanRun:
    """One `mmpipe plan`: its spec and what it prints and writes. schedule: --schedule as given (1f1b, zb-h1,
    dualpipev, both or all; the spec holds the Schedule records). video_slots: the row's slots its clip takes (a
    Qwen3-VL clip one per temporal patch, OneVision's one; 0 without --video-frames)."""
    spec: PlanSpec
    preset: str
    model_args: ModelArgs
    schedule: str = BASELINE.name
    pack: bool = False
    top: int = 10
    json: bool = False
    write_config: str | None = None
    dry_run: bool = False
    image_size: str | None = None
    video_frames: int | None = None
    video_size: str | None = None
    video_slots: int = 0
    tp_notes: tuple[str, ...] = ()  # a line per --tp / --sp degree left out, or the family's 'planned at TP 1 only'
    data_argv: tuple[str, ...] = ()  # --data and what tokenises it, as train takes them (its printed command)

    # the spec's fields the printed words read by the flag's name
    @property
    def text_len(self) -> int:
        return self.spec.text_len

    @property
    def max_images(self) -> int:
        return self.spec.images


def resolve(args) -> PlanRun:
    """The flags of `mmpipe plan` (not --calibrate) -> the PlanRun, or ConfigError naming the first problem (a
    row's problems together, one line each), checked in the order a user meets them. A ValueError is --micro's."""
    model_args = from_namespace(ModelArgs, args)
    cfg = model_args.with_crops(load_preset(args.preset))
    cfg = from_namespace(DataArgs, args, only=VIDEO_FLAGS).with_video(cfg)
    device, precision = device_from_args(args)
    micros = tuple(int(x) for x in args.micro.split(",") if x)
    freeze, lora = model_args.frozen_groups(), model_args.adapters()
    check_lora_rank(cfg, lora)  # as train's resolve: no rank above the narrowest adapted linear's
    with scratch(getattr(args, "data_index", None), args.dry_run) as folder:
        opts, args = read_data(args, cfg, folder) if getattr(args, "data", None) else (None, args)
        row, images, text_len, clip_slots = _check_rows(args, cfg)
        table = layer_costs(cfg, freeze, text_len, args.checkpointing, lora, images, row) if opts else None
        load = row_load(opts, cfg, table, images, text_len, row.budget if row else 0, args.global_batch,
                        folder) if opts else None
    if args.profile and row:
        raise ConfigError(f"--profile: not for a dynamic-resolution preset ({cfg.family}) yet; plan it from "
                          f"--device's peak x --efficiency")
    if args.schedule not in PLAN_SCHEDULES:
        raise ConfigError(f"--schedule: {args.schedule!r} is not a schedule (valid: {', '.join(PLAN_SCHEDULES)})")
    if precision == "fp16" and args.zero != 1:
        raise ConfigError("--precision fp16 needs --zero 1 (DeepSpeed 0.19.8, see docs/configs.md)")
    gpus = args.gpus_per_node * args.nodes
    tps, tp_notes = check_tp(args.tp, cfg, args.gpus_per_node, gpus)
    if max(tps) > 1 and (args.profile or lora):
        raise ConfigError(f"--tp: {max(tps)} with {'--profile' if args.profile else '--lora'} is not planned yet "
                          f"(plan the TP degrees without it)")
    sps, sp_notes = check_sp(getattr(args, "sp", "1"), cfg, args.gpus_per_node, tps)
    sequence = getattr(args, "sequence_parallel", False)
    for why in sequence_parallel_problems(max(tps), cfg, None, 0) if sequence else ():
        raise ConfigError(why)
    if max(sps) > 1 and args.profile:
        raise ConfigError(f"--sp: {max(sps)} with --profile is not planned yet (plan the SP degrees without it)")
    spec = PlanSpec(cfg, device, gpus, args.global_batch, micros, text_len, precision,
                    args.zero, freeze, args.checkpointing, args.profile, lora, asked(args.schedule), images, row,
                    _check_ep(args.ep, cfg), tps, sps, getattr(args, "dpo_reference", None) or "", load or None)
    spec = dataclasses.replace(spec, sequence_parallel=sequence)
    return PlanRun(spec, args.preset, model_args, args.schedule, args.pack, args.top, args.json, args.write_config,
                   args.dry_run, args.image_size, args.video_frames if clip_slots else None, args.video_size,
                   clip_slots, tuple(tp_notes + sp_notes), train_argv(args) if opts else ())


def device_from_args(args) -> tuple[Device, str]:
    """The Device to plan on and the precision: --precision, else the device profile's, else bf16."""
    precision = args.precision
    if args.device_profile:
        prof = load_profile(args.device_profile)
        precision = precision or profile_precision(prof)
        base = profile_device(prof, precision)
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
    missing = [n for n, v in (("--peak-tflops", dev.peak_flops), ("--gpu-mem", dev.memory), ("--link-gbps", dev.link))
               if v <= 0]
    if missing:
        raise ConfigError(f"--device custom: give {', '.join(missing)}")
    return dev, precision or "bf16"


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


def _check_rows(args, cfg: ModelConfig) -> tuple[PatchRow | CropRow | None, int, int, int]:
    """--text-len, --max-images, --pack, --max-patches / --max-tiles, --image-size, --video-*: mmpipe train's check
    (row_text_len, row_budget) -> (the row, its image slots M, its text length, the slots its clip takes). --text-len
    defaults to what the model's context leaves, as it does for `mmpipe train --data` on your own data. The row: a
    dynamic-resolution family's PatchRow or CropRow, None for the others."""
    problems: list[str] = []
    sizes = None if args.image_size is None else parse_image_sizes(args.image_size)
    max_images = args.max_images
    if sizes and image_kind(cfg).flag is None:  # fixed-size images: no size to cost
        problems.append(f"--image-size: the {cfg.family} family resizes every image to {cfg.vision.image_size} px "
                        f"square; only {families_words(sized_families())} (images of any size in a row budget) "
                        f"cost an image size")
    elif sizes and max_images is not None and max_images < len(sizes):
        problems.append(f"--image-size: {len(sizes)} sizes for --max-images {max_images}: a row holds one image "
                        f"of each (give --max-images {len(sizes)} or more)")
    elif sizes and max_images is None:
        max_images = len(sizes)  # a row holds one image of each size
    video = _check_video(args, cfg, problems)
    images = (max_images or 0) if sizes else 0  # images beside the clip: only those given a size
    if video:  # the clip is more media of the row (one; a frame each where frames are images): the default P and
        max_images = images + clip_media(cfg, *video)  # the shares count them
    data = dataclasses.replace(from_namespace(DataArgs, args, only=ROW_FLAGS), max_images=max_images)
    text_len = row_text_len(data, cfg, None, problems)
    budget = row_budget(data, cfg, problems)
    if problems:
        raise ConfigError("\n".join(problems))
    if args.pack and max_images is None:  # train derives them from the data (data.dataset.packed_image_slots)
        print("note: --pack without --max-images: `mmpipe train` sizes a row's image slots from the data (it prints "
              "them: 'mmpipe: --pack: M image slots per row'); plan has no data and costs M = 1 - give that "
              "--max-images M here")
    if video:
        row = clip_row(cfg, budget, *video, images, sizes)
        slots = row.slots if row else max_images  # Gemma 4's fixed slots: its images and the clip's frames
        return row, slots, text_len, slots - images  # a Qwen3-VL clip: a slot per temporal patch
    return patch_row(cfg, max_images or 1, budget, sizes), max_images or 1, text_len, 0  # the row's P, or tiles' T


def _check_video(args, cfg: ModelConfig, problems: list[str]) -> tuple[int, tuple[int, int]] | None:
    """--video-frames N and --video-size WxH -> (N, (W, H)), None without them; a line per problem."""
    frames, size = args.video_frames, args.video_size
    if frames is None and size is None:
        return None
    if "video" not in family_of(cfg).media:
        readers = list(dict.fromkeys(f.family for f in families() if "video" in f.media))
        problems.append(f"--video-frames: the {cfg.family} family reads no clips; only {families_words(readers)} do")
        return None
    if clip_refusal(cfg):
        problems.append(clip_refusal(cfg))
        return None
    if frames is None or frames < 2:
        problems.append(f"--video-frames: {frames} must be given and at least 2 (a temporal patch of 2 frames)")
        return None
    return frames, parse_image_size(size) if size else (cfg.vision.image_size, cfg.vision.image_size)


def _check_ep(text: str, cfg: ModelConfig) -> tuple[int, ...]:
    """--ep N[,N...] -> the degrees, checked as `mmpipe train --ep` checks one (run_config._check_ep): each >= 1,
    above 1 only on an MoE model and dividing its experts; whether it divides a layout's DP, plan decides per
    layout."""
    eps = degrees("--ep", text)
    moe = family_of(cfg).experts(cfg)  # the family's answer: its MoE section, None for a dense decoder
    for ep in eps:
        if ep > 1 and moe is None:
            raise ConfigError(f"--ep: {ep} on {cfg.name}, a dense model (no text.moe): expert parallelism splits "
                              f"experts")
        if ep > 1 and moe.experts % ep:
            raise ConfigError(f"--ep: {ep} does not divide {cfg.name}'s {moe.experts} experts")
    return eps or (1,)
