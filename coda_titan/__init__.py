"""coda_titan: TorchTitan plug-in that trains LLaMA-3 models rewritten as GEMM-epilogue programs.

``--experimental.custom_import coda_titan`` (what ``coda-titan train`` passes) imports this package,
which registers the ``coda_llama3`` train spec, the offline datasets, the ``fa4`` model converter
(FlashAttention-4 for stock and CODA models alike), and the flavors stock ``llama3`` lacks (1B, 3B,
debugmodel_gqa) so a baseline config can name the same flavor.
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import _cpu_device

_cpu_device.install()  # before TorchTitan's Trainer reads its device (no-op when a GPU exists)


def _register() -> None:
    import torchtitan.models.llama3 as stock
    from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec

    from .data import register_datasets
    from .model import attention
    from .model.args import stock_flavor_additions
    from .train_spec import NAME, get_train_spec

    if NAME not in _extra_train_specs:
        register_train_spec(NAME, get_train_spec())
    for flavor, args in stock_flavor_additions().items():
        stock.llama3_args.setdefault(flavor, args)
    register_datasets()
    attention.register()  # the "fa4" model converter (FlashAttention-4), for either model


_register()
