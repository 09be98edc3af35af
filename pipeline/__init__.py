"""Orchestration: configuration, the command line, MLflow tracking and the Prefect flow.
Importing this package imports neither Prefect nor MLflow; the modules that need them do."""
