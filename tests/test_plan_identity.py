"""`mmpipe plan` prints what it printed before the planner was restructured (issue 52: the plan resolved into a record,
printing in its own module, each row kind saying its own flags): every preset x five flag sets, in-process, compared
with tests/fixtures/plan_outputs.json, recorded at the commit it names. Compared: the exit status, stdout, stderr
and the --write-config file, line for line. Left out: the wall-time line '(planned in X s, nothing allocated)', and
the one change made on purpose since (CHANGES below), each named with the commit that made it.

Regenerate (only at a commit whose output is the new reference, and say why in its message):
    OMP_NUM_THREADS=1 python tests/test_plan_identity.py --write
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "plan_outputs.json"
WALL = re.compile(r"^\(planned in \d+\.\d\d s, nothing allocated\)$")
CONFIG = "ds.json"  # --write-config's file, relative to the run's folder: the printed command names it so

# Five flag sets, each given to every preset (a preset that refuses one gives its one line and exit 2: that is
# compared too, as are the tables of a plan that nothing fits). Together: the default layouts (EP 1 on the MoE
# presets, Qwen3-VL's fixed first stage); another device and node count, fp32, ZeRO-0, checkpointing, --freeze, both
# schedules side by side; rows (--pack, --max-images) with LoRA, fp16 and zb-h1, as JSON; images of two sizes in a
# patch budget with expert parallelism (--ep 1,2: the dense presets refuse it, the fixed-size ones the sizes); a clip
# (--video-frames, --video-size) in a patch budget on a custom device, the best layout's config written out.
FLAG_SETS = {
    "default": ["--global-batch", "64", "--text-len", "24"],
    "fp32-zero0-both": ["--device", "a100-40gb", "--gpus-per-node", "4", "--nodes", "2", "--global-batch", "32",
                        "--micro", "1,2", "--text-len", "24", "--precision", "fp32", "--zero", "0", "--checkpointing",
                        "--freeze", "vision", "--schedule", "both", "--top", "5"],
    "pack-lora-json": ["--pack", "--max-images", "2", "--text-len", "24", "--gpus-per-node", "4", "--global-batch",
                       "16", "--micro", "1,2", "--lora", "4", "--schedule", "zb-h1", "--precision", "fp16", "--json"],
    "sized-ep": ["--ep", "1,2", "--image-size", "64x48,32x32", "--max-patches", "1024", "--text-len", "32",
                 "--gpus-per-node", "8", "--nodes", "2", "--global-batch", "32", "--micro", "1,2"],
    "video-custom-write": ["--video-frames", "8", "--video-size", "64x48", "--max-patches", "512", "--text-len", "32",
                           "--device", "custom", "--peak-tflops", "100", "--gpu-mem", "80", "--link-gbps", "50",
                           "--gpus-per-node", "4", "--nodes", "4", "--global-batch", "16", "--micro", "1",
                           "--write-config", CONFIG],
}


def presets() -> list[str]:
    from mmpipe.config import list_presets
    return list_presets()


def run_plan(preset: str, argv: list[str], folder: Path) -> dict:
    """One `mmpipe plan` in this process, run in `folder`: its exit status, stdout, stderr and written config."""
    from mmpipe.cli import main
    out, err, here = io.StringIO(), io.StringIO(), Path.cwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(["plan", "--preset", preset, *argv])
            except SystemExit as e:  # argparse's own refusals
                rc = e.code
        config = Path(CONFIG)
        written = config.read_text() if config.exists() else None
        if written is not None:
            config.unlink()
    finally:
        os.chdir(here)
    return {"rc": rc, "stdout": out.getvalue().splitlines(), "stderr": err.getvalue().splitlines(),
            "config": written}


def without_wall_time(lines: list[str]) -> list[str]:
    return [line for line in lines if not WALL.match(line)]


# What changed on purpose since the fixture's commit, each a function of (preset, flag set, recorded stdout) ->
# the stdout expected now; applied in order, each after the commit it names.
def _no_a2a_at_ep1(lines: list[str]) -> list[str]:
    """Issue 53 item 2: at EP 1 no all-to-all runs, so the best layout's per-rank line names the parameters only
    ('stage 0 1,234 params, all-to-all 1442.2 MiB / 0.00 ms a micro-batch' -> 'stage 0 1,234 params')."""
    best = next((line for line in lines if line.startswith("best: ")), "")
    if "(ep 1)" not in best:
        return lines
    return [re.sub(r" params, all-to-all [\d.]+ MiB / [\d.]+ ms a micro-batch", " params", line)
            if line.startswith("per rank: ") else line for line in lines]


CHANGES = [_no_a2a_at_ep1]


def expected_stdout(recorded: list[str]) -> list[str]:
    lines = without_wall_time(recorded)
    for change in CHANGES:
        lines = change(lines)
    return lines


def record(folder: Path) -> dict:
    commit = _commit()
    outputs = {f"{preset} {name}": run_plan(preset, argv, folder) for preset in presets()
               for name, argv in FLAG_SETS.items()}
    return {"commit": commit, "flag_sets": FLAG_SETS, "outputs": outputs}


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_fixture_covers_every_preset_and_flag_set(recorded):
    """A preset added since the fixture was written must be recorded (regenerate) before it counts as unchanged."""
    assert recorded["flag_sets"] == FLAG_SETS
    assert sorted(recorded["outputs"]) == sorted(f"{p} {n}" for p in presets() for n in FLAG_SETS)


def test_each_change_rewrites_a_recorded_output(recorded):
    """Each change named in CHANGES applies to some recorded plan (else it hides nothing and goes), and only where
    it says: the EP-1 per-rank line loses its all-to-all, an EP-2 one keeps it."""
    outs = [o["stdout"] for o in recorded["outputs"].values()]
    for change in CHANGES:
        assert any(change(lines) != lines for lines in outs), change.__name__
    ep2 = [lines for lines in outs if any(x.startswith("best: ") and "(ep 2)" in x for x in lines)]
    assert ep2 and all(_no_a2a_at_ep1(lines) == lines for lines in ep2)
    assert all(" MiB / " in x for lines in ep2 for x in lines if x.startswith("per rank: "))


def test_each_rerecorded_output_changed_and_says_why(recorded):
    """A plan recorded again names its commit and why, and differs from its 368cfab output beyond the wall time."""
    for key, again in recorded.get("rerecorded", {}).items():
        assert again["commit"] and again["why"], key
        was, now = recorded["outputs"][key], again["output"]
        assert {**was, "stdout": expected_stdout(was["stdout"])} != {**now, "stdout": without_wall_time(now["stdout"])}


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_plan_output_is_unchanged(recorded, name, tmp_path):
    """Every preset under one flag set: the same exit status, stdout (apart from the wall-time line and CHANGES),
    stderr and written config as at the fixture's commit."""
    differ = []
    for preset in presets():
        key = f"{preset} {name}"
        was, now = recorded["outputs"][key], run_plan(preset, FLAG_SETS[name], tmp_path)
        if key in recorded.get("rerecorded", {}):  # changed on purpose at a later commit: that commit's output
            was = recorded["rerecorded"][key]["output"]
        want = {**was, "stdout": expected_stdout(was["stdout"])}
        got = {**now, "stdout": without_wall_time(now["stdout"])}
        if got != want:
            field = next(k for k in want if got[k] != want[k])
            differ.append(f"{preset}: {field}: {_first_difference(want[field], got[field])}")
    assert not differ, f"{len(differ)} presets' plan differs under {name}:\n" + "\n".join(differ)


