"""Build the Ray cluster a run needs: placement, engines, learner group, weight sync, rewards.

Every backend and placement choice of a run is made here, once, from the config:

    colocated (GPU)   bundle i = GPU i = learner rank i; E engines, engine e on bundle e * (N / E)
                      beside that learner rank (auto: E = N, one per GPU), or E = K * N: K engines
                      on every bundle, started one after another, with 1/K of vLLM's share each
                      (`rlhf.rules.engines_per_device`); they sleep while the learners train, and
                      each gets the weights from the rank on its own GPU
    split (GPU)       bundles 0..E/K-1 = the engines, `generator_tp` GPUs each, or K engines on each
                      (`cluster.engines_per_gpu`, started in turn like colocated ones); then N bundles =
                      the learners (auto: E = K x the GPUs the learners leave free / generator_tp)
    learners only     DPO: bundle i = GPU i = learner rank i; no engines, no reward workers
    CPU               the same layouts with small CPU shares instead of GPUs (sleep is a no-op);
                      auto: one engine (more would share the same cores)
    reward worker     no share, unless it serves models on a device (`rlhf.rules.device_share`):
                      colocated, a slice of bundle 0 beside engine 0 and learner rank 0; split,
                      one more bundle of its own after the learners'

Several nodes: the bundles are one placement group (`cluster.placement_strategy`: PACK fills a
node first, SPREAD puts bundles on different nodes); learner rank 0's node is the rendezvous of the
learners and of the NCCL weight sync. The model path must be readable on every node.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from actors.actor_group import TIMEOUT_ENV, ActorGroup, gather, load_class, node_address, set_timeout
from actors.device import detect
from actors.engine_group import EngineGroup
from actors.host_cores import host_gpu_ids
from actors.learner_base import LearnerRank
from actors.learner_group import RayLearnerGroup
from actors.reward_worker import RayRewardScorer
from actors.weight_sync import WeightSyncer, choose_transport, engine_targets
from rlhf.config import ClusterConfig, ConfigError, RunConfig
from rlhf.lora import serves_adapters
from rlhf.rules import (
    device_share,
    engine_count,
    engine_generation,
    engine_gpus,
    engines_per_device,
    engines_sleep,
    holds_reference_model,
)

GENERATORS = {"vllm": "actors.vllm_generator:VLLMGenerator", "hf": "actors.hf_generator:HFGenerator"}
PLACEMENT_TIMEOUT_S = 120.0  # a placement group not ready by then will not be: say why instead of hanging


@dataclass
class RayCluster:
    generator: EngineGroup
    learners: RayLearnerGroup
    weight_sync: WeightSyncer
    rewards: RayRewardScorer
    pg: Any

    def shutdown(self) -> None:
        for close in (self.rewards.shutdown, self.learners.shutdown, self.generator.shutdown):
            try:
                close()
            except Exception as e:  # keep closing the rest; a dead actor must not leak the others
                print(f"shutdown: {e}")
        remove_placement_group(self.pg)


@dataclass(frozen=True)
class Layout:
    bundles: list[dict[str, float]]
    engine_bundles: list[int]
    learner_bundles: list[int]
    engine_share: dict[str, float]
    learner_share: dict[str, float]
    reward_bundle: int | None = None
    """The reward worker's bundle where it takes a device share (module docstring), else None."""
    reward_share: dict[str, float] = dataclasses.field(default_factory=dict)

    def rank_beside(self, engine: int) -> int | None:
        """The learner rank on engine `engine`'s bundle (colocated), else None."""
        bundle = self.engine_bundles[engine]
        return self.learner_bundles.index(bundle) if bundle in self.learner_bundles else None


