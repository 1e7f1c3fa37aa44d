"""The `mmpipe ...` commands of the docs, extracted and checked (tests/test_docs.py states the policy).

`extract` finds them: every logical line of a fenced block whose command word is `mmpipe` (a whole
command, backslash continuations joined, `# comments` and anything after `&&`, `;`, `|`, `>` dropped)
and every inline code span that starts with `mmpipe ` (a fragment of prose). `Checker` checks them
page by page: every command's flags against the parser (`check_flags`), and a whole command with
nothing left to the reader through `mmpipe ... --dry-run` in a sandbox (`run`); `mmpipe plan` runs as
written (it allocates nothing and takes well under a second), and the `mmpipe train` command a
`--write-config` prints is then dry-run as printed.

Transcripts (`TRANSCRIPT`): a fenced block whose first line is `$ mmpipe plan ...` (backslash continuations
allowed) shows that command and, in the rest of the block, what it prints (stdout, then stderr). The
command runs and its output must equal the block's lines (`compare`), trailing spaces aside, except:
  - a line that is only `...` stands for any number of lines left out (the next shown line is matched at its
    first occurrence after it);
  - `...` inside a line stands for any text left out of that line (e.g. a long partition list cut short);
  - the wall time in `(planned in 2.21 s, nothing allocated)` is not compared (`VOLATILE`).
A transcript whose output differs in anything else is stale: a problem, naming the first line that differs."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from mmpipe import cli
from mmpipe.config import list_presets
from mmpipe.data.export import export_shapes
from mmpipe.flags import add_flags
from mmpipe.model.builder import FREEZE_GROUPS
from mmpipe.model.lora import LORA_FILE, Lora
from mmpipe.run_args import LaunchArgs, TrainArgs
from mmpipe.run_config import requested_stages, resolve

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHIPPED = ("ds_configs/", "launch/", "scripts/", "docs/", "mmpipe/")  # paths in the repository, never the user's
SHELL_OPS = {"&&", "||", ";", "|", ">", ">>", "<"}
NUMBER = re.compile(r"^-?[\d.:,]+$")  # -2, 0.5, 4:00:00, 16,8: a value, never a path or a flag
PATH = re.compile(r"/|\.(json|jsonl|png|jpg|safetensors|csv|parquet)$")  # a word that names a file
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.[a-z]+)?$")  # RUN, DIR, HOSTFILE, RESULTS.json
REAL = {"export-shapes", "presets", "plan"}  # they write what later commands read, or print what a page shows,
# in seconds: they run as written, not dry (plan allocates nothing either way; run as written it writes its
# --write-config file in the sandbox and its printed train command can be run)
TRANSCRIPT = re.compile(r"^\$ mmpipe plan\b")  # a fenced block's first line: the block is the command's transcript
VOLATILE = [(re.compile(r"\(planned in \d+(\.\d+)? s,"), "(planned in <wall time> s,")]  # varies run to run
RUN_IT = "; run it with mmpipe train "  # how plan --write-config prints the command that runs the plan
REAL_N = "16"  # export-shapes runs with --n at most this: later commands need its files, not 500 of them
# whole commands a page shows being refused (its words -> what the one-line refusal must say): exit 2 passes
REFUSALS = {"train --preset small-xattn --pack": "reads its image through cross-attention"}
RUN_FLAGS = {"--checkpoint", "--init-from"}  # a run directory (fixture: model.json + a latest checkpoint)
DATA_FLAGS = {"--data", "--eval-data"}  # records (fixture: a small LLaVA export)
IMAGE_FLAGS = {"--image"}  # an image (fixture: a small PNG)
WRITES_RUN = {"train": "--output-dir", "import": "--out"}  # where a command leaves a run directory
PROFILE_FILE = "device_profile.json"  # what `mmpipe check` leaves in its --output-dir (mmpipe.check.profile)
STAND_IN = "llava-tiny"  # the model of a run whose preset no command on the page names (an HF import)


@dataclass
class DocCommand:
    where: str  # "docs/hf.md:55"
    argv: list[str]  # the words after `mmpipe`
    block: bool  # a whole command in a fenced block, else an inline fragment of prose
    shown: list[str] | None = None  # a transcript's output lines as the page shows them (TRANSCRIPT), else None

    def __str__(self) -> str:
        return f"{self.where}: mmpipe {shlex.join(self.argv)}"


def _words(line: str) -> list[str] | None:
    """The words of `mmpipe ...` on a shell line, or None when no command on it is mmpipe."""
    try:
        words = shlex.split(line.strip().removeprefix("$ "), comments=True)
    except ValueError:
        return None
    start = 0  # of the current command, after the last shell operator
    for i, w in enumerate(words):
        if w in SHELL_OPS:
            start = i + 1
        elif w == "mmpipe" and all("=" in v for v in words[start:i]):  # only VAR=value before it
            rest = words[i + 1:]
            return rest[:next((j for j, v in enumerate(rest) if v in SHELL_OPS), len(rest))]
    return None


def _split(fragment: str) -> list[str]:
    try:
        return shlex.split(fragment)
    except ValueError:  # prose's unbalanced quote
        return fragment.split()


def extract(text: str, source: str) -> list[DocCommand]:
    out, fenced, pending, start = [], False, "", 0
    first, indent, transcript = False, 0, None  # the block's first logical line is next; its fence's indent
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, pending, transcript = not fenced, "", None
            first, indent = fenced, len(line) - len(line.lstrip())
            continue
        if transcript is not None:  # the rest of a transcript block is what its command printed
            transcript.shown.append(line[min(indent, len(line) - len(line.lstrip())):].rstrip())
            continue
        if fenced:
            start = start if pending else n
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            words, logical, pending = _words(pending), pending.strip(), ""
            if words:
                out.append(DocCommand(f"{source}:{start}", words, True))
                if first and TRANSCRIPT.match(logical):
                    transcript = out[-1]
                    transcript.shown = []
            first = False
        else:
            out += [DocCommand(f"{source}:{n}", _split(m.group(1)), False)
                    for m in re.finditer(r"`mmpipe ([^`]+)`", line)]
    return out


def placeholder(word: str) -> bool:
    """A word the reader fills in: RUN, DIR, `...`, `[the flags above]`, `1f1b|zb-h1`."""
    return bool(PLACEHOLDER.match(word)) or "..." in word or word.startswith("[") or word.endswith("]") or \
        ("|" in word and not word.startswith("--"))


def check_flags(cmd: DocCommand) -> list[str]:
    """Problems of a command's words, by the parser alone: an unknown subcommand or flag (exact, not
    argparse's abbreviations), a value outside a flag's choices or type, a shipped path that does not
    exist, a preset name that is not one."""
    sub = cli.parser()._subparsers._group_actions[0].choices
    if not cmd.argv or cmd.argv[0] not in sub:
        return [f"{cmd}: no mmpipe command {cmd.argv[:1]}"]
    actions, problems = sub[cmd.argv[0]]._option_string_actions, []
    words = [w for a in cmd.argv[1:] for w in (a.split("=", 1) if a.startswith("--") else [a])]
    for i, w in enumerate(words):
        if w.startswith(SHIPPED) and not (ROOT / w).exists():
            problems.append(f"{cmd}: {w} does not exist in the repository")
        if not w.startswith("-") or NUMBER.match(w):
            continue
        act = actions.get(w)
        if act is None:
            problems.append(f"{cmd}: {w} is not a flag of `mmpipe {cmd.argv[0]}`")
            continue
        value = words[i + 1] if act.nargs != 0 and i + 1 < len(words) else None
        if value is None or placeholder(value):
            continue
        if act.choices and value not in map(str, act.choices):
            problems.append(f"{cmd}: {w} {value}: not one of {', '.join(map(str, act.choices))}")
        elif act.type in (int, float):
            try:
                act.type(value)
            except ValueError:
                problems.append(f"{cmd}: {w} {value}: not a {act.type.__name__}")
        if w == "--preset" and "/" not in value and not value.endswith(".json") and value not in list_presets():
            problems.append(f"{cmd}: --preset {value}: no such preset")
    return problems


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


@dataclass
class Checker:
    """Runs one page's commands in order in `sandbox` (the repository's shipped folders linked in)."""
    sandbox: Path
    ran: list[str] = field(default_factory=list)  # commands that ran (--dry-run, or as written for REAL)
    skipped: list[str] = field(default_factory=list)  # "command: why" for whole commands not run
    problems: list[str] = field(default_factory=list)
    presets: dict[str, str] = field(default_factory=dict)  # run directory -> the preset of its model
    loras: dict[str, str] = field(default_factory=dict)  # run directory -> its --lora rank
    checks: dict[str, list[str]] = field(default_factory=dict)  # a `mmpipe check`'s --output-dir -> its flags

    def __post_init__(self):
        self.sandbox.mkdir(parents=True, exist_ok=True)
        for d in SHIPPED[:3]:
            if not (self.sandbox / d).exists():
                (self.sandbox / d.rstrip("/")).symlink_to(ROOT / d)

    def check(self, cmd: DocCommand) -> None:
        self.problems += check_flags(cmd)
        if cmd.block:
            why = self._why_not(cmd)
            if why:
                self.skipped.append(f"{cmd}: {why}")
            else:
                self.run(cmd)
        self._note_writes(cmd.argv)

    def _why_not(self, cmd: DocCommand) -> str | None:
        """Why a whole command cannot run here, after the fixtures the page assumes are made; None: it can."""
        words = [w for w in cmd.argv if placeholder(w)]
        if words:
            return f"placeholders for the reader: {' '.join(words)}"
        out = os.path.normpath(_value(cmd.argv, "--output-dir") or "runs/default")
        if "--resume" in cmd.argv and not (self.sandbox / out / "checkpoints").exists():
            if out not in self.presets:
                return f"--resume: continues the reader's run {out}"
            write_run(self.sandbox / out, self.presets[out], self.loras.get(out))
        for i, w in enumerate(cmd.argv[1:], 1):
            flag = cmd.argv[i - 1]
            if not w.startswith(("-", *SHIPPED)) and PATH.search(w) and not NUMBER.match(w) \
                    and not self._output(flag):
                if Path(w).is_absolute():  # whatever is there on this machine is not the page's
                    return f"{w}: a path outside the sandbox"
                if not (self.sandbox / w).exists() and not self._fixture(flag, w, cmd.argv[0]):
                    return f"{w}: the reader's own files (a download or an earlier long run)"
        return None

    @staticmethod
    def _output(flag: str) -> bool:
        """A flag whose path the command writes, not reads."""
        return flag in ("--out", "--output-dir", "--write-config", "--write-profile", "--script")

    def _fixture(self, flag: str, path: str, command: str) -> bool:
        """Make what the page assumes at `path`: a run directory, records or an image. False: not ours to make."""
        target = self.sandbox / path
        if flag in RUN_FLAGS or (command == "plot" and not flag.startswith("--")):
            preset = self.presets.get(os.path.normpath(path), STAND_IN)
            write_run(target, preset, self.loras.get(os.path.normpath(path)))
        elif flag in DATA_FLAGS and target.suffix in (".json", ".jsonl"):
            fmt = "llava-jsonl" if target.suffix == ".jsonl" else "llava-json"
            made = export_shapes(target.parent, fmt, 8)
            made.rename(target)
        elif flag == "--device-profile" and target.name == PROFILE_FILE and \
                os.path.normpath(Path(path).parent) in self.checks:  # the page's `mmpipe check` wrote it
            write_check_profile(target, self.checks[os.path.normpath(Path(path).parent)])
        elif flag in IMAGE_FLAGS:
            from PIL import Image
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), (200, 40, 40)).save(target)
        else:
            return False
        return True

    def _note_writes(self, argv: list[str]) -> None:
        """The run directory a train / import command leaves, and its model's preset, for later commands; the
        output directory of a check (its device profile)."""
        if argv[:1] == ["check"]:
            self.checks[os.path.normpath(_value(argv, "--output-dir") or "runs/default")] = argv[1:]
        flag = WRITES_RUN.get(argv[0] if argv else "")
        out = _value(argv, flag) if flag else None
        if out is None:
            return
        parent = _value(argv, "--init-from")
        preset = _value(argv, "--preset") or (self.presets.get(os.path.normpath(parent), STAND_IN) if parent
                                             else "small" if argv[0] == "train" else STAND_IN)
        self.presets[os.path.normpath(out)] = preset
        if _value(argv, "--lora"):
            self.loras[os.path.normpath(out)] = _value(argv, "--lora")

    def run(self, cmd: DocCommand) -> None:
        argv = [*cmd.argv, "--dry-run"]
        if cmd.argv[0] in REAL:
            argv = [min(w, REAL_N, key=int) if argv[i - 1] == "--n" else w for i, w in enumerate(cmd.argv)]
        rc, out, err = self._main(argv)
        self.ran.append(str(cmd))
        said = " ".join((err or out).strip().splitlines()[-1:])
        refusal = REFUSALS.get(shlex.join(cmd.argv))
        if refusal is not None and (rc != 2 or refusal not in said):
            self.problems.append(f"{cmd}: the page shows a refusal ({refusal!r}); got exit {rc}: {said}")
        elif refusal is None and rc != 0:
            self.problems.append(f"{cmd}: exit {rc}: {said}")
        if cmd.shown is not None:
            stale = compare(cmd.shown, (out + err).splitlines())
            if stale:
                self.problems.append(f"{cmd}: stale transcript: {stale}")
        printed = next((ln.split(RUN_IT, 1)[1] for ln in out.splitlines() if RUN_IT in ln), None)
        if rc == 0 and printed is not None:  # plan --write-config: the train command it prints must run as printed
            rc, out, err = self._main(["train", *shlex.split(printed), "--dry-run"])
            if rc != 0:
                said = " ".join((err or out).strip().splitlines()[-1:])
                self.problems.append(f"{cmd}: the command it prints, mmpipe train {printed}: exit {rc}: {said}")

    def _main(self, argv: list[str]) -> tuple[int, str, str]:
        """`mmpipe ARGV` in this process, in the sandbox: its exit status, stdout and stderr."""
        out, err = io.StringIO(), io.StringIO()
        here = Path.cwd()
        try:
            os.chdir(self.sandbox)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main(argv)
                except SystemExit as e:  # argparse's refusal
                    rc = e.code
        finally:
            os.chdir(here)
        return rc, out.getvalue(), err.getvalue()


def _steady(line: str) -> str:
    """A line without its trailing spaces and with what varies run to run (VOLATILE) masked."""
    for pattern, mask in VOLATILE:
        line = pattern.sub(mask, line)
    return line.rstrip()


def _matches(shown: str, line: str) -> bool:
    """A shown line against a printed one: equal, `...` inside the shown line standing for any text."""
    parts = [re.escape(p) for p in _steady(shown).split("...")]
    return re.fullmatch(".*".join(parts), _steady(line)) is not None


def compare(shown: list[str], printed: list[str]) -> str | None:
    """None when the printed lines are what a transcript shows (the module's conventions), else the first
    difference in words: the shown line, and what was printed there."""
    while shown and not shown[-1].strip():  # a block's or an output's trailing blank lines say nothing
        shown = shown[:-1]
    while printed and not printed[-1].strip():
        printed = printed[:-1]
    j, skipping = 0, False
    for n, want in enumerate(shown):
        if want.strip() == "...":
            skipping = True
            continue
        if skipping:
            k = next((k for k in range(j, len(printed)) if _matches(want, printed[k])), None)
            if k is None:
                return f"shown line {n + 1} {want.strip()!r} is not printed after line {j} (the command printed " \
                       f"{len(printed)} lines)"
            j, skipping = k + 1, False
            continue
        if j >= len(printed):
            return f"shown line {n + 1} {want.strip()!r}: the command printed only {len(printed)} lines"
        if not _matches(want, printed[j]):
            return f"shown line {n + 1} {want.strip()!r}, printed {printed[j].strip()!r}"
        j += 1
    if not skipping and j < len(printed):
        return f"the command printed {len(printed) - j} more lines than shown, from {printed[j].strip()!r} (end the " \
               f"block with a '...' line to leave them out)"
    return None


def write_run(run: Path, preset: str, lora_rank: str | None = None) -> None:
    """A run directory as a dry run reads one: model.json (as training writes it), checkpoints/latest naming
    an (empty) tag, a one-row train_log.csv, lora.json for a --lora run. No weights: no dry run reads them."""
    (run / "checkpoints" / "step1").mkdir(parents=True, exist_ok=True)
    model = resolve(TrainArgs(preset=preset, stages=1, eval_samples=0), world_size=1).model  # fitted to its tokenizer
    (run / "model.json").write_text(json.dumps(model.to_dict()))
    (run / "checkpoints" / "latest").write_text("step1")
    (run / "train_log.csv").write_text("step,loss,lr,samples_per_s,elapsed_s\n1,2.0,0.001,10.0,1.0\n")
    if lora_rank:
        lora = Lora.parse(int(lora_rank), None, 0.0, "text", "", FREEZE_GROUPS)
        (run / LORA_FILE).write_text(json.dumps(lora.to_dict()))


def write_check_profile(path: Path, check_flags: list[str]) -> None:
    """device_profile.json as `mmpipe check CHECK_FLAGS` writes it: mmpipe.check.profile's own profile_doc of the
    check's run, this process's layer-kind table (costmodel.profile_layers, ~0.1 s for `small`) standing in for
    the slowest rank's, no links measured (the device's own figures)."""
    from mmpipe.check.profile import model_seconds, profile_doc
    from mmpipe.check.rank import parse
    from mmpipe.planning.costmodel import profile_layers
    from mmpipe.planning.plan import cpu_device
    launch = argparse.ArgumentParser(add_help=False)  # the front door's own flags, not the ranks'
    add_flags(launch, LaunchArgs)
    ns, rest = launch.parse_known_args(check_flags)
    args, _ = parse(rest)
    run = resolve(args, world_size=(ns.dp or 1) * requested_stages(args))
    kinds = profile_layers(run.model, run.text_len, run.micro, run.precision, images=run.max_images)
    doc = profile_doc(run, {"rank": 0, "kinds": kinds, "seconds": model_seconds(run, kinds)}, cpu_device(), [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def check_page(page: Path, sandbox: Path) -> Checker:
    checker = Checker(sandbox)
    for cmd in extract(page.read_text(), str(page.relative_to(ROOT))):
        checker.check(cmd)
    return checker
