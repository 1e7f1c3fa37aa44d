"""Streaming import and export (mmpipe.hf.stream, mmpipe.hf.export, mmpipe.hf.safetensors_io): bf16 sharded
checkpoints of every family (the MoE ones included) go through `mmpipe import` -> `mmpipe export` bit-equal in their
dtype; an import holds one layer's tensors (counted, live bytes; the MoE readers at two shard sizes), an export one
layer file; --init-from opens only the rank's
layer files, each once (a stand-in stage, and two real gloo ranks of DeepSpeed's PipelineModule), and fills fp32
layers with the bf16 files' values; a missing shard or a bad --shard-size is one line."""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from deepspeed.pipe import TiedLayerSpec
from safetensors.torch import load_file, save_file

from mmpipe.cli import main
from mmpipe.config import load_preset
from mmpipe.hf import stream
from mmpipe.hf.moondream import export_moondream
from mmpipe.hf.safetensors_io import INDEX, LazyWeights, open_weights
from mmpipe.model.builder import ReferenceModel, layer_specs
from mmpipe.runtime import trainer

FAMILIES = ("qwen2", "qwen2_5", "qwen3", "qwen3_5", "llava", "llava_next", "qwen3_5_moe", "qwen3_vl_moe")


def _hf_model(family: str):
    """transformers' own tiny model of the family (tests/*_models.py configs), random weights."""
    import transformers

    from hf_models import llava_config
    from llava_next_models import hf_config as next_config
    from qwen3_5_models import qwen3_5_config
    from qwen3_models import qwen3_config
    from qwen_models import qwen_config
    from test_moe import moe_config as qwen3_vl_moe_config  # fused experts ([E, ...] tensors)
    from test_qwen3_5_moe import moe_config as qwen3_5_moe_config  # one module per expert (PerExpert)
    cfg = {"qwen2": lambda: qwen_config("qwen2"), "qwen2_5": lambda: qwen_config("qwen2_5"),
           "qwen3": lambda: qwen3_config(tie=True), "qwen3_5": qwen3_5_config,
           "llava": lambda: llava_config("siglip_llama"), "llava_next": lambda: next_config("next"),
           "qwen3_5_moe": qwen3_5_moe_config, "qwen3_vl_moe": qwen3_vl_moe_config}[family]()
    return getattr(transformers, type(cfg).__name__.replace("Config", "ForConditionalGeneration"))(cfg)


def save_bf16(family: str, out, shard: str = "40KB", seed: int = 0) -> dict[str, torch.Tensor]:
    """The family's tiny model in bf16, saved sharded (save_pretrained's max_shard_size) as a user's download
    would be; every weight but an identity post-LayerNorm perturbed so a mix-up shows. Returns its tensors."""
    torch.manual_seed(seed)
    model = _hf_model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "post_layernorm" not in name:  # LLaVA's export writes the cut tower's as the identity
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=shard)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def read_dir(d) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_equal_in_bf16(family, tmp_path, capsys):
    """import -> export of a sharded bf16 checkpoint gives the source's tensors, bf16, bit for bit: the layer
    files in between are bf16 too (no fp32 copy), and the export is sharded again at --shard-size."""
    source = save_bf16(family, tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2  # really sharded
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    layers = list((tmp_path / "run" / "checkpoints" / "imported").glob("layer_*"))
    assert {t.dtype for f in layers for t in torch.load(f, weights_only=True).values()} == {torch.bfloat16}
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--shard-size", "30KB"]) == 0
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    back = read_dir(tmp_path / "out")
    assert set(index["weight_map"]) == set(back)
    # what is not written back: the tower past the feature layer and SigLIP's pooling head (LLaVA-NeXT, LLaVA),
    # which the import reported unused; a tied lm_head, which save_pretrained drops on both sides
    unused = {k for k in source if k not in back}
    assert all(".layers.2." in k or ".head." in k for k in unused), sorted(unused)[:4]
    assert (family == "llava_next") == any(".layers.2." in k for k in unused)
    for k, t in back.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, source[k]), k


