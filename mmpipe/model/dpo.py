"""Direct preference optimisation (DPO) on the last stage: the loss of `--objective dpo` (mmpipe.model.objectives).

A micro-batch holds whole pairs, rows side by side: row 2j the chosen answer of pair j, row 2j + 1 the rejected one
(mmpipe.data.preference lays them out; an even --micro-batch keeps a pair inside one micro-batch). Each row's
labels mark its answer tokens only (the prompt and the image are never labelled), so a row's sequence log-prob is

    logp(row) = sum over its labelled positions t of log softmax(logits[t])[labels[t]]

the sum over the answer's own tokens, as TRL's DPOTrainer sums its completion mask. The reference model's log-probs
of the same rows travel in the label tuple, (labels [B, T], ref_logps [B]), computed by a reference pass before the
step (mmpipe.runtime.preference). Packed rows (--pack) hold several samples each: rows 2i / 2i + 1 hold the chosen /
rejected sides of the same pairs in the same segment order (mmpipe.data.packing.RowPlan's unit of 2), each sample's
log-prob is the sum over its own segment's labelled positions, and the tuple is (labels, ref_logps [B, K], segments
[B, T]), K the most samples a row of the micro-batch holds. With z = (pi_c - pi_r) - (ref_c - ref_r) per pair, TRL's
three losses:

    sigmoid  -log sigmoid(beta z)                      (the DPO paper's)
    hinge    relu(1 - beta z)                          (SLiC)
    ipo      (z' - 1 / (2 beta))^2,  z' = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r   (n: the answer's tokens; TRL
             normalises IPO by the completion length, trl/trainer/dpo_trainer.py, loss_type "ipo")

the micro-batch's loss is their mean over its pairs, plus rpo_alpha x the mean cross-entropy of the chosen answers'
tokens (RPO; TRL 1.x: loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]). DeepSpeed scales each
micro-batch's loss by 1 / GAS and averages over DP: the step's loss is the mean over its pairs (every micro-batch
holds micro / 2 of them). The rewards TRL logs: beta (pi - ref) of each side, their accuracy (chosen > rejected)
and margin, means over the micro-batch's pairs (`metrics`), which the engine averages the same way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .builder import IGNORE_INDEX
from .moe import split_aux

DPO_LOSSES = ("sigmoid", "ipo", "hinge")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")  # TRL's metric names


def token_labels(labels) -> torch.Tensor:
    """The token labels [B, T] of a label tuple (labels, weights) / (labels, ref_logps), or of bare labels."""
    return labels[0] if isinstance(labels, (tuple, list)) else labels


def full_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy [B, T] from the full vocabulary's logits [B, T, V] (0 at ignored positions). Under
    --tp the objective's vocab_parallel form passes its own (mmpipe.model.objectives: tensor_parallel.vocab_parallel_ce
    on the rank's [B, T, V / TP], the max, the sum of exp and the label's logit all-reduced over the TP group)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return ce.view(labels.shape)


def row_token_logps(logits: torch.Tensor, labels: torch.Tensor, ce=full_ce) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob [B, T] of each labelled position's token, 0 elsewhere; the labelled mask [B, T]); ce: full_ce, or
    its vocab-parallel form on the rank's slice of the vocabulary (the same values on every TP rank)."""
    logits = split_aux(logits)[0]
    mask = labels != IGNORE_INDEX
    return -ce(logits, labels) * mask, mask


def segment_sums(x: torch.Tensor, segments: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] -> [B, k]: column s - 1 the sum of x over row positions of segment s (a packed row's sample s; 0 is
    padding, dropped)."""
    return x.new_zeros(x.shape[0], k + 1).scatter_add_(1, segments, x)[:, 1:]


def is_packed(labels) -> bool:
    """A packed micro-batch's label tuple: (labels [B, T], ref_logps [B, K], segments [B, T])."""
    return isinstance(labels, (tuple, list)) and len(labels) == 3


def whole(x: torch.Tensor) -> torch.Tensor:
    """A sum over a row's positions as it stands: the row is whole on this rank (no --sp)."""
    return x


