"""Rewards: rule functions of a sample (rules.py), reward models (model.py), LLM judges (judge.py), the reward
server (server.py), and the RewardSource protocol + registry that builds any of them from `[rewards]` (sources.py)."""
