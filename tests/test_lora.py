"""LoRA adapters across pipeline stages (`--lora`): the 2-stage run equals the single-device reference
with the same adapters, the frozen base stays bit-identical, the optimizer holds only what trains,
resume is exact, and the export is what peft and transformers load."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import LlavaForConditionalGeneration

from conftest import assert_weights_moved, cut_at, fixed_schedule_config, refused, train_run, write_checkpoint
from hf_models import batch, save_hf, with_random_adapters
from mmpipe.cli import main as cli
from mmpipe.config import REGION_FILE, load_preset
from mmpipe.hf.llava import import_llava
from mmpipe.inference.generate import load_checkpoint
from mmpipe.model import ReferenceModel
from mmpipe.model.lora import LORA_FILE, Lora, base_name, base_state, is_adapter, load_base, merge_adapters
from mmpipe.planning.costmodel import layer_costs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series

TOL = 1e-5
STEPS = 5  # step 1 runs at lr 0 (WarmupCosineLR): 4 updates, the resume from step 2 three
LORA = ["--lora", "4", "--lora-alpha", "8"]


def _args(cfg, *extra):
    return ["--preset", "tiny", "--ds-config", str(cfg), "--steps", str(STEPS), "--eval-samples", "0", "--seed", "3",
            *LORA, *extra]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    # a schedule fixed at STEPS, so the run stopped at step 2 and resumed follows the same curve
    return fixed_schedule_config(tmp_path_factory.mktemp("cfg") / "lora.json", STEPS)


@pytest.fixture(scope="module")
def reference(config):
    run = resolve(TrainArgs.from_argv(_args(config, "--stages", "1")), world_size=1)
    return train_reference(run, seed=3, steps=STEPS)


FROZEN_PREFIX = ("--stages", "2", "--freeze", "vision,projector", "--lora-targets", "qkv")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, config) -> dict:
    """The 2-rank runs that need no other run's files, one launch (tests/rank_series.py: one run after the other in
    the same ranks, each as `mmpipe train` runs it, its own port, output and exit status): the LoRA PP=2 run (pp2) and
    the frozen-prefix run from a base checkpoint (frozen; its base model and files: base)."""
    root = tmp_path_factory.mktemp("lora")
    base = ReferenceModel(load_preset("tiny"), seed=11)
    write_checkpoint(base, root / "base")
    region = root / "base" / REGION_FILE  # moondream's region head, as `mmpipe import --moondream` leaves it
    region.write_bytes(b"region head bytes, carried unchanged")
    # pp2 checkpointed at step 2 as well: test_resume_equals_uninterrupted resumes a copy cut there (one launch fewer
    # than a separate 2-step run, whose step-2 checkpoint is this one's: the schedule is fixed at STEPS either way)
    runs = [(root / "pp2", _args(config, "--stages", "2", "--save-every", "2"), {}),
            (root / "frozen", _args(config, *FROZEN_PREFIX, "--init-from", str(root / "base")), {})]
    pp2, frozen = launch_series(runs)
    return {"pp2": pp2, "frozen": frozen, "base": (base, root / "base", region)}


@pytest.fixture(scope="module")
def pp2(two_rank_runs):
    return two_rank_runs["pp2"].check()


def _state(model) -> dict:
    return {f"{i}.{k}": v for i, layer in enumerate(model) for k, v in layer.state_dict().items()}


def _text_base(state: dict, model) -> tuple[str, ...]:
    """The names of the text group's base tensors (frozen under --lora; their adapters train)."""
    return tuple(k for k in state if not is_adapter(k) and model[int(k.split(".")[0])].group == "text")


