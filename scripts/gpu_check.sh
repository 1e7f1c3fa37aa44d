#!/usr/bin/env bash
# mmpipe on one GPU, as one prepared command (issue 31 item 3; docs/check.md): at most ~8 minutes on an H200.
#
#   scripts/gpu_check.sh                              # on the GPU machine: writes docs/gpu.md
#   MMPIPE_GPU_CHECK_CPU=1 scripts/gpu_check.sh       # the same steps CPU-sized (a rehearsal of the script):
#                                                     # writes /tmp/mmpipe_gpu_check_cpu/gpu.md, never docs/
#
# Steps, each under its own `timeout`, each recorded in OUT/status.tsv whatever it does; a failed or timed-out
# step leaves its log in OUT and the report says so, and the later steps still run:
#   env        GPU name, driver, torch / CUDA / NCCL / DeepSpeed versions, date
#   check      mmpipe check, small PP=1, bf16 (ds_configs/zero1_bf16.json), --full-step: env, equivalence against
#              the fp32 reference, loader, max_memory_allocated against the planner, a device profile
#   check_qwen3_vl  mmpipe check of qwen3-vl-2b (CPU: qwen3-vl-tiny), PP=1 bf16: its shrunk model keeps a DeepStack
#              tap (2 tower blocks, 2 decoder layers), equivalence against the fp32 reference on the device
#   bench      mmpipe bench, PP=1 bf16 steps of moondream-2b and of LLaVA-1.5-7B's stack cut to
#              MMPIPE_GPU_CHECK_7B_LAYERS decoder layers (a model JSON derived from the preset; the whole 7B's
#              20 bytes per parameter of bf16 + Adam states do not fit one 141 GB GPU): step time and MFU,
#              peak memory, each beside the planner's prediction (docs/benchmarks.md's columns)
#   attention  scripts/bench_attention.py at 2048 and 8192 positions, packed (8 samples) vs one-sample rows, if
#              that script exists (on the GPU where it takes --device)
#   delta_rule_fla  Qwen3.5's Gated DeltaNet: flash-linear-attention's chunked kernel (cu_seqlens at the sample
#              starts) equal to the torch path, output, gradients and packed-row logits; skipped without fla
#   report     OUT/gpu.md (DOC): the tables of what was measured, from whatever the steps left
#
# Environment: MMPIPE_GPU_CHECK_OUT (runs/gpu_check), MMPIPE_GPU_CHECK_DOC (docs/gpu.md), MMPIPE_GPU_CHECK_7B_LAYERS (8).
set -euo pipefail
cd "$(dirname "$0")/.."

CPU=${MMPIPE_GPU_CHECK_CPU:-0}
if [ "$CPU" = 1 ]; then
  OUT=${MMPIPE_GPU_CHECK_OUT:-/tmp/mmpipe_gpu_check_cpu}
  DOC=${MMPIPE_GPU_CHECK_DOC:-$OUT/gpu.md}
  # the CPU stand-ins: `small` for moondream-2b, `llava-tiny` for the 7B stack, both cut to 1 decoder layer (the cut
  # JSON path runs as on the GPU); bigger models' Adam states do not fit a small shared machine
  P2B=small P7B=llava-tiny TEXT2B=1 TEXT7B=1 MICRO=4 GAS=2 STEPS=4 WARMUP=1 RUN_TIMEOUT=300 ATTN_ARGS=(--quick)
  T_CHECK=300 T_BENCH=900 T_ATTN=300 PQ3=qwen3-vl-tiny Q3ROW=(--max-patches 256 --text-len 64) T_QWEN3=300
else
  OUT=${MMPIPE_GPU_CHECK_OUT:-runs/gpu_check}
  DOC=${MMPIPE_GPU_CHECK_DOC:-docs/gpu.md}
  P2B=moondream-2b P7B=llava-1.5-7b TEXT2B=0 TEXT7B=${MMPIPE_GPU_CHECK_7B_LAYERS:-8}  # 0: the preset's own layers
  MICRO=4 GAS=4 STEPS=8 WARMUP=3 RUN_TIMEOUT=110  # plan: moondream-2b 76 GiB at micro 4 (117 of 131 at micro 8)
  ATTN_ARGS=()
  T_CHECK=120 T_BENCH=220 T_ATTN=60 T_QWEN3=70  # + env and report: under 9 minutes
  # a row of 1024 patches (the default, room for one image at max_pixels, is 65536: 6 GB of pixels a micro-batch)
  PQ3=qwen3-vl-2b Q3ROW=(--max-patches 1024 --text-len 256)
