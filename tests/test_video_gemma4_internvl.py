"""Clips for Gemma 4 and InternVL (issue 55 deliver 5): frames as images (mmpipe.data.video). Their processors take a
clip as a run of frames, each an image with text before it: Gemma4Processor `mm:ss <start_of_image><|video|> x n
<end_of_image>` per frame (joined by spaces, n at Gemma4VideoProcessor's max_soft_tokens), InternVLProcessor
`Frame{i}: <img><IMG_CONTEXT> x 256</img>` per frame (one crop of the tile size, joined by newlines). The tiny random
transformers models of test_gemma4_aspect and test_internvl, a 7-frame clip at 3 fps (4 frames sampled at 2 fps), LLaVA
records indexed and packed by the data path: a clip, an image, and an image beside a clip in one row give each
sample's transformers logits alone (1e-4), its ids those of the family's own processor (Gemma4Processor /
InternVLProcessor on the chat-templated text, the decoded file and the image; Gemma 4's `<|video|>` read as its image
token), and its frames those of the processor's own sampling (do_sample_frames, num_frames 4, on every decoded frame).
A clip over the row's slots (--max-images) or crops (--max-tiles) is a bad record with its one line; Gemma 4 at a
fixed square and Gemma 3 refuse clips (unsupported_media). In-process, no launch."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmpipe.data.video import decode, probe
from video_clips import moving_square, write_clip

TOL = 1e-4
CLIP = (7, 70, 50, 3)  # frames, width, height, fps: int(7 / 3 x 2) = 4 frames sampled at 2 fps


def _conv(user: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]


RECORDS = [{"video": "clip.mp4", "conversations": _conv("<video>\nw41 w42", "w43")},
           {"image": "a.png", "conversations": _conv("<image> w44", "w45 w46")},
           {"image": "a.png", "video": "clip.mp4", "conversations": _conv("<image> w47 <video> w48", "w49")}]


def _media(d):
    """(every decoded frame of the clip, its VideoMetadata, the image)."""
    from PIL import Image
    from transformers.video_utils import VideoMetadata
    info = probe(d / "clip.mp4")
    meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height)
    return decode(d / "clip.mp4", range(info.frames)), meta, Image.open(d / "a.png").convert("RGB")


def _write_set(d, extra: list[dict]) -> None:
    from PIL import Image
    frames, width, height, fps = CLIP
    write_clip(d / "clip.mp4", moving_square(frames, width, height, seed=3), fps)
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (30, 60, 3), dtype=np.uint8)).save(d / "a.png")
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS + extra))


def _packed_row(d, cfg, out, **flags):
    """The data path: the set indexed and packed, the first row as the stage tuple, and the index's stats."""
    from mmpipe.data.args import DataArgs
    from mmpipe.data.batches import StepBatches, rank_batches
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    args = DataArgs(data=str(d / "data.jsonl"), tokenizer=str(d / "hf"), image_root=str(d), text_len=40,
                    data_workers=0, pack=True, **flags)
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, out, seed=0, verbose=False)
    shape = row_shape(cfg, 10, 3 * opts.text_len, opts.vision_budget)
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=True))
    inputs, _ = next(rank_batches(rows, StepBatches(0, 1, 1, 0, 1)))
    return inputs, samples.index.stats


def _check_row(model, inputs, want_of, image_id: int) -> list[float]:
    """Each of the row's 3 samples (segments): its ids equal the processor's and its logits transformers' alone; the
    pixels reach the logits (the row's patches or crops reversed give others)."""
    ids, segments = inputs[1][0], inputs[3][0]
    errs = []
    with torch.no_grad():
        got = model(*inputs)[0]
        assert int(segments.max()) == 3  # all three samples in the one row
        for seg in (1, 2, 3):
            mine = ids[segments == seg]
            theirs, logits = want_of(mine, image_id)
            assert torch.equal(mine, theirs), seg
            errs.append((got[segments == seg] - logits).abs().max().item())
    assert max(errs) < TOL, errs
    flipped = list(inputs)
    flipped[0] = inputs[0].flip(1)  # the row's patches (crops) in reverse: the frames reach the logits
    with torch.no_grad():
        assert (model(*flipped) - got[None]).abs().max().item() > 1e-3
    return errs


