"""What a run trains on, one `Objective` record each (`--objective`), shaped like a pipeline schedule's record
(mmpipe.planning.schedule_registry): everything that differs between objectives is a field, and the record, not its
name, is what the pipeline, the single-device reference and validation are handed.

    TOKENS   sft: the cross-entropy of the answer tokens, the mean over the global batch's (--loss-norm token) or
             its samples' (sample) labelled positions; an MoE head's load-balancing term added (mmpipe.model.moe)

A record says what the last stage computes from the logits and the row's labels (`loss`: one scalar per micro-batch,
DeepSpeed's loss_fn, whose backward reaches every stage), what validation sums (`eval_sum`: its total over the set's
labelled tokens, divided once by their count), what a row carries for it besides the token labels (`row_fields`,
the names of the label tuple's extra tensors: the SFT loss reads the LossNorm weights only), and the per-step values
it logs beside the loss (`logged`).

    DPO      dpo: a preference loss over (chosen, rejected) rows of one micro-batch against a reference model's
             log-probs (mmpipe.model.dpo; --beta, --dpo-loss, --rpo-alpha). `reference`: a reference pass runs
             before each step (mmpipe.runtime.preference) and `row_logps` is what it records per row; the label tuple
             is then (labels, ref_logps); `metrics` gives the `logged` values of the micro-batch the loss saw last.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .builder import IGNORE_INDEX, lm_loss, lm_loss_sum
from .dpo import REWARDS, DPOLoss, full_ce, row_logps

LossFn = Callable[[torch.Tensor, object], torch.Tensor]


@dataclass(frozen=True)
class Objective:
    name: str  # --objective, summary.json's "objective"
    loss: LossFn  # (logits, labels) -> the micro-batch's training loss on the last stage (and in the reference)
    eval_sum: LossFn  # (logits, labels) -> the summed validation loss of the micro-batch (mmpipe.runtime.validation)
    row_fields: tuple[str, ...] = ()  # the label tuple's tensors beside the token labels
    logged: tuple[str, ...] = ()  # per-step values beside the loss in train_log.csv (an MoE run adds its aux term)
    # (shard, vocab) -> (loss, eval_sum[, row_logps]) on the last stage's 1/TP of the vocabulary's logits under --tp
    # (mmpipe.model.tensor_parallel); None: the objective has no vocab-parallel form yet (refused at --tp > 1)
    vocab_parallel: Callable[[object, int], tuple[LossFn, ...]] | None = None
    pairs: bool = False  # rows come as (chosen, rejected) pairs of preference data (mmpipe.data.preference)
    reference: bool = False  # the loss reads each row's reference log-prob, recorded by a pass before each step
    row_logps: LossFn | None = None  # (logits, labels) -> [B] per-row answer log-prob: the reference pass's record
    metrics: Callable[[], dict] | None = None  # the `logged` values of the micro-batch the loss saw last
    # validation: [len(logged) + 1] sums of the `logged` values over the pass's pairs and their count, cleared per pass
    eval_metrics: Callable[[], torch.Tensor] | None = None
    # shard -> (loss, eval_sum[, row_logps]) under --sp on one SP rank: the head's TiledLogits (or logits) of its
    # slice of the row, this rank's slice of the labels, the sums over the SP group (mmpipe.model.sequence_parallel)
    sequence_parallel: Callable[[object], tuple[LossFn, ...]] | None = None

    def __str__(self) -> str:
        return self.name

    def split_vocab(self, shard, vocab: int) -> "Objective":
        """This record with loss and eval_sum (and a pair objective's row_logps) over vocab-split logits (shard:
        mmpipe.model.tensor_parallel.Shard); metrics / eval_metrics stay: the split forms share the record's loss."""
        parts = self.vocab_parallel(shard, vocab)
        return dataclasses.replace(self, **dict(zip(("loss", "eval_sum", "row_logps"), parts)))

    def split_sequence(self, shard) -> "Objective":
        """This record on one SP rank's slice of every row (shard: its SP group; under --tp too, the tiles carrying
        the TP shard): loss, eval_sum (and row_logps) the whole row's on every SP rank, each rank's gradient its
        positions' share (the step sums them over SP)."""
        parts = self.sequence_parallel(shard)
        return dataclasses.replace(self, **dict(zip(("loss", "eval_sum", "row_logps"), parts)))


def split_ce(shard, vocab: int):
    """(logits [B, T, V / TP], labels [B, T]) -> the per-position cross-entropy [B, T] over the TP group's whole
    vocabulary (tensor_parallel.vocab_parallel_ce), 0 at ignored positions: what both objectives' split forms read."""
    from .tensor_parallel import vocab_parallel_ce

    def ce(logits, labels):
        return vocab_parallel_ce(logits, labels, shard, vocab, IGNORE_INDEX)
    return ce


