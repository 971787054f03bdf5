"""vLLM 0.33.0's ``vllm serve`` command line as committed data, and a checker that
refuses the extra arguments vLLM's own parser would refuse -- without importing vLLM.

The launcher appends the user's extra arguments to the end of the ``vllm serve``
command (:func:`spillway_engine.launcher.serve.build_command`: ``vllm serve MODEL ...
--port N <extra args>``). An argument vLLM's parser refuses there makes every pod exit
2 at start. :func:`refusal` runs the same parse on ``serve MODEL --host H --port N
<extra args>`` and returns vLLM's own message (argparse's wording: ``unrecognized
arguments: ...``, ``argument --x: expected one argument``, ``invalid choice``,
``ambiguous option``, ``ignored explicit argument``), or None when vLLM's parser
accepts them. The operator (the spec model and the CRD's CEL rule) and the launcher
all use it; none has to import vLLM.

What vLLM does, and what the checker reproduces:

* ``vllm serve`` is a subcommand of a top-level parser (``vllm/entrypoints/cli/main.py``:
  ``-h``/``-v`` options, one sub-parser per command); the serve parser is a
  ``FlexibleArgumentParser`` (``vllm/utils/argparse_utils.py``) with ``allow_abbrev``
  on, so any unambiguous prefix of a long option is that option (``--max-num-s`` is
  ``--max-num-seqs``); a prefix of two is ``ambiguous option``.
* Before argparse sees them, ``FlexibleArgumentParser.parse_args`` rewrites the
  arguments (:func:`preprocess` is that code, ported): ``_`` becomes ``-`` in a long
  option's name up to its first ``.``; ``-O3`` / ``-O=3`` / ``-O 3`` become
  ``--optimization-level 3``; a dotted argument (``--kv-events-config.endpoint=x`` or
  ``--x.key value``, any token starting with ``-`` that holds a ``.``, negative decimals
  included) is folded into one JSON value appended at the end (``--x '{"key": ...}'``),
  and without ``=`` it takes the next token as its value whatever it is (none: vLLM
  fails with ``IndexError``); ``--model X`` is moved to the front; ``--config FILE``
  is read from disk (not checkable here: the checker refuses it).
* ``--no-x`` / ``--disable-x`` forms of boolean options are registered option strings
  (``BooleanOptionalAction``, vLLM's ``EnableDisableAction``), so they are in the
  table; the names argparse shows in messages are the visible ones.
* A token ``--omni`` anywhere hands the command to vllm-omni, which the engine image
  does not have (vLLM exits 1); ``-h``/``--help`` print help and exit 0. Both are
  refused: neither serves.

Values are converted as vLLM's parser converts them where the option's type is a plain
one (:data:`TYPES`: ``int``, ``float``, their ``optional_type`` forms, human-readable
sizes), so
``--max-num-seqs abc`` is refused with argparse's ``invalid int value: 'abc'``, and
choices are checked on the converted value. Not checked here (vLLM checks them when it
starts): values of other types (JSON of a config class and kin), whose options the
table leaves without a ``type``; ``--lora-modules``' value format;
combinations vLLM's ``validate_parsed_serve_args`` and engine config refuse.

The table (``vllm_serve_args.json`` beside this file) is generated from vLLM's real
parser: ``python -m spillway_engine.vllm_cli --write`` (needs vLLM; sets
``VLLM_TARGET_DEVICE=cpu`` unless set). ``tests/contract/test_vllm_cli.py`` checks it
equals what vLLM 0.33.0 builds and that :func:`refusal` agrees with vLLM's parser.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TABLE_FILE = Path(__file__).with_name("vllm_serve_args.json")
WRITE_COMMAND = "python -m spillway_engine.vllm_cli --write"

#: What the launcher's command has before the extra arguments, as far as a verdict can
#: tell: the model, then options that have taken their values (it ends ``--host H
#: --port N``). An option before them matters: with none, argparse lets the model's
#: optional positional swallow a following ``--``. tests/contract/test_vllm_cli.py
#: parses the launcher's real command.
_PREFIX = ("serve", "MODEL", "--host", "0.0.0.0", "--port", "8000")

OMNI_MESSAGE = "--omni flag requires a valid instance of vllm-omni to be installed."
HELP_MESSAGE = "{option}: vllm serve prints its help and exits (status 0) instead of serving"
CONFIG_MESSAGE = (
    "--config: vllm serve reads the named YAML file before parsing; it cannot be checked here"
)
CRASH_MESSAGE = "vllm serve fails before parsing its arguments: {kind}: {error}"
#: FlexibleArgumentParser.error's hint, appended when --task is among the unrecognized
TASK_HINT = (
    "\n\nHint: --task is not a vllm serve option. "
    "For embedding, reranking, or reward models, use "
    "--runner pooling. To adapt a generative model for pooling, "
    "also use --convert embed, --convert classify, or "
    "--convert reward."
)


# ------------------------------------------------------------------- the table


@functools.cache
def load_table() -> dict[str, Any]:
    """The committed table (``vllm_serve_args.json``)."""
    return json.loads(TABLE_FILE.read_text())


def long_option_names(table: dict[str, Any] | None = None) -> list[str]:
    """Every long option string of ``vllm serve`` (hidden ``--no-`` forms included),
    without the leading ``--``, in the parser's order."""
    table = table or load_table()
    return [s[2:] for o in table["options"] for s in o["strings"] if s.startswith("--")]


