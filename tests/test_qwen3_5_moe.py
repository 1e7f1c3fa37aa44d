"""Qwen3.5-MoE (issue 43; docs/qwen3_5.md) against transformers' own Qwen3_5MoeForConditionalGeneration, built tiny
and random here: tests/qwen3_5_models.py's shape (decoder layers linear, linear, full, linear, width 64) with every
layer's MLP sparse: 8 experts of width 40, top 2, and a shared expert of width 24 behind its sigmoid gate; the
routers' weights scaled up so that routing is decisive and every expert serves some token. In-process, no launches:

- the import (`mmpipe import --hf`'s reader, by model_type qwen3_5_moe) gives transformers' logits (1e-4) and its
  load-balancing loss (`aux_loss`, 1e-6) for an image sample and a text-only one;
- each sample of a packed row gives its logits alone (transformers' on each sample alone: its torch path for Gated
  DeltaNet has no sample boundaries, tests/test_hf_qwen3_5.py);
- the export loads in transformers with equal tensors; cached greedy decoding gives transformers' `generate` tokens;
- the shared expert counts (its gate set to -inf changes the logits), `moe_stats` rides from the first decoder layer
  to the head, the planner's rules cost the active parameters, and the presets of the released sizes hold their
  published total and active counts."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from mmpipe.config import PRESET_DIR, load_preset
from mmpipe.hf.commands import hf_reader
from mmpipe.model import moe
from mmpipe.model import qwen3_5 as q35
from mmpipe.model.builder import layer_specs
from mmpipe.model.qwen3_vl import Qwen3Merger, Qwen3PatchEmbed, Qwen3VisionBlock
from mmpipe.model.stage import live_fields
from mmpipe.registry import family_of
from qwen3_5_models import _deltanet, qwen3_5_config
from qwen3_models import perturbed, processor
from qwen_models import IMAGE, assert_greedy_is_hf_generate, hf_logits
from test_hf_qwen3_vl import SAMPLES, _sample, row

TOL = 1e-4
EXPERTS, TOP_K, EXPERT_FF, SHARED_FF = 8, 2, 40, 24


def moe_config() -> Qwen3_5MoeConfig:
    dense = qwen3_5_config().to_dict()
    text, vision = dense["text_config"], dense["vision_config"]
    text.pop("intermediate_size")  # Qwen3_5MoeTextConfig has no dense MLP: every layer is sparse
    text.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_FF,
                shared_expert_intermediate_size=SHARED_FF)
    for section in (text, vision):
        section.pop("model_type", None)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **{
        k: dense[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})


def _perturb(name, p):
    if name.endswith("mlp.gate.weight"):
        p.mul_(30)  # std 0.02 routes every token ~uniformly: top-2 ties would hide a wrong expert order
    elif name.endswith("shared_expert_gate.weight"):
        p.mul_(50)  # the gate varies from token to token, so a gate read from the wrong input shows
    else:
        _deltanet(name, p)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5_moe")
    torch.manual_seed(0)
    hf = perturbed(Qwen3_5MoeForConditionalGeneration(moe_config()).eval(), _perturb)
    hf.save_pretrained(d)
    processor().save_pretrained(d)
    got = hf_reader(d)(d)  # mmpipe import --hf's reader, picked by config.json's model_type
    return d, hf, got.model().eval(), got.report


def _hf(hf, ids, px, grids):
    kw = {} if px is None else dict(pixel_values=px, image_grid_thw=grids, mm_token_type_ids=(ids == IMAGE).int()[None])
    with torch.no_grad():
        return hf(input_ids=ids[None], output_router_logits=True, **kw)


def test_import_gives_hf_logits_and_aux_loss(hf_moe):
    """An image sample and a text-only one: transformers' logits and aux_loss; every expert served some token."""
    d, hf, model, report = hf_moe
    m = model.cfg.text.moe
    assert (m.experts, m.top_k, m.ff_dim, m.shared_ff_dim, m.aux_coef, m.norm_topk) == (
        EXPERTS, TOP_K, EXPERT_FF, SHARED_FF, 0.001, True)
    kinds = [type(layer) for layer in model]
    assert kinds.count(q35.DeltaNetMoeBlock) == 3 and kinds.count(q35.GatedAttentionMoeBlock) == 1
    assert isinstance(model[-1], moe.MoeHead) and report.mapped == len(hf.state_dict())
    routed = set()
    for i in (0, 4):  # square image, text only
        ids, px, grids = _sample(i)
        with torch.no_grad():
            logits, aux = model(*row([(ids, px, grids)])[0])  # padding positions and patches after the sample
        want = _hf(hf, ids, px, grids)
        assert (logits[0, :len(ids)] - want.logits[0]).abs().max().item() < TOL, SAMPLES[i][0]
        assert abs(aux.item() / m.aux_coef - want.aux_loss.item()) < 1e-6, SAMPLES[i][0]
        routed |= {int(e) for r in want.router_logits for e in r.topk(TOP_K, -1).indices.flatten()}
    assert routed == set(range(EXPERTS))  # a mis-ordered expert would show