def vocab_parallel_lm_loss(shard, vocab: int):
    """(loss, eval_sum): lm_loss and lm_loss_sum on vocab-split logits (vocab_parallel_ce),
    the same value on every TP rank: the labelled positions' mean, or their LossNorm-weighted sum, or the sum."""
    from .moe import split_aux
    ce = split_ce(shard, vocab)

    def loss(logits, labels):
        logits, aux = split_aux(logits)
        if aux is not None:
            return loss(logits, labels) + aux
        if isinstance(labels, (tuple, list)):
            labels, weights = labels
            return (ce(logits, labels) * weights).sum()
        return ce(logits, labels).sum() / (labels != IGNORE_INDEX).sum()

    def eval_sum(logits, labels):
        return ce(split_aux(logits)[0], labels).sum()
    return loss, eval_sum


def token_ce(logits, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy [B, T] (0 at ignored positions) of a head's output: under --sp its TiledLogits'
    (a tile of logits at a time, never the slice's whole: sequence_parallel.TiledCrossEntropy), else full_ce's."""
    from .sequence_parallel import TiledLogits
    return logits.ce(labels) if isinstance(logits, TiledLogits) else full_ce(logits, labels)


def sp_slice(labels, shard):
    """This SP rank's slice of a label tuple's per-position tensors: the token labels (padded with IGNORE_INDEX, as a
    row SP does not divide is) and a packed dpo tuple's segments (padded with 0); ref_logps / weights as they are."""
    from .sequence_parallel import local
    if not isinstance(labels, (tuple, list)):
        return local(labels, shard, 1, IGNORE_INDEX)
    tokens, other, *segments = labels
    return (local(tokens, shard, 1, IGNORE_INDEX), other, *(local(s, shard, 1) for s in segments))


def sequence_parallel_lm_loss(shard):
    """(loss, eval_sum) on one SP rank: sp_loss (the LossNorm-weighted cross-entropy of its slice, summed over SP)
    and validation's sum of cross-entropy over its slice's labelled positions, summed over SP."""
    from .moe import split_aux
    from .sequence_parallel import sp_loss
    from .tensor_parallel import reduce_from_tp

    def eval_sum(logits, labels):
        return reduce_from_tp(token_ce(split_aux(logits)[0], sp_slice(labels, shard)).sum(), shard)
    return sp_loss(lm_loss, shard), eval_sum


TOKENS = Objective("sft", lm_loss, lm_loss_sum, row_fields=("weights",), vocab_parallel=vocab_parallel_lm_loss,
                   sequence_parallel=sequence_parallel_lm_loss)


def dpo(beta: float = 0.1, kind: str = "sigmoid", rpo_alpha: float = 0.0) -> Objective:
    """The DPO record of these settings (a fresh loss object each: it keeps its last micro-batch's rewards)."""
    loss = DPOLoss(beta, kind, rpo_alpha)

    def vocab_parallel(shard, vocab: int):
        """(loss, eval_sum, row_logps) on the rank's 1/TP of the logits: the same DPOLoss (its rewards and validation
        sums, so metrics / eval_metrics read them) with the vocab-parallel cross-entropy; every TP rank computes the
        same per-sequence sums, losses and rewards, and its backward reaches its own slice of the logits."""
        ce = split_ce(shard, vocab)
        return (functools.partial(loss, ce=ce), functools.partial(loss.eval_sum, ce=ce),
                functools.partial(row_logps, ce=ce))

    def sequence_parallel(shard):
        """(loss, eval_sum, row_logps) on one SP rank: the same DPOLoss on its slice of the labels (sp_slice) with the
        tiled per-position cross-entropy (token_ce); each per-sample sum (log-prob, token count; RPO's chosen sums) is
        this rank's positions' share, all-reduced over SP before the loss (reduce_from_tp: its backward the identity,
        each rank's log-probs feeding the same loss), so every SP rank computes the whole loss and rewards."""
        from .tensor_parallel import reduce_from_tp
        total = functools.partial(reduce_from_tp, shard=shard)

        def on_slice(fn):
            return lambda logits, labels: fn(logits, sp_slice(labels, shard), ce=token_ce, total=total)
        return on_slice(loss), on_slice(loss.eval_sum), on_slice(row_logps)
    return Objective("dpo", loss, loss.eval_sum, row_fields=("ref_logps",), logged=REWARDS, pairs=True,
                     reference=True, row_logps=row_logps, metrics=loss.metrics,
                     eval_metrics=loss.eval_metrics, vocab_parallel=vocab_parallel,
                     sequence_parallel=sequence_parallel)


DPO = dpo()
OBJECTIVES = (TOKENS, DPO)
OBJECTIVE_NAMES = tuple(o.name for o in OBJECTIVES)


def objective_named(name: str | Objective) -> Objective:
    """The record of a name (a record is itself); an unknown name is a ValueError naming the valid ones."""
    for o in OBJECTIVES:
        if name in (o, o.name):
            return o
    raise ValueError(f"unknown objective {name!r} (valid: {', '.join(OBJECTIVE_NAMES)})")


def run_objective(args) -> Objective:
    """The record a run's flags ask for: --objective, with --beta / --dpo-loss / --rpo-alpha for dpo."""
    if objective_named(args.objective).name == DPO.name:
        return dpo(args.beta, args.dpo_loss, args.rpo_alpha)
    return objective_named(args.objective)
