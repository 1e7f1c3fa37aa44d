"""Resume and --init-from across TP (and PP) changes (issue 54, item 6; docs/tensor_parallel.md, "Checkpoints"):
each rank reads its slices of a checkpoint's per-layer, per-TP-rank files (mmpipe.runtime.reshard).

In-process: every TP rank's resharded state of every layer equals the plan's own split of the whole layer
(parallelize) bit for bit, from files written at TP 1, 2 and 4 to TP 1, 2 and 4 (llava-tiny: vocab, kv heads whole at
TP 4 and split at TP 2; the families of patches: Fused qkv and Gated DeltaNet parts, split parameters, summed
norms), each rank opening only the files it needs. Three launches (llava-tiny, the constant-lr, clip-engaged
config of tests/test_tensor_parallel.py): PP=2 x TP=1 for 2 steps; resumed at PP=1 x TP=2 for steps 3-5; that
resumed at PP=1 x TP=1 (one rank) for steps 6-8. Each resume's losses and weights equal the single-device
reference continued from the checkpoint's gathered weights: under the PP and TP change with fresh AdamW moments (they
are kept per stage and TP rank: restarted, said in a warning), under the pure TP change with the moments resharded as
the weights. --init-from a TP run loads its gathered weights (trainer.load_run_weights, in-process).

The chain's first launch also runs bf16 under TP (tests/rank_series.py: three 2-rank runs, one launch): llava-tiny
with 1 kv head, BF16_Optimizer at ZeRO 0, PP=1 x TP=2 against PP=2 x TP=1 on the same batches, each step's loss
within 1e-3 (the TP sum acting on p.grad instead of the optimizer's buffer gave 6.8e-3)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import TiedLayerSpec

import test_tensor_parallel
from conftest import assert_weights_moved, train_run
from mmpipe.config import load_preset
from mmpipe.model.builder import ReferenceModel, layer_specs
from mmpipe.model.lora import Lora, add_adapters
from mmpipe.model.tensor_parallel import Shard, gather_state, parallelize, split_dims
from mmpipe.registry import family_of
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime import reshard, trainer
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series
from test_tensor_parallel import SEED, STEPS, TOL, _argv

tp_config = test_tensor_parallel.tp_config  # its fixture (constant lr, clipping engaged), by name


def _split(model: ReferenceModel, idx: int, rank: int, tp: int, lora: Lora | None) -> dict:
    """What rank `rank` of a run at `tp` holds of layer idx: the plan's own split of the whole layer, then --lora's
    adapters on it (drawn whole under the layer's adapter seed, this rank's slices kept: adapters_split)."""
    layer = parallelize(copy.deepcopy(model[idx]), family_of(model.cfg).tp_plan, Shard(None, rank, tp))
    add_adapters(layer, idx, lora, SEED)
    return layer.state_dict()


def _write(model: ReferenceModel, tp: int, tag: Path, lora: Lora | None) -> None:
    """The layer files a run at `tp` writes (one whole file at TP 1, else one per TP rank), from the whole model."""
    tag.mkdir(parents=True)
    for idx, layer in enumerate(model):
        if layer.state_dict():
            for r in range(tp):
                name = f"layer_{idx:02d}" + (f"-model_{r:02d}" if tp > 1 else "") + "-model_states.pt"
                torch.save(_split(model, idx, r, tp, lora), tag / name)


def _assert_resharded(model: ReferenceModel, tag: Path, tp: int, lora: Lora | None) -> None:
    """Every rank of a run at `tp` reads from `tag` exactly its split of each whole layer of `model` (_split)."""
    plan, specs = family_of(model.cfg).tp_plan, layer_specs(model.cfg)
    for idx, layer in enumerate(model):
        if not layer.state_dict():
            continue
        for r in range(tp):
            got = reshard.layer_state(tag, idx, reshard.meta_layer(specs[idx], idx, lora), r, tp, plan)
            want = _split(model, idx, r, tp, lora)
            assert got.keys() == want.keys(), (idx, r, tp)
            assert all(torch.equal(got[k], want[k]) for k in want), (idx, type(layer).__name__, r, tp)


@pytest.mark.parametrize("preset, degrees, lora", [
    ("llava-tiny", (1, 2, 4), None), ("llava-tiny", (1, 2, 4), Lora(2, 4.0)), ("qwen-tiny", (1, 2), None),
    ("qwen3-vl-tiny", (1, 2), None), ("qwen3.5-tiny", (1, 2), None)],
    ids=["llava-tiny", "llava-tiny-lora", "qwen-tiny", "qwen3-vl-tiny", "qwen3.5-tiny"])
def test_each_rank_reads_the_plans_split_of_each_layer_from_any_tp(tmp_path, monkeypatch, preset, degrees, lora):
    """Files written at every TP the plan accepts, read at every other: each rank's state is the plan's split of the
    whole layer, bit for bit (llava-tiny's 2 kv heads are whole at TP 4 and split at TP 2; with --lora a row
    linear's A split by columns, a column's B by rows; qwen3.5-tiny's fused in_proj_qkv / conv1d parts, dt_bias /
    A_log and summed norms; qwen-tiny's Fused(3) tower qkv). A rank of TP 2 reading TP 4's files opens 3 of the 4:
    its two slices' and rank 0's (the replicated weights)."""
    model = ReferenceModel(load_preset(preset), seed=SEED)
    for saved in degrees:
        _write(model, saved, tmp_path / f"tp{saved}", lora)
    for saved in degrees:
        for tp in degrees:
            _assert_resharded(model, tmp_path / f"tp{saved}", tp, lora)
    if 4 in degrees:
        opened, load = [], torch.load
        monkeypatch.setattr(torch, "load", lambda f, *a, **kw: opened.append(Path(f).name) or load(f, *a, **kw))
        block = next(i for i, s in enumerate(layer_specs(model.cfg)) if s.typename.__name__ == "LlamaBlock")
        reshard.layer_state(tmp_path / "tp4", block, reshard.meta_layer(layer_specs(model.cfg)[block], block, lora),
                            1, 2, family_of(model.cfg).tp_plan)
        assert sorted(opened) == [f"layer_{block:02d}-model_{r:02d}-model_states.pt" for r in (0, 2, 3)]


# ---- three launches: PP=2 x TP=1 -> PP=1 x TP=2 -> PP=1 x TP=1 ---------------------------------------------------

def _resumed(src: Path, out: Path, cfg, *args: str):
    shutil.copytree(src, out)
    return train_run(out, *_argv(cfg, "--resume", *args)).check()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tp_config):
    """The 2-rank runs that start from scratch, one launch (tests/rank_series.py): the chain's PP=2 x TP=1 (2 steps),
    and the bf16 pair (_bf16): PP=1 x TP=2 and PP=2 x TP=1."""
    tmp = tmp_path_factory.mktemp("reshard")
    bf16 = _bf16(tmp, tp_config)
    runs = [(tmp / "pp2", _argv(tp_config, "--stages", "2", "--steps", "2"), {}),
            (tmp / "bf16_tp2", _argv(*bf16, "--stages", "1", "--tp", "2"), {}),
            (tmp / "bf16_tp1", _argv(*bf16, "--stages", "2"), {})]
    return dict(zip(("pp2", "bf16_tp2", "bf16_tp1"), launch_series(runs)))


@pytest.fixture(scope="module")
def chain(two_rank_runs, tp_config):
    pp2 = two_rank_runs["pp2"].check()
    tmp = pp2.out.parent
    tp2 = _resumed(pp2.out, tmp / "tp2", tp_config, "--stages", "1", "--tp", "2", "--steps", "5")
    tp1 = _resumed(tp2.out, tmp / "tp1", tp_config, "--stages", "1", "--steps", "8")
    return pp2, tp2, tp1


def _continued(cfg_path, run_dir: Path, start: int, steps: int):
    """(model, losses) of the single-device reference from run_dir's latest (gathered) weights after `start` steps:
    fresh AdamW, the schedule and the data from step start + 1 on."""
    run = resolve(TrainArgs.from_argv(_argv(cfg_path, "--stages", "1", "--init-from", str(run_dir))), world_size=1)
    return train_reference(run, seed=SEED, steps=steps, start=start)


def _assert_continues(resumed, before, reference, start: int) -> None:
    """resumed's steps after `start`: losses and its last checkpoint's gathered weights equal the reference's
    (model, losses from step start + 1 on; 1e-5), and every tensor moved more than 10 x that from `before`'s
    checkpoint (step `start`)."""
    ref_model, ref_losses = reference
    steps = len(resumed.losses) - start
    assert sorted(resumed.losses) == list(range(1, start + steps + 1))
    for step, ref in enumerate(ref_losses[:steps], start=start + 1):
        assert resumed.losses[step] == pytest.approx(ref, abs=TOL), (step, resumed.losses, ref_losses)
    cfg = load_preset("llava-tiny")
    got, ref = load_reference(resumed.out / "checkpoints", cfg).state_dict(), ref_model.state_dict()
    diff = {k: (v - ref[k]).abs().max().item() for k, v in got.items()}
    assert max(diff.values()) < TOL, {k: d for k, d in diff.items() if d >= TOL}
    start_weights = load_reference(before.out / "checkpoints", cfg).state_dict()  # k_proj.bias: softmax cancels it
    assert_weights_moved({k: v for k, v in got.items() if "k_proj.bias" not in k}, start_weights, TOL)


def test_a_pp2_tp1_checkpoint_resumes_at_pp1_tp2(chain, tp_config):
    """PP and TP changed: the TP=1 files (one per layer) split by the plan on each of the 2 TP ranks, the moments
    restarted (said in a warning): steps 3-5 equal the reference continued from step 2's weights with fresh moments,
    and the checkpoint it writes holds one file per TP rank. The restart shows: the reference that kept the moments
    (uninterrupted) is elsewhere at step 4."""
    pp2, tp2, _ = chain
    out = tp2.proc.stdout
    assert "written by 2 stages x dp 1 x tp 1 (parts" in out and "this run is 1 x dp 1 x tp 2 (parts" in out, \
        out[-2000:]
    assert "starts again from zero" in out
    assert len(list((tp2.out / "checkpoints" / "step5").glob("layer_*-model_01-model_states.pt"))) > 3
    fresh = _continued(tp_config, pp2.out, 2, 3)
    _assert_continues(tp2, pp2, fresh, 2)
    kept = train_reference(resolve(TrainArgs.from_argv(_argv(tp_config, "--stages", "1")), world_size=1), seed=SEED,
                           steps=4)[1]
    assert abs(fresh[1][1] - kept[3]) > 10 * TOL, (fresh[1], kept)


def test_a_tp2_checkpoint_resumes_at_pp1_tp1_on_one_rank_moments_too(chain, tp_config):
    """Only TP changed (1 stage, fp32, ZeRO 0): both TP ranks' files of each layer concatenated on the one rank, and
    the AdamW moments of both TP ranks' optimizers too (reshard.optimizer_state): steps 6-8 equal the reference that
    trains on from step 2 with the moments kept since (the run that wrote step 5 restarted them at step 2). Had the
    moments restarted at step 5, step 7 would be elsewhere."""
    pp2, tp2, tp1 = chain
    out = tp1.proc.stdout
    assert "written by 1 stages x dp 1 x tp 2 (parts" in out and "this run is 1 x dp 1 x tp 1 (parts" in out, \
        out[-2000:]
    assert "AdamW moments) resharded too" in out, out[-2000:]
    model, losses = _continued(tp_config, pp2.out, 2, 6)
    _assert_continues(tp1, tp2, (model, losses[3:]), 5)
    restarted = _continued(tp_config, tp2.out, 5, 2)[1]
    assert abs(restarted[1] - losses[4]) > 10 * TOL, (restarted, losses)


def _stage(model: ReferenceModel, start: int, end: int):
    """What load_run_weights reads of a PipelineModule holding layers start..end - 1: its layers, where they
    start, its copy of a tied module used on it but built on an earlier stage, the layer specs."""
    specs = layer_specs(model.cfg)
    tied = {s.key: model[i] for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and i < start
            and any(isinstance(t, TiedLayerSpec) and t.key == s.key for t in specs[start:end])}
    return SimpleNamespace(forward_funcs=list(model)[start:end], _local_start=start, tied_modules=tied,
                           _layer_specs=specs, each_part=lambda: iter((0,)))  # one part, as 1F1B's stage


def test_init_from_a_tp_run_starts_from_its_gathered_weights(chain, tp_config, monkeypatch):
    """--init-from the PP=1 x TP=2 run (accepted at the front door): each of two stages loads its layers' gathered
    weights (load_reference's, bit for bit; each split tensor checked against both TP files' concatenation by the
    plan) and opens only its own layers' files (both TP ranks' of a split layer, rank 0's of a replicated one), the
    last stage also the tied embedding's."""
    _, tp2, _ = chain
    resolve(TrainArgs.from_argv(_argv(tp_config, "--init-from", str(tp2.out), "--stages", "2")), world_size=2)
    cfg = load_preset("llava-tiny")
    want, plan = load_reference(tp2.out / "checkpoints", cfg), family_of(cfg).tp_plan
    tag = tp2.out / "checkpoints" / "step5"
    for idx, layer in enumerate(want):  # the gather itself, by gather_state on whole files
        if layer.state_dict():
            files = reshard.layer_files(tag, idx)
            assert len(files) == 2
            whole = gather_state([torch.load(f, weights_only=True) for f in files], split_dims(layer, plan, 2))
            assert all(torch.equal(whole[k], v) for k, v in layer.state_dict().items()), idx
    model = ReferenceModel(cfg, seed=SEED + 1)  # another init: every weight must come from the files
    cut = len(model) // 2
    opened = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **kw: opened.append(Path(f).name) or load(f, *a, **kw))
    for start, end in ((0, cut), (cut, len(model))):
        opened.clear()
        stage = _stage(model, start, end)
        n = trainer.load_run_weights(stage, tp2.out / "checkpoints")
        mine = [i for i in range(start, end) if model[i].state_dict()]
        tied = [i for i, s in enumerate(stage._layer_specs) if isinstance(s, TiedLayerSpec) and i < start
                and stage.tied_modules]
        assert n == len(mine)
        # both TP ranks' files of a layer with split tensors, rank 0's of a replicated one (LLaVA's tower)
        assert sorted(opened) == sorted(f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in mine + tied
                                        for r in ((0, 1) if split_dims(want[i], plan, 2) else (0,)))
    for i, (got, ref) in enumerate(zip(model, want)):
        assert all(torch.equal(got.state_dict()[k], v) for k, v in ref.state_dict().items()), i


