"""`mmpipe plan --pack --data FILE` predicts the step from the data's own rows, spread over the DP ranks as train's
--balance spreads them (issue 57, mmpipe.planning.data_rows, docs/balance.md). In process, no launch: the busiest
rank's cost by hand on four rows; on long-tailed rows the balanced step lies between the mean row's and stream
order's, and equals the mean row's at DP 1 and on uniform rows; through the CLI on a small LLaVA set, the data's rows
priced (less than the full row plan assumes without data), the printed lines, the refusals."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random

import numpy as np
import pytest

from conftest import ROOT
from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.model.builder import layer_specs
from mmpipe.planning.costmodel import KNOWN_DEVICES, Shape, layer_costs
from mmpipe.planning.data_rows import RowLoad
from mmpipe.planning.layout import Training, plan_layout
from mmpipe.registry import family_of

WORDS = "red green blue yellow cyan magenta circle square triangle left right top bottom".split()


class Rows:
    """Rows priced as RowCosts prices them: per layer (layer_flops) and (tower, decoder) (call). scale[r]: row r's
    (tower, decoder) multiples of the table's layers."""

    def __init__(self, table, tower: np.ndarray, scale: np.ndarray):
        self.flops, self.tower, self.scale = np.array([r.flops for r in table]), tower, scale

    def layer_flops(self, r: int) -> np.ndarray:
        return self.flops * np.where(self.tower, self.scale[r, 0], self.scale[r, 1])

    def __call__(self, r: int) -> tuple[float, float]:
        v = self.layer_flops(r)
        return float(v[self.tower].sum()), float(v[~self.tower].sum())


def _table():
    cfg = load_preset("llava-tiny")
    table = layer_costs(cfg, (), 24, images=2)
    family = family_of(cfg)
    tower = np.array([family.cost_rule(s).takes in ("pixels", "vision") for s in layer_specs(cfg)])
    return table, tower


def _step(load: RowLoad, table, shape: Shape) -> float:
    training = Training("bf16", 1, KNOWN_DEVICES["h100-80gb"], load=load)
    return plan_layout(load.mean_rows(table), shape, training).step["step_s"]


def test_busiest_rank_by_hand():
    """DP 2, micro-batches of 1 row, rows costing 1, 2, 2, 3: stream order's ranks hold 1 + 2 and 2 + 3 (busiest 2.5 a
    row), balanced 3 + 1 and 2 + 2 (2 a row: the mean); rows 1, 1, 1, 5: 3 a row either way (the floor)."""
    table, tower = _table()
    for costs, stream, balanced in (([1, 2, 2, 3], 2.5, 2.0), ([1, 1, 1, 5], 3.0, 3.0)):
        scale = np.array([[c, c] for c in costs], dtype=float)
        load = RowLoad(Rows(table, tower, scale), batch=4, steps=1)
        whole = [0, len(table)]
        per_row = load.stage_mean(whole)[0] / np.mean(costs)  # one unit of cost
        assert load.busiest(whole, 2, 1, balanced=False)[0] == pytest.approx(stream * per_row, rel=1e-12)
        assert load.busiest(whole, 2, 1, balanced=True)[0] == pytest.approx(balanced * per_row, rel=1e-12)


