"""What the entry scripts share: the command line, the run folder, a Ray session that always ends."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import yaml

from actors.worker_setup import gc_paused
from rlhf.config import ConfigError, RunConfig, config_to_dict, load_config

if TYPE_CHECKING:
    from rlhf.planner.shapes import GpuKind


@contextmanager
def ray_session(cfg: RunConfig) -> Iterator[Path]:
    """Create `cfg.output_dir` with the resolved `config.yaml`, print what the run is, join the Ray
    cluster at `cluster.address` / RAY_ADDRESS (as under `ray job submit`) or start a local one,
    and shut Ray down on the way out, error or not (SIGTERM included: it raises Terminated, as
    Ctrl-C raises KeyboardInterrupt). Unless `logging.verbose`, what the libraries print goes to
    `<output_dir>/logs/` (scripts/console.py). Yields the output folder."""
    import ray

    from rlhf.run.trackers import check_backends
    from scripts.console import describe_run, driver_logs_to_file, ray_init_kwargs

    check_backends(cfg.logging.backends)  # a missing tracker package: one line, before anything starts
    out, verbose = Path(cfg.output_dir), cfg.logging.verbose
    logs = out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        write_run_config(cfg, out)
    except OSError as e:  # checked before (check_output_dir), but a disk can fill up or a folder vanish
        raise ConfigError(f"output_dir={cfg.output_dir}: cannot write the run folder "
                          f"({_one_line(e)})") from None
    print(describe_run(cfg), flush=True)
    if cfg.env.tools or cfg.env.environment:  # the boundary of the code they run
        from rlhf.env.sandbox import describe_mode

        print(describe_mode(cfg.env.sandbox), flush=True)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    with driver_logs_to_file(logs, verbose=verbose):
        context = ray.init(address=address, **ray_init_kwargs(logs, verbose=verbose, local=address is None))
        try:
            with _sigterm_as_interrupt():  # after ray.init, whose own handler would end the driver on the spot
                yield out
        except Exception as e:
            if not verbose and not isinstance(e, ConfigError):
                print(f"logs of the engines, learners and Ray: {logs}/", file=sys.stderr)
            raise
        finally:
            ray.shutdown()
            if not verbose:  # Ray's own logs only from an instance this run started
                gather_logs(logs, None if address else context.address_info.get("session_dir"))


def gather_logs(logs: Path, session_dir: str | None) -> None:
    """`collect_ray_logs` (scripts/console.py), whose failure (a full disk, a vanished file) is one
    warning line: in `ray_session`'s finally it must never replace the error the run is ending
    with, nor bury it under a traceback of its own."""
    from scripts.console import collect_ray_logs

    try:
        collect_ray_logs(logs, session_dir)
    except Exception as e:
        kept = f"; Ray's own logs stay in {session_dir}/logs" if session_dir else ""
        print(f"warning: the run's logs were not all gathered into {logs} ({_one_line(e)[:200]}){kept}",
              file=sys.stderr)


def write_run_config(cfg: RunConfig, out: Path) -> Path:
    """The run's resolved `config.yaml` (settled dtype and memory plan included)."""
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


