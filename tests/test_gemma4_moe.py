"""Gemma 4's MoE block (issue 55 item 4: 26B-A4B) against transformers: test_gemma4's tiny
Gemma4ForConditionalGeneration with enable_moe_block (8 experts of 16, top 2) beside each of its 5 layers' dense MLP,
the router's scale and per-expert scales perturbed from their init of 1. `mmpipe import --hf` gives transformers'
logits, the experts' half showing; a packed row's samples each give their logits alone; `mmpipe export` loads back
into transformers with the run's logits; cached greedy generation gives transformers' tokens; the router statistics
cross every decoder boundary to the head; the planner counts each block's experts and `mmpipe check`'s profile
times each sparse kind; gemma-4-26b-a4b holds the published 25.2B / 3.8B active; a bad MoE section is one line.
In-process."""
from __future__ import annotations

import json

import pytest
import torch

from mmpipe.cli import main
from mmpipe.config import PRESET_DIR, ConfigError, config_from_dict, load_preset
from mmpipe.model import layer_param_counts
from mmpipe.model.builder import layer_specs
from mmpipe.model.moe import split_aux
from mmpipe.model.stage import live_fields
from mmpipe.registry import family_of
from mmpipe.runtime.checkpoint import load_reference
from test_gemma3 import _tokenizer
from test_gemma4 import BOI, EOI, IMG, LOGITS_TOL, SOFT, TOL, _hf_model, _packed, _two_image_prompts, hf_inputs

MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' MoE model, the run `mmpipe import --hf` made of it, the imported model)."""
    d = tmp_path_factory.mktemp("gemma4_moe")
    hf = _hf_model(**MOE)
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = config_from_dict(json.loads((d / "run" / "model.json").read_text()), "gemma4")
    return hf, d / "run", load_reference(d / "run" / "checkpoints", cfg).eval()


def _logits(model, *inputs):
    return split_aux(model(*inputs))[0]


