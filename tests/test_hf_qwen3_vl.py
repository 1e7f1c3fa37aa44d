"""The Qwen3-VL family (dense) against transformers' Qwen3VLForConditionalGeneration (tiny, random, built here:
tests/qwen3_models.py; DeepStack after tower blocks 0, 2, 3 of 5, a head width of its own, interleaved rotary):
imported (the function and `mmpipe import --hf`), mmpipe's model gives HF's logits for single images of three
sizes and aspect ratios, two images of different sizes in one conversation and a text-only sample; the samples
packed into one row give each sample's logits; cached greedy decoding gives HF's `generate` tokens; the export
loads back into transformers with equal logits; switching DeepStack off or un-interleaving the rotary changes
the logits; DeepStack's sets are stage fields carried from their merger to their add only; a bad DeepStack index
is one line; the qwen3-vl-tiny preset trains. In-process, no launches (the pipeline runs are not in this slice:
docs/qwen3_vl.md)."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from hf_models import peft_of, perturbed, with_random_adapters
from mmpipe.cli import main
from mmpipe.config import PRESET_DIR, ConfigError, config_from_dict, load_preset
from mmpipe.hf.qwen3_vl import export_hf, import_qwen3_vl, key_map
from mmpipe.model import ReferenceModel
from mmpipe.model import qwen3_vl as q3
from mmpipe.model.builder import layer_specs
from mmpipe.model.stage import live_fields
from mmpipe.registry import family_of
from mmpipe.runtime.checkpoint import load_reference
from qwen3_models import DEEPSTACK, encode, qwen3_config, save_qwen3
from qwen_models import IMAGE, assert_greedy_is_hf_generate, hf_logits, image, sample, save_tokenizer
from test_hf_qwen2_vl import _cached_logits

TOL = 1e-4
# (name, image sizes w x h): 4 x 4, 4 x 6 and 8 x 4 patch grids of 16 px; two images of different sizes; text only
SAMPLES = [("square", [(64, 64)]), ("wide", [(96, 64)]), ("tall", [(64, 128)]), ("two", [(96, 64), (64, 64)]),
           ("text", [])]
PATCH_DIM = 3 * 2 * 16 * 16  # 1536


def _sample(i: int):
    """(input_ids [T], pixel patches [N, 1536] or None, grids [n, 3] or None) of SAMPLES[i]."""
    sizes = SAMPLES[i][1]
    if not sizes:
        return sample(torch.zeros(0, 3, dtype=torch.long), seed=i, words=5), None, None
    px, grids = encode([image(w, h, seed=10 * i + k) for k, (w, h) in enumerate(sizes)])
    return sample(grids, seed=i), px, grids


def row(samples, extra_patches: int = 8, extra_positions: int = 3, extra_slots: int = 1):
    """One packed row of `samples` (segments 1, 2, ...) as the stage contract's first input, and each sample's
    span of positions: pixel patches in slot order then zeros up to P, an unused slot, padding positions."""
    ids = torch.cat([s[0] for s in samples])
    spans, at = [], 0
    for s in samples:
        spans.append((at, at + len(s[0])))
        at += len(s[0])
    L = len(ids) + extra_positions
    segments = torch.zeros(1, L, dtype=torch.long)
    for k, (a, b) in enumerate(spans):
        segments[0, a:b] = k + 1
    owners = [k + 1 for k, s in enumerate(samples) if s[2] is not None for _ in range(len(s[2]))]
    grids = [g for s in samples if s[2] is not None for g in s[2].tolist()]
    M = max(len(grids) + extra_slots, 1)
    tiling = torch.zeros(1, M, 3, dtype=torch.long)
    has_image = torch.zeros(1, M, dtype=torch.long)
    if grids:
        tiling[0, :len(grids)] = torch.tensor(grids)
        has_image[0, :len(grids)] = torch.tensor(owners)
    patches = [s[1] for s in samples if s[1] is not None]
    n = sum(len(p) for p in patches)
    pixels = torch.zeros(1, max(n + extra_patches, 4), PATCH_DIM)
    if patches:
        pixels[0, :n] = torch.cat(patches)
    input_ids = torch.cat([ids, torch.zeros(extra_positions, dtype=torch.long)])[None]
    return (pixels, input_ids, has_image, segments, tiling), spans


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    hf = save_qwen3(d)
    model, report = import_qwen3_vl(d)
    return d, hf, model.eval(), report


def test_import_gives_hf_logits(qwen3):
    d, hf, model, report = qwen3
    assert report.mapped == len(load_file(str(d / "model.safetensors")))
    v, t = model.cfg.vision, model.cfg.text
    assert (v.deepstack_indexes, v.n_layers, v.num_position_embeddings, v.patch_dim) == (tuple(DEEPSTACK), 5, 36,
                                                                                          PATCH_DIM)
    assert (t.head_dim, t.mrope_interleaved, t.qk_norm, t.tie_embeddings) == (24, True, True, False)
    for i, (name, _) in enumerate(SAMPLES):
        ids, px, grids = _sample(i)
        with torch.no_grad():
            got = model(*row([(ids, px, grids)])[0])[0, :len(ids)]
        assert (got - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL, name


def test_tied_head_imports_and_exports(tmp_path):
    """A tied checkpoint (the 2B / 4B releases' lm_head is the input embedding): imported, one tensor serves both
    (the head is mmpipe's tied layer), the logits are HF's, and the export loads back with them."""
    hf = save_qwen3(tmp_path / "hf", tie=True)
    model, _ = import_qwen3_vl(tmp_path / "hf")
    model.eval()
    assert model.cfg.text.tie_embeddings
    ids, px, grids = _sample(1)
    with torch.no_grad():
        got = model(*row([(ids, px, grids)])[0])[0, :len(ids)]
    assert (got - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL
    back = type(hf).from_pretrained(export_hf(model, tmp_path / "out")).eval()
    assert back.lm_head.weight.data_ptr() == back.model.language_model.embed_tokens.weight.data_ptr()
    assert (got - hf_logits(back, ids, px, grids)).abs().max().item() < TOL


def test_packed_row_gives_each_samples_logits(qwen3):
    """Every sample in one row (two images in sample 4, an unused slot, 12 padding patches, 3 padding
    positions): each sample's logits are its own run's and HF's; DeepStack adds each image's sets at its own
    placeholders only."""
    _, hf, model, _ = qwen3
    samples = [_sample(i) for i in range(len(SAMPLES))]
    inputs, spans = row(samples, extra_patches=12)
    with torch.no_grad():
        packed = model(*inputs)[0]
        for (ids, px, grids), (a, b), (name, _) in zip(samples, spans, SAMPLES):
            alone = model(*row([(ids, px, grids)], extra_patches=0, extra_positions=0, extra_slots=0)[0])[0]
            assert (packed[a:b] - alone).abs().max().item() < TOL, name
            assert (packed[a:b] - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL, name


def test_deepstack_and_interleaving_matter(qwen3, monkeypatch):
    """What the comparison relies on shows in the tiny model: the blocked (Qwen2-VL) rotary, or DeepStack's adds
    left out, change the logits by more than 1e-3."""
    _, _, model, _ = qwen3
    inputs = row([_sample(1)])[0]
    with torch.no_grad():
        want = model(*inputs)
        blocked = dataclasses.replace(model.cfg, text=dataclasses.replace(model.cfg.text, mrope_interleaved=False))
        other = ReferenceModel(blocked).eval()
        other.load_state_dict(model.state_dict())
        assert (other(*inputs) - want).abs().max().item() > 1e-3
        monkeypatch.setattr(q3.DeepstackAdd, "forward", lambda self, args: q3.unpack_in(self, args)._replace(
            **{f"deepstack_{self.index}": None}).pack())
        assert (model(*inputs) - want).abs().max().item() > 1e-3


def test_deepstack_sets_ride_from_their_merger_to_their_add():
    """Each set deepstack_k is a float stage field from DeepstackMerger<k> (after tower block deepstack_indexes[k])
    to DeepstackAdd<k> (after decoder layer k), which drops it: a cut between them sends it, no later cut does."""
    cfg = load_preset("qwen3-vl-tiny")
    kinds = [s.typename for s in layer_specs(cfg)]
    live = live_fields(family_of(cfg).fields(cfg), kinds)
    for k, block in enumerate(cfg.vision.deepstack_indexes):
        made = kinds.index(q3.DEEPSTACK_MERGERS[k])
        added = kinds.index(q3.DEEPSTACK_ADDS[k])
        assert [c.__name__ for c in kinds[:made]].count("Qwen3VisionBlock") == block + 1
        assert [c.__name__ for c in kinds[:added]].count("Qwen3Block") == k + 1
        carrying = [i for i, fields in enumerate(live) if f"deepstack_{k}" in [f.name for f in fields]]
        assert carrying == list(range(made + 1, added + 1))  # the tuples entering layers made+1 .. added
        assert all(f.floating for f in live[added] if f.name.startswith("deepstack"))


def test_cached_decoding_equals_uncached_and_hf_generate(qwen3):
    _, hf, model, _ = qwen3
    ids, px, grids = _sample(3)  # two images: the rope delta carries both blocks' offsets
    new = [5, 17, 33]
    inputs = row([(ids, px, grids)], extra_patches=4, extra_positions=0, extra_slots=0)[0]
    with torch.no_grad():
        cached = _cached_logits(model, inputs, new)
        for k in range(len(new) + 1):
            longer = torch.cat([ids, torch.tensor(new[:k], dtype=torch.long)])
            full = model(inputs[0], longer[None], inputs[2], torch.ones(1, len(longer), dtype=torch.long), inputs[4])
            assert (cached[k] - full[0, -1]).abs().max().item() < TOL, k
    assert_greedy_is_hf_generate(model, hf, *_sample(2))


def test_export_loads_in_transformers(qwen3, tmp_path):
    _, hf, model, _ = qwen3
    changed = perturbed(model)  # as if trained: the export must carry these weights, not the imported ones
    export_hf(changed, tmp_path / "out")
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    ids, px, grids = _sample(3)
    with torch.no_grad():
        mine = changed(*row([(ids, px, grids)])[0])[0, :len(ids)]
        before = model(*row([(ids, px, grids)])[0])[0, :len(ids)]
    assert (mine - hf_logits(back, ids, px, grids)).abs().max().item() < TOL
    assert (mine - before).abs().max().item() > 1e-3
    again, _ = import_qwen3_vl(tmp_path / "out")  # and the export imports back to the same weights
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), changed.state_dict().values()))


def test_lora_adapters_load_with_peft(qwen3, tmp_path):
    """Adapters on every group's linears (the tower's fused qkv and fc1 / fc2, the final and DeepStack mergers'
    fc1 / fc2, the decoder's projections) export as a peft adapter of transformers' model, which then gives
    mmpipe's logits."""
    _, hf, model, _ = qwen3
    adapted = with_random_adapters(model)
    peft_model = peft_of(adapted, type(hf), tmp_path, key_map, export_hf)
    ids, px, grids = _sample(3)
    with torch.no_grad():
        want = adapted(*row([(ids, px, grids)])[0])[0, :len(ids)]
        assert (hf_logits(peft_model, ids, px, grids) - want).abs().max().item() < TOL
        assert (hf_logits(hf, ids, px, grids) - want).abs().max().item() > 1e-2  # the adapters count


def test_import_and_export_commands(qwen3, tmp_path, capsys):
    d, hf, model, _ = qwen3
    shutil.copytree(d, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert "imported qwen3_vl model" in capsys.readouterr().out
    run = load_reference(tmp_path / "run" / "checkpoints", model.cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, run.state_dict()[k]), k
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    back = type(hf).from_pretrained(tmp_path / "back").eval()
    ids, px, grids = _sample(0)
    assert (hf_logits(back, ids, px, grids) - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL


def test_generate_command_from_hf_dir_and_imported_run(qwen3, tmp_path, capsys):
    """`mmpipe generate` on an HF directory (and on its import) gives transformers' greedy answer to the prompt it
    builds (the chat template, the image's bracketed block of its 2 x 3 merge units, the processor's patches at
    patch 16); `mmpipe eval` on a record of the same question answers alike."""
    from mmpipe.data.text import ConversationEncoder, image_text
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.inference.generate import with_images
    d, hf, model, _ = qwen3
    shutil.copytree(d, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    image(96, 64, seed=5).save(tmp_path / "img.png")
    gen = ["generate", "--image", str(tmp_path / "img.png"), "--prompt", "w7 w8", "--max-new-tokens", "5"]
    assert main(gen + ["--checkpoint", str(tmp_path / "hf")]) == 0
    from_hf = capsys.readouterr().out.strip()
    tok = load_tokenizer(str(tmp_path / "hf"))
    ids, at = ConversationEncoder(tok, 512, markers=True, image_text=image_text(tok, model.cfg)).prompt(
        [("user", "w7 w8")], n_images=1)
    px, grids = encode([image(96, 64, seed=5)])
    prompt = torch.tensor(with_images(ids, model.cfg, at, [tuple(grids[0].tolist())]))
    assert int((prompt == IMAGE).sum()) == 6
    with torch.no_grad():
        out = hf.generate(input_ids=prompt[None], pixel_values=px, image_grid_thw=grids, max_new_tokens=5,
                          mm_token_type_ids=(prompt == IMAGE).int()[None], do_sample=False,
                          eos_token_id=tok.eos_token_id)
    assert from_hf == tok.decode(out[0, len(prompt):], skip_special_tokens=True).strip() != ""
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(gen + ["--checkpoint", str(tmp_path / "run"), "--no-cache"]) == 0
    assert capsys.readouterr().out.strip() == from_hf
    records = [{"image": "img.png", "conversations": [{"from": "human", "value": "<image>\nw7 w8"},
                                                       {"from": "gpt", "value": "w9"}]}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "data.jsonl"),
                 "--out", str(tmp_path / "answers.jsonl"), "--max-new-tokens", "5"]) == 0
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert answers[0]["answer"] == from_hf


def test_import_without_preprocessor_config_says_which_defaults_it_took(qwen3, tmp_path, capsys):
    """Without its preprocessor_config.json the import takes Qwen3-VL's processor defaults (65536 .. 16777216 px,
    mean / std 0.5) and its summary line says so; with the file, no such note."""
    d, _, _, report = qwen3
    assert "by default" not in report.summary()
    shutil.copytree(d, tmp_path / "hf", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert ("; no preprocessor_config.json: took min_pixels 65536, max_pixels 16777216, image_mean / image_std 0.5 "
            f"(SigLIP's) by default) -> {tmp_path / 'run'}\n") in capsys.readouterr().out
    vision = json.loads((tmp_path / "run" / "model.json").read_text())["vision"]
    assert (vision["max_pixels"], vision["mean"]) == (16777216, [0.5, 0.5, 0.5])


def test_deepstack_index_beyond_the_tower_is_one_line(tmp_path, capsys):
    """A checkpoint whose DeepStack indexes exceed its tower's 5 blocks: `mmpipe import --hf` (and --dry-run) says
    so in one line, exit 2, and writes nothing."""
    hf = qwen3_config()
    hf.vision_config.deepstack_visual_indexes = [0, 2, 7]
    hf.save_pretrained(tmp_path / "hf")
    want = ("mmpipe: error: model config 'hf': vision.deepstack_indexes: [0, 2, 7]: increasing block indices of a "
            "5-block tower\n")
    for extra in ([], ["--dry-run"]):
        assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), *extra]) == 2
        assert capsys.readouterr().err == want
    assert not (tmp_path / "run").exists()
    cfg = load_preset("qwen3-vl-tiny")
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, n_layers=2)).validate()
    assert str(e.value) == ("model config 'qwen3-vl-tiny': vision.deepstack_indexes: 3 sets for decoder layers 0..2: "
                            "at most 2 (the decoder's 2 layers, mmpipe's 8)")


