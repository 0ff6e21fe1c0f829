"""accelerate's ``Accelerator.prepare`` with a model converted with ``autocast=True``: it
trains like FP32, ``save_state``/``load_state`` resumes exactly, and accelerate's own
mixed precision (which rebinds ``model.forward``) keeps fastcast's autocast."""

from __future__ import annotations

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

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("single_thread")


def _batches(steps: int, start: int = 0) -> list[torch.Tensor]:
    """The batches of steps ``start`` .. ``start + steps - 1``: the rows in a fixed
    shuffled order per epoch."""
    rows = token_rows()
    per_epoch = len(rows) // BATCH
    out = []
    for step in range(start, start + steps):
        epoch = torch.Generator().manual_seed(step // per_epoch)
        order = torch.randperm(len(rows), generator=epoch)
        chunk = step % per_epoch
        out.append(rows[order[chunk * BATCH : (chunk + 1) * BATCH]])
    return out


def _prepared(recipe: fc.recipe.Recipe | None, **kwargs) -> tuple:
    accelerator = accelerate.Accelerator(cpu=True, **kwargs)
    model = tiny_llama()
    if recipe is not None:
        fc.convert(model, recipe=recipe, autocast=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _steps(accelerator, model, opt, batches: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_prepared_model_trains_within_bound_of_fp32():
    reference = _steps(*_prepared(None), _batches(STEPS))
    accelerator, model, opt = _prepared(RECIPE)
    seen = record_recipes(model)
    losses = _steps(accelerator, model, opt, _batches(STEPS))
    assert len(seen) == STEPS and set(seen) == {RECIPE}
    assert not fc.is_autocast_enabled()
    fp8, fp32 = final_loss(losses), final_loss(reference)
    print(f"accelerate: final loss {fp8:.4f} (FP8 current scaling), {fp32:.4f} (FP32)")
    assert losses != reference  # it ran quantized
    assert fp8 < 0.8 * losses[0]  # it learned the tokens
    assert abs(fp8 / fp32 - 1) <= BOUND, (losses, reference)


@pytest.mark.parametrize("recipe", [RECIPE, fc.DelayedScaling(amax_history_len=4)])
def test_save_state_then_load_state_resumes_exactly(recipe, tmp_path):
    """Training 4 steps after ``load_state`` of step 6 gives the losses of the run that
    went on from step 6 (weights, AdamW state and, for delayed scaling, the amax
    histories and scales all came back)."""
    accelerator, model, opt = _prepared(recipe)
    _steps(accelerator, model, opt, _batches(6))
    accelerator.save_state(tmp_path)
    went_on = _steps(accelerator, model, opt, _batches(4, start=6))

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator, model, opt = _prepared(recipe)
    accelerator.load_state(tmp_path)
    seen = record_recipes(model)
    resumed = _steps(accelerator, model, opt, _batches(4, start=6))
    assert set(seen) == {recipe}
    assert resumed == went_on


def test_accelerate_mixed_precision_keeps_the_fastcast_autocast():
    """accelerate's bf16 mixed precision rebinds ``model.forward.__func__`` under
    ``torch.autocast``, and ``unwrap_model(keep_fp32_wrapper=False)`` unwinds it: the
    layers run under both, then under fastcast's alone."""
    accelerator, model, _ = _prepared(RECIPE, mixed_precision="bf16")
    layer = model.model.layers[0].mlp.up_proj
    seen = []
    layer.register_forward_pre_hook(
        lambda *_: seen.append((fc.get_autocast_recipe(), torch.is_autocast_enabled("cpu")))
    )
    ids = token_rows()[:2]
    with torch.no_grad():
        model(input_ids=ids)
        plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        plain(input_ids=ids)
    assert seen == [(RECIPE, True), (RECIPE, False)]
