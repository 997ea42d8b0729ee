"""The models this service tokenizes for, by id, and which one an empty id means."""

from __future__ import annotations

from collections.abc import Iterable

from cachet.errors import NotFound
from cachet.tokenizer.tokenizer_model import TokenizerModel


class ModelRegistry:
    """Loaded models by id; fixed at start-up, so reads need no lock."""

    def __init__(self, models: Iterable[TokenizerModel], default_model_id: str | None = None) -> None:
        self._models: dict[str, TokenizerModel] = {}
        for model in models:
            if model.model_id in self._models:
                raise ValueError(f"model id {model.model_id!r} is configured twice")
            self._models[model.model_id] = model
        if not self._models:
            raise ValueError("a tokenizer service needs at least one model")
        self.default_model_id = default_model_id or next(iter(self._models))
        if self.default_model_id not in self._models:
            raise ValueError(f"default model {self.default_model_id!r} is not among {self.model_ids}")

    @property
    def model_ids(self) -> list[str]:
        return list(self._models)

    def models(self) -> list[TokenizerModel]:
        return list(self._models.values())

    def get(self, model_id: str) -> TokenizerModel:
        """The named model; an empty id means the default one (callers may leave it unset)."""
        if not model_id:
            return self._models[self.default_model_id]
        model = self._models.get(model_id)
        if model is None:
            raise NotFound(
                f"model: {model_id!r} is not served here; available: {', '.join(self._models)}",
                param="model",
                code_name="model_not_found",
            )
        return model
