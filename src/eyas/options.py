"""Typed stage configs: each option is a dataclass field that states its default, its help
and its rule, once; the command line and the recipe are both read through it.

A stage's config is a dataclass whose option fields are made with `option(...)` (one flag
each) or `nested(...)` (a group of options with a config class of its own, e.g. the vLLM
engine's). From the class, `add_arguments` builds the stage's argparse options,
`from_args` builds the config from what argparse parsed, and `from_mapping` builds it from
plain keys and values (a recipe's stage, or a library caller's keywords), refusing an
unknown key or a value of the wrong kind in one line that names it. `check_rules` applies
every field's number rule (eyas.validate) and choices; each config calls it in
`__post_init__`, so a config that exists is valid however it was made.

This module and the config modules import no torch: `eyas --help` builds every stage's
parser from them (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Collection, Iterator, Mapping

from eyas.device_flag import AUTO, DEVICE_HELP
from eyas.errors import EyasError
from eyas.validate import Number, option_name

KEY = "eyas.option"  # where a field's Option lives in its metadata


@dataclass(frozen=True)
class Option:
    """What the command line needs of a field beyond its name, type and default."""

    help: str
    rule: Number | None = None  # a number option's accepted values
    choices: Collection[str] | None = None  # may be a live view (draft/kinds.py's registry: a kind added later counts)
    flag: str | None = None  # the flag if not --name (e.g. --no-progress for `progress: bool = True`)
    parse: Any = None  # text -> the field's value, where that is not the type's own (e.g. a comma list)
    metavar: str | None = None
    positional: bool = False
    required: bool = False  # required on the command line (a field without default always is)
    repeat: bool = False  # given by repeating the flag (a list, or with `parse` a merged mapping); else several values
    negatable: bool = False  # a bool with both --x and --no-x
    group: str | None = None  # the --help section it is listed in
    show_default: bool = True  # append "(default X)" to the help


@dataclass(frozen=True)
class Nested:
    """A field holding another config class, whose options are listed as one --help section."""

    title: str
    description: str | None = None


def option(help: str, default: Any = MISSING, *, default_factory: Any = MISSING, rule: Number | None = None,
           choices: Collection[str] | None = None, flag: str | None = None, parse: Any = None,
           metavar: str | None = None, positional: bool = False, required: bool = False, repeat: bool = False,
           negatable: bool = False, group: str | None = None, show_default: bool = True) -> Any:
    """A config field that is a command-line option: `help` is its doc, the rest as in Option."""
    how = Option(help=help, rule=rule, choices=choices, flag=flag, parse=parse, metavar=metavar,
                 positional=positional, required=required, repeat=repeat, negatable=negatable, group=group,
                 show_default=show_default)
    return field(default=default, default_factory=default_factory, metadata={KEY: how})


def nested(cls: type, title: str, description: str | None = None) -> Any:
    return field(default_factory=cls, metadata={KEY: Nested(title, description)})


def option_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Option]]:
    """Every option of `cls`, nested configs' options included, in --help order."""
    for f in fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Nested):
            yield from option_fields(_field_type(cls, f))
        elif isinstance(meta, Option):
            yield f, meta


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def help_text(f: dataclasses.Field) -> str:
    """The --help line of a field: its doc, then its default (stated nowhere else)."""
    meta: Option = f.metadata[KEY]
    default = default_of(f)
    if not meta.show_default or default is None or default is False or default in ([], (), {}):
        return meta.help
    shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else \
        f"{default:g}" if isinstance(default, float) else default
    return f"{meta.help} (default {shown})"


def flag_of(f: dataclasses.Field) -> str:
    meta: Option = f.metadata[KEY]
    return f.name if meta.positional else meta.flag or option_name(f.name)


def key_of(f: dataclasses.Field) -> str:
    """The option's name in a recipe: its flag's (`baseline` for --baseline), or the field's
    for a --no-X flag (`progress: false` is --no-progress)."""
    meta: Option = f.metadata[KEY]
    if meta.flag and not meta.flag.startswith("--no-"):
        return meta.flag[2:].replace("-", "_")
    return f.name


