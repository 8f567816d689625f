"""Preference data: layouts, built-in pair sets, tokenization, truncation, malformed rows, batching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config
from scripts.assets import hhh_pairs
from rlhf.data.batching import micro_batches, pairs_to_batch, shard_for_rank
from rlhf.data.preferences import (
    MalformedRow,
    PreferenceRow,
    fit_length,
    load_preference_data,
    parse_row,
    tokenize_row,
)
from rlhf.types import PreferenceBatch, PreferencePair

FIX = Path(__file__).parents[1] / "fixtures" / "preferences"


def cfg_for(dataset: str, *extra: str):
    return load_config(None, ["algorithm=dpo", f"dpo.dataset={dataset}", "dpo.num_eval=1", "dpo.num_train=0", *extra])


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2)


# ------------------------------------------------------------------------------------------------
# Layouts


def test_plain_text_row():
    row = parse_row({"prompt": "Q?", "chosen": "good", "rejected": "bad", "extra": 1})
    assert row == PreferenceRow([{"role": "user", "content": "Q?"}], "good", "bad")


def test_ultrafeedback_messages_row():
    rec = json.loads((FIX / "ultrafeedback_like.jsonl").read_text().splitlines()[0])
    row = parse_row(rec)
    assert row.prompt == [{"role": "user", "content": "What is 2+2?"}]
    assert (row.chosen, row.rejected) == ("2+2 = 4.", "2+2 = 5.")


def test_hh_rlhf_transcripts_split_at_the_last_assistant_turn():
    recs = [json.loads(line) for line in (FIX / "hh_rlhf_like.jsonl").read_text().splitlines()]
    single, multi = parse_row(recs[0]), parse_row(recs[1])
    assert single.prompt == [{"role": "user", "content": "How do I boil an egg?"}]
    assert single.chosen == "Put it in boiling water for eight minutes."
    assert multi.prompt == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                            {"role": "user", "content": "Tell me a fact."}]
    assert (multi.chosen, multi.rejected) == ("Honey never spoils.", "No.")


@pytest.mark.parametrize(("rec", "message"), [
    ({"prompt": "q", "chosen": "a"}, "has no rejected"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "chosen is empty"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "chosen is int, not text"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "the same text"),
    ({"chosen": "a", "rejected": "b"}, "not Human/Assistant transcripts"),
    ({"chosen": "\n\nHuman: x\n\nAssistant: a", "rejected": "\n\nHuman: y\n\nAssistant: b"}, "different prompts"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": "b"}, "does not end with an assistant message"),
    ("just a string", "not a mapping"),
])
def test_malformed_rows_say_what_is_wrong(rec, message):
    with pytest.raises(MalformedRow, match=message):
        parse_row(rec)


def test_malformed_rows_error_names_the_row_or_are_skipped_and_counted(tokenizer):
    path = FIX / "malformed.jsonl"
    with pytest.raises(MalformedRow, match=r"malformed.jsonl:\d+: .*dpo.on_malformed=skip"):
        load_preference_data(cfg_for(f"jsonl:{path}", "dpo.num_eval=0"), tokenizer)
    data = load_preference_data(cfg_for(f"jsonl:{path}", "dpo.num_eval=0", "dpo.on_malformed=skip"), tokenizer)
    assert data.stats["rows"] == 5 and data.stats["skipped_malformed"] == 3 and len(data.train) == 2


# ------------------------------------------------------------------------------------------------
# Tokenization and length


def test_chat_template_response_is_what_the_conversation_adds(tokenizer):
    cfg = cfg_for("arithmetic_pairs")
    row = PreferenceRow([{"role": "user", "content": "What is 1 + 1?"}], "2", "3")
    prompt, chosen, rejected = tokenize_row(row, tokenizer, cfg.data)
    full = tokenizer.apply_chat_template([*row.prompt, {"role": "assistant", "content": "2"}], tokenize=False)
    assert prompt + chosen == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(chosen) == "2<|im_end|>\n" and tokenizer.decode(rejected) == "3<|im_end|>\n"


def test_raw_text_responses_end_with_eos(tokenizer):
    cfg = cfg_for("arithmetic_pairs", "data.use_chat_template=false")
    _, chosen, _ = tokenize_row(PreferenceRow([{"role": "user", "content": "Q"}], "yes", "no"), tokenizer, cfg.data)
    assert chosen[-1] == tokenizer.eos_token_id


def test_truncation_rule_keeps_the_prompt_tail_and_cuts_responses():
    p, c, r = list(range(10)), list(range(100, 108)), list(range(200, 203))
    assert fit_length(p, c, r, max_length=18, max_prompt_length=12) == (p, c, r)  # fits: untouched
    assert fit_length(p, c, r, max_length=15, max_prompt_length=12) == (p, c[:5], r)  # prompt kept whole
    assert fit_length(p, c, r, max_length=10, max_prompt_length=6) == (p[-6:], c[:4], r[:3])


def test_over_long_pairs_truncated_or_dropped_and_counted(tokenizer):
    path = FIX / "ultrafeedback_like.jsonl"
    long = cfg_for(f"jsonl:{path}", "dpo.num_eval=0", "dpo.max_length=20", "dpo.max_prompt_length=8")
    data = load_preference_data(long, tokenizer)
    assert data.stats["truncated"] == 2
    assert all(len(p.prompt_ids) <= 8 and len(p.prompt_ids) + len(p.chosen_ids) <= 20 for p in data.train)
    with pytest.raises(ValueError, match="no training pairs left.*dropped_too_long"):
        load_preference_data(cfg_for(f"jsonl:{path}", "dpo.num_eval=0", "dpo.max_length=20",
                                     "dpo.max_prompt_length=8", "dpo.truncation=drop"), tokenizer)


# ------------------------------------------------------------------------------------------------
# Sources


def test_arithmetic_pairs_chosen_is_right_rejected_is_wrong(tokenizer):
    from rewards.tasks import arithmetic

    cfg = cfg_for("arithmetic_pairs", "dpo.num_train=20", "dpo.num_eval=5")
    data = load_preference_data(cfg, tokenizer)
    assert len(data.train) == 20 and len(data.eval) == 5
    train_prompts = {tuple(p.prompt_ids) for p in data.train}
    assert not any(tuple(p.prompt_ids) in train_prompts for p in data.eval)  # disjoint splits
    for pair in data.train:
        question = tokenizer.decode(pair.prompt_ids).split("user\n")[1].split("<|im_end|>")[0]
        expression = question.removeprefix("Calculate ").rstrip(".")
        answer = eval(expression)  # test-only: the generator's own two-term +/- expressions
        chosen = tokenizer.decode(pair.chosen_ids).removesuffix("<|im_end|>\n")
        rejected = tokenizer.decode(pair.rejected_ids).removesuffix("<|im_end|>\n")
        assert arithmetic("", chosen, answer=answer) == 1.0
        assert arithmetic("", rejected, answer=answer) == 0.0


def test_countdown_pairs_rejected_misses_the_target(tokenizer):
    from rewards.tasks import countdown
    from rlhf.data.preferences import countdown_pairs

    cfg = cfg_for("countdown_pairs", "dpo.num_train=12")
    records = countdown_pairs(cfg, "train")
    assert len(records) >= 10
    from rlhf.config import DataConfig
    from rlhf.data.prompts import load_prompts

    rows = load_prompts(DataConfig(task="countdown", num_train=12, num_eval=1), "train")
    by_expr = {r.answer: r for r in rows}
    for rec in records:
        row = by_expr[rec["chosen"]]
        assert countdown("", rec["chosen"], numbers=row.meta["numbers"], target=row.meta["target"]) == 1.0
        assert countdown("", rec["rejected"], numbers=row.meta["numbers"], target=row.meta["target"]) == 0.0


def test_gsm_symbolic_pairs_rejected_stops_a_step_early(tokenizer):
    from rewards.tasks import gsm_symbolic
    from rlhf.config import DataConfig
    from rlhf.data.preferences import gsm_symbolic_pairs
    from rlhf.data.prompts import load_prompts

    cfg = cfg_for("gsm_symbolic_pairs", "dpo.num_train=16", "dpo.num_eval=4")
    records = gsm_symbolic_pairs(cfg, "train")
    assert len(records) >= 12
    rows = load_prompts(DataConfig(task="gsm_symbolic", num_train=16, num_eval=4), "train")
    answers = {r.prompt: r.answer for r in rows}
    for rec in records:
        answer = answers[rec["prompt"][0]["content"]]
        chosen_steps, rejected_steps = rec["chosen"].split("\n"), rec["rejected"].split("\n")
        assert chosen_steps[-1] == f"#### {answer}" or float(chosen_steps[-1][5:]) == float(answer)
        assert rejected_steps[:-1] == chosen_steps[:-2]  # the solution less its last step
        early = rejected_steps[-1].removeprefix("#### ")
        assert early.replace(",", "") in chosen_steps[-3].replace(",", "")  # the step before the last's result
        assert gsm_symbolic("", rec["chosen"], answer=answer) == 1.0
        assert gsm_symbolic("", rec["rejected"], answer=answer) == 0.0
    data = load_preference_data(cfg, tokenizer)
    train_prompts = {tuple(p.prompt_ids) for p in data.train}
    assert data.eval and not any(tuple(p.prompt_ids) in train_prompts for p in data.eval)  # disjoint splits


def test_local_files_in_every_layout_and_parquet(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prefs.parquet")
    data = load_preference_data(cfg_for(f"parquet:{tmp_path / 'prefs.parquet'}", "dpo.num_eval=2"), tokenizer)
    assert (len(data.train), len(data.eval)) == (4, 2)
    for name in ("ultrafeedback_like.jsonl", "hh_rlhf_like.jsonl"):
        data = load_preference_data(cfg_for(f"jsonl:{FIX / name}"), tokenizer)
        assert len(data.train) == 1 and len(data.eval) == 1


def test_hub_sets_load_through_datasets(tokenizer, monkeypatch):
    import datasets

    rows = [json.loads(line) for line in (FIX / "ultrafeedback_like.jsonl").read_text().splitlines()]
    calls = []

    def fake_load(name, split=None, **_):
        calls.append((name, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    data = load_preference_data(cfg_for("hf:HuggingFaceH4/ultrafeedback_binarized:train_prefs"), tokenizer)
    assert calls[0] == ("HuggingFaceH4/ultrafeedback_binarized", "train_prefs") and len(data.train) == 1

    def offline(*_, **__):
        raise ConnectionError("no hub here")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="could not load it from the hub: no hub here.*jsonl:<path>"):
        load_preference_data(cfg_for("hf:Anthropic/hh-rlhf"), tokenizer)


def test_bad_dataset_names_are_one_line_errors(tokenizer):
    with pytest.raises(ValueError, match="unknown dpo.dataset 'nope' \\(known: arithmetic_pairs"):
        load_preference_data(cfg_for("nope"), tokenizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_preference_data(cfg_for("jsonl:/no/such.jsonl"), tokenizer)


def test_hhh_alignment_task_json_becomes_pairs():
    pairs = hhh_pairs(json.loads((FIX / "hhh_task_like.json").read_text()), "helpful")
    assert pairs[1] == {"prompt": "What's the capital of France?", "chosen": "Paris.", "rejected": "It is Lyon.",
                        "subset": "helpful"}
    assert all(parse_row(p) for p in pairs)


# ------------------------------------------------------------------------------------------------
# Batching


def _pairs() -> list[PreferencePair]:
    return [PreferencePair([1, 2], [3], [4, 5, 6]), PreferencePair([7], [8, 9], [10]),
            PreferencePair([11, 12, 13], [14], [15])]


def test_pairs_to_batch_puts_chosen_rows_first():
    batch = pairs_to_batch(_pairs(), pad_id=0)
    assert len(batch) == 3 and batch.input_ids.shape == (6, 5)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 0, 0] and batch.input_ids[3].tolist() == [1, 2, 4, 5, 6]
    assert batch.loss_mask[3].tolist() == [False, False, True, True, True]
    assert batch.loss_mask[1].tolist() == [False, True, True, False, False]


def test_shards_and_micro_batches_keep_the_two_rows_of_a_pair_together():
    batch = pairs_to_batch(_pairs(), pad_id=0)
    batch.ref_chosen_logps, batch.ref_rejected_logps = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])
    shard = shard_for_rank(batch, 1, 2)  # 3 pairs over 2 ranks: bounds [0, 2, 3], rank 1 gets pair 2
    assert len(shard) == 1 and shard.input_ids[0].tolist() == batch.input_ids[2].tolist()
    assert shard.input_ids[1].tolist() == batch.input_ids[5].tolist()
    assert shard.ref_chosen_logps.tolist() == [3.0] and shard.ref_rejected_logps.tolist() == [6.0]
    mbs = [mb for _, mb in micro_batches(batch, size=4)]  # 4 sequences = 2 pairs
    assert [len(mb) for mb in mbs] == [2, 1]
    assert mbs[1].input_ids.shape == (2, 4)  # trimmed to its own longest row
    rows = PreferenceBatch.gather_rows([torch.tensor([[0], [3]]), torch.tensor([[1], [2], [4], [5]])])
    assert rows.flatten().tolist() == [0, 1, 2, 3, 4, 5]  # shard outputs back in batch row order
    dummy = batch.dummy()
    assert dummy.input_ids.shape == (2, 1) and not dummy.loss_mask.any() and dummy.ref_chosen_logps is not None