def test_moondream_round_trip_is_bit_equal(tmp_path):
    """--moondream FILE -> --format safetensors: the same tensors in bf16 (one file, streamed)."""
    model = ReferenceModel(load_preset("tiny"), seed=3).to(torch.bfloat16)
    source = export_moondream(model)
    save_file(source, str(tmp_path / "md.safetensors"))
    assert main(["import", "--moondream", str(tmp_path / "md.safetensors"), "--preset", "tiny",
                 "--out", str(tmp_path / "run")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--format", "safetensors",
                 "--out", str(tmp_path / "back.safetensors")]) == 0
    back = load_file(str(tmp_path / "back.safetensors"))
    assert set(back) == set(source)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], source[k]) for k in source)


class LiveBytes:
    """Counts the bytes of tensors a LazyWeights read that are still referenced (a weakref finalizer per tensor)."""

    def __init__(self):
        self.live, self.peak = 0, 0

    def loaded(self, name, t):
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._freed, n)

    def _freed(self, n):
        self.live -= n


def test_import_holds_one_layer_of_live_tensors(tmp_path, monkeypatch):
    """A sharded import never holds more than one layer plus one shard of read tensors: at each layer file
    saved, exactly that layer's bytes are live (nothing of earlier layers), and the peak over the whole import
    (the tied head's check reads the head and the embedding) is at most the largest layer plus the largest
    shard. Reading every shard into one dict, as before, holds the whole checkpoint and fails both."""
    save_bf16("qwen2_5", tmp_path / "hf", shard="20KB")
    shards = [f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors")]
    total = sum(shards)
    counter, at_save = LiveBytes(), []
    opened = open_weights

    def counting(path):
        w = opened(path)
        w.loaded = counter.loaded
        return w

    def save(state, path):
        at_save.append((counter.live, sum(t.numel() * t.element_size() for t in state.values())))
        torch_save(state, path)

    torch_save = torch.save
    monkeypatch.setattr("mmpipe.hf.qwen2_vl.open_weights", counting)
    monkeypatch.setattr(stream.torch, "save", save)
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert len(at_save) > 5 and all(live == layer for live, layer in at_save), at_save
    largest_layer = max(layer for _, layer in at_save)
    assert 0 < counter.peak <= largest_layer + max(shards) < total / 2
    assert counter.live == 0


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_vl_moe"])
def test_moe_import_holds_one_layer_at_either_shard_size(family, tmp_path, monkeypatch):
    """The MoE readers stream as the dense ones do, whatever the checkpoint's shard size: at 20KB and at 80KB shards
    no tensor read for an earlier layer is live when a layer file is saved, the peak is at most the largest layer
    plus the largest shard, and nothing is left live after. Every LazyWeights the import makes counts (Qwen3.5-MoE's
    reader re-wraps the opened one, less mtp.*). Qwen3-VL-MoE's fused [E, ...] tensors are read as they are, so a
    layer's live bytes are exactly the layer's; Qwen3.5-MoE's experts are stored one module each and PerExpert stacks
    each layer's E into one fused tensor, a new tensor that the count does not see, so there they are at most the
    layer's."""
    from mmpipe.hf import safetensors_io
    torch_save, init = torch.save, safetensors_io.LazyWeights.__init__
    for shard in ("20KB", "80KB"):
        save_bf16(family, tmp_path / shard / "hf", shard=shard)
        sizes = [f.stat().st_size for f in (tmp_path / shard / "hf").glob("*.safetensors")]
        counter, at_save = LiveBytes(), []

        def counted(self, files, counter=counter):
            init(self, files)
            self.loaded = counter.loaded

        def save(state, path, at_save=at_save, counter=counter):
            at_save.append((counter.live, sum(t.numel() * t.element_size() for t in state.values())))
            torch_save(state, path)
        monkeypatch.setattr(safetensors_io.LazyWeights, "__init__", counted)
        monkeypatch.setattr(stream.torch, "save", save)
        assert main(["import", "--hf", str(tmp_path / shard / "hf"), "--out", str(tmp_path / shard / "run")]) == 0
        exact = family == "qwen3_vl_moe"
        assert len(at_save) > 5 and all(live == layer if exact else live <= layer for live, layer in at_save), (
            shard, at_save)
        assert 0 < counter.peak <= max(layer for _, layer in at_save) + max(sizes) < sum(sizes) / 2, shard
        assert counter.live == 0 and len(sizes) > 2, (shard, sizes)


def test_export_reads_one_layer_file_at_a_time(tmp_path, monkeypatch):
    """Export holds at most one layer's tensors: each layer file's tensors are released before the next is read."""
    save_bf16("qwen2", tmp_path / "hf")
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    counter, sizes = LiveBytes(), []
    load = stream.RunLayers.load

    def counted(self, idx):
        state = load(self, idx)
        sizes.append(sum(t.numel() * t.element_size() for t in state.values()))
        for t in state.values():
            counter.loaded(None, t)
        return state

    monkeypatch.setattr(stream.RunLayers, "load", counted)
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--shard-size", "20KB"]) == 0
    assert len(sizes) > 5 and counter.peak == max(sizes) and counter.live == 0


def _stage(model: ReferenceModel, start: int):
    """What load_run_weights reads of a DeepSpeed PipelineModule holding layers start.. (the last stage): its
    layers, where they start, the tied module it keeps a copy of, the layer specs."""
    specs = layer_specs(model.cfg)
    tied = {s.key: model[i] for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec) and i < start
            and any(isinstance(t, TiedLayerSpec) and t.key == s.key for t in specs[start:])}
    return SimpleNamespace(forward_funcs=list(model)[start:], _local_start=start, tied_modules=tied,
                           _layer_specs=specs, each_part=lambda: iter((0,)))  # one part, as 1F1B's stage


