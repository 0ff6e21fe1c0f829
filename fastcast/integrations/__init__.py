"""Trainer integrations. Each submodule imports its framework, which fastcast does not
depend on: ``import fastcast`` imports none of them.

- ``fastcast.integrations.lightning``: ``FastcastPrecision``, a Lightning precision plugin.

Hugging Face's ``Trainer`` and accelerate need no module here: they call the model, so
``fc.convert(model, recipe=r, autocast=True)`` is all they need (docs/usage.md).
"""
