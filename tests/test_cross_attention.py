"""Cross-attention fusion (`fusion: cross_attention`): pipeline == single device at 1, 2 and 3
stages, with the image carried in the stage tuple across two boundaries and through a middle
stage that only passes it on; zero gates give the plain language model; cached generation equals
uncached; the cost model sees the carried image; and a short run learns to read the image."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import EQUIV_STEPS, train_run
from mmpipe.config import load_preset
from mmpipe.inference.generate import generate
from mmpipe.inference.sampling import Sampling
from mmpipe.model import ReferenceModel
from mmpipe.model.builder import bound
from mmpipe.model.cross_attention import CrossAttnBlock
from mmpipe.model.rows import sample_rows
from mmpipe.model.stage import StageTuple, unpack_out
from mmpipe.planning.costmodel import layer_costs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series
from test_pipeline_equivalence import _max_weight_diff
from test_plan import _saved_floats_per_sample

TOL = 1e-5
PRESET = "tiny-xattn"
# tiny-xattn's 11 layers: 0 PatchEmbed, 1-2 VisionBlock, 3 VisionNorm, 4 Projector,
# 5 CrossAttnTextEmbed, 6 CrossAttnBlock, 7 DecoderBlock, 8 CrossAttnBlock(last), 9 DecoderBlock, 10 LMHead.
# Stages [0-4], [5], [6-10]: the image leaves stage 0 as `hidden`, the middle stage only moves it
# into the `vision` field, and every cross-attention layer is on stage 2 - so every gradient the
# vision side gets crosses both boundaries.
THREE_STAGES = "5,6"


def _args(ds_config, *extra):
    return ["--preset", PRESET, "--ds-config", str(ds_config), "--steps", str(EQUIV_STEPS), "--eval-samples", "0",
            "--seed", "3", *extra]


@pytest.fixture(scope="module")
def reference(equivalence_config):
    run = resolve(TrainArgs.from_argv(_args(equivalence_config, "--stages", "1")), world_size=1)
    return train_reference(run, seed=3, steps=EQUIV_STEPS)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, equivalence_config):
    """The 2-rank runs, one launch (tests/rank_series.py: one after the other in the same ranks, each as `mmpipe
    train` runs it): tiny-xattn at PP=2 (runs' pp2) and the learning run of small-xattn (600 steps, PP=2)."""
    pp2, learn = launch_series([
        (tmp_path_factory.mktemp("pp2"), _args(equivalence_config, "--stages", "2"), {}),
        (tmp_path_factory.mktemp("learn"), ["--preset", "small-xattn", "--steps", "600", "--eval-samples", "500"], {})])
    return {"pp2": pp2, "learn": learn}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, equivalence_config, two_rank_runs):
    out = {}
    for name, extra in {"pp1": ("--stages", "1"), "pp3": ("--stages", "3", "--partition", THREE_STAGES)}.items():
        out[name] = train_run(tmp_path_factory.mktemp(name), *_args(equivalence_config, *extra)).check()
    return {**out, "pp2": two_rank_runs["pp2"].check()}


def test_losses_and_weights_match_reference_at_1_2_3_stages(reference, runs):
    ref_model, ref_losses = reference
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # it trained
    assert runs["pp3"].summary["parts"] == [0, 5, 6, 11]
    cfg = load_preset(PRESET)
    for name, run in runs.items():
        assert sorted(run.losses) == list(range(1, EQUIV_STEPS + 1)), name
        for step, ref in enumerate(ref_losses, start=1):
            assert run.losses[step] == pytest.approx(ref, abs=TOL), (name, step)
        trained = load_reference(run.out / "checkpoints", cfg)
        assert _max_weight_diff(trained, ref_model, skip_key_bias=True) < TOL, name


def test_only_floats_cross_the_boundaries_the_image_among_them(runs):
    pp3 = runs["pp3"]
    pp3.assert_only_floats_crossed(per_forward=1)  # stage 0: the projected image, as hidden
    runs["pp2"].assert_only_floats_crossed(per_forward=None)
    # the middle stage sends (text, image) forward and the image's gradient back: 3 per micro-batch
    micro = pp3.summary["gradient_accumulation"] * pp3.summary["steps"]
    assert len([m for m in pp3.wire(1) if m[0] == "data"]) == 3 * micro


