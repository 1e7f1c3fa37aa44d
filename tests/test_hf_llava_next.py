"""The llava_next family against transformers' LlavaNextForConditionalGeneration and
LlavaOnevisionForConditionalGeneration (tiny, random, built here: tests/llava_next_models.py), imported through
`mmpipe import --hf`: mmpipe's model gives HF's logits for images of three aspect ratios (a 1 x 2 tile grid, a
2 x 1 one, a 2 x 2 one that OneVision pools past its cap), two images in one conversation (OneVision: base crops
only) and a text-only sample; the same samples packed into one row (an unused slot, zero crops, padding
positions) give each sample's logits; cached greedy decoding gives the uncached logits and HF's `generate`
tokens; export loads back into transformers' class with equal logits; LoRA adapters load with peft; `mmpipe
generate` / `mmpipe eval` (from the HF directory or its import) give transformers' greedy answers and teacher-forced
loss, as do training validation's rows. The rows are built from transformers' image processor outputs
(pixel_values, image_sizes) by `row` below."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import peft_of, perturbed, with_random_adapters, word_tokenizer
from llava_next_models import (
    CROP,
    IMAGE,
    KINDS,
    VOCAB,
    encode,
    feature_counts,
    hf_config,
    hf_logits,
    image,
    sample,
    save_model,
    tilings,
)
from mmpipe.cli import main
from mmpipe.config import ConfigError
from mmpipe.data.dataset import prepare
from mmpipe.hf.llava_next import config_from_hf, export_hf, import_llava_next, key_map
from mmpipe.hf.llava_next import hf_config as hf_config_of
from mmpipe.inference.generate import generate
from mmpipe.inference.sampling import Sampling
from mmpipe.model.llava_next import image_feature_count, pooled_shape
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.feed import run_dataset
from test_hf_cli import exported_ids
from test_hf_qwen2_vl import _cached_logits

TOL = 1e-4
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} w5 "
            "{% else %}{{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}")
# (name, image sizes w x h): a 1 x 2 tile grid, 2 x 1, 2 x 2 (unpadded 6 x 8 features: OneVision pools them to
# 4 x 6), two images (OneVision: base crops only), text only
SAMPLES = [("wide", [(224, 100)]), ("tall", [(100, 224)]), ("big", [(150, 130)]), ("two", [(150, 90), (70, 70)]),
           ("text", [])]


def _sample(hf, kind: str, i: int):
    """(input_ids [T], processor pixel_values, image_sizes, [(crops [1 + r c, 3, S, S], (h, w, r, c))]) of
    SAMPLES[i]; each image's placeholders as many as HF's model lays features out for it."""
    sizes = SAMPLES[i][1]
    if not sizes:
        return sample([], seed=i, words=5), None, None, []
    px, hw = encode(kind, [image(w, h, seed=10 * i + k) for k, (w, h) in enumerate(sizes)])
    images = [(px[k, :1 + r * c], (h, w, r, c)) for k, (h, w, r, c) in enumerate(tilings(kind, hw))]
    return sample(feature_counts(hf, px, hw), seed=i), px, hw, images


def row(samples, extra_crops: int = 2, extra_positions: int = 3, extra_slots: int = 1):
    """One packed row of `samples` ((input_ids, images) each; segments 1, 2, ...) as the stage contract's first
    input, and each sample's span: crops in slot order then zero crops up to T, unused slots, padding."""
    ids = torch.cat([s[0] for s in samples] + [torch.zeros(extra_positions, dtype=torch.long)])[None]
    segments, spans, at = torch.zeros_like(ids), [], 0
    for k, s in enumerate(samples):
        spans.append((at, at + len(s[0])))
        segments[0, at:at + len(s[0])] = k + 1
        at += len(s[0])
    images = [(crops, tiling, k + 1) for k, s in enumerate(samples) for crops, tiling in s[1]]
    M = max(len(images) + extra_slots, 1)
    tiling, has_image = torch.zeros(1, M, 4, dtype=torch.long), torch.zeros(1, M, dtype=torch.long)
    for j, (_, t, owner) in enumerate(images):
        tiling[0, j], has_image[0, j] = torch.tensor(t), owner
    crops = [c for c, _, _ in images]
    n = sum(len(c) for c in crops)
    pixels = torch.zeros(1, max(n + extra_crops, 1), 3, CROP, CROP)
    if crops:
        pixels[0, :n] = torch.cat(crops)
    return (pixels, ids, has_image, segments, tiling), spans


