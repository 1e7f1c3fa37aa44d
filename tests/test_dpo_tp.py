"""--objective dpo at --tp (issue 56 x issue 54, docs/dpo.md): the DPO objective's vocab-parallel form on 2 gloo ranks
in-process (torch.multiprocessing, as tests/test_tensor_parallel.py checks the SFT loss's). Each rank holds half of
the vocabulary's logits; the per-sequence log-probs, the loss of each variant (sigmoid, ipo, hinge; RPO), the four
rewards, validation's sums and the logits' gradients equal the full-vocabulary ones (1e-6), one sample a row and
packed. Then a whole qwen-tiny with LoRA split by its plan: the DPO loss and every gathered gradient equal the whole
model's, and after an update the adapters-off reference (LiveReference, its tower copy swapped in) gives the starting
model's log-probs. The launch (PP=1 x TP=2 with the live reference and validation on packed pairs against the
single-device loop) is tests/test_dpo_packed.py's series."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import write_checkpoint
from mmpipe.config import config_from_dict, load_preset
from mmpipe.model import ReferenceModel, tensor_parallel
from mmpipe.model.builder import IGNORE_INDEX, layer_specs
from mmpipe.model.dpo import REWARDS, row_logps
from mmpipe.model.lora import Lora, add_adapters
from mmpipe.model.moe import head_aux
from mmpipe.model.objectives import dpo
from mmpipe.model.tensor_parallel import Shard, gather_state, split_dims
from mmpipe.registry import family_of
from mmpipe.runtime.preference import LiveReference
from test_tensor_parallel import _mine, _row, _split_model

VARIANTS = (("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.7), ("ipo", 0.3, 0.0), ("hinge", 0.2, 0.0))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Both checks on 2 gloo ranks of one TP group, forked: rank 0's {check: {name: difference}}. The children
    inherit this process's imports (deepspeed's comm, peft: ~6 s a spawned child under load)."""
    import deepspeed.comm.torch  # noqa: F401
    import peft  # noqa: F401
    tmp = tmp_path_factory.mktemp("dpo_tp2")
    mp.start_processes(_worker, args=(str(tmp),), nprocs=2, start_method="fork")
    return json.loads((tmp / "diffs.json").read_text())


def _worker(rank: int, tmp: str) -> None:
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend

    from mmpipe.runtime import trainer
    trainer.setup_torch()  # one thread before any op: a forked child must not enter the parent's OpenMP pool
    # BF16_Optimizer's memory report runs gc.collect() 4 times on rank 0 over the heap inherited from the test process
    # (test_sp_objectives: seconds under load); frozen, the collections skip it
    gc.freeze()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # the vocab-parallel CE's deepspeed.comm
    shard = Shard(dist.group.WORLD, rank, 2)
    diffs = {"loss": _loss_check(shard), "model": _model_check(shard), "variants": _variants_check(shard, tmp),
             "bf16": _bf16_check(shard)}  # last: its grid's new_group calls after the other checks' collectives
    if rank == 0:
        with open(f"{tmp}/diffs.json", "w") as f:
            json.dump(diffs, f)
    dist.barrier()
    os._exit(0)  # as test_tensor_parallel's worker: leave without destructors once the results are written


