"""Hub ids resolved through huggingface_hub's cache, offline: no test touches the network."""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import constants

from pdserve import LLM, SamplingParams
from pdserve.config import ModelConfig
from pdserve.model.hub import ModelNotFoundError, is_hub_id, resolve_model_config
from pdserve.model.testing import write_hub_cache

REPO = "acme/tiny-llama"


@pytest.fixture
def offline(monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE at import; the subprocess tests set the variable.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hub_cache(tmp_path, llama_ckpt):
    cache = tmp_path / "hub"
    write_hub_cache(cache, REPO, llama_ckpt[0])
    return cache


def _greedy_tokens(model: str, **options) -> list[list[int]]:
    llm = LLM(model, dtype="float32", device="cpu", **options)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": [5, 17, 42, 99]},
                            {"prompt_token_ids": [7, 8]}], params)
    return [o.outputs[0].token_ids for o in outputs]


def test_hub_id_loads_from_the_cache_like_the_folder(offline, hub_cache, llama_ckpt):
    by_id = _greedy_tokens(REPO, download_dir=str(hub_cache))
    assert by_id == _greedy_tokens(str(llama_ckpt[0]))
    assert len(by_id[0]) == 12


def test_resolved_folder_is_the_cached_snapshot(offline, hub_cache):
    model = resolve_model_config(ModelConfig(model=REPO, download_dir=str(hub_cache)))
    assert model.model.startswith(str(hub_cache / "models--acme--tiny-llama" / "snapshots"))
    assert json.loads(open(f"{model.model}/config.json").read())["num_hidden_layers"] == 2


def test_revision_picks_a_ref_or_a_commit(offline, hub_cache, qwen2_ckpt):
    v2 = write_hub_cache(hub_cache, REPO, qwen2_ckpt[0], ref="v2")
    by_ref = resolve_model_config(ModelConfig(model=REPO, revision="v2",
                                              download_dir=str(hub_cache)))
    by_commit = resolve_model_config(ModelConfig(model=REPO, revision=v2.name,
                                                 download_dir=str(hub_cache)))
    main = resolve_model_config(ModelConfig(model=REPO, download_dir=str(hub_cache)))
    assert by_ref.model == by_commit.model == str(v2)
    assert main.model != str(v2)


def test_tokenizer_hub_id_resolves_too(offline, hub_cache):
    model = resolve_model_config(ModelConfig(model="tiny", tokenizer=REPO,
                                             download_dir=str(hub_cache)))
    assert model.model == "tiny"
    assert model.tokenizer.startswith(str(hub_cache / "models--acme--tiny-llama"))


def test_unknown_id_or_revision_offline_is_one_clear_line(offline, hub_cache):
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache") as info:
        resolve_model_config(ModelConfig(model="acme/nothing", download_dir=str(hub_cache)))
    assert "\n" not in str(info.value)
    with pytest.raises(ModelNotFoundError, match="revision 'v9'"):
        resolve_model_config(ModelConfig(model=REPO, revision="v9",
                                         download_dir=str(hub_cache)))


def test_dummy_weights_need_only_the_config(offline, tmp_path, llama_ckpt):
    shapes_only = tmp_path / "shapes"
    shapes_only.mkdir()
    shutil.copy(llama_ckpt[0] / "config.json", shapes_only / "config.json")
    write_hub_cache(tmp_path / "hub", REPO, shapes_only)
    llm = LLM(REPO, load_format="dummy", download_dir=str(tmp_path / "hub"), device="cpu")
    assert llm.engine.arch.num_layers == 2 and llm.engine.arch.vocab_size == 320


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "ckpt").mkdir(parents=True)
    assert is_hub_id("meta-llama/Llama-3.2-1B-Instruct")
    assert not is_hub_id("local/ckpt")  # an existing folder wins
    assert not is_hub_id("./org/name") and not is_hub_id("/abs/path") and not is_hub_id("tiny")
