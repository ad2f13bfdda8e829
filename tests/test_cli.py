"""Bad input: one clear message saying what to change, a non-zero exit, never a raw traceback."""

import dataclasses
import re

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


@pytest.mark.slow
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


# --- the [coda] schema: every bad value is one line naming key, value and what is allowed, exit 2 ----

BAD_CODA = [
    # (TOML line, the override that says the same, words the message must hold)
    ('tile_n = "wide"', ["--coda.tile_n", "wide"], ("tile_n", "'wide'", "an integer >= 1")),
    ("tile_n = 128.5", ["--coda.tile_n", "128.5"], ("tile_n", "128.5", "an integer >= 1")),
    ("tile_n = -1", ["--coda.tile_n", "-1"], ("tile_n", "-1", "an integer >= 1")),
    ("ce_chunk_rows = true", None, ("ce_chunk_rows", "true", "an integer >= 1")),
    ('fp8_dgrad = "yes"', ["--coda.fp8_dgrad", "yes"], ("fp8_dgrad",)),
    ('precision = "fp4"', ["--coda.precision", "fp4"], ("precision", "'fp4'", "one of 'bf16', 'fp8'")),
    ("fp8_amax_history = 0", ["--coda.fp8_amax_history", "0"], ("fp8_amax_history", "0", "an integer >= 1")),
    ("fp8_grad_margin = 25", ["--coda.fp8_grad_margin", "25"], ("fp8_grad_margin", "an integer in 0..24")),
]


def _one_line_exit_2(capsys, argv, words):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"


@pytest.mark.parametrize("line,override,words", BAD_CODA, ids=[b[0] for b in BAD_CODA])
def test_bad_coda_value_in_toml(capsys, bad_config, line, override, words):
    key = line.split(" = ")[0]
    text = re.sub(rf"(?m)^{key} = .*\n", "", (CONFIGS / "debug_cpu_coda.toml").read_text())
    text = text.replace("[coda]\n", f"[coda]\n{line}\n")
    _one_line_exit_2(capsys, ["train", bad_config(text)], words)


@pytest.mark.parametrize("line,override,words", [b for b in BAD_CODA if b[1]], ids=[b[0] for b in BAD_CODA if b[1]])
def test_bad_coda_value_as_override(capsys, line, override, words):
    _one_line_exit_2(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), *override], words)


def test_fp8_knobs_that_would_do_nothing_are_refused_in_one_line(capsys):
    """fp8_layer_wgrads runs weight gradients on fp8: on a bf16 config it would do nothing, so the run
    is refused before it starts (the model refuses it too, for TorchTitan's own entry point), as are
    the other off-by-default fp8 knobs, and the fp8 forward of the head beside the fp8 head. (The
    on-by-default fp8_mlp_da_t, fp8_down_wgrad and fp8_down_dgrad are ignored where their B3 does not
    run: tests/test_model.py.)"""
    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer
    from coda_titan.titan.job_config import Coda, ConfigError

    _one_line_exit_2(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--coda.fp8_layer_wgrads"],
                     ("fp8_layer_wgrads", 'precision = "bf16"'))
    _one_line_exit_2(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--coda.precision", "fp8",
                              "--coda.fp8_mlp_h_t", "--coda.no-fp8_mlp_dgrad"], ("fp8_mlp_h_t", "fp8_mlp_dgrad = false"))
    _one_line_exit_2(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), "--coda.precision", "fp8",
                              "--coda.fp8_lm_head_fwd", "--coda.fp8_lm_head"], ("fp8_lm_head_fwd", "fp8_lm_head = true"))
    for knob in ("fp8_layer_wgrads", "fp8_mlp_h_t", "fp8_qkv_wgrad", "fp8_lm_head_fwd", "fp8_lm_head_dw",
                 "fp8_lm_head_dgrad"):
        args = dataclasses.replace(coda_llama3_args["debugmodel"], coda=Coda(backend="torch", **{knob: True}))
        with pytest.raises(ConfigError, match=knob):
            CodaTransformer(args)


def test_the_model_refuses_what_the_schema_refuses():
    """A config launched through TorchTitan's own entry point never passes the CLI: the model checks too."""
    from coda_titan.model.args import coda_llama3_args
    from coda_titan.model.model import CodaTransformer
    from coda_titan.titan.job_config import Coda, ConfigError

    args = dataclasses.replace(coda_llama3_args["debugmodel"], coda=Coda(backend="torch", tile_n=0))
    with pytest.raises(ConfigError, match="tile_n = 0"):
        CodaTransformer(args)


