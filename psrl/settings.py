"""Settings declared once: each process's settings are dataclass fields made by `setting()` and `section()`,
carrying their help text and unit. The same fields give the command-line flags (`add_flags`), the YAML reader
(`from_mapping`) and the rows of docs/configuration.md (`python -m psrl.settings > docs/configuration.md`).

Flags default to "not given" (argparse.SUPPRESS): `apply_flags` sets only what was given, over the defaults or a
YAML file. A setting's flag is `--` plus its name with dashes; a section's settings get the section's flag prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

_KEY = "psrl.settings"
E = TypeVar("E", bound=enum.StrEnum)


@dataclass(frozen=True)
class Meta:
    """What a field adds to its type and default: help text, unit and how its flag looks."""

    help: str
    unit: str = ""
    flags: tuple[str, ...] | None = None  # None: derived from the name; (): no flag
    choices: tuple[str, ...] | None = None  # None: an enum type's values, else any
    nargs: str | int | None = None  # None: "*" for a list, else one value
    flag_prefix: str | None = None  # sections only: None derives it from the section's name


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    unit: str = "",
    flags: Sequence[str] | None = None,
    choices: Sequence[str] | None = None,
    nargs: str | int | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is one setting; a mutable default goes in `default_factory`."""
    meta = Meta(help, unit, None if flags is None else tuple(flags), None if choices is None else tuple(choices), nargs)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: meta})


def section(cls: type, *, flat: bool = False) -> Any:
    """A field holding a nested settings dataclass, described by the first paragraph of its docstring; `flat`
    gives its settings flags without the section's prefix."""
    summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    return dataclasses.field(default_factory=cls, metadata={_KEY: Meta(summary, flag_prefix="" if flat else None)})


@dataclass(frozen=True)
class Row:
    """One setting as the flags and the docs see it."""

    path: tuple[str, ...]  # attribute names from the top dataclass: ("selector", "enable_group_sticky")
    hint: Any
    default: Any
    meta: Meta
    flags: tuple[str, ...]

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def value_type(self) -> Any:
        """The hint without `| None` and without the list around it."""
        hint = _without_none(self.hint)
        if typing.get_origin(hint) is list:
            return typing.get_args(hint)[0]
        return hint

    @property
    def is_list(self) -> bool:
        return typing.get_origin(_without_none(self.hint)) is list

    @property
    def choices(self) -> tuple[str, ...] | None:
        if self.meta.choices is not None:
            return self.meta.choices
        t = self.value_type
        return tuple(m.value for m in t) if isinstance(t, type) and issubclass(t, enum.Enum) else None


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def _meta(f: dataclasses.Field) -> Meta:
    meta = f.metadata.get(_KEY)
    if meta is None:
        raise TypeError(f"{f.name}: a settings field needs setting(...) or section(...)")
    return meta


def rows(cls: type, path: tuple[str, ...] = (), flag_prefix: str = "") -> Iterator[Row]:
    """Every setting of a settings dataclass, sections included, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta, hint = _meta(f), hints[f.name]
        if dataclasses.is_dataclass(hint):
            prefix = meta.flag_prefix if meta.flag_prefix is not None else f"{f.name.replace('_', '-')}-"
            yield from rows(typing.cast(type, hint), (*path, f.name), flag_prefix + prefix)
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        flags = meta.flags if meta.flags is not None else (f"--{flag_prefix}{f.name.replace('_', '-')}",)
        yield Row((*path, f.name), hint, default, meta, flags)


def sections(cls: type) -> Iterator[tuple[str, Meta]]:
    """The sections of `cls` (one level down): each one's name and what section() recorded."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield f.name, _meta(f)


def _shown(value: Any) -> str:
    """A default as a user types it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list):
        return " ".join(_shown(v) for v in value) or "[]"
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting of `cls` (bools get --flag/--no-flag); each sets dest = the setting's dotted key."""
    for row in rows(cls):
        if not row.flags:
            continue
        help_text = row.meta.help + (f" [{row.meta.unit}]" if row.meta.unit else "")
        if row.default is not None and row.default != []:
            help_text += f" (default: {_shown(row.default)})"
        kwargs: dict[str, Any] = {"dest": row.key, "default": argparse.SUPPRESS, "help": help_text}
        if row.value_type is bool and not row.is_list:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            t = row.value_type
            kwargs["type"] = t if t in (int, float) else str
            if row.choices is not None:
                kwargs["choices"] = row.choices
            else:
                kwargs["metavar"] = row.path[-1].upper()
            nargs = row.meta.nargs if row.meta.nargs is not None else ("*" if row.is_list else None)
            if nargs is not None:
                kwargs["nargs"] = nargs
        parser.add_argument(*row.flags, **kwargs)


