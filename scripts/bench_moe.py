"""Expert parallelism's benchmark (issue 43's must-show; docs/moe.md): measured tokens/s of an MoE layer at EP = 1 vs
EP = 2 on this machine, and the planner's step time for Qwen3-VL-30B-A3B on 2 x 8 H100 as PP x EP layouts.

    python scripts/bench_moe.py                 # both parts: the measurement (~40 s on a shared 2-core box)
    python scripts/bench_moe.py --quick         # 2 repeats, the small shape only: a smoke run, seconds
    python scripts/bench_moe.py --plan-only     # the planner's table alone

Measured: two gloo processes (one thread each: the machine's 2 cores), each with its own tokens, run the MoE MLP of a
decoder block (mmpipe.model.moe.SparseMoe: the router and the experts, grouped matmul) forward and backward, then
reduce the gradients as a data-parallel step does:

    EP 1   each rank holds all E experts: no exchange; every gradient (router and experts) all-reduced over the 2 ranks
    EP 2   each rank holds E / 2 (Experts.shard): two all-to-alls forward, two backward (Experts.exchange); only the
           router's gradient all-reduced (each shard is alone in its expert-data-parallel group of 2 / 2 = 1 rank)

The two alternate, repeat by repeat, so the machine's drift falls on both; a repeat times `iters` steps (20 of the
tiny shape's milliseconds-long step, 2 of the wide one's) and counts the slower rank's wall clock per step (barrier
before each), tokens/s = 2 ranks x tokens per rank / the median repeat's step. Attention and the rest
of the block are the same under both EPs and are left out, so the ratio is the MLP's, the part EP changes.

Shapes: `tiny` is the MoE pipeline test's (tests/test_moe_pipeline.py: D 64, 8 experts of 32, top 2; 2 rows x 88
positions a rank); `wide` is larger (D 512, 16 experts of 256, top 4, 2048 tokens a rank), where the experts' matmuls
outweigh the exchange's fixed costs.

Planned: `mmpipe plan`'s model (mmpipe.planning) for the qwen3-vl-30b-a3b preset (Qwen3-VL-30B-A3B-Instruct's
released shapes, its `_source`; 31,070,754,032 parameters, the checkpoint's count) on 16 H100s, bf16, ZeRO-1, a row
of one 1024 x 1024 image (4096 patches, 1024 image tokens) + 1024 text = 2050 positions, global batch 64 rows, micro 1:
for each PP and EP the best layout's step, its all-to-all share and fullest stage's memory.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# iters: steps timed together as one repeat (the tiny step takes milliseconds, which the shared machine's scheduling
# would otherwise swamp)
SHAPES = {"tiny": dict(dim=64, experts=8, ff=32, top_k=2, tokens=2 * 88, iters=20),
          "wide": dict(dim=512, experts=16, ff=256, top_k=4, tokens=2048, iters=2)}

def _layer(shape: dict):
    from mmpipe.config import config_from_dict, load_preset
    from mmpipe.model.moe import SparseMoe
    d = load_preset("qwen3-vl-tiny").to_dict()
    heads = shape["dim"] // 16  # qwen3-vl-tiny's heads of 16 (its multimodal rotary sections sum to 16 / 2)
    d["text"].update(dim=shape["dim"], n_heads=heads, n_kv_heads=heads // 2, tie_embeddings=False,
                     moe=dict(experts=shape["experts"], top_k=shape["top_k"], ff_dim=shape["ff"]))
    torch.manual_seed(0)
    return SparseMoe(config_from_dict(d, "bench"))


def _step(mlp, x, real, reduce_group, iters: int) -> float:
    """iters x (forward + backward of the MoE MLP, the gradient all-reduce); the slower rank's seconds per step."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        y, stats = mlp(x, real)
        (y.float().square().mean() + stats[:, 1].sum() * 1e-3).backward()
        for p in mlp.parameters():
            if p.grad is not None and not getattr(p, "_shard", False):
                dist.all_reduce(p.grad, group=reduce_group)
            p.grad = None
    seconds = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def _rank(rank: int, store: str, names: list[str], repeats: int, out: str):
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's note on all_to_all_single's new home
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for name in names:
        shape = SHAPES[name]
        one, two = _layer(shape), _layer(shape)
        two.experts.shard(dist.group.WORLD)
        for p in two.experts.parameters():
            p._shard = True  # EP 2: each shard alone in its expert-data-parallel group, no reduction
        x = torch.randn(1, shape["tokens"], shape["dim"], generator=torch.Generator().manual_seed(10 + rank))
        real = torch.ones(1, shape["tokens"], dtype=torch.bool)
        times = {1: [], 2: []}
        for k in range(repeats + 1):
            for ep in ((1, 2) if k % 2 else (2, 1)):  # alternate which goes first
                s = _step(one if ep == 1 else two, x, real, dist.group.WORLD, shape["iters"])
                if k:  # the first round warms allocator and kernels
                    times[ep].append(s)
        results[name] = {ep: statistics.median(v) for ep, v in times.items()}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure(names: list[str], repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/results.pt"
        mp.start_processes(_rank, args=(f"{tmp}/store", names, repeats, out), nprocs=2, start_method="fork")
        return torch.load(out)


def plan_table() -> list[dict]:
    """The best layout (over micro 1, balanced split that fits) per PP x EP for qwen3-vl-30b-a3b on 2 x 8 H100."""
    from mmpipe.config import load_preset
    from mmpipe.planning.costmodel import KNOWN_DEVICES
    from mmpipe.planning.images import patch_row
    from mmpipe.planning.plan import PlanSpec, plan
    cfg = load_preset("qwen3-vl-30b-a3b")
    layouts = plan(PlanSpec(cfg, device=KNOWN_DEVICES["h100-80gb"], gpus=16, global_batch=64, micros=(1,),
                            text_len=1024, precision="bf16", zero=1, images=1, row=patch_row(cfg, 1, 4096),
                            eps=(1, 2, 4, 8)))
    rows = []
    for lay in sorted(layouts, key=lambda lay: (lay.stages, lay.ep)):
        row = {"pp": lay.stages, "dp": lay.dp, "ep": lay.ep, "gas": lay.gas}
        if lay.step:
            row.update(step_s=lay.step["step_s"], a2a_share=lay.step["a2a_share"], a2a_s=lay.step["a2a_s"],
                       bubble=lay.step["bubble"], rows_per_s=lay.throughput,
                       max_gib=max(r["memory_gib"] for r in lay.stage_rows))
        else:
            row["why"] = lay.reason
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="2 repeats of the tiny shape")
    ap.add_argument("--plan-only", action="store_true")
    args = ap.parse_args()
    if not args.plan_only:
        names, repeats = (["tiny"], 2) if args.quick else (list(SHAPES), args.repeats)
        print(f"measured here: 2 gloo ranks x 1 thread, median of {repeats}, load average "
              f"{os.getloadavg()[0]:.1f} at the start (other work shares the machine)")
        got = measure(names, repeats)
        print("| shape | tokens a rank | EP 1 tokens/s | EP 2 tokens/s | EP 2 / EP 1 |\n|---|---|---|---|---|")
        for name in names:
            s, sh = got[name], SHAPES[name]
            rate = {ep: 2 * sh["tokens"] / s[ep] for ep in (1, 2)}
            print(f"| {name}: D {sh['dim']}, {sh['experts']} experts of {sh['ff']}, top {sh['top_k']} | {sh['tokens']} "
                  f"| {rate[1]:,.0f} | {rate[2]:,.0f} | {rate[2] / rate[1]:.2f} |")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print("\nplanned: qwen3-vl-30b-a3b on 2 x 8 h100-80gb (bf16, ZeRO-1, 2050 positions a row, global batch 64, "
          "micro 1)")
    print("| PP | DP | EP | GAS | step s | all-to-all share | bubble | rows/s | max GiB |\n" + "|---" * 9 + "|")
    for r in plan_table():
        if "why" in r:
            print(f"| {r['pp']} | {r['dp']} | {r['ep']} | {r['gas']} | does not fit: {r['why']} | | | | |")
        else:
            print(f"| {r['pp']} | {r['dp']} | {r['ep']} | {r['gas']} | {r['step_s']:.3f} | {r['a2a_share']:.1%} "
                  f"| {r['bubble']:.1%} | {r['rows_per_s']:.1f} | {r['max_gib']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