def alone(s):
    return row([(s[0], s[3])], extra_crops=0, extra_positions=0, extra_slots=0)[0]


@pytest.fixture(scope="module", params=KINDS)
def llava_next(request, tmp_path_factory):
    """(kind, HF directory, HF model, the mmpipe model `mmpipe import --hf` wrote, its run directory); the HF
    directory carries a word-level tokenizer (w0..w99), which the import keeps in the run."""
    d = tmp_path_factory.mktemp(request.param)
    hf = save_model(request.param, d / "hf")
    word_tokenizer(d / "hf", TEMPLATE)
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = import_llava_next(d / "hf")[0].cfg
    return request.param, d / "hf", hf, load_reference(d / "run" / "checkpoints", cfg).eval(), d / "run"


def test_import_gives_hf_logits(llava_next):
    kind, d, hf, model, _ = llava_next
    v = model.cfg.vision
    assert (v.anyres_max, v.image_size, model.cfg.family) == (2 if kind == "onevision" else 0, CROP, "llava_next")
    grids = {name: [t[2:] for _, t in _sample(hf, kind, i)[3]] for i, (name, _) in enumerate(SAMPLES)}
    assert (grids["wide"], grids["tall"], grids["big"]) == ([(1, 2)], [(2, 1)], [(2, 2)])
    assert (pooled_shape(v, 6, 8) is not None) == (kind == "onevision")  # "big"'s unpadded 6 x 8 features
    for i, (name, _) in enumerate(SAMPLES):
        s = _sample(hf, kind, i)
        with torch.no_grad():
            got = model(*alone(s))[0]
        assert (got - hf_logits(hf, s[0], s[1], s[2])).abs().max().item() < TOL, name
    with torch.no_grad():  # the image reaches the logits: another image, other logits
        s = _sample(hf, kind, 2)
        inputs = list(alone(s))
        inputs[0] = inputs[0].flip(-1)
        assert (model(*inputs) - model(*alone(s))).abs().max().item() > 1e-3


def test_feature_counts_are_transformers(llava_next):
    """image_feature_count (what the data side and the planner read) equals HF's layout for every sample image."""
    kind, _, hf, model, _ = llava_next
    for i in range(len(SAMPLES) - 1):
        ids, px, hw, images = _sample(hf, kind, i)
        assert [image_feature_count(model.cfg.vision, *t) for _, t in images] == feature_counts(hf, px, hw)


def test_packed_row_gives_each_samples_logits(llava_next):
    """Every sample in one row (two images in one sample, an unused slot, 2 zero crops, 3 padding positions):
    each sample's logits are its own run's and HF's."""
    kind, _, hf, model, _ = llava_next
    samples = [_sample(hf, kind, i) for i in range(len(SAMPLES))]
    inputs, spans = row([(s[0], s[3]) for s in samples])
    with torch.no_grad():
        packed = model(*inputs)[0]
        for s, (a, b), (name, _) in zip(samples, spans, SAMPLES):
            assert (packed[a:b] - model(*alone(s))[0]).abs().max().item() < TOL, name
            assert (packed[a:b] - hf_logits(hf, s[0], s[1], s[2])).abs().max().item() < TOL, name


def test_cached_decoding_equals_uncached_and_hf_generate(llava_next):
    kind, _, hf, model, _ = llava_next
    s = _sample(hf, kind, 3)  # two images
    new = [5, 17, 33]
    inputs = alone(s)
    with torch.no_grad():
        cached = _cached_logits(model, inputs, new)
        for k in range(len(new) + 1):
            longer = torch.cat([s[0], torch.tensor(new[:k], dtype=torch.long)])
            full = model(inputs[0], longer[None], inputs[2], torch.ones(1, len(longer), dtype=torch.long), inputs[4])
            assert (cached[k] - full[0, -1]).abs().max().item() < TOL, k
    # one image through mmpipe's generate (a 1-slot row), cached and not, and HF's own greedy decoding
    s = _sample(hf, kind, 2)
    pixels, tiling = alone(s)[0], alone(s)[4]
    greedy = Sampling(eos_id=None, max_new_tokens=5)
    mine = generate(model, pixels, s[0].tolist(), greedy, tiling=tiling)
    assert mine == generate(model, pixels, s[0].tolist(), greedy, use_cache=False, tiling=tiling)
    extra = {"batch_num_images": torch.tensor([1])} if kind == "onevision" else {}
    with torch.no_grad():
        out = hf.generate(input_ids=s[0][None], pixel_values=s[1], image_sizes=s[2], max_new_tokens=5,
                          min_new_tokens=5, do_sample=False, **extra)
    assert out[0, len(s[0]):].tolist() == mine


