"""What a run trains on, one `Objective` record each (`--objective`), shaped like a pipeline schedule's record
(mmpipe.planning.schedule_registry): everything that differs between objectives is a field, and the record, not its
name, is what the pipeline, the single-device reference and validation are handed.

    TOKENS   sft: the cross-entropy of the answer tokens, the mean over the global batch's (--loss-norm token) or
             its samples' (sample) labelled positions; an MoE head's load-balancing term added (mmpipe.model.moe)

A record says what the last stage computes from the logits and the row's labels (`loss`: one scalar per micro-batch,
DeepSpeed's loss_fn, whose backward reaches every stage), what validation sums (`eval_sum`: its total over the set's
labelled tokens, divided once by their count), what a row carries for it besides the token labels (`row_fields`,
the names of the label tuple's extra tensors: the SFT loss reads the LossNorm weights only), and the per-step values
it logs beside the loss (`logged`). A preference objective (chosen and rejected answers of one prompt in one
micro-batch) is a second record of the same shape.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .builder import lm_loss, lm_loss_sum

LossFn = Callable[[torch.Tensor, object], torch.Tensor]


@dataclass(frozen=True)
class Objective:
    name: str  # --objective, summary.json's "objective"
    loss: LossFn  # (logits, labels) -> the micro-batch's training loss on the last stage (and in the reference)
    eval_sum: LossFn  # (logits, labels) -> the summed validation loss of the micro-batch (mmpipe.runtime.validation)
    row_fields: tuple[str, ...] = ()  # the label tuple's tensors beside the token labels
    logged: tuple[str, ...] = ()  # per-step values beside the loss in train_log.csv (an MoE run adds its aux term)
    # (shard, vocab) -> (loss, eval_sum) on the last stage's 1/TP of the vocabulary's logits under --tp
    # (mmpipe.model.tensor_parallel); None: the objective has no vocab-parallel form yet (refused at --tp > 1)
    vocab_parallel: Callable[[object, int], tuple[LossFn, LossFn]] | None = None

    def __str__(self) -> str:
        return self.name

    def split_vocab(self, shard, vocab: int) -> "Objective":
        """This record with loss and eval_sum over vocab-split logits (shard: mmpipe.model.tensor_parallel.Shard)."""
        loss, eval_sum = self.vocab_parallel(shard, vocab)
        return dataclasses.replace(self, loss=loss, eval_sum=eval_sum)


def _tokens_vocab_parallel(shard, vocab: int):
    from .tensor_parallel import vocab_parallel_lm_loss
    return vocab_parallel_lm_loss(shard, vocab)


TOKENS = Objective("sft", lm_loss, lm_loss_sum, row_fields=("weights",), vocab_parallel=_tokens_vocab_parallel)
OBJECTIVES = (TOKENS,)
OBJECTIVE_NAMES = tuple(o.name for o in OBJECTIVES)


def objective_named(name: str | Objective) -> Objective:
    """The record of a name (a record is itself); an unknown name is a ValueError naming the valid ones."""
    for o in OBJECTIVES:
        if name in (o, o.name):
            return o
    raise ValueError(f"unknown objective {name!r} (valid: {', '.join(OBJECTIVE_NAMES)})")
