"""Plan: list each dataset's shards, cut them into splits, fix the global chunk order."""

from lakeloader.plan.planner import DatasetPlan, plan_dataset

__all__ = ["DatasetPlan", "plan_dataset"]
