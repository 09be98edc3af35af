"""The averaged model as an MLflow pyfunc that translates, logged from this file ("models from code",
so loading it unpickles nothing):

    mlflow.pyfunc.load_model("models:/transformer-en-de-newstest2014@best").predict(["Resumption of the session."])

Decoding parameters are the pipeline's decode section at logging time (the `decode` artifact); input
text is normalised as the clean stage normalised the training text (the `clean` artifact: its section and
the source language; models logged before it was kept take text as it comes).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class Translator(PythonModel):
    def load_context(self, context: Any) -> None:
        from stages.clean import Normalizer
        from stages.decode import load_with_vocabulary
        from stages.devices import default_device
        from stages.params import CleanParams, DecodeParams

        self.params = DecodeParams(**json.loads(Path(context.artifacts["decode"]).read_text(encoding="utf-8")))
        self.normalize = None
        if "clean" in context.artifacts:
            cleaning = json.loads(Path(context.artifacts["clean"]).read_text(encoding="utf-8"))
            self.normalize = Normalizer(cleaning.pop("lang"), CleanParams(**cleaning))
        self.translator, self.sp = load_with_vocabulary(context.artifacts["model"], context.artifacts["vocab"],
                                                        default_device(), self.params.precision)

    def predict(self, context: Any, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        """model_input: a list of sentences. The type hint is the model's signature: MLflow checks inputs
        against it and turns a one-column DataFrame into its list."""
        from stages.decode import translate

        return translate(self.translator, self.sp, model_input, self.params, desc="translate", normalize=self.normalize)


mlflow.models.set_model(Translator())
