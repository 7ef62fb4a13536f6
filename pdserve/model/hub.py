"""Hugging Face hub ids (``org/name``) turned into local checkpoint folders.

``huggingface_hub`` does the work: it downloads into its cache (``HF_HUB_CACHE``, or
``--download-dir``), reuses what is there, and with ``HF_HUB_OFFLINE=1`` only looks in the
cache. Only the files the engine reads are fetched, never ``*.bin``/``*.pth`` duplicates.
"""

from __future__ import annotations

import dataclasses
import os
import re

from pdserve.config import ModelConfig

# config, tokenizer, generation config, chat template and weights: everything pdserve reads.
CONFIG_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                   "chat_template*"]
WEIGHT_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFoundError(ValueError):
    """A model argument that is neither a folder, a preset nor a reachable hub id."""


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not a local path (a path that exists always wins)."""
    return bool(_HUB_ID.fullmatch(name)) and not os.path.exists(name) \
        and not name.startswith(".")


def download(repo_id: str, revision: str | None = None, download_dir: str | None = None,
             weights: bool = True) -> str:
    """The local snapshot folder of ``repo_id``; raises ``ModelNotFoundError`` in one line."""
    from huggingface_hub import constants, snapshot_download

    patterns = CONFIG_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                 allow_patterns=patterns,
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one readable line
        raise ModelNotFoundError(_explain(repo_id, revision, exc)) from exc


def _explain(repo_id: str, revision: str | None, exc: Exception) -> str:
    from huggingface_hub import constants, errors

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    if isinstance(exc, errors.GatedRepoError):
        return f"{where} is gated: accept its licence on huggingface.co and set HF_TOKEN"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{where}: no such revision on the Hugging Face hub"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"{where} is not a local folder, not a preset and not a model on the Hugging "
                "Face hub (a private model needs HF_TOKEN)")
    if isinstance(exc, errors.LocalEntryNotFoundError) or constants.HF_HUB_OFFLINE:
        return (f"{where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the "
                "hub cannot be reached (HF_HUB_OFFLINE is set or the network is down)")
    return f"{where}: cannot download from the Hugging Face hub: {exc}".splitlines()[0]


def resolve_model_config(model_config: ModelConfig) -> ModelConfig:
    """``model_config`` with hub ids in ``model`` and ``tokenizer`` replaced by local folders.

    Weights are not fetched for ``--load-format dummy``: only the shapes are needed.
    """
    changes = {}
    if is_hub_id(model_config.model):
        changes["model"] = download(model_config.model, model_config.revision,
                                    model_config.download_dir,
                                    weights=model_config.load_format != "dummy")
    if model_config.tokenizer and is_hub_id(model_config.tokenizer):
        changes["tokenizer"] = download(model_config.tokenizer, None,
                                        model_config.download_dir, weights=False)
    return dataclasses.replace(model_config, **changes) if changes else model_config