def option_key(token: str) -> str:
    """The option a long token names as vLLM's rewriting leaves it: the part before
    ``=`` and before the first ``.``, ``_`` turned into ``-`` (``--kv_events_config.a=1``
    -> ``--kv-events-config``)."""
    return token.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


@functools.cache
def name_prefixes() -> frozenset[str]:
    """Every long option name without ``--`` and every prefix of one (argparse takes
    an unambiguous prefix as the option; an ambiguous one is refused by :func:`refusal`,
    not here)."""
    return frozenset(n[:k] for n in long_option_names() for k in range(1, len(n) + 1))


def prefix_tables() -> tuple[list[str], dict[str, str]]:
    """:func:`name_prefixes` in a form small enough for a CRD: the prefixes shared by
    two or more names (exact names that begin another included), and each other name
    keyed by its shortest prefix that begins no other name. A string is in
    :func:`name_prefixes` iff it is shared, or some key of the second table begins it
    and that key's name begins with it."""
    names = long_option_names()
    count: dict[str, int] = defaultdict(int)
    for n in set(names):
        for k in range(1, len(n) + 1):
            count[n[:k]] += 1
    shared = sorted(p for p, c in count.items() if c > 1)
    unique = {}
    for n in names:
        first = next((n[:k] for k in range(1, len(n) + 1) if count[n[:k]] == 1), None)
        if first is not None:
            unique[first] = n
    return shared, dict(sorted(unique.items()))


def unknown_long_flag(token: str) -> bool:
    """The CRD's per-item rule (one token, no context): ``token`` is a long option
    vLLM's parser cannot take as any of its options, exactly or as a prefix. Such a
    token is refused wherever it stands, except as the value a dotted argument without
    ``=`` swallows (``--kv-events-config.endpoint --x``), which this over-refuses;
    tokens with a space are positionals to argparse and left to :func:`refusal`."""
    if not token.startswith("--") or " " in token:
        return False
    key = option_key(token)
    return len(key) > 2 and key[2:] not in name_prefixes()


def int_options(table: dict[str, Any] | None = None) -> dict[str, str]:
    """Each long option name (no ``--``) whose values vLLM converts with ``int``, with
    the option as argparse names it in messages (``--api-server-count/-asc``)."""
    table = table or load_table()
    return {s[2:]: "/".join(o.get("shown", o["strings"])) for o in table["options"]
            if o.get("type") == "int" for s in o["strings"] if s.startswith("--")}


