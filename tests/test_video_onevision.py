"""LLaVA-OneVision clips (issue 44): frames sampled by transformers' LlavaOnevisionVideoProcessor, each encoded by
the tower as a crop and its g x g features bilinear-pooled to ceil(g / 2)^2, one newline after the clip
(LlavaOnevisionModel.get_video_features). The tiny random OneVision of tests/llava_next_models.py (transformers'
class, imported through mmpipe.hf.llava_next): logits equal transformers' (1e-4) for a clip alone and a clip with an
image in one conversation, from mmpipe's own frames (equal to the processor's pixel_values_videos); the data path
indexes `<video>` records from the clip's header (a slot of F crops, the processor's count) and builds the same rows;
a clip over its share of the row's crops is sampled to fewer frames, one that cannot fit is a bad record; LLaVA-NeXT
(anyres_max 0) and the image-only families refuse clips with their reason."""
from __future__ import annotations

import json

import pytest
import torch

from llava_next_models import IMAGE, encode, feature_counts, image, processor, sample, save_model, tilings
from mmpipe.config import load_preset
from mmpipe.data.anyres import tile_rule
from mmpipe.data.image_kinds import TILES
from mmpipe.data.records import BadRecord, VideoRef
from mmpipe.data.video import decode, onevision_sample, probe
from mmpipe.hf.llava_next import import_llava_next
from mmpipe.model.llava_next import clip_tiling, image_feature_count
from video_clips import moving_square, write_clip

TOL = 1e-4
VIDEO = 191  # the HF model's video_token_id (its default, 151647, is past the tiny vocabulary)


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    d = tmp_path_factory.mktemp("onevision")
    hf = save_model("onevision", d / "hf")
    hf.config.video_token_id = VIDEO
    model, _ = import_llava_next(d / "hf")
    write_clip(d / "clip.mp4", moving_square(7, 70, 50, seed=3), 3)  # 7 frames at 3 fps: 4 sampled at 2 fps
    image(150, 90, seed=5).save(d / "a.png")
    return hf, model.eval(), d


def _hf_frames(path, n: int) -> torch.Tensor:
    """transformers' own: LlavaOnevisionVideoProcessor (the tiny model's crop, mean and std) on every decoded frame,
    sampling n frames itself (do_sample_frames, num_frames n) -> pixel_values_videos [1, n, 3, 56, 56]."""
    from transformers import LlavaOnevisionVideoProcessor
    from transformers.video_utils import VideoMetadata
    img = processor("onevision")
    info = probe(path)
    frames = decode(path, range(info.frames))
    proc = LlavaOnevisionVideoProcessor(size={"height": 56, "width": 56}, image_mean=img.image_mean,
                                        image_std=img.image_std, do_sample_frames=True, num_frames=n)
    meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height)
    return proc(videos=[frames], video_metadata=[meta], return_tensors="pt")["pixel_values_videos"]


def _row(ids, media):
    """One sample as the stage contract's first input: its media's crops in slot order, their tilings."""
    tiling = torch.tensor([[t for _, t in media]], dtype=torch.long)
    pixels = torch.cat([c for c, _ in media])[None]
    return pixels, ids[None], torch.ones(1, len(media), dtype=torch.long), torch.ones_like(ids)[None], tiling


