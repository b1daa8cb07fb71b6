"""A tiny Llama for real vLLM on CPU, made here (no model hub): a hand-written config and
random weights from a fixed seed in a local safetensors file. vLLM's ``load_format="dummy"``
ties every logit, so tokens would not depend on the KV; these weights make them depend on
it, so a decode instance that attends to wrong KV bytes produces other tokens.

    python tiny_model.py DIR      # writes DIR/config.json and DIR/model.safetensors
"""

import json
import os
import sys

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # head_dim 64: CPU attention refuses 16
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make(path: str, seed: int = 1234) -> str:
    """Write the model into ``path`` (once: an existing one is kept); returns ``path``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, "model.safetensors")
    tokenizer(path)
    if os.path.exists(weights):
        return path
    c = CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(v, h, scale=1.0), "lm_head.weight": w(v, h, scale=0.5)}
    t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t[p + "self_attn.q_proj.weight"] = w(h, h)
        t[p + "self_attn.k_proj.weight"] = w(kv, h)
        t[p + "self_attn.v_proj.weight"] = w(kv, h, scale=0.3)
        t[p + "self_attn.o_proj.weight"] = w(h, h, scale=0.3)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    save_file(t, weights + ".tmp", metadata={"format": "pt"})
    os.replace(weights + ".tmp", weights)
    return path


def tokenizer(path: str) -> str:
    """A word-level tokenizer over the model's vocabulary, written with the ``tokenizers``
    library (no hub): token ``k`` is the word ``tK``, words split on whitespace, so a text of
    such words encodes to exactly its ids and ids decode to such a text. No token is declared
    special: a decoded text keeps every token (``<unk>``-like specials are skipped when text
    is decoded, and a reply's text would then hide tokens the model chose; the model's
    ``eos_token_id`` still comes from its config). It lets engines serve text prompts and
    ``vllm bench serve`` count tokens; engines started with ``--skip-tokenizer-init`` ignore
    it. Written once."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{k}": k for k in range(CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(make(sys.argv[1]))
