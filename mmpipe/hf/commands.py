"""`mmpipe import` and `mmpipe export`: weights between Hugging Face / moondream files and mmpipe runs.

An imported model is written as an mmpipe run directory: model.json + checkpoints/<tag>/layer_XX-
model_states.pt (DeepSpeed's per-layer layout, which is what `mmpipe generate` and
mmpipe.runtime.checkpoint.load_reference read), and tokenizer/ when the weights come with one (an HF
directory's, or moondream's from --tokenizer, saved in moondream's prompt format). Export reads any
run's latest checkpoint, whatever its stage count.

Both stream (mmpipe.hf.stream): import writes one layer at a time in the source's dtype, export reads one layer
file at a time and writes shards as the tensors come (mmpipe.hf.export); neither holds the model, so a 72B
checkpoint imports on a node with far less memory than its 144 GB (docs/import_memory.md).
"""
from __future__ import annotations

import argparse
import json
from itertools import chain
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ConfigError, config_from_dict, fail, load_preset
from ..data.tokenizer import load_tokenizer
from ..flags import print_plan
from ..model.lora import read_lora
from ..registry import families, family_of, hf_families
from ..runtime.checkpoint import latest_tag, load_reference
from ..runtime.reshard import tp_problems
from .adapter import export_adapter
from .bundle import follow_umask, run_tokenizer, write_processor
from .export import planned
from .llava import read_parts
from .moondream import REGION_FILE, export_moondream, load_region, read_moondream, region_in_layout
from .moondream import key_map as moondream_key_map
from .qwen2_vl import model_type
from .safetensors_io import DEFAULT_SHARD_SIZE, parse_size, write_sharded
from .stream import MergedRunLayers, ModelLayers, RunLayers, renamed_tensors


def hf_importer(path: str | Path):
    """(import function, HF config reader, label) for an HF directory, by its config.json's model_type."""
    hf = _hf_family(path).hf
    return hf.fn("importer"), hf.fn("config"), hf.label


def hf_reader(path: str | Path):
    """The reader that decides an HF directory's import without reading its weights (Imported), by model_type."""
    return _hf_family(path).hf.fn("reader")


def hf_model_types() -> list[str]:
    """The config.json model_types mmpipe reads: every registered family's HF side's (mmpipe.registry.HfSide)."""
    return sorted(hf_families())


def _hf_family(path: str | Path):
    """The family whose HF reader takes an HF directory: by its config.json's model_type. A model_type no reader
    takes (a Gemma3) is one line naming the types that are read; a directory whose model_type cannot be read goes to
    the LLaVA importer, which says what it found."""
    kind, readers = model_type(path), hf_families()
    if kind is None:
        return readers["llava"]
    if kind not in readers:
        raise ConfigError(f"{Path(path) / 'config.json'}: model_type '{kind}' is not one mmpipe reads (yet); "
                          f"it reads {', '.join(sorted(readers))}")
    return readers[kind]


def _names(fam, cfg, layout: str = "current") -> dict[str, str]:
    """Every mmpipe weight name -> its name outside: the HF class's, or moondream's in `layout`."""
    return fam.hf.fn("key_map")(cfg) if fam.hf.names == "hf" else moondream_key_map(cfg, layout)


def add_import_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help=f"a transformers model directory (config.json + safetensors) whose model_type a "
                                  f"registered family reads: {', '.join(hf_model_types())} (docs/hf.md)")
    src.add_argument("--vision", help="a CLIP / SigLIP vision-model directory (with --lm: LLaVA stage-1 start)")
    src.add_argument("--moondream", help="a moondream .safetensors file (current or legacy names; needs --preset)")
    p.add_argument("--lm", help="a Llama / Qwen2 / Mistral causal-LM directory (with --vision)")
    p.add_argument("--feature-layer", type=int, default=-2, help="with --vision: the tower block whose output is used")
    p.add_argument("--feature-select", choices=("default", "full"), default="default")
    p.add_argument("--preset", help="with --moondream: the model shape (e.g. moondream-2b)")
    p.add_argument("--tokenizer", help="with --moondream: moondream's tokenizer directory (a local copy of its "
                                       "starmie-v1 tokenizer.json), kept in OUT/tokenizer in moondream's prompt format")
    p.add_argument("--tp", type=int, default=1,
                   help="write each layer the family's tensor-parallel plan splits as one file per TP rank, each read "
                        "from the source as that rank's slice alone (a `--tp N` run's checkpoint layout; "
                        "docs/tensor_parallel.md). Any --tp reads any import's files; this bounds the import's memory "
                        "to one rank's slice of a layer")
    p.add_argument("--out", required=True, help="run directory to write")


