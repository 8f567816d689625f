"""Learned reward models (rlhf.reward_model) with a tiny random sequence classifier built locally:
the batched scorer equals HF's model on the same text, and `PoolScorer` mixes it with a reward
function by weight. On CPU, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rewards.api import RewardLoadError
from rlhf.config import ConfigError, RewardFnConfig, load_config
from rlhf.data.tiny_models import build_tiny_model
from rlhf.reward_model import RewardModel, check_reward_model
from rlhf.scoring import PoolScorer
from rlhf.types import PromptRow

ROWS = [PromptRow(prompt="What is 2 + 3?", answer="5"),
        PromptRow(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
                  answer="2"),
        PromptRow(prompt="Say a long sentence about numbers and words.", answer="7")]
RESPONSES = ["5", "The answer is 3, which is a small number.", "7 7 7"]


@pytest.fixture(scope="module")
def rm_path(tiny_reward_model) -> Path:
    return tiny_reward_model  # conftest.py's: the reward model of e2e/test_console.py's run too


def test_the_scorer_equals_hf_on_the_same_text(rm_path):
    rm = RewardModel(str(rm_path), batch_size=2)  # batches of 2 and 1: padding must not matter
    got = rm.score(ROWS, RESPONSES)
    tok = AutoTokenizer.from_pretrained(rm_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"},
                                      {"role": "assistant", "content": "5"}], tokenize=False),
             tok.apply_chat_template([*ROWS[1].prompt, {"role": "assistant", "content": RESPONSES[1]}],
                                     tokenize=False),
             tok.apply_chat_template([{"role": "user", "content": ROWS[2].prompt},
                                      {"role": "assistant", "content": RESPONSES[2]}], tokenize=False)]
    assert texts[0] == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for t in texts]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 6) for v in got)) == 3  # the texts differ, so do the scores



def test_scoring_builds_no_kv_cache(rm_path):
    """A scoring pass is one forward: HF's default KV cache would hold every layer's keys and values at
    once (on SmolLM2 2.6x the activations the memory planner counts for the served reward model)."""
    rm = RewardModel(str(rm_path), batch_size=2)
    outputs = []
    rm.model.register_forward_hook(lambda module, args, out: outputs.append(out))
    rm.score(ROWS, RESPONSES)
    assert len(outputs) == 2 and all(getattr(o, "past_key_values", None) is None for o in outputs)

def test_weighted_mixing_with_a_function(rm_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("tiny-qwen2", rm_path.parent / "policy"))
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    rm_scores = torch.tensor(RewardModel(str(rm_path)).score(ROWS, RESPONSES))
    exact = torch.tensor([1.0, 0.0, 1.0])  # rewards.answers:exact_answer on these rows
    scorer = PoolScorer([RewardFnConfig(function="rewards.answers:exact_answer", weight=2.0),
                         RewardFnConfig(model=str(rm_path), weight=0.5, batch_size=2)],
                        tokenizer=tokenizer, timeout_s=10, num_workers=0)
    try:
        rewards, metrics = scorer.score(ROWS, ids)
    finally:
        scorer.close()
    torch.testing.assert_close(rewards, 2.0 * exact + 0.5 * rm_scores)
    # The pool scores in batches of 2, the reference all rows at once: fp32 rounding apart by ~1e-6.
    assert metrics[f"reward/rm_{rm_path.name}/mean"] == pytest.approx(float(rm_scores.mean()), rel=1e-5)
    assert metrics["reward/exact_answer/mean"] == pytest.approx(2 / 3)
    assert metrics["reward/mean"] == pytest.approx(float(rewards.mean()))
    alone = PoolScorer([RewardFnConfig(model=str(rm_path), weight=-1.0)], tokenizer=tokenizer, timeout_s=10,
                       num_workers=0)  # a reward model only: no pool at all
    rewards, metrics = alone.score(ROWS, ids)
    torch.testing.assert_close(rewards, -rm_scores)
    assert metrics["reward/failed"] == 0


def test_config_and_start_up_checks(rm_path, tmp_path):
    cfg = load_config(None, [f"reward.functions=[{{model: {rm_path}, weight: 0.5}}, "
                             "{function: rewards.answers:exact_answer}]"])
    assert cfg.reward.functions[0].model == str(rm_path) and cfg.reward.functions[0].batch_size == 8
    for overrides, message in [
        (["reward.functions=[{weight: 1}]"],
         "reward.functions[0].function is required (or reward.functions[0].model"),
        ([f"reward.functions=[{{model: {rm_path}, function: a:b}}]"], "reward.functions[0].model="),
        ([f"reward.functions=[{{model: {rm_path}, batch_size: 0}}]"],
         "reward.functions[0].batch_size=0 is not allowed"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert str(err.value).startswith(message)
    check_reward_model(str(rm_path))
    with pytest.raises(RewardLoadError, match="cannot be loaded"):
        check_reward_model(str(tmp_path / "nothing"))
    policy = build_tiny_model("tiny-qwen2", tmp_path / "policy")
    with pytest.raises(RewardLoadError, match="outputs; a reward model has one"):
        check_reward_model(str(policy))
