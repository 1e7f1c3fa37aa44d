"""Tensor parallelism's benchmark (issue 54's must-show; docs/tensor_parallel.md, "The benchmark"): parameters and
peak activation bytes per rank at TP = 1 vs TP = 2 vs TP = 2 + sequence parallelism for qwen3-vl-tiny scaled to a
few hundred MB, measured from `mmpipe train --tp [--sequence-parallel]` launches beside the planner's prediction, and
the TP collectives' share of the step.

    python scripts/bench_tp.py     # the three launches (~9 min at load 15-20), docs/benchmarks/tensor_parallel.json
    python scripts/bench_tp.py --steps 2 --variants 2,2sp --out /tmp/x.json --work /tmp/runs   # some, the runs kept

The model (written as a preset file beside the runs): qwen3-vl-tiny's family and vocabulary with the decoder at
D 768, 8 layers of 12 heads (head_dim 64, 4 kv heads, mrope_section 8 / 12 / 12 = 32 = head_dim / 2), FFN 3072, and
the tower at 128 wide, 4 blocks of 4 heads, FFN 512: 72,995,456 parameters, 292 MB in fp32. Each run: PP 1, fp32,
ZeRO 0, 1F1B, micro 1 x GAS 2, packed rows of the built-in shapes data (--max-images 4 --max-patches 256
--text-len 256), --steps steps; TP 1 on one rank, TP 2 on two, TP 2 + SP (--sequence-parallel) on two.

Measured on each rank (a sitecustomize.py on the ranks' PYTHONPATH, active where MMPIPE_BENCH_TP names a folder and
RANK is set, so the launcher and every other process are untouched; nothing in mmpipe changes):

    parameters      the rank's share, read back from the run's checkpoint: each layer file of its model rank
                    (`layer_XX-model_0T-model_states.pt`), numels summed
    activations     the peak of the bytes autograd holds for the backward: a saved-tensors hook adds each saved
                    tensor's storage once (by its address; parameters and their views left out) and takes it off
                    when the graph frees it, so the peak is what the forward of the micro-batches in flight keeps
                    (1F1B at PP 1: one micro-batch)
    peak RSS        ru_maxrss of the rank (parameters, gradients, AdamW moments, activations, the interpreter,
                    torch and DeepSpeed: the whole process)
    TP collective   the wall seconds inside mmpipe.model.tensor_parallel's _all_reduce, _all_gather and
                    _reduce_scatter (every collective at a TP region's edge: an entry's backward, a row's forward;
                    under SP their gather / reduce-scatter pairs) per step, and inside sum_summed_gradients (the
                    step's one bucketed sum of the whole weights' shares: q / k norms, under SP every norm),
                    against the step's own wall seconds (PipelineEngine.train_batch, timed around), the first step
                    left out. On gloo a collective waits for the slower rank, so under a shared machine's load the
                    share counts each rank's wait for the other, not the wire alone: the report says the load
                    (os.getloadavg)

Predicted: the planner's rows (mmpipe.planning.costmodel.layer_costs at the run's row, planning.tensor_parallel's
tp_layer_costs at TP 2, with sequence=True for TP 2 + SP): parameters per rank and activation bytes of one
micro-batch (LayerCost.act_bytes, fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROW = {"max_images": 4, "max_patches": 256, "text_len": 256}
MICRO, GAS = 1, 2

HOOK = r'''
"""bench_tp's per-rank probes (scripts/bench_tp.py): active only where MMPIPE_BENCH_TP and RANK are set."""
import os
if os.environ.get("MMPIPE_BENCH_TP") and os.environ.get("RANK") is not None:
    import atexit, json, resource, time
    import torch
    state = {"live": 0, "peak": 0, "held": {}, "ar_s": 0.0, "ar_calls": 0, "ar_bytes": 0, "sum_s": 0.0, "steps": []}

    def _is_param(t):
        base = t._base if t._base is not None else t
        return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)

    class _Held:
        __slots__ = ("key", "t")

        def __init__(self, key, t):
            self.key, self.t = key, t

        def __del__(self):
            if self.key is not None:
                n = state["held"][self.key]
                n[0] -= 1
                if n[0] == 0:
                    state["live"] -= n[1]
                    del state["held"][self.key]

    def _pack(t):
        if _is_param(t) or t.device.type == "meta":
            return _Held(None, t)
        s = t.untyped_storage()
        key = s.data_ptr()
        n = state["held"].setdefault(key, [0, s.nbytes()])
        if n[0] == 0:
            state["live"] += n[1]
            state["peak"] = max(state["peak"], state["live"])
        n[0] += 1
        return _Held(key, t)

    torch.autograd.graph.saved_tensors_hooks(_pack, lambda h: h.t).__enter__()

    import mmpipe.model.tensor_parallel as tpm

    def _timer(inner):
        def _timed(x, shard):
            t0 = time.perf_counter()
            y = inner(x, shard)
            if shard.group is not None:
                state["ar_s"] += time.perf_counter() - t0
                state["ar_calls"] += 1
                # an all-reduce's row; an all-gather or reduce-scatter half of it: (TP - 1) / TP x the row on a
                # ring, where an all-reduce moves 2 (TP - 1) / TP x it (its two halves)
                row = max(x.numel(), y.numel()) * x.element_size()
                state["ar_bytes"] += row if inner.__name__ == "_all_reduce" else row // 2
            return y
        return _timed
    for _name in ("_all_reduce", "_all_gather", "_reduce_scatter"):
        if hasattr(tpm, _name):  # (a tree before --sequence-parallel has the all-reduce alone: before / after runs)
            setattr(tpm, _name, _timer(getattr(tpm, _name)))
    _sum = getattr(tpm, "sum_summed_gradients", None)

    def _summed(*args):
        t0 = time.perf_counter()
        n = _sum(*args)
        state["sum_s"] += time.perf_counter() - t0
        return n
    if _sum is not None:
        tpm.sum_summed_gradients = _summed

    from deepspeed.runtime.pipe.engine import PipelineEngine
    _train_batch = PipelineEngine.train_batch

    def _step(self, *a, **k):
        before = (state["ar_s"], state["ar_calls"], state["ar_bytes"], state["sum_s"])
        t0 = time.perf_counter()
        out = _train_batch(self, *a, **k)
        state["steps"].append({"step_s": time.perf_counter() - t0, "tp_allreduce_s": state["ar_s"] - before[0],
                               "tp_allreduce_calls": state["ar_calls"] - before[1],
                               "tp_allreduce_bytes": state["ar_bytes"] - before[2],
                               "tp_grad_sum_s": state["sum_s"] - before[3], "load1": os.getloadavg()[0]})
        return out
    PipelineEngine.train_batch = _step

    @atexit.register
    def _write():
        out = {"rank": int(os.environ["RANK"]), "peak_saved_bytes": state["peak"],
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "steps": state["steps"]}
        path = os.path.join(os.environ["MMPIPE_BENCH_TP"], f"rank{out['rank']}.json")
        with open(path, "w") as f:
            json.dump(out, f)
