"""Lightning's ``Trainer`` with ``FastcastPrecision``: a tiny Llama trains in FP8 like in
FP32, and its checkpoint loads back into a module that predicts the same."""

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
from torch.utils.data import DataLoader

import fastcast as fc

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")
from fastcast.integrations.lightning import FastcastPrecision  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


class LitLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)


def _trainer(plugins: list, steps: int = STEPS) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=plugins,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _loader(shuffle: bool = True) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(token_rows(), batch_size=BATCH, shuffle=shuffle, generator=generator)


def _fit(plugins: list) -> LitLlama:
    module = LitLlama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
        _trainer(plugins).fit(module, _loader())
    return module


def _predict(module: LitLlama, plugins: list) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _trainer(plugins).predict(module, _loader(shuffle=False))
    return torch.cat(out)


def test_plugin_trains_within_bound_of_fp32_and_its_checkpoint_loads(tmp_path):
    reference = _fit([]).losses
    plugin = FastcastPrecision(recipe=RECIPE)
    module = LitLlama()
    seen = record_recipes(fc.convert(module, recipe=RECIPE))  # the plugin converts it again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer([plugin])
        trainer.fit(module, _loader())
    losses = module.losses

    # Every training step ran under the plugin's recipe; the backward outside it.
    assert len(seen) == STEPS and set(seen) == {RECIPE}
    assert not fc.is_autocast_enabled()
    fp8, fp32 = final_loss(losses), final_loss(reference)
    print(f"Lightning: final loss {fp8:.4f} (FP8 current scaling), {fp32:.4f} (FP32)")
    assert losses != reference  # it ran quantized
    assert fp8 < 0.8 * losses[0]  # it learned the tokens
    assert abs(fp8 / fp32 - 1) <= BOUND, (losses, reference)

    # Lightning's checkpoint -> load_from_checkpoint (a plain module: the plugin converts
    # it) -> predict gives what the trained module predicts.
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    loaded = LitLlama.load_from_checkpoint(path)
    assert type(loaded.model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    predicted = _predict(loaded, [FastcastPrecision(recipe=RECIPE)])
    assert type(loaded.model.model.layers[0].mlp.up_proj) is fc.Linear
    assert torch.equal(predicted, _predict(module, [FastcastPrecision(recipe=RECIPE)]))
    assert not torch.equal(predicted, _predict(module, []))  # predicting ran quantized


def test_plugin_converts_the_module_as_convert_would():
    module = LitLlama()
    plugin = FastcastPrecision(fc.NVFP4BlockScaling(), keep_head=False)
    assert plugin.convert_module(module) is module
    assert type(module.model.lm_head) is fc.Linear  # keep_head was passed on
    kept = FastcastPrecision(RECIPE, module_filter_fn=lambda layer, name: "mlp" not in name)
    other = kept.convert_module(LitLlama())
    assert type(other.model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert type(other.model.model.layers[0].self_attn.q_proj) is fc.Linear
    untouched = FastcastPrecision(RECIPE, convert_layers=False).convert_module(LitLlama())
    assert not any(isinstance(m, fc.Linear) for m in untouched.modules())


def test_plugin_context_is_a_fresh_autocast_with_its_recipe():
    plugin = FastcastPrecision(recipe=RECIPE)
    with plugin.forward_context():
        assert fc.get_autocast_recipe() == RECIPE and fc.is_autocast_enabled()
        with plugin.forward_context():  # a new instance each time: it nests
            assert fc.is_autocast_enabled()
    assert not fc.is_autocast_enabled()
    assert plugin.precision == "32-true"


def test_plugin_refuses_what_is_no_recipe():
    with pytest.raises(TypeError, match="recipe must be a fastcast recipe"):
        FastcastPrecision(recipe="current")
    with pytest.raises(TypeError, match="convert_layers must be a bool"):
        FastcastPrecision(RECIPE, convert_layers=1)
