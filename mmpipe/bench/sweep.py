"""The sweep file: fields, defaults, checks, and its expansion into variants.

Everything is checked before any run starts; a problem is one line naming the field (exit 2).
A variant that is well formed but that mmpipe or DeepSpeed refuses (e.g. fp16 without ZeRO) is
NOT a sweep-file error: it is recorded as a failed variant with its reason, like a crash.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import ConfigError, read_json
from ..model.builder import FREEZE_GROUPS
from ..planning.costmodel import KNOWN_DEVICES
from ..planning.schedule_registry import BASELINE, SCHEDULE_NAMES

# variant field -> (type check, description of the valid values)
VARIANT_FIELDS = {
    "name": (lambda v: isinstance(v, str) and v and all(c.isalnum() or c in "-_." for c in v),
             "a non-empty name of letters, digits, - _ ."),
    "preset": (lambda v: isinstance(v, str) and v, "a preset name or model JSON path"),
    "stages": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "dp": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "ep": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
           "an integer >= 1 dividing dp (mmpipe train --ep: an MoE model's experts split over groups of ep of the "
           "dp ranks)"),
    "tp": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
           "an integer >= 1 (mmpipe train --tp: each stage's layers split over tp ranks; world = stages x dp x tp)"),
    "sp": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
           "an integer >= 1 (mmpipe train --sp: each row's positions split over sp ranks of a stage; world = stages "
           "x dp x sp)"),
    "zero": (lambda v: v in (0, 1, 2, 3) and not isinstance(v, bool), "0 or 1 (pipeline), 1, 2 or 3 (engine 'dp')"),
    "precision": (lambda v: v in ("fp32", "bf16", "fp16"), "fp32, bf16 or fp16"),
    "micro": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "gas": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "checkpointing": (lambda v: isinstance(v, bool), "true or false"),
    "partition": (lambda v: isinstance(v, str) and v, "balanced, uniform, parameters, best or boundaries '3,7'"),
    "data_workers": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                     "an integer >= 0 (loader worker processes on the first stage)"),
    "engine": (lambda v: v in ("pipe", "dp"), "'pipe' (PipelineEngine) or 'dp' (DeepSpeed's ordinary engine, "
                                              "no pipeline)"),
    "pack": (lambda v: isinstance(v, bool), "true or false (mmpipe train --pack: several samples per row)"),
    "max_images": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                   "an integer >= 1, or null for mmpipe train's default (1; with pack, what the data fills a "
                   "row with) (mmpipe train --max-images: image slots per row)"),
    "text_len": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 2),
                 "an integer >= 2, or null for the data's default (mmpipe train --text-len)"),
    "schedule": (lambda v: v in SCHEDULE_NAMES,
                 f"{' or '.join(SCHEDULE_NAMES)} (mmpipe train --schedule, docs/schedules.md)"),
    "freeze": (lambda v: isinstance(v, str) and (v == "" or all(g in FREEZE_GROUPS for g in v.split(","))),
               f"'' (nothing frozen) or comma-separated groups of {', '.join(FREEZE_GROUPS)} (mmpipe train --freeze)"),
}
VARIANT_DEFAULTS = {"preset": "small", "stages": 1, "dp": 1, "ep": 1, "tp": 1, "sp": 1, "zero": 0, "precision": "fp32",
                    "micro": 16, "gas": 4, "checkpointing": False, "partition": "best", "data_workers": 2,
                    "engine": "pipe", "pack": False, "max_images": None, "text_len": None, "schedule": BASELINE.name,
                    "freeze": ""}
PEERS = ("hf", "torch_pipe", "torch_pipe_zb")
TOP_FIELDS = {"name", "steps", "warmup_steps", "repeats", "timeout_s", "base", "grid", "variants", "peers",
              "device", "peak_flops", "targets", "data", "_comment"}
TARGET_ROLES = ("pp1", "pp2", "hf_base")


@dataclass
class Variant:
    name: str
    preset: str = "small"
    stages: int = 1
    dp: int = 1
    ep: int = 1  # --ep: expert-parallel ranks, dividing dp (an MoE preset; mmpipe train refuses it on a dense one)
    tp: int = 1  # --tp: tensor-parallel ranks of each stage (a family with a tp_plan; docs/tensor_parallel.md)
    sp: int = 1  # --sp: sequence-parallel ranks of each stage (a family with an sp_plan; docs/sequence_parallel.md)
    zero: int = 0
    precision: str = "fp32"
    micro: int = 16
    gas: int = 4
    checkpointing: bool = False
    partition: str = "best"
    data_workers: int = 2  # mmpipe train's --data-workers
    engine: str = "pipe"
    pack: bool = False  # mmpipe train's --pack: several whole samples per row
    max_images: int | None = None  # --max-images: image slots per row (and images per sample for LLaVA); None:
    # train's rule (1; with pack, mmpipe.data.dataset.packed_image_slots)
    text_len: int | None = None  # --text-len; None: the data's default (the shapes set's 12)
    schedule: str = BASELINE.name  # the DeepSpeed JSON's pipeline.schedule (--schedule): 1f1b, zb-h1 or dualpipev
    freeze: str = ""  # --freeze: comma-separated groups (vision, projector, text) whose weights do not train

    @property
    def world(self) -> int:
        return self.stages * self.dp * self.tp * self.sp

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sweep:
    name: str
    steps: int
    warmup_steps: int
    repeats: int
    timeout_s: int
    variants: list[Variant]
    peers: list[str] = field(default_factory=list)
    device: str | None = None       # a KNOWN_DEVICES key or "cpu"; None: detect
    peak_flops: float | None = None  # per device, overrides the table / the CPU measurement
    targets: dict = field(default_factory=dict)  # role (pp1, pp2, hf_base) -> variant name
    data: str = "shapes"  # every run's --data: 'shapes' or a path (relative ones resolved against the sweep file)

    def peer_shape(self) -> Variant:
        """The shapes and batch the peers run: the 'pp2' variant's, else the first variant's."""
        name = self.targets.get("pp2")
        return next((v for v in self.variants if v.name == name), self.variants[0])


def _check_variant(d: dict, where: str, problems: list[str]) -> None:
    for k, v in d.items():
        if k not in VARIANT_FIELDS:
            problems.append(f"{where}: unknown key '{k}' (valid: {', '.join(VARIANT_FIELDS)})")
        elif not VARIANT_FIELDS[k][0](v):
            problems.append(f"{where}.{k}: {v!r} must be {VARIANT_FIELDS[k][1]}")


def _int_field(data: dict, key: str, default: int, minimum: int, problems: list[str]) -> int:
    v = data.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        problems.append(f"{key}: {v!r} must be an integer >= {minimum}")
        return default
    return v


def _auto_name(d: dict, keys) -> str:
    short = {"stages": "pp", "dp": "dp", "ep": "ep", "tp": "tp", "sp": "sp", "zero": "z", "micro": "mb", "gas": "gas",
             "checkpointing": "ckpt", "data_workers": "w", "partition": "part-", "precision": "", "engine": "",
             "preset": "", "max_images": "img", "text_len": "tl", "schedule": ""}
    parts = []
    for k in keys:
        v = d[k]
        if k == "checkpointing":
            parts.append("ckpt" if v else "nockpt")
        elif k == "pack":
            parts.append("pack" if v else "nopack")
        elif k == "text_len" and v is None:
            parts.append("tldefault")
        elif k == "max_images" and v is None:
            parts.append("imgauto")
        elif k == "freeze":
            parts.append("frozen-" + v.replace(",", "-") if v else "trainable")
        else:
            parts.append(f"{short.get(k, k)}{v}")
    return "_".join(parts) or "base"


def parse(data, source: str = "sweep") -> Sweep:
    """A sweep file's JSON -> Sweep, or ConfigError with one line per problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must hold a JSON object")
    problems: list[str] = []
    for k in data:
        if k not in TOP_FIELDS:
            problems.append(f"{k}: unknown key (valid: {', '.join(sorted(TOP_FIELDS - {'_comment'}))})")
    steps = _int_field(data, "steps", 12, 2, problems)
    warmup = _int_field(data, "warmup_steps", 2, 0, problems)
    if warmup >= steps:
        problems.append(f"warmup_steps: {warmup} leaves no measured step of {steps} steps")
    repeats = _int_field(data, "repeats", 1, 1, problems)
    timeout = _int_field(data, "timeout_s", 900, 10, problems)
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        problems.append(f"name: {name!r} must be a non-empty string")
    base = data.get("base", {})
    if not isinstance(base, dict):
        problems.append("base: must be an object of variant fields")
        base = {}
    _check_variant(base, "base", problems)
    if "name" in base:
        problems.append("base.name: a name belongs to one variant, not to base")
    grid, variants_in = data.get("grid"), data.get("variants")
    if grid is None and variants_in is None:
        problems.append("grid / variants: give one (grid: cross product of field lists; variants: a list)")
    raw = (_grid_variants(grid, base, problems) if grid is not None else []) + (
        _listed_variants(variants_in, base, problems) if variants_in is not None else [])
    names = [d["name"] for d in raw]
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"variants: name '{n}' is used twice; names pick the output folders")
    for d in raw:
        # what cannot be run at all, whatever DeepSpeed says: the engine's shape
        if d.get("engine") == "dp" and d.get("stages") != 1:
            problems.append(f"variant '{d['name']}': engine 'dp' runs without a pipeline, so stages must be 1 "
                            f"(got {d['stages']})")
        many = isinstance(d.get("max_images"), int) and d["max_images"] > 1
        if d.get("engine") == "dp" and (d.get("pack") is True or many):
            problems.append(f"variant '{d['name']}': engine 'dp' trains one-sample rows; pack / max_images > 1 "
                            f"need engine 'pipe'")
        ep, dp = d.get("ep"), d.get("dp")
        if isinstance(ep, int) and isinstance(dp, int) and ep > 1 and dp % ep:
            problems.append(f"variant '{d['name']}': ep {ep} does not divide dp {dp} (each expert-parallel group "
                            f"is ep of a stage's dp ranks)")
        if isinstance(d.get("tp"), int) and d["tp"] > 1 and d.get("engine") == "dp":
            problems.append(f"variant '{d['name']}': engine 'dp' has no tensor parallelism; tp > 1 needs engine "
                            "'pipe'")
        if isinstance(d.get("sp"), int) and d["sp"] > 1 and d.get("engine") == "dp":
            problems.append(f"variant '{d['name']}': engine 'dp' has no sequence parallelism; sp > 1 needs engine "
                            "'pipe'")
        if isinstance(ep, int) and ep > 1 and d.get("engine") == "dp":
            problems.append(f"variant '{d['name']}': engine 'dp' has no expert parallelism; ep > 1 needs engine "
                            f"'pipe'")
    peers = data.get("peers", [])
    if not isinstance(peers, list) or any(p not in PEERS for p in peers):
        problems.append(f"peers: {peers!r} must be a list of {', '.join(PEERS)}")
        peers = []
    device, peak = data.get("device"), data.get("peak_flops")
    _check_device(device, peak, problems)
    tg = _targets(data.get("targets", {}), names, problems)
    data_arg = _data(data.get("data", "shapes"), source, problems)
    if problems:
        raise ConfigError("\n".join(problems))
    return Sweep(name, steps, warmup, repeats, timeout, [Variant(**d) for d in raw], peers, device,
                 float(peak) if peak else None, tg, data_arg)