def test_clip_logits_equal_transformers(onevision):
    """A clip alone, and an image then a clip in one conversation: mmpipe's frames are the processor's, its feature
    count LlavaOnevisionProcessor's (4 frames x 2 x 2 pooled + 1 newline = 17 at g = 4), and its logits
    transformers' within 1e-4; the pooled frames reach the logits (other frames, other logits)."""
    hf, model, d = onevision
    rule = tile_rule(model.cfg, 0, 2)
    grids, counts = TILES.media_grids([VideoRef("clip.mp4")], rule, d, 0)
    (g,) = grids.tolist()
    assert g == [*clip_tiling(4), 17] == [0, 0, -1, -3, 17] and counts["clip_frames_sampled"] == 4
    assert image_feature_count(model.cfg.vision, *g[:4]) == 17
    frames = TILES.clip_pixels(VideoRef("clip.mp4"), rule, d, 1, g)
    want_px = _hf_frames(d / "clip.mp4", 4)
    assert torch.equal(frames, want_px[0])
    ids = sample([17], seed=1)
    theirs = torch.where(ids == IMAGE, VIDEO, ids)
    with torch.no_grad():
        want = hf(input_ids=theirs[None], pixel_values_videos=want_px).logits[0]
        got = model(*_row(ids, [(frames, tuple(g[:4]))]))[0]
        err_alone = (got - want).abs().max().item()
        assert err_alone < TOL, err_alone
        other = model(*_row(ids, [(frames.flip(0), tuple(g[:4]))]))[0]
        assert (other - got).abs().max().item() > 1e-3
    # an image then the clip: the image tiled as transformers tiles a sample's one image (batch_num_images 1)
    px, hw = encode("onevision", [image(150, 90, seed=5)])
    (t,) = tilings("onevision", hw)
    n_img = feature_counts(hf, px, hw)[0]
    ids = sample([n_img, 17], seed=2)
    theirs = ids.clone()
    theirs[len(ids) - 3 - 17:len(ids) - 3] = VIDEO  # the clip's block: before the last 3 words
    media = [(px[0, :1 + t[2] * t[3]], t), (frames, tuple(g[:4]))]
    with torch.no_grad():
        want = hf(input_ids=theirs[None], pixel_values=px, image_sizes=hw, batch_num_images=torch.tensor([1]),
                  pixel_values_videos=want_px).logits[0]
        got = model(*_row(ids, media))[0]
    err_mixed = (got - want).abs().max().item()
    assert err_mixed < TOL, err_mixed
    print(f"onevision clip logits vs transformers: alone {err_alone:.2e}, with an image {err_mixed:.2e}")


def test_clip_budget_and_refusals(onevision):
    """A clip over its share of the row's crops is sampled to fewer frames (said in the counts); one whose
    min_frames do not fit is too_many_tiles; LLaVA-NeXT (anyres_max 0) refuses a clip (unsupported_media)."""
    import dataclasses
    _, model, d = onevision
    rule = tile_rule(model.cfg, 0, 2)  # T = 5: the largest pinpoint's 4 tiles + the base crop
    info = probe(d / "clip.mp4")
    assert onevision_sample(rule, info, 4) == (4, 0)
    assert onevision_sample(dataclasses.replace(rule, video=(3.0, 2, 768)), info, 3) == (3, 7)  # 7 at 3 fps
    with pytest.raises(BadRecord) as e:
        onevision_sample(rule, info, 2)
    assert e.value.kind == "too_many_tiles" and "even 4 (min_frames) > the 2" in e.value.reason
    # the image (tiled: 5 crops) beside the clip leaves it 2 of T = 7: min_frames 4 do not fit, 2 do
    rule = dataclasses.replace(rule, row_tiles=7)
    assert rule.crops(rule.grid(150, 90, 1)) == 5
    with pytest.raises(BadRecord) as e:
        TILES.media_grids(["a.png", VideoRef("clip.mp4")], rule, d, 10 ** 8)
    assert e.value.kind == "too_many_tiles"
    small = dataclasses.replace(rule, video=(2.0, 2, 768))
    grids, counts = TILES.media_grids(["a.png", VideoRef("clip.mp4")], small, d, 10 ** 8)
    assert grids[1].tolist() == [*clip_tiling(2), 2 * 4 + 1]
    assert (counts["clips_fewer_frames"], counts["clip_frames_dropped"]) == (1, 2)
    with pytest.raises(BadRecord) as e:
        TILES.media_grids([VideoRef("clip.mp4")], dataclasses.replace(rule, anyres_max=0), d, 0)
    assert e.value.kind == "unsupported_media" and "LLaVA-NeXT" in e.value.reason


