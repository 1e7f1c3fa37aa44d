"""LoRA adapter dropout under --tp, --tp --sequence-parallel and --sp (issues 54 and 58; docs/lora.md): the mask a rank
applies is its slice of the mask the single device draws (mmpipe.model.lora.SplitDropout, the slice set by the plan's
application: tensor_parallel._mark_inputs, sequence_parallel._reads_positions). In process on 2 forked gloo ranks
(test_dpo_tp's way): qwen-tiny with rank-4 adapters on the text (B drawn nonzero, so the masks reach the loss and
every adapter's gradient), --lora-dropout 0.3, one packed row, the same seed before each forward: the loss and every
adapter gradient (gathered over TP, summed over SP) at TP 2, TP 2 + --sequence-parallel and SP 2 against the whole
model's, in float64 (TOL); and the naive mask (each rank drawing at its own input's shape from the shared RNG state)
against it too."""
from __future__ import annotations

import dataclasses
import json
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel, tensor_parallel
from mmpipe.model.builder import IGNORE_INDEX, lm_loss
from mmpipe.model.lora import Lora, SplitDropout, add_adapters, lora_layers
from mmpipe.model.objectives import vocab_parallel_lm_loss
from mmpipe.model.sequence_parallel import parallelize_sequence, sp_loss, sum_gradients
from mmpipe.model.tensor_parallel import Shard, gather_state, split_dims
from mmpipe.registry import family_of
from test_tensor_parallel import _row, _split_model

