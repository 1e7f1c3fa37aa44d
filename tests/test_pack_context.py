"""--pack's rows fit the model's context in every family (mmpipe.data.dataset.context_slots, row_text_len).

--pack without --max-images takes a row's image slots M from the data (M = round(k x --text-len / t), docs/packing.md);
until 4eb6a82 nothing held that row to text.max_context, so on the built-in set qwen-tiny at --text-len 100 built rows
of 298 positions against its 256, llava-next-tiny 1068 against 512, gemma3-tiny 166 against 128. Now the row gets the
most slots, up to the data's, whose positions (the budget following them) and --text-len fit; a --text-len that leaves
no room for one image, or an explicit --max-images whose slots overflow, is one line at the front door (exit 2).
In-process: resolve() reads the built-in set's token index, no image opened, no launch.
"""
from __future__ import annotations

import pytest

from conftest import refused
from mmpipe.config import list_presets, load_preset
from mmpipe.data.dataset import SLOT_SAMPLES, prepare
from mmpipe.data.image_kinds import image_kind
from mmpipe.data.packing import row_shape
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve

TINY = sorted(p for p in list_presets() if "tiny" in p)  # one per family: moondream, cross-attention, LLaVA, ...


def _argv(preset: str, out, *extra: str) -> list[str]:
    return ["--preset", preset, "--stages", "1", "--pack", "--steps", "1", "--output-dir", str(out), *extra]


def _sizes(run, out) -> list:
    """(Encoded, images) of the first SLOT_SAMPLES stream positions, as packed_image_slots reads them."""
    samples = prepare(run.data, run.model, out, 0, verbose=False)
    return [samples.tokens(pos) for pos in range(SLOT_SAMPLES)]


def _data_slots(sizes: list, text_len: int) -> int:
    """The M the data asks for at --text-len (packed_image_slots' rate, before the context's cut)."""
    return max(1, round(sum(int(n) for _, n in sizes) * text_len / sum(len(e.ids) for e, _ in sizes)))


@pytest.mark.parametrize("preset", TINY)
def test_packed_row_fits_the_context(preset, tmp_path):
    """At --text-len = 3/4 of the context the data's slots overflow it for every family with image positions (e.g.
    qwen-tiny at 192: M = 21, P = 1344, 42 + 336 + 192 = 570 > 256): the row gets the most slots that fit (qwen-tiny
    3, P 192: 6 + 48 + 192 = 246; InternVL keeps more slots at fewer crops, its T fitted to the context), and one
    more would overflow; the cross-attention family's slots take no decoder positions, so it keeps the data's M."""
    assert len(TINY) >= 10, TINY  # every family's tiny preset
    context = load_preset(preset).text.max_context
    run = resolve(TrainArgs.from_argv(_argv(preset, tmp_path, "--text-len", str(context * 3 // 4))), world_size=1)
    d, cfg, kind = run.data, run.model, image_kind(run.model)
    length = row_shape(cfg, d.max_images, d.text_len, d.vision_budget).length
    assert length <= context, (preset, d.max_images, d.vision_budget, length, context)
    sizes = _sizes(run, tmp_path)
    wanted = _data_slots(sizes, d.text_len)
    if kind.blocks(cfg, 1, d.vision_budget).positions(1) == 0:  # cross-attention: the image is not in the row
        assert d.max_images == wanted > 1 and length == d.text_len
        return
    # the data's M (and the budget following it) would have overflowed: cut
    assert d.max_images < wanted or d.vision_budget < kind.follow(cfg, wanted, sizes), (preset, d, wanted)
    m = d.max_images + 1
    budget = d.vision_budget and kind.follow(cfg, m, sizes)
    if hasattr(kind, "context_budget"):  # InternVL fits T, so one more slot overflows only at one crop each
        budget = max(m, kind.context_budget(cfg, budget, m, d.text_len))
    assert row_shape(cfg, m, d.text_len, budget).length > context, (preset, m, budget)


@pytest.mark.parametrize("preset", [p for p in TINY if "xattn" not in p])
def test_no_room_for_one_image_is_one_line(preset, tmp_path, capsys):
    """A --text-len that leaves no room for one image beside it: one line naming --text-len and the room."""
    context = load_preset(preset).text.max_context
    err = refused(_argv(preset, tmp_path, "--text-len", str(context - 1)), capsys)
    assert len(err) == 1 and err[0].startswith(f"mmpipe: error: --text-len: {context - 1} must be between 2 and "), err
    assert f"(text.max_context {context} - " in err[0], err


def test_explicit_max_images_over_the_context_is_one_line(tmp_path, capsys):
    """--max-images M under --pack sizes M slots of the row for the moondream family too: tiny (16 positions an image,
    context 64) at --max-images 3 --text-len 40 is 88 positions, refused (it passed before: one sample's 16 counted);
    at --max-images 4 the slots alone fill the context, so the line names --max-images."""
    err = refused(_argv("tiny", tmp_path, "--max-images", "3", "--text-len", "40"), capsys)
    assert err == ["mmpipe: error: --text-len: 40 must be between 2 and 16 (text.max_context 64 - 48 image "
                   "positions)"], err
    err = refused(_argv("tiny", tmp_path, "--max-images", "4", "--text-len", "40"), capsys)
    assert err == ["mmpipe: error: --max-images: the image positions (64 for 4 slots) leave no room for text in "
                   "text.max_context 64: give a smaller --max-images"], err
    err = refused(_argv("qwen-tiny", tmp_path, "--max-images", "11", "--text-len", "100"), capsys)
    assert err == ["mmpipe: error: --text-len: 100 must be between 2 and 58 (text.max_context 256 - 198 image "
                   "positions)"], err