def _first_difference(want, got) -> str:
    if isinstance(want, list) and isinstance(got, list):
        for k, (a, b) in enumerate(zip(want, got)):
            if a != b:
                return f"line {k}: was {a!r}, now {b!r}"
        return f"{len(want)} lines before, {len(got)} now"
    return f"was {want!r}, now {got!r}"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()


def rerecord(key: str, why: str, folder: Path) -> None:
    """Record one plan again (a change made on purpose), beside its original output."""
    fixture = json.loads(FIXTURE.read_text())
    preset, name = key.rsplit(" ", 1)
    output = run_plan(preset, FLAG_SETS[name], folder)
    fixture.setdefault("rerecorded", {})[key] = {"commit": _commit(), "why": why, "output": output}
    FIXTURE.write_text(json.dumps(fixture, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        if sys.argv[1:] == ["--write"]:
            FIXTURE.write_text(json.dumps(record(Path(tmp)), indent=1) + "\n")
        elif len(sys.argv) == 4 and sys.argv[1] == "--rerecord":
            rerecord(sys.argv[2], sys.argv[3], Path(tmp))
        else:
            sys.exit("usage: python tests/test_plan_identity.py --write | --rerecord 'PRESET FLAGSET' 'WHY'")
    print(f"wrote {FIXTURE}")
