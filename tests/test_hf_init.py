"""`mmpipe train --init-from RUN`: an imported HF LLaVA (SigLIP + Llama, tiny, random) trained 2 steps
on 2 stages from its weights on a LLaVA .jsonl in its own tokenizer's words; the first loss is HF's
forward loss on the same micro-batch. A disagreeing --preset and the shapes set with the run's own
tokenizer are refused with one line."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from conftest import train_run, write_ds_config
from hf_models import IMAGE_TOKEN, save_hf, word_tokenizer
from mmpipe.cli import main
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare
from mmpipe.data.packing import sample_rowset
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.model.builder import lm_loss
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference

TEMPLATE = ("{{ bos_token }} {% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} w5 "
            "{% else %}{{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}")


def _tokenizer(path):
    return word_tokenizer(path, TEMPLATE)


def test_init_from_imported_llava(tmp_path, capsys):
    hf = save_hf("siglip_llama", tmp_path / "hf")
    _tokenizer(tmp_path / "hf")
    imported = tmp_path / "imported"
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(imported)]) == 0
    g = torch.Generator().manual_seed(0)
    (tmp_path / "img").mkdir()
    records = []
    for i in range(8):
        Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()).save(tmp_path / "img" / f"{i}.png")
        q = torch.randint(6, IMAGE_TOKEN, (3,), generator=g).tolist()
        a = torch.randint(6, IMAGE_TOKEN, (2,), generator=g)
        records.append({"image": f"img/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(f"w{t}" for t in q)},
            {"from": "gpt", "value": " ".join(f"w{t}" for t in a.tolist())}]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = write_ds_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                         scheduler=None, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})
    args = ["--init-from", str(imported), "--data", str(data), "--text-len", "12", "--ds-config", str(ds),
            "--steps", "2", "--eval-samples", "0", "--seed", "5"]
    run = train_run(tmp_path / "run", "--stages", "2", *args).check()

    # the same first micro-batch, through HF's own forward (HF labels: the token at each position)
    rc = resolve(TrainArgs.from_argv(args + ["--stages", "1"]), world_size=1)
    assert rc.model.image_token_id == IMAGE_TOKEN and len(rc.data.tokenizer) == 100
    samples = prepare(rc.data, rc.model, tmp_path / "run", 5, verbose=False)
    inputs, labels = next(rank_batches(sample_rowset(samples, rc.model, 12), StepBatches(0, 2, 1, 0, 1)))
    px, ids, has_image, _ = inputs
    # the 16 placeholders sit at the <image> marker, after the template's "w4": [BOS] w4 <image> x 16 ...
    assert has_image.tolist() == [[1], [1]] and (ids[:, 2:18] == IMAGE_TOKEN).all() and (ids[:, 1] != IMAGE_TOKEN).all()
    hf_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, :-1]], dim=1)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=px.flatten(0, 1), labels=hf_labels).loss.item()
    losses = run.losses
    assert losses[1] == pytest.approx(want, abs=1e-4)
    # it trained from there: after 2 steps the first micro-batch's loss fell (lr 1e-2 on 8 records)
    trained = load_reference(run.out / "checkpoints", rc.model)
    with torch.no_grad():
        assert lm_loss(trained(*inputs), labels).item() < want - 0.05
    # the run keeps the import's tokenizer, so generate / eval / --init-from on it read the same ids
    kept = load_tokenizer(str(run.out / "tokenizer"))
    assert kept.get_vocab() == rc.data.tokenizer.get_vocab() and kept.chat_template == rc.data.tokenizer.chat_template

    capsys.readouterr()
    assert main(["train", *args, "--preset", "llava-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmpipe: error: --preset: llava-tiny is not the model") and len(err.splitlines()) == 1
    assert main(["train", "--init-from", str(imported), "--steps", "1"]) == 2
    assert "the shapes set" in capsys.readouterr().err
