"""Reasoning-time methods: latent-token reasoning traces (`latent_tokens`, Token Assorted) and adaptive speculative
decoding (`banditspec`, BanditSpec)."""
