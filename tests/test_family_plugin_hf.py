"""A family with an HF reader is one module too (issue 52): tests/vipllava_family.py, ViP-LLaVA from outside the
package (transformers' VipLlavaForConditionalGeneration, a model_type mmpipe itself does not read), registered by
importing it. `mmpipe import --hf` of a tiny random VipLlava gives transformers' logits, its projector reading the
tower's states in the config's order; a 2-stage pipeline from the imported run, on a LLaVA .jsonl in its own
tokenizer's words and cut inside the tower (the read states cross beside hidden), equals the single-device
reference, losses and weights; `mmpipe export` of it loads in transformers with the run's logits; its image kind and
its config checks refuse in one line. One launch (~60 s here, the file ~80 s)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from PIL import Image

from conftest import EQUIV_STEPS, ROOT, Run, assert_weights_moved, mmpipe_train, refused
from hf_models import IMAGE_TOKEN, VOCAB
from mmpipe.cli import main
from mmpipe.config import ConfigError, config_from_dict
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference

LOGITS_TOL = 1e-4  # the HF import tests'
TOL = 1e-5  # the pipeline equivalence tests'
TESTS = str(ROOT / "tests")
STATES = [-2, 1, -3]  # of a 4-layer tower's 5 states: 3, 1, 2; not in block order, and block 4 never runs
# layers: 0 VisionEmbed, 1 TowerBlock, 2 FeatureTap, 3 TowerBlock, 4 FeatureTap, 5 TowerBlock, 6 FeatureTap,
# 7 VipProjector, 8 LlavaEmbed, 9-10 LlamaBlock, 11 FinalNorm, 12 head; stages [0-4], [5-12]: states 1 and 2 cross
CUT = "5"
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} w5 "
            "{% else %}{{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def family():
    """The family, registered by importing its module; forgotten after this file, since later tests in the same
    process list the model types mmpipe reads."""
    import vipllava_family
    from mmpipe import registry
    yield vipllava_family
    registry.unregister(vipllava_family.VIPLLAVA)
    sys.modules.pop("vipllava_family", None)


def _tokenizer(path):
    """A word-level tokenizer over w0..w98 (BOS w1, EOS w2, pad w0) and <image> (99, a special token, as a real
    ViP-LLaVA tokenizer has it: the export then writes transformers' processor), saved to path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(IMAGE_TOKEN)}, "<image>": IMAGE_TOKEN},
                                     unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0",
                                   unk_token="w3", additional_special_tokens=["<image>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def _hf_model(seed: int = 0):
    from transformers import CLIPVisionConfig, LlamaConfig, VipLlavaConfig, VipLlavaForConditionalGeneration
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                              image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = VipLlavaForConditionalGeneration(VipLlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, vision_feature_layer=STATES,
        projector_layernorm_eps=1e-4)).eval()
    with torch.no_grad():  # HF's init leaves norms at 1, biases at 0: perturbed, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform
    return model


@pytest.fixture(scope="module")
def imported(family, tmp_path_factory):
    """(transformers' model, its directory, the run `mmpipe import --hf` made of it)."""
    d = tmp_path_factory.mktemp("vipllava")
    hf = _hf_model()
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    return hf, d / "hf", d / "run"


def _model_json(run) -> dict:
    return json.loads((run / "model.json").read_text())


def test_import_gives_transformers_logits(imported, family):
    hf, _, run = imported
    cfg = config_from_dict(_model_json(run), "vip")
    assert cfg.family == "vipllava" and cfg.vision.states == (3, 1, 2) and cfg.vision.projector_ln_eps == 1e-4
    model = load_reference(run / "checkpoints", cfg).eval()
    kinds = [type(layer).__name__ for layer in model]
    assert kinds[:8] == ["VisionEmbed", "TowerBlock", "FeatureTap", "TowerBlock", "FeatureTap", "TowerBlock",
                         "FeatureTap", "VipProjector"], kinds
    g = torch.Generator().manual_seed(1)
    text = torch.randint(3, IMAGE_TOKEN, (2, 6), generator=g)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), text[:, :1], torch.full((2, 16), IMAGE_TOKEN), text[:, 1:]],
                    1)  # BOS, a word, (32 / 8)^2 = 16 placeholders, text
    px = torch.randn(2, 3, 32, 32, generator=g)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=px).logits
        got = model.one_per_row(px, ids)
        assert (got - want).abs().max().item() < LOGITS_TOL
        model[7].order = [0, 1, 2]  # the states in block order instead of the config's: not transformers' model
        assert (model.one_per_row(px, ids) - want).abs().max().item() > 100 * LOGITS_TOL


def test_config_and_image_kind_refuse_in_one_line(imported, family, tmp_path, capsys):
    """A state the tower does not have, and --augment (the kind's own rule: its images carry drawn visual
    prompts), are one line each, exit 2; LLaVA's kind takes --augment."""
    _, _, run = imported
    data = _model_json(run)
    data["vision"]["feature_layers"] = [-2, 5]
    with pytest.raises(ConfigError, match=r"vision.feature_layers: \(-2, 5\): a list of the tower's hidden states, "
                                          r"each in -5 \.\. 4"):
        config_from_dict(data, "bad")
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"image": "0.png", "conversations": [
        {"from": "human", "value": "<image>\nw7"}, {"from": "gpt", "value": "w8"}]}) + "\n")
    lines = refused(["--init-from", str(run), "--data", str(records), "--augment", "--dry-run"], capsys)
    assert len(lines) == 1 and "--augment: the vipllava family's images carry visual prompts" in lines[0], lines
    from mmpipe.data.image_kinds import PLACEHOLDERS
    assert PLACEHOLDERS.augment_refusal(config_from_dict(data | {"family": "llava", "vision": {
        k: v for k, v in data["vision"].items() if k not in ("feature_layers", "projector_ln_eps")}}, "llava")) is None


