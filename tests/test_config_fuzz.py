"""Every numeric field of every preset set to 0, to -1 and to a value of the wrong type (issue 52's fuzz): each case
is the preset's JSON with that one field changed, given to `mmpipe plan --preset` in-process (its parser made
once). A case is refused as every bad field is: exit status 2, one line on stderr naming the field, no traceback. A
field is each number of the preset's top level, "vision", "text" and "text.moe" sections, each list of numbers
(mean, std, mrope_section, deepstack_indexes, grid_pinpoints, ...) and the first number in it (vision.std[0],
vision.grid_pinpoints[0][0]).

A value the config documents as a setting (ALLOWED: 0 kv heads is n_heads, -1 the last block's output, ...) is the
one exception: that case is loaded in-process (mmpipe.config.load_preset; the planner's run over each would cost
minutes) and must give a config holding the value, or be refused in one line by a check of a field the value
feeds (attn_head_dim 0 -> head_dim dim / n_heads -> mrope_section's sum). The wrong type ("x") is never allowed.
All failures of a preset are collected and shown together; each preset prints its counts."""
from __future__ import annotations

import functools
import json
import re

import pytest

from mmpipe import cli
from mmpipe.config import PRESET_DIR, ConfigError, list_presets, load_preset

VALUES = (0, -1, "x")

# (field, value): why the config takes it. Fields by their dotted path, list elements with their index.
ALLOWED = {
    ("text.n_kv_heads", 0): "0: as many key/value heads as n_heads (TextConfig.kv_heads)",
    ("text.attn_head_dim", 0): "0: a head width of dim / n_heads (TextConfig.head_dim)",
    ("cross_attn_heads", 0): "0: the decoder's n_heads (ModelConfig)",
    ("vision.feature_layer", -1): "-1: the tower's last block's output (HF's vision_feature_layer)",
    ("vision.max_crops", 0): "0: one crop per image, no multi-crop (CropVision)",
    ("vision.overlap_margin", 0): "local crops that share no patch (the check's 0 <= 2 x margin < grid)",
    ("vision.anyres_max", 0): "0: LLaVA-NeXT's tiling, no pooling (AnyresVision)",
    ("vision.window_size", 0): "0: every block full attention, no windows (PatchVision)",
    ("vision.min_pixels", 0): "0: no lower resize bound (PatchVision)",
    ("vision.max_pixels", 0): "0: no upper resize bound (PatchVision; plan then asks for --max-patches)",
    ("vision.tokens_per_second", 0): "0: Qwen2-VL's temporal index in a clip's rotary (Qwen2Vision)",
    ("text.moe.shared_ff_dim", 0): "0: no shared expert, as Qwen3-VL-MoE (MoeConfig)",
    ("text.moe.aux_coef", 0): "0: no load-balancing loss (MoeConfig; its check: >= 0)",
    ("vision.mean[0]", 0): "the normalisation's shift: any number",
    ("vision.mean[0]", -1): "the normalisation's shift: any number",
    ("vision.fullatt_blocks[0]", 0): "block 0: an index of the tower's blocks",
    ("vision.deepstack_indexes[0]", 0): "block 0: an index of the tower's blocks",
    ("text.full_attention_indexes[0]", 0): "layer 0: an index of the decoder's layers",
    ("image_token_id", 0): "token 0: an id of the vocabulary",
    ("vision_start_id", 0): "token 0: an id of the vocabulary",
    ("vision_end_id", 0): "token 0: an id of the vocabulary",
    ("vision.head_dim", 0): "0: a head width of dim / n_heads (Gemma4Vision.attn_head_dim)",
    ("text.global_head_dim", 0): "0: full layers as wide as sliding ones (Gemma4Text.layer_head_dim)",
    ("text.global_kv_heads", 0): "0: full layers with the sliding ones' kv heads (Gemma4Text.layer_kv_heads)",
    ("text.final_softcap", 0): "0: no logit soft-capping (Gemma4Text; its check: >= 0)",
    ("text.ple_dim", 0): "0: no per-layer inputs, as Gemma 4 31B (Gemma4Text)",
    ("text.kv_shared_layers", 0): "0: no KV sharing, as Gemma 4 31B (Gemma4Text)",
}


def numeric_fields(section: dict, prefix: str = ""):
    """(path, keys) of every number and list of numbers in a model JSON, and of each list's first number: keys walk
    the dict / lists to it."""
    for name, value in section.items():
        path, keys = f"{prefix}{name}", (name,)
        if name.startswith("_"):
            continue
        if isinstance(value, dict):
            yield from ((f"{path}.{p}", keys + k) for p, k in numeric_fields(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield path, keys
        elif isinstance(value, list) and value:
            yield path, keys
            while isinstance(value, list):
                path, keys, value = f"{path}[0]", keys + (0,), value[0]
            yield path, keys


def mutated(data: dict, keys: tuple, value) -> dict:
    out = json.loads(json.dumps(data))
    at = out
    for k in keys[:-1]:
        at = at[k]
    at[keys[-1]] = value
    return out


def held(cfg, path: str):
    """The loaded config's value at a field path: vision.std[0] -> cfg.vision.std[0]."""
    at = cfg
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        at = at[int(part[1:-1])] if part.startswith("[") else getattr(at, part)
    return at


@functools.cache
def parser():
    """mmpipe's argument parser, made once: cli.main makes it per call (~20 ms, most of a case's time)."""
    return cli.parser()


def plan(preset: str) -> int:
    """`mmpipe plan --preset <preset>` as cli.main runs it: its exit status."""
    args = parser().parse_args(["plan", "--preset", preset])
    return args.func(args)


def run_case(tmp_path, capsys, name: str, data: dict, path: str, keys: tuple, value) -> tuple[str, str | None]:
    """('refused' | 'loaded' | 'refused-dependent', None) or (outcome, what went wrong)."""
    case = tmp_path / f"{name}.json"
    case.write_text(json.dumps(mutated(data, keys, value)))
    field = re.sub(r"\[\d+\]", "", path)
    if (path, value) in ALLOWED:
        try:
            cfg = load_preset(str(case))
        except ConfigError as e:
            return "refused-dependent", (None if "\n" not in str(e) else f"refused in {len(str(e).splitlines())} lines")
        except Exception as e:  # noqa: BLE001 - the fuzz reports any crash as the case's failure
            return "crashed", f"{type(e).__name__}: {e}"
        return "loaded", None if held(cfg, path) == value else f"loaded as {held(cfg, path)!r}"
    try:
        status = plan(str(case))
    except SystemExit as e:
        status = e.code
    except Exception as e:  # noqa: BLE001
        return "crashed", f"{type(e).__name__}: {e}"
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    if status != 2 or len(err) != 1 or "Traceback" in err[0] or field not in err[0]:
        return "accepted" if status == 0 else "unclear", f"exit {status}, stderr {err[:3]}"
    return "refused", None


@pytest.mark.parametrize("preset", list_presets())
def test_every_numeric_field_at_0_minus_1_and_wrong_type_is_refused_in_one_line(preset, tmp_path, capsys):
    data = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    counts, failures = {}, []
    for path, keys in numeric_fields(data):
        for value in VALUES:
            outcome, problem = run_case(tmp_path, capsys, preset, data, path, keys, value)
            counts[outcome] = counts.get(outcome, 0) + 1
            if problem:
                failures.append(f"{path} = {value!r}: {outcome}: {problem}")
    capsys.readouterr()
    with capsys.disabled():
        print(f"\n{preset}: {sum(counts.values())} cases, {counts}")
    assert not failures, f"{len(failures)} of {sum(counts.values())} cases:\n" + "\n".join(failures)
