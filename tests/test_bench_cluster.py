"""mmpipe bench on a cluster, for real: a tiny sweep submitted with --slurm to the one-node Slurm of
tests/services.py (one job per run, a peer as its own job), one variant preempted with USR1 mid-run,
requeued and still measured, `--collect` on the half-finished directory (finished runs measured,
the rest pending) and at the end (every row ok, a local run's columns); a --hostfile sweep over the
two loopback ssh hosts; and the refusals (too many ranks for the Slurm flags, an unknown partition,
an unreachable host, a malformed --collect directory), one line each, exit 2."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import slurm_cluster, ssh_cluster
from test_bench import documented_columns

ROOT = Path(__file__).resolve().parent.parent
STEPS = 120  # tiny: ~50 ms a step, so the preempted variant is still training when USR1 arrives


def write_sweep(path: Path, variants: list[dict], peers: list[str], steps: int = STEPS) -> Path:
    path.write_text(json.dumps({
        "name": "cluster", "steps": steps, "warmup_steps": 2, "repeats": 1, "timeout_s": 300,
        "base": {"preset": "tiny", "micro": 4, "gas": 2, "data_workers": 0},
        "variants": variants, "peers": peers,
        "targets": {role: role for role in ("pp1", "pp2") if role in {v["name"] for v in variants}}}))
    return path


# the preempted variant and the one it is measured against; each a job on the one node's 2 CPUs
TWO = [{"name": "pp2", "stages": 2}, {"name": "pp1"}]


def bench(args: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "mmpipe.cli", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def read_csv(path: Path) -> tuple[list[str], dict[str, dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = {r["name"]: r for r in reader}
        return reader.fieldnames, rows


def losses(run: Path) -> list[float]:
    with open(run / "train_log.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def one_error_line(code: int, err: str, expect: str) -> None:
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmpipe: error:") and expect in lines[0], err


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _job_state(env, job) -> dict:
    r = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def _until(cond, what: str, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def _done(out: Path, items: list[dict]) -> set[str]:
    return {it["dir"] for it in items if (out / it["dir"] / "outcome.json").is_file()}


def test_slurm_sweep_preempted_requeued_and_collected(tmp_path, slurm, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])  # for --collect, run in this process
    sweep = write_sweep(tmp_path / "sweep.json", TWO, ["torch_pipe"])
    out = tmp_path / "out"
    proc = bench([str(sweep), "--slurm", "--output-dir", str(out), "--slurm-partition", "debug",
                  "--job-name", "mmpipe-bench", "--time", "15:00"], slurm, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads((out / "bench.json").read_text())
    items = plan["items"]
    jobs = {it["dir"]: it["job"] for it in items}
    # one job per run, the peer's too, each writing where a local sweep would
    assert sorted(jobs) == ["peers/torch_pipe_r0", "variants/pp1_r0", "variants/pp2_r0"]
    assert all(j and j.isdigit() for j in jobs.values()) and len(set(jobs.values())) == 3
    script = (out / "variants" / "pp2_r0" / "slurm_job.sh").read_text()
    assert "--ntasks-per-node=2" in script and "--requeue" in script and "--partition=debug" in script
    assert "--ntasks-per-node=1" in (out / "variants" / "pp1_r0" / "slurm_job.sh").read_text()

    # preempt pp2 mid-run: it finishes its step, checkpoints, the job is requeued and resumes
    pp2, j1 = out / "variants" / "pp2_r0", jobs["variants/pp2_r0"]
    log_csv = pp2 / "train_log.csv"
    _until(lambda: log_csv.is_file() and len(log_csv.read_text().splitlines()) > 10, "pp2 training", 240)
    subprocess.run(["scancel", "--signal=USR1", j1], env=slurm, check=True)
    _until(lambda: _job_state(slurm, j1).get("Restarts") == "1", "pp2's job requeued", 120)

    # half-finished: what has an outcome is measured, what has none is pending
    _until(lambda: "variants/pp1_r0" in _done(out, items), "pp1's job", 300)
    before = _done(out, items)
    from mmpipe.cli import main
    capsys.readouterr()
    assert main(["bench", "--collect", str(out)]) == 0  # in this process: a launch costs ~4 s of imports
    mid = capsys.readouterr().out
    after = _done(out, items)
    _, rows = read_csv(out / "results.csv")
    by_dir = {it["dir"]: rows["peer_" + it["name"] if it["kind"] == "peer" else it["name"]] for it in items}
    assert all(by_dir[d]["status"] == "ok" for d in before), rows
    pending = [d for d in jobs if d not in after]
    assert pending and all(by_dir[d]["status"] == "pending" for d in pending), rows
    assert all(f"job {jobs[d]}" in by_dir[d]["reason"] for d in pending)
    assert re.search(r"run\(s\) pending: ", mid)

    # every job runs; the last one to finish writes the results
    for d, j in jobs.items():
        st = _until(lambda j=j: (s := _job_state(slurm, j)).get("JobState") in
                    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, f"job {j}", 400)
        assert st["JobState"] == "COMPLETED", (out / d / f"slurm-{j}.out").read_text()[-3000:]
    fields, rows = read_csv(out / "results.csv")
    assert fields == documented_columns()  # the same columns as a local run's results.csv
    assert set(rows) == {"pp2", "pp1", "peer_torch_pipe"}
    assert all(r["status"] == "ok" and float(r["samples_per_s"]) > 0 for r in rows.values()), rows
    assert all(int(r["measured_steps"]) == STEPS - 2 for r in rows.values())
    assert rows["pp2"]["world"] == "2" and len(rows["pp2"]["peak_mem_mb_per_rank"].split(";")) == 2
    assert json.loads((out / "results.json").read_text())["meta"]["pending"] == 0
    assert "every run of the sweep is over; collecting" in "".join(
        (out / d / f"slurm-{j}.out").read_text() for d, j in jobs.items())

    # the preempted variant: stopped once, requeued under the same id, resumed from its checkpoint
    st = _job_state(slurm, j1)
    assert st["Restarts"] == "1"
    slurm_log = (pp2 / f"slurm-{j1}.out").read_text()
    assert f"requeueing job {j1}" in slurm_log
    stopped = re.search(r"mmpipe: SIGUSR1: stopped after step (\d+) of 120", (pp2 / "run.log").read_text())
    assert stopped, (pp2 / "run.log").read_text()[-3000:]
    k = int(stopped[1])
    assert 10 <= k < STEPS and json.loads((pp2 / "summary.json").read_text())["start_step"] == k
    attempts = [json.loads(ln) for ln in (pp2 / "attempts.jsonl").read_text().splitlines()]
    assert [a["rc"] for a in attempts] == [75, 0]  # exit 75: stopped for requeue
    assert float(rows["pp2"]["wall_s"]) == pytest.approx(sum(a["wall_s"] for a in attempts), abs=0.2)
    # each step once, and the same losses as the unpreempted one-stage run of the same batch
    assert len(losses(pp2)) == STEPS
    assert losses(pp2) == pytest.approx(losses(out / "variants" / "pp1_r0"), rel=1e-4)

    # --collect afterwards rebuilds the same table from the same files
    before_csv = (out / "results.csv").read_text()
    assert main(["bench", "--collect", str(out)]) == 0
    assert (out / "results.csv").read_text() == before_csv


def test_slurm_refuses_an_unknown_partition(tmp_path, slurm, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])  # the refusal asks the cluster (sinfo), in this process
    sweep = write_sweep(tmp_path / "sweep.json", TWO, [])
    from mmpipe.cli import main
    code = main(["bench", str(sweep), "--slurm", "--slurm-partition", "gpu-huge",
                 "--output-dir", str(tmp_path / "out")])
    one_error_line(code, capsys.readouterr().err,
                   "--slurm-partition: 'gpu-huge' is not a partition of this cluster (sinfo lists: debug)")
    assert not (tmp_path / "out").exists()  # nothing submitted, nothing written


@pytest.mark.parametrize("variant, flags, expect", [
    ({"name": "pp2", "stages": 2}, ["--tasks-per-node", "1"],
     "variant 'pp2' (2 stages x dp 1): 2 ranks need 2 nodes of 1 tasks; --nodes allows 1"),
    ({"name": "pp3x2", "stages": 3, "dp": 2}, ["--nodes", "3", "--tasks-per-node", "4"],
     "variant 'pp3x2' (3 stages x dp 2): 6 ranks do not fill whole nodes of 4 tasks"),
])
def test_slurm_refuses_variants_larger_than_the_flags_allow(tmp_path, capsys, variant, flags, expect):
    from mmpipe.cli import main
    sweep = write_sweep(tmp_path / "sweep.json", [{"name": "pp1"}, variant], [])
    assert main(["bench", str(sweep), "--slurm", "--output-dir", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmpipe: error:") and len(err.strip().splitlines()) == 1 and expect in err, err
    assert not (tmp_path / "out").exists()  # refused before anything is written or submitted


def test_slurm_refuses_a_peer_that_does_not_fit_one_node(tmp_path, capsys):
    from mmpipe.cli import main
    sweep = write_sweep(tmp_path / "sweep.json", [{"name": "pp1"}], ["torch_pipe"])
    assert main(["bench", str(sweep), "--slurm", "--tasks-per-node", "1", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == "mmpipe: error: peer 'torch_pipe': its 2 ranks run on one node; --tasks-per-node allows 1\n"


def _plan_text(tmp_path, text: str) -> Path:
    out = tmp_path / "res"
    out.mkdir()
    (out / "bench.json").write_text(text)
    return out


def _plan(tmp_path, **change) -> Path:
    """A well-formed plan of a one-variant local sweep, with `change` applied, in its own directory."""
    out = tmp_path / "res"
    out.mkdir()
    sweep = {"name": "x", "steps": 4, "warmup_steps": 1, "variants": [{"name": "pp1"}]}
    plan = {"version": 1, "mode": "slurm", "sweep_file": "x.json", "sweep": sweep,
            "items": [{"kind": "variant", "name": "pp1", "repeat": 0, "dir": "variants/pp1_r0", "job": "7",
                       "status": None, "reason": ""}]}
    for k, v in change.items():
        if k == "item":
            plan["items"][0].update(v)
        else:
            plan[k] = v
    (out / "bench.json").write_text(json.dumps(plan))
    return out


@pytest.mark.parametrize("make, expect", [
    (lambda t: t / "missing", "no such directory"),
    (lambda t: t, "bench.json: no such file, so not the output directory of `mmpipe bench`"),
    (lambda t: _plan_text(t, "{oops"), "bench.json: not valid JSON"),
    (lambda t: _plan(t, version=9), "bench.json: version 9 is not 1"),
    (lambda t: _plan(t, sweep={"variants": [{"name": "pp1", "stagez": 2}]}),
     "its sweep is malformed: variants[0]: unknown key 'stagez'"),
    (lambda t: _plan(t, item={"name": "pp9"}), "items[0] is not a run of its sweep"),
    (lambda t: _plan(t, item={"dir": "../../etc"}), "items[0].dir '../../etc' is not 'variants/pp1_r0'"),
    (lambda t: _plan(t, item={"job": "7; rm -rf /"}), "items[0] has a malformed status, reason or job id"),
])
def test_collect_refuses_a_malformed_directory(tmp_path, capsys, make, expect):
    from mmpipe.cli import main
    d = make(tmp_path)
    assert main(["bench", "--collect", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmpipe: error: --collect: ") and len(err.strip().splitlines()) == 1, err
    assert expect in err, err
    assert not (Path(d) / "results.csv").exists()


def test_collect_marks_runs_without_an_outcome_pending(tmp_path, capsys):
    """Without Slurm (the job id is unknown there): no outcome.json = pending, exit 0; a broken one = failed, 1."""
    from mmpipe.cli import main
    out = _plan(tmp_path)
    assert main(["bench", "--collect", str(out)]) == 0
    _, rows = read_csv(out / "results.csv")
    assert rows["pp1"]["status"] == "pending" and rows["pp1"]["reason"].startswith("job 7 ")
    assert "1 of 1 run(s) pending: pp1#0" in capsys.readouterr().out
    (out / "variants" / "pp1_r0").mkdir(parents=True)
    (out / "variants" / "pp1_r0" / "outcome.json").write_text("[]")
    assert main(["bench", "--collect", str(out)]) == 1
    _, rows = read_csv(out / "results.csv")
    assert rows["pp1"]["status"] == "failed" and "neither a status nor an exit status" in rows["pp1"]["reason"]


def test_hostfile_refusals_before_any_launch(tmp_path, capsys):
    from mmpipe.cli import main
    sweep = write_sweep(tmp_path / "sweep.json", [{"name": "pp2x2", "stages": 2, "dp": 2}], [])
    hf = tmp_path / "hostfile"
    hf.write_text("localhost slots=2\n")
    assert main(["bench", str(sweep), "--hostfile", str(hf), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == ("mmpipe: error: variant 'pp2x2': 4 ranks (2 stages x dp 2) need more than the hostfile's "
                   "2 active slots\n")
    # every host is asked over ssh before any rank starts, as `mmpipe train --hostfile` does: one line per host
    hf.write_text("no-such-host-a.invalid slots=2\nno-such-host-b.invalid slots=2\n")
    assert main(["bench", str(sweep), "--hostfile", str(hf), "--output-dir", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln.split(" is not reachable")[0] for ln in lines] == [
        f"mmpipe: error: --hostfile: host no-such-host-{h}.invalid" for h in "ab"], lines
    assert all("over passwordless ssh" in ln for ln in lines)
    assert not (tmp_path / "o").exists()


def test_hostfile_sweep_over_two_hosts(tmp_path):
    sweep = write_sweep(tmp_path / "sweep.json", [{"name": "pp2", "stages": 2}, {"name": "pp1"}], [], steps=6)
    out = tmp_path / "out"
    with ssh_cluster(tmp_path / "ssh") as (hosts, ssh_opts):
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in hosts))
        env = dict(os.environ, PDSH_SSH_ARGS_APPEND=ssh_opts)
        proc = bench([str(sweep), "--hostfile", str(hostfile), "--output-dir", str(out)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fields, rows = read_csv(out / "results.csv")
    assert fields == documented_columns()
    assert {n: r["status"] for n, r in rows.items()} == {"pp2": "ok", "pp1": "ok"}
    log = (out / "variants" / "pp2_r0" / "run.log").read_text()
    # one rank per host: stage 0 on the first host, stage 1 on the second (pdsh prefixes remote lines)
    assert f"--include {hosts[0]}:0@{hosts[1]}:0" in log and "pdsh" in log
    for h in hosts:
        assert re.search(rf"^{h}: ", log, re.M), log[-3000:]
    assert losses(out / "variants" / "pp2_r0") == pytest.approx(losses(out / "variants" / "pp1_r0"), rel=1e-4)
    assert json.loads((out / "bench.json").read_text())["mode"] == "hostfile"
    # the same directory collected afterwards: the same table
    table = (out / "results.csv").read_text()
    from mmpipe.cli import main
    assert main(["bench", "--collect", str(out)]) == 0  # in this process: no launch needed
    assert (out / "results.csv").read_text() == table
