"""The wire form of routed experts: which experts each token went through, per MoE layer.

A sample's routes cover the tokens the server ran through the model to sample it: the prompt's
and every completion token but the last (the last is sampled, never fed back), in sequence
order, ``[tokens, layers, k]`` expert indices (``k``: the model's experts per token, in the
router's order). They travel as base64 of the little-endian row-major array, one byte an index
(``uint8``) for models of up to 256 experts, else two (``int16``).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from rollout_server.protocol.base import WireModel

if TYPE_CHECKING:
    import numpy as np

RoutesDtype = Literal["uint8", "int16"]
_ITEM_BYTES = {"uint8": 1, "int16": 2}


class RoutedExperts(WireModel):
    shape: tuple[int, int, int] = Field(description="[tokens, layers, k]")
    dtype: RoutesDtype = Field(description="uint8 (up to 256 experts) or int16")
    data: str = Field(description="base64 of the little-endian row-major [tokens, layers, k] array")

    @model_validator(mode="after")
    def _sized(self) -> RoutedExperts:
        tokens, layers, k = self.shape
        if min(self.shape) < 0:
            raise ValueError(f"routed_experts.shape {list(self.shape)} has a negative size")
        want = tokens * layers * k * _ITEM_BYTES[self.dtype]
        got = len(self.data) // 4 * 3 - self.data[-2:].count("=") if self.data else 0
        if got != want:
            raise ValueError(
                f"routed_experts.data holds {got} bytes; shape {list(self.shape)} of "
                f"{self.dtype} needs {want}"
            )
        return self

    @classmethod
    def encode(cls, routes: np.ndarray, num_experts: int) -> RoutedExperts:
        """From a ``[tokens, layers, k]`` integer array of indices below ``num_experts``."""
        import numpy as np

        if routes.ndim != 3:
            raise ValueError(f"routes must be [tokens, layers, k], got shape {routes.shape}")
        dtype: RoutesDtype = "uint8" if num_experts <= 256 else "int16"
        array = np.ascontiguousarray(routes, dtype=np.dtype(dtype).newbyteorder("<"))
        data = base64.b64encode(array.tobytes()).decode("ascii")
        return cls(shape=tuple(routes.shape), dtype=dtype, data=data)  # type: ignore[arg-type]

    def decode(self) -> np.ndarray:
        """The ``[tokens, layers, k]`` int16 array."""
        import numpy as np

        raw = base64.b64decode(self.data)
        array = np.frombuffer(raw, dtype=np.dtype(self.dtype).newbyteorder("<"))
        return array.astype(np.int16).reshape(self.shape)

    @property
    def num_tokens(self) -> int:
        return self.shape[0]