def _record(mine: torch.Tensor) -> dict:
    """The record a sample of the row is, by its answer's first word (w43, w45, w49: ids 43, 45, 49; the tokenizers'
    special w1 and w2 would split w1x and w2x words)."""
    return next(r for r in RECORDS if int(r["conversations"][1]["value"].split()[0][1:]) in mine.tolist())


def _planner_clip_is_the_rows(cfg, d, inputs, budget: int):
    """The planner's clip (mmpipe.planning.images.frame_clip, the test clip's header: 7 frames at 3 fps, 70 x 50) is
    the data path's, token for token: each frame's text (its processor's, tokenised) then its block (the row's
    blocks at the planner's grid) make a run of the clip sample's ids, its length the planner's count, clip.positions
    image positions + the frame text's tokens. Returns the clip."""
    from transformers import AutoTokenizer

    from mmpipe.data.image_kinds import image_kind
    from mmpipe.planning.images import frame_clip
    frames, width, height, fps = CLIP
    clip, _, _ = frame_clip(cfg, frames, (width, height), 0, budget, fps=fps)
    tok = AutoTokenizer.from_pretrained(d / "hf")
    blocks = image_kind(cfg).blocks(cfg, clip.sampled, budget)
    want = []
    for text, grid in zip(clip.texts, clip.grids, strict=True):
        want += tok(text, add_special_tokens=False)["input_ids"] + blocks.block(grid).tolist()
    assert len(want) == clip.positions + clip.text_tokens(tok)
    ids, segments = inputs[1][0], inputs[3][0]
    mine = next(ids[segments == s].tolist() for s in (1, 2, 3) if _record(ids[segments == s]) is RECORDS[0])
    assert any(mine[i:i + len(want)] == want for i in range(len(mine) - len(want) + 1)), (want, mine)
    return clip


# ---- Gemma 4 -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    from transformers import Gemma4ImageProcessor

    from mmpipe.hf.gemma4 import import_gemma4
    from test_gemma3 import _tokenizer
    from test_gemma4_aspect import BUDGET, _hf_aspect_model
    d = tmp_path_factory.mktemp("gemma4_video")
    hf = _hf_aspect_model()
    hf.config.text_config.max_position_embeddings = 1024  # a sample of 5 slots at P = 6300: 10 + 700 image positions
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    Gemma4ImageProcessor(patch_size=4, max_soft_tokens=BUDGET, pooling_kernel_size=3).save_pretrained(d / "hf")
    model, _ = import_gemma4(d / "hf")
    _write_set(d, [{"image": ["a.png", "a.png"], "video": "clip.mp4",
                    "conversations": _conv("<image> <image> w50 <video>", "w51")}])  # 6 slots > --max-images 5
    return hf, model.eval(), d


def _gemma4_processor(d):
    """transformers' Gemma4Processor over the test's tokenizer (audio brackets named: its input check asks for them),
    the image processor at the model's budget and the video processor at its default 70, sampling 4 frames."""
    from transformers import AutoTokenizer, Gemma4ImageProcessor, Gemma4Processor, Gemma4VideoProcessor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    tok = AutoTokenizer.from_pretrained(d / "hf")
    tok.boa_token, tok.eoa_token = "w20", "w21"
    sizes = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), tokenizer=tok,
                           image_processor=Gemma4ImageProcessor(**sizes),
                           video_processor=Gemma4VideoProcessor(**sizes, num_frames=4))


