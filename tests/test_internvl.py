"""The internvl family (InternVL3.5: InternViT on dynamic tiles, pixel shuffle, a Qwen3 decoder) against
transformers' InternVLForConditionalGeneration, tiny and random, built here (nothing downloaded), its tiles cut by
transformers' GotOcr2ImageProcessor as InternVLProcessor runs it (crop_to_patches, 1..4 tiles of 28 px + a
thumbnail): `mmpipe import --hf` gives HF's logits for images of four tilings (1 tile, 1 x 2, 2 x 1, 2 x 2) and a
text-only sample, alone and packed in one row; an MoE decoder (Qwen3-MoE) imports to HF's logits; the export loads
back into transformers with equal logits; `mmpipe generate` on the HF directory gives transformers' greedy answers
for four image sizes in one batch; an image over its tile cap at a fixed --max-tiles is one line. The pipeline: one
launch, PP=2 cut inside the tower == the single-device reference (fp32, packed rows, 1e-5)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration

from hf_models import peft_of, with_random_adapters, word_tokenizer
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.data.internvl import intern_rule
from mmpipe.data.records import BadRecord
from mmpipe.hf.internvl import export_hf, import_internvl, key_map
from mmpipe.runtime.checkpoint import load_reference

TOL = 1e-4
VOCAB, CTX, START, END = 200, 190, 188, 189  # <img>, </img> before <IMG_CONTEXT>, as InternVL-HF
TILE = 28
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} w5 "
            "{% else %}{{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}")
# (name, width x height): 1 tile (no thumbnail), 1 x 2 tiles + thumbnail, 2 x 1, 2 x 2
SIZES = [("one", (30, 26)), ("wide", (60, 28)), ("tall", (28, 62)), ("big", (70, 66))]


def hf_config(moe: bool = False) -> InternVLConfig:
    text = dict(model_type="qwen3_moe" if moe else "qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    vision = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=TILE,
                  patch_size=7, use_qk_norm=True, attention_bias=True, layer_norm_eps=1e-6)
    return InternVLConfig(vision_config=vision, text_config=text, image_token_id=CTX, image_seq_length=4,
                          tie_word_embeddings=False)


def processor() -> GotOcr2ImageProcessor:
    return GotOcr2ImageProcessor(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                                 max_patches=4, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


def save_model(out, moe: bool = False, seed: int = 0):
    """The tiny model, its image processor and a word tokenizer saved to out; the model, in eval mode."""
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(hf_config(moe)).eval()
    with torch.no_grad():  # HF's init leaves norms at 1, biases and positions at 0: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "position_embeddings" in name or "cls_token" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform, blind to positions and masks
            elif "lambda_" in name:
                p.mul_(5)  # layer scale 0.1: the tower's blocks would barely show
            elif "multi_modal_projector.linear_2.weight" in name:
                p.mul_(10)
    model.save_pretrained(out)
    processor().save_pretrained(out)
    word_tokenizer(out, TEMPLATE)
    return model


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def sample(images: list, seed: int, words: int = 3):
    """(input_ids [T], crops [n, 3, S, S], tilings [(h, w, rows, cols)]): text, then per image its <img>,
    crops x 4 placeholders, </img> and more text; the crops transformers' processor cuts, in order."""
    g = torch.Generator().manual_seed(seed)
    parts, crops, tilings, rule = [torch.randint(3, 99, (words,), generator=g)], [], [], intern_rule(_preset())
    for im in images:
        px = processor()(images=[im], return_tensors="pt")["pixel_values"]
        h, w, r, c, n = rule.grid(im.width, im.height)
        assert n == 4 * len(px) + 2 and 1 + r * c == len(px)
        parts += [torch.tensor([START] + [CTX] * (n - 2) + [END]), torch.randint(3, 99, (words,), generator=g)]
        crops.append(px)
        tilings.append((h, w, r, c))
    return torch.cat(parts), torch.cat(crops) if crops else None, tilings


def _preset():
    return load_preset("internvl-tiny")


