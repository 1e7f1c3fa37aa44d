"""User data end to end: a LLaVA-format set trains in a 2-stage pipeline, bad records are counted
and left out (never fatal, never silent), and --resume continues with exactly the next sample."""
from __future__ import annotations

import csv
import json

import pytest

from conftest import cut_at, refused, train_run, write_ds_config
from fixtures_data import HUGE_LIMIT, write_fuzz_set
from mmpipe.data.records import BAD_KINDS

STEPS = 10  # two epochs of write_fuzz_set's 40 good records


@pytest.fixture(scope="module")
def small_batches(tmp_path_factory):
    """4 micro x 2 GAS = 8 samples per step; a fixed STEPS-step schedule, so a resumed run follows the same one."""
    d = tmp_path_factory.mktemp("cfg")
    return write_ds_config(
        d / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": STEPS, "warmup_num_steps": 2,
                                                       "warmup_type": "linear", "warmup_min_ratio": 0.1}})


def _seen(out) -> list[tuple[int, int]]:
    with open(out / "samples_dp0.csv") as f:
        return [(int(r["position"]), int(r["row"])) for r in csv.DictReader(f)]


def _args(cfg, data, *extra):
    return ["--preset", "tiny", "--ds-config", str(cfg), "--data", str(data), "--eval-samples", "0", "--seed", "1",
            "--stages", "2", "--text-len", "24", "--log-samples", *extra]


def test_llava_jsonl_with_bad_records_trains_on_every_good_one_and_resumes_at_the_next_sample(tmp_path,
                                                                                                 small_batches):
    """One run carries both: the bad records are counted and left out, every good record is trained on
    once an epoch, and a run stopped half-way and resumed sees exactly the same samples."""
    data, injected, good_rows = write_fuzz_set(tmp_path / "data")  # 40 good records: 5 steps an epoch
    args = _args(small_batches, data, "--max-image-pixels", str(HUGE_LIMIT))
    half = STEPS // 2
    # checkpointed half-way as well: the resume below starts from a copy cut there (conftest.cut_at: the files a run of
    # --steps 5 leaves, its summary.json aside, which --resume does not read; the schedule is fixed at STEPS, so that
    # run's step-5 checkpoint is this one), one launch fewer than stopping a run of its own
    full = train_run(tmp_path / "full", *args, "--steps", str(STEPS), "--save-every", str(half)).check()
    s = full.summary
    assert s["stages"] == 2 and s["data"]["bad_by_kind"] == injected
    assert s["data"]["good"] == len(good_rows) and s["data"]["records"] == len(good_rows) + sum(injected.values())
    assert s["data"]["with_image"] == len(good_rows) - 2
    assert s["data"]["epochs"] == pytest.approx(STEPS * 8 / len(good_rows))
    listed = [json.loads(line) for line in (full.out / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert len(listed) == sum(injected.values()) and all(b["where"].startswith(str(data) + ":") for b in listed)
    assert "15 skipped" in full.proc.stdout
    # 10 steps x 8 = 80 positions in order; every epoch (40 positions) visits each good record once
    seen = _seen(full.out)
    assert [p for p, _ in seen] == list(range(STEPS * 8))
    for e in range(2):
        assert sorted(r for _, r in seen[40 * e:40 * (e + 1)]) == good_rows
    assert [r for _, r in seen[:40]] != good_rows  # shuffled, deterministically by (seed, epoch)

    resumed = train_run(cut_at(full, tmp_path / "resumed", half), *args, "--steps", str(STEPS), "--resume").check()
    assert resumed.summary["start_step"] == half
    assert _seen(resumed.out) == seen  # nothing repeated, nothing skipped
    for step, loss in full.losses.items():
        assert resumed.losses[step] == pytest.approx(loss, abs=1e-6), step


def test_strict_policy_stops_before_training_naming_file_line_and_reason(tmp_path, capsys):
    data, injected, _ = write_fuzz_set(tmp_path / "data")
    errors = refused(["--preset", "tiny", "--data", str(data), "--output-dir", str(tmp_path / "run"),
                      "--text-len", "24", "--bad-records", "strict", "--steps", "2",
                      "--max-image-pixels", str(HUGE_LIMIT)], capsys)
    assert errors[0] == (f"mmpipe: error: --bad-records strict: {data}:2: corrupt_image: "
                         f"{tmp_path / 'data' / 'images' / 'corrupt.png'}: not a recognised image format")
    assert len(errors) == 11  # the first 10 bad records, then the counts by kind
    n = sum(injected.values())
    kinds = ", ".join(f"{injected[k]} {k}" for k in BAD_KINDS if k in injected)
    assert errors[-1] == (f"mmpipe: error: --bad-records strict: ... and {n - 10} more; {n} bad records in all: "
                          f"{kinds}; all listed in {tmp_path / 'run' / 'data' / 'bad_records.jsonl'}")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_dataset_of_only_bad_records_is_a_clear_error(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"conversations": []}\nnot json\n')
    assert refused(["--preset", "tiny", "--data", str(data), "--output-dir", str(tmp_path / "run")], capsys) == [
        f"mmpipe: error: --data: every one of the 2 records of {data} is bad (1 bad_json, 1 missing_field); "
        f"first: {data}:1: missing_field: 'conversations' is missing or not a non-empty list"]
