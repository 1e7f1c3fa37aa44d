"""Peak memory of this process: the accelerator's max_memory_allocated on a GPU, peak RSS on CPU."""
from __future__ import annotations

import json
import os
import resource
from pathlib import Path


def peak_memory() -> dict:
    # ru_maxrss is in KiB on Linux; loader workers are child processes and are not counted
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"rank": int(os.environ.get("RANK", "0")), "peak_rss_bytes": rss_bytes,
           "max_memory_allocated_bytes": None}
    try:
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        if acc.device_name() != "cpu":
            out["max_memory_allocated_bytes"] = int(acc.max_memory_allocated())
    except Exception:  # no accelerator layer: RSS is all we have
        pass
    return out


def write_peak(out_dir: str | Path) -> None:
    m = peak_memory()
    (Path(out_dir) / f"memory_rank{m['rank']}.json").write_text(json.dumps(m) + "\n")
