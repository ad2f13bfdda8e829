"""The structure rules of the package (docs/design.md): one program, one place; one statically
readable interface; small files and functions."""

import ast
import dataclasses
import inspect

import torch

from coda_titan import kernels
from coda_titan.kernels import PROGRAMS, TORCH, Backend, op_backend

from .conftest import ROOT

FAMILIES = ("rms_partial", "residual_rms", "norm_swiglu", "norm_rope", "norm_residual_bwd", "lm_head_ce", "gemm", "casts")


def _py(folder):
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_big_files_or_functions():
    too_big = [(p.relative_to(ROOT), n) for folder, limit in (("coda_titan", 400), ("scripts", 500))
               for p in _py(folder) if (n := len(p.read_text().splitlines())) > limit]
    assert not too_big, too_big
    long = []
    for p in _py("coda_titan") + _py("scripts"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append((str(p.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1))
    assert not long, long


def test_every_program_family_has_its_cuda_file_of_the_same_name():
    for family in FAMILIES:
        assert (ROOT / "coda_titan" / "kernels" / f"{family}.py").is_file()
        assert (ROOT / "coda_titan" / "kernels" / "cute" / f"{family}.py").is_file(), family


def test_backend_is_a_static_record_of_keyword_only_programs():
    assert "__getattr__" not in vars(Backend) and dataclasses.is_dataclass(Backend)
    ops = op_backend()
    for name in PROGRAMS:
        ref = getattr(TORCH, name)
        params = inspect.signature(ref).parameters.values()
        assert all(p.kind == p.KEYWORD_ONLY for p in params), f"{name} must take keyword-only arguments"
        assert ref.__module__.startswith("coda_titan.kernels."), name
        assert callable(getattr(ops, name)) and hasattr(torch.ops.coda, name), name


def test_the_model_reaches_programs_only_through_the_backend():
    """No side doors from model/ into a program module's internals (scaling math is shared, not a program)."""
    allowed = {"coda_titan.kernels", "coda_titan.kernels._common", "coda_titan.kernels.scaling"}
    for p in _py("coda_titan/model"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module:
                module = f"coda_titan.{node.module}" if node.level == 2 else node.module  # model/ is one level down
                assert module in allowed, f"{p.name} imports {module}"
    assert kernels.get_backend("torch") is TORCH


def _named_traces(doc):
    """Every ``trace`` string anywhere in a result document (a profile's kept trace, a timeline's source)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k == "trace" and isinstance(v, str):
                yield v
            else:
                yield from _named_traces(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _named_traces(v)


def test_every_trace_a_result_names_is_kept():
    """A profile or timeline in benchmarks/results names the gzipped trace it was derived from; that trace must
    be in benchmarks/results/traces (twice a device call's moving them aside was committed as their deletion)."""
    import json

    results = ROOT / "benchmarks" / "results"
    named = {(path.name, t) for path in results.rglob("*.json") if "traces" not in path.parts
             for t in _named_traces(json.loads(path.read_text()))}
    assert named, "no result names a trace: the check would be empty"
    missing = sorted((f, t) for f, t in named if not (results / "traces" / t.rsplit("/", 1)[-1]).is_file())
    assert not missing, f"traces named but not kept: {missing}"