def cli(doc: str, default_config: str, algorithm: str, argv: list[str] | None,
        prepare: Callable[[RunConfig], tuple], run: Callable[..., None]) -> int:
    """The entry scripts' `main`: everything that can fail on bad input, checked before Ray starts
    (`checked_run`), then `run(cfg, *prepared)`. Bad input prints one `error:` line and returns 2;
    an actor that dies or hangs, or a RunError, one line naming it and where to resume, and 1;
    Ctrl-C, one line naming what was saved and how to resume, and 130 (Ray is shut down on the way
    out: `ray_session`); SIGTERM (a scheduler, `kill`, `timeout`) the same way, and 143. Tracebacks
    go to `<output_dir>/logs/driver.log`, not the terminal."""
    try:
        with gc_paused():  # start-up (actors/worker_setup.py)
            cfg, prepared = checked_run(doc, default_config, algorithm, argv, prepare)
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) before the run started; run the command again to start it",
              file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, ImportError, KeyError) as e:  # ConfigError is a ValueError
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        run(cfg, *prepared)
    except KeyboardInterrupt as e:  # Terminated too: SIGTERM once Ray is up (ray_session)
        _end_progress_bars()
        _log_traceback(cfg, e)
        print(f"error: {interrupted(cfg, 'SIGTERM' if isinstance(e, Terminated) else 'Ctrl-C')}", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except ConfigError as e:  # what only the Ray cluster can tell: too few GPUs for the layout
        _end_progress_bars()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from actors.actor_group import ActorFailure
        from rlhf.errors import RunError

        if not isinstance(e, (ActorFailure, RunError)):
            raise
        _end_progress_bars()
        _log_traceback(cfg, e)
        print(f"error: {_one_line(e)}. {resume_hint(cfg)}", file=sys.stderr)
        return 1
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run, taken as a Ctrl-C is: otherwise the driver dies on the spot (Ray's own
    handler logs it and re-raises), Ray is never shut down and its agents outlive the run."""


def _terminate(signum: int, frame: object) -> NoReturn:
    raise Terminated


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated inside (signal handlers belong to the main thread: elsewhere, as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def checked_run(doc: str, default_config: str, algorithm: str, argv: list[str] | None,
                prepare: Callable[[RunConfig], tuple]) -> tuple[RunConfig, tuple]:
    """Parse `--config` and overrides, check the recipe is for `algorithm`, apply `memory.plan: auto`
    (`with_memory_plan`), settle the compute dtype for this machine, check the output folder
    (writable; an earlier run there is refused without resume or overwrite: rlhf/run/folder.py)
    and the checkpoint to resume from, run `prepare(cfg)` (everything else that can fail on bad
    input, the resume's fit to its checkpoint included), and with overwrite=true delete the earlier
    run last. Returns the settled config and what `prepare` returned."""
    from rlhf.run.preflight import check_files
    from rlhf.run.folder import check_run_folder, clear_earlier_run

    args = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter).parse(
        argv, default_config)
    cfg = load_config(args.config, args.overrides)
    if cfg.algorithm != algorithm:
        raise ConfigError(f"algorithm={cfg.algorithm!r}: this script trains {algorithm} recipes "
                          f"(algorithm: {algorithm}); use scripts/train_{cfg.algorithm}.py")
    check_rollout_quantization(cfg)  # before the dtype is settled: on CPU the device is the reason
    # The plan is for the GPU that `memory.gpu` names, in the dtype the recipe asks of it; then the
    # dtype is settled for this machine (a CPU without native bf16 computes in fp32).
    cfg = with_compute_dtype(with_memory_plan(cfg, args.config, args.overrides))
    check_output_dir(cfg.output_dir)
    check_model_folder(cfg.model.path)
    check_files(cfg)  # learner.deepspeed_config
    check_run_folder(cfg)  # an earlier run without resume/overwrite; the checkpoint to resume verified
    prepared = prepare(cfg)
    from rlhf.run.checkpoint import preflight_checkpoints

    preflight_checkpoints(cfg, prepared[0])  # the signing key; room on the disk for the checkpoints
    if cfg.learner.lora_rank:  # prepared[0]: the resolved model folder
        from actors.vllm_lora import settle_lora_sync
        from rlhf.lora import check_lora

        check_lora(cfg, prepared[0])  # target modules; adapters need the vLLM generator
        cfg = settle_lora_sync(cfg, prepared[0])  # auto -> adapter or merged; adapters vLLM can serve
    if cfg.overwrite and (cleared := clear_earlier_run(cfg.output_dir)):
        print(cleared)  # last: nothing is deleted for a run that bad input stops
    return cfg, prepared


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


def check_rollout_quantization(cfg: RunConfig) -> None:
    """`generation.quantization: fp8` refused in one line where this machine's device has no FP8
    (the engines run on the kind of device the driver sees: actors/cluster.py), else said once."""
    if cfg.algorithm != "grpo" or cfg.generation.quantization == "none":
        return
    from actors.device import detect
    from actors.vllm_generator import refuse_quantization

    refuse_quantization(cfg.generation, detect())
    print(f"generation.quantization: {cfg.generation.quantization}: the engines serve vLLM's online FP8, "
          f"quantized again at every push (mismatch/logprob_abs_diff: the gap to the learners' weights)")


def with_memory_plan(cfg: RunConfig, config_path: str | None, overrides: list[str]) -> RunConfig:
    """`cfg` with `memory.plan: auto` applied (rlhf/planner/memory.py): the plan's values for the keys that
    neither the recipe nor the overrides set, printed once; they reach every actor and config.yaml.
    A recipe that fits nowhere is a ConfigError naming the memory it needs and what to change. On a
    machine without a GPU and `memory.gpu: auto` there is nothing to plan for: one line says so and
    the recipe runs as written (CPU runs keep working with the key on)."""
    if cfg.memory.plan == "off":
        return cfg
    from rlhf.config import explicit_keys
    from rlhf.planner.memory import applied, make_plan, no_fit_message, plan_lines
    from rlhf.planner.shapes import model_shape

    gpu = planned_gpu(cfg.memory.gpu, cfg.memory.gpu_memory_gib)
    if gpu is None:
        print("memory.plan=auto: no GPU here to plan for, the recipe runs as written "
              "(memory.gpu=KIND plans for one)")
        return cfg
    pinned, shape = explicit_keys(config_path, overrides), model_shape(cfg.model.path)
    plan = make_plan(cfg, shape, gpu, pinned)
    if plan.best is None:
        raise ConfigError(f"memory.plan=auto: {no_fit_message(cfg, shape, gpu, plan, pinned)}")
    kept = f" (kept as set: {', '.join(plan.kept)})" if plan.kept else ""
    values = " ".join(plan_lines(plan)) or "no changes"
    print(f"memory plan for {gpu.name} ({gpu.memory_gib:.0f} GiB): {values}{kept}")
    return applied(cfg, plan)


def planned_gpu(kind: str, memory_gib: float = 0.0) -> GpuKind | None:
    """The planner's GpuKind for `memory.gpu` (`auto`: this machine's GPU 0 by name and memory), its
    memory replaced by `memory_gib` when > 0; None for `auto` with neither a GPU nor a memory."""
    from actors.device import gpu_identity
    from rlhf.planner.shapes import gpu_kind, gpu_kind_of_device

    if kind != "auto":
        return gpu_kind(kind, memory_gib)
    name, found_gib = gpu_identity() or ("custom GPU", 0.0)
    return gpu_kind_of_device(name, memory_gib or found_gib) if memory_gib or found_gib else None


def check_output_dir(output_dir: str) -> None:
    """The run folder exists or can be made, and is a writable folder (not a file). Tried, not
    asked: as root os.access says yes to /proc or /sys, where nothing can be created; a folder made
    and removed again in the deepest part of the path that exists says what creating it will."""
    out = Path(output_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir!r}: {existing} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlhf-write-test-", dir=existing))
    except OSError as e:
        raise ConfigError(f"output_dir={output_dir!r}: nothing can be created in {existing or Path.cwd()} "
                          f"({e.strerror or type(e).__name__}); choose a folder you can write to") from None


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
    from rlhf.run.checkpoint import latest_checkpoint
    from rlhf.run.folder import earlier_run

    path = latest_checkpoint(cfg.output_dir)
    if path is not None:
        return f"Resume from {path} with resume=true"
    kept = sorted(Path(cfg.output_dir, "checkpoints").glob("step_*_model_only"))
    if kept:  # a save that failed kept the finished model (rlhf.run.checkpoint)
        return f"No resumable checkpoint was written; the trained model is in {kept[-1]}"
    again = "start it again with overwrite=true" if earlier_run(cfg.output_dir) else "run it again"
    return f"No checkpoint was written; {again} (save_every=K keeps one every K steps)"


def interrupted(cfg: RunConfig, by: str = "Ctrl-C") -> str:
    """The line for a run stopped by Ctrl-C (or SIGTERM): how far it got, what was saved, how to resume."""
    from rlhf.run.folder import metrics_steps, steps_done

    steps = metrics_steps(cfg.output_dir)
    return f"interrupted ({by}){f' after {steps_done(steps)}' if steps else ''}. {resume_hint(cfg)}"


def _end_progress_bars() -> None:
    """Close the progress bar a run ended inside of (it ends its line), so that the error line
    starts a line of its own and no bar is drawn after it at exit."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _log_traceback(cfg: RunConfig, e: BaseException) -> None:
    """Append the driver's traceback of a run-ending failure to `<output_dir>/logs/driver.log`
    (the terminal gets one line); nothing when that folder is not there."""
    import traceback

    try:
        with open(Path(cfg.output_dir) / "logs" / "driver.log", "a") as f:
            f.write("run ended by:\n" + "".join(traceback.format_exception(e)))
    except OSError:
        pass
