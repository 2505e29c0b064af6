"""Tiny random Llama-family models, written to a directory as Hugging Face
would (config.json + model.safetensors + tokenizer.json), for fast CPU tests.

The random weights are scaled up so greedy argmaxes have a margin: a freshly
initialised model has near-uniform logits and batched vs unbatched float
math could otherwise flip a near-tie. Tests and benchmarks build their models here;
`hf_llama_from_state` and `load_hf_model` give transformers' reference model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "The capital of France is Paris. The capital of Italy is Rome. ",
    "Once upon a time there was a little model that served tokens very fast. ",
    "def hello(): return 'world'  # code 12345 67890 ",
    "héllo wörld, ünïcode and emoji 🙂🚀 are bytes too. ",
    "Paged attention stores keys and values in fixed blocks of tokens. ",
]


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return tok


def make_tiny_model(path: str | Path, arch: str = "llama", *, vocab_size: int = 384,
                    hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                    num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                    weight_scale: float = 20.0, seed: int = 0, rope_scaling: dict | None = None,
                    padded_vocab_size: int | None = None) -> Path:
    """Write a tiny random model of ``arch`` ("llama" or "qwen2") to ``path``. With
    ``padded_vocab_size`` the embedding (and lm_head) has that many rows, more than the
    tokenizer has tokens, as Qwen2 checkpoints do: the model can produce ids no token has."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    real_vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    if padded_vocab_size is not None and padded_vocab_size <= real_vocab:
        raise ValueError(f"padded_vocab_size {padded_vocab_size} must exceed the tokenizer's {real_vocab} tokens")
    common = dict(vocab_size=padded_vocab_size or real_vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, bos_token_id=tok.token_to_id("<|endoftext|>"),
                  eos_token_id=eos_id, rms_norm_eps=1e-5)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0,
                                       **({"rope_scaling": rope_scaling} if rope_scaling else {}))
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            else:
                p.mul_(weight_scale)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def load_hf_model(path: str | Path, dtype=torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model


def hf_llama_from_state(cfg, state):
    """A transformers LlamaForCausalLM on our loader's weights (the reference
    for a GGUF model, whose dequantized tensors transformers cannot read alone)."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"state does not fit a LlamaForCausalLM of this config: unexpected {unexpected}, "
                         f"missing {missing}; pass the loader's weights for the same model config")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