def _keys(cls: type, flags_only: bool = False) -> dict[str, tuple[dataclasses.Field, Option, Any, bool]]:
    """Each name a recipe or caller may give an option of `cls`: its key, its field's name
    (unless `flags_only`: a recipe names flags), and for a bool with a --no-X flag also `no_X`
    (true meaning false); -> (field, Option, type, inverted)."""
    known = {}
    for f, meta in option_fields(cls):
        tp = option_type(cls, f.name)
        known[key_of(f)] = (f, meta, tp, False)
        if not flags_only:
            known[f.name] = known[key_of(f)]
        if tp is bool and (meta.negatable or (meta.flag or "").startswith("--no-")):
            known["no_" + f.name] = (f, meta, tp, True)
    return known


# ---------------------------------------------------------------- types


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    return _hints(cls)[f.name]


def _base(tp: Any) -> Any:
    """`int | None` -> int; `list[str]` stays a list type; `dict[str, Any]` -> dict."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else str
    return dict if typing.get_origin(tp) is dict else tp


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple)


# ---------------------------------------------------------------- argparse


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """The options of config class `cls` on `parser`, in field order, sections as declared."""
    groups: dict[str | None, Any] = {None: parser}
    hints = _hints(cls)
    for f in fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Nested):
            _add_all(parser.add_argument_group(meta.title, meta.description), hints[f.name])
        elif isinstance(meta, Option):
            if meta.group not in groups:
                groups[meta.group] = parser.add_argument_group(meta.group)
            _add(groups[meta.group], f, meta, hints[f.name])


def _add_all(group: Any, cls: type) -> None:
    hints = _hints(cls)
    for f, meta in option_fields(cls):
        _add(group, f, meta, hints[f.name])


def _argparse_type(parse: Any) -> Any:
    """`parse` as argparse calls a type: a refusal becomes argparse's own one-line usage error."""
    def read(text: str) -> Any:
        try:
            return parse(text)
        except EyasError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = parse.__name__
    return read


class _Merge(argparse.Action):
    """A repeated flag whose values are mappings: the later ones update the earlier."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), **values})


def _add(target: Any, f: dataclasses.Field, meta: Option, tp: Any) -> None:
    base, default = _base(tp), default_of(f)
    kwargs: dict[str, Any] = {"help": help_text(f), "dest": f.name}
    if base is bool and meta.parse is None:
        if meta.negatable:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            kwargs["action"] = "store_false" if default else "store_true"
    else:
        kwargs.update(default=default, choices=meta.choices, metavar=meta.metavar)
        if meta.parse is not None:
            kwargs["type"] = _argparse_type(meta.parse)
            if base is dict:
                kwargs["action"] = _Merge  # each flag's mapping, merged in order
        elif _is_list(base):
            kwargs["type"] = typing.get_args(base)[0]
            kwargs["action" if meta.repeat else "nargs"] = "append" if meta.repeat else "+"
        elif base in (int, float):
            kwargs["type"] = base
    if meta.positional:
        del kwargs["dest"]  # a positional's name is its dest
        if f.default is not MISSING or f.default_factory is not MISSING:
            kwargs["nargs"] = "?"
        target.add_argument(f.name, **kwargs)
        return
    if meta.required or (f.default is MISSING and f.default_factory is MISSING):
        kwargs["required"] = True
        del kwargs["default"]
    target.add_argument(flag_of(f), **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The config `cls` from what its generated options parsed into `args`."""
    hints, values = _hints(cls), {}
    for f in fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Nested):
            values[f.name] = from_args(hints[f.name], args)
        elif isinstance(meta, Option):
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def snake_keys(values: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe's keys as option names: `max-len` and `max_len` are one key."""
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def argv_of(cls: type, values: Mapping[str, Any]) -> list[str]:
    """The command-line arguments that give `cls`'s options `values` (keyed as `from_mapping`
    takes them), in their order: what a recipe records as a stage's command, and launches
    under torchrun. One way only: nothing parses them back (a recipe builds the config with
    `from_mapping`)."""
    known, argv = _keys(cls), []
    for key, value in values.items():
        f, meta, tp, inverted = known[str(key).replace("-", "_")]
        argv += _arguments(f, meta, tp, not value if inverted else value)
    return argv


def _arguments(f: dataclasses.Field, meta: Option, tp: Any, value: Any) -> list[str]:
    """One option's arguments, as `_add` made its flag take them: nothing for None or a bool
    the flag would not set, the flag (or its --no- form) for a bool, one flag per value where
    it repeats (a mapping's key=value each), else the flag and its value or values."""
    if value is None:
        return []
    if meta.positional:
        return [str(value)]
    flag = flag_of(f)
    if tp is bool and meta.parse is None:
        if meta.negatable:
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value != default_of(f) else []
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in (flag, f"{k}={json.dumps(v)}")]
    if meta.repeat or (_is_list(tp) and isinstance(value, (list, tuple))):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [x for v in items for x in (flag, str(v))] if meta.repeat else [flag, *map(str, items)]
    return [flag, str(value)]


