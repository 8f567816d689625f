"""ActorGroup on a local Ray with fake engines and ranks: prompt order restored, per-engine figures,
failures named by actor and phase, ranks joining the store their driver serves.

The sharding and layout rules without Ray: tests/unit/test_engines.py."""

from __future__ import annotations

import os
import time

import pytest

from rlhf.types import Completion, SamplingSpec

# ------------------------------------------------------------------------------------------------
# Over real Ray actors


class FakeEngine:
    """Answers each prompt with n completions that spell out (global prompt index, k) in their tokens
    and the engine in their log-probs."""

    def __init__(self, rank: int, delay: float = 0.0, gate: str = "") -> None:
        self.rank, self.delay, self.gate, self.called = rank, delay, gate, []

    def generate(self, prompt_ids, sampling, first_index=0):
        self.called.append("generate")
        time.sleep(self.delay)
        give_up = time.monotonic() + 120  # with `gate`, wait until that file exists (a test opens it)
        while self.gate and not os.path.exists(self.gate) and time.monotonic() < give_up:
            time.sleep(0.01)
        return [Completion(token_ids=[first_index + i, k], logprobs=[float(self.rank)] * 2,
                           finish_reason="stop") for i, _ in enumerate(prompt_ids) for k in range(sampling.n)]

    def sleep(self):
        self.called.append("sleep")

    def wake(self):
        self.called.append("wake")

    def calls(self):
        return self.called

    def stall(self):
        time.sleep(3600)

    def crash(self):
        os._exit(1)

    def fail(self):
        raise ValueError("bad bucket")

    def relay(self):  # as a learner rank whose push found an engine dead
        from actors.actor_group import ActorFailure

        raise ActorFailure("engine 3 died during weight sync: its worker process has died", lost=True)

    def shutdown(self, *, process_exits: bool = False):
        pass


class FakeRank:
    """A process-group member joining through the rendezvous its group hands it."""

    def __init__(self, rank: int, world: int, addr: str, port: int, fail: bool = False) -> None:
        import torch.distributed as dist

        if fail:
            raise FileNotFoundError("no weights at /nowhere")
        store = dist.TCPStore(addr, port, is_master=False, use_libuv=True)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t)

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def ray_local():
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _group(ray, engines: int, delays=None, gate: str = ""):
    from ray.util.placement_group import placement_group

    from actors.actor_group import ActorGroup

    pg = placement_group([{"CPU": 0.1}] * engines)
    ray.get(pg.ready())
    delays = delays or [0.0] * engines
    return ActorGroup(FakeEngine, name="engine", pg=pg, bundles=list(range(engines)), num_cpus=0.1, num_gpus=0,
                      make_kwargs=lambda rank, addr, port: dict(rank=rank, delay=delays[rank], gate=gate))


@pytest.mark.ray
def test_engine_group_restores_prompt_order_and_reports_each_engine(ray_local):
    from actors.engine_group import EngineGroup

    gen = EngineGroup(_group(ray_local, 3, delays=[0.0, 3.0, 0.0]))  # far above a loaded machine's round trip
    gen.generate([[1]] * 3, SamplingSpec(n=1, max_new_tokens=1))  # the actors have started
    out = gen.generate([[1]] * 7, SamplingSpec(n=2, max_new_tokens=2, seed=0))
    # prompt i's samples are out[2i], out[2i+1], carry the step-wide index i and come from one engine
    assert [c.token_ids for c in out] == [[i, k] for i in range(7) for k in range(2)]
    assert [c.logprobs[0] for c in out[::2]] == [0, 0, 0, 1, 1, 2, 2]  # engines' shards 3, 2, 2
    m = gen.last_metrics()
    assert [m[f"gen/engine{e}_tokens"] for e in range(3)] == [12.0, 8.0, 8.0]
    assert m["gen/engine1_s"] >= 3.0 > m["gen/engine0_s"]
    assert m["gen/engine_time_ratio"] > 2
    # fewer prompts than engines: the idle engine is not called and not reported
    assert [c.logprobs[0] for c in gen.generate([[1]] * 2, SamplingSpec(n=1, max_new_tokens=1))] == [0, 1]
    assert "gen/engine2_s" not in gen.last_metrics()
    assert "throughput/gen_tokens_per_s_per_gpu" not in gen.last_metrics()  # CPU engines: no GPUs
    gen.shutdown()


