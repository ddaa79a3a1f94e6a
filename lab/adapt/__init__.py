"""Test-time adaptation: TLM (perplexity minimisation, `tlm`), its entropy baselines Tent and EATA (`entropy_tta`)
and the offline/online loops they share (`loop`)."""
