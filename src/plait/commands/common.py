"""What several ``plait`` verbs share: the one-line user error, and flag values read from a
``--config`` file (``train``, ``info``, ``simulate``, ``plan``).

Errors a user can cause end as one line, ``plait VERB: error: ...``, on stderr and exit
code 2; a run stopped by Ctrl-C exits 130, by SIGTERM 143 (``die``).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import yaml

TRUST_HELP = ("load checkpoints under PATH although their manifest is not signed with your "
              "plait key: loading runs code their author can choose (a DCP .metadata is a "
              "pickle); only for checkpoints you trust (docs/security.md)")  # fmt: skip


class UserError(Exception):
    """Bad input: printed as one line, exit code 2."""


def die(prog: str, msg: str, code: int = 2) -> int:
    """Print ``plait PROG: error: MSG`` on stderr and return ``code`` (the exit code)."""
    from plait.errors import printable

    label = "" if code in (130, 143) else "error: "  # a signal is the user's choice
    # the line may quote a worker, a store or a file: no control character reaches the terminal
    print(f"plait {prog}: {label}{printable(msg)}", file=sys.stderr)
    return code


def read_config_file(path: str, *, run: bool = True) -> dict:
    """Flag values from a YAML or TOML file: flat keys named like the flags (``tp: 2``,
    ``global-batch-size: 16``), or a ``config.yaml`` written by ``plait train`` (whose
    data section and run folder only ``train`` reads: left out unless ``run``)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: no such file")
    try:
        text = p.read_text()
        raw = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"--config {path}: not valid {'TOML' if p.suffix == '.toml' else 'YAML'} "
                        f"({str(e).splitlines()[0]})")  # fmt: skip
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values")
    flat = {}
    if isinstance(raw.get("model"), dict):  # a resolved config.yaml
        for section in ("layout", "train", "lora", "qat", "dp_algo", "data", "resilience"):
            if raw.get(section) is not None and not isinstance(raw[section], dict):
                raise UserError(f"--config {path}: {section}: expected a mapping of its "
                                f"fields, got {type(raw[section]).__name__}")  # fmt: skip
        m = raw["model"]
        flat.update(
            layers=m.get("n_layers"), hidden=m.get("hidden"), heads=m.get("n_heads"),
            kv_heads=m.get("n_kv_heads"), ffn_hidden=m.get("ffn_hidden"),
            vocab_size=m.get("vocab_size"), seq_len=m.get("seq_len"), arch=m.get("arch"),
            dropout=m.get("dropout"),
        )  # fmt: skip
        for section in ("layout", "train"):
            flat.update(raw.get(section) or {})
        lora, qat = raw.get("lora") or {}, raw.get("qat") or {}
        flat.update(lora_rank=lora.get("rank"), lora_alpha=lora.get("alpha"),
                    lora_targets=",".join(lora.get("targets") or []) or None,
                    qat=qat.get("dtype"),
                    quant_group_size=qat.get("group_size") if qat.get("dtype") == "int4" else None)  # fmt: skip
        algo = dict(raw.get("dp_algo") or {})
        if "algo" in algo:
            algo["dp_algo"] = algo.pop("algo")
        flat.update(algo)
        if run:
            d = raw.get("data") or {}
            flat.update(data=d.get("path"), tokenizer=d.get("tokenizer"),
                        cache_dir=d.get("cache_dir"), val_fraction=d.get("val_fraction"),
                        text_column=d.get("text_column"))  # fmt: skip
            if "out" in raw:
                flat["out"] = raw["out"]
            res = dict(raw.get("resilience") or {})  # a run's, like its data and folder
            if "respawn" in res:
                res["no_respawn"] = not res.pop("respawn")
            flat.update(res)
        flat.pop("resume", None)
        flat.pop("resume_from", None)
        flat.pop("trust_checkpoint", None)  # trust is given each time, never inherited
        return {k: v for k, v in flat.items() if v is not None}
    return {str(k).replace("-", "_"): v for k, v in raw.items()}


def merged_values(
    args: argparse.Namespace, parser: argparse.ArgumentParser, *, run: bool = False
) -> dict:
    """Config file values overridden by the flags given on the command line (``run``: the
    command trains, and takes a run config's data and folder too)."""
    values = {}
    if getattr(args, "config", None):
        values = read_config_file(args.config, run=run)
        from plait.train.config import TRAIN_FIELDS

        known = {a.dest for a in parser._actions} | TRAIN_FIELDS
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"--config {args.config}: unknown key {unknown[0]!r}")
        actions = {a.dest: a for a in parser._actions}
        for key in list(values):
            if key in actions:
                values[key] = _config_value(args.config, key, values[key], actions[key])
    for k, v in vars(args).items():
        if v is not None and k != "config":
            values[k] = v
    return values


def _config_value(path: str, key: str, value, action: argparse.Action):
    """A config file's ``value`` for the flag ``action`` as the command line would have
    parsed it: a switch takes true / false, a number a number (or a string that reads as
    one, like the flag's), a choice one of its choices; anything else one line naming the
    file and the key."""

    def bad(want: str):
        return UserError(f"--config {path}: {key}: expected {want}, got {value!r}")

    if action.nargs == 0:  # a switch (store_true / store_false)
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if (
        _lists(action.type)
        and isinstance(value, list)
        and all(isinstance(v, (int, float, str)) for v in value)
    ):  # a flag of a,b,c
        value = ",".join(str(v) for v in value)
    if isinstance(value, (dict, list)) or (isinstance(value, bool) and action.type is not None):
        raise bad("one value" if action.type is None else _type_name(action.type))
    if action.type is not None and value is not None:
        if action.type is int and isinstance(value, float) and not value.is_integer():
            raise bad("an integer")
        try:
            value = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise bad(_type_name(action.type)) from None
    if action.choices is not None and value is not None and value not in action.choices:
        raise bad("one of " + ", ".join(map(str, action.choices)))
    return value


def _lists(t) -> bool:
    """The flag's type parses a comma-separated list (``cli_args``' ``_int_list`` ...)."""
    return "list" in getattr(t, "__name__", "")


def _type_name(t) -> str:
    if _lists(t):
        return "a list (a, b, ... or [a, b, ...])"
    return {int: "an integer", float: "a number"}.get(t, "a value the flag takes")