def save_run(model, out: Path, tag: str = "imported") -> Path:
    """model.json + a checkpoint in DeepSpeed's per-layer layout (a tied head has no file, as in DeepSpeed)."""
    d = out / "checkpoints" / tag
    d.mkdir(parents=True, exist_ok=True)
    (out / "model.json").write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    for i, layer in enumerate(model):
        if layer.state_dict():
            torch.save(layer.state_dict(), d / f"layer_{i:02d}-model_states.pt")
    (out / "checkpoints" / "latest").write_text(tag)
    return out


def main_import(args: argparse.Namespace) -> int:
    """The weights are decided from the source's headers first (every problem found before anything is
    written), then written one layer at a time in the source's dtype (mmpipe.hf.stream.Imported.save)."""
    tok, report = None, None
    try:
        if args.tokenizer and not args.moondream:
            raise ConfigError("--tokenizer: only with --moondream (an HF directory brings its own tokenizer)")
        if args.vision and not args.lm:
            raise ConfigError("--vision needs --lm (the causal-LM directory)")
        if args.moondream and not args.preset:
            raise ConfigError("--moondream needs --preset (the model shape)")
        if args.tp < 1:
            raise ConfigError(f"--tp: {args.tp} must be >= 1")
        if args.dry_run:
            return _import_plan(args)
        if args.hf:
            got = hf_reader(args.hf)(args.hf)
            report, note = got.report, got.report.summary()
        elif args.vision:
            got = read_parts(args.vision, args.lm, feature_layer=args.feature_layer, feature_select=args.feature_select)
            report, note = got.report, got.report.summary() + "; projector freshly initialised"
        else:
            cfg = load_preset(args.preset)
            tok = _moondream_tokenizer(args, cfg)  # checked before anything is written
            got = read_moondream(cfg, args.moondream)
            note = f"all tensors mapped, region head {'-> ' + REGION_FILE if got.extra else 'absent'}"
            if tok is None:  # generate would fall back to the built-in tokenizer, whose ids mean nothing here
                note += "; no tokenizer (--tokenizer DIR keeps moondream's in the run)"
        for problem in tp_problems(got.cfg, args.tp):  # before anything is written
            raise ConfigError(problem)
        if args.tp > 1:
            note += f"; split layers in {args.tp} TP ranks' files"
    except (ConfigError, FileNotFoundError, OSError) as e:
        return fail(e if isinstance(e, ConfigError) else ConfigError(str(e)))
    out = Path(args.out)
    got.save(out, tp=args.tp)
    for name, tensors in got.extra.items():  # moondream's region head: no pipeline layer holds it; export
        save_file(tensors, str(out / name))  # puts it back (mmpipe.hf.moondream)
    cfg = got.cfg
    if tok is None:  # moondream's was loaded and checked above
        tok = _tokenizer_of(args, report)
    if tok is not None:  # `mmpipe generate --checkpoint OUT` reads it from OUT/tokenizer
        tok.save_pretrained(out / "tokenizer")
        note += "; tokenizer saved"
    print(f"mmpipe: imported {cfg.family} model ({note}) -> {args.out}")
    return 0


def _moondream_tokenizer(args: argparse.Namespace, cfg):
    """--tokenizer, in moondream's prompt format, checked against the preset's vocabulary; None without it."""
    if not args.tokenizer:
        return None
    tok = load_tokenizer(args.tokenizer, prompt_format="moondream")
    if len(tok) > cfg.text.vocab_size:
        raise ConfigError(f"--tokenizer: {len(tok)} tokens but {args.preset}'s vocabulary has "
                          f"{cfg.text.vocab_size}; give the tokenizer the weights were trained with")
    return tok


