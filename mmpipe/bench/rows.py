"""One results row per run, shared by a sweep that runs here (mmpipe.bench.main), a Slurm job's driver
(mmpipe.bench.job) and `mmpipe bench --collect` (mmpipe.bench.collect): the fields a row starts from,
the outcome a run leaves in its folder (outcome.json), and the measured row read back from it."""
from __future__ import annotations

import json
from pathlib import Path

from .peers import PEER_RANKS, PEER_SCHEDULES
from .run_variant import first_error, measure
from .sweep import Sweep, Variant

OUTCOME = "outcome.json"  # a finished run's exit status, wall time and the peaks MFU is taken against


def variant_base(v: Variant, rep: int) -> dict:
    return {"kind": "variant", "repeat": rep, **v.to_dict(), "world": v.world}


def peer_base(name: str, rep: int, sw: Sweep) -> tuple[dict, Variant]:
    """A peer's row fields and the Variant it is measured as (the sweep's peer shape, its stages, its text
    length; one-sample rows whatever the shape's pack and max_images: the peers do not pack)."""
    shape = sw.peer_shape()
    stages = PEER_RANKS[name]  # ranks; torch_pipe_zb: 4 stages in a V over its 2 ranks
    row = {"kind": "peer", "repeat": rep, **shape.to_dict(), "name": f"peer_{name}", "engine": name, "stages": stages,
           "dp": 1, "zero": None, "world": stages, "pack": False, "max_images": 1,
           "schedule": PEER_SCHEDULES.get(name), "freeze": ""}  # the peers train every layer
    like = Variant(name=row["name"], preset=shape.preset, stages=stages, micro=shape.micro, gas=shape.gas,
                   data_workers=shape.data_workers, text_len=shape.text_len, max_images=1)
    return row, like


def outcome(row: dict, v: Variant, sw: Sweep, vout: Path, peak: dict, rc: int, reason: str, wall: float) -> dict:
    """The row of a finished launch: measured when it wrote its summary, else why it did not."""
    row = {**row, "wall_s": round(wall, 1)}
    if (vout / "summary.json").is_file():  # the success marker: DeepSpeed can abort at exit after a good run
        try:
            return {**row, "status": "ok", "reason": "" if rc == 0 else f"exit {rc} after the summary was written",
                    **measure(v, sw, vout, peak.get(v.precision))}
        except (OSError, ValueError, KeyError) as e:
            return {**row, "status": "failed", "reason": f"unreadable results: {e}"}
    log = vout / "run.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    kind = "oom" if "out of memory" in text.lower() or rc in (137, -9) else "timeout" if rc == 124 else "crashed"
    return {**row, "status": kind, "reason": reason or first_error(text) + f" (exit {rc}; {log})"}


def write_outcome(vout: Path, **fields) -> None:
    """Written last, atomically: its presence means the run is over (collect's 'not pending')."""
    tmp = vout / (OUTCOME + ".tmp")
    tmp.write_text(json.dumps(fields, indent=2) + "\n")
    tmp.replace(vout / OUTCOME)


def read_outcome(vout: Path) -> dict | None:
    """The run's outcome, None while it has none; ValueError when the file is not an outcome."""
    p = vout / OUTCOME
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or not (isinstance(d.get("status"), str) or isinstance(d.get("rc"), int)):
        raise ValueError(f"{p}: has neither a status nor an exit status 'rc'")
    return d
