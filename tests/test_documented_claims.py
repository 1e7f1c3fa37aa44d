"""Claims the docs make that no other test checked (issue 59 item 6), in-process, seconds:

- docs/video.md: a clip without its `<video>` marker is a bad record (`video_marker`), counted and written to
  bad_records.jsonl with its reason, and the record beside it with its marker indexes good;
- docs/architecture.md: a family registers through the `mmpipe.families` entry point of an installed package, which
  `registry.load()` imports on the first question (the entry point's module is tests/toy_family.py, registered as
  an installed distribution's metadata on sys.path here, as pip would leave it).

(docs/moe.md's fp32 EP checkpoint resuming under another DP: tests/test_moe_ep.py.)"""
from __future__ import annotations

import json

from test_multi_image_data import load
from video_clips import moving_square, write_clip
from video_records import conv


def test_a_clip_without_its_marker_is_a_bad_record(tmp_path):
    """docs/video.md's bad-record table: "a <video> marker without a clip, or a clip without a marker" is
    video_marker. The record with a clip and no marker is counted bad, with the reason naming both counts; the same
    clip with its marker is good."""
    from test_qwen_data import save_tokenizer  # qwen-tiny's vision specials at 197 .. 199
    write_clip(tmp_path / "c.mp4", moving_square(4, 56, 56), 4)
    save_tokenizer(tmp_path / "tok")
    records = [{"video": "c.mp4", "conversations": conv("<video>\nw5 w6", "w7")},
               {"video": "c.mp4", "conversations": conv("w5 w6", "w7")}]  # the clip, no marker
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _, samples = load(tmp_path, str(tmp_path / "data.jsonl"), "--preset", "qwen-tiny", "--tokenizer",
                      str(tmp_path / "tok"), "--image-root", str(tmp_path))
    s = samples.index.stats
    assert s["bad_by_kind"] == {"video_marker": 1} and s["good"] == 1, s
    bad = [json.loads(line) for line in (tmp_path / "run" / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert [b["kind"] for b in bad] == ["video_marker"]
    assert "1 video(s) but 0 <video> marker(s)" in bad[0]["reason"], bad[0]["reason"]


_PROBE = ("import json\nfrom mmpipe.registry import families\n"
          "print(json.dumps(sorted(f.family for f in families())))\n")


def _families_seen(path: list[str]) -> list[str]:
    """The families a fresh interpreter's registry knows with `path` on PYTHONPATH and no MMPIPE_FAMILIES."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    env = {k: v for k, v in os.environ.items() if k != "MMPIPE_FAMILIES"}
    env["PYTHONPATH"] = os.pathsep.join(path)
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_family_registers_through_an_entry_point(tmp_path):
    """An installed distribution whose metadata names tests/toy_family.py under the `mmpipe.families` entry-point
    group (what `pip install` of a package declaring `entry_points={"mmpipe.families": [...]}` leaves on sys.path)
    registers toy_carry with nothing else set; without the metadata the same path registers no such family."""
    from conftest import ROOT
    dist = tmp_path / "mmpipe_toy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mmpipe-toy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mmpipe.families]\ntoy_carry = toy_family\n")
    tests = str(ROOT / "tests")
    assert "toy_carry" in _families_seen([str(tmp_path), tests])
    assert "toy_carry" not in _families_seen([tests])
