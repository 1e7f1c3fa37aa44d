"""The Qwen2-VL family against transformers' Qwen2VLForConditionalGeneration and
Qwen2_5_VLForConditionalGeneration (tiny, random, built here: tests/qwen_models.py): imported, mmpipe's
model gives HF's logits for single images of three sizes and aspect ratios, two images of different sizes
in one conversation and a text-only sample; the same samples packed into one row (with an unused image
slot, zero patch padding and padding positions) give each sample's logits; cached greedy decoding gives
the uncached logits and HF's `generate` tokens; export loads back into transformers' class with equal
logits; `mmpipe import --hf` / `mmpipe export` do it from the command line."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import peft_of, perturbed, with_random_adapters
from mmpipe.cli import main
from mmpipe.config import ConfigError
from mmpipe.data.text import ConversationEncoder, image_text
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.hf.qwen2_vl import config_from_hf, export_hf, import_qwen2_vl, key_map
from mmpipe.inference.generate import with_images
from mmpipe.model import ReferenceModel
from mmpipe.model.stage import unpack_in
from mmpipe.runtime.checkpoint import load_reference
from qwen_models import (
    END,
    IMAGE,
    KINDS,
    START,
    assert_greedy_is_hf_generate,
    encode,
    hf_logits,
    image,
    qwen_config,
    sample,
    save_qwen,
    save_tokenizer,
)
from test_hf_cli import exported_ids, ids_of

TOL = 1e-4
# (name, image sizes w x h): 4 x 4, 4 x 6 and 8 x 4 patch grids; two images of different sizes; text only
SAMPLES = [("square", [(56, 56)]), ("wide", [(84, 56)]), ("tall", [(56, 112)]), ("two", [(84, 56), (56, 56)]),
           ("text", [])]


def _sample(i: int):
    """(input_ids [T], pixel patches [N, 1176] or None, grids [n, 3] or None) of SAMPLES[i]."""
    sizes = SAMPLES[i][1]
    if not sizes:
        return sample(torch.zeros(0, 3, dtype=torch.long), seed=i, words=5), None, None
    px, grids = encode([image(w, h, seed=10 * i + k) for k, (w, h) in enumerate(sizes)])
    return sample(grids, seed=i), px, grids


def row(samples, extra_patches: int = 8, extra_positions: int = 3, extra_slots: int = 1):
    """One packed row of `samples` (segments 1, 2, ...), as the stage contract's first input, and each
    sample's span of positions: pixel patches in slot order then zeros up to P, an unused slot, padding."""
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
    M = max(len(grids) + extra_slots, 1)  # a row has at least one slot and one merge unit of patches
    tiling = torch.zeros(1, M, 3, dtype=torch.long)
    has_image = torch.zeros(1, M, dtype=torch.long)
    if grids:
        tiling[0, :len(grids)] = torch.tensor(grids)
        has_image[0, :len(grids)] = torch.tensor(owners)
    patches = [s[1] for s in samples if s[1] is not None]
    n = sum(len(p) for p in patches)
    pixels = torch.zeros(1, max(n + extra_patches, 4), 1176)
    if patches:
        pixels[0, :n] = torch.cat(patches)
    input_ids = torch.cat([ids, torch.zeros(extra_positions, dtype=torch.long)])[None]
    return (pixels, input_ids, has_image, segments, tiling), spans