def _data(value, source: str, problems: list[str]) -> str:
    """The sweep's `data`: 'shapes' (the built-in set), or a path, relative ones taken from the sweep
    file's folder and made absolute (runs start elsewhere: each variant's folder, a Slurm node)."""
    if not isinstance(value, str) or not value:
        problems.append(f"data: {value!r} must be 'shapes' or a path to data mmpipe train --data reads")
        return "shapes"
    if value == "shapes":
        return value
    return str((Path(source).parent / Path(value).expanduser()).absolute())


def _grid_variants(grid, base: dict, problems: list[str]) -> list[dict]:
    """The cross product of the grid's field lists, on top of base, each named after its values."""
    if not isinstance(grid, dict) or not grid:
        problems.append("grid: must be an object mapping variant fields to non-empty lists")
        return []
    ok = True
    for k, vals in grid.items():
        if k == "name" or k not in VARIANT_FIELDS:
            problems.append(f"grid: unknown key '{k}' (valid: {', '.join(f for f in VARIANT_FIELDS if f != 'name')})")
            ok = False
        elif not isinstance(vals, list) or not vals:
            problems.append(f"grid.{k}: must be a non-empty list")
            ok = False
        else:
            bad = [v for v in vals if not VARIANT_FIELDS[k][0](v)]
            problems += [f"grid.{k}: {v!r} must be {VARIANT_FIELDS[k][1]}" for v in bad]
            ok = ok and not bad
    if not ok:
        return []
    keys = list(grid)
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        d = {**VARIANT_DEFAULTS, **base, **dict(zip(keys, combo))}
        out.append({**d, "name": _auto_name(d, keys)})
    return out


