"""The `mmpipe` command: a table of subcommands, each with its flags and its function.
`mmpipe train` checks the run, then starts the deepspeed launcher with stages x dp local processes,
each running `python -m mmpipe.train` with the same TrainArgs."""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

gc.disable()  # while torch and the commands import: as mmpipe.train's (~0.15 s of CPU of every `mmpipe` command)
import torch  # noqa: E402

# The front door only checks and launches; keep its refusals to the one line each. DeepSpeed
# announces its CPU fallback at import, and the ranks it starts still say so in their logs.
logging.getLogger("DeepSpeed").addFilter(lambda r: "Setting accelerator to CPU" not in r.getMessage())

from .bench.main import add_bench_args, main_bench  # noqa: E402
from .check.main import CHECK_FILE, check_verdict  # noqa: E402
from .cluster import hostfile  # noqa: E402
from .cluster.ports import free_port  # noqa: E402
from .cluster.slurm import add_slurm_args, main_slurm  # noqa: E402
from .config import ConfigError, fail, list_presets  # noqa: E402
from .data.dataset import prepare, prepare_eval  # noqa: E402
from .data.export import add_export_args, export_shapes  # noqa: E402
from .flags import add_dry_run, add_flags, from_namespace, print_plan, to_argv  # noqa: E402
from .hf.commands import add_export_args as add_weights_export_args  # noqa: E402
from .hf.commands import add_import_args, main_export, main_import  # noqa: E402
from .inference.generate import add_generate_args, main_generate  # noqa: E402
from .inference.scoring import add_eval_args, main_eval  # noqa: E402
from .model.attention import attention_backend  # noqa: E402
from .planning.plan import add_plan_args, main_plan  # noqa: E402
from .run_args import CheckArgs, LaunchArgs, TrainArgs  # noqa: E402
from .run_config import config_dp, requested_stages, resolve  # noqa: E402
from .runtime import checkpoint, precision  # noqa: E402
from .runtime.curves import add_plot_args, main_plot  # noqa: E402
from .runtime.feed import decoder_length  # noqa: E402
from .runtime.precomputed import main_score_reference, read_reference  # noqa: E402

gc.enable()


def cmd_train(ns: argparse.Namespace, module: str = "mmpipe.train", extra: tuple[str, ...] = ()) -> int:
    """module: the rank entry the launcher starts (`mmpipe check` starts mmpipe.check.rank on the same ranks);
    extra: flags for that entry beyond train's (check's own)."""
    args, la = from_namespace(TrainArgs, ns), from_namespace(LaunchArgs, ns)
    try:
        hosts, world = _ranks(args, la)
        run = resolve(args, world_size=world)
        if args.resume:  # before launch: the saved rows are what its data position counts
            checkpoint.check_same_rows(Path(args.output_dir) / "checkpoints", run)
        if run.data.auto_slots:
            print(f"mmpipe: --pack: {run.max_images} image slots per row of {decoder_length(run)} positions "
                  f"(--text-len {run.text_len} / the data's mean sample text, at most what text.max_context "
                  f"{run.model.text.max_context} holds; --max-images N sets them); images a "
                  f"record may have: {run.data.image_limit}", flush=True)  # too_many_images' own words
        if hosts is None:  # local ranks use this machine's accelerator; remote hosts check in their ranks
            device = precision.this_device()
            precision.check(run.precision, device)
            # MMPIPE_ATTENTION=flex without CUDA: the attention module's own rule, here rather than at every
            # rank's first attention (a traceback per rank, the one line buried in the launcher's log)
            attention_backend(torch.device(device.kind))
    except ConfigError as e:
        return fail(e)
    # read and check every record once, before any rank starts; the ranks reuse the indexes (a dry
    # run checks them in a scratch directory: it writes nothing)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            index_dir = scratch if ns.dry_run else args.output_dir
            real = args.output_dir if ns.dry_run else None  # the bad-record list the report names: a run's
            if not run.data.builtin:
                samples = prepare(run.data, run.model, index_dir, args.seed, verbose="always", run_dir=real)
                if run.reference_logps:  # dpo's precomputed reference: this model's, on this index (fingerprints)
                    read_reference(run.reference_logps, run, samples, args.seed)
            if run.eval_data is not None and not run.eval_data.builtin:
                prepare_eval(run.eval_data, run.model, index_dir, args.seed, args.eval_samples, verbose="always",
                             run_dir=real)
        launcher = shutil.which("deepspeed")
        if launcher is None:
            raise ConfigError("deepspeed launcher not found on PATH (pip install deepspeed)")
        env = dict(os.environ)
        hostfile.with_rank_threads(env)  # one thread per rank unless set; the launcher does not set it
        where = _where(la, hosts, run, args, env, ns.dry_run)
    except ConfigError as e:
        return fail(e)
    cmd = [launcher, *where, "--module", module, *args.to_argv(), *extra]
    if ns.dry_run:
        return _train_plan(cmd, run, args, hosts, "train" if module == "mmpipe.train" else "check")
    print("mmpipe: " + " ".join(cmd), flush=True)
    return _run_launcher(cmd, env)


