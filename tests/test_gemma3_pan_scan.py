"""Gemma 3's pan-and-scan (issue 55; mmpipe.data.gemma3.Gemma3PanScan): test_gemma3's tiny transformers Gemma 3 (32 px
images, 4 soft tokens) saved with an image processor that cuts crops (do_pan_and_scan, min crop 8 px, at most 4,
from a 1.2 aspect ratio) and a tokenizer that knows the words Gemma3Processor writes around them. `mmpipe import
--hf` takes the setting from the processor config; two LLaVA records, a 96 x 32 image (3 crops: 4 image slots, 24
block positions and 15 connecting words) and a 32 x 32 one (no crop), are indexed, packed into one row and batched
as the pipeline's stage tuple: each sample's token ids and pixels are transformers' Gemma3Processor's, its logits
transformers' (1e-4), and the index counted the crops' slots and words before any pixel was read. `mmpipe generate`
(both images in one batch) and `mmpipe eval` read every crop: transformers' greedy answers and loss. With a
byte-pair tokenizer that reads newlines with their neighbours, rows and prompts hold Gemma3Processor's ids, its
blank lines around each block included. In-process."""
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
    kept; --augment and generating on an image that cannot be read are one line each; `mmpipe export` writes the
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
    from mmpipe.data.tokenizer import load_tokenizer
    from mmpipe.inference.generate import _inputs
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match=r"^--image: corrupt_image: .*bad.png: cannot read the image header"):
        _inputs([(str(tmp_path / "bad.png"), "w40", "--image")], model.cfg, load_tokenizer(str(d / "hf")))
    shutil.rmtree(tmp_path / "out")
    assert main(["export", "--checkpoint", str(d / "run"), "--out", str(tmp_path / "hf")]) == 0
    v = hf_gemma3_config(tmp_path / "hf")[1].vision
    assert (v.pan_and_scan, v.pan_and_scan_min_crop, v.pan_and_scan_max_crops, v.pan_and_scan_min_ratio) == \
        (True, CROP, MAX_CROPS, RATIO)


def _hf_inputs(proc, tok, image, question: str, answer: str | None = None):
    """Gemma3Processor's inputs for one conversation (its user turn the image, then the question), pan-and-scan on."""
    turns = [{"role": "user", "content": f"<start_of_image>\n{question}"}]
    turns += [{"role": "assistant", "content": answer}] if answer is not None else []
    return proc(images=[[image]], text=[tok.apply_chat_template(turns, tokenize=False)], return_tensors="pt", **CALL)


def _hf_processor(d):
    from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor
    tok = AutoTokenizer.from_pretrained(d / "hf")
    return Gemma3Processor(image_processor=Gemma3ImageProcessor.from_pretrained(d / "hf"), tokenizer=tok,
                           image_seq_length=SOFT), tok


def test_generate_reads_every_crop_as_transformers(pan_scan, tmp_path, capsys):
    """`mmpipe generate` on the pan-and-scan checkpoint with the wide image (4 slots: its prompt holds the processor's
    words and 4 blocks) and the square one (1 slot, 35 words so both prompts are 44 positions: one batch, the
    square's row padded with 3 unused slots): each answer is transformers' greedy generate on Gemma3Processor's
    inputs for that image alone, with the KV cache and without it (--no-cache)."""
    hf, d, _, images = pan_scan
    questions = ["w40 w41", " ".join(f"w{40 + i % 20}" for i in range(35))]
    argv = ["generate", "--checkpoint", str(d / "hf"), "--max-new-tokens", "10"]
    for i, q in enumerate(questions):
        argv += ["--image", str(d / f"{i}.png"), "--prompt", f"<image>\n{q}"]
    proc, tok = _hf_processor(d)
    want = []
    for image, q in zip(images, questions):
        inputs = _hf_inputs(proc, tok, image, q)
        assert inputs["input_ids"].shape[1] == 44 and len(inputs["pixel_values"]) == (4 if image.width > 32 else 1)
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=10, do_sample=False)
        want.append(tok.decode(out[0, 44:], skip_special_tokens=True).strip())
    assert len(set(want)) == 2 and min(len(a.split()) for a in want) > 3, want
    for extra in ([], ["--no-cache"]):
        capsys.readouterr()
        assert main(argv + extra) == 0
        assert [json.loads(line)["answer"] for line in capsys.readouterr().out.splitlines()] == want, extra


