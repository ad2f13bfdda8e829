"""coda_titan: TorchTitan plug-in that trains LLaMA-3 models rewritten as GEMM-epilogue programs.

``--experimental.custom_import coda_titan`` (what ``coda-titan train`` passes) imports this package,
which registers the ``coda_llama3`` train spec, the offline datasets, the ``fa4`` model converter
(FlashAttention-4 for stock and CODA models alike), and the flavors stock ``llama3`` lacks (1B, 3B,
debugmodel_gqa) so a baseline config can name the same flavor. Nothing else runs at import.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .titan import cpu_device, register

cpu_device.install()  # before TorchTitan's Trainer reads its device (no-op when a GPU exists)
register()