def row_logps(logits: torch.Tensor, labels, ce=full_ce, total=whole) -> torch.Tensor:
    """[B]: each row's sum of its answer tokens' log-probs (the reference pass's record, and the policy's); packed
    rows (is_packed): [B, K], each sample's own sum (K: the ref_logps' columns). ce: as row_token_logps. total: the
    sum of per-position sums over the ranks holding the row's positions (--sp: each SP rank sums its slice's share of a
    sample, a sample cut by the slice on both, then all-reduced; objectives.dpo's sequence_parallel)."""
    lp = row_token_logps(logits, token_labels(labels), ce)[0]
    return total(segment_sums(lp, labels[2], labels[1].shape[1]) if is_packed(labels) else lp.sum(-1))


def stage_segments(inputs) -> torch.Tensor:
    """The segments [B, T] of a stage tuple as mmpipe.data.batches.rank_batches builds it: ([pixels,] input_ids,
    has_image, segments[, tiling]), tiling [B, M, w] the only 3-dim integer tensor after segments."""
    return inputs[-2] if inputs[-1].dim() == 3 else inputs[-1]


def dpo_labels(inputs, labels, ref: torch.Tensor | None, packed: bool):
    """The label tuple the DPO loss reads: (labels, ref_logps [B]) for one sample a row; with --pack (labels,
    ref_logps [B, K], segments [B, T]), K the micro-batch's most samples in a row (ref None: zeros, the reference
    pass's placeholder, whose record fills them)."""
    tokens = token_labels(labels)
    if not packed:
        return tokens, ref
    segments = stage_segments(inputs)
    return tokens, (torch.zeros(len(tokens), int(segments.max())) if ref is None else ref), segments


