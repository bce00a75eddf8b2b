"""The demo tasks (outside the library): arithmetic / countdown generators and the shipped data sets (datasets.py),
the calculator agent task (agent_task.py)."""