def test_export_loads_in_transformers(llava_next, tmp_path):
    kind, _, hf, model, run = llava_next
    changed = perturbed(model)  # as if trained: the export must carry these weights, not the imported ones
    export_hf(changed, tmp_path / "out")
    assert exported_ids(tmp_path / "out") == [(None, None, None)] * 2  # no tokenizer given: no class default
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    for i in (2, 3):  # tiles (OneVision: pooled); two images
        s = _sample(hf, kind, i)
        with torch.no_grad():
            mine, before = changed(*alone(s))[0], model(*alone(s))[0]
        assert (mine - hf_logits(back, s[0], s[1], s[2])).abs().max().item() < TOL
        assert (mine - before).abs().max().item() > 1e-3
    again, _ = import_llava_next(tmp_path / "out")  # the export (and its image processor) imports back as it was
    fields = lambda v: (v.grid_pinpoints, v.anyres_max, v.image_size, v.mean, v.std, v.n_blocks_used)  # noqa: E731
    assert fields(again.cfg.vision) == fields(changed.cfg.vision)  # the tower cut at its feature layer
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), changed.state_dict().values()))
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "cli")]) == 0  # the command's
    assert (tmp_path / "cli" / "preprocessor_config.json").is_file()
    assert exported_ids(tmp_path / "cli") == [(1, 2, 0)] * 2  # the run's tokenizer's (w1, w2, w0), stop included
    s = _sample(hf, kind, 0)
    back = type(hf).from_pretrained(tmp_path / "cli").eval()
    assert (hf_logits(back, *s[:3]) - hf_logits(hf, *s[:3])).abs().max().item() < TOL


def test_lora_adapters_load_with_peft(llava_next, tmp_path):
    """Adapters on every group's linears (the tower's, the projector's, the decoder's) export as a peft adapter
    of transformers' model, which then gives mmpipe's logits."""
    kind, _, hf, model, _ = llava_next
    adapted = with_random_adapters(model)
    peft_model = peft_of(adapted, type(hf), tmp_path, key_map, export_hf)
    s = _sample(hf, kind, 2)
    with torch.no_grad():
        want = adapted(*alone(s))[0]
        assert (hf_logits(peft_model, *s[:3]) - want).abs().max().item() < TOL
        assert (hf_logits(hf, *s[:3]) - want).abs().max().item() > 1e-2  # the adapters count


def test_import_without_preprocessor_config_says_which_defaults_it_took(llava_next, tmp_path, capsys):
    """Imported without its preprocessor_config.json, the model gets its tower's default mean / std (CLIP's, or
    SigLIP's 0.5) instead of the processor's, and the import's summary line says so; with it, no such note."""
    kind, d, _, model, _ = llava_next
    assert "by default" not in import_llava_next(d)[1].summary()
    shutil.copytree(d, tmp_path / "hf", ignore=shutil.ignore_patterns("preprocessor_config.json"))
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    taken = "CLIP's image_mean / image_std" if kind == "next" else "image_mean / image_std 0.5 (SigLIP's)"
    assert (f"; no preprocessor_config.json: took {taken} by default; tokenizer saved) -> {tmp_path / 'run'}\n"
            in capsys.readouterr().out)
    mean = json.loads((tmp_path / "run" / "model.json").read_text())["vision"]["mean"]
    assert mean != list(model.cfg.vision.mean) and mean == ([0.48145466, 0.4578275, 0.40821073] if kind == "next"
                                                            else [0.5] * 3)


