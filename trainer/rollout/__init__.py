"""Rollouts: prompt data (data.py), the engine-driving manager (manager.py), pure sample functions and filters
(samples.py), rewards, trajectories and the built-in data set generators."""
