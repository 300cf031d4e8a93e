"""Settings files: the speculative settings that `vegas tune` recommends, read back by
`vegas generate`, `vegas compare` and any other front end with `--config FILE`.

A settings file is one JSON object:

    {"format": "vegas-config", "version": 1,
     "speculative": {"method": "vegas", "gamma": 5, "ratio": 0.04, ...},
     "measured": {...}}

`speculative` holds `SpecConfig.as_dict()`: the shared fields and the method's own settings,
flat (checked by `SpecConfig` itself, which names a setting its method lacks); `measured` says
where the setting comes from (model, device, workload, throughput) and is not read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vegas_spec.config import ConfigError, SpecConfig, spec_config

FORMAT, VERSION = "vegas-config", 1


def write_config(path: Path, spec: SpecConfig, measured: dict[str, Any]) -> None:
    data = {"format": FORMAT, "version": VERSION, "speculative": spec.as_dict(),
            "measured": measured}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def read_config(path: Path) -> SpecConfig:
    """The SpecConfig a settings file holds; ConfigError (naming the file) when it is missing,
    not JSON, not a settings file, or holds an unknown or invalid field."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file {path} is not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"config file {path} is not a settings file written by `vegas tune` "
                          f"(no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ConfigError(f"config file {path} has version {data.get('version')!r}; this "
                          f"version of vegas reads version {VERSION}")
    spec = data.get("speculative")
    if not isinstance(spec, dict):
        raise ConfigError(f"config file {path} has no \"speculative\" object")
    try:
        return spec_config(spec)
    except ConfigError as err:
        raise ConfigError(f"config file {path}: {err}") from None