@pytest.fixture(scope="module", params=KINDS)
def qwen(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = save_qwen(request.param, d)
    model, report = import_qwen2_vl(d)
    return request.param, d, hf, model.eval(), report


def test_import_gives_hf_logits(qwen):
    kind, d, hf, model, report = qwen
    assert report.mapped == len(load_file(str(d / "model.safetensors"))) and not report.unused
    v = model.cfg.vision
    assert (v.merge_size, v.temporal_patch_size, v.patch_dim, v.max_pixels) == (2, 2, 1176, 28 * 28 * 16)
    if kind == "qwen2_5":  # window attention in blocks 0 and 2, full in block 1
        assert (v.window_size, v.fullatt_blocks, v.norm, v.mlp) == (56, (1,), "rmsnorm", "swiglu")
        assert model.cfg.text.tie_embeddings
    for i, (name, _) in enumerate(SAMPLES):
        ids, px, grids = _sample(i)
        with torch.no_grad():
            got = model(*row([(ids, px, grids)])[0])[0, :len(ids)]
        assert (got - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL, name


def test_geometry_is_built_once_per_micro_batch(qwen, monkeypatch):
    """The tower's masks and rotary are built once per block kind (Qwen2.5: windowed and full) and the
    decoder's multimodal positions once, for all blocks of a forward: they come from the integer tensors
    alone, which no layer changes (mmpipe.model.attention.row_cached)."""
    from mmpipe.model import qwen2_vl
    kind, _, _, model, _ = qwen
    calls = []
    for name in ("vision_geometry", "mrope_positions"):
        real = getattr(qwen2_vl, name)
        monkeypatch.setattr(qwen2_vl, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    inputs = row([_sample(1)])[0]
    with torch.no_grad():
        model(*inputs)
    assert sorted(calls) == ["mrope_positions"] + ["vision_geometry"] * (2 if kind == "qwen2_5" else 1)
    assert model.cfg.vision.n_layers >= 2 and model.cfg.text.n_layers >= 2  # several blocks shared them


def test_windows_and_positions_matter(qwen):
    """The tiny models see what the comparison relies on: Qwen2.5's windows (a 4 x 6 grid spans 2 windows of
    2 x 2 merge units) and the multimodal positions (an image's tokens at their grid positions)."""
    kind, _, _, model, _ = qwen
    ids, px, grids = _sample(1)
    inputs = row([(ids, px, grids)])[0]
    changed = []
    if kind == "qwen2_5":
        changed.append(dataclasses.replace(model.cfg, vision=dataclasses.replace(model.cfg.vision, window_size=0)))
    changed.append(dataclasses.replace(model.cfg, text=dataclasses.replace(model.cfg.text, mrope_section=(8, 0, 0))))
    with torch.no_grad():
        want = model(*inputs)
        for cfg in changed:
            other = ReferenceModel(cfg).eval()
            other.load_state_dict(model.state_dict())
            assert (other(*inputs) - want).abs().max().item() > 1e-3, cfg


def test_packed_row_gives_each_samples_logits(qwen):
    """Every sample in one row (two images in sample 2, five image slots with one unused, 8 padding
    patches, 3 padding positions): each sample's logits are its own run's and HF's."""
    kind, _, hf, model, _ = qwen
    samples = [_sample(i) for i in range(len(SAMPLES))]
    inputs, spans = row(samples, extra_patches=12)
    with torch.no_grad():
        packed = model(*inputs)[0]
        for (ids, px, grids), (a, b), (name, _) in zip(samples, spans, SAMPLES):
            alone = model(*row([(ids, px, grids)], extra_patches=0, extra_positions=0, extra_slots=0)[0])[0]
            assert (packed[a:b] - alone).abs().max().item() < TOL, name
            assert (packed[a:b] - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL, name


def _cached_logits(model, inputs, new_tokens: list[int]) -> list[torch.Tensor]:
    """The last position's logits of the prompt and of each new token, through the layers' decode (a KV
    cache per layer; the image side once), as mmpipe.inference.generate runs them."""
    first = next(i for i, layer in enumerate(model) if hasattr(layer, "decode"))
    x = inputs
    for layer in list(model)[:first]:
        x = layer(x)
    decoder = list(model)[first:]
    t, caches, out, start = unpack_in(decoder[0], x), [{} for _ in decoder], [], 0
    for tok in [None] + new_tokens:
        if tok is not None:
            t = t._replace(hidden=None, input_ids=torch.tensor([[tok]]), segments=torch.ones(1, 1, dtype=torch.long))
        y = t
        for layer, cache in zip(decoder, caches):
            y = layer.decode(y, cache, start)
        start += y.shape[1]
        out.append(y[0, -1])
    return out


def test_cached_decoding_equals_uncached_and_hf_generate(qwen):
    kind, _, hf, model, _ = qwen
    ids, px, grids = _sample(3)  # two images: the rope delta carries both blocks' offsets
    new = [5, 17, 33]
    inputs = row([(ids, px, grids)], extra_patches=4, extra_positions=0, extra_slots=0)[0]
    with torch.no_grad():
        cached = _cached_logits(model, inputs, new)
        for k in range(len(new) + 1):
            longer = torch.cat([ids, torch.tensor(new[:k], dtype=torch.long)])
            full = model(inputs[0], longer[None], inputs[2], torch.ones(1, len(longer), dtype=torch.long), inputs[4])
            assert (cached[k] - full[0, -1]).abs().max().item() < TOL, k
    # one image through mmpipe's generate (a 1-slot row), cached and not, and HF's own greedy decoding
    assert_greedy_is_hf_generate(model, hf, *_sample(2))


def test_export_loads_in_transformers(qwen, tmp_path):
    kind, _, hf, model, _ = qwen
    changed = perturbed(model)  # as if trained: the export must carry these weights, not the imported ones
    export_hf(changed, tmp_path / "out")
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    # no tokenizer given: no special id, rather than Qwen2VLConfig's 151643 / 151645 in a 200-token vocabulary
    assert exported_ids(tmp_path / "out") == [(None, None, None)] * 2
    back = type(hf).from_pretrained(tmp_path / "out").eval()  # Qwen2.5-VL's class for the SwiGLU tower
    ids, px, grids = _sample(3)
    with torch.no_grad():
        mine = changed(*row([(ids, px, grids)])[0])[0, :len(ids)]
        before = model(*row([(ids, px, grids)])[0])[0, :len(ids)]
    assert (mine - hf_logits(back, ids, px, grids)).abs().max().item() < TOL
    assert (mine - before).abs().max().item() > 1e-3
    again, _ = import_qwen2_vl(tmp_path / "out")  # and the export imports back to the same weights
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), changed.state_dict().values()))


def test_lora_adapters_load_with_peft(qwen, tmp_path):
    """Adapters on every group's linears (the tower's fused qkv, the merger's mlp.0 / mlp.2, the decoder's
    projections) export as a peft adapter of transformers' model, which then gives mmpipe's logits."""
    kind, _, hf, model, _ = qwen
    adapted = with_random_adapters(model)
    peft_model = peft_of(adapted, type(hf), tmp_path, key_map, export_hf)
    ids, px, grids = _sample(3)
    with torch.no_grad():
        want = adapted(*row([(ids, px, grids)])[0])[0, :len(ids)]
        assert (hf_logits(peft_model, ids, px, grids) - want).abs().max().item() < TOL
        assert (hf_logits(hf, ids, px, grids) - want).abs().max().item() > 1e-2  # the adapters count


def test_import_and_export_commands(qwen, tmp_path, capsys):
    """The import and the export; the export's config declares the run's tokenizer's special ids (Qwen's: no
    BOS, EOS <|im_end|>), so transformers' generate stops where `mmpipe generate` does."""
    kind, d, hf, model, _ = qwen
    shutil.copytree(d, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert "imported qwen2_vl model" in capsys.readouterr().out
    run = load_reference(tmp_path / "run" / "checkpoints", model.cfg)
    for k, v in model.state_dict().items():
        assert torch.equal(v, run.state_dict()[k]), k
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    back = type(hf).from_pretrained(tmp_path / "back").eval()
    tok = load_tokenizer(str(tmp_path / "hf"))
    assert exported_ids(tmp_path / "back") == ids_of(tok) == [(None, 195, 0)] * 2
    ids, px, grids = _sample(0)
    assert (hf_logits(back, ids, px, grids) - hf_logits(hf, ids, px, grids)).abs().max().item() < TOL


def test_import_without_preprocessor_config_says_which_defaults_it_took(qwen, tmp_path, capsys):
    """The tiny model's processor allows at most 28 x 28 x 16 pixels: imported without its
    preprocessor_config.json it gets transformers' 1003520 and CLIP's mean / std, and the import's summary line
    says so (the file and the defaults), as it names a key the file lacks; with the whole file, no such note."""
    kind, d, _, model, report = qwen
    assert "by default" not in report.summary()
    shutil.copytree(d, tmp_path / "hf", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert ("; no preprocessor_config.json: took min_pixels 3136, max_pixels 1003520, CLIP's image_mean / image_std "
            f"by default) -> {tmp_path / 'run'}\n") in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "model.json").read_text())["vision"]["max_pixels"] == 1003520
    settings = json.loads((d / "preprocessor_config.json").read_text())
    settings.pop("max_pixels", None)  # the bound in either spelling (transformers 5 writes size's)
    settings.get("size", {}).pop("longest_edge", None)
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(settings))
    assert import_qwen2_vl(tmp_path / "hf")[1].summary().endswith(
        "; preprocessor_config.json has no max_pixels: took max_pixels 1003520 by default")


