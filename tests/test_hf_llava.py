"""LLaVA family against transformers' LlavaForConditionalGeneration (tiny, random, built here):
import gives HF's logits (SigLIP + Llama; CLIP + Qwen2 with tied embeddings), sharded or not; bad
weights are refused naming the tensor; a 2-stage pipeline's first loss is HF's loss on the same
batch; after training, export -> from_pretrained gives mmpipe's logits; cached generation equals
uncached; the LLaVA-1.5 presets have the real parameter counts."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlavaForConditionalGeneration

from conftest import ROOT
from hf_models import batch, save_hf, shifted
from mmpipe.cluster.ports import free_port
from mmpipe.config import ConfigError, load_preset
from mmpipe.hf.llava import export_hf, import_llava
from mmpipe.inference.generate import generate
from mmpipe.inference.sampling import Sampling
from mmpipe.model import layer_param_counts, lm_loss
from mmpipe.planning.costmodel import layer_costs
from mmpipe.runtime.checkpoint import load_reference

KINDS = ("siglip_llama", "clip_qwen2")
TOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def hf_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, save_hf(request.param, d)


def test_import_gives_hf_logits(hf_dir):
    kind, d, hf = hf_dir
    model, report = import_llava(d)
    assert model.cfg.text.tie_embeddings == (kind == "clip_qwen2")
    assert model.cfg.vision.n_blocks_used == (2 if kind == "clip_qwen2" else 3)
    # the only source tensors left out are the ones LLaVA never runs
    assert all(("post_layernorm" in k or ".head." in k or "layers.2." in k) for k in report.unused), report.unused
    assert report.mapped + len(report.unused) == len(load_file(str(d / "model.safetensors")))
    px, ids, labels = batch(kind)
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=px, labels=labels)
        got = model.one_per_row(px, ids)
    assert got.shape == ref.logits.shape
    assert (got - ref.logits).abs().max().item() < TOL
    assert lm_loss(got, shifted(labels)).item() == pytest.approx(ref.loss.item(), abs=TOL)


def test_sharded_import_equals_single_file(hf_dir, tmp_path):
    kind, d, hf = hf_dir
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, _ = import_llava(d)
    b, _ = import_llava(tmp_path)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_bad_tensors_are_named(hf_dir, tmp_path):
    kind, d, _ = hf_dir
    weights = load_file(str(d / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.0.mlp.down_proj.weight"))
    for problem, edit in (("has shape", lambda w: w.__setitem__(name, w[name][:, :-1].contiguous())),
                          ("matches no weight", lambda w: w.__setitem__("model.extra.weight", torch.zeros(2))),
                          ("no tensor for", lambda w: w.pop(name))):
        bad = tmp_path / problem.replace(" ", "_")
        bad.mkdir()
        (bad / "config.json").write_text((d / "config.json").read_text())
        w = dict(weights)
        edit(w)
        save_file(w, str(bad / "model.safetensors"))
        with pytest.raises(ConfigError, match=problem) as e:
            import_llava(bad)
        assert ("model.extra.weight" if problem == "matches no weight" else "down_proj") in str(e.value)


def test_cached_generation_equals_uncached(hf_dir):
    kind, d, hf = hf_dir
    model, _ = import_llava(d)
    px, ids, _ = batch(kind, B=1)
    prompt = ids[0, :-2].tolist()
    cached = generate(model, px, prompt, Sampling(eos_id=None, max_new_tokens=10))
    assert cached == generate(model, px, prompt, Sampling(eos_id=None, max_new_tokens=10), use_cache=False)
    # and HF's own greedy decoding agrees
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), pixel_values=px, max_new_tokens=10, do_sample=False,
                          min_new_tokens=10)
    assert out[0, len(prompt):].tolist() == cached


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """CLIP + Qwen2 (tied: the embedding on stage 0, the head on stage 1) trained 3 steps on 2 ranks,
    in mmpipe's VLMPipeline (tests/hf_pipeline_step.py)."""
    d = tmp_path_factory.mktemp("tied")
    hf = save_hf("clip_qwen2", d / "hf")
    out = d / "run"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_addr", "127.0.0.1",
                           "--master_port", str(free_port()),
                           str(ROOT / "tests" / "hf_pipeline_step.py"), "--hf", str(d / "hf"), "--kind", "clip_qwen2",
                           "--out", str(out), "--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert (out / "losses.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return hf, d, out


