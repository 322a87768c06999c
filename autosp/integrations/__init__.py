"""Integrations of AutoSP with training frameworks (DeepSpeed)."""
