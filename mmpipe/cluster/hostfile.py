"""Multi-node launch through DeepSpeed's own launcher: `deepspeed --hostfile FILE` (pdsh over ssh).

mmpipe checks what DeepSpeed would only find out late or not at all, before any rank starts:
each hostfile line (`HOST slots=N`, N >= 1), duplicate hosts, the --include/--exclude filter (by
DeepSpeed's own parser, so both agree on the active hosts), and that every active host answers
over ssh with the options pdsh will use (DeepSpeed checks only the first host).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from ..config import ConfigError

LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.-]+)\s+slots=(?P<slots>-?\d+)$")
# variables a cluster run needs on every host; pdsh starts remote ranks with a bare ssh environment
PASS_ENV = ("OMP_NUM_THREADS", "NCCL_", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "CUDA_LAUNCH_BLOCKING",
            "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_", "HF_", "TRANSFORMERS_", "MMPIPE_")


def rank_threads(env) -> int:
    """OMP_NUM_THREADS as every rank applies it: unset or empty is 1 (one thread per rank: 2 ranks on
    2 cores; more oversubscribes the cores). Anything else must be a positive integer."""
    v = (env.get("OMP_NUM_THREADS") or "").strip()
    if not v:
        return 1
    if not v.isdigit() or int(v) < 1:
        raise ConfigError(f"OMP_NUM_THREADS: {v!r} is not a thread count; set a positive integer (1 per rank on "
                          f"CPU) or unset it")
    return int(v)


def with_rank_threads(env: dict) -> dict:
    """env with OMP_NUM_THREADS set as the ranks apply it (the launchers pass an empty value on)."""
    env["OMP_NUM_THREADS"] = str(rank_threads(env))
    return env


def parse(path: str) -> dict[str, int]:
    """Host -> slots, in file order. One problem per line, naming the line."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--hostfile: file not found: {path}")
    if p.is_dir():
        raise ConfigError(f"--hostfile: {path} is a directory; give a file of 'HOST slots=N' lines")
    hosts: dict[str, int] = {}
    problems = []
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = LINE.match(line)
        if not m:
            problems.append(f"--hostfile: {path}:{n}: {raw.strip()!r} is not 'HOST slots=N'")
        elif int(m["slots"]) < 1:
            problems.append(f"--hostfile: {path}:{n}: {m['host']} has slots={m['slots']}; slots must be >= 1")
        elif m["host"] in hosts:
            problems.append(f"--hostfile: {path}:{n}: {m['host']} is listed twice (one line per host, "
                            f"slots = its ranks)")
        else:
            hosts[m["host"]] = int(m["slots"])
    if not hosts and not problems:
        problems.append(f"--hostfile: {path} names no host (lines are 'HOST slots=N')")
    if problems:
        raise ConfigError("\n".join(problems))
    return hosts


def active(hosts: dict[str, int], include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """The hosts and slots a launch uses, by DeepSpeed's own --include/--exclude rules."""
    from deepspeed.launcher.runner import parse_inclusion_exclusion
    if include and exclude:
        raise ConfigError("--include / --exclude: use one of them, not both")
    try:
        res = parse_inclusion_exclusion(dict(hosts), include, exclude)
    except (ValueError, KeyError) as e:
        flag = "--include" if include else "--exclude"
        raise ConfigError(f"{flag}: {e}") from None
    res = {h: s for h, s in res.items() if s}
    if not res:
        raise ConfigError("--include / --exclude: no host or slot left to run on")
    return res


def ssh_options(env: dict) -> list[str]:
    """The options pdsh adds to its ssh calls (PDSH_SSH_ARGS_APPEND), so the check sees what pdsh sees."""
    return shlex.split(env.get("PDSH_SSH_ARGS_APPEND", ""))


def check_reachable(hosts, env: dict, timeout: int = 10) -> None:
    """Every host answers `ssh HOST true` without a password prompt, or one line per host that does not."""
    problems = []
    for h in hosts:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", *ssh_options(env), h, "true"]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 5,
                               stdin=subprocess.DEVNULL)
            why = (r.stderr.strip().splitlines() or [f"ssh exit status {r.returncode}"])[-1] if r.returncode else None
        except subprocess.TimeoutExpired:
            why = f"no answer within {timeout} s"
        if why:
            problems.append(f"--hostfile: host {h} is not reachable over passwordless ssh ({why}); "
                            f"fix ssh (keys, ~/.ssh/config or PDSH_SSH_ARGS_APPEND) or drop it with --exclude {h}")
    if problems:
        raise ConfigError("\n".join(problems))


def env_file(out_dir: Path, env: dict) -> Path:
    """A DeepSpeed environment file (DS_ENV_FILE) with what every remote rank must see: pdsh
    exports only PYTHON* variables by itself. ~/.deepspeed_env, which DS_ENV_FILE replaces, comes first."""
    lines = []
    home = Path.home() / ".deepspeed_env"
    if home.is_file():
        lines += [ln for ln in home.read_text().splitlines() if "=" in ln]
    lines.append(f"PATH={env.get('PATH', os.defpath)}")  # the same Python and tools as this host
    lines += [f"{k}={v}" for k, v in sorted(env.items())
              if k.startswith(PASS_ENV) and "\n" not in v]
    out_dir.mkdir(parents=True, exist_ok=True)
    f = out_dir / "deepspeed_env"
    f.write_text("\n".join(lines) + "\n")
    return f.resolve()
