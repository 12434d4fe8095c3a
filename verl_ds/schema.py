"""The config schema's mechanics: a field's help, choices and bounds as dataclass metadata (TRL's
`GRPOConfig` pattern), and the check of a whole (nested) config against them. The fields
themselves live with their sections (config.py, precision.py)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any

from verl_ds.errors import ConfigError


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory=None,
    choices=None,
    gt=None,
    ge=None,
    lt=None,
    le=None,
    auto: bool = False,
):
    """A config field: `help` for docs/CONFIG.md, `choices` and bounds checked by `validate`;
    `auto`: the string "auto" is allowed besides an integer within the bounds."""
    meta = {
        "auto": auto,
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "gt": gt,
        "ge": ge,
        "lt": lt,
        "le": le,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help: str = ""):
    """A nested section (its own dataclass)."""
    return field(default_factory=cls, metadata={"help": help or (cls.__doc__ or "").strip().split("\n")[0]})


def _check_value(value: Any, meta: dict) -> str | None:
    """What is wrong with `value` against a field's `opt` metadata (None: nothing)."""
    choices = meta.get("choices")
    if choices is not None:
        if not any(value == c and type(value) is type(c) for c in choices):
            shown = ", ".join("null" if c is None else str(c) for c in choices)
            return f"'{value}' is not one of {shown}"
        return None
    if meta.get("auto"):
        if value == "auto":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be auto or an integer, got {value!r}"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for key, op, ok in (
        ("gt", ">", lambda b: value > b),
        ("ge", ">=", lambda b: value >= b),
        ("lt", "<", lambda b: value < b),
        ("le", "<=", lambda b: value <= b),
    ):
        bound = meta.get(key)
        if bound is not None and not ok(bound):
            return f"must be {op} {bound}, got {value}"
    return None


def field_errors(obj, prefix: str = "") -> list[ConfigError]:
    """Each field's choices and bounds, over the whole (nested) config."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += field_errors(value, f"{prefix}{f.name}.")
        elif (msg := _check_value(value, f.metadata)) is not None:
            out.append(ConfigError(f"{prefix}{f.name}", msg))
    return out


def _type_text(tp) -> str:
    """`int`, `str or null` (Optional), `any`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and len(args) < len(typing.get_args(tp)):
        return f"{_type_text(args[0])} or null"
    return "any" if tp is Any else getattr(tp, "__name__", str(tp))


def _value_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def _allowed_text(meta) -> str:
    if meta.get("choices") is not None:
        return ", ".join("null" if c is None else str(c) for c in meta["choices"])
    bounds = [
        f"{op} {meta[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if meta.get(k) is not None
    ]
    return " and ".join((["auto or an integer"] if meta.get("auto") else []) + bounds)


def markdown(cls, title: str, intro: str = "") -> str:
    """Every key of the (nested) dataclass `cls`: a table per section with type, default, allowed
    values and help, all read from the fields (what docs/CONFIG.md is generated from)."""
    lines = [f"# {title}", "", intro, ""] if intro else [f"# {title}", ""]

    def walk(obj, prefix: str, doc: str) -> None:  # defaults: the values of a default-built `obj`
        hints = typing.get_type_hints(type(obj))
        rows, subs = [], []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                subs.append((value, f"{prefix}{f.name}.", f.metadata.get("help", "")))
                continue
            help_ = f.metadata.get("help", "").replace("|", "\\|")
            allowed = _allowed_text(f.metadata).replace("|", "/")
            rows.append(
                f"| `{prefix}{f.name}` | {_type_text(hints[f.name])} | {_value_text(value)} | {allowed} | {help_} |"
            )
        if rows:
            lines.extend(
                [
                    f"## `{prefix.rstrip('.') or '(top level)'}`",
                    "",
                    doc,
                    "",
                    "| key | type | default | allowed | help |",
                    "|---|---|---|---|---|",
                    *rows,
                    "",
                ]
            )
        for sub, p, h in subs:
            walk(sub, p, h or (type(sub).__doc__ or "").strip().split("\n")[0])

    walk(cls(), "", (cls.__doc__ or "").strip())
    return "\n".join(lines).rstrip() + "\n"
