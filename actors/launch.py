"""What the entry scripts share: the command line, the run folder, a Ray session that always ends."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import yaml

from rlhf.config import ConfigError, RunConfig, config_to_dict, load_config


@contextmanager
def ray_session(cfg: RunConfig) -> Iterator[Path]:
    """Create `cfg.output_dir` with the resolved `config.yaml`, print what the run is, join the Ray
    cluster at `cluster.address` / RAY_ADDRESS (as under `ray job submit`) or start a local one,
    and shut Ray down on the way out, error or not. Unless `logging.verbose`, what the libraries
    print goes to `<output_dir>/logs/` (actors/console.py). Yields the output folder."""
    import ray

    from actors.console import collect_ray_logs, describe_run, driver_logs_to_file, ray_init_kwargs
    from rlhf.trackers import check_backends

    check_backends(cfg.logging.backends)  # a missing tracker package: one line, before anything starts
    out, verbose = Path(cfg.output_dir), cfg.logging.verbose
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    print(describe_run(cfg), flush=True)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    with driver_logs_to_file(logs, verbose=verbose):
        context = ray.init(address=address, **ray_init_kwargs(logs, verbose=verbose))
        try:
            yield out
        except Exception as e:
            if not verbose and not isinstance(e, ConfigError):
                print(f"logs of the engines, learners and Ray: {logs}/", file=sys.stderr)
            raise
        finally:
            ray.shutdown()
            if not verbose:  # Ray's own logs only from an instance this run started
                collect_ray_logs(logs, None if address else context.address_info.get("session_dir"))


def cli(doc: str, default_config: str, algorithm: str, argv: list[str] | None,
        prepare: Callable[[RunConfig], tuple], run: Callable[..., None]) -> int:
    """The entry scripts' `main`: parse `--config` and overrides, check the recipe is for
    `algorithm`, settle the compute dtype for this machine, check the output folder and the
    checkpoint to resume from, run `prepare(cfg)` (everything else that can fail on bad input),
    all before Ray starts; then `run(cfg, *prepared)`. Bad input prints one `error:` line and
    returns 2; an actor that dies or hangs, one line naming it and where to resume, and 1."""
    from rlhf.checkpoint import checkpoint_to_resume

    try:
        args = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse(
            argv, default_config)
        cfg = with_compute_dtype(load_config(args.config, args.overrides))
        if cfg.algorithm != algorithm:
            raise ConfigError(f"algorithm={cfg.algorithm!r}: this script trains {algorithm} recipes "
                              f"(algorithm: {algorithm}); use scripts/train_{cfg.algorithm}.py")
        check_output_dir(cfg.output_dir)
        check_model_folder(cfg.model.path)
        if cfg.resume:
            checkpoint_to_resume(cfg.output_dir, cfg.resume)  # verified now: a corrupt one is bad input
        prepared = prepare(cfg)
    except (ValueError, OSError, RuntimeError, ImportError, KeyError) as e:  # ConfigError is a ValueError
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        run(cfg, *prepared)
    except ConfigError as e:  # what only the Ray cluster can tell: too few GPUs for the layout
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from actors.actor_group import ActorFailure
        from rlhf.grpo import RewardFailure

        if not isinstance(e, (ActorFailure, RewardFailure)):
            raise
        print(f"error: {_one_line(e)}. {resume_hint(cfg)}", file=sys.stderr)
        return 1
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one `error:` line (exit status 2) instead of usage + error."""

    def parse(self, argv: list[str] | None, default_config: str) -> argparse.Namespace:
        self.add_argument("--config", default=default_config, help="YAML recipe (default: %(default)s)")
        self.add_argument("--verbose", action="store_true",
                          help="show vLLM/Ray/learner logs here (= logging.verbose=true; else <output_dir>/logs/)")
        self.add_argument("overrides", nargs="*", help="key=value overrides, e.g. learner.lr=1e-5 output_dir=outputs/x")
        args = self.parse_args(argv)
        args.overrides += ["logging.verbose=true"] if args.verbose else []
        return args

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (usage: {self.prog} [--config FILE] [key=value ...])")


def with_compute_dtype(cfg: RunConfig) -> RunConfig:
    """`cfg` with `model.dtype` settled for this machine (`actors.device.compute_dtype`: `auto`, or
    bf16 on a CPU that only emulates it, becomes what the hardware computes fast), printed once when
    it differs from the recipe's. Every actor, and the run's config.yaml, sees the settled value."""
    from actors.device import compute_dtype

    dtype, why = compute_dtype(cfg.model.dtype)
    if dtype == cfg.model.dtype:
        return cfg
    print(f"model.dtype: {cfg.model.dtype} -> {dtype}: {why}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


def check_output_dir(output_dir: str) -> None:
    """The run folder exists or can be made, and is a writable folder (not a file)."""
    out = Path(output_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir!r}: {existing} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={output_dir!r}: {existing} is not writable")


def check_model_folder(path: str) -> None:
    """A local model folder exists and holds an HF config (built-in names and hub ids such as
    `Qwen/Qwen2.5-0.5B` are resolved later)."""
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists():
        raise ConfigError(f"model.path={path!r} does not exist")
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path={path!r} is a folder without config.json, not a Hugging Face model folder")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (ValueError, OSError, RuntimeError)) else f"{type(e).__name__}: {text}"


def resume_hint(cfg: RunConfig) -> str:
    """Where a failed run can continue from."""
    from rlhf.checkpoint import latest_checkpoint

    path = latest_checkpoint(cfg.output_dir)
    if path is None:
        return "No checkpoint was written; rerun from the start (save_every=K keeps one every K steps)"
    return f"Resume from {path} with resume=true"