#: A value no ``int`` takes, and simple enough for a CEL regex: letters only (or none).
_NOT_AN_INT = re.compile(r"[A-Za-z]*")


def bad_int_value(token: str) -> bool:
    """The CRD's per-item value rule: ``--name=value`` naming an int option exactly
    (``_`` read as ``-``, no ``.``) with a value of letters only, which vLLM refuses
    (``invalid int value``) wherever it stands, except as the value a dotted argument
    without ``=`` swallows, which this over-refuses as :func:`unknown_long_flag` does.
    A space-separated value is the next item, left to :func:`refusal`."""
    if not token.startswith("--") or "=" not in token:
        return False
    key, value = token.split("=", 1)
    if "." in key:
        return False
    return key[2:].replace("_", "-") in _int_names() and bool(_NOT_AN_INT.fullmatch(value))


@functools.cache
def _int_names() -> frozenset[str]:
    return frozenset(int_options())


# ------------------------------------------------------ FlexibleArgumentParser


def preprocess(args: Sequence[str]) -> list[str]:
    """``FlexibleArgumentParser.parse_args``' rewriting of vLLM 0.33.0, ported line for
    line (``vllm/utils/argparse_utils.py``); raises what it raises (IndexError,
    ValueError). ``--config`` (which reads a file) is the caller's to refuse first."""
    args = list(args)
    if args and args[0] == "serve":
        model_idx = next(
            (i for i, arg in enumerate(args) if re.match(r"^--model(=.+|$)", arg)), None
        )
        if model_idx is not None:
            if args[model_idx] == "--model":
                model_tag = args[model_idx + 1]
                rest_start_idx = model_idx + 2
            else:
                model_tag = args[model_idx].removeprefix("--model=")
                rest_start_idx = model_idx + 1
            args = ["serve", model_tag, *args[1:model_idx], *args[rest_start_idx:]]
        if (
            len(args) > 1
            and args[1].startswith("-")
            and not any(re.match(r"^--config(=.+|$)", arg) for arg in args)
            and any(re.match(r"^--served[-_]model[-_]name(=.+|$)", arg) for arg in args)
        ):
            raise ValueError(
                "`model` should be provided as the first positional argument when "
                "using `vllm serve`. i.e. `vllm serve <model> --<arg> <value>`."
            )

    def repl(match: re.Match[str]) -> str:
        return match.group(0).replace("_", "-")

    pattern = re.compile(r"(?<=--)[^\.]*")  # everything between the first -- and the first .
    processed_args: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            processed_args.append("--help")
        elif arg.startswith("--"):
            if "=" in arg:
                key, value = arg.split("=", 1)
                key = pattern.sub(repl, key, count=1)
                processed_args.append(f"{key}={value}")
            else:
                processed_args.append(pattern.sub(repl, arg, count=1))
        elif arg.startswith("-O") and arg != "-O":
            optimization_level = arg[3:] if arg[2] == "=" else arg[2:]
            processed_args += ["--optimization-level", optimization_level]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            processed_args.append("--optimization-level")
        else:
            processed_args.append(arg)

    def create_nested_dict(keys: list[str], value: Any) -> dict[str, Any]:
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        return nested

    def recursive_dict_update(original: dict[str, Any], update: dict[str, Any]) -> None:
        for k, v in update.items():
            if isinstance(v, dict) and isinstance(original.get(k), dict):
                recursive_dict_update(original[k], v)
            elif isinstance(v, list) and isinstance(original.get(k), list):
                original[k] += v
            else:
                original[k] = v

    delete: set[int] = set()
    dict_args: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    for i, processed_arg in enumerate(processed_args):
        if i in delete:  # the value of the argument before
            continue
        if processed_arg.startswith("--") and "." not in processed_arg:
            continue
        if processed_arg.startswith("-") and "." in processed_arg:
            if "=" in processed_arg:
                processed_arg, value_str = processed_arg.split("=", 1)
                if "." not in processed_arg:
                    continue  # the '.' was in the value
            else:
                value_str = processed_args[i + 1]
                delete.add(i + 1)
            if processed_arg.endswith("+"):
                processed_arg = processed_arg[:-1]
                value_str = json.dumps(list(value_str.split(",")))
            key, *keys = processed_arg.split(".")
            try:
                value = json.loads(value_str)
            except json.decoder.JSONDecodeError:
                try:
                    value = human_readable_int(value_str)
                except (ValueError, argparse.ArgumentTypeError):
                    value = value_str
            recursive_dict_update(dict_args[key], create_nested_dict(keys, value))
            delete.add(i)
    processed_args = [a for i, a in enumerate(processed_args) if i not in delete]
    for dict_arg, dict_value in dict_args.items():
        processed_args.append(dict_arg)
        processed_args.append(json.dumps(dict_value))
    return processed_args


