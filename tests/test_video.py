"""Video (issue 44, first slice): clips written here with PyAV (tests/video_clips.py) in two containers / codecs;
index time reads each clip's frames, rate and size from its header and gives the grid transformers' own video
processor gives after decoding and sampling the file itself; unreadable, zero-frame and marker-less clips are bad
records with their reasons; the tiny random Qwen2.5-VL (transformers' class, tests/qwen_models.py) gives
transformers' logits (1e-4) for a clip alone, a clip and an image in one conversation, and two clips of different
lengths and frame sizes packed in one row, under its absolute-time temporal rotary."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.data.patches import PatchRule
from mmpipe.data.records import BadRecord
from mmpipe.data.video import VideoRule, probe, record_clips, step_bits
from mmpipe.hf.qwen2_vl import import_qwen2_vl
from qwen_models import END, IMAGE, PIXELS, START, VIDEO, encode, image, save_qwen
from video_clips import moving_square, write_clip, write_empty
from video_records import GOOD, conv, packed_row

TOL = 1e-4
P = 256  # the row's patch budget in these tests
# (name, frames, width, height, fps, format): 7 frames at 3 fps sample 4 (2 temporal patches, sampled_fps 12 / 7,
# a step of 4 x 2 / (12 / 7) = 4.67 positions: 0, 4); 13 frames at 3 fps sample 8, their 84 x 56 frames under the
# processor's max_pixels (12544) and 4 x 24 = 96 patches within the row's P: kept at 6 x 4 patches, step 4.33: 0, 4,
# 8, 13 (3 x 4.3333335 in float32, floored as transformers does)
CLIPS = [("short", 7, 56, 56, 3, "mp4"), ("long", 13, 84, 56, 3, "mkv")]


def _rule(tokens_per_second: int) -> VideoRule:
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # the processor's CLIP
    image_rule = PatchRule(14, 2, 2, 3, PIXELS["min_pixels"], PIXELS["max_pixels"], P, mean, std)
    return VideoRule(image_rule, tokens_per_second=tokens_per_second)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    out = {}
    for k, (name, n, w, h, fps, fmt) in enumerate(CLIPS):
        write_clip(d / f"{name}.{fmt}", moving_square(n, w, h, seed=k), fps)
        out[name] = d / f"{name}.{fmt}"
    return out


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2_5")
    hf = save_qwen("qwen2_5", d)
    model, _ = import_qwen2_vl(d)
    return hf, model.eval()


def _reference(path, rule: VideoRule, frame_cap: int = PIXELS["max_pixels"]):
    """transformers' own video processor on every frame of the file (decoded here with PyAV, counted by decoding):
    its fps sampling and resize at its own pixel bounds (the model's processor's, tests/qwen_models.PIXELS), or at
    a row's frame_cap where the row's share binds -> (pixel_values_videos, video_grid_thw [1, 3],
    second_per_grid_ts float32 [1]) as Qwen2_5_VLProcessor makes them (temporal_patch_size / the sampled frames'
    fps). (transformers' own PyAV reader, video_utils.read_video_pyav, takes the header's frame count, which
    Matroska does not store: it reads 0 frames there.)"""
    import av
    from transformers import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    with av.open(str(path)) as c:
        rate = float(c.streams.video[0].average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    meta = VideoMetadata(total_num_frames=len(frames), fps=rate, width=frames.shape[2], height=frames.shape[1],
                         duration=len(frames) / rate)
    proc = Qwen2VLVideoProcessor(min_pixels=PIXELS["min_pixels"], max_pixels=frame_cap, do_sample_frames=True,
                                 fps=rule.fps, cap_pixels_per_frame=False)
    out = proc(videos=[frames], video_metadata=[meta], return_metadata=True, return_tensors="pt")
    seconds = torch.tensor([2 / out["video_metadata"][0].sampled_fps], dtype=torch.float32)
    return out["pixel_values_videos"], out["video_grid_thw"], seconds


def test_header_gives_the_processors_grid_in_both_containers(clips):
    """probe reads frames / fps / size without decoding (Matroska stores no frame count: duration x rate), and the
    index's grid and sampled frames are what transformers' processor makes of the file after decoding it."""
    rule = _rule(4)
    for name, n, w, h, fps, _ in CLIPS:
        info = probe(clips[name])
        assert (info.frames, info.fps, info.width, info.height) == (n, fps, w, h), name
        clip = rule.clip(info)
        px, grid, seconds = _reference(clips[name], rule)  # the processor at its own bounds: P = 256 binds neither
        assert clip.grid == tuple(grid[0].tolist()), name
        assert clip.seconds_per_grid == seconds.item(), name
        got = rule.patches(clips[name], clip)
        assert torch.equal(got, px.float()), name
    short, long = (rule.clip(probe(clips[c])) for c in ("short", "long"))
    assert (short.grid, len(short.indices), long.grid, len(long.indices)) == ((2, 4, 4), 4, (4, 4, 6), 8)


def test_bad_clips_are_bad_records_with_their_reasons(tmp_path, clips):
    rule = _rule(4)
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    write_empty(tmp_path / "empty.mp4")
    write_clip(tmp_path / "one.mp4", moving_square(1, 56, 56), 3)  # one frame: no temporal patch of 2
    cases = {"junk.mp4": "bad_video", "empty.mp4": "empty_video", "one.mp4": "empty_video", "gone.mp4": "bad_video"}
    for name, kind in cases.items():
        with pytest.raises(BadRecord) as e:
            record_clips([name], 1, tmp_path, rule)
        assert e.value.kind == kind, (name, e.value.reason)
    with pytest.raises(BadRecord) as e:  # a <video> marker without a clip
        record_clips([], 1, clips["short"].parent, rule)
    assert e.value.kind == "video_marker"
    got = record_clips([clips["short"].name], 1, clips["short"].parent, rule)
    assert got[0][2].grid == (2, 4, 4)


def _row(samples, width: int = 4):
    """video_records.packed_row at Qwen2.5-VL's 1176 floats a patch and a 4-column tiling (t, h, w, the step's float32
    bits; width 3: without the steps)."""
    return packed_row(samples, 1176, width)


def _conversation(items, seed: int):
    """(mmpipe ids, HF ids, HF mm_token_type_ids): 3 text tokens, then per item ("image" | "video", grid) its
    bracketed block (mmpipe: image placeholders for both, which the embedding replaces alike; HF: <|video_pad|> and
    type 2 for a clip) and 3 more text tokens."""
    g = torch.Generator().manual_seed(seed)
    ours, theirs, types = [torch.randint(3, 180, (3,), generator=g)], [], []
    theirs.append(ours[0])
    types.append(torch.zeros(3, dtype=torch.int))
    for kind, grid in items:
        n = int(torch.tensor(grid).prod()) // 4
        text = torch.randint(3, 180, (3,), generator=g)
        pad = IMAGE if kind == "image" else VIDEO
        ours += [torch.tensor([START] + [IMAGE] * n + [END]), text]
        theirs += [torch.tensor([START] + [pad] * n + [END]), text]
        types += [torch.tensor([0] + [1 if kind == "image" else 2] * n + [0], dtype=torch.int),
                  torch.zeros(3, dtype=torch.int)]
    return torch.cat(ours), torch.cat(theirs), torch.cat(types)


def _case(clips, rule, names, with_image: bool, seed: int):
    """One conversation's mmpipe sample and transformers' logits: the clips `names` (then an image)."""
    media, hf_kw, items = [], {}, []
    vids, grids, secs = [], [], []
    for name in names:
        clip = rule.clip(probe(clips[name]))
        px, grid, seconds = _reference(clips[name], rule, rule.frame_cap(clip.grid[0]))
        media.append((rule.patches(clips[name], clip), clip.tiling))
        items.append(("video", clip.grid))
        vids.append(px)
        grids.append(grid)
        secs.append(seconds)
    if names:
        hf_kw.update(pixel_values_videos=torch.cat(vids), video_grid_thw=torch.cat(grids),
                     second_per_grid_ts=torch.cat(secs))
    if with_image:
        px, grid = encode([image(84, 56, seed=seed)])
        media.append((px, (*grid[0].tolist(), 0)))  # an image's step is never read (t = 1)
        items.append(("image", tuple(grid[0].tolist())))
        hf_kw.update(pixel_values=px, image_grid_thw=grid)
    ours, theirs, types = _conversation(items, seed)
    return (ours, media), theirs, types, hf_kw


def _hf_logits(hf, ids, types, kw):
    with torch.no_grad():
        return hf(input_ids=ids[None], mm_token_type_ids=types[None], **kw).logits[0]


def test_qwen2_5_clip_logits_equal_transformers(qwen25, clips):
    """A clip alone, a clip and an image in one conversation, and two clips of different lengths and frame sizes
    (2 x 4 x 4 and 4 x 2 x 4 patches, steps 4.67 and 4.33), each alone and all packed in one row."""
    hf, model = qwen25
    rule = _rule(hf.config.vision_config.tokens_per_second)
    cases = [_case(clips, rule, ["short"], False, 1), _case(clips, rule, ["long"], True, 2),
             _case(clips, rule, ["short", "long"], False, 3)]
    wants = [_hf_logits(hf, theirs, types, kw) for _, theirs, types, kw in cases]
    for (ours, _, _, _), want in zip(cases, wants):
        with torch.no_grad():
            got = model(*_row([ours])[0])[0, :len(ours[0])]
        assert (got - want).abs().max().item() < TOL
    inputs, spans = _row([c[0] for c in cases])
    with torch.no_grad():
        got = model(*inputs)[0]
    for (a, b), want in zip(spans, wants):
        assert (got[a:b] - want).abs().max().item() < TOL


def test_absolute_time_positions_matter(qwen25, clips):
    """The clip's temporal step reaches the logits: the same clip read as Qwen2-VL's temporal index (step 1.0)
    differs from transformers' Qwen2.5-VL by more than 1e-3, so the equality above is the rule's, not luck."""
    hf, model = qwen25
    rule = _rule(hf.config.vision_config.tokens_per_second)
    (ours, media), theirs, types, kw = _case(clips, rule, ["long"], False, 4)
    want = _hf_logits(hf, theirs, types, kw)
    media = [(px, (*til[:3], step_bits(1.0))) for px, til in media]
    with torch.no_grad():
        got = model(*_row([(ours, media)])[0])[0, :len(ours)]
    assert (got - want).abs().max().item() > 1e-3


# LLaVA-style records: tests/video_records.py's GOOD (a clip alone, a clip then an image, two clips of different
# lengths and frame sizes, an image alone); then the bad ones: an unreadable clip, a <video> marker without a clip, a
# zero-frame clip
BAD = [("bad_video", {"video": "junk.mp4", "conversations": conv("<video> w5", "w6")}),
       ("video_marker", {"conversations": conv("<video> w5", "w6")}),
       ("empty_video", {"video": "empty.mp4", "conversations": conv("<video> w5", "w6")})]


def test_llava_video_records_pack_into_rows_with_transformers_logits(qwen25, clips, tmp_path):
    """The data path end to end: LLaVA records with "video" paths and <video> markers are indexed from the clips'
    headers (bad ones counted with their reasons), packed into rows of P patches beside images (two media a row's
    slots), and each sample of each row gives transformers' logits: the row's patches, grids and steps (the tiling's
    4th column) are transformers' processor's and get_rope_index's for the files."""
    import json
    import re

    from transformers import Qwen2VLImageProcessor

    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.index import describe
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    from mmpipe.data.patches import patch_rule
    from mmpipe.data.video import video_rule
    from qwen_models import save_tokenizer
    from video_clips import write_empty
    hf, model = qwen25
    root = clips["short"].parent
    image(84, 56, seed=7).save(root / "a.png")
    (root / "junk.mp4").write_bytes(b"not a video")
    write_empty(root / "empty.mp4")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD + [r for _, r in BAD]))
    save_tokenizer(root / "tok")
    cfg = model.cfg
    assert cfg.vision.tokens_per_second == hf.config.vision_config.tokens_per_second == 4  # imported
    args = DataArgs(data=str(root / "data.jsonl"), tokenizer=str(root / "tok"), text_len=40, data_workers=0,
                    max_images=2, max_patches=P, pack=True)
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, tmp_path / "index", seed=0, verbose=False)
    stats = samples.index.stats
    assert (stats["good"], stats["bad_by_kind"]) == (len(GOOD), {k: 1 for k, _ in BAD})
    # the data report: 4 clips (7 + 13 + 13 + 7 frames, 4 + 8 + 8 + 4 sampled at 2 fps), each within its share of
    # the row (P / 2 = 128 patches: the 13-frame clip's 4 x 4 x 6 = 96), so none smaller than its processor makes it
    assert describe(stats)[1] == ("data: 4 clips: 24 of their 40 frames sampled (the family's video processor's fps "
                                  "rule)")
    # summary.json's data section counts the 2 images (2 records) and the 4 clips apart, not 4 records "with an image"
    from mmpipe.runtime.steplog import data_counts
    counts = data_counts(stats)
    assert (counts["with_image"], counts["images"], counts["clips"], stats["with_image"]) == (2, 2, 4, 4)
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    plan = RowPlan(sample_size(samples, shape), shape, pack=True, chunk=len(samples.index))
    rows = RowSet(samples, plan)
    rule = video_rule(patch_rule(cfg, P))
    seen, r = [], 0
    while len(seen) < len(GOOD):
        item, positions = rows[r], plan.row(r)
        seen += positions
        inputs = (item["pixels"][None].float(), torch.as_tensor(item["input_ids"])[None],
                  torch.as_tensor(item["has_image"])[None], torch.as_tensor(item["segments"])[None],
                  torch.as_tensor(item["tiling"])[None])
        assert inputs[-1].shape[-1] == 4  # (t, h, w, step bits)
        with torch.no_grad():
            got = model(*inputs)[0]
        for seg, pos in enumerate(positions, start=1):
            record = GOOD[samples.row(pos)]
            where = torch.as_tensor(np.flatnonzero(item["segments"] == seg))
            ids = inputs[1][0, where]
            videos = record.get("video", [])
            videos = videos if isinstance(videos, list) else [videos]
            kinds = re.findall(r"<(video|image)>", record["conversations"][0]["value"])  # the media in order
            n = len(kinds)
            kw, types, theirs = {}, torch.zeros_like(ids, dtype=torch.int), ids.clone()
            starts = torch.nonzero(ids == START).flatten().tolist()
            vids, secs, grids = [], [], []
            for block, kind in zip(starts, kinds, strict=True):
                if kind == "video":
                    path = root / videos[len(vids)]
                    clip = rule.clip(probe(path), n)
                    px, grid, seconds = _reference(path, rule, rule.frame_cap(clip.grid[0], n))
                    vids.append(px)
                    grids.append(grid)
                    secs.append(seconds)
                    size = int(grid.prod()) // 4
                    theirs[block + 1:block + 1 + size] = VIDEO
                    types[block + 1:block + 1 + size] = 2
                else:
                    cap = rule.image.cap(n)
                    out = Qwen2VLImageProcessor(min_pixels=PIXELS["min_pixels"], max_pixels=cap)(
                        images=[image(84, 56, seed=7)], return_tensors="pt")
                    kw.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
                    size = int(out["image_grid_thw"].prod()) // 4
                    types[block + 1:block + 1 + size] = 1
            if vids:
                kw.update(pixel_values_videos=torch.cat(vids), video_grid_thw=torch.cat(grids),
                          second_per_grid_ts=torch.cat(secs))
            want = _hf_logits(hf, theirs, types, kw)
            assert (got[where] - want).abs().max().item() < TOL, record
        r += 1
    assert sorted(seen) == list(range(len(GOOD))) and r < len(GOOD)  # packed: clips and images share rows


