"""A checkpoint's layer files read at another tensor-parallel degree (issue 54, item 6): resume and --init-from
across TP (and PP) changes, resharded as each layer is loaded, nothing rewritten on disk.

A layer's files (DeepSpeed's PipelineModule.ckpt_layer_path; they do not depend on the stage count): one,
layer_XX-model_states.pt, written at TP 1 (or by SP rank 0, whole), or one per TP rank of the run that wrote it,
layer_XX-model_RR-model_states.pt, each holding that rank's slice of every tensor the family's plan splits and the
whole of every other. Rank r of a run at TP t reads, for each split tensor of whole width n along its split dim
(mmpipe.model.tensor_parallel.split_dims: a dim, or a fused weight's dim and whole part widths), the rows
[r n / t, (r + 1) n / t) of each part, from the saved ranks whose slices [s n / S, (s + 1) n / S) overlap them:
from S = 2 to t = 1 both halves concatenated, from S = 1 to t = 2 half of the one file, from S = 4 to t = 2 files
2r and 2r + 1. What is split at one degree and whole at the other (k / v of fewer kv heads than ranks: whole at
TP 4 with 2 kv heads, split at TP 2) reads as one whole slice. Every tensor the plan does not split (norms, a
`summed` or replicated module, a kv weight whole on each rank) is model rank 0's, as load_reference gathers it
(the copies are equal: they take the same, all-reduced, gradients).

Memory: the files are opened memory-mapped (torch.load mmap=True), so a rank pages in the slices it copies,
and only one layer's: the layer's state is this rank's slices (the whole layer at t = 1), never more.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..model.tensor_parallel import split_dims


def tp_problems(cfg, tp: int, flag: str = "--tp") -> list[str]:
    """Why a model cannot be split over `tp` ranks, one line each (none: it can): the checks `mmpipe train --tp`
    makes of the model (mmpipe.run_config), for the commands that split a model without training it (`mmpipe import
    --tp`, `mmpipe generate --tp`): a plan for the family, TP dividing the heads, vocabulary, FFN width and the plan's
    SIZES, the kv heads divided or dividing."""
    from ..model.tensor_parallel import tp_sizes
    from ..registry import families, family_of
    if tp < 1:
        return [f"{flag}: {tp} must be >= 1"]
    if tp == 1:
        return []
    plan = family_of(cfg).tp_plan
    if not plan:
        have = ", ".join(sorted(f.family for f in families() if f.tp_plan))
        return [f"{flag}: {tp} on {cfg.name}: the {cfg.family} family has no tensor-parallel plan yet ({have} have "
                f"one)"]
    t = cfg.text
    out = [f"{flag}: {tp} does not divide {cfg.name}'s {n} {what}" for what, n in (
        ("attention heads (text.n_heads)", t.n_heads), ("vocabulary (text.vocab_size)", t.vocab_size),
        ("FFN width (text.ff_dim)", t.ff_dim), *tp_sizes(cfg, plan)) if n % tp]
    if t.kv_heads % tp and tp % t.kv_heads:
        out.append(f"{flag}: {tp} does not divide {cfg.name}'s {t.kv_heads} KV heads (text.n_kv_heads) and is not a "
                   f"multiple of them")
    return out


def layer_files(tag_dir: Path, idx: int) -> list[Path]:
    """Layer idx's files in TP rank order: the one whole file (written at TP 1), else one per TP rank (the names sort
    by the model-axis coordinate, two digits), else none (a layer without weights: a tied head's later use)."""
    whole = Path(tag_dir) / f"layer_{idx:02d}-model_states.pt"
    return [whole] if whole.is_file() else sorted(Path(tag_dir).glob(f"layer_{idx:02d}-model_[0-9]*-model_states.pt"))


def run_plan(run_dir: Path) -> dict:
    """The tensor-parallel plan of the family of a run directory's model.json (what wrote its checkpoints)."""
    from ..config import config_from_dict
    from ..registry import family_of
    return family_of(config_from_dict(json.loads((Path(run_dir) / "model.json").read_text()), "run")).tp_plan


def meta_layer(spec, idx: int, lora=None) -> Callable[[], nn.Module]:
    """Layer idx built whole from its LayerSpec on the meta device (shapes only), with --lora's adapters where the
    run has them (their split follows their base linear's: split_dims), for layer_state's split dims."""
    def build() -> nn.Module:
        from ..model.builder import shapes_only
        from ..model.lora import add_adapters
        with shapes_only():
            layer = spec.build()
            add_adapters(layer, idx, lora, 0)  # the seed draws values the meta device does not keep
        return layer
    return build


def layer_state(tag_dir: Path, idx: int, whole: Callable[[], nn.Module], rank: int = 0, tp: int = 1,
                plan: dict | None = None) -> dict:
    """Layer idx's state dict as rank `rank` of a run at TP `tp` holds it, from a checkpoint tag directory written
    at any TP (module docstring). whole(): the layer built whole (meta_layer; called only to reshard, for the plan's
    split dims); plan: the family's (None: read from the run directory holding tag_dir, run_plan). Written at this
    TP: the rank's own file as it is, bit for bit."""
    files = layer_files(tag_dir, idx)
    if not files:
        raise FileNotFoundError(f"checkpoint {tag_dir} has no file for layer {idx}")
    if len(files) == tp:
        return torch.load(files[rank], map_location="cpu", weights_only=True)
    plan = run_plan(Path(tag_dir).parent.parent) if plan is None else plan
    layer = whole()
    saved, mine = split_dims(layer, plan, len(files)), split_dims(layer, plan, tp)
    opened: dict[int, dict] = {}

    def read(s: int) -> dict:
        if s not in opened:  # memory-mapped: only the slices copied below are read
            opened[s] = torch.load(files[s], map_location="cpu", weights_only=True, mmap=True)
        return opened[s]

    out = {}
    for key in read(0):
        dim = saved.get(key, mine.get(key))
        if dim is None:  # whole at both degrees: model rank 0's
            out[key] = read(0)[key].clone()
            continue
        src = len(files) if key in saved else 1  # split in the files, or whole in file 0
        dst, r = (tp, rank) if key in mine else (1, 0)  # this rank's slice, or the whole tensor
        out[key] = _slice(read, key, dim, src, (r, dst))
    return out


def _slice(read, key: str, dim, src: int, part: tuple[int, int]) -> torch.Tensor:
    """Slice part = (r, of) of a tensor saved as `src` slices (read(s)[key], s < src) along dim (an int, or (dim,
    whole part widths) for a fused weight: each part sliced, in order). E.g. 64 rows saved as 2 x 32, slice (1, 4):
    rows 16..31 of file 0's 32."""
    r, of = part
    d, widths = (dim, None) if isinstance(dim, int) else dim
    widths = widths or (read(0)[key].shape[d] * src,)
    pieces = []
    for p, n in enumerate(widths):
        lo, hi, per = r * n // of, (r + 1) * n // of, n // src  # wanted rows of the part; rows per saved slice
        for s in range(lo // per, -(-hi // per)):
            saved = read(s)[key].split([w // src for w in widths], d)[p]
            a, b = max(lo, s * per), min(hi, (s + 1) * per)
            pieces.append(saved.narrow(d, a - s * per, b - a))
    return torch.cat(pieces, d)


def install(pipe, run) -> None:
    """Make the PipelineModule's load_state_dir (what engine.load_checkpoint calls for the layer files) read each of
    this rank's layers through layer_state, resharded to the run's --tp (its TP rank the grid's model-axis
    coordinate), then broadcast the tied weights as DeepSpeed's own does."""
    from ..registry import family_of
    plan, tp = family_of(run.model).tp_plan, run.tp
    rank = pipe._grid.get_slice_parallel_rank() if tp > 1 else 0  # (an --sp run's model axis is not TP)

    def load_state_dir(load_dir, checkpoint_engine, strict=True):
        for _ in pipe.each_part():  # DualPipeV's two parts, else the one
            for offset, layer in enumerate(pipe.forward_funcs):
                if isinstance(layer, nn.Module) and layer.state_dict():
                    idx = pipe._local_start + offset
                    whole = meta_layer(pipe._layer_specs[idx], idx, run.lora)
                    layer.load_state_dict(layer_state(Path(load_dir), idx, whole, rank, tp, plan), strict=strict)
        pipe._synchronize_tied_weights()

    pipe.load_state_dir = load_state_dir


def _layer_key(pipe, name: str) -> tuple[int, str]:
    """(layer index, state-dict key) of a PipelineModule parameter name: DeepSpeed registers layer i as "i" and a
    tied module as "tied_modules.<key>", the layer of its first TiedLayerSpec."""
    head, _, key = name.partition(".")
    if head.isdigit():
        return int(head), key
    if head != "tied_modules":
        raise ValueError(f"resharding the optimizer: {name} is not a layer's parameter")
    from deepspeed.pipe import TiedLayerSpec
    tie, _, key = key.partition(".")
    return next(i for i, s in enumerate(pipe._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == tie), key


def model_rank(stage: int, sp: int, tp: int, tp_rank: int = 0) -> int:
    """DeepSpeed's model-parallel rank (a stage file's SS, mp_rank_SS_...) of SP rank 0's TP rank `tp_rank` of `stage`:
    the grid is pipe-major, then seq, TP innermost (runtime.pipeline.grid_topology), SS = (stage x SP + 0) x TP + TP
    rank; every SP rank's optimizer is the same (gradients summed over SP before the step), so SP rank 0's serves."""
    return stage * sp * tp + tp_rank


def optimizer_state(pipe, tag_dir: Path, run, saved_tp: int, safe_globals: list) -> dict:
    """--resume under a pure TP change (fp32, ZeRO 0, the same stages, parts, DP and EP 1): this rank's AdamW state
    dict from the saved stage's TP ranks' optimizers (mp_rank_SS_model_states.pt, SS = stage x saved TP + TP rank:
    DeepSpeed's model-parallel rank, pipe-major), each moment sliced as its parameter (module docstring); the step
    counters and the replicated parameters' moments model rank 0's. The optimizer's parameters are the stage's
    trainable ones in pipe.named_parameters() order, the same names at any TP (trainer.build_engine)."""
    from ..registry import family_of
    plan, tp = family_of(run.model).tp_plan, run.tp
    rank = pipe._grid.get_slice_parallel_rank() if tp > 1 else 0
    files = [Path(tag_dir) / f"mp_rank_{model_rank(pipe.stage_id, run.sp, saved_tp, s):02d}_model_states.pt"
             for s in range(saved_tp)]  # (SP rank 0's, under --sp)
    opened: dict[int, dict] = {}

    def read(s: int) -> dict:
        if s not in opened:
            with torch.serialization.safe_globals(safe_globals):
                opened[s] = torch.load(files[s], map_location="cpu", weights_only=True, mmap=True)["optimizer"]
        return opened[s]

    params = [(n, p) for n, p in pipe.named_parameters() if p.requires_grad]
    if sum(len(g["params"]) for g in read(0)["param_groups"]) != len(params):
        raise ValueError(f"{files[0]}: its optimizer holds another parameter count than this stage's {len(params)}")
    dims: dict[int, tuple[dict, dict]] = {}
    state = {}
    for i, (name, p) in enumerate(params):
        if i not in read(0)["state"]:
            continue  # never stepped (no gradient yet)
        idx, key = _layer_key(pipe, name)
        if idx not in dims:
            layer = meta_layer(pipe._layer_specs[idx], idx, run.lora)()
            dims[idx] = split_dims(layer, plan, saved_tp), split_dims(layer, plan, tp)
        saved, mine = dims[idx]
        dim = saved.get(key, mine.get(key))
        entry = {}
        for k, v in read(0)["state"][i].items():
            if dim is None or v.dim() == 0:
                entry[k] = v.clone()
            else:
                src, (dst, r) = (saved_tp if key in saved else 1), ((tp, rank) if key in mine else (1, 0))
                entry[k] = _slice(lambda s, k=k: {key: read(s)["state"][i][k]}, key, dim, src, (r, dst))
            if v.dim() and entry[k].shape != p.shape:
                raise ValueError(f"resharding the optimizer: {name}'s {k} came out {tuple(entry[k].shape)}, the "
                                 f"parameter is {tuple(p.shape)}")
        state[i] = entry
    return {"state": state, "param_groups": read(0)["param_groups"]}


def load_zero1_across_sp(engine, ckpt_dir: Path, tag: str, saved_sp: int) -> bool:
    """--resume under a pure SP change at ZeRO-1 (fp32, the same stages, parts and DP, EP 1): this rank's partition of
    its stage's optimizer from the files SP rank 0 of the stage saved, zero_pp_rank_D_mp_rank_<stage x saved SP>,
    D = this rank's data-parallel rank (DeepSpeed's model-parallel rank is stage x SP + SP rank, pipe-major). ZeRO-1
    partitions each SP rank's optimizer over its data axis only, and every SP rank's gradients are the same (summed
    over SP before the step), so the SP ranks' part D are the same tensors, bit for bit (tests/test_sequence_parallel
    checks it): DP rank D at the new SP loads the saved part D, through DeepSpeed's own ZeRO loader pointed at that
    model-parallel rank. False where DeepSpeed finds no such files."""
    own = engine.checkpoint_mp_rank
    tp = engine.module.tp  # under --tp this TP rank's part D of SP rank 0's
    engine.checkpoint_mp_rank = model_rank(engine.stage_id, saved_sp, tp,
                                           engine.grid.get_slice_parallel_rank() if tp > 1 else 0)
    try:
        return engine._load_zero_checkpoint(str(ckpt_dir), tag, load_optimizer_states=True)
    finally:
        engine.checkpoint_mp_rank = own