def _ranks(args: TrainArgs, la: LaunchArgs) -> tuple[dict | None, int]:
    """(the hostfile's active hosts, None for local ranks; the world size): a replica's ranks are stages x tp, DP of
    them; locally without --dp the config's own DP when it fixes one (plan --write-config's), else 1. ConfigError for
    a filter without a hostfile, a bad --dp or one the hostfile's slots do not give."""
    hosts = None
    if la.hostfile or la.include or la.exclude:
        if not la.hostfile:
            raise ConfigError("--include / --exclude: they filter a --hostfile; give one")
        hosts = hostfile.active(hostfile.parse(la.hostfile), la.include, la.exclude)
    dp = la.dp if la.dp is not None or hosts else config_dp(args)
    if dp is not None and dp < 1:
        raise ConfigError(f"--dp: {dp} must be >= 1")
    stages, tp = requested_stages(args), max(1, args.tp) * max(1, args.sp)  # a replica's ranks: stages x tp (or sp)
    world = sum(len(s) for s in hosts.values()) if hosts else dp * stages * tp
    if hosts and dp is not None and dp * stages * tp != world:
        raise ConfigError(f"--dp: {dp} x {stages} stages{f' x tp {tp}' if tp > 1 else ''} != the hostfile's "
                          f"{world} slots; leave --dp out (with --hostfile it is slots / stages"
                          f"{' / tp' if tp > 1 else ''})")
    return hosts, world


def _run_launcher(cmd: list[str], env: dict) -> int:
    """Run `cmd` (the `deepspeed` command printed above) through DeepSpeed's own runner, called in this
    process rather than as a new one: the same launch, without a fresh interpreter importing torch and
    DeepSpeed again (~3.6 s of CPU per launch). The runner reads os.environ and exits with the launch's
    failing status (SystemExit), as the `deepspeed` command does."""
    from deepspeed.launcher import runner
    os.environ.clear()
    os.environ.update(env)
    # what this process built is kept until it exits: out of the collector's sight (gc.freeze), its exit does not
    # walk those objects looking for garbage (~1 s of CPU per launch, as a rank's: mmpipe.train.exit_fast)
    gc.freeze()
    try:
        runner.main(cmd[1:])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def _where(la: LaunchArgs, hosts: dict | None, run, args: TrainArgs, env: dict, dry_run: bool) -> list[str]:
    """The launcher's placement flags: local ranks, or the hostfile's hosts (checked over ssh and given
    DS_ENV_FILE in env, except in a dry run)."""
    if hosts is None:
        return ["--num_gpus", str(run.stages * run.dp * run.tp * run.sp), "--master_addr", "127.0.0.1",
                "--master_port", str(la.master_port or free_port())]
    if not dry_run:
        if len(hosts) > 1:  # DeepSpeed runs a single active host locally, without ssh
            hostfile.check_reachable(hosts, env)
        env["DS_ENV_FILE"] = str(hostfile.env_file(Path(args.output_dir), env))
    # every host was checked above; DeepSpeed's own check (first host, plain ssh) would not
    # see PDSH_SSH_ARGS_APPEND's options
    where = ["--hostfile", la.hostfile, "--no_ssh_check", "--master_addr", la.master_addr or next(iter(hosts)),
             "--master_port", str(la.master_port or 29500)]
    return where + (["--include", la.include] if la.include else ["--exclude", la.exclude] if la.exclude else [])


