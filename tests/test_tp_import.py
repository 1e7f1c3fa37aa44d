"""Issue 54 items 6 and 1 (docs/tensor_parallel.md, "Import, export, --init-from and generate under TP"): a
transformers model imported at `--tp 2` (tiny Qwen2-VL and Qwen2.5-VL, random, built here: tests/qwen_models.py)
is written as one file per TP rank of each layer the plan splits, each read from the safetensors as that rank's rows
alone; its 2 TP ranks (forked, gloo) give transformers' logits; its export gathers the ranks' files and loads in
transformers with equal weights and logits; `--init-from` at `--tp 2` (trainer.load_run_weights) gives each rank
the plan's own split of every layer, opening only its own files; `mmpipe generate --tp 2` answers as `--tp 1`."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deepspeed.pipe import TiedLayerSpec

from conftest import write_ds_config
from forked_ranks import check_rank
from mmpipe.check import links
from mmpipe.check.loader import planner_device as loader_device
from mmpipe.cli import main
from mmpipe.config import config_from_dict
from mmpipe.data.dataset import prepare
from mmpipe.hf import safetensors_io
from mmpipe.hf.commands import hf_reader
from mmpipe.hf.stream import meta_model
from mmpipe.inference.generate import tp_reference
from mmpipe.model.builder import ReferenceModel, layer_specs
from mmpipe.model.tensor_parallel import Shard, parallelize, split_dims
from mmpipe.registry import family_of
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime import trainer
from mmpipe.runtime.checkpoint import load_reference
from qwen_models import KINDS, encode, hf_logits, image, sample, save_qwen, save_tokenizer
from test_hf_qwen2_vl import row

TOL = 1e-4


def _cfg(run: Path):
    return config_from_dict(json.loads((run / "model.json").read_text()), run.name)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each kind saved by transformers, imported at --tp 1 and --tp 2 (every tensor read logged: name, bytes);
    transformers' logits of a two-image sample and a text-only one beside."""
    tmp = tmp_path_factory.mktemp("tp_import")
    out, mp_ = {}, pytest.MonkeyPatch()
    for kind in KINDS:
        d = tmp / kind
        hf = save_qwen(kind, d / "hf")
        save_tokenizer(d / "hf")
        reads = {}
        for tp in (1, 2):
            log = reads[tp] = []
            mp_.setattr(safetensors_io.LazyWeights, "loaded",
                        staticmethod(lambda name, t, log=log: log.append((name, t.numel() * t.element_size()))))
            assert main(["import", "--hf", str(d / "hf"), "--out", str(d / f"tp{tp}"), "--tp", str(tp)]) == 0
        samples = []
        for i, sizes in enumerate(([(84, 56), (56, 56)], [])):
            if sizes:
                px, grids = encode([image(w, h, seed=10 * i + k) for k, (w, h) in enumerate(sizes)])
                ids = sample(grids, seed=i)
            else:
                ids, px, grids = sample(torch.zeros(0, 3, dtype=torch.long), seed=i, words=5), None, None
            samples.append(((ids, px, grids), hf_logits(hf, ids, px, grids)))
        torch.save(samples, d / "samples.pt")
        out[kind] = SimpleNamespace(dir=d, hf=hf, reads=reads, samples=samples)
    mp_.undo()
    return out


