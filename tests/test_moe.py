"""Mixture-of-experts decoder blocks (issue 43, first slice; docs/moe.md) against transformers' own
Qwen3VLMoeForConditionalGeneration, built tiny and random here (tests/qwen3_models.py's Qwen3-VL shape: 5-block
tower with DeepStack after blocks 0, 2, 3, a decoder of 4 layers of width 64, each MLP 8 experts of width 40,
top 2). In-process, no launches (tests/test_moe_pipeline.py runs the pipeline):

- import (`mmpipe import --hf`'s reader, by model_type qwen3_vl_moe) gives transformers' logits (1e-4) and its
  load-balancing loss (`aux_loss`, 1e-6) on single images, two images and a text-only sample, and the samples
  packed into one row give each one's logits; the export loads in transformers with equal logits;
- the dispatch through torch's grouped matmul and the loop over experts give the same outputs and gradients;
- no token is dropped: a router forced to send every token to the same two experts gives every token those
  experts' output, with every choice counted;
- the load-balancing term reaches every layer's router; bad MoE configs are one line each."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from conftest import write_checkpoint
from hf_models import peft_of, with_random_adapters
from mmpipe.cli import main as cli
from mmpipe.config import ConfigError, config_from_dict, load_preset
from mmpipe.hf.commands import hf_reader
from mmpipe.hf.qwen3_vl import export_hf, key_map
from mmpipe.model import moe
from mmpipe.model.builder import bound, layer_specs, lm_loss
from mmpipe.model.lora import LORA_FILE, is_adapter
from mmpipe.model.qwen3_vl import MoeConfig
from mmpipe.model.stage import live_fields
from mmpipe.registry import family_of
from qwen3_models import perturbed, processor, qwen3_config
from qwen_models import assert_greedy_is_hf_generate, hf_logits
from test_hf_qwen3_vl import SAMPLES, _sample, row

TOL = 1e-4
EXPERTS, TOP_K, EXPERT_FF = 8, 2, 40


def moe_config() -> Qwen3VLMoeConfig:
    dense = qwen3_config().to_dict()
    text, vision = dense["text_config"], dense["vision_config"]
    text.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_FF)
    for section in (text, vision):
        section.pop("model_type", None)
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **{
        k: dense[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})


def _louder_router(name, p):
    if name.endswith("mlp.gate.weight"):
        p.mul_(30)  # std 0.02 routes every token ~uniformly: top-2 ties would hide a wrong expert order


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    hf = perturbed(Qwen3VLMoeForConditionalGeneration(moe_config()).eval(), _louder_router)
    hf.save_pretrained(d)
    processor().save_pretrained(d)
    got = hf_reader(d)(d)  # mmpipe import --hf's reader, picked by config.json's model_type
    return d, hf, got.model().eval(), got.report


def test_import_gives_hf_logits_and_aux_loss(hf_moe):
    d, hf, model, report = hf_moe
    m = model.cfg.text.moe
    assert (m.experts, m.top_k, m.ff_dim, m.aux_coef, m.norm_topk) == (EXPERTS, TOP_K, EXPERT_FF, 0.001, True)
    assert sum(isinstance(layer, moe.Qwen3MoeBlock) for layer in model) == 4 and isinstance(model[-1], moe.MoeHead)
    assert report.mapped == len(hf.state_dict())
    routed = set()
    for i, (name, _) in enumerate(SAMPLES):
        ids, px, grids = _sample(i)
        with torch.no_grad():
            logits, aux = model(*row([(ids, px, grids)])[0])  # padding positions and patches after the sample
            kw = {} if px is None else dict(pixel_values=px, image_grid_thw=grids,
                                            mm_token_type_ids=(ids == hf.config.image_token_id).int()[None])
            want = hf(input_ids=ids[None], output_router_logits=True, **kw)
        assert (logits[0, :len(ids)] - want.logits[0]).abs().max().item() < TOL, name
        assert abs(aux.item() / m.aux_coef - want.aux_loss.item()) < 1e-6, name
        routed |= {int(e) for r in want.router_logits for e in r.topk(TOP_K, -1).indices.flatten()}
    assert routed == set(range(EXPERTS))  # every expert served some token: a mis-ordered expert would show


def test_packed_row_gives_each_samples_logits(hf_moe):
    _, hf, model, _ = hf_moe
    samples = [_sample(i) for i in (1, 4, 3)]
    with torch.no_grad():
        logits, _ = model(*row(samples)[0])
        for (a, b), (ids, px, grids) in zip(row(samples)[1], samples):
            assert (logits[0, a:b] - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL


def test_export_loads_in_transformers_with_equal_logits(hf_moe, tmp_path):
    _, hf, model, _ = hf_moe
    back = Qwen3VLMoeForConditionalGeneration.from_pretrained(export_hf(model, tmp_path / "out")).eval()
    assert back.config.text_config.num_experts == EXPERTS and back.config.text_config.num_experts_per_tok == TOP_K
    sd = back.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in hf.state_dict().items())
    ids, px, grids = _sample(3)
    with torch.no_grad():
        got = model(*row([(ids, px, grids)])[0])[0][0, :len(ids)]
    assert (got - hf_logits(back, ids, px, grids)).abs().max().item() < TOL


def test_transposed_expert_layout_imports_as_transformers_reads_it(hf_moe, tmp_path):
    """A checkpoint whose experts are stored transposed ([E, D, 2F], [E, F, D]: the layout transformers 5 still reads,
    transposing on load) imports to the same weights, and transformers' own load of it gives the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file
    d, hf, model, _ = hf_moe
    legacy = tmp_path / "legacy"
    shutil.copytree(d, legacy)
    tensors = load_file(str(d / "model.safetensors"))
    flipped = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()}
    assert flipped["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 64, 2 * EXPERT_FF)
    save_file(flipped, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    got = hf_reader(legacy)(legacy).model().eval()
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), model.state_dict().values()))
    theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(legacy).eval()
    ids, px, grids = _sample(0)
    with torch.no_grad():
        mine = got(*row([(ids, px, grids)])[0])[0][0, :len(ids)]
    assert (mine - hf_logits(theirs, ids, px, grids)).abs().max().item() < TOL


