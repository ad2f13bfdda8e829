"""What the Triton-interpreter checks (``*_interpreter_check.py``, run as scripts with TRITON_INTERPRET=1)
share. ``coda_titan.kernels.cute`` imports quack, which a CPU install lacks: its package is stood in for,
so that only the module asked for loads; and a cute file's reference function is taken from its source
text alone (the file itself imports quack)."""

import importlib
import pathlib
import sys
import types

import coda_titan.kernels as kernels

CUTE_DIR = pathlib.Path(kernels.__file__).parent / "cute"


def cute_module(name: str):
    """``coda_titan.kernels.cute.<name>``, loaded without the package's own ``__init__``."""
    if "coda_titan.kernels.cute" not in sys.modules:
        pkg = types.ModuleType("coda_titan.kernels.cute")
        pkg.__path__ = [str(CUTE_DIR)]
        sys.modules["coda_titan.kernels.cute"] = pkg
    return importlib.import_module(f"coda_titan.kernels.cute.{name}")


def cute_function(file: str, start: str, stop: str, ns: dict):
    """The function defined in ``cute/<file>`` from the text ``start`` up to ``stop``, executed in ``ns``
    (which supplies its globals); returns it by the name after ``def``."""
    src = (CUTE_DIR / file).read_text()
    exec(src[src.index(start):src.index(stop)], ns)
    return ns[start.removeprefix("def ").strip()]


def refuses(fn, *args, says: str) -> bool:
    """Whether ``fn(*args)`` raises a ValueError whose message contains ``says``."""
    try:
        fn(*args)
    except ValueError as e:
        return says in str(e)
    return False