def _import_plan(args: argparse.Namespace) -> int:
    """--dry-run: the source's config (or preset and tokenizer) read and checked; no weight read."""
    cfg = None
    if args.hf:
        _, read, label = hf_importer(args.hf)
        cfg = read(args.hf)[1]
        source = f"{Path(args.hf).resolve()} (HF {label})"
    elif args.vision:
        for flag, d in (("--vision", args.vision), ("--lm", args.lm)):
            if not (Path(d) / "config.json").is_file():
                raise ConfigError(f"{flag}: {d} has no config.json (give an HF model directory)")
        source = f"{Path(args.vision).resolve()} + {Path(args.lm).resolve()} (a fresh projector)"
    else:
        if not Path(args.moondream).is_file():
            raise ConfigError(f"--moondream: {args.moondream} is not a file")
        cfg, source = load_preset(args.preset), f"{Path(args.moondream).resolve()} (moondream)"
        _moondream_tokenizer(args, cfg)
    return print_plan(f"import {source}", model=cfg and f"{cfg.name} ({cfg.family})", out=Path(args.out).resolve(),
                      writes="model.json, checkpoints/imported/, tokenizer/ when the source brings one")


def _tokenizer_of(args, report):
    """The tokenizer that belongs to the imported weights: stage 1's (with <image> added), else one
    an HF directory carries; None when there is none."""
    if report is not None and report.tokenizer is not None:
        return report.tokenizer
    if args.hf and (Path(args.hf) / "tokenizer.json").is_file():
        return load_tokenizer(args.hf)
    return None


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="an mmpipe run directory (model.json + checkpoints/)")
    p.add_argument("--out", required=True, help="a directory (--format hf) or a .safetensors file")
    p.add_argument("--format", choices=("hf", "safetensors", "peft"), default="hf",
                   help="hf: a LlavaForConditionalGeneration directory (LLaVA family); safetensors: one consolidated "
                        "file in HF names (LLaVA) or moondream's names (moondream family); a LoRA run's adapters are "
                        "merged into both. peft: a LoRA run's adapters alone, as a peft adapter directory with the "
                        "unmerged base in OUT/base (LLaVA family; docs/lora.md)")
    p.add_argument("--layout", choices=("current", "legacy"), default="current", help="moondream names to write")
    p.add_argument("--shard-size", default=DEFAULT_SHARD_SIZE,
                   help=f"--format hf / peft: the largest weight file, e.g. 5GB or 500MB (default "
                        f"{DEFAULT_SHARD_SIZE}, transformers' own); more weights go in model-0000k-of-0000N"
                        f".safetensors shards with model.safetensors.index.json. Export holds one layer in memory, "
                        f"whatever the size")
    p.add_argument("--region", help=f"moondream family: the region head to write with the weights, a {REGION_FILE} "
                                    f"or the import run holding it (default: CHECKPOINT/{REGION_FILE} if present)")


def consolidated(model, layout: str = "current", region=None) -> dict[str, torch.Tensor]:
    """Every weight once, in the family's ecosystem names: HF's where it has an HF class, else moondream's
    (with its region head, when given)."""
    fam = family_of(model.cfg)
    if fam.hf.names == "hf":
        state = model.state_dict()
        names = _names(fam, model.cfg)
        return {h: state[m].detach().contiguous() for m, h in names.items()}
    return export_moondream(model, layout, region)


def _layers(run: Path, cfg, fmt: str):
    """The run's layers to export, read one file at a time (mmpipe.hf.stream.RunLayers; a LoRA run's merged
    layer by layer, MergedRunLayers); --format peft, whose adapters go beside an unmerged base through peft's
    own model, the single-device model in memory."""
    ckpt = run / "checkpoints"
    if fmt == "peft":
        return ModelLayers(load_reference(ckpt, cfg))
    tag = latest_tag(ckpt)
    if tag is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt} (no 'latest' file)")
    lora = read_lora(run)  # a --tp run's layers are gathered from its TP ranks' files as they are read
    return RunLayers(ckpt / tag, cfg) if lora is None else MergedRunLayers(ckpt / tag, cfg, lora)