def test_gemma4_clip_records_pack_with_images_and_give_transformers_ids_and_logits(gemma4, tmp_path):
    """The data path at --max-images 5, --max-patches 6300 (the row's 10 slots of 630): the clip (4 frames of
    21 x 27 patches, 63 soft tokens each), the image and the image beside the clip in one row; each sample's ids are
    Gemma4Processor's (timestamps 00:00 00:00 00:01 00:01 before the frames' blocks) and its logits transformers'
    alone; the record of 6 slots is too_many_images, counted with its line."""
    hf, model, d = gemma4
    inputs, stats = _packed_row(d, model.cfg, tmp_path / "out", max_images=5, max_patches=6300)
    assert (stats["good"], stats["bad_by_kind"]) == (3, {"too_many_images": 1})
    assert stats["first_bad"][0]["reason"] == ("6 image slots (a clip takes one per temporal patch (Qwen3-VL) or frame "
                                               "(Gemma 4, InternVL)) > --max-images 5")
    proc = _gemma4_processor(d)
    hf.config.video_token_id = proc.video_token_id  # past the tiny vocabulary: the model embeds it as padding
    frames, meta, image = _media(d)
    from test_gemma4 import IMG

    def want_of(mine, image_id):
        rec = _record(mine)
        user = rec["conversations"][0]["value"].replace("<video>", proc.video_token).replace("<image>",
                                                                                            proc.image_token)
        text = proc.tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                   {"role": "assistant", "content": rec["conversations"][1]["value"]}],
                                                  tokenize=False)
        kw = dict(images=[[image]]) if "image" in rec else {}
        if "video" in rec:
            kw.update(videos=[frames], video_metadata=[meta])
        out = proc(text=[text], return_tensors="pt", **kw)
        theirs = out["input_ids"][0]
        keys = ("input_ids", "mm_token_type_ids", "pixel_values", "image_position_ids", "pixel_values_videos",
                "video_position_ids", "num_frames_per_video")
        logits = hf(**{k: v for k, v in out.items() if k in keys}).logits[0]
        return torch.where(theirs == proc.video_token_id, IMG, theirs), logits

    errs = _check_row(model, inputs, want_of, IMG)
    print(f"gemma4 clip samples vs transformers: {['%.1e' % e for e in errs]}")
    clip = _planner_clip_is_the_rows(model.cfg, d, inputs, 6300)
    assert (clip.sampled, clip.positions, clip.text_tokens(proc.tokenizer)) == (4, 4 * (63 + 2), 4)
    _plan_prints_the_clip(model.cfg, tmp_path, clip, "4 image slots x 72")


def _plan_prints_the_clip(cfg, folder, clip, row_words: str) -> None:
    """`mmpipe plan --preset MODEL.json --video-frames 4 --video-size 70x50` (the clip's 4 frames at the sampling
    rate: the same frames' grids) prints the clip's frames and image positions, and a row of its frame slots."""
    import contextlib
    import io

    from mmpipe.cli import main
    (folder / "clip_model.json").write_text(json.dumps(cfg.to_dict()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--preset", str(folder / "clip_model.json"), "--video-frames", "4", "--video-size", "70x50",
                   "--text-len", "40", "--gpus-per-node", "2", "--global-batch", "4", "--top", "1"])
    text = out.getvalue()
    assert rc == 0, text
    assert "4 frames sampled, each an image slot" in text and f": {clip.positions} image positions" in text, text
    assert row_words in text, text


def test_gemma4_fixed_square_and_gemma3_refuse_clips(tmp_path):
    """gemma4-tiny (a fixed square: vision.max_soft_tokens 0) and gemma3-tiny count a clip's record as
    unsupported_media with its reason; the image record is kept."""
    from mmpipe.config import load_preset
    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    _write_set(tmp_path, [])
    for preset, reason in (("gemma4-tiny", "a video for the gemma4 family at a fixed square"),
                           ("gemma3-tiny", "the gemma3 family reads image only")):
        cfg = load_preset(preset)
        args = DataArgs(data=str(tmp_path / "data.jsonl"), image_root=str(tmp_path), text_len=40, data_workers=0,
                        max_images=5)
        stats = prepare(resolve_data(args, cfg), cfg, tmp_path / preset, seed=0, verbose=False).index.stats
        assert (stats["good"], stats["bad_by_kind"]) == (1, {"unsupported_media": 2}), preset
        assert reason in stats["first_bad"][0]["reason"], stats["first_bad"][0]