def test_pp2_equals_reference_and_only_adapters_and_unfrozen_train(reference, pp2):
    ref_model, ref_losses = reference
    for step, want in enumerate(ref_losses, start=1):
        assert pp2.losses[step] == pytest.approx(want, abs=TOL), step
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # it trained
    cfg = load_preset("tiny")
    trained, init = _state(load_reference(pp2.out / "checkpoints", cfg)), _state(ReferenceModel(cfg, seed=3))
    ref = _state(ref_model)
    assert trained.keys() == ref.keys()
    adapters = [k for k in trained if is_adapter(k)]
    assert adapters and all((trained[k] - ref[k]).abs().max() < TOL for k in adapters)
    assert any((trained[k] - ref[k]).abs().max() > 0 or trained[k].abs().max() > 0 for k in adapters if "lora_B" in k)
    # every adapter and every vision / projector tensor moved > 10 x TOL from its start (4 updates at lr > 0:
    # step 1 runs at lr 0), so the equalities above compare training, not the initial weights (issue 59)
    start = _state(ReferenceModel(cfg, seed=3, lora=ref_model.lora))
    assert_weights_moved(trained, start, TOL, frozen=_text_base(trained, ref_model))
    # the text group's base is frozen: bit-identical to its initialisation; vision and projector trained
    for k, v in trained.items():
        group = ref_model[int(k.split(".")[0])].group
        if group == "text" and not is_adapter(k):
            assert torch.equal(v, init[base_name(k)]), k
    assert any(not torch.equal(trained[k], init[k]) for k in trained if ref_model[int(k.split(".")[0])].group
               == "vision")
    # the optimizer of each stage holds exactly its adapters plus the unfrozen vision / projector layers
    parts = pp2.summary["parts"]
    want = [sum(p.numel() for layer in list(ref_model)[a:b] for p in layer.parameters() if p.requires_grad)
            for a, b in zip(parts, parts[1:])]
    assert pp2.summary["optimizer_params"] == want
    assert want[1] == sum(v.numel() for k, v in trained.items() if is_adapter(k))  # stage 1: text, adapters only
    assert pp2.summary["lora"]["rank"] == 4 and json.loads((pp2.out / LORA_FILE).read_text())["alpha"] == 8


def test_resume_equals_uninterrupted(tmp_path, config, pp2):
    first = cut_at(pp2, tmp_path / "run", 2)  # the run as if it had stopped after step 2
    resumed = train_run(first, *_args(config, "--stages", "2", "--resume")).check()
    assert resumed.summary["start_step"] == 2
    assert resumed.losses == pp2.losses
    cfg = load_preset("tiny")
    a, b = _state(load_reference(first / "checkpoints", cfg)), _state(load_reference(pp2.out / "checkpoints", cfg))
    assert all(torch.equal(a[k], b[k]) for k in a)
    cut = _state(load_reference(first / "checkpoints", cfg, "step2"))  # the resumed 3 steps trained
    assert_weights_moved(a, cut, TOL, frozen=_text_base(a, ReferenceModel(cfg, seed=3)))


def test_frozen_prefix_stage_and_init_from_base(tmp_path, capsys, config, two_rank_runs):
    """--freeze vision,projector with adapters only on qkv: stage 0's own layers are all frozen; the
    balanced partition gives it the first adapted blocks, so no stage is left without a trainable
    parameter (DeepSpeed's empty-optimizer crash); the base comes from --init-from and stays bit-equal."""
    cfg = load_preset("tiny")
    base, base_dir, region = two_rank_runs["base"]
    extra = (*FROZEN_PREFIX, "--init-from", str(base_dir))
    run = two_rank_runs["frozen"].check()  # _args(config, *extra)
    assert (run.out / REGION_FILE).read_bytes() == region.read_bytes()  # so `mmpipe export` finds it
    parts = run.summary["parts"]
    n_frozen = cfg.vision.n_layers + 4  # patch embedding, blocks, norm, projector, text embedding
    assert parts[1] > n_frozen  # stage 0 also holds an adapted decoder block
    assert all(n > 0 for n in run.summary["optimizer_params"])
    trained = load_reference(run.out / "checkpoints", cfg)
    for i, (mine, theirs) in enumerate(zip(trained, base)):
        got = base_state(mine)
        assert all(torch.equal(got[k], v) for k, v in theirs.state_dict().items()), i
    assert all(not is_adapter(k) or "qkv" in k for k in _state(trained))
    # an explicit cut that leaves stage 0 nothing to train is refused before launch, in one line
    bad = refused(["--output-dir", str(tmp_path / "bad"), *_args(config, *extra, "--partition", str(n_frozen - 1))],
                  capsys)
    assert "would hold no trainable parameter" in "\n".join(bad)
    # and a LoRA run is not a base: --init-from it is refused with what to do instead
    again = refused(["--output-dir", str(tmp_path / "again"),
                     *_args(config, "--stages", "1", "--init-from", str(run.out))], capsys)
    assert "merged" in "\n".join(again)


