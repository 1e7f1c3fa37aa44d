"""The `mmpipe` command. `mmpipe train` checks the run, then starts the deepspeed launcher with
stages x dp local processes, each running `python -m mmpipe.train` with the same flags."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

# The front door only checks and launches; keep its refusals to the one line each. DeepSpeed
# announces its CPU fallback at import, and the ranks it starts still say so in their logs.
logging.getLogger("DeepSpeed").addFilter(lambda r: "Setting accelerator to CPU" not in r.getMessage())

from .cluster.ports import free_port  # noqa: E402
from .runtime import precision  # noqa: E402
from .config import ConfigError, list_presets  # noqa: E402
from .run_config import add_train_args, fail, requested_stages, resolve  # noqa: E402


def cmd_train(args: argparse.Namespace, rank_argv: list[str]) -> int:
    hosts = None
    if args.hostfile or args.include or args.exclude:
        from .cluster import hostfile
        try:
            if not args.hostfile:
                raise ConfigError("--include / --exclude: they filter a --hostfile; give one")
            hosts = hostfile.active(hostfile.parse(args.hostfile), args.include, args.exclude)
        except ConfigError as e:
            return fail(e)
    elif args.dp is None:
        args.dp = 1
    if args.dp is not None and args.dp < 1:
        return fail(ConfigError(f"--dp: {args.dp} must be >= 1"))
    try:
        stages = requested_stages(args)
        world = sum(len(s) for s in hosts.values()) if hosts else args.dp * stages
        if hosts and args.dp is not None and args.dp * stages != world:
            raise ConfigError(f"--dp: {args.dp} x {stages} stages != the hostfile's {world} slots; leave --dp "
                              f"out (with --hostfile it is slots / stages)")
        run = resolve(args, world_size=world)
        if hosts is None:  # local ranks use this machine's accelerator; remote hosts check in their ranks
            precision.check(run.precision)
    except ConfigError as e:
        return fail(e)
    if not run.data.builtin:
        # read and check every record once, before any rank starts; the ranks reuse the index
        from .data.dataset import prepare
        try:
            prepare(run.data, run.model, args.output_dir, args.seed, verbose="always")
        except ConfigError as e:
            return fail(e)
    launcher = shutil.which("deepspeed")
    if launcher is None:
        return fail(ConfigError("deepspeed launcher not found on PATH (pip install deepspeed)"))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; the launcher does not set it
    if hosts is None:
        where = ["--num_gpus", str(run.stages * run.dp), "--master_addr", "127.0.0.1",
                 "--master_port", str(args.master_port or free_port())]
    else:
        from .cluster import hostfile
        if len(hosts) > 1:  # DeepSpeed runs a single active host locally, without ssh
            try:
                hostfile.check_reachable(hosts, env)
            except ConfigError as e:
                return fail(e)
        env["DS_ENV_FILE"] = str(hostfile.env_file(Path(args.output_dir), env))
        # every host was checked above; DeepSpeed's own check (first host, plain ssh) would not
        # see PDSH_SSH_ARGS_APPEND's options
        where = ["--hostfile", args.hostfile, "--no_ssh_check", "--master_addr", args.master_addr or next(iter(hosts)),
                 "--master_port", str(args.master_port or 29500)]
        where += ["--include", args.include] if args.include else ["--exclude", args.exclude] if args.exclude else []
    cmd = [launcher, *where, "--module", "mmpipe.train", *rank_argv]
    print("mmpipe: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="mmpipe", description="Train vision-language models as DeepSpeed pipelines.")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train on this machine through the deepspeed launcher")
    add_train_args(t)
    t.add_argument("--dp", type=int, default=None,
                   help="data-parallel replicas of the pipeline (default: 1; with --hostfile: slots / stages)")
    t.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: a free one; with --hostfile 29500)")
    t.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('HOST slots=N' lines): run on those hosts "
                                                    "over ssh (pdsh); docs/multinode.md")
    t.add_argument("--include", default="", help="with --hostfile: only these hosts/slots, e.g. node1:0,1@node2")
    t.add_argument("--exclude", default="", help="with --hostfile: leave out these hosts/slots, e.g. node3")
    t.add_argument("--master-addr", default=None,
                   help="with --hostfile: rendezvous host (default: the first active host)")
    from .cluster.slurm import add_slurm_args
    sl = sub.add_parser("slurm", help="write (and --submit) an sbatch script that runs this training under Slurm")
    add_slurm_args(sl)
    add_train_args(sl)
    sub.add_parser("presets", help="list the model presets")
    from .planning.plan import add_plan_args
    add_plan_args(sub.add_parser("plan", help="predict step time, memory and throughput of each PP x DP x micro layout"))
    from .data.export import add_export_args
    add_export_args(sub.add_parser("export-shapes", help="write the built-in shapes set as LLaVA / pairs / HF data"))
    from .inference.generate import add_generate_args
    add_generate_args(sub.add_parser("generate", help="answer a prompt about an image with a trained or HF model"))
    from .hf.commands import add_export_args as add_weights_export_args, add_import_args
    add_import_args(sub.add_parser("import", help="an HF LLaVA / vision + LM / moondream model -> an mmpipe run directory"))
    add_weights_export_args(sub.add_parser("export", help="a run's checkpoint -> an HF LLaVA directory or one safetensors file"))
    from .bench.main import add_bench_args
    add_bench_args(sub.add_parser("bench", help="run a sweep of training variants and peers; table, CSV, plots "
                                                "(docs/benchmarks.md)"))
    args = p.parse_args(argv)
    if args.command == "bench":
        from .bench.main import main_bench
        return main_bench(args)
    if args.command in ("import", "export"):
        from .hf import commands
        return commands.main_import(args) if args.command == "import" else commands.main_export(args)
    if args.command == "generate":
        from .inference.generate import main_generate
        return main_generate(args)
    if args.command == "slurm":
        from .cluster.slurm import main_slurm
        return main_slurm(argv[1:])
    if args.command == "presets":
        print("\n".join(list_presets()))
        return 0
    if args.command == "plan":
        from .planning.plan import main_plan
        return main_plan(args)
    if args.command == "export-shapes":
        from .data.export import export_shapes
        print(export_shapes(args.out, args.format, args.n, seed=args.seed, image_size=args.image_size,
                            patch=args.patch))
        return 0
    if args.command == "train":
        rank_argv = _strip(argv[1:], FRONT_DOOR_FLAGS)
        return cmd_train(args, rank_argv)
    p.print_help()
    return 2


FRONT_DOOR_FLAGS = {"--dp", "--master-port", "--hostfile", "--include", "--exclude", "--master-addr"}


def _strip(argv: list[str], flags: set[str]) -> list[str]:
    """argv without the front-door-only flags (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif a.split("=", 1)[0] not in flags:
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
