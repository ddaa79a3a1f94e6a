"""Test-time adaptation: TLM (perplexity minimisation) and its entropy baselines."""