def test_vision_weights_train_through_two_boundaries(runs):
    """Weight decay is 0 and Adam moves nothing whose gradient stayed 0, so a vision layer that
    changed got a gradient - on stage 0, from cross-attention layers two boundaries away."""
    cfg = load_preset(PRESET)
    init, trained = ReferenceModel(cfg, seed=3), load_reference(runs["pp3"].out / "checkpoints", cfg)
    for idx in range(cfg.vision.n_layers + 3):  # patch embedding, vision blocks, norm, projector
        assert _max_weight_diff(init[idx], trained[idx]) > 1e-4, f"layer {idx} did not train"
    gates = [trained[i].attn_gate.item() for i in (6, 8)]
    assert all(abs(g) > 1e-4 for g in gates)  # the gates opened from 0


def _plain_decoder_logits(model, ids, has_image):
    """The language model alone: the same embedding, decoder blocks and head, no cross-attention."""
    t = StageTuple(torch.zeros(ids.shape[0], 1, model.cfg.text.dim), *sample_rows(model.cfg, ids, has_image))
    for layer in model:  # each layer's own tuple fields are those of its place in the list: run them by name
        if type(layer).__name__ == "CrossAttnTextEmbed":
            t = unpack_out(layer, layer(t.pack()))._replace(vision=None)
        elif type(layer).__name__ == "DecoderBlock":
            t = t._replace(hidden=layer.run(t, 0))
        elif type(layer).__name__ == "LMHead":
            return layer.decode(t, {}, 0)


def test_zero_gates_give_the_plain_decoder():
    cfg = load_preset(PRESET)
    model = ReferenceModel(cfg, seed=1).eval()
    torch.manual_seed(0)
    pixels = torch.randn(3, 3, cfg.vision.image_size, cfg.vision.image_size)
    ids = torch.randint(0, cfg.text.vocab_size, (3, 10))
    has = torch.ones(3, dtype=torch.long)
    with torch.no_grad():
        fused = model.one_per_row(pixels, ids, has)
        assert fused.shape == (3, 10, cfg.text.vocab_size)  # logits cover the text alone
        assert torch.equal(fused, _plain_decoder_logits(model, ids, has))
        for layer in model:  # opened gates let the image in, so the comparison above can fail
            if isinstance(layer, CrossAttnBlock):
                layer.attn_gate.fill_(0.5)
        opened = model.one_per_row(pixels, ids, has)
        assert (opened - fused).abs().max() > 1e-3
        # a text-only sample (no image of its own) stays the plain decoder whatever the gates
        text_only = torch.zeros(3, dtype=torch.long)
        assert torch.equal(model.one_per_row(pixels, ids, text_only), _plain_decoder_logits(model, ids, text_only))


def test_cached_generation_equals_uncached():
    cfg = load_preset(PRESET)
    model = ReferenceModel(cfg, seed=2)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, CrossAttnBlock):  # open the gates: the answer must depend on the image
                layer.attn_gate.fill_(1.0)
                layer.mlp_gate.fill_(1.0)
            if hasattr(layer, "image_pos"):  # at init the positions (std 1) drown the image (~0.1)
                layer.image_pos.zero_()
    torch.manual_seed(0)
    pixels = torch.randn(2, 1, 3, cfg.vision.image_size, cfg.vision.image_size)
    answers = []
    for img in pixels:
        for prompt in ([1, 7, 9], [1, 4, 11, 12, 13, 5]):
            cached, plain = (generate(model, img, prompt, Sampling(eos_id=None, max_new_tokens=10), use_cache=c)
                             for c in (True, False))
            assert len(cached) == 10 and cached == plain
            answers.append(tuple(cached))
    assert answers[:2] != answers[2:]  # another image, another continuation

    calls = []
    kv = CrossAttnBlock.decode

    def counting(self, t, cache, start):
        calls.append("kv" in cache)
        return kv(self, t, cache, start)
    CrossAttnBlock.decode = counting
    try:
        generate(model, pixels[0], [1, 7], Sampling(eos_id=None, max_new_tokens=4))
    finally:
        CrossAttnBlock.decode = kv
    # 2 cross-attention layers x 4 calls: keys / values computed on each layer's first call only
    assert calls == [False, False] + [True, True] * 3


