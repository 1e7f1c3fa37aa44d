"""Per-rank training entry: `python -m mmpipe.train ...` under the deepspeed launcher or torchrun.

Each rank resolves and checks the whole run (mmpipe.run_config) before creating a process group,
then trains its stage (mmpipe.runtime.trainer). After the last step, rank 0 reloads the final
checkpoint into the single-device reference model and scores held-out accuracy on the built-in
shapes set (greedy answers, exact match).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

# No cyclic garbage collection while torch and DeepSpeed import: their ~260k objects all stay, and the collector's
# automatic full passes over a growing heap cost ~0.6 s of a rank's ~2.5 s import CPU (measured, both loaded alike)
gc.disable()
from .cluster.hostfile import rank_threads  # noqa: E402
from .cluster.preempt import Preemption  # noqa: E402
from .cluster.slurm_env import ranks_from_slurm  # noqa: E402
from .config import ConfigError, fail  # noqa: E402
from .flags import add_flags, from_namespace  # noqa: E402
from .inference.evaluate import blind_baseline, evaluate  # noqa: E402
from .run_args import TrainArgs  # noqa: E402
from .run_config import RunConfig, resolve  # noqa: E402
from .runtime.checkpoint import load_reference  # noqa: E402
from .runtime.teardown import rank_failed, release  # noqa: E402
from .runtime.trainer import train  # noqa: E402

gc.enable()


def parse_args(argv=None) -> TrainArgs:
    p = argparse.ArgumentParser(prog="python -m mmpipe.train", description=__doc__.splitlines()[0])
    add_flags(p, TrainArgs)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # the launcher's
    return from_namespace(TrainArgs, p.parse_args(argv))


def shapes_evaluation(args: TrainArgs, run: RunConfig):
    """The held-out scoring of the built-in shapes set (user data is not scored), as the trainer's
    evaluate hook: checkpoint dir -> summary fields."""
    if args.eval_samples <= 0 or not run.data.builtin:
        return None

    def score(ckpt_dir: Path) -> dict:
        model = load_reference(ckpt_dir, run.model, merged=True)
        res = evaluate(model, run.model, seed=args.seed, n_samples=args.eval_samples)
        blank = evaluate(model, run.model, seed=args.seed, n_samples=args.eval_samples, blank_images=True)
        chance = blind_baseline(run.model, seed=args.seed)["accuracy"]
        print(f"mmpipe: held-out accuracy {res['accuracy']:.3f} "
              f"({', '.join(f'{k} {v:.2f}' for k, v in res['per_type'].items())}); "
              f"blank images {blank['accuracy']:.3f}; blind chance {chance:.3f}", flush=True)
        return {"eval_accuracy": res["accuracy"], "eval_per_type": res["per_type"], "eval_samples": res["n"],
                "blank_image_accuracy": blank["accuracy"], "blank_image_per_type": blank["per_type"],
                "chance_accuracy": chance}
    return score


def main(argv=None) -> int:
    args = parse_args(argv)
    preempt = Preemption()  # before anything slow: a signal during start-up stops at the first step
    ranks_from_slurm(os.environ)
    try:
        rank_threads(os.environ)  # a bad OMP_NUM_THREADS: one line here, not a traceback in every rank
        run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return fail(e)
    return run_rank(args, run, preempt)


def run_rank(args: TrainArgs, run: RunConfig, preempt: Preemption) -> int:
    """train() with every exit path ending the same way (mmpipe.runtime.teardown): its status, a refusal's or
    an error's one line, then the process groups destroyed and gloo's threads joined before the interpreter
    finalizes (else a thread can abort the exit of a finished run)."""
    # The ~400k objects alive now (torch's, DeepSpeed's, transformers' modules) out of the collector's sight while the
    # rank trains: each automatic full collection (torch._dynamo's import at the optimizer, the steps) would walk them
    # all again. release() needs them back: gc.get_referrers, which finds the process groups' holders, skips frozen ones
    gc.freeze()
    try:
        return train(args, run, preempt, evaluate=shapes_evaluation(args, run))
    except ConfigError as e:  # a refusal found in the rank (e.g. a checkpoint another layout wrote)
        return fail(e)
    except Exception as e:  # this rank's error: one line, exit 1; the peers fail on the lost connection
        return rank_failed(e, args.output_dir)
    finally:
        gc.unfreeze()
        left = release()
        if left:
            print(f"mmpipe: warning: {len(left)} gloo threads still running at exit ({', '.join(sorted(set(left)))}):"
                  f" a process group is still referenced", file=sys.stderr, flush=True)


def exit_fast(status: int) -> None:
    """sys.exit(status), with every object alive now moved out of the collector's sight first (gc.freeze): the
    interpreter's exit then does not walk the ~400k objects that torch, DeepSpeed and transformers made at import
    to find garbage (measured: 1.2 s of the 4.4 s CPU of `python -c "import mmpipe.train, torch._dynamo"`, 0.95 s
    of it saved). Only after the run: release() already freed the process groups, and every file is closed."""
    gc.freeze()
    sys.exit(status)


if __name__ == "__main__":
    exit_fast(main())