def test_packed_row_gives_each_samples_logits(hf_moe):
    """Three samples in one row: each one's logits are transformers' on that sample alone."""
    _, hf, model, _ = hf_moe
    samples = [_sample(i) for i in (1, 4, 3)]
    inputs, spans = row(samples)
    with torch.no_grad():
        logits, _ = model(*inputs)
    for (a, b), (ids, px, grids) in zip(spans, samples):
        assert (logits[0, a:b] - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL


def test_shared_expert_counts(hf_moe):
    """With every shared expert's output zeroed the logits move: the shared expert is in the sum (the model is
    restored after)."""
    _, _, model, _ = hf_moe
    ids, px, grids = _sample(4)
    inputs = row([(ids, px, grids)])[0]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(*inputs)[0]
        for layer in model:
            if isinstance(layer, moe.MoeBlock):
                layer.mlp.shared_expert.down_proj.weight.zero_()
        got = model(*inputs)[0]
    model.load_state_dict(saved)
    assert (got - want).abs().max().item() > 1e-2


def test_export_loads_in_transformers_with_equal_tensors(hf_moe, tmp_path):
    """`mmpipe import --hf` then `mmpipe export` (the commands, in-process): the run's model.json keeps the moe
    section with its shared expert, and the export, its experts one module each as transformers saves them, loads
    in transformers' Qwen3_5MoeForConditionalGeneration with every tensor equal."""
    from safetensors import safe_open

    from mmpipe.cli import main
    d, hf, _, _ = hf_moe
    assert main(["import", "--hf", str(d), "--out", str(tmp_path / "run")]) == 0
    moe_json = json.loads((tmp_path / "run" / "model.json").read_text())["text"]["moe"]
    assert moe_json == dict(experts=EXPERTS, top_k=TOP_K, ff_dim=EXPERT_FF, aux_coef=0.001, norm_topk=True,
                            shared_ff_dim=SHARED_FF)
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "model.language_model.layers.0.mlp.experts.7.up_proj.weight" in f.keys()
    back = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    tc = back.config.text_config
    assert (tc.num_experts, tc.num_experts_per_tok, tc.shared_expert_intermediate_size) == (EXPERTS, TOP_K, SHARED_FF)
    sd = back.state_dict()
    assert sd.keys() == hf.state_dict().keys() and all(torch.equal(sd[k], v) for k, v in hf.state_dict().items())


def test_generation_gives_hf_generate_tokens(hf_moe):
    """mmpipe's KV-cached greedy decoding (the recurrent state and conv window for the linear layers, the sparse
    MLP at every step) and the uncached one give transformers' `generate` tokens on an image prompt."""
    _, hf, model, _ = hf_moe
    assert_greedy_is_hf_generate(model, hf, *_sample(2))


def test_moe_stats_ride_from_the_first_decoder_layer_and_reach_every_router(hf_moe):
    """moe_stats is made by layer 0's kind (linear here), kept to the head; the auxiliary term alone gives every
    layer's router (both kinds) a gradient."""
    cfg = hf_moe[2].cfg
    kinds = [s.typename for s in layer_specs(cfg)]
    live = live_fields(family_of(cfg).fields(cfg), kinds)
    first = kinds.index(q35.DeltaNetMoeBlock)
    assert all(("moe_stats" in [f.name for f in fs]) == (i > first) for i, fs in enumerate(live))
    model = hf_moe[2]
    ids, px, grids = _sample(0)
    _, aux = model(*row([(ids, px, grids)])[0])
    aux.backward()
    grads = [layer.mlp.gate.weight.grad for layer in model if isinstance(layer, moe.MoeBlock)]
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads)
    model.zero_grad()


@pytest.mark.parametrize("kind, rule, dense", [(q35.DeltaNetMoeBlock, q35.DELTANET_MOE_BLOCK, q35._deltanet_block),
                                               (q35.GatedAttentionMoeBlock, q35.GATED_ATTENTION_MOE_BLOCK,
                                                q35._gated_attention_block)])
