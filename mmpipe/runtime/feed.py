"""The run's dataset for one rank: rows (RowSet, the one layout: one sample per row, or several with
--pack; --max-images image slots), with the loss weights of --loss-norm on the last stage.
Training, validation and the single-device reference build theirs here, so they read the same rows."""
from __future__ import annotations

from torch.utils.data import Dataset

from ..data.balance import RowCosts, StepBalance, run_unevenness
from ..data.image_kinds import image_kind
from ..data.packing import LossNorm, RowPlan, RowSet, RowShape, answer_counts, row_shape, sample_size
from ..data.preference import shares_images
from ..run_config import RunConfig


def run_dataset(run: RunConfig, samples, *, first: bool = True, last: bool = True, augment_seed: int | None = None,
                train: bool = True) -> Dataset:
    """first: the rank reads images; last: labels (and, when train, loss weights). train=False
    (validation, the bench peers): unpacked rows, labels alone (validation divides its loss sum by
    the set's tokens; the peers take the per-micro-batch mean). Pairs share their images in every one (training, the
    reference pass and validation alike: the floats a stage sends keep one shape through a run, mmpipe.runtime.wire)."""
    shape = run_shape(run)
    plan = RowPlan(sample_size(samples, shape), shape, pack=run.pack and train, unit=pair_unit(run))
    norm = (LossNorm(run.loss_norm, run.train_batch, run.gas, run.dp, answer_counts(samples, plan))
            if train and last else None)
    return RowSet(samples, plan, blank=image_kind(run.model).blank(run.model), need_images=first,
                  need_labels=last, norm=norm, augment_seed=augment_seed, share_pairs=share_pair_images(run))


def share_pair_images(run: RunConfig) -> bool:
    """Whether a pair's two rows carry its images once, the tower encoding them once for both sides (dpo, a family
    whose images are placed by one layer: mmpipe.data.preference.shares_images; docs/dpo.md). Under --sp too: the
    tower split over the SP ranks deals out the pairs' shared image rows (mmpipe.model.sp_tower)."""
    return pair_unit(run) == 2 and shares_images(run.model)


def step_balance(run: RunConfig, samples, plan: RowPlan, force: bool = False) -> StepBalance | None:
    """The run's row layout by predicted cost (mmpipe.data.balance), None where rows go in stream order: one sample
    per row (no --pack), or --balance off (force: built all the same, for the data report's figures). The same on
    every rank: first and last stage, every DP replica, the reference loop."""
    if not plan.pack or not run.layers or not (run.data.balance or force):
        return None
    return StepBalance(RowCosts(run.model, run_shape(run), run.layers, plan, samples), run.micro, run.gas, run.dp,
                       unit=pair_unit(run))


def pair_unit(run: RunConfig) -> int:
    """Rows kept together: 2 for preference pairs (--objective dpo: a chosen row and its rejected row, packed side by
    side and balanced as one, so a pair never leaves its micro-batch), else 1."""
    return 2 if run.objective.pairs else 1


def step_order(run: RunConfig, samples, plan: RowPlan):
    """StepBatches' order: step_balance's layout, or None (stream order)."""
    balance = step_balance(run, samples, plan)
    return balance.order if balance is not None else None


def decoder_length(run: RunConfig) -> int:
    """Decoder positions per row, pads included: M x N + text_len, e.g. one image slot of 16 + 12 text = 28
    (a dynamic family's adds P / merge^2, RowShape)."""
    return run_shape(run).length


def run_shape(run: RunConfig) -> RowShape:
    """The run's row: --max-images slots, --text-len, and its vision budget (a family of patches' P, tiles' T)."""
    return row_shape(run.model, run.max_images, run.text_len, run.data.vision_budget)


class StepCounts:
    """What a stretch of rows holds: (samples, useful decoder positions), useful meaning a sample's
    own text and image positions, padding not counted. E.g. 16-image-token samples of 20, 35 and 12
    text tokens packed into one 160-position row: 3 samples, 3 x 16 + 67 = 115 useful of 160.
    Read from the token index alone (no image is opened): every rank can count any step."""

    def __init__(self, run: RunConfig, samples, plan: RowPlan | None = None):
        """plan: the training dataset's own (RowSet.plan), so rows are packed once; None builds it."""
        shape = run_shape(run)
        self.size = sample_size(samples, shape)
        self.plan = plan if plan is not None else RowPlan(self.size, shape, pack=run.pack)
        self.balanced = run.data.balance
        self.balance = step_balance(run, samples, self.plan, force=True)
        self.seen: dict[int, dict] = {}  # a step's first row -> its unevenness, counted as the step ran

    def unevenness(self, first_row: int, rows: int) -> dict | None:
        """summary.json's data.balance over rows [first_row, first_row + rows) (mmpipe.data.balance.run_unevenness:
        each step's per-rank and per-micro-batch max / mean predicted cost, in stream order and balanced), with
        `applied` saying which the run trained; None for unpacked rows."""
        if self.balance is None:
            return None
        return {"applied": self.balanced, **run_unevenness(self.balance, first_row, rows, self.seen)}

    def __call__(self, first_row: int, rows: int) -> tuple[int, int]:
        if self.balance is not None and rows == self.balance.batch:  # a step: its unevenness now (~10 ms), not
            self.seen[first_row] = self.balance.unevenness(first_row)  # all of a long run's at its end
        positions = [p for r in range(first_row, first_row + rows) for p in self.plan.row(r)]
        return len(positions), sum(self.size(p)[0] for p in positions)