def test_pipeline_first_loss_is_hf_loss(trained):
    hf, d, out = trained
    d = d / "hf"
    losses = json.loads((out / "losses.json").read_text())
    px, ids, labels = batch("clip_qwen2")
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=px, labels=labels).loss.item()
    assert losses[0] == pytest.approx(ref, abs=TOL)
    assert losses[-1] < losses[0] - 1e-3  # and it trained
    # every step equals one-process training with the same recipe (AdamW 1e-2, global-norm clipping at 1)
    model, _ = import_llava(d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, got in enumerate(losses):
        loss = lm_loss(model.one_per_row(px, ids), shifted(labels))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert got == pytest.approx(loss.item(), abs=1e-5), step


def test_round_trip_export_from_pretrained(trained):
    hf, d, out = trained
    cfg = import_llava(d / "hf")[0].cfg
    model = load_reference(out / "checkpoints", cfg)
    export_hf(model, d / "exported")
    back = LlavaForConditionalGeneration.from_pretrained(d / "exported").eval()
    px, ids, _ = batch("clip_qwen2", seed=7)
    with torch.no_grad():
        mine = model.one_per_row(px, ids)
        theirs, before = back(input_ids=ids, pixel_values=px).logits, hf(input_ids=ids, pixel_values=px).logits
    assert (mine - theirs).abs().max().item() < TOL
    assert (mine - before).abs().max().item() > 1e-3  # the exported weights are the trained ones
    again, _ = import_llava(d / "exported")  # and the exported directory imports back to the same model
    assert (again.one_per_row(px, ids) - mine).abs().max().item() < TOL


def test_llava_presets_have_real_shapes():
    # LLaVA-1.5: CLIP ViT-L/14-336 (23 of 24 blocks used), 2-layer projector, Vicuna 7B / 13B
    for name, total in (("llava-1.5-7b", 7.06e9), ("llava-1.5-13b", 13.35e9)):
        cfg = load_preset(name)
        assert cfg.vision.n_features == 576 and cfg.vision.n_blocks_used == 23
        assert sum(layer_param_counts(cfg)) == pytest.approx(total, rel=0.01), name
        rows = layer_costs(cfg, ("vision",), text_len=128)  # what `mmpipe plan` prices
        assert rows[1].tokens == 577 and rows[-2].tokens == 576 + 128 and not rows[0].trainable
    tied = layer_costs(load_preset("llava-tiny"), (), text_len=8)
    assert tied[-1].name == "LMHead" and tied[-1].fwd_flops == 2 * 64 * 32 * (16 + 8)  # V x D per position


def test_stage1_import_from_tower_and_lm_dirs(tmp_path):
    """LLaVA's stage-1 recipe: a CLIP tower dir + a Qwen2 causal-LM dir (with a tokenizer lacking
    <image>) + a fresh projector. The tower gives CLIP's second-to-last hidden state, the decoder the
    LM's logits, the projector is the seeded fresh one, and <image> was added (vocab + 1)."""
    from tokenizers import Tokenizer, models
    from transformers import CLIPVisionModel, PreTrainedTokenizerFast, Qwen2ForCausalLM

    from hf_models import llava_config
    from mmpipe.hf.llava import import_parts
    from mmpipe.model import ReferenceModel
    from mmpipe.model.rows import sample_rows

    c = llava_config("clip_qwen2")
    torch.manual_seed(4)
    tower, lm = CLIPVisionModel(c.vision_config).eval(), Qwen2ForCausalLM(c.text_config).eval()
    tower.save_pretrained(tmp_path / "tower")
    lm.save_pretrained(tmp_path / "lm")
    vocab = {f"w{i}": i for i in range(c.text_config.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w3")),
                                  bos_token="w1", eos_token="w2", unk_token="w3")
    tok.save_pretrained(tmp_path / "lm")
    model, report = import_parts(tmp_path / "tower", tmp_path / "lm", seed=5)
    assert report.unused == [k for k in report.unused if "post_layernorm" in k or "layers.2." in k]
    from mmpipe.data.tokenizer import load_tokenizer
    n = len(load_tokenizer(str(tmp_path / "lm")))  # what AutoTokenizer makes of the LM dir (Qwen2's adds a pad)
    assert n >= 100 and (model.cfg.image_token_id, model.cfg.text.vocab_size) == (n, n + 1)
    px, ids, _ = batch("clip_qwen2")
    with torch.no_grad():
        want = tower(pixel_values=px, output_hidden_states=True).hidden_states[-2]
        x = (px, *sample_rows(model.cfg, ids))
        for layer in list(model)[:3]:
            x = layer(x)
        assert (x[0] - want).abs().max().item() < TOL
        text = ids[:, :2]  # no image: the decoder alone is the causal LM
        mine = model.one_per_row(px, text, torch.zeros(2, dtype=torch.long))[..., :100]
        assert (mine - lm(input_ids=text).logits).abs().max().item() < TOL
    fresh = ReferenceModel(model.cfg, seed=5)
    assert torch.equal(model[3].linear_1.weight, fresh[3].linear_1.weight)  # the projector: seed + its index
