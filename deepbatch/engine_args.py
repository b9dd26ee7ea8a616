"""Engine arguments, generated from the config dataclasses (deepbatch/config.py): the flags of
``deepbatch serve | generate | chat | doctor`` and ``deepbatch bench throughput``, the keywords
of ``LLM(...)``, and one builder behind both, ``engine_config(**kwargs)``.

A field declared with ``arg(...)`` is ``LLM(name=...)`` and ``--name`` (dashes); one declared
``internal(...)`` is neither. Two spellings exist on the command line only: the positional MODEL
(``serve``, ``doctor``) beside ``--model``, and ``--scheduling static`` that turns
``--static-batch-size`` on.

    python -m deepbatch.engine_args    # the flag reference of docs/operations.md, as markdown
"""

from __future__ import annotations

import argparse
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import Any

from deepbatch import envs
from deepbatch.config import UNSET, ArgSpec, EngineConfig, default_device, resolve_dtype


@dataclass(frozen=True)
class EngineArg:
    name: str  # the LLM(...) keyword and the CLI dest
    path: tuple[str, ...]  # where the value lands in EngineConfig: ("scheduler", "policy")
    type: type  # int, float, str or bool: what the CLI parses
    default: Any  # LLM(...)'s
    cli_default: Any
    help: str
    choices: tuple[str, ...] | None
    flags: tuple[str, ...]  # ("--tensor-parallel-size", "-tp")


def _fields(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field, Any, ArgSpec]]:
    """(path, field, type, spec) of every leaf field under ``cls``, nested configs walked."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if is_dataclass(tp):
            yield from _fields(tp, prefix + (f.name,))
            continue
        spec = f.metadata.get("arg")
        if spec is None:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with arg(...) (an engine argument) or "
                            "internal(...) in deepbatch/config.py")
        yield prefix + (f.name,), f, tp, spec


def _plain_type(tp: Any) -> type:
    """``int | None`` -> int."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        (tp,) = [t for t in typing.get_args(tp) if t is not type(None)]
    return tp


@functools.cache
def engine_args() -> tuple[EngineArg, ...]:
    out = []
    for path, f, tp, spec in _fields(EngineConfig):
        if spec.internal:
            continue
        name = spec.name or f.name
        default = spec.user_default if spec.user_default is not UNSET else f.default
        if default is MISSING:
            raise TypeError(f"{'.'.join(path)}: an engine argument needs a default (arg(user_default=...))")
        out.append(EngineArg(
            name=name, path=path, type=spec.type or _plain_type(tp), default=default,
            cli_default=default if spec.cli_default is UNSET else spec.cli_default, help=spec.help,
            choices=spec.choices, flags=("--" + name.replace("_", "-"), *spec.aliases)))
    names = [a.name for a in out]
    if len(set(names)) != len(names):
        raise TypeError(f"engine arguments named twice: {sorted({n for n in names if names.count(n) > 1})}")
    return tuple(out)


def engine_config(**kwargs: Any) -> EngineConfig:
    """The frozen EngineConfig for these engine arguments, with LLM(...)'s defaults for the rest.

    Resolved here, for the device the config is for: ``device=None`` is cuda when available, a
    ``dtype`` name becomes a torch dtype, and ``admission_batch_size=None`` is 64 on CUDA with
    CUDA graphs (offline runs are for throughput), else 1. Internal fields read from the
    environment take its value now. An unknown keyword is a TypeError naming it; a bad value
    is the ValueError of the config's check."""
    args = {a.name: a for a in engine_args()}
    for name in kwargs:
        if name not in args:
            raise TypeError(f"engine_config() got an unexpected keyword argument {name!r}")
    values = {name: kwargs.get(name, a.default) for name, a in args.items()}
    device = values["device"] = values["device"] or default_device()
    values["dtype"] = resolve_dtype(values["dtype"], device)
    if values["admission_batch_size"] is None:
        values["admission_batch_size"] = 64 if device.startswith("cuda") and not values["enforce_eager"] else 1
    by_path = {args[name].path: value for name, value in values.items()}
    for path, _, _, spec in _fields(EngineConfig):
        if spec.env is not None:
            by_path[path] = getattr(envs, spec.env)
    return _build(EngineConfig, by_path, ())


