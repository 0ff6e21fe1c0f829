"""NVFP4 with and without the output head in high precision: final loss / FP32 loss.

    PYTHONPATH=. python -m bench.nvfp4_head [--steps 20] [--seeds 5]
        [--models llama,gpt2,qwen3-moe] [--keep model.layers.0.self_attn]

Tiny Hugging Face models built from configs (no hub access), float32 on the CPU (the
NVFP4 GEMMs are emulated, to FP32 rounding of the hardware's result), trained from the
same initial weights on the same data with AdamW, as docs/first-hour.md's flow does: one
fixed batch of random tokens that the model learns (``--batch random`` draws a new batch
every step instead, which a model cannot learn beyond the token frequencies, so every
run ends near ln(vocab) and the ratios say little): once in FP32 without fastcast, once
under ``fc.NVFP4BlockScaling()`` converted with the default (``fc.convert(model,
recipe=recipe)``: the output head stays in high precision), once with
``keep_head=False`` (every layer in NVFP4, the default before), and with ``--keep`` once
more with those layers (qualified names, ``fc.keep_high_precision(model, names=...)``)
kept as well. The final loss of a run is the average of its last ``--tail`` steps.

Each of ``--seeds`` seeds draws its own initial weights (seed s), batch (s + 1) and
stochastic rounding of the gradients (s + 2, the global generator): seed 0 is the run of
earlier versions of this script. Near the end of these runs the loss falls by 10-25% a
step, so the ratio of one seed's two final losses moves by a few percent from seed to
seed; printed: the median over the seeds of each final loss, and the median of the
per-seed ratios to FP32 with their smallest and largest.
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


def train(
    build,
    mode: str,
    steps: int,
    lr: float,
    fixed: bool = True,
    seed: int = 0,
    keep: tuple[str, ...] = (),
) -> list[float]:
    """Losses of ``steps`` steps; ``mode``: "fp32", "nvfp4" (default conversion),
    "nvfp4-all" (``keep_head=False``) or "nvfp4-keep" (the default, and the layers
    named in ``keep`` kept in high precision)."""
    torch.manual_seed(seed)
    model = build()
    model.train()
    recipe = None
    if mode != "fp32":
        recipe = fc.NVFP4BlockScaling()
        keeps = fc.keep_high_precision(model, names=keep) if mode == "nvfp4-keep" else None
        fc.convert(model, keeps, recipe=recipe, keep_head=False if mode == "nvfp4-all" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 2)  # stochastic rounding's draws
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


def _ratios(final: dict[str, list[float]], mode: str) -> str:
    """``mode``'s median final loss, and its per-seed ratios to FP32: median [min..max]."""
    ratios = [loss / ref for loss, ref in zip(final[mode], final["fp32"])]
    return (
        f"{statistics.median(final[mode]):.4f} {statistics.median(ratios):6.3f} "
        f"[{min(ratios):.3f}..{max(ratios):.3f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tail", type=int, default=1, help="final loss: mean of the last N")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", choices=("fixed", "random"), default="fixed")
    parser.add_argument(
        "--keep", default="", help="comma-separated qualified names also kept (a column more)"
    )
    args = parser.parse_args()
    logging.getLogger("fastcast").setLevel(logging.ERROR)  # the head's note, once per model
    keep = tuple(name for name in args.keep.split(",") if name)
    modes = ("fp32", "nvfp4", "nvfp4-all") + (("nvfp4-keep",) if keep else ())
    print(
        f"final loss after {args.steps} steps (mean of the last {args.tail}; {args.batch} "
        f"batch), median over {args.seeds} seeds; ratio to FP32: median [min..max] per seed"
    )
    columns = ["nvfp4 head kept", "nvfp4 head converted"]
    if keep:
        columns.append(f"nvfp4 also kept: {','.join(keep)}")
    print(f"{'model':<10} {'fp32':>7}   " + "   ".join(f"{c:<28}" for c in columns).rstrip())
    for name in args.models.split(","):
        final: dict[str, list[float]] = {mode: [] for mode in modes}
        for seed in range(args.seeds):
            for mode in modes:
                losses = train(
                    MODELS[name], mode, args.steps, args.lr, args.batch == "fixed", seed, keep
                )
                final[mode].append(statistics.fmean(losses[-args.tail :]))
        cells = [_ratios(final, mode) for mode in modes[1:]]
        print(
            f"{name:<10} {statistics.median(final['fp32']):7.4f}   "
            + "   ".join(f"{c:<28}" for c in cells).rstrip()
        )


if __name__ == "__main__":
    main()
