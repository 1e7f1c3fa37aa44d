"""The built-in shapes VQA set: deterministic, unambiguous, held out, answerable only from the image."""
from __future__ import annotations

import torch

from mmpipe.config import load_preset
from mmpipe.data.batches import StepBatches, micro_batch_indices, rank_batches
from mmpipe.data.packing import sample_rowset
from mmpipe.data.samples import SHAPES_TEXT_LEN, ShapesSamples
from mmpipe.data.shapes import QUESTION_TYPES, ShapesVQA
from mmpipe.inference.evaluate import blind_baseline
from mmpipe.model import IGNORE_INDEX
from mmpipe.model.rows import IMAGE_SLOT


def test_samples_are_deterministic_by_seed_and_index():
    a, b, c = ShapesVQA(64, 16, seed=1), ShapesVQA(64, 16, seed=1), ShapesVQA(64, 16, seed=2)
    assert [a.sample(i) for i in range(50)] == [b.sample(i) for i in range(50)]
    assert a.render(a.sample(7)).tobytes() == b.render(b.sample(7)).tobytes()
    assert [a.sample(i) for i in range(50)] != [c.sample(i) for i in range(50)]


def test_eval_split_is_a_different_stream():
    train, held = ShapesVQA(64, 16, "train", 0), ShapesVQA(64, 16, "eval", 0)
    assert sum(train.sample(i) == held.sample(i) for i in range(500)) == 0


