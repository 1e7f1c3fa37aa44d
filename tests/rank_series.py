"""A rank entry that runs several `mmpipe.train` runs one after another in the same ranks: one launch (one set of
interpreters importing torch, DeepSpeed and transformers, ~15 s of start-up under the suite's load) instead of one
per run. Each run is the rank code `mmpipe train` starts (mmpipe.train.run_rank: resolve, join the process group,
train, tear the groups down), so a run here resumes, trains and saves what its own launch would; the next run
joins a fresh process group. test_prechange_resume.py resumes its eight checkpoints so, and compares each run's
files bit for bit with what the old code wrote: a state one run left behind for the next would fail there.

    deepspeed --num_gpus N ... --module rank_series RUNS.json   (PYTHONPATH=tests; RUNS.json: a list of argv lists)

A run that fails does not stop the series: every run is tried, and the rank's exit status is the first non-zero
one."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mmpipe.cluster.preempt import Preemption
from mmpipe.config import ConfigError, fail
from mmpipe.run_config import resolve
from mmpipe.train import exit_fast, parse_args, run_rank


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("--local_rank")]  # the launcher's own flag
    status = 0
    for run_argv in json.loads(Path(paths[0]).read_text()):
        args = parse_args(run_argv)
        try:
            run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        except ConfigError as e:
            status = status or fail(e)
            continue
        code = run_rank(args, run, Preemption())  # every rank runs every run: none may skip one its peers run
        status = status or code
    return status


if __name__ == "__main__":
    exit_fast(main(sys.argv[1:]))
