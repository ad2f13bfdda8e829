"""Bad input: one clear message saying what to change, a non-zero exit, never a raw traceback."""

import pytest
import torch

from coda_titan import cli

from .conftest import CONFIGS, run_cli


@pytest.fixture
def bad_config(tmp_path):
    def write(text):
        p = tmp_path / "bad.toml"
        p.write_text(text)
        return str(p)

    return write


def _fails(capsys, argv, *expected):
    rc = cli.main(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc != 0, text
    assert "Traceback" not in text
    for e in expected:
        assert e in out.err, f"{e!r} not in:\n{out.err}"
    assert out.err.count("coda-titan: error:") == 1


def test_unknown_flavor(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--model.flavor", "13B"],
           "unknown flavor '13B'", "debugmodel_gqa")


def test_unknown_coda_key(capsys, bad_config):
    text = (CONFIGS / "debug_cpu_coda.toml").read_text().replace("[coda]\n", "[coda]\ntile_width = 64\n")
    _fails(capsys, ["train", bad_config(text)], "unknown key 'tile_width' in [coda]", "tile_n")


def test_unknown_section(capsys, bad_config):
    text = (CONFIGS / "debug_cpu_coda.toml").read_text() + "\n[codaa]\nbackend = 'torch'\n"
    _fails(capsys, ["train", bad_config(text)], "unknown key 'codaa'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cute_backend_without_gpu(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--coda.backend", "cute"],
           "backend = 'cute' cannot run here", "no CUDA GPU", "backend = 'auto'")


def test_bad_backend_name(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--coda.backend", "triton"],
           "backend = 'triton' is not allowed: use one of 'auto', 'torch', 'cute'")


def test_malformed_toml(capsys, bad_config):
    _fails(capsys, ["train", bad_config("[model\nname = 'coda_llama3'\n")], "is not valid TOML")


def test_missing_config_file(capsys, tmp_path):
    _fails(capsys, ["train", str(tmp_path / "nope.toml")], "not found")


def test_missing_dataset_path(capsys, tmp_path):
    missing = str(tmp_path / "corpus.jsonl")
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--training.dataset", "local",
                    "--training.dataset_path", missing], missing, "does not exist")


def test_unknown_dataset_name(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--training.dataset", "pile"],
           "unknown training.dataset 'pile'", "coda_stdlib")


def test_unknown_model_name(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--model.name", "llama9"], "unknown model.name")


def test_error_from_a_real_process(tmp_path, cache_dir):
    """The console command itself: exit status 2 and one line on stderr."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\n")
    proc = run_cli(["train", str(bad)], cwd=tmp_path, cache_dir=cache_dir, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().startswith("coda-titan: error:") and "not valid TOML" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_fa4_without_gpu(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_baseline.toml"), "--model.converters", "fa4"],
           "'fa4' (FlashAttention-4)", "no CUDA GPU", "remove it to use SDPA")


def test_unknown_converter(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--model.converters", "fa5"],
           "unknown model.converters entry 'fa5'", "fa4")


def test_float8_converter_refused_for_coda(capsys):
    _fails(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--model.converters", "quantize.linear.float8"],
           "cannot apply to coda_llama3", "precision = 'fp8'", "model.name = 'llama3'")
