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
import glob
import logging
import os
import shlex
import signal
import socket
import sys
import threading
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


def parse_config(config_path: str, overrides: list[str]):
    """TorchTitan JobConfig from the TOML plus CLI overrides, with the plug-in wired in."""
    from .titan.config_checks import check_overrides, check_toml
    from .titan.job_config import ConfigError

    path = Path(config_path)
    toml = _load_toml(path)
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
    try:  # before TorchTitan's parser, which would only warn about a wrong type or print a usage box
        check_toml(merged, toml)
        check_overrides(merged, overrides, toml)
    except ConfigError as e:
        raise UserError(str(e)) from None
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
    from .titan import preflight
    from .titan.data import DataError, LOCAL_DATASET, ensure_tokenizer, known_datasets
    from .titan.train_spec import NAME

    try:
        spec = get_train_spec(config.model.name)
    except ValueError:
        raise UserError(f"unknown model.name {config.model.name!r}; use {NAME!r} (CODA), 'llama3' (baseline) or "
                        "'liger_llama3' (the baseline with Liger's kernels)") from None
    if config.model.flavor not in spec.model_args:
        raise UserError(
            f"unknown flavor {config.model.flavor!r} for model {config.model.name!r}; "
            f"choose one of: {', '.join(sorted(spec.model_args))}"
        )
    if config.model.name == NAME:
        from .titan.job_config import ConfigError, validate as validate_coda

        try:  # (each [coda] value was checked against the schema by parse_config; here their combination)
            validate_coda(config.coda)
            backend = resolve_backend(config.coda.backend)
        except (BackendUnavailable, ConfigError) as e:
            raise UserError(str(e)) from None
        print(f"coda-titan: [coda] backend = {config.coda.backend!r} -> running the {backend!r} programs", flush=True)
        if config.coda.precision == "fp8" and backend == "torch":
            _say("[coda] precision = 'fp8' on the torch backend runs the exact fp8 emulation of the reference "
                 "programs: correct, and slower than bf16 (the fast fp8 path needs the cute backend on an H100)")
    _check_liger(config)
    _check_converters(config)
    dataset = config.training.dataset.lower()
    if dataset not in known_datasets():
        raise UserError(f"unknown training.dataset {config.training.dataset!r}; choose one of: {', '.join(known_datasets())}")
    try:
        preflight.check_training(config)
        preflight.check_folders(config)
        preflight.check_dataset(config, LOCAL_DATASET)
        config.model.hf_assets_path = ensure_tokenizer(config.model.hf_assets_path, log=_say)
        preflight.check_tokenizer(config.model.hf_assets_path, spec.model_args[config.model.flavor].vocab_size)
        for note in preflight.check_checkpoint(config):
            _say(note)
    except (DataError, preflight.PreflightError) as e:
        raise UserError(str(e)) from None


def _check_liger(config) -> None:
    from .titan.liger import NAME as LIGER, liger_unavailable_reason

    if config.model.name == LIGER:
        reason = liger_unavailable_reason()
        if reason is not None:
            raise UserError(f"model.name = {LIGER!r} runs Liger's kernels but {reason}; use 'llama3' for stock")
        print("coda-titan: model = stock llama3 with Liger's RMSNorm, SiLU-mul and fused linear cross-entropy",
              flush=True)


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
    if os.environ.get("RANK", "0") == "0":  # under torchrun: once, from rank 0
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


class Interrupted(Exception):
    """Ctrl-C during training; the message says where it stopped and how to resume."""


SHUTDOWN_S = 60
_said: list[str] = []


class CheckpointSafeInterrupts:
    """SIGINT handling that never cuts a checkpoint write in half.

    Outside a save, Ctrl-C raises KeyboardInterrupt as usual. During a save (TorchTitan's
    ``CheckpointManager.save``, wrapped with :meth:`guard`) the first Ctrl-C is deferred: the save
    finishes, then KeyboardInterrupt is raised. An interrupted DCP save would otherwise end as a
    CheckpointException with a traceback, or block in its writer. A second Ctrl-C during the save
    stops at once, saying that the step being written is incomplete (a resume skips it)."""

    def __init__(self):
        self.saving = False
        self.pending = False

    def handler(self, signum, frame):
        if not self.saving:
            raise KeyboardInterrupt
        if not self.pending:
            self.pending = True
            _say("Ctrl-C: finishing the checkpoint being written, then stopping (Ctrl-C again to stop at once)")
            return
        sys.stderr.write("coda-titan: interrupted again while a checkpoint was being written: that step has no "
                         ".metadata and a resume skips it\n")
        sys.stderr.flush()
        os._exit(130)

    def guard(self, save):
        def guarded(*args, **kwargs):
            self.saving = True
            try:
                return save(*args, **kwargs)
            finally:
                self.saving = False
                if self.pending:
                    self.pending = False
                    raise KeyboardInterrupt
        return guarded


def _exit_if_shutdown_hangs(message: str, dump_folder: str, seconds: float = SHUTDOWN_S) -> None:
    """After Ctrl-C: if closing the trainer or the interpreter's exit has not ended the process in
    ``seconds``, write every thread's stack to ``<dump_folder>/interrupt_stacks.txt``, say the
    interruption line (unless it was said already) and end the process with 130. A Ctrl-C must stop
    the run even when a library's shutdown blocks."""
    import faulthandler

    def fire():
        path = Path(dump_folder) / "interrupt_stacks.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            path = None
        if not _said:
            where = f"; thread stacks in {path}" if path else ""
            sys.stderr.write(f"coda-titan: {message} (shutdown did not finish in {seconds:.0f} s{where})\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def train(config_path: str, overrides: list[str]) -> None:
    config = parse_config(config_path, overrides)
    validate(config)
    _setup_env(config, config_path)

    import torch
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    from .titan import fp8_state, input_stream
    from .titan.run_summary import StepLog, lm_head_repairs, newest_checkpoint, summary

    init_logger()
    logger.info(f"coda-titan: training {config.model.name}/{config.model.flavor} from {config_path}")
    steps = StepLog()
    logging.getLogger().addHandler(steps)
    trainer = None
    interrupts = CheckpointSafeInterrupts()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupts.handler)
    try:
        trainer = Trainer(config)
        if trainer.checkpointer is not None:
            trainer.checkpointer.save = interrupts.guard(trainer.checkpointer.save)
        fp8_state.attach(trainer)
        input_stream.attach(trainer)
        trainer.train()
        clamped = fp8_state.saturation_report(trainer)
    except KeyboardInterrupt:
        ckpt = newest_checkpoint(config)
        where = f"the last checkpoint is {ckpt}" if ckpt else "no checkpoint was saved (checkpoint.enable is off or none was due)"
        again = shlex.join(["coda-titan", "train", config_path, *overrides])
        message = f"interrupted during step {trainer.step if trainer else 0}; {where}; resume with: {again}"
        _exit_if_shutdown_hangs(message, config.job.dump_folder)
        raise Interrupted(message) from None
    finally:
        logging.getLogger().removeHandler(steps)
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    _say(f"done: {summary(steps.rows)}{lm_head_repairs()}")
    if clamped:
        _say(clamped)
    ckpt = newest_checkpoint(config)
    _say(f"outputs in {config.job.dump_folder}" + (f"; newest checkpoint {ckpt}" if ckpt else ""))
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
    except Interrupted as e:
        print(f"coda-titan: {e}", file=sys.stderr, flush=True)
        _said.append(str(e))
        return 130
    except KeyboardInterrupt:
        print("coda-titan: interrupted before training started; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
