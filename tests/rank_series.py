"""Several `mmpipe train` runs one after another in the same ranks: one launch (one set of interpreters importing
torch, DeepSpeed and transformers, ~15 s of start-up under the suite's load) instead of one per run. Each run is the
rank code `mmpipe train` starts (mmpipe.train.run_rank: resolve, join a fresh process group, train, tear the groups
down), after its front door's own code in the test process (every check, the data's indexes, the ranks' flags), so
it trains, saves and resumes what its own launch would. The runs of a series need the same number of
ranks and no file another run of the series writes. What the test hooks patch for one run (MMPIPE_WIRE_LOG's p2p
send) is put back before the next. Each run's environment is the launch's plus its own (train_run's
MMPIPE_WIRE_LOG=its output directory unless given; a rendezvous port of its own), and its output and exit status
are its own (OUT.series.out / .err / .rc<RANK> beside its output directory: conftest.Run.proc as from a launch).

The tests that use it compare each run with what a run of its own gives (bit for bit: test_prechange_resume.py's
old code's step, test_moe_ep.py's resumes) or with the in-process reference, so a state one run left for the next
would fail there.

    launch_series([(out, argv, env), ...]) -> [Run, ...]            (in the test process)
    deepspeed --num_gpus N ... --module rank_series RUNS.json      (each rank; RUNS.json: [{"out", "argv", "env"}])

A run that fails on a rank ends the series there (that rank exits with its status, and DeepSpeed's launcher stops
the others): the later runs have no summary.json, and their tests fail with the launch's output."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mmpipe.cluster.preempt import Preemption
from mmpipe.config import ConfigError, fail
from mmpipe.run_config import resolve
from mmpipe.train import exit_fast, parse_args, run_rank

ROOT = Path(__file__).resolve().parent.parent


def launch_series(runs: list[tuple[Path, list[str], dict]], timeout: int = 900, **env: str) -> list:
    """Each (output dir, `mmpipe train` flags but --output-dir, its own environment) run in turn in one launch; env:
    every run's (e.g. MMPIPE_FAULT). Each run's front door (every check and the data's indexes, as `mmpipe train`
    makes them before its launch) runs here first, in this process; the runs must take the same number of ranks.
    Returns a conftest.Run for each, its proc its own output (the front door's, then its ranks') and exit status."""
    from conftest import Run
    from mmpipe.cluster.ports import free_port
    doors = [front_door(out, argv) for out, argv, _ in runs]
    ranks = {d[3] for d in doors}
    assert len(ranks) == 1, f"a series' runs take the same number of ranks, not {sorted(ranks)}"
    # each run its own rendezvous port: rank 0's new TCPStore, never the last run's, which a rank done with that run
    # sooner could reach while rank 0 still tears it down (and read the old process group's addresses there: gloo's
    # "Connection refused", seen once here)
    spec = [{"out": str(out), "argv": door[0],
             "env": {"MMPIPE_WIRE_LOG": str(out), "MASTER_PORT": str(free_port()), **own}}
            for (out, _, own), door in zip(runs, doors)]
    path = Path(runs[0][0]).parent / f"series-{Path(runs[0][0]).name}.json"
    path.write_text(json.dumps(spec))
    launch_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)  # as conftest.mmpipe_train's
    launch_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), launch_env.get("PYTHONPATH")]))
    n = ranks.pop()
    proc = subprocess.run([shutil.which("deepspeed"), "--num_gpus", str(n), "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()), "--module", "rank_series", str(path)],
                          cwd=ROOT, env=launch_env, capture_output=True, text=True, timeout=timeout)
    return [Run(Path(out), _run_proc(Path(out), door, proc, n)) for (out, _, _), door in zip(runs, doors)]


def front_door(out: Path, argv: list[str]) -> tuple[list[str], str, str, int]:
    """`mmpipe train --output-dir OUT ARGV` in this process up to its launch (mmpipe.cli's own code, its launcher
    call caught): (the ranks' flags, its stdout, its stderr, its number of ranks). AssertionError when it refuses."""
    from mmpipe import cli
    launched, real = [], cli._run_launcher
    cli._run_launcher = lambda cmd, env: launched.append(cmd) or 0
    out_text, err_text = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out_text), contextlib.redirect_stderr(err_text):
            code = cli.main(["train", "--output-dir", str(out), *argv])
    finally:
        cli._run_launcher = real
    assert code == 0 and launched, f"mmpipe train refused {out}'s run: {err_text.getvalue()}"
    cmd = launched[0]
    return cmd[cmd.index("--module") + 2:], out_text.getvalue(), err_text.getvalue(), int(cmd[cmd.index("--num_gpus")
                                                                                              + 1])


def _run_proc(out: Path, door: tuple, launch: subprocess.CompletedProcess, ranks: int) -> subprocess.CompletedProcess:
    """One run's own output and status (its ranks' first non-zero exit status, else 0; the launch's, or 1, when a
    rank never ended it): the front door's lines, its ranks', then the launch's own."""
    read = lambda p: p.read_text() if p.is_file() else ""  # noqa: E731
    codes = [int(p.read_text()) for p in sorted(out.parent.glob(f"{out.name}.series.rc*"))]
    status = next((c for c in codes if c), 0) if len(codes) == ranks else launch.returncode or 1
    return subprocess.CompletedProcess(launch.args, status, door[1] + read(Path(f"{out}.series.out")) + launch.stdout,
                                       door[2] + read(Path(f"{out}.series.err")) + launch.stderr)


def one_run(out: str, argv: list[str], env: dict) -> int:
    """One run of the series: its environment set, this rank's stdout and stderr appended to OUT.series.out / .err
    (the run's own output, as its own launch would have shown it), its exit status to OUT.series.rc<RANK>, and the
    hooks' patches undone after it."""
    from deepspeed.runtime.pipe import p2p
    saved_env, send = dict(os.environ), p2p.send
    os.environ.update(env)
    saved_fds = _redirect(out)
    code = 1
    try:
        args = parse_args(argv)
        try:
            run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        except ConfigError as e:
            code = fail(e)
        else:
            code = run_rank(args, run, Preemption())
        return code
    finally:
        _restore(saved_fds)
        Path(f"{out}.series.rc{os.environ.get('RANK', '0')}").write_text(str(code))
        p2p.send = send  # mmpipe.runtime.wire's log of this run's sends
        os.environ.clear()
        os.environ.update(saved_env)


def _redirect(out: str) -> list[int]:
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(f"{out}.series.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    return saved


def _restore(saved: list[int]) -> None:
    sys.stdout.flush(), sys.stderr.flush()
    for fd, old in zip((1, 2), saved):
        os.dup2(old, fd)
        os.close(old)


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("--local_rank")]  # the launcher's own flag
    for run in json.loads(Path(paths[0]).read_text()):
        code = one_run(run["out"], run["argv"], run["env"])
        if code:  # this rank's exit ends the launch (the launcher stops the others): no rank waits on a run left
            return code
    return 0


if __name__ == "__main__":
    exit_fast(main(sys.argv[1:]))
