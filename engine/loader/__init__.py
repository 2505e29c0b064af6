"""Model loading: HF directories (config.json + safetensors) and GGUF files."""
from engine.loader.default_model import default_model_path
from engine.loader.gguf_weights import load_gguf
from engine.loader.hf_config import load_hf_config, model_config_from_hf
from engine.loader.hf_weights import load_hf_weights
from engine.loader.load import load_model_source, resolve_model_path

__all__ = ["default_model_path", "load_gguf", "load_hf_config", "load_hf_weights",
           "load_model_source", "model_config_from_hf", "resolve_model_path"]