# ---- InternVL ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    from mmpipe.hf.internvl import import_internvl
    from test_internvl import save_model
    d = tmp_path_factory.mktemp("internvl_video")
    hf = save_model(d / "hf")
    _intern_tokenizer(d / "hf")
    model, _ = import_internvl(d / "hf")
    _write_set(d, [{"image": ["big.png", "big.png", "a.png"], "video": "clip.mp4",  # 5 + 5 + 3 + 4 crops > 14
                    "conversations": _conv("<image> <image> <image> w50 <video>", "w51")}])
    from test_internvl import image
    image(70, 66, 9).save(d / "big.png")
    return hf, model.eval(), d


def _intern_tokenizer(path):
    """test_internvl's word-level tokenizer and template, with InternVL's <img>, </img>, <IMG_CONTEXT> at the model's
    ids and a <video> marker, named as InternVLProcessor reads them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from test_internvl import CTX, END, START, TEMPLATE, VOCAB
    special = {START: "<img>", END: "</img>", CTX: "<IMG_CONTEXT>", VOCAB - 9: "<video>"}
    tok = Tokenizer(models.WordLevel({special.get(i, f"w{i}"): i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0", unk_token="w3",
        additional_special_tokens=list(special.values()),
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


def _intern_processor(d):
    """transformers' InternVLProcessor: test_internvl's image processor, 4 placeholders a crop, and
    InternVLVideoProcessor at the tile size, mean and std, sampling 4 frames itself."""
    from transformers import AutoTokenizer, InternVLProcessor, InternVLVideoProcessor

    from test_internvl import TILE, processor
    img = processor()
    video = InternVLVideoProcessor(size={"height": TILE, "width": TILE}, image_mean=img.image_mean,
                                   image_std=img.image_std, do_sample_frames=True, num_frames=4)
    return InternVLProcessor(image_processor=img, tokenizer=AutoTokenizer.from_pretrained(d / "hf"),
                             image_seq_length=4, video_processor=video)


def test_internvl_clip_records_pack_with_images_and_give_transformers_ids_and_logits(internvl, tmp_path):
    """The data path at --max-tiles 14: the clip (4 frames, a crop each), the 2-tile image (3 crops) and both in one
    row (14 crops); each sample's ids are InternVLProcessor's (`Frame1: ` ... lines) and its logits transformers'
    alone (its pixel_values: the image's crops and InternVLVideoProcessor's frames in text order); the record whose
    three images (5 + 5 + 3 crops) and clip make 17 crops is too_many_tiles, counted with its line."""
    from test_internvl import CTX
    hf, model, d = internvl
    inputs, stats = _packed_row(d, model.cfg, tmp_path / "out", max_images=8, max_tiles=14)
    assert (stats["good"], stats["bad_by_kind"]) == (3, {"too_many_tiles": 1})
    assert stats["first_bad"][0]["reason"] == ("3 images and 4 clip frames make 17 crops (a frame one crop) > the "
                                               "row's 14 (--max-tiles)")
    proc = _intern_processor(d)
    frames, meta, image = _media(d)

    def want_of(mine, image_id):
        rec = _record(mine)
        user = rec["conversations"][0]["value"].replace("<image>", proc.image_token)
        text = proc.tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                   {"role": "assistant", "content": rec["conversations"][1]["value"]}],
                                                  tokenize=False)
        kw = dict(images=[image]) if "image" in rec else {}
        if "video" in rec:
            kw.update(videos=[frames], video_metadata=[meta])
        out = proc(text=[text], return_tensors="pt", **kw)
        return out["input_ids"][0], hf(input_ids=out["input_ids"], pixel_values=out["pixel_values"]).logits[0]

    errs = _check_row(model, inputs, want_of, CTX)
    print(f"internvl clip samples vs transformers: {['%.1e' % e for e in errs]}")
    clip = _planner_clip_is_the_rows(model.cfg, d, inputs, 14)
    assert (clip.sampled, clip.positions, clip.text_tokens(proc.tokenizer)) == (4, 4 * (4 + 2), 4)
    _plan_prints_the_clip(model.cfg, tmp_path, clip, "vision crops per row: 4 of --max-tiles")


@pytest.mark.parametrize("family", ["gemma4", "internvl"])
def test_generate_command_answers_on_a_clip_as_transformers(family, request, capsys):
    """`mmpipe generate --video` on each tiny transformers directory: the clip's 4 frames, each an image slot after
    its processor's text, at the start of the user turn, give transformers' greedy answer (its processor on the
    decoded file, `generate`, 5 new tokens)."""
    from mmpipe.cli import main
    hf, _, d = request.getfixturevalue(family)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(d / "hf"), "--video", str(d / "clip.mp4"), "--prompt", "w41 w42",
                 "--max-new-tokens", "5"]) == 0
    got = capsys.readouterr().out.strip()
    frames, meta, _ = _media(d)
    if family == "gemma4":
        proc = _gemma4_processor(d)
        hf.config.video_token_id = proc.video_token_id
        keys = ("input_ids", "mm_token_type_ids", "pixel_values_videos", "video_position_ids", "num_frames_per_video")
    else:
        proc, keys = _intern_processor(d), ("input_ids", "pixel_values")
    text = proc.tokenizer.apply_chat_template([{"role": "user", "content": f"{proc.video_token}\nw41 w42"}],
                                              tokenize=False, add_generation_prompt=True)
    out = proc(text=[text], videos=[frames], video_metadata=[meta], return_tensors="pt")
    with torch.no_grad():
        want = hf.generate(**{k: v for k, v in out.items() if k in keys}, max_new_tokens=5, do_sample=False)
    assert got == proc.tokenizer.decode(want[0, out["input_ids"].shape[1]:]), got


# ---- The checkpoints' video processor settings, and the refusals ---------------------------------------------------

def _with_video_config(src, dst, proc):
    """dst: src's files linked, with proc (a video processor) saved beside them."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    proc.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("family", ["gemma4", "internvl"])