def test_video_records_index_and_rows_give_transformers_logits(onevision, tmp_path):
    """The data path: LLaVA records with a clip, a clip and an image, and a bad clip, indexed at --max-tiles 9
    from the clip's header (a slot of 4 crops, 17 positions), and the rows' samples give transformers' logits; an
    image-only family (llava-tiny) counts the video records as unsupported_media."""
    from mmpipe.config import load_preset
    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.index import describe
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    from qwen_models import save_tokenizer
    hf, model, d = onevision
    (d / "junk.mp4").write_bytes(b"not a video")
    conv = [{"from": "human", "value": "<video>\nw5 w6"}, {"from": "gpt", "value": "w7"}]
    both = [{"from": "human", "value": "<image> w8 <video> w9"}, {"from": "gpt", "value": "w10"}]
    records = [{"video": "clip.mp4", "conversations": conv},
               {"video": "clip.mp4", "image": "a.png", "conversations": both},
               {"video": "junk.mp4", "conversations": conv}]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if not (d / "tok").is_dir():
        save_tokenizer(d / "tok")
    args = DataArgs(data=str(d / "data.jsonl"), tokenizer=str(d / "tok"), text_len=40, data_workers=0, max_images=2,
                    max_tiles=9)
    cfg = model.cfg
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, tmp_path / "index", seed=0, verbose=False)
    stats = samples.index.stats
    assert (stats["good"], stats["bad_by_kind"]) == (2, {"bad_video": 1})
    assert describe(stats)[1].startswith("data: 2 clips: 8 of their 14 frames sampled")
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    plan = RowPlan(sample_size(samples, shape), shape, pack=False, chunk=len(samples.index))
    rows = RowSet(samples, plan)
    seen = 0
    for r in range(2):
        item = rows[r]
        inputs = (item["pixels"][None].float(), torch.as_tensor(item["input_ids"])[None],
                  torch.as_tensor(item["has_image"])[None], torch.as_tensor(item["segments"])[None],
                  torch.as_tensor(item["tiling"])[None])
        tiling = inputs[-1][0]
        is_clip = tiling[:, 2] < 0
        assert is_clip.any() and tiling[is_clip].tolist()[0] == list(clip_tiling(4))
        ids = inputs[1][0]
        n = int((inputs[3][0] > 0).sum())
        with torch.no_grad():
            got = model(*inputs)[0, :n]
        # transformers on the same ids and the processors' own pixels for the files
        theirs, kw, at = ids[:n].clone(), {}, torch.nonzero(ids[:n] == IMAGE).flatten()
        crops = item["pixels"].float()
        if (~is_clip[:2] & (inputs[2][0, :2] > 0)).any():  # the image first: its crops, its block
            px, hw = encode("onevision", [image(150, 90, seed=5)])
            n_img = feature_counts(hf, px, hw)[0]
            kw = dict(pixel_values=px, image_sizes=hw, batch_num_images=torch.tensor([1]))
            theirs[at[n_img:]] = VIDEO
            assert torch.equal(crops[:len(px[0, :1 + tiling[0, 2] * tiling[0, 3]])],
                               px[0, :1 + tiling[0, 2] * tiling[0, 3]])
        else:
            theirs[at] = VIDEO
        with torch.no_grad():
            want = hf(input_ids=theirs[None], pixel_values_videos=_hf_frames(d / "clip.mp4", 4), **kw).logits[0]
        assert (got - want).abs().max().item() < TOL
        seen += 1 + bool(kw)
    assert seen == 3  # the clip alone, then the image and the clip
    text = {"conversations": [{"from": "human", "value": "w5"}, {"from": "gpt", "value": "w6"}]}
    (d / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2] + [text]))
    tiny = load_preset("llava-tiny")
    stats = prepare(resolve_data(DataArgs(data=str(d / "mixed.jsonl"), tokenizer=str(d / "tok"), text_len=40,
                                          data_workers=0), tiny), tiny, tmp_path / "llava", seed=0,
                    verbose=False).index.stats
    assert (stats["good"], stats["bad_by_kind"]) == (1, {"unsupported_media": 2})
    assert "the llava family reads image only" in stats["first_bad"][0]["reason"]