# ---------------------------------------------------------------- plain keys and values


def from_mapping(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """The config `cls` from `values` keyed by option name (`max_len` or `max-len`), a nested
    config's options among them; an unknown key or a value of the wrong kind is one line
    starting with `where`."""
    check_mapping(cls, values, where)
    known, by_field = _keys(cls), {}
    for key, value in values.items():
        f, meta, tp, inverted = known[str(key).replace("-", "_")]
        by_field[f.name] = not value if inverted else _value(meta, tp, value)
    return _build(cls, by_field)


def _is_text(meta: Option, value: Any) -> bool:
    """`value` is what the command line would give a `parse` option: its text (a list of texts if repeated)."""
    return meta.parse is not None and (isinstance(value, str) or (
        meta.repeat and isinstance(value, list) and all(isinstance(v, str) for v in value)))


def _value(meta: Option, tp: Any, value: Any) -> Any:
    """A recipe's or caller's value as the field holds it: text read by `parse` (repeated
    texts merged, as the command line's action does), else converted to the field's type."""
    if not _is_text(meta, value):
        return _coerce(value, tp)
    if isinstance(value, str):
        return meta.parse(value)
    parsed = [meta.parse(v) for v in value]
    return {k: v for d in parsed for k, v in d.items()} if tp is dict else parsed


def _build(cls: type, values: dict[str, Any]) -> Any:
    """`cls` from option values by field name, nested configs' among them."""
    hints, kwargs = _hints(cls), {}
    for f in fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Nested):
            kwargs[f.name] = _build(hints[f.name], values)
        elif isinstance(meta, Option) and f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def check_mapping(cls: type, values: Mapping[str, Any], where: str, also: frozenset[str] = frozenset(),
                  flags_only: bool = False) -> None:
    """Every key of `values` names an option of `cls` (or is in `also`; with `flags_only`, by
    its flag's name), with a value of its kind that its rule and choices accept; else one
    line starting with `where` that names it."""
    known = _keys(cls, flags_only)
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in also:
            continue
        if name not in known:
            raise EyasError(f"{where}: unknown option `{key}`; the options are those of its command's --help "
                            f"({', '.join(sorted(k for k, v in known.items() if not v[3]))}).")
        f, meta, tp, _ = known[name]
        if not _is_text(meta, value) and not _fits(value, tp):
            raise EyasError(f"{where}: `{key}` takes {_kind(tp)}, not {value!r}.")
        try:
            _check_value(f, meta, _value(meta, tp, value))
        except EyasError as e:
            raise EyasError(f"{where}: {e}") from None


def option_type(cls: type, name: str) -> Any:
    """The value type of option `name` of `cls` (or of one of its nested configs): `int | None` -> int."""
    return _base(_hints_of_owner(cls, name))


def _hints_of_owner(cls: type, name: str) -> Any:
    """The annotation of option `name` of `cls` or of one of its nested configs."""
    hints = _hints(cls)
    for f in fields(cls):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Nested):
            try:
                return _hints_of_owner(hints[f.name], name)
            except KeyError:
                continue
        elif f.name == name:
            return hints[name]
    raise KeyError(name)


def _fits(value: Any, tp: Any) -> bool:
    if value is None:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if tp is int:
        return isinstance(value, int)
    if tp is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float))
    if _is_list(tp):
        return all(_fits(v, typing.get_args(tp)[0]) for v in (value if isinstance(value, list) else [value]))
    return isinstance(value, (str, int, float, os.PathLike))  # a text option: a YAML number, a path, is its text


def _coerce(value: Any, tp: Any) -> Any:
    if value is None:
        return None
    if _is_list(tp):
        return [_coerce(v, typing.get_args(tp)[0]) for v in (value if isinstance(value, list) else [value])]
    if tp is float:
        return float(value)
    if tp is dict:
        return dict(value)
    if tp is str:
        return str(value)
    return value


