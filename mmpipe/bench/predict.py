"""The planner's prediction beside each measured variant: step time, bubble and peak memory per
rank, from the row's own variant fields (preset, stages, dp, zero, precision, micro, gas,
checkpointing, partition) and the sweep's device and peaks in results' meta, computed when the
report is written, so results collected from elsewhere get them too.

The numbers are `mmpipe plan`'s for that layout (mmpipe.planning.calibrate.predict_row ->
mmpipe.planning.layout.plan_layout), uncalibrated: the device's default efficiency (0.5 on CPU,
0.45 on a GPU) times the peak per rank the sweep measured or looked up for the precision, i.e.

    mmpipe plan --preset P --device cpu --peak-tflops PEAK/1e12 --efficiency 0.5 --precision X
                --zero Z --gpus-per-node STAGESxDP --global-batch MICROxGASxDP --micro MICRO --text-len 12

lists the same step time, bubble and per-stage memory for the row's PP x DP layout (balanced
partition; for 'uniform' and explicit boundaries plan_layout cuts as mmpipe train does).
Ratios are measured / predicted: > 1 means the planner is optimistic.
"""
from __future__ import annotations

from ..config import ConfigError
from ..planning.calibrate import predict_row, results_device
from ..planning.layout import GiB

COLUMNS = ["predicted_step_time_s", "step_time_ratio", "predicted_bubble", "bubble_ratio",
           "predicted_peak_mem_mb_per_rank", "predicted_peak_mem_mb_max", "peak_mem_ratio"]


def prediction(row: dict, meta: dict, cache: dict) -> dict:
    """The prediction columns of one row; all None for a peer, a precision without a recorded peak,
    or a layout the planner cannot cut (e.g. more stages than layers)."""
    out = dict.fromkeys(COLUMNS)
    if row.get("kind", "variant") != "variant" or not all(row.get(k) for k in ("stages", "dp", "micro", "gas")):
        return out
    device = results_device(meta, row.get("precision") or "fp32")
    if device is None:
        return out
    try:
        lay = predict_row(row, device, cache)
    except (ConfigError, KeyError, ValueError):
        return out
    if not lay.step:
        return out
    dp, mp = int(row["dp"]), int(row.get("tp") or 1) * int(row.get("sp") or 1)
    # DeepSpeed's pipe x data x model topology numbers ranks stage-major: rank = (stage x DP + replica) x MP + t, MP the
    # model axis's TP or SP ranks (--sp takes that axis: docs/sequence_parallel.md)
    per_rank = [round(lay.stage_rows[r // (dp * mp)]["memory_gib"] * GiB / 2**20, 3)
                for r in range(lay.stages * dp * mp)]
    out.update(predicted_step_time_s=lay.step["step_s"], predicted_bubble=lay.step["bubble"],
               predicted_peak_mem_mb_per_rank=per_rank, predicted_peak_mem_mb_max=max(per_rank))
    if row.get("status") == "ok":
        out["step_time_ratio"] = _ratio(row.get("step_time_s"), out["predicted_step_time_s"])
        out["bubble_ratio"] = _ratio(row.get("bubble_measured"), out["predicted_bubble"])
        out["peak_mem_ratio"] = _ratio(row.get("peak_mem_mb_max"), out["predicted_peak_mem_mb_max"])
    return out


def _ratio(measured, predicted):
    if measured is None or not predicted:
        return None
    return float(measured) / predicted


def add_predictions(rows: list[dict], meta: dict) -> list[dict]:
    """The rows with the prediction columns set (new dicts; earlier predictions replaced)."""
    cache: dict = {}
    return [{**r, **prediction(r, meta, cache)} for r in rows]


def describe(meta: dict) -> str:
    """One line for results.md: what the predictions assume."""
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in (meta.get("peaks") or {}).items() if v)
    dev = results_device(meta, "fp32") or results_device(meta, "bf16")
    eff = f"{dev.efficiency:.2f}" if dev else "?"
    return (f"Predicted: `mmpipe plan`'s cost model for each row's layout on {meta.get('device')} (peak per rank "
            f"{peaks} GFLOP/s x efficiency {eff}, uncalibrated; no CPU runtime in the memory). Ratio = measured / "
            f"predicted; > 1: the planner is optimistic.")