def test_a_clip_beside_an_image_takes_fewer_frames_to_fit_the_rows_positions(onevision, tmp_path):
    """The row holds a sample's text (--text-len) and image positions (at least the largest image's: 62 here, 16 +
    the pooled bound int(1.21 x 2 x 16) = 38 + 8 newlines): a 112 x 112 image (2 x 2 tiles, 16 + 5 x 6 = 46
    positions) beside the 13-frame clip (8 frames sampled, 33 positions) and 9 text tokens at --text-len 10 fits the
    crops (5 + 8 of 14) but not the row's 62 + 10 positions: 46 + 33 + 9 = 88 (it was indexed good and its row failed
    to build: could not broadcast). The clip takes the positions the image and the sample's text leave
    (video.onevision_share): (62 + (10 - 9) - 46 - 1) // 4 = 4 frames, 46 + 17 + 9 = 72, counted as fewer frames,
    and its row builds; at --text-len 40 the text leaves room for all 8."""
    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    from qwen_models import save_tokenizer
    _, model, d = onevision
    write_clip(tmp_path / "long.mp4", moving_square(13, 56, 56, seed=4), 3)  # 13 frames at 3 fps: 8 sampled at 2
    image(112, 112, seed=6).save(tmp_path / "big.png")
    both = [{"from": "human", "value": "<image> <video> w9"}, {"from": "gpt", "value": "w10"}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"video": "long.mp4", "image": "big.png", "conversations": both}))
    save_tokenizer(tmp_path / "tok")
    cfg = model.cfg
    assert tile_rule(cfg).image_positions() == 16 + 38 + 8
    for text_len in (10, 40):
        args = DataArgs(data=str(tmp_path / "d.jsonl"), image_root=str(tmp_path), tokenizer=str(tmp_path / "tok"),
                        text_len=text_len, data_workers=0, max_images=2, max_tiles=14, bad_records="strict")
        opts = resolve_data(args, cfg)
        samples = prepare(opts, cfg, tmp_path / f"index{text_len}", seed=0, verbose=False)
        enc, n = samples.tokens(0)
        (image_grid, clip_grid) = enc.grids[:n].tolist()
        frames, text = 1 - clip_grid[3], len(enc.ids)
        assert image_grid[2:] == [112, 112, 2, 2, 46][2:] and clip_grid[4] == 4 * frames + 1
        if text_len == 10:
            assert (text, frames) == (9, 4) and 46 + 4 * frames + 1 + text == 62 + 10
            assert samples.index.stats["clips_fewer_frames"] == 1
        else:
            assert frames == 8 and samples.index.stats["clips_fewer_frames"] == 0
        shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
        item = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=False, chunk=1))[0]
        assert len(item["input_ids"]) == shape.length == 62 + text_len and (item["input_ids"] == IMAGE).sum() == (
            46 + 4 * frames + 1)


def test_cached_greedy_decoding_on_a_clip_gives_transformers_generate(onevision):
    """mmpipe's generate on a clip (one slot of 4 frames' crops), cached and not, gives transformers' greedy
    `generate` tokens on the same prompt and the processor's frames."""
    from mmpipe.inference.generate import generate
    from mmpipe.inference.sampling import Sampling
    hf, model, d = onevision
    rule = tile_rule(model.cfg, 0, 2)
    grids, _ = TILES.media_grids([VideoRef("clip.mp4")], rule, d, 0)
    pixels = TILES.clip_pixels(VideoRef("clip.mp4"), rule, d, 1, grids[0])[None]
    ids = sample([17], seed=4)
    greedy = Sampling(eos_id=None, max_new_tokens=5)
    tiling = torch.as_tensor(grids[:, :4])[None]
    mine = generate(model, pixels, ids.tolist(), greedy, tiling=tiling)
    assert mine == generate(model, pixels, ids.tolist(), greedy, use_cache=False, tiling=tiling)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.where(ids == IMAGE, VIDEO, ids)[None], max_new_tokens=5, min_new_tokens=5,
                          pixel_values_videos=_hf_frames(d / "clip.mp4", 4), do_sample=False)
    assert out[0, len(ids):].tolist() == mine