def human_readable_int(value: str) -> int:
    """vLLM's ``human_readable_int`` (``1k`` = 1000, ``1K`` = 1024), ported with its
    messages: :func:`preprocess` uses it, and options of this type are checked with it."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        try:
            return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                "Decimals are not allowed "
                f"with binary suffixes like {suffix}. Did you mean to use "
                f"{number}{suffix.lower()} instead?"
            ) from e
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    """vLLM's ``human_readable_int_or_auto``: also ``-1`` or ``auto`` (-1)."""
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


# --------------------------------------------------------------- the parser


class _Refused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Exits(Exception):
    def __init__(self, option: str) -> None:
        super().__init__(option)
        self.option = option


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


class _Takes(argparse.Action):
    """An option or positional that takes its ``nargs`` values and keeps nothing."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        pass


class _Exit(argparse.Action):
    """``--help`` / ``--version``: vLLM prints and exits when it reaches one."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        raise _Exits(option_string or "")


def _parse(return_type: Callable[[str], Any]) -> Callable[[str], Any]:
    """vLLM's ``parse_type(return_type)``: its ValueError as vLLM words it."""

    def _parse_type(val: str) -> Any:
        try:
            return return_type(val)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"Value {val} cannot be converted to {return_type}."
            ) from e

    return _parse_type


def _optional(return_type: Callable[[str], Any]) -> Callable[[str], Any]:
    """vLLM's ``optional_type(return_type)``."""

    def _optional_type(val: str) -> Any:
        if val == "" or val == "None":
            return None
        return _parse(return_type)(val)

    return _optional_type


def _lower_snake(val: str) -> str:
    """vLLM's ``lambda s: s.lower().replace("-", "_")`` (``--moe-backend`` and kin)."""
    return val.lower().replace("-", "_")


_lower_snake.__name__ = "<lambda>"  # as argparse names vLLM's lambda in its message

#: The value types the checker reproduces, with the names argparse shows when one
#: fails (``invalid int value: 'x'``): the table names each option's type when one of
#: these behaves as it does on every probe (:func:`_type_name`); an option whose type
#: is none of them (JSON of a config class, ...) is left to vLLM at start.
TYPES: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "optional_str": _optional(str),
    "optional_int": _optional(int),
    "optional_float": _optional(float),
    "lower_snake": _lower_snake,
    "human_readable_int": human_readable_int,
    "human_readable_int_or_auto": human_readable_int_or_auto,
}


@functools.cache
def _parser() -> _Parser:
    return build_parser(load_table())


