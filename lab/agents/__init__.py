"""Agents: learning-progress curricula over large goal spaces (`magellan`, MAGELLAN)."""
