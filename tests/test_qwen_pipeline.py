"""The Qwen2-VL family through the pipeline (issue 32): `mmpipe train --preset qwen-tiny --pack` on a LLaVA-format
set of images of mixed sizes and aspect ratios (grids differ within a row and a micro-batch), conversations
with several images, text-only records. PP=2 (vision trained) and PP=4 (--freeze vision) equal the
single-device reference loop (losses, weights; fp32, 1e-5; the decoder's key biases 1e-4), only floats cross
the stage boundaries while every stage takes the grids from its own loader, the frozen tower stays
bit-identical, and a PP=2 run cut at step 2 and resumed is bit-identical to the uninterrupted one.
Three launches in all: the cut run is a copy of the uninterrupted one as its step-2 checkpoint left it."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_weights_moved, cut_at, train_run, write_ds_config
from fixtures_data import mixed_image_records
from mmpipe.config import load_preset
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare
from mmpipe.model import ReferenceModel
from mmpipe.model.builder import layer_specs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.feed import run_dataset
from mmpipe.runtime.reference import train_reference
from test_qwen_data import WORDS, save_tokenizer

TOL = 1e-5
KEY_BIAS_TOL = 1e-4
STEPS, CUT, SEED = 5, 2, 5  # step 1 runs at lr 0: 4 updates, the resume 3 (steps 3 to 5)
# (width, height): grids (t, h, w) 1x4x4, 1x4x6, 1x8x4, 1x6x8, 1x4x10, and 400x300 resized down by the processor
SIZES = [(56, 56), (84, 56), (56, 112), (112, 84), (140, 56), (400, 300)]
ANSWER_WORDS = WORDS[5:] + [f"w{i}" for i in range(40)]  # the tokenizer's plain words


class PackedSet:
    """A LLaVA-format set under root and the runs on it, as the pipeline tests of the families of patches use it:
    images of `sizes` (random pixels), n conversations of 0 (text-only), 1, 2 or 3 images (distinct sizes) with
    answers of 1..10 words, the tokenizer with the vision specials (ids 197 .. 199, the tiny presets'), and a
    DeepSpeed config of 2 rows x 2 micro-batches a step whose warm-up + cosine schedule is fixed at twice the runs'
    steps (so a resumed run's schedule is the uninterrupted one's, and the last step still moves the weights); rows
    of --max-patches 128, --text-len 48, up to 4 images, packed. `parts`: each stage count's explicit cuts."""

    def __init__(self, root, preset: str, sizes, n: int, steps: int, seed: int, parts: dict | None = None):
        self.root, self.steps, self.seed, self.parts = root, steps, seed, parts or {}
        rng = np.random.default_rng(0)
        for k, (w, h) in enumerate(sizes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{k}.png")
        records = mixed_image_records(n, len(sizes), ANSWER_WORDS,
                                      lambda rnd, i: 1 + int(rnd.lognormvariate(0.8, 0.7)) % 10)
        (root / "data.json").write_text(json.dumps(records))
        save_tokenizer(root / "tok")
        ds = write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                             scheduler={"type": "WarmupCosineLR",
                                        "params": {"total_num_steps": 2 * steps, "warmup_num_steps": 1,
                                                   "warmup_type": "linear", "warmup_min_ratio": 0.5}})
        self.args = ["--preset", preset, "--data", str(root / "data.json"), "--tokenizer", str(root / "tok"),
                     "--ds-config", str(ds), "--text-len", "48", "--pack", "--max-images", "4", "--max-patches", "128",
                     "--eval-samples", "0", "--seed", str(seed), "--data-workers", "0"]

    def resolved(self, *extra: str):
        return resolve(TrainArgs.from_argv([*self.args, "--stages", "1", "--output-dir", str(self.root / "ref"),
                                            *extra]), world_size=1)

    def reference(self, *extra: str):
        """The single-device reference loop's (model, losses)."""
        return train_reference(self.resolved(*extra), seed=self.seed, steps=self.steps, out_dir=str(self.root / "ref"))

    def launch(self, name: str, stages: int, *extra: str):
        cuts = ["--partition", ",".join(map(str, self.parts[stages]))] if stages in self.parts else []
        return train_run(self.root / name, *self.args, "--stages", str(stages), "--steps", str(self.steps), *cuts,
                         *extra).check()

    def assert_resume_bit_exact(self, uninterrupted, cut: int, stages: int, *extra: str) -> None:
        """`uninterrupted` (checkpointed every `cut` steps) cut after step `cut` and resumed to the end gives its
        losses and weights bit for bit (same rows, optimizer moments, LR schedule and RNG). The cut run is its
        directory as the step-`cut` checkpoint left it (a run stopped there: `latest` at it, `cut` logged steps, no
        later checkpoint, no summary), so it costs no launch of its own; the resume is a launch."""
        cut_at(uninterrupted, self.root / "cut", cut)
        resumed = self.launch("cut", stages, *extra, "--resume")
        assert resumed.summary["start_step"] == cut
        assert [int(r["step"]) for r in resumed.rows] == list(range(1, self.steps + 1))
        assert resumed.losses == uninterrupted.losses
        cfg = self.resolved().model  # its vocabulary fitted to the tokenizer, as the runs' model.json
        got, want = (torch.nn.Sequential(*load_reference(r.out / "checkpoints", cfg)).state_dict()
                     for r in (resumed, uninterrupted))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        # the resumed steps trained: every trained tensor moved from the cut's weights by more than 10 x 1e-5
        cut_weights = load_reference(resumed.out / "checkpoints", cfg, f"step{cut}")
        assert_weights_moved(got, cut_weights, 1e-5, frozen_prefixes(cut_weights, extra))


@pytest.fixture(scope="module")
def qwen_set(tmp_path_factory):
    return PackedSet(tmp_path_factory.mktemp("qwen_pipe"), "qwen-tiny", SIZES, 36, STEPS, SEED)


@pytest.fixture(scope="module")
def reference(qwen_set):
    return qwen_set.reference()


@pytest.fixture(scope="module")
def reference_frozen(qwen_set):
    return qwen_set.reference("--freeze", "vision")


@pytest.fixture(scope="module")
def pp2(qwen_set):
    """Vision trained; also the uninterrupted run of the resume test, so it checkpoints at the cut too."""
    return qwen_set.launch("pp2", 2, "--save-every", str(CUT))


@pytest.fixture(scope="module")
def pp4_frozen(qwen_set):
    return qwen_set.launch("pp4", 4, "--freeze", "vision")


def test_rows_mix_grids_images_and_text_only(qwen_set):
    """What the runs below train on: packed rows whose image grids differ within a row and within each
    micro-batch, conversations of 2 and 3 images, text-only samples, each image's t h w / 4 placeholders the
    tokenizer's own <|image_pad|>; and a later stage's loader (no images decoded) gives the first stage's grids."""
    run = qwen_set.resolved()
    m, tok = run.model, run.data.tokenizer
    # the placeholders are the tokenizer's own vision tokens, as Qwen's processor makes them; nothing is added
    assert [m.vision_start_id, m.image_token_id, m.vision_end_id] == tok.convert_tokens_to_ids(
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]) and m.text.vocab_size == len(tok) == 200
    images_per_sample, text_only, mixed_rows = set(), 0, 0
    for pixels, ids, has_image, segments, tiling in loaders_agree(run, qwen_set.root, SEED, STEPS):
        assert pixels.shape == (2, 128, 1176) and tiling.shape == (2, 4, 3)
        n_tokens = (tiling.prod(-1) * (has_image > 0)).sum(-1) // 4
        assert torch.equal((ids == m.image_token_id).sum(-1), n_tokens)
        grids = [{tuple(g) for g in row.tolist() if any(g)} for row in tiling]
        assert len(set.union(*grids)) >= 2  # grids differ within the micro-batch
        mixed_rows += sum(len(g) >= 2 for g in grids)  # and within a row
        for counts in sample_image_counts(has_image, segments):
            assert len(counts) >= 2  # packed
            images_per_sample.update(counts)
            text_only += counts.count(0)
    assert {0, 1, 2, 3} <= images_per_sample and text_only >= 2
    assert mixed_rows >= STEPS * run.gas


