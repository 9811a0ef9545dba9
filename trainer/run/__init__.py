"""A training run: the loop and its parts (the step executor, the pieces of a micro-batch, the schedule, when to
save and evaluate, the collector's pauses)."""