def test_eval_reads_every_crop_as_transformers(pan_scan, tmp_path):
    """`mmpipe eval` on the wide and the square record: neither is a bad record (the wide one's 4 slots are one
    image), each answer is transformers' greedy one, and the teacher-forced loss over the 5 answer tokens (w50 EOS;
    w51 w52 EOS) is transformers' cross-entropy on Gemma3Processor's inputs (all 4 slots of the wide image)."""
    hf, d, _, images = pan_scan
    out = tmp_path / "answers.jsonl"
    assert main(["eval", "--checkpoint", str(d / "hf"), "--data", _records(d, tmp_path), "--text-len", "40",
                 "--max-new-tokens", "6", "--out", str(out)]) == 0
    summary = json.loads(out.with_name("answers.summary.json").read_text())
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    proc, tok = _hf_processor(d)
    loss, answers = 0.0, []
    for image, (q, a, n) in zip(images, [("w40 w41", "w50", 2), ("w42", "w51 w52", 3)]):
        inputs = _hf_inputs(proc, tok, image, q, a)
        ids = inputs["input_ids"]
        with torch.no_grad():
            logits = hf(**inputs).logits[0, -n - 1:-1]
            loss += torch.nn.functional.cross_entropy(logits, ids[0, -n:], reduction="sum").item()
            prompt = {k: v[:, :-n] if k != "pixel_values" else v for k, v in inputs.items()}
            new = hf.generate(**prompt, max_new_tokens=6, do_sample=False)[0, ids.shape[1] - n:]
        answers.append(tok.decode(new, skip_special_tokens=True).strip())
    assert (summary["n"], summary["bad_records"], summary["answer_tokens"]) == (2, 0, 5), summary
    assert [line["answer"] for line in lines] == answers
    assert abs(summary["val_loss"] - loss / 5) < 1e-5, (summary["val_loss"], loss / 5)


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
                  "'user' }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # Gemma 3's, text only


def _bpe_tokenizer(path):
    """A byte-pair tokenizer in Gemma's manner (spaces as '▁', no splitting before the merges: a run of newlines
    merges with its neighbours, e.g. '\\n\\n\\nwhat▁' is one token), trained here on 80 lines, its special tokens at
    ids 0..8 (<image_soft_token>, <start_of_image>, <end_of_image>: 4, 5, 6), Gemma 3's chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    special = ["<pad>", "<bos>", "<eos>", "<unk>", "<image_soft_token>", "<start_of_image>", "<end_of_image>",
               "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer, tok.decoder = normalizers.Replace(" ", "▁"), decoders.Replace("▁", " ")
    lines = ["user\n\n\nwhat is here\n\n\nmodel\na red cat\n\n", "what colour is the cat\n\n\n\n",
             "Here is the original image \n\n and here are some crops to help you see better \n\n \n\n",
             "look at this \n\n and that\n\n\n"] * 20
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=120, special_tokens=special, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=special[4:],
                                   extra_special_tokens={"image_token": special[4], "boi_token": special[5],
                                                         "eoi_token": special[6]})
    fast.chat_template = GEMMA_TEMPLATE
    fast.save_pretrained(path)
    return fast


@pytest.mark.parametrize("pan_and_scan", [True, False])
def test_blank_lines_around_each_block_give_gemma3_processor_ids(pan_scan, tmp_path, pan_and_scan):
    """With a tokenizer that reads newlines with their neighbours, the data path's rows (an image at the start of
    the question, one inside it) and generate's prompts hold Gemma3Processor's ids exactly, its "\\n\\n" on either side
    of each block included, with pan-and-scan (the wide image's 4 blocks among the processor's words) and without."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import sample_rowset
    from mmpipe.inference.generate import _inputs
    _, d, model, images = pan_scan
    tok = _bpe_tokenizer(tmp_path / "tok")
    cfg = dataclasses.replace(model.cfg, image_token_id=4, vision_start_id=5, vision_end_id=6,
                              vision=dataclasses.replace(model.cfg.vision, pan_and_scan=pan_and_scan))
    turns = [("<image>\nwhat colour is the cat", "a red cat"), ("look at this <image> and that", "a cat")]
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"image": str(d / f"{i}.png"), "conversations": [{"from": "human", "value": q},
                                                                    {"from": "gpt", "value": a}]}) + "\n"
        for i, (q, a) in enumerate(turns)))
    opts = resolve_data(DataArgs(data=str(tmp_path / "data.jsonl"), tokenizer=str(tmp_path / "tok"), text_len=60,
                                 data_workers=0, max_images=5), cfg)
    rows = sample_rowset(prepare(opts, cfg, tmp_path / "out", seed=0, verbose=False), cfg, 60, slots=5,
                         need_images=False)
    prompts = _inputs([(str(d / f"{i}.png"), q, "--image") for i, (q, _) in enumerate(turns)], cfg, tok)[3]
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok,
                           image_seq_length=SOFT)
    call = CALL if pan_and_scan else {}
    for p, (image, (q, a)) in enumerate(zip(images, turns)):
        user = [{"role": "user", "content": q.replace("<image>", "<start_of_image>")}]
        want = proc(images=[[image]], text=[tok.apply_chat_template(user + [{"role": "assistant", "content": a}],
                                                                    tokenize=False)], **call)["input_ids"][0]
        row = rows[p]
        assert row["input_ids"][row["segments"] > 0].tolist() == want, (p, tok.convert_ids_to_tokens(want))
        want = proc(images=[[image]], text=[tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)],
                    **call)["input_ids"][0]
        assert prompts[p] == want, p
        assert want.count(5) == (4 if pan_and_scan and p == 0 else 1)
        assert sum("\n\n" in t for t in tok.convert_ids_to_tokens(want)) >= 2 * want.count(5)  # the blank lines
