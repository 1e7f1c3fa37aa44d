"""Shared helpers: launch real multi-rank runs through `mmpipe train` and read what they wrote."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the files that start real services on fixed addresses (sshd on 127.0.0.2-3:2222, munged, Slurm,
# /etc/hosts): never two at once
SERVICES = ("test_cluster", "test_bench_cluster")


# Seconds each group took in a clean-clone run of the suite (written by the run itself when
# MMPIPE_FILE_SECONDS names a file: `MMPIPE_FILE_SECONDS=tests/file_seconds.json python -m pytest ...`).
FILE_SECONDS = ROOT / "tests" / "file_seconds.json"


def _group(name: str) -> str:
    return "services" if name in SERVICES else name


def pytest_configure(config):
    # xdist hands out groups biggest-first by TEST COUNT unless told otherwise: a 1-test file that trains
    # for minutes (test_learning) then starts last and runs alone at the end. We order by seconds instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's `--dist loadgroup` (the README's test command: two workers on two cores), a
    test file is one unit, so its module fixtures (reference runs shared by its tests) are built once,
    and the service files share one worker. The groups go out costliest first (longest processing time
    first: the two workers then finish within about the cheapest groups' time of each other); a file
    not measured yet counts as a minute. Serially this changes nothing but the order of the files."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item.module.__name__)))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (-seconds.get(_group(it.module.__name__), 60), order[id(it)]))


def pytest_runtest_logreport(report):
    """Each group's seconds (setup, call and teardown of its tests), summed where the reports arrive:
    the xdist controller, or the one process of a serial run."""
    group = _group(Path(report.nodeid.split("::")[0]).stem)
    _seconds_by_group[group] = _seconds_by_group.get(group, 0.0) + report.duration


_seconds_by_group: dict[str, float] = {}  # this process's sums (pytest_runtest_logreport)


def pytest_sessionfinish(session):
    out = os.environ.get("MMPIPE_FILE_SECONDS")
    if out and not hasattr(session.config, "workerinput"):  # the controller (or a serial run) writes it
        Path(out).write_text(json.dumps({k: round(v) for k, v in sorted(_seconds_by_group.items(),
                                                                         key=lambda kv: -kv[1])}, indent=1))


def write_ds_config(path: Path, **overrides) -> Path:
    """ds_configs/cpu_fp32.json with overrides (a value of None deletes the key)."""
    cfg = json.loads((ROOT / "ds_configs" / "cpu_fp32.json").read_text())
    for k, v in overrides.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return path


def fixed_schedule_config(path: Path, steps: int) -> Path:
    """4 micro x 2 GAS; a schedule fixed at `steps` (not "auto"), so a shorter, resumed or
    requeued run follows the same curve."""
    return write_ds_config(
        path, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": 3,
                                                       "warmup_type": "linear", "warmup_min_ratio": 0.1}})


def mmpipe_train(args: list[str], timeout: int = 600, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_vars)
    return subprocess.run([sys.executable, "-m", "mmpipe.cli", "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


class Run:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess):
        self.out, self.proc = out, proc

    def check(self) -> "Run":
        # the success marker, not only the exit code (a run that trained writes summary.json last; its exit status
        # is test_clean_exit's and test_reliability's to check)
        assert (self.out / "summary.json").is_file(), self.proc.stdout[-3000:] + self.proc.stderr[-3000:]
        return self

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    @property
    def losses(self) -> dict[int, float]:
        with open(self.out / "train_log.csv") as f:
            return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}

    @property
    def rows(self) -> list[dict]:
        with open(self.out / "train_log.csv") as f:
            return list(csv.DictReader(f))

    def wire(self, rank: int) -> list[tuple[str, str, str]]:
        """(kind, dtype, shape) of every p2p message rank `rank` sent (mmpipe.runtime.wire's test hook)."""
        path = self.out / f"wire_rank{rank}.csv"
        return [tuple(line.split(",")) for line in path.read_text().splitlines()] if path.is_file() else []

    def assert_only_floats_crossed(self, per_forward: int | None = 1) -> None:
        """No integer tensor crossed a stage boundary: every message of every rank but DeepSpeed's int32
        shape announcement is a float tensor, and rank 0 (stage 0) sends `per_forward` of them per
        micro-batch it trains (a run without validation, not resumed into the same directory; None: any)."""
        ranks = self.summary["stages"] * self.summary["dp"] * self.summary.get("tp", 1) * self.summary.get("sp", 1)
        data = {r: [m for m in self.wire(r) if m[0] == "data"] for r in range(ranks)}
        for r, sent in data.items():
            assert sent and all(dtype in ("torch.float32", "torch.bfloat16", "torch.float16")
                                for _, dtype, _ in sent), (r, sorted(set(sent)))
        micro = self.summary["gradient_accumulation"] * (self.summary["steps"] - self.summary["start_step"])
        assert per_forward is None or len(data[0]) == per_forward * micro, (len(data[0]), micro)


def write_checkpoint(model, run_dir: Path) -> None:
    """A ReferenceModel saved in DeepSpeed's pipeline layout, as `mmpipe train` leaves it: model.json,
    checkpoints/latest -> step1, one layer_XX file per layer."""
    import torch
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "model.json").write_text(json.dumps(model.cfg.to_dict()))
    tag = run_dir / "checkpoints" / "step1"
    tag.mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step1")
    for i, layer in enumerate(model):
        torch.save(layer.state_dict(), tag / f"layer_{i:02d}-model_states.pt")


