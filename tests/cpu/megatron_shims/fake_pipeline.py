"""Drive Megatron-Core's real pipeline schedule functions on one process, without a model.

`run_schedule` calls forward_backward_pipelining_{with,without}_interleaving or
forward_backward_no_pipelining with a fake P2P communicator (sends nothing, receives None) and
records the order in which the schedule calls forward_step / backward_step for one pipeline rank.
The recorded order is what the slot generators in pipeline_slots.py must reproduce.

`forward_step` / `backward_step` replacements are passed in so the slot hooks can wrap them.
"""

from __future__ import annotations

import torch


class FakeGroup:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class FakeP2P:
    """P2PCommunicator stand-in: every send is dropped, every receive returns None."""

    def __init__(self, pp_size: int, pp_rank: int, vp_size: int | None):
        self.pp_group = FakeGroup(pp_size, pp_rank)
        self.virtual_pipeline_model_parallel_size = vp_size
        self.total_stages, self.current_stage = pp_size, pp_rank
        self.is_pp_first_stage = pp_rank == 0
        self.is_pp_last_stage = pp_rank == pp_size - 1
        self.config = None

    def __getattr__(self, name: str):
        if not name.startswith(("send", "recv")):
            raise AttributeError(name)

        def communicate(*args, **kwargs):
            if kwargs.get("overlap_p2p_comm"):
                return None, {}
            if name == "send_forward_backward_recv_forward_backward":
                return None, None
            return None

        return communicate


class _TorchOnCpu:
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, **kwargs)


class Chunk(torch.nn.Module):
    """A model chunk with the attributes the schedules read (config, model_type, vp_stage)."""

    def __init__(self, config, vp_stage: int | None, num_dist_moe_layers: int = 1):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.vp_stage = vp_stage
        self.layers = torch.nn.ModuleList(_FakeDistMoELayer() for _ in range(num_dist_moe_layers))


class _FakeDistMoELayer(torch.nn.Module):
    is_dist_moe_layer = True


def recording_steps(log: list):
    """forward_step / backward_step that log (kind, vstage, microbatch) and return a fresh
    output tensor that carries its (vstage, microbatch) to the backward."""

    def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                     forward_data_store, config, *args, **kwargs):
        vstage = kwargs.get("vp_stage") or 0
        mb = kwargs.get("current_microbatch")
        if forward_step_func is not None:
            forward_step_func(vstage, mb)
        log.append(("F", vstage, mb))
        out = torch.zeros(1, requires_grad=True) * 1.0
        out.lifetime = (vstage, mb)
        return out, torch.tensor(0)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config, *args, **kwargs):
        out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        log.append(("B", *out.lifetime))
        return None

    return forward_step, backward_step


def run_schedule(kind: str, num_microbatches: int, pp_size: int, pp_rank: int,
                 vp_size: int | None = None, *, forward_step, backward_step, wrap=None,
                 layers_per_chunk: int = 1, forward_step_func=None):
    """Run Megatron's schedule `kind` ("no_pipelining" | "1f1b" | "interleaved") for one rank.

    `wrap(schedule_fn, kind)` may wrap the schedule function (the slot hooks do).
    """
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp_size, virtual_pipeline_model_parallel_size=vp_size,
        microbatch_group_size_per_vp_stage=pp_size if vp_size else None,
        pipeline_dtype=torch.float32 if pp_size > 1 else None)
    config.deallocate_pipeline_outputs = False
    config.hidden_size = 4
    num_chunks = vp_size or 1
    chunks = [Chunk(config, c if vp_size else None, layers_per_chunk) for c in range(num_chunks)]
    pg = ProcessGroupCollection()
    pg.tp, pg.cp = FakeGroup(1, 0), FakeGroup(1, 0)
    fn = {"no_pipelining": schedules.forward_backward_no_pipelining,
          "1f1b": schedules.forward_backward_pipelining_without_interleaving,
          "interleaved": schedules.forward_backward_pipelining_with_interleaving}[kind]
    if wrap is not None:
        fn = wrap(fn, kind)
    kwargs = dict(forward_step_func=forward_step_func, num_microbatches=num_microbatches,
                  seq_length=4, micro_batch_size=1, pg_collection=pg)
    if kind == "interleaved":
        kwargs.update(model=chunks, data_iterator=[None] * num_chunks,
                      p2p_communicator=FakeP2P(pp_size, pp_rank, vp_size))
    elif kind == "1f1b":
        kwargs.update(model=chunks[0], data_iterator=None,
                      p2p_communicator=FakeP2P(pp_size, pp_rank, None))
    else:
        kwargs.update(model=chunks[0], data_iterator=None)
    saved = (schedules.forward_step, schedules.backward_step, schedules.torch)
    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    schedules.torch = _TorchOnCpu()
    try:
        return fn(**kwargs)
    finally:
        schedules.forward_step, schedules.backward_step, schedules.torch = saved