fi
PY=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STATUS=$OUT/status.tsv
printf 'step\texit\tseconds\tlog\n' > "$STATUS"

# step NAME SECONDS CMD...: run CMD under timeout, its output in OUT/NAME.log; record the exit status, never stop
step() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  echo "== $name (timeout ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$OUT/$name.log" >> "$STATUS"
  if [ "$rc" = 0 ]; then echo "   ok ($((SECONDS - t0)) s)"; else echo "   FAILED: exit $rc (124: timed out); $OUT/$name.log"; fi
}

step env 30 "$PY" - "$OUT/env.json" <<'EOF'
import datetime, json, platform, subprocess, sys
import torch, deepspeed
gpu = torch.cuda.is_available()
env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
       "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
       "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or platform.machine()})",
       "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpu else None,
       "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None, "bf16": bool(gpu and torch.cuda.is_bf16_supported())}
try:
    q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                       text=True, timeout=20)
    env["driver"] = q.stdout.strip().splitlines()[0] if gpu and q.stdout.strip() else None
except (OSError, subprocess.TimeoutExpired):  # no nvidia-smi: the driver is left out, the rest stands
    env["driver"] = None
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
EOF

step check "$T_CHECK" "$PY" -m mmpipe.cli check --preset small --stages 1 --ds-config ds_configs/zero1_bf16.json \
  --full-step --output-dir "$OUT/check"
step check_qwen3_vl "$T_QWEN3" "$PY" -m mmpipe.cli check --preset "$PQ3" --stages 1 "${Q3ROW[@]}" \
  --ds-config ds_configs/zero1_bf16.json --output-dir "$OUT/check_qwen3_vl"

# the bench's sweep: the 2B preset as shipped, the 7B one with its decoder cut (a model JSON derived from the preset)
step sweep 60 "$PY" - "$OUT" "$P2B:$TEXT2B" "$P7B:$TEXT7B" "$MICRO" "$GAS" "$STEPS" "$WARMUP" "$RUN_TIMEOUT" <<'EOF'
import json, sys
from pathlib import Path
from mmpipe.config import PRESET_DIR
out, models, (micro, gas, steps, warmup, limit) = sys.argv[1], sys.argv[2:4], map(int, sys.argv[4:])

def variant(spec):
    """PRESET:N -> the preset with N decoder layers (0: as shipped), written beside the results."""
    preset, layers = spec.split(":")
    if int(layers) == 0:
        return {"name": preset, "preset": preset}
    d = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    d["text"]["n_layers"] = int(layers)
    d["_comment"] = f"{preset} cut to {layers} decoder layers by scripts/gpu_check.sh"
    path = Path(out) / f"{preset}-{layers}L.json"
    path.write_text(json.dumps(d, indent=1))
    return {"name": f"{preset}-{layers}L", "preset": str(path)}
sweep = {"name": "gpu_check", "steps": steps, "warmup_steps": warmup, "repeats": 1, "timeout_s": limit,
         "base": {"precision": "bf16", "zero": 1, "micro": micro, "gas": gas, "data_workers": 4},
         "variants": [variant(m) for m in models], "peers": []}
Path(out, "sweep.json").write_text(json.dumps(sweep, indent=1))
print(json.dumps(sweep))
EOF
step bench "$T_BENCH" "$PY" -m mmpipe.cli bench "$OUT/sweep.json" --no-peers --output-dir "$OUT/bench"

if [ -f scripts/bench_attention.py ]; then
  DEVICE_ARG=()
  if [ "$CPU" != 1 ]; then DEVICE_ARG=(--device cuda --dtype bf16); fi  # flex compiled, as runs use it there
  for n in 2048 8192; do
    if [ "$CPU" = 1 ] && [ "$n" = 8192 ]; then continue; fi  # --quick is its own size on CPU
    step "attention_$n" "$((T_ATTN / 2))" "$PY" scripts/bench_attention.py --positions "$n" --samples 1,8 \
      "${DEVICE_ARG[@]}" "${ATTN_ARGS[@]}"
  done
else
  printf 'attention\tmissing\t0\tscripts/bench_attention.py does not exist\n' >> "$STATUS"
fi

# Qwen3.5's Gated DeltaNet through flash-linear-attention's kernel against the torch path (skipped, and said so in
# the log, where CUDA or the fla package is missing: it is not a dependency, install it beforehand to check it)
step delta_rule_fla 120 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_hf_qwen3_5.py -k "fla or cu_seqlens"