def test_cost_model_counts_the_carried_image():
    cfg = load_preset(PRESET)
    rows = layer_costs(cfg, (), 12)
    names = [r.name for r in rows]
    image = cfg.vision.n_tokens * cfg.text.dim  # 16 x 32 per sample
    carried = [r.carried_elems for r in rows]
    # the image rides along from the text embedding (5) up to, not after, the last cross-attention (8)
    assert carried == [0.0] * 5 + [image] * 3 + [0.0] * 3
    assert rows[5].boundary_elems == 12 * cfg.text.dim + image
    assert rows[8].boundary_elems == rows[8].out_elems
    xa = rows[names.index("CrossAttnBlock")]
    assert xa.tokens == 12 and xa.fwd_flops > 4.0 * 12 * cfg.vision.n_tokens * cfg.text.dim
    # every 2nd of the 2 blocks instead of each: one cross-attention layer, fewer carried boundaries
    sparse = layer_costs(dataclasses.replace(cfg, cross_attn_every=2), (), 12)
    assert [r.name for r in sparse].count("CrossAttnBlock") == 1
    assert sum(r.carried_elems > 0 for r in sparse) < sum(c > 0 for c in carried)


def test_cross_attention_activations_match_what_autograd_keeps():
    cfg = load_preset(PRESET)
    text_len, n, d = 12, cfg.vision.n_tokens, cfg.text.dim
    row = next(r for r in layer_costs(cfg, (), text_len) if r.name == "CrossAttnBlock")
    layer = bound(CrossAttnBlock(cfg), cfg, 6)  # the first CrossAttnBlock's place: it takes the image

    def make(batch):
        return (torch.randn(batch, text_len, d, requires_grad=True), torch.randn(batch, n, d, requires_grad=True),
                torch.zeros(batch, text_len, dtype=torch.long), torch.ones(batch, 1, dtype=torch.long),
                torch.ones(batch, text_len, dtype=torch.long))
    assert _saved_floats_per_sample(layer, make) == row.act_elems


def test_short_run_learns_to_read_the_image(two_rank_runs):
    """The long run (scripts/learning_curve.py --preset small-xattn, docs/models.md) reaches >= 90%
    held-out; this one checks the image is read: counting needs it, blanking it undoes it, and
    position-keyed retrieval has left chance (1/4), which without the Projector's image positions
    it never did (measured here at 600 steps: count 1.0, where_is_shape 0.46, 100 samples per type)."""
    run = two_rank_runs["learn"].check()  # --preset small-xattn --steps 600 --eval-samples 500, PP=2
    s = run.summary
    assert s["stages"] == 2
    assert s["eval_per_type"]["count"] >= 0.6
    assert s["eval_per_type"]["where_is_shape"] >= 0.35
    assert s["blank_image_accuracy"] <= s["chance_accuracy"] + 0.1
    assert s["final_loss"] < run.losses[1] / 4


def test_ablation_script_drops_the_image_positions(monkeypatch):
    """docs/models.md reruns its ablation rows with `scripts/xattn_ablations.py --no-image-pos`: the patched
    Projector takes the family's own keywords and leaves no learned image positions."""
    import argparse
    import importlib.util
    from pathlib import Path

    from mmpipe.model import layers
    monkeypatch.setattr(layers.Projector, "__init__", layers.Projector.__init__)  # restored after the test
    path = Path(__file__).resolve().parent.parent / "scripts" / "xattn_ablations.py"
    spec = importlib.util.spec_from_file_location("xattn_ablations", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.patch(argparse.Namespace(kvnorm=False, no_image_pos=True, xattn_before=""))
    names = [n for n, _ in ReferenceModel(load_preset(PRESET), seed=0).named_parameters()]
    assert names and not any("image_pos" in n for n in names)