def _block(cfg=None):
    cfg = cfg or tiny_moe()
    i = next(k for k, s in enumerate(layer_specs(cfg)) if s.typename is moe.Qwen3MoeBlock)
    torch.manual_seed(0)
    return cfg, bound(moe.Qwen3MoeBlock(cfg), cfg, i)


def tiny_moe(**moe_fields):
    """qwen3-vl-tiny with 8 experts of 40, top 2, untied (the pipeline test's model)."""
    base = load_preset("qwen3-vl-tiny")
    d = base.to_dict()
    d["text"]["moe"] = dict(dict(experts=EXPERTS, top_k=TOP_K, ff_dim=EXPERT_FF), **moe_fields)
    d["text"]["tie_embeddings"] = False  # untied, as the released MoE models are
    return config_from_dict(d, "qwen3-vl-moe-tiny")


def test_grouped_matmul_and_loop_dispatch_agree():
    """torch's grouped matmul (one call for all experts, offsets on the device) and the loop over the experts that
    have tokens: the same output and the same gradients for x, the router and every expert."""
    cfg, block = _block()
    x = torch.randn(300, cfg.text.dim)
    with torch.no_grad():
        block.mlp.gate.weight.mul_(30)
    probs, idx, w = block.mlp.gate(x)
    assert len(idx.unique()) == EXPERTS
    runs = {}
    for how in ("grouped", "loop"):
        block.zero_grad()
        xi = x.clone().requires_grad_()
        block.mlp.experts.dispatch = how
        out = block.mlp.experts(xi, *block.mlp.gate(xi)[1:])
        out.square().sum().backward()
        runs[how] = [out, xi.grad] + [p.grad.clone() for p in block.mlp.parameters()]
    assert moe.grouped_mm_ok(x)  # on this CPU, torch offers it: the default path is the grouped one
    for a, b in zip(*runs.values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_no_token_is_dropped_when_all_go_to_the_same_experts():
    """A router forced to send all 512 tokens to experts 3 and 5 (weights 0.7 / 0.3): 4 x the 128 a capacity factor
    of 1 would allow each (512 x 2 / 8). Every token's output is 0.7 E3(x) + 0.3 E5(x), by both dispatches, and the
    statistics count all 512 choices of each."""
    cfg, block = _block()
    x = torch.randn(2, 256, cfg.text.dim)
    N = x.shape[0] * x.shape[1]
    forced = (torch.zeros(N, EXPERTS), torch.tensor([[3, 5]]).expand(N, 2), torch.tensor([[0.7, 0.3]]).expand(N, 2))
    block.mlp.gate.forward = lambda flat: forced
    e = block.mlp.experts

    def expert(k, v):
        gate, up = F.linear(v, e.gate_up_proj[k]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, e.down_proj[k])
    flat = x.reshape(-1, cfg.text.dim)
    want = 0.7 * expert(3, flat) + 0.3 * expert(5, flat)
    for how in ("grouped", "loop"):
        e.dispatch = how
        with torch.no_grad():
            y, stats = block.mlp(x, torch.ones(2, 256, dtype=torch.bool))
        torch.testing.assert_close(y.reshape(-1, cfg.text.dim), want, atol=1e-6, rtol=1e-5)
        assert stats.sum(0)[0].tolist() == [0, 0, 0, N, 0, N, 0, 0], how


def test_aux_loss_reaches_every_router_and_rides_the_stage_tuple(hf_moe):
    """moe_stats is a float stage field from the first MoE block to the head; the head's auxiliary term alone gives
    every layer's router a gradient (so lm_loss's sum trains them on whatever stage they sit)."""
    from mmpipe.model import ReferenceModel
    cfg = hf_moe[2].cfg
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, moe=dataclasses.replace(cfg.text.moe,
                                                                                                aux_coef=0.01)))
    specs = layer_specs(cfg)
    kinds = [s.typename for s in specs]
    live = live_fields(family_of(cfg).fields(cfg), kinds)
    first = kinds.index(moe.Qwen3MoeBlock)
    assert all(("moe_stats" in [f.name for f in fs]) == (i > first) for i, fs in enumerate(live))
    torch.manual_seed(0)
    model = ReferenceModel(cfg, seed=3)
    ids, px, grids = _sample(0)
    inputs = row([(ids, px, grids)])[0]
    logits, aux = model(*inputs)
    assert aux.item() > 0
    aux.backward()
    routers = [layer.mlp.gate.weight.grad for layer in model if isinstance(layer, moe.Qwen3MoeBlock)]
    assert len(routers) == cfg.text.n_layers and all(g is not None and g.abs().sum() > 0 for g in routers)
    labels = torch.full(logits.shape[:2], -100)
    labels[0, : len(ids) - 1] = ids[1:]
    total = lm_loss((logits, aux), labels)
    assert total.item() == pytest.approx(lm_loss(logits, labels).item() + aux.item(), abs=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(top_k=9), "text.moe.top_k: 9 must be between 1 and the 8 experts"),
    (dict(experts=0), "text.moe.experts"),
    (dict(aux_coef=-1.0), "text.moe.aux_coef"),
])
def test_bad_moe_config_is_one_line(change, message):
    with pytest.raises(ConfigError) as e:
        tiny_moe(**change)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_moe_on_a_family_without_moe_blocks_is_refused():
    for preset in ("qwen2-vl-2b", "llava-tiny"):  # (qwen3.5 has MoE blocks: Qwen3.5-MoE)
        d = load_preset(preset).to_dict()
        d["text"]["moe"] = dataclasses.asdict(MoeConfig(experts=8, top_k=2, ff_dim=16))
        with pytest.raises(ConfigError, match="moe"):
            config_from_dict(d, preset)


