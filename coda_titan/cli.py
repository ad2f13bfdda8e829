"""``coda-titan``: train LLaMA-3 models with TorchTitan, stock or rewritten as CODA GEMM-epilogue programs.

    coda-titan train CONFIG.toml [--section.key value ...]
    coda-titan train CONFIG.toml --help      every override key, with its value in CONFIG.toml

``train`` runs TorchTitan's own ``Trainer`` (its config parser, checkpointing, metrics and W&B
logging) with this plug-in imported, on the GPU when there is one and on the CPU otherwise. Before
anything is built it checks the config and says, in one line, what to change (exit status 2): a
missing or malformed TOML, an unknown key or section, a ``[coda]`` value the schema refuses, an
unknown model or flavor, a backend that cannot run here, a missing dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import socket
import sys
from pathlib import Path

PLUGIN = "coda_titan"
CONFIG_MODULE = "coda_titan.titan.job_config"


class UserError(Exception):
    """A problem with the user's input; printed as one message, exit status 2."""


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    if not path.is_file():
        raise UserError(f"config file {str(path)!r} not found")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML ({e}); fix the file and run again") from None


def _has_flag(overrides: list[str], key: str) -> bool:
    dashed = key.replace("_", "-")
    return any(a.split("=")[0] in (f"--{key}", f"--{dashed}") for a in overrides)


def _check_keys(cls, values: dict, where: str = "") -> None:
    """Every TOML key must be a field of TorchTitan's (merged) JobConfig; name the bad one."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        here = f"{where}.{key}" if where else key
        if key not in fields:
            section = f"[{where}]" if where else "the top level"
            valid = ", ".join(sorted(fields))
            raise UserError(f"unknown key {key!r} in {section} of the config; valid keys there: {valid}")
        ftype = fields[key].type
        if dataclasses.is_dataclass(ftype):
            if not isinstance(value, dict):
                raise UserError(f"[{here}] must be a table (section), got {value!r}")
            _check_keys(ftype, value, here)


def _coda_overrides(overrides: list[str]) -> dict:
    """The ``--coda.KEY VALUE`` overrides, typed as the schema's fields (a value that does not parse
    stays a string, for the schema to refuse); a switch given a value is refused here."""
    from .titan.job_config import FIELDS

    values = {}
    for i, arg in enumerate(overrides):
        if not arg.startswith("--coda."):
            continue
        key, eq, value = arg[len("--coda."):].replace("-", "_").partition("=")
        attached = bool(eq)
        if not attached:
            value = overrides[i + 1] if i + 1 < len(overrides) and not overrides[i + 1].startswith("--") else None
        name = key[3:] if key.startswith("no_") and key[3:] in FIELDS else key
        f = FIELDS.get(name)
        if f is None:
            raise UserError(f"unknown override --coda.{key}; valid [coda] keys: {', '.join(FIELDS)}")
        if f.type is bool:
            if value is not None:
                raise UserError(f"--coda.{name} is a switch: write --coda.{name} (true) or --coda.no_{name} (false), "
                                f"without a value")
            values[name] = name == key
        elif value is None:
            raise UserError(f"--coda.{name} needs a value")
        else:
            values[name] = int(value) if f.type is int and value.lstrip("-").isdigit() else value
    return values


def parse_config(config_path: str, overrides: list[str]):
    """TorchTitan JobConfig from the TOML plus CLI overrides, with the plug-in wired in."""
    from .titan.job_config import ConfigError, validate_table

    path = Path(config_path)
    toml = _load_toml(path)
    try:  # before TorchTitan's parser, which would only warn about a wrong type
        coda = toml.get("coda", {})
        validate_table({**(coda if isinstance(coda, dict) else {}), **_coda_overrides(overrides)})
    except ConfigError as e:
        raise UserError(str(e)) from None
    args = ["--job.config_file", str(path)]
    job = toml.get("job", {}) if isinstance(toml.get("job"), dict) else {}
    if not job.get("custom_config_module") and not _has_flag(overrides, "job.custom_config_module"):
        args += ["--job.custom_config_module", CONFIG_MODULE]
    exp = toml.get("experimental", {}) if isinstance(toml.get("experimental"), dict) else {}
    if not exp.get("custom_import") and not _has_flag(overrides, "experimental.custom_import"):
        args += ["--experimental.custom_import", PLUGIN]
    args += overrides

    import coda_titan  # noqa: F401  (registers the train spec; routes TorchTitan to CPU if no GPU)
    from torchtitan.config import ConfigManager

    manager = ConfigManager()
    merged = manager._maybe_add_custom_config(args, toml)
    _check_keys(merged, toml)
    tt_logger = logging.getLogger()  # TorchTitan logs through the root logger
    quiet = _DropBuiltinTokenizerWarning()
    tt_logger.addFilter(quiet)
    try:
        return manager.parse_args(args)
    except ValueError as e:
        raise UserError(f"invalid config: {e}") from None
    finally:
        tt_logger.removeFilter(quiet)


class _DropBuiltinTokenizerWarning(logging.Filter):
    """TorchTitan warns that hf_assets_path does not exist; a coda: tokenizer spec is resolved later."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("HF assets path coda:")


