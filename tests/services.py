"""Real services for the cluster tests: an OpenSSH server on two loopback addresses named as two
hosts, and a one-node Slurm (munge + slurmctld + slurmd). Each starts only what is missing, is
installed by `.ci/run` (Debian packages), and stops every daemon it started, by pid."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from mmpipe.cluster.ports import free_port

HOSTS = {"mmpipe-node1": "127.0.0.2", "mmpipe-node2": "127.0.0.3"}
SSH_PORT = 2222


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (.ci/run apt-installs openssh-server pdsh slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("needs root: starts sshd/munged/slurmd and names loopback hosts in /etc/hosts")


def _wait(check, what: str, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up within {timeout} s")


def _port_open(addr: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((addr, port)) == 0


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):  # the daemons we started, newest first, by pid
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()


@contextmanager
def loopback_hosts():
    """/etc/hosts names two loopback addresses as two hosts; restored afterwards."""
    hosts = Path("/etc/hosts")
    before = hosts.read_text()
    lines = [f"{ip} {name}" for name, ip in HOSTS.items() if name not in before]
    if lines:
        hosts.write_text(before.rstrip("\n") + "\n" + "\n".join(lines) + "\n")
    try:
        yield list(HOSTS)
    finally:
        hosts.write_text(before)


@contextmanager
def ssh_cluster(tmp: Path):
    """sshd listening on both host addresses, root key auth with a key made here. Yields the ssh
    options that reach it (for PDSH_SSH_ARGS_APPEND, which mmpipe's own reachability check reads too)."""
    _need("sshd", "ssh", "ssh-keygen", "pdsh")
    tmp.mkdir(parents=True, exist_ok=True)
    key = tmp / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")], check=True)
    shutil.copy(tmp / "id_ed25519.pub", tmp / "authorized_keys")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    conf = tmp / "sshd_config"
    conf.write_text("\n".join([
        *(f"ListenAddress {ip}:{SSH_PORT}" for ip in HOSTS.values()),
        f"HostKey {tmp / 'host_key'}", f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
        f"PidFile {tmp / 'sshd.pid'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "StrictModes no", "UsePAM no", "AcceptEnv *", ""]))
    with loopback_hosts() as names:
        sshd = subprocess.Popen([shutil.which("sshd"), "-D", "-e", "-f", str(conf)],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "sshd.log", "w"))
        try:
            _wait(lambda: all(_port_open(ip, SSH_PORT) for ip in HOSTS.values()), "sshd")
            opts = (f"-p {SSH_PORT} -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                    f"-o LogLevel=ERROR")
            yield names, opts
        finally:
            _stop([sshd])


SLURM_CONF = """\
ClusterName=mmpipe-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits out the step credential's lifetime (120 s by default) before it may start
# again on a node that revoked it; 10 s keeps the preemption test short
AuthInfo=cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@contextmanager
def slurm_cluster(tmp: Path):
    """A one-node Slurm: this machine's hostname, all its CPUs. Yields the environment (SLURM_CONF)
    under which sbatch/squeue/scancel talk to it."""
    _need("munged", "slurmctld", "slurmd", "sbatch")
    tmp.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool"):
        (tmp / d).mkdir(exist_ok=True)
    host = socket.gethostname()
    conf = tmp / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, cpus=os.cpu_count(), tmp=tmp, ctld_port=free_port(),
                                      d_port=free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []
    try:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            # munged refuses to run as root or with loose ownership of its directories
            Path("/run/munge").mkdir(exist_ok=True)
            for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
                shutil.chown(d, "munge", "munge")
            if not Path("/etc/munge/munge.key").is_file():
                subprocess.run(["mungekey", "--create"], check=True)
                shutil.chown("/etc/munge/munge.key", "munge", "munge")
            procs.append(subprocess.Popen([shutil.which("munged"), "--foreground"], user="munge", group="munge",
                                          stdout=subprocess.DEVNULL, stderr=open(tmp / "munged.log", "w")))
            _wait(lambda: Path("/run/munge/munge.socket.2").exists(), "munged")
        procs.append(subprocess.Popen([shutil.which("slurmctld"), "-D", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(tmp / "slurmctld.err", "w")))
        _wait(lambda: subprocess.run(["scontrol", "ping"], env=env, capture_output=True,
                                     text=True).stdout.count("UP") > 0, "slurmctld")
        procs.append(subprocess.Popen([shutil.which("slurmd"), "-D", "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(tmp / "slurmd.err", "w")))
        _wait(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                               text=True).stdout, "slurmd (node idle)", timeout=60)
        yield env
    finally:
        _stop(procs)
