"""Data-parallel generation without vLLM: prompt sharding, per-prompt seeds, the engine count and
layout for each placement, which learner rank feeds which engine, per-engine metrics, and (over
real Ray actors) order restoration and fail-fast errors that name the actor and the phase."""

from __future__ import annotations

import pytest

from rlhf.config import ConfigError, load_config
from rlhf.data.batching import even_shards
from rlhf.types import SamplingSpec

# ------------------------------------------------------------------------------------------------
# Sharding: contiguous, balanced, order restored, a group never split


@pytest.mark.parametrize("count,parts", [(0, 3), (1, 4), (5, 2), (7, 3), (8, 8), (64, 7), (3, 1)])
def test_even_shards_cover_everything_in_order_and_balance(count, parts):
    shards = even_shards(count, parts)
    assert len(shards) == parts
    assert [i for s in shards for i in s] == list(range(count))  # concatenation restores the order
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger shares first


def test_even_shards_hand_computed():
    assert even_shards(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert even_shards(2, 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]
    with pytest.raises(ValueError):
        even_shards(4, 0)


def test_a_group_never_spans_engines():
    """Engines get whole prompts; completions [i*n, (i+1)*n) answer prompt i, so the n samples of a
    prompt always come from the engine that got the prompt."""
    n, prompts = 4, 10
    owner = {}
    for engine, shard in enumerate(even_shards(prompts, 3)):
        for p in shard:
            for k in range(n):
                owner[p * n + k] = engine
    for p in range(prompts):
        assert len({owner[p * n + k] for k in range(n)}) == 1


# ------------------------------------------------------------------------------------------------
# Per-prompt seeds


def test_prompt_seeds_are_deterministic_distinct_and_not_adjacent():
    spec = SamplingSpec(n=8, max_new_tokens=4, seed=12345)
    seeds = [spec.prompt_seed(i) for i in range(2000)]
    assert seeds == [SamplingSpec(n=8, max_new_tokens=4, seed=12345).prompt_seed(i) for i in range(2000)]
    assert all(0 <= s < 2**62 for s in seeds)
    # vLLM seeds the k-th sample of a prompt with seed + k: no two prompts may share any of those.
    used = [s + k for s in seeds for k in range(spec.n)]
    assert len(set(used)) == len(used)
    other = SamplingSpec(n=8, max_new_tokens=4, seed=12346)
    assert not set(seeds) & {other.prompt_seed(i) for i in range(2000)}  # the next step draws anew
    assert SamplingSpec(n=1, max_new_tokens=1).prompt_seed(3) is None


# ------------------------------------------------------------------------------------------------
# Engine count, layout and weight-sync targets


def _cfg(*overrides: str):
    return load_config(None, ["grpo.prompts_per_step=8", *overrides])


def test_auto_engine_count_per_placement_and_device():
    from rlhf.rules import engine_count

    assert engine_count(_cfg("learner.num_ranks=4"), "cpu", 0) == 1  # CPU: engines would share cores
    assert engine_count(_cfg("learner.num_ranks=4"), "cuda", 4) == 4  # colocated: one per learner GPU
    assert engine_count(_cfg("learner.num_ranks=8", "grpo.prompts_per_step=6"), "cuda", 8) == 4  # <= groups,
    # and a divisor of the ranks
    split = ["cluster.placement=split", "learner.num_ranks=7"]
    assert engine_count(_cfg(*split), "cuda", 8) == 1  # the seeds' layout: GPU 0 generates, 1-7 learn
    assert engine_count(_cfg("cluster.placement=split", "learner.num_ranks=4"), "cuda", 8) == 4
    assert engine_count(_cfg("cluster.placement=split", "learner.num_ranks=2", "cluster.generator_tp=2"),
                        "cuda", 8) == 3
    assert engine_count(_cfg("cluster.generator_engines=2", "learner.num_ranks=2"), "cpu", 0) == 2


def test_the_planner_counts_the_engines_the_cluster_builds():
    """One rule (rlhf.rules.engine_count) for the cluster and the planner: colocated `auto` is capped
    by the step's prompt groups and divides the ranks (the planner's own copy had said one engine
    per rank); split with pinned ranks gets every GPU they leave (it had said one engine)."""
    from rlhf.planner.memory import engines
    from rlhf.rules import engine_count

    capped = _cfg("learner.num_ranks=8", "grpo.prompts_per_step=6")
    assert engines(capped) == engine_count(capped, "cuda", 8) == 4
    split = _cfg("cluster.placement=split", "learner.num_ranks=7")
    assert engines(split) == engine_count(split, "cuda", 8) == 1
    pinned = _cfg("cluster.placement=split", "learner.num_ranks=4", "cluster.generator_engines=4")
    assert engines(pinned) == engine_count(pinned, "cuda", 8) == 4
    assert engines(load_config(None, ["algorithm=dpo"])) == 0


def test_engines_sharing_a_gpu_split_its_memory_share():
    """K colocated engines beside each learner rank hold vLLM's share of the GPU together, 1/K each;
    split engines (a GPU each) and one engine per rank keep the whole share."""
    from rlhf.rules import engine_generation, engines_per_device

    two = _cfg("learner.num_ranks=2", "cluster.generator_engines=4", "generation.gpu_memory_utilization=0.5")
    k = engines_per_device(two, 4)
    assert k == 2 and engine_generation(two.generation, k).gpu_memory_utilization == 0.25
    one = _cfg("learner.num_ranks=2", "generation.gpu_memory_utilization=0.5")
    assert engines_per_device(one, 2) == 1 and engine_generation(one.generation, 1) is one.generation
    split = _cfg("cluster.placement=split", "learner.num_ranks=2", "cluster.generator_engines=4")
    assert engines_per_device(split, 4) == 1
    shared = _cfg("cluster.placement=split", "learner.num_ranks=3", "cluster.generator_engines=2",
                  "cluster.engines_per_gpu=2", "generation.gpu_memory_utilization=0.8")
    assert engines_per_device(shared, 2) == 2
    assert engine_generation(shared.generation, 2).gpu_memory_utilization == pytest.approx(0.4)


def test_split_engines_sharing_a_gpu_take_one_gpu_per_k():
    """`cluster.engines_per_gpu=K` (split): K engines on each generating GPU; `auto` fills the GPUs the
    learners leave free with K engines each; the GPU count a run takes counts GPUs, not engines."""
    from rlhf.planner.memory import engines
    from rlhf.rules import engine_count, engine_gpus, engines_without_cluster, run_gpus

    two = _cfg("cluster.placement=split", "learner.num_ranks=3", "cluster.engines_per_gpu=2")
    assert engine_count(two, "cuda", 4) == 2 and engine_gpus(two, 2) == 1 and run_gpus(two, 2) == 4
    assert engines(two) == 2  # the planner's one generating GPU
    assert engines_without_cluster(two) == 2 and engines_without_cluster(_cfg("cluster.placement=split")) == 1
    pinned = _cfg("cluster.placement=split", "learner.num_ranks=2", "cluster.generator_engines=4",
                  "cluster.engines_per_gpu=2")
    assert engine_count(pinned, "cuda", 4) == 4 == engines_without_cluster(pinned) and run_gpus(pinned, 4) == 4
    with pytest.raises(ConfigError, match=r"needs 5 GPUs \(learner.num_ranks=3 \+ 2 for 4 engine"):
        engine_count(_cfg("cluster.placement=split", "learner.num_ranks=3", "cluster.generator_engines=4",
                          "cluster.engines_per_gpu=2"), "cuda", 4)


def test_only_colocated_engines_on_a_gpu_sleep():
    """vLLM's sleep mode hands colocated engines' GPU memory to the learners; split engines keep
    theirs (and generate on while the learners train), and CPU engines have no sleep mode."""
    from rlhf.rules import engines_sleep

    assert engines_sleep("colocated", "cuda")  # ROCm too: its Device.kind is "cuda"
    assert not engines_sleep("split", "cuda") and not engines_sleep("colocated", "cpu")


@pytest.mark.parametrize("overrides,gpus,message", [
    (["cluster.placement=split", "learner.num_ranks=8"], 8, "leave 0"),
    (["cluster.placement=split", "learner.num_ranks=5", "cluster.generator_tp=2"], 8, "not a positive multiple"),
    (["cluster.placement=split", "learner.num_ranks=2", "cluster.generator_engines=3"], 4, "needs 5 GPUs"),
    (["learner.num_ranks=4"], 2, "needs 4 GPUs"),
])
def test_engine_count_that_does_not_fit_the_gpus_is_one_line(overrides, gpus, message):
    from rlhf.rules import engine_count

    with pytest.raises(ConfigError, match=message) as err:
        engine_count(_cfg(*overrides), "cuda", gpus)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["learner.num_ranks=4", "cluster.generator_engines=3"], "a divisor or a multiple of learner.num_ranks=4"),
    (["learner.num_ranks=2", "cluster.generator_engines=3"], "a divisor or a multiple of learner.num_ranks=2"),
    (["learner.num_ranks=8", "cluster.generator_engines=8", "grpo.prompts_per_step=4"],
     "at most grpo.prompts_per_step=4"),
    (["cluster.generator_engines=0"], "'auto' or an integer >= 1"),
    (["cluster.generator_tp=2"], "tensor-parallel engines need placement=split"),
    (["cluster.generator_tp=0", "cluster.placement=split"], "an integer >= 1"),
    (["cluster.generator_engines=two"], "expected an integer or one of 'auto'"),
    (["cluster.generator_gpus=2"], "use cluster.generator_tp"),
    (["cluster.placement_strategy=EVERYWHERE"], "one of 'PACK'"),
    (["cluster.engines_per_gpu=2"], "1 with placement=colocated"),
    (["cluster.placement=split", "cluster.engines_per_gpu=2", "cluster.generator_tp=2"],
     "1 with cluster.generator_tp=2"),
    (["cluster.placement=split", "cluster.engines_per_gpu=2", "cluster.generator_engines=3"],
     "a multiple of cluster.engines_per_gpu=2"),
    (["cluster.placement=split", "cluster.engines_per_gpu=0"], "an integer >= 1"),
])
def test_bad_engine_settings_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_layouts():
    from actors.cluster import plan_layout

    colocated = plan_layout(_cfg("learner.num_ranks=4", "cluster.generator_engines=2"), "cuda", 2)
    assert colocated.bundles == [{"GPU": 1.0}] * 4
    assert colocated.engine_bundles == [0, 2] and colocated.learner_bundles == [0, 1, 2, 3]
    assert [colocated.rank_beside(e) for e in range(2)] == [0, 2]
    assert colocated.engine_share["GPU"] + colocated.learner_share["GPU"] <= 1.0  # both fit on one GPU

    # two engines on each learner's GPU: every bundle holds both, and their shares beside the learner's
    doubled = plan_layout(_cfg("learner.num_ranks=2", "cluster.generator_engines=4"), "cuda", 4)
    assert doubled.bundles == [{"GPU": 1.0}] * 2 and doubled.engine_bundles == [0, 0, 1, 1]
    assert [doubled.rank_beside(e) for e in range(4)] == [0, 0, 1, 1]
    assert 2 * doubled.engine_share["GPU"] + doubled.learner_share["GPU"] <= 1.0

    split = plan_layout(_cfg("cluster.placement=split", "learner.num_ranks=3", "cluster.generator_tp=2"), "cuda", 2)
    assert split.bundles == [{"GPU": 2.0}] * 2 + [{"GPU": 1.0}] * 3
    assert split.engine_bundles == [0, 1] and split.learner_bundles == [2, 3, 4]

    # the seeds' 4-GPU split with two engines on the generating GPU: one bundle holds both
    shared = plan_layout(_cfg("cluster.placement=split", "learner.num_ranks=3", "cluster.engines_per_gpu=2",
                              "cluster.generator_engines=2"), "cuda", 2)
    assert shared.bundles == [{"GPU": 1.0}] * 4 and shared.engine_bundles == [0, 0]
    assert shared.learner_bundles == [1, 2, 3] and shared.engine_share == {"GPU": 0.5}
    assert [shared.rank_beside(e) for e in range(2)] == [None, None]

    cpu = plan_layout(_cfg("learner.num_ranks=2", "cluster.generator_engines=2"), "cpu", 2)
    assert cpu.bundles == [{"CPU": 0.1}] * 2 and cpu.engine_bundles == [0, 1]
    assert plan_layout(_cfg("learner.num_ranks=2"), "cpu").engine_bundles == []  # learners only (DPO)


