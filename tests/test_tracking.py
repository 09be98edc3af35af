"""MLflow records that never cost the work: the registry's `best` alias, tracking that goes on without
its server, and the replay of what a lost server missed."""
from __future__ import annotations

from mlflow.tracking import MlflowClient

from pipeline import registry


def test_the_best_alias_follows_the_highest_test_bleu(tmp_path):
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("m")
    for bleu in ("30.1", "35.2", "20.0"):
        client.create_model_version("m", source=str(tmp_path / "model"), tags={"test_bleu": bleu})
    assert registry.point_best(client, "m") == "2"
    assert str(client.get_model_version_by_alias("m", "best").version) == "2"
    client.create_model_version("m", source=str(tmp_path / "model"), tags={"test_bleu": "35.3"})
    assert registry.point_best(client, "m") == "4"  # a better run takes the alias; a worse one leaves it
    client.create_model_version("m", source=str(tmp_path / "model"), tags={"test_bleu": "1.0"})
    assert registry.point_best(client, "m") == "4"