def _records(d) -> str:
    """12 LLaVA records, a 32 px image and a question / answer in the tokenizer's words each."""
    g = torch.Generator().manual_seed(0)
    (d / "img").mkdir()
    lines = []
    for i in range(12):
        Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()).save(d / "img" / f"{i}.png")
        q, a = (torch.randint(6, IMAGE_TOKEN, (k,), generator=g).tolist() for k in (3, 2))
        lines.append(json.dumps({"image": f"img/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(f"w{t}" for t in q)},
            {"from": "gpt", "value": " ".join(f"w{t}" for t in a)}]}) + "\n")
    (d / "data.jsonl").write_text("".join(lines))
    return str(d / "data.jsonl")


def _weights_differ(a, b) -> dict[str, float]:
    sb = b.state_dict()
    return {k: (v - sb[k]).abs().max().item() for k, v in a.state_dict().items()}


@pytest.fixture(scope="module")
def trained(imported, equivalence_config, tmp_path_factory):
    """The one launch: PP=2 from the imported run, cut inside the tower, and its single-device reference."""
    _, _, run = imported
    d = tmp_path_factory.mktemp("vip_train")
    args = ["--init-from", str(run), "--data", _records(d), "--text-len", "12", "--ds-config",
            str(equivalence_config), "--steps", str(EQUIV_STEPS), "--eval-samples", "0", "--seed", "3"]
    rc = resolve(TrainArgs.from_argv(args + ["--stages", "1"]), world_size=1)
    reference = train_reference(rc, seed=3, steps=EQUIV_STEPS, out_dir=str(d / "ref"))
    env = {"MMPIPE_FAMILIES": "vipllava_family",
           "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    pp2 = Run(d / "pp2", mmpipe_train(["--output-dir", str(d / "pp2"), *args, "--stages", "2", "--partition", CUT],
                                      MMPIPE_WIRE_LOG=str(d / "pp2"), **env)).check()
    return rc.model, reference, pp2


def test_pp2_from_import_equals_reference(imported, trained, equivalence_config):
    cfg, (ref_model, ref_losses), pp2 = trained
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # it trained
    assert pp2.summary["parts"] == [0, 5, 13]
    for step, want in enumerate(ref_losses, start=1):
        assert pp2.losses[step] == pytest.approx(want, abs=TOL), step
    model = load_reference(pp2.out / "checkpoints", cfg)
    diffs = _weights_differ(model, ref_model)
    assert max(diffs.values()) < TOL, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    init = load_reference(imported[2] / "checkpoints", cfg)
    # every tensor moved but the tower's key biases: softmax cancels q.b_k, so their gradient is 0 in exact arithmetic
    # (they move by rounding noise, ~1e-6 here; equal to the reference's all the same, checked above)
    assert_weights_moved({k: v for k, v in model.state_dict().items() if not k.endswith("k_proj.bias")}, init, TOL)
    # stage 0 sends hidden [micro, 17, 32] and the taps of states 1 and 2 [micro, 16, 2 x 32] per micro-batch
    pp2.assert_only_floats_crossed(per_forward=2)
    micro = json.loads(equivalence_config.read_text())["train_micro_batch_size_per_gpu"]
    shapes = {shape for kind, _, shape in pp2.wire(0) if kind == "data"}
    assert shapes == {f"{micro}x17x32", f"{micro}x16x64"}, shapes


def test_export_loads_in_transformers(trained, tmp_path, capsys):
    """`mmpipe export` of the trained run (the family's writer and weight-name map, the run's tokenizer with
    <image>): transformers' AutoProcessor and VipLlavaForConditionalGeneration.from_pretrained of it give the run's
    logits on an image and a prompt, its tower cut after the last read state and the states named from 0."""
    from transformers import AutoProcessor, VipLlavaForConditionalGeneration

    from mmpipe.data.image_kinds import image_kind
    cfg, _, pp2 = trained
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(pp2.out), "--out", str(tmp_path / "hf")]) == 0
    assert "(with the run's tokenizer and processor)" in capsys.readouterr().out
    hf = VipLlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.vision_feature_layer == [3, 1, 2] and hf.config.vision_config.num_hidden_layers == 3
    image = Image.fromarray((torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(2)) * 255).byte().numpy())
    inputs = AutoProcessor.from_pretrained(tmp_path / "hf")(images=image, text="w1 <image> w7 w8", return_tensors="pt")
    ids = inputs["input_ids"]
    assert ids.tolist() == [[1] + [IMAGE_TOKEN] * 16 + [7, 8]]  # (32 / 8)^2 placeholders, the class token dropped
    model = load_reference(pp2.out / "checkpoints", cfg).eval()
    pixels = image_kind(cfg).one_image(cfg)(image)[None]  # the run's own reading of the image
    with torch.no_grad():
        want = hf(**inputs).logits
        assert (model.one_per_row(pixels, ids) - want).abs().max().item() < LOGITS_TOL
