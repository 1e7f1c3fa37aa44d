"""A family is one module (issue 40): tests/toy_family.py, a family defined outside the package (moondream's tower,
which attends within each image, plus one carried feature made by its text embedding and added after the first
decoder block), registered by naming its module in MMPIPE_FAMILIES, trains as a 2-stage pipeline whose losses and
weights equal the single-device reference's, the carried feature crossing the boundary as a second float. Without
the variable the family is unknown: one line, exit 2. One launch (~25 s here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import toy_family
from conftest import EQUIV_STEPS, ROOT, Run, mmpipe_train
from mmpipe.config import ConfigError, config_from_dict, load_preset
from mmpipe.model.builder import ReferenceModel, layer_specs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from test_pipeline_equivalence import _max_weight_diff

TOL = 1e-5
TESTS = str(ROOT / "tests")
# tiny's shapes: 0 PatchEmbed, 1-2 VisionBlock, 3 VisionNorm, 4 Projector, 5 SummaryEmbed, 6 DecoderBlock,
# 7 SummaryAdd, 8 DecoderBlock, 9 LMHead; stages [0-6], [7-9]: summary crosses the boundary beside hidden
CUT = "7"


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> str:
    cfg = json.loads((ROOT / "mmpipe/presets/tiny.json").read_text())
    path = tmp_path_factory.mktemp("toy") / "toy-carry.json"
    path.write_text(json.dumps({**cfg, "family": "toy_carry"}))
    return str(path)


def _args(preset, ds_config, *extra):
    return ["--preset", preset, "--ds-config", str(ds_config), "--steps", str(EQUIV_STEPS), "--eval-samples", "0",
            "--seed", "3", *extra]


def _env() -> dict:
    return {"MMPIPE_FAMILIES": "toy_family", "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get(
        "PYTHONPATH")]))}


def test_toy_family_pp2_equals_reference(preset, equivalence_config, tmp_path):
    cfg = load_preset(preset)
    # its own text section: the gate starts where its model JSON says (default 0.5); moondream's has no such field
    data = json.loads(Path(preset).read_text())
    data["text"]["summary_gate"] = 0.25
    gated = config_from_dict(data, "toy")
    assert isinstance(cfg.text, toy_family.ToyText) and ReferenceModel(gated, seed=3)[7].gate.item() == 0.25
    with pytest.raises(ConfigError, match=r"text: \['summary_gate'\]: not a field of the moondream family's"):
        config_from_dict({**data, "family": "moondream"}, "md")
    assert [s.typename for s in layer_specs(cfg)][5:8] == [toy_family.SummaryEmbed, toy_family.DecoderBlock,
                                                          toy_family.SummaryAdd]
    run = resolve(TrainArgs.from_argv(_args(preset, equivalence_config, "--stages", "1")), world_size=1)
    ref_model, ref_losses = train_reference(run, seed=3, steps=EQUIV_STEPS)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # it trained
    out = tmp_path / "pp2"
    pp2 = Run(out, mmpipe_train(["--output-dir", str(out), *_args(preset, equivalence_config, "--stages", "2",
                                                                   "--partition", CUT)],
                                MMPIPE_WIRE_LOG=str(out), **_env())).check()
    assert pp2.summary["parts"] == [0, 7, 10]
    for step, ref in enumerate(ref_losses, start=1):
        assert pp2.losses[step] == pytest.approx(ref, abs=TOL), step
    trained = load_reference(out / "checkpoints", cfg)
    # the key biases' gradient is rounding noise that Adam scales to ~lr steps (test_pipeline_equivalence's
    # _max_weight_diff): their max diff was 1.1e-5 and 1.4e-5 in two runs on an AMD EPYC, whatever the cut
    assert _max_weight_diff(trained, ref_model, skip_key_bias=True) < TOL
    init = ReferenceModel(cfg, seed=3)
    assert _max_weight_diff(init[1], trained[1]) > 1e-4  # the tower trained, its gradient through both floats
    # hidden and summary forward from stage 0: 2 floats per micro-batch, the summary [micro, 1, D]
    pp2.assert_only_floats_crossed(per_forward=2)
    micro = json.loads(equivalence_config.read_text())["train_micro_batch_size_per_gpu"]
    shapes = {shape for kind, _, shape in pp2.wire(0) if kind == "data"}
    assert f"{micro}x1x{cfg.text.dim}" in shapes and len(shapes) == 2, shapes  # the row's hidden, the summary


def test_unregistered_family_is_one_line(preset):
    """Without MMPIPE_FAMILIES the model JSON names a family mmpipe does not know; a module that does not import is
    named too. Each one line, exit 2, before any rank starts."""
    env = {k: v for k, v in os.environ.items() if k != "MMPIPE_FAMILIES"}
    for extra, want in (({}, "'toy_carry' is not a known family (valid: moondream, llava, qwen2_vl, llava_next, "
                             "qwen3_vl, qwen3_5, internvl, gemma3, gemma4)"),
                        ({"MMPIPE_FAMILIES": "no_such_family_module"},
                         "MMPIPE_FAMILIES: family module 'no_such_family_module' does not import")):
        proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "train", "--preset", preset, "--dry-run"],
                              cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and want in lines[0], lines