step report 60 "$PY" - "$OUT" "$DOC" "$CPU" <<'EOF'
import csv, json, sys
from pathlib import Path
out, doc, cpu = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"

def load(p):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

def table(header, rows):
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join("-" if c is None else str(c) for c in r) + " |" for r in rows])

def num(v, f="{:.3g}"):
    return None if v in (None, "") else f.format(float(v))

env = load(out / "env.json") or {}
status = list(csv.DictReader(open(out / "status.tsv"), delimiter="\t"))
lines = ["# mmpipe on one GPU" + (" (CPU REHEARSAL: not GPU numbers)" if cpu else ""), "",
         f"Written by `scripts/gpu_check.sh` on {env.get('date', '?')}: {env.get('device', '?')}"
         f" ({env.get('memory_gib') or '-'} GiB), driver {env.get('driver') or '-'}, torch {env.get('torch', '?')}, CUDA "
         f"{env.get('cuda') or '-'}, NCCL {env.get('nccl') or '-'}, DeepSpeed {env.get('deepspeed', '?')}, Python "
         f"{env.get('python', '?')}. Raw outputs: the script's OUT folder (`{out.name}`).", "", "## Steps", "",
         table(["step", "exit", "seconds", "result"],
               [[s["step"], s["exit"], s["seconds"], "ok" if s["exit"] == "0" else "FAILED (124: timed out)"
                 if s["exit"] != "missing" else s["log"]] for s in status])]
for name, title in (("check", "small, PP=1, bf16, ZeRO-1, --full-step"),
                    ("check_qwen3_vl", "Qwen3-VL's shrunk model with a DeepStack tap, PP=1, bf16, ZeRO-1")):
    chk = load(out / name / "check.json")
    lines += ["", f"## mmpipe check ({title})", ""]
    if chk:
        lines += [table(["check", "result", "detail"], [[k, "pass" if c.get("ok") else "FAIL",
                                                         chk["summary"].get(k, "")] for k, c in chk["checks"].items()])]
    else:
        lines += [f"No check.json: the check did not finish (see {name}.log)."]
res = load(out / "bench" / "results.json")
lines += ["", "## PP=1 bf16 steps against the planner", ""]
if res:
    rows = [[r["name"], r.get("status"), num(r.get("step_time_s")), num(r.get("predicted_step_time_s")),
             num(r.get("step_time_ratio"), "{:.2f}"), num(r.get("mfu"), "{:.1%}"), num(r.get("peak_mem_mb_max"), "{:.0f}"),
             num(r.get("predicted_peak_mem_mb_max"), "{:.0f}"), num(r.get("peak_mem_ratio"), "{:.2f}"),
             num(r.get("samples_per_s")), (r.get("reason") or "")[:80]] for r in res.get("rows", [])]
    lines += [f"micro x GAS per step, the rates over the steps after warm-up; MFU against "
              f"{num((res.get('meta') or {}).get('peaks', {}).get('bf16'))} FLOP/s bf16 peak "
              f"({(res.get('meta') or {}).get('device')}); memory: max_memory_allocated (CPU: peak RSS), MiB.", "",
              table(["variant", "status", "step s", "predicted s", "ratio", "MFU", "peak MiB", "predicted MiB",
                     "ratio", "samples/s", "reason"], rows)]
else:
    lines += ["No results.json: the bench did not finish (see bench.log)."]
lines += ["", "## Attention: packed (8 samples per row) vs one-sample rows", ""]
attn = sorted(out.glob("attention_*.log"))
if not attn:
    lines += ["Not run: scripts/bench_attention.py does not exist here."]
for p in attn:  # the script's own header line says the positions, device and threads it ran with
    lines += [f"`{p.name}`:", "", "```text",
              *[ln for ln in p.read_text().strip().splitlines() if "[WARNING]" not in ln][-25:], "```", ""]
doc.parent.mkdir(parents=True, exist_ok=True)
doc.write_text("\n".join(lines).rstrip() + "\n")
print(f"wrote {doc}")
EOF

echo "status: $STATUS"
column -t -s $'\t' "$STATUS" 2>/dev/null || cat "$STATUS"
# the exit status: 0 when every step ran through, 1 when one failed (its partial results are in the report)
! awk -F'\t' 'NR > 1 && $2 != "0" && $2 != "missing" {bad = 1} END {exit !bad}' "$STATUS"
