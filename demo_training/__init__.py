"""Training the demo model's projector (`python -m demo_training.train`, `make train-demo`): the
generated scenes, the conversations and their tokens, the trainer and the held-out checks.

The model itself (what inference loads) is `engine.demo`; this package only builds on it, and
nothing in `engine/`, `worker/` or `app/` imports it. docs/demo-model.md says how it trains.
"""