def test_parquet_video_column(clips, tmp_path):
    """A parquet file's "video" column (paths) and <video> markers in its conversations: the clip's grid and step in
    the index, as from a LLaVA file; a row without a clip stays text-only."""
    import dataclasses

    import pandas as pd

    from mmpipe.config import load_preset
    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from test_qwen_data import save_tokenizer
    root = clips["short"].parent
    pd.DataFrame([{"video": "short.mp4", "conversations": conv("<video> what", "red")},
                  {"video": None, "conversations": conv("what colour", "red")}]).to_parquet(tmp_path / "d.parquet")
    save_tokenizer(tmp_path / "tok")
    cfg = load_preset("qwen-tiny")
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, tokens_per_second=2))
    args = DataArgs(data=str(tmp_path / "d.parquet"), image_root=str(root), tokenizer=str(tmp_path / "tok"),
                    text_len=40, data_workers=0)
    samples = prepare(resolve_data(args, cfg), cfg, tmp_path / "index", seed=0, verbose=False)
    assert samples.index.n_images.tolist() == [1, 0]
    # 2 temporal patches of 4 x 4; step 2 x 2 / (12 / 7) = 2.33 positions a temporal patch, as float32 bits
    assert samples.index.grids.tolist() == [[2, 4, 4, step_bits(np.float32(2 * np.float32(2 / (4 / 7 * 3))))]]


