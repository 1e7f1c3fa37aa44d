"""Peak resident memory and wall time of `mmpipe import --hf` and `mmpipe export` against the checkpoint's size
(docs/import_memory.md has the table this printed).

Each checkpoint is a Qwen2.5-VL-shaped model of transformers' own class (Qwen2_5_VLForConditionalGeneration's
config, names and shapes, read off the model built on the meta device), random bf16 weights, saved sharded the
way save_pretrained saves it (its original names, model-0000k-of-0000N.safetensors + the index) but written one
shard at a time with safetensors' own save_file, so generating 2B parameters needs one shard of memory, not 4.4 GB.

Every command runs in a child process of its own, measured by a python wrapper (resource.getrusage(
RUSAGE_CHILDREN).ru_maxrss after it exits: the child's peak resident set, in KiB on Linux). The floor is the same
command with --dry-run: the interpreter with torch, transformers and mmpipe loaded, before any weight is read.
The export is then compared with the source, tensor by tensor (lazily, two in memory at a time): bit-equal or not.

    python scripts/bench_import.py --sizes 0.3B --work /tmp/bench_import
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

# name -> (text hidden, text layers, text intermediate, heads, kv heads, vision depth, vision hidden, vision
# intermediate, vision heads); head_dim 128 and vocabulary 151936 as every Qwen2.5-VL, untied (the embedding and
# head alone are 2 x 151936 x hidden: 0.27 B parameters at 896, 0.62 B at 2048)
SIZES = {"0.3B": (896, 2, 4864, 7, 1, 4, 640, 1728, 10),
         "1B": (1536, 10, 8960, 12, 2, 12, 1024, 2816, 16),
         "2B": (2048, 14, 11008, 16, 2, 16, 1280, 3420, 16)}
WRAP = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)")


def hf_config(size: str):
    from transformers import Qwen2_5_VLConfig
    dim, layers, inter, heads, kv, vdepth, vdim, vinter, vheads = SIZES[size]
    text = dict(hidden_size=dim, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=151936, max_position_embeddings=32768, bos_token_id=151643,
                eos_token_id=151645, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                       "mrope_section": [16, 24, 24]}, tie_word_embeddings=False)
    vision = dict(depth=vdepth, hidden_size=vdim, intermediate_size=vinter, num_heads=vheads, out_hidden_size=dim,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[vdepth // 2 - 1, vdepth - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def generate(size: str, out: Path, shard_bytes: int, seed: int = 0) -> tuple[int, int]:
    """The checkpoint (module docstring) -> (parameters, bytes of weights)."""
    from safetensors.torch import save_file

    from mmpipe.hf.export import hf_meta_model, saved_names
    from mmpipe.hf.safetensors_io import plan_shards
    hf = hf_config(size)
    meta = hf_meta_model(hf)
    names = saved_names(meta)
    entries = [(names[k], torch.bfloat16, tuple(t.shape)) for k, t in meta.state_dict().items()]
    shards = plan_shards(entries, shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    hf.dtype, hf.architectures = "bfloat16", [type(meta).__name__]
    hf.save_pretrained(out)
    gen, weight_map = torch.Generator().manual_seed(seed), {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {entries[i][0]: (torch.randn(entries[i][2], generator=gen) * 0.02).to(torch.bfloat16) for i in shard}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    total = sum(math.prod(s) * 2 for _, _, s in entries)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return sum(math.prod(s) for _, _, s in entries), total


def measured(argv: list[str], code: str | None = None) -> tuple[float, float]:
    """(peak RSS in GB, wall seconds) of a command in a child of its own; code: another checkout's mmpipe."""
    env = dict(os.environ, PYTHONPATH=code) if code else None
    t = time.perf_counter()  # cwd: `python -m` puts it first on sys.path, before PYTHONPATH
    res = subprocess.run([sys.executable, "-c", WRAP, *argv], capture_output=True, text=True, env=env, cwd=code)
    wall = time.perf_counter() - t
    kib, rc = res.stdout.strip().splitlines()[-1].split()
    if rc != "0":
        sys.exit(f"bench_import: {' '.join(argv)} failed:\n{res.stderr[-2000:]}")
    return int(kib) * 1024 / 1e9, wall


def bit_equal(a: Path, b: Path) -> bool:
    """Every tensor of the export equals the source's of the same name, dtype and bits; and the names are equal."""
    from mmpipe.hf.safetensors_io import open_weights
    src, out = open_weights(a), open_weights(b)
    return set(src) == set(out) and all(src.dtype(k) == out.dtype(k) and torch.equal(src[k], out[k]) for k in src)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0.3B,1B,2B", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--work", default="/tmp/bench_import", help="scratch directory (removed per size)")
    p.add_argument("--shard-size", default="500MB", help="the source's shards and the export's")
    p.add_argument("--code", help="run another checkout's mmpipe (e.g. a git worktree of the commit before "
                                  "streaming): its directory, put first on PYTHONPATH")
    args = p.parse_args(argv)
    from mmpipe.hf.safetensors_io import parse_size
    mmpipe = [sys.executable, "-m", "mmpipe.cli"]
    rows = []
    for size in args.sizes.split(","):
        work = Path(args.work).resolve() / size
        shutil.rmtree(work, ignore_errors=True)
        params, nbytes = generate(size, work / "hf", parse_size(args.shard_size))
        gb = nbytes / 1e9
        floor, _ = measured(mmpipe + ["import", "--hf", str(work / "hf"), "--out", str(work / "run"), "--dry-run"],
                            args.code)
        imp, imp_s = measured(mmpipe + ["import", "--hf", str(work / "hf"), "--out", str(work / "run")], args.code)
        run_gb = sum(f.stat().st_size for f in (work / "run" / "checkpoints").rglob("*.pt")) / 1e9
        shard = [] if args.code else ["--shard-size", args.shard_size]  # a checkout before streaming lacks it
        exp, exp_s = measured(mmpipe + ["export", "--checkpoint", str(work / "run"), "--out", str(work / "out"),
                                        *shard], args.code)
        same = bit_equal(work / "hf", work / "out")
        rows.append((size, params / 1e9, gb, len(list((work / "hf").glob("*.safetensors"))), run_gb, floor,
                     imp, imp / gb, imp_s, exp, exp / gb, exp_s, same))
        print(f"{size}: done ({rows[-1]})", file=sys.stderr, flush=True)
        shutil.rmtree(work, ignore_errors=True)
    print("| model | parameters | checkpoint (bf16) | shards | layer files | floor RSS | import peak RSS | "
          "import / checkpoint | import s | export peak RSS | export / checkpoint | export s | round trip |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (size, params, gb, shards, run_gb, floor, imp, imp_r, imp_s, exp, exp_r, exp_s, same) in rows:
        print(f"| {size} | {params:.2f} B | {gb:.2f} GB | {shards} | {run_gb:.2f} GB | {floor:.2f} GB | {imp:.2f} GB | "
              f"{imp_r:.2f}x | {imp_s:.0f} | {exp:.2f} GB | {exp_r:.2f}x | {exp_s:.0f} | "
              f"{'bit-equal' if same else 'DIFFERS'} |")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