@pytest.mark.parametrize("flags, says", [
    (["--lora", "-2"], "--lora: rank -2"),
    (["--lora", "4", "--lora-groups", "text,decoder"], "--lora-groups"),
    (["--lora", "4", "--lora-targets", "q_proj("], "is not a regular expression"),
    (["--lora", "4", "--lora-targets", "nothing_named_so"], "matches no linear layer"),
    (["--lora", "4", "--lora-dropout", "1.5"], "--lora-dropout"),
])
def test_bad_lora_flags_one_line(tmp_path, capsys, flags, says):
    lines = refused(["--output-dir", str(tmp_path), "--preset", "tiny", "--steps", "1", "--stages", "1", *flags],
                    capsys)
    errors = [ln for ln in lines if ln.startswith("mmpipe: error:")]
    assert len(errors) == 1 and says in errors[0], lines


@pytest.fixture(scope="module")
def adapted_llava(tmp_path_factory):
    """An imported tiny HF LLaVA (CLIP + Qwen2, tied embeddings) with trained-looking adapters on the
    text and projector groups, saved as a LoRA run's checkpoint."""
    d = tmp_path_factory.mktemp("llava_lora")
    save_hf("clip_qwen2", d / "hf")
    imported, _ = import_llava(d / "hf")
    model = with_random_adapters(imported, groups=("text", "projector"))
    write_checkpoint(model, d / "run")
    (d / "run" / LORA_FILE).write_text(json.dumps(model.lora.to_dict()))
    return d, model


def test_merged_export_equals_adapter_model(adapted_llava):
    d, model = adapted_llava
    px, ids, _ = batch("clip_qwen2", seed=7)
    with torch.no_grad():
        want = model.one_per_row(px, ids)
    assert cli(["export", "--checkpoint", str(d / "run"), "--out", str(d / "merged")]) == 0
    merged = LlavaForConditionalGeneration.from_pretrained(d / "merged").eval()
    loaded, _ = load_checkpoint(d / "run")  # what generate and eval run: merged on the fly
    with torch.no_grad():
        assert (merged(input_ids=ids, pixel_values=px).logits - want).abs().max().item() < TOL
        assert (loaded.one_per_row(px, ids) - want).abs().max().item() < TOL
        assert not any(is_adapter(k) for k in loaded.state_dict())
        bare = ReferenceModel(model.cfg)
        for mine, theirs in zip(bare, model):
            load_base(mine, base_state(theirs))
        assert (bare.one_per_row(px, ids) - want).abs().max().item() > 1e-2  # the adapters change the answer