def plan_layout(cfg: RunConfig, device_kind: str, engines: int = 0) -> Layout:
    """Bundles and per-actor resource shares for the configured placement with `engines` engines
    (0: learners only, one whole device each). Colocated, `engines` divides the learner ranks or is
    a multiple of them, and TP is 1: the config's validation and `rlhf.rules.engine_count` guarantee it."""
    n, tp = cfg.learner.num_ranks, cfg.cluster.generator_tp
    unit = "GPU" if device_kind != "cpu" else "CPU"
    # CPU shares are tokens for scheduling, not a claim on cores: actors on CPU all share the host.
    one = 1.0 if unit == "GPU" else 0.1
    if not engines:
        return Layout(bundles=[{unit: one} for _ in range(n)], engine_bundles=[],
                      learner_bundles=list(range(n)), engine_share={}, learner_share={unit: one})
    served = device_share(cfg.reward)  # the reward worker's share, by the same rule as the engines'
    if cfg.cluster.placement == "colocated":
        k = engines_per_device(cfg, engines)
        return Layout(
            bundles=[{unit: one} for _ in range(n)],
            engine_bundles=[e // k if k > 1 else e * (n // engines) for e in range(engines)],
            learner_bundles=list(range(n)),
            engine_share={unit: one * 0.4 / k},
            learner_share={unit: one * 0.5},
            reward_bundle=0 if served else None,
            reward_share={unit: one * 0.1} if served else {},
        )
    k = engines_per_device(cfg, engines)  # engines sharing a generating device (then TP 1)
    devices = engine_gpus(cfg, engines) // tp
    return Layout(
        bundles=[{unit: one * tp} for _ in range(devices)] + [{unit: one} for _ in range(n + served)],
        engine_bundles=[e // k for e in range(engines)],
        learner_bundles=list(range(devices, devices + n)),
        engine_share={unit: one * tp / k},
        learner_share={unit: one},
        reward_bundle=devices + n if served else None,
        reward_share={unit: one} if served else {},
    )


def _reward_scorer(cfg: RunConfig, model_path: str, pg: Any, layout: Layout, generator: EngineGroup,
                   start_after: list | None = None) -> RayRewardScorer:
    """The reward worker on its share of `layout` (none: num_cpus=0 anywhere), handed the policy's
    engines for judges that have no model of their own; with a share, it touches the device once
    `start_after` is ready."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {"num_cpus": 0}
    if layout.reward_bundle is not None:
        options = {**_share(layout.reward_share), "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=layout.reward_bundle)}
    return RayRewardScorer(cfg.reward, model_path, options=options,
                           offload=layout.reward_bundle is not None and cfg.cluster.placement == "colocated",
                           generation=cfg.generation, dtype=cfg.model.dtype, seed=cfg.seed,
                           start_after=start_after if layout.reward_bundle is not None else None,
                           engines=list(generator.engines) if any(f.judge and not f.judge_model
                                                                  for f in cfg.reward.functions) else [])


def _share(share: dict[str, float]) -> dict[str, float]:
    return {"num_gpus": share.get("GPU", 0.0), "num_cpus": share.get("CPU", 0.0)}


def _learner_group(cfg: RunConfig, model_path: str, pg: Any, layout: Layout, start_after: list | None = None
                   ) -> RayLearnerGroup:
    host_gpus = pinned_host_gpus(cfg.cluster)
    group = ActorGroup(
        LearnerRank, name="learner rank", pg=pg, bundles=layout.learner_bundles,
        **_share(layout.learner_share),
        make_kwargs=lambda rank, addr, port: dict(
            rank=rank, world_size=cfg.learner.num_ranks, master_addr=addr, master_port=port,
            model_path=model_path, model_cfg=cfg.model, learner_cfg=cfg.learner,
            temperature=cfg.generation.temperature or 1.0, with_reference=holds_reference_model(cfg), seed=cfg.seed,
            driver_store=True, start_after=start_after, host_gpus=host_gpus,
        ),
        env=_timeout_env(cfg.cluster), rendezvous_store=True,
    )
    return RayLearnerGroup(group, model_path=model_path, export_dtype=cfg.model.dtype)


def _engine_group(cfg: RunConfig, model_path: str, pg: Any, layout: Layout, device_kind: str) -> EngineGroup:
    engines, host_gpus = len(layout.engine_bundles), pinned_host_gpus(cfg.cluster)
    k = engines_per_device(cfg, engines)
    # K engines of one GPU hold vLLM's share together and start one after another: vLLM sizes its
    # KV cache from the memory it finds free, as build_cluster's comment on the learners says.
    gen_cfg = engine_generation(cfg.generation, k)
    sleeps = engines_sleep(cfg.cluster.placement, device_kind)
    group = ActorGroup(
        load_class(GENERATORS[cfg.generation.backend]), name="engine", pg=pg, bundles=layout.engine_bundles,
        **_share(layout.engine_share),
        after=(lambda e: e - 1 if k > 1 and e % k else None),
        make_kwargs=lambda rank, addr, port: dict(
            model_path=model_path, cfg=gen_cfg, dtype=cfg.model.dtype, seed=cfg.seed,
            enable_sleep=sleeps,
            tensor_parallel_size=cfg.cluster.generator_tp, engines_per_host=engines,
            host_gpus=host_gpus,
            **({"lora": cfg.learner} if serves_adapters(cfg) else {}),
        ),
        env=_timeout_env(cfg.cluster),
    )
    gpus = len(set(layout.engine_bundles)) * cfg.cluster.generator_tp if device_kind != "cpu" else 0
    return EngineGroup(group, gpus=gpus, sleeps=sleeps)


def pinned_host_gpus(cluster: ClusterConfig) -> list[str]:
    """Under `cluster.pin_cores`, the GPU ids Ray hands out on the driver's node (every node's are
    taken to be numbered alike), which the engines and learner ranks split the node's cores by;
    [] when off, or where the node has no GPU."""
    if not cluster.pin_cores:
        return []
    node = ray.get_runtime_context().get_node_id()
    gpus = next((n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["NodeID"] == node), 0.0)
    return host_gpu_ids(os.environ, int(gpus)) if gpus else []


def _timeout_env(cluster: ClusterConfig) -> dict[str, str]:
    """`cluster.timeout_s` for the fan-outs the actors themselves wait on (weight sync), and for the
    driver's (actors.actor_group: time limit)."""
    set_timeout(cluster.timeout_s)
    return {TIMEOUT_ENV: str(cluster.timeout_s)}


def _placement_group(cluster: ClusterConfig, layout: Layout) -> Any:
    """The run's placement group, ready; a clear error instead of waiting forever when the Ray
    cluster cannot hold it (too few devices, or none of its nodes has a bundle's devices)."""
    pg = placement_group(layout.bundles, strategy=cluster.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ConfigError(
            f"Ray could not place the run's {len(layout.bundles)} bundles {layout.bundles} with strategy "
            f"{cluster.placement_strategy} within {PLACEMENT_TIMEOUT_S:g} s; the cluster has "
            f"{_resources()}") from None
    return pg


def _resources() -> str:
    res = ray.cluster_resources()
    return f"{len(ray.nodes())} node(s), {res.get('GPU', 0):g} GPUs, {res.get('CPU', 0):g} CPUs"


def describe_placement(pg: Any, layout: Layout) -> str:
    """One line: which node holds each engine and each learner rank (node ids shortened)."""
    nodes = placement_group_table(pg)["bundles_to_node_id"]
    short = {node: f"node{i}" for i, node in enumerate(dict.fromkeys(nodes[b] for b in sorted(nodes)))}
    engines = " ".join(f"{e}@{short[nodes[b]]}" for e, b in enumerate(layout.engine_bundles))
    learners = " ".join(f"{r}@{short[nodes[b]]}" for r, b in enumerate(layout.learner_bundles))
    ids = ", ".join(f"{name}={node[:8]}" for node, name in short.items())
    reward = "" if layout.reward_bundle is None else f" | reward worker @{short[nodes[layout.reward_bundle]]}"
    return f"placement: engines {engines or '-'} | learner ranks {learners}{reward} ({ids})"


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
    layout = plan_layout(cfg, detect().kind)
    pg = _placement_group(cfg.cluster, layout)
    return LearnerCluster(learners=_learner_group(cfg, model_path, pg, layout), pg=pg)


def build_cluster(cfg: RunConfig, model_path: str) -> RayCluster:
    """Create every actor of the run; Ray must be initialised already (scripts do it)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    device = detect()
    engines = engine_count(cfg, device.kind, ray.cluster_resources().get("GPU", 0.0))
    layout = plan_layout(cfg, device.kind, engines)
    pg = _placement_group(cfg.cluster, layout)
    print(f"cluster: {cfg.cluster.placement}, {engines} engine(s) x TP {cfg.cluster.generator_tp}, "
          f"{cfg.learner.num_ranks} {cfg.learner.backend} learner rank(s) on {_resources()}")
    print(describe_placement(pg, layout))
    start, ready = time.perf_counter(), {}
    generator = _engine_group(cfg, model_path, pg, layout, device.kind)
    engines_first = device.kind != "cpu" and cfg.cluster.placement == "colocated"
    # vLLM sizes its KV cache from the GPU's free memory measured around its start-up profile,
    # assuming no other process allocates meanwhile: a learner starting beside it was counted as
    # vLLM's own use (ZeRO-3 under memory.plan=auto: "No available memory for the cache blocks").
    # So colocated learners touch the GPU only once the engines are up; their processes start and
    # import their backend meanwhile (`start_after`).
    # A reward worker with a device share beside them loads its models in the same gap, after the
    # engines and before the learners (a judge's own engine profiles the GPU like the policy's).
    after = generator.group.ready_refs() if engines_first else None
    rewards = _reward_scorer(cfg, model_path, pg, layout, generator, start_after=after)
    if engines_first and layout.reward_bundle is not None:
        after = [rewards.ready_ref()]
    learners = _learner_group(cfg, model_path, pg, layout, start_after=after)
    if engines_first:
        generator.group.ready()
        ready["engines"] = time.perf_counter() - start
    # Learner rank 0 runs the sender side of the NCCL transport: its node's address and a free port.
    transport = choose_transport(cfg, device.kind, lambda: ray.get(node_address.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, layout.learner_bundles[0])).remote()))
    targets = engine_targets(transport, generator.engines, cfg.learner.num_ranks,
                             [layout.rank_beside(e) for e in range(len(layout.engine_bundles))])
    gather([rewards.ready_ref()], ["reward worker"], "start-up")  # before the learners that may wait on it
    learners.group.ready()
    ready["learners"] = time.perf_counter() - start
    if not engines_first:
        generator.group.ready()
        ready["engines"] = time.perf_counter() - start
    print("start-up: " + ", ".join(f"{name} ready after {s:.1f} s" for name, s in ready.items())
          + (" (colocated: the learners take the GPU once the engines are up)" if engines_first else ""))
    return RayCluster(generator=generator, learners=learners, weight_sync=WeightSyncer(learners, targets, transport),
                      rewards=rewards, pg=pg)
