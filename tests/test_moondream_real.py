"""moondream2's real shapes and moondream's own numbers (issue 17: presets, grouped-query attention,
region head, multi-crop vision end to end; the crop rule itself is tests/test_crops.py's).

tests/fixtures/moondream2_tables.json and moondream_reference.json were written by
tests/fixtures/make_moondream_reference.py, which ran moondream's own code (vikhyat/moondream at the
commit recorded in them; none of its code is in the project):

- the tables: every tensor name and shape of moondream2 (2B) and 0.5B, in both checkpoint layouts,
  read off moondream's model and its legacy loader on the meta device;
- the reference: a seeded small model with moondream's structure (27 vision layers at 378 px, text
  heads 64 wide, 4 heads over 2 kv heads), its logits of BOS + image + prompt for a one-tile image
  and its greedy tokens, and the same for a 640 x 900 image moondream tiles 2 x 4 (its whole vision
  path: crops, encoder, stitching, pooling, projector); the harness also loaded mmpipe's export of
  it through moondream's own loaders in both layouts and found every tensor, region head included,
  bit-equal.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpipe.cli import main
from mmpipe.config import ConfigError, config_from_dict, load_preset
from mmpipe.data.crops import CropTransform, stack_images
from mmpipe.hf.moondream import LAYOUTS, REGION_NAMES, export_moondream, import_moondream, key_map
from mmpipe.inference.generate import generate
from mmpipe.inference.sampling import Sampling
from mmpipe.model import ReferenceModel
from mmpipe.model.attention import apply_partial_rotary, row_geometry
from mmpipe.model.layers import DecoderBlock
from mmpipe.model.rows import IMAGE_SLOT, sample_rows
from mmpipe.model.stage import StageTuple
from moondream_ref import (
    MMPIPE_SMALL,
    MOONDREAM_COMMIT,
    PROMPT,
    multi_tile_image,
    pixels,
    reference_image,
    seeded_weights,
)

FIXTURES = Path(__file__).parent / "fixtures"
TABLES = json.loads((FIXTURES / "moondream2_tables.json").read_text())
REF = json.loads((FIXTURES / "moondream_reference.json").read_text())
PRESETS = ("moondream-2b", "moondream-0.5b")


def test_fixtures_come_from_one_moondream_commit():
    assert TABLES["moondream_commit"] == REF["moondream_commit"] == MOONDREAM_COMMIT
    assert REF["moondream_loader_loads_mmpipe_export"] == {"current": True, "legacy": True}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_size_moondream_maps_every_tensor_on_meta(preset, layout):
    """592 tensors: 578 into the layer list (27 + 24 blocks, projector 2 x vision width wide), 14 region."""
    table = TABLES[preset][layout]
    assert len(table) == 592
    with torch.device("meta"):
        model = ReferenceModel(load_preset(preset))
    source = {n: torch.empty(s, device="meta") for n, s in table.items()}
    region = import_moondream(model, source, preset)
    assert len(region) == len(REGION_NAMES) == 14 and len(key_map(model.cfg, layout)) == 578
    out = export_moondream(model, layout, region)
    assert {n: list(t.shape) for n, t in out.items()} == table  # what moondream's loader reads, no more, no less


def test_presets_have_moondreams_fields():
    for preset, (fc1_in, qkv_rows) in {"moondream-2b": (2304, 6144), "moondream-0.5b": (1440, 3072)}.items():
        cfg = load_preset(preset)
        assert cfg.vision.ln_eps == 1e-5 and cfg.vision.proj_in_dim == fc1_in
        assert TABLES[preset]["current"]["model.text.blocks.0.attn.qkv.weight"][0] == qkv_rows
        assert config_from_dict(json.loads(json.dumps(cfg.to_dict())), preset) == cfg  # JSON round trip


def _cli(*argv) -> str:
    """`mmpipe ARGV` in this process (the same entry point as the command); its stdout."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    assert rc == 0, err.getvalue()[-2000:]
    return out.getvalue()


