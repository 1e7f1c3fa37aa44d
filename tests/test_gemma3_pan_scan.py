"""Gemma 3's pan-and-scan (issue 55; mmpipe.data.gemma3.Gemma3PanScan): test_gemma3's tiny transformers Gemma 3 (32 px
images, 4 soft tokens) saved with an image processor that cuts crops (do_pan_and_scan, min crop 8 px, at most 4,
from a 1.2 aspect ratio) and a tokenizer that knows the words Gemma3Processor writes around them. `mmpipe import
--hf` takes the setting from the processor config; two LLaVA records, a 96 x 32 image (3 crops: 4 image slots, 24
block positions and 15 connecting words) and a 32 x 32 one (no crop), are indexed, packed into one row and batched
as the pipeline's stage tuple: each sample's token ids and pixels are transformers' Gemma3Processor's, its logits
transformers' (1e-4), and the index counted the crops' slots and words before any pixel was read. In-process."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from PIL import Image

from mmpipe.cli import main
from mmpipe.config import config_from_dict
from mmpipe.runtime.checkpoint import load_reference
from test_gemma3 import BOI, EOI, IMG, LOGITS_TOL, SOFT, TEMPLATE, VOCAB, _hf_model

WORDS = "Here is the original image and here are some crops to help you see better".split()  # Gemma3Processor's
FIRST_WORD = 20  # the words' ids: 20..34 (the records' words are w40..w59)
CROP, MAX_CROPS, RATIO = 8, 4, 1.2
# Gemma3Processor's own call defaults (do_pan_and_scan False, 256 px, ...) win over its image processor's saved
# settings (transformers 5.25), so its user passes them when calling it, as here
CALL = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=CROP, pan_and_scan_max_num_crops=MAX_CROPS,
            pan_and_scan_min_ratio_to_activate=RATIO)
SIZES = [(96, 32), (32, 32)]  # (W, H): 3:1 -> round(3.0) = 3 crops of 32 x 32; square -> none


def _tokenizer(path):
    """test_gemma3's word-level tokenizer with WORDS at ids 20..34 (so the connecting text is not 15 unknowns)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    special = {IMG: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>"}
    special |= {FIRST_WORD + i: w for i, w in enumerate(WORDS)}
    vocab = {special.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0", unk_token="w3",
        additional_special_tokens=[special[IMG], special[BOI], special[EOI]],
        extra_special_tokens={"image_token": special[IMG], "boi_token": special[BOI], "eoi_token": special[EOI]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def pan_scan(tmp_path_factory):
    """(transformers' model, its directory, the imported model, the two PIL images saved as 0.png and 1.png)."""
    from transformers import Gemma3ImageProcessor
    d = tmp_path_factory.mktemp("gemma3_pan_scan")
    hf = _hf_model()
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    Gemma3ImageProcessor(size={"height": 32, "width": 32}, do_pan_and_scan=True, pan_and_scan_min_crop_size=CROP,
                         pan_and_scan_max_num_crops=MAX_CROPS,
                         pan_and_scan_min_ratio_to_activate=RATIO).save_pretrained(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = config_from_dict(json.loads((d / "run" / "model.json").read_text()), "gemma3")
    g = torch.Generator().manual_seed(13)
    images = []
    for i, (w, h) in enumerate(SIZES):
        images.append(Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy()))
        images[-1].save(d / f"{i}.png")
    return hf, d, load_reference(d / "run" / "checkpoints", cfg).eval(), images


def _records(d, tmp_path) -> str:
    from test_qwen_data import conv
    records = [{"image": str(d / "0.png"), "conversations": conv("<image>\nw40 w41", "w50")},
               {"image": str(d / "1.png"), "conversations": conv("<image>\nw42", "w51 w52")}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(tmp_path / "data.jsonl")


def test_packed_pan_and_scan_row_gives_transformers_ids_pixels_and_logits(pan_scan, tmp_path):
    """The training data path (--pack, 5 image slots) on the wide and the square record: the wide sample's text
    holds Gemma3Processor's words and 4 blocks (the whole image, 3 crops), the square's one; each sample's ids in
    the row are Gemma3Processor's for its conversation, its slots' pixels the processor's pixel_values (exactly),
    its logits transformers' within 1e-4; the index knew each sample's slots and length before reading a pixel."""
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

    from mmpipe.data.args import DataArgs
    from mmpipe.data.batches import StepBatches, rank_batches
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.image_kinds import image_kind
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    hf, d, model, images = pan_scan
    cfg = model.cfg
    v = cfg.vision
    assert (v.pan_and_scan, v.pan_and_scan_min_crop, v.pan_and_scan_max_crops, v.pan_and_scan_min_ratio) == \
        (True, CROP, MAX_CROPS, RATIO)  # read from the checkpoint's preprocessor_config.json
    assert [image_kind(cfg).crops(w, h) for w, h in SIZES] == [3, 0]
    args = DataArgs(data=_records(d, tmp_path), tokenizer=str(d / "hf"), text_len=40, data_workers=0, max_images=5,
                    pack=True)
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, tmp_path / "out", seed=0, verbose=False)
    index = samples.index
    assert sorted(index.n_images.tolist()) == [1, 4] and index.stats["images"] == 5
    shape = row_shape(cfg, 5, opts.text_len)
    sizes = {int(index.n_images[samples.entry(p)]): sample_size(samples, shape)(p)[0] for p in range(2)}
    text = {int(index.n_images[samples.entry(p)]): len(samples.tokens(p)[0].ids) for p in range(2)}
    # BOS, w4, the 15 words, w40 w41, w5, w50, EOS: 22 text positions and 4 blocks of 2 + 4; the square 7 and 1
    assert text == {4: 22, 1: 7} and sizes == {4: 22 + 4 * (SOFT + 2), 1: 7 + SOFT + 2}
    # the index's fingerprint holds the settings: the same data and directory without pan-and-scan is indexed anew
    plain = dataclasses.replace(cfg, vision=dataclasses.replace(v, pan_and_scan=False))
    assert prepare(opts, plain, tmp_path / "out", seed=0, verbose=False).index.n_images.tolist() == [1, 1]
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=True))
    inputs, _ = next(rank_batches(rows, StepBatches(0, 1, 1, 0, 1)))
    pixels, ids, has_image, segments = inputs
    owners = has_image[0].tolist()  # each slot's sample (1, 2: the row's segments)
    assert pixels.shape == (1, 5, 3, 32, 32) and sorted(owners.count(s) for s in (1, 2)) == [1, 4]
    tok = AutoTokenizer.from_pretrained(d / "hf")
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessor.from_pretrained(d / "hf"), tokenizer=tok,
                           image_seq_length=SOFT)
    convs = {1: ("w42", "w51 w52", images[1]), 4: ("w40 w41", "w50", images[0])}
    with torch.no_grad():
        got = model(*inputs)
        for seg in (1, 2):
            where = segments[0] == seg
            slots = [k for k, owner in enumerate(owners) if owner == seg]
            question, answer, image = convs[len(slots)]
            text = tok.apply_chat_template([{"role": "user", "content": f"<start_of_image>\n{question}"},
                                            {"role": "assistant", "content": answer}], tokenize=False)
            want_in = proc(images=[[image]], text=[text], return_tensors="pt", **CALL)
            sample = ids[0, where][None]
            assert torch.equal(sample, want_in["input_ids"]), (seg, sample, want_in["input_ids"])
            assert torch.equal(pixels[0, slots], want_in["pixel_values"]), seg
            want = hf(input_ids=sample, pixel_values=want_in["pixel_values"],
                      token_type_ids=want_in["token_type_ids"]).logits
            assert (got[0, where] - want[0]).abs().max().item() < LOGITS_TOL, seg
    wide = ids[0, segments[0] == max((1, 2), key=owners.count)].tolist()
    assert wide.count(BOI) == 4 and all(FIRST_WORD + i in wide for i in range(len(WORDS)))


