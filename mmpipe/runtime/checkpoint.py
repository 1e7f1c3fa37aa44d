"""Reading DeepSpeed pipeline checkpoints outside the engine.

Layout (one directory per tag): layer_XX-model_states.pt per layer (written by data-parallel
rank 0 of the stage that owns it; a --tp run's layer_XX-model_RR-model_states.pt per layer and TP rank,
read at any TP by mmpipe.runtime.reshard), mp_rank_SS_model_states.pt per stage (optimizer, counters,
client state), plus a `latest` file naming the newest tag. DeepSpeed's zero_to_fp32.py does not
understand pipeline checkpoints, so consolidation reads the layer files directly; they do not
depend on the stage count that wrote them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..model.builder import ReferenceModel
from ..model.lora import merge_adapters, read_lora
from . import reshard, rng
from .reshard import layer_files, layer_state


def latest_tag(ckpt_dir: str | Path) -> str | None:
    f = Path(ckpt_dir) / "latest"
    return f.read_text().strip() if f.is_file() else None


def load_reference(ckpt_dir: str | Path, cfg: ModelConfig, tag: str | None = None, *, merged: bool = False
                   ) -> ReferenceModel:
    """The single-device model with every layer's weights from a pipeline checkpoint of any stage count;
    a LoRA run's (lora.json beside checkpoints/) with its adapters, or with them folded into the base
    weights (`merged`: what generate, eval and export use - plain names, no adapter overhead)."""
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir} (no 'latest' file)")
    from ..registry import family_of
    model, plan = ReferenceModel(cfg, lora=read_lora(Path(ckpt_dir).parent)), family_of(cfg).tp_plan
    for idx, layer in enumerate(model):
        if not layer_files(Path(ckpt_dir) / tag, idx) and not layer.state_dict():
            continue  # a tied layer's later use (LM head through TiedLayerSpec): DeepSpeed writes no file for it
        # a --tp run's files (one per TP rank) gathered along the plan's split dims (mmpipe.runtime.reshard)
        layer.load_state_dict(layer_state(Path(ckpt_dir) / tag, idx, lambda layer=layer: layer, plan=plan))
    return merge_adapters(model) if merged else model


# ---- writing: atomic, fsynced, pruned -----------------------------------------------------------
#
# DeepSpeed writes <dir>/<tag>/ from every stage and then has global rank 0 write `latest`
# without waiting for the others and without flushing anything to disk. mmpipe instead saves
# under a temporary tag, fsyncs every file, waits for every rank, renames the directory to its
# final tag and only then replaces `latest` (a write to a temporary file + os.replace). A crash at
# any point leaves `latest` naming the previous complete checkpoint.

TMP_PREFIX = ".tmp-"
STATE_FILE = "mmpipe_state.json"   # run state every rank can read (step, samples, layout, schedule)
RANK_DIR = "rank_state"            # rank_state/rank<R>.json: that rank's RNG states


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        try:
            if not f.is_file():
                continue
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            # another rank's `x.json.PID.tmp`, renamed between the listing and the open: its writer
            # fsynced it before the rename (_write_json_atomic). Seen as a rank crashing in save
            # under load (tests/test_validation.py at PP=4), the others then stuck in the barrier.
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoints (step<N> directories), oldest first."""
    tags = [p.name for p in Path(ckpt_dir).glob("step*") if p.is_dir() and p.name[4:].isdigit()]
    return sorted(tags, key=lambda t: int(t[4:]))


def remove_partial(ckpt_dir: Path) -> list[str]:
    """Delete what a crash during a save left behind (temporary tags); returns their names."""
    gone = []
    for p in Path(ckpt_dir).glob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name)
    return gone


def prune(ckpt_dir: Path, keep: int) -> list[str]:
    """Keep the newest `keep` checkpoints (0 = all); never the one `latest` names."""
    if keep <= 0:
        return []
    latest = latest_tag(ckpt_dir)
    tags = step_tags(ckpt_dir)
    doomed = [t for t in tags[:-keep] if t != latest]
    for t in doomed:
        shutil.rmtree(Path(ckpt_dir) / t, ignore_errors=True)
    return doomed


