"""Rows balanced by predicted cost (issue 57, docs/balance.md, mmpipe.data.balance).

In process: the assignment evens a long-tailed set (DP ranks and micro-batches, tower and decoder apart), is the
same from a fresh object, keeps each step's set of rows and a unit's rows together, and a resumed stream reads the
same micro-batches; RowCosts is the cost model's own numbers (the table's FLOPs for a row of one full sample, each
sample's attention apart, a dynamic tower's cost of the row's own grids); the single-device loop's token-normalised
losses are the same balanced or not. One launch (DP=2 x PP=1, --pack, balanced by default): its losses equal one
replica accumulating the same rows in stream order (1e-5), each step's rows are the stream's, laid out as
StepBalance lays them, and summary.json's data.balance reports the unevenness before and after."""
from __future__ import annotations

import csv
import json
import random

import numpy as np
import pytest

from conftest import ROOT, train_run, write_ds_config
from mmpipe.config import load_preset
from mmpipe.data.balance import TOWER_INPUTS, RowCosts, StepBalance, assign, ratio
from mmpipe.data.batches import StepBatches, micro_batch_indices
from mmpipe.data.dataset import prepare
from mmpipe.data.packing import row_shape
from mmpipe.model.builder import layer_specs
from mmpipe.model.costs import PatchRow
from mmpipe.planning.costmodel import layer_costs
from mmpipe.registry import family_of
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.feed import run_dataset, step_balance
from mmpipe.runtime.reference import train_reference

TOL = 1e-5
WORDS = "red green blue yellow cyan magenta circle square triangle left right top bottom".split()


def _long_tail(n: int, seed: int = 0) -> np.ndarray:
    """[n, 2] (tower, decoder) costs, both long-tailed and independent: Pareto(1.2) decoders (a few rows 10x the
    median), towers of 0..4 images of lognormal size."""
    rng = np.random.default_rng(seed)
    decoder = 1e6 * (1 + rng.pareto(1.2, n))
    tower = np.array([rng.lognormal(0, 1, k).sum() for k in rng.integers(0, 5, n)]) * 1e6 + 1e5
    return np.stack([tower, decoder], axis=1)