def test_crops_take_slots_and_export_keeps_the_setting(pan_scan, tmp_path):
    """At --max-images 2 the wide image's 4 slots do not fit: a bad record, too_many_images, saying why, the square
    kept; --augment and generating with an image (one square an image) are one line each; `mmpipe export` writes the
    processor's pan-and-scan settings, so an import of the export cuts the same crops."""
    from mmpipe.config import ConfigError
    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.hf.gemma3 import hf_gemma3_config
    _, d, model, _ = pan_scan
    args = DataArgs(data=_records(d, tmp_path), tokenizer=str(d / "hf"), text_len=40, data_workers=0, max_images=2)
    samples = prepare(resolve_data(args, model.cfg), model.cfg, tmp_path / "out", seed=0, verbose=False)
    assert (samples.index.stats["good"], samples.index.stats["bad_by_kind"]) == (1, {"too_many_images": 1})
    bad = json.loads((tmp_path / "out" / "data" / "bad_records.jsonl").read_text())
    assert bad["reason"] == "4 images (a crop takes a slot) > --max-images 2", bad
    with pytest.raises(ConfigError, match="^--augment: pan-and-scan images are resized and cut by transformers'"):
        resolve_data(DataArgs(data=args.data, tokenizer=args.tokenizer, text_len=40, augment=True), model.cfg)
    from mmpipe.inference.generate import _images
    with pytest.raises(ConfigError, match=r"^vision.pan_and_scan: mmpipe generate reads an image as one square"):
        _images([(str(d / "0.png"), "w40", "--image")], model.cfg)
    shutil.rmtree(tmp_path / "out")
    assert main(["export", "--checkpoint", str(d / "run"), "--out", str(tmp_path / "hf")]) == 0
    v = hf_gemma3_config(tmp_path / "hf")[1].vision
    assert (v.pan_and_scan, v.pan_and_scan_min_crop, v.pan_and_scan_max_crops, v.pan_and_scan_min_ratio) == \
        (True, CROP, MAX_CROPS, RATIO)
