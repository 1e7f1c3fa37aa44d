"""Per-rank entry of a pipeline variant: `python -m mmpipe.bench.rank <mmpipe.train flags>`.

It is `mmpipe.train` itself (same checks, data, engine, train_log.csv, summary.json with the
stage timing and bubble), plus one file per rank with its peak memory, which train does not record.
"""
from __future__ import annotations

import sys

from .. import train
from .memory import write_peak


def main(argv=None) -> int:
    args = train.parse_args(argv)
    rc = train.main(argv)
    write_peak(args.output_dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