def test_which_rank_feeds_which_engine():
    import torch

    from actors.weight_sync import CudaIpcTransport, ObjectStoreTransport, engine_targets

    engines = ["e0", "e1"]
    ipc = engine_targets(CudaIpcTransport(dtype=torch.bfloat16), engines, num_ranks=4, beside=[0, 2])
    assert ipc == [[(0, "e0")], [], [(1, "e1")], []]  # each engine from the rank on its own GPU
    cpu = engine_targets(ObjectStoreTransport(dtype=torch.float32), engines, num_ranks=2, beside=[0, 1])
    assert cpu == [[(0, "e0"), (1, "e1")], []]  # rank 0 sends each bucket once to every engine
    four = ["e0", "e1", "e2", "e3"]  # two engines on each of two GPUs: each rank feeds both of its own
    ipc = engine_targets(CudaIpcTransport(dtype=torch.bfloat16), four, num_ranks=2, beside=[0, 0, 1, 1])
    assert ipc == [[(0, "e0"), (1, "e1")], [(2, "e2"), (3, "e3")]]


def test_only_nccl_asks_for_a_rendezvous_address():
    """The (address, free port) for NCCL comes from a Ray task on learner rank 0's node: a worker
    process to start, so it is asked for only where the transport is NCCL."""
    from actors.weight_sync import CudaIpcTransport, NcclTransport, ObjectStoreTransport, choose_transport

    asked = []

    def rendezvous() -> tuple[str, int]:
        asked.append(1)
        return "10.0.0.7", 29555

    assert isinstance(choose_transport(_cfg(), "cpu", rendezvous), ObjectStoreTransport)
    assert isinstance(choose_transport(_cfg("cluster.placement=colocated"), "cuda", rendezvous), CudaIpcTransport)
    assert asked == []
    nccl = choose_transport(_cfg("cluster.placement=split"), "cuda", rendezvous)
    assert isinstance(nccl, NcclTransport)
    assert (nccl.master_address, nccl.master_ports) == ("10.0.0.7", (29555,))
    assert asked == [1]

    ports = iter([29555, 29555, 29601])  # K groups need K distinct ports: one handed out twice is asked again
    split2 = _cfg("cluster.placement=split", "cluster.engines_per_gpu=2", "cluster.generator_engines=2")
    two = choose_transport(split2, "cuda", lambda: ("10.0.0.7", next(ports)))
    assert two.master_ports == (29555, 29601)