def _split_sources(d: Path) -> dict[str, tuple[int, object]]:
    """The source (HF) names of the tensors the plan splits at TP 2 -> (layer index, split dim)."""
    got = hf_reader(d)(d)
    meta, plan = meta_model(got.cfg), family_of(got.cfg).tp_plan
    out = {}
    for mine, src in got.assign.items():
        idx, sub = mine.split(".", 1)
        dims = split_dims(meta[int(idx)], plan, 2)
        if sub in dims:
            out[src] = (int(idx), dims[sub])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_import_at_tp2_reads_each_ranks_rows_alone(imported, kind):
    """At --tp 2 each tensor the plan splits (q / k / v / o, the MLP, the tower's fused qkv and MLP, the merger, the
    vocabulary) is read twice, each time half its bytes (one rank's rows, LazyWeights.rows), never whole; every
    other tensor whole, once per rank file that holds it. The files gather (load_reference) to the --tp 1 import's
    weights bit for bit; a split layer has one file per rank, a replicated one (the patch embedding) one whole file."""
    case = imported[kind]
    split = _split_sources(case.dir / "hf")
    assert len(split) >= 20 and any("visual" in n and "qkv" in n for n in split) and any("embed" in n for n in split)
    at = {1: {}, 2: {}}  # name -> the bytes of each read of it
    for tp in (1, 2):
        for name, n in case.reads[tp]:
            at[tp].setdefault(name, []).append(n)
    assert at[1].keys() == at[2].keys()
    sizes = {k: t.numel() * t.element_size() for k, t in case.hf.state_dict().items()}
    for name, reads in at[1].items():
        n = sizes.get(name, max(reads))  # (a tied lm_head, when saved: read only by the tie's check, in blocks)
        assert max(reads) == n, name  # at TP 1 whole (a tied embedding also in blocks: same_tensor)
        if name in split:  # never more than one rank's half at once; the same bytes in all
            assert max(at[2][name]) == n // 2 and sum(at[2][name]) == sum(reads), (name, n, at[2][name])
        else:
            assert sorted(set(at[2][name])) == sorted(set(reads)), (name, reads, at[2][name])
    tag = case.dir / "tp2" / "checkpoints" / "imported"
    for idx in {i for i, _ in split.values()}:
        assert [p.name for p in sorted(tag.glob(f"layer_{idx:02d}-*"))] == [
            f"layer_{idx:02d}-model_{r:02d}-model_states.pt" for r in (0, 1)]
    for f in tag.glob("*-model_0[01]-*"):  # a rank's file holds its rows only: a slice saved as a view into the
        for k, t in torch.load(f, weights_only=True).items():  # source's mapping would carry the whole tensor
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (f.name, k)
    assert (tag / "layer_00-model_states.pt").is_file()  # the patch embedding: replicated, one whole file
    cfg = _cfg(case.dir / "tp1")
    a, b = (load_reference(case.dir / f"tp{tp}" / "checkpoints", cfg).state_dict() for tp in (1, 2))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _logits_worker(rank: int, dirs: list[str], tmp: str) -> None:
    """TP rank `rank` of 2: each kind's --tp 2 import loaded as generate --tp loads it (tp_reference: this rank's
    files through reshard.layer_state, the path --init-from and --resume read), its logits of each sample gathered
    over the vocabulary; rank 0 writes the largest difference from transformers' per kind."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    shard, diffs = Shard(dist.group.WORLD, rank, 2), {}
    for d in map(Path, dirs):
        model = tp_reference(d / "tp2" / "checkpoints", _cfg(d / "tp2"), shard).eval()
        halves = [p.shape[0] for n, p in model.named_parameters() if n.endswith("self_attn.q_proj.weight")]
        diffs[d.name] = {"q rows": halves}  # each decoder block's on this rank
        for k, ((ids, px, grids), want) in enumerate(torch.load(d / "samples.pt", weights_only=False)):
            with torch.no_grad():
                got = model(*row([(ids, px, grids)])[0])[0, :len(ids)]
            diffs[d.name][k] = (got - want).abs().max().item()
    if rank == 0:
        Path(tmp, "diffs.json").write_text(json.dumps(diffs))
    dist.barrier()
    os._exit(0)  # the results are written (as tests/test_tensor_parallel.py's workers: no destructors at exit)


def test_imported_model_at_tp2_gives_transformers_logits(imported, tmp_path):
    """2 TP ranks (forked, gloo) of each kind's --tp 2 import: the split tower (windows and full blocks in
    Qwen2.5-VL), merger, decoder and vocab head give transformers' logits for a two-image sample and a text-only one
    (1e-4; measured 1e-6 or under), each rank holding half of q_proj's rows."""
    mp.start_processes(_logits_worker, args=([str(imported[k].dir) for k in KINDS], str(tmp_path)), nprocs=2,
                       start_method="fork")
    diffs = json.loads((tmp_path / "diffs.json").read_text())
    for kind in KINDS:
        got = diffs[kind]
        assert got.pop("q rows") == [32, 32], got  # 2 blocks, 4 heads x 16 of 64 rows each: 2 heads a rank
        assert len(got) == 2 and max(got.values()) < TOL, (kind, got)


def test_export_of_a_tp2_run_loads_in_transformers(imported, tmp_path):
    """`mmpipe export` of the --tp 2 import gathers each layer from its rank files (RunLayers through
    reshard.layer_state) and transformers loads it: every weight equal to the source's, equal logits."""
    case = imported["qwen2_5"]
    assert main(["export", "--checkpoint", str(case.dir / "tp2"), "--out", str(tmp_path / "back")]) == 0
    back = type(case.hf).from_pretrained(tmp_path / "back").eval()
    mine, theirs = back.state_dict(), case.hf.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    (ids, px, grids), want = case.samples[0]
    assert (hf_logits(back, ids, px, grids) - want).abs().max().item() < 1e-6


