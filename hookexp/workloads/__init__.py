"""What a run trains on: the tasks (objective, loss, metrics), the models, the data (one module per source) and
the learning-rate schedules, each named by a config group's ``_target_``."""
