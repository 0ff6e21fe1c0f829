"""Hugging Face ``Trainer`` trains a model converted with ``fc.convert(..., autocast=True)``
(the Trainer calls the model itself), and its ``save_model`` reloads with
``from_pretrained``."""

from __future__ import annotations

import warnings

import pytest
import torch
from _trainer_models import (
    BATCH,
    BOUND,
    LR,
    RECIPE,
    STEPS,
    final_loss,
    record_recipes,
    tiny_llama,
    token_rows,
)

import fastcast as fc

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own dependency

pytestmark = pytest.mark.usefixtures("single_thread")


def _train(model: torch.nn.Module, out: str) -> tuple[transformers.Trainer, list[float]]:
    rows = token_rows()
    # A list of dicts: the Trainer keeps the columns the forward's signature names.
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_trains_within_bound_of_fp32_and_reloads(tmp_path):
    _, reference = _train(tiny_llama(), str(tmp_path / "fp32"))
    model = fc.convert(tiny_llama(), recipe=RECIPE, autocast=True)
    seen = record_recipes(model)
    trainer, losses = _train(model, str(tmp_path / "fp8"))

    # Every forward the Trainer ran was under the recipe, and it trained like FP32.
    assert len(seen) == STEPS and set(seen) == {RECIPE}
    assert not fc.is_autocast_enabled()
    fp8, fp32 = final_loss(losses), final_loss(reference)
    print(f"HF Trainer: final loss {fp8:.4f} (FP8 current scaling), {fp32:.4f} (FP32)")
    assert losses != reference  # it ran quantized
    assert fp8 < 0.8 * losses[0]  # it learned the tokens
    assert abs(fp8 / fp32 - 1) <= BOUND, (losses, reference)

    # save_model -> from_pretrained: a plain checkpoint that reloads strictly and, converted
    # the same way, gives identical outputs.
    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    model.eval()
    plain, info = transformers.LlamaForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    reloaded = fc.convert(plain, recipe=RECIPE, autocast=True).eval()
    ids = token_rows()[:2]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
        with fc.autocast(enabled=False):  # the caller's autocast decides: high precision
            high = model(ids).logits
        assert not torch.equal(high, model(ids).logits)


def test_generate_runs_every_step_under_the_recipe():
    """``generate`` calls the forward once per new token: each runs under the recipe,
    exactly as inside a ``with fc.autocast`` block."""
    model = fc.convert(tiny_llama(), recipe=RECIPE, autocast=True).eval()
    seen = record_recipes(model)
    ids = token_rows()[:1, :4]
    kwargs = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    out = model.generate(ids, **kwargs)
    assert seen == [RECIPE] * 3
    reference = fc.convert(tiny_llama(), recipe=RECIPE).eval()
    with fc.autocast(recipe=RECIPE):
        assert torch.equal(out, reference.generate(ids, **kwargs))