def test_cost_rules_count_the_active_parameters(hf_moe, kind, rule, dense):
    """Each sparse kind's FLOPs are its dense kind's rule on the parameters a token runs through: the mixer, norms,
    router, shared expert and its gate, and top_k of the experts (the block built with top_k experts, plus the
    router's rows of the others); the family costs each kind by its own rule."""
    import dataclasses
    cfg, seq = hf_moe[2].cfg, 88
    only_k = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, moe=dataclasses.replace(cfg.text.moe,
                                                                                                   experts=TOP_K)))
    total = sum(p.numel() for p in kind(cfg).parameters())
    active = sum(p.numel() for p in kind(only_k).parameters()) + (EXPERTS - TOP_K) * cfg.text.dim
    assert active == total - (EXPERTS - TOP_K) * moe.expert_params(cfg) < total
    assert rule.cost_of(cfg, total, 0, seq).fwd == dense(cfg, active, 0, seq).fwd
    spec = next(s for s in layer_specs(cfg) if s.typename is kind)
    assert family_of(cfg).cost_rule(spec) is rule


def _counts(cfg) -> dict[str, int]:
    """A preset's parameters built on the meta device: total (mmpipe = transformers' model), the tower's, and the
    language model's active count: its total less the E - top_k experts a token skips in each sparse layer (the
    embedding and head counted whole, as the model cards count them)."""
    from mmpipe.planning.costmodel import layer_param_counts
    tower = (Qwen3PatchEmbed, Qwen3VisionBlock, Qwen3Merger)
    m, counts = cfg.text.moe, layer_param_counts(cfg)
    total = sum(counts)
    vision = sum(n for s, n in zip(layer_specs(cfg), counts) if issubclass(s.typename, tower))
    skipped = cfg.text.n_layers * (m.experts - m.top_k) * moe.expert_params(cfg)
    return {"total": total, "vision": vision, "active": total - vision - skipped}


def _mtp(cfg) -> int:
    """The released checkpoint's multi-token-prediction head (mtp.*, which transformers and the import skip): one
    gated full-attention layer with the sparse MLP, the 2D -> D fc and 3 norms (Qwen3.5-397B-A17B: 6,595,568,128, as
    the census in its preset's _source splits the checkpoint)."""
    with torch.device("meta"):
        layer = sum(p.numel() for p in q35.GatedAttentionMoeBlock(cfg).parameters())
    return layer + 2 * cfg.text.dim ** 2 + 3 * cfg.text.dim


@pytest.mark.parametrize("preset", ["qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"])
def test_presets_have_the_published_parameter_counts(preset):
    """The released sizes: mmpipe's total plus the checkpoint's mtp.* head is the checkpoint's exact total (the Hub
    API's safetensors.total, the preset's `_params`; within 1% asked, exact found); the language model's active
    count lies in what the model card's rounded figure pins (3B: [2.5, 3.5) B, 10B: [9.5, 10.5) B, 17B:
    [16.5, 17.5) B, the preset's `_active_interval`), and for the 397B equals the census's exact 17,349,040,896
    (`_active`). The counts with the tower (3.90 / 10.22 / 17.81 B) are not what the cards count."""
    data = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    cfg = load_preset(preset)
    got = _counts(cfg)
    assert got["total"] + _mtp(cfg) == int(data["_params"]), (preset, got)
    lo, hi = (float(x) * 1e9 for x in data["_active_interval"])
    assert lo <= got["active"] < hi, (preset, got)
    if "_active" in data:
        assert got["active"] == int(data["_active"])
    kinds = {s.typename for s in layer_specs(cfg)}
    assert {q35.DeltaNetMoeBlock, q35.GatedAttentionMoeBlock, moe.MoeHead} <= kinds and cfg.text.moe.shared_ff_dim


def test_transformers_model_of_a_preset_has_mmpipes_parameter_count():
    """transformers' Qwen3_5MoeForConditionalGeneration of hf_config(qwen3.5-35b-a3b) on the meta device holds
    exactly mmpipe's parameters (the same config read both ways)."""
    from mmpipe.hf.qwen3_5 import hf_config
    cfg = load_preset("qwen3.5-35b-a3b")
    with torch.device("meta"):
        theirs = Qwen3_5MoeForConditionalGeneration(hf_config(cfg))
    assert sum(p.numel() for p in theirs.parameters()) == _counts(cfg)["total"]