# ---- bf16 under TP: PP=1 x TP=2 against PP=2 x TP=1 (in two_rank_runs' launch) -------------------------------------

def _bf16(root: Path, tp_config) -> tuple:
    """(the DeepSpeed JSON, --preset and its path): tp_config (micro 4 x GAS 2, clip 0.05, AdamW lr 5e-4 eps 1e-4) in
    bf16 at ZeRO 0 (DeepSpeed's BF16_Optimizer), llava-tiny with 1 kv head: k / v whole on both TP ranks, their
    gradients summed over TP in the optimizer's own accumulation buffer (tensor_parallel.step_gradients)."""
    ds = json.loads(tp_config.read_text())
    ds["bf16"] = {"enabled": True}
    (root / "bf16.json").write_text(json.dumps(ds))
    model = load_preset("llava-tiny").to_dict()
    model["text"]["n_kv_heads"] = 1
    (root / "llava-kv1.json").write_text(json.dumps(model))
    return root / "bf16.json", "--preset", str(root / "llava-kv1.json")


# TP 2 against TP 1 (PP 2: the same per-stage bf16 arithmetic as PP 1), measured here: 4.1e-4, 2.2e-4, 4.1e-4 (step 1,
# before any update, is bf16's forward at TP 2); the TP sum on p.grad instead of the optimizer's buffer (before
# 8a3f257, by hand): 4.1e-4, 3.3e-3, 6.8e-3
BF16_LOSS_GAP = 1e-3