def test_generate_command_from_hf_dir_and_imported_run(qwen, tmp_path, capsys):
    """`mmpipe generate` on an HF directory (and on its import) gives transformers' greedy answer to the prompt
    it builds: the chat template, the image's bracketed block of its 2 x 3 merge units, the processor's patches."""
    kind, d, hf, model, _ = qwen
    shutil.copytree(d, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    image(84, 56, seed=5).save(tmp_path / "img.png")
    gen = ["generate", "--image", str(tmp_path / "img.png"), "--prompt", "w7 w8", "--max-new-tokens", "5"]
    assert main(gen + ["--checkpoint", str(tmp_path / "hf")]) == 0
    from_hf = capsys.readouterr().out.strip()
    tok = load_tokenizer(str(tmp_path / "hf"))
    ids, at = ConversationEncoder(tok, 512, markers=True, image_text=image_text(tok, model.cfg)).prompt(
        [("user", "w7 w8")], n_images=1)
    px, grids = encode([image(84, 56, seed=5)])
    prompt = torch.tensor(with_images(ids, model.cfg, at, [tuple(grids[0].tolist())]))
    assert [int((prompt == t).sum()) for t in (START, IMAGE, END)] == [1, 6, 1]
    with torch.no_grad():
        out = hf.generate(input_ids=prompt[None], pixel_values=px, image_grid_thw=grids, max_new_tokens=5,
                          mm_token_type_ids=(prompt == IMAGE).int()[None], do_sample=False,
                          eos_token_id=tok.eos_token_id)
    assert from_hf == tok.decode(out[0, len(prompt):], skip_special_tokens=True).strip() != ""
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert "tokenizer saved" in capsys.readouterr().out
    assert main(gen + ["--checkpoint", str(tmp_path / "run"), "--no-cache"]) == 0
    assert capsys.readouterr().out.strip() == from_hf
    # `mmpipe eval` on records of the same question (the data side's prompt, patches and grid) answers alike
    records = [{"image": "img.png", "conversations": [{"from": "human", "value": "<image>\nw7 w8"},
                                                       {"from": "gpt", "value": "w9"}]},
               {"conversations": [{"from": "human", "value": "w7 w8"}, {"from": "gpt", "value": "w9"}]}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "data.jsonl"),
                 "--out", str(tmp_path / "answers.jsonl"), "--max-new-tokens", "5"]) == 0
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["has_image"] for a in answers] == [True, False] and answers[0]["answer"] == from_hf


