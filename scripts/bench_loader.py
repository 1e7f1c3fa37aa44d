"""Loader throughput against training's consumption, as ratios measured in one run.

    python scripts/bench_loader.py                       # small preset, 2000 exported LLaVA records
    python scripts/bench_loader.py --data my.jsonl --workers 0,2,4 --out-json runs/bench.json

1. data: exports the built-in shapes set as LLaVA JSONL (PNG files, the preset's image size) into
   the work directory, unless --data names a dataset (anything `mmpipe train --data` accepts).
2. training: `python -m mmpipe.cli train --preset P --data D --steps N --eval-samples 0 ...` and
   its summary.json's samples_per_s (median step, first step left out). Per first-stage rank that
   is samples_per_s / dp samples per second pulled from the loader.
3. loader alone, with the CPU otherwise idle: the first stage's stream built as mmpipe.train builds
   it (same flags resolved by mmpipe.run_config, the index the front door wrote, RowSet with
   images and, in a multi-stage pipeline, without labels, StepBatches, rank_batches) for each
   --workers count; warm-up micro-batches (worker start-up included) first, then --windows timed
   windows of --batches micro-batches each, the median window reported. The last stage's stream
   (labels, no images, no workers, as in training) too, and a per-sample breakdown of the
   first stage's work (index lookup, record re-read, PNG decode, transform, collate).
4. prints a table with loader / training for each worker count, whether it is >= --target (5x),
   and writes everything to --out-json.

Extra flags go to both the training run and the loader (e.g. --augment, --resize squash,
--ds-config ds_configs/cpu_bf16.json, --data-workers 1: training's own worker count).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as each training rank runs (mmpipe.cli sets it)

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mmpipe.config import load_preset  # noqa: E402
from mmpipe.flags import add_flags, from_namespace  # noqa: E402
from mmpipe.run_args import LaunchArgs, TrainArgs  # noqa: E402
from mmpipe.run_config import requested_stages, resolve  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Unknown flags are passed to `mmpipe train` and used for the loader too.")
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument("--data", default=None,
                   help="dataset to read (any --data mmpipe accepts); default: export the shapes set as LLaVA JSONL")
    p.add_argument("--records", type=int, default=2000,
                   help="records to export when --data is not given (default: 2000)")
    p.add_argument("--steps", type=int, default=60, help="training steps for the consumption rate (default: 60)")
    p.add_argument("--train-summary", default=None,
                   help="read training's rate from this summary.json instead of running training")
    p.add_argument("--workers", default="0,1,2",
                   help="loader worker counts to measure, comma-separated (default: 0,1,2)")
    p.add_argument("--prefetch", type=int, default=4, help="micro-batches each worker decodes ahead (default: 4, "
                                                           "rank_batches' default, what training uses)")
    p.add_argument("--warmup", type=int, default=16, help="micro-batches pulled before timing (default: 16)")
    p.add_argument("--batches", type=int, default=150, help="micro-batches per timed window (default: 150)")
    p.add_argument("--windows", type=int, default=3, help="timed windows per worker count; the median is "
                                                         "reported (default: 3)")
    p.add_argument("--breakdown-samples", type=int, default=400,
                   help="samples timed step by step for the breakdown (0: skip; default: 400)")
    p.add_argument("--target", type=float, default=5.0, help="required loader / training ratio (default: 5)")
    p.add_argument("--work-dir", default=None, help="exported data and the training run go here (default: a temporary "
                                                    "directory, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--out-json", default=str(Path(tempfile.gettempdir()) / "bench_loader.json"),
                   help="write the results here (default: %(default)s)")
    args, extra = p.parse_known_args(argv)
    try:
        args.worker_counts = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        p.error(f"--workers: {args.workers!r} is not a comma-separated list of integers")
    if any(w < 0 for w in args.worker_counts) or not args.worker_counts:
        p.error("--workers: give one or more counts >= 0")
    for name in ("steps", "batches", "windows", "records", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1")
    if args.steps < 3 and not args.train_summary:
        p.error("--steps: use at least 3 (the first step is left out of the rate)")
    return args, extra


# ---------------------------------------------------------------- steps 1 and 2

def export_data(work: Path, n: int, preset: str) -> Path:
    from mmpipe.data.export import export_shapes
    v = load_preset(preset).vision
    t0 = time.perf_counter()
    path = export_shapes(work / "shapes_llava", "llava-jsonl", n, image_size=v.image_size, patch=v.patch_size)
    print(f"bench: exported {n} LLaVA records ({v.image_size} px PNG) to {path} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return path


def run_training(train_argv: list[str], out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", *train_argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    log_path = out_dir.parent / "train.log"
    print(f"bench: training: {' '.join(cmd)}  (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if rc != 0 or not (out_dir / "summary.json").is_file():
        tail = log_path.read_text().splitlines()[-30:]
        sys.exit("bench: training failed (exit status %d); last lines of %s:\n%s" % (rc, log_path, "\n".join(tail)))
    print(f"bench: training finished in {wall:.0f} s (start-up included)", flush=True)
    return training_rate(out_dir / "summary.json", wall)


def training_rate(summary_path: Path, wall: float | None = None) -> dict:
    s = json.loads(Path(summary_path).read_text())
    res = {"summary": str(summary_path), "steps": s["steps"], "samples_per_s": s["samples_per_s"],
           "step_time_s": s["step_time_s"], "train_batch": s["train_batch"], "dp": s["dp"], "stages": s["stages"],
           "micro_batch": s["micro_batch"], "gradient_accumulation": s["gradient_accumulation"],
           "train_time_s": s["train_time_s"], "wall_s_with_startup": wall}
    log = Path(summary_path).parent / "train_log.csv"
    if log.is_file():  # the mean over steps 2..N, beside the median, to show how steady the steps were
        import csv
        with open(log) as f:
            rows = [r for r in csv.DictReader(f)]
        if len(rows) >= 3:
            span = float(rows[-1]["elapsed_s"]) - float(rows[0]["elapsed_s"])
            res["samples_per_s_mean"] = (len(rows) - 1) * s["train_batch"] / span
            rates = sorted(float(r["samples_per_s"]) for r in rows[1:])
            res["samples_per_s_p10_p90"] = [rates[len(rates) // 10], rates[(9 * len(rates)) // 10]]
    # each first-stage rank's loader serves one data-parallel replica: train_batch / dp per step
    res["per_rank_samples_per_s"] = s["samples_per_s"] / s["dp"]
    return res


# ---------------------------------------------------------------- step 3

def build_run(train_argv: list[str]):
    """The run as every rank resolves it, from the same flags (and mmpipe train's front-door ones)."""
    p = argparse.ArgumentParser()
    add_flags(p, TrainArgs)
    add_flags(p, LaunchArgs)
    ns = p.parse_args(train_argv)
    args, dp = from_namespace(TrainArgs, ns), ns.dp or 1
    run = resolve(args, world_size=dp * requested_stages(args))
    return args, run


def load_samples(args, run):
    """The samples as a rank gets them: the front door builds (or has built) the index; each rank
    then calls prepare() again, which loads it and opens the source afresh."""
    from mmpipe.data.dataset import prepare
    if not run.data.builtin:
        prepare(run.data, run.model, args.output_dir, args.seed, verbose=False)
    return prepare(run.data, run.model, args.output_dir, args.seed, verbose=False)


def make_dataset(samples, run, args, *, first: bool, last: bool):
    from mmpipe.runtime.feed import run_dataset
    return run_dataset(run, samples, first=first, last=last, augment_seed=args.seed if run.data.augment else None,
                       train=False)


def time_stream(dataset, run, *, workers: int, prefetch: int, warmup: int, batches: int, windows: int) -> dict:
    """Pull micro-batches from rank 0's stream (dp rank 0) as DeepSpeed's pipeline would."""
    from mmpipe.data.batches import StepBatches, rank_batches
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(run.precision, torch.float32)
    t0 = time.perf_counter()
    stream = rank_batches(dataset, StepBatches(0, run.micro, run.gas, 0, run.dp), workers=workers, prefetch=prefetch,
                          dtype=dtype)
    next(stream)
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        next(stream)
    warm_s = time.perf_counter() - t0
    rates = []
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(batches):
            next(stream)
        rates.append(batches * run.micro / (time.perf_counter() - t))
    stream.close()  # ends the DataLoader iterator: its workers shut down
    del stream
    gc.collect()
    return {"workers": workers, "samples_per_s": statistics.median(rates), "windows": rates,
            "first_batch_s": first_s, "warmup_s": warm_s, "timed_micro_batches": batches * windows}


def breakdown(samples, dataset, run, n: int) -> dict:
    """Seconds per sample of each piece of the first stage's __getitem__ + collate, in this process."""
    from mmpipe.data.batches import collate
    from mmpipe.data.packing import row_shape, sample_sequence
    positions = range(n)
    parts = {}

    def clock(name, fn):
        t = time.perf_counter()
        out = [fn(p) for p in positions]
        parts[name] = (time.perf_counter() - t) / n
        return out

    indexed = hasattr(samples, "source")  # a user dataset, tokenised once in the index; the built-in set tokenises here
    shape = row_shape(run.model, run.max_images, run.text_len)
    clock("tokens + row" + (" (index lookup)" if indexed else " (chat template + tokenise)"),
          lambda p: sample_sequence(*samples.tokens(p), shape))
    if indexed:  # a user dataset: what IndexedSamples.pixels() does, piece by piece
        from mmpipe.data.images import open_image
        rows = [samples.row(p) for p in positions]
        recs = clock("record re-read (JSON parse + checks)", lambda p: samples.source.record(rows[p]))
        imgs = clock("image open + PNG decode + RGB", lambda p: open_image(recs[p].image, samples.reader.image_root,
                                                                           samples.reader.max_pixels))
        clock("transform (pad/resize/normalise)", lambda p: samples.reader.transform(imgs[p]))
    else:  # the built-in set renders its images
        clock("pixels (render + transform)", samples.pixels)
    items = clock("RowSet.__getitem__ (all of the above)", dataset.__getitem__)
    t = time.perf_counter()
    for i in range(0, n - run.micro + 1, run.micro):
        collate(items[i:i + run.micro])
    parts["collate"] = (time.perf_counter() - t) / (n - n % run.micro)
    return {"samples": n, "seconds_per_sample": parts,
            "implied_samples_per_s": 1 / (parts["RowSet.__getitem__ (all of the above)"] + parts["collate"])}


# ---------------------------------------------------------------- report

def report(res: dict, target: float) -> list[str]:
    tr = res["training"]
    consume = tr["per_rank_samples_per_s"]
    lines = [f"training consumes {tr['samples_per_s']:.0f} samples/s (median step, steps 2..{tr['steps']}, "
             f"{tr['micro_batch']} micro x {tr['gradient_accumulation']} GAS x {tr['dp']} DP, {tr['stages']} stages"
             + (f"; mean {tr['samples_per_s_mean']:.0f}" if "samples_per_s_mean" in tr else "")
             + f"), i.e. {consume:.0f} samples/s from each first-stage loader; training used "
             f"--data-workers {res['config']['train_data_workers']}",
             "",
             f"{'stream':<28}{'workers':>8}{'samples/s':>12}{'windows (samples/s)':>28}{'x training':>12}"
             f"{'>= ' + format(target, 'g') + 'x':>8}",
             "-" * 96]
    for r in res["loader"]["first_stage"]:
        w = ", ".join(f"{x:.0f}" for x in r["windows"])
        lines.append(f"{'first stage (images)':<28}{r['workers']:>8}{r['samples_per_s']:>12.0f}{w:>28}"
                     f"{r['ratio']:>11.1f}x{'yes' if r['ratio'] >= target else 'NO':>8}")
    r = res["loader"]["last_stage"]
    if r:
        w = ", ".join(f"{x:.0f}" for x in r["windows"])
        lines.append(f"{'last stage (labels only)':<28}{r['workers']:>8}{r['samples_per_s']:>12.0f}{w:>28}"
                     f"{r['ratio']:>11.1f}x{'yes' if r['ratio'] >= target else 'NO':>8}")
    v = res["verdict"]
    lines += ["", v["text"]]
    b = res.get("breakdown")
    if b:
        lines += ["", f"first-stage work per sample, in one process ({b['samples']} samples):"]
        lines += [f"  {k:<42}{s * 1e6:>8.0f} us" for k, s in b["seconds_per_sample"].items()]
        lines.append(f"  -> at most {b['implied_samples_per_s']:.0f} samples/s per process")
    return lines


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tmp = args.work_dir is None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_loader_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = str(Path(args.data).resolve()) if args.data and args.data != "shapes" and Path(args.data).exists() \
            else args.data
        if data is None:
            data = str(export_data(work, args.records, args.preset))
        out_dir = work / "train"
        train_argv = ["--preset", args.preset, "--data", data, "--steps", str(args.steps), "--eval-samples", "0",
                      "--output-dir", str(out_dir), *extra]
        bargs, run = build_run(train_argv)  # refuses bad flags before anything runs

        training = training_rate(Path(args.train_summary)) if args.train_summary else run_training(train_argv, out_dir)

        print("bench: loader alone (nothing else running in this benchmark)", flush=True)
        # Fresh samples for every stream, as each rank has: the source of a .jsonl file keeps one open file
        # whose offset forked DataLoader workers would share had this process read a record before forking
        # them (see docs/loader_benchmark.md); a rank never reads one before its workers start.
        results = []
        for w in args.worker_counts:
            first = make_dataset(load_samples(bargs, run), run, bargs, first=True, last=run.stages == 1)
            r = time_stream(first, run, workers=w, prefetch=args.prefetch, warmup=args.warmup, batches=args.batches,
                            windows=args.windows)
            r["ratio"] = r["samples_per_s"] / training["per_rank_samples_per_s"]
            print(f"bench:   first stage, {w} workers: {r['samples_per_s']:.0f} samples/s "
                  f"({r['ratio']:.1f}x training; first micro-batch after {r['first_batch_s']:.2f} s)", flush=True)
            results.append(r)
        last_r = None
        if run.stages > 1:
            last = make_dataset(load_samples(bargs, run), run, bargs, first=False, last=True)
            last_r = time_stream(last, run, workers=0, prefetch=args.prefetch, warmup=args.warmup,
                                 batches=args.batches, windows=args.windows)
            last_r["ratio"] = last_r["samples_per_s"] / training["per_rank_samples_per_s"]
        bd = None
        if args.breakdown_samples >= run.micro:
            samples = load_samples(bargs, run)
            bd = breakdown(samples, make_dataset(samples, run, bargs, first=True, last=run.stages == 1), run,
                           args.breakdown_samples)

        train_w = run.data.workers
        used = next((r for r in results if r["workers"] == train_w), None)
        best = max(results, key=lambda r: r["samples_per_s"])
        if used is not None:
            ok = used["ratio"] >= args.target
            text = (f"{'MET' if ok else 'NOT MET'}: with the {train_w} loader workers training uses, the first stage's "
                    f"loader delivers {used['samples_per_s']:.0f} samples/s = {used['ratio']:.1f}x what training "
                    f"consumes (target >= {args.target:g}x)")
        else:
            ok = best["ratio"] >= args.target
            text = (f"{'MET' if ok else 'NOT MET'}: training's {train_w} workers were not measured; the best measured "
                    f"count ({best['workers']}) gives {best['ratio']:.1f}x (target >= {args.target:g}x)")
        if used is not None and not ok and best["ratio"] >= args.target:
            text += f"; {best['workers']} workers would give {best['ratio']:.1f}x"
        res = {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                        "gpu": torch.cuda.is_available(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "omp_num_threads": os.environ["OMP_NUM_THREADS"]},
            "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]) if argv is None else argv,
            "config": {"preset": args.preset, "data": data, "exported_records": None if args.data else args.records,
                       "image_size": run.model.vision.image_size, "text_len": run.text_len, "micro": run.micro,
                       "gas": run.gas, "dp": run.dp, "stages": run.stages, "precision": run.precision,
                       "train_data_workers": train_w, "prefetch": args.prefetch, "warmup": args.warmup,
                       "batches_per_window": args.batches, "windows": args.windows, "train_argv": train_argv},
            "training": training,
            "loader": {"first_stage": results, "last_stage": last_r},
            "breakdown": bd,
            "target": args.target,
            "verdict": {"met": ok, "workers_in_training": train_w, "text": text},
        }
        lines = report(res, args.target)
        print("\n" + "\n".join(lines), flush=True)
        out_json = Path(args.out_json)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"\nbench: results in {out_json}", flush=True)
        return 0
    finally:
        if tmp and not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
