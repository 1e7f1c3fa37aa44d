"""--objective dpo at --tp (issue 56 x issue 54, docs/dpo.md): the DPO objective's vocab-parallel form on 2 gloo ranks
in-process (torch.multiprocessing, as tests/test_tensor_parallel.py checks the SFT loss's). Each rank holds half of
the vocabulary's logits; the per-sequence log-probs, the loss of each variant (sigmoid, ipo, hinge; RPO), the four
rewards, validation's sums and the logits' gradients equal the full-vocabulary ones (1e-6), one sample a row and
packed. Then a whole qwen-tiny with LoRA split by its plan: the DPO loss and every gathered gradient equal the whole
model's, and after an update the adapters-off reference (LiveReference, its tower copy swapped in) gives the starting
model's log-probs. The launch (PP=1 x TP=2 with the live reference and validation on packed pairs against the
single-device loop) is tests/test_dpo_packed.py's series."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel, tensor_parallel
from mmpipe.model.builder import IGNORE_INDEX
from mmpipe.model.dpo import REWARDS, row_logps
from mmpipe.model.lora import Lora, add_adapters
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
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # the vocab-parallel CE's deepspeed.comm
    shard = Shard(dist.group.WORLD, rank, 2)
    diffs = {"loss": _loss_check(shard), "model": _model_check(shard)}
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
    plan = family_of(cfg).tp_plan
    for i, (w, s) in enumerate(zip(whole, split)):
        dims, mine = split_dims(w, plan, shard.size), dict(s.named_parameters())
        largest = max((p.grad.abs().max().item() for p in w.parameters() if p.grad is not None), default=0.0)
        for k, p in w.named_parameters():
            if p.grad is None or largest == 0:
                continue
            gathered = [torch.empty_like(mine[k]) for _ in range(shard.size)]
            dist.all_gather(gathered, mine[k].grad.contiguous())
            diffs[f"grad {i}.{k}"] = ((gather_state([{k: t} for t in gathered], dims)[k] - p.grad).abs().max()
                                      / largest).item()
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


def test_front_door_takes_dpo_at_tp_and_refuses_what_is_not_checked(tmp_path, capsys):
    """`mmpipe train --objective dpo --tp 2` passes the front door (--dry-run); the combinations not checked with dpo
    at --tp are refused, one line each, exit 2."""
    from conftest import refused
    from mmpipe.cli import main
    from mmpipe.data.export import export_shapes
    pairs = export_shapes(tmp_path / "pairs", "dpo-jsonl", 4)
    argv = ["train", "--preset", "llava-tiny", "--objective", "dpo", "--data", str(pairs), "--stages", "1", "--tp",
            "2", "--output-dir", str(tmp_path / "run")]
    assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    lines = refused([*argv[1:], "--sequence-parallel"], capsys)
    assert lines[-1] == ("mmpipe: error: --tp: 2 with --objective dpo and --sequence-parallel is not supported yet: "
                         "dpo at --tp is checked in fp32 on dense models with the live, LoRA and precomputed "
                         "references (docs/dpo.md)"), lines


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