# --- help and version ---------------------------------------------------------------------------------


def test_help_and_version(capsys):
    for argv, words in ((["--help"], ("train", "--version", "CONFIG.toml --help")),
                        (["train", "--help"], ("TOML job config", "--training.steps", "every override key"))):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert all(w in out for w in words), out
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("coda-titan ")


def test_config_help_lists_every_override_key_with_its_doc(capsys):
    from coda_titan.titan.job_config import FIELDS

    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(CONFIGS / "debug_cpu_coda.toml"), "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, f in FIELDS.items():
        assert f"--coda.{name.replace('_', '-')}" in out
        assert " ".join(f.metadata["doc"].split()[:4]) in out.replace("│", "").replace("  ", " ")
    assert "--training.steps" in out


# --- bad input found before the model is built (coda_titan.titan.preflight) ---------------------------


def _bad_inputs(tmp):
    (tmp / "empty.jsonl").write_text("")
    (tmp / "empty.txt").write_text("")
    (tmp / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp / "afile").write_text("x")
    return [
        # (overrides, words of the one-line message)
        (["--training.dataset", "local"], ("training.dataset_path",)),
        (["--training.dataset", "local", "--training.dataset_path", str(tmp / "nope")], ("does not exist",)),
        (["--training.dataset", "local", "--training.dataset_path", str(tmp / "empty.jsonl")], ("empty.jsonl", "empty")),
        (["--training.dataset", "local", "--training.dataset_path", str(tmp / "empty.txt")], ("empty.txt", "empty")),
        (["--training.dataset", "local", "--training.dataset_path", str(tmp / "notext.jsonl")], ("'text' field", "body")),
        (["--training.seq_len", "0"], ("training.seq_len = 0", "an integer >= 1")),
        (["--training.steps", "2.5"], ("training.steps", "an integer")),
        (["--training.local_batch_size", "0"], ("training.local_batch_size = 0",)),
        (["--model.hf_assets_path", "coda:stdlib-bpe-4096"], ("4096 tokens", "vocab_size is 2048")),
        (["--job.dump_folder", str(tmp / "afile")], ("is a file", "job.dump_folder")),
        (["--job.dump_folder", str(tmp / "out"), "--checkpoint.enable", "--checkpoint.folder", "../afile"],
         ("checkpoint folder", "is a file")),
        (["--training.bogus", "1"], ("unknown override --training.bogus",)),
        (["--checkpoint.enable", "true"], ("is a switch",)),
    ]


def test_bad_input_table(capsys, tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    for overrides, words in _bad_inputs(tmp_path):
        _one_line_exit_2(capsys, ["train", str(CONFIGS / "debug_cpu_coda.toml"), *overrides], words)
    assert not (tmp_path / "out").exists()  # nothing was written


def test_fp8_on_the_torch_backend_says_it_is_the_emulation(capsys, tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("CODA_TITAN_CACHE", str(cache_dir))
    config = cli.parse_config(str(CONFIGS / "debug_cpu_coda.toml"), ["--coda.precision", "fp8", "--coda.backend", "torch",
                                                                      "--job.dump_folder", str(tmp_path / "o")])
    cli.validate(config)
    assert "exact fp8 emulation" in capsys.readouterr().out


def test_the_run_summary_reports_the_lm_head_rows_repaired_only_when_the_exp_head_ran(monkeypatch):
    """``CODA_TITAN_CE_PASS=exp``: the end-of-run line says how many LM-head rows the repair kernel rewrote (read
    and reset through the program's ``take_repaired``); without the cute head loaded, or with no counter made
    (the exp head never ran), it adds nothing."""
    import sys
    import types

    from coda_titan.titan.run_summary import lm_head_repairs

    monkeypatch.delitem(sys.modules, "coda_titan.kernels.cute.lm_head_ce", raising=False)
    assert lm_head_repairs() == ""
    taken = []
    mod = types.ModuleType("coda_titan.kernels.cute.lm_head_ce")
    mod._REPAIRED = {}
    mod.take_repaired = lambda: taken.append(1) or 1234
    monkeypatch.setitem(sys.modules, "coda_titan.kernels.cute.lm_head_ce", mod)
    assert lm_head_repairs() == "" and not taken
    mod._REPAIRED = {"cuda:0": object()}
    assert lm_head_repairs() == ", 1,234 LM-head rows repaired (CODA_TITAN_CE_PASS=exp)" and taken == [1]
