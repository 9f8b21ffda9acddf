"""What ``/info`` reports: the engine's model and limits, with the server's weight version and
sleep state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_server.protocol import InfoResponse

if TYPE_CHECKING:
    from rollout_server.core import ServerCore
    from rollout_server.native.service import NativeService


class StatusService:
    def __init__(self, core: ServerCore, native: NativeService) -> None:
        self.core = core
        self.native = native

    def info(self) -> InfoResponse:
        core = self.core
        core.require_loaded()
        e = core.engine.info()
        return InfoResponse(
            model=e.model,
            engine=e.engine,
            dtype=e.dtype,
            device=e.device,
            max_model_len=e.max_model_len,
            vocab_size=e.vocab_size,
            eos_token_ids=e.eos_token_ids,
            weight_version=core.version,
            sleeping=bool(core.asleep),
            sleep_level=core.sleep_level,
            tensor_parallel_size=e.tensor_parallel_size,
            data_parallel_size=e.data_parallel_size,
            max_num_seqs=e.max_num_seqs,
            max_batch_tokens=e.max_batch_tokens,
            limits=core.limits,
            # no /weights/* routes at all under --disable-admin-endpoints
            weight_transports=[] if core.settings.disable_admin_endpoints else e.weight_transports,
            lora_rank=core.engine.served_lora_rank(),
            weight_transfer_backend=self.native.backend(),
        )