def save(engine, ckpt_dir: str | Path, step: int, state: dict, *, keep: int, rank_state: dict) -> str:
    """Every rank calls this at the same step. Returns the committed tag."""
    import torch.distributed as dist
    ckpt_dir = Path(ckpt_dir)
    tag, tmp_tag = f"step{step}", f"{TMP_PREFIX}step{step}"
    rank = dist.get_rank()
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=state, save_latest=False)  # ends in a barrier
    tmp = ckpt_dir / tmp_tag
    (tmp / RANK_DIR).mkdir(exist_ok=True)
    _write_json_atomic(tmp / RANK_DIR / f"rank{rank}.json", rank_state)
    if rank == 0:
        _write_json_atomic(tmp / STATE_FILE, state)
    _fault("kill-in-save", step)
    _fsync_tree(tmp)  # each rank flushes; on a shared file system that covers its own files too
    dist.barrier()
    if rank == 0:
        final = ckpt_dir / tag
        if final.exists():  # a step saved again after a resume from an older checkpoint
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        tmp_latest = ckpt_dir / f"latest.{os.getpid()}.tmp"
        tmp_latest.write_text(tag)
        with open(tmp_latest) as f:
            os.fsync(f.fileno())
        os.replace(tmp_latest, ckpt_dir / "latest")
        _fsync_dir(ckpt_dir)
        prune(ckpt_dir, keep)
    dist.barrier()
    return tag


def read_state(ckpt_dir: str | Path, tag: str | None = None) -> dict | None:
    tag = tag or latest_tag(ckpt_dir)
    f = Path(ckpt_dir) / str(tag) / STATE_FILE
    return json.loads(f.read_text()) if tag and f.is_file() else None


def read_rank_state(ckpt_dir: str | Path, tag: str, rank: int) -> dict | None:
    f = Path(ckpt_dir) / tag / RANK_DIR / f"rank{rank}.json"
    return json.loads(f.read_text()) if f.is_file() else None


def _fault(name: str, step: int) -> None:
    """Test hook: MMPIPE_FAULT=kill-in-save:STEP:RANK SIGKILLs that rank at that point, so the tests
    can crash a run exactly mid-save. Unset in normal runs."""
    spec = os.environ.get("MMPIPE_FAULT", "")
    if not spec.startswith(name + ":"):
        return
    import torch.distributed as dist
    _, at_step, at_rank = spec.split(":")
    if int(at_step) == step and int(at_rank) == dist.get_rank():
        os.kill(os.getpid(), signal.SIGKILL)


# ---- loading DeepSpeed's files without unpickling code ----------------------------------------