def refused(argv: list[str], capsys) -> list[str]:
    """`mmpipe train ARGV` in this process, which must be refused at the front door (exit 2, before any
    rank or launcher starts: the place every refusal of a flag, config or data set happens); its stderr
    lines. In-process because a new interpreter costs ~4 s of imports for a one-line answer."""
    from mmpipe.cli import main
    capsys.readouterr()
    try:
        code = main(["train", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    return [ln for ln in err.splitlines() if ln.strip()]


def cut_at(run: Run, out: Path, step: int) -> Path:
    """A copy of `run` (checkpointed at `step`) at `out` as if it had stopped after that step: `latest` names it, no
    later checkpoint, the log holds steps 1 .. step, no summary. A --resume of it should give `run`'s later steps."""
    shutil.copytree(run.out, out)
    (out / "checkpoints" / "latest").write_text(f"step{step}")
    for later in (out / "checkpoints").glob("step*"):
        if int(later.name[4:]) > step:
            shutil.rmtree(later)
    (out / "summary.json").unlink()
    log = (out / "train_log.csv").read_text().splitlines(keepends=True)
    (out / "train_log.csv").write_text("".join(log[:1 + step]))  # the header and steps 1 .. step
    return out


@pytest.fixture(scope="module")
def small_tiles():
    """The --sp launches' loss in tiles of 16 positions (V = 200: 16 x 200 x 4 B of fp32 logits), so each rank's 2 x 44
    positions a micro-batch take 6 tiles (sequence_parallel.TiledLogits; at the default 1 GiB, one). A module's
    `pytestmark = pytest.mark.usefixtures("small_tiles")` sets it before the module's launch fixtures."""
    from mmpipe.model.sequence_parallel import TILE_ENV
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TILE_ENV, str(16 * 200 * 4))
        yield


def train_run(out: Path, *args: str) -> Run:
    # every rank logs what it sends to the next / previous stage (Run.wire)
    return Run(out, mmpipe_train(["--output-dir", str(out), *args], MMPIPE_WIRE_LOG=str(out)))


@pytest.fixture(scope="session")
def equivalence_config(tmp_path_factory) -> Path:
    """Tiny batches, a real schedule: warm-up then cosine decay over the run, clipping on."""
    d = tmp_path_factory.mktemp("cfg")
    return write_ds_config(
        d / "equiv.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 2,
                                                       "warmup_type": "linear", "warmup_min_ratio": 0.1}})


EQUIV_STEPS = 6


MOVED_FACTOR = 10
"""An equivalence test's weights must have moved by more than MOVED_FACTOR x its tolerance (docs/testing.md, "Choosing
a tolerance"): otherwise the comparison cannot tell a run that trained from one that did not."""


def assert_weights_moved(got, init, tol: float, frozen: tuple[str, ...] = (),
                         no_gradient: tuple[str, ...] = ()) -> dict[str, float]:
    """Every floating tensor of `got` (a module or a state dict) moved from `init`'s by more than MOVED_FACTOR x `tol`
    (its largest element), but those whose names start with one of `frozen` ("0." for a Sequential's layer 0);
    returns each checked tensor's movement. DeepSpeed's WarmupCosineLR runs step 1 at lr 0, and a run at lr 0 (or
    whose updates were skipped) equals its reference exactly: this is what fails then. `no_gradient`: name endings of
    tensors whose gradient is 0 by construction (a key bias without rotary: softmax cancels it; they move by
    rounding noise only, ~4e-7), left out too."""
    got = got.state_dict() if hasattr(got, "state_dict") else got
    init = init.state_dict() if hasattr(init, "state_dict") else init
    moved = {k: (v.float() - init[k].float()).abs().max().item() for k, v in got.items()
             if v.is_floating_point() and v.numel() and not k.startswith(tuple(frozen))
             and not k.endswith(tuple(no_gradient))}
    still = {k: m for k, m in moved.items() if m <= MOVED_FACTOR * tol}
    assert moved and not still, (f"{len(still)} of {len(moved)} tensors moved <= {MOVED_FACTOR} x {tol}, e.g. "
                                 f"{dict(list(still.items())[:4])}")
    return moved


BREAKS = ROOT / "tests" / "breaks"


def broken_env(name: str) -> dict[str, str]:
    """The environment that makes a launched run apply the deliberate break `name` (tests/breaks/sitecustomize.py)
    in every rank: a control run that a test must tell apart from a good one."""
    path = os.pathsep.join(p for p in (str(BREAKS), os.environ.get("PYTHONPATH", "")) if p)
    return {"MMPIPE_TEST_BREAK": name, "PYTHONPATH": path}