def write_consolidated(layers, out: Path, layout: str = "current", region=None) -> Path:
    """--format safetensors: every weight once in one file, in the family's ecosystem names (as consolidated),
    written one layer at a time (mmpipe.hf.safetensors_io.write_sharded, no shard limit)."""
    cfg = layers.cfg
    fam = family_of(cfg)
    names = _names(fam, cfg, layout)
    extra = region_in_layout(region or {}, layout)
    entries = planned(layers, names) + [(n, t.dtype, tuple(t.shape)) for n, t in extra.items()]
    write_sharded(out.parent, entries, chain(renamed_tensors(layers, names), extra.items()), None, single=out.name)
    return out


def _export_plan(args: argparse.Namespace, run: Path, cfg) -> int:
    """--dry-run: the run's model and latest checkpoint resolved; no weight read."""
    tag = latest_tag(run / "checkpoints")
    if tag is None:
        raise ConfigError(f"--checkpoint: no checkpoint in {run / 'checkpoints'} (no 'latest' file)")
    return print_plan(f"export {cfg.name} ({cfg.family}) as {args.format}",
                      weights=(run / "checkpoints" / tag).resolve(), out=Path(args.out).resolve(),
                      layout=args.layout if args.format == "safetensors" else None)


def main_export(args: argparse.Namespace) -> int:
    run = Path(args.checkpoint)
    try:
        if not (run / "model.json").is_file():
            raise ConfigError(f"--checkpoint: {run} has no model.json (give an mmpipe run directory)")
        cfg = config_from_dict(json.loads((run / "model.json").read_text()), run.name)
        fam = family_of(cfg)
        if fam.hf is None:  # moondream's names would miss its cross-attention layers
            raise ConfigError(f"--format {args.format}: the {cfg.fusion} family's layers have no names outside "
                              f"mmpipe (no HF or moondream model holds them); its run directory is the checkpoint")
        if args.format in ("hf", "peft") and (fam.hf.names != "hf" or fam.hf.export is None):
            takers = ", ".join(dict.fromkeys(f.family for f in families() if f.hf and f.hf.export))
            raise ConfigError(f"--format {args.format}: the {cfg.family} family has no HF model class to export to "
                              f"(the {takers} families have); use --format safetensors (a LoRA run's adapters merged "
                              f"in)")
        if args.format == "peft" and read_lora(run) is None:
            raise ConfigError(f"--format peft: {run} trained no LoRA adapters (no lora.json); use --format hf")
        if args.dry_run:
            return _export_plan(args, run, cfg)
        parse_size(args.shard_size)  # checked before anything is read or written
        tok = run_tokenizer(run, cfg) if args.format in ("hf", "peft") else None  # checked before writing
        layers = _layers(run, cfg, args.format)
        region_src = Path(args.region) if args.region else run / REGION_FILE
        moondream_names = fam.hf.names == "moondream"  # they carry moondream's region head
        region = (load_region(region_src, cfg.text.dim) if args.format == "safetensors" and moondream_names
                  and (args.region or region_src.is_file()) else None)
    except (ConfigError, FileNotFoundError) as e:
        return fail(e if isinstance(e, ConfigError) else ConfigError(f"--checkpoint: {e}"))
    wrote = ""
    if args.format == "peft":
        names, export = fam.hf.fn("key_map"), fam.hf.fn("export")
        export_adapter(layers.model, args.out, names,
                       lambda m, out: export(m, out, tok, shard_size=args.shard_size))
        wrote = write_processor(tok, cfg, Path(args.out) / "base")  # OUT/base serves as a checkpoint too
        write_processor(tok, cfg, Path(args.out))
    elif args.format == "hf":
        fam.hf.fn("export")(layers, args.out, tok, shard_size=args.shard_size)
        wrote = write_processor(tok, cfg, Path(args.out))
    else:
        write_consolidated(layers, Path(args.out), args.layout, region)
    if region is None and moondream_names:
        print(f"mmpipe: note: no region head ({run / REGION_FILE} absent, no --region): moondream's legacy loader "
              f"needs one, its current loader leaves it uninitialised")
    follow_umask(Path(args.out))
    print(f"mmpipe: exported {run} -> {args.out}" + (f" (with the run's {wrote})" if wrote else ""))
    return 0