def _tiny_sparse():
    """The tiny model's sparse MLP (8 experts of 40, top 2, a shared expert of 24), seeded: the same on every rank."""
    from mmpipe.config import config_from_dict
    from mmpipe.hf.qwen3_5 import config_from_hf
    cfg = config_from_dict(config_from_hf(moe_config()).to_dict(), "tiny-moe")
    torch.manual_seed(0)
    layer = moe.SparseMoe(cfg)
    with torch.no_grad():
        layer.gate.weight.mul_(30)
        layer.shared_expert_gate.weight.mul_(50)
    return layer


def _ep_tokens(rank: int) -> torch.Tensor:
    return torch.randn(1, 150, 64, generator=torch.Generator().manual_seed(300 + rank))


def _ep_rank(rank: int, store: str, out: str):
    import os

    import torch.distributed as dist
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    layer = _tiny_sparse()
    layer.experts.shard(dist.group.WORLD)  # what --ep 2 does to every Experts module (mmpipe.runtime.experts)
    x = _ep_tokens(rank).requires_grad_()
    y, stats = layer(x, torch.ones(1, 150, dtype=torch.bool))
    y.square().sum().backward()
    torch.save({"y": y.detach(), "stats": stats, "x": x.grad, "shared": layer.shared_expert.up_proj.weight.grad,
                "experts": layer.experts.down_proj.grad}, f"{out}/ep{rank}.pt")
    dist.destroy_process_group()


def test_expert_parallel_ranks_with_a_shared_expert_equal_one_rank(tmp_path):
    """--ep's dispatch under the shared expert, the layer alone: two gloo ranks, each with 4 of the 8 experts (the
    shared expert replicated) and its own 150 tokens, give one process's outputs and statistics on all 300 tokens,
    their input gradients, each expert shard's gradient, and the shared expert's gradient summed over the ranks (what
    the data-parallel reduction adds)."""
    import torch.multiprocessing as mp
    mp.start_processes(_ep_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="fork")
    got = [torch.load(tmp_path / f"ep{r}.pt") for r in (0, 1)]
    layer = _tiny_sparse()
    x = torch.cat([_ep_tokens(0), _ep_tokens(1)], 1).requires_grad_()
    y, stats = layer(x, torch.ones(1, 300, dtype=torch.bool))
    y.square().sum().backward()
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g["y"] for g in got], 1), y.detach(), **close)
    torch.testing.assert_close(got[0]["stats"] + got[1]["stats"], stats.detach(), **close)
    torch.testing.assert_close(torch.cat([g["x"] for g in got], 1), x.grad, **close)
    torch.testing.assert_close(torch.cat([g["experts"] for g in got]), layer.experts.down_proj.grad, **close)
    torch.testing.assert_close(got[0]["shared"] + got[1]["shared"], layer.shared_expert.up_proj.weight.grad, **close)


def test_bad_shared_expert_settings_are_one_line():
    """A negative shared width in a model JSON; on export, a shared expert for Qwen3VLMoe (its class has none) and
    none for Qwen3_5Moe (its class always has one): one line each."""
    from mmpipe.config import ConfigError, config_from_dict
    from mmpipe.hf.moe import hf_moe_fields
    from mmpipe.model.qwen3_vl import MoeConfig
    d = load_preset("qwen3.5-35b-a3b").to_dict()
    d["text"]["moe"]["shared_ff_dim"] = -1
    cases = [(lambda: config_from_dict(d, "bad"), "text.moe.shared_ff_dim: -1 must be >= 0"),
             (lambda: hf_moe_fields(MoeConfig(8, 2, 16, shared_ff_dim=16)), "Qwen3VLMoe has no shared expert"),
             (lambda: hf_moe_fields(MoeConfig(8, 2, 16), "qwen3_5_moe"), "always has a shared expert")]
    for make, message in cases:
        with pytest.raises(ConfigError) as e:
            make()
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# 4 steps: DeepSpeed's WarmupCosineLR runs step 1 at lr 0 (its schedule before it starts), so steps 2..4 are 3 real
# updates, and the losses of steps 3 and 4 are taken at trained weights (with 2 steps both were forward passes at the
# initial weights and the final weights carried one update).
PIPE_STEPS, PIPE_SEED = 4, 5