def test_generate_command_answers_on_a_clip(onevision, capsys, monkeypatch):
    """`mmpipe generate --checkpoint HF_DIR --video clip.mp4 --prompt ...` on the tiny OneVision: the model gets the
    processor's frames and their block (the processor's 17 placeholders) at the user turn's start, and answers
    transformers' greedy answer; --video-max-frames 2 reaches the processor: its 2 frames, 2 x 2 x 2 + 1 = 9
    placeholders. (The tiny model's greedy answers repeat one word whatever the clip, so the inputs are checked.)"""
    import mmpipe.inference.generate as gen
    from hf_models import word_tokenizer
    from mmpipe.cli import main
    from mmpipe.data.text import ConversationEncoder
    from test_hf_llava_next import TEMPLATE, _hf_answer
    hf, _, d = onevision
    tok = word_tokenizer(d / "hf", TEMPLATE)
    ids, at = ConversationEncoder(tok, 512, markers=True).prompt([("user", "<image>\nw7 w8")], n_images=1)
    seen, real = [], gen.generate
    monkeypatch.setattr(gen, "generate", lambda model, pixels, prompt, *a, **kw: seen.append((pixels, prompt))
                        or real(model, pixels, prompt, *a, **kw))
    command = ["generate", "--checkpoint", str(d / "hf"), "--video", str(d / "clip.mp4"), "--prompt", "w7 w8",
               "--max-new-tokens", "5"]
    for frames, flags in ((4, []), (2, ["--video-max-frames", "2", "--video-min-frames", "1"])):
        assert main(command + flags) == 0
        pixels, prompt = seen.pop()
        want_px, n = _hf_frames(d / "clip.mp4", frames), frames * 4 + 1
        assert torch.equal(pixels[0], want_px[0]) and prompt == ids[:at[0]] + [IMAGE] * n + ids[at[0]:]
        want = _hf_answer(hf, tok, ids[:at[0]] + [VIDEO] * n + ids[at[0]:], dict(pixel_values_videos=want_px), 5)
        assert want and capsys.readouterr().out.strip() == want, frames


