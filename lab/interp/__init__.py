"""Interpretability tools: attention-like views of non-attention layers."""
