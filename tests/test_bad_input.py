"""Bad input never starts Ray: every malformed config, override, recipe file, data file, reward
spec and output folder below is one `error:` line on stderr and exit status 2, with no traceback.

Most cases call the scripts' `main` in this process with `ray.init` replaced by a function that
fails the test (so "Ray was not started" is checked, not assumed); a few run the real command line.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
        "syntax.yaml": "grpo: [unclosed\n",
        "list.yaml": "- 1\n- 2\n",
        "unknown_key.yaml": "algorithm: grpo\nlearner:\n  lrr: 1.0e-5\n",
        "wrong_type.yaml": "algorithm: grpo\ngrpo:\n  steps: many\n",
        "renamed.yaml": "algorithm: grpo\nmodel:\n  gradient_checkpointing: true\n",
        "bad_json.jsonl": '{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": \n',
        "no_prompt.jsonl": '{"question": "1+1?", "solution": "2"}\n',
        "empty.jsonl": "",
        "pairs_missing.jsonl": '{"prompt": "1+1?", "chosen": "2"}\n',
        "syntax_reward.py": "def reward(prompt, completion, **row):\n    return (\n",
        "no_args_reward.py": "def reward():\n    return 1.0\n",
        "not_callable_reward.py": "reward = 3\n",
        "raises_on_import.py": "raise RuntimeError('cannot import me')\n",
        "a_file": "not a folder\n",
    }
    for name, content in text.items():
        (d / name).write_text(content)
    (d / "binary.yaml").write_bytes(b"\xff\xfe\x00bad")
    (d / "adir.yaml").mkdir()
    (d / "model_without_config").mkdir()
    return {name: str(d / name) for name in [*text, "binary.yaml", "adir.yaml", "model_without_config"]}


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
    "invalid YAML": ("train_grpo", ["--config", "{syntax.yaml}"], "is not valid YAML"),
    "YAML list": ("train_grpo", ["--config", "{list.yaml}"], "must hold a mapping at the top level"),
    "binary recipe": ("train_grpo", ["--config", "{binary.yaml}"], "is not UTF-8 text"),
    "unknown key in recipe": ("train_grpo", ["--config", "{unknown_key.yaml}"], "unknown key 'learner.lrr'"),
    "wrong type in recipe": ("train_grpo", ["--config", "{wrong_type.yaml}"], "grpo.steps='many' has the wrong type"),
    "renamed key in recipe": ("train_grpo", ["--config", "{renamed.yaml}"], "'model.gradient_checkpointing' was replaced"),
    "recipe of the other algorithm": ("train_grpo", TINY_DPO, "this script trains grpo recipes"),
    # model
    "missing model folder": ("train_grpo", TINY_GRPO + ["model.path=/nonexistent/model"],
                             "model.path='/nonexistent/model' does not exist"),
    "model folder without config": ("train_grpo", TINY_GRPO + ["model.path={model_without_config}"],
                                    "model_without_config"),
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
    # data files
    "unknown task": ("train_grpo", TINY_GRPO + ["data.task=nosuch"], "unknown data.task 'nosuch'"),
    "missing data file": ("train_grpo", TINY_GRPO + ["data.task=jsonl:/nonexistent/d.jsonl"], "/nonexistent/d.jsonl"),
    "malformed JSON line": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{bad_json.jsonl}"], "bad_json.jsonl:2: invalid JSON"),
    "data file without prompt column": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{no_prompt.jsonl}"], "no_prompt.jsonl"),
    "empty data file": ("train_grpo", TINY_GRPO + ["data.task=jsonl:{empty.jsonl}"], "has no rows"),
    "template with unknown field": ("train_grpo", TINY_GRPO + ["data.prompt_template='{nosuch}'"],
                                    "data.prompt_template '{nosuch}' uses a field"),
    "preference file missing": ("train_dpo", TINY_DPO + ["dpo.dataset=jsonl:/nonexistent/p.jsonl"], "/nonexistent/p.jsonl"),
    "preference row missing a field": ("train_dpo", TINY_DPO + ["dpo.dataset=jsonl:{pairs_missing.jsonl}"],
                                       "pairs_missing.jsonl"),
    # output folders and checkpoints
    "output_dir is a file": ("train_grpo", TINY_GRPO + ["output_dir={a_file}"], "is a file, not a folder"),
    "output_dir under a file": ("train_grpo", TINY_GRPO + ["output_dir={a_file}/run"], "is a file, not a folder"),
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

    from rlhf.checkpoint import save_checkpoint
    from test_checkpoint_integrity import FakeLearners

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.chdir(ROOT)
    save_checkpoint(tmp_path, 1, FakeLearners(), {"prompts": {}})
    second = save_checkpoint(tmp_path, 2, FakeLearners(), {"prompts": {}})
    (second / "train_state" / "__1_0.distcp").unlink()
    import rlhf.checkpoint

    rlhf.checkpoint._verified.clear()
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