def _refused(*argv) -> str:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    assert rc == 2, err.getvalue()[-2000:]
    return err.getvalue().strip()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The reference model's seeded weights as a moondream file (current names, the region head in bf16
    as moondream2's file has it), imported with `mmpipe import --moondream`."""
    d = tmp_path_factory.mktemp("md")
    weights = seeded_weights(REF["weights_table"])
    weights = {n: v.to(torch.bfloat16) if n.startswith("model.region.") else v for n, v in weights.items()}
    save_file(weights, str(d / "md.safetensors"))
    (d / "small.json").write_text(json.dumps(MMPIPE_SMALL))
    out = _cli("import", "--moondream", str(d / "md.safetensors"), "--preset", str(d / "small.json"), "--out",
               str(d / "run"))
    assert "region head -> region.safetensors" in out
    return d, weights


def _load(run: Path) -> ReferenceModel:
    from mmpipe.runtime.checkpoint import load_reference
    return load_reference(run / "checkpoints", config_from_dict(json.loads((run / "model.json").read_text()), "run"))


def test_logits_and_greedy_tokens_equal_moondreams(small):
    """One-tile image: the projector's [g, g] is exactly what moondream feeds (its harness measured
    0.0 between its projected global + pooled local features and [g, g] projected)."""
    d, _ = small
    assert REF["tiling"] == [1, 1] and REF["crops_identical"] and REF["projected_vs_global_twice_max_abs"] == 0.0
    model = _load(d / "run").eval()
    px = pixels(reference_image())
    with torch.no_grad():
        logits = model.one_per_row(px, torch.tensor([PROMPT]))[0]  # [730 + 6, V]
    assert logits.shape == (730 + len(PROMPT) - 1, 512)
    want = torch.tensor(REF["logits"])
    got = logits[REF["logit_positions"]]
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    # moondream's greedy decoding (KV cache; it stops at eos 0, never reached here)
    for use_cache in (True, False):
        assert generate(model, px, PROMPT, Sampling(eos_id=0, max_new_tokens=len(REF["greedy_tokens"])),
                        use_cache=use_cache) == REF["greedy_tokens"]


def test_multi_tile_image_logits_and_greedy_tokens_equal_moondreams(small):
    """A 640 x 900 image: moondream tiles it 2 x 4, encodes 1 + 8 crops, stitches the local crops'
    features without their overlaps, pools them to 27 x 27 and projects [global, local]. mmpipe runs
    the same model with a 12-crop budget (13 fixed slots, 4 of them padding) and must agree."""
    d, _ = small
    ref = REF["multi_tile"]
    base = _load(d / "run").eval()
    cfg = dataclasses.replace(base.cfg, vision=dataclasses.replace(base.cfg.vision, max_crops=12))
    model = ReferenceModel(cfg).eval()
    model.load_state_dict(base.state_dict())
    from PIL import Image
    crops = CropTransform(cfg.vision, 12, 4)(Image.fromarray(multi_tile_image()))
    assert list(crops.tiling) == ref["tiling"] == [2, 4] and int(crops.valid.sum()) == 1 + 8
    px, tiling = stack_images([crops])  # [1, 13, 3, 378, 378], [[2, 4]]
    with torch.no_grad():
        logits = model.one_per_row(px, torch.tensor([PROMPT]), None, tiling)[0]
    got, want = logits[ref["logit_positions"]], torch.tensor(ref["logits"])
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    single = REF["logits"]  # and it is not the one-tile answer: the local crops matter
    assert (got[:1] - torch.tensor(single[:1])).abs().max() > 1e-2
    for use_cache in (True, False):
        assert generate(model, px, PROMPT, Sampling(eos_id=0, max_new_tokens=len(ref["greedy_tokens"])),
                        use_cache=use_cache, tiling=tiling) == ref["greedy_tokens"]