def build_parser(table: dict[str, Any]) -> _Parser:
    """A parser with vLLM's structure: the top-level ``vllm`` parser and its ``serve``
    sub-parser, every option string and positional of the table, nothing stored."""
    top = _Parser(prog="vllm", add_help=False)
    for strings in table["top_options"]:
        top.add_argument(*strings, action=_Exit, nargs=0)
    sub = top.add_subparsers(dest="subparser", parser_class=_Parser)
    serve = sub.add_parser(
        "serve", prog=table["prog"], add_help=False, allow_abbrev=table["allow_abbrev"]
    )
    for p in table["positionals"]:
        serve.add_argument(p["dest"], nargs=p["nargs"], metavar=p["metavar"], action=_Takes)
    for o in table["options"]:
        kwargs: dict[str, Any] = {"nargs": o["nargs"], "dest": o["dest"]}
        if "choices" in o:
            kwargs["choices"] = o["choices"]
        if o.get("type"):
            kwargs["type"] = TYPES[o["type"]]
        action = serve.add_argument(*o["strings"], action=_Exit if o.get("exits") else _Takes,
                                    **kwargs)
        action.option_strings = o.get("shown", o["strings"])  # vLLM hides some from messages
    return top


def refusal(extra_args: Sequence[str], table: dict[str, Any] | None = None) -> str | None:
    """vLLM's message when ``vllm serve MODEL <extra_args>`` would not serve (its parser
    exits 2, or it exits before parsing), else None. The message is vLLM's own."""
    parser = _parser() if table is None else build_parser(table)
    args = [*_PREFIX, *extra_args]
    if "--omni" in args:  # vllm/entrypoints/cli/main.py, before any parsing
        return OMNI_MESSAGE
    if "--config" in args:
        return CONFIG_MESSAGE
    try:
        processed = preprocess(args)
    except (IndexError, ValueError) as e:
        return CRASH_MESSAGE.format(kind=type(e).__name__, error=e)
    try:
        parser.parse_args(processed)
    except _Exits as e:
        return HELP_MESSAGE.format(option=e.option)
    except _Refused as e:
        message = e.message
        task_hint = any(re.match(r"^--task(=.+|$)", a) for a in args[1:])
        if (
            task_hint
            and message.startswith("unrecognized arguments:")
            and re.search(r"(^|\s)--task(=|\s|$)", message)
        ):
            message += TASK_HINT
        return message
    return None


def one_line(message: str) -> str:
    return " ".join(message.split())


# ------------------------------------------------------------ generating it


def _outcome(func: Callable[[str], Any] | None, value: str) -> tuple[str, Any]:
    """What argparse makes of ``value`` with type ``func``: the value, or its message
    (``argparse.ArgumentParser._get_value``'s wording), or the exception it lets out."""
    if func is None:
        return ("ok", repr(value))
    try:
        return ("ok", repr(func(value)))  # repr: nan is not nan
    except argparse.ArgumentTypeError as e:
        return ("error", str(e))
    except (TypeError, ValueError):
        name = getattr(func, "__name__", repr(func))
        return ("error", f"invalid {name} value: {value!r}")
    except Exception as e:
        return ("crash", type(e).__name__)


#: Values a type is tried on before the table says the checker's type is the option's.
_PROBES = frozenset({
    "", "None", "none", "x", "X-Y_z", "1", "-1", "0", "1.5", "-0.5", "1e3", "inf", "nan",
    "AUTO", "a_b", "a-b", "  1 ", "1k", "1K", "0x10", "1_000", "{}", "[1]", "true", "\u0663",
})


def _type_name(action: argparse.Action) -> str | None:
    """The :data:`TYPES` entry that behaves as the action's type on every probe (None:
    no type); for an option without choices, "" when none does (not checked)."""
    probes = set(_PROBES)
    for c in action.choices or ():
        probes |= {str(c), str(c).upper(), str(c).replace("_", "-"), str(c).replace("-", "_")}
    candidates = {None: None, **TYPES}
    for name, func in candidates.items():
        if all(_outcome(action.type, p) == _outcome(func, p) for p in sorted(probes)):
            return name
    if action.choices is None:
        return ""
    raise SystemExit(
        f"{'/'.join(action.option_strings)}: its choices need a value type the checker does "
        f"not know ({action.type!r}); add it to vllm_cli.TYPES"
    )


