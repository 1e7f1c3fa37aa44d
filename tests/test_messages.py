"""Messages a user acts on say what is true of their run (issue 34 item 13): a hint never suggests a
flag already in effect, a default never produces a refusal of flags the user did not give, a
report never prints an empty value."""
from __future__ import annotations

import pytest

from mmpipe.bench.report import markdown
from mmpipe.cli import main
from mmpipe.data.index import describe


def _err(capsys) -> str:
    return capsys.readouterr().err.strip()


def test_plan_nothing_fits_suggests_only_levers_not_pulled(capsys):
    rc = main(["plan", "--preset", "vlm-7b", "--device", "a100-40gb", "--gpus-per-node", "1", "--zero", "1",
               "--freeze", "vision", "--checkpointing", "--micro", "1"])
    err = _err(capsys)
    assert rc == 2 and "no layout of vlm-7b fits" in err
    hint = err.split("(try ", 1)[1]
    assert "--lora 16" in hint and "more --nodes" in hint
    for pulled in ("--zero 1", "--freeze vision", "--checkpointing", "smaller --micro"):
        assert pulled not in hint


def test_slurm_without_flags_runs_one_pipeline_per_node(tmp_path, capsys):
    """`mmpipe slurm` with no Slurm flags: one node with the run's stages as tasks (was a world of 1,
    refused as 'not a multiple of 2 stages')."""
    rc = main(["slurm", "--preset", "tiny", "--output-dir", str(tmp_path / "run"), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 node(s) x 2 task(s)" in out and "#SBATCH --ntasks-per-node=2" in out
    assert not (tmp_path / "run").exists()  # a dry run writes no script
    # under --tp a pipeline is stages x tp ranks: 2 x 2 = 4 tasks (was 2: a world of 2 refused for 4 ranks a replica)
    rc = main(["slurm", "--preset", "llava-tiny", "--tp", "2", "--output-dir", str(tmp_path / "tp"), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 node(s) x 4 task(s)" in out and "#SBATCH --ntasks-per-node=4" in out
    rc = main(["slurm", "--preset", "qwen-tiny", "--sp", "2", "--output-dir", str(tmp_path / "sp"), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "#SBATCH --ntasks-per-node=4" in out, out  # and under --sp: stages x sp


def test_hostfile_that_is_no_file_of_hosts(tmp_path, capsys):
    assert main(["train", "--hostfile", "/dev/null", "--dry-run"]) == 2
    assert _err(capsys) == "mmpipe: error: --hostfile: /dev/null names no host (lines are 'HOST slots=N')"
    assert main(["train", "--hostfile", str(tmp_path), "--dry-run"]) == 2
    assert "is a directory" in _err(capsys)


def test_bench_table_before_any_peak_is_measured():
    meta = {"sweep": "s.json", "device": "cpu", "peaks": {}, "steps": 5, "warmup_steps": 1}
    head = markdown([], [], meta).splitlines()[0]
    assert "(peak  per rank)" not in head and "peak not measured yet" in head


def test_unknown_tokens_warning_names_the_builtin_only_when_it_is_used():
    stats = {"good": 10, "records": 10, "with_image": 10, "truncated": 0, "bad": 0, "first_bad": [],
             "unknown_token_share": 0.92}
    builtin = "\n".join(describe({**stats, "builtin_tokenizer": True}))
    own = "\n".join(describe({**stats, "builtin_tokenizer": False}))
    assert "92% of text tokens" in builtin and "built-in one knows only the shapes words" in builtin
    assert "92% of text tokens" in own and "built-in" not in own and "trained with" in own


def test_pack_alone_says_what_images_a_record_may_have(tmp_path, capsys):
    """--pack without --max-images, a LLaVA-family preset (<image> markers): the rows get several image slots,
    but the index keeps one image a record (the slots are read from it). The front door's slot line and a 2-image
    record's too_many_images reason name that one limit in the same words, never a `--max-images 1` the user did
    not give; --max-images 2 takes the record."""
    import json

    from mmpipe.data.export import export_shapes
    export_shapes(tmp_path, "pairs-csv", 3)  # images/00000.png .. 00002.png
    ask = [{"from": "human", "value": "<image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"}]
    records = [{"image": f"images/0000{k}.png", "conversations": ask} for k in range(3)]
    records.insert(1, {"image": ["images/00000.png", "images/00001.png"], "conversations": [
        {"from": "human", "value": "<image> and <image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"}]})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # --text-len 24: llava-tiny's context (64) then holds 2 slots of 16 beside the text (at its default, 48, one)
    argv = ["train", "--preset", "llava-tiny", "--data", str(tmp_path / "data.jsonl"), "--pack", "--dry-run",
            "--text-len", "24", "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    (slots,) = [ln for ln in out if ln.startswith("mmpipe: --pack: ")]
    (skipped,) = [ln for ln in out if "too_many_images:" in ln]
    assert int(slots.split()[2]) > 1  # "N image slots per row": the rows could hold the record's 2 images
    limit = slots.split("images a record may have: ", 1)[1]
    assert limit.startswith("1 (--pack alone") and "--max-images N" in limit
    assert skipped == f"mmpipe: data: skipped {tmp_path / 'data.jsonl'}:2: too_many_images: 2 images > {limit}"
    assert main(argv + ["--max-images", "2"]) == 0
    assert "too_many_images" not in capsys.readouterr().out


def test_tied_weight_sync_leaves_no_autograd_warning(tmp_path, monkeypatch):
    """DeepSpeed's PipelineModule broadcasts each tied weight (llava-tiny's, qwen-tiny's embedding = head) from its
    first stage; done in grad mode, torch's autograd fallback for c10d::broadcast_ makes the first backward through
    the weight warn "may lead to silently incorrect behavior" on every rank holding a copy (seen in the llava-tiny
    check and qwen-tiny runs). VLMPipeline makes that copy under no_grad: the weight is copied as before, the
    gradient is the same, and no warning is given. On a one-rank gloo group, in this process."""
    import types
    import warnings

    import deepspeed.comm
    import torch
    import torch.distributed as tdist
    from deepspeed.pipe import PipelineModule

    from mmpipe.runtime.pipeline import VLMPipeline
    if tdist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    sent = []
    monkeypatch.setattr(deepspeed.comm, "broadcast", lambda tensor, src, group=None, async_op=False: (
        sent.append(tensor), tdist.broadcast(tensor, src)))  # DeepSpeed's own call, on torch's group of one

    def sync_then_backward(sync) -> tuple[list[str], torch.Tensor]:
        embed = types.SimpleNamespace(embed_tokens=torch.nn.Embedding(8, 4))
        holder = VLMPipeline.__new__(VLMPipeline)
        torch.nn.Module.__init__(holder)
        holder.tied_comms = {"embed": {"module": embed, "weight_attr": ["embed_tokens.weight"], "ranks": [0],
                                       "group": None}}
        sync(holder)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            embed.embed_tokens(torch.tensor([1, 3])).pow(2).sum().backward()
        weight = embed.embed_tokens.weight
        assert sent[-1] is weight and torch.equal(weight.grad[[1, 3]], 2 * weight.detach()[[1, 3]])
        return [str(w.message) for w in seen if "c10d::broadcast_" in str(w.message)]

    try:
        assert len(sync_then_backward(PipelineModule._synchronize_tied_weights)) == 1  # DeepSpeed's: the warning
        assert sync_then_backward(VLMPipeline._synchronize_tied_weights) == []
    finally:
        tdist.destroy_process_group()