@pytest.mark.parametrize("layout_in", LAYOUTS)
def test_region_head_bit_exact_through_import_and_export(small, layout_in, tmp_path):
    d, weights = small
    run = d / "run"
    if layout_in == "legacy":  # a legacy file: mmpipe's legacy export, which moondream's legacy loader reads
        _cli("export", "--checkpoint", str(run), "--format", "safetensors", "--layout", "legacy", "--out",
             str(tmp_path / "legacy-in.safetensors"))
        run = tmp_path / "run-legacy"
        _cli("import", "--moondream", str(tmp_path / "legacy-in.safetensors"), "--preset", str(d / "small.json"),
             "--out", str(run))
    kmaps = {lay: key_map(config_from_dict(MMPIPE_SMALL, "small"), lay) for lay in LAYOUTS}
    for layout in LAYOUTS:
        f = tmp_path / f"{layout}.safetensors"
        _cli("export", "--checkpoint", str(run), "--format", "safetensors", "--layout", layout, "--out", str(f))
        out = load_file(str(f))
        for current, (legacy, transposed) in REGION_NAMES.items():
            name = current if layout == "current" else legacy
            want = weights[current].t() if transposed and layout == "legacy" else weights[current]
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], want), name
        for current, mine in zip(kmaps["current"].values(), kmaps[layout].values()):
            assert torch.equal(out[mine], weights[current]), mine
        assert len(out) == len(weights)  # every tensor of moondream's file, nothing else


def test_export_without_a_region_head_says_so_and_takes_one_by_flag(small, tmp_path):
    d, weights = small
    bare = tmp_path / "bare"
    _cli("export", "--checkpoint", str(d / "run"), "--format", "safetensors", "--out", str(tmp_path / "x.safetensors"))
    shutil.copytree(d / "run", bare)
    (bare / "region.safetensors").unlink()  # e.g. a training run started with --init-from d/run
    out = _cli("export", "--checkpoint", str(bare), "--format", "safetensors", "--out", str(tmp_path / "a.safetensors"))
    assert "mmpipe: note: no region head" in out
    assert not any("region" in n for n in load_file(str(tmp_path / "a.safetensors")))
    _cli("export", "--checkpoint", str(bare), "--format", "safetensors", "--layout", "legacy", "--region",
         str(d / "run"), "--out", str(tmp_path / "b.safetensors"))
    got = load_file(str(tmp_path / "b.safetensors"))
    assert torch.equal(got["region_model.size_features.weight"], weights["model.region.size_features"].t())
    err = _refused("export", "--checkpoint", str(bare), "--format", "safetensors", "--region", str(tmp_path / "none"),
                   "--out", str(tmp_path / "c.safetensors"))
    assert err.startswith("mmpipe: error: --region: ") and "does not exist" in err and "\n" not in err


def test_partial_or_misfit_region_heads_are_refused():
    cfg = config_from_dict(MMPIPE_SMALL, "small")
    with torch.device("meta"):
        model = ReferenceModel(cfg)
        good = {n: torch.empty(s) for n, s in REF["weights_table"].items()}
    partial = {k: v for k, v in good.items() if k != "model.region.size_decoder.fc2.bias"}
    with pytest.raises(ConfigError, match="region head incomplete: no tensor for 'model.region.size_decoder.fc2.bias'"):
        import_moondream(model, partial)
    with pytest.raises(ConfigError, match="'model.region.extra' .* is not part of moondream's region head"):
        import_moondream(model, {**good, "model.region.extra": torch.empty(3, device="meta")})
    narrow = {**good, "model.region.coord_encoder.weight": torch.empty(128, 16, device="meta")}
    with pytest.raises(ConfigError, match="region head is 128 wide, the text model 256"):
        import_moondream(model, narrow)


def _gqa_cfg(n_kv_heads: int):
    cfg = load_preset("tiny")
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_heads=4, n_kv_heads=n_kv_heads))


