"""Bad input never starts Ray: every malformed config, override, recipe file, data file, reward
spec, model folder, output folder and resume below is one `error:` line on stderr and exit status
2, with no traceback; a message about a file names it, and its line where it has lines.

Most cases call the scripts' `main` in this process with `ray.init` replaced by a function that
fails the test (so "Ray was not started" is checked, not assumed); a few run the real command line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_GRPO = ["--config", "configs/grpo_tiny_cpu.yaml"]
TINY_DPO = ["--config", "configs/dpo_tiny_cpu.yaml"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bad_input_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Malformed files of every kind, by name."""
    d = tmp_path_factory.mktemp("bad")
    text = {
        "twice.yaml": "algorithm: grpo\ngrpo:\n  steps: 3\n  steps: 4\n",
        "bad_value.yaml": "algorithm: grpo\n\ngrpo:\n  group_size: 1\n",
        "tab.yaml": "grpo:\n\tsteps: 3\n",
        "missing_column.jsonl": '{"prompt": "1+1?", "answer": "2"}\n\n{"answer": "4"}\n',
        "not_an_object.jsonl": '{"prompt": "1+1?", "answer": "2"}\n[1, 2]\n',
        "empty_prompt.jsonl": '{"prompt": "1+1?", "answer": "2"}\n{"prompt": " ", "answer": "2"}\n',
        "not_parquet.parquet": "prompt,answer\n",
        "ds_config.json": '{"zero_optimization": {\n  "stage": 2,\n}}\n',
        "pairs_bad_json.jsonl": '{"prompt": "1+1?", "chosen": "2", "rejected": "3"}\n{"prompt": \n',
        "syntax.yaml": "grpo: [unclosed\n",
        "list.yaml": "- 1\n- 2\n",
        "unknown_key.yaml": "algorithm: grpo\nlearner:\n  lrr: 1.0e-5\n",
        "wrong_type.yaml": "algorithm: grpo\ngrpo:\n  steps: many\n",
        "renamed.yaml": "algorithm: grpo\nmodel:\n  gradient_checkpointing: true\n",
        "bad_json.jsonl": '{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": \n',
        "no_prompt.jsonl": '{"question": "1+1?", "solution": "2"}\n',
        "empty.jsonl": "",
        "pairs_missing.jsonl": '{"prompt": "1+1?", "chosen": "2", "rejected": "3"}\n\n{"prompt": "2+2?", "chosen": "4"}\n',
        "syntax_reward.py": "def reward(prompt, completion, **row):\n    return (\n",
        "no_args_reward.py": "def reward():\n    return 1.0\n",
        "not_callable_reward.py": "reward = 3\n",
        "raises_on_import.py": "raise RuntimeError('cannot import me')\n",
        "a_file": "not a folder\n",
    }
    for name, content in text.items():
        (d / name).write_text(content)
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    (d / "not_utf8.jsonl").write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff"}\n')
    (d / "adir.yaml").mkdir()
    (d / "model_without_config").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": "2"}, {"prompt": None, "answer": "3"}]),
                   d / "missing.parquet")
    models = _broken_models(d)
    return {name: str(d / name) for name in [*text, "binary.yaml", "not_utf8.jsonl", "adir.yaml",
                                             "model_without_config", "missing.parquet", *models]}


def _broken_models(d: Path) -> list[str]:
    """Copies of the tiny model's folder, each missing something a model folder needs."""
    import shutil

    from rlhf.data.assets import resolve_model_path

    tiny = Path(resolve_model_path("tiny-qwen2"))
    broken = {"model_without_weights": ["model.safetensors"], "model_without_tokenizer": ["tokenizer.json"],
              "model_missing_a_shard": ["model.safetensors"], "model_bad_config": []}
    for name, drop in broken.items():
        shutil.copytree(tiny, d / name, ignore=shutil.ignore_patterns(*drop) if drop else None)
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model_missing_a_shard" / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "model_missing_a_shard" / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (d / "model_bad_config" / "config.json").write_text('{"model_type": "qwen2",\n "hidden_size": }\n')
    return list(broken)