def test_import_gives_transformers_logits(imported):
    """Every decoder layer sparse, the head the soft-capped tied one that also returns the (0: transformers' Gemma 4
    has none) load-balancing term; with every expert's output zeroed the logits move far past the tolerance."""
    hf, run, model = imported
    assert model.cfg.text.moe.experts == 8 and model.cfg.text.moe.aux_coef == 0
    assert [type(x).__name__ for x in model][5:10] == [
        "Gemma4SlidingMoeBlock", "Gemma4SlidingMoeStore", "Gemma4GlobalMoeStore", "Gemma4SlidingMoeShared",
        "Gemma4GlobalMoeShared"]
    ids, px = _two_image_prompts(torch.Generator().manual_seed(1))
    inputs = (px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
    with torch.no_grad():
        want = hf(**hf_inputs(ids, px), mm_token_type_ids=(ids == IMG).long()).logits
        logits, aux = model(*inputs)
        kept = [layer.experts.down_proj.clone() for layer in list(model)[5:10]]
        for layer in list(model)[5:10]:
            layer.experts.down_proj.zero_()
        without = _logits(model, *inputs)
        for layer, w in zip(list(model)[5:10], kept):
            layer.experts.down_proj.copy_(w)
    assert (logits - want).abs().max().item() < LOGITS_TOL
    assert aux.item() == 0
    assert (without - want).abs().max().item() > 100 * LOGITS_TOL


def test_packed_row_equals_each_sample_alone(imported):
    """Routing is per position: a packed row's samples each give their logits alone."""
    *_, model = imported
    ids, px = _two_image_prompts(torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = _logits(model, px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
        packed = _logits(model, *_packed(ids, px))
    assert (packed[0, :20] - alone[0]).abs().max().item() < TOL
    assert (packed[0, 20:40] - alone[1]).abs().max().item() < TOL


def test_export_loads_in_transformers(imported, tmp_path):
    """`mmpipe export` writes enable_moe_block and the experts under transformers' names: from_pretrained of it
    gives the run's logits."""
    from transformers import Gemma4ForConditionalGeneration
    _, run, model = imported
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    t = hf.config.text_config
    assert (t.enable_moe_block, t.num_experts, t.top_k_experts, t.moe_intermediate_size) == (True, 8, 2, 16)
    ids, px = _two_image_prompts(torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _logits(model, px, ids, torch.ones(2, 2, dtype=torch.long), torch.ones_like(ids))
        got = hf(**hf_inputs(ids, px), mm_token_type_ids=(ids == IMG).long()).logits
    assert (got - want).abs().max().item() < LOGITS_TOL


def test_cached_generation_equals_transformers_greedy(imported):
    """mmpipe's KV-cached greedy decode (the sparse blocks' decode: routing one new position at a time, the sliding
    window past its 6 positions, the shared layers reading their producers' cache) gives transformers' greedy
    generate's 12 token ids for 4 prompts, each with its own 24 px image (no EOS: every step compared)."""
    from mmpipe.inference.generate import generate
    from mmpipe.inference.sampling import Sampling
    hf, _, model = imported
    g = torch.Generator().manual_seed(7)
    for i in range(4):
        px = torch.rand(1, 1, 3, 24, 24, generator=g)
        prompt = [1, 4, BOI] + [IMG] * SOFT + [EOI, 40 + i, 50 + i, 5]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(**hf_inputs(ids, px), mm_token_type_ids=(ids == IMG).long(), max_new_tokens=12,
                               do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
        assert generate(model, px, prompt, Sampling(max_new_tokens=12, eos_id=None)) == want


def test_router_statistics_cross_to_the_head_and_the_planner_counts_experts():
    """gemma4-moe-tiny: moe_stats made by decoder layer 0 and kept to the head beside the per-layer inputs and the
    shared K/V; the planner gives each of the 5 blocks its 4 experts of 3 x 32 x 16 (what --ep splits)."""
    from mmpipe.planning.costmodel import layer_costs
    cfg = load_preset("gemma4-moe-tiny")
    specs = layer_specs(cfg)
    out = [[f.name for f in fields if f.floating] for fields in
           live_fields(family_of(cfg).fields(cfg), [s.typename for s in specs])[1:]]
    ple = ["hidden", "per_layer", "moe_stats"]
    assert out[:11] == [["hidden"]] * 4 + [["hidden", "per_layer"], ple, ple + ["kv_sliding"],
                                           ple + ["kv_sliding", "kv_full"], ple + ["kv_full"]] + [
        ["hidden", "moe_stats"]] * 2
    rows = layer_costs(cfg, (), text_len=24)
    assert [r.expert_params for r in rows] == [0] * 5 + [4 * 3 * 32 * 16] * 5 + [0, 0]


def test_the_profile_times_every_sparse_kind():
    """`mmpipe check`'s profile (costmodel.profile_layers) times one layer of each kind on random inputs: the sparse
    classes after decoder layer 0 and the head take moe_stats [micro, 2, E] beside the per-layer inputs and K/V."""
    from mmpipe.planning.costmodel import profile_layers
    cfg = load_preset("gemma4-moe-tiny")
    kinds = profile_layers(cfg, 8, 2, "fp32", repeats=1)
    assert {"Gemma4SlidingMoeBlock", "Gemma4SlidingMoeStore", "Gemma4GlobalMoeStore", "Gemma4SlidingMoeShared",
            "Gemma4GlobalMoeShared"} <= set(kinds)
    assert all(f > 0 and b > 0 for f, b in kinds.values())


def test_26b_a4b_preset_holds_the_published_counts():
    """gemma-4-26b-a4b's text model (the embedding, tied head once, and 30 decoder layers: the model card's count,
    the ~550M vision encoder apart) is 25,233,141,760 parameters, 3,822,530,560 of them active a token (the 120 of
    128 experts of 3 x 2816 x 704 a layer skipped): the published 25.2B total and 3.8B active (docs/gemma4.md)."""
    cfg = load_preset("gemma-4-26b-a4b")
    counts = layer_param_counts(cfg)[:-1]  # the last, the tied head, is the embedding's matrix again
    tower = sum(counts[:cfg.vision.n_layers + 2])  # patch embed, tower blocks, projector
    text = sum(counts) - tower
    active = text - cfg.text.n_layers * (128 - 8) * 3 * 2816 * 704
    assert (text, active) == (25_233_141_760, 3_822_530_560)
    assert (round(text / 1e9, 1), round(active / 1e9, 1), round(tower / 1e6)) == (25.2, 3.8, 573)


def test_a_bad_moe_section_is_one_line(tmp_path):
    """A model JSON with a shared expert (Gemma 4 has none: its dense MLP is the always-on path) is refused naming
    the field; enable_moe_block without the experts' sizes, likewise on import (test_gemma4)."""
    preset = json.loads((PRESET_DIR / "gemma4-moe-tiny.json").read_text())
    preset["text"]["moe"]["shared_ff_dim"] = 8
    with pytest.raises(ConfigError, match="text.moe.shared_ff_dim: 8: Gemma 4's MoE block has no shared expert"):
        config_from_dict(preset, "bad")
