"""A checkpoint saved before a change resumes with today's code and goes on bit for bit as the old code did: one
run of each family, PP=2, from tests/fixtures/prechange/ (made by tests/fixtures/make_prechange_checkpoints.py).
tiny, tiny-xattn, llava-tiny, llava-next-tiny and qwen-tiny were made by commit bc9da67, before the family object
(issue 40: named stage fields, image kinds, schedules as records); qwen3-vl-micro, qwen3.5-micro and
qwen3-vl-moe-micro (the Qwen3-VL and Qwen3.5 families and an MoE decoder: their tiny presets shrunk, model JSONs in
the fixture folder) by commit 368cfab, before one registry entry per family (issue 52). The step after the
checkpoint must give the old code's loss (its logged digits) and its weights (a digest of every tensor of every
layer file). One launch for the eight (tests/rank_series.py: the ranks resume one checkpoint after another, each run
the rank code `mmpipe train` starts after its front door's own in the test process; a launch each cost ~15 s of
start-up); the cross-attention family's carried vision, the dynamic families' tilings, DeepStack's sets and the MoE
router statistics are stage fields that cross the cut.

The old code's step is recorded per CPU vendor (expected.json: runs[preset][vendor]): the same code gives other bits
on an Intel Xeon and an AMD EPYC (oneDNN's kernels differ; qwen-tiny's loss in its 7th digit, every weight digest),
while on one machine it is bit for bit. The AMD figures of the bc9da67 runs were made by 368cfab, which equals
bc9da67 on these fixtures (it passed them on Intel). A vendor with no record skips, saying how to make one: run this
file from a checkout of the run's commit with MMPIPE_PRECHANGE_RECORD=FILE, which writes what the old code got."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import tarfile
from pathlib import Path

import pytest

from conftest import ROOT, Run
from rank_series import launch_series

FIXTURES = Path(__file__).parent / "fixtures"
_spec = importlib.util.spec_from_file_location("make_prechange", FIXTURES / "make_prechange_checkpoints.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
EXPECTED = json.loads((make.HERE / "expected.json").read_text())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, Run]:
    """Every preset's checkpoint resumed at PP=2 to its last step (`mmpipe train --resume`), the eight in one launch
    (tests/rank_series.py: each run's front door here, then its ranks' run after the last one's)."""
    root = tmp_path_factory.mktemp("prechange")
    cfg = make.ds_config(ROOT, root / "ds.json")
    runs = []
    for preset in make.PRESETS:
        out = root / preset
        with tarfile.open(make.HERE / f"{preset}.tar.gz") as tar:
            tar.extractall(out, filter="data")
        runs.append((out, [*make.train_args(preset, cfg, out)[:-2], "--resume"], {}))
    return dict(zip(make.PRESETS, launch_series(runs)))


@pytest.mark.parametrize("preset", make.PRESETS)
def test_a_prechange_checkpoint_resumes_bit_for_bit(resumed, preset):
    run = resumed[preset].check()
    out = run.out
    assert run.summary["start_step"] == make.KEPT
    with open(out / "train_log.csv") as f:
        last = list(csv.DictReader(f))[-1]
    vendor = make.cpu_vendor()
    got = {"loss": last["loss"], "weights": make.digest(out / "checkpoints" / f"step{make.STEPS}")}
    if os.environ.get("MMPIPE_PRECHANGE_RECORD"):  # recording the old code's step on this CPU (docstring)
        _record(Path(os.environ["MMPIPE_PRECHANGE_RECORD"]), preset, vendor, got)
        return
    want = EXPECTED["runs"][preset].get(vendor)
    if want is None:
        pytest.skip(f"{preset}: the old code's step is recorded on {', '.join(EXPECTED['runs'][preset])} only, not "
                    f"{vendor}: record it with MMPIPE_PRECHANGE_RECORD (this file's docstring)")
    assert (int(last["step"]), got["loss"]) == (make.STEPS, want["loss"])
    assert got["weights"] == want["weights"]


def _record(path: Path, preset: str, vendor: str, got: dict) -> None:
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.setdefault(preset, {})[vendor] = got
    path.write_text(json.dumps(old, indent=1) + "\n")