def test_questions_are_unambiguous_and_balanced():
    data = ShapesVQA(64, 16)
    counts = {q: 0 for q in QUESTION_TYPES}
    for i in range(1200):
        s = data.sample(i)
        counts[s.qtype] += 1
        kinds, colours, quarters = zip(*[(x.kind, x.colour, x.quarter) for x in s.shapes])
        assert len(set(kinds)) == len(set(colours)) == len(set(quarters)) == len(s.shapes)
        for x in s.shapes:  # inside the image, inside one patch cell
            x0, y0, x1, y1 = x.box
            assert 0 <= x0 <= x1 < 64 and 0 <= y0 <= y1 < 64
            assert x0 // 16 == x1 // 16 and y0 // 16 == y1 // 16
            assert (x0 // 32) + 2 * (y0 // 32) == x.quarter
    assert set(counts.values()) == {1200 // len(QUESTION_TYPES)}


def test_blind_guessing_scores_at_most_25_percent():
    res = blind_baseline(load_preset("small"), seed=0, n_samples=50000)
    assert res["accuracy"] <= 0.25
    assert max(res["per_type"].values()) < 0.28  # the best single types have 4 answers: ~25%


def test_labels_cover_answer_and_eos_only():
    cfg = load_preset("small")
    shapes = ShapesSamples(cfg, 0)
    tok = shapes.tok
    s = shapes.data.sample(3)  # a where_is_shape question
    item = sample_rowset(shapes, cfg, SHAPES_TEXT_LEN)[3]
    ids, labels = item["input_ids"], item["labels"]
    n_img = cfg.vision.n_tokens
    answer = tok(s.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert labels[labels != IGNORE_INDEX].tolist() == answer
    # the first labelled position is the question's last word (its key word), at decoder position n_img + j
    prompt = shapes.encoder.prompt_ids([("user", s.question)])
    j = len(prompt) - 1
    assert labels[n_img + j] == answer[0]
    assert ids[n_img + j] == tok.convert_tokens_to_ids(s.question.split()[-1])
    assert (ids[1:1 + n_img] == IMAGE_SLOT).all() and item["has_image"].tolist() == [1]
    # training text = the generation prompt + the answer
    assert [ids[0]] + ids[1 + n_img:n_img + len(prompt)].tolist() == prompt


def test_first_and_last_stage_streams_agree_and_last_skips_images():
    cfg = load_preset("tiny")

    def stream(**kw):
        data = sample_rowset(ShapesSamples(cfg, 0), cfg, SHAPES_TEXT_LEN, **kw)
        return rank_batches(data, StepBatches(2 * 12, 4, 3, 0, 1))
    first, last, both = stream(need_labels=False), stream(need_images=False), stream()
    for _ in range(7):
        (pix, ids, has_image, segments), no_labels = next(first)
        ints, labels = next(last)  # the integer tensors alone: what a later stage joins to what it receives
        (pix2, ids2, _, _), labels2 = next(both)
        assert no_labels is None and torch.equal(ints[0], ids) and torch.equal(ints[2], segments)
        assert torch.equal(ids, ids2) and torch.equal(labels, labels2) and torch.equal(pix, pix2)
        assert has_image.tolist() == [[1]] * 4


def test_data_parallel_ranks_see_disjoint_samples():
    # 4 micro x 3 GAS x 2 DP = 24 samples per step
    seen = [i for d in range(2) for mb in micro_batch_indices(5, 4, 3, d, 2) for i in mb]
    assert sorted(seen) == list(range(5 * 24, 6 * 24))


def _indexed(tmp_path, n=30):

    from mmpipe.data.dataset import prepare
    from mmpipe.data.export import export_shapes
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    data = export_shapes(tmp_path / "d", "llava-jsonl", n)
    run = resolve(TrainArgs.from_argv(["--preset", "tiny", "--data", str(data), "--output-dir", str(tmp_path / "o"),
                                "--text-len", "24"]), world_size=2)
    return run, prepare(run.data, run.model, tmp_path / "o", seed=4, verbose=False)


def test_user_data_dp_shards_are_disjoint_and_complete_per_epoch(tmp_path):
    run, samples = _indexed(tmp_path)  # 30 records; 3 micro x 1 GAS x 2 DP = 6 per step: 5 steps an epoch
    for epoch in range(2):
        rows = {d: [samples.row(p) for s in range(5 * epoch, 5 * epoch + 5) for mb in micro_batch_indices(s, 3, 1, d, 2)
                    for p in mb] for d in range(2)}
        assert not set(rows[0]) & set(rows[1])
        assert sorted(rows[0] + rows[1]) == list(range(30))
    # a new order each epoch, the same order for the same seed
    assert [samples.row(p) for p in range(30)] != [samples.row(p) for p in range(30, 60)]
    assert [samples.row(p) for p in range(60)] == [_indexed(tmp_path / "again")[1].row(p) for p in range(60)]


def test_user_data_first_and_last_stage_agree_per_micro_batch(tmp_path):
    run, samples = _indexed(tmp_path)
    first = rank_batches(sample_rowset(samples, run.model, run.text_len, need_labels=False),
                         StepBatches(3 * 16, 4, 2, 1, 2), workers=2)
    last = rank_batches(sample_rowset(samples, run.model, run.text_len, need_images=False),
                        StepBatches(3 * 16, 4, 2, 1, 2))
    for _ in range(6):
        (pixels, ids, has_image, segments), no_labels = next(first)
        ints, labels = next(last)  # the last stage: no images, the integer tensors it joins to what it receives
        assert no_labels is None and pixels.shape == (4, 1, 3, 32, 32)
        assert len(ints) == 3 and all(torch.equal(a, b) for a, b in zip(ints, (ids, has_image, segments)))
        # the labels are the next tokens of the same texts the first stage embeds
        target = labels[:, :-1]
        keep = target != IGNORE_INDEX
        assert keep.any() and torch.equal(target[keep], ids[:, 1:][keep])


def test_forked_loader_workers_read_the_right_records(tmp_path):
    """The rank reads the JSONL (index build, a first image) before its DataLoader forks workers:
    they share its file descriptor, and must still each read exactly their record."""
    run, samples = _indexed(tmp_path, n=120)
    ref = sample_rowset(samples, run.model, run.text_len)
    ref[0]  # the parent opens the file first
    stream = rank_batches(sample_rowset(samples, run.model, run.text_len), StepBatches(0, 8, 1, 0, 1), workers=2)
    for k in range(30):
        (pixels, *_), _ = next(stream)
        assert torch.equal(pixels, torch.stack([ref[p]["pixels"] for p in range(8 * k, 8 * k + 8)])), k