def test_qwen3_fields_on_a_qwen2_vl_config_are_refused():
    """A qwen2_vl config asking for Qwen3-VL's interleaved rotary would train with the blocked one: its section has
    no such field, so the model JSON is refused in one line; the same field at its default (what a model.json
    written before the per-family sections holds for every family's fields) is dropped."""
    data = json.loads((PRESET_DIR / "qwen-tiny.json").read_text())
    data["text"]["mrope_interleaved"] = True
    with pytest.raises(ConfigError) as e:
        config_from_dict(data, "qwen-tiny")
    assert str(e.value) == ("model config 'qwen-tiny': text: ['mrope_interleaved']: not a field of the qwen2_vl "
                            "family's section, whose layers would not read it (valid: ['attn_head_dim', 'dim', "
                            "'ff_dim', 'ln_eps', 'max_context', 'mrope_section', 'n_heads', 'n_kv_heads', 'n_layers', "
                            "'partial_rotary_factor', 'qkv_bias', 'rope_theta', 'tie_embeddings', 'vocab_size'])")
    data["text"]["mrope_interleaved"] = False
    assert config_from_dict(data, "qwen-tiny") == load_preset("qwen-tiny")


def test_tiny_preset_trains(tmp_path):
    """qwen3-vl-tiny trains on packed rows of images of mixed sizes and text-only samples (the single-device loop):
    the loss falls, and every DeepStack merger's weights move (their sets reach the loss)."""
    from conftest import write_ds_config
    from fixtures_data import mixed_image_records
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from mmpipe.runtime.reference import train_reference
    from test_qwen_data import WORDS
    from test_qwen_data import save_tokenizer as save_data_tokenizer
    sizes = [(64, 64), (96, 64), (64, 128), (128, 96)]
    rng = np.random.default_rng(0)
    for k, (w, h) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{k}.png")
    records = mixed_image_records(12, len(sizes), WORDS[5:], lambda rnd, i: 1 + i % 5)
    (tmp_path / "data.json").write_text(json.dumps(records))
    save_data_tokenizer(tmp_path / "tok")
    ds = write_ds_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                         optimizer={"type": "AdamW", "params": {"lr": 3e-3}})
    args = ["--preset", "qwen3-vl-tiny", "--data", str(tmp_path / "data.json"), "--tokenizer", str(tmp_path / "tok"),
            "--ds-config", str(ds), "--text-len", "48", "--pack", "--max-images", "3", "--max-patches", "96",
            "--eval-samples", "0", "--seed", "3", "--data-workers", "0", "--stages", "1",
            "--output-dir", str(tmp_path / "out")]
    run = resolve(TrainArgs.from_argv(args), world_size=1)
    start = ReferenceModel(run.model, seed=3).state_dict()
    model, losses = train_reference(run, seed=3, steps=8, out_dir=str(tmp_path / "out"))
    assert all(np.isfinite(losses)) and min(losses[-3:]) < losses[0], losses
    for i, layer in enumerate(model):
        if isinstance(layer, q3.DeepstackMerger):
            assert not torch.equal(layer.linear_fc1.weight, start[f"{i}.linear_fc1.weight"]), type(layer).__name__


