"""Tiny random models and a byte-level tokenizer, built in memory (no downloads): for tests and smoke runs."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(family: str = "llama", kv_heads: int = 2, seed: int = 0, **overrides):
    config_cls, model_cls = FAMILIES[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    config = config_cls(**{**TINY, **extra, **overrides}, num_key_value_heads=kv_heads)
    torch.manual_seed(seed)
    model = model_cls(config)
    # Random init gives near-uniform attention; a larger query/key scale makes it peaked like a trained model's.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    return model.eval()


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 2 chat specials) built in memory, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<|im_start|>": 256, "<|im_end|>": 257})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def tiny_chat_model(**overrides):
    """A tiny random Llama whose vocabulary matches :func:`tiny_tokenizer` (for studio tests); its context holds
    the studio's examples, which are ~8K bytes = tokens long."""
    return tiny_model("llama", 2, **{"vocab_size": 258, "num_hidden_layers": 3, "max_position_embeddings": 16384,
                                     **overrides})
