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
  `export-shapes`, `presets` and `plan` run as written instead of a dry run (later commands read what
  export-shapes writes, its --n capped at 16 for time; plan allocates nothing and takes well under a
  second). The `mmpipe train` command a `plan --write-config` prints is then dry-run as printed. A command
  the page shows being refused (docs_commands.REFUSALS) must exit 2 with its refusal.
- Transcripts: a fenced block whose first line is `$ mmpipe plan ...` shows that command and, in the rest
  of the block, its output, which must equal what the command prints now (docs_commands.compare: trailing
  spaces aside; a line `...` leaves any number of lines out, `...` inside a line leaves text out; the
  wall time of `(planned in 2.21 s, ...)` is not compared). A stale number is a problem naming its line.
- Fixtures the pages assume are made: a run directory named by --checkpoint, --init-from, a plot RUN
  or a --resume's --output-dir (model.json of the preset of the page's command that writes it, else
  llava-tiny as the stand-in for an HF model; an empty latest checkpoint; lora.json for a --lora run);
  records named by --data / --eval-data (.json / .jsonl) are a small LLaVA export; an --image is a PNG;
  a --device-profile DIR/device_profile.json where the page ran `mmpipe check --output-dir DIR` is the
  profile that check writes for its run (docs_commands.write_check_profile).
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


PLAN = "mmpipe plan --preset small --device a100-80gb --gpus-per-node 2 --global-batch 32 --micro 4,8 --text-len 12"


def _transcript(shown: list[str]) -> str:
    return "\n".join(["```text", f"$ {PLAN}", *shown, "```", ""])


def test_planted_stale_transcript_fails(tmp_path, capsys):
    """A `$ mmpipe plan ...` block's output is compared with what the command prints now: the page's own shape
    (`...` lines and in-line `...`, another wall time) passes; a stale number, a shown line no longer printed and
    printed lines the page neither shows nor elides each fail, naming the line (issue 46 item 8: planning.md's
    72B transcript showed 68.48 GiB where plan printed 68.41)."""
    assert cli.main(PLAN.split()[1:]) == 0
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    assert printed[-1].startswith("(planned in ") and len(printed) > 8
    header, rows, best = printed[0], printed[3:5], printed.index("") + 1
    shown = [header[:40] + "...", *printed[1:5], "...", *printed[best:-1], "(planned in 9.99 s, nothing allocated)"]
    good = _check_text(_transcript(shown), tmp_path / "good")
    assert good.problems == [] and good.ran == [f"planted.md:2: {PLAN}"]
    row = rows[1].rsplit("  ", 1)[0]  # '  1   2     8    4    0.0% ... 0.1' without its partition
    gib = row.split()[-1]
    stale = [ln.replace(row, row[:-len(gib)] + f"{float(gib) + 0.1:.1f}") for ln in shown]
    found = _check_text(_transcript(stale), tmp_path / "stale").problems
    assert len(found) == 1 and "stale transcript: shown line 5" in found[0] and repr(rows[1].strip()) in found[0]
    gone = _check_text(_transcript([*shown[:5], "...", "best: 9 stages x dp 9, micro 1 x GAS 1", "..."]),
                       tmp_path / "gone").problems
    assert len(gone) == 1 and "'best: 9 stages x dp 9, micro 1 x GAS 1' is not printed" in gone[0]
    cut = _check_text(_transcript(shown[:5]), tmp_path / "cut").problems
    assert len(cut) == 1 and "more lines than shown" in cut[0]


def test_a_written_configs_printed_command_is_run_and_a_checks_profile_plans(tmp_path, monkeypatch):
    """plan runs as written: the `mmpipe train` command --write-config prints is dry-run as printed (planted: a
    printed command without its --preset fails, as issue 46 item 2 found); a plan on the device profile the page's
    `mmpipe check` writes runs as docs/check.md shows it (item 1), and another precision is refused in one line
    whose advice fits check's profile."""
    from mmpipe.planning import plan
    page = """
        ```bash
        mmpipe plan --preset llava-tiny --gpus-per-node 2 --global-batch 32 --micro 4 --text-len 32 \\
            --max-images 2 --write-config runs/ds.json
        mmpipe check --preset small --stages 2 --output-dir runs/check
        mmpipe plan --device-profile runs/check/device_profile.json --preset small --text-len 12 --micro 16
        ```
        """
    checker = _check_text(page, tmp_path / "good")
    assert checker.problems == [] and len(checker.ran) == 3 and checker.skipped == []
    assert (tmp_path / "good" / "runs" / "check" / "device_profile.json").is_file()
    bf16 = _check_text(page.replace("--micro 16", "--micro 16 --precision bf16"), tmp_path / "bf16").problems
    assert len(bf16) == 1 and "calibrated for fp32 only, not --precision bf16 (plan with --precision fp32, or rerun " \
        "mmpipe check with a bf16 --ds-config)" in bf16[0], bf16
    full = plan.train_flags
    monkeypatch.setattr(plan, "train_flags", lambda *a: full(*a)[2:])  # as before the fix: no --preset
    found = _check_text(page, tmp_path / "stale").problems
    assert len(found) == 1 and "the command it prints, mmpipe train --ds-config runs/ds.json" in found[0], found
