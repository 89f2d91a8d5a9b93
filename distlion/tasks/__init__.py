"""Tasks: data + model + loss + evaluation, built from the `task` and `model` config groups."""

from distlion.tasks.base import ClassificationTask, Task

__all__ = ["ClassificationTask", "Task"]
