"""The decoder's attention paths (mmpipe.model.attention, docs/attention.md) against the dense-mask reference:
FlexAttention's document mask for packed rows (CUDA's path; run here in eager, gradients included), the causal
split by sample for packed rows (CPU's path), SDPA's is_causal for one-sample rows, the moondream prefix keeping
its mask on CPU, one mask (or split) per row for all layers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmpipe.cli import main
from mmpipe.config import ConfigError, load_preset
from mmpipe.model import attention
from mmpipe.model.attention import CAUSAL, Split, attend, document_block_mask, row_attention, row_mask, sample_split
from mmpipe.model.layers import DecoderBlock
from mmpipe.model.llava import LlamaBlock
from mmpipe.model.rows import IMAGE_SLOT
from mmpipe.model.stage import StageTuple

L = 300  # three 128-position blocks: the document mask has whole blocks to skip


def packed_segments(samples: int, rows: int = 2, pad: int = 17, seed: int = 0) -> torch.Tensor:
    """rows of `samples` samples of random lengths, then `pad` padding positions (segment 0)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, L, dtype=torch.long)
    for r in range(rows):
        cuts = torch.randperm(L - pad - 1, generator=g)[:samples - 1].add(1).sort().values.tolist()
        for s, (a, b) in enumerate(zip([0] + cuts, cuts + [L - pad])):
            out[r, a:b] = s + 1
    return out


def qkv(rows: int, heads: int, kv_heads: int, dim: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, h, L, dim, generator=g).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def out_and_grads(mask, q, k, v, upstream):
    """attend's output and the input gradients of sum(out x upstream)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, mask)
    (out * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """torch 2.14's flex_attention refuses inputs that require grad on CPU (its _validate_device) although
    its eager math reference has a backward; lifting that check lets the test compare the gradients of the
    very rule CUDA's compiled kernels run."""
    import torch.nn.attention.flex_attention as flex
    monkeypatch.setattr(flex, "_validate_device", lambda *a: None)


@pytest.mark.parametrize("samples", [1, 2, 8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_flex_document_mask_equals_the_dense_mask_with_gradients(flex_on_cpu, samples, heads, kv_heads):
    segments = packed_segments(samples)
    q, k, v = qkv(2, heads, kv_heads)
    upstream = torch.randn(2, heads, L, 16, generator=torch.Generator().manual_seed(2))
    block = document_block_mask(segments)
    flex, dense = out_and_grads(block, q, k, v, upstream), out_and_grads(row_mask(segments), q, k, v, upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), flex, dense):
        assert (a - b).abs().max() < 1e-5, (name, (a - b).abs().max())
    if samples == 8:  # cross-sample blocks are skipped: fewer blocks than causal attention computes
        assert block.kv_num_blocks.sum() + block.full_kv_num_blocks.sum() < 2 * (1 + 2 + 3)


def test_small_heads_attend_under_the_mask_the_block_mask_encodes():
    """Compiled flex needs head dim >= 16 (llava-tiny has 8): such heads take dense_of(BlockMask), row_mask's."""
    segments = packed_segments(8)
    block = document_block_mask(segments)
    assert torch.equal(attention.dense_of(block), row_mask(segments))
    q, k, v = (t[..., :8] for t in qkv(2, 4, 2))  # no flex call: no CPU backward needed
    upstream = torch.randn(2, 4, L, 8)
    small, dense = out_and_grads(block, q, k, v, upstream), out_and_grads(row_mask(segments), q, k, v, upstream)
    assert all(torch.equal(a, b) for a, b in zip(small, dense))


def test_flex_keeps_the_moondream_prefix_bidirectional(flex_on_cpu):
    segments = packed_segments(2, rows=1)
    prefix = attention.row_positions(segments) == 0  # each sample's BOS (row_attention adds it)
    prefix[0, 1:20] = True  # and sample 1's image block after it
    q, k, v = qkv(1, 2, 2)
    upstream = torch.randn(1, 2, L, 16)
    flex = out_and_grads(document_block_mask(segments, prefix), q, k, v, upstream)
    dense = out_and_grads(row_mask(segments, prefix), q, k, v, upstream)
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(flex, dense))


