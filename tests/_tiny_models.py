"""Tiny Hugging Face models built from configs (no hub access), as the user-flow tests
use them: Llama, GPT-2 (transformers' ``Conv1D`` layers) and Qwen3-MoE (transformers 5
experts). ``transformers`` is imported on call: callers ``importorskip`` it first."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128


def tiny_llama(
    layers: int = 2, positions: int = 32, tie: bool = False, seed: int | None = 0
) -> nn.Module:
    """A Llama of hidden size 64 (2 heads, MLP 128); ``seed`` None leaves the generator."""
    import transformers  # noqa: PLC0415

    if seed is not None:
        torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(layers: int = 2, positions: int = 32, seed: int | None = 0) -> nn.Module:
    """A GPT-2 of n_embd 64 (2 heads)."""
    import transformers  # noqa: PLC0415

    if seed is not None:
        torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=positions, n_embd=64, n_layer=layers, n_head=2
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_qwen3_moe(seed: int | None = 0) -> nn.Module:
    """A one-block Qwen3-MoE of hidden size 64 with 4 experts, 2 per token."""
    import transformers  # noqa: PLC0415

    if seed is not None:
        torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    return transformers.Qwen3MoeForCausalLM(config)
