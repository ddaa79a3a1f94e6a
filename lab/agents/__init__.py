"""Agents: learning-progress curricula over large goal spaces (`magellan`, MAGELLAN; `little_zoo`: the goal space and
the simulated learner)."""