def test_nccl_groups_hold_one_engine_per_gpu_and_each_bucket_reaches_every_engine(monkeypatch):
    """K engines on each generating GPU (engines e // K share one): K NCCL groups, engine e in group
    e % K at rank 1 + i*tp by its place i there; every bucket is broadcast once per group, and an
    engine is asked to receive only while its own group broadcasts."""
    import torch

    from actors import vllm_generator, weight_sync
    from actors.weight_sync import NcclTransport

    calls: list[tuple] = []

    class Comm:
        def __init__(self, port: int, world: int) -> None:
            self.port, self.world = port, world

        def broadcast(self, t: torch.Tensor, src: int) -> None:
            calls.append(("broadcast", self.port, tuple(t.shape), src))

    class Method:
        def __init__(self, engine: int, name: str) -> None:
            self.engine, self.name = engine, name

        def remote(self, *args):
            calls.append((self.name, self.engine, args))
            return self.engine

    class Engine:
        def __init__(self, e: int) -> None:
            self.init_weight_update_group = Method(e, "join")
            self.update_weights_from_nccl = Method(e, "receive")

    monkeypatch.setattr(vllm_generator, "open_learner_weight_group",
                        lambda address, port, world: (calls.append(("open", port, world)), Comm(port, world))[1])
    monkeypatch.setattr(weight_sync, "gather", lambda refs, labels, what: [calls.append(("wait", labels))])
    engines = [(e, Engine(e)) for e in range(4)]  # GPUs 0 and 1, two engines each
    transport = NcclTransport(dtype=torch.bfloat16, master_address="10.0.0.7", master_ports=(100, 200),
                              engine_tp=1)
    assert [[e for e, _ in g] for g in transport.groups(engines)] == [[0, 2], [1, 3]]
    bucket = [("a", torch.zeros(2, 3)), ("b", torch.zeros(5))]
    transport.send(bucket, engines)
    transport.send(bucket, engines)

    joins = [c for c in calls if c[0] == "join"]
    assert [(c[1], c[2]) for c in joins] == [(0, ("10.0.0.7", 100, 1, 3)), (2, ("10.0.0.7", 100, 2, 3)),
                                             (1, ("10.0.0.7", 200, 1, 3)), (3, ("10.0.0.7", 200, 2, 3))]
    assert [c for c in calls if c[0] == "open"] == [("open", 100, 3), ("open", 200, 3)]  # once per run
    sends = [c for c in calls if c[0] in ("receive", "broadcast", "wait")][2:]  # after the two handshakes' waits
    one_bucket = [("receive", 0), ("receive", 2), ("broadcast", 100), ("broadcast", 100),
                  ("wait", ["engine 0", "engine 2"]),
                  ("receive", 1), ("receive", 3), ("broadcast", 200), ("broadcast", 200),
                  ("wait", ["engine 1", "engine 3"])]
    assert [c[:2] for c in sends] == one_bucket * 2
    assert [c[2] for c in sends if c[0] == "broadcast"][:2] == [(2, 3), (5,)]