# (script, argv with {name} for files, what the one line must contain)
CASES = {
    # overrides
    "unknown key": ("train_grpo", TINY_GRPO + ["grpo.gropu_size=3"], "unknown key 'grpo.gropu_size'"),
    "wrong type": ("train_grpo", TINY_GRPO + ["learner.lr=abc"], "learner.lr='abc' has the wrong type"),
    "out of range": ("train_grpo", TINY_GRPO + ["grpo.group_size=1"], "grpo.group_size=1 is not allowed"),
    "not key=value": ("train_grpo", TINY_GRPO + ["grpo.steps"], "override 'grpo.steps' must look like key=value"),
    "scalar for a section": ("train_grpo", TINY_GRPO + ["grpo=3"], "grpo must be a mapping"),
    "nan learning rate": ("train_grpo", TINY_GRPO + ["learner.lr=.nan"], "learner.lr=nan is not allowed"),
    "unknown dtype": ("train_grpo", TINY_GRPO + ["model.dtype=float16"], "model.dtype='float16' is not allowed"),
    "bad resume": ("train_grpo", TINY_GRPO + ["resume=maybe"], "resume='maybe' has the wrong type"),
    "zero timeout": ("train_grpo", TINY_GRPO + ["cluster.timeout_s=0"], "cluster.timeout_s=0.0 is not allowed"),
    "zero failed steps": ("train_grpo", TINY_GRPO + ["reward.max_failed_steps=0"],
                          "reward.max_failed_steps=0 is not allowed"),
    "unknown flag": ("train_grpo", TINY_GRPO + ["--confg", "x.yaml"], "unrecognized arguments: --confg"),
    "lora rank below 0": ("train_grpo", TINY_GRPO + ["learner.lora_rank=-4"], "learner.lora_rank=-4 is not allowed"),
    "lora target matches nothing": ("train_grpo", TINY_GRPO + ["learner.lora_rank=8", "learner.lora_target_modules=[nope]"],
                                    "learner.lora_target_modules: 'nope' matches no linear layer"),
    "lora adapters with the hf generator": ("train_grpo", TINY_GRPO + ["learner.lora_rank=8", "generation.backend=hf",
                                                           "learner.lora_sync=adapter"],
                                            "learner.lora_sync=adapter needs generation.backend=vllm"),
    "lora adapters above vllm's rank": ("train_grpo", TINY_GRPO + ["learner.lora_rank=1024", "learner.lora_sync=adapter"],
                                        "vLLM serves adapters up to rank 512, learner.lora_rank is 1024"),
    "lora on the dpo target": ("train_dpo", TINY_DPO + ["learner.lora_rank=8", "learner.lora_target_modules=[lm_head]"],
                               "'lm_head' matches no linear layer"),
    # recipe files
    "missing recipe": ("train_grpo", ["--config", "configs/missing.yaml"], "config file 'configs/missing.yaml' does not exist"),
    "recipe is a folder": ("train_grpo", ["--config", "{adir.yaml}"], "is a folder, not a YAML file"),
    "invalid YAML": ("train_grpo", ["--config", "{syntax.yaml}"], "{syntax.yaml}:2: not valid YAML (expected ','"),
    "tab in a recipe": ("train_grpo", ["--config", "{tab.yaml}"], "{tab.yaml}:2: not valid YAML (found character '\\t'"),
    "key set twice in recipe": ("train_grpo", ["--config", "{twice.yaml}"],
                                "{twice.yaml}:4: 'grpo.steps' is set twice (first on line 3)"),
    "bad value in recipe": ("train_grpo", ["--config", "{bad_value.yaml}"],
                            "{bad_value.yaml}:4: grpo.group_size=1 is not allowed"),
    "YAML list": ("train_grpo", ["--config", "{list.yaml}"], "must hold a mapping at the top level"),
    "binary recipe": ("train_grpo", ["--config", "{binary.yaml}"], "is not UTF-8 text"),
    "unknown key in recipe": ("train_grpo", ["--config", "{unknown_key.yaml}"],
                              "{unknown_key.yaml}:3: unknown key 'learner.lrr'"),
    "wrong type in recipe": ("train_grpo", ["--config", "{wrong_type.yaml}"],
                             "{wrong_type.yaml}:3: grpo.steps='many' has the wrong type"),
    "renamed key in recipe": ("train_grpo", ["--config", "{renamed.yaml}"],
                              "{renamed.yaml}:3: 'model.gradient_checkpointing' was replaced"),
    # settings under which GRPO cannot learn (rlhf/config_checks.py)
    "greedy GRPO": ("train_grpo", TINY_GRPO + ["generation.temperature=0"],
                    "generation.temperature=0.0 is not allowed: > 0 for GRPO"),
    "top-1 GRPO": ("train_grpo", TINY_GRPO + ["generation.top_k=1"], "generation.top_k=1 is not allowed: not 1 for GRPO"),
    "every reward weight 0": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: 'rewards.tasks:arithmetic', weight: 0}]"],
                              "at least one weight != 0"),
    "NaN reward weight": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: 'rewards.tasks:arithmetic', weight: .nan}]"],
                          "reward.functions[0].weight=nan is not allowed"),
    "clip range frozen at 1": ("train_grpo", TINY_GRPO + ["grpo.clip_low=0", "grpo.clip_high=0", "grpo.updates_per_step=2"],
                               "grpo.clip_high=0.0 is not allowed: > 0 (or grpo.clip_low > 0) with grpo.updates_per_step=2"),
    "recipe of the other algorithm": ("train_grpo", TINY_DPO, "this script trains grpo recipes"),
    # model
    "missing model folder": ("train_grpo", TINY_GRPO + ["model.path=/nonexistent/model"],
                             "model.path='/nonexistent/model' does not exist"),
    "model folder without config": ("train_grpo", TINY_GRPO + ["model.path={model_without_config}"],
                                    "model_without_config"),
    "model folder without weights": ("train_grpo", TINY_GRPO + ["model.path={model_without_weights}"],
                                     "model_without_weights' has a config.json but no weights (model.safetensors"),
    "model folder without tokenizer": ("train_dpo", TINY_DPO + ["model.path={model_without_tokenizer}"],
                                       "model_without_tokenizer' has a config.json but no tokenizer files"),
    "model folder missing a shard": ("train_grpo", TINY_GRPO + ["model.path={model_missing_a_shard}"],
                                     "no 1 of the 2 weight shards model.safetensors.index.json names "
                                     "(model-00002-of-00002.safetensors"),
    "model config.json not JSON": ("train_grpo", TINY_GRPO + ["model.path={model_bad_config}"],
                                   "{model_bad_config}/config.json:2: invalid JSON"),
    "prompt and completion past the model's positions": ("train_grpo", TINY_GRPO + ["generation.max_new_tokens=2000"],
                                                         "data.max_prompt_tokens=256 + generation.max_new_tokens=2000 "
                                                         "= 2256 tokens is more than the 2048 positions"),
    "evaluation past the model's positions": ("train_grpo", TINY_GRPO + ["eval.max_new_tokens=1900"],
                                              "+ eval.max_new_tokens=1900 = 2156 tokens is more than the 2048"),
    "held-out prompts the train split holds all of": ("train_grpo", TINY_GRPO + [
        "eval_every=5", "data.task=arithmetic_1digit", "data.num_train=2000", "data.num_eval=64"],
        "task 'arithmetic_1digit': only 0 of 64 eval prompts are not in the train split"),
    "pairs past the model's positions": ("train_dpo", TINY_DPO + ["dpo.max_length=4096"],
                                         "dpo.max_length=4096 is more than the 2048 positions"),
    "DeepSpeed config missing": ("train_grpo", TINY_GRPO + ["learner.backend=deepspeed",
                                                            "learner.deepspeed_config=/nonexistent/ds.json"],
                                 "learner.deepspeed_config='/nonexistent/ds.json': no such file"),
    "DeepSpeed config not JSON": ("train_dpo", TINY_DPO + ["learner.backend=deepspeed", "learner.deepspeed_config={ds_config.json}"],
                                  "{ds_config.json}:3: invalid JSON (Expecting property name"),
    # reward specs
    "reward module missing": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: 'nosuch.module:fn'}]"],
                              "nosuch.module"),
    "reward attribute missing": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: 'rewards.answers:nope'}]"],
                                 "nope"),
    "reward file missing": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: '/nonexistent/r.py:fn'}]"],
                            "/nonexistent/r.py"),
    "reward file syntax error": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: '{syntax_reward.py}:reward'}]"],
                                 "syntax_reward.py"),
    "reward file raises on import": ("train_grpo",
                                     TINY_GRPO + ["reward.functions=[{function: '{raises_on_import.py}:reward'}]"],
                                     "cannot import me"),
    "reward not callable": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: '{not_callable_reward.py}:reward'}]"],
                            "not_callable_reward.py"),
    "reward takes no arguments": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: '{no_args_reward.py}:reward'}]"],
                                  "no_args_reward.py"),
    "reward spec without colon": ("train_grpo", TINY_GRPO + ["reward.functions=[{function: no_colon}]"],
                                  "reward.functions[0].function='no_colon' is not allowed"),
    "environment not importable": ("train_grpo", TINY_GRPO + ["env.environment=nosuch_env:Env"],
                                   "env.environment: environment module 'nosuch_env' is not importable"),
    # data files
    "unknown task": ("train_grpo", TINY_GRPO + ["data.task=nosuch"], "unknown data.task 'nosuch'"),
    "missing data file": ("train_grpo", TINY_GRPO + ["data.task=jsonl:/nonexistent/d.jsonl"], "/nonexistent/d.jsonl"),
    "malformed JSON line": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{bad_json.jsonl}"], "{bad_json.jsonl}:2: invalid JSON"),
    "data row missing its column": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{missing_column.jsonl}"],
                                    "{missing_column.jsonl}:3: no 'prompt' (columns: answer)"),
    "data row not an object": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{not_an_object.jsonl}"],
                               "{not_an_object.jsonl}:2: a row must be a mapping of columns"),
    "data row with an empty prompt": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{empty_prompt.jsonl}"],
                                      "{empty_prompt.jsonl}:2: the prompt is empty"),
    "data file not UTF-8": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{not_utf8.jsonl}"], "{not_utf8.jsonl}:2: not UTF-8"),
    "not a parquet file": ("train_grpo", TINY_GRPO + ["data.task=parquet:{not_parquet.parquet}"],
                           "{not_parquet.parquet}: not a readable parquet file"),
    "parquet row missing its prompt": ("train_grpo", TINY_GRPO + ["data.task=parquet:{missing.parquet}"],
                                       "{missing.parquet} row 1: no 'prompt'"),
    "data file without prompt column": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{no_prompt.jsonl}"], "no_prompt.jsonl"),
    "empty data file": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{empty.jsonl}"], "has no rows"),
    "template with unknown field": ("train_grpo", TINY_GRPO + ["data.prompt_template='{nosuch}'"],
                                    "data.prompt_template '{nosuch}' uses a field"),
    "preference file missing": ("train_dpo", TINY_DPO + ["dpo.dataset=jsonl:/nonexistent/p.jsonl"], "/nonexistent/p.jsonl"),
    "preference row missing a field": ("train_dpo", TINY_DPO + ["dpo.dataset=jsonl:{pairs_missing.jsonl}"],
                                       "{pairs_missing.jsonl}:3: has no rejected"),
    "preference file malformed JSON": ("train_dpo", TINY_DPO + ["dpo.dataset=jsonl:{pairs_bad_json.jsonl}"],
                                       "{pairs_bad_json.jsonl}:2: invalid JSON"),
    # output folders and checkpoints
    "output_dir is a file": ("train_grpo", TINY_GRPO + ["output_dir={a_file}"], "is a file, not a folder"),
    "output_dir under a file": ("train_grpo", TINY_GRPO + ["output_dir={a_file}/run"], "is a file, not a folder"),
    # /proc passes os.access(W_OK) as root, yet nothing can be created there
    "output_dir where nothing can be made": ("train_grpo", TINY_GRPO + ["output_dir=/proc/rlhf-test/run"],
                                             "output_dir='/proc/rlhf-test/run': nothing can be created in /proc"),
    "overwrite with resume": ("train_grpo", TINY_GRPO + ["overwrite=true", "resume=true"],
                              "overwrite=True is not allowed: false when resume is set"),
}


