"""Dataclass fields as command-line flags: each flag is declared once, as a field with its help,
and argparse only maps a command line onto the dataclass (`add_flags`, `from_namespace`) or a
dataclass back onto one (`to_argv`, how the front door hands a run to its ranks)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")
_TYPES = {"int": int, "str": str, "float": float}


def flag(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,
         group: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also the flag --NAME (underscores become dashes)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                                        "group": group, "aliases": aliases})


def _flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _base_type(f: dataclasses.Field):
    name = str(f.type).replace(" | None", "").replace("None | ", "")  # "int | None" -> int
    return _TYPES[name] if name in _TYPES else name


def add_flags(p: argparse.ArgumentParser, cls, only: tuple[str, ...] | None = None) -> None:
    """only: these fields' flags alone (a command that shares part of a dataclass, as plan does DataArgs')."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    fields = [f for f in _flag_fields(cls) if only is None or f.name in only]
    for f in sorted(fields, key=lambda f: f.metadata["group"] is not None):  # a group's flags last
        md = f.metadata
        where = groups.setdefault(md["group"], p.add_argument_group(md["group"])) if md["group"] else p
        kw: dict = {"dest": f.name, "default": f.default, "help": md["help"]}
        if _base_type(f) == "bool":
            kw["action"] = "store_true"
        else:
            kw["type"] = _base_type(f)
            kw.update({k: md[k] for k in ("choices", "metavar") if md[k] is not None})
        where.add_argument("--" + f.name.replace("_", "-"), *md["aliases"], **kw)


def from_namespace(cls: type[T], ns: argparse.Namespace, only: tuple[str, ...] | None = None) -> T:
    """only: as add_flags's; the other fields keep their defaults."""
    return cls(**{f.name: getattr(ns, f.name) for f in _flag_fields(cls) if only is None or f.name in only})


def to_argv(obj) -> list[str]:
    """The flags that reproduce `obj` (fields left at their defaults are omitted)."""
    out: list[str] = []
    for f in _flag_fields(type(obj)):
        val = getattr(obj, f.name)
        if val == f.default:
            continue
        name = "--" + f.name.replace("_", "-")
        out += [name] if val is True else [name, str(val)]
    return out


def add_dry_run(p: argparse.ArgumentParser) -> None:
    """--dry-run, on every `mmpipe` command (cli.parser adds it once for all)."""
    p.add_argument("--dry-run", action="store_true",
                   help="check and resolve everything, print the plan (what would be launched or written) and "
                        "start nothing")


def print_plan(what: str, **items: Any) -> int:
    """--dry-run's report: what the command would do, then one `name: value` line per item; exit status 0."""
    print(f"mmpipe: dry run: {what} (nothing started, nothing written)", flush=True)
    for name, value in items.items():
        if value is not None:
            print(f"  {name.replace('_', ' ')}: {value}", flush=True)
    return 0


def degrees(flag: str, text: str) -> tuple[int, ...]:
    """A planner axis' `N[,N...]` (`mmpipe plan --tp / --sp / --ep`): the distinct degrees in order, each >= 1, or
    one line naming the flag."""
    try:
        values = tuple(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a list of integers, e.g. 1,2,4,8") from None
    for n in values:
        if n < 1:
            raise ConfigError(f"{flag}: {n} must be >= 1")
    return values
