"""`mmpipe eval`: a checkpoint answers a held-out LLaVA-format file through the training data
pipeline. Its per-record answers equal generating one record at a time from the question alone
(moondream-shaped run trained 3 steps on 2 stages; an untrained LLaVA checkpoint), its metric is
the count the answers file shows, its validation loss the one training computed on the same file,
and a text-only record and a bad record are handled as training handles them."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import train_run, write_checkpoint, write_ds_config
from mmpipe.cli import main as cli_main
from mmpipe.config import load_preset
from mmpipe.data.export import export_shapes
from mmpipe.data.image_kinds import image_kind
from mmpipe.data.images import ImageTransform
from mmpipe.data.shapes import ShapesVQA
from mmpipe.data.text import ConversationEncoder
from mmpipe.data.tokenizer import builtin_tokenizer
from mmpipe.inference.generate import generate, load_checkpoint
from mmpipe.inference.sampling import Sampling
from mmpipe.inference.scoring import normalise, score
from mmpipe.model import ReferenceModel

N_TRAIN, N_HELD = 24, 8
TEXT_ONLY = {"id": "text-only", "conversations": [{"from": "human", "value": "how many shapes are there"},
                                                  {"from": "gpt", "value": "two"}]}
BAD = {"id": "bad", "image": "images/nowhere.png", "conversations": [
    {"from": "human", "value": "<image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"}]}


def mmpipe_eval(*argv: str) -> int:
    return cli_main(["eval", *argv])  # the command line as typed, shared flags (--dry-run) included


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """32 exported shapes records: the first 24 train; the last 8 are held out, each naming its
    question type, followed by a text-only record and a bad one (its image is missing)."""
    root = tmp_path_factory.mktemp("data")
    exported = export_shapes(root, "llava-jsonl", N_TRAIN + N_HELD, image_size=32, patch=8)
    records = [json.loads(line) for line in exported.read_text().splitlines()]
    shapes = ShapesVQA(32, 8, "train", 0)  # what export_shapes drew the records from
    for i, r in enumerate(records):
        r["type"] = shapes.sample(i).qtype
    train, held = root / "train_part.jsonl", root / "held_out.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records[:N_TRAIN]))
    held.write_text("".join(json.dumps(r) + "\n" for r in records[N_TRAIN:] + [TEXT_ONLY, BAD]))
    return train, held


@pytest.fixture(scope="module")
def run(tmp_path_factory, data):
    """3 steps on 2 stages, validated at the end on the held-out file."""
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = write_ds_config(out.parent / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1)
    return train_run(out, "--preset", "tiny", "--ds-config", str(cfg), "--data", str(data[0]), "--steps", "3",
                     "--eval-samples", "0", "--text-len", "24", "--eval-data", str(data[1])).check()


def one_at_a_time(model, held: Path, max_new_tokens: int) -> list[str]:
    """Each good record answered alone from its first question, as `mmpipe generate` would: the
    built-in tokenizer's generation prompt, the image (none for a text-only record) at its <image> marker
    (the LLaVA family; the moondream family splices it after BOS)."""
    cfg = model.cfg
    tok = builtin_tokenizer(image_token=image_kind(cfg).markers)
    encoder = ConversationEncoder(tok, cfg.text.max_context, markers=image_kind(cfg).markers)
    answers = []
    for r in map(json.loads, held.read_text().splitlines()):
        if r.get("id") == "bad":
            continue
        has_image = "image" in r
        prompt, image_at = encoder.prompt([("user", r["conversations"][0]["value"])], n_images=int(has_image))
        if has_image:
            pixels = ImageTransform(cfg.vision)(Image.open(held.parent / r["image"]).convert("RGB"))[None]
            prompt = image_kind(cfg).with_images(prompt, cfg, image_at)
        else:
            pixels = torch.zeros(1, 3, cfg.vision.image_size, cfg.vision.image_size)
        sampling = Sampling(eos_id=tok.eos_token_id, max_new_tokens=max_new_tokens,
                            n_tokens=len(tok))  # only the tokenizer's text ids, as generate picks
        new = generate(model, pixels, prompt, sampling, has_image=has_image)
        answers.append(tok.decode(new, skip_special_tokens=True).strip())
    return answers


def read(out: Path) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return lines, json.loads(out.with_name(out.stem + ".summary.json").read_text())


def test_scores():
    assert normalise("  Circle.\n") == "circle" and score("exact", "Two!", "two") == 1
    assert score("exact", "two shapes", "two") == 0 and score("contains", "Two shapes.", "two") == 1
    assert score("contains", "one", "two") == 0


def test_eval_answers_as_one_at_a_time_and_scores_what_it_wrote(tmp_path, data, run, capsys):
    train, held = data
    out = tmp_path / "eval" / "answers.jsonl"
    assert mmpipe_eval("--checkpoint", str(run.out), "--data", str(held), "--out", str(out), "--batch-size", "3",
                       "--max-new-tokens", "4", "--text-len", "24") == 0
    printed = capsys.readouterr().out
    assert "1 skipped: 1 missing_image" in printed and "mmpipe: eval: exact" in printed
    lines, summary = read(out)
    # every good record in file order; the bad one (row 9) counted and left out, as training does
    assert [x["row"] for x in lines] == list(range(N_HELD + 1))
    assert (summary["n"], summary["records"], summary["bad_records"]) == (N_HELD + 1, N_HELD + 2, 1)
    assert summary["bad_by_kind"] == {"missing_image": 1}
    assert (out.parent / "eval_data" / "bad_records.jsonl").is_file()  # the index beside --out
    # the answers are what one-at-a-time generation gives (the 2-stage checkpoint, loaded as generate does)
    model, _ = load_checkpoint(run.out)
    assert [x["answer"] for x in lines] == one_at_a_time(model, held, 4)
    records = [json.loads(line) for line in held.read_text().splitlines()]
    assert [x["reference"] for x in lines] == [r["conversations"][1]["value"] for r in records[:-1]]
    assert [x["prompt"] for x in lines] == ["question: " + r["conversations"][0]["value"].replace("<image>\n", "")
                                            for r in records[:-1]]
    # the text-only record: answered without an image, and has no type; the others name theirs
    assert [x["has_image"] for x in lines] == [True] * N_HELD + [False]
    assert [x.get("type") for x in lines] == [r.get("type") for r in records[:-1]]
    # the metric is the count the answers file shows, overall and per type
    hits = [int(normalise(x["answer"]) == normalise(x["reference"])) for x in lines]
    assert [x["score"] for x in lines] == hits and summary["correct"] == sum(hits)
    assert summary["exact"] == sum(hits) / len(hits)
    for qtype, got in summary["per_type"].items():
        mine = [h for h, x in zip(hits, lines) if x.get("type") == qtype]
        assert got == {"exact": sum(mine) / len(mine), "n": len(mine)}
    assert sum(v["n"] for v in summary["per_type"].values()) == N_HELD
    # the teacher-forced loss is the validation loss training computed on the same file with the same weights
    assert summary["val_loss"] == pytest.approx(run.summary["eval_loss"], abs=1e-5)
    assert summary["samples_per_s"] > 0

    # answers that match: make two references the model's own answers; the answers do not change
    # (the prompt is everything before the first answer token) and both now count
    picked = [i for i, x in enumerate(lines[:N_HELD]) if x["answer"] and not x["score"]][:2]
    assert len(picked) == 2
    for i in picked:
        records[i]["conversations"][1]["value"] = lines[i]["answer"]
    held2 = held.with_name("held_out_2.jsonl")
    held2.write_text("".join(json.dumps(r) + "\n" for r in records))
    for metric in ("exact", "contains"):
        out2 = tmp_path / metric / "answers.jsonl"
        assert mmpipe_eval("--checkpoint", str(run.out / "checkpoints"), "--data", str(held2), "--out", str(out2),
                           "--max-new-tokens", "4", "--metric", metric) == 0
        lines2, summary2 = read(out2)
        assert [x["answer"] for x in lines2] == [x["answer"] for x in lines]
        hits2 = [score(metric, x["answer"], x["reference"]) for x in lines2]
        assert all(hits2[i] for i in picked) and summary2["correct"] == sum(hits2) >= sum(hits) + 2
        assert summary2[metric] == sum(hits2) / len(hits2)


def test_eval_llava_family_and_refusals(tmp_path, data, capsys):
    """An untrained LLaVA checkpoint (placeholders after BOS for image records, none for the text-only
    one) answers as one at a time; bad input is one `mmpipe: error:` line and exit 2."""
    cfg = load_preset("llava-tiny")
    cfg = dataclasses.replace(cfg, image_token_id=len(builtin_tokenizer(image_token=True)) - 1).with_vocab(64)
    model = ReferenceModel(cfg, seed=3)
    write_checkpoint(model, tmp_path)
    held = data[1]
    out = tmp_path / "eval" / "answers.jsonl"
    assert mmpipe_eval("--checkpoint", str(tmp_path), "--data", str(held), "--out", str(out),
                       "--max-new-tokens", "3", "--batch-size", "4") == 0
    lines, summary = read(out)
    assert [x["answer"] for x in lines] == one_at_a_time(model, held, 3)
    assert summary["n"] == N_HELD + 1 and summary["bad_records"] == 1 and lines[-1]["has_image"] is False
    # a record of two images: eval scores one a record and has no --max-images, so its reason names what takes more
    first = json.loads(held.read_text().splitlines()[0])
    two = dict(first, image=[first["image"]] * 2, conversations=[
        {"from": "human", "value": "<image> and <image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"}])
    (tmp_path / "two.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(two) + "\n")
    capsys.readouterr()
    assert mmpipe_eval("--checkpoint", str(tmp_path), "--data", str(tmp_path / "two.jsonl"), "--image-root",
                       str(held.parent), "--out", str(tmp_path / "two" / "answers.jsonl"), "--dry-run") == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "too_many_images:" in ln]
    assert line.endswith(":2: too_many_images: 2 images > 1 (mmpipe eval scores records of one image; training's "
                         "validation takes more: mmpipe train --eval-data FILE --max-images N)"), line
    for argv, start in [
        (["--checkpoint", str(tmp_path / "nope"), "--data", str(held)], "--checkpoint:"),
        (["--checkpoint", str(tmp_path), "--data", str(tmp_path / "nope.jsonl")], "--data:"),
        (["--checkpoint", str(tmp_path), "--data", str(held), "--bad-records", "strict"], "--bad-records strict:"),
        (["--checkpoint", str(tmp_path), "--data", str(held), "--batch-size", "0"], "--batch-size:"),
    ]:
        assert mmpipe_eval(*argv, "--out", str(tmp_path / "refused" / "answers.jsonl")) == 2
        err = capsys.readouterr().err
        assert err.startswith("mmpipe: error: " + start), err


def test_eval_names_the_bad_record_list_by_its_path(tmp_path, data, capsys, monkeypatch):
    """More bad records than the report shows one per line (10): the last line names the list by the absolute path
    the run wrote (--out relative, as typed), which holds every one; a dry run, which keeps no list, names where a
    run writes it; --bad-records strict's refusal names it too."""
    from mmpipe.data.index import SHOW_BAD
    write_checkpoint(ReferenceModel(load_preset("tiny").with_vocab(len(builtin_tokenizer())), seed=3), tmp_path / "m")
    held = data[1]
    bad = [dict(BAD, id=f"bad{i}") for i in range(SHOW_BAD + 4)]
    records = [json.loads(line) for line in held.read_text().splitlines()][:2] + bad
    (tmp_path / "many_bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.chdir(tmp_path)
    argv = ["--checkpoint", "m", "--data", "many_bad.jsonl", "--image-root", str(held.parent), "--out",
            "eval/answers.jsonl", "--max-new-tokens", "1"]
    listed = tmp_path / "eval" / "eval_data" / "bad_records.jsonl"
    capsys.readouterr()
    assert mmpipe_eval(*argv, "--dry-run") == 0
    assert f"mmpipe: data: ... 4 more; all 14 listed in {listed} once run without --dry-run (a dry run keeps no " \
           f"list)\n" in capsys.readouterr().out and not listed.exists()
    assert mmpipe_eval(*argv) == 0
    assert f"mmpipe: data: ... 4 more; all 14 listed in {listed}\n" in capsys.readouterr().out
    assert [json.loads(line)["where"].endswith(f":{3 + i}") for i, line in
            enumerate(listed.read_text().splitlines())] == [True] * 14
    assert mmpipe_eval(*argv, "--bad-records", "strict") == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"mmpipe: error: --bad-records strict: ... and 4 more; 14 bad records in all: 14 missing_image; " \
                   f"all listed in {listed}"


def test_a_record_whose_answer_tokenizes_to_nothing_is_a_bad_record(tmp_path, data, capsys):
    """A tokenizer that maps an answer's text to no token (here its normalizer drops '@'): the record is counted bad
    (empty_answer, with its reason, in the summary's bad records and on stderr) and scored nowhere, where before it
    was scored as an empty reference against the answer."""
    from tokenizers import normalizers
    cfg = load_preset("llava-tiny")
    tok = builtin_tokenizer(image_token=True)
    cfg = dataclasses.replace(cfg, image_token_id=len(tok) - 1).with_vocab(64)
    write_checkpoint(ReferenceModel(cfg, seed=3), tmp_path)
    tok.backend_tokenizer.normalizer = normalizers.Replace("@", "")
    tok.save_pretrained(tmp_path / "tok")
    records = [json.loads(line) for line in data[1].read_text().splitlines()][:2]
    records.append(dict(records[0], id="at", conversations=[records[0]["conversations"][0],
                                                            {"from": "gpt", "value": "@@ @"}]))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "eval" / "answers.jsonl"
    assert mmpipe_eval("--checkpoint", str(tmp_path), "--data", str(tmp_path / "held.jsonl"), "--image-root",
                       str(data[1].parent), "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
                       "--max-new-tokens", "2") == 0
    lines, summary = read(out)
    assert summary["n"] == len(lines) == 2 and summary["bad_records"] == 1
    assert summary["bad_by_kind"] == {"empty_answer": 1}
    assert [(b["row"], b["kind"]) for b in summary["bad_after_tokenizing"]] == [(2, "empty_answer")]
    assert "1 bad records skipped after tokenizing (empty_answer, row 2: the first answer tokenizes to no token" \
        in capsys.readouterr().err
