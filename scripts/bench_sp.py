"""Issue 58's memory demonstration: one row of 65,536 decoder positions trains at --sp 2 under an activation-memory cap
that --sp 1 exceeds; each rank's peak activation bytes at SP = 1, 2 and 4 (docs/sequence_parallel.md, "Memory").

    python scripts/bench_sp.py --out runs/bench_sp            # 5 launches, a few minutes on 2 CPU cores
    python scripts/bench_sp.py --loss                         # the head's loss alone: whole logits vs tiled

The model is llava-tiny (2 decoder layers, dim 32) with its context raised to the row and 4 KV heads (SP 4 divides
them); the row packs ~64 text samples of ~1,000 words of the built-in tokenizer into 65,536 positions (each sample
attends to itself: a one-sample row of 65,536 would cost CPU attention L^2 = 4.3e9 score pairs a head and layer,
minutes a step; packed, the per-position work the cap is about, embeddings, norms, MLPs, the head's logits, is the
same). Stages 1, micro-batch 1, 2 steps.

Each rank runs mmpipe.train in process (the script is the deepspeed launcher's entry) under
torch.autograd.graph.saved_tensors_hooks: every tensor autograd keeps for backward is counted once per storage
while it is alive (a weakref on what the hook returns), so `peak_saved_bytes` is the rank's peak of activations kept
for backward (its weights are 2e4 parameters, 0.1 MB, among them). With --cap-mib the hook refuses a save that would
take the live total over the cap (MemoryError, the rank stops): the cap this script sets. Peak RSS per rank is
mmpipe.bench.memory's (ru_maxrss: the process, libraries and gloo buffers included).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the ranks run this file by path: mmpipe from the checkout beside it
LENGTH = 65_536  # decoder positions per row: 2^16, so SP 1, 2, 4 all divide it
CAP_ENV, OUT_ENV = "BENCH_SP_CAP", "BENCH_SP_OUT"


class SavedBytes:
    """Live bytes of the storages autograd holds for backward, and their peak; over `cap`: MemoryError."""

    def __init__(self, cap: int | None):
        self.cap, self.live, self.peak, self.count = cap, 0, 0, {}

    def pack(self, t):
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key not in self.count:
            if self.cap is not None and self.live + size > self.cap:
                raise MemoryError(f"bench_sp: activations kept for backward would reach {self.live + size} bytes, "
                                  f"over the cap of {self.cap} bytes")
            self.count[key] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self.count[key] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, key, size)
        return held

    @staticmethod
    def unpack(held):
        return held.t

    def _release(self, key: int, size: int) -> None:
        self.count[key] -= 1
        if not self.count[key]:
            del self.count[key]
            self.live -= size


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def rank_main(argv: list[str]) -> int:
    """One rank (the launcher's entry): mmpipe.train under the saved-tensor meter; writes memory_rank<R>.json."""
    import torch

    from mmpipe import train
    from mmpipe.bench.memory import peak_memory
    argv = [a for a in argv if not a.startswith("--local_rank")]
    cap = int(os.environ[CAP_ENV]) if os.environ.get(CAP_ENV) else None
    meter, rc, error = SavedBytes(cap), 1, None
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            rc = train.main(argv)
    except MemoryError as e:
        error = str(e)
        raise
    finally:
        m = peak_memory() | {"peak_saved_bytes": meter.peak, "cap_bytes": cap, "error": error}
        (Path(os.environ[OUT_ENV]) / f"memory_rank{m['rank']}.json").write_text(json.dumps(m) + "\n")
    return rc


def write_inputs(root: Path, samples: int, words: int) -> list[str]:
    """The model JSON (llava-tiny, context = the row), the text set, the DeepSpeed JSON; the train flags."""
    from mmpipe.config import load_preset
    from mmpipe.data.packing import row_shape
    from mmpipe.data.shapes import VOCABULARY
    cfg = load_preset("llava-tiny")
    slot = row_shape(cfg, 1, 0).length  # --pack keeps one image slot a row (16 positions, unused: text only)
    model = cfg.to_dict()
    model["text"].update(max_context=LENGTH + 64, n_kv_heads=4)  # 4 KV heads (llava-tiny's 2): SP 4 divides them
    (root / "model.json").write_text(json.dumps(model))
    rnd = random.Random(0)
    records = [{"conversations": [
        {"from": "human", "value": "how many shapes are there"},
        {"from": "gpt", "value": " ".join(rnd.choice(VOCABULARY) for _ in range(words - rnd.randrange(words // 8)))}]}
        for _ in range(samples)]
    (root / "data.json").write_text(json.dumps(records))
    (root / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    return ["--preset", str(root / "model.json"), "--data", str(root / "data.json"), "--ds-config",
            str(root / "ds.json"), "--text-len", str(LENGTH - slot), "--pack", "--stages", "1",
            "--eval-samples", "0", "--data-workers", "0", "--save-every", "0"]


def launch(flags: list[str], sp: int, out: Path, cap: int | None, timeout: int) -> dict:
    """One deepspeed launch of `sp` ranks with this script as their entry; its result row."""
    from mmpipe.bench.run_variant import first_error
    from mmpipe.cluster.ports import free_port
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{OUT_ENV: str(out)})
    env.pop(CAP_ENV, None)
    if cap is not None:
        env[CAP_ENV] = str(cap)
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(sp), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).resolve()), "--rank", "--",
           *flags, "--sp", str(sp), "--output-dir", str(out)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    (out / "launch.log").write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("memory_rank*.json"))]
    trained = (out / "summary.json").is_file()
    losses = []
    if (out / "train_log.csv").is_file():
        import csv
        with open(out / "train_log.csv") as f:
            losses = [float(r["loss"]) for r in csv.DictReader(f)]
    return {"sp": sp, "cap_bytes": cap, "trained": trained, "losses": losses, "seconds": round(time.time() - t0, 1),
            "peak_saved_bytes": [r["peak_saved_bytes"] for r in ranks],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
            "error": None if trained else first_error(log).split("mmpipe: error: ")[-1]}  # past tqdm's bar


def _hwm_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("bench_sp: no VmHWM in /proc/self/status (Linux only)")


def loss_main(kind: str, n: int, dim: int, vocab: int, tile_bytes: int) -> int:
    """One process: the head's loss on hidden [1, n, dim] and a head [vocab, dim], forward and backward, on the
    whole logits (lm_loss, what a rank computed before the tiling) or tiled (TiledLogits); prints its peak resident
    growth over the inputs (VmHWM reset after they are made: /proc/self/clear_refs 5) and the loss, as JSON."""
    import torch
    import torch.nn.functional as F

    from mmpipe.model.builder import lm_loss
    from mmpipe.model.sequence_parallel import TiledLogits, tile_positions
    torch.manual_seed(0)
    hidden = torch.randn(1, n, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.02).requires_grad_()
    labels, weights = torch.randint(0, vocab, (1, n)), torch.full((1, n), 1.0 / n)
    Path("/proc/self/clear_refs").write_text("5")
    base, t0 = _hwm_bytes(), time.time()
    tile = tile_positions(vocab, tile_bytes)
    if kind == "whole":
        loss = lm_loss(F.linear(hidden, weight), (labels, weights))
    else:
        loss = TiledLogits(hidden, weight, tile).loss(labels, weights)
    loss.backward()
    print(json.dumps({"kind": kind, "positions": n, "vocab": vocab, "tile": n if kind == "whole" else tile,
                      "peak_growth_bytes": _hwm_bytes() - base, "logits_bytes": 4 * n * vocab,
                      "loss": loss.item(), "grad_norm": hidden.grad.norm().item(), "seconds": time.time() - t0}))
    return 0


def loss_bench(a) -> int:
    """--loss: loss_main whole and tiled, each in a fresh process; the table docs/sequence_parallel.md quotes."""
    rows = []
    for kind in ("whole", "tiled"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--loss-rank", kind, str(a.loss_positions),
               str(a.loss_dim), str(a.loss_vocab), str(int(a.tile_mib * 2 ** 20))]
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=a.timeout, check=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nthe head's loss on {a.loss_positions} positions (one SP rank's slice), dim {a.loss_dim}, vocabulary "
          f"{a.loss_vocab}: whole fp32 logits {_mib(rows[0]['logits_bytes'])} MiB\n")
    print("| loss | positions a tile | peak growth MiB | loss | hidden gradient norm | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['tile']} | {_mib(r['peak_growth_bytes'])} | {r['loss']:.6f} | "
              f"{r['grad_norm']:.6e} | {r['seconds']:.2f} |")
    return 0


def _mib(n) -> str:
    return f"{n / 2 ** 20:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench_sp")
    ap.add_argument("--cap-mib", type=float, default=None,
                    help="the activation cap for the capped runs (default: midway between SP 1's and SP 2's peaks)")
    ap.add_argument("--samples", type=int, default=160, help="text samples (~64 fill a row)")
    ap.add_argument("--words", type=int, default=1000, help="answer words per sample (up to)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    ap.add_argument("--loss", action="store_true", help="bench the head's loss alone, whole logits vs tiled")
    ap.add_argument("--loss-positions", type=int, default=1024, help="--loss: positions (one rank's slice)")
    ap.add_argument("--loss-dim", type=int, default=64, help="--loss: hidden size")
    ap.add_argument("--loss-vocab", type=int, default=151_936, help="--loss: vocabulary (Qwen's)")
    ap.add_argument("--tile-mib", type=float, default=64, help="--loss: a tile's fp32 logits, MiB")
    a = ap.parse_args(argv)
    if a.loss:
        return loss_bench(a)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flags = [*write_inputs(out, a.samples, a.words), "--steps", str(a.steps)]
    rows = []
    for sp in (1, 2, 4):  # uncapped: each SP's own peak
        rows.append(launch(flags, sp, out / f"sp{sp}", None, a.timeout))
        print(json.dumps(rows[-1]), flush=True)
    peak = {r["sp"]: max(r["peak_saved_bytes"] or [0]) for r in rows}
    cap = int(a.cap_mib * 2 ** 20) if a.cap_mib else (peak[1] + peak[2]) // 2
    for sp in (1, 2):  # the cap: SP 1 stops, SP 2 trains
        rows.append(launch(flags, sp, out / f"sp{sp}_capped", cap, a.timeout))
        print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nrow of {LENGTH} positions, llava-tiny, cap {_mib(cap)} MiB of activations per rank\n")
    print("| SP | cap | trained | peak activation MiB per rank | peak RSS MiB per rank | losses |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sp']} | {_mib(r['cap_bytes']) if r['cap_bytes'] else '-'} | "
              f"{'yes' if r['trained'] else 'no: ' + (r['error'] or '')[-120:]} | "
              f"{', '.join(map(_mib, r['peak_saved_bytes']))} | {', '.join(map(_mib, r['peak_rss_bytes']))} | "
              f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    return 0


if __name__ == "__main__":
    if "--loss-rank" in sys.argv[1:]:
        kind, *sizes = sys.argv[sys.argv.index("--loss-rank") + 1:]
        sys.exit(loss_main(kind, *map(int, sizes)))
    if "--rank" in sys.argv[1:]:
        i = sys.argv.index("--rank")
        rest = sys.argv[i + 1:]
        sys.exit(rank_main(rest[1:] if rest[:1] == ["--"] else rest))
    sys.exit(main())
