"""Reasoning-time methods: latent-token reasoning traces (`latent_tokens`, Token Assorted; `latent_tokens_study`: the
toy) and adaptive speculative decoding (`banditspec`, BanditSpec; `banditspec_decode`: the loop; `banditspec_bench`:
the toy, the checkpoint path and `python -m lab bench banditspec`)."""
