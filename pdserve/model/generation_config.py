"""A checkpoint's ``generation_config.json`` as request defaults, the way vLLM applies it.

With ``--generation-config auto`` the sampling fields the model's authors set (Llama 3 Instruct:
temperature 0.6, top_p 0.9) become the defaults of every request that does not set them;
``vllm`` keeps the engine's own defaults; a folder reads its ``generation_config.json``.
Fields the engine cannot honour are logged once, never silently dropped.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# generation_config.json name -> SamplingParams name: what the engine supports.
SUPPORTED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "max_new_tokens": "max_tokens"}
# Sampling knobs the engine does not have, with the value at which they do nothing.
UNSUPPORTED_NEUTRAL = {"repetition_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0,
                       "no_repeat_ngram_size": 0, "num_beams": 1, "min_new_tokens": None,
                       "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "length_penalty": 1.0}


def read_generation_config(source: str, model_folder: str) -> dict[str, Any]:
    """The raw generation config ``source`` (auto | vllm | FOLDER) points at; {} for none."""
    if source == "vllm":
        return {}
    folder = model_folder if source == "auto" else source
    path = os.path.join(folder, "generation_config.json")
    if source != "auto" and not os.path.isfile(path):
        raise ValueError(f"--generation-config {source}: no generation_config.json there")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None


def sampling_defaults(source: str, model_folder: str) -> dict[str, Any]:
    """SamplingParams fields to use when a request leaves them unset (validated here)."""
    raw = read_generation_config(source, model_folder)
    defaults = {ours: raw[theirs] for theirs, ours in SUPPORTED.items()
                if raw.get(theirs) is not None}
    ignored = {k: raw[k] for k, neutral in UNSUPPORTED_NEUTRAL.items()
               if k in raw and raw[k] != neutral}
    if ignored:
        log.warning("generation config: %s not supported by pdserve, not applied",
                    ", ".join(f"{k}={v}" for k, v in sorted(ignored.items())))
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation config of {model_folder}: {exc}") from None
    if defaults:
        log.info("request defaults from the generation config: %s", defaults)
    return defaults