def test_bad_weights_and_rows_are_named(llava_next, tmp_path):
    kind, d, hf, model, _ = llava_next
    weights = load_file(str(d / "model.safetensors"))
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file({k: v for k, v in weights.items() if k != "image_newline"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="no tensor for 'model.image_newline'"):
        import_llava_next(tmp_path)
    s = _sample(hf, kind, 0)
    inputs = list(alone(s))
    n = int((inputs[1] == IMAGE).sum())
    inputs[1] = inputs[1].clone()
    inputs[1][0, int((inputs[1][0] == IMAGE).nonzero()[0, 0])] = 7  # one placeholder fewer
    with torch.no_grad(), pytest.raises(ValueError, match=rf"row 0: {n - 1} image placeholder positions \(id {IMAGE}\) "
                                                          rf"for {n} image features"):
        model(*inputs)
    with torch.no_grad(), pytest.raises(ValueError, match="crop budget"):
        model(inputs[0][:, :2], *inputs[1:])  # a 1 x 2 grid's 3 crops in a row of 2
    fields = r"\(hidden, input_ids, has_image, segments, tiling\)"
    with torch.no_grad(), pytest.raises(ValueError, match=rf"stage tuple: expected {fields}, got 4"):
        model(*inputs[:4])


@pytest.mark.parametrize("field, value, problem", [
    ("grid_pinpoints", ((56, 100),), "vision.grid_pinpoints: [[56, 100]]: one or more [h, w] pairs in pixels, each "
                                     "a positive multiple of image_size 56"),
    ("grid_pinpoints", (), "vision.grid_pinpoints: []"),
    ("anyres_max", -1, "vision.anyres_max: -1 must be >= 0"),
    ("feature_select", "full", "vision.feature_select: 'full' with a clip tower: tiles need one feature per patch")])
def test_config_checks_name_the_field(field, value, problem):
    """A LLaVA-NeXT config with one bad field: one line naming it (mmpipe.config's llava_next checks)."""
    cfg = config_from_hf(hf_config("next"), "tiny")
    bad = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, **{field: value}))
    with pytest.raises(ConfigError) as e:
        bad.validate()
    assert str(e.value).startswith(f"model config 'tiny': {problem}") and "\n" not in str(e.value)


def test_unsupported_aspect_ratio_is_one_line():
    hf = hf_config("onevision")
    hf.vision_aspect_ratio = "anyres"
    with pytest.raises(ConfigError, match="vision_aspect_ratio: 'anyres' .supported: anyres_max_N"):
        config_from_hf(hf)


def test_real_shapes_read():
    """transformers' default configs (LLaVA-v1.6's CLIP-L 336 and 5 pinpoints; OneVision's SigLIP 384 px / 14,
    27 x 27 patches, and anyres_max_9 over 36 pinpoints) read into valid configs that write back the class."""
    from transformers import LlavaNextConfig, LlavaOnevisionConfig
    for hf, want in ((LlavaNextConfig(image_token_id=31999), (336, 24, 576, 0, 5)),
                     (LlavaOnevisionConfig(), (384, 27, 729, 9, 36))):
        v = config_from_hf(hf).vision
        assert (v.image_size, v.grid, v.n_features, v.anyres_max, len(v.grid_pinpoints)) == want
        assert type(hf_config_of(config_from_hf(hf))) is type(hf)


def test_data_rows_give_hf_logits(llava_next, tmp_path):
    """The data side's rows (mmpipe.data.anyres through run_dataset: crops, placeholders, tilings) of a LLaVA
    .jsonl, for a run --init-from the import, give transformers' logits for each sample: the model and the data
    agree on every grid, count and crop, OneVision's padded base crops of a two-image conversation included."""
    kind, _, hf, model, run = llava_next
    sizes = [w_h for _, images in SAMPLES for w_h in images]
    for k, (w, h) in enumerate(sizes):
        image(w, h, seed=k).save(tmp_path / f"{k}.png")
    convs = [[{"from": "human", "value": "<image>\nw7 w8"}, {"from": "gpt", "value": "w9 w10"}],
             [{"from": "human", "value": "<image> w6 <image>\nw7 w8"}, {"from": "gpt", "value": "w9 w10"}]]
    records = [{"image": f"{k}.png", "conversations": convs[0]} for k in range(3)]
    records.append({"image": ["3.png", "4.png"], "conversations": convs[1]})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rc = resolve(TrainArgs.from_argv(["--init-from", str(run), "--data", str(tmp_path / "data.jsonl"), "--steps", "1",
                                      "--eval-samples", "0", "--stages", "1", "--max-images", "2"]), world_size=1)
    rows = run_dataset(rc, prepare(rc.data, rc.model, tmp_path / "out", 5, verbose=False), train=False)
    seen = set()
    for r in range(len(records)):
        item = rows[r]
        inputs = [torch.as_tensor(np.asarray(item[k]))[None] for k in ("input_ids", "has_image", "segments", "tiling")]
        n, used = int((inputs[2] > 0).sum()), inputs[3][0][inputs[1][0] > 0]
        files = [sizes.index((w, h)) for h, w, _, _ in used.tolist()]
        seen.add(tuple(files))
        px, hw = encode(kind, [image(*sizes[k], seed=k) for k in files])
        with torch.no_grad():
            got = model(torch.as_tensor(item["pixels"])[None], *inputs)[0, :n]
        assert (got - hf_logits(hf, inputs[0][0, :n], px, hw)).abs().max().item() < TOL, files
    assert seen == {(0,), (1,), (2,), (3, 4)}


