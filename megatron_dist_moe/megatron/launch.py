"""Run an unmodified Megatron-LM entry point with the dist_moe plugin installed.

    python -m megatron_dist_moe.megatron.launch [--config MODEL.yaml ...] SCRIPT [ARGS...]
    torchrun ... -m megatron_dist_moe.megatron.launch --config configs/megatron/x.yaml \\
        pretrain_gpt.py --mock-data ...

Calls megatron_dist_moe.megatron.install(), then runs SCRIPT as `__main__` with its directory
first on sys.path, as `python SCRIPT` would.

--config files are flat YAML mappings of Megatron-LM argument names (underscores or dashes) to
values, plus an optional `dist_moe:` mapping for the plugin's `--dist-moe-*` options. They are
expanded into command-line flags placed *before* ARGS, so explicit ARGS override them:

    key: true        -> --key            (false / null: flag omitted)
    key: [a, b]      -> --key a b
    key: value       -> --key value
    dist_moe: {backend: cuda}  -> --dist-moe-backend cuda
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any, Mapping

__all__ = ["main", "yaml_to_argv", "load_config_argv"]


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def yaml_to_argv(mapping: Mapping[str, Any]) -> list[str]:
    """Megatron-LM command-line flags for a flat mapping (see the module docstring)."""
    argv: list[str] = []
    for key, value in mapping.items():
        if key == "dist_moe":
            if not isinstance(value, Mapping):
                raise ValueError("the `dist_moe:` section must be a mapping of option: value")
            argv += yaml_to_argv({f"dist_moe_{k}": v for k, v in value.items()})
        elif isinstance(value, Mapping):
            raise ValueError(f"{key}: nested sections are not Megatron-LM arguments "
                             "(only `dist_moe:` may be a mapping)")
        elif value is True:
            argv.append(_flag(key))
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [_flag(key), *(str(v) for v in value)]
        else:
            argv += [_flag(key), str(value)]
    return argv


def load_config_argv(path: str) -> list[str]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of Megatron-LM argument names to values")
    return yaml_to_argv(data)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_argv: list[str] = []
    while argv and argv[0] == "--config":
        if len(argv) < 2:
            raise SystemExit("megatron_dist_moe.megatron.launch: --config needs a YAML file")
        config_argv += load_config_argv(argv[1])
        argv = argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_dist_moe.megatron.launch: no such script: {script}")
    from . import install

    install()
    sys.argv = [script, *config_argv, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
