"""Moondream's weight names both ways, in both layouts: every tensor of the model gets exactly one
name, a state dict in moondream's names loads with none left over (the region head kept aside),
and renamed, missing, extra or misshapen tensors are refused naming the tensor."""
from __future__ import annotations

import pytest
import torch

from mmpipe.config import ConfigError, load_preset
from mmpipe.hf.moondream import LAYOUTS, REGION_NAMES, export_moondream, import_moondream, key_map, region_in_layout
from mmpipe.model import ReferenceModel


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(load_preset("tiny"), seed=11)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_ways_nothing_left_over(model, layout):
    kmap = key_map(model.cfg, layout)
    assert sorted(kmap) == sorted(model.state_dict())  # every mmpipe tensor named ...
    assert len(set(kmap.values())) == len(kmap)  # ... with a distinct moondream name
    exported = export_moondream(model, layout)
    fresh = ReferenceModel(load_preset("tiny"), seed=99)
    assert import_moondream(fresh, exported) == {}  # no region head in the source: none comes back
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    assert export_moondream(fresh, layout).keys() == exported.keys()
    # a region head (moondream's 14 tensors, here 32 wide as tiny's text) is kept aside, bit-exact
    torch.manual_seed(0)
    region = {n: torch.randn(2, 3) if n.endswith("_features") else torch.randn(32, 4) for n in REGION_NAMES}
    source = {**exported, **region_in_layout(region, layout)}
    kept = import_moondream(fresh, source)
    assert kept.keys() == region.keys() and all(torch.equal(kept[n], region[n]) for n in region)
    back = export_moondream(fresh, layout, kept)
    assert back.keys() == source.keys() and all(torch.equal(back[n], source[n]) for n in source)


def test_names_are_moondreams(model):
    cur, leg = export_moondream(model, "current"), export_moondream(model, "legacy")
    n_v, n_t = model.cfg.vision.n_layers, model.cfg.text.n_layers
    for name in ("model.vision.patch_emb.weight", "model.vision.pos_emb", f"model.vision.blocks.{n_v - 1}.ln1.weight",
                 "model.vision.proj_mlp.fc2.bias", "model.text.wte", f"model.text.blocks.{n_t - 1}.attn.qkv.weight",
                 "model.text.post_ln.weight", "model.text.lm_head.weight"):
        assert name in cur, name
    for name in ("vision_encoder.encoder.model.visual.patch_embed.linear.weight",
                 "vision_encoder.encoder.model.visual.pos_embed",
                 "vision_encoder.encoder.model.visual.blocks.0.norm2.bias",
                 "vision_encoder.encoder.model.visual.norm.weight", "text_model.transformer.embd.wte.weight",
                 f"text_model.transformer.h.{n_t - 1}.mixer.Wqkv.weight", "text_model.lm_head.linear.bias"):
        assert name in leg, name
    # the same tensor under both names: the token embedding
    assert torch.equal(cur["model.text.wte"], leg["text_model.transformer.embd.wte.weight"])


def test_bad_state_dicts_are_named(model):
    good = export_moondream(model, "current")
    bad_shape = {**good, "model.text.blocks.0.mlp.fc1.weight": torch.zeros(3, 3)}
    with pytest.raises(ConfigError, match=r"'model.text.blocks.0.mlp.fc1.weight' has shape \(3, 3\)"):
        import_moondream(ReferenceModel(model.cfg), bad_shape)
    extra = {**good, "model.text.blocks.9.ln.weight": torch.zeros(32)}
    with pytest.raises(ConfigError, match="'model.text.blocks.9.ln.weight'.*matches no weight"):
        import_moondream(ReferenceModel(model.cfg), extra)
    missing = dict(good)
    missing.pop("model.vision.post_ln.bias")
    with pytest.raises(ConfigError, match="no tensor for 'model.vision.post_ln.bias'"):
        import_moondream(ReferenceModel(model.cfg), missing)
    with pytest.raises(ConfigError, match="not a moondream state dict"):
        import_moondream(ReferenceModel(model.cfg), {"encoder.weight": torch.zeros(1)})
