"""The run's plan: its step as the planner sees it, the plan made and told, and the plan watched against the run."""