def _listed_variants(variants_in, base: dict, problems: list[str]) -> list[dict]:
    if not isinstance(variants_in, list) or not variants_in:
        problems.append("variants: must be a non-empty list of objects")
        return []
    out = []
    for i, v in enumerate(variants_in):
        if not isinstance(v, dict):
            problems.append(f"variants[{i}]: must be an object")
            continue
        _check_variant(v, f"variants[{i}]", problems)
        out.append({"name": f"v{i}", **VARIANT_DEFAULTS, **base, **v})
    return out


def _check_device(device, peak, problems: list[str]) -> None:
    if device is not None and device != "cpu" and device not in KNOWN_DEVICES:
        problems.append(f"device: {device!r} is not known (valid: cpu, {', '.join(KNOWN_DEVICES)}); "
                        f"or give peak_flops")
    if peak is not None and (not isinstance(peak, (int, float)) or isinstance(peak, bool) or peak <= 0):
        problems.append(f"peak_flops: {peak!r} must be a positive number (FLOP/s per device)")


def _targets(tg, names: list[str], problems: list[str]) -> dict:
    if not isinstance(tg, dict):
        problems.append("targets: must map roles (pp1, pp2, hf_base) to variant names")
        return {}
    for role, vname in tg.items():
        if role not in TARGET_ROLES:
            problems.append(f"targets: unknown role '{role}' (valid: {', '.join(TARGET_ROLES)})")
        elif vname not in names:
            problems.append(f"targets.{role}: no variant named {vname!r}")
    return tg


def load(path: str) -> Sweep:
    data = read_json(path, path, "sweep file not found")
    sweep = parse(data, str(path))
    if sweep.data != "shapes" and not Path(sweep.data).exists():
        raise ConfigError(f"data: {data['data']!r} not found (relative paths start from the sweep file's folder: "
                          f"{sweep.data})")
    return sweep
