"""Where a PP=1 mmpipe step goes, next to the transformers peer's: cProfile of N steps of each, in
one process with one thread, printing the top functions by own time and the per-step totals.

    python scripts/profile_pp1.py --steps 8

The mmpipe side is `python -m mmpipe.train` itself (a 1-rank world, gloo, the `small` preset,
cpu_fp32.json: 16 x 4), the HF side `python -m mmpipe.bench.hf_peer` with the same shapes.
"""
from __future__ import annotations

import argparse
import os
import pstats
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=18)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mmpipe-prof-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    runs = {
        "mmpipe PP=1": ["-m", "mmpipe.train", "--preset", "small", "--stages", "1", "--steps", str(a.steps),
                        "--eval-samples", "0", "--output-dir", str(tmp / "mm")],
        "transformers loop": ["-m", "mmpipe.bench.hf_peer", "--micro", "16", "--gas", "4", "--steps", str(a.steps),
                              "--out", str(tmp / "hf")],
    }
    for name, argv in runs.items():
        prof = tmp / (name.split()[0] + ".prof")
        subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), *argv], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"=== {name}: top {a.top} by own time over {a.steps} steps (start-up included)")
        pstats.Stats(str(prof)).sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