def validate(config) -> None:
    """Semantic checks TorchTitan would only fail on deep inside the Trainer."""
    from torchtitan.protocols.train_spec import get_train_spec

    from .kernels import BackendUnavailable, resolve_backend
    from .titan.data import DataError, LOCAL_DATASET, ensure_tokenizer, known_datasets, local_files
    from .titan.job_config import ConfigError
    from .titan.job_config import validate as validate_coda
    from .titan.train_spec import NAME

    try:
        spec = get_train_spec(config.model.name)
    except ValueError:
        raise UserError(f"unknown model.name {config.model.name!r}; use {NAME!r} (CODA) or 'llama3' (baseline)") from None
    if config.model.flavor not in spec.model_args:
        raise UserError(
            f"unknown flavor {config.model.flavor!r} for model {config.model.name!r}; "
            f"choose one of: {', '.join(sorted(spec.model_args))}"
        )
    if config.model.name == NAME:
        try:
            validate_coda(config.coda)
            backend = resolve_backend(config.coda.backend)
        except (BackendUnavailable, ConfigError) as e:
            raise UserError(str(e)) from None
        print(f"coda-titan: [coda] backend = {config.coda.backend!r} -> running the {backend!r} programs", flush=True)
    _check_converters(config)
    dataset = config.training.dataset.lower()
    if dataset not in known_datasets():
        raise UserError(f"unknown training.dataset {config.training.dataset!r}; choose one of: {', '.join(known_datasets())}")
    try:
        if dataset == LOCAL_DATASET:
            local_files(config.training.dataset_path or "")
        elif config.training.dataset_path and not Path(config.training.dataset_path).exists():
            raise DataError(
                f"training.dataset_path {config.training.dataset_path!r} does not exist; fix it or remove it"
            )
        config.model.hf_assets_path = ensure_tokenizer(config.model.hf_assets_path, log=_say)
    except DataError as e:
        raise UserError(str(e)) from None


def _check_converters(config) -> None:
    import torchtitan.components.quantization  # noqa: F401  (registers TorchTitan's float8/mx converters)
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    from .titan.fa4 import NAME as FA4, fa4_unavailable_reason

    for name in config.model.converters:
        if name not in _registry_model_converter_cls:
            raise UserError(
                f"unknown model.converters entry {name!r}; registered: {', '.join(sorted(_registry_model_converter_cls))}"
            )
    from .titan.train_spec import NAME

    quantized = [c for c in config.model.converters if c.startswith("quantize.")]
    if config.model.name == NAME and quantized:
        raise UserError(
            f"model.converters {quantized} cannot apply to {NAME}: its GEMMs run inside the CODA programs, which "
            "TorchTitan's float8/mx linears would not reach. Set [coda] precision = 'fp8' for CODA's FP8 programs, "
            "or model.name = 'llama3' for TorchTitan's FP8 baseline"
        )
    if FA4 in config.model.converters:
        reason = fa4_unavailable_reason()
        if reason is not None:
            raise UserError(f"model.converters lists {FA4!r} (FlashAttention-4) but {reason}; remove it to use SDPA")
        print("coda-titan: attention = FlashAttention-4 (model.converters 'fa4')", flush=True)
    else:
        print("coda-titan: attention = SDPA (add 'fa4' to model.converters for FlashAttention-4)", flush=True)


def _say(msg: str) -> None:
    print(f"coda-titan: {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_env(config, config_path: str) -> None:
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if config.metrics.enable_wandb:
        stem = Path(config_path).stem
        os.environ.setdefault("WANDB_PROJECT", "coda_titan")
        os.environ.setdefault("WANDB_RUN_NAME", stem)
        os.environ.setdefault("WANDB_TAGS", ",".join([stem, config.model.name, config.model.flavor]))
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE") and not _wandb_logged_in():
            os.environ["WANDB_MODE"] = "offline"
            _say("no W&B API key found: W&B runs in offline mode (set WANDB_API_KEY or run `wandb login` to sync live)")


def _wandb_logged_in() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def _report_wandb(config) -> None:
    if not config.metrics.enable_wandb:
        return
    root = Path(config.job.dump_folder) / config.metrics.save_tb_folder
    runs = sorted(glob.glob(str(root / "**" / "wandb" / "*run-*"), recursive=True), key=os.path.getmtime)
    if runs:
        run = runs[-1]
        if Path(run).name.startswith("offline-run"):
            _say(f"W&B offline run written to {run}; upload it with: wandb sync {run}")
        else:
            _say(f"W&B run files in {run}")


def train(config_path: str, overrides: list[str]) -> None:
    config = parse_config(config_path, overrides)
    validate(config)
    _setup_env(config, config_path)

    import torch
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    init_logger()
    logger.info(f"coda-titan: training {config.model.name}/{config.model.flavor} from {config_path}")
    trainer = None
    try:
        trainer = Trainer(config)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    _say(f"done: outputs in {config.job.dump_folder}")
    _report_wandb(config)


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="coda-titan", description=__doc__.split("\n\n")[0].strip("`").replace("``", ""),
        epilog="Run `coda-titan train CONFIG.toml --help` for every override key of a config.",
    )
    parser.add_argument("--version", action="version", version=f"coda-titan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_train = sub.add_parser(
        "train", help="train from a TorchTitan TOML config",
        description="Train from a TorchTitan TOML job config with TorchTitan's own Trainer. The config is checked "
        "before anything is built; a problem is one line on stderr and exit status 2.",
        epilog="`coda-titan train CONFIG.toml --help` lists every override key (--section.key) with its value.",
    )
    p_train.add_argument("config", help="path to a TOML job config (see configs/)")
    p_train.add_argument("overrides", nargs=argparse.REMAINDER,
                         help="TorchTitan overrides, e.g. --training.steps 20 --coda.precision fp8")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            train(args.config, args.overrides)
    except UserError as e:
        print(f"coda-titan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
