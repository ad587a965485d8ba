"""``--report-to mlflow``: an MLflow run (tracking URI and experiment from MLflow's own environment variables,
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``), the training config as parameters, every metric at its
optimizer step."""
from __future__ import annotations

from . import scalars

PARAM_CHARS = 500  # MLflow's limit on a parameter value


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    found = {}
    for key, value in config.items():
        if isinstance(value, dict):
            found.update(flat(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = str(value)[:PARAM_CHARS]
    return found


class MLflowTracker:
    def __init__(self, config: dict, run_name: str):
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params(flat(config))

    def log(self, step: int, row: dict) -> None:
        self.mlflow.log_metrics({k: v for k, v in scalars(row).items() if k != "step"}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
