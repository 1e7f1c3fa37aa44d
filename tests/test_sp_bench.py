"""`mmpipe bench` sweeping `sp` (issue 58 deliver 5; docs/sequence_parallel.md): a sweep's sp axis is mmpipe train's
--sp, and its prediction is `mmpipe plan --sp`'s for the variant's layout. No launch."""
from __future__ import annotations

import json

import pytest

from mmpipe.bench.predict import add_predictions
from mmpipe.bench.run_variant import check, rank_module
from mmpipe.bench.sweep import parse
from mmpipe.cli import main
from mmpipe.config import ConfigError, load_preset
from mmpipe.planning.calibrate import text_len_of

META = {"sweep": "test", "device": "cpu", "peaks": {"fp32": 1.0e11}, "steps": 6, "warmup_steps": 1,
        "machine": {"cpu": "test", "cores": 2}}


def test_an_sp_variant_runs_as_train_sp_and_is_planned_as_plan_sp(tmp_path, capsys):
    """A variant's world is stages x dp x sp, its name says its sp, its ranks run `--sp 2`, and `check` resolves it
    as mmpipe train does (llava-tiny has a sequence-parallel plan); engine 'dp' with sp > 1 is one line. Its
    prediction is `mmpipe plan --sp 2`'s layout, one SP rank's memory on each of the 4 ranks (the model axis:
    rank = (stage x DP + replica) x SP + s), below the SP 1 variant's (each rank keeps half the row's activations)."""
    sweep = parse({"base": {"preset": "llava-tiny", "stages": 2, "micro": 4, "gas": 2}, "grid": {"sp": [1, 2]}})
    one, two = sweep.variants
    assert (one.world, two.world) == (2, 4) and "sp2" in two.name and "sp1" in one.name
    argv = rank_module(two, sweep, tmp_path / "sp2")
    assert argv[argv.index("--sp") + 1] == "2"
    assert check(two, sweep, tmp_path / "sp2") is None
    rows = add_predictions([{"kind": "variant", "repeat": 0, **v.to_dict(), "world": v.world, "status": "ok",
                             "reason": ""} for v in sweep.variants], META)
    text_len = str(text_len_of(load_preset("llava-tiny")))
    assert main(["plan", "--preset", "llava-tiny", "--text-len", text_len, "--json", "--sp", "2", "--device", "cpu",
                 "--peak-tflops", str(META["peaks"]["fp32"] / 1e12), "--efficiency", "0.5", "--gpus-per-node", "4",
                 "--global-batch", "8", "--micro", "4", "--precision", "fp32", "--zero", "0"]) == 0
    lay = next(g for g in json.loads(capsys.readouterr().out) if (g["stages"], g["dp"], g.get("sp")) == (2, 1, 2))
    assert rows[1]["predicted_step_time_s"] == pytest.approx(lay["step"]["step_s"], rel=1e-12)
    per_stage = [s["memory_gib"] * 1024 for s in lay["stage_rows"]]
    assert rows[1]["predicted_peak_mem_mb_per_rank"] == pytest.approx([per_stage[k // 2] for k in range(4)], abs=1e-3)
    assert rows[1]["predicted_peak_mem_mb_max"] < rows[0]["predicted_peak_mem_mb_max"]
    with pytest.raises(ConfigError, match="engine 'dp' has no sequence parallelism; sp > 1 needs engine 'pipe'"):
        parse({"variants": [{"name": "dp_sp", "engine": "dp", "dp": 2, "sp": 2}]})