def test_init_from_opens_only_the_ranks_layers_and_casts_bf16(tmp_path, monkeypatch):
    """--init-from on the last stage (decoder blocks and head) opens that stage's layer files and the tied
    embedding's (its copy of the head), nothing else; fp32 layers get the bf16 files' values exactly (what the
    fp32 files of the same source held before: bf16 -> fp32 is exact)."""
    source = save_bf16("qwen2_5", tmp_path / "hf")
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    cfg = json.loads((tmp_path / "run" / "model.json").read_text())
    from mmpipe.config import config_from_dict
    model = ReferenceModel(config_from_dict(cfg, "run"), seed=9)
    specs = layer_specs(model.cfg)
    embed = next(i for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec))
    start = embed + 1  # the stage of the decoder blocks and the head, whose weight is the embedding's
    opened = []
    load = torch.load

    def spy(path, *a, **kw):
        opened.append(int(str(path).split("layer_")[1][:2]))
        return load(path, *a, **kw)

    monkeypatch.setattr(trainer.torch, "load", spy)
    n = trainer.load_run_weights(_stage(model, start), tmp_path / "run" / "checkpoints")
    own = [i for i in range(start, len(model)) if model[i].state_dict()]
    assert sorted(opened) == sorted(own + [embed]) and n == len(own) and embed < start
    from mmpipe.hf.qwen2_vl import canonical, key_map
    source = {canonical(k): t for k, t in source.items()}  # transformers saves the checkpoint's original names
    for mine, hf in key_map(model.cfg).items():
        i = int(mine.split(".")[0])
        if i in own or i == embed:
            got = model.state_dict()[mine]
            assert got.dtype == torch.float32 and torch.equal(got, source[hf].float()), mine