def vllm_serve_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """vLLM's own top-level parser and its ``serve`` sub-parser, built as
    ``vllm/entrypoints/cli/main.py`` builds them (needs vLLM)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import importlib.metadata

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    top.add_argument(
        "-v", "--version", action="version", version=importlib.metadata.version("vllm")
    )
    serve = ServeSubcommand().subparser_init(top.add_subparsers(required=False, dest="subparser"))
    return top, serve


def build_table() -> dict[str, Any]:
    """The table, from vLLM's real parser (needs vLLM)."""
    import importlib.metadata

    top, serve = vllm_serve_parsers()
    if serve._mutually_exclusive_groups or serve.prefix_chars != "-" or (
        serve.fromfile_prefix_chars is not None
    ):
        raise SystemExit("vllm serve's parser has a feature the checker does not model")
    registered: dict[int, list[str]] = {}
    for string, action in serve._option_string_actions.items():
        registered.setdefault(id(action), []).append(string)
    options: list[dict[str, Any]] = []
    positionals: list[dict[str, Any]] = []
    order: list[str] = []
    for action in serve._actions:
        if action.required:
            raise SystemExit(f"{action.dest}: a required argument; the checker has none")
        if not action.option_strings:
            positionals.append({"dest": action.dest, "metavar": action.metavar,
                                "nargs": action.nargs})
            continue
        strings = registered[id(action)]
        order += strings
        entry: dict[str, Any] = {"strings": strings, "dest": action.dest, "nargs": action.nargs}
        if list(action.option_strings) != strings:
            entry["shown"] = list(action.option_strings)
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            entry["exits"] = True
        if action.choices is not None:
            entry["choices"] = list(action.choices)
            entry["type"] = _type_name(action)
        elif action.nargs != 0 and action.type is not None and (
                kind := _type_name(action)) not in (None, "", "str", "optional_str"):
            entry["type"] = kind  # a type that refuses values: checked as vLLM does
        if action.nargs == "?" and action.choices is not None and action.const is not None:
            raise SystemExit(f"{strings[0]}: an optional value with a constant and choices")
        options.append(entry)
    if order != list(serve._option_string_actions):
        raise SystemExit("vllm serve's option strings are not registered action by action")
    return {
        "generated_by": WRITE_COMMAND,
        "vllm_version": importlib.metadata.version("vllm"),
        "prog": serve.prog,
        "allow_abbrev": serve.allow_abbrev,
        "top_options": [list(a.option_strings) for a in top._actions if a.option_strings],
        "positionals": positionals,
        "options": options,
    }


def dump_table(table: dict[str, Any]) -> str:
    """The file's text: one option a line, so a new vLLM's changes read as a diff."""
    head = {k: v for k, v in table.items() if k != "options"}
    lines = [json.dumps(head, sort_keys=True)[:-1] + ', "options": [']
    rows = [json.dumps(o, sort_keys=True) for o in table["options"]]
    lines += [f"  {row}," for row in rows[:-1]] + [f"  {rows[-1]}", "]}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spillway_engine.vllm_cli",
        description="Write or check the committed vllm serve argument table (needs vLLM).",
    )
    parser.add_argument("--write", action="store_true", help=f"rewrite {TABLE_FILE.name}")
    args = parser.parse_args(argv)
    text = dump_table(build_table())
    if args.write:
        TABLE_FILE.write_text(text)
        print(f"wrote {TABLE_FILE}", file=sys.stderr)
        return 0
    if TABLE_FILE.read_text() != text:
        print(f"{TABLE_FILE.name} differs from the installed vLLM's parser; run {WRITE_COMMAND}",
              file=sys.stderr)
        return 1
    print(f"{TABLE_FILE.name} matches the installed vLLM", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
