"""The reference model of --objective dpo, live in each stage: a reference pass before every optimizer step.

DeepSpeed's pipeline hands the last stage's loss_fn (logits, labels) and nothing else, so the reference log-probs
must be in the labels before the step runs. `LiveReference.step` draws the step's GAS micro-batches, runs them
through the whole pipeline once with the reference weights (DeepSpeed's eval_batch: no graph, no gradient, the
last stage's loss_fn swapped for a recorder of each row's answer log-prob, mmpipe.model.dpo.row_logps), then hands
train_batch the same micro-batches with (labels, ref_logps) as labels. Every stage runs both passes, in the same
order; the wire, the loaders and DP are untouched (each rank replays its own micro-batches).

The reference weights are the run's starting weights (the seed's, or --init-from's), or --reference RUN's:
    (a) a frozen copy of this stage's trained tensors, taken when the engine is built (before --resume loads the
        checkpoint): no gradient, no optimizer state; memory one copy of the stage's TRAINED parameters (a frozen
        group is shared: its values never change). The reference pass swaps the copy's storage in (p.data) and
        back: no tensor is copied per step.
    (b) with --lora: the adapters switched off (peft's disable_adapters: the base linears alone, no copy), plus (a)
        for any trained tensor that is not an adapter (a group outside --lora-groups and --freeze). LoRA's B starts
        at zero, so the adapters-off model is the starting model: (b) equals (a) exactly, at an adapter's copy less.
    (d) --reference RUN: (a)'s copies hold every tensor of the stage (a frozen group too), read from RUN's latest
        checkpoint as --init-from reads one (trainer.load_run_weights, into the swapped-in copies); LoRA adapters off.
A live reference costs one forward per step (no backward): about a third of a step's compute.
"""
from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path

import torch

from ..model.builder import ReferenceModel
from ..model.dpo import dpo_labels
from ..model.lora import is_adapter, load_base, lora_layers
from .checkpoint import load_reference
from .pipeline import rank_objective


class LiveReference:
    """This rank's reference weights and the pass that records the reference log-probs of a step's rows."""

    def __init__(self, engine, run, load=None):
        """load(module, ckpt_dir): reads a run's latest checkpoint into the module's layers (trainer.load_run_weights);
        with --reference RUN it fills the copies, which then hold every tensor of the stage (the frozen ones too)."""
        self.engine, self.run = engine, run
        module = engine.module
        self.adapters = [layer for _, _, layer in lora_layers(module)] if run.lora else []
        seen, self.copies = set(), []
        for name, p in module.named_parameters():
            if (p.requires_grad or run.reference) and not is_adapter(name) and id(p) not in seen:
                seen.add(id(p))
                self.copies.append((p, p.detach().clone()))
        if run.reference:  # the copies swapped in, the reference run's layers loaded into them, swapped out
            self._swap()
            try:
                load(module, Path(run.reference) / "checkpoints")
            finally:
                self._swap()
        self.seconds = 0.0  # the last reference pass's wall time (the step's time includes it)
        self.row_logps = _row_logps(engine, run)

    @property
    def copied(self) -> int:
        """Elements held for the reference: the copy of the trained non-adapter tensors."""
        return sum(r.numel() for _, r in self.copies)

    @contextlib.contextmanager
    def weights(self):
        """The stage's layers hold the reference weights inside the block (storage swapped, adapters off)."""
        self._swap()
        for layer in self.adapters:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in self.adapters:
                layer.enable_adapters(True)
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for p, ref in self.copies:
            p.data, ref.data = ref.data, p.data

    def step(self, batches):
        """The next step's GAS micro-batches from `batches`, the last stage's labels (labels, ref_logps)."""
        engine, gas, last = self.engine, self.run.gas, self.engine.is_last_stage()
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(gas)]
        if last and self.run.pack:  # packed rows: the record is per sample, by the rows' segments (model.dpo)
            micro = [(inputs, dpo_labels(inputs, labels, None, True)) for inputs, labels in micro]
        recorded: list[torch.Tensor] = []

        def record(logits, labels):
            lp = self.row_logps(logits, labels)
            recorded.append(lp.detach())
            return lp.sum()

        loss_fn, monitor_on = engine.module.loss_fn, engine.monitor.enabled
        engine.module.loss_fn, engine.monitor.enabled = record, False  # DeepSpeed would log it as 'eval_loss'
        try:
            with self.weights():
                engine.eval_batch(iter(micro), num_micro_batches=gas)
        finally:
            engine.module.loss_fn, engine.monitor.enabled = loss_fn, monitor_on
        if last:
            micro = [(inputs, dpo_labels(inputs, labels, ref, self.run.pack))
                     for (inputs, labels), ref in zip(micro, recorded)]
        self.seconds = time.perf_counter() - t0
        return iter(micro)


def _row_logps(engine, run):
    """The reference pass's record of each row's answer log-prob, in the form this rank's loss takes
    (pipeline.rank_objective: under --tp on the last stage's 1/TP of the vocabulary, the copies above being this
    rank's slices of the stage's layers, split as the policy's; under --sp each SP rank's slice's share of every
    sample's log-prob, all-reduced over SP): every TP and SP rank records the whole sums."""
    return rank_objective(engine, run).row_logps


def reference_rows(ref_model, inputs, labels, objective, packed: bool = False):
    """The single-device reference's (labels, ref_logps[, segments]) of one micro-batch (model.dpo.dpo_labels):
    ref_model, a frozen copy of the starting model, run on it without a graph (mmpipe.runtime.reference)."""
    labels = dpo_labels(inputs, labels, None, packed) if packed else labels
    with torch.no_grad():
        ref = objective.row_logps(ref_model(*inputs), labels)
    return dpo_labels(inputs, labels, ref, packed)


def starting_model(run, seed: int) -> ReferenceModel:
    """The single-device model a run starts from: the seed's, with --init-from's weights (adapters keep their init),
    as mmpipe.runtime.trainer.load_run_weights loads them into the stages."""
    model = ReferenceModel(run.model, seed=seed, freeze=run.freeze, lora=run.lora)
    if run.init_from:
        for mine, base in zip(model, load_reference(Path(run.init_from) / "checkpoints", run.model)):
            load_base(mine, base.state_dict())
    return model


def reference_model(run, model):
    """The single-device loop's reference (mmpipe.runtime.reference): --reference RUN's model, else a frozen copy of
    the starting `model`; no gradient either way."""
    if run.reference:
        ref = load_reference(Path(run.reference) / "checkpoints", run.model)
        return ref.requires_grad_(False)
    return copy.deepcopy(model).requires_grad_(False)