def _plan_json(capsys, argv: list[str]) -> dict:
    from mmpipe.cli import main
    assert main(["plan", "--preset", "llava-onevision-qwen2-0.5b", "--device", "h100-80gb", "--gpus-per-node", "8",
                 "--global-batch", "64", "--text-len", "256", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)[0]


def test_plan_costs_a_onevision_clip(capsys):
    """`mmpipe plan --video-frames N` on LLaVA-OneVision (llava-onevision-qwen2-0.5b: SigLIP 384 px, patch 14, g = 27
    features a side, pooled to ceil(27 / 2) = 14; pinpoints up to 6 x 6 tiles, so T = 1 + 36 = 37 crops by default):
    the clip takes N crops (frames sampled at the --video-* rule: N at its own rate, capped by --video-max-frames and
    by the crops and positions the row leaves), tiling (0, 0, -1, 1 - F), N x 14^2 + 1 decoder positions within the
    row's 729 + 7938 + 162 = 8829 image positions (its largest image's: base 27^2, anyres_max 9's pooled bound
    int(1.21 x 9 x 729), a newline per row of 6 x 27); the tower runs on T crops as for images. A clip whose
    min_frames do not fit the crops, or LLaVA-NeXT's: one line, exit 2."""
    from mmpipe.cli import main
    from mmpipe.model.costs import CropRow
    from mmpipe.planning.images import crop_line
    length = 729 + 7938 + 162 + 256
    one = _plan_json(capsys, ["--video-frames", "16"])  # 16 frames: 16 crops of 37, 16 x 196 + 1 = 3137 positions
    assert (one["max_tiles"], one["image_tilings"], one["decoder_length"]) == (37, [[0, 0, -1, 1 - 16]], length)
    assert crop_line(load_preset("llava-onevision-qwen2-0.5b"), CropRow(37, ((0, 0, -1, -15),)), 256, length) == (
        f"vision crops per row: 16 of --max-tiles 37 (57% padding); decoder positions per row: 8829 image "
        f"({16 * 196 + 1} used) + 256 text = {length}")
    # 48 frames: 37 fit the row's crops (the fewer-frames rule); --video-max-frames 8: 8 (its cap, in the sampling)
    assert _plan_json(capsys, ["--video-frames", "48"])["image_tilings"] == [[0, 0, -1, 1 - 37]]
    assert _plan_json(capsys, ["--video-frames", "16", "--video-max-frames", "8"])["image_tilings"] == [[0, 0, -1, -7]]
    # a 1024 x 768 image beside it, tiled alone (2 x 3 tiles, 7 crops, 4725 positions: batch_num_images counts
    # images): 32 frames; the crops leave 37 - 7 = 30, the positions (the text filling --text-len) (8829 - 4725 - 1)
    # // 196 = 20 (30 would take 4725 + 5881 = 10606 > 8829): 20 frames, 7 + 20 = 27 crops, 4725 + 3921 = 8646
    both = _plan_json(capsys, ["--video-frames", "32", "--image-size", "1024x768"])
    assert both["image_tilings"] == [[768, 1024, 2, 3], [0, 0, -1, -19]] and both["decoder_length"] == length
    assert (8829 - 4725 - 1) // 196 == 20 and 4725 + 20 * 196 + 1 == 8646 <= 8829 < 4725 + 21 * 196 + 1
    fails = {  # argv -> the last line
        ("--video-frames", "32", "--image-size", "1024x768", "--max-tiles", "10"):  # 10 - 7 = 3 < min_frames 4
            "--video-frames 32 --video-size 384x384: video 384x384, 32 frames: 32 frames sampled take 32 crops, and "
            "even 4 (min_frames) > the 3 the row's 10 crops (--max-tiles) and its positions leave it beside the "
            "sample's images (--max-tiles 10, 1 image(s) beside the clip)"}
    for argv, line in fails.items():
        assert main(["plan", "--preset", "llava-onevision-qwen2-0.5b", "--text-len", "256", *argv]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"mmpipe: error: {line}"
    assert main(["plan", "--preset", "llava-next-tiny", "--video-frames", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mmpipe: error: --video-frames: LLaVA-NeXT (vision.anyres_max 0) reads no clips; only LLaVA-OneVision's (the "
        "llava_next family at vision.anyres_max > 0) do")
    assert main(["plan", "--preset", "llava-onevision-qwen2-0.5b", "--device", "h100-80gb", "--gpus-per-node", "8",
                 "--global-batch", "64", "--text-len", "256", "--video-frames", "16"]) == 0
    assert ("text 256 + a clip of 16 frames of vision.image_size px -> 16 frames sampled, each a 384 px crop pooled "
            "to 14 x 14 (16 crops, 16 x 196 + 1 = 3137 image tokens)") in capsys.readouterr().out


def test_plan_and_flags_on_onevision(capsys):
    """--video-max-frames reaches OneVision's clip rule, --video-max-pixels is refused (its frames are the tower's
    crop)."""
    from mmpipe.cli import main
    from mmpipe.config import load_preset
    from mmpipe.data.args import DataArgs
    preset = "llava-onevision-qwen2-0.5b"
    cfg = DataArgs(video_max_frames=8, video_fps=1.0).with_video(load_preset(preset))
    assert tile_rule(cfg).video == (1.0, 4, 8)
    # the index key moves with them; at the defaults it is the old one
    base = tile_rule(load_preset(preset))
    assert TILES.grid_key(tile_rule(cfg), 1, 0) != TILES.grid_key(base, 1, 0)
    assert [1.0, 4, 8] not in TILES.grid_key(base, 1, 0) and len(TILES.grid_key(base, 1, 0)) == 11
    assert main(["train", "--dry-run", "--preset", preset, "--video-max-pixels", "100"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mmpipe: error: --video-max-pixels: the llava_next family's clip frames are its tower's crop "
        "(vision.image_size 384 px), not bounded by pixels")
