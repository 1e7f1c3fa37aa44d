"""CPU cost of the decoder's attention paths (mmpipe.model.attention, docs/attention.md), in one process:

    python scripts/bench_attention.py               # the docs' numbers: 2048 positions, 3 repeats, ~2 min
    python scripts/bench_attention.py --quick       # 512 positions, 1 repeat: a smoke run, seconds
    python scripts/bench_attention.py --device cuda --dtype bf16 --positions 8192   # scripts/gpu_check.sh's
    python scripts/bench_attention.py --packed      # CPU's packed rows: dense mask vs split by sample, ~10 min

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

--packed (docs/attention.md's table, issue 42 item 3): packed rows as --pack makes them, L = 2048 and 4096
positions of 4, 8 and 16 samples of unequal lengths then 1/16 padding, for three head layouts (16 x 64 MHA;
Qwen2.5-VL-7B's 28 query heads over 4 kv heads of 128; llava-1.5-7b's 32 x 128 MHA), fp32 (--dtype), forward
+ backward of one attend call on each of the row's two CPU paths, interleaved, the order turning each repeat:

    dense    SDPA under row_mask's bool [B, 1, L, L] (MMPIPE_ATTENTION=dense, the reference)
    split    attention.sample_split: each sample's own is_causal SDPA (equal lengths batched), no mask

Per case: the median CPU seconds (time.process_time; on one thread the work done, which the shared machine's
other load disturbs less than wall time) and wall seconds of each, split / dense, the bytes autograd keeps for
the backward (saved tensors, each storage once), the build of each (once per micro-batch, shared by every layer
of the stage) and the largest difference of the output and q, k, v gradients.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from mmpipe.model.attention import CAUSAL, attend, document_block_mask, row_mask, sample_split
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


LAYOUTS = "16x64/16,28x128/4,32x128/32"  # --packed's head layouts: query heads x head dim / kv heads


def packed_segments(positions: int, samples: int, seed: int = 0) -> torch.Tensor:
    """[1, positions]: `samples` samples of unequal lengths (random shares, each at least a fifth of the mean),
    then 1/16 padding (segment 0), as a packed row of a long-tailed set ends. E.g. 2048, 4: 1920 real
    positions, samples of a few hundred to ~900."""
    g = torch.Generator().manual_seed(seed)
    real = positions - positions // 16
    w = torch.rand(samples, generator=g) + 0.25
    ends = (w.cumsum(0) / w.sum() * real).long()
    ends[-1] = real
    seg = torch.searchsorted(ends, torch.arange(positions), right=True) + 1
    return torch.where(torch.arange(positions) < real, seg, 0)[None]


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for fn()'s backward, each storage once (the mask, the split's
    gathered q, k, v, outputs, indices...)."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def bench_packed(args) -> None:
    dtype = DTYPES[args.dtype]
    layouts = (x.replace("/", "x").split("x") for x in args.layouts.split(","))  # "28x128/4" -> 28, 128, 4
    heads = [(int(h), int(kv), int(d)) for h, d, kv in layouts]
    print(f"packed rows, fwd+bwd of one attend call, {args.dtype}, {args.threads} thread(s), torch "
          f"{torch.__version__}, median of {args.repeats} interleaved (CPU s = process_time)")
    print("| L | samples | heads x dim (kv) | dense CPU s | split CPU s | split / dense | dense wall s | split wall s "
          "| saved MiB: dense | saved MiB: split | build ms: mask | build ms: split | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for L in (int(x) for x in args.lengths.split(",")):
        for samples in (int(x) for x in args.samples.split(",")):
            seg = packed_segments(L, samples)
            t0 = time.perf_counter()
            paths = {"dense": row_mask(seg)}
            build = {"dense": time.perf_counter() - t0}
            t0 = time.perf_counter()
            paths["split"] = sample_split(seg)
            build["split"] = time.perf_counter() - t0
            for H, Hkv, Dh in heads:
                g = torch.Generator().manual_seed(L + samples + H)
                q, up = (torch.randn(1, H, L, Dh, generator=g).to(dtype) for _ in range(2))
                k, v = (torch.randn(1, Hkv, L, Dh, generator=g).to(dtype) for _ in range(2))
                cpu, wall, outs, saved = {n: [] for n in paths}, {n: [] for n in paths}, {}, {}
                for r in range(args.repeats + 1):  # the first a warm-up
                    for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                        qq, kk, vv = (a.detach().clone().requires_grad_() for a in (q, k, v))
                        t0, w0 = time.process_time(), time.perf_counter()
                        o = attend(qq, kk, vv, paths[name])
                        o.backward(up)
                        if r:
                            cpu[name].append(time.process_time() - t0)
                            wall[name].append(time.perf_counter() - w0)
                        outs[name] = [o.detach().float()] + [a.grad.float() for a in (qq, kk, vv)]
                for name, mask in paths.items():
                    qq, kk, vv = (a.detach().clone().requires_grad_() for a in (q, k, v))
                    saved[name] = saved_bytes(lambda: attend(qq, kk, vv, mask))
                diff = max((a - b).abs().max().item() for a, b in zip(outs["dense"], outs["split"]))
                d, s = (statistics.median(cpu[n]) for n in ("dense", "split"))
                dw, sw = (statistics.median(wall[n]) for n in ("dense", "split"))
                print(f"| {L} | {samples} | {H} x {Dh} ({Hkv}) | {d:.3f} | {s:.3f} | {s / d:.2f}x | {dw:.3f} | "
                      f"{sw:.3f} | {saved['dense'] / 2**20:.1f} | {saved['split'] / 2**20:.1f} | "
                      f"{build['dense'] * 1e3:.1f} | {build['split'] * 1e3:.1f} | {diff:.1e} |", flush=True)


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
    p.add_argument("--packed", action="store_true", help="CPU's packed rows: dense mask vs split by sample")
    p.add_argument("--lengths", default="2048,4096", help="--packed: positions per row, comma-separated")
    p.add_argument("--layouts", default=LAYOUTS,
                   help="--packed: head layouts, query heads x head dim / kv heads, comma-separated")
    args = p.parse_args(argv)
    if args.quick:
        args.positions, args.repeats = 512, 1
    torch.set_num_threads(args.threads)
    if args.packed:
        if args.samples == "1,8":  # the default of the other mode
            args.samples = "4,8,16"
        if args.quick:
            args.lengths, args.samples = "512", "4"
        return bench_packed(args)
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