def loaders_agree(run, root, seed: int, steps: int):
    """The first `steps` x GAS micro-batches of the first stage's loader, each checked against a later stage's
    (no image decoded): the same integer tensors. Yields the first's (pixels, input_ids, has_image, segments,
    tiling)."""
    samples = prepare(run.data, run.model, str(root / "ref"), seed, verbose=False)
    first = rank_batches(run_dataset(run, samples), StepBatches(0, run.micro, run.gas, 0, 1))
    later = rank_batches(run_dataset(run, samples, first=False), StepBatches(0, run.micro, run.gas, 0, 1))
    for _ in range(steps * run.gas):
        (inputs, _), (ints, _) = next(first), next(later)
        assert len(inputs) == 5 and all(torch.equal(a, b) for a, b in zip(inputs[1:], ints, strict=True))
        yield inputs


def sample_image_counts(has_image, segments) -> list[list[int]]:
    """Per row of a micro-batch: each of its samples' image counts (has_image holds each slot's sample)."""
    return [[int((has_image[b] == s).sum()) for s in range(1, int(segments[b].max()) + 1)]
            for b in range(has_image.shape[0])]


def frozen_prefixes(model, flags) -> tuple[str, ...]:
    """The state-dict prefixes of the tower's layers where `flags` hold --freeze vision (their weights stay)."""
    if "--freeze" not in flags:
        return ()
    return tuple(f"{i}." for i, layer in enumerate(model) if getattr(layer, "group", None) == "vision")