@pytest.mark.parametrize("preset, published", [("qwen3-vl-2b", 2.13e9), ("qwen3-vl-4b", 4.44e9),
                                               ("qwen3-vl-8b", 8.77e9), ("qwen3-vl-32b", 33.4e9)])
def test_presets_have_the_published_parameter_counts(preset, published):
    """The dense presets' shapes (built on the meta device, a tied head counted once) give the released models'
    totals, as the Hub's model pages show them (2.13 B, 4.44 B, 8.77 B, 33.4 B), within 1%; and transformers'
    Qwen3VLConfig of each preset is the model it builds (mmpipe.hf.qwen3_vl.hf_config: the same count)."""
    from test_docs import _parameters
    mine = _parameters(preset)
    assert abs(mine / published - 1) < 0.01, (preset, mine)
    from transformers import Qwen3VLForConditionalGeneration

    from mmpipe.hf.qwen3_vl import hf_config
    with torch.device("meta"):
        theirs = Qwen3VLForConditionalGeneration(hf_config(load_preset(preset)))
    seen = {}
    for p in theirs.parameters():  # a tied lm_head is the embedding's tensor, counted once
        seen[id(p)] = p.numel()
    assert sum(seen.values()) == mine


def test_data_side_gives_the_processors_patches_and_counts_bad_images(tmp_path):
    """The data side reaches the family through its image kind (patches): qwen3-vl-tiny's rule gives transformers'
    image processor's grids and patches at patch 16 (1536 values each), and a record whose image needs more patches
    than the row holds is counted with its reason, never trained, never a traceback."""
    from transformers import Qwen2VLImageProcessor

    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.patches import patch_rule
    from test_qwen_data import conv
    from test_qwen_data import save_tokenizer as save_data_tokenizer
    cfg, v = load_preset("qwen3-vl-tiny"), load_preset("qwen3-vl-tiny").vision
    ref = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=v.min_pixels,
                                max_pixels=v.max_pixels, image_mean=list(v.mean), image_std=list(v.std))
    rule = patch_rule(cfg, 64)
    # 64 x 64 -> 4 x 4 patches; 96 x 64 -> 4 x 6; 400 x 300 resized down to at most 128 x 128 px: 6 x 8
    for (w, h), want in (((64, 64), (1, 4, 4)), ((96, 64), (1, 4, 6)), ((400, 300), (1, 6, 8))):
        img = image(w, h, seed=w)
        theirs = ref(images=[img], return_tensors="pt")
        patches, grid = rule.patches(img)
        assert grid == tuple(theirs["image_grid_thw"][0].tolist()) == want, (w, h)
        assert patches.shape == (np.prod(grid), PATCH_DIM) and torch.equal(patches, theirs["pixel_values"])
    image(64, 64, seed=1).save(tmp_path / "a.png")
    image(24, 2000, seed=2).save(tmp_path / "thin.png")
    records = [{"image": "a.png", "conversations": conv("<image>\nwhat colour is it", "red")},
               {"image": "thin.png", "conversations": conv("<image> what colour", "red")}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    save_data_tokenizer(tmp_path / "tok")
    args = DataArgs(data=str(tmp_path / "data.jsonl"), tokenizer=str(tmp_path / "tok"), text_len=40, data_workers=0,
                    max_images=1, max_patches=64)
    samples = prepare(resolve_data(args, cfg), cfg, tmp_path / "out", seed=0, verbose=False)
    stats = samples.index.stats
    assert (stats["good"], stats["bad"]) == (1, 1), stats
    bad = json.loads((tmp_path / "out" / "data" / "bad_records.jsonl").read_text().splitlines()[0])
    assert bad["kind"] == "too_many_patches" and "24x2000" in bad["reason"] and "--max-patches" in bad["reason"], bad