def _stage(model: ReferenceModel, start: int, end: int, rank: int):
    """What load_run_weights reads of a PipelineModule holding layers start..end - 1 at TP rank `rank`."""
    specs = layer_specs(model.cfg)
    tied = {s.key: model[i] for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and i < start
            and any(isinstance(t, TiedLayerSpec) and t.key == s.key for t in specs[start:end])}
    grid = SimpleNamespace(get_slice_parallel_rank=lambda: rank)
    return SimpleNamespace(forward_funcs=list(model)[start:end], _local_start=start, tied_modules=tied, _grid=grid,
                           _layer_specs=specs, each_part=lambda: iter((0,)))


def test_init_from_at_tp2_gives_each_rank_its_slices(imported, monkeypatch):
    """--init-from at --tp 2 (accepted at the front door): trainer.load_run_weights on each TP rank's stages (two
    stages of the tied Qwen2.5-VL, the last holding the tied embedding's copy) gives every layer exactly the plan's
    split of the whole imported layer, from the --tp 2 import (each rank opening only its own rank files and the
    whole ones) and from the --tp 1 import (its whole files, memory-mapped: the rank's rows copied)."""
    case = imported["qwen2_5"]
    record = {"conversations": [{"from": "human", "value": "w7 w8"}, {"from": "gpt", "value": "w9"}]}
    (case.dir / "data.jsonl").write_text(json.dumps(record) + "\n")
    for tp in (1, 2):
        resolve(TrainArgs.from_argv(["--init-from", str(case.dir / f"tp{tp}"), "--tp", "2", "--stages", "2",
                                     "--data", str(case.dir / "data.jsonl"), "--steps", "1"]), world_size=4)
    cfg = _cfg(case.dir / "tp1")
    whole, plan = load_reference(case.dir / "tp1" / "checkpoints", cfg), family_of(cfg).tp_plan
    opened, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **kw: opened.append(Path(f).name) or load(f, *a, **kw))
    for tp in (1, 2):
        for rank in (0, 1):
            want = ReferenceModel(cfg)
            want.load_state_dict(whole.state_dict())
            for layer in want:
                parallelize(layer, plan, Shard(None, rank, 2))  # the plan's own split of the whole layer
            model = ReferenceModel(cfg, seed=7)  # another init: every weight must come from the files
            for layer in model:
                parallelize(layer, plan, Shard(None, rank, 2))
            cut, opened[:] = len(model) // 2, []
            for start, end in ((0, cut), (cut, len(model))):
                trainer.load_run_weights(_stage(model, start, end, rank), case.dir / f"tp{tp}" / "checkpoints", 2)
            for i, (got, ref) in enumerate(zip(model, want)):
                assert all(torch.equal(got.state_dict()[k], v) for k, v in ref.state_dict().items()), (tp, rank, i)
            if tp == 2:  # a rank file's name: layer_XX-model_RR-model_states.pt
                ranks = [re.search(r"-model_(\d\d)-", n) for n in opened]
                assert opened and all(m is None or int(m[1]) == rank for m in ranks), opened


