"""Build the Ray cluster a run needs: placement, generator, learner group, weight sync, rewards.

Every backend and placement choice of a run is made here, once, from the config:

    colocated (GPU)   bundle i = GPU i; learner rank i on bundle i; the vLLM engine shares
                      bundle 0 with learner rank 0 and sleeps while the learners train
    split (GPU)       bundle 0 = the generator's `generator_gpus` GPUs; bundles 1..N = learners
    learners only     DPO: bundle i = GPU i = learner rank i; no generator, no reward workers
    CPU               the same layouts with small CPU shares instead of GPUs (sleep is a no-op)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from actors.actor_group import ActorGroup, load_class, node_address
from actors.device import detect
from actors.learner_group import RayLearnerGroup
from actors.reward_worker import RayRewardScorer
from actors.weight_sync import WeightSyncer, choose_transport
from rlhf.config import RunConfig
from rlhf.dpo import needs_reference_model
from rlhf.types import Completion, SamplingSpec

GENERATORS = {"vllm": "actors.vllm_generator:VLLMGenerator", "hf": "actors.hf_generator:HFGenerator"}
LEARNERS = {"fsdp2": "actors.fsdp2_learner:FSDP2Learner", "deepspeed": "actors.deepspeed_learner:DeepSpeedLearner"}


class RemoteGenerator:
    """`rlhf.protocols.Generator` over the generator actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def generate(self, prompt_ids: Sequence[list[int]], sampling: SamplingSpec) -> list[Completion]:
        return ray.get(self.actor.generate.remote(list(prompt_ids), sampling))

    def sleep(self) -> None:
        ray.get(self.actor.sleep.remote())

    def wake(self) -> None:
        ray.get(self.actor.wake.remote())


@dataclass
class RayCluster:
    generator: RemoteGenerator
    learners: RayLearnerGroup
    weight_sync: WeightSyncer
    rewards: RayRewardScorer
    pg: Any

    def shutdown(self) -> None:
        for close in (self.rewards.shutdown, self.learners.shutdown, lambda: ray.kill(self.generator.actor)):
            try:
                close()
            except Exception as e:  # keep closing the rest; a dead actor must not leak the others
                print(f"shutdown: {e}")
        remove_placement_group(self.pg)


@dataclass(frozen=True)
class _Layout:
    bundles: list[dict[str, float]]
    generator_bundle: int
    learner_bundles: list[int]
    generator_share: dict[str, float]
    learner_share: dict[str, float]


def plan_layout(cfg: RunConfig, device_kind: str, *, generator: bool = True) -> _Layout:
    """Bundles and per-actor resource shares for the configured placement (`generator=False`:
    learners only, one whole device each)."""
    n, g = cfg.learner.num_ranks, cfg.cluster.generator_gpus
    unit = "GPU" if device_kind != "cpu" else "CPU"
    # CPU shares are tokens for scheduling, not a claim on cores: actors on CPU all share the host.
    one = 1.0 if unit == "GPU" else 0.1
    if not generator:
        return _Layout(bundles=[{unit: one} for _ in range(n)], generator_bundle=-1,
                       learner_bundles=list(range(n)), generator_share={}, learner_share={unit: one})
    if cfg.cluster.placement == "colocated":
        if g != 1:
            raise ValueError("cluster.placement=colocated runs one engine beside learner rank 0: set "
                             "cluster.generator_gpus=1 (or use placement=split for tensor-parallel generation)")
        return _Layout(
            bundles=[{unit: one} for _ in range(n)],
            generator_bundle=0,
            learner_bundles=list(range(n)),
            generator_share={unit: one * 0.4},
            learner_share={unit: one * 0.5},
        )
    return _Layout(
        bundles=[{unit: one * g}] + [{unit: one} for _ in range(n)],
        generator_bundle=0,
        learner_bundles=list(range(1, n + 1)),
        generator_share={unit: one * g},
        learner_share={unit: one},
    )


def _share(share: dict[str, float]) -> dict[str, float]:
    return {"num_gpus": share.get("GPU", 0.0), "num_cpus": share.get("CPU", 0.0)}


def needs_reference(cfg: RunConfig) -> bool:
    """Whether the learners hold a frozen reference model: GRPO with a KL term, DPO unless its
    reference log-probs are precomputed (or it is SimPO)."""
    return cfg.grpo.kl_coef > 0 if cfg.algorithm == "grpo" else needs_reference_model(cfg)


def _learner_group(cfg: RunConfig, model_path: str, pg: Any, layout: _Layout) -> RayLearnerGroup:
    group = ActorGroup(
        load_class(LEARNERS[cfg.learner.backend]), pg=pg, bundles=layout.learner_bundles,
        **_share(layout.learner_share),
        make_kwargs=lambda rank, addr, port: dict(
            rank=rank, world_size=cfg.learner.num_ranks, master_addr=addr, master_port=port,
            model_path=model_path, model_cfg=cfg.model, learner_cfg=cfg.learner,
            temperature=cfg.generation.temperature or 1.0, with_reference=needs_reference(cfg), seed=cfg.seed,
        ),
    )
    return RayLearnerGroup(group, model_path=model_path, export_dtype=cfg.model.dtype)


@dataclass
class LearnerCluster:
    """Learners only (DPO): what `rlhf.dpo.run_dpo` talks to."""

    learners: RayLearnerGroup
    pg: Any

    def shutdown(self) -> None:
        try:
            self.learners.shutdown()
        finally:
            remove_placement_group(self.pg)


def build_learner_cluster(cfg: RunConfig, model_path: str) -> LearnerCluster:
    """The learner group alone, one device per rank; Ray must be initialised already."""
    layout = plan_layout(cfg, detect().kind, generator=False)
    pg = placement_group(layout.bundles, strategy="PACK")
    ray.get(pg.ready())
    return LearnerCluster(learners=_learner_group(cfg, model_path, pg, layout), pg=pg)


def build_cluster(cfg: RunConfig, model_path: str) -> RayCluster:
    """Create every actor of the run; Ray must be initialised already (scripts do it)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    device = detect()
    layout = plan_layout(cfg, device.kind)
    pg = placement_group(layout.bundles, strategy="PACK")
    ray.get(pg.ready())

    gen_cls = ray.remote(load_class(GENERATORS[cfg.generation.backend]))
    generator = gen_cls.options(
        **_share(layout.generator_share),
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, layout.generator_bundle),
    ).remote(
        model_path, cfg.generation, dtype=cfg.model.dtype, seed=cfg.seed,
        enable_sleep=device.kind != "cpu" and cfg.cluster.placement == "colocated",
        tensor_parallel_size=cfg.cluster.generator_gpus,
    )

    learners = _learner_group(cfg, model_path, pg, layout)
    # Learner rank 0 runs the sender side of the NCCL transport: its node's address and a free port.
    addr, port = ray.get(node_address.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, layout.learner_bundles[0])).remote())
    transport = choose_transport(cfg, device.kind, addr, port)
    return RayCluster(
        generator=RemoteGenerator(generator),
        learners=learners,
        weight_sync=WeightSyncer(learners, generator, transport),
        rewards=RayRewardScorer(cfg.reward),
        pg=pg,
    )