@pytest.mark.ray
def test_engines_without_sleep_mode_are_never_called_to_sleep(ray_local, tmp_path):
    """Split engines have no sleep mode: `sleep` and `wake` return while a generation runs ahead
    (asynchronous GRPO), which a call to an engine would have waited behind, holding the learners
    until it ended; engines that do sleep (colocated on a GPU) get both calls."""
    from actors.engine_group import EngineGroup

    gate = tmp_path / "open"
    split = EngineGroup(_group(ray_local, 2, gate=str(gate)))
    pending = split.submit([[1]] * 2, SamplingSpec(n=1, max_new_tokens=1))
    split.sleep()
    split.wake()
    gate.touch()  # only now can the generation finish
    assert len(pending.result()) == 2
    assert ray_local.get([e.calls.remote() for e in split.engines]) == [["generate"]] * 2
    colocated = EngineGroup(_group(ray_local, 2), sleeps=True)
    colocated.sleep()
    colocated.wake()
    assert ray_local.get([e.calls.remote() for e in colocated.engines]) == [["sleep", "wake"]] * 2
    split.shutdown()
    colocated.shutdown()


@pytest.mark.ray
def test_tokens_per_gpu_counts_every_engine_gpu(ray_local):
    from actors.engine_group import EngineGroup

    gen = EngineGroup(_group(ray_local, 2, delays=[0.3, 0.3]), gpus=4)  # 2 engines of TP 2
    gen.generate([[1]] * 2, SamplingSpec(n=1, max_new_tokens=1))
    gen.generate([[1]] * 4, SamplingSpec(n=5, max_new_tokens=2))  # 4 prompts x 5 samples x 2 tokens
    m = gen.last_metrics()
    slowest = max(m["gen/engine0_s"], m["gen/engine1_s"])
    assert m["throughput/gen_tokens_per_s_per_gpu"] == pytest.approx(40 / slowest / 4)
    gen.shutdown()


@pytest.mark.ray
def test_an_actor_relaying_a_death_names_the_dead_actor_first(ray_local):
    """A learner rank whose weight push found engine 3 dead raises that ActorFailure: the line names
    engine 3 (the actor to look at, and what a resumed run must restart) and then who noticed."""
    from actors.actor_group import ActorFailure, gather

    group = _group(ray_local, 1)
    with pytest.raises(ActorFailure) as err:
        gather([group.actors[0].relay.remote()], group.labels(), "push_weights")
    assert str(err.value) == ("engine 3 died during weight sync: its worker process has died "
                              "(reported by engine 0 during push_weights)")
    assert err.value.lost
    group.shutdown()


@pytest.mark.ray
def test_a_dead_actor_fails_fast_with_its_name_and_phase(ray_local):
    """Actor 1 dies while actor 0 is blocked forever (as a rank in a collective whose peer died):
    the wait ends at once and names actor 1, instead of waiting on actor 0."""
    from actors.actor_group import ActorFailure, gather

    group = _group(ray_local, 2)
    group.ready()
    with pytest.raises(ActorFailure, match=r"^engine 1 died during generate: ") as err:
        gather([group.actors[0].stall.remote(), group.actors[1].crash.remote()], group.labels(), "generate")
    # (actor 0 stalls forever: that the call returned at all is the fail-fast path)
    assert "\n" not in str(err.value)
    group.shutdown(timeout_s=1)  # actor 0 is still stalled: shutdown must not wait for it


@pytest.mark.ray
def test_an_actor_that_raises_is_named_with_the_error(ray_local):
    from actors.actor_group import ActorFailure

    group = _group(ray_local, 2)
    with pytest.raises(ActorFailure, match=r"^engine [01] failed during fail: ValueError: bad bucket"):
        group.call("fail")
    group.shutdown()


def _ranks(ray, world: int, fail: bool = False):
    from ray.util.placement_group import placement_group

    from actors.actor_group import ActorGroup

    pg = placement_group([{"CPU": 0.1}] * world)
    ray.get(pg.ready())
    return ActorGroup(FakeRank, name="learner rank", pg=pg, bundles=list(range(world)), num_cpus=0.1, num_gpus=0,
                      rendezvous_store=True,
                      make_kwargs=lambda rank, addr, port: dict(rank=rank, world=world, addr=addr, port=port,
                                                                fail=fail and rank == 1))


@pytest.mark.ray
def test_ranks_join_the_store_their_driver_serves(ray_local):
    """The rendezvous store is bound by the driver itself (no free-port race with other processes)."""
    group = _ranks(ray_local, 3)
    assert group.call_each("all_reduce", [(1.0,), (2.0,), (4.0,)]) == [7.0, 7.0, 7.0]
    group.shutdown()


@pytest.mark.ray
def test_a_constructor_that_raises_is_named_with_its_exception(ray_local):
    from actors.actor_group import ActorFailure

    group = _ranks(ray_local, 2, fail=True)
    with pytest.raises(ActorFailure, match=r"^learner rank 1 died during all_reduce: its constructor raised "
                                           r"FileNotFoundError: no weights at /nowhere$"):
        group.call("all_reduce", 1.0)
    group.shutdown(timeout_s=1)