LORA = Lora(4, 8.0, dropout=0.3)
SEED, DRAW = 3, 7  # the layers' seed; the RNG state every rank (and the single device) holds before the forward
# relative: the loss to itself, a gradient's largest difference to the largest adapter gradient element of the model.
# Run in float64: in fp32 TP's split sums round in another order at this level already without dropout (TP 2 at
# dropout 0: 5.0e-7; with the masks 1.1e-6, SP 2 2.3e-7, the naive masks 1.0); in float64 TP 2 measures 5.2e-8 (the
# losses' own fp32 casts), SP 2 2.5e-16
TOL = 1e-6


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Rank 0's {layout: {name: difference}}: the children inherit this process's imports (peft, deepspeed's comm)."""
    import deepspeed.comm.torch  # noqa: F401
    import peft  # noqa: F401
    tmp = tmp_path_factory.mktemp("lora_dropout")
    mp.start_processes(_worker, args=(str(tmp),), nprocs=2, start_method="fork")
    return json.loads((tmp / "diffs.json").read_text())


def _worker(rank: int, tmp: str) -> None:
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend

    from mmpipe.runtime import trainer
    trainer.setup_torch()  # one thread before any op: a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # the vocab-parallel CE's deepspeed.comm
    torch.set_default_dtype(torch.float64)  # the model, the row's floats, the masks (TOL)
    diffs = _check(Shard(dist.group.WORLD, rank, 2))
    if rank == 0:
        with open(f"{tmp}/diffs.json", "w") as f:
            json.dump(diffs, f)
    dist.barrier()
    os._exit(0)  # as test_tensor_parallel's worker: leave without destructors once the results are written


def _adapt(model) -> None:
    """Adapters on every layer as the pipeline adds them (after the plan's split), B drawn nonzero (peft's zeros_
    replaced by a normal draw from the layer's adapter seed, at the whole linear's sizes as A's)."""
    def nonzero(t):
        with torch.no_grad():
            return t.normal_(0, 0.2)
    with mock.patch.object(torch.nn.init, "zeros_", nonzero):
        for i, layer in enumerate(model):
            add_adapters(layer, i, LORA, SEED)
    assert all(isinstance(d, SplitDropout) for _, _, a in lora_layers(model) for d in a.lora_dropout.values())


def _naive(model) -> None:
    """Each rank draws the mask at its own input's shape (what peft's nn.Dropout does on a split input)."""
    for _, _, adapted in lora_layers(model):
        for d in adapted.lora_dropout.values():
            d.split = ()


def _batch(cfg):
    """test_tensor_parallel's packed row (an image sample, a text sample, 2 padding positions; 48 positions, so TP 2
    and SP 2 each hold 24) with LossNorm weights: (inputs, (labels, weights))."""
    inputs, labels = _row(cfg)
    labels[:, :20] = IGNORE_INDEX  # the first sample's image and prompt
    labels[inputs[3] == 0] = IGNORE_INDEX
    weights = (labels != IGNORE_INDEX).float() / (labels != IGNORE_INDEX).sum()
    return inputs, (labels, weights)


def _run(model, loss_fn, inputs, labels) -> float:
    torch.manual_seed(DRAW)  # the pipeline reseeds every layer alike on each rank (DeepSpeed's seed_layers)
    loss = loss_fn(model(*inputs), labels)
    loss.backward()
    return loss.item()


def _adapter_grads(model) -> dict:
    return {f"{i}.{k}": p for i, layer in enumerate(model) for k, p in layer.named_parameters() if ".lora_" in k}


def _tp_diffs(whole, split, loss, want: float, shard: Shard, plan: dict) -> dict:
    """The loss's difference and each adapter's gathered gradient's, relative (module docstring)."""
    tensor_parallel.sum_summed_gradients(split.parameters(), shard)  # the step's sum (sum_gradients_at_step)
    diffs = {"loss": abs(loss - want) / abs(want)}
    for i, (w, s) in enumerate(zip(whole, split)):
        dims, mine = split_dims(w, plan, shard.size), dict(s.named_parameters())
        for k, p in w.named_parameters():
            if ".lora_" in k:
                gathered = [torch.empty_like(mine[k]) for _ in range(shard.size)]
                dist.all_gather(gathered, mine[k].grad.contiguous())
                got = gather_state([{k: t} for t in gathered], dims)[k]
                diffs[f"{i}.{k}"] = ((got - p.grad).abs().max() / _largest(whole)).item()
    return diffs


def _largest(model) -> float:
    return max(p.grad.abs().max().item() for k, p in model.named_parameters() if ".lora_" in k)


def _sp_diffs(whole, model, loss, want: float, shard: Shard) -> dict:
    sum_gradients([p for p in model.parameters() if p.requires_grad], shard)  # each SP rank saw half the positions
    mine = _adapter_grads(model)
    return {"loss": abs(loss - want) / abs(want),
            **{k: ((mine[k].grad - p.grad).abs().max() / _largest(whole)).item()
               for k, p in _adapter_grads(whole).items()}}


def _check(shard: Shard) -> dict:
    cfg = load_preset("qwen-tiny")
    inputs, labels = _batch(cfg)
    whole = ReferenceModel(cfg, seed=SEED)
    _adapt(whole)
    want = _run(whole, lm_loss, inputs, labels)
    out = {"adapters": len(_adapter_grads(whole))}
    tp_plan, tp_loss = family_of(cfg).tp_plan, vocab_parallel_lm_loss(shard, cfg.text.vocab_size)[0]
    for name, sequence, naive in (("tp2", False, False), ("tp2 sp", True, False), ("tp2 naive", False, True)):
        split = _split_model(cfg, dataclasses.replace(shard, sequence=sequence))
        _adapt(split)
        if naive:
            _naive(split)
        out[name] = _tp_diffs(whole, split, _run(split, tp_loss, inputs, labels), want, shard, tp_plan)
    for name, naive in (("sp2", False), ("sp2 naive", True)):
        model = ReferenceModel(cfg, seed=SEED)
        parallelize_sequence(list(model), shard, family_of(cfg).sp_plan)  # in place: the Sequential runs it
        _adapt(model)
        if naive:
            _naive(model)
        out[name] = _sp_diffs(whole, model, _run(model, sp_loss(lm_loss, shard), inputs, labels), want, shard)
    return out


@pytest.mark.parametrize("layout", ["tp2", "tp2 sp", "sp2"])
def test_each_rank_applies_its_slice_of_the_single_device_mask(two_ranks, layout):
    """The loss and every adapter's gradient equal the single device's with the same seed (1e-6 relative)."""
    diffs = two_ranks[layout]
    assert len(diffs) == 1 + two_ranks["adapters"] > 20, diffs  # every adapter of qwen-tiny's 2 blocks
    assert max(diffs.values()) < TOL, {k: v for k, v in diffs.items() if v >= TOL}


@pytest.mark.parametrize("layout", ["tp2 naive", "sp2 naive"])
def test_a_mask_drawn_at_the_rank_input_shape_is_not_the_single_device(two_ranks, layout):
    """Each rank's own draw (peft's nn.Dropout on its slice): row-split layers' TP ranks get the same mask for each
    feature slice, SP ranks the same for each slice of positions; the loss and the gradients leave the single
    device's by far more than the tolerance."""
    diffs = two_ranks[layout]
    assert diffs["loss"] > 100 * TOL and max(diffs.values()) > 1e-2, diffs
