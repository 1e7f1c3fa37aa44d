"""Per-rank memory of `mmpipe import --hf --tp N` and of a TP rank loading an import (docs/tensor_parallel.md, "Import,
export, --init-from and generate under TP"): a Qwen2-VL scaled up so its layers are tens of MB (the decoder D 1024,
4 layers of 16 heads with 8 kv heads, FFN 4096, a 32,000-token vocabulary, untied head: 132,448,256 parameters,
505 MiB of fp32, the embedding and the head 125 MiB each; a 2-block tower 256 wide), saved by transformers, imported
at each --tp in its own process.

Measured in each process, after the import is decided from the headers (mmpipe.hf.commands.hf_reader: the code it
imports, ~250 MiB, the same at every TP) and the kernel's peak-RSS mark is reset (/proc/self/clear_refs), around the
writing (Imported.save): the peak RSS it adds (VmHWM - VmRSS before; its anonymous and file-backed parts sampled every
2 ms), the largest state dict it holds at once
(the bytes of each torch.save's tensors: one layer at TP 1, one rank's slice of a layer at TP N), the bytes read from
the safetensors (every LazyWeights read, whole or rows) and the largest single read. Then, as a TP rank of --init-from
/ generate --tp reads it (mmpipe.runtime.reshard.layer_state, rank 0 of N), the largest layer state a rank holds.

    python scripts/bench_tp_import.py [--tp 1 2 4] [--dir /tmp/tp-import-bench] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20

PROBE = r"""
import json, sys, threading, time, torch
from pathlib import Path
from mmpipe.hf import safetensors_io
from mmpipe.hf.commands import hf_reader

def vm(*keys):
    got = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in keys:
            got[k] = int(line.split()[1]) * 1024
    return got

hf, out, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
reads, states = [], []
safetensors_io.LazyWeights.loaded = staticmethod(lambda name, t: reads.append(t.numel() * t.element_size()))
save = torch.save
def counted(obj, f, *a, **kw):
    states.append(sum(t.numel() * t.element_size() for t in obj.values()))
    return save(obj, f, *a, **kw)

torch.save = counted
got = hf_reader(hf)(hf)  # what `mmpipe import` decides from the headers first (and its code's imports)
open("/proc/self/clear_refs", "w").write("5")  # the peak-RSS mark starts again here
before, peaks, done = vm("VmRSS", "RssAnon", "RssFile"), {"RssAnon": 0, "RssFile": 0}, []

def sample():  # the anonymous (tensors) and file-backed (the safetensors' mapped pages) parts, every 2 ms
    while not done:
        for k, v in vm("RssAnon", "RssFile").items():
            peaks[k] = max(peaks[k], v)
        time.sleep(0.002)

thread = threading.Thread(target=sample)
thread.start()
got.save(Path(out), tp=tp)  # what `mmpipe import --tp` then does
done.append(1)
thread.join()
peak = vm("VmHWM")["VmHWM"] - before["VmRSS"]
torch.save = save
from mmpipe.config import config_from_dict
from mmpipe.model.builder import layer_specs
from mmpipe.registry import family_of
from mmpipe.runtime import reshard
cfg = config_from_dict(json.loads((Path(out) / "model.json").read_text()), "bench")
tag, specs, plan = Path(out) / "checkpoints" / "imported", layer_specs(cfg), family_of(cfg).tp_plan
rank_state = 0
for idx in range(len(specs)):
    if reshard.layer_files(tag, idx):
        state = reshard.layer_state(tag, idx, reshard.meta_layer(specs[idx], idx), 0, tp, plan)
        rank_state = max(rank_state, sum(t.numel() * t.element_size() for t in state.values()))
        del state
print(json.dumps({"tp": tp, "peak_rss_added": peak, "anon_added": peaks["RssAnon"] - before["RssAnon"],
                  "file_added": peaks["RssFile"] - before["RssFile"], "largest_state": max(states),
                  "files": len(states), "read": sum(reads), "largest_read": max(reads),
                  "rank_layer_state": rank_state}))
"""


def build(d: Path) -> int:
    """The scaled Qwen2-VL saved by transformers in d; returns its parameter count."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    text = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=2, embed_dim=256, hidden_size=1024, num_heads=4, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=31990, video_token_id=31991,
                        vision_start_token_id=31992, vision_end_token_id=31993, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.save_pretrained(d)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dir", default=None, help="where the model and imports go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tp-import-bench-") as tmp:
        d = Path(args.dir or tmp)
        n = build(d / "hf")
        print(f"model: {n:,} parameters, {n * 4 / MIB:.0f} MiB fp32", flush=True)
        rows = []
        for tp in args.tp:
            proc = subprocess.run([sys.executable, "-c", PROBE, str(d / "hf"), str(d / f"tp{tp}"), str(tp)],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"tp {tp}: the import failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"tp {tp}: peak RSS added {r['peak_rss_added'] / MIB:7.1f} MiB (sampled: anonymous "
                  f"{r['anon_added'] / MIB:6.1f}, file-backed {r['file_added'] / MIB:6.1f}), largest state held "
                  f"{r['largest_state'] / MIB:6.1f} MiB ({r['files']} files), read {r['read'] / MIB:7.1f} MiB "
                  f"(largest read {r['largest_read'] / MIB:6.1f} MiB); a rank's largest layer state on load "
                  f"{r['rank_layer_state'] / MIB:6.1f} MiB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": n, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
