"""Agents: learning-progress curricula over large goal spaces (`magellan`, MAGELLAN; `magellan_study`: its baselines,
runs and the goal-space swap; `little_zoo`: the goal space and the simulated learner), and the model behind an agent
(`backends`: offline rules, a local `transformers` LM, or any OpenAI-compatible server) for sequential falsification
(`popper`, POPPER) and text-to-SQL (`sgu_sql`, SGU-SQL)."""