'''


def model_dict() -> dict:
    """qwen3-vl-tiny scaled up (module docstring)."""
    from mmpipe.config import load_preset
    d = load_preset("qwen3-vl-tiny").to_dict()
    d["text"].update(dim=768, n_layers=8, n_heads=12, n_kv_heads=4, ff_dim=3072, mrope_section=[8, 12, 12],
                     max_context=1024)
    d["vision"].update(dim=128, n_layers=4, n_heads=4, ff_dim=512, deepstack_indexes=[0, 1, 3])
    return d


def ds_config(path: Path) -> Path:
    cfg = json.loads((ROOT / "ds_configs" / "cpu_fp32.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=GAS)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def launch(variant: str, preset: Path, ds: Path, work: Path, steps: int, port: int) -> dict:
    """One `mmpipe train --tp tp [--sequence-parallel]` run at PP 1 with the probes on (variant "1", "2" or "2sp");
    its per-rank records and summary."""
    tp = int(variant.removesuffix("sp"))
    out, probes = work / f"tp{variant}", work / f"probes_tp{variant}"
    probes.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MMPIPE_BENCH_TP": str(probes), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(work / "hook"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--preset", str(preset), "--stages", "1", "--tp", str(tp),
           "--ds-config", str(ds), "--steps", str(steps), "--eval-samples", "0", "--pack", "--seed", "0",
           "--max-images", str(ROW["max_images"]), "--max-patches", str(ROW["max_patches"]),
           "--text-len", str(ROW["text_len"]), "--output-dir", str(out), "--master-port", str(port),
           *(["--sequence-parallel"] if variant.endswith("sp") else [])]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"bench_tp: tp {tp} run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(probes.glob("rank*.json"))]
    return {"ranks": sorted(ranks, key=lambda x: x["rank"]), "summary": json.loads((out / "summary.json").read_text()),
            "params": checkpoint_params(out, tp), "wall_s": time.time() - t0}


def checkpoint_params(out: Path, tp: int) -> list[int]:
    """Per TP rank, the parameters its layer files hold in the run's last checkpoint (at TP 1 DeepSpeed names them
    layer_XX-model_states.pt, at TP > 1 layer_XX-model_0T-model_states.pt)."""
    import torch
    ckpt = out / "checkpoints"
    folder = ckpt / (ckpt / "latest").read_text().strip()
    counts = []
    for t in range(tp):
        n, name = 0, "layer_*-model_states.pt" if tp == 1 else f"layer_*-model_{t:02d}-model_states.pt"
        for f in sorted(folder.glob(name)):
            n += sum(v.numel() for v in torch.load(f, map_location="cpu", weights_only=True).values())
        counts.append(n)
    return counts


def predicted(d: dict, tp: int, sequence: bool = False) -> dict:
    """The planner's parameters and activation bytes (one micro-batch, fp32) per rank at TP tp (sequence: + SP)."""
    from mmpipe.config import config_from_dict
    from mmpipe.planning.costmodel import layer_costs
    from mmpipe.planning.images import patch_row
    from mmpipe.planning.tensor_parallel import tp_layer_costs
    cfg = config_from_dict(d, "qwen3-vl-tp-bench")
    rows = layer_costs(cfg, (), ROW["text_len"], images=ROW["max_images"],
                       patches=patch_row(cfg, ROW["max_images"], ROW["max_patches"]))
    rows = tp_layer_costs(cfg, rows, tp, sequence) if sequence else tp_layer_costs(cfg, rows, tp)
    # a tied head's table is the embedding's: one count (costmodel counts a tied pair once a stage likewise)
    seen, params = set(), 0
    for r in rows:
        if r.tied and r.tied in seen:
            continue
        seen.add(r.tied)
        params += r.params
    return {"params": params, "act_bytes": MICRO * sum(r.act_bytes("fp32") for r in rows),
            "decoder_length": rows[-1].tokens, "tp_allreduce_bytes_per_step":
            GAS * MICRO * 4 * sum(r.tp_ar_fwd + r.tp_ar_bwd for r in rows)}


def summarise(run: dict, variant: str, pred: dict) -> dict:
    ranks = run["ranks"]
    steps = [r["steps"][1:] or r["steps"] for r in ranks]
    share = [sum(s["tp_allreduce_s"] for s in st) / sum(s["step_s"] for s in st) for st in steps]
    return {"tp": int(variant.removesuffix("sp")), "sequence_parallel": variant.endswith("sp"), "ranks": len(ranks),
            "tp_grad_sum_s_per_step": [statistics.median(s.get("tp_grad_sum_s", 0.0) for s in st) for st in steps],
            "params_per_rank": run["params"], "params_predicted": pred["params"],
            "peak_saved_bytes": [r["peak_saved_bytes"] for r in ranks], "act_bytes_predicted": pred["act_bytes"],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            "step_s_median": statistics.median(s["step_s"] for st in steps for s in st),
            "tp_allreduce_share": share,
            "tp_allreduce_calls_per_step": steps[0][0]["tp_allreduce_calls"] if steps[0] else 0,
            "tp_allreduce_bytes_per_step": steps[0][0]["tp_allreduce_bytes"] if steps[0] else 0,
            "tp_allreduce_bytes_per_step_predicted": pred["tp_allreduce_bytes_per_step"],
            "decoder_length": run["summary"].get("decoder_length"), "decoder_length_predicted":
            pred["decoder_length"], "load1": [s["load1"] for st in steps for s in st], "wall_s": run["wall_s"],
            "steps": [r["steps"] for r in ranks]}


def table(results: list[dict]) -> str:
    mb = 2 ** 20
    names = {(1, False): "TP 1", (2, False): "TP 2", (2, True): "TP 2 + SP"}
    lines = ["| | " + " | ".join(names.get((r["tp"], r["sequence_parallel"]), str(r["tp"])) for r in results) + " |",
             "|---|" + "---|" * len(results)]

    def row(name, f):
        lines.append(f"| {name} | " + " | ".join(f(r) for r in results) + " |")
    row("parameters per rank (measured)", lambda r: ", ".join(f"{n:,}" for n in r["params_per_rank"]))
    row("parameters per rank (planner)", lambda r: f"{r['params_predicted']:,}")
    row("peak saved activations per rank, MiB (measured)",
        lambda r: ", ".join(f"{b / mb:.1f}" for b in r["peak_saved_bytes"]))
    row("activations of a micro-batch, MiB (planner)", lambda r: f"{r['act_bytes_predicted'] / mb:.1f}")
    row("peak RSS per rank, MiB", lambda r: ", ".join(f"{b / mb:.0f}" for b in r["peak_rss_bytes"]))
    row("step s (median, first left out)", lambda r: f"{r['step_s_median']:.2f}")
    row("TP collectives a step: calls, MiB as all-reduced rows (planner MiB)",
        lambda r: f"{r['tp_allreduce_calls_per_step']}, {r['tp_allreduce_bytes_per_step'] / mb:.1f} "
                  f"({r['tp_allreduce_bytes_per_step_predicted'] / mb:.1f})")
    row("TP collectives' share of the step", lambda r: ", ".join(f"{s:.1%}" for s in r["tp_allreduce_share"]))
    row("the step's gradient sum over TP, ms (median)",
        lambda r: ", ".join(f"{1000 * s:.1f}" for s in r["tp_grad_sum_s_per_step"]))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "tensor_parallel.json"))
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--variants", default="1,2,2sp", help="which runs: 1 (TP 1), 2 (TP 2), 2sp (TP 2 + SP)")
    a = ap.parse_args()
    d = model_dict()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp:
        work = Path(a.work or tmp)
        (work / "hook").mkdir(parents=True, exist_ok=True)
        (work / "hook" / "sitecustomize.py").write_text(HOOK)
        preset = work / "qwen3-vl-tp-bench.json"
        preset.write_text(json.dumps(d, indent=1))
        ds = ds_config(work / "ds.json")
        for i, variant in enumerate(a.variants.split(",")):
            print(f"bench_tp: tp {variant}, load {os.getloadavg()[0]:.1f} ...", flush=True)
            tp, sequence = int(variant.removesuffix("sp")), variant.endswith("sp")
            results.append(summarise(launch(variant, preset, ds, work, a.steps, a.port + i), variant,
                                     predicted(d, tp, sequence)))
    text = table(results)
    print(text)
    Path(a.out).write_text(json.dumps({"model": {"text": d["text"], "vision": d["vision"]}, "row": ROW,
                                       "micro": MICRO, "gas": GAS, "steps": a.steps, "cpus": os.cpu_count(),
                                       "results": results, "table": text}, indent=1) + "\n")
    print(f"bench_tp: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