def test_cost_rule_counts_the_active_parameters():
    """The planner's rule for an MoE block (mmpipe.model.moe.MOE_BLOCK): its FLOPs are the dense block's on the
    parameters a token runs through, the attention, norms, router and top_k of the experts: the same block built
    with top_k experts holds those, but for the router's rows of the other E - top_k."""
    from mmpipe.model import costs
    cfg, seq = tiny_moe(), 88
    total = sum(p.numel() for p in moe.Qwen3MoeBlock(cfg).parameters())
    only_k = sum(p.numel() for p in moe.Qwen3MoeBlock(tiny_moe(experts=TOP_K)).parameters())
    active = only_k + (EXPERTS - TOP_K) * cfg.text.dim
    assert active < total / 2
    got = moe.MOE_BLOCK.cost_of(cfg, total, 0, seq)
    assert got.fwd == costs._llama_block(cfg, active, 0, seq).fwd


def test_generation_gives_hf_generate_tokens(hf_moe):
    """mmpipe's KV-cached greedy decoding (each layer's decode: the MoE block's run, the head's logits alone) and the
    uncached one give transformers' generate tokens on an image prompt."""
    _, hf, model, _ = hf_moe
    assert_greedy_is_hf_generate(model, hf, *_sample(2))


def test_cli_import_and_export_round_trip(hf_moe, tmp_path):
    """`mmpipe import --hf` writes an MoE run (model.json with text.moe, layer files of whole experts) and
    `mmpipe export` of it loads in transformers as a Qwen3VLMoeForConditionalGeneration with the same tensors."""
    import json

    from mmpipe.cli import main
    d, hf, _, _ = hf_moe
    assert main(["import", "--hf", str(d), "--out", str(tmp_path / "run")]) == 0
    moe_json = json.loads((tmp_path / "run" / "model.json").read_text())["text"]["moe"]
    assert moe_json == dict(experts=EXPERTS, top_k=TOP_K, ff_dim=EXPERT_FF, aux_coef=0.001, norm_topk=True)
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    back = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "out")
    sd = back.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in hf.state_dict().items())