def test_engine_metrics():
    from actors.engine_group import engine_metrics

    m = engine_metrics({0: (100, 2.0), 1: (80, 0.5)})
    assert m == {"gen/engine0_tokens": 100.0, "gen/engine0_s": 2.0, "gen/engine1_tokens": 80.0,
                 "gen/engine1_s": 0.5, "gen/engine_time_ratio": 4.0}
    assert engine_metrics({0: (5, 1.0)})["gen/engine_time_ratio"] == 1.0


def test_actor_failure_survives_pickling():
    """Raised inside an actor (a learner's weight-sync fan-out), it reaches the driver pickled."""
    import pickle

    from actors.actor_group import ActorFailure

    again = pickle.loads(pickle.dumps(ActorFailure("engine 1 died during weight sync: gone", lost=True)))
    assert str(again) == "engine 1 died during weight sync: gone" and again.lost


def test_socket_folders_of_dead_engines_are_swept_and_live_ones_kept(tmp_path):
    """A run killed outright never reaches VLLMGenerator.shutdown; the next engine removes the socket
    folders whose creating process is gone (actors.vllm_process.sweep_stale_socket_folders)."""
    import os
    import subprocess
    import sys

    from actors.vllm_process import sweep_stale_socket_folders

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = tmp_path / f"rlhf-vllm-ipc-{dead.stdout.strip()}-abc"
    live = tmp_path / f"rlhf-vllm-ipc-{os.getpid()}-def"
    other = tmp_path / "rlhf-vllm-ipc-notapid-ghi"
    for folder in (gone, live, other):
        folder.mkdir()
        (folder / "socket").write_text("")
    assert sweep_stale_socket_folders(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and live.exists() and other.exists()