def test_one_sample_rows_take_the_causal_path_equal_to_the_mask():
    """Rows 1..1 0..0 (padding at the end, different lengths) attend with is_causal: every real position's
    output and every input gradient of a loss over real positions equal the dense mask's."""
    segments = packed_segments(1, pad=0)
    segments[0, 250:], segments[1, 290:] = 0, 0
    assert row_attention(segments) is CAUSAL
    q, k, v = qkv(2, 4, 2)
    upstream = torch.randn(2, 4, L, 16) * (segments > 0)[:, None, :, None]  # labels ignore the padding
    causal, dense = out_and_grads(CAUSAL, q, k, v, upstream), out_and_grads(row_mask(segments), q, k, v, upstream)
    real = (segments > 0)[:, None, :, None]
    assert ((causal[0] - dense[0]) * real).abs().max() < 1e-5
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(causal[1:], dense[1:]))


@pytest.mark.parametrize("samples", [2, 8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_cpu_split_by_sample_equals_the_dense_mask_with_gradients(samples, heads, kv_heads):
    """CPU's packed rows: each sample's own causal SDPA (sample_split, what row_attention gives on CPU), padding
    causal among the row's padding as row_mask has it, equals the dense mask, output and q, k, v gradients,
    within 1e-5 (fp32), on two rows of different cuts."""
    segments = packed_segments(samples)
    split = row_attention(segments)
    assert isinstance(split, Split) and split.causal and len(split.alone) == 0
    q, k, v = qkv(2, heads, kv_heads)
    upstream = torch.randn(2, heads, L, 16, generator=torch.Generator().manual_seed(2))
    fast, dense = out_and_grads(split, q, k, v, upstream), out_and_grads(row_mask(segments), q, k, v, upstream)
    for name, a, b in zip(("out", "dq", "dk", "dv"), fast, dense):
        assert (a - b).abs().max() < 1e-5, (name, (a - b).abs().max())


def test_the_split_groups_samples_by_length_and_keeps_no_mask():
    """Equal lengths share one SDPA (rows of 5, 7, 5 + 3 padding and 11, 9: groups of 3, 5 (two), 7, 9, 11),
    and the backward keeps no L x L tensor, where the dense mask keeps one (as SDPA's float mask: L^2 values)."""
    segments = torch.tensor([[1] * 5 + [2] * 7 + [3] * 5 + [0] * 3, [1] * 11 + [2] * 9])
    split = sample_split(segments)
    assert sorted((g.shape[1], g.shape[0]) for g in split.groups) == [(3, 1), (5, 2), (7, 1), (9, 1), (11, 1)]
    for mask, keeps_square in ((split, False), (row_mask(segments), True)):
        q, k, v = (torch.randn(2, 4, 20, 8, requires_grad=True) for _ in range(3))
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            attend(q, k, v, mask)
        assert any(s[-2:] == (20, 20) for s in shapes) == keeps_square, shapes


def test_which_rows_keep_a_mask():
    """On CPU: one-sample rows causal, packed rows the split by sample, a moondream image prefix (bidirectional
    past its BOS) the dense mask; a prefix of BOS alone is causal, packed or not."""
    one = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert row_attention(one) is CAUSAL
    packed = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 2]])
    assert isinstance(row_attention(packed), Split)
    image = torch.tensor([[False, True, True, False], [False] * 4])  # moondream: image after BOS
    assert isinstance(row_attention(one, image), torch.Tensor)  # bidirectional prefix: its mask stays
    assert isinstance(row_attention(packed, image), torch.Tensor)
    text_only = torch.zeros(2, 4, dtype=torch.bool)
    assert row_attention(one, text_only) is CAUSAL  # text-only: BOS alone is causal
    assert isinstance(row_attention(packed, text_only), Split)


def test_backend_by_device_and_override(monkeypatch):
    cpu, cuda, backend = torch.device("cpu"), torch.device("cuda"), attention.attention_backend
    assert (backend(cpu), backend(cuda)) == ("split", "flex")
    monkeypatch.setenv("MMPIPE_ATTENTION", "dense")  # the reference: a mask for one-sample rows too
    assert backend(cuda) == "dense" and isinstance(row_attention(torch.ones(1, 4).long()), torch.Tensor)
    for value, msg in (("fast", "MMPIPE_ATTENTION=fast: no such attention backend (valid: auto, dense, flex)"),
                       ("flex", "MMPIPE_ATTENTION=flex: FlexAttention needs CUDA")):
        monkeypatch.setenv("MMPIPE_ATTENTION", value)
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            backend(cpu)


