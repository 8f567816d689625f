"""What a run reads, and the tensors it trains on: prompts, preference pairs, batches, model files.

prompts (tasks and datasets -> PromptRow), preferences (DPO pairs), batching (rollouts and pairs
-> padded batches, shards, micro-batches), assets (what `model.path` names; where the cache of models and data is),
tiny_models (random test models, no download), model_folder (checks of a model folder).
Never imports a loop.
"""
