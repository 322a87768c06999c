"""Example training scripts built on the public API (``python -m autosp.examples.train_lm``): copy one and
adapt it to your model and data."""