def _labels(g, V: int):
    """4 rows (2 pairs) of 7 positions, the first 2 (the prompt) unlabelled; one sample a row: (labels, ref [4]);
    packed: rows 2i / 2i + 1 hold the same 2 pairs' sides in segments 1, 2 (row 3's second rejected side shorter,
    row 1 padded), (labels, ref [4, 2], segments)."""
    labels = torch.randint(0, V, (4, 7), generator=g)
    labels[:, :2] = IGNORE_INDEX
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 2, 2, 2, 0],
                             [1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0, 0]])
    packed = labels.clone()
    packed[:, 4] = IGNORE_INDEX  # segment 2's prompt in rows 0, 2
    packed[segments == 0] = IGNORE_INDEX
    return {"rows": (labels, -5 * torch.rand(4, generator=g)),
            "packed": (packed, -5 * torch.rand(4, 2, generator=g), segments)}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the tensor's largest element, at least 1: fp32 carries ~7 digits, so a
    summed log-prob of ~-40 rounds in steps of 3.8e-6 whichever way its log-sum-exp is computed (the full CE's or the
    TP ranks'), and a margin, the difference of two such sums, keeps their rounding."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


def _loss_check(shard: Shard) -> dict:
    """The dpo record's vocab-parallel form (split_vocab) on this rank's half of the logits against the record on the
    full logits: row_logps, each variant's loss, its rewards (metrics), the logits' gradient (this rank's slice),
    validation's eval_sum and its reward sums (eval_metrics)."""
    g = torch.Generator().manual_seed(0)
    V = 16
    logits = (3 * torch.randn(4, 7, V, generator=g, dtype=torch.float64)).float()  # a peaked softmax too
    diffs = {}
    for case, labels in _labels(g, V).items():
        split_logps = dpo().split_vocab(shard, V).row_logps(_mine(logits, shard), labels)
        diffs[f"{case} row_logps"] = _rel(split_logps, row_logps(logits, labels))
        for kind, beta, rpo in VARIANTS:
            full, split = dpo(beta, kind, rpo), dpo(beta, kind, rpo).split_vocab(shard, V)
            name = f"{case} {kind} rpo {rpo}"
            whole, mine = logits.clone().requires_grad_(), _mine(logits, shard).clone().requires_grad_()
            want, got = full.loss(whole, labels), split.loss(mine, labels)
            want.backward()
            got.backward()
            diffs[f"{name} loss"] = _rel(got, want)
            diffs[f"{name} grad"] = (mine.grad - _mine(whole.grad, shard)).abs().max().item()
            diffs.update({f"{name} {k}": _rel(split.metrics()[k], full.metrics()[k]) for k in REWARDS})
            sums = [o.eval_sum(x.detach(), labels) for o, x in ((full, logits), (split, mine))]
            diffs[f"{name} eval_sum"] = _rel(sums[1], sums[0])
            diffs[f"{name} eval_metrics"] = _rel(split.eval_metrics(), full.eval_metrics())
        diffs[f"{case} margin"] = -abs(float(full.metrics()["rewards/margins"]))  # not vacuous: asserted < -1e-2
    return diffs


def _pair_batch(cfg):
    """test_tensor_parallel's packed row (an image sample, a text sample, padding) as a pair: row 0 the chosen sides,
    row 1 the same inputs with other labels the rejected ones; (inputs, (labels, ref None, segments))."""
    inputs, chosen = _row(cfg)
    g = torch.Generator().manual_seed(2)
    labels = torch.cat([chosen, torch.randint(0, cfg.text.vocab_size, chosen.shape, generator=g)])
    inputs = tuple(torch.cat([t, t]) for t in inputs)
    segments = inputs[3]
    labels[:, :20] = IGNORE_INDEX  # the first sample's image and prompt
    labels[segments == 0] = IGNORE_INDEX
    return inputs, labels, segments


def _model_check(shard: Shard) -> dict:
    """qwen-tiny with LoRA 4 on the text group (the tower trained whole), split by its plan on 2 ranks against the
    whole model: the DPO loss (sigmoid + RPO, packed pair) and every trained tensor's gathered gradient relative to its
    largest element; then both take the same SGD step and the adapters-off reference (LiveReference.weights: the
    adapters off, the tower's copy swapped in) gives the starting model's per-sample log-probs on this rank."""
    cfg, lora = load_preset("qwen-tiny"), Lora(4, 32.0)
    inputs, labels, segments = _pair_batch(cfg)
    start = ReferenceModel(cfg, seed=3)
    with torch.no_grad():
        ref = row_logps(start(*inputs), (labels, torch.zeros(2, 2), segments))
    split = _split_model(cfg, shard)
    for i, layer in enumerate(split):
        add_adapters(layer, i, lora, 3)  # after the split, as the pipeline's stages add them (drawn whole)
    whole, objective = ReferenceModel(cfg, seed=3, lora=lora), dpo(0.5, "sigmoid", 0.7)
    diffs, losses = {}, []
    for model, loss_fn in ((whole, objective.loss), (split, objective.split_vocab(shard, cfg.text.vocab_size).loss)):
        loss = loss_fn(model(*inputs), (labels, ref, segments))
        loss.backward()
        tensor_parallel.sum_summed_gradients(model.parameters(), shard)
        losses.append(loss.item())
    diffs["loss"] = abs(losses[0] - losses[1])
    diffs.update(_gathered_grads(whole, split, cfg, shard))
    diffs["adapters trained"] = -sum(1 for k, p in split.named_parameters() if ".lora_" in k and p.grad is not None)
    reference = _live(split, shard, lora, cfg)  # the copies taken before the step, as the engine takes them
    with torch.no_grad():
        for p in split.parameters():
            if p.grad is not None:
                p.sub_(0.05 * p.grad)
        moved = reference.row_logps(split(*inputs), (labels, ref, segments))
        with reference.weights():
            off = reference.row_logps(split(*inputs), (labels, ref, segments))
    diffs["reference"] = (off - ref).abs().max().item()
    diffs["policy moved"] = -(moved - ref).abs().max().item()
    return diffs


def _gathered_grads(whole, split, cfg, shard: Shard, prefix: str = "") -> dict:
    """{"grad i.name": the split model's gradient gathered over TP against the whole one's, relative to its layer's
    largest element} for every tensor with a gradient (after the step's TP sum of the tp_summed shares)."""
    diffs, plan = {}, family_of(cfg).tp_plan
    for i, (w, s) in enumerate(zip(whole, split)):
        dims, mine = split_dims(w, plan, shard.size), dict(s.named_parameters())
        largest = max((p.grad.abs().max().item() for p in w.parameters() if p.grad is not None), default=0.0)
        for k, p in w.named_parameters():
            if p.grad is None or largest == 0:
                continue
            gathered = [torch.empty_like(mine[k]) for _ in range(shard.size)]
            dist.all_gather(gathered, mine[k].grad.contiguous())
            diffs[f"{prefix}grad {i}.{k}"] = ((gather_state([{k: t} for t in gathered], dims)[k] - p.grad).abs().max()
                                              / largest).item()
    return diffs


MOE = {"experts": 8, "top_k": 2, "ff_dim": 32, "aux_coef": 1.0}  # test_tp_moe's: the aux gradient no rounding


def _variants_check(shard: Shard, tmp: str) -> dict:
    """The combinations dpo takes at --tp beyond _model_check's, each whole against split on the packed pair, the
    reference another model's (seed 4: policy != reference): "sp" qwen-tiny under --sequence-parallel (the head
    all-gathers the row's positions before the vocab-split logits, so the per-sample sums are the whole row's as
    without SP; the norms' gradients each rank's positions' share until the step's TP sum); "moe" a qwen3-vl MoE
    (router replicated, experts split by F; the head's aux term whole on each rank, added once) at TP and "moe sp"
    under --sequence-parallel too (each rank routes its positions, the router statistics summed over TP); then
    "reference": --reference RUN, a whole run directory (seed 4) read into a split policy's LiveReference copies by
    --init-from's loader (trainer.load_run_weights: each rank its slices), whose pass gives RUN's log-probs."""
    from mmpipe.runtime import trainer
    dense = load_preset("qwen-tiny")
    moe = load_preset("qwen3-vl-tiny").to_dict()
    moe["text"].update({"tie_embeddings": False, "moe": MOE})
    moe = config_from_dict(moe, "qwen3-vl-moe")
    objective, diffs = dpo(0.5, "sigmoid", 0.7), {}
    for name, cfg, sequence in (("sp", dense, True), ("moe", moe, False), ("moe sp", moe, True)):
        inputs, labels, segments = _pair_batch(cfg)
        with torch.no_grad():
            ref = row_logps(ReferenceModel(cfg, seed=4)(*inputs), (labels, torch.zeros(2, 2), segments))
        whole, split = ReferenceModel(cfg, seed=3), _split_model(cfg, dataclasses.replace(shard, sequence=sequence))
        losses, split_loss = [], objective.split_vocab(shard, cfg.text.vocab_size).loss
        for model, loss_fn in ((whole, objective.loss), (split, split_loss)):
            loss = loss_fn(model(*inputs), (labels, ref, segments))
            loss.backward()
            tensor_parallel.sum_summed_gradients(model.parameters(), shard)  # the step's sum (sum_gradients_at_step)
            losses.append(loss.item())
        diffs[f"{name} loss"] = abs(losses[0] - losses[1])
        diffs[f"{name} reward"] = -abs(float(objective.metrics()["rewards/margins"]))  # not vacuous: asserted < -1e-2
        if cfg is moe:
            diffs[f"{name} aux"] = -float(head_aux(list(whole)[-1]))  # the aux term in the loss: asserted < -1e-3
            diffs[f"{name} aux split"] = abs(float(head_aux(list(split)[-1]) - head_aux(list(whole)[-1])))
        diffs.update(_gathered_grads(whole, split, cfg, shard, f"{name} "))
    diffs.update(_reference_run_check(shard, Path(tmp) / "base", dense, trainer.load_run_weights))
    return diffs


def _reference_run_check(shard: Shard, base: Path, cfg, load_run_weights) -> dict:
    """--reference RUN at TP 2: RUN a whole checkpoint of qwen-tiny at seed 4 (written by rank 0), the policy split
    at seed 3; inside LiveReference.weights() the split policy's per-sample log-probs are RUN's whole model's, after
    it the policy's own again."""
    inputs, labels, segments = _pair_batch(cfg)
    tuple_ = (labels, torch.zeros(2, 2), segments)
    run_model, start = ReferenceModel(cfg, seed=4), ReferenceModel(cfg, seed=3)
    if shard.rank == 0:
        write_checkpoint(run_model, base)
    dist.barrier()
    policy = _split_model(cfg, shard)
    grid = SimpleNamespace(get_slice_parallel_group=lambda: shard.group, get_slice_parallel_rank=lambda: shard.rank)
    pipe = SimpleNamespace(forward_funcs=list(policy), tied_modules={}, _layer_specs=layer_specs(cfg), _local_start=0,
                           each_part=lambda: iter([0]), _grid=grid)
    run = SimpleNamespace(lora=None, reference=str(base), tp=shard.size, objective=dpo(), model=cfg)
    live = LiveReference(SimpleNamespace(module=policy, grid=grid), run,
                         lambda module, d: load_run_weights(pipe, d, shard.size))
    with torch.no_grad():
        want, own = row_logps(run_model(*inputs), tuple_), row_logps(start(*inputs), tuple_)
        with live.weights():
            got = live.row_logps(policy(*inputs), tuple_)
        after = live.row_logps(policy(*inputs), tuple_)
    return {"reference run": _rel(got, want), "reference after": _rel(after, own),
            "reference apart": -(want - own).abs().max().item(),  # RUN is not the start: asserted < -1e-2
            "reference copied": -float(live.copied == sum(p.numel() for p in policy.parameters()))}


def _bf16_check(shard: Shard) -> dict:
    """qwen-tiny in bf16 split at TP 2 under DeepSpeed 0.19.8's BF16_Optimizer on the pipeline's grid (PP 1 x TP 2,
    cpu_bf16.json's ZeRO 0, bf16 accumulation), the DPO loss (sigmoid + RPO) of two micro-batches (the packed pair
    against two references) as the engine's backward drives it (clear_lp_grads, backward, update_hp_grads), then
    ReduceGrads' TP sum on the optimizer's buffers and its global norm: each tensor's gathered buffer relative to the
    whole fp32 model's gradient (the sum of both), beside the whole model in bf16 at TP 1 (bf16's own spread), as
    test_tensor_parallel's bf16 check judges TP's. A tensor whose fp32 gradient is rounding (a key bias: softmax
    cancels it) is left out, as assert_weights_moved leaves it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from deepspeed.runtime.utils import get_global_norm_of_tensors
    cfg, objective = load_preset("qwen-tiny"), dpo(0.5, "sigmoid", 0.7)
    inputs, labels, segments = _pair_batch(cfg)
    refs = [-5 * torch.rand(2, 2, generator=torch.Generator().manual_seed(s)) - 20 for s in (5, 6)]
    whole, bf16 = ReferenceModel(cfg, seed=3), ReferenceModel(cfg, seed=3).to(torch.bfloat16)
    split = _split_model(cfg, shard).to(torch.bfloat16)
    tensor_parallel.mark_norm_counting(split.parameters(), shard.rank)
    grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(1, shard.size, 1))
    names = {p: n for n, p in split.named_parameters()}
    # never stepped: its param groups alone (torch.optim's would import torch._dynamo in each forked rank, seconds)
    inner = SimpleNamespace(param_groups=[{"params": list(split.parameters())}], state={})
    opt = BF16_Optimizer(inner, names, DeepSpeedBF16Config(enabled=True), mpu=grid,
                         dp_process_group=grid.get_data_parallel_group(), grad_acc_dtype=torch.bfloat16)
    split_loss = objective.split_vocab(shard, cfg.text.vocab_size).loss
    for ref in refs:
        for m in (whole, bf16):
            objective.loss(m(*inputs), (labels, ref, segments)).backward()
        opt.clear_lp_grads()
        split_loss(split(*inputs), (labels, ref, segments)).backward()
        opt.update_hp_grads()
    params = dict(split.named_parameters())
    buffers = {n: opt.fp32_groups_gradients[0][j].view(params[n].shape) for j, n in enumerate(params)}
    tensor_parallel.sum_summed_gradients(split.parameters(), shard, opt)  # ReduceGrads' (sum_gradients_at_step)
    norm = get_global_norm_of_tensors(opt.get_grads_for_norm()[0], mpu=grid).item()
    ref_grads, tp1 = dict(whole.named_parameters()), dict(bf16.named_parameters())
    whole_norm = torch.stack([p.grad.norm() for p in ref_grads.values()]).norm().item()
    diffs = {"norm tp2": abs(norm - whole_norm) / whole_norm,
             "norm tp1": abs(torch.stack([p.grad.float().norm() for p in tp1.values()]).norm().item() - whole_norm)
             / whole_norm}
    plan = family_of(cfg).tp_plan
    for i, w in enumerate(ReferenceModel(cfg, seed=3)):
        dims = split_dims(w, plan, shard.size)
        for k, _ in w.named_parameters():
            key, want = f"{i}.{k}", ref_grads[f"{i}.{k}"].grad
            if k.endswith("k_proj.bias"):
                continue
            gathered = [torch.empty_like(buffers[key]) for _ in range(shard.size)]
            dist.all_gather(gathered, buffers[key].contiguous())
            got = gather_state([{k: t} for t in gathered], dims)[k].float()
            diffs[f"{key} tp2"] = ((got - want).norm() / want.norm()).item()
            diffs[f"{key} tp1"] = ((tp1[key].grad.float() - want).norm() / want.norm()).item()
    return diffs


def _live(model, shard: Shard, lora: Lora, cfg) -> LiveReference:
    """The pipeline's LiveReference on this rank's split model (an engine's module and its grid's TP group)."""
    grid = SimpleNamespace(get_slice_parallel_group=lambda: shard.group, get_slice_parallel_rank=lambda: shard.rank)
    run = SimpleNamespace(lora=lora, reference=None, tp=shard.size, objective=dpo(), model=cfg)
    return LiveReference(SimpleNamespace(module=model, grid=grid), run)


def test_vocab_parallel_dpo_equals_the_full_vocabulary(two_ranks):
    """Each rank's half of the logits: the per-sequence log-probs, every variant's loss and rewards, validation's sums
    and the logits' gradient equal the full-vocabulary record's within 1e-6 (relative where above 1: _rel), one
    sample a row and packed."""
    diffs = two_ranks["loss"]
    assert len([k for k in diffs if k.endswith(" grad")]) == 2 * len(VARIANTS)
    assert max(diffs["rows margin"], diffs["packed margin"]) < -1e-2  # the pairs' rewards are not all 0
    close = {k: v for k, v in diffs.items() if not k.endswith("margin")}
    assert max(close.values()) < 1e-6, {k: v for k, v in close.items() if v >= 1e-6}


def test_split_model_and_adapters_off_reference(two_ranks):
    """qwen-tiny + LoRA under its plan: the DPO loss within 1e-6 and every trained tensor's gathered gradient within
    1e-5 of its largest element (the family check's tolerance, test_tensor_parallel), the adapters among them; after
    a step that moved the policy's log-probs, the adapters-off reference gives the starting model's (1e-5)."""
    diffs = two_ranks["model"]
    grads = {k: v for k, v in diffs.items() if k.startswith("grad ")}
    assert diffs["loss"] < 1e-6 and any(".lora_B." in k for k in grads) and diffs["adapters trained"] < -4
    assert max(grads.values()) < 1e-5, {k: v for k, v in grads.items() if v >= 1e-5}
    assert diffs["policy moved"] < -1e-2 and diffs["reference"] < 1e-5, diffs


@pytest.mark.parametrize("case", ["sp", "moe", "moe sp"])
def test_dpo_at_tp_with_sequence_parallel_and_moe(two_ranks, case):
    """--sequence-parallel (qwen-tiny), an MoE model (qwen3-vl MoE, aux_coef 1) at TP and both: the split DPO loss
    (sigmoid + RPO, the aux term in it) within 1e-6 of the whole model's and every gathered gradient within 1e-5 of
    its layer's largest (test_tensor_parallel's family tolerance), the routers' among them."""
    diffs = two_ranks["variants"]
    grads = {k: v for k, v in diffs.items() if k.startswith(f"{case} grad ")}
    assert diffs[f"{case} loss"] < 1e-6 and diffs[f"{case} reward"] < -1e-2, diffs
    assert max(grads.values()) < 1e-5, {k: v for k, v in grads.items() if v >= 1e-5}
    if case.startswith("moe"):
        assert diffs[f"{case} aux"] < -1e-3 and diffs[f"{case} aux split"] < 1e-6, diffs
        assert any(k.endswith("mlp.gate.weight") for k in grads) and any("experts" in k for k in grads), sorted(grads)


def test_bf16_dpo_at_tp_under_bf16_optimizer(two_ranks):
    """bf16 at TP 2 (BF16_Optimizer's buffers summed over TP, its norm counting each slice once) with the split DPO
    loss: every gathered gradient within twice the largest error bf16 itself makes at TP 1 (the whole model in bf16),
    as test_tensor_parallel's bf16 check judges SFT's, and the global norm within twice TP 1's error + 1e-4."""
    diffs = two_ranks["bf16"]
    tol = 2 * max(v for k, v in diffs.items() if k.endswith(" tp1") and not k.startswith("norm"))
    assert 1e-3 < tol < 0.1, tol  # bf16's 8 mantissa bits: ~4e-3 per rounding
    worse = {k: v for k, v in diffs.items() if k.endswith(" tp2") and v > tol}
    assert not worse and len(diffs) > 40, (tol, worse)
    assert diffs["norm tp2"] < 2 * diffs["norm tp1"] + 1e-4, diffs


def test_reference_run_at_tp_reads_each_ranks_slices(two_ranks):
    """--reference RUN at --tp 2: a whole run directory read by --init-from's loader into each rank's LiveReference
    copies (every tensor of the split stage): the reference pass's per-sample log-probs are RUN's whole model's
    (1e-6 relative), and the policy's own after it."""
    diffs = two_ranks["variants"]
    assert diffs["reference apart"] < -1e-2 and diffs["reference copied"] == -1.0, diffs
    assert diffs["reference run"] < 1e-6 and diffs["reference after"] < 1e-6, diffs


def test_front_door_takes_dpo_at_tp_with_sequence_parallel_and_bf16(tmp_path, capsys):
    """`mmpipe train --objective dpo --tp 2` passes the front door (--dry-run), with --sequence-parallel and in bf16
    too (fp16 is refused at --tp whatever the objective: test_tensor_parallel)."""
    from mmpipe.cli import main
    from mmpipe.data.export import export_shapes
    pairs = export_shapes(tmp_path / "pairs", "dpo-jsonl", 4)
    argv = ["train", "--preset", "llava-tiny", "--objective", "dpo", "--data", str(pairs), "--stages", "1", "--tp",
            "2", "--output-dir", str(tmp_path / "run")]
    assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    assert main([*argv, "--sequence-parallel", "--dry-run"]) == 0, capsys.readouterr().err
    assert main([*argv, "--ds-config", "ds_configs/cpu_bf16.json", "--dry-run"]) == 0, capsys.readouterr().err


def test_planner_counts_a_tp_ranks_reference_copy():
    """`mmpipe plan --tp 2 --dpo-reference live`: each stage's live copy is one TP rank's trained tensors (the plan's
    split ones halved, the replicated whole, a stage's tied embedding copy by its vocabulary slice) in bf16: stage 0
    15,680 B against TP 1's 27,008; and the reference pass's forwards carry TP's all-reduces (on this tiny model their
    latency outweighs the halved matmuls: 1.10e-6 s against TP 1's 4.1e-7) (llava-tiny, --freeze vision, PP 2, m 8)."""
    from mmpipe.model.builder import TiedCall
    from mmpipe.planning.costmodel import KNOWN_DEVICES, Shape
    from mmpipe.planning.layout import Training, predict_layout
    cfg, dev, plan = load_preset("llava-tiny"), KNOWN_DEVICES["h100-80gb"], family_of(load_preset("llava-tiny")).tp_plan
    lay = {(tp, r): predict_layout(cfg, Shape(2, 1, 4, 8, tp=tp), Training("bf16", 0, dev, freeze=("vision",),
                                                                           reference=r), 32)
           for tp in (1, 2) for r in ("precomputed", "live")}  # both a dpo run's rows (the tower once a pair)
    base, live = lay[2, "precomputed"], lay[2, "live"]
    assert live.parts == base.parts and live.step["reference_s"] > lay[1, "live"].step["reference_s"]
    model = ReferenceModel(cfg, freeze=("vision",))
    for s, (a, b) in enumerate(zip(base.parts, base.parts[1:])):
        trained = {}
        for layer in list(model)[a:b]:
            module = layer.module if isinstance(layer, TiedCall) else layer
            dims = split_dims(module, plan, 2)
            trained.update({id(p): p.numel() // 2 if k in dims else p.numel()
                            for k, p in module.named_parameters() if p.requires_grad})
        more = (live.stage_rows[s]["memory_gib"] - base.stage_rows[s]["memory_gib"]) * 2 ** 30
        one = (lay[1, "live"].stage_rows[s]["memory_gib"] - lay[1, "precomputed"].stage_rows[s]["memory_gib"])
        whole = one * 2 ** 30
        assert more == pytest.approx(2 * sum(trained.values()), rel=1e-9) and more < 0.75 * whole, s