def test_import_reads_the_video_processor_config_and_export_writes_it_back(family, request, tmp_path):
    """`mmpipe import --hf` reads the directory's video_preprocessor_config.json into vision.video_* (fps ->
    video_fps, num_frames -> video_max_frames (video_min_frames lowered to it), Gemma 4's max_soft_tokens ->
    video_soft_tokens), and an export writes them back: transformers' AutoVideoProcessor loads the exported directory
    with the same settings and a re-import reads the same fields. A value the processor cannot take is one line."""
    from transformers import AutoVideoProcessor, Gemma4VideoProcessor, InternVLVideoProcessor

    from mmpipe.config import ConfigError
    _, model, d = request.getfixturevalue(family)
    if family == "gemma4":
        from mmpipe.hf.gemma4 import export_hf
        from mmpipe.hf.gemma4 import hf_gemma4_config as read
        from mmpipe.hf.gemma4 import import_gemma4 as load
        proc = Gemma4VideoProcessor(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70, num_frames=3, fps=1.5)
        want = dict(video_soft_tokens=70, video_fps=1.5, video_min_frames=3, video_max_frames=3)
    else:
        from mmpipe.hf.internvl import export_hf
        from mmpipe.hf.internvl import hf_internvl_config as read
        from mmpipe.hf.internvl import import_internvl as load
        proc = InternVLVideoProcessor(size={"height": 28, "width": 28}, num_frames=6, fps=1.0)
        want = dict(video_fps=1.0, video_min_frames=4, video_max_frames=6)
    assert {k: getattr(model.cfg.vision, k) for k in want} != want  # the defaults before
    src = _with_video_config(d / "hf", tmp_path / "in", proc)
    notes = []
    cfg = read(src, notes)[1]
    assert {k: getattr(cfg.vision, k) for k in want} == want
    assert any("video_preprocessor_config.json" in n for n in notes), notes
    out = export_hf(load(src)[0], tmp_path / "out")
    back = AutoVideoProcessor.from_pretrained(out)
    assert type(back) is type(proc) and (back.fps, back.num_frames) == (proc.fps, proc.num_frames)
    assert getattr(back, "max_soft_tokens", None) == getattr(proc, "max_soft_tokens", None)
    assert {k: getattr(read(out)[1].vision, k) for k in want} == want
    bad = json.loads((out / "video_preprocessor_config.json").read_text())
    (out / "video_preprocessor_config.json").write_text(json.dumps({**bad, "fps": -2}))
    with pytest.raises(ConfigError, match=r"video_preprocessor_config.json: fps -2 is not a positive number"):
        read(out)
    if family == "gemma4":  # the tiny tower's 256-entry table holds 70 x 3 patches a side, not 140 x 3
        (out / "video_preprocessor_config.json").write_text(json.dumps({**bad, "max_soft_tokens": 140}))
        with pytest.raises(ConfigError, match=r"max_soft_tokens 140 makes frame sides of up to 420 patches, past "
                                              r"the 256-entry position table"):
            read(out)