def test_train_refuses_an_unknown_backend_before_any_rank(monkeypatch, capsys):
    monkeypatch.setenv("MMPIPE_ATTENTION", "fast")
    assert main(["train", "--preset", "tiny", "--stages", "2", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mmpipe: error: MMPIPE_ATTENTION=fast: no such attention backend (valid: auto, dense, flex)"]


SWEEP = Path(__file__).resolve().parent.parent / "ds_configs/sweeps/default.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_flex_without_cuda_is_refused_at_the_front_door(monkeypatch, capsys, tmp_path):
    """MMPIPE_ATTENTION=flex on a CPU machine: `mmpipe train` / `check` / `bench` (local ranks), `generate` and `eval`
    (this process) refuse it in attention_backend's own line, exit 2, before any rank starts or weight is read (not
    at each rank's first attention: a traceback per rank with the line buried mid-log)."""
    monkeypatch.setenv("MMPIPE_ATTENTION", "flex")
    with pytest.raises(ConfigError) as rule:
        attention.attention_backend(torch.device("cpu"))
    want = [f"mmpipe: error: {rule.value}"]
    assert "FlexAttention needs CUDA" in want[0]
    monkeypatch.setattr("mmpipe.cli._run_launcher", lambda *a: pytest.fail("a rank was launched"))
    (tmp_path / "im.png").write_bytes(b"")  # generate checks the file exists; no pixel is read before the refusal
    for argv in (["train", "--preset", "tiny", "--stages", "2", "--output-dir", str(tmp_path / "run")],
                 ["check", "--preset", "tiny", "--stages", "2", "--output-dir", str(tmp_path / "check")],
                 ["train", "--preset", "tiny", "--stages", "2", "--dry-run"],
                 ["generate", "--checkpoint", str(tmp_path / "none"), "--image", str(tmp_path / "im.png"),
                  "--prompt", "what"],
                 ["eval", "--checkpoint", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"),
                  "--out", str(tmp_path / "answers.jsonl")],
                 ["bench", str(SWEEP), "--output-dir", str(tmp_path / "bench")]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.splitlines() == want, argv


def test_flex_on_cpu_still_has_no_backward_in_torch():
    """Why CPU trains on the dense mask (besides eager flex's cost, docs/attention.md): if torch gains a CPU
    backward this fails, and the choice in attention_backend deserves a new measurement."""
    q, k, v = qkv(1, 2, 2)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        attend(q, k, v, document_block_mask(packed_segments(2, rows=1)))


def _run_blocks(blocks, t: StageTuple, seed: int = 3):
    """The blocks in a row over t (a fresh copy of its hidden): the output and the gradients of the hidden
    and of every parameter, for a loss over the real positions only."""
    hidden = t.hidden.detach().clone().requires_grad_()
    for p in blocks.parameters():
        p.grad = None
    x = t._replace(hidden=hidden).pack()
    for block in blocks:
        x = block(x)
    out = StageTuple.unpack(x).hidden
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * (t.segments > 0)[..., None]
    (out * weight).sum().backward()
    return [out.detach() * (t.segments > 0)[..., None], hidden.grad] + [p.grad for p in blocks.parameters()]


@pytest.mark.parametrize("preset,block", [("llava-tiny", LlamaBlock), ("tiny", DecoderBlock)])
def test_decoder_blocks_equal_the_reference_and_build_one_mask_per_row(monkeypatch, preset, block):
    """A stack of decoder blocks over one-sample rows (causal path) and packed rows (CPU: LLaVA's the split by
    sample, moondream's image prefix the dense mask; built once for all blocks) equals MMPIPE_ATTENTION=dense
    (row_mask every row, the reference), gradients too."""
    cfg = load_preset(preset)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(block(cfg) for _ in range(3))
    built = []
    monkeypatch.setattr(attention, "row_mask", lambda *a: built.append("mask") or row_mask(*a))
    monkeypatch.setattr(attention, "sample_split", lambda *a: built.append("split") or sample_split(*a))
    for segments in (torch.tensor([[1] * 20 + [0] * 4, [1] * 24]), torch.tensor([[1] * 9 + [2] * 11 + [0] * 4] * 2)):
        ids = torch.randint(1, 40, segments.shape)
        ids[:, 1:5] = IMAGE_SLOT if preset == "tiny" else 1  # moondream: an image block after each row's BOS
        t = StageTuple(torch.randn(2, 24, cfg.text.dim), ids, torch.ones(2, 1, dtype=torch.long), segments)
        built.clear()
        fast = _run_blocks(blocks, t)
        want = ["mask"] if preset == "tiny" else [] if segments.max() == 1 else ["split"]
        assert built == want, (preset, built)
        monkeypatch.setenv("MMPIPE_ATTENTION", "dense")
        reference = _run_blocks(blocks, t._replace(segments=segments.clone(), input_ids=ids.clone()))
        monkeypatch.delenv("MMPIPE_ATTENTION")
        assert all((a - b).abs().max() < 1e-5 for a, b in zip(fast, reference))
