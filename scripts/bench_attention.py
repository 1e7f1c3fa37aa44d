"""CPU cost of the decoder's attention paths (mmpipe.model.attention, docs/attention.md), in one process:

    python scripts/bench_attention.py               # the docs' numbers: 2048 positions, 3 repeats, ~2 min
    python scripts/bench_attention.py --quick       # 512 positions, 1 repeat: a smoke run, seconds
    python scripts/bench_attention.py --device cuda --dtype bf16 --positions 8192   # scripts/gpu_check.sh's

One call = forward + backward of attend(q, k, v, mask) for q, k, v [B, heads, L, head_dim] (the upstream
gradient random), each path on the same tensors:

    dense    SDPA under row_mask's bool [B, 1, L, L]: CPU's path for packed rows, and the reference
    flex     torch's flex_attention under document_block_mask (eager: torch's math reference, which
             materializes every score; CUDA runs it compiled). torch 2.14 refuses a CPU backward in
             flex_attention's device check, which is lifted here as in tests/test_attention.py
    causal   SDPA is_causal=True: one-sample rows' path; for packed rows only the floor (no mask at all,
             NOT their attention)

for rows of each --samples count (equal samples, no padding). Repeats interleave the paths, the order turning
each repeat, so the machine's drift falls on all; the median wall seconds per call and the ratio to dense are
printed, and the BlockMask's build (once per row, shared by every layer) apart. torch.set_num_threads(--threads,
default 1): the machine is shared.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from mmpipe.model.attention import CAUSAL, attend, document_block_mask, row_mask
from mmpipe.runtime.trainer import DTYPES  # the precisions' names as runs spell them


def row_segments(batch: int, positions: int, samples: int) -> torch.Tensor:
    """[batch, positions]: `samples` equal samples per row (1, 2, ...; the last takes the remainder)."""
    per = positions // samples
    return (torch.arange(positions) // per).clamp(max=samples - 1).add(1).expand(batch, -1).contiguous()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_call(mask, q, k, v, upstream) -> float:
    """Wall seconds of attend's forward + backward (the GPU synchronised around it)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    _sync(q.device)
    start = time.perf_counter()
    attend(q, k, v, mask).backward(upstream)
    _sync(q.device)
    return time.perf_counter() - start


def bench_rows(args, samples: int) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    segments = row_segments(args.batch, args.positions, samples).to(device)
    document_block_mask(segments[:, :128])  # the first build pays one-off setup (imports, vmap)
    _sync(device)
    start = time.perf_counter()
    block = document_block_mask(segments)
    _sync(device)
    build = time.perf_counter() - start
    masks = {"dense": row_mask(segments), "flex": block, "causal": CAUSAL}
    g = torch.Generator().manual_seed(0)
    q, k, v, up = (torch.randn(args.batch, args.heads, args.positions, args.head_dim, generator=g).to(device, dtype)
                   for _ in range(4))
    for mask in masks.values():  # warm-up
        one_call(mask, q, k, v, up)
    times = {name: [] for name in masks}
    for r in range(args.repeats):
        for name in (list(masks) if r % 2 == 0 else list(masks)[::-1]):
            times[name].append(one_call(masks[name], q, k, v, up))
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"samples": samples, "block_mask_s": build, "sparsity": block.sparsity(), "median_s": median}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--samples", default="1,8", help="samples per row, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="512 positions, 1 repeat")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (flex compiled, as mmpipe runs it there)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    if args.quick:
        args.positions, args.repeats = 512, 1
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        import torch.nn.attention.flex_attention as flex
        flex._validate_device = lambda *a: None  # CPU backward: see the module docstring
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # on purpose
    print(f"B={args.batch} heads={args.heads} head_dim={args.head_dim} L={args.positions} {args.dtype} "
          f"on {args.device}, "
          f"{args.threads} thread(s), torch {torch.__version__}, median of {args.repeats}: fwd+bwd s (x dense)")
    for samples in (int(s) for s in args.samples.split(",")):
        r = bench_rows(args, samples)
        dense = r["median_s"]["dense"]
        cells = "  ".join(f"{n} {s:.3f} s ({s / dense:.2f}x)" for n, s in r["median_s"].items())
        print(f"{samples} sample(s)/row: {cells}  | block mask build {r['block_mask_s']:.3f} s once, "
              f"{r['sparsity']:.0f}% blocks skipped")


if __name__ == "__main__":
    main()