def test_bad_weights_and_rows_are_named(qwen, tmp_path):
    kind, d, _, model, _ = qwen
    weights = load_file(str(d / "model.safetensors"))
    name = next(k for k in weights if k.endswith("blocks.0.attn.qkv.weight"))  # the Hub's layout: visual.*
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="no tensor for 'model.visual.blocks.0.attn.qkv.weight'"):
        import_qwen2_vl(tmp_path)
    save_file({**weights, name: weights[name][:, :-1].contiguous()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"tensor '{name}' has shape"):
        import_qwen2_vl(tmp_path)
    ids, px, grids = _sample(0)
    inputs = list(row([(ids, px, grids)])[0])
    inputs[1] = torch.cat([inputs[1][:, :4], inputs[1][:, 5:]], dim=1)  # 3 words, START, 4 placeholders: 3 left
    inputs[3] = inputs[3][:, 1:]
    with torch.no_grad(), pytest.raises(ValueError, match="3 image placeholder positions .* for 4 merged"):
        model(*inputs)
    fields = r"\(hidden, input_ids, has_image, segments, tiling\)"
    with torch.no_grad(), pytest.raises(ValueError, match=rf"stage tuple: expected {fields}, got 4"):
        model(*inputs[:4])  # no tiling


@pytest.mark.parametrize("section, field, value, problem", [
    ("text", "mrope_section", (2, 3, 2), "text.mrope_section: [2, 3, 2]: 3 sections summing to head_dim / 2 = 8"),
    ("vision", "window_size", 50, "vision.window_size: 50 must be a multiple of patch_size x merge_size = 28"),
    ("vision", "fullatt_blocks", (3,), "vision.fullatt_blocks: [3]: block indices of a 3-block tower"),
    ("vision", "act", "quick_gelu", "vision.act: 'quick_gelu' with mlp 'swiglu' (valid: silu with swiglu"),
    ("top", "vision_end_id", 500, "vision_end_id: 500 is not a token id of the 200-token vocabulary")])
def test_config_checks_name_the_field(section, field, value, problem):
    """A Qwen2.5 config with one bad field: one line naming it (mmpipe.config's qwen2_vl checks)."""
    cfg = config_from_hf(qwen_config("qwen2_5"), "tiny")
    bad = (dataclasses.replace(cfg, **{field: value}) if section == "top" else
           dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})}))
    with pytest.raises(ConfigError) as e:
        bad.validate()
    assert str(e.value).startswith(f"model config '{cfg.name}': {problem}") and "\n" not in str(e.value)


def test_export_beside_the_builtin_tokenizer_writes_no_llava_processor(tmp_path):
    """A run trained with the built-in tokenizer has its `<image>` as image_token_id; the export writes that
    tokenizer (the image processor is export_hf's), never LLaVA's processor."""
    from mmpipe.config import load_preset
    from mmpipe.data.tokenizer import builtin_tokenizer
    from mmpipe.hf.bundle import write_processor
    tok = builtin_tokenizer(image_token=True)
    cfg = dataclasses.replace(load_preset("qwen-tiny"), image_token_id=tok.convert_tokens_to_ids("<image>"))
    assert write_processor(tok, cfg, tmp_path) == "tokenizer"
    assert not (tmp_path / "processor_config.json").exists()