def test_plan_costs_a_clip(capsys):
    """`mmpipe plan --video-frames N --video-size WxH`: the row's clip as the data side makes it (the family's video
    processor rules): qwen2.5-vl-7b, 16 frames of 448 x 448 sampled -> one 8 x 32 x 32 grid, 2048 image tokens and 2
    brackets; qwen3-vl-tiny's clip a (1, h, w) slot per temporal patch; a family without clips: one line, exit 2."""
    import json

    from mmpipe.cli import main
    common = ["--device", "h100-80gb", "--json"]
    assert main(["plan", "--preset", "qwen2.5-vl-7b", "--gpus-per-node", "8", "--global-batch", "256",
                 "--video-frames", "16", "--video-size", "448x448", "--max-patches", "8192", "--text-len", "256",
                 *common]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["image_grids"] == [[8, 32, 32]] and out[0]["decoder_length"] == 2 + 2048 + 256
    assert main(["plan", "--preset", "qwen3-vl-tiny", "--video-frames", "8", "--video-size", "64x64",
                 "--image-size", "96x64", "--max-patches", "256", "--text-len", "32", *common]) == 0
    out = json.loads(capsys.readouterr().out)
    # the image, then the clip's 4 temporal patches at transformers' Qwen3-VL video processor's size of 8 frames of
    # 64 x 64 at the preset's own settings (no video config: the images' pixel bounds, a whole-clip bound there)
    from transformers import Qwen3VLVideoProcessor

    from mmpipe.config import load_preset
    v = load_preset("qwen3-vl-tiny").vision
    theirs = Qwen3VLVideoProcessor(patch_size=v.patch_size, merge_size=v.merge_size, cap_pixels_per_frame=False,
                                   size={"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels})(
        videos=[np.zeros((8, 64, 64, 3), np.uint8)], do_sample_frames=False, return_tensors="pt")["video_grid_thw"]
    t, h, w = theirs[0].tolist()
    assert out[0]["image_grids"] == [[1, 4, 6]] + [[1, h, w]] * t and t == 4
    assert main(["plan", "--preset", "llava-tiny", "--video-frames", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mmpipe: error: --video-frames: the llava family reads no clips; only the qwen2_vl, llava_next, qwen3_vl, "
        "internvl and gemma4 families do")


def test_cached_greedy_decoding_on_a_clip_gives_transformers_generate(qwen25, clips):
    """mmpipe's cached greedy decoding (the layers' decode, the rope delta of a clip whose temporal positions run past
    its h and w) on the 13-frame clip gives transformers' `generate` tokens, and equals the uncached reference."""
    from mmpipe.inference.generate import generate
    from mmpipe.inference.sampling import Sampling
    hf, model = qwen25
    rule = _rule(hf.config.vision_config.tokens_per_second)
    (ours, media), theirs, types, kw = _case(clips, rule, ["long"], False, 5)
    px, tiling = media[0]
    pixels = torch.cat([px, torch.zeros(4, px.shape[1])])[None]
    greedy = Sampling(eos_id=None, max_new_tokens=5)
    mine = generate(model, pixels, ours.tolist(), greedy, tiling=torch.tensor([[tiling]]))
    assert mine == generate(model, pixels, ours.tolist(), greedy, use_cache=False, tiling=torch.tensor([[tiling]]))
    with torch.no_grad():
        out = hf.generate(input_ids=theirs[None], mm_token_type_ids=types[None], max_new_tokens=5, min_new_tokens=5,
                          do_sample=False, **kw)
    assert out[0, len(theirs):].tolist() == mine


def test_qwen2_vl_clip_takes_the_temporal_index(clips, tmp_path):
    """Qwen2-VL (transformers' Qwen2VLForConditionalGeneration, no tokens_per_second): imported with
    vision.tokens_per_second 0, a clip's rows keep 3 tiling columns and its temporal patch f sits at f, and the
    logits equal transformers' for a clip and an image in one conversation."""
    hf = save_qwen("qwen2", tmp_path)
    model, _ = import_qwen2_vl(tmp_path)
    assert model.cfg.vision.tokens_per_second == 0
    rule = _rule(0)
    (ours, media), theirs, types, kw = _case(clips, rule, ["long"], True, 8)
    assert media[0][1][3] == step_bits(1.0)  # the clip's step: 1, its temporal index
    kw.pop("second_per_grid_ts")  # Qwen2-VL's forward takes none
    with torch.no_grad():
        got = model(*_row([(ours, media)], width=3)[0])[0, :len(ours)]
    assert (got - _hf_logits(hf.eval(), theirs, types, kw)).abs().max().item() < TOL


def test_generate_command_answers_on_a_clip(qwen25, clips, tmp_path, capsys):
    """`mmpipe generate --video PATH --prompt TEXT` on an HF directory gives transformers' greedy answer to the prompt
    training builds (the chat template, the clip's bracketed block at the start of the user turn) on the processor's
    own sampled frames and time steps."""
    from mmpipe.cli import main
    from mmpipe.data.text import ConversationEncoder, image_text
    from mmpipe.data.tokenizer import load_tokenizer
    from qwen_models import processor, save_tokenizer
    hf, model = qwen25
    d = tmp_path / "hf"
    hf.save_pretrained(d)
    processor().save_pretrained(d)
    save_tokenizer(d)
    gen = ["generate", "--checkpoint", str(d), "--video", str(clips["long"]), "--prompt", "w7 w8",
           "--max-new-tokens", "5"]
    assert main(gen) == 0
    answer = capsys.readouterr().out.strip()
    tok = load_tokenizer(str(d))
    ids, at = ConversationEncoder(tok, 512, markers=True, image_text=image_text(tok, model.cfg)).prompt(
        [("user", "<image>\nw7 w8")], n_images=1)
    rule = _rule(hf.config.vision_config.tokens_per_second)
    px, grid, seconds = _reference(clips["long"], rule)  # the processor at its own bounds: generate's row holds it
    a = int(at[0])
    prompt = torch.tensor(ids[:a] + [START] + [VIDEO] * (int(grid.prod()) // 4) + [END] + ids[a:])
    with torch.no_grad():
        out = hf.generate(input_ids=prompt[None], pixel_values_videos=px, video_grid_thw=grid,
                          second_per_grid_ts=seconds, mm_token_type_ids=(prompt == VIDEO).int()[None] * 2,
                          max_new_tokens=5, do_sample=False, eos_token_id=tok.eos_token_id)
    assert answer == tok.decode(out[0, len(prompt):], skip_special_tokens=True).strip() != ""


def test_decoded_clips_are_kept_up_to_the_cache_bound(clips, monkeypatch):
    """A clip read again (a Qwen3-VL clip's next temporal-patch slot, the next epoch) comes from the loader's cache,
    the same patches a fresh decode gives; past CLIP_CACHE_BYTES the least recently read clip goes first."""
    from mmpipe.data import video
    rule = _rule(0).image
    monkeypatch.setattr(video, "_clip_cache", type(video._clip_cache)())
    monkeypatch.setattr(video, "_cached", [0])
    short = video._clip_patches(clips["short"], rule, 1)
    assert video._clip_patches(clips["short"], rule, 1)[1] is short[1]  # read again: not decoded again
    monkeypatch.setattr(video, "CLIP_CACHE_BYTES", short[1].nbytes)  # room for one clip: the next one evicts
    long_ = video._clip_patches(clips["long"], rule, 1)
    assert list(video._clip_cache) == [(clips["long"], rule, 1)] and video._cached == [long_[1].nbytes]
    fresh = video._clip_patches(clips["short"], rule, 1)  # decoded anew, equal
    assert fresh[1] is not short[1] and torch.equal(fresh[1], short[1]) and fresh[0] == short[0]
