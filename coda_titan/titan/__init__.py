"""Everything TorchTitan calls: the train spec, the ``[coda]`` job config, the FA4 model converter,
the offline datasets and the CPU device shim (the shape of ``torchtitan/experiments/<name>/``)."""

from __future__ import annotations


def register() -> None:
    """Register the ``coda_llama3`` and ``liger_llama3`` train specs, the flavors stock ``llama3`` lacks (1B, 3B,
    debugmodel_gqa), the offline datasets and the ``fa4`` converter with TorchTitan (idempotent).
    Stock ``llama3`` is registered again unchanged but for its tokenizer builder, which also resolves
    the built-in ``coda:stdlib-bpe-<vocab>`` names (TorchTitan prefers a registered spec)."""
    import torchtitan.models.llama3 as stock
    from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

    from ..model.args import stock_flavor_additions
    from . import fa4, liger
    from .data import register_datasets
    from .train_spec import NAME, get_train_spec, stock_llama3_spec

    if NAME not in _extra_train_specs:
        register_train_spec(NAME, get_train_spec())
    if liger.NAME not in _extra_train_specs:  # (the Liger baseline: stock llama3 with Liger's kernels)
        register_train_spec(liger.NAME, liger.get_train_spec())
    if "llama3" not in _extra_train_specs:  # stock llama3, resolving the built-in tokenizer names too
        register_train_spec("llama3", stock_llama3_spec())
    for flavor, args in stock_flavor_additions().items():
        stock.llama3_args.setdefault(flavor, args)
    register_datasets()
    fa4.register()
