"""Video for Qwen3-VL (issue 44, first slice): a clip's grid and patches by transformers' Qwen3VLVideoProcessor, its
timestamps (`<t seconds>` before each temporal patch's block) as transformers' Qwen3VLProcessor writes them, and the
tiny random Qwen3-VL (transformers' class, tests/qwen3_models.py) giving transformers' logits (1e-4) for a clip
alone, a clip and an image in one conversation, and two clips of different lengths and frame sizes packed in one
row. A clip takes one slot of grid (1, h, w) per temporal patch (mmpipe.data.video.Qwen3VideoRule.frame_grids)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mmpipe.data.patches import PatchRule
from mmpipe.data.video import Qwen3VideoRule, probe
from mmpipe.hf.qwen3_vl import import_qwen3_vl
from qwen3_models import PIXELS, encode, save_qwen3
from qwen_models import END, IMAGE, START, VIDEO, image, save_tokenizer
from video_clips import moving_square, write_clip
from video_records import GOOD, packed_row

TOL = 1e-4
P = 256
PATCH_DIM = 3 * 2 * 16 * 16
# (name, frames, width, height, fps, format): 7 frames at 3 fps sample 4 (linspace 0, 2, 4, 6: 2 temporal patches);
# 13 frames at 3 fps sample 8 (4 temporal patches) of 96 x 64 px, resized to the clip's pixel bound (P x 256 x 2)
CLIPS = [("short", 7, 64, 64, 3, "mp4"), ("long", 13, 96, 64, 3, "mkv")]
# the timestamps' words get ids of their own (180...), so the ids say which text stands before each frame:
# short's frames (0, 2), (4, 6); long's (0, 2), (3, 5), (7, 9), (10, 12) at 3 fps, each pair's mean time
STAMPS = {180 + k: w for k, w in enumerate(["<0.3", "<1.7", "<1.3", "<2.7", "<3.7", "seconds>"])}


def _rule() -> Qwen3VideoRule:
    image_rule = PatchRule(16, 2, 2, 3, PIXELS["min_pixels"], PIXELS["max_pixels"], P, (0.5,) * 3, (0.5,) * 3)
    return Qwen3VideoRule(image_rule)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_video")
    clips = {}
    for k, (name, n, w, h, fps, fmt) in enumerate(CLIPS):
        write_clip(d / f"{name}.{fmt}", moving_square(n, w, h, seed=k), fps)
        clips[name] = d / f"{name}.{fmt}"
    hf = save_qwen3(d / "model")
    model, _ = import_qwen3_vl(d / "model")
    save_tokenizer(d / "tok", STAMPS)
    from transformers import AutoTokenizer
    return clips, hf, model.eval(), AutoTokenizer.from_pretrained(d / "tok")


def _hf_processor(tok, rule: Qwen3VideoRule):
    """transformers' Qwen3VLProcessor over the tiny tokenizer: its own frame sampling (do_sample_frames), resize at
    its own pixel bounds (the model's: no video config, so the images' as a whole-clip bound; the row's P = 256 binds
    none of these clips), and prompt expansion with timestamps."""
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor

    from qwen3_models import processor as image_processor
    video = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, do_sample_frames=True, fps=rule.fps, cap_pixels_per_frame=False,
                                  size={"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]})
    return Qwen3VLProcessor(image_processor=image_processor(), tokenizer=tok, video_processor=video)


def _decoded(path):
    """Every frame of the file (PyAV) and transformers' VideoMetadata from the decoded count (its own PyAV reader
    takes the header's count, which Matroska does not store)."""
    import av
    from transformers.video_utils import VideoMetadata
    with av.open(str(path)) as c:
        rate = float(c.streams.video[0].average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    return frames, VideoMetadata(total_num_frames=len(frames), fps=rate, width=frames.shape[2],
                                 height=frames.shape[1], duration=len(frames) / rate)


def _case(setup, names, with_image: bool, seed: int):
    """One conversation of the clips `names` (then an image): mmpipe's (ids, [(patches, grid)]) built from the index
    side (probe, the rule's clip, its timestamps tokenized, its patches) and transformers' (input_ids,
    mm_token_type_ids, processor outputs) from its processor on the decoded frames and the text's markers."""
    clips, _, _, tok = setup
    rule = _rule()
    words = [f"w{10 + 3 * seed + k}" for k in range(3)]
    text, ours, media = " ".join(words), tok(" ".join(words))["input_ids"], []
    videos, metas, images = [], [], []
    for name in names:
        info = probe(clips[name])
        clip = rule.clip(info)
        px = rule.patches(clips[name], clip)
        per = clip.grid[1] * clip.grid[2]
        for k, (stamp, grid) in enumerate(zip(rule.timestamps(info, clip), rule.frame_grids(clip))):
            ours += tok(stamp)["input_ids"] + [START] + [IMAGE] * (per // 4) + [END]
            media.append((px[k * per:(k + 1) * per], grid))
        ours += tok(" w7")["input_ids"]
        text += " <|vision_start|><|video_pad|><|vision_end|> w7"
        frames, meta = _decoded(clips[name])
        videos.append(frames)
        metas.append(meta)
    if with_image:
        im = image(96, 64, seed=seed)
        px, grid = encode([im])
        ours += [START] + [IMAGE] * (int(grid.prod()) // 4) + [END] + tok(" w8")["input_ids"]
        media.append((px, tuple(grid[0].tolist())))
        text += " <|vision_start|><|image_pad|><|vision_end|> w8"
        images.append(im)
    kw = dict(videos=videos, video_metadata=metas) if videos else {}
    out = _hf_processor(tok, rule)(text=[text], images=images or None, return_tensors="pt", **kw)
    return (torch.tensor(ours), media), out


def _row(samples):
    """video_records.packed_row at Qwen3-VL's patch (PATCH_DIM floats) and a 3-column tiling (t, h, w)."""
    return packed_row(samples, PATCH_DIM, 3)


def test_clip_grid_patches_and_timestamps_are_transformers(setup):
    """The index side's sampled frames, grid and patches, and the timestamp text, are what transformers' processor
    makes of the decoded file and writes into the prompt: mmpipe's ids equal its input_ids, <|video_pad|> read as
    the image placeholder (the embedding replaces both alike)."""
    clips, _, _, tok = setup
    rule = _rule()
    for name in ("short", "long"):
        (ours, media), out = _case(setup, [name], False, 0)
        theirs = out["input_ids"][0].clone()
        theirs[theirs == VIDEO] = IMAGE
        assert torch.equal(ours, theirs), name
        assert not (ours == 0).any()  # no unknown word: each timestamp is its own id
        assert torch.equal(torch.cat([px for px, _ in media]), out["pixel_values_videos"].float()), name
    info = probe(clips["short"])
    clip = rule.clip(info)
    assert (clip.indices, clip.grid) == ((0, 2, 4, 6), (2, 4, 4))
    assert rule.timestamps(info, clip) == ["<0.3 seconds>", "<1.7 seconds>"]  # frames (0, 2) and (4, 6) at 3 fps


def test_qwen3_clip_logits_equal_transformers(setup):
    """A clip alone, a clip and an image, two clips of different lengths and frame sizes: each alone and all three
    packed in one row give transformers' logits."""
    _, hf, model, _ = setup
    cases = [_case(setup, ["short"], False, 1), _case(setup, ["long"], True, 2),
             _case(setup, ["short", "long"], False, 3)]
    wants = []
    for _, out in cases:
        kw = {k: out[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                  "mm_token_type_ids") if k in out}
        with torch.no_grad():
            wants.append(hf(input_ids=out["input_ids"], **kw).logits[0])
    for (ours, _), want in zip(cases, wants):
        with torch.no_grad():
            got = model(*_row([ours])[0])[0, :len(ours[0])]
        assert got.shape == want.shape and (got - want).abs().max().item() < TOL
    inputs, spans = _row([c[0] for c in cases])
    with torch.no_grad():
        got = model(*inputs)[0]
    for (a, b), want in zip(spans, wants):
        assert (got[a:b] - want).abs().max().item() < TOL


# LLaVA-style records: tests/video_records.py's GOOD (a clip alone, a clip then an image, two clips of different
# lengths and frame sizes, an image alone); clips take a slot per temporal patch (2 and 4 here), so a row has 6 slots


def test_llava_video_records_pack_into_rows_with_transformers_ids_and_logits(setup, tmp_path):
    """The data path end to end for Qwen3-VL: LLaVA records with clips are indexed from the headers, each clip's
    marker made its timestamps and a slot per temporal patch, packed into rows beside images; each sample's ids
    equal what transformers' Qwen3VLProcessor makes of the chat-templated conversation (<|video_pad|> read as
    <|image_pad|>), and its logits transformers'."""
    import json
    import re

    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    clips, hf, model, tok = setup
    root = clips["short"].parent
    image(96, 64, seed=7).save(root / "a.png")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD))
    cfg = model.cfg
    args = DataArgs(data=str(root / "data.jsonl"), tokenizer=str(root / "tok"), text_len=64,
                    data_workers=0, max_images=6, max_patches=P, pack=True)
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, tmp_path / "index", seed=0, verbose=False)
    assert samples.index.stats["good"] == len(GOOD), samples.index.stats
    shape = row_shape(cfg, 6, opts.text_len, opts.vision_budget)
    plan = RowPlan(sample_size(samples, shape), shape, pack=True, chunk=len(samples.index))
    rows = RowSet(samples, plan)
    rule = _rule()
    blocks = {kind: f"<|vision_start|><|{kind}_pad|><|vision_end|>" for kind in ("video", "image")}
    seen, r = [], 0
    while len(seen) < len(GOOD):
        item, positions = rows[r], plan.row(r)
        seen += positions
        inputs = (item["pixels"][None].float(), torch.as_tensor(item["input_ids"])[None],
                  torch.as_tensor(item["has_image"])[None], torch.as_tensor(item["segments"])[None],
                  torch.as_tensor(item["tiling"])[None])
        with torch.no_grad():
            got = model(*inputs)[0]
        for seg, pos in enumerate(positions, start=1):
            record = GOOD[samples.row(pos)]
            where = torch.as_tensor(np.flatnonzero(item["segments"] == seg))
            kinds = re.findall(r"<(video|image)>", record["conversations"][0]["value"])
            videos = record.get("video", [])
            videos = videos if isinstance(videos, list) else [videos]
            msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"].strip()}
                    for t in record["conversations"]]
            for kind in ("video", "image"):
                msgs[0]["content"] = msgs[0]["content"].replace(f"<{kind}>", blocks[kind])
            text = tok.apply_chat_template(msgs, tokenize=False)
            decoded = [_decoded(root / v) for v in videos]
            kw = dict(videos=[d[0] for d in decoded], video_metadata=[d[1] for d in decoded]) if videos else {}
            proc = _hf_processor(tok, rule)
            proc.video_processor.size = {"shortest_edge": PIXELS["min_pixels"],
                                         "longest_edge": rule.clip_pixels(len(kinds))}
            cap = rule.image.cap(len(kinds))
            proc.image_processor.size = {"shortest_edge": PIXELS["min_pixels"], "longest_edge": cap}
            out = proc(text=[text], images=[image(96, 64, seed=7)] if "image" in kinds else None,
                       return_tensors="pt", **kw)
            theirs = out["input_ids"][0].clone()
            theirs[theirs == VIDEO] = IMAGE
            assert inputs[1][0, where].tolist() == theirs.tolist(), record
            hf_kw = {k: out[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                         "mm_token_type_ids") if k in out}
            with torch.no_grad():
                want = hf(input_ids=out["input_ids"], **hf_kw).logits[0]
            assert (got[where] - want).abs().max().item() < TOL, record
        r += 1
    assert sorted(seen) == list(range(len(GOOD))) and r < len(GOOD)  # packed: clips and images share rows


def test_cached_greedy_decoding_on_a_clip_gives_transformers_generate(setup):
    """mmpipe's cached greedy decoding on the 13-frame clip (4 temporal-patch slots after their timestamps) gives
    transformers' `generate` tokens, and equals the uncached reference."""
    from mmpipe.inference.generate import generate
    from mmpipe.inference.sampling import Sampling
    _, hf, model, _ = setup
    (ours, media), out = _case(setup, ["long"], False, 6)
    pixels = torch.cat([torch.cat([px for px, _ in media]), torch.zeros(4, PATCH_DIM)])[None]
    tiling = torch.tensor([[g for _, g in media]])
    greedy = Sampling(eos_id=None, max_new_tokens=5)
    mine = generate(model, pixels, ours.tolist(), greedy, tiling=tiling)
    assert mine == generate(model, pixels, ours.tolist(), greedy, use_cache=False, tiling=tiling)
    kw = {k: out[k] for k in ("pixel_values_videos", "video_grid_thw", "mm_token_type_ids")}
    with torch.no_grad():
        got = hf.generate(input_ids=out["input_ids"], max_new_tokens=5, min_new_tokens=5, do_sample=False, **kw)
    assert got[0, out["input_ids"].shape[1]:].tolist() == mine