def _train_plan(cmd: list[str], run, args: TrainArgs, hosts: dict | None, command: str = "train") -> int:
    """--dry-run: what `mmpipe train` (or `mmpipe check`) would launch."""
    data = lambda d: d if d is None else "shapes (built-in)" if d.builtin else str(Path(d.name).resolve())  # noqa: E731
    return print_plan(
        f"{command} {run.model.name}", launch=shlex.join(cmd),
        layout=f"{run.stages} stages x dp {run.dp}{f' x tp {run.tp}' if run.tp > 1 else ''}"
               f"{f' x sp {run.sp}' if run.sp > 1 else ''} = "
               f"{run.stages * run.dp * run.tp * run.sp} ranks, micro {run.micro} x GAS {run.gas} "
               f"x dp {run.dp} = {run.train_batch} rows per step, schedule {run.schedule}",
        stages=f"layer boundaries {run.parts} ({len(run.layers)} layers)",
        ds_config=f"{Path(run.ds_config_path).resolve()} ({run.precision}, ZeRO-{run.zero_stage})",
        data=data(run.data), eval_data=data(run.eval_data),
        init_from=run.init_from and str(Path(run.init_from).resolve()),
        output_dir=str(Path(args.output_dir).resolve()),
        not_checked=f"ssh to the {len(hosts)} hosts (checked at launch)" if hosts and len(hosts) > 1 else None)


def cmd_check(ns: argparse.Namespace) -> int:
    """`mmpipe check`: train's checks and launch, the check ranks instead of training; exit from check.json."""
    if not ns.dry_run:
        (Path(ns.output_dir) / CHECK_FILE).unlink(missing_ok=True)  # an earlier check's verdict is not this one's
    rc = cmd_train(ns, module="mmpipe.check.rank", extra=tuple(to_argv(from_namespace(CheckArgs, ns))))
    return rc if ns.dry_run or rc == 2 else check_verdict(Path(ns.output_dir), rc)


def cmd_slurm(ns: argparse.Namespace) -> int:
    return main_slurm(ns, from_namespace(TrainArgs, ns))


def cmd_presets(ns: argparse.Namespace) -> int:
    print("\n".join(list_presets()))
    return 0


def cmd_export_shapes(ns: argparse.Namespace) -> int:
    if ns.n < 1:
        return fail(ConfigError(f"--n: {ns.n} must be >= 1"))
    if ns.dry_run:
        return print_plan(f"export-shapes: {ns.n} records as {ns.format}", out=str(Path(ns.out).resolve()),
                          images=f"{ns.image_size} px, shapes on a {ns.patch}-px grid, seed {ns.seed}")
    print(export_shapes(ns.out, ns.format, ns.n, seed=ns.seed, image_size=ns.image_size, patch=ns.patch))
    return 0


def _train_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, TrainArgs)
    add_flags(p, LaunchArgs)


def _check_flags(p: argparse.ArgumentParser) -> None:
    _train_flags(p)
    add_flags(p, CheckArgs)


def _slurm_flags(p: argparse.ArgumentParser) -> None:
    add_slurm_args(p)
    add_flags(p, TrainArgs)


# name -> (help, declares the flags, runs the command)
COMMANDS = {
    "train": ("train on this machine through the deepspeed launcher", _train_flags, cmd_train),
    "check": ("run train's ranks as a check: env, links, pipeline == single device, loader (docs/check.md)",
              _check_flags, cmd_check),
    "slurm": ("write (and --submit) an sbatch script that runs this training under Slurm", _slurm_flags, cmd_slurm),
    "presets": ("list the model presets", lambda p: None, cmd_presets),
    "plan": ("predict step time, memory and throughput of each PP x DP x micro layout", add_plan_args, main_plan),
    "export-shapes": ("write the built-in shapes set as LLaVA / pairs / HF data", add_export_args, cmd_export_shapes),
    "generate": ("answer a prompt about an image with a trained or HF model", add_generate_args, main_generate),
    "import": ("an HF LLaVA / vision + LM / moondream model -> an mmpipe run directory", add_import_args, main_import),
    "export": ("a run's checkpoint -> an HF LLaVA directory or one safetensors file", add_weights_export_args,
               main_export),
    "score-reference": ("--objective dpo: write each preference pair's reference log-probs beside the data index "
                        "(train reads them with --reference-logps; docs/dpo.md)",
                        lambda p: add_flags(p, TrainArgs), main_score_reference),
    "eval": ("score a trained or HF model on a dataset: batched generation, metric per record and type, "
             "validation loss", add_eval_args, main_eval),
    "plot": ("draw runs' training curves (loss, validation loss, lr, throughput) as one PNG", add_plot_args,
             main_plot),
    "bench": ("run a sweep of training variants and peers; table, CSV, plots (docs/benchmarks.md)", add_bench_args,
              main_bench),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmpipe", description="Train vision-language models as DeepSpeed pipelines.")
    sub = p.add_subparsers(dest="command")
    for name, (help_, add_args, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_)
        add_args(sp)
        add_dry_run(sp)  # each command's function honours it where everything is resolved
        sp.set_defaults(func=run)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not hasattr(args, "func"):
        p.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