def apply_flags(target: Any, ns: argparse.Namespace) -> None:
    """Set on `target` each setting a flag gave (keys from `add_flags`; other names in `ns` are left alone)."""
    for key, value in vars(ns).items():
        *head, name = key.split(".")
        obj = target
        for part in head:
            obj = getattr(obj, part)
        if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
            setattr(obj, name, value)


def from_mapping(cls: type, data: dict[str, Any], where: str) -> Any:
    """A settings dataclass from a mapping (YAML), sections included; unknown keys are an error naming them."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            kwargs[key] = from_mapping(typing.cast(type, hint), value, f"{where}.{key}")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def choice(enum_type: type[E], value: str, what: str) -> E:
    """`value` as a member of `enum_type`, or a ValueError naming the setting and its choices."""
    try:
        return enum_type(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {', '.join(m.value for m in enum_type)}, got {value!r}") from None


# ---- docs/configuration.md --------------------------------------------------------------------------------

# (title, config module, settings dataclass, reads YAML); each module also has build_parser(). Only the
# generator imports them.
PROCESSES = (
    ("Router: `python -m psrl.router`", "psrl.router.config", "RouterConfig", True),
    ("SessionRouter: `python -m psrl.session`", "psrl.session.config", "SessionConfig", False),
    ("Replica: `python -m psrl.worker`", "psrl.worker.config", "WorkerArgs", False),
    ("Gateway: `python -m psrl.gateway`", "psrl.gateway.config", "GatewayConfig", True),
    ("PSManager: `python -m psrl.psmanager`", "psrl.psmanager.config", "ServerArgs", False),
)

_INTRO = """# Configuration

Generated by `make docs` (`python -m psrl.settings > docs/configuration.md`) from the settings declared in each
process's config module; do not edit it by hand.

Every setting is a flag; a boolean flag `--x` also has the form `--no-x`. The router and the gateway read a YAML
file too (`--config FILE`), whose keys are the YAML keys below; flags override the file. A section's settings
are a mapping under the section's name: `selector.enable_group_sticky` is `enable_group_sticky` under
`selector:`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type_name(row: Row) -> str:
    if row.choices is not None:
        name = " \\| ".join(row.choices)
    else:
        t = row.value_type
        name = t.__name__ if isinstance(t, type) else str(t)
    return f"list of {name}" if row.is_list else name


def _table(selected: list[Row], reads_yaml: bool) -> list[str]:
    columns = ["Flag", *(["YAML key"] if reads_yaml else []), "Type", "Default", "Unit", "Meaning"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in selected:
        default = _shown(row.default)
        flags = ", ".join(f"`{f}`" for f in row.flags) or "(none)"
        cells = [flags, *([f"`{row.key}`"] if reads_yaml else [])]
        cells += [_type_name(row), f"`{default}`" if default else "", row.meta.unit, _cell(row.meta.help)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def process_markdown(title: str, cls: type, parser: argparse.ArgumentParser, reads_yaml: bool) -> str:
    """One process's part: a table of its top-level settings, one per section, and its other flags."""
    all_rows = list(rows(cls))
    lines = [f"## {title}", "", *_table([r for r in all_rows if len(r.path) == 1], reads_yaml)]
    for name, meta in sections(cls):
        lines += ["", f"### `{name}`", "", meta.help, ""]
        lines += _table([r for r in all_rows if r.path[0] == name and len(r.path) > 1], reads_yaml)
    own = {r.key for r in all_rows}
    extra = [a for a in parser._actions if a.option_strings and a.dest not in own and a.dest != "help"]
    if extra:
        lines += ["", "Other flags:", ""]
        lines += [f"- {', '.join(f'`{o}`' for o in a.option_strings)}: {a.help}" for a in extra]
    return "\n".join(lines) + "\n"


def configuration_markdown() -> str:
    """The text of docs/configuration.md."""
    parts = [_INTRO]
    for title, module_name, cls_name, reads_yaml in PROCESSES:
        module = importlib.import_module(module_name)
        parts.append(process_markdown(title, getattr(module, cls_name), module.build_parser(), reads_yaml))
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(configuration_markdown())