def test_refusals_give_each_family_its_own_reason():
    """--video-max-pixels: Gemma 4's frames are sized by vision.video_soft_tokens (and what to set instead), InternVL's
    and OneVision's are the tower's crop; `mmpipe plan --video-frames` on Gemma 4 at a fixed square names why."""
    from mmpipe.config import ConfigError, load_preset
    from mmpipe.data.args import DataArgs
    from mmpipe.planning.images import clip_refusal
    for preset, reason in (("gemma4-tiny", "--video-max-pixels: the gemma4 family's clip frames are sized by "
                                           "vision.video_soft_tokens (70 soft tokens a frame"),
                           ("internvl-tiny", "--video-max-pixels: the internvl family's clip frames are its tower's "
                                             "crop")):
        with pytest.raises(ConfigError) as e:
            DataArgs(video_max_pixels=100000).with_video(load_preset(preset))
        assert str(e.value).startswith(reason), str(e.value)
    assert "--video-frames: the gemma4 family at a fixed square (vision.max_soft_tokens 0) reads no clips" in \
        clip_refusal(load_preset("gemma4-tiny"))
    assert clip_refusal(load_preset("internvl-tiny")) is None


# ---- InternVL: a 32-frame clip in a row sized by its crops ---------------------------------------------------------

LONG = (48, 20, 16, 3)  # frames, width, height, fps: int(48 / 3 x 2) = 32 frames sampled (vision.video_max_frames)