def test_gqa_block_equals_multi_head_block_with_repeated_kv_heads():
    """4 query heads over 2 kv heads == multi-head attention whose k/v heads are the kv heads repeated
    (head h reads kv head h // 2), the re-computation the grouping stands for."""
    gqa_cfg, mha_cfg = _gqa_cfg(2), _gqa_cfg(0)
    torch.manual_seed(0)
    gqa, mha = DecoderBlock(gqa_cfg), DecoderBlock(mha_cfg)
    D, hd = gqa_cfg.text.dim, gqa_cfg.text.head_dim
    assert gqa.attn.qkv.weight.shape == (D + 2 * 2 * hd, D)  # [q | k | v] = D + 2 x kv_heads x head_dim rows
    sd = {k: v.clone() for k, v in gqa.state_dict().items()}
    for p in ("weight", "bias"):
        q, k, v = sd[f"attn.qkv.{p}"].split([D, 2 * hd, 2 * hd])
        rep = [t.unflatten(0, (2, hd)).repeat_interleave(2, dim=0).flatten(0, 1) for t in (k, v)]
        sd[f"attn.qkv.{p}"] = torch.cat([q, *rep])
    mha.load_state_dict(sd)
    ints = sample_rows(gqa_cfg, torch.randint(4, 40, (2, 6)), torch.tensor([1, 0]))  # an image row, a text-only one
    x = torch.randn(2, gqa_cfg.prefix_len + 5, D)
    t = StageTuple(x, *ints)
    with torch.no_grad():
        assert (gqa.run(t, 0) - mha.run(t, 0)).abs().max() < 1e-6
        # and by hand: split, rotate, repeat each kv head for its 2 query heads, per-sample prefix-LM mask
        h = gqa.ln(x)
        q, k, v = gqa.attn.qkv(h).split([D, 2 * hd, 2 * hd], dim=-1)
        q, k, v = (t_.unflatten(-1, (-1, hd)).transpose(1, 2) for t_ in (q, k, v))
        mask, (cos, sin) = row_geometry(ints[2], gqa_cfg.text.rotary_dim, gqa_cfg.text.rope_theta,
                                        ints[0] == IMAGE_SLOT)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        want = x + gqa.attn.proj(a.transpose(1, 2).flatten(2)) + gqa.mlp(h)
        assert (gqa.run(t, 0) - want).abs().max() < 1e-6


def test_gqa_cached_generation_equals_full_forward():
    model = ReferenceModel(_gqa_cfg(1), seed=3).eval()  # one kv head for 4 query heads (multi-query)
    pixels_ = torch.randn(1, 3, 32, 32)
    for prompt in ([1, 7, 9], [1, 4, 11, 12, 13, 5]):
        greedy = Sampling(eos_id=None, max_new_tokens=10)
        cached = generate(model, pixels_, prompt, greedy)
        assert len(cached) == 10 and cached == generate(model, pixels_, prompt, greedy, use_cache=False)


def test_config_refuses_what_the_layers_cannot_run():
    for text, vision, msg in (
            ({"n_heads": 4, "n_kv_heads": 3}, {}, "text.n_kv_heads: 3 does not divide n_heads 4"),
            ({}, {"crop_features": 3}, "vision.crop_features: 3 (valid: 1, or 2 for"),
            ({}, {"crop_features": 1, "max_crops": 4}, "vision.max_crops: 4: multi-crop needs crop_features 2"),
            ({}, {"max_crops": 4, "overlap_margin": 14}, "vision.overlap_margin: 14 patches on each side leave no"),
    ):
        d = json.loads(json.dumps(MMPIPE_SMALL))
        d["text"].update(text)
        d["vision"].update(vision)
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
            config_from_dict(d, "bad")
    llava = load_preset("llava-tiny").to_dict()
    llava["vision"]["crop_features"] = 2
    # moondream's crop fields are not the LLaVA family's section: set, one line naming it; at the default, dropped
    with pytest.raises(ConfigError, match=r"vision: \['crop_features'\]: not a field of the llava family's section"):
        config_from_dict(llava, "bad")
    llava["vision"]["crop_features"] = 1
    assert config_from_dict(llava, "llava-tiny") == load_preset("llava-tiny")
