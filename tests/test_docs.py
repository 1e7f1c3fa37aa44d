"""The docs' commands still work: every `mmpipe ...` in README.md and docs/*.md is checked
(tests/docs_commands.py), so a flag that no longer exists, a path that does not resolve or a config
the code refuses fails the suite. No training and no process: the whole check is in-process dry runs.

Policy, per command:
- Every command, a whole one or a fragment of prose, has its words checked against the parser: the
  subcommand exists, every `--flag` is one of its flags (exactly, not an argparse abbreviation), a
  value is within the flag's choices and type, a repository path (ds_configs/, launch/, scripts/,
  docs/, mmpipe/) exists, a --preset name is a preset.
- A whole command (a line of a fenced block) also runs, in process, as `mmpipe ... --dry-run`: it
  resolves everything the front door checks and starts nothing. Each page runs in its own sandbox,
  its commands in page order, the repository's ds_configs/, launch/ and scripts/ linked in.
  `export-shapes` and `presets` run instead of a dry run (later commands read what export-shapes
  writes; its --n is capped at 16 for time). A command the page shows being refused
  (docs_commands.REFUSALS) must exit 2 with its refusal.
- Fixtures the pages assume are made: a run directory named by --checkpoint, --init-from, a plot RUN
  or a --resume's --output-dir (model.json of the preset of the page's command that writes it, else
  llava-tiny as the stand-in for an HF model; an empty latest checkpoint; lora.json for a --lora run);
  records named by --data / --eval-data (.json / .jsonl) are a small LLaVA export; an --image is a PNG.
- Skipped as a whole command, counted and listed, never silently (their words are still checked):
  placeholders for the reader (CAPS words such as RUN or HOSTFILE, `...`, `[...]`, `a|b`), the
  reader's own files (an HF download, moondream's weights, an earlier benchmark's results), a path
  outside the sandbox, a --resume of a run the page did not start.
- Inline fragments are not run: they are partial (`mmpipe export --format peft`) or show a refusal.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from docs_commands import DOCS, ROOT, Checker, check_page, extract
from mmpipe import cli
from mmpipe.config import list_presets, load_preset
from mmpipe.model.builder import layer_param_counts, layer_specs


def _check_text(text: str, sandbox: Path) -> Checker:
    checker = Checker(sandbox)
    for cmd in extract(textwrap.dedent(text), "planted.md"):
        checker.check(cmd)
    return checker


def test_docs_commands(tmp_path, capsys):
    whole = fragments = 0
    ran, skipped, problems = [], [], []
    for page in DOCS:
        cmds = extract(page.read_text(), str(page.relative_to(ROOT)))
        whole += sum(c.block for c in cmds)
        fragments += sum(not c.block for c in cmds)
        checker = check_page(page, tmp_path / page.stem)
        ran += checker.ran
        skipped += checker.skipped
        problems += checker.problems
    report = (f"docs check: {whole + fragments} mmpipe commands in {len(DOCS)} pages: {whole} whole commands "
              f"({len(ran)} run as --dry-run or as written, {len(skipped)} skipped), {fragments} inline fragments "
              f"(flags checked); all {whole + fragments} checked against the parser")
    with capsys.disabled():  # the count is part of the result: shown even when the test passes
        print("\n" + report + "".join(f"\n  skipped {s}" for s in skipped))
    assert not problems, report + "\n" + "\n".join(problems)
    assert len(ran) >= 35 and fragments >= 100, report  # the extractor still finds the pages' commands


def test_planted_stale_flag_fails(tmp_path):
    """The check fails on what goes stale: a removed flag (in a block and in prose), a shipped path
    that moved, a config the code refuses; the same page without them passes."""
    good = """
        Train it:

        ```bash
        mmpipe train --preset tiny --steps 2 --output-dir runs/t
        ```
        """
    assert not _check_text(good, tmp_path / "good").problems
    stale = good + """
        ```bash
        mmpipe train --preset tiny --stages 2 --micro-batches 4
        mmpipe train --preset tiny --ds-config ds_configs/gone.json
        mmpipe train --preset tiny --stages 20
        ```
        Or plan first with `mmpipe plan --preset tiny --gpu-count 2`.
        """
    checker = _check_text(stale, tmp_path / "stale")
    found = "\n".join(checker.problems)
    assert "--micro-batches is not a flag of `mmpipe train`" in found
    assert "--gpu-count is not a flag of `mmpipe plan`" in found
    assert "ds_configs/gone.json does not exist in the repository" in found
    assert "--stages 20: exit 2" in found and "(valid: 1..9)" in found
    assert len(checker.ran) == 4


def test_placeholders_are_skipped_and_counted(tmp_path):
    """A command with the reader's placeholders is counted as skipped, not run and not silently
    passed; its flags are still checked."""
    checker = _check_text("""
        ```bash
        mmpipe generate --checkpoint RUN --image PATH --prompt TEXT
        mmpipe generate --checkpoint RUN --picture PATH --prompt TEXT
        ```
        """, tmp_path)
    assert checker.ran == [] and len(checker.skipped) == 2
    assert "placeholders for the reader: RUN PATH TEXT" in checker.skipped[0]
    assert [p.split(": ", 1)[1] for p in checker.problems] == \
        ["mmpipe generate --checkpoint RUN --picture PATH --prompt TEXT: --picture is not a flag of `mmpipe generate`"]


def test_dry_run_starts_nothing(tmp_path, capsys, monkeypatch):
    """`mmpipe train --dry-run` prints the plan of the run (launcher line, layout, resolved paths) and
    neither launches nor writes anything, user data included (it is checked in a scratch directory)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["export-shapes", "--n", "4", "--out", "data"]) == 0
    out = tmp_path / "runs" / "x"
    assert cli.main(["train", "--preset", "tiny", "--data", "data/train.jsonl", "--output-dir", str(out),
                     "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "mmpipe: dry run: train" in said and "--module mmpipe.train" in said
    assert "2 stages x dp 1" in said and f"output dir: {out}" in said
    assert str(ROOT / "ds_configs" / "cpu_fp32.json") in said
    assert not out.exists()


def _parameters(preset: str) -> int:
    """The model's parameters, a tied head counted once, built on the meta device (no weights)."""
    cfg, seen, total = load_preset(preset), set(), 0
    for spec, n in zip(layer_specs(cfg), layer_param_counts(cfg)):
        key = getattr(spec, "key", None)  # a TiedLayerSpec's later use shares the first one's weights
        total += 0 if key in seen else n
        if key is not None:
            seen.add(key)
    return total


def test_configs_md_preset_table_is_true():
    """docs/configs.md's preset table has a row per preset, and each row's parameter count is the
    model's to the digits shown."""
    section = (ROOT / "docs" / "configs.md").read_text().split("## Model presets", 1)[1]
    rows = dict(re.findall(r"^\| `([\w.-]+)` \|.*\| ([\d.]+ [KMB]) \|$", section, re.M))
    assert sorted(rows) == sorted(list_presets())
    for preset, shown in rows.items():
        number, unit = shown.split()
        scale = {"K": 1e3, "M": 1e6, "B": 1e9}[unit]
        digits = len(number.split(".")[1]) if "." in number else 0
        assert abs(_parameters(preset) / scale - float(number)) <= 0.5 * 10 ** -digits, (preset, shown)