def test_internvl_32_frame_clip_fits_a_row_sized_by_its_crops(internvl, tmp_path):
    """A clip of 32 sampled frames (the default most) at --text-len 1024, --max-images 33, no --max-tiles, in a context
    that holds the frames (a crop each: 32 x (4 + 2) = 192 positions) but not 33 slots at their 5-crop cap (33 x 22 +
    1024 = 1750 > 1234; InternVL3.5's 40,960 at 256 a crop alike: 32 x 3330 + 1024 > 40,960): T's default is the crops
    the context holds, (1234 - 1024 - 66) // 4 = 36, the row 36 x 4 + 66 + 1024 = 1234 positions (before: --text-len
    refused). The clip record is admitted and packed beside an image record; each sample's ids are InternVLProcessor's
    and the row's crops its pixel_values (the 32 frames InternVLVideoProcessor samples itself, then the image's); the
    record of a 5-crop image beside the clip (37 crops > 36) is too_many_tiles with its line. The planner (mmpipe plan
    --video-frames 32 --image-size 30x26 on the model JSON) prints the clip's 192 positions and the row's 1234."""
    import dataclasses

    from mmpipe.data.args import DataArgs
    from mmpipe.data.batches import StepBatches, rank_batches
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    from mmpipe.data.video import decode, probe
    hf, model, d = internvl
    cfg = dataclasses.replace(model.cfg, text=dataclasses.replace(model.cfg.text, max_context=1234))
    frames, width, height, fps = LONG
    write_clip(tmp_path / "long.mp4", moving_square(frames, width, height, seed=4), fps)
    for name in ("hf", "a.png", "big.png"):
        (tmp_path / name).symlink_to(d / name)
    recs = [{"video": "long.mp4", "conversations": _conv("<video>\nw41", "w43")},
            {"image": "a.png", "conversations": _conv("<image> w44", "w45")},
            {"image": "big.png", "video": "long.mp4", "conversations": _conv("<image> <video> w47", "w49")}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = DataArgs(data=str(tmp_path / "data.jsonl"), tokenizer=str(tmp_path / "hf"), image_root=str(tmp_path),
                    text_len=1024, max_images=33, data_workers=0, pack=True)
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, tmp_path / "out", seed=0, verbose=False)
    stats = samples.index.stats
    assert (opts.vision_budget, stats["good"], stats["bad_by_kind"]) == (36, 2, {"too_many_tiles": 1})
    assert stats["first_bad"][0]["reason"] == ("1 images and 32 clip frames make 37 crops (a frame one crop) > the "
                                               "row's 36 (--max-tiles)")
    shape = row_shape(cfg, 33, 1024, opts.vision_budget)
    assert shape.length == 1234
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=True))
    inputs, _ = next(rank_batches(rows, StepBatches(0, 1, 1, 0, 1)))
    ids, segments = inputs[1][0], inputs[3][0]
    assert int(segments.max()) == 2 and len(ids) == 1234  # both samples in the one row
    proc = _intern_processor(tmp_path)
    proc.video_processor.num_frames = 32
    info = probe(tmp_path / "long.mp4")
    from PIL import Image
    from transformers.video_utils import VideoMetadata
    meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height)
    clip = decode(tmp_path / "long.mp4", range(info.frames))
    pixels = []
    for seg in (1, 2):
        mine = ids[segments == seg]
        rec = next(r for r in recs if int(r["conversations"][1]["value"][1:]) in mine.tolist())
        user = rec["conversations"][0]["value"].replace("<image>", proc.image_token)
        text = proc.tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                   {"role": "assistant", "content": rec["conversations"][1]["value"]}],
                                                  tokenize=False)
        kw = (dict(videos=[clip], video_metadata=[meta]) if "video" in rec else
              dict(images=[Image.open(tmp_path / "a.png").convert("RGB")]))
        out = proc(text=[text], return_tensors="pt", **kw)
        assert torch.equal(mine, out["input_ids"][0]), seg
        pixels.append(out["pixel_values"])
    want = torch.cat(pixels)
    assert len(want) == 32 + 3  # the 32 frames and the 1 x 2-tile image's 3 crops, of the row's 36
    assert (inputs[0][0][:len(want)] - want).abs().max().item() < 1e-6
    ix = samples.index
    clip_grids = ix.grids_of(next(n for n in range(len(ix)) if ix.n_images[n] == 32))
    _planner_row_is_the_index(cfg, tmp_path, clip_grids)


def _planner_row_is_the_index(cfg, folder, clip_grids) -> None:
    """The planner's clip (frame_clip: 48 frames of 20 x 16 at 3 fps) has the index's frame grids and positions, and
    `mmpipe plan` on the model JSON (the clip at the sampling rate and a 1-crop image, --text-len 1024: 33 slots, T 36
    by the same rule) prints the clip's positions and the data's row of 1234."""
    import contextlib
    import io

    from mmpipe.cli import main
    from mmpipe.planning.images import frame_clip
    frames, width, height, fps = LONG
    clip, _, _ = frame_clip(cfg, frames, (width, height), 0, 36, fps=fps)
    assert [list(g) for g in clip.grids] == [[int(x) for x in g] for g in clip_grids]
    assert clip.positions == sum(int(g[4]) for g in clip_grids) == 32 * (4 + 2)
    (folder / "clip_model.json").write_text(json.dumps(cfg.to_dict()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--preset", str(folder / "clip_model.json"), "--video-frames", "32", "--video-size",
                   f"{width}x{height}", "--image-size", "30x26", "--text-len", "1024", "--gpus-per-node", "2",
                   "--global-batch", "4", "--top", "1"])
    text = out.getvalue()
    assert rc == 0, text
    assert "32 frames sampled, each an image slot" in text and ": 192 image positions" in text, text
    assert "vision crops per row: 33 of --max-tiles 36" in text and "+ 1024 text = 1234" in text, text
