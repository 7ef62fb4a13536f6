"""generation_config.json as request defaults (vLLM's --generation-config auto|vllm|FOLDER)."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.model.generation_config import sampling_defaults


def _folder(tmp_path, name: str, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


LLAMA3_INSTRUCT = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                   "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0"}


def test_auto_takes_the_supported_fields(tmp_path):
    model = _folder(tmp_path, "model", {**LLAMA3_INSTRUCT, "top_k": 20, "max_new_tokens": 64})
    assert sampling_defaults("auto", str(model)) == {"temperature": 0.6, "top_p": 0.9,
                                                     "top_k": 20, "max_tokens": 64}


def test_vllm_keeps_the_engine_defaults(tmp_path):
    assert sampling_defaults("vllm", str(_folder(tmp_path, "model", LLAMA3_INSTRUCT))) == {}


def test_a_folder_overrides_the_model(tmp_path):
    model = _folder(tmp_path, "model", LLAMA3_INSTRUCT)
    other = _folder(tmp_path, "other", {"temperature": 0.2})
    assert sampling_defaults(str(other), str(model)) == {"temperature": 0.2}
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path), str(model))


def test_no_file_and_preset_give_no_defaults(tmp_path):
    assert sampling_defaults("auto", str(tmp_path)) == {}
    assert sampling_defaults("auto", "tiny") == {}


def test_unsupported_fields_are_logged_not_dropped_silently(tmp_path, caplog):
    model = _folder(tmp_path, "model", {"temperature": 0.7, "repetition_penalty": 1.05,
                                        "min_p": 0.0, "num_beams": 1})
    with caplog.at_level(logging.WARNING, logger="pdserve.model.generation_config"):
        assert sampling_defaults("auto", str(model)) == {"temperature": 0.7}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # min_p 0 and num_beams 1 change nothing, so only repetition_penalty is worth a word.
    assert warnings == ["generation config: repetition_penalty=1.05 not supported by "
                        "pdserve, not applied"]


def test_invalid_values_stop_start_up(tmp_path):
    model = _folder(tmp_path, "model", {"top_p": 0.0})
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_defaults("auto", str(model))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling_defaults("auto", str(broken))
