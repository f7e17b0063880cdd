"""generation_config.json: read, and turned into the sampling defaults a request gets when it sets none."""

from __future__ import annotations

import json
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


HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}  # transformers' GenerationConfig


def sampling_defaults(gen: dict, where: str = "generation_config.json") -> tuple[float, float, int]:
    """(temperature, top_p, top_k) a request gets when it leaves them unset: what transformers' generate()
    uses for this generation_config.json. ``do_sample`` false or absent: greedy (0, 1, 0); true: its
    temperature, top_p and top_k, transformers' defaults (1, 1, 50) for those absent. A value of the wrong
    type or out of range stops start-up."""
    if not gen.get("do_sample", False):
        return 0.0, 1.0, 0
    values = {k: d if gen.get(k) is None else gen[k] for k, d in HF_SAMPLING_DEFAULTS.items()}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{where}: {name} = {value!r} must be a number")
    temperature, top_p, top_k = float(values["temperature"]), float(values["top_p"]), values["top_k"]
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"{where}: temperature = {temperature!r} must be a finite number >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"{where}: top_p = {top_p!r} must be in (0, 1]")
    if top_k != int(top_k) or top_k < 0:
        raise ValueError(f"{where}: top_k = {top_k!r} must be an integer >= 0")
    return temperature, top_p, int(top_k)