def preference_losses(pc, pr, rc, rr, *, beta: float, kind: str, lengths=None) -> torch.Tensor:
    """Per-pair losses [P] from the policy's (pc, pr) and the reference's (rc, rr) chosen / rejected log-probs;
    lengths (n_c, n_r): the answers' token counts, which IPO divides by."""
    if kind == "sigmoid":
        return -F.logsigmoid(beta * ((pc - pr) - (rc - rr)))
    if kind == "hinge":
        return torch.relu(1 - beta * ((pc - pr) - (rc - rr)))
    if kind == "ipo":
        n_c, n_r = (n.clamp(min=1) for n in lengths)
        return ((pc - rc) / n_c - (pr - rr) / n_r - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {kind!r} (valid: {', '.join(DPO_LOSSES)})")


def rewards(pc, pr, rc, rr, beta: float) -> dict[str, torch.Tensor]:
    """TRL's four metrics of a set of pairs, means over the pairs."""
    chosen, rejected = beta * (pc - rc).detach(), beta * (pr - rr).detach()
    return {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean()}


def _pairs(lp: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor, segments: torch.Tensor | None,
           drop_empty: bool = False, total=whole):
    """The micro-batch's pairs [P] from its token log-probs and mask [B, T]: (pi_c, pi_r, ref_c, ref_r, n_c, n_r).
    One sample a row: row 2j / 2j + 1 is pair j. Packed (segments): rows 2i / 2i + 1 hold the chosen / rejected sides
    of the same pairs in the same segment order (mmpipe.data.packing.RowPlan's unit of 2), so column s of the two
    rows' per-sample sums [B, K] is one pair; a column with no tokens in either row (a row of fewer samples) is none.
    drop_empty: one sample a row too, a pair with a side without answer tokens is none (validation's padding rows).
    total: row_logps'; the sums and token counts are the whole row's after it.
    """
    if segments is None:
        seq, n, ref = lp.sum(-1, keepdim=True), mask.sum(-1, keepdim=True), ref[:, None]
    else:
        seq, n = segment_sums(lp, segments, ref.shape[1]), segment_sums(mask.to(lp.dtype), segments, ref.shape[1])
    seq, n = total(seq), total(n)
    keep = ((n[0::2] > 0) & (n[1::2] > 0) if segments is not None or drop_empty
            else torch.ones_like(n[0::2], dtype=torch.bool))
    n = n.to(seq.dtype)
    ref = ref.to(seq)
    return seq[0::2][keep], seq[1::2][keep], ref[0::2][keep], ref[1::2][keep], n[0::2][keep], n[1::2][keep]


class DPOLoss:
    """The last stage's loss_fn under --objective dpo: (logits [B, T, V], (labels [B, T], ref_logps [B])) -> the
    micro-batch's loss; `last` keeps the rewards of the micro-batch it saw last (the engine logs them)."""

    def __init__(self, beta: float = 0.1, kind: str = "sigmoid", rpo_alpha: float = 0.0):
        self.beta, self.kind, self.rpo_alpha = beta, kind, rpo_alpha
        self.last: dict[str, torch.Tensor] | None = None
        self.totals: torch.Tensor | None = None  # validation: the rewards' sums and the pairs counted (eval_sum)

    def __call__(self, logits, labels, ce=full_ce, total=whole) -> torch.Tensor:
        """ce: the per-position cross-entropy (full_ce; under --tp the vocab-parallel one, under --sp the tiled one on
        the rank's slice: objectives.dpo); total: row_logps'."""
        logits, aux = split_aux(logits)
        tokens, ref, *segments = labels
        if ref.dim() != 1 + len(segments):  # (labels, weights): rows that did not pass through a reference pass
            raise ValueError("--objective dpo: the micro-batch's labels carry no reference log-probs (the reference "
                             "pass, mmpipe.runtime.preference, puts them there; this path has none yet)")
        lp, mask = row_token_logps(logits, tokens, ce)
        pc, pr, rc, rr, n_c, n_r = _pairs(lp, mask, ref, segments[0] if segments else None, total=total)
        loss = preference_losses(pc, pr, rc, rr, beta=self.beta, kind=self.kind, lengths=(n_c, n_r)).mean()
        if self.rpo_alpha:  # the chosen answers' mean token NLL, over the micro-batch's chosen tokens
            loss = loss + self.rpo_alpha * (-total(lp[0::2].sum()) / total(mask[0::2].sum()).clamp(min=1))
        self.last = rewards(pc, pr, rc, rr, self.beta)
        return loss if aux is None else loss + aux

    def eval_sum(self, logits, labels, ce=full_ce, total=whole) -> torch.Tensor:
        """Validation (mmpipe.runtime.validation): the SUM of the preference losses of the micro-batch's pairs whose
        two sides both have answer tokens (a validation step's padding rows have none), without the RPO term; their
        rewards' sums and count are added to `totals`, which the validator reads and clears per pass. A --pack run's
        validation rows (one sample a row) come labelled as packed ones (the reference pass's), each row one sample."""
        tokens, ref, *segments = labels
        lp, mask = row_token_logps(split_aux(logits)[0], tokens, ce)
        pc, pr, rc, rr, n_c, n_r = _pairs(lp, mask, ref, segments[0] if segments else None, drop_empty=True,
                                          total=total)
        losses = preference_losses(pc, pr, rc, rr, beta=self.beta, kind=self.kind, lengths=(n_c, n_r))
        chosen, rejected = self.beta * (pc - rc), self.beta * (pr - rr)
        sums = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).to(pc.dtype).sum(),
                            (chosen - rejected).sum(), torch.tensor(float(len(pc)))]).detach().double()
        self.totals = sums if self.totals is None else self.totals + sums
        return losses.sum()

    def eval_metrics(self) -> torch.Tensor:
        """[5]: the validation pass's sums (rewards chosen, rejected, accuracies, margins; pairs counted), zeros where
        this rank saw none (a stage before the last); cleared for the next pass."""
        out, self.totals = (self.totals if self.totals is not None else torch.zeros(5, dtype=torch.float64)), None
        return out

    def metrics(self) -> dict[str, torch.Tensor]:
        """The rewards of the last micro-batch (zeros before any: DeepSpeed asks every stage for the same keys)."""
        return self.last if self.last is not None else {k: torch.zeros(()) for k in REWARDS}
