"""Reasoning-time methods: adaptive speculative decoding (`banditspec`, BanditSpec; `banditspec_decode`: the loop;
`banditspec_bench`: the toy, the checkpoint path and `python -m lab bench banditspec`)."""
