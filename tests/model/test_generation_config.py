"""The model's sampling defaults (--generation-config): read from a folder's generation_config.json or a GGUF's
general.sampling keys, overridden, and refused with the source named when they are not values a request could
take."""
from __future__ import annotations

import json

import gguf
import pytest

from tokenmill.config import EngineArgs
from tokenmill.model.generation_config import default_sampling


def _folder(tmp_path, config: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_folders_generation_config_gives_the_six_sampling_defaults(tmp_path) -> None:
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
                                "repetition_penalty": None, "max_new_tokens": 64, "eos_token_id": [1, 2],
                                "transformers_version": "4.57.0"})
    assert default_sampling("auto", folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
                                                "max_tokens": 64}
    assert default_sampling("vllm", folder) == {}
    assert default_sampling(folder, None) == default_sampling("auto", folder)  # a folder named as the source
    assert default_sampling("auto", folder, {"temperature": 0.2, "max_new_tokens": 8}) == {
        "temperature": 0.2, "top_p": 0.95, "top_k": 20, "min_p": 0, "max_tokens": 8}
    assert default_sampling("vllm", folder, {"top_k": 5}) == {"top_k": 5}


def test_a_folder_without_the_file_has_no_defaults(tmp_path) -> None:
    assert default_sampling("auto", str(tmp_path)) == {}


def test_a_gguf_files_sampling_keys_are_its_defaults(tmp_path) -> None:
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert default_sampling("auto", path) == {"temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}


def test_the_default_model_sets_none(default_model_path) -> None:
    assert default_sampling("auto", default_model_path) == {}


@pytest.mark.parametrize("config, message", [
    ({"temperature": -1.0}, "temperature must be"),
    ({"top_p": 0}, "top_p must be"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"top_k": "many"}, "top_k must be"),
])
def test_a_value_no_request_could_take_is_refused_naming_the_file(tmp_path, config: dict, message: str) -> None:
    folder = _folder(tmp_path, config)
    with pytest.raises(ValueError, match=message) as e:
        default_sampling("auto", folder)
    assert "generation_config.json" in str(e.value)


@pytest.mark.parametrize("kw, message", [
    ({"generation_config": "/no/such/folder"}, "generation_config must be 'auto'.*'vllm'.*or a folder holding "
                                               "generation_config.json; got '/no/such/folder'"),
    ({"override_generation_config": {"do_sample": True}}, "override_generation_config takes temperature, top_p, "
                                                          "top_k, min_p, repetition_penalty, max_new_tokens; got "
                                                          "do_sample"),
    ({"override_generation_config": {"temperature": -1}}, "override_generation_config: temperature must be"),
    ({"override_generation_config": [("temperature", 0.5)]}, "override_generation_config must be a dict or null"),
])
def test_bad_engine_options_are_refused_before_a_model_loads(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


def test_a_folder_source_is_taken(tmp_path) -> None:
    folder = _folder(tmp_path, {"temperature": 0.3})
    assert EngineArgs(generation_config=folder, override_generation_config={"top_p": 0.5}).generation_config == folder