def test_generate_at_tp2_answers_as_at_tp1(imported, tmp_path, capfd):
    """`mmpipe generate --tp 2` (2 ranks forked, the logits gathered over the vocabulary) gives --tp 1's greedy
    answers to image and text-only prompts, from the --tp 2 import's rank files and from the HF directory itself."""
    case = imported["qwen2"]  # untied: its answers differ from prompt to prompt (the tied tiny one echoes)
    image(84, 56, seed=5).save(tmp_path / "a.png")
    image(56, 112, seed=7).save(tmp_path / "b.png")
    records = [{"image": "a.png", "prompt": "w7 w8"}, {"image": "b.png", "prompt": "w30 w31 w5"},
               {"image": None, "prompt": "w100 w3"}, {"image": "b.png", "prompt": "w9"}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    gen = ["generate", "--records", str(tmp_path / "r.jsonl"), "--max-new-tokens", "6"]
    capfd.readouterr()
    answers = []
    for where, tp in (("tp1", "1"), ("tp2", "2"), ("hf", "2")):  # (capfd: rank 0 prints in its own process)
        assert main(gen + ["--checkpoint", str(case.dir / where), "--tp", tp]) == 0
        answers.append([json.loads(line)["answer"] for line in capfd.readouterr().out.splitlines()])
    assert answers[0] == answers[1] == answers[2] and len(set(answers[0])) == 4, answers


def test_tp_refusals_one_line_each(imported, tmp_path, capsys):
    d = imported["qwen2"].dir
    assert main(["import", "--hf", str(d / "hf"), "--out", str(tmp_path / "x"), "--tp", "3"]) == 2
    err = capsys.readouterr().err  # checked before anything is written
    assert "--tp: 3 does not divide hf's 4 attention heads" in err and not (tmp_path / "x").exists(), err
    image(56, 56, seed=1).save(tmp_path / "a.png")
    assert main(["generate", "--checkpoint", str(d / "tp1"), "--tp", "3", "--image", str(tmp_path / "a.png"),
                 "--prompt", "w7"]) == 2
    err = capsys.readouterr().err
    assert "--tp: 3 does not divide" in err and "4 attention heads" in err and len(err.strip().splitlines()) == 1, err


def _check_argv(tmp: Path) -> list[str]:
    """llava-tiny PP=2 x TP=2, micro 4 x GAS 2, AdamW at a constant 5e-4 (no warm-up: step 1 updates), clip 1.0."""
    cfg = write_ds_config(tmp / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                          scheduler=None)
    return ["--preset", "llava-tiny", "--stages", "2", "--tp", "2", "--steps", "1", "--ds-config", str(cfg),
            "--output-dir", str(tmp / "run")]


def _links_worker(rank: int, tmp: str, argv: list[str]) -> None:
    """Rank `rank` of a PP=2 x TP=2 run's 4 (forked, gloo): `mmpipe check`'s link measurement and its equivalence
    (collective), then the equivalence again with the TP entry's backward all-reduce planted out (copy_to_tp's: each
    rank's input gradient its own heads' share); rank 0 writes the rows and both verdicts."""
    from mmpipe.check import equivalence
    from mmpipe.model import tensor_parallel
    args, run = check_rank(rank, 4, tmp, argv)
    rows = links.measure(run)
    good = equivalence.check(run, args, rank, torch.device("cpu"))
    tensor_parallel._CopyToTP.backward = staticmethod(lambda ctx, grad: (grad, None))  # this child's class: no undo
    broken = equivalence.check(run, args, rank, torch.device("cpu"))
    if rank == 0:
        Path(tmp, "links.json").write_text(json.dumps({"rows": rows, "bytes": links.tp_allreduce_bytes(run),
                                                       "good": good, "broken": broken}))
    dist.barrier()
    os._exit(0)


def test_check_times_the_tp_all_reduce_and_runs_the_equivalence(tmp_path):
    """`mmpipe check --tp 2`'s links on the engine's grid (rank = (pipe x dp + data) x tp + model): each TP rank's
    stage boundary to the same TP rank of the next stage, and each stage's TP group all-reducing one block's output
    [micro, positions, D] (links.tp_allreduce_bytes), timed and set beside the planner's ring time, bytes x
    2 (tp - 1) / tp / link. Its equivalence at TP 2: 3 steps of the pipeline against the single-device loop built
    from the same seed (the losses, and each stage's gradient norm summed over its TP ranks' slices with each
    replicated weight once) pass at fp32's 1e-5 / 1e-4; with copy_to_tp's backward all-reduce planted out the
    gradient norm is off and it fails, while the first step's loss still matches. By hand, `mmpipe check --preset
    llava-tiny --stages 2 --tp 2 --steps 1` prints these rows (docs/tensor_parallel.md)."""
    argv = _check_argv(tmp_path)
    args = TrainArgs.from_argv(argv)
    run = resolve(args, world_size=4)
    prepare(run.data, run.model, tmp_path / "run", args.seed, verbose=False)  # the index, as the front door builds it
    mp.start_processes(_links_worker, args=(str(tmp_path), argv), nprocs=4, start_method="fork")
    got = json.loads((tmp_path / "links.json").read_text())
    rows = {r["name"]: r for r in got["rows"]}
    assert sorted(rows) == ["stage 0 -> 1 (ranks 0 <-> 2, dp 0, tp 0)", "stage 0 -> 1 (ranks 1 <-> 3, dp 0, tp 1)",
                            "stage 0 tp group (ranks 0, 1, dp 0)", "stage 1 tp group (ranks 2, 3, dp 0)"], sorted(rows)
    cpu = loader_device()
    for name in ("stage 0 tp group (ranks 0, 1, dp 0)", "stage 1 tp group (ranks 2, 3, dp 0)"):
        r = rows[name]
        assert r["kind"] == "tp all-reduce" and r["bytes"] == got["bytes"] and r["seconds"] > 0
        assert r["planned_s"] == pytest.approx(r["bytes"] * 2 * (2 - 1) / 2 / cpu.link)
    good, broken = got["good"], got["broken"]
    assert good["ok"] and good["steps"] == 3, good
    assert good["max_loss_rel_diff"] <= 1e-5 and good["max_grad_norm_rel_diff"] <= 1e-4, good
    assert good["worst_grad_norm"]["where"].startswith("stage ")  # fp32, ZeRO 0: each stage's norm, over its TP ranks
    assert good["losses"]["pipeline"][2] != good["losses"]["pipeline"][0]  # it trained
    assert not broken["ok"] and broken["max_grad_norm_rel_diff"] > 1e-2, broken
    assert abs(broken["losses"]["pipeline"][0] - good["losses"]["pipeline"][0]) < 1e-6  # forward unchanged
