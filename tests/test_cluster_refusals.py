"""Bad cluster input is refused before any rank starts, one line naming the problem, exit status 2;
Slurm fields never reach a shell unquoted."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from mmpipe.cli import main

TRAIN = ["--preset", "tiny", "--eval-samples", "0", "--steps", "2"]


def _refused(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("mmpipe: error:")]
    assert rc == 2 and len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("text, expected", [
    ("node1 slots=2\nnode2:2\n", r"hostfile:2: 'node2:2' is not 'HOST slots=N'"),
    ("node1 slots=2 gpus=4\n", r"hostfile:1: 'node1 slots=2 gpus=4' is not 'HOST slots=N'"),
    ("node1 slots=0\n", "hostfile:1: node1 has slots=0; slots must be >= 1"),
    ("node1 slots=-2\n", "hostfile:1: node1 has slots=-2; slots must be >= 1"),
    ("node1 slots=1\n# comment\nnode1 slots=1\n", "hostfile:3: node1 is listed twice"),
    ("# only a comment\n\n", "names no host"),
    ("node1; touch /tmp/x slots=1\n", "is not 'HOST slots=N'"),
])
def test_bad_hostfile_lines(tmp_path, capsys, text, expected):
    hf = tmp_path / "hostfile"
    hf.write_text(text)
    line = _refused(capsys, ["train", "--hostfile", str(hf), "--output-dir", str(tmp_path / "o"), *TRAIN])
    assert expected in line and line.startswith("mmpipe: error: --hostfile: ")


def test_missing_hostfile_and_filters(tmp_path, capsys):
    assert "file not found" in _refused(capsys, ["train", "--hostfile", str(tmp_path / "nope"), *TRAIN])
    hf = tmp_path / "hostfile"
    hf.write_text("node1 slots=2\nnode2 slots=2\n")
    assert "--include: Hostname 'node3' not found in hostfile" in _refused(
        capsys, ["train", "--hostfile", str(hf), "--include", "node3", *TRAIN])
    assert "--include / --exclude: use one of them" in _refused(
        capsys, ["train", "--hostfile", str(hf), "--include", "node1", "--exclude", "node2", *TRAIN])
    assert "they filter a --hostfile" in _refused(capsys, ["train", "--exclude", "node2", *TRAIN])
    assert "--dp: 1 x 2 stages != the hostfile's 4 slots" in _refused(
        capsys, ["train", "--hostfile", str(hf), "--dp", "1", "--stages", "2", *TRAIN])
    # 3 slots cannot hold whole 2-stage pipelines: the ordinary stage check, on the hostfile's world
    hf.write_text("node1 slots=2\nnode2 slots=1\n")
    assert "world size 3 is not a multiple of 2 stages" in _refused(
        capsys, ["train", "--hostfile", str(hf), "--stages", "2", *TRAIN])


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client (.ci/run installs openssh)")
def test_unreachable_host_is_named_before_any_rank_starts(tmp_path, capsys):
    hf = tmp_path / "hostfile"
    hf.write_text("mmpipe-no-such-host-a slots=1\nmmpipe-no-such-host-b slots=1\n")
    out = tmp_path / "o"
    rc = main(["train", "--hostfile", str(hf), "--output-dir", str(out), "--stages", "2", *TRAIN])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.startswith("mmpipe: error:")]
    assert rc == 2 and len(lines) == 2, cap.err  # one line per unreachable host
    assert "host mmpipe-no-such-host-a is not reachable over passwordless ssh" in lines[0]
    assert "mmpipe-no-such-host-b" in lines[1] and "--exclude mmpipe-no-such-host-b" in lines[1]
    assert "deepspeed" not in cap.out and not (out / "train_log.csv").exists()  # nothing launched


def _slurm(tmp_path, *extra):
    return ["slurm", "--output-dir", str(tmp_path / "o"), "--tasks-per-node", "2", *TRAIN, *extra]


@pytest.mark.parametrize("flag, value, expected", [
    ("--job-name", "x; touch pwned", "--job-name: 'x; touch pwned' may hold only"),
    ("--job-name", "a\n#SBATCH --uid=0", "--job-name: 'a\\n#SBATCH --uid=0' may hold only"),
    ("--slurm-partition", "gpu$(id)", "--slurm-partition: 'gpu$(id)' may hold only"),
    ("--account", "acct`id`", "--account: 'acct`id`' may hold only"),
    ("--time", "1:00:00\nrm -rf /", "--time: '1:00:00\\nrm -rf /' is not a Slurm time"),
    ("--env", "A B=1", "--env: 'A B=1' is not KEY=VALUE"),
    ("--env", "X=1\ntouch pwned", "--env: X's value holds a newline"),
    ("--nodes", "0", "--nodes: 0 must be >= 1"),
])
def test_bad_slurm_fields(tmp_path, capsys, flag, value, expected):
    line = _refused(capsys, _slurm(tmp_path, flag, value))
    assert expected in line
    assert not (tmp_path / "o" / "slurm_job.sh").exists()


def test_slurm_output_dir_with_metacharacters_is_refused(tmp_path, capsys):
    line = _refused(capsys, ["slurm", "--output-dir", str(tmp_path / "o;id"), "--tasks-per-node", "2", *TRAIN])
    assert "--output-dir: " in line and "may hold only" in line


def test_a_bad_run_is_refused_before_submission(tmp_path, capsys):
    line = _refused(capsys, _slurm(tmp_path, "--stages", "3"))  # 2 tasks, 3 stages
    assert "world size 2 is not a multiple of 3 stages" in line


def test_script_quotes_values_and_maps_ranks(tmp_path, capsys):
    """Run the generated script with stand-in srun/scontrol: metacharacters in an --env value reach
    the ranks verbatim and are never executed."""
    marker = tmp_path / "pwned"
    value = f"$(touch {marker}); `touch {marker}` && touch {marker} 'q' \"d\""
    assert main(_slurm(tmp_path, "--env", f"MMPIPE_NOTE={value}", "--job-name", "t1")) == 0
    script = (tmp_path / "o" / "slurm_job.sh").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --job-name=t1" in script
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text("#!/bin/sh\n[ -n \"$PREEMPT\" ] && touch \"$PREEMPT\"\n"
                               f"exec {shutil.which('python3') or 'python3'} -c 'import json,os,sys; "
                               f"print(json.dumps([sys.argv[1:], os.environ[\"MMPIPE_NOTE\"], "
                               f"os.environ[\"MASTER_ADDR\"], os.environ[\"MASTER_PORT\"]]))' \"$@\"\n")
    (bin_ / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\necho node7\necho node8\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_ID="1234",
               SLURM_JOB_NODELIST="node[7-8]", SLURM_CPUS_PER_TASK="1")
    r = subprocess.run(["bash", str(tmp_path / "o" / "slurm_job.sh")], env=env, capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    argv, note, addr, port = json.loads(r.stdout.strip().splitlines()[-1])
    assert note == value and not marker.exists()
    assert addr == "node7" and port == str(20000 + 1234 % 20000)
    assert argv[1:4] == ["-u", "-m", "mmpipe.train"] and "--resume" not in argv
    assert argv[argv.index("--output-dir") + 1] == str(tmp_path / "o")
    # once a checkpoint exists the same script resumes
    (tmp_path / "o" / "checkpoints").mkdir()
    (tmp_path / "o" / "checkpoints" / "latest").write_text("step1")
    r = subprocess.run(["bash", str(tmp_path / "o" / "slurm_job.sh")], env=env, capture_output=True, text=True)
    assert json.loads(r.stdout.strip().splitlines()[-1])[0][-1] == "--resume"
    # a stale marker is not this run's: no requeue; one the ranks write is: requeue this job
    marker = tmp_path / "o" / "preempted"
    marker.write_text("old")
    subprocess.run(["bash", str(tmp_path / "o" / "slurm_job.sh")], env=env, capture_output=True, check=True)
    assert "requeue" not in (tmp_path / "scontrol.log").read_text() and not marker.exists()
    r = subprocess.run(["bash", str(tmp_path / "o" / "slurm_job.sh")], env=dict(env, PREEMPT=str(marker)),
                       capture_output=True, text=True)
    assert r.returncode == 0 and "requeueing job 1234" in r.stdout
    assert "requeue 1234" in (tmp_path / "scontrol.log").read_text() and not marker.exists()


def test_ranks_from_slurm_variables():
    from mmpipe.cluster.slurm_env import ranks_from_slurm
    task = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
    env = dict(task)
    assert ranks_from_slurm(env) and (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "1", "4")
    launched = dict(task, RANK="0")  # deepspeed or torchrun inside the allocation: theirs wins
    assert not ranks_from_slurm(launched) and launched["RANK"] == "0"
    batch_shell = {k: v for k, v in task.items() if k != "SLURM_STEP_ID"}
    assert not ranks_from_slurm(batch_shell) and "RANK" not in batch_shell


@pytest.mark.parametrize("value, threads", [("", 1), (" 3 ", 3), ("abc", None), ("0", None)])
def test_omp_num_threads_empty_is_one_and_junk_is_one_line(capsys, monkeypatch, tmp_path, value, threads):
    """An exported-but-empty OMP_NUM_THREADS is 'unset' (1 thread per rank), as the launchers pass it on;
    anything but a positive integer stops the front door and each rank entry with one line, before launch."""
    from mmpipe.cluster.hostfile import rank_threads, with_rank_threads
    from mmpipe.train import main as rank_main
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    if threads is not None:
        assert rank_threads(os.environ) == threads
        assert with_rank_threads({"OMP_NUM_THREADS": value})["OMP_NUM_THREADS"] == str(threads)
        return
    for entry in (lambda a: main(["train", *a]), rank_main):
        assert entry([*TRAIN, "--output-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert [ln for ln in err.splitlines() if ln.startswith("mmpipe: error:")] == [
            f"mmpipe: error: OMP_NUM_THREADS: {value!r} is not a thread count; set a positive integer (1 per rank "
            f"on CPU) or unset it"], err


def test_hostfile_script_runs_one_host_without_ssh(tmp_path):
    """docs/multinode.md: one host needs no ssh. DeepSpeed ssh-checks the first host of any hostfile, so
    launch/deepspeed_hostfile.sh passes --no_ssh_check when one host is active (a one-line `localhost`
    file, or --exclude leaving one), not with two; a bad hostfile is one line, exit 2, before DeepSpeed."""
    from conftest import ROOT
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "deepspeed"  # records its command line instead of launching
    fake.write_text("#!/bin/sh\necho \"deepspeed $*\"\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    (tmp_path / "one").write_text("localhost slots=2\n")
    (tmp_path / "two").write_text("a slots=1\nb slots=1\n")
    (tmp_path / "bad").write_text("a slots=0\n")

    def launch(hostfile, *ds):
        return subprocess.run([str(ROOT / "launch" / "deepspeed_hostfile.sh"), str(tmp_path / hostfile), "a", *ds,
                               "--", "--stages", "2"], env=env, capture_output=True, text=True, timeout=120)
    line = [ln for ln in launch("one").stdout.splitlines() if ln.startswith("deepspeed ")]
    assert len(line) == 1 and "--no_ssh_check" in line[0] and line[0].endswith("--module mmpipe.train --stages 2")
    assert "--no_ssh_check" not in launch("two").stdout
    assert "--no_ssh_check" in launch("two", "--exclude", "b").stdout
    bad = launch("bad")
    assert bad.returncode == 2 and "deepspeed " not in bad.stdout
    assert bad.stderr.strip().splitlines() == ["deepspeed_hostfile.sh: --hostfile: " + str(tmp_path / "bad")
                                               + ":1: a has slots=0; slots must be >= 1"]


def test_check_job_neither_resumes_nor_requeues(tmp_path, capsys):
    """`mmpipe slurm --command check` (docs/check.md: the check job neither resumes nor requeues): its script asks
    Slurm for no requeue and no USR1, never adds --resume, touches no preemption marker and says nothing of
    requeueing; its exit status is srun's, the check's verdict. Training's script, same flags, keeps all of it."""
    for command in ("check", "train"):
        assert main(_slurm(tmp_path / command, "--stages", "2", "--command", command)) == 0
    capsys.readouterr()
    check, train = ((tmp_path / c / "o" / "slurm_job.sh").read_text() for c in ("check", "train"))
    preemption = ("#SBATCH --requeue", "#SBATCH --signal=USR1@120", "RESUME", "--resume", "preempted", "requeue",
                  "SIGTERM")
    assert [w for w in preemption if w in train] == list(preemption)
    assert [w for w in preemption if w in check.replace("#SBATCH --no-requeue", "")] == []
    assert "#SBATCH --no-requeue" in check.splitlines() and "--signal" not in check
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text("#!/bin/sh\necho \"$@\"\nexit 1\n")  # a check that failed: rank 0 exits 1
    (bin_ / "scontrol").write_text("#!/bin/sh\necho node7\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="node7")
    r = subprocess.run(["bash", str(tmp_path / "check" / "o" / "slurm_job.sh")], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stdout.split()[2:4] == ["-m", "mmpipe.check.rank"], r.stdout + r.stderr
