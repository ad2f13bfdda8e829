"""The shipped configs parse through TorchTitan's ConfigManager, and each CODA config differs from
its baseline only in model.name and the [coda] section (plus where it writes its outputs)."""

import dataclasses
from pathlib import Path

import pytest

from coda_titan import cli
from coda_titan.model.args import coda_llama3_args, same_architecture
from coda_titan.titan.job_config import Coda
from torchtitan.models.llama3 import llama3_args

from .conftest import CONFIGS

PAIRS = [
    ("debug_cpu_baseline.toml", "debug_cpu_coda.toml"),
    ("llama3_1b_bf16_baseline.toml", "llama3_1b_bf16_coda.toml"),
    ("llama3_1b_bf16_baseline_compile.toml", "llama3_1b_bf16_coda_compile.toml"),
    ("llama3_8b_bf16_baseline.toml", "llama3_8b_bf16_coda.toml"),
]
# each *_compile config is its eager twin plus [compile] (and its own output folder)
COMPILE_TWINS = [("llama3_1b_bf16_baseline.toml", "llama3_1b_bf16_baseline_compile.toml"),
                 ("llama3_1b_bf16_coda.toml", "llama3_1b_bf16_coda_compile.toml"),
                 ("llama3_1b_fp8_coda.toml", "llama3_1b_fp8_coda_compile.toml")]
OUTPUT_ONLY = {("job", "dump_folder"), ("job", "description")}


def _flatten(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


@pytest.mark.parametrize("baseline,coda", PAIRS)
def test_pair_differs_only_in_model_name_and_coda(baseline, coda):
    b = dict(_flatten(cli._load_toml(CONFIGS / baseline)))
    c = dict(_flatten(cli._load_toml(CONFIGS / coda)))
    diff = {k for k in b.keys() | c.keys() if b.get(k) != c.get(k)} - OUTPUT_ONLY
    assert diff - {("model", "name")} == {k for k in c if k[0] == "coda"}
    assert b[("model", "name")] == "llama3" and c[("model", "name")] == "coda_llama3"


@pytest.mark.parametrize("name", sorted(p.name for p in Path(CONFIGS).glob("*.toml")))
def test_config_parses(name):
    config = cli.parse_config(str(CONFIGS / name), [])
    assert config.experimental.custom_import == "coda_titan"
    assert config.model.flavor in (coda_llama3_args if config.model.name == "coda_llama3" else llama3_args)


def test_flavors_mean_the_same_in_both_models():
    for flavor in ("debugmodel_gqa", "1B", "3B", "8B", "70B"):
        assert same_architecture(coda_llama3_args[flavor], llama3_args[flavor]), flavor
    assert same_architecture(coda_llama3_args["debugmodel"], coda_llama3_args["debugmodel_gqa"])
    a = coda_llama3_args["debugmodel"]
    assert a.n_kv_heads < a.n_heads  # GQA


def test_1b_shape():
    import torch

    from coda_titan.model.model import CodaTransformer

    a = coda_llama3_args["1B"]
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (2048, 16, 32, 8, 128256)
    with torch.device("meta"):
        m = CodaTransformer(dataclasses.replace(a, coda=Coda(backend="torch")))
    assert m.layers["0"].feed_forward.w1.weight.shape == (8192, 2048)
    assert m.layers["0"].attention.wk.weight.shape == (512, 2048)


@pytest.mark.parametrize("eager,compiled", COMPILE_TWINS)
def test_compile_twin_differs_only_in_compile(eager, compiled):
    e = dict(_flatten(cli._load_toml(CONFIGS / eager)))
    c = dict(_flatten(cli._load_toml(CONFIGS / compiled)))
    diff = {k for k in e.keys() | c.keys() if e.get(k) != c.get(k)} - OUTPUT_ONLY
    assert diff == {("compile", "enable"), ("compile", "components")}
    assert c[("compile", "enable")] is True and e[("compile", "enable")] is False


@pytest.mark.parametrize("kind", ["baseline", "baseline_compile"])
def test_fp8_baseline_is_its_bf16_twin_plus_float8(kind):
    b = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_1b_bf16_{kind}.toml")))
    f = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_1b_fp8_{kind}.toml")))
    diff = {k for k in b.keys() | f.keys() if b.get(k) != f.get(k)} - OUTPUT_ONLY
    assert diff == {("model", "converters"), ("quantize", "linear", "float8", "recipe_name"),
                    ("quantize", "linear", "float8", "filter_fqns")}
    assert f[("model", "converters")] == ["fa4", "quantize.linear.float8"]
    assert f[("quantize", "linear", "float8", "filter_fqns")] == ["output"]  # LM head in bf16
    config = cli.parse_config(str(CONFIGS / f"llama3_1b_fp8_{kind}.toml"), [])
    assert config.quantize.linear.float8.recipe_name == "tensorwise"


def test_1b_and_8b_configs_use_fa4_on_both_sides():
    for p in list(CONFIGS.glob("llama3_1b_*.toml")) + list(CONFIGS.glob("llama3_8b_*.toml")):
        assert cli._load_toml(p)["model"]["converters"][0] == "fa4", p.name


@pytest.mark.parametrize("kind", ["coda", "coda_compile"])
def test_fp8_coda_is_its_bf16_twin_plus_precision(kind):
    b = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_1b_bf16_{kind}.toml")))
    f = dict(_flatten(cli._load_toml(CONFIGS / f"llama3_1b_fp8_{kind}.toml")))
    diff = {k for k in b.keys() | f.keys() if b.get(k) != f.get(k)} - OUTPUT_ONLY
    assert diff == {("coda", "precision"), ("coda", "fp8_amax_history")}
    config = cli.parse_config(str(CONFIGS / f"llama3_1b_fp8_{kind}.toml"), [])
    assert config.coda.precision == "fp8" and config.model.converters == ["fa4"]