def test_lora_adapts_the_attention_and_loads_with_peft_and_merged(hf_moe, tmp_path):
    """--lora on an MoE model (issue 43: LoRA on attention): each block's adapters sit on the attention's q, k, v, o
    projections, the router and the fused 3-D experts (not linears) frozen with the base; the adapters export as a
    peft adapter of transformers' Qwen3VLMoeForConditionalGeneration and, merged (`mmpipe export` of the run), as
    the model itself, both giving the adapted model's logits."""
    _, hf, model, _ = hf_moe
    adapted = with_random_adapters(model, groups=("text",))
    for layer in adapted:
        if isinstance(layer, moe.Qwen3MoeBlock):
            trained = {n for n, p in layer.named_parameters() if p.requires_grad}
            assert all(is_adapter(n) for n in trained)
            assert {n.split(".lora_")[0] for n in trained} == {f"self_attn.{x}_proj" for x in "qkvo"}, trained
    ids, px, grids = _sample(3)
    peft_model = peft_of(adapted, type(hf), tmp_path / "peft", key_map, export_hf)
    write_checkpoint(adapted, tmp_path / "run")
    (tmp_path / "run" / LORA_FILE).write_text(json.dumps(adapted.lora.to_dict()))
    assert cli(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "merged")]) == 0
    merged = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        want = adapted(*row([(ids, px, grids)])[0])[0][0, :len(ids)]
        assert (hf_logits(peft_model, ids, px, grids) - want).abs().max().item() < TOL
        assert (hf_logits(merged, ids, px, grids) - want).abs().max().item() < TOL
        assert (hf_logits(hf, ids, px, grids) - want).abs().max().item() > 1e-2  # the adapters count


def test_expert_all_to_all_is_the_deprecated_ones_without_its_warning(tmp_path):
    """EP's all-to-all (mmpipe.model.moe.AllToAll over torch.distributed.all_to_all_single) gives the output and
    input gradients of torch.distributed.nn.functional.all_to_all_single, which torch 2.14 deprecates with a
    FutureWarning on each call (4 lines in an EP=2 run's log), on uneven splits over 2 gloo processes, and warns
    nothing."""
    import socket

    import torch.multiprocessing as mp

    import a2a_worker
    import mmpipe.model.moe  # noqa: F401  (imported before the fork)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children start with torch and mmpipe imported (a spawn re-imports them, ~25 s on 2 busy cores)
    mp.start_processes(a2a_worker.check, args=(port, str(tmp_path / "out")), nprocs=2, start_method="fork")
    lines = [(tmp_path / f"out.{r}").read_text().strip() for r in (0, 1)]
    assert lines == ["[3, 4] True True []", "[5, 4] True True []"]
