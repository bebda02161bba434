"""The speculative core: the engine (models and token ids) and the bandit (arms and rewards)."""