def _init_rank(rank: int, store: str, run_dir: str, parts: list[int], out: str):
    """One of two gloo ranks: the real PipelineModule (VLMPipeline, DeepSpeed's own partition into this rank's
    stage) loads --init-from's weights; saves the layer files it opened, where its stage starts, and its state."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    trainer.setup_torch()  # as every rank entry: one thread, DeepSpeed's shared-memory op not JIT-built
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import deepspeed
    deepspeed.init_distributed()  # DeepSpeed's comm over the group joined above
    from mmpipe.config import config_from_dict
    from mmpipe.runtime.pipeline import VLMPipeline
    cfg = config_from_dict(json.loads((Path(run_dir) / "model.json").read_text()), "run")
    from mmpipe.model.objectives import TOKENS
    run = SimpleNamespace(model=cfg, stages=2, parts=parts, ds_config={}, freeze=(), lora=None, ep=1, tp=1, sp=1, dp=1,
                          objective=TOKENS, experts=None)  # what VLMPipeline reads of a RunConfig
    pipe = VLMPipeline(run, seed=9)
    opened, load = [], torch.load

    def spy(path, *a, **kw):
        opened.append(int(str(path).split("layer_")[1][:2]))
        return load(path, *a, **kw)
    trainer.torch.load = spy  # this process's own module: nothing to undo
    n = trainer.load_run_weights(pipe, Path(run_dir) / "checkpoints")
    torch.save({"opened": opened, "n": n, "start": pipe._local_start, "count": len(pipe.forward_funcs),
                "state": {k: v for k, v in pipe.state_dict().items()}}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_init_from_on_two_pipeline_ranks_each_opens_only_its_own_layer_files(tmp_path):
    """Two real ranks (gloo, DeepSpeed's PipelineModule cut [0, cut) / [cut, n)) start from an imported Qwen2.5-VL:
    rank 0 opens exactly its own layers' files (the tower, the embedding, the first decoder blocks), rank 1 its own
    and the tied embedding's (its copy of the head), no file twice; together they read every file that holds a
    weight, and each rank's weights equal the bf16 files' (fp32 copies, exact)."""
    save_bf16("qwen2_5", tmp_path / "hf")
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    from mmpipe.config import config_from_dict
    cfg = config_from_dict(json.loads((tmp_path / "run" / "model.json").read_text()), "run")
    specs = layer_specs(cfg)
    embed = next(i for i, s in enumerate(specs) if isinstance(s, TiedLayerSpec))
    cut, n = embed + 2, len(specs)  # stage 0: the tower, the embedding and one decoder block
    mp.start_processes(_init_rank, args=(str(tmp_path / "store"), str(tmp_path / "run"), [0, cut, n], str(tmp_path)),
                       nprocs=2, start_method="fork")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    files = {int(f.name[6:8]) for f in (tmp_path / "run" / "checkpoints" / "imported").glob("layer_*")}
    model = ReferenceModel(cfg, seed=9)
    weighted = {i for i in range(n) if model[i].state_dict()}
    assert files == weighted
    assert (got[0]["start"], got[0]["count"], got[1]["start"], got[1]["count"]) == (0, cut, cut, n - cut)
    assert got[0]["opened"] == sorted(i for i in weighted if i < cut) and embed in got[0]["opened"]
    assert got[1]["opened"] == sorted(i for i in weighted if i >= cut) + [embed]
    assert got[0]["n"] + got[1]["n"] == len(weighted)
    for r in (0, 1):
        for key, value in got[r]["state"].items():  # DeepSpeed's "<layer>.<param>", tied ones "tied_modules.<key>."
            layer = embed if key.startswith("tied_modules.") else int(key.split(".")[0])
            name = key.split(".", 2)[2] if key.startswith("tied_modules.") else key.split(".", 1)[1]
            want = torch.load(tmp_path / "run" / "checkpoints" / "imported" / f"layer_{layer:02d}-model_states.pt",
                              weights_only=True)[name]
            assert value.dtype == torch.float32 and torch.equal(value, want.float()), (r, key)


def test_missing_shard_and_bad_shard_size_are_one_line(tmp_path, capsys):
    save_bf16("qwen2", tmp_path / "hf", shard="40KB")
    gone = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    gone.unlink()
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mmpipe: error: {tmp_path / 'hf'}: the index names shard {gone.name}, which is missing"]
    assert not (tmp_path / "run").exists()
    model = ReferenceModel(load_preset("tiny"))
    from mmpipe.hf.commands import save_run
    save_run(model, tmp_path / "md")
    assert main(["export", "--checkpoint", str(tmp_path / "md"), "--format", "safetensors", "--out",
                 str(tmp_path / "x.safetensors"), "--shard-size", "lots"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mmpipe: error: --shard-size: 'lots' is not a size (e.g. 5GB, 500MB, 2GiB)"]


def test_lazy_weights_read_headers_only(tmp_path):
    """Opening a sharded directory reads no tensor: shapes and dtypes come from the headers."""
    source = save_bf16("qwen2", tmp_path / "hf")
    w = open_weights(tmp_path / "hf")
    reads = []
    w.loaded = lambda name, t: reads.append(name)
    assert isinstance(w, LazyWeights) and set(w) == set(source) and reads == []
    k = next(iter(source))
    assert w.shape(k) == tuple(source[k].shape) and w.dtype(k) == torch.bfloat16
    assert torch.equal(w[k], source[k]) and reads == [k]


@pytest.mark.parametrize("kind", ["clip_qwen2", "siglip_llama"])  # tied embeddings; an untied head grown too
def test_stage1_start_streams_in_bf16_as_the_model_import(tmp_path, kind):
    """`mmpipe import --vision --lm` (LLaVA's stage-1 start) streams too: bf16 tower and LM give bf16 layer files,
    the fresh projector is the seeded one (fp32, as built), <image> is added and the embedding grown; the run
    loads to import_parts' model, exactly but for the new row, whose mean is rounded to bf16."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, CLIPVisionModel, PreTrainedTokenizerFast, SiglipVisionModel

    from hf_models import llava_config
    from mmpipe.hf.llava import import_parts
    from mmpipe.runtime.checkpoint import load_reference
    c = llava_config(kind)
    torch.manual_seed(4)
    tower = (CLIPVisionModel if kind == "clip_qwen2" else SiglipVisionModel)(c.vision_config)
    tower.to(torch.bfloat16).save_pretrained(tmp_path / "tower")
    AutoModelForCausalLM.from_config(c.text_config).to(torch.bfloat16).save_pretrained(tmp_path / "lm")
    vocab = {f"w{i}": i for i in range(c.text_config.vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w3")), bos_token="w1",
                            eos_token="w2", unk_token="w3").save_pretrained(tmp_path / "lm")
    assert main(["import", "--vision", str(tmp_path / "tower"), "--lm", str(tmp_path / "lm"),
                 "--out", str(tmp_path / "run")]) == 0
    want, _ = import_parts(tmp_path / "tower", tmp_path / "lm", seed=1234)
    from mmpipe.config import config_from_dict
    cfg = config_from_dict(json.loads((tmp_path / "run" / "model.json").read_text()), "run")
    assert (cfg.text.vocab_size, cfg.image_token_id) == (want.cfg.text.vocab_size, want.cfg.image_token_id)
    assert cfg.text.vocab_size > c.text_config.vocab_size  # <image> (and the tokenizer's pad) grew it
    files = {int(f.name[6:8]): torch.load(f, weights_only=True)
             for f in (tmp_path / "run" / "checkpoints" / "imported").glob("layer_*")}
    assert {t.dtype for i, s in files.items() for t in s.values()} == {torch.bfloat16, torch.float32}
    assert {i for i, s in files.items() if any(t.dtype == torch.float32 for t in s.values())} == {3}  # projector
    got = load_reference(tmp_path / "run" / "checkpoints", cfg)
    new_row = c.text_config.vocab_size
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            assert torch.equal(a[:new_row], b[:new_row]) and torch.equal(a[new_row:], b[new_row:].bfloat16().float())
        else:
            assert torch.equal(a, b), name
    assert (tmp_path / "run" / "tokenizer").is_dir()


def test_lora_run_exports_merged_layer_by_layer(tmp_path):
    """A LoRA run's export merges each layer alone (MergedRunLayers): the same tensors, bit for bit, as the whole
    model merged in memory (load_reference(merged=True)), and one layer file read at a time."""
    from hf_models import with_random_adapters
    from mmpipe.hf.commands import save_run
    from mmpipe.model.lora import LORA_FILE
    from mmpipe.runtime.checkpoint import load_reference
    save_bf16("qwen2", tmp_path / "hf")
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")]) == 0
    base = load_reference(tmp_path / "base" / "checkpoints", _cfg(tmp_path / "base"))
    adapted = with_random_adapters(base, groups=("vision", "text"))
    save_run(adapted, tmp_path / "run")
    (tmp_path / "run" / LORA_FILE).write_text(json.dumps(adapted.lora.to_dict()))
    want = load_reference(tmp_path / "run" / "checkpoints", base.cfg, merged=True).state_dict()
    layers = stream.MergedRunLayers(tmp_path / "run" / "checkpoints" / "imported", base.cfg, adapted.lora)
    metas = layers.metas()
    for i in layers.layers:
        got = layers.load(i)
        assert list(got) == list(metas[i]) and all(got[k].dtype == metas[i][k][0] for k in got)
        assert all(torch.equal(t, want[f"{i}.{k}"]) for k, t in got.items()), i
    assert any(not torch.equal(want[k], base.state_dict()[k]) for k in want)  # the adapters changed something
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert set(read_dir(tmp_path / "out")) == set(read_dir(tmp_path / "hf"))


def _cfg(run):
    from mmpipe.config import config_from_dict
    return config_from_dict(json.loads((run / "model.json").read_text()), run.name)