def _kind(tp: Any) -> str:
    if _is_list(tp):
        return f"a list of {_kind(typing.get_args(tp)[0])}s"
    return {bool: "true or false", int: "an integer", float: "a number", dict: "a mapping"}.get(tp, "a text")


# ---------------------------------------------------------------- rules


def check_rules(config: Any) -> None:
    """Each option's number rule and choices (the first refused names its flag, its range and the value)."""
    for f in fields(config):
        meta = f.metadata.get(KEY)
        if isinstance(meta, Option):
            _check_value(f, meta, getattr(config, f.name))


def _check_value(f: dataclasses.Field, meta: Option, value: Any) -> None:
    if meta.rule is not None:
        meta.rule.check(flag_of(f), value)
    if meta.choices and value is not None and value not in meta.choices:
        raise EyasError(f"{flag_of(f)} must be one of {', '.join(meta.choices)} (got {value!r}).")


# ---------------------------------------------------------------- options several stages share

AUTO_LAYERS = "auto"
AUTO_LAYERS_MEANS = "(2, N//2, N-3)"  # models/layers.py default_aux_ids, for an N-layer target
SPREAD_LAYERS = "spread:"  # spread:K, K ids evenly from 2 to N-2 (models/layers.py spread_aux_ids)
# Why `auto` is also DFlash's: at equal steps on SmolLM2, spread:5 drafted no better (docs/train.md).
AUTO_LAYERS_DFLASH = "for DFlash too: the peers' spread:5 trained no better at equal steps (docs/train.md)"
LAYERS_HELP = (f"aux layer ids, e.g. 2,15,27; {AUTO_LAYERS} = {AUTO_LAYERS_MEANS}, {AUTO_LAYERS_DFLASH}; "
               f"{SPREAD_LAYERS}K = K ids spread evenly from 2 to N-2 (SpecForge's DFlash reads 5 of Qwen3-8B's 36 "
               "layers so: spread:5). Id N is always added")


def aux_layer_count(spec: str) -> int | None:
    """How many aux states `--layers` asks for, known before the target is (None: unreadable;
    the stage that resolves it says why)."""
    if spec == AUTO_LAYERS:
        return 3
    text = str(spec)
    if text.startswith(SPREAD_LAYERS):
        count = text[len(SPREAD_LAYERS):]
        return int(count) if count.isdigit() else None
    return len(text.split(","))
BATCH_TOKENS = 8192
# A micro-batch holds at least one sample of two tokens (one next-token pair).
BATCH_TOKENS_RULE = Number(lo=2, integer=True, required=True)


def crop_length(max_len: int | None, batch_tokens: int) -> int:
    """The tokens a sample keeps in training (and in scoring as training did): --max-len, at
    most --batch-tokens, since one micro-batch must hold a whole sample."""
    return min(max_len or batch_tokens, batch_tokens)

# Every stage's --seed. Seeds are derived from it (seed * 1_000_003 + epoch or prompt, seed +
# conversation) and handed to torch's and engines' generators, which take 64-bit (some 32-bit)
# seeds: a non-negative 31-bit seed keeps every derived one in range.
SEED_RULE = Number(lo=0, hi=2**31 - 1, integer=True, required=True)


def layers_option(note: str = "", group: str | None = None) -> Any:
    """`--layers`: which aux states capture stores and online training computes."""
    return option(LAYERS_HELP + (f" ({note})" if note else ""), AUTO_LAYERS, group=group)


def batch_tokens_option(help: str, group: str | None = None) -> Any:
    """`--batch-tokens`: padded tokens per forward, in capture and in training."""
    return option(help, BATCH_TOKENS, rule=BATCH_TOKENS_RULE, group=group)


def seed_option(help: str, group: str | None = None) -> Any:
    """Every stage's `--seed`: default 0, within SEED_RULE."""
    return option(help, 0, rule=SEED_RULE, group=group)


def device_option(note: str = "", group: str | None = None) -> Any:
    """Every stage's `--device`: same name, default and help (`note` says what it applies to)."""
    return option(DEVICE_HELP + (f"; {note}" if note else ""), AUTO, show_default=False, group=group)


def rules(cls: type) -> dict[str, Number]:
    """The number rules of `cls`'s options by field name, for functions that take them as keywords."""
    return {f.name: meta.rule for f, meta in option_fields(cls) if meta.rule is not None}
