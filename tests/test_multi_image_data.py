"""Several images per sample on the data side: a LLaVA record's "image" list, one `<image>` marker per
image, each image's placeholder block at its marker (Encoded.image_at), --max-images and its refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmpipe.config import ConfigError, load_preset
from mmpipe.data.dataset import prepare
from mmpipe.data.export import export_shapes
from mmpipe.data.image_kinds import image_kind
from mmpipe.data.packing import sample_rowset
from mmpipe.data.records import BadRecord
from mmpipe.data.text import ConversationEncoder
from mmpipe.data.tokenizer import builtin_tokenizer
from mmpipe.model import IGNORE_INDEX
from mmpipe.model.rows import IMAGE_SLOT
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve

IMG = ["images/00000.png", "images/00001.png", "images/00002.png"]
# two images, their markers in two user turns: the second one's block goes after the first answer
TWO = {"image": IMG[:2], "conversations": [
    {"from": "human", "value": "<image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"},
    {"from": "human", "value": "what shape is blue <image>"}, {"from": "gpt", "value": "square"}]}


def one(image: str, question: str = "<image>\nwhat shape is red") -> dict:
    return {"image": image, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "circle"}]}


def write(tmp_path, *records) -> str:
    export_shapes(tmp_path, "pairs-csv", 3)  # images/00000.png .. 00002.png, 64 x 64
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def load(tmp_path, data, *flags):
    args = TrainArgs.from_argv(["--data", data, "--output-dir", str(tmp_path / "run"), *flags])
    run = resolve(args, 2)
    return run, prepare(run.data, run.model, args.output_dir, seed=0, verbose=False)


def expected(record: dict) -> tuple[list[int], list[int], int]:
    """(text ids, image_at, all ids) from the LLaVA tokenizer's own tokenisation of the rendered text with its
    markers: each marker is one <image> token; taking marker k out leaves image k before the token at its
    position less the k markers in front of it."""
    tok = builtin_tokenizer(image_token=True)
    roles = {"human": "user", "gpt": "assistant"}
    msgs = [{"role": roles[t["from"]], "content": t["value"].strip()} for t in record["conversations"]]
    full = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids
    image = tok.convert_tokens_to_ids("<image>")
    marks = [p for p, t in enumerate(full) if t == image]
    return [t for t in full if t != image], [p - k for k, p in enumerate(marks)], len(full)


def position_of_row(samples, row: int) -> int:
    return [samples.row(p) for p in range(len(samples.index))].index(row)


def test_two_image_record_indexes_its_images_at_their_markers(tmp_path):
    want_ids, want_at, with_markers = expected(TWO)
    assert want_at == [2, 13] and with_markers == len(want_ids) + 2
    # --text-len counts text tokens only: the two marker tokens need no room
    data = write(tmp_path, TWO, one(IMG[2]))
    run, samples = load(tmp_path, data, "--preset", "llava-tiny", "--max-images", "2",
                        "--text-len", str(len(want_ids)))
    assert run.data.max_images == 2 and run.data.markers
    ix = samples.index
    assert ix.stats["bad"] == 0 and ix.stats["with_image"] == 2 and ix.stats["images"] == 3
    n = ix.rows.tolist().index(0)
    assert ix.n_images.tolist()[n] == 2 and ix.images_of(n).tolist() == want_at
    assert ix.image_offsets.tolist() == [0, *np.cumsum(ix.n_images).tolist()]
    enc, n_images = samples.tokens(position_of_row(samples, 0))
    assert n_images == 2 and enc.ids.tolist() == want_ids and enc.image_at.tolist() == want_at
    tok = run.data.tokenizer
    assert tok.convert_ids_to_tokens(enc.ids[enc.target].tolist()) == ["circle", "[EOS]", "square", "[EOS]"]
    # pixels(pos, k): image k, in marker order
    p = position_of_row(samples, 0)
    for k in range(2):
        want = samples.reader.transform(Image.open(tmp_path / IMG[k]).convert("RGB"))
        assert torch.equal(samples.pixels(p, k), want)
    assert not torch.equal(samples.pixels(p, 0), samples.pixels(p, 1))
    # a cut of the index keeps each record's images with it
    sub = ix.subset(np.array([n]), "one")
    assert sub.n_images.tolist() == [2] and sub.image_at.tolist() == want_at and sub.image_offsets.tolist() == [0, 2]


def test_more_images_than_max_images_is_a_counted_bad_record(tmp_path):
    text_only = {"conversations": [{"from": "human", "value": "what shape is red"}, {"from": "gpt", "value": "circle"}]}
    data = write(tmp_path, one(IMG[0]), TWO, one(IMG[1]), text_only)
    run, samples = load(tmp_path, data, "--preset", "llava-tiny")  # --max-images 1, the default
    s = samples.index.stats
    assert s["bad_by_kind"] == {"too_many_images": 1} and s["good"] == 3 and s["records"] == 4
    assert s["with_image"] == s["images"] == 2
    bad = [json.loads(line) for line in (tmp_path / "run" / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert [(b["where"].rsplit(":", 1)[1], b["kind"], b["reason"]) for b in bad][0] == (
        "2", "too_many_images", "2 images > --max-images 1")
    # the good records load into training items; every one has one image at most
    ts = sample_rowset(samples, run.model, run.data.text_len)
    assert sorted(int(ts[pos]["has_image"][0]) for pos in range(len(samples.index))) == [0, 1, 1]


def test_markers_must_match_the_images(tmp_path):
    two_one_marker = {**TWO, "conversations": [{**TWO["conversations"][0]}, *TWO["conversations"][1:2]]}
    records = [two_one_marker,                                               # 2 images, 1 marker
               one(IMG[0], "<image> what shape is <image> red"),            # 1 image, 2 markers
               {"conversations": one(IMG[0])["conversations"]},              # a marker, no image
               {"image": IMG[0], "conversations": [{"from": "human", "value": "<image>\nwhat shape is red"},
                                                   {"from": "gpt", "value": "<image> circle"}]},  # in an answer
               one(IMG[1])]
    _, samples = load(tmp_path, write(tmp_path, *records), "--preset", "llava-tiny", "--max-images", "2")
    assert samples.index.stats["bad_by_kind"] == {"image_marker": 4} and samples.index.stats["good"] == 1
    reasons = [json.loads(line)["reason"] for line in
               (tmp_path / "run" / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert "2 image(s) but 1 <image> marker(s)" in reasons[0]
    assert "1 image(s) but 2 <image> marker(s)" in reasons[1]
    assert "0 image(s) but 1 <image> marker(s)" in reasons[2]
    assert "turn 1 (assistant) holds an <image> marker" in reasons[3]


def _labels_of(seq: np.ndarray, target: np.ndarray) -> list[int]:
    """Position p holds seq[p + 1] where that is an answer token (BOS never), IGNORE_INDEX elsewhere."""
    out = [IGNORE_INDEX] * len(seq)
    for p in range(len(seq) - 1):
        if target[p + 1] and p + 1 >= 1:
            out[p] = int(seq[p + 1])
    return out


def test_one_image_llava_block_sits_at_its_marker_and_moondream_keeps_it_after_bos(tmp_path):
    data = write(tmp_path, one(IMG[0], "what shape is <image> red"))
    want_ids, want_at, _ = expected(one(IMG[0], "what shape is <image> red"))
    assert want_at == [5]  # [BOS] question: what shape is | <image> | red ...
    run, samples = load(tmp_path / "llava", data, "--preset", "llava-tiny", "--text-len", "12")
    token, n_ph = run.model.image_token_id, run.model.vision.n_features
    enc, n_images = samples.tokens(0)
    assert n_images == 1 and enc.ids.tolist() == want_ids and enc.image_at.tolist() == want_at
    item = sample_rowset(samples, run.model, 12)[0]
    seq = np.concatenate([enc.ids[:5], np.full(n_ph, token), enc.ids[5:]])  # the block before "red"
    target = np.concatenate([enc.target[:5], np.zeros(n_ph, bool), enc.target[5:]])
    assert item["input_ids"][:len(seq)].tolist() == seq.tolist()
    assert (item["input_ids"][len(seq):] == samples.pad_id).all()
    assert item["labels"][:len(seq)].tolist() == _labels_of(seq, target)
    assert (item["labels"][len(seq):] == IGNORE_INDEX).all()

    # the moondream family splices its image after BOS: markers are stripped, nothing moves
    run, samples = load(tmp_path / "moondream", data, "--preset", "tiny", "--text-len", "12")
    assert not run.data.markers
    enc, n_images = samples.tokens(0)
    assert n_images == 1 and enc.image_at.tolist() == [1] and enc.ids.tolist() == want_ids
    n_img = run.model.n_image_positions
    item = sample_rowset(samples, run.model, 12)[0]
    assert item["input_ids"][:n_img + len(want_ids)].tolist() == want_ids[:1] + [IMAGE_SLOT] * n_img + want_ids[1:]
    j = np.flatnonzero(enc.target)
    assert item["labels"][n_img + j - 1].tolist() == enc.ids[j].tolist()  # text token j at decoder position n_img + j


def test_truncation_keeps_every_image_marker_and_prompts_place_the_image():
    tok = builtin_tokenizer(image_token=True)
    msgs = [(("user" if t["from"] == "human" else "assistant"), t["value"]) for t in TWO["conversations"]]
    full = ConversationEncoder(tok, 64, markers=True).encode(msgs, 2)
    assert len(full.ids) == 15 and full.image_at.tolist() == [2, 13]  # the second block goes before "square"
    cut = ConversationEncoder(tok, 13, "truncate", markers=True).encode(msgs, 2)  # a block may close the text
    assert cut.truncated and cut.ids.tolist() == full.ids[:13].tolist() and cut.image_at.tolist() == [2, 13]
    with pytest.raises(BadRecord) as e:
        ConversationEncoder(tok, 12, "truncate", markers=True).encode(msgs, 2)
    assert e.value.kind == "too_long" and "marker (before token 13) would be cut" in e.value.reason
    # a generation prompt: its image at its marker, after BOS without one
    ids, at = ConversationEncoder(tok, 64, markers=True).prompt([("user", "what shape <image> is red")], n_images=1)
    assert tok.convert_ids_to_tokens(ids) == ["[BOS]", "question:", "what", "shape", "is", "red"] and at == [4]
    cfg = load_preset("llava-tiny")  # 16 placeholders of id 63
    assert image_kind(cfg).with_images(ids, cfg, at) == ids[:4] + [63] * 16 + ids[4:]
    assert image_kind(cfg).with_images(ids, cfg, None) == ids[:1] + [63] * 16 + ids[1:]  # no place given: after BOS
    assert ConversationEncoder(tok, 64, markers=True).prompt([("user", "what shape is red")], n_images=1)[1] == [1]


@pytest.mark.parametrize("flags, line", [
    (["--preset", "llava-tiny", "--max-images", "0"], "--max-images: 0 must be >= 1"),
    (["--preset", "tiny", "--max-images", "2"],
     "--max-images: 2: the moondream family splices one image after BOS; several images per sample need the "
     "LLaVA family (with --pack it sizes a row's image slots)")])
def test_max_images_refusals(tmp_path, flags, line):
    data = write(tmp_path, one(IMG[0]))
    with pytest.raises(ConfigError) as e:
        resolve(TrainArgs.from_argv(["--data", data, "--output-dir", str(tmp_path / "run"), *flags]), 2)
    assert line in str(e.value).splitlines()
