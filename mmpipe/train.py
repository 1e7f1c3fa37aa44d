"""Per-rank training entry: `python -m mmpipe.train ...` under the deepspeed launcher or torchrun.

Each rank resolves and checks the whole run (mmpipe.run_config) before creating a process group,
then trains its stage (mmpipe.runtime.trainer). After the last step, rank 0 reloads the final
checkpoint into the single-device reference model and scores held-out accuracy on the built-in
shapes set (greedy answers, exact match).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .cluster.hostfile import rank_threads
from .cluster.preempt import Preemption
from .cluster.slurm_env import ranks_from_slurm
from .config import ConfigError, fail
from .flags import add_flags, from_namespace
from .inference.evaluate import blind_baseline, evaluate
from .run_args import TrainArgs
from .run_config import RunConfig, resolve
from .runtime.checkpoint import load_reference
from .runtime.teardown import rank_failed, release
from .runtime.trainer import train


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
    try:
        return train(args, run, preempt, evaluate=shapes_evaluation(args, run))
    except ConfigError as e:  # a refusal found in the rank (e.g. a checkpoint another layout wrote)
        return fail(e)
    except Exception as e:  # this rank's error: one line, exit 1; the peers fail on the lost connection
        return rank_failed(e, args.output_dir)
    finally:
        left = release()
        if left:
            print(f"mmpipe: warning: {len(left)} gloo threads still running at exit ({', '.join(sorted(set(left)))}):"
                  f" a process group is still referenced", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