def test_bf16_under_tp2_trains_as_tp1(two_rank_runs):
    """bf16 on a dense model under TP (issue 54; docs/tensor_parallel.md, bf16): PP=1 x TP=2 and PP=2 x TP=1 on the
    same batches, 3 steps, clip 0.05: each step's loss within BF16_LOSS_GAP of TP 1's (a bf16 TP run is checked against
    a bf16 TP 1 run: against the fp32 loop bf16 itself is 7.4e-3 off), TP 1's loss having moved > 100 x that. (Not
    the weights: 3 bf16 steps move k / v by 1.3e-3 .. 1.7e-3, about bf16's spacing at their size, and the runs' weights
    differ by 9.8e-4, the bug's by 2.9e-3: printed.)"""
    tp2, tp1 = two_rank_runs["bf16_tp2"].check(), two_rank_runs["bf16_tp1"].check()
    assert [(r.summary["stages"], r.summary.get("tp", 1)) for r in (tp2, tp1)] == [(1, 2), (2, 1)]
    assert sorted(tp2.losses) == sorted(tp1.losses) == list(range(1, STEPS + 1))
    gaps = [abs(tp2.losses[s] - tp1.losses[s]) for s in sorted(tp1.losses)]
    cfg = load_preset(str(tp2.out.parent / "llava-kv1.json"))
    got, want = (load_reference(r.out / "checkpoints", cfg).state_dict() for r in (tp2, tp1))
    weights = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"bf16 PP=1 x TP=2 against PP=2 x TP=1: losses {', '.join(f'{g:.1e}' for g in gaps)}, weights {weights:.1e}")
    assert tp1.losses[1] - tp1.losses[STEPS] > 100 * BF16_LOSS_GAP, tp1.losses
    assert max(gaps) <= BF16_LOSS_GAP, (tp2.losses, tp1.losses)