def test_peft_loads_the_adapter_onto_the_exported_base(adapted_llava):
    d, model = adapted_llava
    assert cli(["export", "--checkpoint", str(d / "run"), "--format", "peft", "--out", str(d / "adapter")]) == 0
    assert (d / "adapter" / "adapter_config.json").is_file() and (d / "adapter" / "adapter_model.safetensors").is_file()
    base = LlavaForConditionalGeneration.from_pretrained(d / "adapter" / "base").eval()
    peft_model = PeftModel.from_pretrained(base, d / "adapter").eval()
    px, ids, _ = batch("clip_qwen2", seed=9)
    with torch.no_grad():
        want = model.one_per_row(px, ids)
        got = peft_model(input_ids=ids, pixel_values=px).logits
        assert (got - want).abs().max().item() < 1e-4
        # the same adapter applied to the original HF model (the import the adapters were trained on)
        orig = PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(d / "hf"), d / "adapter").eval()
        assert (orig(input_ids=ids, pixel_values=px).logits - want).abs().max().item() < 1e-4
    cfg = json.loads((d / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and any("multi_modal_projector" in t for t in cfg["target_modules"])


def test_merge_adapters_keeps_logits():
    cfg = load_preset("tiny")
    model = ReferenceModel(cfg, seed=1, lora=Lora(2, 4.0, groups=("text", "vision")))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.normal_(0, 0.3)
    px = torch.randn(2, 3, cfg.vision.image_size, cfg.vision.image_size)
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        want = model.one_per_row(px, ids)
        got = merge_adapters(model).one_per_row(px, ids)
    assert (got - want).abs().max().item() < TOL
    assert not any(is_adapter(k) for k in model.state_dict())


def test_cost_model_counts_adapters_as_the_only_trainable_state():
    cfg = load_preset("tiny")
    lora = Lora(4, 8.0)
    rows = layer_costs(cfg, ("vision",), 12, lora=lora)
    model = ReferenceModel(cfg, freeze=("vision",), lora=lora)
    assert sum(r.trainable_params for r in rows) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(r.params for r in rows) == sum(p.numel() for p in model.parameters())
    # moondream decoder block at rank r: r (8 D + 2 F) adapter weights (mmpipe.model.lora)
    D, F = cfg.text.dim, cfg.text.ff_dim
    assert [r.adapter_params for r in rows if r.name == "DecoderBlock"][0] == 4 * (8 * D + 2 * F)


def test_plan_lora_makes_a_7b_llava_fit_one_gpu(capsys):
    """A 7B LLaVA full fine-tune fits no layout on one A100-40GB; with adapters the base needs no
    gradients or AdamW moments and it fits (docs/lora.md's table: text 128; at the full 4096 context the
    activations alone no longer fit)."""
    plan = ["plan", "--preset", "llava-1.5-7b", "--device", "a100-40gb", "--gpus-per-node", "1", "--global-batch",
            "64", "--freeze", "vision", "--text-len", "128", "--json"]
    assert cli(plan) == 2
    capsys.readouterr()
    assert cli(plan + ["--lora", "16"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["step"] and max(r["memory_gib"] for r in best["stage_rows"]) < 37


@pytest.mark.parametrize("preset", ["llava-tiny", "tiny", "tiny-xattn"])
def test_init_from_a_lora_run_names_real_commands(tmp_path, monkeypatch, preset):
    """The refusal of --init-from a LoRA run says how to make its merged weights a run: commands the
    parser takes, and (moondream family) that work, in order. The cross-attention family has no export
    (no model outside mmpipe holds its layers): export refuses it in one line, and no command is offered."""
    import shlex

    from mmpipe.cli import parser
    from mmpipe.config import ConfigError
    from mmpipe.model.lora import LORA_FILE
    from mmpipe.run_config import init_model
    run = tmp_path / "lora-run"
    write_checkpoint(ReferenceModel(load_preset(preset), seed=2), run)
    (run / LORA_FILE).write_text(json.dumps(Lora(4, 8.0).to_dict()))
    with pytest.raises(ConfigError) as e:
        init_model(str(run), None)
    commands = str(e.value).split("`")[1::2]
    if preset == "tiny-xattn":
        assert commands == [] and "start from the run it started from" in str(e.value)
        assert cli(["export", "--checkpoint", str(run), "--format", "safetensors", "--out", str(tmp_path / "x")]) == 2
        return
    assert len(commands) == 2 and [c.split()[:2] for c in commands] == [["mmpipe", "export"], ["mmpipe", "import"]]
    for c in commands:
        parser().parse_args(shlex.split(c)[1:])  # a flag that does not exist: SystemExit
    if preset == "tiny":  # run them (on the run without its adapters: the same base weights)
        (run / LORA_FILE).unlink()
        monkeypatch.chdir(tmp_path)
        assert all(cli(shlex.split(c)[1:]) == 0 for c in commands)
        assert init_model(str(tmp_path / "RUN"), None).text == load_preset(preset).text


def test_rank_above_the_narrowest_adapted_linear_is_refused(capsys):
    """--lora 100000 on llava-tiny (whose narrowest adapted linear is k_proj, 32 -> 16) is no adapter anyone
    means: one line naming the largest useful rank, before launch; that rank itself runs."""
    assert cli(["train", "--preset", "llava-tiny", "--stages", "1", "--steps", "1", "--lora", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmpipe: error: --lora: rank 100000 is more than") and "--lora 16 or less" in err
    assert len(err.splitlines()) == 1
    assert cli(["plan", "--preset", "llava-tiny", "--lora", "100000"]) == 2  # plan applies train's check
    assert "--lora 16 or less" in capsys.readouterr().err
    run = resolve(TrainArgs.from_argv(["--preset", "llava-tiny", "--stages", "1", "--lora", "16"]), world_size=1)
    assert run.lora.rank == 16