def _safe_globals() -> list:
    """The non-tensor classes DeepSpeed 0.19.8 pickles into its checkpoints (fp16 loss scalers,
    ZeRO-1's stage enum and fragment addresses): data holders, allowed by name."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [DynamicLossScaler, LossScaler, ZeroStageEnum, fragment_address]


def make_loads_safe(engine) -> None:
    """DeepSpeed reads checkpoints with torch.load(weights_only=False), which runs whatever a
    pickle says. Route every engine read (layers, optimizer, ZeRO shards) through weights_only=True
    with only DeepSpeed's own data classes allowed: a tampered checkpoint is refused, not run."""
    import pickle
    allowed = _safe_globals()

    def load(path, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise SystemExit(f"mmpipe: error: {path}: refused to load: it holds objects other than tensors and "
                             f"plain data ({str(e).split('WeightsUnpickler error: ')[-1].splitlines()[0]})") from None

    engine.checkpoint_engine.load = load


# ---- resuming, also under another stage count ---------------------------------------------------

def run_state(engine, run, args, step: int, samples: int, fingerprint, counters: dict) -> dict:
    """What mmpipe_state.json holds: enough to continue on any layout."""
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return {"step": step, "samples": samples, "seed": args.seed, "total_steps": args.steps,
            "data_fingerprint": fingerprint, "stages": run.stages, "parts": run.parts, "dp": run.dp,
            "zero_stage": run.zero_stage, "precision": run.precision, "ep": run.ep, "tp": run.tp,
            "sp": run.sp, "train_batch": run.train_batch,
            "rows": row_layout(run), "lr_scheduler": sched, **counters}


# what a data position and a step's loss mean: a resume that changes any of them trains other samples
ROW_LAYOUT = {"text_len": "--text-len", "pack": "--pack", "max_images": "--max-images", "loss_norm": "--loss-norm"}


def row_layout(run) -> dict:
    return {key: getattr(run, key) for key in ROW_LAYOUT}


def check_same_rows(ckpt_dir: str | Path, run, state: dict | None = None) -> None:
    """--resume: the row layout must be the one the latest checkpoint was written with (its data position
    counts samples of those rows, e.g. 64-position rows of one sample each, not 80-position packed rows);
    ConfigError, one line naming each change and its saved value. A checkpoint older than the saved
    layout is not checked (its text length still is, by the data fingerprint for user data)."""
    tag = latest_tag(ckpt_dir)
    saved = ((state if state is not None else read_state(ckpt_dir, tag)) or {}).get("rows") or {}
    show = lambda v: ("on" if v else "off") if isinstance(v, bool) else v  # noqa: E731
    changed = [f"{flag} {show(getattr(run, key))} (saved: {show(saved[key])})" for key, flag in ROW_LAYOUT.items()
               if key in saved and saved[key] != getattr(run, key)]
    if changed:
        raise ConfigError(f"--resume: {', '.join(changed)}: {Path(ckpt_dir) / str(tag)} was written with other rows, "
                          f"so its data position means other samples; resume with the saved values")


def resume(engine, ckpt_dir: str | Path, run, *, fingerprint, rank: int) -> tuple[dict, list[str]]:
    """Load the latest checkpoint into the engine. Returns (its run state, notes to print).
    Same stages, partition, TP (and, under ZeRO-1, the same DP): everything is restored, optimizer
    moments included. Another layout: the weights (from the per-layer files, which do not depend
    on the stage count; written at another --tp, each rank reads its slices of them: mmpipe.runtime.reshard),
    step and sample counters and the LR schedule are restored; the optimizer's moments, kept per stage
    and TP rank (and per DP shard), start again from zero, with a warning; under a pure TP change (fp32, ZeRO 0)
    they are resharded as the weights are, under a pure SP change (fp32, ZeRO 0 or 1) carried whole."""
    ckpt_dir = Path(ckpt_dir)
    tag = latest_tag(ckpt_dir)
    state = read_state(ckpt_dir, tag)
    if tag is None or state is None:
        raise SystemExit(f"mmpipe: error: --resume: no complete checkpoint in {ckpt_dir}")
    if state["data_fingerprint"] != fingerprint:
        raise SystemExit("mmpipe: error: --resume: the data, tokenizer or --text-len differ from the run that wrote "
                         f"{ckpt_dir / tag}, so its data position means other samples; resume with the same data")
    try:  # the front door checked it too; a rank started some other way (Slurm, by hand) checks it here
        check_same_rows(ckpt_dir, run, state)
    except ConfigError as e:
        raise SystemExit(f"mmpipe: error: {e}") from None
    # DeepSpeed's bf16 optimizer (BF16_Optimizer, also at ZeRO 0) and ZeRO 1 keep each DP rank's part of the fp32
    # weights and moments in a file of their own (bf16_zero_pp_rank_D_mp_rank_SS_optim_states.pt): DP must match,
    # and so must --ep in bf16, whose expert shards' parts sit in those files (mmpipe.runtime.experts)
    partitioned = run.zero_stage > 0 or run.precision == "bf16"
    saved_tp = state.get("tp", 1)
    if saved_tp != run.tp:  # DeepSpeed's loader would merge or split the per-TP-rank files by Megatron's rules
        reshard.install(engine.module, run)
    # --sp: the layer files are whole layers at any SP, but DeepSpeed's stage files (optimizer, one per stage x SP
    # rank: mp_rank_<stage x SP + SP rank>) are named by the model axis SP takes, so another SP is another layout
    saved_sp = state.get("sp", 1)
    same = saved_tp == run.tp and saved_sp == run.sp and state["stages"] == run.stages and state["parts"] == run.parts
    same = same and (not partitioned or state["dp"] == run.dp) and state["precision"] == run.precision and (
        run.precision != "bf16" or state.get("ep", 1) == run.ep)
    notes = [] if saved_sp == run.sp else [f"note: {tag} was written at --sp {saved_sp}, this run is --sp {run.sp}"]
    if same and run.precision == "bf16" and run.zero_stage == 0:
        # DeepSpeed 0.19.8 loads ZeRO 0's optimizer from the stage file, which holds DP rank 0's part as one dict that
        # BF16_Optimizer.load_state_dict indexes by DP rank (KeyError), and never reads the per-rank files it saved:
        # load the rest, then those files, as its ZeRO load does (engine._load_zero_checkpoint)
        load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=False)
        if load_path is not None and not engine._load_zero_checkpoint(str(ckpt_dir), tag, load_optimizer_states=True):
            raise SystemExit(f"mmpipe: error: --resume: {ckpt_dir / tag} lacks the bf16 optimizer's per-rank files")
    elif same:
        load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    else:
        load_path, note = _load_other_layout(engine, ckpt_dir, tag, state, run)
        notes.append(note)
    if load_path is None:
        raise SystemExit(f"mmpipe: error: --resume: DeepSpeed could not load {ckpt_dir / tag}")
    mine = read_rank_state(ckpt_dir, tag, rank) if same and state["dp"] == run.dp else None
    if mine is not None:
        rng.set_state(mine["rng"])
    elif same:
        notes.append(f"note: {tag} has no RNG state for rank {rank}; random streams start afresh")
    return state, notes


