"""Multi-turn episodes with tools: the environment API and the multi-turn rollouts over the
engines (`episodes`), the built-in tools and their parser (`tools`), and the child process that
runs model-written Python under limits (`sandbox`). Pure Python: no Ray or vLLM."""