def _floor(costs: np.ndarray, ranks: int, part: int) -> float:
    """No layout's per-rank max/mean of one part is below this: 1, or the rank holding the largest row together
    with the smallest others (every rank takes n / ranks rows)."""
    x = np.sort(costs[:, part])
    return max(1.0, (x[-1] + x[:len(x) // ranks - 1].sum()) / (x.sum() / ranks))


def test_assignment_evens_a_long_tailed_set():
    """30 steps of 64 rows over DP 4 x GAS 4 x micro 4, tower and decoder both long-tailed: each part's per-rank
    max/mean within 5% of the floor no layout goes under, the median step's (the worse part) under 1.1 where
    stream order's is over 1.3; the micro-batches more even too."""
    step = StepBalance(lambda r: (0.0, 0.0), micro=4, gas=4, dp=4)
    before, after, micro_before, micro_after = [], [], [], []
    for seed in range(30):
        costs = _long_tail(64, seed)
        order = step.layout(costs)
        assert sorted(order) == list(range(64))  # a permutation: the same rows
        for part in (0, 1):
            assert ratio(costs, order, step, "rank", part) <= 1.05 * _floor(costs, 4, part), (seed, part)
        before.append(max(ratio(costs, list(range(64)), step, "rank", p) for p in (0, 1)))
        after.append(max(ratio(costs, order, step, "rank", p) for p in (0, 1)))
        micro_before.append(ratio(costs, list(range(64)), step, "micro", None))
        micro_after.append(ratio(costs, order, step, "micro", None))
    assert np.median(before) > 1.3 and np.median(after) < 1.1, (before, after)
    assert np.median(micro_after) < np.median(micro_before), (micro_after, micro_before)


def test_assignment_is_deterministic_and_keeps_units_and_rows():
    """A fresh StepBalance lays out the same rows the same way (every rank and a resumed run derive it); exactly
    cap units a bin; a unit of 2 rows (a preference pair) stays in one micro-batch, adjacent, in its order."""
    costs = _long_tail(48, 7)
    table = {r: tuple(costs[r % 48]) for r in range(96)}
    a = StepBalance(table.__getitem__, micro=4, gas=3, dp=2, unit=2)
    b = StepBalance(table.__getitem__, micro=4, gas=3, dp=2, unit=2)
    assert a.order(24) == b.order(24) and sorted(a.order(24)) == list(range(24, 48))
    slots = a.order(24)
    for m in range(6):
        mb = slots[4 * m:4 * m + 4]
        assert all(mb[k] % 2 == 0 and mb[k + 1] == mb[k] + 1 for k in (0, 2)), mb
    assert [len(g) for g in assign(costs, 6, 8)] == [8] * 6
    with pytest.raises(ValueError, match="does not divide"):
        StepBalance(table.__getitem__, micro=3, gas=1, dp=1, unit=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """80 LLaVA conversations in the built-in tokenizer's words: 0..4 images each, answers of 2..~40 words
    (Pareto: most short, a few long), and a preset whose context holds 4 images and 64 text positions."""
    root = tmp_path_factory.mktemp("balance")
    rnd = random.Random(0)
    (root / "img").mkdir()
    from PIL import Image
    for i in range(6):
        Image.new("RGB", (40, 40), tuple(rnd.randrange(256) for _ in range(3))).save(root / "img" / f"{i}.png")
    recs = []
    for _ in range(80):
        k = rnd.choice([0, 1, 1, 2, 3, 4])
        answer = " ".join(rnd.choice(WORDS) for _ in range(min(40, int(2 * rnd.paretovariate(1.1)))))
        rec = {"conversations": [{"from": "human", "value": "what shape is " + " ".join(["<image>"] * k)},
                                 {"from": "gpt", "value": answer}]}
        if k:
            rec["image"] = [f"img/{rnd.randrange(6)}.png" for _ in range(k)]
        recs.append(rec)
    (root / "data.json").write_text(json.dumps(recs))
    cfg = json.loads((ROOT / "mmpipe" / "presets" / "llava-tiny.json").read_text())
    cfg["text"]["max_context"] = 4 * 16 + 64
    (root / "llava.json").write_text(json.dumps(cfg))
    return root


def _args(root, gas: int, *extra: str) -> list[str]:
    ds = write_ds_config(root / f"ds{gas}.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=gas,
                         scheduler=None)
    return ["--preset", str(root / "llava.json"), "--ds-config", str(ds), "--data", str(root / "data.json"),
            "--text-len", "64", "--max-images", "4", "--pack", "--eval-samples", "0", "--seed", "3", "--steps", "3",
            "--data-workers", "0", "--stages", "1", *extra]


def _run(root, gas: int, world: int, *extra: str):
    out = root / f"out{gas}_{world}{'_'.join(extra)}"
    run = resolve(TrainArgs.from_argv(_args(root, gas, "--output-dir", str(out), *extra)), world_size=world)
    return run, prepare(run.data, run.model, str(out), 3, verbose=False), out


def test_resumed_stream_reads_the_same_micro_batches(data):
    """A run resumed at step 2 (position 2 x B) reads, on every rank, the micro-batches the uninterrupted run read
    from there: the balanced layout depends on the data position alone."""
    run, samples, _ = _run(data, 2, 2)
    plan = run_dataset(run, samples).plan
    order = step_balance(run, samples, plan).order
    fresh = step_balance(run, samples, run_dataset(run, samples).plan).order  # a resumed process's own
    B = run.train_batch
    for d in range(2):
        whole = StepBatches(0, run.micro, run.gas, d, 2, order)
        resumed = StepBatches(2 * B, run.micro, run.gas, d, 2, fresh)
        seen = [mb for mb, _ in zip(whole, range(5 * run.gas))]
        assert [mb for mb, _ in zip(resumed, range(3 * run.gas))] == seen[2 * run.gas:]
    for s in range(5):  # each step: the stream's rows, spread over both ranks
        rows = [r for d in range(2) for mb in micro_batch_indices(s, run.micro, run.gas, d, 2, order=order)
                for r in mb]
        assert sorted(rows) == list(range(s * B, (s + 1) * B))


class _Plan:
    """Row r holds sample r alone (RowCosts reads plan.row and plan.pack)."""
    pack = True

    def row(self, r: int) -> list[int]:
        return [r]


def _tower(cfg, table) -> float:
    """The tower's FLOPs in a layer table (its layers take pixels or vision tokens)."""
    family = family_of(cfg)
    return sum(r.flops for r, spec in zip(table, layer_specs(cfg)) if family.cost_rule(spec).takes in TOWER_INPUTS)


def test_row_costs_are_the_cost_models_numbers(data):
    """A row of one sample filling all L positions costs the planner's table (decoder: every decoder layer's
    FLOPs at L, tower: the tower's); splitting it into samples of a and L - a positions removes exactly the
    cross-sample attention, k x 4 d x 2 a (L - a) per block (forward 4 seq^2 d, k = 3: forward + backward)."""
    run, samples, _ = _run(data, 2, 1)
    shape = row_shape(run.model, run.max_images, run.text_len)
    L, a = shape.length, 40

    class Rows(RowCosts):
        def lengths(self, r):
            return [L, 0] if r == 0 else [a, L - a, 0]
    costs = Rows(run.model, shape, run.layers, _Plan(), samples)
    tower = _tower(run.model, run.layers)
    assert costs(0) == pytest.approx((tower, sum(r.flops for r in run.layers) - tower), rel=1e-12)
    blocks = sum(r.name == "LlamaBlock" for r in run.layers)
    assert costs(0)[1] - costs(1)[1] == pytest.approx(blocks * 3 * 4 * run.model.text.dim * 2 * a * (L - a), rel=1e-9)
    assert costs(1)[0] == costs(0)[0]  # fixed-size images: every row's M slots, the same tower


def test_dynamic_tower_is_priced_on_the_rows_own_images():
    """Qwen2-VL: a row's tower costs what the cost model gives for a PatchRow of its images' grids (attention
    within each image): one 8 x 8 image costs more than four 4 x 4 in the same patch budget. Layer by layer
    (layer_flops, what `mmpipe plan --data` prices each stage with) the tower's and the decoder's add up to the
    same."""
    cfg = load_preset("qwen-tiny")
    shape = row_shape(cfg, 4, 32, 128)
    grids = {0: [(1, 8, 8)], 1: [(1, 4, 4)] * 4}

    class Enc:
        def __init__(self, g):
            self.grids, self.ids = np.array(g), np.zeros(10, dtype=np.int64)

    class Samples:
        def tokens(self, p):
            return Enc(grids[p]), len(grids[p])
    table = layer_costs(cfg, (), 32, images=4, patches=PatchRow(128, ((1, 8, 8),)))
    costs = RowCosts(cfg, shape, table, _Plan(), Samples())
    tower = np.array([family_of(cfg).cost_rule(s).takes in TOWER_INPUTS for s in layer_specs(cfg)])
    for r, g in grids.items():
        own = layer_costs(cfg, (), 32, images=4, patches=PatchRow(128, tuple(g)))
        assert costs(r)[0] == pytest.approx(_tower(cfg, own), rel=1e-12)
        per_layer = costs.layer_flops(r)
        assert (per_layer[tower].sum(), per_layer[~tower].sum()) == pytest.approx(costs(r), rel=1e-12)
    assert costs(0)[0] > costs(1)[0]


def test_reference_losses_are_the_same_balanced_or_not(data):
    """The single-device loop, GAS 4: balanced micro-batches hold other rows than stream order's, the step's set
    is the same, so the token-normalised loss of each step is the same (1e-5)."""
    on, _, out = _run(data, 4, 1)
    off = resolve(TrainArgs.from_argv(_args(data, 4, "--output-dir", str(out), "--balance", "off")), world_size=1)
    _, balanced = train_reference(on, seed=3, steps=3, out_dir=str(out))
    _, plain = train_reference(off, seed=3, steps=3, out_dir=str(out))
    assert balanced == pytest.approx(plain, abs=TOL)
    samples = prepare(on.data, on.model, str(out), 3, verbose=False)
    order = step_balance(on, samples, run_dataset(on, samples).plan).order
    assert any(order(s * on.train_batch) != tuple(range(s * 8, s * 8 + 8)) for s in range(3))  # reordered


def test_dp2_balanced_run_equals_stream_order(data, tmp_path):
    """One launch, DP=2 x PP=1, balanced by default: its losses equal one replica accumulating the same rows in
    stream order (GAS 4, --balance off; 1e-5); each rank trained the rows StepBalance gives it, each step the
    stream's rows; summary.json's data.balance and the printed line report before and after."""
    run = train_run(tmp_path / "dp2", *_args(data, 2, "--dp", "2", "--log-samples")).check()
    off = resolve(TrainArgs.from_argv(_args(data, 4, "--output-dir", str(tmp_path / "ref"), "--balance", "off")),
                  world_size=1)
    _, ref = train_reference(off, seed=3, steps=3, out_dir=str(tmp_path / "ref"))
    assert list(run.losses.values()) == pytest.approx(ref, abs=TOL)
    on, samples, _ = _run(data, 2, 2)
    order = step_balance(on, samples, run_dataset(on, samples).plan).order
    for d in range(2):
        with open(run.out / f"samples_dp{d}.csv") as f:
            trained = list(dict.fromkeys(int(r["position"]) for r in csv.DictReader(f)))
        want = [r for s in range(3) for mb in micro_batch_indices(s, 2, 2, d, 2, order=order) for r in mb]
        assert trained == want
    b = run.summary["data"]["balance"]
    assert b["applied"] and b["steps"] == 3
    assert b["rank"]["after"]["max"] <= b["rank"]["before"]["max"]
    assert "data: rows balanced by predicted cost (--balance on): per-rank predicted cost max/mean" in run.proc.stdout