def _pure_change(state: dict, run, axis: str) -> bool:
    """Only --tp or only --sp (`axis`) changed, in the layout whose optimizer is one torch AdamW per stage x model
    rank over the stage's parameters (fp32, ZeRO 0, no EP, 1F1B's one stage a rank). A TP change reshards its moments
    (reshard.optimizer_state); an SP change carries them (_sp_optimizer_state), at ZeRO-1 too (each DP rank its
    saved partition: reshard.load_zero1_across_sp)."""
    other = "sp" if axis == "tp" else "tp"
    zero = (0, 1) if axis == "sp" else (0,)
    return (state.get(axis, 1) != getattr(run, axis) and state.get(other, 1) == getattr(run, other)
            and state["stages"] == run.stages and state["parts"] == run.parts
            and state["dp"] == run.dp and state.get("zero_stage", 0) == run.zero_stage and run.zero_stage in zero
            and state["precision"] == run.precision == "fp32" and state.get("ep", 1) == run.ep == 1
            and run.schedule.engine == "PipelineEngine")


def _sp_optimizer_state(pipe, tag_dir: Path, saved_sp: int) -> dict:
    """--resume under a pure SP change: this stage's SP rank 0 optimizer (mp_rank_<stage x saved SP>: DeepSpeed's
    model-parallel rank is stage x SP + SP rank). SP splits positions, not parameters, and the gradients are summed
    over SP before the step, so every SP rank's AdamW state is the same tensors, bit for bit, whole at any SP."""
    tp_rank = pipe._grid.get_slice_parallel_rank() if pipe.tp > 1 else 0  # under --tp: this TP rank's slices
    ss = reshard.model_rank(pipe.stage_id, saved_sp, pipe.tp, tp_rank)
    path = Path(tag_dir) / f"mp_rank_{ss:02d}_model_states.pt"
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)["optimizer"]


def _load_other_layout(engine, ckpt_dir: Path, tag: str, state: dict, run) -> tuple[str | None, str]:
    """resume under another layout: the weights (resharded to another TP: reshard.install), counters and LR schedule;
    the AdamW moments resharded under a pure TP change, carried under a pure SP change,
    else restarted. Returns (DeepSpeed's load path, the note)."""
    load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_only=True,
                                          load_optimizer_states=False, load_lr_scheduler_states=False)
    resharded, carried_sp = _pure_change(state, run, "tp"), _pure_change(state, run, "sp")
    moments = resharded or carried_sp
    if resharded and load_path is not None:
        engine.optimizer.load_state_dict(reshard.optimizer_state(engine.module, ckpt_dir / tag, run, state["tp"],
                                                                 _safe_globals()))
    elif carried_sp and load_path is not None and run.zero_stage:
        if not reshard.load_zero1_across_sp(engine, ckpt_dir, tag, state.get("sp", 1)):
            raise SystemExit(f"mmpipe: error: --resume: {ckpt_dir / tag} lacks ZeRO-1's optimizer files")
    elif carried_sp and load_path is not None:
        engine.optimizer.load_state_dict(_sp_optimizer_state(engine.module, ckpt_dir / tag, state.get("sp", 1)))
    engine.global_steps, engine.global_samples = state["step"], state["samples"]
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        # DeepSpeed's schedulers load their counter only: the optimizer's groups, not loaded here, would keep
        # the initial rate (0 at a warm-up's start) for the next update; set them to the counter's rate
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration)
    saved_tp = state.get("tp", 1)
    ep = (f", ep {state.get('ep', 1)}", f", ep {run.ep}") if max(state.get("ep", 1), run.ep) > 1 else ("", "")
    tp = (f" x tp {saved_tp}", f" x tp {run.tp}") if max(saved_tp, run.tp) > 1 else ("", "")
    carried = ("the optimizer state (AdamW moments) resharded too" if resharded else
               "the optimizer state (AdamW moments) carried too (the same on every SP rank)" if carried_sp else
               "the optimizer state (AdamW moments) starts again from zero")
    return load_path, (f"{'note' if moments else 'warning'}: {tag} was written by {state['stages']} stages x dp "
                       f"{state['dp']}{tp[0]} (parts {state['parts']}, {state['precision']}{ep[0]}), this run is "
                       f"{run.stages} x dp {run.dp}{tp[1]} (parts {run.parts}, {run.precision}{ep[1]}): weights, step "
                       f"{state['step']}, data position and LR schedule carried over; {carried}")