def assert_trained_as_reference(run, ref_model, seed: int, tol: float, no_gradient: tuple[str, ...] = ()) -> None:
    """The run's final weights are the reference's within tol (_weights_equal_within) and every trained tensor moved
    from the seed's initial weights by more than 10 x tol (conftest.assert_weights_moved; with AdamW.step a no-op,
    MMPIPE_TEST_BREAK=no_update, the first passes and this fails)."""
    got = torch.nn.Sequential(*load_reference(run.out / "checkpoints", ref_model.cfg))
    _weights_equal_within(got, ref_model, tol)
    frozen = frozen_prefixes(ref_model, ["--freeze"] if run.summary["freeze"] else [])
    assert_weights_moved(got, ReferenceModel(ref_model.cfg, seed=seed), tol, frozen, no_gradient)


def _weights_equal_within(model, reference: ReferenceModel, tol: float, skip: set[str] = frozenset()) -> None:
    """Every tensor within tol, the decoder's key biases within KEY_BIAS_TOL: a key bias shifts a query's scores
    only through the rotary angle between positions, so its gradient is a near-cancelling sum whose fp32
    rounding (~1% of it here) Adam passes on at full step size (3e-6 measured, every other tensor < 2e-7;
    tests/test_pipeline_equivalence.py leaves a rotary-free key bias out altogether)."""
    ref = reference.state_dict()
    for k, v in model.state_dict().items():  # skip: tensors the caller bounds itself
        assert k in skip or (v - ref[k]).abs().max().item() < (KEY_BIAS_TOL if k.endswith("k_proj.bias") else tol), k


@pytest.mark.parametrize("name, ref", [("pp2", "reference"), ("pp4_frozen", "reference_frozen")])
def test_pipeline_equals_single_device(name, ref, request):
    """PP=2 with the tower trained, PP=4 with it frozen: each step's loss and the final weights are the
    reference loop's on the same rows (fp32, 1e-5)."""
    run, (ref_model, ref_losses) = request.getfixturevalue(name), request.getfixturevalue(ref)
    assert sorted(run.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    assert_trained_as_reference(run, ref_model, SEED, TOL)


def test_only_floats_cross_and_later_stages_take_the_grids_from_their_loader(pp2, pp4_frozen):
    """One float message per micro-batch forward, never an integer tensor, while a decoder block sits on every
    stage after the first but PP=4's last: those stages compute their multimodal rotary positions from the
    grids (tiling) their own loader gives (mmpipe.runtime.wire). Without them the runs fail; with zeroed grids
    the first micro-batch's loss moves by ~5e-3, far outside the reference match above."""
    kinds = [s.typename.__name__ for s in layer_specs(load_preset("qwen-tiny"))]
    for run, with_blocks in ((pp2, [1]), (pp4_frozen, [1, 2])):
        run.assert_only_floats_crossed(per_forward=1)
        parts = run.summary["parts"]
        assert len(parts) == run.summary["stages"] + 1 and "QwenVisionBlock" in kinds[parts[0]:parts[1]]
        for stage in with_blocks:
            assert "QwenBlock" in kinds[parts[stage]:parts[stage + 1]], (stage, parts)
    shapes = {shape for r in range(3) for kind, _, shape in pp4_frozen.wire(r) if kind == "data"}
    assert shapes == {"2x88x64"}, shapes  # [B, L, D_text] alone, L = 4 x 2 + 128 / 4 + 48


def test_frozen_tower_is_bit_identical_and_trained_tower_moves(pp2, pp4_frozen, reference_frozen):
    cfg = reference_frozen[0].cfg
    init = ReferenceModel(cfg, seed=SEED)
    frozen = load_reference(pp4_frozen.out / "checkpoints", cfg)
    trained = load_reference(pp2.out / "checkpoints", cfg)
    vision = [i for i, layer in enumerate(init) if getattr(layer, "group", None) == "vision"]
    assert len(vision) == 1 + cfg.vision.n_layers and pp4_frozen.summary["freeze"] == ["vision"]
    for i in vision:
        for k, v in init[i].state_dict().items():
            assert torch.equal(frozen[i].state_dict()[k], v), (i, k)
            assert not torch.equal(trained[i].state_dict()[k], v), (i, k)
    merger = vision[-1] + 1
    assert not torch.equal(frozen[merger].mlp[0].weight, init[merger].mlp[0].weight)  # the rest trained


def test_resume_is_bit_exact(qwen_set, pp2):
    """PP=2 cut after step 2 (its checkpoint) and resumed to step 5: the uninterrupted run's losses and weights,
    bit for bit (PackedSet.assert_resume_bit_exact)."""
    qwen_set.assert_resume_bit_exact(pp2, CUT, 2)