def _hf_prompt(hf, kind: str, tok, question: str, images: list) -> tuple[list[int], dict]:
    """The generation prompt (chat template, BOS) with each image's placeholders at its <image> marker, as many
    as transformers' model lays its features out, and HF's image inputs for it."""
    from mmpipe.data.text import ConversationEncoder
    ids, at = ConversationEncoder(tok, 512, markers=True).prompt([("user", question)], n_images=len(images))
    return _with_blocks(hf, kind, ids, at, images)


def _with_blocks(hf, kind: str, ids, at, images: list, fill=IMAGE) -> tuple[list, dict]:
    """ids with image k's placeholders (HF's count, `fill`) before ids[at[k]]; HF's image inputs."""
    if not images:
        return list(ids), {}
    px, hw = encode(kind, images)
    ids = list(ids)
    for a, n in sorted(zip(at, feature_counts(hf, px, hw)), reverse=True):
        ids[a:a] = [fill] * n
    extra = {"batch_num_images": torch.tensor([len(images)])} if kind == "onevision" else {}
    return ids, dict(pixel_values=px, image_sizes=hw, **extra)


def _hf_answer(hf, tok, prompt: list[int], inputs: dict, new: int) -> str:
    """transformers' greedy answer, ids past the tokenizer never picked (as mmpipe's generate: in_vocab)."""
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          eos_token_id=tok.eos_token_id, suppress_tokens=list(range(len(tok), VOCAB)), **inputs)
    return tok.decode(out[0, len(prompt):], skip_special_tokens=True).strip()


def test_generate_command_from_hf_dir_and_imported_run(llava_next, tmp_path, capsys):
    """`mmpipe generate` on the HF directory and on its import (cached, and --no-cache) gives transformers' greedy
    answers: an image that tiles 1 x 2 (the processor's crops, the processor's count of placeholders at the
    prompt's <image> marker) and a text-only prompt in one --records file; an image too thin for the tiles is
    one line."""
    from mmpipe.data.tokenizer import load_tokenizer
    kind, d, hf, _, run = llava_next
    image(224, 100, seed=5).save(tmp_path / "wide.png")
    requests = [{"image": "wide.png", "prompt": "<image>\nw7 w8"}, {"image": None, "prompt": "w5 w6 w7"}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    tok = load_tokenizer(str(d))
    assert tilings(kind, encode(kind, [image(224, 100, seed=5)])[1]) == [(100, 224, 1, 2)]
    want = [_hf_answer(hf, tok, *_hf_prompt(hf, kind, tok, r["prompt"], [image(224, 100, seed=5)] if r["image"]
                                            else []), 5) for r in requests]
    assert all(want), want
    gen = ["generate", "--records", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "5"]
    for extra in (["--checkpoint", str(d)], ["--checkpoint", str(run)], ["--checkpoint", str(run), "--no-cache"]):
        assert main(gen + extra) == 0
        assert [json.loads(line)["answer"] for line in capsys.readouterr().out.splitlines()] == want, extra
    image(300, 2, seed=1).save(tmp_path / "thin.png")  # 1 x 2 tiles whose unpadding keeps no feature row
    assert main(["generate", "--checkpoint", str(run), "--image", str(tmp_path / "thin.png"), "--prompt", "w7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmpipe: error: --image: {tmp_path / 'thin.png'}: image 300x2:") and "bad_aspect" in err
    assert err.count("\n") == 1


# a LLaVA .jsonl's records as (image files, question, answer): 1 x 2 tiles, 2 x 1, text only, two images
RECORDS = [(["wide.png"], "<image>\nw7 w8", "w9 w10"), (["tall.png"], "w6 <image>\nw7", "w11"),
           ([], "w5 w6", "w12 w13"), (["wide.png", "tall.png"], "<image> w6 <image>\nw7 w8", "w9")]
PICTURES = {"wide.png": (224, 100, 5), "tall.png": (100, 224, 6), "thin.png": (300, 2, 1)}  # w, h, seed


def _data(root, records) -> str:
    for name, (w, h, seed) in PICTURES.items():
        image(w, h, seed).save(root / name)
    lines = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
              **({"image": files if len(files) > 1 else files[0]} if files else {})} for files, q, a in records]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(root / "data.jsonl")