def test_balanced_step_lies_between_the_mean_and_stream_order():
    """64 steps of 32 long-tailed rows (Pareto decoders, 0..4 images' towers): at DP 2 x PP 2 the balanced step is
    above the mean row's and below stream order's; at DP 1 every order's busiest rank is the mean (the step's whole
    set of rows); uniform rows: the balanced step is the mean row's, which is the table's at that row."""
    table, tower = _table()
    rng = np.random.default_rng(0)
    scale = np.stack([0.2 + rng.integers(0, 5, 2048) * rng.lognormal(0, 0.5, 2048), 1 + rng.pareto(1.2, 2048)], 1)
    load = RowLoad(Rows(table, tower, scale), batch=32)
    assert load.steps == 64  # PLAN_ROWS' 2048 rows in whole steps
    shape = Shape(stages=2, dp=2, micro=2, gas=8)
    mean, balanced, stream = (_step(load.with_mode(m), table, shape) for m in ("mean", "balanced", "stream"))
    assert mean < balanced < stream, (mean, balanced, stream)
    one = Shape(stages=2, dp=1, micro=2, gas=16)
    assert _step(load, table, one) == pytest.approx(_step(load.with_mode("mean"), table, one), rel=1e-9)
    uniform = RowLoad(Rows(table, tower, np.full((64, 2), 0.5)), batch=32, steps=2)
    training = Training("bf16", 1, KNOWN_DEVICES["h100-80gb"])
    half = [dataclasses.replace(r, fwd_flops=r.fwd_flops / 2, bwd_flops=r.bwd_flops / 2, w_flops=r.w_flops / 2)
            for r in table]
    assert _step(uniform, table, shape) == pytest.approx(plan_layout(half, shape, training).step["step_s"], rel=1e-9)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """120 LLaVA conversations: 0..2 images, answers of 2..200 words (lognormal, median 12); a preset whose context
    holds 8 images and 256 text positions."""
    root = tmp_path_factory.mktemp("plan_balance")
    rnd = random.Random(0)
    (root / "img").mkdir()
    from PIL import Image
    for i in range(3):
        Image.new("RGB", (40, 40), tuple(rnd.randrange(256) for _ in range(3))).save(root / "img" / f"{i}.png")
    recs = []
    for _ in range(120):
        k, words = rnd.randrange(3), min(200, max(2, round(rnd.lognormvariate(np.log(12), 1.2))))
        rec = {"conversations": [{"from": "human", "value": "what shape is " + " ".join(["<image>"] * k)},
                                 {"from": "gpt", "value": " ".join(rnd.choice(WORDS) for _ in range(words))}]}
        if k:
            rec["image"] = [f"img/{rnd.randrange(3)}.png" for _ in range(k)]
        recs.append(rec)
    (root / "data.json").write_text(json.dumps(recs))
    cfg = json.loads((ROOT / "mmpipe" / "presets" / "llava-tiny.json").read_text())
    cfg["text"]["max_context"] = 8 * 16 + 256  # room for the image slots the data fills (--pack alone)
    (root / "llava.json").write_text(json.dumps(cfg))
    return root


def _plan(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_plan_prices_the_datas_rows(data, tmp_path):
    """--data: each layout's step carries the rows' figures, balanced no worse than stream order; the mean row
    costs less than the full row plan assumes without data, so every predicted step is shorter; the text says which
    rows it assumed (--pack alone: the image slots the data fills, as train derives them); the index is built in
    --data-index's folder, not under --dry-run; --data without --pack is one line, exit 2."""
    base = ["--preset", str(data / "llava.json"), "--pack", "--max-images", "2", "--text-len", "256",
            "--global-batch", "32", "--micro", "1,2", "--gpus-per-node", "4"]
    with_data = [*base, "--data", str(data / "data.json"), "--data-index", str(tmp_path)]
    rc, out, _ = _plan(*with_data, "--json")
    assert rc == 0
    priced = {(lay["stages"], lay["dp"], lay["micro"]): lay for lay in json.loads(out)}
    for lay in priced.values():
        rows = lay["step"]["rows"]
        assert all(b <= s + 1e-9 for b, s in zip(rows["busiest_over_mean"]["balanced"],
                                                 rows["busiest_over_mean"]["stream"]))
        assert 0 < rows["padding_share"] < 1
    assert (tmp_path / "data" / "index.npz").exists()  # built there: the next plan (or train run) reads it
    dry = tmp_path / "dry"
    rc, _, _ = _plan(*[a if a != str(tmp_path) else str(dry) for a in with_data], "--json", "--dry-run")
    assert rc == 0 and not dry.exists()  # a dry run writes nothing of the user's
    rc, out, _ = _plan(*base, "--json")
    uniform = {(lay["stages"], lay["dp"], lay["micro"]): lay for lay in json.loads(out)}
    assert all(priced[k]["step"]["step_s"] < uniform[k]["step"]["step_s"] for k in priced)
    rc, out, _ = _plan(*[a for a in with_data if a not in ("--max-images", "2")])  # slots from the data, as train
    assert rc == 0 and "note: --pack without --max-images: the data fills a row's" in out
    assert "packed rows of" in out and "busiest rank / mean row" in out
    rc, out, _ = _plan(*base)
    assert rc == 0 and "rows: assumed uniform" in out
    rc, _, err = _plan(*[a for a in with_data if a != "--pack"])
    assert rc == 2 and err.strip().splitlines() == [
        "mmpipe: error: --data: only with --pack (a row of one sample costs its full row whatever it holds; packed "
        "rows are priced from the data)"]
