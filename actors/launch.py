"""What the entry scripts share: the command line, the run folder, a Ray session that always ends."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from rlhf.config import ConfigError, RunConfig, config_to_dict, load_config


@contextmanager
def ray_session(cfg: RunConfig) -> Iterator[Path]:
    """Create `cfg.output_dir` with the resolved `config.yaml`, join the Ray cluster at
    `cluster.address` / RAY_ADDRESS (as under `ray job submit`) or start a local one, and shut Ray
    down on the way out, error or not. Yields the output folder."""
    import ray

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    ray.init(address=cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    try:
        yield out
    finally:
        ray.shutdown()


def cli(doc: str, default_config: str, algorithm: str, argv: list[str] | None,
        prepare: Callable[[RunConfig], tuple], run: Callable[..., None]) -> int:
    """The entry scripts' `main`: parse `--config` and overrides, check the recipe is for
    `algorithm`, run `prepare(cfg)` (everything that can fail on bad input, before Ray starts),
    then `run(cfg, *prepared)`. Bad input prints one `error:` line and returns 2."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_config, help="YAML recipe (default: %(default)s)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. learner.lr=1e-5 output_dir=outputs/x")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.algorithm != algorithm:
            raise ConfigError(f"algorithm={cfg.algorithm!r}: this script trains {algorithm} recipes "
                              f"(algorithm: {algorithm}); use scripts/train_{cfg.algorithm}.py")
        prepared = prepare(cfg)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        run(cfg, *prepared)
    except ConfigError as e:  # what only the Ray cluster can tell: too few GPUs for the layout
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from actors.actor_group import ActorFailure

        if not isinstance(e, ActorFailure):
            raise
        print(f"error: {e}. {resume_hint(cfg)}", file=sys.stderr)
        return 1
    return 0


def resume_hint(cfg: RunConfig) -> str:
    """Where a failed run can continue from."""
    from rlhf.checkpoint import latest_checkpoint

    path = latest_checkpoint(cfg.output_dir)
    if path is None:
        return "No checkpoint was written; rerun from the start (save_every=K keeps one every K steps)"
    return f"Resume from {path} with resume=true"
