"""Settings files: the speculative settings that `vegas tune` recommends, read back by
`vegas generate`, `vegas compare` and any other front end with `--config FILE`.

A settings file is one JSON object:

    {"format": "vegas-config", "version": 1,
     "speculative": {"method": "vegas", "gamma": 5, "ratio": 0.04, ...},
     "measured": {...}}

`speculative` holds `SpecConfig` fields (checked by `SpecConfig` itself); `measured` says
where the setting comes from (model, device, workload, throughput) and is not read back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from vegas_spec.config import ConfigError, SpecConfig

FORMAT, VERSION = "vegas-config", 1
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SpecConfig))


def write_config(path: Path, spec: SpecConfig, measured: dict[str, Any]) -> None:
    data = {"format": FORMAT, "version": VERSION, "speculative": dataclasses.asdict(spec),
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
    unknown = sorted(set(spec) - set(SPEC_FIELDS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown speculative setting(s) "
                          f"{', '.join(unknown)}; known: {', '.join(SPEC_FIELDS)}")
    try:
        return SpecConfig(**spec)
    except ConfigError as err:
        raise ConfigError(f"config file {path}: {err}") from None
