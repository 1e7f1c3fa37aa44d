"""Counts of what makes a family hard to add (issue 52), measured on the source the same way each time:

    python scripts/architecture_counts.py [--json]

- registries: module-level dicts / lists in mmpipe/ that hold per-family data (keyed by a family name, a family
  tuple, a model_type, an HF class or a kind name that a family names), found by the names listed in REGISTRIES
  below, each checked to still exist;
- getattr probes: `getattr(obj, "name", default)` whose object is one of mmpipe's own config or layer objects (a
  model config or its sections, a layer, a spec, a rule, a row, a dataset / sample source): the three-argument
  form asks "is this field there?" of an object whose class mmpipe defines, where the class should answer;
  objects of other libraries (transformers configs `hf` / `tc` / `vc`, tokenizers, DeepSpeed's engine and
  parameters, argparse namespaces) are not counted;
- isinstance / issubclass on a family-specific class (a class defined in a family's own modules, FAMILY_MODULES)
  outside those modules;
- functions over 8 parameters, and the longest function (lines, decorators excluded).
"""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mmpipe"

# a family's own modules: its layers, its HF side, its data side's rule (a class defined in one of these and tested
# with isinstance elsewhere is a type test standing in for a question the family should answer)
FAMILY_MODULES = {
    "model/layers.py", "model/cross_attention.py", "model/llava.py", "model/llava_next.py", "model/qwen2_vl.py",
    "model/qwen3_vl.py", "model/qwen3_5.py", "model/crops.py",
    "hf/moondream.py", "hf/llava.py", "hf/llava_next.py", "hf/qwen2_vl.py", "hf/qwen3_vl.py", "hf/qwen3_5.py",
    "hf/tokens.py", "data/anyres.py", "data/patches.py", "data/crops.py",
    "model/gemma3.py", "hf/gemma3.py", "data/gemma3.py",
}
# model/moe.py and hf/moe.py are the mixture-of-experts machinery both MoE families share (Qwen3-VL-MoE and
# Qwen3.5-MoE import its Experts, MoeBlock, MoeHead, router), as model/attention.py is every family's attention: the
# expert-parallel runtime finding the Experts containers it shards is not a family test. Qwen3-VL's own sparse
# block, defined there, is named below.
# row kinds and config sections that exist for one family (defined in shared modules)
FAMILY_CLASSES_ELSEWHERE = {"Qwen3MoeBlock", "CropRow", "PatchRow", "TileRule", "PatchRule", "CropVision", "ClipVision",
                            "AnyresVision", "Qwen2Vision", "Qwen3Vision", "DeepstackVision", "LlamaText",
                            "MropeText", "Qwen3Text", "HybridText", "MoeConfig"}
# (module, name) of the registries that held per-family data at 368cfab, and the one that holds it now
REGISTRIES = [("model/families.py", "FAMILIES"), ("config.py", "LAYOUTS"), ("config.py", "FAMILY_CHECKS"),
              ("data/image_kinds.py", "KINDS"), ("hf/commands.py", "HF_IO"), ("hf/commands.py", "READERS"),
              ("hf/commands.py", "weight_names"), ("registry.py", "_FAMILIES")]
# names of mmpipe's own config / layer objects as the code calls them
# (a LayerSpec is DeepSpeed's, whose TiedLayerSpec alone has forward_fn / key: not counted)
OWN_OBJECTS = {"cfg", "cfg.text", "cfg.vision", "model.text", "model.vision", "run.model.text", "run.model",
               "text", "vision", "v", "t", "new", "section", "layer", "module", "rule", "row", "patches",
               "self", "last", "samples", "dataset", "source", "rec", "m", "kind", "fam", "family"}


def _files():
    return sorted(p for p in PKG.rglob("*.py"))


def _rel(p: Path) -> str:
    return p.relative_to(PKG).as_posix()


def family_classes() -> set[str]:
    out = set(FAMILY_CLASSES_ELSEWHERE)
    for rel in FAMILY_MODULES:
        p = PKG / rel
        if p.exists():
            out |= {n.name for n in ast.parse(p.read_text()).body if isinstance(n, ast.ClassDef)}
    return out


def registries() -> list[str]:
    found = []
    for rel, name in REGISTRIES:
        p = PKG / rel
        if not p.exists():
            continue
        tree = ast.parse(p.read_text())
        assigned = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        if name in assigned or (name == "weight_names" and "weight_names" in p.read_text()):
            found.append(f"{rel}:{name}")
    return found


def getattr_probes() -> list[str]:
    hits = []
    for p in _files():
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and ast.unparse(node.args[0]) in OWN_OBJECTS):
                hits.append(f"{_rel(p)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def isinstance_checks() -> list[str]:
    classes, hits = family_classes(), []
    for p in _files():
        if _rel(p) in FAMILY_MODULES:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                arg = node.args[1]
                names = [e for e in (arg.elts if isinstance(arg, ast.Tuple) else [arg])]
                if any(ast.unparse(e).split(".")[-1] in classes for e in names):
                    hits.append(f"{_rel(p)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def functions() -> tuple[list[str], list[tuple[int, str]]]:
    many, lengths = [], []
    for p in _files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                n -= bool(a.args) and a.args[0].arg in ("self", "cls")
                where = f"{_rel(p)}:{node.lineno}: {node.name}"
                if n > 8:
                    many.append(f"{where} ({n} parameters)")
                lengths.append((node.end_lineno - node.lineno + 1, where))
    return many, sorted(lengths, reverse=True)


def counts() -> dict:
    many, lengths = functions()
    return {"registries": registries(), "getattr_probes": getattr_probes(), "isinstance_family": isinstance_checks(),
            "functions_over_8_parameters": many, "longest_functions": [f"{n} lines {w}" for n, w in lengths[:5]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="every hit, as JSON")
    c = counts()
    if ap.parse_args().json:
        print(json.dumps(c, indent=1))
        return
    for k, v in c.items():
        print(f"{k}: {len(v) if k != 'longest_functions' else v[0]}")
        for h in v if k != "longest_functions" else v[1:]:
            print(f"    {h}")


if __name__ == "__main__":
    main()