def row(samples, extra_crops: int = 2, extra_positions: int = 3, extra_slots: int = 1):
    """One packed row of samples (segments 1, 2, ...) as the stage contract's first input, and each sample's span."""
    ids = torch.cat([s[0] for s in samples] + [torch.zeros(extra_positions, dtype=torch.long)])[None]
    segments, spans, at = torch.zeros_like(ids), [], 0
    for k, s in enumerate(samples):
        spans.append((at, at + len(s[0])))
        segments[0, at:at + len(s[0])] = k + 1
        at += len(s[0])
    slots = [(t, k + 1) for k, s in enumerate(samples) for t in s[2]]
    M = max(len(slots) + extra_slots, 1)
    tiling, has_image = torch.zeros(1, M, 4, dtype=torch.long), torch.zeros(1, M, dtype=torch.long)
    for j, (t, owner) in enumerate(slots):
        tiling[0, j], has_image[0, j] = torch.tensor(t), owner
    crops = [s[1] for s in samples if s[1] is not None]
    n = sum(len(c) for c in crops)
    pixels = torch.zeros(1, max(n + extra_crops, 1), 3, TILE, TILE)
    if crops:
        pixels[0, :n] = torch.cat(crops)
    return (pixels, ids, has_image, segments, tiling), spans


def hf_logits(model, s) -> torch.Tensor:
    kw = {} if s[1] is None else {"pixel_values": s[1]}
    with torch.no_grad():
        return model(input_ids=s[0][None], **kw).logits[0]


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """(HF directory, HF model, the model `mmpipe import --hf` wrote, its run directory, the samples)."""
    d = tmp_path_factory.mktemp("internvl")
    hf = save_model(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = import_internvl(d / "hf")[0].cfg
    samples = [sample([image(w, h, seed=k)], seed=k) for k, (_, (w, h)) in enumerate(SIZES)]
    samples.append(sample([image(40, 30, 7), image(28, 28, 8)], seed=5))  # two images in one sample
    samples.append(sample([], seed=6, words=6))
    return d / "hf", hf, load_reference(d / "run" / "checkpoints", cfg).eval(), d / "run", samples


def test_import_gives_hf_logits_alone_and_packed(internvl):
    """The import equals the preset (the pipeline test's model) and gives HF's logits for each sample alone and for
    every sample packed in one row (an unused slot, 2 zero crops, 3 padding positions)."""
    _, hf, model, _, samples = internvl
    preset = _preset()
    assert (model.cfg.vision, model.cfg.text, model.cfg.vision_start_id, model.cfg.vision_end_id) == (
        preset.vision, preset.text, preset.vision_start_id, preset.vision_end_id)
    assert [s[2][0][2:] for s in samples[:4]] == [(0, 0), (1, 2), (2, 1), (2, 2)]  # rows x cols, 0 x 0: one crop
    inputs, spans = row(samples)
    with torch.no_grad():
        packed = model(*inputs)[0]
        for k, (s, (a, b)) in enumerate(zip(samples, spans)):
            want = hf_logits(hf, s)
            assert (model(*row([s], 0, 0, 0)[0])[0] - want).abs().max().item() < TOL, k
            assert (packed[a:b] - want).abs().max().item() < TOL, k
        flipped = list(row([samples[3]], 0, 0, 0)[0])
        flipped[0] = flipped[0].flip(-1)  # the image reaches the logits
        assert (model(*flipped) - model(*row([samples[3]], 0, 0, 0)[0])).abs().max().item() > 1e-3


def test_moe_import_and_export_give_hf_logits(internvl, tmp_path):
    """A Qwen3-MoE decoder (4 experts, top 2, renormalised; transformers saves its experts one module each) imports to
    HF's logits; each import's export (the MoE one per expert again) loads back into transformers with HF's logits."""
    _, hf, model, _, samples = internvl
    moe_hf = save_model(tmp_path / "moe", moe=True, seed=1)
    moe, _ = import_internvl(tmp_path / "moe")
    assert moe.cfg.text.moe.experts == 4 and moe.cfg.text.moe.norm_topk
    back = InternVLForConditionalGeneration.from_pretrained(export_hf(model, tmp_path / "out")).eval()
    moe_back = InternVLForConditionalGeneration.from_pretrained(export_hf(moe.eval(), tmp_path / "moe_out")).eval()
    with torch.no_grad():
        for s in samples[3:5]:
            got = moe(*row([s], 0, 0, 0)[0])
            got = got[0] if isinstance(got, (tuple, list)) else got
            assert (got[0] - hf_logits(moe_hf, s)).abs().max().item() < TOL
            assert (hf_logits(moe_back, s) - hf_logits(moe_hf, s)).abs().max().item() < TOL
            assert (hf_logits(back, s) - hf_logits(hf, s)).abs().max().item() < TOL


def test_unsupported_checkpoint_is_one_line(tmp_path, capsys):
    """What the layers do not implement is refused in one line naming the field (exit 2): a downsample ratio of
    0.25, a Qwen2 decoder (InternVL3's)."""
    qwen2 = {"model_type": "qwen2", "vocab_size": VOCAB}
    for field, value, where in (("downsample_ratio", 0.25, "downsample_ratio"),
                                ("text_config", qwen2, "text_config.model_type")):
        d = tmp_path / where
        cfg = InternVLConfig(**{**hf_config().to_dict(), field: value})
        cfg.save_pretrained(d)
        assert main(["import", "--hf", str(d), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"mmpipe: error: {where}: ") and err.count("\n") == 1, err


def test_lora_adapters_load_with_peft(internvl, tmp_path):
    """Adapters on every group's linears (InternViT's, the projector's, the Qwen3 decoder's) export as a peft adapter
    of transformers' InternVLForConditionalGeneration, which then gives mmpipe's logits."""
    _, hf, model, _, samples = internvl
    adapted = with_random_adapters(model)
    peft_model = peft_of(adapted, type(hf), tmp_path, key_map, export_hf)
    s = samples[3]
    with torch.no_grad():
        want = adapted(*row([s], 0, 0, 0)[0])[0]
        assert (hf_logits(peft_model, s) - want).abs().max().item() < TOL
        assert (hf_logits(hf, s) - want).abs().max().item() > 1e-2  # the adapters count


def _hf_answer(hf, tok, question: str, im, new: int) -> str:
    """transformers' greedy answer to the chat-template prompt with the image's block at its marker."""
    from mmpipe.data.text import ConversationEncoder
    ids, at = ConversationEncoder(tok, 512, markers=True).prompt([("user", question)], n_images=1)
    s = sample([im], seed=0, words=0)
    ids = ids[:at[0]] + s[0].tolist() + ids[at[0]:]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=s[1], max_new_tokens=new, do_sample=False,
                          eos_token_id=tok.eos_token_id, suppress_tokens=list(range(len(tok), VOCAB)))
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()


# generate's batch: four sizes of 3 crops each (1 x 2 and 2 x 1 tiles + the thumbnail), equal prompt lengths, so one
# decoding batch of four rows (mmpipe.inference.generate.length_buckets); then a 1-tile and a 2 x 2-tile image alone
BATCH = [(60, 28), (100, 44), (28, 62), (44, 100), (30, 26), (70, 66)]


def test_generate_batch_of_four_sizes_gives_hf_answers(internvl, tmp_path, capsys):
    """`mmpipe generate --records` on the HF directory: four images of four sizes (two tilings) in one batch, and a
    1-tile and a 2 x 2-tile image, each prompt its answer as transformers' greedy decoding gives it, with the layers'
    KV cache and with --no-cache."""
    from mmpipe.data.text import ConversationEncoder
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.inference.generate import length_buckets
    d, hf, _, _, _ = internvl
    tok = load_tokenizer(str(d))
    images = [image(w, h, seed=k) for k, (w, h) in enumerate(BATCH)]
    for k, im in enumerate(images):
        im.save(tmp_path / f"{k}.png")
    requests = [{"image": f"{k}.png", "prompt": "<image>\nw7 w8"} for k in range(len(BATCH))]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    ids, _ = ConversationEncoder(tok, 512, markers=True).prompt([("user", "<image>\nw7 w8")], n_images=1)
    lengths = [len(ids) + len(sample([im], seed=0, words=0)[0]) for im in images]
    assert length_buckets(lengths, 16) == [[0, 1, 2, 3], [4], [5]]  # the four sizes decode as one batch
    want = [_hf_answer(hf, tok, "<image>\nw7 w8", im, 4) for im in images]
    assert all(want) and len(set(want)) > 2, want
    for extra in ([], ["--no-cache"]):  # the layers' KV cache, and the whole prompt again each step
        assert main(["generate", "--checkpoint", str(d), "--records", str(tmp_path / "prompts.jsonl"),
                     "--max-new-tokens", "4", *extra]) == 0
        assert [json.loads(line)["answer"] for line in capsys.readouterr().out.splitlines()] == want, extra


def test_image_over_its_tile_cap_is_one_line(tmp_path, capsys):
    """At a fixed budget (--max-tiles 4) a 2 x 2-tile image (5 crops with its thumbnail) is too_many_tiles: the rule's
    one line names the image, its crops and the budget, and `mmpipe train --bad-records strict` stops on it with that
    line (exit 2); the default budget (M x (max_tiles + 1) = 5) takes it."""
    cfg = _preset()
    assert intern_rule(cfg).row_tiles == 5 and intern_rule(cfg).grid(70, 66)[2:] == (2, 2, 4 * 5 + 2)
    with pytest.raises(BadRecord) as e:
        intern_rule(cfg, budget=4).grid(70, 66)
    line = "image 70x66 makes 5 crops (2 x 2 tiles + the thumbnail) > the row's 4 (--max-tiles)"
    assert e.value.kind == "too_many_tiles" and e.value.reason == line
    image(70, 66, 9).save(tmp_path / "big.png")
    image(30, 26, 8).save(tmp_path / "one.png")
    conv = [{"from": "human", "value": "<image>\nwhat colour is it"}, {"from": "gpt", "value": "red"}]
    (tmp_path / "data.json").write_text(json.dumps([{"image": name, "conversations": conv}
                                                    for name in ("one.png", "big.png")]))
    train = ["train", "--preset", "internvl-tiny", "--data", str(tmp_path / "data.json"), "--text-len", "40",
             "--steps", "1", "--bad-records", "strict", "--output-dir", str(tmp_path / "run"), "--dry-run"]
    assert main(train + ["--max-tiles", "4"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("mmpipe: error:")]
    assert err[0] == f"mmpipe: error: --bad-records strict: {tmp_path / 'data.json'}[1]: too_many_tiles: {line}"
    assert main(train) == 0


def test_pack_alone_fits_the_crop_budget_to_the_context(tmp_path):
    """--pack without --max-images: the data gives the row its image slots M (packed_image_slots), and T, which
    follows them, is fitted to the context at --text-len as --max-images M's default is. internvl-tiny (context 512,
    5 crops of 4 positions an image at its cap) on the built-in set: at --text-len 200, M = 23 took T = 115 crops, a
    row of 706 positions; now (512 - 200 - 46) // 4 = 66 crops, 510. At --text-len 400 even one crop an image (45 x 6
    = 270 positions) overflows it, so the row keeps the most slots that fit at one crop each (as every family's packed
    row does, mmpipe.data.dataset.context_slots): 18, T = (512 - 400 - 36) // 4 = 19 crops, 512 positions."""
    from mmpipe.data.image_kinds import image_kind
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    argv = ["--preset", "internvl-tiny", "--stages", "1", "--pack", "--steps", "1", "--output-dir", str(tmp_path)]
    run = resolve(TrainArgs.from_argv([*argv, "--text-len", "200"]), world_size=1)
    d = run.data
    assert (d.max_images, d.vision_budget) == (23, 66)
    assert image_kind(run.model).sample_positions(run.model, 23, 66) + 200 == 510 <= run.model.text.max_context
    d = resolve(TrainArgs.from_argv([*argv, "--text-len", "400"]), world_size=1).data
    assert (d.max_images, d.vision_budget) == (18, 19)
    assert image_kind(run.model).sample_positions(run.model, 18, 19) + 400 == 512


# InternVL3.5's published totals (vision + language, billions; https://internvl.readthedocs.io/en/latest/internvl3.5/
# quick_start.html, the model cards), rounded as published; the MoE sizes' active parameters too
PUBLISHED = {"1b": 1.1, "2b": 2.3, "4b": 4.7, "8b": 8.5, "14b": 15.1, "38b": 38.4, "30b-a3b": 30.8, "241b-a28b": 240.7}
ACTIVE = {"30b-a3b": 3.7, "241b-a28b": 27.8}  # 0.3 + 3.3 (Qwen3-30B-A3B's active) and the card's A28B


@pytest.mark.parametrize("size", PUBLISHED)
def test_presets_have_the_published_parameter_counts(size):
    """Each preset's parameters (the layer list on the meta device) round to the published total; the MoE ones'
    active parameters (top 8 of 128 experts a layer) to theirs."""
    from mmpipe.model.builder import layer_param_counts
    cfg = load_preset(f"internvl3.5-{size}")
    total = sum(layer_param_counts(cfg))
    assert round(total / 1e9, 1) == PUBLISHED[size]
    if cfg.text.moe:
        t = cfg.text
        active = total - (t.moe.experts - t.moe.top_k) * 3 * t.dim * t.moe.ff_dim * t.n_layers
        assert round(active / 1e9, 1) == ACTIVE[size]
