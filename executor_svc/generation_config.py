"""generation_config.json: read, and turned into the sampling defaults a request gets when it sets none."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path


def read_generation_config(path: Path) -> dict:
    """generation_config.json as a dict ({} when the checkpoint has none)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model {path}: generation_config.json is unreadable: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"model {path}: generation_config.json must hold a JSON object")
    return data


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """What a request that leaves a sampling field unset gets. Without generation_config.json: OpenAI's and vLLM's
    defaults (temperature 1: sampled; no top-p, top-k, repetition penalty or min-p)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    repetition_penalty: float = 1.0
    min_p: float = 0.0


def sampling_defaults(gen: dict, where: str = "generation_config.json") -> RequestDefaults:
    """The defaults vLLM takes from a checkpoint's generation_config.json (its --generation-config auto, the
    default): each of temperature, top_p, top_k, repetition_penalty and min_p that the file sets, OpenAI's and
    vLLM's own for the rest. ``do_sample`` is not read (vLLM does not: a file with do_sample false and temperature
    0.6 samples at 0.6; one with neither samples at 1). A value of the wrong type or out of range stops start-up."""
    values = {f.name: gen[f.name] for f in fields(RequestDefaults) if gen.get(f.name) is not None}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}: {name} = {value!r} must be a finite number")
    if values.get("top_k") == -1:  # (vLLM's spelling of "no top-k filter")
        values["top_k"] = 0
    checks = {"temperature": (lambda v: v >= 0, "must be >= 0 (0: greedy)"),
              "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
              "top_k": (lambda v: v == int(v) and v >= 0, "must be an integer >= 0 (0 or -1: no top-k filter)"),
              "repetition_penalty": (lambda v: v > 0, "must be > 0 (1: no penalty)"),
              "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]")}
    for name, value in values.items():
        ok, rule = checks[name]
        if not ok(value):
            raise ValueError(f"{where}: {name} = {value!r} {rule}")
    return RequestDefaults(**{k: int(v) if k == "top_k" else float(v) for k, v in values.items()})