def _hf_loss(hf, kind: str, tok, records) -> tuple[float, int]:
    """transformers' teacher-forced cross-entropy summed over the records' answer tokens, and their count: each
    record through the chat template with its images' placeholders (HF's count) at their markers."""
    from mmpipe.data.text import ConversationEncoder
    total, count = 0.0, 0
    for files, q, a in records:
        images = [image(*PICTURES[f]) for f in files]
        enc = ConversationEncoder(tok, 512, markers=True).encode([("user", q), ("assistant", a)], len(images))
        ids, inputs = _with_blocks(hf, kind, enc.ids.tolist(), enc.image_at, images)
        target = torch.tensor(_with_blocks(hf, kind, enc.target.tolist(), enc.image_at, images, fill=False)[0])
        logits = hf_logits(hf, torch.tensor(ids), inputs.get("pixel_values"), inputs.get("image_sizes"))
        labels = torch.where(target[1:], torch.tensor(ids[1:]), -100)
        total += torch.nn.functional.cross_entropy(logits[:-1], labels, reduction="sum").item()
        count += int(target[1:].sum())
    return total, count


def test_eval_command_answers_and_loss(llava_next, tmp_path):
    """`mmpipe eval` of the HF directory on a LLaVA .jsonl (1 x 2 and 2 x 1 tiles, text only, an image too thin to
    tile, two images): each good record's answer is transformers' greedy one and the validation loss its
    teacher-forced one over the same answer tokens; the bad records are counted as training counts them (bad_aspect;
    too_many_images: eval's rows have one image slot, as the Qwen2-VL family's)."""
    from mmpipe.data.tokenizer import load_tokenizer
    kind, d, hf, _, _ = llava_next
    data = _data(tmp_path, RECORDS + [(["thin.png"], "<image>\nw7", "w9")])
    out = tmp_path / "eval" / "answers.jsonl"
    assert main(["eval", "--checkpoint", str(d), "--data", data, "--out", str(out), "--max-new-tokens", "4",
                 "--batch-size", "2"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_name("answers.summary.json").read_text())
    assert (summary["n"], summary["bad_by_kind"]) == (3, {"bad_aspect": 1, "too_many_images": 1})
    tok = load_tokenizer(str(d))
    want = [_hf_answer(hf, tok, *_hf_prompt(hf, kind, tok, q, [image(*PICTURES[f]) for f in files]), 4)
            for files, q, _ in RECORDS[:3]]
    assert [x["answer"] for x in lines] == want and [x["has_image"] for x in lines] == [True, True, False]
    loss, tokens = _hf_loss(hf, kind, tok, RECORDS[:3])
    assert summary["answer_tokens"] == tokens and summary["val_loss"] == pytest.approx(loss / tokens, abs=TOL)


def test_validation_rows_give_hf_loss(llava_next, tmp_path):
    """Training's validation (--eval-data, runtime.validation) reads the data side's rows of the eval file
    (run_dataset, train=False) and sums lm_loss_sum over them: on the single-device model that is transformers'
    teacher-forced loss, a two-image conversation (OneVision: base crops only) included."""
    from mmpipe.data.batches import collate
    from mmpipe.data.dataset import prepare_eval
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.model.builder import lm_loss_sum
    kind, d, hf, model, run = llava_next
    data = _data(tmp_path, RECORDS)
    rc = resolve(TrainArgs.from_argv(["--init-from", str(run), "--data", data, "--eval-data", data, "--steps", "1",
                                      "--eval-samples", "0", "--stages", "1", "--max-images", "2"]), world_size=1)
    evalset = prepare_eval(rc.eval_data, rc.model, tmp_path / "out", 0, 0, verbose=False)
    rows = run_dataset(rc, evalset, train=False)
    b = collate([rows[r] for r in range(evalset.size)])
    with torch.no_grad():
        got = lm_loss_sum(model(b["pixels"], b["input_ids"], b["has_image"], b["segments"], b["tiling"]), b["labels"])
    loss, tokens = _hf_loss(hf, kind, load_tokenizer(str(d)), RECORDS)
    assert evalset.answer_tokens() == tokens and got.item() == pytest.approx(loss, abs=TOL * tokens)