@pytest.fixture(scope="module")
def moe_pipe(tmp_path_factory):
    """tests/test_moe_pipeline.py's records, images and tokenizer (write_moe_set) with qwen3.5-tiny made sparse
    (untied; 8 experts of 16, top 2, a shared expert of 24, aux_coef 0.01): its args, the single-device loop's
    (model, losses, each step's auxiliary term) and one PP=2 launch cut at layer 7, between the second and third
    linear layers, so `moe_stats` (made by layer 5) crosses the cut."""
    from conftest import train_run, write_ds_config
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from mmpipe.runtime.reference import train_reference
    from test_moe_pipeline import write_moe_set
    root = tmp_path_factory.mktemp("qwen3_5_moe_pipe")
    args = write_moe_set(root)
    model = load_preset("qwen3.5-tiny").to_dict()
    model["text"].update(tie_embeddings=False, moe=dict(experts=8, top_k=2, ff_dim=16, aux_coef=0.01,
                                                        shared_ff_dim=24))
    (root / "qwen3.5-moe-tiny.json").write_text(json.dumps(model))
    args[args.index("--preset") + 1] = str(root / "qwen3.5-moe-tiny.json")
    ds = write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 2 * PIPE_STEPS, "warmup_num_steps": 1,
                                               "warmup_type": "linear", "warmup_min_ratio": 0.5}})
    args += ["--ds-config", str(ds)]
    seen, forward = [], moe.MoeHead.forward

    def recording(self, a):
        out = forward(self, a)
        seen.append(out[1].item())
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe.MoeHead, "forward", recording)
        run = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1)
        ref, losses = train_reference(run, seed=PIPE_SEED, steps=PIPE_STEPS, out_dir=str(root / "ref"))
    aux = [(seen[2 * s] + seen[2 * s + 1]) / 2 for s in range(PIPE_STEPS)]
    pp2 = train_run(root / "pp2", *args, "--stages", "2", "--steps", str(PIPE_STEPS), "--partition", "7").check()
    return ref, losses, aux, pp2


def test_pipeline_equals_single_device_loss_aux_and_weights(moe_pipe):
    """PP=2 (one 2-rank launch): each step's loss, lm_loss and aux_loss and the final weights (routers, experts and
    shared experts of both stages) equal the single-device loop's (fp32, 1e-5); what crosses the cut is floats only:
    the hidden [2, 88, 64] and `moe_stats` [2, 2, 8]."""
    from conftest import assert_weights_moved
    from mmpipe.runtime.checkpoint import load_reference
    from test_qwen_pipeline import _weights_equal_within
    ref, losses, aux, pp2 = moe_pipe
    kinds = [s.typename for s in layer_specs(ref.cfg)]
    assert kinds[5:9] == [q35.DeltaNetMoeBlock] * 3 + [q35.GatedAttentionMoeBlock] and kinds[-1] is moe.MoeHead
    rows = pp2.rows
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses, abs=1e-5)
    assert [float(r["aux_loss"]) for r in rows] == pytest.approx(aux, abs=1e-5) and min(aux) > 0.005
    assert [float(r["lm_loss"]) for r in rows] == pytest.approx([a - b for a, b in zip(losses, aux)], abs=1e-5)
    got = torch.nn.Sequential(*load_reference(pp2.out / "checkpoints", ref.cfg))
    # Gated DeltaNet's in_proj_a (each head's decay input) takes a gradient whose fp32 rounding Adam scales to about
    # its step, so it alone sits at the 1e-5 margin: 1.3e-5 in test_qwen3_5_pipeline from a 2-thread reference (stop
    # 51), 1.44e-5 here once --pack's rows were balanced by cost (issue 57), both layouts equal on both sides (the
    # losses and aux terms above agree within 1e-5). It is held to 3e-5, and moved > 10 x that below
    decay = {k for k in got.state_dict() if k.endswith("linear_attn.in_proj_a.weight")}
    _weights_equal_within(got, ref, 1e-5, skip=decay)
    assert max((got.state_dict()[k] - ref.state_dict()[k]).abs().max().item() for k in decay) < 3e-5
    # every tensor (routers, experts and shared experts of both stages included) moved by more than 10 x 1e-5. Broken
    # on purpose (MMPIPE_TEST_BREAK=no_update PYTHONPATH=tests/breaks: AdamW.step a no-op in the ranks and the
    # reference) every comparison above passed and this failed: all 105 tensors moved 0 (run once by hand)
    assert_weights_moved(got, type(ref)(ref.cfg, seed=PIPE_SEED), 1e-5)
    assert_weights_moved({k: got.state_dict()[k] for k in decay}, type(ref)(ref.cfg, seed=PIPE_SEED), 3e-5)
    pp2.assert_only_floats_crossed(per_forward=2)
    assert {shape for kind, _, shape in pp2.wire(0) if kind == "data"} == {"2x88x64", "2x2x8"}
