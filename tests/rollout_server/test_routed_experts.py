"""Routed experts on the wire: the compact encoding, and which servers return them."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from rollout_server.client import RolloutClient
from rollout_server.engine.vllm_engine import VLLMEngine
from rollout_server.protocol import GenerateRequest, RoutedExperts
from rollout_server.settings import ServerSettings


@pytest.mark.parametrize(("experts", "dtype", "nbytes"), [(8, "uint8", 1), (300, "int16", 2)])
def test_routes_round_trip_in_one_or_two_bytes_an_index(
    experts: int, dtype: str, nbytes: int
) -> None:
    routes = np.random.default_rng(0).integers(0, experts, size=(5, 3, 2))
    wire = RoutedExperts.encode(routes, experts)
    assert wire.dtype == dtype
    assert len(wire.data) == 4 * -(-routes.size * nbytes // 3)  # base64 of size x nbytes bytes
    again = RoutedExperts.model_validate_json(wire.model_dump_json())
    np.testing.assert_array_equal(again.decode(), routes)


def test_routes_whose_data_does_not_fill_the_shape_are_refused() -> None:
    wire = RoutedExperts.encode(np.zeros((4, 2, 2), dtype=np.int64), 8)
    with pytest.raises(ValidationError, match="holds 16 bytes; shape \\[5, 2, 2\\] of uint8"):
        RoutedExperts(shape=(5, 2, 2), dtype="uint8", data=wire.data)


async def test_a_dense_model_s_server_refuses_to_return_routes(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        async with RolloutClient(server.url, max_retries=0) as client:
            with pytest.raises(Exception, match="no mixture-of-experts routers") as err:
                await client.generate(
                    GenerateRequest(prompts=["a"], max_tokens=2, return_routed_experts=True)
                )
            assert "400" in str(err.value)
            plain = await client.generate(GenerateRequest(prompts=["a"], max_tokens=2))
    assert plain.results[0].samples[0].routed_experts is None


def test_the_vllm_engine_refuses_routes_naming_the_engine_to_use() -> None:
    engine = VLLMEngine.__new__(VLLMEngine)  # the refusal needs no model
    why = engine.routed_experts_refusal()
    assert why is not None and "needs the transformers engine here" in why
