"""--sequence-parallel (Megatron's, with --tp) on the MoE decoders and on moondream's parallel block (issue 54
deliver 3; mmpipe.model.tp_plans' module docstring, docs/tensor_parallel.md), in-process on 2 gloo ranks (one fork):
each model split by its family's plan twice, with and without SP, on one packed row.

MoE (Qwen3-VL-MoE untied: MoeHead; Qwen3.5-MoE with its shared expert, tied: TiedMoeHead, both layer kinds;
InternVL3.5's MoE decoder): the router runs on this rank's 1/TP of the positions, the experts on the row gathered
over TP, their partial outputs reduce-scattered back, the layer's statistics summed over TP. The loss (LM + aux, at
aux_coef 1 so the aux term's gradient is no rounding beside the LM loss's), the aux loss itself and every rank's
gradient of every tensor equal TP alone's. Moondream (Phi's parallel attention + MLP under one LayerNorm): its two
branch regions gather and reduce-scatter as a sequential block's. Gemma 4, dense and MoE: the per-layer inputs
scattered with the row, the K/V fields made in the attention regions from the gathered row."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from forked_ranks import forked
from mmpipe.config import config_from_dict, load_preset
from mmpipe.model import tensor_parallel
from mmpipe.model.builder import IGNORE_INDEX
from mmpipe.model.moe import split_aux
from mmpipe.model.objectives import vocab_parallel_lm_loss
from mmpipe.model.tensor_parallel import Shard
from test_tensor_parallel import _counting, _row, _split_model

MOE = {"experts": 8, "top_k": 2, "ff_dim": 32, "aux_coef": 1.0}
MODELS = {"qwen3-vl-moe": ("qwen3-vl-tiny", {"tie_embeddings": False, "moe": MOE}),
          "qwen3.5-moe": ("qwen3.5-tiny", {"moe": {**MOE, "shared_ff_dim": 32}}),
          "internvl-moe": ("internvl-tiny", {"moe": MOE}),
          "moondream": ("tiny", {}),
          # Gemma 4: the per-layer inputs scattered with the row, K/V producers and readers, sandwich norms; its MoE
          # blocks' router and experts beside the dense MLP (the preset's experts, at aux_coef 1)
          "gemma3": ("gemma3-tiny", {}),
          "gemma4": ("gemma4-tiny", {}),
          "gemma4-moe": ("gemma4-moe-tiny", {"moe": {"aux_coef": 1.0}})}
COLLECTIVES = ("_all_reduce", "_all_gather", "_reduce_scatter")


def _model(name: str) -> dict:
    """MODELS[name] as a model JSON's dict: its preset, its text section's changes (an moe section merged)."""
    preset, text = MODELS[name]
    model = load_preset(preset).to_dict()
    model["text"].update({k: {**(model["text"].get(k) or {}), **v} if k == "moe" else v for k, v in text.items()})
    return model


def _write_models(root) -> dict[str, str]:
    paths = {}
    for name in MODELS:
        paths[name] = str(root / f"{name}.json")
        (root / f"{name}.json").write_text(json.dumps(_model(name)))
    return paths


def _padded(inputs, labels, tp: int):
    """One more padding position where TP does not divide the row (each rank holds L / TP of it)."""
    if labels.shape[1] % tp == 0:
        return inputs, labels
    pad = torch.zeros(1, 1, dtype=torch.long)
    inputs = (inputs[0], torch.cat([inputs[1], pad], 1), inputs[2], torch.cat([inputs[3], pad], 1), *inputs[4:])
    return inputs, torch.cat([labels, pad + IGNORE_INDEX], 1)


def _run(cfg, shard: Shard, inputs, labels) -> tuple[dict, dict, float, float | None, dict]:
    """One forward and backward of the split model: (the collectives counted, the tp_summed gradients before the
    step's sum, the loss, the aux loss, the parameters after the sum)."""
    counts, saved = {}, {name: getattr(tensor_parallel, name) for name in COLLECTIVES}
    for name, fn in saved.items():
        setattr(tensor_parallel, name, _counting(fn, counts, name))
    try:
        model = _split_model(cfg, shard)
        out = model(*inputs)
        loss = vocab_parallel_lm_loss(shard, cfg.text.vocab_size)[0](out, labels)
        loss.backward()
    finally:
        for name, fn in saved.items():
            setattr(tensor_parallel, name, fn)
    shares = {k: p.grad.clone() for k, p in model.named_parameters() if getattr(p, "tp_summed", False)}
    tensor_parallel.sum_summed_gradients(model.parameters(), shard)  # the step's sum (sum_gradients_at_step)
    aux = split_aux(out)[1]
    return counts, shares, loss.item(), None if aux is None else aux.item(), dict(model.named_parameters())


def _check(shard: Shard, path: str) -> dict:
    """SP against TP alone (test_tensor_parallel._sp_check's comparison, with the aux loss): losses, aux losses,
    each rank's gradient of every tensor relative to its largest element, the collectives of each run, and how far
    the whole weights' gradients were before the step's TP sum (each rank's positions' share)."""
    cfg = load_preset(path)
    inputs, labels = _padded(*_row(cfg), shard.size)
    tp = _run(cfg, shard, inputs, labels)
    sp = _run(cfg, dataclasses.replace(shard, sequence=True), inputs, labels)
    diffs = {f"{tag} {k}": v for tag, run in (("tp", tp), ("sp", sp)) for k, v in run[0].items()}
    diffs["loss"] = abs(tp[2] - sp[2])
    if tp[3] is not None:
        diffs.update({"aux": abs(tp[3] - sp[3]), "aux tp": tp[3]})
    for k, p in tp[4].items():
        diffs[f"grad {k}"] = ((sp[4][k].grad - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
    for k, g in sp[1].items():  # SP's whole weights before the sum: this rank's positions' share of TP's gradient
        diffs[f"share {k}"] = ((g - tp[4][k].grad).abs().max() / tp[4][k].grad.abs().max().clamp(min=1e-12)).item()
    return diffs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp_sp_moe")
    paths = _write_models(tmp)
    return forked(tmp, lambda rank: {name: _check(Shard(dist.group.WORLD, rank, 2), path)
                                     for name, path in paths.items()})[0]


def _counts(cfg) -> tuple[int, int, int]:
    """(all-gathers, reduce-scatters, all-reduces SP saves) of a model's whole forward + backward under SP. A
    decoder block's attention (or Gated DeltaNet) region: 2 all-gathers forward + backward's re-gather and row
    all-gather = 3, 2 reduce-scatters, 2 all-reduces of TP alone's; a dense MLP (moondream's branch, Gemma 4's beside
    its experts) or a shared expert likewise. The experts: x, the top-k ids and weights gathered forward, the output's
    gradient backward (4), the output reduce-scattered forward and x's and the weights' gradients backward (3), where
    TP alone all-reduced the output forward and x's and the weights' gradients backward (3), the statistics
    all-reduced under SP only (1). The embedding's scatter (its gradient gathered; Gemma 4's per-layer inputs too) and
    the head's gather (gradient reduce-scattered, TP alone's all-reduce): 2 all-gathers (3) and 1 reduce-scatter more;
    each DeepStack add 1 all-gather backward."""
    t, region = cfg.text, (3, 2, 2)
    moe = getattr(t, "moe", None)
    parts = [region, *([region] if moe is None or cfg.family == "gemma4" else []), *([(4, 3, 2)] if moe else []),
             *([region] if moe and moe.shared_ff_dim else [])]
    adds = len(getattr(cfg.vision, "deepstack_indexes", ()) or ()) + (1 if getattr(t, "ple_dim", 0) else 0)
    return tuple(t.n_layers * sum(p[i] for p in parts) + (2 + adds, 1, 1)[i] for i in range(3))


# Measured (fp32): losses and aux losses bit-equal for the first four; the largest gradient difference relative to
# its tensor's largest element: qwen3-vl-moe 2.1e-7, internvl-moe 1.4e-7, moondream 4.2e-7, only in the whole weights
# (norms, routers: their positions summed in another order; every split weight bit-equal); qwen3.5-moe 2.4e-5 (layer
# 7's Gated DeltaNet dt_bias / A_log). Its one source: the shared expert's gate, a [N, D] x [D, 1] matmul, whose
# rounding on the CPU depends on the row count (N / TP positions under SP, N without: 1.9e-6 apart at N 50, measured;
# a router's [D, E] product was bit-equal), which the DeltaNet's fp32 chunked solves amplify, as test_tp_moe's
# 2.9e-4 against the whole model. Gemma 4 (its replicated matmuls on N / TP rows round otherwise too, carried through
# its soft-capped head and sandwich norms, as its 2.7e-5 / 3.6e-5 TP against the whole model): gemma4 loss 0.0,
# gradients 1.1e-5, gemma4-moe loss 4.8e-7, aux 2.4e-7, gradients 2.3e-6. By hand the same checks in float64
# (their fp32 casts too): qwen3.5-moe 4.2e-16, gemma4 2.9e-15, gemma4-moe 4.0e-15: exact.
TOL = {"qwen3.5-moe": 1e-3, "gemma4": 1e-4, "gemma4-moe": 1e-4}
ROUTERS = ("mlp.gate.weight", "router.proj.weight")


@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallel_equals_tp_alone(two_ranks, name):
    """Losses and aux losses bit-equal or within 1e-6; every rank's gradient of every tensor (the experts' F / TP
    slices, the routers', the shared expert's and the norms' after the step's TP sum) within 1e-6 of its tensor's
    largest element (TOL: measured above); the collectives SP runs in place of TP's all-reduces (_counts)."""
    diffs, tol, cfg = two_ranks[name], TOL.get(name, 1e-6), config_from_dict(_model(name), name)
    assert diffs["loss"] < 1e-6, diffs["loss"]
    if getattr(cfg.text, "moe", None):
        assert diffs["aux tp"] > 0.5 and diffs["aux"] < 1e-6, (diffs["aux tp"], diffs["aux"])  # E x sum f p >= 1
        assert any(k.endswith("experts.gate_up_proj") for k in diffs)
        # the routers hold each rank's positions' share until the step's sum (they route only those): 0.35-0.87 of
        # their largest element off, measured
        routers = [v for k, v in diffs.items() if k.startswith("share") and k.endswith(ROUTERS)]
        assert len(routers) == cfg.text.n_layers and min(routers) > 0.2, routers
    grads = {k: v for k, v in diffs.items() if k.startswith("grad ")}
    assert max(grads.values()) < tol, {k: v for k, v in grads.items() if v >= tol}
    gathers, scatters, saved = _counts(cfg)
    assert "tp _all_gather" not in diffs and "tp _reduce_scatter" not in diffs, diffs
    assert (diffs["sp _all_gather"], diffs["sp _reduce_scatter"]) == (gathers, scatters), diffs
    assert diffs["tp _all_reduce"] - diffs["sp _all_reduce"] == saved, diffs


def test_the_front_door_accepts_sequence_parallel_on_them(tmp_path):
    """`--tp 2 --sequence-parallel` on these models passes the plan check (every layer from the decoder embedding on
    has a SEQUENCE role; the tied MoE head, a forward_fn object, read by its class, as parallelize reads it: it was
    refused by its repr), where a plan without the form is refused in one line."""
    from mmpipe.planning.tensor_parallel import sequence_parallel_problems
    for name, path in _write_models(tmp_path).items():
        assert sequence_parallel_problems(2, load_preset(path), None, 0) == [], name
    tied = load_preset(_write_models(tmp_path)["qwen3-vl-moe"]).to_dict()
    tied["text"]["tie_embeddings"] = True
    (tmp_path / "tied.json").write_text(json.dumps(tied))
    assert sequence_parallel_problems(2, load_preset(str(tmp_path / "tied.json")), None, 0) == []
    assert sequence_parallel_problems(2, load_preset("tiny-xattn"), None, 0) == [
        "--sequence-parallel on tiny-xattn: its plan has no sequence-parallel form (no SEQUENCE entry scatters "
        "the decoder's row)"]


def test_the_planner_counts_what_each_tp_rank_carries():
    """`mmpipe plan --tp` on Gemma 4 with K/V sharing: each TP rank carries its own kv heads' K/V fields (the plan's
    CARRIED widths; gemma-4-e4b: 2 kv heads, 1 a rank at TP 2), and with --sequence-parallel its positions' share of
    the per-layer inputs the embedding scatters; the layer after the last K/V producer of a 1282-position row."""
    from mmpipe.planning.costmodel import layer_costs
    from mmpipe.planning.tensor_parallel import tp_layer_costs
    cfg = load_preset("gemma-4-e4b")
    t, rows = cfg.text, layer_costs(cfg, (), 1024)
    i = max(range(len(rows)), key=lambda k: rows[k].carried_elems)
    kv = sum(2 * t.layer_kv_heads(s) * t.layer_head_dim(s) for s in (True, False)) * rows[i].tokens  # both fields
    ple = t.n_layers * t.ple_dim * rows[i].tokens
    assert rows[i].carried_elems == kv + ple
    assert tp_layer_costs(cfg, rows, 2)[i].carried_elems == kv / 2 + ple
    assert tp_layer_costs(cfg, rows, 2, sequence=True)[i].carried_elems == kv / 2 + ple / 2
