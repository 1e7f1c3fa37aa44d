"""The precomputed reference of --objective dpo (issue 56, item 3c): the reference's log-probs scored once, read at
train time, so no reference runs during training.

    mmpipe score-reference --preset P --objective dpo --data pairs.jsonl --output-dir runs/r
        -> runs/r/data/reference_logps.npz, beside the data index (runs/r/data/index.npz)
    mmpipe train ... --objective dpo --reference-logps runs/r/data/reference_logps.npz

The file holds one float64 per side of the pair_cut index (entry n: the summed answer log-prob of index row n, the
reference's mmpipe.model.dpo.row_logps), and two fingerprints that the run must match, or it is refused in one line:

    weights  sha256 of the model config (model.json, as fitted) and of where the reference weights come from: the
             bytes of every layer file of --reference RUN's latest checkpoint, else of --init-from's, else the seed
             (a seeded start is a function of config and seed). LoRA adds nothing: its reference is the base.
    index    the data index's own fingerprint (the data files' size and mtime, the tokenizer, text length, policies)
             and a sha256 of its rows (which records the index kept, in order).

At train time each micro-batch's positions are those of the rank's StepBatches (the stream's sampler, the same
arguments), position -> index entry by the samples (PairedSamples.entry), and the last stage's labels become
(labels, ref_logps) as the live reference pass makes them (mmpipe.runtime.preference.LiveReference.step).
Cost: 8 bytes per side on disk and in memory, no forward at train time.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..data.batches import StepBatches, rank_batches
from ..model.dpo import dpo_labels
from .feed import run_dataset, step_order
from .preference import reference_model, starting_model

FILE = "reference_logps.npz"


def weights_fingerprint(run, seed: int) -> str:
    """What the reference weights are: the model config and RUN's / --init-from's layer files, or the seed."""
    h = hashlib.sha256(json.dumps(run.model.to_dict(), sort_keys=True).encode())
    source = run.reference or run.init_from
    if source:
        ckpt = Path(source) / "checkpoints"
        tag = (ckpt / "latest").read_text().strip()
        for f in sorted((ckpt / tag).glob("layer_*-model_states.pt")):
            h.update(f.name.encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    else:
        h.update(f"seed {seed}".encode())
    return h.hexdigest()[:16]


def index_fingerprint(samples) -> str:
    """The pair index's fingerprint and the rows it kept."""
    index = samples.index
    h = hashlib.sha256(index.stats["fingerprint"].encode())
    h.update(np.ascontiguousarray(index.rows, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def score_reference(run, samples, seed: int, out: Path) -> tuple[int, float]:
    """Writes every side's reference log-prob to `out`; (sides scored, seconds). The rows go through in the
    training stream's micro-batches of epoch 0 (positions [k micro, (k + 1) micro)), as the run will first see them."""
    t0 = time.perf_counter()
    ref = reference_model(run, starting_model(run, seed)).eval()
    n = len(samples.index)
    sampler = [list(range(i, min(i + run.micro, n))) for i in range(0, n, run.micro)]
    logps = np.zeros(n, dtype=np.float64)
    batches = rank_batches(run_dataset(run, samples, train=False), sampler)  # one sample a row, --pack or not
    with torch.no_grad():
        for positions, (inputs, labels) in zip(sampler, batches):
            lp = run.objective.row_logps(ref(*inputs), labels)
            logps[[samples.entry(p) for p in positions]] = lp.double().numpy()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:  # np.savez would add .npz to a name without it
        np.savez(f, logps=logps, weights=np.array(weights_fingerprint(run, seed)),
                 index=np.array(index_fingerprint(samples)))
    return n, time.perf_counter() - t0


def read_reference(path: str | Path, run, samples, seed: int, weights: bool = True) -> np.ndarray:
    """The file's log-probs per index entry; ConfigError (one line) where they are another model's or index's.
    weights=False: the index alone (a rank: the front door checked the weights, whose fingerprint reads every layer
    file of a checkpoint reference; each rank reading them all again would multiply that by the world size)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            logps, theirs, index = z["logps"], str(z["weights"]), str(z["index"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--reference-logps: {path} is not a file `mmpipe score-reference` wrote ({e})") from None
    mine = weights_fingerprint(run, seed) if weights else theirs
    if theirs != mine:
        raise ConfigError(f"--reference-logps: {path} was scored with another reference model (weights fingerprint "
                          f"{theirs}, this run's reference {mine}: model, seed, --init-from or --reference differ)")
    mine = index_fingerprint(samples)
    if index != mine or len(logps) != len(samples.index):
        raise ConfigError(f"--reference-logps: {path} was scored on another data index (index fingerprint {index}, "
                          f"this run's {mine}: the data, its files, tokenizer or text length differ)")
    return logps


class PrecomputedReference:
    """LiveReference's place at train time (step, seconds) with the log-probs read from a file: no forward."""

    def __init__(self, run, samples, seed: int, sampler: StepBatches, last: bool = True, plan=None):
        """sampler: a twin of the rank's stream sampler (the same start, micro, GAS, DP rank and order); plan: the
        rows' RowPlan (row position -> its samples' positions; with --pack a row holds several)."""
        self.run, self.samples, self.last, self.plan = run, samples, last, plan
        self.logps = torch.from_numpy(read_reference(run.reference_logps, run, samples, seed, weights=False))
        self.positions = iter(sampler)
        self.seconds = 0.0

    @classmethod
    def for_stream(cls, run, samples, seed: int, start: int, dp_rank: int, plan, last: bool):
        """The twin of trainer.DataStream's sampler (mmpipe.runtime.trainer) from stream position `start`."""
        order = step_order(run, samples, plan)
        return cls(run, samples, seed, StepBatches(start, run.micro, run.gas, dp_rank, run.dp, order), last, plan)

    def rows(self, inputs, labels):
        """The next micro-batch's (labels, ref_logps[, segments]) (mmpipe.model.dpo.dpo_labels): with --pack,
        ref_logps [B, K] holds row b's sample s's log-prob in column s - 1 (0 where the row has fewer)."""
        rows = next(self.positions)
        if not self.run.pack:
            return dpo_labels(inputs, labels, self.logps[[self.samples.entry(p) for p in rows]], False)
        held = [self.plan.row(r) for r in rows]
        ref = torch.zeros(len(rows), max(len(h) for h in held), dtype=self.logps.dtype)
        for b, h in enumerate(held):
            ref[b, :len(h)] = self.logps[[self.samples.entry(p) for p in h]]
        return dpo_labels(inputs, labels, ref, True)

    def step(self, batches):
        """The next step's GAS micro-batches, the last stage's labels (labels, ref_logps[, segments])."""
        micro = [next(batches) for _ in range(self.run.gas)]
        labelled = [(inputs, self.rows(inputs, labels)) for inputs, labels in micro]  # every stage walks them
        return iter(labelled if self.last else micro)


def main_score_reference(ns) -> int:
    """`mmpipe score-reference [train's flags]`: the run's reference log-probs to OUTPUT_DIR/data/reference_logps.npz,
    beside the data index; one process, the whole model (the stages' layers in one list, --tp's too), fp32."""
    from ..config import fail
    from ..data.dataset import index_dir, prepare
    from ..flags import from_namespace, print_plan
    from ..run_args import TrainArgs
    from ..run_config import requested_stages, resolve
    args = from_namespace(TrainArgs, ns)
    out = index_dir(args.output_dir) / FILE
    try:
        if args.objective != "dpo" or args.reference_logps:
            raise ConfigError("score-reference: give --objective dpo without --reference-logps (it scores each "
                              "preference pair's reference log-probs; docs/dpo.md)")
        # train's flags as given, --tp too (one process scores the whole model: log-probs do not depend on TP, so a
        # TP 1 score serves a --tp run and this file equals TP 1's)
        run = resolve(args, world_size=requested_stages(args) * max(1, args.tp))
        if ns.dry_run:
            return print_plan(f"score-reference {run.model.name}", data=str(Path(run.data.name).resolve()),
                              reference=run.reference or run.init_from or f"the seed's weights ({args.seed})",
                              out=str(out.resolve()))
        samples = prepare(run.data, run.model, args.output_dir, args.seed, verbose="always")
    except ConfigError as e:
        return fail(e)
    n, seconds = score_reference(run, samples, args.seed, out)
    print(f"mmpipe: score-reference: {n} answers ({n // 2} pairs) scored in {seconds:.1f} s; written to {out} "
          f"(train with --reference-logps {out})", flush=True)
    return 0