def _argv(argv: list[str], files: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for name, path in files.items():
            a = a.replace("{" + name + "}", path)
        out.append(a)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2_before_ray(case, files, capsys, monkeypatch, tmp_path):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.chdir(ROOT)
    script, argv, message = CASES[case]
    argv = _argv(argv, files)
    if not any(a.startswith("output_dir=") for a in argv):
        argv.append(f"output_dir={tmp_path / 'out'}")
    code = _script(script).main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert _argv([message], files)[0] in lines[0], lines[0]
    assert "Traceback" not in err


def test_damaged_checkpoint_is_one_line_before_ray(tmp_path, capsys, monkeypatch):
    import ray

    from rlhf.run.checkpoint import save_checkpoint
    from test_checkpoint_integrity import FakeLearners

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.chdir(ROOT)
    save_checkpoint(tmp_path, 1, FakeLearners(), {"prompts": {}})
    second = save_checkpoint(tmp_path, 2, FakeLearners(), {"prompts": {}})
    (second / "train_state" / "__1_0.distcp").unlink()
    import rlhf.run.checkpoint

    rlhf.run.checkpoint._verified.clear()
    code = _script("train_grpo").main([*TINY_GRPO, f"output_dir={tmp_path}", "resume=true"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1
    assert lines[0] == (f"error: the latest checkpoint is damaged: {second}/train_state/__1_0.distcp is missing; "
                        f"the previous good checkpoint is {tmp_path}/checkpoints/step_000001: resume from it with "
                        "resume=previous")


@pytest.mark.parametrize("argv,message", [
    (["grpo.gropu_size=3"], "error: unknown key 'grpo.gropu_size'"),
    (["--config", "configs/missing.yaml"], "error: config file 'configs/missing.yaml' does not exist"),
    (["reward.functions=[{function: 'nosuch.module:fn'}]"], "error: reward"),
])
def test_the_command_line_itself(argv, message, tmp_path):
    """The real command: exit 2, one line, no traceback. RAY_ADDRESS points at nothing, so a
    started Ray would fail with a different message."""
    if "--config" not in argv:
        argv = [*TINY_GRPO, *argv]
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "scripts/train_grpo.py", *argv, f"output_dir={tmp_path}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr


def test_evaluate_refuses_an_incomplete_model_folder_in_one_line(files, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = _script("evaluate").main(["--config", "configs/grpo_tiny_cpu.yaml", "--model", files["model_without_weights"]])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --model='{files['model_without_weights']}' has a config.json but no weights")