def _build(cls: type, by_path: dict[tuple[str, ...], Any], prefix: tuple[str, ...]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        path = prefix + (f.name,)
        if is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], by_path, path)
        elif path in by_path:
            kwargs[f.name] = by_path[path]
    return cls(**kwargs)


# -- the command line --------------------------------------------------------------------------

def add_engine_args(p: argparse.ArgumentParser, positional_model: bool,
                    cli_defaults: Mapping[str, Any] | None = None) -> None:
    """Every engine argument as a flag of ``p``; ``positional_model`` adds the positional MODEL
    beside ``--model``. ``cli_defaults`` overrides defaults by name (``bench throughput`` keeps
    LLM(...)'s admission_batch_size)."""
    cli_defaults = dict(cli_defaults or {})
    unknown = set(cli_defaults) - {a.name for a in engine_args()}
    if unknown:
        raise TypeError(f"cli_defaults: not engine arguments: {sorted(unknown)}")
    for a in engine_args():
        help_text = a.help.replace("%", "%%")
        default = cli_defaults.get(a.name, a.cli_default)
        if a.name == "model" and positional_model:
            p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=help_text)
            help_text = "same as MODEL"
        if a.type is bool:
            p.add_argument(*a.flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            p.add_argument(*a.flags, type=a.type, choices=a.choices, default=default, help=help_text)
        if a.name == "static_batch_size":
            p.add_argument("--scheduling", choices=("continuous", "static"), default="continuous",
                           help="static: fixed batches of --static-batch-size requests (only to compare against "
                                "continuous batching)")


def add_queue_args(p: argparse.ArgumentParser) -> None:
    """The bounds of the waiting queue beyond which requests get 429, for the engines that serve
    (``deepbatch serve``, Ray Serve replicas)."""
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="waiting sequences beyond which requests get 429 (0: no limit)")
    p.add_argument("--max-queued-tokens", type=int, default=0,
                   help="waiting prompt tokens beyond which requests get 429 (0: no limit)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The frozen EngineConfig of a namespace parsed with ``add_engine_args``, built by the
    builder behind ``LLM(...)``."""
    return engine_config(**engine_kwargs_from_args(args))


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``engine_config`` keywords of a namespace parsed with ``add_engine_args``."""
    kwargs = {a.name: getattr(args, a.name) for a in engine_args()}
    kwargs["model"] = getattr(args, "model_tag", None) or args.model
    # --static-batch-size has a CLI default (8) and only counts under --scheduling static.
    if args.scheduling != "static":
        kwargs["static_batch_size"] = None
    return kwargs


# -- LLM(...) and the docs ---------------------------------------------------------------------


def llm_parameters() -> list[inspect.Parameter]:
    """The parameters ``LLM.__init__`` must have (after self): model positional, the rest keywords."""
    return [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD if a.name == "model"
                              else inspect.Parameter.KEYWORD_ONLY, default=a.default)
            for a in engine_args()]


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def llm_docstring() -> str:
    """The engine arguments as the ``Args:`` section of ``LLM.__init__``'s docstring."""
    lines = ["", "Args:"]
    for a in engine_args():
        choices = f" ({', '.join(a.choices)})" if a.choices else ""
        text = f"{a.name}{choices}: {a.help} [default: {_show(a.default)}; CLI: {a.flags[0]}]"
        lines.append(textwrap.fill(text, 100, initial_indent="    ", subsequent_indent="        ",
                                   break_on_hyphens=False, break_long_words=False))
    return "\n".join(lines) + "\n"


def flags_markdown() -> str:
    """The engine flag reference table of docs/operations.md."""
    rows = ["| flag | `LLM(...)` keyword | default | meaning |", "|---|---|---|---|"]
    for a in engine_args():
        flags = ", ".join(f"`{f}`" for f in a.flags)
        if a.type is bool:
            flags += f" / `--no-{a.flags[0][2:]}`"
        if a.name == "model":
            flags = "`MODEL` (serve, doctor), " + flags
        if a.name == "static_batch_size":
            flags = "`--scheduling static`, " + flags
        if a.choices:
            flags += " " + "\\|".join(a.choices)
        default = _show(a.cli_default)
        if a.default != a.cli_default:
            default += f" (`LLM`: {_show(a.default)})"
        meaning = a.help.replace("|", "\\|")
        rows.append(f"| {flags} | `{a.name}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
