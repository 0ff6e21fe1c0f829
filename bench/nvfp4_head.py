"""NVFP4 with and without the output head in high precision: final loss / FP32 loss.

    PYTHONPATH=. python -m bench.nvfp4_head [--steps 20] [--models llama,gpt2,qwen3-moe]

Tiny Hugging Face models built from configs (no hub access), float32 on the CPU (the
NVFP4 GEMMs are emulated, to FP32 rounding of the hardware's result), trained from the
same initial weights on the same data with AdamW, as docs/first-hour.md's flow does: one
fixed batch of random tokens that the model learns (``--batch random`` draws a new batch
every step instead, which a model cannot learn beyond the token frequencies, so every
run ends near ln(vocab) and the ratios say little): once in FP32 without fastcast, once
under ``fc.NVFP4BlockScaling()`` converted with the default (``fc.convert(model,
recipe=recipe)``: the output head stays in high precision), once with
``keep_head=False`` (every layer in NVFP4, the default before). Prints the final loss of
each and its ratio to FP32's: the average of the last ``--tail`` steps, so that one
batch's noise does not decide it. NVFP4's stochastic rounding of gradients draws from
the global generator, seeded per run.
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch
from torch import nn

import fastcast as fc

VOCAB = 128
BATCH, SEQ = 2, 16


def _llama() -> nn.Module:
    import transformers  # noqa: PLC0415 - an optional dependency

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> nn.Module:
    import transformers  # noqa: PLC0415

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2
    )
    return transformers.GPT2LMHeadModel(config)


def _qwen3_moe() -> nn.Module:
    import transformers  # noqa: PLC0415

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    )
    return transformers.Qwen3MoeForCausalLM(config)


MODELS = {"llama": _llama, "gpt2": _gpt2, "qwen3-moe": _qwen3_moe}


def train(build, mode: str, steps: int, lr: float, fixed: bool = True) -> list[float]:
    """Losses of ``steps`` steps; ``mode``: "fp32", "nvfp4" (default conversion) or
    "nvfp4-all" (``keep_head=False``)."""
    torch.manual_seed(0)
    model = build()
    model.train()
    recipe = None
    if mode != "fp32":
        recipe = fc.NVFP4BlockScaling()
        fc.convert(model, recipe=recipe, keep_head=None if mode == "nvfp4" else False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # stochastic rounding's draws
    losses = []
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
    for _ in range(steps):
        if not fixed:
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
        with fc.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tail", type=int, default=1, help="final loss: mean of the last N")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", choices=("fixed", "random"), default="fixed")
    args = parser.parse_args()
    logging.getLogger("fastcast").setLevel(logging.ERROR)  # the head's note, once per model
    print(
        f"final loss after {args.steps} steps (mean of the last {args.tail}; {args.batch} "
        "batch), ratio to FP32"
    )
    print(f"{'model':<10} {'fp32':>8} {'nvfp4 head kept':>22} {'nvfp4 head converted':>26}")
    for name in args.models.split(","):
        final = {}
        for mode in ("fp32", "nvfp4", "nvfp4-all"):
            losses = train(MODELS[name], mode, args.steps, args.lr, args.batch == "fixed")
            final[mode] = statistics.fmean(losses[-args.tail :])
        ref = final["fp32"]
        kept, converted = final["nvfp4"], final["nvfp4-all"]
        print(
            f"{name:<10} {ref:8.4f} {kept:12.4f} ({kept / ref:6.3f}) "
            f"{converted:16.4f} ({converted / ref:6.3f})"
        )


if __name__ == "__main__":
    main()
